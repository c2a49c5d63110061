"""The launch tests of test_evaluate.py (tests/spec): evaluate.py run in subprocesses or as whole stages."""
import json
import os
import subprocess
import sys

import pytest

import evaluate
from test_evaluate import ROOT, main, server  # noqa: F401, F811 (fixtures: server)


def cli(*args, code=0):
    proc = subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout + proc.stderr


@pytest.mark.launch
def test_no_usable_judge_answers_is_a_clear_error_and_valid_json(tiny_models, tmp_path, server, capsys):
    server.behaviour = "ramble"
    common = ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--n_prompts", "6",
              "--max_prompt_len", "16", "--max_response_len", "6", "--output_dir", str(tmp_path),
              "--judge_url", server.url]
    out = cli("winrate", "--policy", "sft", "--judge", "llm", *common, code=1)
    assert "usable verdict for 0 of 6 items" in out and "both responses have merits" in out    # raw replies shown
    result = json.loads(open(tmp_path / "winrate.json").read(), parse_constant=lambda c: pytest.fail(c))
    assert result["win_rate"] is None and "usable verdict" in result["error"]
    out = main(capsys, "agreement", "--policy", "sft", "--judges", "llm,gold", *common, code=1)
    assert "usable verdict for 0 of 6" in out
    json.loads(open(tmp_path / "agreement.json").read(), parse_constant=lambda c: pytest.fail(c))
    server.behaviour = "logprobs"                                  # the same run, answered in logprob mode
    main(capsys, "agreement", "--policy", "sft", "--judges", "llm,gold", "--judge_mode", "logprobs", *common)
    matrix = json.load(open(tmp_path / "agreement.json"))["matrix"]
    assert matrix["llm"]["llm"] == 1.0 and 0.0 <= matrix["llm"]["gold"] <= 1.0


@pytest.mark.launch
def test_every_command_runs_from_the_command_line(tiny_models, tmp_path, server, capsys):
    common = ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--n_prompts", "8",
              "--max_prompt_len", "16", "--max_response_len", "6", "--output_dir", str(tmp_path)]
    main(capsys, "score", "--policies", "sft", str(tiny_models / "sft"), *common)
    score = json.load(open(tmp_path / "score.json"))
    assert score["sft"]["n"] == 8 and score["sft"] == score[str(tiny_models / "sft")]   # same seed, same model
    assert os.path.getsize(tmp_path / "score.png") > 0
    main(capsys, "winrate", "--policy", "sft", "--baseline", "chosen", "--judge", "gold", *common)
    assert json.load(open(tmp_path / "winrate.json"))["n"] == 8
    main(capsys, "winrate", "--policy", "sft", "--judge", "llm", "--judge_url", server.url, *common)
    assert len(server.requests) == 8
    main(capsys, "agreement", "--policy", "sft", "--baseline", "chosen", "--judges", "rm,gold", *common)
    m = json.load(open(tmp_path / "agreement.json"))["matrix"]
    assert m["rm"]["rm"] == 1.0 and 0.0 <= m["rm"]["gold"] <= 1.0
    main(capsys, "best_of_n", "--policy", "sft", "--ns", "1,2,4", "--temperatures", "0.5,1.0", *common)
    bon = json.load(open(tmp_path / "best_of_n.json"))
    for t in ("0.5", "1.0"):
        assert bon[t]["1"] <= bon[t]["2"] <= bon[t]["4"]
    rows = tmp_path / "results.jsonl"
    rows.write_text('{"policy": "sft", "difficulty": "intro", "n": 5, "correct": 2}\n')
    assert "40.0%" in main(capsys, "passk", "--results", str(rows), "--ks", "1", "--output_dir", str(tmp_path))


@pytest.mark.launch
def test_passk_samples_code_policies_through_the_sandbox(tiny_models, tmp_path, capsys):
    out = main(capsys, "passk", "--task", "code", "--sft_path", str(tiny_models / "sft"), "--policies", "sft",
               "--samples", "3", "--ks", "1,3", "--n_prompts", "6", "--max_response_len", "6",
               "--output_dir", str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "passk_results.jsonl")]
    assert len(rows) == 6 and all(r["n"] == 3 and 0 <= r["correct"] <= 3 for r in rows)
    table = json.load(open(tmp_path / "passk.json"))
    expected = sum(evaluate.pass_at_k(3, r["correct"], 1) for r in rows) / 6
    assert table["sft"]["all"]["pass@1"] == pytest.approx(expected) and "pass@3" in out
    with pytest.raises(SystemExit, match="smaller than the largest k"):
        evaluate.main(["passk", "--task", "code", "--sft_path", str(tiny_models / "sft"), "--samples", "2", "--ks", "1,5"])


@pytest.mark.launch
def test_win_rates_carry_the_diversity_of_policy_baseline_and_sft_model(tiny_models, parrot, tmp_path, capsys):
    common = ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--n_prompts", "16",
              "--max_prompt_len", "16", "--max_response_len", "12", "--output_dir", str(tmp_path)]
    out = main(capsys, "winrate", "--policy", str(parrot), "--baseline", "sft", "--judge", "gold", *common)
    result = json.load(open(tmp_path / "winrate.json"))
    replies = result["replies"]
    assert replies["sft"] == replies["baseline"] and result["win_rate"] > 0.9 and result["degenerate"]
    assert replies["policy"]["distinct_2"] < 0.5 * replies["sft"]["distinct_2"] and replies["policy"]["repetition"] > 0.5
    assert replies["policy"]["gold_strict"] < 0 < replies["policy"]["distinct_2"]
    assert "the policy's replies are degenerate" in out and "mostly one repeated word" in out
    main(capsys, "winrate", "--policy", "sft", "--baseline", "chosen", "--judge", "gold", *common)
    result = json.load(open(tmp_path / "winrate.json"))
    assert set(result["replies"]) == {"policy", "baseline", "sft"} and not result["degenerate"]
    assert result["replies"]["baseline"]["distinct_2"] > 0.5          # people's replies
