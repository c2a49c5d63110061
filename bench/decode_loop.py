"""Micro-benchmark: what transformers' generate() costs beyond the model's own decoding steps, at a rollout's sizes.

Times data.sample (generate() with the rollout's explicit config) against a plain decoding loop of the same
distribution: the model's forward on the KV cache, a softmax and torch.multinomial per step, finished rows padded,
stopping when every row has its EOS. Under one seed both draw the same tokens (checked and printed), so the
difference is generate()'s own overhead. Also prints the share of the loop's time spent in the softmax and
torch.multinomial's draw (on CPU, an exponential per vocabulary entry and row: the sampling itself, not overhead).
Both sample at temperature 1 (the rollouts use 0.8: one division of the logits apart).

    python bench/decode_loop.py [--model runs/chitchat/sft] [--batch 32,256] [--new_tokens 32] [--repeats 5]

The model folder is one sft.py saved (the default run builds runs/chitchat/sft). Threads: torch's default,
or --threads.
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402


@torch.no_grad()
def plain_loop(model, tokenizer, prompts, max_prompt_len, new_tokens, timings):
    """Sampled responses [B, <= new_tokens] at temperature 1 with no top-k / top-p, as data.sample draws them;
    `timings["multinomial"]` gathers the seconds of the softmax and the draw."""
    ids, mask, _ = data.encode_prompts(tokenizer, prompts, max_prompt_len)
    from transformers import DynamicCache
    cache, pos, x = DynamicCache(config=model.config), data.position_ids(mask), ids
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    running, out = torch.ones(len(prompts), dtype=torch.long), []
    for _ in range(new_tokens):
        logits = model(input_ids=x, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1].float()
        t0 = time.perf_counter()
        token = torch.multinomial(logits.softmax(-1), 1).squeeze(1)
        timings["multinomial"] += time.perf_counter() - t0
        token = token * running + pad * (1 - running)
        out.append(token)
        running = running * (token != eos).long()
        if not running.any():
            break
        x, pos = token[:, None], pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(out, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "runs", "chitchat", "sft"), help="an sft.py output folder")
    p.add_argument("--batch", default="32,256", help="prompts per call, separated by commas (32: a rollout; 256: "
                   "an evaluation's chunk)")
    p.add_argument("--new_tokens", type=int, default=32, help="tokens generated at most")
    p.add_argument("--max_prompt_len", type=int, default=48, help="prompt tokens kept")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each (median)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    a = p.parse_args()
    if not os.path.exists(os.path.join(a.model, "config.json")):
        sys.exit(f"error: no model at {a.model!r}: run `accelerate launch ppo.py --n 5` (it builds runs/chitchat/sft) "
                 f"or pass --model")
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(a.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    prompts = data.prompts_of(data.load_task("chitchat", only=("test",))["test"])     # held-out prompts
    print(f"{a.model}: {sum(t.numel() for t in model.parameters()) / 1e6:.1f}M parameters, {a.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads; median of {a.repeats} calls")
    print("| prompts | generate() s | plain loop s | loop / generate | softmax + multinomial, share of the loop | same tokens |")
    print("|---|---|---|---|---|---|")
    for batch in [int(b) for b in a.batch.split(",")]:
        chunk = (prompts * (batch // len(prompts) + 1))[:batch]
        gen, loop, share, same = [], [], [], True
        for r in range(a.repeats + 1):          # the first call of each warms up, not timed
            torch.manual_seed(r)
            t0 = time.perf_counter()
            _, _, g_ids, g_mask, _ = data.sample(model, tokenizer, chunk, a.max_prompt_len, a.new_tokens)
            t1 = time.perf_counter()
            torch.manual_seed(r)
            timings = {"multinomial": 0.0}
            l_ids = plain_loop(model, tokenizer, chunk, a.max_prompt_len, a.new_tokens, timings)
            t2 = time.perf_counter()
            l_ids, _ = data.cut_after_eos(l_ids, tokenizer.eos_token_id, tokenizer.pad_token_id)
            same &= l_ids.shape == g_ids.shape and bool((l_ids == g_ids).all())
            if r:
                gen.append(t1 - t0)
                loop.append(t2 - t1)
                share.append(timings["multinomial"] / (t2 - t1))
        g, lo = statistics.median(gen), statistics.median(loop)
        print(f"| {batch} | {g:.3f} | {lo:.3f} | {lo / g:.2f}x | {statistics.median(share):.0%} | {'yes' if same else 'NO'} |",
              flush=True)


if __name__ == "__main__":
    main()
