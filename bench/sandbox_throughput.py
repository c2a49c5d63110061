"""Sandbox throughput: trivial programs per second through sandbox.run_many, by number of workers.

    python bench/sandbox_throughput.py [--programs 200]

Each program reads a number and prints its double (one stdin/stdout test), so the figure is the
per-program cost of the sandbox itself: a fresh interpreter in its namespaces, a per-run cgroup, a new
root, limits, a seccomp filter, the guard, and the trusted side reading every channel.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=200, help="programs per measurement")
    args = parser.parse_args()
    jobs = [(f"print({i} * int(input()))", {"inputs": ["2"], "outputs": [str(2 * i)]}) for i in range(args.programs)]
    print(f"{os.cpu_count()} CPU cores, {args.programs} trivial programs per row\n")
    print("| workers | seconds | programs/s | all passed |\n|---|---|---|---|")
    for workers in sorted({1, os.cpu_count() or 1}):
        t0 = time.time()
        results = sandbox.run_many(jobs, workers=workers)
        seconds = time.time() - t0
        ok = all(r.outcome == "passed" for r in results)
        print(f"| {workers} | {seconds:.2f} | {args.programs / seconds:.1f} | {ok} |")


if __name__ == "__main__":
    main()
