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
# --cpu: two gloo processes, a 1-layer model (SFT and RM built first, 2 steps each, in one process), one step or
# iteration a run (STEPS=1), under DDP (--multi_gpu), ZeRO-2 and ZeRO-3 (configs/zero*.yaml through
# tests/launch/deepspeed_cpu.py, DeepSpeed's CPU shim) and FSDP2 (configs/fsdp.yaml through tests/launch/fsdp_cpu.py, which
# gives accelerate the FSDP state it starts only on GPUs), each with sft.py, sft.py --gradient_checkpointing,
# sft.py --lora_r 4, reward_model.py, reward_model.py --gradient_checkpointing, ppo.py, ppo.py
# --gradient_checkpointing and ppo.py --lora_r 4, all with --bf16: 32 runs, the same checks. A launch costs more
# than a tiny run, so each configuration is one launch whose processes run its 8 stages one after the other
# (tests/launch/launched_stages.py --keep_going: accelerate's state reset between stages, as the tests do; a stage that
# fails is recorded and the next one runs; a launch still running after LAUNCH_TIMEOUT seconds, 480 by default,
# is stopped and its unfinished runs fail). The seconds column is then a stage's own time (the launch's start
# excluded; the first stage pays the stage modules' imports). 3.5 to 4.5 minutes on 2 busy cores.
# CONFIGS="fsdp zero3" (names separated by spaces) runs only those configurations, in either mode.
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
  LAUNCH_TIMEOUT=${LAUNCH_TIMEOUT:-480}    # seconds for one configuration's launch (a rank left in a collective)
  rm -rf "$OUT/models" && mkdir -p "$OUT/models"
  python - "$SFT" "$RM" "${TINY[@]}" > "$OUT/build.log" 2>&1 <<'PY' \
      || { echo "gpu_check: building the tiny SFT and reward models failed: $OUT/build.log"; exit 1; }
import sys
sys.path.insert(0, "tests/spec")
from stages import run_stage     # both stages in one process: an interpreter's imports take ~5 s on 2 cores
sft, rm, tiny = sys.argv[1], sys.argv[2], sys.argv[3:]
print(run_stage("sft.py", "--hidden_size", "32", "--num_layers", "1", "--vocab_size", "300", *tiny, "--max_steps", "2",
                "--output_dir", sft))
print(run_stage("reward_model.py", "--sft_path", sft, *tiny, "--max_steps", "2", "--n_gold_prompts", "0",
                "--output_dir", rm))
PY
else
  SFT=runs/chitchat/sft; RM=runs/chitchat/rm; GOLD=16
  TINY=(--n_eval 64); SMALL=(--n_eval_prompts 16)
  python ppo.py --steps 1 --output_dir "$OUT/build" --n_eval_prompts 8 > "$OUT/build.log" 2>&1 \
      || { echo "gpu_check: building the default SFT and reward models failed: $OUT/build.log"; exit 1; }
fi
# job_args CONFIG JOB: the stage command line of one run (without its launcher) in the array `args`
job_args() {
  local run="$OUT/$1_$2"
  local common=(--bf16 --save_every "$STEPS" --eval_every "$STEPS" --output_dir "$run")
  local ppo=(ppo.py "${common[@]}" --steps "$STEPS" "${SMALL[@]}")
  [ "$CPU" = 1 ] && ppo+=(--sft_path "$SFT" --rm_path "$RM")
  local sft=(sft.py "${common[@]}" --max_steps "$STEPS" "${TINY[@]}")
  [ "$CPU" = 1 ] && sft+=(--hidden_size 32 --num_layers 1 --vocab_size 300)
  local rm_=(reward_model.py "${common[@]}" --max_steps "$STEPS" "${TINY[@]}" --n_gold_prompts "$GOLD" --sft_path "$SFT")
  case "$2" in
    sft) args=("${sft[@]}") ;;
    sft_gc) args=("${sft[@]}" --gradient_checkpointing) ;;
    sft_lora) args=(sft.py "${common[@]}" --max_steps "$STEPS" "${TINY[@]}" --model "$SFT" --lora_r 4) ;;
    rm) args=("${rm_[@]}") ;;
    rm_gc) args=("${rm_[@]}" --gradient_checkpointing) ;;
    ppo) args=("${ppo[@]}") ;;
    ppo_gc) args=("${ppo[@]}" --gradient_checkpointing) ;;
    ppo_lora) args=("${ppo[@]}" --lora_r "$([ "$CPU" = 1 ] && echo 4 || echo 8)") ;;
  esac
}

