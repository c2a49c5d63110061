"""Sandbox throughput: trivial programs per second through sandbox.run_many, by number of workers.

    python bench/sandbox_throughput.py [--programs 200]
    python bench/sandbox_throughput.py --against OTHER/sandbox.py [--programs 40] [--rounds 3]

Each program reads a number and prints its double (one stdin/stdout test), so the figure is the
per-program cost of the sandbox itself: a fresh interpreter in its namespaces, a per-run cgroup, a new
root, limits, a seccomp filter, the guard, and the trusted side reading every channel.

With --against, this sandbox.py and another (an older version, `git show REV:sandbox.py > old.py`) run in
turn in one process, one worker, for a number of rounds: the CPU time per program (this process and the
children it reaped) depends far less on other work on the machine than programs per second do.
"""
import argparse
import importlib.util
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402


def jobs(n):
    return [(f"print({i} * int(input()))", {"inputs": ["2"], "outputs": [str(2 * i)]}) for i in range(n)]


def cpu_seconds():
    """CPU time of this process and of the children it has reaped."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def against(path, programs, rounds):
    spec = importlib.util.spec_from_file_location("sandbox_other", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    print(f"{programs} trivial programs per cell, one worker; load average {os.getloadavg()[0]:.1f} at the start\n")
    print("| round | sandbox | CPU ms / program | wall ms / program |\n|---|---|---|---|")
    for i in range(rounds):
        for name, module in ((path, other), ("sandbox.py", sandbox)):
            c0, t0 = cpu_seconds(), time.time()
            results = module.run_many(jobs(programs), workers=1)
            cpu, wall = cpu_seconds() - c0, time.time() - t0
            assert all(r.outcome == "passed" for r in results), results[:3]
            print(f"| {i + 1} | {name} | {1000 * cpu / programs:.1f} | {1000 * wall / programs:.0f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=200, help="programs per measurement")
    parser.add_argument("--against", help="another sandbox.py to alternate with (CPU time per program)")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: rounds of the two in turn")
    args = parser.parse_args()
    if args.against:
        return against(args.against, args.programs, args.rounds)
    print(f"{os.cpu_count()} CPU cores, {args.programs} trivial programs per row\n")
    print("| workers | seconds | programs/s | all passed |\n|---|---|---|---|")
    for workers in sorted({1, os.cpu_count() or 1}):
        t0 = time.time()
        results = sandbox.run_many(jobs(args.programs), workers=workers)
        seconds = time.time() - t0
        ok = all(r.outcome == "passed" for r in results)
        print(f"| {workers} | {seconds:.2f} | {args.programs / seconds:.1f} | {ok} |")


if __name__ == "__main__":
    main()
