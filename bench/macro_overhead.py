"""Micro-benchmark: macro-action work at paper-scale shapes (B=64, T=512) on this CPU.

Times the vectorized fixed n-gram + sigma + macro_advantages path and the perplexity rule
against straightforward per-sample Python loops of the same math (the released code's style),
checks both give the same numbers, and prints parsing throughput.

    python bench/macro_overhead.py [--B 64] [--T 512] [--n 5] [--repeats 20]
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "spec")]
import macro_actions as ma  # noqa: E402
from reference import fixed_ngram_loop, macro_gae_loop, perplexity_loop  # noqa: E402


def best_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=64, help="responses per batch")
    p.add_argument("--T", type=int, default=512, help="max response tokens")
    p.add_argument("--n", type=int, default=5, help="fixed n-gram size")
    p.add_argument("--sigma", default="position", help="sigma weights to time")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats of the vectorized code (median)")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(a.T // 2, a.T + 1, (a.B, 1), generator=g)
    mask = (torch.arange(a.T) < lengths).long()
    values, rewards = torch.randn(a.B, a.T, generator=g) * mask, torch.randn(a.B, a.T, generator=g) * mask
    logprobs = -torch.rand(a.B, a.T, generator=g) * 4 * mask
    print(f"B={a.B} T={a.T} n={a.n} sigma={a.sigma} threads={torch.get_num_threads()}")

    def fixed_vec():
        starts = ma.fixed_ngram_starts(mask, a.n)
        return ma.macro_advantages(values, rewards, mask, starts, sigma=a.sigma)

    def fixed_loop():
        starts = fixed_ngram_loop(mask, a.n)
        return macro_gae_loop(values, rewards, mask, starts, sigma=a.sigma)

    rows = []
    vec_ms, (adv, ret) = best_ms(fixed_vec, a.repeats)
    loop_ms, (ref_adv, ref_ret) = best_ms(fixed_loop, 1)
    same = torch.allclose(adv, ref_adv, atol=1e-4) and torch.allclose(ret, ref_ret, atol=1e-4)
    rows.append((f"fixed n={a.n} + sigma + macro GAE", vec_ms, loop_ms, same))
    vec_ms, starts = best_ms(lambda: ma.perplexity_starts(logprobs, mask), a.repeats)
    loop_ms, ref = best_ms(lambda: perplexity_loop(logprobs, mask), 1)
    rows.append(("perplexity termination", vec_ms, loop_ms, torch.equal(starts, ref)))
    ppl_starts = starts
    vec_ms, _ = best_ms(lambda: ma.macro_advantages(values, rewards, mask, ppl_starts, sigma=a.sigma), a.repeats)
    rows.append(("macro GAE on ppl starts", vec_ms, float("nan"), True))

    print(f"\n| path | vectorized ms | loop ms | speed-up | same numbers |\n|---|---|---|---|---|")
    for name, v, l, s in rows:
        print(f"| {name} | {v:.2f} | {l:.1f} | {l / v:.0f}x | {s} |")
    parsing_throughput(a.B)
    if not all(r[3] for r in rows):
        sys.exit("vectorized and loop versions disagree")


def parsing_throughput(B):
    from sft import train_tokenizer
    sentences = [
        "The committee approved the new budget after a long debate about schools and roads.",
        "She said that the weather in the mountains was colder than anyone had expected.",
        "If you water the plants every morning, they will grow faster and stay green.",
        "My brother, who lives in a small town near the coast, builds wooden boats.",
        "We could not find the keys (they were in the car), so we walked home.",
    ]
    texts = [" ".join(sentences[(i + k) % 5] for k in range(4)) for i in range(B)]   # ~60 words
    tok = train_tokenizer(sentences * 10, vocab_size=600)
    rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    T = max(map(len, rows))
    ids = torch.full((B, T), tok.pad_token_id)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    ma.parsing_starts(ids[:2], mask[:2], tok)                          # load spaCy once
    for language, batch in [("text", texts), ("python", None)]:
        if language == "python":
            code = "def f(xs):\n    total = 0\n    for x in xs:\n        if x % 2 == 0:\n            total += x * x\n    return total\n"
            rows = [tok(code * 2, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]] * B
            T = len(rows[0])
            ids, mask = torch.tensor(rows), torch.ones(B, T, dtype=torch.long)
        t0 = time.perf_counter()
        starts, fallback = ma.parsing_starts(ids, mask, tok, language=language, return_fallback=True)
        dt = time.perf_counter() - t0
        print(f"parsing ({language}): {B} responses of {int(mask.sum(1).float().mean())} tokens in "
              f"{dt * 1000:.0f} ms = {B / dt:.0f} responses/s; mean macro length "
              f"{mask.sum().item() / starts.sum().item():.2f} tokens; fallback {int(fallback.sum())}/{B}")


if __name__ == "__main__":
    main()