# launcher CONFIG: the `accelerate launch` of one configuration, in the array `launch`
launcher() {
  if [ "$CPU" = 0 ]; then
    launch=(accelerate launch --config_file "configs/$1.yaml" --num_processes "$GPUS")
  elif [ "$1" = ddp ]; then
    launch=(python -m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1
            --mixed_precision no --dynamo_backend no)
  elif [ "$1" = fsdp ]; then
    launch=(python -m accelerate.commands.launch --config_file configs/fsdp.yaml --num_processes 2
            --mixed_precision no --dynamo_backend no tests/launch/fsdp_cpu.py)
  else
    launch=(python -m accelerate.commands.launch --config_file "configs/$1.yaml" --num_processes 2
            tests/launch/deepspeed_cpu.py)
  fi
}

# verdict STEPS [RUN STATUS SECONDS CONFIG JOB]...: one table row per run, from what it left. STATUS is the
# launch's exit status, or (--cpu) the prefix of the per-rank <prefix>.<rank>.json that tests/launch/launched_stages.py
# --keep_going wrote for the stage (none: the launch stopped before the stage ended).
verdict() {
  TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 python - "$@" <<'PY'
import glob, json, os, statistics, sys
steps, runs = int(sys.argv[1]), sys.argv[2:]
for run, status, wall, config, job in zip(*[iter(runs)] * 5):
    problems = []
    if status.isdigit():
        rc = int(status)
    else:                                   # one stage of a --cpu launch: its outcome on each rank
        ranks = [json.load(open(f)) for f in sorted(glob.glob(status + ".*.json"))]
        rc = max((r["rc"] for r in ranks), default=None) if len(ranks) == 2 else None
        wall = f"{max((r['seconds'] for r in ranks), default=float('nan')):.0f}"
        if rc is None:
            launch_log = os.path.join(os.path.dirname(status), "launch.log")
            problems.append(f"no result on {2 - len(ranks)} rank(s): the launch stopped or timed out ({launch_log})")
            if not ranks:                   # never ran: nothing more to check
                print(f"| {config} | {job} | {os.environ['GPUS']} | nan | nan | FAILED: {problems[0]} |", flush=True)
                continue
    if rc:
        problems.append(f"exit {rc}")
    log = open(run + ".log").read() if os.path.exists(run + ".log") else ""
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
    result = "ok" if not problems else "FAILED: " + "; ".join(problems)
    print(f"| {config} | {job} | {os.environ['GPUS']} | {step_s} | {peak:.2f} | {result} |", flush=True)
PY
}

export GPUS
rows=()
printf "| config | stage | processes | seconds | peak GPU memory (GiB) | result |\n|---|---|---|---|---|---|\n"
for config in "${CONFIGS[@]}"; do
  launcher "$config"
  if [ "$CPU" = 0 ]; then                 # one launch per run: its own processes, its own peak memory
    for job in "${JOBS[@]}"; do
      run="$OUT/${config}_$job"
      rm -rf "$run"
      job_args "$config" "$job"
      start=$(date +%s)
      "${launch[@]}" "${args[@]}" > "$run.log" 2>&1
      rc=$?
      rows+=("$(verdict "$STEPS" "$run" "$rc" "$(( $(date +%s) - start ))" "$config" "$job")")
      echo "${rows[-1]}"
    done
  else                                    # one launch per configuration: its 8 runs one after the other
    dir="$OUT/$config"
    rm -rf "$dir" "$OUT/${config}_"*
    mkdir -p "$dir"
    lines=()
    for job in "${JOBS[@]}"; do
      job_args "$config" "$job"
      lines+=("$(python -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${args[@]}")")
    done
    json="[$(IFS=,; echo "${lines[*]}")]"
    timeout -k 30 "$LAUNCH_TIMEOUT" "${launch[@]}" tests/launch/launched_stages.py --keep_going "$dir" "$json" \
        > "$dir/launch.log" 2>&1
    spec=()
    for i in "${!JOBS[@]}"; do
      run="$OUT/${config}_${JOBS[$i]}"
      for rank in 0 1; do
        [ -f "$dir/$i.$rank.txt" ] && { echo "== rank $rank"; cat "$dir/$i.$rank.txt"; }
      done > "$run.log"
      spec+=("$run" "$dir/$i" - "$config" "${JOBS[$i]}")
    done
    while IFS= read -r row; do rows+=("$row"); echo "$row"; done < <(verdict "$STEPS" "${spec[@]}")
  fi
done
failed=()
for row in "${rows[@]}"; do
  case "$row" in *FAILED*) IFS='|' read -r _ config job _ <<< "$row"; config=${config// /}; job=${job// /}
                           failed+=("${config}_$job (see $OUT/${config}_$job.log)");; esac
done
if [ ${#failed[@]} -gt 0 ]; then
  echo; echo "gpu_check: FAILED: ${failed[*]}"; exit 1
fi
echo; echo "gpu_check: every run passed"
