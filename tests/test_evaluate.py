"""evaluate.py and bench/learning_efficiency.py: the arithmetic by hand, the LLM judge against a real
HTTP server on 127.0.0.1, and each command from the command line on tiny models."""
import argparse
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import learning_efficiency as study  # noqa: E402


def test_win_rate_counts_ties_half_and_leaves_unanswered_items_out():
    r = evaluate.win_rate(["A", "A", "B", "E", None, "A"])
    assert (r["wins"], r["losses"], r["ties"], r["n"], r["unanswered"]) == (3, 1, 1, 5, 1)
    assert r["win_rate"] == pytest.approx(3.5 / 5)
    assert evaluate.compare([1.0, 0.5, 2.0], [0.5, 0.5, 3.0]) == ["A", "E", "B"]


def test_agreement_matrix_by_hand():
    m = evaluate.agreement_matrix({"x": ["A", "B", "E", "A"], "y": ["A", "A", "E", None]})
    assert m["x"]["x"] == 1.0 and m["x"]["y"] == pytest.approx(2 / 3) and m["y"]["x"] == m["x"]["y"]


def test_pass_at_k_against_hand_computed_values():
    assert evaluate.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert evaluate.pass_at_k(5, 0, 3) == 0.0
    assert evaluate.pass_at_k(5, 4, 2) == 1.0                        # every pair holds a correct one
    assert evaluate.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert evaluate.pass_at_k(200, 13, 1) == pytest.approx(13 / 200)
    with pytest.raises(ValueError, match="at least 5 samples"):
        evaluate.pass_at_k(3, 1, 5)


def test_passk_table_groups_by_difficulty_and_overall():
    rows = [{"policy": "p", "difficulty": "intro", "n": 5, "correct": 2},
            {"policy": "p", "difficulty": "interview", "n": 5, "correct": 0}]
    t = evaluate.passk_table(rows, [1])
    assert t["p"]["intro"]["pass@1"] == pytest.approx(0.4) and t["p"]["interview"]["pass@1"] == 0.0
    assert t["p"]["all"]["pass@1"] == pytest.approx(0.2)


def test_best_of_n_takes_the_max_of_the_first_n_samples():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.2], [0.5, 0.4, 0.8, 0.0]])
    assert evaluate.best_of_n_scores(scores, [1, 2, 4]) == pytest.approx({1: 0.3, 2: 0.7, 4: 0.85})


def test_curves_aggregate_over_seeds_on_common_steps():
    runs = [[{"step": 1, "m": 1.0}, {"step": 2}, {"step": 2, "m": 3.0}, {"step": 4, "m": 9.0}],
            [{"step": 2, "m": 5.0}, {"step": 1, "m": 3.0}]]
    steps, mean, std = evaluate.aggregate(runs, "m")
    assert steps == [1, 2] and mean.tolist() == [2.0, 4.0]
    assert std.tolist() == pytest.approx([2 ** 0.5, 2 ** 0.5])


@pytest.mark.parametrize("reply, verdict", [
    ("Comparison: A is shorter.\nPreferred: A", "A"),
    ("Comparison: summary A misses the point.\n**Preferred:** \"B\"", "B"),
    ("I think they are equal.\nPreferred: E", "E"),
    ('Sure! ```json\n{"reason": "B is kinder", "choice": "B"}\n```', "B"),
    ('{"reason": "both fine", "choice": "e"}', "E"),
    ("{not json} then Preferred: A", "A"),
    ("  b. ", "B"),
    ("I cannot decide.", None),
    ("", None),
    (None, None),
])
def test_judge_answers_are_parsed_robustly(reply, verdict):
    assert evaluate.parse_verdict(reply) == verdict


class JudgeServer:
    """A real OpenAI-compatible endpoint on 127.0.0.1. It prefers the response shown first,
    fails with 500 on the first request for item text containing "flaky", and stalls on "slow"."""

    def __init__(self):
        self.requests, seen = [], set()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = body["messages"][0]["content"]
                outer.requests.append((self.headers.get("Authorization"), content))
                if "flaky" in content and content not in seen:
                    seen.add(content)
                    self.send_response(500)
                    self.end_headers()
                    return
                if "slow" in content:
                    time.sleep(1.0)
                reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Preferred: A"}}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                try:
                    self.wfile.write(reply.encode())
                except BrokenPipeError:
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server():
    s = JudgeServer()
    yield s
    s.httpd.shutdown()


def test_llm_judge_randomizes_order_and_maps_verdicts_back(server, tmp_path):
    judge = evaluate.LLMJudge(server.url, "m", "tldr", key="sekret", seed=7, backoff=0.01)
    n = 16
    verdicts = judge(["post"] * n, [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)])
    swapped = [judge.swapped(i) for i in range(n)]
    assert 0 < sum(swapped) < n                                     # both orders occur
    # the server always prefers the first response shown: A where A came first, B where it was swapped
    assert verdicts == ["B" if s else "A" for s in swapped]
    for i, (auth, content) in enumerate(server.requests):
        assert auth == "Bearer sekret"
        assert content.index(f"b{i}" if swapped[i] else f"a{i}") < content.index(f"a{i}" if swapped[i] else f"b{i}")
    assert [evaluate.LLMJudge(server.url, "m", "tldr", seed=7).swapped(i) for i in range(n)] == swapped


