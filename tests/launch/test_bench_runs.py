"""bench/real_ppo.py --tiny runs end to end: the random models built, each side in a process of its own, a table per
update configuration. It checks that the bench works and says what it measured, never how fast anything is. TRL's
side needs a venv of its own that CI does not have: it is exercised by the bench's sittings (bench/records/tiny_trl)."""
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.launch
ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def tiny_bench(*flags):
    proc = subprocess.run([sys.executable, "bench/real_ppo.py", "--tiny", "--steps", "2", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def rows(out):
    """{arm: (iteration wall s, peak RSS MB)} of the table(s) printed (the tokens generated between them)."""
    row = r"^\| (ours \w+|trl) \|.*\*\*([\d.]+) \([\d.]+\)\*\* \| \d+ \| (\d+) \|$"
    return {arm: (float(s), int(mb)) for arm, s, mb in re.findall(row, out, re.M)}


def test_tiny_bench_without_trl_skips_its_side_and_measures_ours_arms():
    """CI has no TRL venv: its side is skipped with a line saying so, ours' arms (gae, group) are measured."""
    out = tiny_bench("--configs", "2x2", "--arms", "gae,group", "--trl_python", "/nonexistent/python")
    assert "TRL's side skipped" in out and "3.1M parameters" in out and "2 epoch(s) x 2 minibatch(es) of 8" in out
    measured = rows(out)
    assert set(measured) == {"ours gae", "ours group"}
    assert all(s > 0 and mb > 100 for s, mb in measured.values())
    assert re.search(r"^- group / gae: [\d.]+x the s/iteration", out, re.M) and "ours / TRL" not in out


def test_tiny_bench_refuses_a_configuration_that_does_not_divide_the_batch():
    proc = subprocess.run([sys.executable, "bench/real_ppo.py", "--tiny", "--configs", "2x3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--configs 2x3" in proc.stderr
