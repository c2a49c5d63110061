"""Run by tests/launch/test_two_processes.py under one 2-process `accelerate launch` (gloo, CPU): stage command lines
one after the other, as tests/launch/launched_stages.py runs them, with two spies that call the real functions and keep
what each rank gave them: the prompts of every rollout and evaluation (data.encode_prompts) and the scores and
advantages of every call of macro_actions.group_advantages. Stage i of rank r writes LOG_DIR/<i>.<r>.pt ({"prompts":
[...], "groups": [(scores, advantages), ...]}) and what it printed to LOG_DIR/<i>.<r>.txt. Then, given IN_CHUNKS_DIR,
the same launch runs tests/launch/in_chunks_ranks.py's check into it (one launch for all of them: a launch costs
5-6 s of imports and setup on a quiet 2-core machine).

    python tests/launch/critic_free_ranks.py LOG_DIR '[["ppo.py", "--advantage", "group", ...], ...]' [IN_CHUNKS_DIR]
"""
import json
import os
import sys

import torch
from accelerate.state import AcceleratorState, GradientState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the stage modules
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec"))   # stages.py
import data  # noqa: E402
import macro_actions as ma  # noqa: E402
from stages import run_stage  # noqa: E402


def main(log_dir, command_lines, in_chunks_dir=None):
    rank = os.environ.get("RANK", "0")
    encode, group_advantages = data.encode_prompts, ma.group_advantages
    for i, argv in enumerate(command_lines):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        seen = {"prompts": [], "groups": []}

        def spied_encode(tokenizer, prompts, *args, **kwargs):
            seen["prompts"].append(list(prompts))
            return encode(tokenizer, prompts, *args, **kwargs)

        def spied_group_advantages(scores, *args, **kwargs):
            advantages = group_advantages(scores, *args, **kwargs)
            seen["groups"].append((scores.clone(), advantages.clone()))
            return advantages

        data.encode_prompts, ma.group_advantages = spied_encode, spied_group_advantages
        printed = run_stage(*argv)
        with open(os.path.join(log_dir, f"{i}.{rank}.txt"), "w") as f:
            f.write(printed)
        torch.save(seen, os.path.join(log_dir, f"{i}.{rank}.pt"))
    data.encode_prompts, ma.group_advantages = encode, group_advantages
    if in_chunks_dir is not None:
        import in_chunks_ranks
        AcceleratorState._reset_state()
        GradientState._reset_state()
        in_chunks_ranks.main(in_chunks_dir)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), *sys.argv[3:])
