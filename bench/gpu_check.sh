#!/usr/bin/env bash
# One command that checks every multi-GPU configuration on a machine with GPUs:
#
#     bash bench/gpu_check.sh            # all GPUs, 6 steps / iterations per run
#     STEPS=10 bash bench/gpu_check.sh
#
# For each of configs/ddp.yaml, fsdp.yaml, zero2.yaml, zero3.yaml it runs, with --bf16, every stage: sft.py
# (the tiny default model), reward_model.py (from the default SFT model), ppo.py, ppo.py
# --gradient_checkpointing and ppo.py --lora_r 8 (the tiny default models are built once, first). It checks
# that each run finished, that the ranks ended in sync (PPO under DDP; the sharded runs gather their weights
# instead), and that every saved folder (final model and checkpoint) loads with from_pretrained with no
# missing or unexpected weights; the LoRA run's final policy must be a plain model (adapters merged). It
# prints one line per run with seconds per step or iteration (median, PPO) or in all (SFT, RM) and peak
# GPU memory, and exits 1, naming every run that broke, if any did: a broken run is a failure, never a skip.
set -uo pipefail
cd "$(dirname "$0")/.."
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$GPUS" -lt 1 ]; then echo "gpu_check: no GPU found (nvidia-smi -L lists none)"; exit 1; fi
STEPS=${STEPS:-6}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
python ppo.py --steps 1 --output_dir "$OUT/build" --n_eval_prompts 8 > "$OUT/build.log" 2>&1 \
    || { echo "gpu_check: building the default SFT and reward models failed: $OUT/build.log"; exit 1; }
failed=()
printf "| config | stage | processes | seconds | peak GPU memory (GiB) | result |\n|---|---|---|---|---|---|\n"
for config in ddp fsdp zero2 zero3; do
  for job in sft rm ppo ppo_gc ppo_lora; do
    name="${config}_${job}"
    run="$OUT/$name"
    rm -rf "$run"
    common=(--bf16 --save_every "$STEPS" --eval_every "$STEPS" --output_dir "$run")
    case "$job" in
      sft) args=(sft.py "${common[@]}" --max_steps "$STEPS" --n_eval 64) ;;
      rm) args=(reward_model.py "${common[@]}" --max_steps "$STEPS" --n_eval 64 --n_gold_prompts 16
                --sft_path runs/chitchat/sft) ;;
      ppo) args=(ppo.py "${common[@]}" --steps "$STEPS" --n_eval_prompts 16) ;;
      ppo_gc) args=(ppo.py "${common[@]}" --steps "$STEPS" --n_eval_prompts 16 --gradient_checkpointing) ;;
      ppo_lora) args=(ppo.py "${common[@]}" --steps "$STEPS" --n_eval_prompts 16 --lora_r 8) ;;
    esac
    start=$(date +%s)
    accelerate launch --config_file "configs/$config.yaml" --num_processes "$GPUS" "${args[@]}" > "$run.log" 2>&1
    rc=$?
    verdict=$(python - "$run" "$rc" "$STEPS" "$config" "$job" "$(( $(date +%s) - start ))" <<'PY'
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
    step_s = f"{statistics.median(r['time/step'] for r in rows[1:]):.2f} / iteration" if len(rows) > 1 else "nan"
    peak = max((r.get("memory/peak_gb", float("nan")) for r in rows), default=float("nan"))
    folders = {"policy": "AutoModelForCausalLM", "checkpoint/critic": "AutoModelForSequenceClassification",
               "checkpoint/policy": "AutoModelForCausalLM"}
    if job == "ppo_lora":     # the checkpoint holds adapters; the final policy is merged
        folders = {"policy": "AutoModelForCausalLM"}
        if not os.path.exists(os.path.join(run, "checkpoint/policy/adapter_config.json")):
            problems.append("no LoRA adapters in the checkpoint")
else:
    auto = "AutoModelForCausalLM" if job == "sft" else "AutoModelForSequenceClassification"
    folders = {".": auto, "checkpoint/model": auto}
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
