"""sandbox.py: hostile programs get the right outcome and reward in bounded time, and the test
process survives; the APPS (stdin/stdout, call-based) and HumanEval formats on good and bad code."""
import collections
import os
import time

import pytest

import sandbox
from sandbox_runs import leftover_processes

ADD = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [0, 0]], "outputs": [[3], [7], [0]]}
SUM_IO = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
CHECK = {"entry_point": "inc", "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n"}
QUICK = sandbox.Limits(timeout=2.0, cpu_seconds=2)
# Outcomes must not depend on the machine's speed or load: programs that should end by themselves (an
# error, a limit) get a wall clock far beyond what they need, and only the timeout cases a short one.
# The growing list reaches its 256 MiB address space limit long before 30 s on any machine.
PATIENT = sandbox.Limits(timeout=30.0, cpu_seconds=20, memory_mb=256)


def run(program, tests=SUM_IO, limits=QUICK):
    t0 = time.time()
    result = sandbox.run(program, tests, limits)
    assert time.time() - t0 < limits.timeout + 30                      # bounded, whatever the program does
    return result


@pytest.mark.parametrize("program, tests, outcome, counts, reward", [
    ("a, b = map(int, input().split())\nprint(a + b)\n", SUM_IO, "passed", (2, 0), 1.0),
    ("a, b = map(int, input().split())\nprint(a * b if a == 5 else a + b)\n", SUM_IO, "failed", (1, 1), 0.35),
    ("import sys\ndata = sys.stdin.read().split()\nprint(int(data[0]) + int(data[1]))\n", SUM_IO, "passed", (2, 0), 1.0),
    ("def main():\n    a, b = map(int, input().split())\n    print(a + b)\nif __name__ == '__main__':\n    main()\n",
     SUM_IO, "passed", (2, 0), 1.0),
    ("def add(a, b):\n    return a + b\n", ADD, "passed", (3, 0), 1.0),
    ("def add(a, b):\n    return a - b if a else b\n", ADD, "failed", (1, 2), -0.3 + 1.3 / 3),
    ("class Solution:\n    def add(self, a, b):\n        return a + b\n", ADD, "passed", (3, 0), 1.0),
    ("def add(a, b):\n    return (a + b,)\n", ADD, "passed", (3, 0), 1.0),             # tuple vs list output
    ("def inc(x):\n    return x + 1\n", CHECK, "passed", (1, 0), 1.0),
    ("def inc(x):\n    return x + 2\n", CHECK, "failed", (0, 1), -0.3),
])
def test_apps_and_humaneval_formats(program, tests, outcome, counts, reward):
    r = run(program, tests)
    assert (r.outcome, (r.passed, r.failed)) == (outcome, counts), r.detail
    assert r.reward == pytest.approx(reward)


