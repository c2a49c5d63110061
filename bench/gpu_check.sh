#!/usr/bin/env bash
# One command that checks every multi-GPU configuration on a machine with GPUs:
#
#     bash bench/gpu_check.sh            # all GPUs, 6 PPO iterations per configuration
#     STEPS=10 bash bench/gpu_check.sh
#
# For each of configs/ddp.yaml, fsdp.yaml, zero2.yaml, zero3.yaml, each also with --gradient_checkpointing,
# it runs ppo.py on the default task with --bf16 (the tiny default models are built once, first), then
# checks that the run finished, that the ranks ended in sync (DDP; the sharded runs gather their weights
# instead), and that the saved policy and checkpoint reload with from_pretrained. It prints one line per
# configuration with seconds per iteration (median) and peak GPU memory, and exits 1, naming every
# configuration that broke, if any did: a broken configuration is a failure, never a skip.
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
printf "| config | gradient checkpointing | processes | s / iteration | peak GPU memory (GiB) | result |\n|---|---|---|---|---|---|\n"
for config in ddp fsdp zero2 zero3; do
  for gc in "" "--gradient_checkpointing"; do
    name="${config}${gc:+_gc}"
    run="$OUT/$name"
    rm -rf "$run"
    accelerate launch --config_file "configs/$config.yaml" --num_processes "$GPUS" ppo.py --bf16 $gc \
        --steps "$STEPS" --save_every "$STEPS" --eval_every "$STEPS" --n_eval_prompts 16 --output_dir "$run" \
        > "$run.log" 2>&1
    rc=$?
    verdict=$(python - "$run" "$rc" "$STEPS" "$config" <<'PY'
import json, os, statistics, sys
run, rc, steps, config = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
problems = [] if rc == 0 else [f"exit {rc}"]
rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))] if os.path.exists(os.path.join(run, "metrics.jsonl")) else []
if len(rows) != steps:
    problems.append(f"{len(rows)} of {steps} iterations logged")
log = open(run + ".log").read()
if config == "ddp" and "ranks in sync: True" not in log:
    problems.append("ranks not in sync")
try:
    from transformers import AutoModelForCausalLM
    for folder in ("policy", "checkpoint/policy"):
        AutoModelForCausalLM.from_pretrained(os.path.join(run, folder))
except Exception as err:  # noqa: BLE001
    problems.append(f"reload failed: {type(err).__name__}: {err}"[:200])
step_s = statistics.median(r["time/step"] for r in rows[1:]) if len(rows) > 1 else float("nan")
peak = max((r.get("memory/peak_gb", float("nan")) for r in rows), default=float("nan"))
print(f"{step_s:.2f} | {peak:.2f} | " + ("ok" if not problems else "FAILED: " + "; ".join(problems)))
PY
)
    printf "| %s | %s | %s | %s |\n" "$config" "${gc:+yes}" "$GPUS" "$verdict"
    case "$verdict" in *FAILED*) failed+=("$name (see $run.log)");; esac
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  echo; echo "gpu_check: FAILED: ${failed[*]}"; exit 1
fi
echo; echo "gpu_check: every configuration passed"
