"""Seconds per PPO iteration, broken down, for vanilla PPO (n=1) and MA-PPO (n=5) at the demo size.

    python bench/ppo_step.py [--steps 12] [--sft_path runs/chitchat/sft --rm_path runs/chitchat/rm]

Runs the real ppo.py loop (not a copy of it) and reads the timings it writes to metrics.jsonl:
generation, the no-grad forwards (old / reference logprobs, values, RM score), the macro-action
work (termination + macro GAE) and the PPO update. The first two iterations are warm-up and are
not counted. Without trained models it builds random tiny ones of the default size: the timings
depend on the sizes, not on the weights (responses run to the length limit more often, though).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import harness  # noqa: E402
import ppo  # noqa: E402
import sft  # noqa: E402


def random_models(root):
    from transformers import AutoModelForSequenceClassification
    import data
    rows = data.load_task("chitchat", only=("sft",))["sft"][:5000]
    tokenizer = sft.train_tokenizer([r["prompt"] + r["chosen"] for r in rows], 2048)
    torch.manual_seed(0)
    harness.atomic_save(os.path.join(root, "sft"), sft.tiny_gemma(tokenizer), tokenizer)
    reward = AutoModelForSequenceClassification.from_pretrained(os.path.join(root, "sft"), num_labels=1)
    harness.atomic_save(os.path.join(root, "rm"), reward, tokenizer)
    return os.path.join(root, "sft"), os.path.join(root, "rm")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="iterations per setting (2 more for warm-up)")
    parser.add_argument("--sft_path", default="runs/chitchat/sft", help="SFT model; random tiny one if missing")
    parser.add_argument("--rm_path", default="runs/chitchat/rm", help="reward model; random tiny one if missing")
    cli = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="ppo_bench_")
    if not (os.path.exists(os.path.join(cli.sft_path, "config.json")) and os.path.exists(os.path.join(cli.rm_path, "config.json"))):
        print("no trained models found: building random tiny ones of the default size")
        cli.sft_path, cli.rm_path = random_models(tmp)
    keys = ["time/generate", "time/forward", "time/macro", "time/update", "time/step"]
    print(f"\nB=32 prompts/iteration, prompt <= 48, response <= 32 tokens, {torch.get_num_threads()} threads, "
          f"median of {cli.steps} iterations\n")
    print("| setting | generate s | no-grad forwards s | macro actions ms | update s | iteration s | macro share | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (1, 5):
        out = os.path.join(tmp, f"n{n}")
        ppo.main(*ppo.harness.split_flags(ppo.ARGS, dict(
            sft_path=cli.sft_path, rm_path=cli.rm_path, output_dir=out, n=n, steps=cli.steps + 2, eval_every=10 ** 9,
            save_every=10 ** 9, n_eval_prompts=8)))
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][2:]
        med = {k: statistics.median(r[k] for r in rows) for k in keys + ["tokens_per_s"]}
        print(f"| n={n} | {med['time/generate']:.3f} | {med['time/forward']:.3f} | {1000 * med['time/macro']:.2f} | "
              f"{med['time/update']:.3f} | {med['time/step']:.3f} | {med['time/macro'] / med['time/step']:.2%} | "
              f"{med['tokens_per_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