@pytest.mark.parametrize("name, program, outcome, detail", [
    ("syntax error", "def add(a, b)\n    return a + b\n", "compile_error", "SyntaxError"),
    ("infinite loop", "while True:\n    pass\n", "timeout", "killed"),
    ("sleeping forever", "import time\ntime.sleep(100)\n", "timeout", "killed"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()\n", "runtime_error", "no attribute 'fork'"),
    ("subprocess", "import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])\n", "runtime_error", ""),
    ("memory bomb", "x = bytearray(8 * 1024 ** 3)\n", "runtime_error", "MemoryError"),
    ("growing list", "x = []\nwhile True:\n    x.append('a' * 10 ** 6)\n", "runtime_error", "MemoryError"),
    ("output flood", "while True:\n    print('x' * 10000)\n", "runtime_error", "output limit"),
    ("stderr flood", "import sys\nwhile True:\n    sys.stderr.write('x' * 100000)\n", "timeout", "killed"),
    ("kill the parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", "runtime_error", ""),
    ("kill the group", "import os, signal\nos.killpg(0, signal.SIGKILL)\n", "runtime_error", ""),
    ("sys.exit in a test", "import sys\ndef inc(x):\n    sys.exit(0)\n", "runtime_error", "SystemExit"),
    ("os._exit with a failure status", "import os\nos._exit(1)\n", "runtime_error", "ProgramExit"),
    ("a flood on fd 1", "import os\nwhile True:\n    os.write(1, b'x' * 100000)\n", "runtime_error", "output limit"),
    ("recursion bomb", "def f(n):\n    return f(n + 1)\nf(0)\n", "runtime_error", "RecursionError"),
    ("deep recursion bomb", "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1)\nf(0)\n",
     "runtime_error", "RecursionError"),
    ("ctypes", "import ctypes\nctypes.CDLL(None).fork()\n", "runtime_error", "import of ctypes halted"),
])
def test_hostile_programs_get_the_right_outcome_and_the_test_process_survives(name, program, outcome, detail):
    tests = CHECK if "sys.exit" in name else SUM_IO
    r = run(program, tests, QUICK if outcome == "timeout" else PATIENT)
    assert r.outcome == outcome, (name, r)
    assert detail in r.detail
    assert r.reward == {"compile_error": -1.0, "timeout": -0.6, "runtime_error": -0.6}[outcome]


def test_one_report_costs_the_trusted_side_little_and_honest_megabyte_answers_pass():
    """A call-based answer of `[[0]] * 10**6` (4 MB of JSON, two million values) is refused by its count of
    values before anything is built from it; the cost is measured as the peak memory this process allocates
    while running and deciding (tracemalloc), not as a time. Answers of about a megabyte still pass."""
    import tracemalloc
    call = {"fn_name": "f", "inputs": [[10 ** 6]], "outputs": [[[0]]]}
    tracemalloc.start()
    try:
        r = run("def f(n):\n    return [[0]] * n\n", call, sandbox.Limits(timeout=30.0, cpu_seconds=20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "values" in r.detail and peak < 48 << 20, (r, f"{peak >> 20} MiB")
    for body, n, expected in [("list(range(n))", 150000, list(range(150000))), ("[0] * n", 500000, [0] * 500000),
                              ("'x' * n", 10 ** 6, "x" * 10 ** 6), ("[(i, str(i)) for i in range(n)]", 50000,
                                                                   [[i, str(i)] for i in range(50000)])]:
        r = run(f"def f(n):\n    return {body}\n", {"fn_name": "f", "inputs": [[n]], "outputs": [expected]}, PATIENT)
        assert r.outcome == "passed", (body, r)
    r = run("print(',' * 900000)\n", {"inputs": [""], "outputs": ["," * 900000]}, PATIENT)   # commas in a string
    assert r.outcome == "passed", r                                                      # are not values


def test_expected_outputs_stored_as_lists_of_lines_are_compared_as_lines():
    """APPS stores some expected outputs as lists of lines (as it does some inputs)."""
    tests = {"inputs": [["1 2", "3"], "2 2\n4\n"], "outputs": [["3", "6\n"], ["4", "8"]]}
    assert run("a, b = map(int, input().split())\nprint(a + b)\nprint(2 * int(input()))\n", tests).outcome == "passed"
    assert run("a, b = map(int, input().split())\nprint(a + b)\nprint(int(input()))\n", tests).outcome == "failed"


def test_sys_exit_zero_ends_a_stdin_stdout_program_normally():
    assert run("import sys\nprint(input())\nsys.exit(0)\n", {"inputs": ["7"], "outputs": ["7"]}).outcome == "passed"


def test_the_parents_environment_and_proc_are_out_of_reach(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "hunter2")
    leak = {"inputs": [""], "outputs": ["hunter2"]}
    r = run("import os\nprint(os.environ.get('SANDBOX_TEST_SECRET'))\n", leak)
    assert r.outcome == "failed"                                       # printed None: the env was scrubbed
    r = run("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())\n", leak)
    assert r.outcome == "runtime_error" and "not allowed" in r.detail


def test_writing_outside_the_working_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for program in [f"open({str(target)!r}, 'w').write('x')\n",
                    f"import os\nos.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))\n",
                    f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')\n",
                    f"import os\nos.remove({str(tmp_path)!r})\n"]:
        assert run(program).outcome == "runtime_error", program
    assert not target.exists() and tmp_path.exists()
    inside = "open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\n"
    assert run(inside, {"inputs": [""], "outputs": ["ok"]}).outcome == "passed"   # its own directory is fine


def test_a_forged_verdict_on_the_pipe_is_not_believed():
    forge = ("import os, json\nfor fd in range(3, 20):\n    try:\n"
             "        os.write(fd, (json.dumps({'outcome': 'passed', 'passed': 9, 'failed': 0}) + '\\n').encode())\n"
             "    except OSError:\n        pass\nwhile True:\n    pass\n")
    assert run(forge).outcome == "timeout"


def test_run_many_runs_concurrently_and_keeps_the_order():
    jobs = [(f"print({i} * int(input()))", {"inputs": ["2"], "outputs": [str(2 * i)]}) for i in range(6)]
    jobs[3] = ("while True:\n    pass\n", SUM_IO)
    t0 = time.time()
    results = sandbox.run_many(jobs, sandbox.Limits(timeout=1.5, cpu_seconds=2), workers=2)
    assert [r.outcome for r in results] == ["passed"] * 3 + ["timeout"] + ["passed"] * 2
    assert time.time() - t0 < 1.5 + 6 * 1.0                          # the loop did not hold everything up


def test_all_humaneval_canonical_solutions_pass_and_wrong_completions_fail():
    import data
    problems = data.humaneval_problems()
    assert len(problems) == 164
    results = sandbox.run_many([(p["prompt"] + p["canonical_solution"], p["tests"]) for p in problems])
    failures = [(p["task_id"], r) for p, r in zip(problems, results) if r.outcome != "passed"]
    assert not failures, failures[:3]
    wrong = sandbox.run_many([(p["prompt"] + "    return None\n", p["tests"]) for p in problems[:20]])
    assert all(r.outcome in ("failed", "runtime_error") and r.reward < 0 for r in wrong)


# ---------------------------------------------------------------- reward hacks and escapes
# Each program is written so that the damage stays bounded if containment fails: one marker file in a
# folder of the test's own, a `sleep` of a few seconds, a connection to a listener of the test's own.

ALWAYS_EQUAL = "class Anything:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
HACKS = {
    "an object equal to anything (call-based)": (ALWAYS_EQUAL + "def add(a, b):\n    return Anything()\n", ADD),
    "an object equal to anything (HumanEval check)": (ALWAYS_EQUAL + "def inc(x):\n    return Anything()\n", CHECK),
    # crosses as the int it holds (-1, never right), whatever its __eq__, __int__ and __repr__ say
    "an int subclass equal to anything": ("class I(int):\n    __eq__ = lambda s, o: True\n"
                                          "    __int__ = __index__ = lambda s: 3\n    __repr__ = lambda s: '3'\n"
                                          "def add(a, b):\n    return I(-1)\n", ADD),
    "a dict subclass whose items lie": ("class D(dict):\n    items = lambda s: [(3, 3)]\n    __eq__ = lambda s, o: True\n"
                                        "def add(a, b):\n    return D()\n", ADD),
    "the harness's comparison replaced through __main__": (
        "import sys\nfor m in list(sys.modules.values()):\n    for name in ('_same_value', '_same_output'):\n"
        "        if hasattr(m, name):\n            setattr(m, name, lambda *a: True)\n"
        "def add(a, b):\n    return -1\n", ADD),
    "the harness's report called from the stack, its pipe closed": (
        "import sys\ndef add(a, b):\n    f = sys._getframe()\n    while f is not None:\n"
        "        if 'report' in f.f_locals and callable(f.f_locals['report']):\n"
        "            f.f_locals['report']('passed', 3, 0)\n"
        "            for v in f.f_locals.values():\n"
        "                if hasattr(v, 'close') and hasattr(v, 'write'):\n                    v.close()\n"
        "        f = f.f_back\n    return -1\n", ADD),
    "the check's assertions disabled": ("import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
                                        "def inc(x):\n    return 0\n", CHECK),
    "a SystemExit from inside a test": ("import sys\ndef add(a, b):\n    raise SystemExit(0)\n", ADD),
}


@pytest.mark.parametrize("name", list(HACKS))
def test_reward_hacks_never_pass(name):
    program, tests = HACKS[name]
    r = run(program, tests, PATIENT)
    assert r.outcome != "passed" and r.passed == 0 and r.reward < 0, (name, r)


def test_a_write_through_low_level_modules_stays_inside(tmp_path):
    os.chmod(tmp_path, 0o777)                              # writable by anyone: only the sandbox can stop it
    marker = tmp_path / "escaped"
    for opener in ("import _io\n_io.open({p!r}, 'w').write('x')\n", "import _io\n_io.FileIO({p!r}, 'w').write(b'x')\n",
                   "import posix\nposix.close(posix.open({p!r}, posix.O_CREAT | posix.O_WRONLY))\n"):
        run(opener.format(p=str(marker)), SUM_IO, PATIENT)
        assert not marker.exists(), opener
    r = run("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\n",
            {"inputs": [""], "outputs": ["ok"]}, PATIENT)
    assert r.outcome == "passed", r                        # its own working directory stays writable


def test_no_process_outlives_the_run_even_after_restoring_fork():
    """The program re-imports `posix` (restoring the fork the guard removed), leaves the process group
    and runs `sleep 7.31` (a token to find it by); after run() nothing of it may be left."""
    token = "7.31"
    program = ("import sys\ndel sys.modules['posix']\nimport posix\n"
               "if posix.fork() == 0:\n    posix.setsid()\n"
               f"    posix.execv('/bin/sleep', ['sleep', {token!r}])\n")
    run(program, SUM_IO, PATIENT)
    time.sleep(0.3)
    assert not [pid for pid in sleepers(token)], "a process of the program outlived the run"


def sleepers(token):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:2] == [b"sleep", token.encode()]:
                found.append(pid)
        except OSError:
            pass
    return found


def test_no_network_not_even_to_localhost():
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'x')\n"
    run(program, SUM_IO, PATIENT)
    with pytest.raises(socket.timeout):
        listener.accept()                                  # nobody connected
    listener.close()


def test_plain_values_round_trip_and_anything_else_is_refused():
    value = [None, True, 3, -2.5, float("inf"), "x\ny", (1, [2, (3,)]), {"k": [1], 2: (None,)}]
    assert sandbox.decode(sandbox.parse_line(sandbox._line(sandbox.encode(value)))) == value
    assert type(sandbox.decode(sandbox.encode((1, 2)))) is tuple
    for bad in [object(), {1, 2}, b"x", [1, {2}], {"k": object()}]:
        with pytest.raises(sandbox.NotPlain):
            sandbox.encode(bad)
    for bad in [{"tuple": 3}, {"object": []}, {"a": 1, "b": 2}, (1, 2), {3}]:
        with pytest.raises(sandbox.NotPlain):
            sandbox.decode(bad)
    assert sandbox.parse_line("__import__('os').system('true')") is None    # literals only


def test_subclasses_of_plain_types_cross_as_the_values_they_hold():
    """Counter, defaultdict, OrderedDict, a named tuple, an IntEnum, a str subclass, a UserDict: plain Python (and
    APPS's harness) compares them equal to the expected dict, tuple, int or str, so the honest "count the characters"
    kata passes.
    What crosses is the value read through the base type's own methods, never the subclass's: a lying `items` or
    `__str__` changes nothing."""
    program = ("import collections, enum\nclass Level(enum.IntEnum):\n    HIGH = 2\nclass Name(str):\n"
               "    __str__ = lambda s: 'lie'\nPoint = collections.namedtuple('Point', 'x y')\n"
               "def f(kind, s):\n    return {'counter': collections.Counter, 'ordered': collections.OrderedDict.fromkeys,\n"
               "            'default': lambda s: collections.defaultdict(list, {c: [1] for c in s}),\n"
               "            'named': lambda s: Point(s, len(s)), 'enum': lambda s: Level.HIGH, 'str': Name,\n"
               "            'user': lambda s: collections.UserDict({s: collections.UserList([1])})}[kind](s)\n")
    tests = {"fn_name": "f", "inputs": [["counter", "abca"], ["ordered", "ba"], ["default", "a"], ["named", "ab"],
                                       ["enum", ""], ["str", "xy"], ["user", "k"]],
             "outputs": [{"a": 2, "b": 1, "c": 1}, {"b": None, "a": None}, {"a": [1]}, ["ab", 2], 2, "xy", {"k": [1]}]}
    r = run(program, tests, PATIENT)
    assert (r.outcome, r.passed) == ("passed", 7), r
    wrong = dict(tests, outputs=[{"a": 1, "b": 1, "c": 1}, {"b": 1}, {"a": []}, ["ab", 3], 3, "lie", {"k": [2]}])
    r = run(program, wrong, PATIENT)
    assert (r.outcome, r.passed, r.failed) == ("failed", 0, 7), r
    assert sandbox.encode(collections.Counter("aab")) == {"dict": [["a", 2], ["b", 1]]}
    check = {"entry_point": "count", "test": "def check(candidate):\n    assert candidate('aab') == {'a': 2, 'b': 1}\n"}
    r = run("import collections\ndef count(s):\n    return collections.Counter(s)\n", check, PATIENT)
    assert r.outcome == "passed", r                                     # HumanEval's check sees the dict too


def test_ints_past_the_decimal_digit_limit_are_plain_values():
    """A call-based answer past CPython's 4300-digit limit on int <-> str (a factorial without its modulus) made the
    child's report crash: every test of the run lost, a runtime error. It is a value like any other: the right one
    passes, a wrong one fails that test alone. It travels in hex (linear, not limited), and so costs the trusted side
    a linear parse."""
    big = {"fn_name": "f", "inputs": [[6000], [2], [3]], "outputs": [[7 ** 6000], [49], [343]]}
    r = run("def f(n):\n    return 7 ** n\n", big, PATIENT)
    assert (r.outcome, r.passed, r.failed) == ("passed", 3, 0), r
    r = run("import math\ndef f(n):\n    return math.factorial(n) if n > 5 else 7 ** n\n", big, PATIENT)
    assert (r.outcome, r.passed, r.failed) == ("failed", 2, 1), r
    assert sandbox.decode(sandbox.parse_line(sandbox._line(sandbox.encode([-(7 ** 6000), (3 ** 9000,)])))) == [
        -(7 ** 6000), (3 ** 9000,)]


def test_a_sandbox_that_cannot_start_its_program_gives_a_failed_verdict_and_leaves_nothing(monkeypatch, capsys):
    """The trusted side's own failures (here: fork fails, as when the host is out of processes) end in a
    failed verdict and a warning, never an exception in the trainer; the run's cgroup and folder are
    removed (the fixture below checks). The failure is injected: a host cannot be made to run out here."""
    import subprocess

    def out_of_processes(*args, **kwargs):
        raise BlockingIOError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(subprocess, "Popen", out_of_processes)
    for tests in ({"inputs": ["1"], "outputs": ["2"]}, {"entry_point": "f", "test": "def check(f): pass"}):
        result = sandbox.run("print(2)", tests)
        assert result.outcome == "runtime_error" and "sandbox failure" in result.detail, result
    assert "[sandbox] warning: the sandbox failed" in capsys.readouterr().err


@pytest.fixture(scope="module", autouse=True)
def nothing_is_left_behind():
    """After every test of this file: no temporary folder of the sandbox, no process of a program, no cgroup of
    a run. Only this process's folders and cgroups count, and the sandbox processes it answers for
    (tests/spec/sandbox_runs.py: not those of another live trainer, a second pytest worker or a study)."""
    import glob
    import tempfile
    pattern = os.path.join(tempfile.gettempdir(), f"sandbox_{os.getpid()}_*")
    before = set(glob.glob(pattern))
    yield
    time.sleep(0.5)
    assert set(glob.glob(pattern)) <= before, "the sandbox left temporary folders behind"
    mine = leftover_processes()
    assert not mine, f"processes of the sandbox left running: {mine}"
    assert not glob.glob(f"/sys/fs/cgroup/*/{sandbox.CGROUP_PARENT}/{os.getpid()}_*") + glob.glob(
        f"/sys/fs/cgroup/{sandbox.CGROUP_PARENT}/{os.getpid()}_*"), "a cgroup of a run was left behind"
