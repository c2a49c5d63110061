"""sandbox.py runs honest contest code as its benchmark's own harness runs it: a stdin/stdout program as its own
`__main__` module (`python program.py < input`), a call-based program imported once and its function called per test
(APPS's harness), what call-based and HumanEval code prints discarded (neither harness judges it). Each program was
first run under plain CPython (stdin from a file), where it does what it is expected to do here."""
import pytest

import sandbox
from test_sandbox import nothing_is_left_behind  # noqa: F401 (a fixture: no process, folder or cgroup left)

PATIENT = sandbox.Limits(timeout=30.0, cpu_seconds=20, memory_mb=256)

DATACLASS = '''from __future__ import annotations
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class Point:
    scale: ClassVar[int] = 2
    x: int
    y: int = 0
    tags: list = field(default_factory=list)


'''
PICKLE = '''import pickle


class Node:
    def __init__(self, value):
        self.value = value


'''
MODULES = '''import sys


def double(x):
    return 2 * x


'''


@pytest.mark.parametrize("name, program", [
    ("a dataclass with a ClassVar under `from __future__ import annotations`",
     DATACLASS + "a = int(input())\nprint(Point(a, 1).x * Point.scale - a + 1)\n"),
    ("pickle of a class the program defines",
     PICKLE + "print(pickle.loads(pickle.dumps(Node(int(input())))).value + 1)\n"),
    ("getattr(sys.modules[__name__], ...)",
     MODULES + "a = int(input())\nprint(getattr(sys.modules[__name__], 'double')(a) - a + 1)\n"),
    ("sys.modules['__main__'] is the program",
     "import sys\nmarker = 1\nprint(int(input()) + sys.modules['__main__'].marker)\n"),
])
def test_a_stdin_stdout_program_is_its_own_main_module(name, program):
    """`__name__` was "__main__" in a namespace that no module held: the dataclass failed (TypeError: its ClassVar,
    a string, was read as a field), pickle could not find the class, sys.modules[__name__] was the sandbox's own
    `-c` module. Two inputs: each input gets a fresh module."""
    r = sandbox.run(program, {"inputs": ["2", "5"], "outputs": ["3", "6"]}, PATIENT)
    assert (r.outcome, r.passed) == ("passed", 2), (name, r)


def test_a_call_based_program_is_a_module_of_its_own():
    """The same three idioms in a call-based answer: its module is registered under its name ("program", not
    "__main__": APPS imports it, and a `__main__` block that reads input must not run)."""
    program = (DATACLASS + PICKLE + MODULES + "def f(n):\n    p = pickle.loads(pickle.dumps(Node(n))).value\n"
               "    return getattr(sys.modules[__name__], 'double')(Point(p).x * Point.scale) - 3 * n\n"
               "if __name__ == '__main__':\n    print(f(int(input())))\n")
    r = sandbox.run(program, {"fn_name": "f", "inputs": [[1], [2]], "outputs": [1, 2]}, PATIENT)
    assert (r.outcome, r.passed) == ("passed", 2), r


def test_a_call_based_program_is_imported_once_and_called_per_test():
    """APPS's call-based harness imports the program once and calls its function per test: a module-level count of
    calls reads 1, 2, ..., 40 (the program was run again for every test: 1 each time). A table precomputed at import
    is built once, not forty times."""
    program = ("calls = 0\nTABLE = [i * i for i in range(300000)]\ndef f(n):\n    global calls\n    calls += 1\n"
               "    return [calls, TABLE[n]]\n")
    tests = {"fn_name": "f", "inputs": [[i] for i in range(40)], "outputs": [[i + 1, i * i] for i in range(40)]}
    r = sandbox.run(program, tests, sandbox.Limits(timeout=30.0, cpu_seconds=4))
    assert (r.outcome, r.passed) == ("passed", 40), r
    method = "class Solution:\n    def __init__(self):\n        self.seen = 0\n    def f(self, n):\n" \
             "        self.seen += 1\n        return self.seen\n"                      # one Solution(), as APPS
    r = sandbox.run(method, {"fn_name": "f", "inputs": [[0]] * 3, "outputs": [1, 2, 3]}, PATIENT)
    assert (r.outcome, r.passed) == ("passed", 3), r


def test_a_call_that_raises_or_runs_out_of_budget_ends_the_run():
    """Each call runs under what is left of the run's budget: a call that spins ends the run as a timeout (a test
    that times out in APPS's harness is a runtime error there: the same reward), one that raises as a runtime
    error, the tests before it counted."""
    program = ("def f(n):\n    if n == 2:\n        raise ValueError('no')\n    while n == 3:\n        pass\n"
               "    return n\n")
    r = sandbox.run(program, {"fn_name": "f", "inputs": [[1], [2]], "outputs": [1, 2]}, PATIENT)
    assert (r.outcome, r.passed) == ("runtime_error", 1) and "ValueError" in r.detail, r
    r = sandbox.run(program, {"fn_name": "f", "inputs": [[1], [3]], "outputs": [1, 3]},
                    sandbox.Limits(timeout=30.0, cpu_seconds=1.5))
    assert r.outcome == "timeout", r


def test_what_a_call_based_answer_prints_is_not_its_output():
    """1.7 MB printed in one test (print, sys.stdout.write and os.write on fd 1): "output file is full" before;
    APPS's call-based harness ignores prints, and so does this one (fd 1 is /dev/null)."""
    program = ("import os, sys\ndef f(n):\n    for i in range(1000):\n        print('debug', i, 'x' * 600)\n"
               "        sys.stdout.write('y' * 500 + '\\n')\n        os.write(1, b'z' * 600 + b'\\n')\n"
               "    return n + 1\n")
    r = sandbox.run(program, {"fn_name": "f", "inputs": [[1], [2]], "outputs": [2, 3]}, PATIENT)
    assert (r.outcome, r.passed) == ("passed", 2), r


def test_what_a_humaneval_completion_prints_is_discarded():
    """1.4 MB of debug output from a HumanEval completion: its stdout was the trainer's pipe, capped at 1 MiB, and
    it died of BrokenPipeError; HumanEval's harness discards what completions print, and so does this one."""
    program = "def inc(x):\n    for i in range(2000):\n        print('debug', i, 'x' * 700)\n    return x + 1\n"
    check = {"entry_point": "inc", "test": "def check(candidate):\n    assert candidate(1) == 2\n", "prompt": ""}
    r = sandbox.run(program, check, PATIENT)
    assert r.outcome == "passed", r


def test_text_that_is_not_utf8_is_a_wrong_answer_not_a_crash():
    """A call-based answer holding a lone surrogate, or bytes printed that are not UTF-8: the child's report crashed
    on them (a runtime error, every test lost); they are outputs like any other, compared with the expected text."""
    r = sandbox.run("def f(x):\n    return '\\ud800' + x\n", {"fn_name": "f", "inputs": [["a"], ["b"]],
                                                               "outputs": ["a", "b"]}, PATIENT)
    assert (r.outcome, r.passed, r.failed) == ("failed", 0, 2), r
    program = "import sys\nsys.stdout.buffer.write(b'\\xff' + input().encode() + b'\\n')\n"
    r = sandbox.run(program, {"inputs": ["a", "b"], "outputs": ["a", "b"]}, PATIENT)
    assert (r.outcome, r.passed, r.failed) == ("failed", 0, 2), r
