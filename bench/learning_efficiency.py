"""When do macro actions help? PPO (n=1) against MA-PPO over seeds, one named hypothesis at a time
(the paper's Fig. 1-2 claim: MA-PPO reaches PPO's final reward 1.7-2x faster).

    python bench/learning_efficiency.py baseline          # PPO vs MA-PPO n=5, 5 seeds, 120 iterations
    python bench/learning_efficiency.py sigma             # H1: equal / first / unit / position
    python bench/learning_efficiency.py all               # every hypothesis, in the order below
    python bench/learning_efficiency.py report            # tables from the committed results only
    python bench/learning_efficiency.py baseline --quick  # the same in miniature (2 seeds x 12 iterations)
    python bench/learning_efficiency.py sigma --jobs 2    # two runs at a time, one thread each

`--jobs 2` on 2 cores finished whole runs 1.2-1.5x faster than one run at a time on two threads (1.6x
on short runs); a run's numbers do not depend on its thread count.

Hypotheses (issue 11): mean (the released code's macro reward vs PPO with beta/n), sigma (H1 credit
leak), lambda (H2 effective lambda), critic (H3 RM-initialised critic), lr (H4 learning rate),
length and termination (H5), code and count (H6: the execution-reward code task; counting, whose
answers are 2-3x longer and whose gold judge reads the whole response).

Every run is a real `ppo.py` subprocess in runs/study/<config>/seed<k>/ (resumed from its checkpoint
if interrupted). When a run finishes, a small record goes to docs/study/runs/<config>/seed<k>.json:
its evaluation rows (held-out RM / gold score every --eval_every iterations, KL, L2 norms) and the
per-prompt scores of its final policy on --win_prompts held-out prompts under one sampling seed.
A configuration whose record exists is never run again, so a later session continues the study
from the committed records. The report reads only those records:
- final held-out scores: mean and a 95% t-interval over seeds;
- steps to parity: the iterations PPO needs to reach its own final score (seed-mean curve, trailing
  mean over --smooth evaluations), against the iterations this configuration needs to reach that
  score; a 95% bootstrap interval over seeds (resampled with replacement, both arms); "never" when
  the curve does not get there, and the share of bootstrap draws where it never does;
- win rate against PPO: per-prompt comparisons of final policies (same prompts, same seed),
  pooled over seeds, ties half, with a 95% bootstrap interval over seeds (gold score; on the code
  task, passing the tests);
- where a change applies to both methods (critic, lr: PARTNERS), each MA-PPO configuration paired by
  seed with PPO under the same change: the gap in first-half mean score and the win rate.
"""
import argparse
import concurrent.futures
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import evaluate  # noqa: E402

