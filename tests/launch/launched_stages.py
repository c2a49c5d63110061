"""Run by the tests (and by bench/gpu_check.sh --cpu) under one 2-process `accelerate launch` (gloo, CPU): stage
command lines one after the other in this process, each as `accelerate launch <stage>.py ...` runs it;
accelerate's process-wide state is reset between them (as in tests/launch/zero_stages.py), the process group is kept.
What stage i printed on rank r goes to LOG_DIR/<i>.<r>.txt.

    python tests/launch/launched_stages.py LOG_DIR '[["sft.py", "--max_steps", "60", ...], ["ppo.py", ...], ...]'
    python tests/launch/launched_stages.py --keep_going LOG_DIR '[...]'

An entry may instead be {"call": "module.function", "args": [...], "env": {...}}: the function of a module on the tests'
path called with those arguments (what it prints goes to LOG_DIR/<i>.<r>.txt too, its outcome as a stage's under
--keep_going), the environment variables set for the call as a launch would set them (e.g. test_audit5.fsdp_main
under FSDP_RESHARD_AFTER_FORWARD=false).

One launch instead of one per command line (a launch costs 5-6 s of imports and setup on a quiet 2-core machine).
The first stage that fails ends the launch; with --keep_going each stage's outcome is written to LOG_DIR/<i>.<r>.json
({"rc": its exit status, 1 for an exception, "seconds": its wall time}; the traceback at the end of its .txt) and
the next stage runs. A stage that fails on one rank only may leave the other waiting in a collective: whoever
runs the launch bounds it in time (bench/gpu_check.sh does) and counts a stage with no .json as failed.
"""
import contextlib
import importlib
import json
import os
import sys
import time
import traceback

from accelerate.state import AcceleratorState, GradientState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the stage modules
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec"))   # stages.py
from stages import run_stage  # noqa: E402


def main(log_dir, command_lines, keep_going=False):
    rank = os.environ.get("RANK", "0")
    for i, argv in enumerate(command_lines):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        if not keep_going:
            with open(os.path.join(log_dir, f"{i}.{rank}.txt"), "w") as f:
                run(argv, f)
            continue
        start, rc = time.time(), 0
        with open(os.path.join(log_dir, f"{i}.{rank}.txt"), "w") as f, \
                contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):     # argparse's errors too
            try:
                run(argv, f)
            except SystemExit as stop:          # a stage's own refusal: sys.exit(message or code)
                rc = stop.code if isinstance(stop.code, int) else 1
                f.write(f"\nSystemExit: {stop.code}\n")
            except Exception:  # noqa: BLE001   (recorded, and the next stage runs)
                rc = 1
                f.write("\n" + traceback.format_exc())
        with open(os.path.join(log_dir, f"{i}.{rank}.json"), "w") as f:
            json.dump({"rc": rc, "seconds": round(time.time() - start, 2)}, f)


def run(entry, printed):
    """One entry, what it prints written to the stream `printed`: a stage's command line (stages.run_stage), or
    {"call": "module.function", "args": [...], "env": {...}}: the function called with `env` set for the call."""
    if not isinstance(entry, dict):
        run_stage(*entry, printed=printed)
        return
    module, function = entry["call"].rsplit(".", 1)
    env = entry.get("env", {})
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            getattr(importlib.import_module(module), function)(*entry.get("args", ()))
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v

if __name__ == "__main__":
    keep_going = sys.argv[1] == "--keep_going"
    log_dir, command_lines = sys.argv[1 + keep_going:]
    main(log_dir, json.loads(command_lines), keep_going)
