"""bench/real_ppo.py --tiny runs end to end: the random models built, each side in a process of its own, a table per
update configuration; bench/scoring_forwards.py on the tiny models. They check that the benches work and say what
they measured, never how fast anything is. TRL's side needs a venv of its own that CI does not have: it is
exercised by the bench's sittings (bench/records/tiny_trl)."""
import json
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


@pytest.mark.parametrize("lora_r", [4, 0])
def test_scoring_forwards_bench_times_each_model_apart_and_records_what_it_ran(tiny_models, tmp_path, capsys, lora_r):
    """bench/scoring_forwards.py on the tiny models, in this process: a row per forward and backward (the critic's
    too; under full fine-tuning beside a frozen reference), the policy's operators, and a record that names the
    models it measured and prints the same table back (--show)."""
    from accelerate.state import AcceleratorState
    sys.path.insert(0, str(ROOT / "bench"))
    import real_ppo
    import scoring_forwards
    AcceleratorState._reset_state()
    record = tmp_path / "record.json"
    scoring_forwards.main(["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"),
                           "--chat_template", "false", "--lora_r", str(lora_r), "--prompts", "4", "--prompt_len", "16",
                           "--new_tokens", "6", "--repeats", "2", "--record", str(record)])
    printed = capsys.readouterr().out
    saved = json.loads(record.read_text())
    assert list(saved["seconds"]) == [
        "reference logprobs (no graph)", "score: the RM's forward (no graph)", "policy logprobs and entropy (no graph)",
        "policy forward with its graph", "policy backward", "critic forward with its graph", "critic backward"]
    assert all(s >= 0 for s in saved["seconds"].values())        # rounded to ms: the tiny model's can read 0
    assert saved["sizes"]["lora_r"] == lora_r and saved["sizes"]["tokens"][0] == 4
    assert 0 < saved["sizes"]["response_tokens"] <= 4 * 6
    assert "aten::mm" in [name for name, _, _ in saved["policy_ops"]]
    assert saved["weights_sha256"] == {k: real_ppo.weights_hash(str(tiny_models / k)) for k in ("sft", "rm")}
    assert saved["command"].startswith("python bench/scoring_forwards.py") and len(saved["commit"]) == 40
    scoring_forwards.main(["--show", str(record)])
    assert capsys.readouterr().out.strip() in printed
