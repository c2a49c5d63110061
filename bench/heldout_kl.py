"""The study's KL measured again after the runs, on held-out prompts: each final policy's per-sequence KL from the
SFT model on the very replies its final scores were judged on.

    python bench/heldout_kl.py real_kl10                  # from the repository root: every committed run of real_kl10
    python bench/learning_efficiency.py report            # its tables then read the held-out KL beside run_kl

The study matches and fits on run_kl: the mean per-sequence KL of the training batches of a run's last iterations
(16 samples an iteration on the real model). This reads the KL where the scores are read instead. For one run it
samples the final scoring's replies again (learning_efficiency.final_eval_args: the held-out prompts, the sampling
seed, the prompt format, the record's thread count; as evaluate.sample_responses makes them), checks that they
are those replies (their RM and gold scores equal the record's, prompt by prompt, and the SFT / RM folders hash as
the record says), and scores each reply under the policy and under the SFT model at the sampling temperature, as
ppo.py's step 2 does:

    KL(x) = sum over the reply's tokens of  log pi(y_t | x, y_<t) - log pi_sft(y_t | x, y_<t)

With replies sampled from the policy, each KL(x) is an unbiased estimate of the sequence KL at prompt x (one reply
can give a negative value; their mean estimates a KL, which is never below 0). The per-prompt values go to
docs/study/runs/<config>/seed<k>.heldout_kl.json beside the run's record (which stays as it was written), with
the commit and command that measured them, the hashes of the record, the replies and the folders, and the
sampling settings. A run whose file exists is skipped; the report refuses one whose record has changed since.
"""
import argparse
import hashlib
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import data  # noqa: E402
import evaluate  # noqa: E402
import learning_efficiency as study  # noqa: E402
from ppo import response_logprobs  # noqa: E402


def sidecar_path(args, name, seed):
    return os.path.join(args.results_dir, "runs", name, f"seed{seed}.heldout_kl.json")


@torch.no_grad()
def heldout_kl(ctx, policy, sft, seed, chunk=256):
    """(per-prompt KL of `policy` from `sft`, the replies) on ctx's held-out prompts: the replies sampled as
    evaluate.sample_responses samples them (one seed, then `chunk` prompts per generate call), the KL summed over
    each reply's tokens (its EOS included, the padding after it not) at ctx's sampling temperature."""
    a, kls, texts = ctx.args, [], []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for i in range(0, len(ctx.prompts), chunk):
            p_ids, p_mask, r_ids, r_mask, _ = data.sample(policy, ctx.tokenizer, ctx.prompts[i:i + chunk],
                                                          a.max_prompt_len, a.max_response_len, a.temperature)
            texts += ctx.tokenizer.batch_decode(r_ids, skip_special_tokens=True)
            ids, mask, width = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), p_ids.shape[1]
            logp, _ = response_logprobs(policy, ids, mask, width, a.temperature)
            ref_logp, _ = response_logprobs(sft, ids, mask, width, a.temperature)
            kls += ((logp - ref_logp) * r_mask).sum(-1).tolist()
    return kls, texts


def refuse(config, seed, why):
    sys.exit(f"error: {config.name} seed {seed}: {why}")


