"""The launch tests of test_sandbox.py (tests/spec): sandbox.py run in subprocesses or as whole stages."""
import os

import pytest

import sandbox
from test_sandbox import nothing_is_left_behind  # noqa: F401, F811 (fixtures: nothing_is_left_behind)


@pytest.mark.launch
def test_the_trainers_environment_is_out_of_reach_even_through_proc():
    """A trainer started with a secret in its environment (/proc/PID/environ shows the environment a
    process was started with) runs a program that reads every environ in /proc it can."""
    import subprocess
    import sys
    steal = ("import _io, os\nfound = ''\nfor pid in os.listdir('/proc'):\n    try:\n"
             "        found += _io.open(f'/proc/{pid}/environ', 'rb').read().decode(errors='ignore')\n"
             "    except Exception:\n        pass\nprint('hunter2' if 'hunter2' in found else 'no')\n")
    trainer = ("import sandbox, sys\nr = sandbox.run(sys.argv[1], {'inputs': [''], 'outputs': ['hunter2']},"
               " sandbox.Limits(timeout=30, cpu_seconds=20))\nprint(r.outcome)\n")
    proc = subprocess.run([sys.executable, "-c", trainer, steal], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          env={**os.environ, "SANDBOX_TEST_SECRET": "hunter2"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] != "passed"


@pytest.mark.launch
def test_check_prints_the_layers_that_hold():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "sandbox.py", "--check"], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0 and "in-process guard" in proc.stdout and "probe" in proc.stdout, proc.stderr
    if sandbox.isolation()[0]:                             # where namespaces hold, the probe found no network
        assert "network namespace" in proc.stdout and "probe (a program trying 127.0.0.1): passed" in proc.stdout


@pytest.mark.launch
def test_without_namespaces_the_first_run_warns_once_and_still_runs():
    """No unshare on PATH (as on macOS or in an unprivileged container): a warning naming the active layers."""
    import subprocess
    import sys
    code = ("import sandbox\nfor _ in range(2):\n    print(sandbox.run('print(int(input()) + 1)', "
            "{'inputs': ['1'], 'outputs': ['2']}).outcome)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/nonexistent"}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.stdout.split() == ["passed", "passed"], proc.stderr
    assert proc.stderr.count("[sandbox] warning: no namespaces") == 1 and "rlimits" in proc.stderr
