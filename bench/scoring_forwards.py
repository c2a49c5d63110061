"""One PPO iteration's forwards and backwards apart, at a real model's size: where ours' step 2 (the scoring
forwards) and step 6 (the update) spend their seconds, model by model, before anything is changed for speed.

    python bench/scoring_forwards.py --sft_path runs/smollm2/sft --rm_path runs/smollm2/rm [--lora_r 16]
        [--repeats 3] [--record bench/records/scoring_forwards_r16.json]
    python bench/scoring_forwards.py --show \\
        bench/records/scoring_forwards_r16.json,bench/records/scoring_forwards_r0.json     # a column each

The run is built as ppo.py builds it (ppo.resolve, ppo.setup) at bench/real_ppo.py's sizes: 16 prompts of at most
48 tokens with the chat template, at most 64 new tokens at temperature 0.8, LoRA r=16 on every linear layer of the
policy and of the critic (--lora_r 0: full fine-tuning, beside a frozen reference), fp32. One rollout is sampled
(the policy's generate(), as step 1); on it each of these is timed, the median of --repeats after one warm-up:

- the reference's logprobs (ppo.reference_logprobs: the frozen SFT model, or under LoRA the policy with its
  adapters off), no graph;
- the score (the run's scorer: the RM's forward), no graph;
- the policy's logprobs and entropy without a graph, and with it (ppo.scoring_forwards as step 2 runs it when the
  update reuses it), then the backward of their sum;
- the critic's values with their graph (the Critic ppo.py trains), then the backward of their sum;

and torch.profiler's operators over one forward and backward of the policy, the most costly first (self CPU
seconds and calls): the matrix products of the layers, the LM head's and the vocabulary-wide element-wise work.
Threads: torch's default. SmolLM2's folders: docs/real_models.md.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import harness  # noqa: E402
import ppo  # noqa: E402
from real_ppo import LR, PROMPT, RESPONSE, SEED, TARGETS, TEMPERATURE, B, R, sitting, weights_hash  # noqa: E402

TOP_OPS = 8


def build(cli, out_dir):
    """ppo.py's Setup at the bench's sizes, and one rollout of it: (setup, ids, attention_mask, prompt width, rows)."""
    args = harness.split_flags(ppo.ARGS, dict(
        task="chitchat", sft_path=cli.sft_path, rm_path=cli.rm_path, output_dir=out_dir, n=1, steps=1,
        chat_template=cli.chat_template, lora_r=cli.lora_r, lora_alpha=R, lora_target_modules=TARGETS,
        rollout_batch_size=cli.prompts, mini_batch_size=cli.prompts, max_prompt_len=cli.prompt_len,
        max_response_len=cli.new_tokens, temperature=TEMPERATURE, policy_lr=LR, critic_lr=LR, seed=SEED,
        plot=False))
    s = ppo.setup(args[0], *ppo.resolve(args[0], *args[1:]))
    torch.manual_seed(SEED)
    rows = [s.rows[i] for i in range(cli.prompts)]
    p_ids, p_mask, _ = data.encode_prompts(s.tokenizer, [r["prompt"] for r in rows], cli.prompt_len)
    policy = s.trained["policy"].model.eval()
    with torch.no_grad():
        out = policy.generate(input_ids=p_ids, attention_mask=p_mask, generation_config=s.generation)
    r_ids, r_mask = data.cut_after_eos(out[:, p_ids.shape[1]:], s.tokenizer.eos_token_id, s.tokenizer.pad_token_id)
    return s, torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), p_ids.shape[1], rows


def median_s(fn, repeats):
    """The median wall-clock seconds of `fn()` over `repeats` calls after one warm-up call."""
    fn()
    laps = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        laps.append(time.perf_counter() - start)
    return round(statistics.median(laps), 3)


def forward_backward(forward):
    """(seconds of `forward()`, which returns tensors with their graph, seconds of the backward of their sum)."""
    start = time.perf_counter()
    outputs = forward()
    middle = time.perf_counter()
    sum(o.sum() for o in outputs).backward()
    return middle - start, time.perf_counter() - middle


def graph_medians(forward, repeats):
    """The median seconds of the forward and of the backward (forward_backward) over `repeats` calls after one
    warm-up call."""
    forward_backward(forward)
    laps = [forward_backward(forward) for _ in range(repeats)]
    return tuple(round(statistics.median(lap), 3) for lap in zip(*laps))


def measure(cli):
    """{"sizes": ..., "seconds": {what: median s}, "policy_ops": [[operator, self CPU s, calls], ...]}."""
    with tempfile.TemporaryDirectory(prefix="scoring_forwards_") as out_dir:     # the run's folder: nothing kept
        s, ids, mask, P, rows = build(cli, out_dir)
    policy, critic = s.trained["policy"].model, s.trained.get("critic")
    acc, T = s.trained["policy"].accelerator, TEMPERATURE

    def no_grad(fn):
        return lambda: torch.no_grad()(fn)()

    def policy_graph():
        return ppo.scoring_forwards(policy, None, ids, mask, P, T, True)[:1]
    timed = {"reference logprobs (no graph)": median_s(no_grad(
                 lambda: ppo.reference_logprobs(s.ref, acc, policy, ids, mask, P, T)), cli.repeats),
             "score: the RM's forward (no graph)": median_s(no_grad(
                 lambda: s.scorer(ids, mask, P, rows, None)), cli.repeats),
             "policy logprobs and entropy (no graph)": median_s(no_grad(
                 lambda: ppo.response_logprobs(policy, ids, mask, P, T, True)), cli.repeats)}
    graphs = [("policy", policy_graph)] + ([("critic", lambda: [critic.model(ids, mask, P)])] if critic else [])
    for name, forward in graphs:
        timed[f"{name} forward with its graph"], timed[f"{name} backward"] = graph_medians(forward, cli.repeats)
        for trained in s.trained.values():
            trained.model.zero_grad(set_to_none=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward(policy_graph)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP_OPS]
    return {"sizes": {"prompts": cli.prompts, "prompt_len": cli.prompt_len, "new_tokens": cli.new_tokens,
                      "lora_r": cli.lora_r, "chat_template": cli.chat_template, "temperature": T,
                      "threads": torch.get_num_threads(), "repeats": cli.repeats,
                      "tokens": list(ids.shape), "response_tokens": int(mask[:, P:].sum())},
            "seconds": timed,
            "policy_ops": [[e.key, round(e.self_cpu_time_total / 1e6, 3), e.count] for e in ops]}


def setting(result):
    return f"LoRA r={result['sizes']['lora_r']}" if result["sizes"]["lora_r"] else "full fine-tuning"


def table(results):
    """The seconds of each forward and backward, a column per result (record)."""
    lines = ["| forward / backward | " + " | ".join(setting(r) for r in results) + " |",
             "|---|" + "---|" * len(results)]
    lines += [f"| {name} | " + " | ".join(f"{r['seconds'].get(name, float('nan')):.2f}" for r in results) + " |"
              for name in dict.fromkeys(n for r in results for n in r["seconds"])]
    return "\n".join(lines)


def ops_table(result):
    """The policy's costliest operators over one forward and backward: self CPU seconds and calls."""
    z = result["sizes"]
    return "\n".join([f"| operator ({setting(result)}: the policy's forward and backward, {z['prompts']} x "
                      f"{z['tokens'][1]} tokens) | self CPU s | calls |", "|---|---|---|",
                      *(f"| `{name}` | {s:.2f} | {calls} |" for name, s, calls in result["policy_ops"])])


