"""Learning efficiency: vanilla PPO (n=1) against MA-PPO with identical budgets, over several seeds
(the paper's Fig. 1-2 claim: MA-PPO reaches PPO's final reward 1.7-2x faster).

    python bench/learning_efficiency.py                 # PPO vs MA-PPO n=5, 3 seeds, 120 iterations
    python bench/learning_efficiency.py --quick         # the same in miniature (~5 min)
    python bench/learning_efficiency.py --ns 1,3,5,10 --terminations fixed,ppl --ablation

Every run is a real `ppo.py` subprocess writing runs/study/<config>/seed<k>/metrics.jsonl, with the
held-out RM and gold scores every --eval_every iterations. Finished runs are reused, so an
interrupted study continues where it stopped. The report (study.md, study.json, study.png, and
study_norms.png with the L2 norms of advantages and Q-values, paper Fig. 11) gives:
- final held-out RM / gold score and KL per configuration, mean ± std over the seeds;
- the gold win rate of each MA-PPO configuration against PPO (final policies, same prompts and
  sampling seed, pooled over the seeds; ties count half);
- the steps-to-parity ratio: the iterations PPO needs to reach its own final score (curves averaged
  over seeds, then smoothed by a trailing mean over --smooth evaluations) divided by the
  iterations MA-PPO needs to reach that same score. Above 1 means MA-PPO got there sooner.
--ablation adds the comparison the released code hides: MA-PPO with `--reward_agg mean` (which
divides the macro action's KL penalty by its length) next to PPO with beta divided by n.
"""
import argparse
import itertools
import shlex
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import evaluate  # noqa: E402


def configs(args):
    """[(name, label, ppo.py flags)], PPO first."""
    out = [("n1", "PPO (n=1)", ["--n", "1"])]
    for n, term, sigma, agg in itertools.product(args.ns.split(","), args.terminations.split(","),
                                                 args.sigmas.split(","), args.reward_aggs.split(",")):
        if n == "1" and term == "fixed":
            continue
        extra = [f"{k}={v}" for k, v, default in [("term", term, "fixed"), ("sigma", sigma, "equal"),
                                                  ("agg", agg, "sum")] if v != default]
        out.append((f"n{n}_{term}_{sigma}_{agg}", f"MA-PPO (n={n}{', ' if extra else ''}{', '.join(extra)})",
                    ["--n", n, "--termination", term, "--sigma", sigma, "--reward_agg", agg]))
    if args.ablation:
        n = max(int(x) for x in args.ns.split(","))
        out += [(f"n{n}_mean", f"MA-PPO (n={n}, agg=mean)", ["--n", str(n), "--reward_agg", "mean"]),
                (f"n1_beta_div{n}", f"PPO (n=1, beta/{n})", ["--n", "1", "--beta", str(args.beta / n)])]
    return out


def finished(run_dir, steps):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not (os.path.exists(path) and os.path.exists(os.path.join(run_dir, "policy", "config.json"))):
        return False
    return any(json.loads(line)["step"] == steps for line in open(path))


def train(args, models, name, flags, seed):
    """One ppo.py run (or its reuse); returns its metrics rows."""
    run_dir = os.path.join(args.output_dir, name, f"seed{seed}")
    if finished(run_dir, args.steps):
        print(f"[study] {name} seed {seed}: reusing {run_dir}")
        return evaluate.read_metrics(run_dir)
    cmd = [sys.executable, "ppo.py", *flags, "--seed", str(seed), "--steps", str(args.steps),
           "--eval_every", str(args.eval_every), "--n_eval_prompts", str(args.n_eval_prompts),
           "--beta", str(args.beta), "--output_dir", run_dir, *models, *shlex.split(args.ppo_args)]
    if "--beta" in flags:                                  # the ablation's own beta comes last and wins
        cmd += ["--beta", flags[flags.index("--beta") + 1]]
    if os.path.exists(os.path.join(run_dir, "checkpoint", "policy", "config.json")):
        cmd.append("--resume")
    os.makedirs(run_dir, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed (exit {proc.returncode}); see {run_dir}/log.txt. "
                 "Run the study again to continue from its checkpoint.")
    rows = evaluate.read_metrics(run_dir)
    last = [r for r in rows if "eval/rm" in r][-1]
    print(f"[study] {name} seed {seed}: {time.time() - t0:.0f} s, held-out RM {last['eval/rm']:.3f}"
          + (f", gold {last['eval/gold']:.3f}" if "eval/gold" in last else ""))
    return rows


