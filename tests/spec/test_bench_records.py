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


SITTINGS = ("real_ppo_full.json", "real_grpo_1.json", "real_grpo_2.json", "real_ppo_samelr_loaded.json",
            "real_ppo_full_samelr_loaded.json", "real_ppo_samelr.json", "real_ppo_full_samelr.json")


@pytest.mark.parametrize("name", ["real_ppo.json", *SITTINGS])
def test_the_committed_record_says_what_produced_it(name):
    record = json.loads(RECORD.with_name(name).read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and record["command"].startswith("python bench/real_ppo.py")
    assert set(record["weights_sha256"]) == {"sft", "rm"} and record["cpus"] >= 1
    for side in record["sides"].values():
        assert side["peak_rss_mb"] > 0 and side["threads"] >= 1 and "torch" in side["versions"]
        assert len(side["iterations"]) == record["sizes"]["steps"]
        assert all(side["median_s"][k]["wall"] > 0 for k in ("generate", "forwards", "update", "total"))


def test_real_models_tables_are_printed_from_the_committed_records():
    # LoRA r=16, full fine-tuning, GRPO against TRL's GRPOTrainer at LoRA r=16 (two sittings), and both PPO sizes
    # again with one learning rate on both sides (a loaded sitting, then a quiet one)
    for record in (RECORD, *(RECORD.with_name(n) for n in SITTINGS)):
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


def test_real_ppo_refuses_an_arm_trl_has_not_at_the_smollm2_sizes():
    """At the SmolLM2 sizes one arm a sitting, gae (TRL's PPOTrainer beside it) or group (its GRPOTrainer)."""
    import subprocess
    import sys
    for arms in ("mc", "gae,group"):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "real_ppo.py"), "--sft_path", "x", "--rm_path", "y",
                               "--arms", arms], capture_output=True, text=True)
        assert done.returncode == 2 and f"--arms {arms}: at the SmolLM2 sizes one of gae, group" in done.stderr


def summary(total, rss, tokens=512):
    phase = {"wall": total / 3, "cpu": total / 3}
    return {"median_s": {"generate": phase, "forwards": phase, "update": phase, "total": {"wall": total, "cpu": total}},
            "peak_rss_mb": rss, "tokens": tokens}


def test_tiny_table_sets_each_arm_against_the_trl_trainer_matched_with_it():
    """ours gae against TRL's PPOTrainer, ours group against its GRPOTrainer, never across; tokens shown."""
    table = real_ppo().tiny_table({"ours gae": summary(1.0, 800), "trl ppo": summary(2.0, 1000),
                                   "ours group": summary(0.6, 700), "trl grpo": summary(0.8, 560, 500)})
    assert "ours gae / TRL ppo: 0.50x the s/iteration (0.50x its CPU s), 0.80x the peak RSS" in table
    assert "ours group / TRL grpo: 0.75x the s/iteration (0.75x its CPU s), 1.25x the peak RSS" in table
    assert "| trl grpo | 0.267 (0.267) | 0.267 (0.267) | 0.267 (0.267) | **0.800 (0.800)** | 500 | 560 |" in table
    assert "group / gae: 0.60x" in table
    alone = real_ppo().tiny_table({"ours group": summary(0.6, 700), "trl ppo": summary(2.0, 1000)})
    assert "/ TRL" not in alone                           # group is never set against PPOTrainer


def test_ours_group_arm_reports_the_split_and_samples_the_prompts_trl_is_given(tiny_models, tmp_path, monkeypatch):
    """bench/real_ppo.py's ours side, --advantage group at the tiny sizes: every iteration split into generate /
    forwards / update within its total, with the tokens it generated; and the prompts of each rollout are the ones
    our_batches hands TRL's GRPOTrainer (4 a step, each sampled K=4 times in adjacent rows), token for token."""
    import argparse
    import data
    import harness
    import ppo
    bench = real_ppo()
    for module, name in ((harness, "Stopwatch"), (ppo.evaluate, "during_training"), (ppo, "finish"),
                         (data, "cut_after_eos")):
        monkeypatch.setattr(module, name, getattr(module, name))     # the side patches them: put back after
    cli = argparse.Namespace(tiny=True, task="chitchat", sft_path=str(tiny_models / "sft"),
                             rm_path=str(tiny_models / "rm"), steps=2, tmp=str(tmp_path), lora_r=0, minibatches=1,
                             epochs=1, advantage="group", threads=1)
    sampled, encode = [], data.encode_prompts

    def seen(tokenizer, prompts, max_prompt_len, *a, **k):
        ids, mask, n_cut = encode(tokenizer, prompts, max_prompt_len, *a, **k)
        sampled.append([row[m.bool()].tolist() for row, m in zip(ids, mask)])
        return ids, mask, n_cut

    monkeypatch.setattr(data, "encode_prompts", seen)
    result = bench.ours(cli)
    rollouts = list(sampled)        # our_batches below encodes prompts too
    its = result["iterations"]
    assert len(its) == 2 and result["peak_rss_mb"] > 0
    for i in its:
        parts = [i[k] for k in ("generate", "forwards", "update")]
        assert all(p > 0 for p in parts) and sum(parts) <= i["total"] + 1e-3
        assert i["tokens"] == round(i["response_len"] * 16) and 1 <= i["longest"] <= 32
    trl_batches = bench.our_batches(cli, bench.K)
    assert [len(b) for b in trl_batches] == [4, 4]
    assert rollouts == [[ids for ids in batch for _ in range(bench.K)] for batch in trl_batches]
    assert rollouts[0] != rollouts[1]