PPO = ("n1", "PPO (n=1)", ["--n", "1"])
MA5 = ("n5", "MA-PPO (n=5)", ["--n", "5"])
HYPOTHESES = {
    "baseline": ("Does MA-PPO (n=5, the paper's defaults) learn faster than PPO?", [PPO, MA5]),
    "mean": ("The released code's macro reward (`--reward_agg mean`: KL averaged per macro action, score whole) "
             "against PPO with beta/5: is its gain only a weaker KL penalty?",
             [PPO, MA5, ("n5_mean", "MA-PPO (n=5, agg=mean)", ["--n", "5", "--reward_agg", "mean"]),
              ("n1_beta_div5", "PPO (n=1, beta/5)", ["--n", "1", "--beta", "0.01"])]),
    "sigma": ("H1 credit leak: V(omega) from values inside omega (equal, unit, position) or where it begins (first)",
              [PPO, MA5] + [(f"n5_sigma_{s}", f"MA-PPO (n=5, sigma={s})", ["--n", "5", "--sigma", s])
                            for s in ("first", "unit", "position")]),
    "lambda": ("H2 effective lambda: is the macro effect a reparametrised GAE lambda?",
               [PPO, MA5, ("n1_lam0.99", "PPO (lam=0.99)", ["--n", "1", "--lam", "0.99"]),
                ("n1_lam1", "PPO (lam=1)", ["--n", "1", "--lam", "1.0"]),
                ("n5_lam0.774", "MA-PPO (n=5, lam=0.95^5)", ["--n", "5", "--lam", "0.7738"]),
                ("n5_lam1", "MA-PPO (n=5, lam=1)", ["--n", "5", "--lam", "1.0"])]),
    "critic": ("H3 critic init: the RM (dense shaping for PPO at the start) or the SFT model with a fresh head",
               [PPO, MA5, ("n1_critic_sft", "PPO (critic from SFT)", ["--n", "1", "--critic_path", "{sft}"]),
                ("n5_critic_sft", "MA-PPO (n=5, critic from SFT)", ["--n", "5", "--critic_path", "{sft}"])]),
    "lr": ("H4 learning rate: each method at its best of a small grid",
           [PPO, MA5] + [(f"n{n}_lr{lr}", f"{'PPO' if n == 1 else 'MA-PPO (n=5)'} lr={lr}",
                          ["--n", str(n), "--policy_lr", lr, "--critic_lr", clr])
                         for lr, clr in (("1e-4", "3e-4"), ("3e-5", "1e-4")) for n in (1, 5)]),
    "length": ("H5 macro length n", [PPO] + [(f"n{n}", f"MA-PPO (n={n})", ["--n", str(n)]) for n in (2, 3)]
               + [MA5, ("n10", "MA-PPO (n=10)", ["--n", "10"]), ("n0", "MA-PPO (whole response)", ["--n", "0"])]),
    "termination": ("H5 termination", [PPO, MA5] + [(f"term_{t}", f"MA-PPO ({t})", ["--termination", t])
                                                     for t in ("randomized", "parsing", "ppl", "entropy")]),
    "code": ("H6 horizon: the code task (execution reward, longer responses)",
             [("code_n1", "PPO (n=1)", ["--task", "code", "--n", "1"]),
              ("code_n10", "MA-PPO (n=10)", ["--task", "code", "--n", "10"])]),
    "count": ("H6 horizon: the count task (20-60 token answers; the gold judge reads the whole response)",
              [("count_n1", "PPO (n=1)", ["--task", "count", "--n", "1"]),
               ("count_n5", "MA-PPO (n=5)", ["--task", "count", "--n", "5"]),
               ("count_n10", "MA-PPO (n=10)", ["--task", "count", "--n", "10"])]),
    "count_critic": ("H6 on count with H3's control: is MA-PPO's head start horizon, or the RM critic's noise?",
                     [("count_n1", "PPO (n=1)", ["--task", "count", "--n", "1"]),
                      ("count_n5", "MA-PPO (n=5)", ["--task", "count", "--n", "5"]),
                      ("count_n1_critic_sft", "PPO (critic from SFT)", ["--task", "count", "--n", "1", "--critic_path", "{sft}"]),
                      ("count_n5_critic_sft", "MA-PPO (n=5, critic from SFT)",
                       ["--task", "count", "--n", "5", "--critic_path", "{sft}"])]),
}
# The fair opponent of these is PPO under the same change, not default PPO: the report pairs them by seed.
PARTNERS = {"n5_critic_sft": "n1_critic_sft", "n5_lr1e-4": "n1_lr1e-4", "n5_lr3e-5": "n1_lr3e-5",
            "count_n5_critic_sft": "count_n1_critic_sft"}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
KEPT = ("step", "eval/rm", "eval/gold", "eval/exec", "eval/pass@1", "reward/rm", "reward/exec", "kl",
        "adv/l2", "q/l2", "adv/l2_macro", "q/l2_macro", "macro/mean_len", "response/len")


# ---------------------------------------------------------------- statistics (tested in tests/test_study.py)

