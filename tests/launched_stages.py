"""Run by test_two_processes.py under one 2-process `accelerate launch` (gloo, CPU): stage command lines one
after the other in this process, each as `accelerate launch <stage>.py ...` runs it; accelerate's
process-wide state is reset between them (as in tests/zero_stages.py), the process group is kept. What
stage i printed on rank r goes to LOG_DIR/<i>.<r>.txt.

    python tests/launched_stages.py LOG_DIR '[["sft.py", "--max_steps", "60", ...], ["ppo.py", ...], ...]'

One launch instead of one per command line (a launch costs ~15 s of imports and setup on 2 cores).
"""
import json
import os
import sys

from accelerate.state import AcceleratorState, GradientState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the stage modules
from stages import run_stage  # noqa: E402


def main(log_dir, command_lines):
    for i, argv in enumerate(command_lines):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        out = run_stage(*argv)
        with open(os.path.join(log_dir, f"{i}.{os.environ['RANK']}.txt"), "w") as f:
            f.write(out)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
