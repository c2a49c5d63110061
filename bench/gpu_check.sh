#!/usr/bin/env bash
# One command that checks every multi-GPU configuration on a machine with GPUs:
#
#     bash bench/gpu_check.sh            # all GPUs, 6 steps / iterations per run
#     STEPS=10 bash bench/gpu_check.sh
#     bash bench/gpu_check.sh --cpu      # the same checks first, on 2 CPU processes with a tiny model
#
# For each of configs/ddp.yaml, fsdp.yaml, zero2.yaml, zero3.yaml it runs, with --bf16, every stage: sft.py
# (the tiny default model), reward_model.py (from the default SFT model), ppo.py, ppo.py
# --gradient_checkpointing and ppo.py --lora_r 8 (the tiny default models are built once, first). It checks
# that each run finished, that the ranks ended in sync (PPO under DDP; the sharded runs gather their weights
# instead), and that every saved folder (final model and checkpoint) loads with from_pretrained with no
# missing or unexpected weights; the LoRA run's final policy must be a plain model (adapters merged). It
# prints one line per run with seconds per step or iteration (median, PPO) or in all (SFT, RM) and peak
# GPU memory, and exits 1, naming every run that broke, if any did: a broken run is a failure, never a skip.
#
# --cpu: two gloo processes, a 1-layer model (SFT and RM built first, 2 steps each), one step or iteration a
# run (STEPS=1), under DDP (--multi_gpu), ZeRO-2 and ZeRO-3 (configs/zero*.yaml through tests/deepspeed_cpu.py,
# DeepSpeed's CPU shim), each with sft.py, sft.py --gradient_checkpointing, sft.py --lora_r 4, reward_model.py,
# reward_model.py --gradient_checkpointing, ppo.py, ppo.py --gradient_checkpointing and ppo.py --lora_r 4, all
# with --bf16, and under FSDP2 (configs/fsdp.yaml through tests/fsdp_cpu.py, which gives accelerate the FSDP
# state it starts only on GPUs): 32 runs, the same checks. CONFIGS="fsdp zero3" (names separated by spaces)
# runs only those configurations, in either mode.
set -uo pipefail
cd "$(dirname "$0")/.."
CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1
if [ "$CPU" = 1 ]; then
  GPUS=2
  STEPS=${STEPS:-1}
  OUT=${OUT:-runs/gpu_check_cpu}
  DEFAULT_CONFIGS="ddp fsdp zero2 zero3"
  JOBS=(sft sft_gc sft_lora rm rm_gc ppo ppo_gc ppo_lora)
  export OMP_NUM_THREADS=1 MA_RLHF_CPU_THREADS=1     # tiny models: a second thread per process gains nothing
else
  GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$GPUS" -lt 1 ]; then echo "gpu_check: no GPU found (nvidia-smi -L lists none); on a CPU: --cpu"; exit 1; fi
  STEPS=${STEPS:-6}
  OUT=${OUT:-runs/gpu_check}
  DEFAULT_CONFIGS="ddp fsdp zero2 zero3"
  JOBS=(sft rm ppo ppo_gc ppo_lora)
fi
read -r -a CONFIGS <<< "${CONFIGS:-$DEFAULT_CONFIGS}"
for config in "${CONFIGS[@]}"; do
  [ -f "configs/$config.yaml" ] || { echo "gpu_check: CONFIGS: no configs/$config.yaml (choices: $DEFAULT_CONFIGS)"; exit 2; }
done
mkdir -p "$OUT"
if [ "$CPU" = 1 ]; then
  SFT="$OUT/models/sft"; RM="$OUT/models/rm"; GOLD=4
  TINY=(--max_prompt_len 24 --max_response_len 12 --batch_size 4 --n_eval 16)
  SMALL=(--rollout_batch_size 4 --mini_batch_size 2 --max_prompt_len 16 --max_response_len 8 --n_eval_prompts 4)
  { python sft.py --hidden_size 32 --num_layers 1 --vocab_size 300 "${TINY[@]}" --max_steps 2 --output_dir "$SFT" &&
    python reward_model.py --sft_path "$SFT" "${TINY[@]}" --max_steps 2 --n_gold_prompts 0 --output_dir "$RM"; } \
      > "$OUT/build.log" 2>&1 || { echo "gpu_check: building the tiny SFT and reward models failed: $OUT/build.log"; exit 1; }
else
  SFT=runs/chitchat/sft; RM=runs/chitchat/rm; GOLD=16
  TINY=(--n_eval 64); SMALL=(--n_eval_prompts 16)
  python ppo.py --steps 1 --output_dir "$OUT/build" --n_eval_prompts 8 > "$OUT/build.log" 2>&1 \
      || { echo "gpu_check: building the default SFT and reward models failed: $OUT/build.log"; exit 1; }
