"""Seconds per PPO iteration of `--reward segment` against `--reward rm` (Yin et al. 2025's segment
rewards: the SFT entropy at temperature 1 from the reference forward already made, the head read at
every segment's end, the location normalizer, the spread over the segment's tokens).

    python bench/segment_cost.py [--steps 12] [--rounds 2]
    python bench/segment_cost.py --sft_path runs/chitchat/sft --rm_path runs/chitchat/rm --segment_rm runs/chitchat/rm_segment

Runs the real ppo.py loop and reads the timings it writes to metrics.jsonl (the first two iterations
are warm-up). The two settings alternate, `--rounds` times each, so that a machine whose speed drifts
slows both alike; the table gives each setting's median over all its iterations and the ratio. Without
trained models it builds random tiny ones of the default size and gives the segment RM a normalizer
fitted to its own head values: the cost depends on the sizes, not on the weights.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import ppo  # noqa: E402
import reward_model as rm  # noqa: E402
import segment_rewards as sr  # noqa: E402
from ppo_step import random_models  # noqa: E402

KEYS = ["time/generate", "time/forward", "time/macro", "time/update", "time/step"]


def random_segment_rm(sft_path, rm_path, out, c_ent=6.0):
    """A copy of the sequence RM with segment_reward.json: segments at c_ent, a normalizer fitted to the
    head's values at the segment ends of a few SFT samples."""
    import data
    from transformers import AutoModelForCausalLM
    shutil.copytree(rm_path, out)
    sft = AutoModelForCausalLM.from_pretrained(sft_path).eval()
    model, tokenizer = rm.load_reward_model(out)
    prompts = [r["prompt"] for r in data.load_task("chitchat", only=("ppo",))["ppo"][:64]]
    responses = tokenizer.batch_decode(data.sample(sft, tokenizer, prompts, 48, 32)[2], skip_special_tokens=True)
    batch = data.collate(tokenizer, prompts, responses, 48, 32)
    ends, p = sr.segment_layout(sft, batch, "segment", c_ent, tokenizer.eos_token_id)
    with torch.no_grad():
        values = rm.token_values(model.eval(), batch["input_ids"], batch["attention_mask"])
    settings = {"unit": "segment", "c_ent": c_ent, "normalizer": sr.fit_location_normalizer(p[ends], values[ends])}
    with open(os.path.join(out, sr.SEGMENT_FILE), "w") as f:
        json.dump(settings, f)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="iterations per run (2 more for warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating")
    parser.add_argument("--sft_path", default="runs/chitchat/sft", help="SFT model; random tiny one if missing")
    parser.add_argument("--rm_path", default="runs/chitchat/rm", help="sequence RM; random tiny one if missing")
    parser.add_argument("--segment_rm", default="runs/chitchat/rm_segment",
                        help="segment RM (reward_model.py --unit segment); the sequence RM with a fitted normalizer if missing")
    cli = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="segment_bench_")
    if not all(os.path.exists(os.path.join(p, "config.json")) for p in (cli.sft_path, cli.rm_path)):
        print("no trained models found: building random tiny ones of the default size")
        cli.sft_path, cli.rm_path = random_models(tmp)
    if not os.path.exists(os.path.join(cli.segment_rm, sr.SEGMENT_FILE)):
        print(f"no segment RM at {cli.segment_rm}: the sequence RM with a normalizer fitted to its head")
        cli.segment_rm = random_segment_rm(cli.sft_path, cli.rm_path, os.path.join(tmp, "rm_segment"))
    settings = {"rm": {"reward": "rm", "rm_path": cli.rm_path},
                "segment": {"reward": "segment", "rm_path": cli.segment_rm}}
    rows = {name: [] for name in settings}
    for round_ in range(cli.rounds):
        for name, flags in settings.items():
            out = os.path.join(tmp, f"{name}{round_}")
            ppo.main(*ppo.harness.split_flags(ppo.ARGS, dict(
                sft_path=cli.sft_path, output_dir=out, n=1, steps=cli.steps + 2, eval_every=10 ** 9, save_every=10 ** 9,
                n_eval_prompts=8, **flags)))
            rows[name] += [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][2:]
    med = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in rows.items()}
    print(f"\nB=32 prompts/iteration, prompt <= 48, response <= 32 tokens, {torch.get_num_threads()} threads, "
          f"median of {cli.rounds} x {cli.steps} iterations per setting, alternating\n")
    print("| --reward | generate s | no-grad forwards s | update s | iteration s |")
    print("|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['time/generate']:.3f} | {m['time/forward']:.3f} | {m['time/update']:.3f} | {m['time/step']:.3f} |")
    print(f"\nsegment / rm: no-grad forwards {med['segment']['time/forward'] / med['rm']['time/forward']:.3f}, "
          f"iteration {med['segment']['time/step'] / med['rm']['time/step']:.3f}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