def test_llm_judge_retries_a_500_gives_up_on_a_timeout_and_resumes_from_its_cache(server, tmp_path):
    cache = str(tmp_path / "cache.jsonl")
    judge = evaluate.LLMJudge(server.url, "m", "hh", cache=cache, seed=0, timeout=0.3, retries=1, backoff=0.01)
    prompts, a, b = ["p1", "p2", "p3"], ["fine", "flaky", "slow"], ["x", "y", "z"]
    t0 = time.time()
    verdicts = judge(prompts, a, b)
    assert verdicts[0] in ("A", "B") and verdicts[1] in ("A", "B")   # the 500 was retried
    assert verdicts[2] is None                                       # timed out twice: no answer
    assert time.time() - t0 < 5
    assert sum("flaky" in c for _, c in server.requests) == 2
    before = len(server.requests)
    again = evaluate.LLMJudge(server.url, "m", "hh", cache=cache, seed=0, timeout=0.3, retries=0)(prompts, a, b)
    assert again[:2] == verdicts[:2]
    assert len(server.requests) == before + 1                        # only the unanswered item is asked again


def test_unknown_template_is_a_clear_error():
    with pytest.raises(ValueError, match="--judge_template must be one of"):
        evaluate.LLMJudge("http://127.0.0.1:1", "m", "poetry")


def test_steps_to_parity_by_hand():
    ppo = ([10, 20, 30, 40], [0.0, 0.5, 0.8, 1.0])
    fast = ([10, 20, 30, 40], [0.2, 1.0, 1.1, 1.2])
    assert study.steps_to_parity(ppo, fast, window=1) == (40, 20, 2.0)
    assert study.steps_to_parity(ppo, ([10, 20, 30, 40], [0.1] * 4), window=1) == (40, None, None)
    assert study.smoothed([0.0, 3.0, 6.0], 2) == [0.0, 1.5, 4.5]


def test_study_configurations_always_start_with_ppo():
    args = argparse.Namespace(ns="5,10", terminations="fixed,ppl", sigmas="equal",
                              reward_aggs="sum", ablation=True, beta=0.05)
    names = [c[0] for c in study.configs(args)]
    assert names[0] == "n1" and "n5_ppl_equal_sum" in names and "n10_fixed_equal_sum" in names
    assert names[-2:] == ["n10_mean", "n1_beta_div10"]
    assert study.configs(args)[-1][2] == ["--n", "1", "--beta", str(0.05 / 10)]


def cli(*args):
    proc = subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_every_command_runs_from_the_command_line(tiny_models, tmp_path, server):
    common = ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--n_prompts", "8",
              "--max_prompt_len", "16", "--max_response_len", "6", "--output_dir", str(tmp_path)]
    cli("score", "--policies", "sft", str(tiny_models / "sft"), *common)
    score = json.load(open(tmp_path / "score.json"))
    assert score["sft"]["n"] == 8 and score["sft"] == score[str(tiny_models / "sft")]   # same seed, same model
    assert os.path.getsize(tmp_path / "score.png") > 0
    cli("winrate", "--policy", "sft", "--baseline", "chosen", "--judge", "gold", *common)
    assert json.load(open(tmp_path / "winrate.json"))["n"] == 8
    cli("winrate", "--policy", "sft", "--judge", "llm", "--judge_url", server.url, *common)
    assert len(server.requests) == 8
    cli("agreement", "--policy", "sft", "--baseline", "chosen", "--judges", "rm,gold", *common)
    m = json.load(open(tmp_path / "agreement.json"))["matrix"]
    assert m["rm"]["rm"] == 1.0 and 0.0 <= m["rm"]["gold"] <= 1.0
    cli("best_of_n", "--policy", "sft", "--ns", "1,2,4", "--temperatures", "0.5,1.0", *common)
    bon = json.load(open(tmp_path / "best_of_n.json"))
    for t in ("0.5", "1.0"):
        assert bon[t]["1"] <= bon[t]["2"] <= bon[t]["4"]
    rows = tmp_path / "results.jsonl"
    rows.write_text('{"policy": "sft", "difficulty": "intro", "n": 5, "correct": 2}\n')
    assert "40.0%" in cli("passk", "--results", str(rows), "--ks", "1", "--output_dir", str(tmp_path))


def test_curves_command_and_a_clear_error_for_missing_runs(tmp_path):
    for seed, offset in [(1, 0.0), (2, 1.0)]:
        d = tmp_path / "runs" / f"seed{seed}"
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "eval/rm": s + offset, "adv/l2": 1.0}) + "\n" for s in (1, 2)))
    out = cli("curves", "--runs", f"ppo={tmp_path}/runs/seed*", "--metrics", "eval/rm,adv/l2", "--output_dir", str(tmp_path))
    assert "2.500 ± 0.707" in out and os.path.getsize(tmp_path / "curves.png") > 0
    proc = subprocess.run([sys.executable, "evaluate.py", "curves", "--runs", f"x={tmp_path}/nothing*"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no run folder with a metrics.jsonl" in proc.stderr


def test_passk_samples_code_policies_through_the_sandbox(tiny_models, tmp_path):
    out = cli("passk", "--task", "code", "--sft_path", str(tiny_models / "sft"), "--policies", "sft",
              "--samples", "3", "--ks", "1,3", "--n_prompts", "6", "--max_response_len", "6",
              "--output_dir", str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "passk_results.jsonl")]
    assert len(rows) == 6 and all(r["n"] == 3 and 0 <= r["correct"] <= 3 for r in rows)
    table = json.load(open(tmp_path / "passk.json"))
    expected = sum(evaluate.pass_at_k(3, r["correct"], 1) for r in rows) / 6
    assert table["sft"]["all"]["pass@1"] == pytest.approx(expected) and "pass@3" in out
    proc = subprocess.run([sys.executable, "evaluate.py", "passk", "--task", "code", "--sft_path", str(tiny_models / "sft"),
                           "--samples", "2", "--ks", "1,5"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "smaller than the largest k" in proc.stderr
