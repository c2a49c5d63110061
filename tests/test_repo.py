"""The repository keeps its promises: CI runs the README's test command, torch stays pinned."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Run the tests.*?```bash\n(.*?)```", readme, re.S).group(1)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in block.strip().splitlines():
        for part in command.split("&&"):
            assert part.strip() in ci_lines, f"README test step {part.strip()!r} is not in .ci/run"


def test_torch_is_pinned_to_the_cpu_wheel():
    reqs = (ROOT / "requirements.txt").read_text().splitlines()
    assert "torch==2.13.0" in reqs
    assert all(re.match(r"^[A-Za-z0-9_.\-]+==[\w.]+$", r) for r in reqs if r and not r.startswith("#"))
