"""evaluate.py: the arithmetic by hand, the LLM judge against a real
HTTP server on 127.0.0.1, and each command from the command line on tiny models."""
import dataclasses
from stages import ppo_config
import http.server
import json
import math
import os
import re
import threading
import time

import pytest
import torch

import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    fails with 500 on the first request for item text containing "flaky", and stalls on "slow".
    `behaviour`: "first" (the above), "ramble" (replies without a verdict), "no_json_mode" (400 for
    a request with response_format, like servers without JSON mode), "logprobs" (top_logprobs put
    the most probability on the response shown *second*, while the text says "A": a verdict taken
    from the text would be wrong)."""

    def __init__(self):
        self.requests, self.bodies, seen = [], [], set()
        self.behaviour = "first"
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = body["messages"][0]["content"]
                outer.requests.append((self.headers.get("Authorization"), content))
                outer.bodies.append(body)
                if outer.behaviour == "no_json_mode" and "response_format" in body:
                    self.send_response(400)
                    self.end_headers()
                    self.wfile.write(b'{"error": "response_format is not supported"}')
                    return
                if "flaky" in content and content not in seen:
                    seen.add(content)
                    self.send_response(500)
                    self.end_headers()
                    return
                if "slow" in content:
                    time.sleep(1.0)
                choice = {"message": {"role": "assistant", "content": "Preferred: A"}}
                if outer.behaviour == "ramble":
                    choice["message"]["content"] = "Well, both responses have merits. " * 20
                if outer.behaviour == "logprobs":
                    choice = {"message": {"role": "assistant", "content": "A"}, "logprobs": {"content": [{
                        "token": "A", "logprob": -1.9, "top_logprobs": [
                            {"token": " B", "logprob": -0.4}, {"token": "b", "logprob": -3.0},
                            {"token": "A", "logprob": -1.9}, {"token": "The", "logprob": -2.2}]}]}}
                reply = json.dumps({"choices": [choice]})
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


def main(capsys, *args, code=0):
    """evaluate.main on a command line, in this process: the argv parsing and exit code of a run from the
    shell, without starting another interpreter (cli() runs one through `python evaluate.py`, with its exit
    code: test_no_usable_judge_answers_is_a_clear_error_and_valid_json)."""
    try:
        evaluate.main(list(args))
        rc = 0
    except SystemExit as exit:
        rc = exit.code
    captured = capsys.readouterr()
    assert rc == code, captured.out[-2000:] + captured.err[-2000:]
    return captured.out + captured.err


def test_json_mode_is_asked_for_and_dropped_when_the_server_refuses_it(server):
    server.behaviour = "no_json_mode"
    judge = evaluate.LLMJudge(server.url, "m", "hh", seed=0, backoff=0.01)
    assert judge(["p"] * 4, [f"a{i}" for i in range(4)], [f"b{i}" for i in range(4)]).count(None) == 0
    with_format = [b for b in server.bodies if "response_format" in b]
    assert len(with_format) == 1 and with_format[0]["response_format"] == {"type": "json_object"}   # asked once
    assert len(server.bodies) == 5 and all(b["max_tokens"] == evaluate.MAX_TOKENS for b in server.bodies)
    letter = evaluate.LLMJudge(server.url, "m", "tldr", seed=0)               # a letter template: no JSON mode
    letter(["p"], ["a"], ["b"])
    assert "response_format" not in server.bodies[-1]


def test_logprob_mode_takes_the_most_probable_letter_not_the_text(server):
    server.behaviour = "logprobs"
    judge = evaluate.LLMJudge(server.url, "m", "hh", seed=3, mode="logprobs")
    n = 8
    verdicts = judge(["p"] * n, [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)])
    # the server's probabilities favour the response shown second: B unswapped, A where swapped
    assert verdicts == ["A" if judge.swapped(i) else "B" for i in range(n)]
    body = server.bodies[0]
    assert body["logprobs"] is True and body["top_logprobs"] >= 5 and body["max_tokens"] == 1
    assert "Answer with one letter only" in body["messages"][0]["content"]
    assert evaluate.letter_probabilities([{"token": " a", "logprob": math.log(0.2)}, {"token": "A", "logprob": math.log(0.3)},
                                          {"token": "x", "logprob": 0.0}]) == pytest.approx({"A": 0.5})
    assert evaluate.letter_probabilities([{"token": "Sure", "logprob": -0.1}]) is None


def test_curves_command_and_a_clear_error_for_missing_runs(tmp_path, capsys):
    for seed, offset in [(1, 0.0), (2, 1.0)]:
        d = tmp_path / "runs" / f"seed{seed}"
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "eval/rm": s + offset, "adv/l2": 1.0}) + "\n" for s in (1, 2)))
    out = main(capsys, "curves", "--runs", f"ppo={tmp_path}/runs/seed*", "--metrics", "eval/rm,adv/l2",
               "--output_dir", str(tmp_path))
    assert "2.500 ± 0.707" in out and os.path.getsize(tmp_path / "curves.png") > 0
    with pytest.raises(SystemExit, match="no run folder with a metrics.jsonl"):
        evaluate.main(["curves", "--runs", f"x={tmp_path}/nothing*"])


# --- diversity beside every score, and learning curves of the run's own score -------------------------------
RUNS = os.path.join(ROOT, "tests", "fixtures", "runs")


@pytest.mark.parametrize("kind, panels", [
    ("rm", ["reward/rm", "eval/rm", "eval/gold", "eval/gold_strict", "eval/distinct_2"]),
    ("gold", ["reward/gold", "eval/gold", "eval/rm", "eval/gold_strict", "eval/distinct_2"]),
    ("segment", ["reward/segment", "eval/rm", "eval/gold", "eval/gold_strict", "eval/distinct_2"]),
    ("exec", ["reward/exec", "eval/exec", "eval/pass@1", "eval/distinct_2"]),
])
def test_a_learning_curve_plots_the_runs_own_score_and_no_empty_panel(tmp_path, kind, panels):
    """tests/fixtures/runs/<kind>.jsonl: the metrics.jsonl of real 4-iteration ppo.py runs on tiny models
    (--steps 4 --eval_every 2; --reward gold; --reward segment --termination segment on a segment RM; --task
    code). The first panel is the score the run trained on, the second its held-out score (a segment RM's is
    e(x, y), logged as eval/rm); every panel has data, and matplotlib warns of nothing."""
    import shutil
    import warnings
    shutil.copy(os.path.join(RUNS, f"{kind}.jsonl"), tmp_path / "metrics.jsonl")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert evaluate.run_panels(rows) == panels
    assert all(any(p in r for r in rows) for p in panels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = evaluate.plot_run(str(tmp_path / "metrics.jsonl"))
    assert os.path.getsize(png) > 0


def test_a_run_logged_before_the_diversity_metrics_still_plots_its_own_score(tmp_path):
    """An older run: no eval/gold_strict, no eval/distinct_2, a gold reward; no panel for what it did not log."""
    rows = [{"step": s, "reward/gold": 0.1 * s, "kl": 0.0, **({"eval/rm": 0.2, "eval/gold": 0.3} if s % 2 == 0 else {})}
            for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert evaluate.run_panels(rows) == ["reward/gold", "eval/gold", "eval/rm"]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate.plot_run(str(tmp_path / "metrics.jsonl"))


@pytest.fixture(scope="module")
def models(tiny_models, parrot):
    from transformers import AutoModelForCausalLM
    import data
    import ppo
    import reward_model as rm
    args, *extensions = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                                      max_prompt_len=16, max_response_len=12)
    ppo.resolve(args, *extensions)
    tokenizer = data.load_tokenizer(args.sft_path)
    rows = data.first_row_per_prompt(data.load_task("chitchat", only=("test",))["test"])[:16]
    load = (lambda path: AutoModelForCausalLM.from_pretrained(path).eval())
    return args, tokenizer, rows, load(tiny_models / "sft"), load(parrot), rm.load_reward_model(str(tiny_models / "rm"))[0]


def test_the_final_report_says_in_words_that_a_parrots_replies_are_degenerate(models, tmp_path):
    """A policy that says one word the gold judge likes: a high gold score and a 100% gold win rate, and beside
    them its diversity, the SFT model's, gold_strict, and a warning that the gold score is being gamed. The SFT
    model against itself does not collapse by this measure."""
    import shutil
    args, tokenizer, rows, sft_model, parrot_model, reward = models
    shutil.copy(os.path.join(RUNS, "rm.jsonl"), tmp_path / "metrics.jsonl")
    sampling = evaluate.Sampling(args.task, args.max_prompt_len, args.max_response_len, seed=args.seed)
    evaluate.final_report(parrot_model, sft_model, reward, tokenizer, rows, str(tmp_path / "metrics.jsonl"), sampling)
    summary = open(tmp_path / "summary.md").read()
    d2 = re.search(r"\| distinct-1 / distinct-2 of the replies \| [\d.]+ / ([\d.]+) \| [\d.]+ / ([\d.]+) \|", summary)
    sft_d2, policy_d2 = float(d2.group(1)), float(d2.group(2))
    assert policy_d2 < 0.5 * sft_d2 and "| mean gold_strict score" in summary
    assert "the policy's replies are degenerate" in summary and "gold scores are being gamed" in summary
    assert re.search(r"\| replies mostly one repeated word \| [\d.]+% \| (\d+\.\d)% \|", summary).group(1) != "0.0"
    pictures = ("learning_curve.png", "macro_actions.png", "macro_actions.json")
    assert "learning curve: " in summary and all((tmp_path / name).exists() for name in pictures)
    evaluate.final_report(sft_model, sft_model, reward, tokenizer, rows, str(tmp_path / "metrics.jsonl"), sampling,
                          plot=False)
    summary = open(tmp_path / "summary.md").read()
    assert "degenerate:" not in summary and "no collapse by this measure" in summary
    # --plot false: no picture, and none of the report before it left in the folder to be read as this one's
    assert "learning curve" not in summary and not any((tmp_path / name).exists() for name in pictures)
