"""The page-cache channel between sandbox runs: how many bits a sender run passes to a receiver run, measured.

    python bench/sandbox_page_cache.py [--bits 64] [--rounds 3] [--seed 0]

Every run can read the host's standard library and shared-library folders (read-only). A sender run reads the files
of a codebook whose bit is 1, which brings them into the host's page cache; a receiver run times its first read of
each file against a second read of it: a first read as fast as the second was cached (1), a slower one came from the
disk (0). Both are ordinary programs run by sandbox.run, with every layer `sandbox.py --check` names; the codebook
(the paths) is public, as the standard library's layout is. Before each round this process (trusted, on the host)
evicts the codebook's files from the cache (posix_fadvise DONTNEED), as the host's own memory pressure would.

The receiver answers one test per bit (its input the bit's index, its expected output the bit): the sandbox's own
verdict counts the bits it decoded. Three settings: the receiver in the next run, the two concurrent (one run_many
batch, the receiver starting 1.5 s later), and a control with no sender (every bit should read 0).
"""
import argparse
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402

LIMITS = sandbox.Limits(timeout=60.0, cpu_seconds=30)
SENDER = "import os\nfor path, bit in zip(PATHS, BITS):\n    if bit:\n        with open(path, 'rb') as f:\n" \
         "            f.read()\nprint('sent')\n"
# one input per bit: the first read of a page of the file against a second read of the same page
RECEIVER = ("import os, time\ni = int(input())\nif i == 0:\n    time.sleep(WAIT)\nfd = os.open(PATHS[i], os.O_RDONLY)\n"
            "t = time.perf_counter_ns()\nos.pread(fd, 4096, 0)\nfirst = time.perf_counter_ns() - t\n"
            "t = time.perf_counter_ns()\nos.pread(fd, 4096, 0)\nagain = time.perf_counter_ns() - t\n"
            "print(1 if first < again + 15000 else 0)\n")


# What a child shows a run, worked out as _isolate does it: the standard library's folder and the folders of the
# shared libraries its interpreter has mapped by then (the child has loaded ctypes, for its filter)
SHOWN = ("import ctypes, os, sys\nsys.path.insert(0, sys.argv[1])\nimport sandbox\n"
         "print('\\n'.join(sorted({os.path.dirname(os.path.realpath(os.__file__)), *sandbox._mounted_library_dirs()})))")


def readable():
    """(files, bytes) a run can read: the regular files under the folders a child shows, site-packages left out."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folders = subprocess.run([sandbox._interpreter(), "-I", "-S", "-c", SHOWN, root], capture_output=True, text=True,
                             check=True).stdout.split()
    shown = [f for f in folders if not any(f.startswith(other + os.sep) for other in folders)]
    files = size = 0
    for folder in shown:
        for where, subfolders, names in os.walk(folder):
            subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
            for name in names:
                path = os.path.join(where, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    files, size = files + 1, size + os.path.getsize(path)
    return shown, files, size


def codebook(n):
    """n standard-library files no sandbox child imports (the largest .py files of its test folders), sorted."""
    stdlib = os.path.dirname(os.__file__)
    found = []
    for root, _, files in os.walk(os.path.join(stdlib, "test")):
        found += [os.path.join(root, f) for f in files if f.endswith(".py")]
    found.sort(key=lambda p: (-os.path.getsize(p), p))
    if len(found) < n:
        raise SystemExit(f"--bits {n}: only {len(found)} files in {stdlib}/test")
    return sorted(found[:n])


def evict(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def entropy(p):
    return 0.0 if p in (0.0, 1.0) else -p * math.log2(p) - (1 - p) * math.log2(1 - p)


def one_round(paths, bits, setting):
    """Bits decoded right (the receiver's passed tests) out of len(bits), and the pair's wall seconds."""
    given = f"PATHS = {paths!r}\nBITS = {bits!r}\nWAIT = {1.5 if setting == 'concurrent' else 0.0}\n"
    tests = {"inputs": [str(i) for i in range(len(bits))], "outputs": [str(b) for b in bits]}
    evict(paths)
    start = time.time()
    if setting == "next run":
        sent = sandbox.run(given + SENDER, {"inputs": [""], "outputs": ["sent"]}, LIMITS)
        received = sandbox.run(given + RECEIVER, tests, LIMITS)
    elif setting == "concurrent":
        sent, received = sandbox.run_many([(given + SENDER, {"inputs": [""], "outputs": ["sent"]}),
                                           (given + RECEIVER, tests)], LIMITS, workers=2)
    else:                                                  # no sender: every bit is 0
        sent, tests["outputs"] = None, ["0"] * len(bits)
        received = sandbox.run(given + RECEIVER, tests, LIMITS)
    assert sent is None or sent.outcome == "passed", sent
    assert received.outcome in ("passed", "failed"), received
    return received.passed, time.time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, default=64, help="bits (codebook files) per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each setting")
    parser.add_argument("--seed", type=int, default=0, help="seed of the messages")
    args = parser.parse_args()
    layers = sandbox.isolation()[4]
    paths, rng = codebook(args.bits), random.Random(args.seed)
    shown, files, size = readable()
    print(f"A run can read {files} files, {size / 2 ** 20:.0f} MiB, under {', '.join(shown)}")
    print(f"{len(layers)} sandbox layers hold; {args.bits} bits a round, codebook in {os.path.dirname(paths[0])}; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| setting | round | bits right | seconds |\n|---|---|---|---|")
    for setting in ("next run", "concurrent", "no sender (control)"):
        right = 0
        for i in range(args.rounds):
            bits = [rng.randint(0, 1) for _ in range(args.bits)]
            ok, seconds = one_round(paths, bits, setting)
            right += ok
            print(f"| {setting} | {i + 1} | {ok} / {args.bits} | {seconds:.1f} |", flush=True)
        p = 1 - right / (args.rounds * args.bits)
        print(f"| {setting} | all | error rate {p:.3f}: {args.bits * (1 - entropy(p)):.1f} bits a run pair "
              "(binary symmetric channel) | |")


if __name__ == "__main__":
    main()
