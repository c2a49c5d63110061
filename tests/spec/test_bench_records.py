"""The real-model cost guard: bench/real_ppo.py's record (medians, peak RSS, commit, command) and the table of
docs/real_models.md, which is printed from the committed record, never re-typed; bench/decode_loop.py's plain
loop draws generate()'s tokens."""
import json
import pathlib
import re

import pytest

from stages import bench_module

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
RECORD = ROOT / "bench" / "records" / "real_ppo.json"


def real_ppo():
    return bench_module("real_ppo")


def iteration(total, forwards, length):
    return {"generate": 1.0, "forwards": forwards, "update": 2.0, "total": total, "response_len": length,
            "cpu": {"generate": 2.0, "forwards": 2 * forwards, "update": 4.0, "total": 2 * total}}


def test_a_side_summary_is_the_median_of_the_iterations_after_the_warm_up():
    its = [iteration(100.0, 90.0, 10), iteration(30.0, 12.0, 40), iteration(34.0, 16.0, 42), iteration(31.0, 13.0, 38)]
    summary = real_ppo().side_summary({"iterations": its, "peak_rss_mb": 8437.4, "wall_s": 250.2, "threads": 2,
                                       "versions": {"torch": "x"}})
    assert summary["median_s"]["total"] == {"wall": 31.0, "cpu": 62.0}         # 100 s of warm-up left out
    assert summary["median_s"]["forwards"] == {"wall": 13.0, "cpu": 26.0}
    assert summary["response_len"] == 40 and summary["peak_rss_mb"] == 8437 and summary["threads"] == 2
    assert summary["iterations"] == its


@pytest.mark.parametrize("name", ["real_ppo.json", "real_ppo_full.json"])
def test_the_committed_record_says_what_produced_it(name):
    record = json.loads(RECORD.with_name(name).read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and record["command"].startswith("python bench/real_ppo.py")
    assert set(record["weights_sha256"]) == {"sft", "rm"} and record["cpus"] >= 1
    for side in record["sides"].values():
        assert side["peak_rss_mb"] > 0 and side["threads"] >= 1 and "torch" in side["versions"]
        assert len(side["iterations"]) == record["sizes"]["steps"]
        assert all(side["median_s"][k]["wall"] > 0 for k in ("generate", "forwards", "update", "total"))


def test_real_models_tables_are_printed_from_the_committed_records():
    for record in (RECORD, RECORD.with_name("real_ppo_full.json")):       # LoRA r=16, and full fine-tuning
        table = real_ppo().table(json.loads(record.read_text()))
        assert table in (ROOT / "docs" / "real_models.md").read_text()


def test_the_full_fine_tuning_record_trains_every_weight():
    record = json.loads(RECORD.with_name("real_ppo_full.json").read_text())
    assert record["sizes"]["lora_r"] == 0 and "--lora_r 0" in record["command"]
    assert record["weights_sha256"] == json.loads(RECORD.read_text())["weights_sha256"]    # the same folders


def test_decode_loop_bench_draws_the_tokens_generate_draws(tiny_lm, tokenizer):
    """bench/decode_loop.py times generate() against a plain decoding loop: like for like only if, under one seed,
    the loop samples the very tokens data.sample does (same distribution, same draws, the same EOS cut)."""
    import torch
    import data
    decode = bench_module("decode_loop")
    prompts = ["The quick brown fox", "I think we should", "def add(a, b):", "Hello"] * 3
    torch.manual_seed(7)
    _, _, g_ids, _, _ = data.sample(tiny_lm, tokenizer, prompts, 16, 12)
    torch.manual_seed(7)
    timings = {"multinomial": 0.0}
    l_ids = decode.plain_loop(tiny_lm, tokenizer, prompts, 16, 12, timings)
    l_ids, _ = data.cut_after_eos(l_ids, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert l_ids.shape == g_ids.shape and torch.equal(l_ids, g_ids)
    assert timings["multinomial"] > 0
    torch.manual_seed(8)                                   # another seed, other tokens: the check can fail
    other = decode.plain_loop(tiny_lm, tokenizer, prompts, 16, 12, {"multinomial": 0.0})
    assert not torch.equal(data.cut_after_eos(other, tokenizer.eos_token_id, tokenizer.pad_token_id)[0], g_ids)


def test_real_ppo_refuses_a_lora_rank_it_cannot_run():
    """--lora_r: a rank >= 0 (0 = full fine-tuning) at the SmolLM2 sizes; --tiny trains every weight already."""
    import subprocess
    import sys
    for flags in (["--tiny", "--lora_r", "4"], ["--lora_r", "-1", "--sft_path", "x", "--rm_path", "y"]):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "real_ppo.py"), *flags], capture_output=True,
                              text=True)
        assert done.returncode == 2 and f"--lora_r {flags[flags.index('--lora_r') + 1]}: a rank >= 0" in done.stderr