def measure(args, config, seed):
    """The held-out KL of one committed run, written beside its record; returns the sidecar's content. It refuses
    a run whose replies, sampled again, do not score as its record's final scores did (every judge, prompt by
    prompt), or whose SFT / RM folders are not the ones its record names."""
    record = study.committed_record(args, config.name, seed)
    if config.task == "code":
        refuse(config, seed, "the code task's final scores run code, not a judge of replies sampled once")
    run_dir = os.path.join(args.runs_dir, config.name, f"seed{seed}")
    policy_path = os.path.join(run_dir, "policy")
    if not os.path.exists(os.path.join(policy_path, "config.json")):
        refuse(config, seed, f"no final policy at {policy_path} (its record is committed, its run folder is not): "
                             "the held-out KL needs the policy itself")
    if record.get("threads"):
        torch.set_num_threads(record["threads"])               # as the final scores were sampled
    found = study.provenance(args, args.models[config.models_key])      # after: its `threads` is what measured
    for name in ("sft_hash", "rm_hash"):
        if record.get(name) and found[name] != record[name]:
            refuse(config, seed, f"its record's {name} is {record[name][:8]}, the folder here {str(found[name])[:8]}: "
                                 "another model build than the run's")
    ctx = evaluate.Context(study.final_eval_args(args, run_dir, config))
    judged = [k for k in ("rm", "gold") if k in record["final"]]
    if len(ctx.prompts) != len(record["final"][judged[0]]):
        refuse(config, seed, f"its record scored {len(record['final'][judged[0]])} prompts, --win_prompts gives "
                             f"{len(ctx.prompts)} here")
    kls, texts = heldout_kl(ctx, ctx.model(policy_path), ctx.model("sft"), args.seed_eval)
    for key in judged:
        scored = [round(x, 4) for x in (ctx.gold(texts) if key == "gold" else ctx.rm_scores(texts))]
        bad = [i for i, (x, y) in enumerate(zip(scored, record["final"][key])) if x != y]
        if bad:
            refuse(config, seed, f"the replies sampled again are not the ones its record scored (prompt {bad[0]}: "
                                 f"{key} {scored[bad[0]]} here, {record['final'][key][bad[0]]} in the record): another "
                                 "policy folder or sampling setting than the run's")
    a = ctx.args
    sidecar = {"config": config.name, "seed": seed, "kl": [round(x, 4) for x in kls], "n_prompts": len(kls),
               "record_sha256": study.record_digest(args, config.name, seed), "replies_checked_by": judged,
               "replies_sha256": hashlib.sha256(json.dumps(texts).encode()).hexdigest(),
               "seed_eval": args.seed_eval, "temperature": a.temperature, "max_response_len": a.max_response_len,
               "policy_hash": study.folder_hash(policy_path), "command": getattr(args, "command", None), **found}
    study.write_record(sidecar_path(args, config.name, seed), sidecar)
    print(f"[heldout_kl] {config.name} seed {seed}: mean held-out KL {sum(kls) / len(kls):.3f} (run_kl "
          f"{study.run_kl(record):.3f}) over {len(kls)} prompts", flush=True)
    return sidecar


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hypotheses", nargs="+", help="the hypotheses whose committed runs to measure (real_kl10)")
    parser.add_argument("--seeds", default="", help="only these seeds (commas); default every committed one")
    parser.add_argument("--configs", default="", help="only these configurations (commas, e.g. "
                        "real_kl10_n5_beta0.077); default every one of the hypotheses")
    parser.add_argument("--win_prompts", type=int, default=256, help="as learning_efficiency.py's (the real model "
                        f"caps it at {study.REAL_WIN_PROMPTS})")
    parser.add_argument("--seed_eval", type=int, default=4321, help="as learning_efficiency.py's: the final scores' "
                        "sampling seed")
    parser.add_argument("--results_dir", default=os.path.join(ROOT, "docs", "study"), help="where the records are")
    parser.add_argument("--runs_dir", default="runs/study", help="the run folders (their policy/)")
    parser.add_argument("--sft_path", default=data.run_dir("chitchat", "sft"), help="the chitchat SFT model, as "
                        "learning_efficiency.py's")
    parser.add_argument("--rm_path", default=data.run_dir("chitchat", "rm"), help="the chitchat reward model, as "
                        "learning_efficiency.py's")
    args = parser.parse_args(argv)
    args.command = " ".join(["python", "bench/heldout_kl.py", *(sys.argv[1:] if argv is None else argv)])
    unknown = [h for h in args.hypotheses if h not in study.HYPOTHESES]
    if unknown:
        parser.error(f"unknown hypothesis {unknown[0]!r}; one of {', '.join(study.HYPOTHESES)}")
    args.jobs = 1
    args.models = {"chitchat": (args.sft_path, args.rm_path),
                   **{task: (data.run_dir(task, "sft"), data.run_dir(task, "rm")) for task in ("code", "count")},
                   "smollm2": study.REAL_MODELS, "smollm2_kl10": study.REAL_KL10_MODELS}
    wanted = {int(s) for s in args.seeds.split(",")} if args.seeds else None
    configs = [c for h in args.hypotheses for c in study.HYPOTHESES[h].configs]
    names = args.configs.split(",") if args.configs else [c.name for c in configs]
    stray = [n for n in names if n not in {c.name for c in configs}]
    if stray:
        parser.error(f"--configs: {stray[0]!r} is not a configuration of {', '.join(args.hypotheses)}; one of "
                     f"{', '.join(c.name for c in configs)}")
    out = []
    for config in (c for c in configs if c.name in names):
        for seed in sorted(study.committed_seeds(args, config.name)):
            if (wanted is None or seed in wanted) and not os.path.exists(sidecar_path(args, config.name, seed)):
                out.append(measure(args, config, seed))
    print(f"[heldout_kl] {len(out)} run(s) measured", flush=True)
    return out


if __name__ == "__main__":
    main()
