"""How much of the project one PPO iteration runs: the distinct lines of the project's own files executed between
the second and the third rollout of ppo.py (one steady-state iteration: score, rewards, macro actions, advantages,
update, log, then up to the next rollout's sampling), per file.

    python bench/iteration_lines.py                          # the default flags
    python bench/iteration_lines.py --flags "--advantage group"
    python bench/iteration_lines.py --flags "--n 1" --list ppo.py      # also print ppo.py's executed lines

It runs ppo.main in this process on random tiny models (bench/same_numbers.py's recipe: the same layout as the
default run's, built in a second) with every other flag at its default, and traces with sys.settrace from the
moment data.batch_indices (the rollout's first call) is entered for the second time until it is entered for the third. A reader who follows one
iteration line by line reads these lines; the count is what the tutorial core keeps small.
"""
import argparse
import collections
import os
import shlex
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def project_files():
    """The project's own modules: the .py files at the repository's top level (not tests/ or bench/)."""
    return {os.path.join(ROOT, name) for name in os.listdir(ROOT) if name.endswith(".py")}


def traced_iteration(flags, workdir):
    """{file name: sorted line numbers} executed by one steady-state iteration of ppo.py under `flags`."""
    from transformers import HfArgumentParser
    import data
    import ppo
    from same_numbers import tiny_models
    sft_path, rm_path = tiny_models(os.path.join(workdir, "models"))
    argv = ["--sft_path", sft_path, "--rm_path", rm_path, "--output_dir", os.path.join(workdir, "run"),
            "--steps", "3", "--plot", "false", "--n_eval_prompts", "8", *flags]
    args = HfArgumentParser(ppo.ARGS).parse_args_into_dataclasses(argv)
    ours, seen, calls = project_files(), collections.defaultdict(set), [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename not in ours:
            return None     # no line events inside torch, transformers, ...
        if event in ("line", "call"):
            seen[frame.f_code.co_filename].add(frame.f_lineno)
        return tracer

    batch_indices = data.batch_indices

    def watched(*a, **k):     # the second rollout starts the trace, the third ends it
        calls[0] += 1
        if calls[0] == 2:
            sys.settrace(tracer)
            sys._getframe().f_back.f_trace = tracer     # the running loop's own frame too
        elif calls[0] == 3:
            sys.settrace(None)
        return batch_indices(*a, **k)

    data.batch_indices = watched
    try:
        ppo.main(*args)
    finally:
        sys.settrace(None)
        data.batch_indices = batch_indices
    if calls[0] < 3:
        sys.exit(f"error: ppo.py sampled {calls[0]} rollouts, not 3: the iteration was not traced whole")
    return {os.path.basename(f): sorted(lines) for f, lines in seen.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", default="", help="ppo.py flags beyond the defaults, e.g. '--advantage group'")
    parser.add_argument("--list", default="", help="print the executed lines of this file (e.g. ppo.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="iteration_lines_") as workdir:
        lines = traced_iteration(shlex.split(args.flags), workdir)
    total = sum(len(v) for v in lines.values())
    core = sum(len(lines.get(f, ())) for f in ("ppo.py", "macro_actions.py"))
    print(f"\none iteration of ppo.py {args.flags or '(default flags)'}: {total} distinct project lines in "
          f"{len(lines)} files, {100 * core / max(total, 1):.0f}% in ppo.py + macro_actions.py")
    for name, numbers in sorted(lines.items(), key=lambda kv: -len(kv[1])):
        print(f"  {name:20s} {len(numbers):4d}")
    if args.list:
        source = open(os.path.join(ROOT, args.list)).read().splitlines()
        for n in lines.get(args.list, ()):
            print(f"{n:5d}  {source[n - 1]}")


if __name__ == "__main__":
    main()
