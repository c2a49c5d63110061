"""What a run's untrusted data costs the trusted side (the trainer): its CPU and peak memory on worst cases, beside
honest twins.

    python bench/sandbox_trusted_cost.py [--keys 15000] [--against OTHER/sandbox.py]

CPU is this thread's (`time.thread_time()` around `sandbox.run`: the run is decided on the calling thread, the
children are other processes), peak memory what this process allocated (tracemalloc). A forged report is written
in two forms, a line per test and then a line for the whole run (the report's form before each test had its line),
so that either sandbox.py meets the forged value; the forging program then points every fd it holds at /dev/null.
With --against, the other sandbox.py (`git show REV:sandbox.py > old.py`) runs each case just before this one.
"""
import argparse
import importlib.util
import os
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402

LIMITS = sandbox.Limits(timeout=60, cpu_seconds=20, memory_mb=512)
MERSENNE = (1 << 61) - 1          # CPython hashes an int to itself modulo 2**61 - 1, in every process
FORGE = ("import os\nline = {line!r}\nfor fd in range(3, 30):\n    try:\n        os.write(fd, line)\n"
         "    except OSError:\n        pass\nnull = os.open('/dev/null', os.O_RDONLY)\nfor fd in range(3, 30):\n"
         "    if fd != null:\n        try:\n            os.fstat(fd)\n            os.dup2(null, fd)\n"
         "        except OSError:\n            pass\n")


def forged(value):
    return ('{"out":' + value + '}\n{"results":[{"out":' + value + '}]}\n').encode()


def cases(keys):
    """(name, program, tests) of each case."""
    def dict_of(key):
        return forged('{"dict":[' + ",".join(f"[{key(i)},0]" for i in range(keys)) + "]}")
    call = {"fn_name": "f", "inputs": [[keys]], "outputs": [{0: 0}]}
    humaneval = {"entry_point": "f", "test": "def check(candidate):\n    assert candidate(1) == 1\n", "prompt": ""}
    say_x = {"inputs": [""], "outputs": ["x"]}
    lines = forged('"' + "ab\\n" * 700000 + '"')
    letters = "abcdefghijkl"
    return [
        (f"call-based: a dict of {keys} honest int keys", "def f(n):\n    return {i: 0 for i in range(n)}\n", call),
        (f"call-based: {keys} keys sharing one hash",
         f"def f(n):\n    return {{i * {MERSENNE}: 0 for i in range(n)}}\n", call),
        ("stdin/stdout report: honest keys, forged", FORGE.format(line=dict_of(lambda i: i)), say_x),
        ("stdin/stdout report: colliding keys, forged", FORGE.format(line=dict_of(lambda i: i * MERSENNE)), say_x),
        ("HumanEval report: colliding keys, forged",
         "def f(x):\n    return x\n" + FORGE.format(line=dict_of(lambda i: i * MERSENNE)), humaneval),
        ("one string of 700,000 lines, forged", FORGE.format(line=lines), {"inputs": [""], "outputs": ["ab\nab\nx"]}),
        ("twelve honest outputs of 600 KB", "print(input() * 600000)\n",
         {"inputs": list(letters), "outputs": [c * 600000 for c in letters]}),
    ]


def measure(module, program, tests):
    tracemalloc.start()
    try:
        start = time.thread_time()
        result = module.run(program, tests, LIMITS)
        cpu = time.thread_time() - start
        peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
    finally:
        tracemalloc.stop()
    return result, cpu, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=15000, help="int keys of the dicts")
    parser.add_argument("--against", help="another sandbox.py, run on each case just before this one")
    args = parser.parse_args()
    modules = [("sandbox.py", sandbox)]
    if args.against:
        spec = importlib.util.spec_from_file_location("sandbox_other", args.against)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        modules.insert(0, (args.against, other))
    for _, module in modules:
        module.isolation()                                  # probed once, outside the measurements
    print(f"load average {os.getloadavg()[0]:.1f}\n")
    print("| case | sandbox | trainer CPU s | peak MiB | outcome |\n|---|---|---|---|---|")
    for name, program, tests in cases(args.keys):
        for label, module in modules:
            result, cpu, peak = measure(module, program, tests)
            print(f"| {name} | {label} | {cpu:.3f} | {peak:.1f} | {result.outcome}: {result.detail[:50]} |",
                  flush=True)


if __name__ == "__main__":
    main()