def smoothed(values, window):
    """Trailing mean over `window` points (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def steps_to_parity(baseline, other, window):
    """(steps, mean) curves -> (steps the baseline needs to reach its final smoothed score, steps
    `other` needs to reach that score or None, their ratio or None)."""
    b_steps, b_mean = baseline
    o_steps, o_mean = other
    b, o = smoothed(list(b_mean), window), smoothed(list(o_mean), window)
    target = b[-1]
    b_at = next(s for s, v in zip(b_steps, b) if v >= target)
    o_at = next((s for s, v in zip(o_steps, o) if v >= target), None)
    return b_at, o_at, (b_at / o_at if o_at else None)


def head_to_head(args, models, base_name, name, seeds):
    """Final policies of `name` vs PPO on the same held-out prompts and sampling seed, pooled over
    seeds: gold and RM verdicts."""
    eval_args = evaluate.EvalArgs(n_prompts=args.win_prompts, seed=args.seed_eval, output_dir=args.output_dir,
                                  sft_path=models[1], rm_path=models[3])
    ctx = evaluate.Context(eval_args)
    verdicts = {"gold": [], "rm": []}
    for seed in seeds:
        a = ctx.responses(os.path.join(args.output_dir, name, f"seed{seed}", "policy"))
        b = ctx.responses(os.path.join(args.output_dir, base_name, f"seed{seed}", "policy"))
        for judge in verdicts:
            verdicts[judge] += ctx.verdicts(judge, a, b)
    return {judge: evaluate.win_rate(v) for judge, v in verdicts.items()}


def report(args, models, runs, labels, seeds, elapsed):
    groups = {labels[name]: rows for name, rows in runs.items()}
    png = os.path.join(args.output_dir, "study.png")
    summary, _ = evaluate.plot_curves(groups, ["eval/rm", "eval/gold"], png)
    norms_png = os.path.join(args.output_dir, "study_norms.png")          # paper Fig. 11
    evaluate.plot_curves(groups, ["adv/l2", "q/l2", "kl"], norms_png)
    base = next(iter(runs))
    result = {"seeds": seeds, "steps": args.steps, "eval_every": args.eval_every, "minutes": elapsed / 60, "configs": {}}
    lines = [f"Held-out scores after {args.steps} iterations, mean ± std over seeds {seeds} "
             f"({args.n_eval_prompts} prompts; study time {elapsed / 60:.1f} min):", "",
             "| configuration | RM score | gold score | KL (nats) | gold win rate vs PPO | RM win rate vs PPO "
             "| steps to PPO's final RM (PPO / this, ratio) | same for gold |", "|---|---|---|---|---|---|---|---|"]
    for name, rows_by_seed in runs.items():
        label, cell = labels[name], {}
        for metric in ("eval/rm", "eval/gold", "kl"):
            _, mean, std = evaluate.aggregate(rows_by_seed, metric)
            cell[metric] = (mean[-1].item(), std[-1].item()) if len(mean) else (float("nan"), float("nan"))
        parity = {}
        for metric in ("eval/rm", "eval/gold"):
            if metric in summary.get(label, {}) and metric in summary.get(labels[base], {}):
                curve = lambda s: (s[metric]["steps"], s[metric]["mean"])  # noqa: E731
                parity[metric] = steps_to_parity(curve(summary[labels[base]]), curve(summary[label]), args.smooth)
        wins = head_to_head(args, models, base, name, seeds) if name != base else None
        result["configs"][label] = {"final": cell, "parity": parity, "vs_ppo": wins}

        def fmt_parity(p):
            return "-" if not p else f"{p[0]} / {p[1] or 'never'}" + (f" ({p[2]:.2f}x)" if p[2] else "")
        lines.append(f"| {label} | " + " | ".join(f"{m:.3f} ± {s:.3f}" for m, s in cell.values())
                     + (f" | {wins['gold']['win_rate']:.1%} | {wins['rm']['win_rate']:.1%}" if wins else " | - | -")
                     + f" | {fmt_parity(parity.get('eval/rm'))} | {fmt_parity(parity.get('eval/gold'))} |")
    lines += ["", f"learning curves: {png}; L2 norms of advantages and Q-values, KL: {norms_png}"]
    with open(os.path.join(args.output_dir, "study.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.output_dir, "study.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", default="1,5", help="macro action lengths (1 = PPO, always included)")
    parser.add_argument("--terminations", default="fixed", help="comma-separated: fixed, randomized, parsing, ppl, entropy")
    parser.add_argument("--sigmas", default="equal", help="comma-separated: equal, unit, position, first")
    parser.add_argument("--reward_aggs", default="sum", help="comma-separated: sum, mean")
    parser.add_argument("--seeds", default="1,2,3", help="training seeds (every configuration gets all of them)")
    parser.add_argument("--steps", type=int, default=120, help="PPO iterations per run")
    parser.add_argument("--eval_every", type=int, default=10, help="held-out evaluation interval (iterations)")
    parser.add_argument("--n_eval_prompts", type=int, default=128, help="held-out prompts per evaluation")
    parser.add_argument("--win_prompts", type=int, default=256, help="held-out prompts for the final win rates")
    parser.add_argument("--smooth", type=int, default=3, help="trailing mean over this many evaluations for parity")
    parser.add_argument("--beta", type=float, default=0.05, help="KL coefficient of every run")
    parser.add_argument("--ablation", action="store_true", help="add MA-PPO with --reward_agg mean and PPO with beta/n")
    parser.add_argument("--ppo_args", default="", help="extra ppo.py flags for every run, e.g. '--policy_lr 1e-4'")
    parser.add_argument("--sft_path", default="runs/chitchat/sft", help="SFT model (built by ppo.py if missing)")
    parser.add_argument("--rm_path", default="runs/chitchat/rm", help="reward model (built by ppo.py if missing)")
    parser.add_argument("--seed_eval", type=int, default=4321, help="sampling seed of the final head-to-head")
    parser.add_argument("--quick", action="store_true", help="2 seeds x 12 iterations, small evaluations (~5 min)")
    parser.add_argument("--output_dir", default="", help="default runs/study (runs/study_quick with --quick)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.eval_every, args.n_eval_prompts, args.win_prompts = "1,2", 12, 4, 32, 64
        args.smooth = 1
        if not os.path.exists(os.path.join(ROOT, args.sft_path, "config.json")):    # small models of its own
            args.sft_path, args.rm_path = "runs/study_quick/sft", "runs/study_quick/rm"
            args.ppo_args += " --sft_args '--max_steps 120' --rm_args '--max_steps 60'"
    args.output_dir = args.output_dir or ("runs/study_quick" if args.quick else "runs/study")
    print(f"[study] {vars(args)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    models = ["--sft_path", args.sft_path, "--rm_path", args.rm_path]
    t0 = time.time()
    runs, labels = {}, {}
    for name, label, flags in configs(args):
        labels[name] = label
        runs[name] = [train(args, models, name, flags, seed) for seed in seeds]
    return report(args, models, runs, labels, seeds, time.time() - t0)


if __name__ == "__main__":
    main()
