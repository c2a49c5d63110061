"""sandbox.py: what a run's untrusted data can make the trusted side (the trainer) spend is bounded by the data's
size, whatever its content. The worst cases: a dict whose keys share one hash (returned by a call-based answer,
or forged on the report pipe of a stdin/stdout or a HumanEval run), one output string of many short lines, many
large outputs. The trainer's CPU is read on this thread (the run is decided here; the
children are other processes), as a ratio to an honest twin measured in the same test; its memory with tracemalloc.

The hostile programs only write bytes to their own pipes and /dev/null."""
import itertools
import random
import time
import tracemalloc

import pytest

import sandbox
from test_sandbox import nothing_is_left_behind  # noqa: F401 (a fixture: no process, folder or cgroup left)

PATIENT = sandbox.Limits(timeout=60.0, cpu_seconds=20, memory_mb=512)
MERSENNE = (1 << 61) - 1          # CPython hashes an int to itself modulo 2**61 - 1, in every process
KEYS = 12000
# every fd from 3 on written with `line`, then pointed at /dev/null: the child's own report after it is lost,
# so that `line` is the only report line (a program's forgery; it holds the report pipe)
FORGE = ("import os\nline = {line!r}\nfor fd in range(3, 30):\n    try:\n        os.write(fd, line)\n"
         "    except OSError:\n        pass\nnull = os.open('/dev/null', os.O_RDONLY)\nfor fd in range(3, 30):\n"
         "    if fd != null:\n        try:\n            os.fstat(fd)\n            os.dup2(null, fd)\n"
         "        except OSError:\n            pass\n")
HUMANEVAL = {"entry_point": "f", "test": "def check(candidate):\n    assert candidate(1) == 1\n", "prompt": ""}


def trusted_cost(program, tests, limits=PATIENT):
    """(the run's Result, CPU seconds of this thread, peak MiB this process allocated) for one run."""
    tracemalloc.start()
    try:
        start = time.thread_time()
        result = sandbox.run(program, tests, limits)
        cpu = time.thread_time() - start
        peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
    finally:
        tracemalloc.stop()
    return result, cpu, peak


def forged(value):
    """A forged report holding `value` (JSON text) as the first test's output, in two forms: a line per test, then
    a line for the whole run (the report's form before each test had its line): whichever one the trusted side
    reads, it meets the value."""
    return ('{"out":' + value + '}\n{"results":[{"out":' + value + '}]}\n').encode()


def forged_dict(key):
    """A forged report holding one dict of KEYS int keys, in the child's encoding."""
    return forged('{"dict":[' + ",".join(f"[{key(i)},0]" for i in range(KEYS)) + "]}")


@pytest.mark.parametrize("how", ["call-based answer", "forged on a stdin/stdout run's report",
                                 "forged on a HumanEval run's report"])
def test_keys_that_share_one_hash_cost_the_trusted_side_what_honest_keys_do(how):
    """20,000 int keys, all multiples of 2**61 - 1, against 20,000 honest ones, measured in turn: rebuilding the
    colliding dict was quadratic (1.25 s of the trainer's CPU for 15,000 keys against 0.04 s, the child paying
    nothing when forged; 12,000 here); now the keys are only looked up in the expected dict, built from trusted keys."""
    sandbox.isolation()                                         # probed once, outside the measurements
    if how == "call-based answer":
        cases = {name: (f"def f(n):\n    return {{i * {m}: 0 for i in range(n)}}\n",
                        {"fn_name": "f", "inputs": [[KEYS]], "outputs": [{0: 0}]}) for name, m in
                 (("honest", 1), ("colliding", MERSENNE))}
    else:
        tests = HUMANEVAL if "HumanEval" in how else {"inputs": [""], "outputs": ["x"]}
        prefix = "def f(x):\n    return x\n" if "HumanEval" in how else ""
        cases = {name: (prefix + FORGE.format(line=forged_dict(key)), tests) for name, key in
                 (("honest", lambda i: i), ("colliding", lambda i: i * MERSENNE))}
    cpu = {"honest": [], "colliding": []}
    for _ in range(2):
        for name, (program, tests) in cases.items():
            result, seconds, peak = trusted_cost(program, tests)
            assert result.outcome != "passed" and peak < 16, (how, name, result, f"{peak:.1f} MiB")
            cpu[name].append(seconds)
    honest, colliding = min(cpu["honest"]), min(cpu["colliding"])
    assert colliding < 3 * honest + 0.05, f"{how}: {colliding:.3f} s of the trainer's CPU against {honest:.3f} s"