def test_a_tiny_record_prints_every_rounds_table_as_the_sitting_did():
    """--show of a --tiny record: each round and update configuration under its heading, its table and ratios."""
    bench = real_ppo()
    arms = {"ours group": summary(0.6, 700), "trl grpo": summary(0.8, 560)}
    shown = bench.tiny_tables({"rounds": [{"round": 1, "update": "1x1", "arms": arms},
                                          {"round": 2, "update": "2x2", "arms": {"ours group": summary(0.9, 650)}}]})
    first, second = shown.split("round 2, 2 epoch(s) x 2 minibatch(es) of 8")
    assert first.startswith("\nround 1, 1 epoch(s) x 1 minibatch(es) of 16\n\n" + bench.tiny_table(arms))
    assert "ours group / TRL grpo: 0.75x" in first and "/ TRL" not in second and "| ours group | 0.300" in second


def test_the_grpo_records_set_ours_group_arm_against_trls_grpotrainer_at_the_same_tokens():
    """The GRPO sittings (tiny: both sides alternated twice; SmolLM2 with LoRA: two records): ours' group arm beside
    TRL's GRPOTrainer, each side's generation running to the same limit, the tiny tables printed in training.md."""
    tiny = json.loads((ROOT / "bench" / "records" / "tiny_grpo.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", tiny["commit"]) and tiny["command"].startswith("python bench/real_ppo.py --tiny")
    assert [r["round"] for r in tiny["rounds"]] == [1, 2] and all(r["update"] == "1x1" for r in tiny["rounds"])
    for r in tiny["rounds"]:
        ours, trl = r["arms"]["ours group"], r["arms"]["trl grpo"]
        assert "trl" in trl["versions"] and len(ours["iterations"]) == len(trl["iterations"]) == tiny["sizes"]["steps"]
        assert all(i["longest"] == tiny["sizes"]["new_tokens"] for i in ours["iterations"] + trl["iterations"])
        assert abs(ours["tokens"] - trl["tokens"]) <= 0.05 * trl["tokens"]
    assert real_ppo().tiny_tables(tiny) in (ROOT / "docs" / "training.md").read_text()
    for name in ("real_grpo_1.json", "real_grpo_2.json"):
        record = json.loads(RECORD.with_name(name).read_text())
        assert record["sizes"]["arm"] == "group" and record["sizes"]["lora_r"] == 16 and "--arms group" in record["command"]
        assert all(i["longest"] == record["sizes"]["max_new_tokens"] for side in record["sides"].values()
                   for i in side["iterations"])


FORWARDS = ("scoring_forwards_r16.json", "scoring_forwards_r0.json")


def test_the_scoring_forwards_records_say_what_produced_them_and_docs_print_their_tables():
    """bench/scoring_forwards.py's two sittings (LoRA r=16, full fine-tuning): commit, command, the models measured
    (the quiet PPO sitting's: docs/real_models.md compares the two), and docs/real_models.md's tables printed from
    them (--show), never re-typed."""
    bench = bench_module("scoring_forwards")
    records = [json.loads(RECORD.with_name(name).read_text()) for name in FORWARDS]
    for record, rank in zip(records, (16, 0)):
        assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]) and not record["dirty"]
        assert record["command"].startswith("python bench/scoring_forwards.py") and record["sizes"]["lora_r"] == rank
        assert record["weights_sha256"] == json.loads(RECORD.with_name("real_ppo_samelr.json").read_text())[
            "weights_sha256"]
        assert len(record["seconds"]) == 7 and all(s > 0 for s in record["seconds"].values())
    docs = (ROOT / "docs" / "real_models.md").read_text()
    assert bench.table(records) in docs and bench.ops_table(records[0]) in docs
