"""The numbers do not move: ppo.py of a reference git revision and of the working tree, run with the
same tiny models, seed and flags, must write the same metrics.jsonl values (timings aside).

    python bench/same_numbers.py                     # against HEAD
    python bench/same_numbers.py --rev 1a30cd8 --steps 4 --flags "--n 5 --termination ppl"
    python bench/same_numbers.py --segment_rm --flags "--reward segment"      # a segment RM's rewards

Use it for any change that should not change training (refactors, renames, moving code). It builds a
random tiny SFT model and RM once (tests/conftest.py's recipe; `--segment_rm`: the RM with a segment_reward.json,
tests/spec/test_segments.py's recipe), checks out --rev into a temporary git
worktree, runs both ppo.py's as subprocesses and prints every value that differs; exit 1 if any does.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMINGS = ("time/", "tokens_per_s")


def tiny_models(root):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, ROOT)
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from conftest import SAMPLE_TEXT
    import sft
    tokenizer = sft.train_tokenizer(SAMPLE_TEXT * 20, vocab_size=400)
    torch.manual_seed(0)
    model = sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=2)
    for path, m in [("sft", model), ("rm", None)]:
        m = m or AutoModelForSequenceClassification.from_pretrained(os.path.join(root, "sft"), num_labels=1)
        m.save_pretrained(os.path.join(root, path))
        tokenizer.save_pretrained(os.path.join(root, path))
    del AutoModelForCausalLM
    return os.path.join(root, "sft"), os.path.join(root, "rm")


def segment_rm(sft_path, rm_path):
    """The tiny RM made a segment RM: c_ent at the SFT model's median next-token entropy over a few texts, a location
    normalizer fitted on its segment rewards there, saved beside it as reward_model.py --unit segment saves them."""
    import json
    import torch
    from transformers import AutoModelForCausalLM
    from conftest import SAMPLE_TEXT
    import data
    import reward_model as rm
    import segment_rewards as sr
    tokenizer = data.load_tokenizer(sft_path)
    sft_model = AutoModelForCausalLM.from_pretrained(sft_path).eval()
    batch = data.collate(tokenizer, [t[:20] for t in SAMPLE_TEXT], [t[20:] for t in SAMPLE_TEXT], 24, 24)
    P, ids, mask = batch["prompt_width"], batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = sft_model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"]).logits
        c_ent = sr.next_token_entropy(logits[:, P - 1:-1].float())[mask[:, P:].bool()].median().item()
        ends, p = sr.segment_layout(sft_model, batch, "segment", c_ent, tokenizer.eos_token_id)
        values = rm.token_values(rm.load_reward_model(rm_path)[0].eval(), ids, mask)
    settings = {"unit": "segment", "c_ent": c_ent, "normalizer": sr.fit_location_normalizer(p[ends], values[ends])}
    with open(os.path.join(rm_path, sr.SEGMENT_FILE), "w") as f:
        json.dump(settings, f)


def run(code_dir, out, sft_path, rm_path, args):
    cmd = [sys.executable, "ppo.py", "--sft_path", sft_path, "--rm_path", rm_path, "--output_dir", out,
           "--steps", str(args.steps), "--eval_every", "2", "--rollout_batch_size", "8", "--mini_batch_size", "4",
           "--max_prompt_len", "24", "--max_response_len", "12", "--n_eval_prompts", "8", *shlex.split(args.flags)]
    proc = subprocess.run(cmd, cwd=code_dir, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: ppo.py failed in {code_dir}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="HEAD", help="reference git revision")
    parser.add_argument("--steps", type=int, default=4, help="PPO iterations compared")
    parser.add_argument("--flags", default="--n 5", help="extra ppo.py flags for both runs")
    parser.add_argument("--segment_rm", action="store_true", help="the RM a segment RM (a segment_reward.json beside "
                        "it), for --reward segment, --termination segment and a segment RM under --reward rm")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="same_numbers_")
    sft_path, rm_path = tiny_models(os.path.join(tmp, "models"))
    if args.segment_rm:
        segment_rm(sft_path, rm_path)
    ref_dir = os.path.join(tmp, "ref")
    subprocess.run(["git", "worktree", "add", "--detach", ref_dir, args.rev], cwd=ROOT, check=True, capture_output=True)
    try:
        before = run(ref_dir, os.path.join(tmp, "before"), sft_path, rm_path, args)
        after = run(ROOT, os.path.join(tmp, "after"), sft_path, rm_path, args)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", ref_dir], cwd=ROOT, capture_output=True)
    differ, new = differences(before, after)
    compared = sum(1 for row in before for k in row if not k.startswith(TIMINGS))
    print("\n".join(differ) or f"same numbers: {compared} values over {len(before)} iterations "
                                 f"({args.rev} vs working tree, flags {args.flags!r})")
    if new:
        print(f"new metrics, not in {args.rev} (not compared): {', '.join(new)}")
    sys.exit(1 if differ else 0)


def differences(before, after):
    """(what differs, new keys): every metric of the reference's rows (`before`) that the working tree's
    rows (`after`) lack or give another value, timings aside, and a differing number of iterations; the
    keys only `after` logs are new metrics, listed apart: adding a metric changes no number."""
    differ = []
    for b, a in zip(before, after):
        for key in sorted(b):
            if not key.startswith(TIMINGS) and (key not in a or b[key] != a[key]):
                differ.append(f"iteration {b['step']}: {key} {b[key]} -> {a.get(key, 'missing')}")
    if len(before) != len(after):
        differ.append(f"{len(before)} iterations before, {len(after)} after")
    new = sorted({k for row in after for k in row} - {k for row in before for k in row})
    return differ, new


if __name__ == "__main__":
    main()
