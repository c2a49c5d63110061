"""sandbox.py: hostile programs get the right outcome and reward in bounded time, and the test
process survives; the APPS (stdin/stdout, call-based) and HumanEval formats on good and bad code."""
import time

import pytest

import sandbox

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
    ("stderr flood", "import sys\nwhile True:\n    sys.stderr.write('x' * 100000)\n", "runtime_error", ""),
    ("kill the parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", "runtime_error", ""),
    ("kill the group", "import os, signal\nos.killpg(0, signal.SIGKILL)\n", "runtime_error", ""),
    ("sys.exit in a test", "import sys\ndef inc(x):\n    sys.exit(0)\n", "runtime_error", "SystemExit"),
    ("os._exit", "import os\nos._exit(0)\n", "runtime_error", ""),
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