def test_one_string_of_many_lines_is_compared_a_piece_at_a_time():
    """A report holding one string of 700,000 lines "ab" (2.8 MB of JSON: the value count lets it through) was
    split whole: a string object per line (a 54 MiB peak: bench/sandbox_trusted_cost.py). Now a piece of 16K
    characters at a time, stopping at the first difference: the peak is about the report's own bytes."""
    line = forged('"' + "ab\\n" * 700000 + '"')
    result, _, peak = trusted_cost(FORGE.format(line=line), {"inputs": [""], "outputs": ["ab\nab\nx"]})
    assert result.outcome != "passed" and peak < 24, (result, f"{peak:.1f} MiB")


def test_many_large_outputs_pass_and_the_trusted_side_holds_one_at_a_time():
    """Twelve honest outputs of 600 KB, each under the 1 MiB cap per test: the whole run's report was capped at
    about 6 MiB ("output limit exceeded (all outputs of the run)"); now each test's line is judged as it arrives,
    and the trusted side's peak is about one output's, not twelve."""
    letters = "abcdefghijkl"
    tests = {"inputs": list(letters), "outputs": [c * 600000 for c in letters]}
    result, _, peak = trusted_cost("print(input() * 600000)\n", tests)
    assert (result.outcome, result.passed) == ("passed", 12), result
    assert peak < 8, f"{peak:.1f} MiB"


def test_the_trusted_sides_cpu_on_a_report_is_capped(monkeypatch):
    """Past TRUSTED_CPU_SHARE of the run's budget spent parsing and comparing its report lines, the run fails.
    The share is made tiny here, so that an honest report passes it: the mechanism, on a real run."""
    program, tests = "print(int(input()) * 2)\n", {"inputs": ["1", "2"], "outputs": ["2", "4"]}
    assert sandbox.run(program, tests, PATIENT).outcome == "passed"
    monkeypatch.setattr(sandbox, "TRUSTED_CPU_SHARE", 1e-12)
    result = sandbox.run(program, tests, PATIENT)
    assert result.outcome == "runtime_error" and "cost the trusted side" in result.detail, result


def test_more_report_lines_than_tests_end_the_reading():
    """Each report line is parsed once, and no more lines than there are tests: a forged line for a test that does
    not exist fails the run."""
    forged = b'{"out":"x"}\n' * 3
    result = sandbox.run(FORGE.format(line=forged), {"inputs": ["", ""], "outputs": ["x", "x"]}, PATIENT)
    assert result.outcome == "runtime_error" and "more report lines than tests" in result.detail, result


def reference_lines(text):
    """The comparison's definition, written plainly: lines of the stripped text, each right-stripped."""
    return [line.rstrip() for line in text.strip().splitlines()]


def test_the_streamed_comparison_is_the_plain_one():
    """Random texts over line boundaries, whitespace and letters, compared in pieces of 1, 2, 3 and 16K characters,
    give what comparing the whole texts' lines gives."""
    alphabet = ["a", "b", " ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\u2028", "\xa0"]
    rng = random.Random(0)
    agreed = {True: 0, False: 0}
    for _ in range(3000):
        got = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        expected = rng.choice([got, got.replace("\n", " \n", 1), got + "\n a",
                               "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))])
        same = reference_lines(got) == reference_lines(expected)
        for piece in (1, 2, 3, 1 << 14):
            assert sandbox._same_output(got, expected, piece) == same, (got, expected, piece)
        agreed[same] += 1
    assert min(agreed.values()) > 300, agreed                     # both answers were exercised


def test_dicts_compare_by_value_through_their_pairs():
    """A dict the program sent is a list of pairs on the trusted side (never hashed): equal to the expected dict
    when it holds the same keys (1 == 1.0 == True, tuples as lists) with equal values, once each."""
    def value(x):
        return sandbox.parse_report(sandbox._line(sandbox.encode(x)).encode())
    expected = {1: [(2, "a")], (3, 4): {"k": None}, "s": 1.5}
    assert sandbox._same_value(value({1.0: [[2, "a"]], (3, 4): {"k": None}, "s": 1.5}), expected)
    assert sandbox._same_value(value(expected), [expected])                         # APPS's [answer]
    for wrong in [{1: [(2, "b")], (3, 4): {"k": None}, "s": 1.5}, {1: [(2, "a")], (3, 4): {"k": None}},
                  {1: [(2, "a")], (3, 5): {"k": None}, "s": 1.5}, [1, (3, 4), "s"]]:
        assert not sandbox._same_value(value(wrong), expected), wrong
    twice = sandbox.parse_report(b'{"dict":[[1,0],[1,0]]}')                         # a forged duplicate key
    assert not sandbox._same_value(twice, {1: 0, 2: 0})
    unhashable = sandbox.parse_report(b'{"dict":[[{"dict":[]},0]]}')                # a dict as a key
    assert not sandbox._same_value(unhashable, {(): 0})
    assert list(itertools.chain(*sandbox._pieces(""))) == []