def show(results):
    z = results[0]["sizes"]
    return "\n\n".join([f"{z['prompts']} rows of {z['tokens'][1]} tokens, {z['threads']} threads; seconds, the median "
                        f"of {z['repeats']} after a warm-up", table(results), *map(ops_table, results)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft_path", default="", help="SFT model folder (sft.py's output)")
    parser.add_argument("--rm_path", default="", help="reward model folder (reward_model.py's output)")
    parser.add_argument("--lora_r", type=int, default=R, help="LoRA rank of the policy and the critic; 0: full "
                                                             "fine-tuning beside a frozen reference")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each, after one warm-up")
    parser.add_argument("--prompts", type=int, default=B, help="rows of the rollout")
    parser.add_argument("--prompt_len", type=int, default=PROMPT, help="prompt tokens at most")
    parser.add_argument("--new_tokens", type=int, default=RESPONSE, help="generated tokens at most")
    parser.add_argument("--chat_template", type=lambda v: v.lower() == "true", default=True,
                        help="render the prompts with the tokenizer's chat template (true: SmolLM2's recipe)")
    parser.add_argument("--record", default="", help="also write the figures (JSON) here, with the sitting")
    parser.add_argument("--show", default="", help="print the tables of records written by --record (comma-separated:"
                                                   " a column each), and exit")
    cli = parser.parse_args(argv)
    if cli.show:
        print(show([json.load(open(path)) for path in cli.show.split(",")]))
        return
    if not (cli.sft_path and cli.rm_path):
        parser.error("--sft_path and --rm_path are needed (or --show RECORD)")
    if cli.repeats < 1:
        parser.error(f"--repeats {cli.repeats}: at least 1")
    record = {**sitting(cli), "command": " ".join(["python", os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "weights_sha256": {"sft": weights_hash(cli.sft_path), "rm": weights_hash(cli.rm_path)}}
    result = measure(cli)
    print(show([result]))
    if cli.record:
        with open(cli.record, "w") as f:
            json.dump({**record, **result}, f, indent=1)
        print(f"record: {cli.record}")


if __name__ == "__main__":
    main()