fi
failed=()
printf "| config | stage | processes | seconds | peak GPU memory (GiB) | result |\n|---|---|---|---|---|---|\n"
for config in "${CONFIGS[@]}"; do
  for job in "${JOBS[@]}"; do
    name="${config}_${job}"
    run="$OUT/$name"
    rm -rf "$run"
    common=(--bf16 --save_every "$STEPS" --eval_every "$STEPS" --output_dir "$run")
    ppo=(ppo.py "${common[@]}" --steps "$STEPS" "${SMALL[@]}")
    [ "$CPU" = 1 ] && ppo+=(--sft_path "$SFT" --rm_path "$RM")
    sft=(sft.py "${common[@]}" --max_steps "$STEPS" "${TINY[@]}")
    [ "$CPU" = 1 ] && sft+=(--hidden_size 32 --num_layers 1 --vocab_size 300)
    rm_=(reward_model.py "${common[@]}" --max_steps "$STEPS" "${TINY[@]}" --n_gold_prompts "$GOLD" --sft_path "$SFT")
    case "$job" in
      sft) args=("${sft[@]}") ;;
      sft_gc) args=("${sft[@]}" --gradient_checkpointing) ;;
      sft_lora) args=(sft.py "${common[@]}" --max_steps "$STEPS" "${TINY[@]}" --model "$SFT" --lora_r 4) ;;
      rm) args=("${rm_[@]}") ;;
      rm_gc) args=("${rm_[@]}" --gradient_checkpointing) ;;
      ppo) args=("${ppo[@]}") ;;
      ppo_gc) args=("${ppo[@]}" --gradient_checkpointing) ;;
      ppo_lora) args=("${ppo[@]}" --lora_r "$([ "$CPU" = 1 ] && echo 4 || echo 8)") ;;
    esac
    if [ "$CPU" = 0 ]; then
      launch=(accelerate launch --config_file "configs/$config.yaml" --num_processes "$GPUS")
    elif [ "$config" = ddp ]; then
      launch=(python -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1
              --mixed_precision no --dynamo_backend no)
    elif [ "$config" = fsdp ]; then
      launch=(python -m accelerate.commands.launch --config_file configs/fsdp.yaml --num_processes 2
              --mixed_precision no --dynamo_backend no tests/fsdp_cpu.py)
    else
      launch=(python -m accelerate.commands.launch --config_file "configs/$config.yaml" --num_processes 2
              tests/deepspeed_cpu.py)
    fi
    start=$(date +%s)
    "${launch[@]}" "${args[@]}" > "$run.log" 2>&1
    rc=$?
    verdict=$(TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 python - "$run" "$rc" "$STEPS" "$config" "$job" "$(( $(date +%s) - start ))" <<'PY'
import json, os, statistics, sys
run, rc, steps, config, job, wall = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
problems = [] if rc == 0 else [f"exit {rc}"]
log = open(run + ".log").read()
step_s, peak = wall + " in all", float("nan")
if job.startswith("ppo"):
    path = os.path.join(run, "metrics.jsonl")
    rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    if len(rows) != steps:
        problems.append(f"{len(rows)} of {steps} iterations logged")
    if config == "ddp" and "ranks in sync: True" not in log:
        problems.append("ranks not in sync")
    timed = rows[1:] or rows         # the first iteration compiles and warms up, unless it is the only one
    step_s = f"{statistics.median(r['time/step'] for r in timed):.2f} / iteration" if timed else "nan"
    peak = max((r.get("memory/peak_gb", float("nan")) for r in rows), default=float("nan"))
    folders = {"policy": "AutoModelForCausalLM", "checkpoint/critic": "AutoModelForSequenceClassification",
               "checkpoint/policy": "AutoModelForCausalLM"}
    if job == "ppo_lora":     # the checkpoint holds adapters; the final policy is merged
        folders = {"policy": "AutoModelForCausalLM"}
        if not os.path.exists(os.path.join(run, "checkpoint/policy/adapter_config.json")):
            problems.append("no LoRA adapters in the checkpoint")
else:
    auto = "AutoModelForCausalLM" if job.startswith("sft") else "AutoModelForSequenceClassification"
    folders = {".": auto} if job.endswith("lora") else {".": auto, "checkpoint/model": auto}
    if job.endswith("lora") and not os.path.exists(os.path.join(run, "checkpoint/model/adapter_config.json")):
        problems.append("no LoRA adapters in the checkpoint")
try:
    import transformers
    for folder, auto in folders.items():
        if os.path.exists(os.path.join(run, folder, "adapter_config.json")):
            problems.append(f"{folder}: adapters, not a merged model")
        _, info = getattr(transformers, auto).from_pretrained(os.path.join(run, folder), output_loading_info=True)
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            problems.append(f"{folder}: {bad}"[:200])
except Exception as err:  # noqa: BLE001
    problems.append(f"reload failed: {type(err).__name__}: {err}"[:200])
print(f"{step_s} | {peak:.2f} | " + ("ok" if not problems else "FAILED: " + "; ".join(problems)))
PY
)
    printf "| %s | %s | %s | %s |\n" "$config" "$job" "$GPUS" "$verdict"
    case "$verdict" in *FAILED*) failed+=("$name (see $run.log)");; esac
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  echo; echo "gpu_check: FAILED: ${failed[*]}"; exit 1
fi
echo; echo "gpu_check: every run passed"