def t_interval(values):
    """(mean, half-width of the 95% t-interval); half-width nan for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, T_975.get(n - 1, 1.96) * sd / math.sqrt(n)


def smoothed(values, window):
    """Trailing mean over `window` points (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def mean_curve(runs, metric):
    """Seed-mean curve (steps, values) on the steps every run logged `metric` at."""
    per_run = [{r["step"]: r[metric] for r in rows if metric in r} for rows in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    return steps, [sum(p[s] for p in per_run) / len(per_run) for s in steps]


def first_half_mean(rows, metric):
    """Mean of a run's evaluations of `metric` in the first half of its iterations (the area under the early
    curve: how fast it learns before both methods saturate)."""
    last = rows[-1]["step"]
    values = [r[metric] for r in rows if metric in r and r["step"] <= last / 2]
    return sum(values) / len(values)


def steps_to_parity(baseline, other, window):
    """(steps, values) curves -> (steps the baseline needs to reach its final smoothed score, steps
    `other` needs to reach that score or None)."""
    b, o = smoothed(baseline[1], window), smoothed(other[1], window)
    target = b[-1]
    b_at = next(s for s, v in zip(baseline[0], b) if v >= target)
    o_at = next((s for s, v in zip(other[0], o) if v >= target), None)
    return b_at, o_at


def bootstrap_parity(base_runs, runs, metric, window, draws=2000, seed=0):
    """Point estimate and 95% bootstrap interval (over seeds, both arms resampled) of the steps
    `runs` needs to reach the baseline's final score; `never` is the share of draws that never do."""
    rng = random.Random(seed)
    point = steps_to_parity(mean_curve(base_runs, metric), mean_curve(runs, metric), window)
    samples = []
    for _ in range(draws):
        b = [rng.choice(base_runs) for _ in base_runs]
        o = [rng.choice(runs) for _ in runs]
        samples.append(steps_to_parity(mean_curve(b, metric), mean_curve(o, metric), window)[1])
    reached = sorted(s for s in samples if s is not None)
    never = 1 - len(reached) / draws

    def pct(q):        # percentiles over all draws, "never" counting as the largest value
        k = min(draws - 1, int(q * draws))
        return reached[k] if k < len(reached) else None
    return {"ppo_steps": point[0], "steps": point[1], "low": pct(0.025), "high": pct(0.975), "never": never}


def per_seed_wins(base_runs, runs, key):
    """[(wins, ties, n)] of `runs`' final per-prompt `key` scores against the same seed's baseline run."""
    by_seed = {r["seed"]: r for r in base_runs}
    rows = []
    for r in runs:
        if r["seed"] in by_seed:
            a, b = r["final"][key], by_seed[r["seed"]]["final"][key]
            rows.append((sum(x > y for x, y in zip(a, b)), sum(x == y for x, y in zip(a, b)), len(a)))
    return rows


def paired_gap(base_runs, runs, metric):
    """First-half mean of `metric`, this run minus the same seed's baseline run: (mean, 95% t half-width)."""
    by_seed = {r["seed"]: r for r in base_runs}
    return t_interval([first_half_mean(r["rows"], metric) - first_half_mean(by_seed[r["seed"]]["rows"], metric)
                       for r in runs if r["seed"] in by_seed])


def bootstrap_win_rate(per_seed, draws=2000, seed=0):
    """per_seed: [(wins, ties, n)] -> win rate pooled over seeds, 95% bootstrap interval over seeds."""
    rng = random.Random(seed)

    def rate(rows):
        n = sum(r[2] for r in rows)
        return (sum(r[0] for r in rows) + 0.5 * sum(r[1] for r in rows)) / n if n else float("nan")
    values = sorted(rate([rng.choice(per_seed) for _ in per_seed]) for _ in range(draws))
    return rate(per_seed), values[int(0.025 * draws)], values[min(draws - 1, int(0.975 * draws))]


# ---------------------------------------------------------------- runs

def record_path(args, name, seed):
    return os.path.join(args.results_dir, "runs", name, f"seed{seed}.json")


def final_scores(args, run_dir, task):
    """Per-prompt scores of a run's final policy on the held-out prompts, one sampling seed."""
    eval_args = evaluate.EvalArgs(task=task, n_prompts=args.win_prompts, seed=args.seed_eval,
                                  output_dir=os.path.join(run_dir, "eval"), sft_path=args.models[task][0],
                                  rm_path=args.models[task][1])
    ctx = evaluate.Context(eval_args)
    policy = os.path.join(run_dir, "policy")
    if ctx.code:
        rows = evaluate.passk_samples(ctx, policy, 1)
        return {"exec_pass": [r["correct"] for r in rows]}
    texts = ctx.responses(policy)
    return {"rm": [round(x, 4) for x in ctx.rm_scores(texts)], "gold": [round(x, 4) for x in ctx.gold(texts)]}


def scores_of(base):
    """(score, second score) of a hypothesis whose first configuration is `base`: the score each trains on first."""
    if base.startswith("code"):
        return "eval/exec", "eval/pass@1"
    return ("eval/gold", "eval/rm") if base.startswith("count") else ("eval/rm", "eval/gold")


def is_ppo(flags):
    return "--n" in flags and flags[flags.index("--n") + 1] == "1"


def task_of(flags):
    return flags[flags.index("--task") + 1] if "--task" in flags else "chitchat"


def train(args, name, flags, seed):
    """One ppo.py run, or its committed record; returns the record."""
    path = record_path(args, name, seed)
    if os.path.exists(path):
        return json.load(open(path))
    if args.report_only:
        return None
    task = task_of(flags)
    sft_path, rm_path = args.models[task]
    flags = [f.format(sft=sft_path) for f in flags]
    run_dir = os.path.join(args.runs_dir, name, f"seed{seed}")
    cmd = [sys.executable, "ppo.py", "--seed", str(seed), "--steps", str(args.steps), "--eval_every",
           str(args.eval_every), "--n_eval_prompts", str(args.n_eval_prompts), "--output_dir", run_dir,
           "--sft_path", sft_path, "--rm_path", rm_path, *shlex.split(args.ppo_args), *flags]
    if task in ("code", "count"):
        cmd += shlex.split(getattr(args, f"{task}_args"))
    done = os.path.join(run_dir, "policy", "config.json")
    if not os.path.exists(done) and os.path.exists(os.path.join(run_dir, "checkpoint", "policy", "config.json")):
        cmd.append("--resume")
    t0 = time.time()
    if not os.path.exists(done):
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "log.txt"), "a") as log:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            sys.exit(f"error: {shlex.join(cmd)} failed (exit {proc.returncode}); see {run_dir}/log.txt. "
                     "Run the study again to continue from its checkpoint.")
    rows = evaluate.read_metrics(run_dir)
    record = {"config": name, "seed": seed, "flags": flags, "steps": args.steps, "seconds": round(time.time() - t0),
              "rows": [{k: r[k] for k in KEPT if k in r} for r in rows if any(k.startswith("eval/") for k in r)],
              "final": final_scores(args, run_dir, task)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    last = record["rows"][-1]
    print(f"[study] {name} seed {seed}: {record['seconds']} s, " + ", ".join(
        f"{k} {last[k]:.3f}" for k in ("eval/rm", "eval/gold", "eval/exec") if k in last), flush=True)
    return record


def _one_job_threads(threads):
    """Worker initializer: every ppo.py this worker starts (and its own evaluation) uses `threads` threads."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    torch.set_num_threads(threads)


def train_all(args, todo):
    """Run the (name, flags, seed) configurations that have no record yet, `args.jobs` at a time."""
    todo = [t for t in todo if not os.path.exists(record_path(args, t[0], t[2]))]
    if args.report_only or not todo:
        return
    if args.jobs == 1:
        for name, flags, seed in todo:
            train(args, name, flags, seed)
        return
    for task, (sft_path, rm_path) in args.models.items():     # the first run of a task builds its SFT/RM: alone
        first = next((t for t in todo if task_of(t[1]) == task), None)
        needed = [sft_path] + ([] if task == "code" else [rm_path])
        if first and not all(os.path.exists(os.path.join(ROOT, p, "config.json")) for p in needed):
            train(args, *first)
            todo.remove(first)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with concurrent.futures.ProcessPoolExecutor(args.jobs, initializer=_one_job_threads, initargs=(threads,)) as pool:
        for future in concurrent.futures.as_completed([pool.submit(train, args, *t) for t in todo]):
            future.result()                      # a failed run stops the study (its checkpoint is kept)


# ---------------------------------------------------------------- report

def fmt(mean, half):
    return f"{mean:.3f} ± {half:.3f}" if half == half else f"{mean:.3f}"


def fmt_parity(p):
    if p is None:
        return "-"
    steps = p["steps"] if p["steps"] is not None else "never"
    low, high = p["low"] or "never", p["high"] or "never"
    return f"{p['ppo_steps']} / {steps} [{low}, {high}]" + (f", never {p['never']:.0%}" if p["never"] else "")


def report(args, hypothesis, records):
    """records {config: [record per seed]} -> (markdown lines, json)."""
    question, configs = HYPOTHESES[hypothesis]
    base = configs[0][0]
    code = base.startswith("code")
    score, second = scores_of(base)
    win_key = "exec_pass" if code else "gold"
    lines = [f"### {hypothesis}: {question}", "",
             f"| configuration | seeds | final {score} | final {second} | KL | first-half mean {score} | steps to PPO's "
             f"final {score}: PPO / this [95% CI] | same for {second} | win rate vs PPO [95% CI] |", "|---" * 9 + "|"]
    result = {}
    for name, label, _ in configs:
        runs = [r for r in records.get(name, []) if r]
        if not runs:
            lines.append(f"| {label} | 0 | not run yet | | | | | | |")
            continue
        rows = [r["rows"] for r in runs]
        finals = {m: t_interval([rr[-1][m] for rr in rows]) for m in (score, second, "kl") if m in rows[0][-1]}
        early = t_interval([first_half_mean(rr, score) for rr in rows])    # learning speed before saturation
        base_runs = [r for r in records.get(base, []) if r]
        parity = {m: bootstrap_parity([r["rows"] for r in base_runs], rows, m, args.smooth)
                  for m in (score, second) if base_runs and name != base and m in rows[0][-1]}
        per_seed = per_seed_wins(base_runs, runs, win_key) if name != base else []
        win = bootstrap_win_rate(per_seed) if per_seed else None
        result[name] = {"label": label, "seeds": [r["seed"] for r in runs], "final": finals, "first_half": early,
                        "parity": parity,
                        "gold_win_rate_vs_ppo": win}
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(fmt(*finals[m]) if m in finals else "-"
                                                                 for m in (score, second, "kl"))
                     + f" | {fmt(*early)} | {fmt_parity(parity.get(score))} | {fmt_parity(parity.get(second))} | "
                     + (f"{win[0]:.1%} [{win[1]:.1%}, {win[2]:.1%}]" if win else "-") + " |")
    pairs = [(name, PARTNERS.get(name, base), label) for name, label, flags in configs
             if name != base and not is_ppo(flags)] if any(c[0] in PARTNERS for c in configs) else []
    if pairs:
        lines += ["", f"Paired by seed with PPO under the same change: first-half mean {score}, this minus that "
                  f"PPO (95% t-interval), and the {win_key} win rate of the final policies against it.", "",
                  "| configuration | against | seeds | first-half mean gap | win rate [95% CI] |", "|---" * 5 + "|"]
        labels = {name: label for name, label, _ in configs}
        for name, partner, label in pairs:
            runs, others = ([r for r in records.get(k, []) if r] for k in (name, partner))
            per_seed = per_seed_wins(others, runs, win_key)
            if not per_seed:
                continue
            gap, win = paired_gap(others, runs, score), bootstrap_win_rate(per_seed)
            result[name]["paired"] = {"against": partner, "seeds": len(per_seed), "first_half_gap": gap,
                                      "win_rate": win}
            lines.append(f"| {label} | {labels[partner]} | {len(per_seed)} | {fmt(*gap)} | "
                         f"{win[0]:.1%} [{win[1]:.1%}, {win[2]:.1%}] |")
    return lines, result


def plot(args, hypothesis, records):
    _, configs = HYPOTHESES[hypothesis]
    groups = {label: [r["rows"] for r in records.get(name, []) if r] for name, label, _ in configs}
    if not all(groups.values()):                 # pictures of finished hypotheses only
        return None
    base = configs[0][0]
    metrics = [*scores_of(base)] + ([] if base.startswith(("code", "count")) else ["adv/l2_macro", "q/l2_macro"])
    png = os.path.join(args.results_dir, f"{hypothesis}.png")
    evaluate.plot_curves(groups, metrics, png)
    return png


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hypotheses", nargs="*", default=["baseline"],
                        help=f"which: {', '.join(HYPOTHESES)}, `all`, or `report` (tables from committed results)")
    parser.add_argument("--seeds", default="1,2,3,4,5", help="training seeds (every configuration gets all of them)")
    parser.add_argument("--steps", type=int, default=120, help="PPO iterations per run")
    parser.add_argument("--eval_every", type=int, default=10, help="held-out evaluation interval (iterations)")
    parser.add_argument("--n_eval_prompts", type=int, default=128, help="held-out prompts per evaluation")
    parser.add_argument("--win_prompts", type=int, default=256, help="held-out prompts scored for the final win rates")
    parser.add_argument("--smooth", type=int, default=3, help="trailing mean over this many evaluations for parity")
    parser.add_argument("--ppo_args", default="", help="extra ppo.py flags for every run, e.g. '--policy_lr 1e-4'")
    parser.add_argument("--code_args", default="--sft_args '--max_steps 200' --steps 80 --policy_lr 1e-4",
                        help="extra ppo.py flags for the code task's runs (after --steps, so they win)")
    parser.add_argument("--count_args", default="--reward gold --policy_lr 1e-4 --critic_lr 3e-4",
                        help="extra ppo.py flags for the count task's runs (the gold judge is the reward: its RM is weak)")
    parser.add_argument("--sft_path", default="runs/chitchat/sft", help="SFT model (built by ppo.py if missing)")
    parser.add_argument("--rm_path", default="runs/chitchat/rm", help="reward model (built by ppo.py if missing)")
    parser.add_argument("--seed_eval", type=int, default=4321, help="sampling seed of the final per-prompt scores")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets cores / jobs threads)")
    parser.add_argument("--quick", action="store_true", help="2 seeds x 12 iterations, small evaluations")
    parser.add_argument("--results_dir", default="", help="committed records and tables (default docs/study)")
    parser.add_argument("--runs_dir", default="", help="run folders (default runs/study)")
    args = parser.parse_args(argv)
    names = list(HYPOTHESES) if "all" in args.hypotheses else [h for h in args.hypotheses if h != "report"]
    args.report_only = "report" in args.hypotheses
    if args.report_only and not names:
        names = list(HYPOTHESES)
    unknown = [h for h in names if h not in HYPOTHESES]
    if unknown:
        parser.error(f"unknown hypothesis {unknown[0]!r}; choose from {', '.join(HYPOTHESES)}, all, report")
    if args.quick:
        args.seeds, args.steps, args.eval_every, args.n_eval_prompts, args.win_prompts, args.smooth = "1,2", 12, 4, 32, 64, 1
        args.code_args = "--sft_args '--max_steps 60' --steps 12"
        args.count_args = "--reward gold --sft_args '--max_steps 60' --rm_args '--max_steps 30' --steps 12"
        if not os.path.exists(os.path.join(ROOT, args.sft_path, "config.json")):    # small models of its own
            args.sft_path, args.rm_path = "runs/study_quick/sft", "runs/study_quick/rm"
            args.ppo_args += " --sft_args '--max_steps 120' --rm_args '--max_steps 60'"
    args.results_dir = args.results_dir or ("runs/study_quick/results" if args.quick else "docs/study")
    args.runs_dir = args.runs_dir or ("runs/study_quick" if args.quick else "runs/study")
    args.models = {"chitchat": (args.sft_path, args.rm_path), "code": ("runs/code/sft", "runs/code/rm"),
                   "count": ("runs/count/sft", "runs/count/rm")}
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"[study] {vars(args)}", flush=True)
    todo = [(name, flags, seed) for h in names for name, _, flags in HYPOTHESES[h][1] for seed in seeds]
    train_all(args, list(dict.fromkeys((n, tuple(f), s) for n, f, s in todo)))
    lines, result = [], {}
    for hypothesis in names:
        records = {name: [train(args, name, flags, seed) for seed in seeds] for name, _, flags in HYPOTHESES[hypothesis][1]}
        h_lines, result[hypothesis] = report(args, hypothesis, records)
        png = plot(args, hypothesis, records)
        lines += h_lines + (["", f"![{hypothesis}]({os.path.basename(png)})"] if png else []) + [""]
    os.makedirs(args.results_dir, exist_ok=True)
    stem = "study" if len(names) == len(HYPOTHESES) else "study_" + "_".join(names)
    with open(os.path.join(args.results_dir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.results_dir, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
