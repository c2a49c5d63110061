"""bench/learning_efficiency.py: the study's statistics, checked by hand."""
import argparse
import json
import math
import os
import re
import subprocess
import sys

import numpy
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import learning_efficiency as study  # noqa: E402
import data  # noqa: E402


def ppo_namespace(args):
    """ppo.py's command line `args` parsed as ppo.py parses it (every dataclass of ppo.ARGS), one flat namespace."""
    import argparse
    from transformers import HfArgumentParser
    import harness
    import ppo
    return argparse.Namespace(**harness.config_of(*HfArgumentParser(ppo.ARGS).parse_args_into_dataclasses(args=args)))


def test_t_interval_by_hand():
    mean, half = study.t_interval([1.0, 2.0, 3.0])          # sd 1, n 3: 4.3027 / sqrt(3)
    assert mean == 2.0 and half == pytest.approx(4.3027 / 3 ** 0.5, abs=1e-4)
    assert study.t_interval([5.0])[1] != study.t_interval([5.0])[1]          # nan for one seed


def test_steps_to_parity_by_hand():
    base = ([10, 20, 30, 40], [0.0, 1.0, 2.0, 2.0])          # reaches its final 2.0 at 30
    fast = ([10, 20, 30, 40], [0.0, 2.0, 2.0, 2.0])
    slow = ([10, 20, 30, 40], [0.0, 0.5, 1.0, 1.5])
    assert study.steps_to_parity(base, fast, 1) == (30, 20)
    assert study.steps_to_parity(base, slow, 1) == (30, None)


def test_a_float_tie_with_the_target_reaches_it():
    base = ([10, 20], [0.0, 0.3])
    tie = ([10, 20], [0.0, 0.1 + 0.2])                       # 0.30000000000000004: the same score
    under = ([10, 20], [0.0, 0.3 - 1e-6])
    assert study.steps_to_parity(tie, base, 1) == (20, 20)
    assert study.steps_to_parity(base, under, 1) == (20, None)


def test_mean_curve_keeps_only_the_steps_every_seed_logged():
    runs = [[{"step": 10, "eval/rm": 1.0}, {"step": 20, "eval/rm": 3.0}], [{"step": 20, "eval/rm": 5.0}]]
    assert study.mean_curve(runs, "eval/rm") == ([20], [4.0])


def runs_of(curves):
    return [[{"step": s, "eval/rm": v} for s, v in zip([10, 20, 30], c)] for c in curves]


def test_bootstrap_parity_interval_covers_the_point_and_counts_never():
    base = runs_of([[0, 1, 2], [0, 1, 2]])
    same = study.bootstrap_parity(base, runs_of([[0, 2, 2], [0, 2, 2]]), "eval/rm", 1, draws=200)
    assert same["steps"] == 20 and same["low"] == same["high"] == 20 and same["never"] == 0
    mixed = study.bootstrap_parity(base, runs_of([[0, 3, 3], [0, 0, 0]]), "eval/rm", 1, draws=400)
    assert mixed["ppo_steps"] == 30 and mixed["steps"] is None        # mean curve 0, 1.5, 1.5 < 2
    assert 0.6 < mixed["never"] < 0.9          # reached only when both draws are the good run: ~3/4 never


def final_run(seed, scores):
    return {"seed": seed, "final": {"gold": scores}}


def test_win_rate_is_the_mean_of_each_seeds_rate_with_ties_half():
    ppo = [final_run(1, [0.5] * 10), final_run(2, [0.5] * 10)]
    ma = [final_run(1, [0.9] * 6 + [0.5] * 2 + [0.1] * 2),          # 7 of 10
          final_run(2, [0.9] * 2 + [0.1] * 8)]                      # 2 of 10
    rate, low, high = study.win_rate(ppo, ma, "gold")
    assert rate == pytest.approx(0.45) and low < 0.45 < high
    assert study.win_rate(ppo, ma[:1], "gold") == (pytest.approx(0.7), None, None)     # one seed: no interval


def test_t_quantiles_match_the_tables_and_go_past_ten_degrees_of_freedom():
    """Student's t quantiles to the tables' three decimals, and at 18 degrees of freedom (20 seeds, a fit's two
    parameters) 2.101, where the tables it replaced fell back to the normal's 1.96."""
    for df, t975, t95, t80 in ((1, 12.706, 6.314, 1.376), (3, 3.182, 2.353, 0.978), (5, 2.571, 2.015, 0.920),
                               (10, 2.228, 1.812, 0.879), (18, 2.101, 1.734, 0.862)):
        assert [round(study.t_quantile(p, df), 3) for p in (0.975, 0.95, 0.80)] == [t975, t95, t80]


def crossed_design(rng, seeds=8, prompts=64, d=0.02, sd_seed=0.03, sd_shared=0.15, sd_run=0.4, sd_common=0.3):
    """[seeds, prompts] gaps of a crossed design: MA-PPO minus PPO = d + a seed's own offset + a prompt effect shared
    by every seed + each run's own noise (two runs a seed) + noise the two runs of a seed share (one sampling seed),
    which drops out of the gap. Returns the gaps and the true variance of their grand mean."""
    shared = rng.normal(0, sd_shared, prompts)
    rows = []
    for _ in range(seeds):
        common = rng.normal(0, sd_common, prompts)
        ma, ppo = common + rng.normal(0, sd_run, prompts), common + rng.normal(0, sd_run, prompts)
        rows.append(d + rng.normal(0, sd_seed) + shared + ma - ppo)
    return numpy.array(rows), sd_seed ** 2 / seeds + sd_shared ** 2 / prompts + 2 * sd_run ** 2 / (seeds * prompts)


def test_the_standard_error_counts_prompts_crossed_with_seeds_on_a_design_whose_se_is_known():
    """Over 400 draws of a crossed design (prompts shared by every seed), compare()'s variance averages the true
    variance of the mean gap (within 10%), and its 95% interval covers d about 95% of the time; a seed spread alone
    misses the shared prompt effect (too narrow), and counting each seed's prompt noise again (the seed-then-prompt
    bootstrap it replaces) is too wide."""
    rng = numpy.random.default_rng(11)
    est, covered, seeds_only, twice = [], 0, [], []
    for _ in range(400):
        gaps, true_var = crossed_design(rng)
        c = study.compare([g[None, :] for g in gaps])
        est.append(c["se"] ** 2)
        covered += c["ci95"][0] < 0.02 < c["ci95"][1]
        seeds_only.append(gaps.mean(1).var(ddof=1) / len(gaps))
        twice.append(seeds_only[-1] + gaps.var(ddof=1) / gaps.size)
    assert numpy.mean(est) == pytest.approx(true_var, rel=0.1)
    assert 0.92 < covered / 400 < 0.98
    assert numpy.mean(seeds_only) < 0.75 * true_var and numpy.mean(twice) > 1.2 * true_var


def test_the_prompt_part_is_the_covariance_of_runs_of_different_seeds_by_hand():
    """Two seeds, one gap row each over three prompts: the prompt part is their covariance over prompts over the
    prompts (weights 1/2 each, W = 1); rows that share nothing across seeds give 0, not a negative variance."""
    rows = [[0.1, 0.4, -0.2], [0.3, 0.5, 0.1]]
    cov = numpy.cov(rows)[0, 1]
    assert study.shared_prompt_variance(rows, [1, 2], [0, 0], [0.5, 0.5]) == pytest.approx(cov / 3)
    assert study.shared_prompt_variance([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0]], [1, 2], [0, 0], [0.5, 0.5]) == 0.0
    assert study.shared_prompt_variance(rows, [1, 1], [0, 0], [0.5, 0.5]) == 0.0        # one seed


def test_verdict_words_come_only_from_the_interval_and_the_margin_by_hand():
    """6 seeds: t(5) 2.571 (95%), 2.015 (90%), 1.476 (90%, one-sided power), 0.920 (80% power); margin 0.05."""
    ahead = study.verdict(0.1, 0.02, 6)
    assert ahead["ci95"] == (pytest.approx(0.1 - 2.571 * 0.02, abs=1e-5), pytest.approx(0.1 + 2.571 * 0.02, abs=1e-5))
    assert ahead["verdict"] == "ahead" and ahead["mde"] == pytest.approx((2.571 + 0.920) * 0.02, abs=1e-4)
    assert ahead["mde_level"] == pytest.approx((2.015 + 1.476) * 0.02, abs=1e-4) and ahead["df"] == 5
    assert study.verdict(-0.1, 0.02, 6)["verdict"] == "behind"
    level = study.verdict(0.01, 0.015, 6)                # 90%: 0.01 +- 0.030, inside +-0.05
    assert level["verdict"] == "level" and level["ci90"][1] == pytest.approx(0.01 + 2.015 * 0.015, abs=1e-5)
    assert study.verdict(0.01, 0.03, 6)["verdict"] == "undecided"       # holds 0, reaches past the margin
    assert study.verdict(0.03, 0.005, 6)["verdict"] == "ahead, within the margin"
    assert study.verdict(0.01, float("nan"), 1)["verdict"] == "one seed: no verdict"
    assert study.verdict(0.0, 0.02, 3)["mde"] == pytest.approx((4.303 + 1.061) * 0.02, abs=1e-4)   # fewer seeds
    fit = study.verdict(0.0, 0.02, 6, df=4)             # a fit's two seed-level parameters: t(4)
    assert fit["ci95"][1] == pytest.approx(2.776 * 0.02, abs=1e-5)
    assert study.verdict(0.0, 0.02, 2, df=0)["verdict"] == "no verdict: no degrees of freedom left"
    assert study.detectable_at(study.verdict(0.0, 0.02, 6), 10) == pytest.approx((2.262 + 0.883) * 0.02 * 0.6 ** 0.5,
                                                                                 abs=1e-4)
    # the prompt part of the SE does not shrink with more seeds
    split = study.verdict(0.0, 0.025, 6, se_parts=(0.02, 0.015))
    assert study.detectable_at(split, 24) == pytest.approx(
        (study.t_quantile(0.975, 23) + study.t_quantile(0.8, 23)) * (0.02 ** 2 / 4 + 0.015 ** 2) ** 0.5)


def test_paired_comparison_matches_seeds_and_prompts_by_hand():
    ppo = [final_run(1, [0.5, 0.5, 0.5]), final_run(2, [0.1, 0.9, 0.5])]
    ma = [final_run(2, [0.2, 0.2, 0.5]), final_run(1, [0.9, 0.1, 0.5]), final_run(3, [1, 1, 1])]   # 3: no partner
    units = study.paired_units(ppo, ma, "gold")
    assert [u.tolist() for u in units] == [[[0.1, -0.7, 0.0]], [[0.4, -0.4, 0.0]]]
    assert [u.tolist() for u in study.paired_units(ppo, ma, "gold", win=True)] == [[[1, 0, 0.5]], [[1, 0, 0.5]]]
    c = study.compare(units)
    assert c["mean"] == pytest.approx((-0.2 + 0.0) / 2) and c["seeds"] == 2


def test_the_one_kl_is_the_mean_of_the_last_five_iterations_batches_by_hand():
    record = {"trace": [{"step": s, "kl": float(s)} for s in range(1, 11)],
              "rows": [{"step": 5, "kl": 5.0, "eval/gold": 0.1}, {"step": 10, "kl": 10.0, "eval/gold": 0.2}]}
    assert study.run_kl(record) == 8.0 and study.run_kl(record, 5) == 3.0 and study.run_kl(record, 2) == 1.5
    assert [r["kl"] for r in study.kl_rows(record)] == [3.0, 8.0]
    old = {"rows": record["rows"]}                                  # made before the trace was kept: one batch
    assert study.run_kl(old) == 10.0 and study.run_kl(old, 5) == 5.0 and not study.has_trace(old)


def test_matched_kl_is_decided_per_pair_and_both_ways():
    assert study.kl_matched(1.0, 1.2) and study.kl_matched(1.2, 1.0)
    assert not study.kl_matched(1.0, 1.21) and not study.kl_matched(1.21, 1.0)
    assert not study.kl_matched(-0.1, -0.1) and not study.kl_matched(0.0, 0.0)


def test_the_equal_kl_fit_recovers_a_known_difference_by_hand():
    """Each run's gold = its seed's level + 0.1 log KL - 0.03 for MA-PPO (no noise): the fit returns -0.03 and
    the slope 0.1 exactly, whatever KL each run ended at; a seed with one method only is left out."""
    runs = []
    for seed, level in ((1, 0.4), (2, 0.5), (3, 0.45)):
        for ma, kl in ((False, 0.5), (False, 1.3), (True, 0.7), (True, 2.0)):
            runs.append((seed, ma, kl, [level + 0.1 * math.log(kl) - 0.03 * ma] * 8))
    runs.append((4, False, 1.0, [0.9] * 8))
    fit = study.equal_kl_fit(runs)
    assert fit["mean"] == pytest.approx(-0.03) and fit["slope"] == pytest.approx(0.1)
    assert fit["seeds"] == 3 and fit["runs"] == 12 and fit["se"] == pytest.approx(0, abs=1e-9)
    assert study.equal_kl_fit(runs[:4]) is None                     # one seed: no fit


def test_a_repeated_run_is_counted_once():
    a, b = (1, False, 0.7, [0.1, 0.2]), (1, False, 1.5, [0.1, 0.2])      # the same run under two targets
    assert study.distinct_runs([a, b, (1, True, 0.7, [0.1, 0.2]), (2, False, 0.7, [0.1, 0.2])]) == [
        a, (1, True, 0.7, [0.1, 0.2]), (2, False, 0.7, [0.1, 0.2])]


def test_every_hypothesis_starts_with_its_baseline_and_names_are_unique():
    for name, h in study.HYPOTHESES.items():
        base = h.configs[0]
        assert base.is_ppo and base.flags[:2] == ("--n", "1"), name   # PPO first: the parity baseline
        assert len({c.name for c in h.configs}) == len(h.configs)
        assert len({c.task for c in h.configs}) == 1, name            # one task per comparison
        for c in h.configs:
            n = c.flags[c.flags.index("--n") + 1] if "--n" in c.flags else "5"     # ppo.py's default n is 5
            assert c.is_ppo == (n == "1"), c
            if not c.is_ppo:                                          # a partner is a PPO run on the same task
                partner = next(p for hh in study.HYPOTHESES.values() for p in hh.configs if p.name == c.partner)
                assert partner.is_ppo and partner.task == c.task, c


def test_a_configuration_knows_its_command_line_and_scores():
    count = study.HYPOTHESES["count_critic"].configs[2]
    assert count.argv("runs/count/sft") == ["--task", "count", "--n", "1", "--critic_path", "runs/count/sft"]
    assert count.metrics == ("eval/gold", "eval/rm") and count.win_key == "gold"
    code = study.HYPOTHESES["code"].configs[1]
    assert code.metrics == ("eval/exec", "eval/pass@1") and code.win_key == "exec_pass" and code.partner == "code_n1"
    assert study.HYPOTHESES["baseline"].configs[1].argv("x") == ["--n", "5"]


def test_a_configurations_own_flags_win_over_the_tasks_and_segment_arms_point_at_their_rms():
    """ppo.py parses each run's command line: the count arms' --reward rm beats --count_args' --reward gold,
    the segment arms read the segment / token RMs beside the SFT model, (E) segments at the segment RM's c_ent."""
    from transformers import HfArgumentParser
    import ppo
    args = argparse.Namespace(steps=120, eval_every=10, n_eval_prompts=128, ppo_args="--beta 0.04",
                              count_args="--reward gold --policy_lr 1e-4", code_args="",
                              models={"count": ("runs/count/sft", "runs/count/rm")})
    parsed = {c.name: ppo_namespace(
        args=study.ppo_flags(args, c, 3, "out")) for c in (study.COUNT_PPO,
                                                              *study.HYPOTHESES["segment_count"].configs)}
    a, b, c, d, e, a_norm = (parsed[x.name] for x in study.HYPOTHESES["segment_count"].configs)
    assert parsed[study.COUNT_PPO.name].reward == "gold" and a.reward == e.reward == "rm"
    assert a_norm.rm_norm and not any(x.rm_norm for x in (a, b, c, d, e))      # (A') is (A) with --rm_norm only
    without_norm = (lambda ns: {k: v for k, v in vars(ns).items() if k != "rm_norm"})
    assert without_norm(a_norm) == without_norm(a)
    assert b.reward == c.reward == d.reward == "segment" and a.rm_path == e.rm_path == "runs/count/rm"
    assert b.rm_path == d.rm_path == os.path.join("runs/count", "rm_segment")
    assert c.rm_path == os.path.join("runs/count", "rm_token")
    assert (d.termination, e.termination, b.termination) == ("segment", "segment", "fixed")
    assert e.c_ent == study.SEGMENT_C_ENT["count"] and d.c_ent == 0.0
    assert all(x.critic_path == "runs/count/sft" and x.policy_lr == 1e-4 and x.beta == 0.04 and x.seed == 3
               for x in (a, b, c, d, e))


def test_the_real_model_arms_run_the_recipe_on_their_own_models_and_are_scored_in_its_prompt_format():
    """The real-model configurations train and are scored on the SmolLM2 SFT / RM with the chat template and
    96-token prompts; their own run length beats the study's; `all` leaves them out."""
    from transformers import HfArgumentParser
    import ppo
    args = argparse.Namespace(steps=120, eval_every=10, n_eval_prompts=128, ppo_args="", count_args="", code_args="",
                              win_prompts=256, seed_eval=7, models={"chitchat": ("runs/chitchat/sft",
                                                                                 "runs/chitchat/rm"),
                                                                    "smollm2": ("s/sft", "s/rm")})
    h = study.HYPOTHESES["real"]
    for config in h.configs[1:]:
        parsed = ppo_namespace(
            args=study.ppo_flags(args, config, 2, "o"))
        assert (parsed.sft_path, parsed.rm_path, parsed.task, parsed.chat_template) == ("s/sft", "s/rm", "chitchat",
                                                                                        True)
        assert (parsed.steps, parsed.eval_every, parsed.n_eval_prompts, parsed.max_prompt_len) == (30, 5, 32, 96)
        assert (parsed.lora_r, parsed.reward, parsed.rollout_batch_size) == (16, "gold", 16)
        assert parsed.n == int(config.flag("--n")) and config.flag("--steps") == "30"
        e = study.final_eval_args(args, "o", config)
        assert (e.sft_path, e.rm_path, e.chat_template, e.max_prompt_len, e.n_prompts, e.seed) == (
            "s/sft", "s/rm", True, 96, study.REAL_WIN_PROMPTS, 7)
    assert parsed.sigma == "first" and h.configs[1].partner == h.configs[2].partner == h.configs[0].name
    sft_stage, rm_stage = study.real_model_stages(("s/sft", "s/rm"), "m.gguf")
    import reward_model
    import sft
    sft_args = HfArgumentParser(sft.SFTArgs).parse_args_into_dataclasses(args=sft_stage[1:])[0]
    rm_args = HfArgumentParser(reward_model.RMArgs).parse_args_into_dataclasses(args=rm_stage[1:])[0]
    assert (sft_args.model, sft_args.output_dir, rm_args.sft_path, rm_args.output_dir) == ("m.gguf", "s/sft", "s/sft",
                                                                                           "s/rm")
    assert sft_args.chat_template and rm_args.chat_template and sft_args.max_prompt_len == rm_args.max_prompt_len == 96
    plain = study.final_eval_args(args, "o", study.PPO)
    assert (plain.sft_path, plain.chat_template, plain.max_prompt_len, plain.n_prompts) == ("runs/chitchat/sft", False,
                                                                                            48, 256)
    assert study.PPO.flag("--steps") is None and study.PPO.flag("--steps", 9) == 9


@pytest.mark.parametrize("text, errors", [
    (" 3, 4, 5, 6.", []),
    (" 3, 4, 4, 5, 6.", [(4, 5)]),           # an extra 4 (the judge's alignment marks the first)
    (" 3, 5, 6.", [(2, 4)]),                 # 4 missing: the gap between 3 and 5
    (" 3, 4, 5.", [(8, 9)]),                 # stopped early: the gap after 5, to the end
    (" 3, 4, x, 6.", [(7, 8)]),              # a word where 5 belongs
    (" 2, 3, 4, 5, 6.", [(1, 2)]),           # one too many at the start
])
def test_count_error_spans_by_hand(text, errors):
    prompt = "\n\nHuman: Count from 3 to 6.\n\nAssistant:"
    assert study.count_error_spans(prompt, text) == errors
    assert (data.count_gold([prompt], [text])[0] == 1.0) == (not errors)
    assert study.overlaps((6, 9), [(7, 8)]) and not study.overlaps((0, 7), [(7, 8)])


def test_first_half_mean_averages_the_evaluations_up_to_half_the_run():
    rows = [{"step": s, "eval/rm": v} for s, v in [(10, 1.0), (20, 2.0), (30, 6.0), (40, 100.0)]]
    assert study.first_half_mean(rows, "eval/rm") == 1.5            # steps 10 and 20 of 40
    rows.insert(0, {"step": 5, "kl": 0.1})                          # rows without the metric are skipped
    assert study.first_half_mean(rows, "eval/rm") == 1.5


def test_paired_comparisons_match_seeds_by_hand():
    def run(seed, curve, gold):
        return {"seed": seed, "rows": [{"step": s, "eval/rm": v} for s, v in zip([10, 20, 30, 40], curve)],
                "final": {"gold": gold}}
    ppo = [run(1, [1, 1, 9, 9], [0.5, 0.5, 0.5]), run(2, [2, 2, 9, 9], [0.1, 0.9, 0.5])]
    ma = [run(2, [1, 1, 0, 0], [0.2, 0.2, 0.5]), run(1, [2, 2, 0, 0], [0.9, 0.1, 0.5]), run(3, [5, 5, 5, 5], [1, 1, 1])]
    gap, half = study.paired_gap(ppo, ma, "eval/rm")                             # seed 2: 1 - 2, seed 1: 2 - 1
    assert gap == 0.0 and half == pytest.approx(12.706, abs=1e-3)   # sd sqrt(2) over 2 seeds


def test_report_pairs_configurations_with_their_own_ppo(tmp_path):
    def run(seed, level):
        return {"seed": seed, "rows": [{"step": s, "eval/rm": level, "eval/gold": 0.5, "kl": 1.0,
                                        "macro/mean_len": 1.0 if level != 0.0 else 5.0,
                                        "response/len": 20.0} for s in (10, 20)],
                "final": {"gold": [level] * 4, "rm": [level] * 4}}
    records = {"n1": [run(1, 1.0), run(2, 1.0)], "n5": [run(1, 0.0), run(2, 0.0)],
               "n1_critic_sft": [run(1, 0.0), run(2, 0.0)], "n5_critic_sft": [run(1, 2.0), run(2, 2.0)]}
    args = argparse.Namespace(smooth=1)
    lines, result = study.report(args, "critic", records)
    assert result["n5"]["paired"]["against"] == "n1" and result["n5"]["paired"]["first_half_gap"][0] == -1.0
    assert result["n5_critic_sft"]["paired"]["against"] == "n1_critic_sft"
    assert result["n5_critic_sft"]["paired"]["win_rate"][0] == 1.0                 # 2.0 beats 0.0 on every prompt
    assert result["n5_critic_sft"]["gold_win_rate_vs_ppo"][0] == 1.0                # and default PPO's 1.0
    assert "n1_critic_sft" not in {k for k, v in result.items() if "paired" in v}  # PPO is never paired
    assert sum("| MA-PPO" in line and "| PPO" in line for line in lines) == 2
    assert result["n5"]["early"]["score_at_first"][0] == 0.0 and result["n5"]["early"]["macro_len"][0] == 5.0


def test_count_reports_the_share_of_exact_counts_and_the_sft_line_from_its_record_by_hand(tmp_path):
    def run(seed, golds):
        return {"seed": seed, "rows": [{"step": s, "eval/gold": 0.5, "eval/rm": 0.0, "kl": 1.0,
                                        "macro/mean_len": 1.0, "response/len": 30.0 + seed} for s in (10, 20)],
                "final": {"gold": golds, "rm": golds}}
    records = {"count_n1": [run(1, [1.0, 0.8, 0.6, 1.0])], "count_n5": [run(1, [1.0, 0.2, 0.0, 0.0])]}
    lines, result = study.report(argparse.Namespace(smooth=1), "count", records)
    assert "sft" not in result and not any("The SFT model" in line for line in lines)    # no record: no line
    study.write_record(study.record_path(argparse.Namespace(results_dir=str(tmp_path)), "count_sft", 0),
                       {"config": "count_sft", "final": {"gold": [0.25, 0.5, 1.0, 0.0]}})
    lines, result = study.report(argparse.Namespace(smooth=1, results_dir=str(tmp_path)), "count", records)
    assert result["sft"] == {"final_mean": 0.4375, "record": "count_sft"}
    assert any("mean gold 0.438 (its record: `runs/count_sft/seed0.json`)" in line for line in lines)
    assert result["count_n1"]["early"]["exact"] == 0.5 and result["count_n5"]["early"]["exact"] == 0.25
    assert any(line.startswith("| MA-PPO (n=5) |") and line.endswith("| 1.0 | 31.0 | 25.0% |") for line in lines)
    assert result["count_n1"]["early"]["response_len"][0] == 31.0


def test_the_real_study_reports_its_final_policies_paired_by_seed_by_hand():
    def run(seed, golds):
        return {"seed": seed, "rows": [{"step": s, "eval/gold": 0.5, "eval/rm": 0.0, "kl": 1.0,
                                        "macro/mean_len": 1.0, "response/len": 20.0} for s in (5, 10)],
                "final": {"gold": golds, "rm": golds}}
    records = {"real_n1": [run(1, [0.2, 0.4]), run(2, [0.5, 0.5])],
               "real_n5": [run(2, [0.9, 0.9]), run(1, [0.3, 0.3]), run(3, [0.0, 0.0])],      # seed 3: no partner
               "real_n5_sigma_first": []}
    lines, result = study.report(argparse.Namespace(smooth=1), "real", records)
    assert result["real_n1"]["final_policies"] == {"mean": (0.4, pytest.approx(12.706 * 0.1, abs=1e-4)),
                                                   "gap_vs_ppo": None}
    gap = result["real_n5"]["final_policies"]["gap_vs_ppo"]        # seed 1: 0.3 - 0.3, seed 2: 0.9 - 0.5
    assert (gap["mean"], gap["seeds"]) == (pytest.approx(0.2), 2) and gap["ci95"][0] < 0.2 < gap["ci95"][1]
    assert gap["verdict"] == "no verdict: not at equal KL"         # no KL held: the stored result has no rule word
    assert result["real_n5"]["final_policies"]["mean"][0] == pytest.approx(0.4)
    assert f"| MA-PPO (n=5) | 3 | 0.400 ± 1.138 | +0.200 [{gap['ci95'][0]:+.3f}, {gap['ci95'][1]:+.3f}] | 2 |" in lines
    # by seed: seed 1's policies tie on both prompts, seed 2's win both (0.9 against 0.5); no trace: KLs marked *
    assert "| MA-PPO (n=5) | 1 | 1.00 / 1.00 * | 0.300 / 0.300 | 50.0% |" in lines
    assert "| MA-PPO (n=5) | 2 | 1.00 / 1.00 * | 0.500 / 0.900 | 100.0% |" in lines
    assert "final_policies" not in study.report(argparse.Namespace(smooth=1), "count", {
        "count_n1": [run(1, [1.0])], "count_n5": [run(1, [0.0])]})[1]["count_n5"]       # only where it is asked


def test_fill_blocks_replaces_only_between_its_markers():
    page = "intro\n<!-- study:a -->\nold\n<!-- /study:a -->\nmiddle\n<!-- study:b -->\n<!-- /study:b -->\nend\n"
    filled = study.fill_blocks(page, {"a": ["| x |", ""], "b": ["y"]})
    assert filled == ("intro\n<!-- study:a -->\n| x |\n\n<!-- /study:a -->\nmiddle\n<!-- study:b -->\ny\n"
                      "<!-- /study:b -->\nend\n")
    assert study.fill_blocks(filled, {"a": ["| x |", ""], "b": ["y"]}) == filled          # idempotent


def test_the_study_page_holds_exactly_the_generated_tables():
    """docs/study/README.md's tables are the report's (docs/study/study.md), not typed by hand."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    generated = open(os.path.join(root, "docs", "study", "study.md")).read()
    page = open(os.path.join(root, "docs", "study", "README.md")).read()
    sections = {}
    for part in generated.split("### ")[1:]:
        name = part.split(":", 1)[0]
        sections[name] = part.split("\n", 2)[2].rstrip("\n") + "\n"        # without its heading line
    assert set(sections) == set(study.HYPOTHESES)
    for name, body in sections.items():
        block = page.split(f"<!-- study:{name} -->\n")[1].split(f"<!-- /study:{name} -->")[0]
        assert block == body, name


def test_matched_kl_pairs_each_method_with_ppo_at_its_own_target_by_hand(tmp_path):
    """real_kl: MA-PPO at KL 0.7 against PPO at KL 0.7 (not at 1.5), final KL from the last 5 iterations, the
    SFT row from its record, thresholds reached, and a verdict that says whether the KLs matched."""
    def run(seed, golds, kl, curve):
        return {"seed": seed, "trace": [{"step": s, "kl": 99.0 if s <= 25 else kl, "beta": 0.1} for s in range(1, 31)],
                "rows": [{"step": s, "eval/gold": v, "eval/rm": 0.0, "kl": 1.0, "macro/mean_len": 1.0,
                          "response/len": 20.0} for s, v in zip((10, 20, 30), curve)], "final": {"gold": golds,
                                                                                                 "rm": golds}}
    configs = study.HYPOTHESES["real_kl"].configs
    n1, n5, n1_high, n5_high, n1_beta, n5_beta, *tries = configs
    assert (n5.partner, n5_high.partner, n5_beta.partner) == (n1.name, n1_high.name, n1_beta.name)
    ppo_before = [[p for p in configs[:i] if p.partner is None][-1] for i, c in enumerate(configs) if c.partner]
    assert [c.partner for c in configs if c.partner] == [p.name for p in ppo_before]   # each MA-PPO after its PPO
    low = [c for c in tries if c.partner is None]      # the second level by beta: PPO's beta chosen, above 0.05
    assert all(float(c.flag("--beta")) > float(n1_beta.flag("--beta", "0.05")) for c in low)
    partners = {c.flag("--beta"): {m.flag("--beta") for m in configs if m.partner == c.name} for c in low}
    assert partners == {"0.1": {"0.12"}, "0.08": {"0.09"}}   # MA-PPO near KL 0.5, each with the PPO that matches it
    assert n5.flag("--kl_target") == "0.7" and n5_beta.flag("--kl_target") is None
    assert float(n5_beta.flag("--beta")) > float(n1_beta.flag("--beta", "0.05"))
    records = {n1.name: [run(1, [0.4, 0.4], 0.7, [0.3, 0.4, 0.5]), run(2, [0.6, 0.6], 0.7, [0.3, 0.3, 0.3])],
               n5.name: [run(2, [0.5, 0.5], 0.8, [0.5, 0.6, 0.6]), run(1, [0.5, 0.5], 0.8, [0.6, 0.6, 0.6])],
               n1_high.name: [run(1, [0.0, 0.0], 2.5, [0.0] * 3)], n5_high.name: [run(1, [1.0, 1.0], 4.0, [1.0] * 3)],
               n1_beta.name: [run(1, [0.2, 0.2], 1.0, [0.2] * 3), run(2, [0.4, 0.4], 0.6, [0.4] * 3)],
               n5_beta.name: [run(1, [0.5, 0.5], 0.9, [0.5] * 3), run(2, [0.5, 0.5], 0.8, [0.5] * 3)]}
    study.write_record(study.record_path(argparse.Namespace(results_dir=str(tmp_path)), "real_sft", 0),
                       {"config": "real_sft", "final": {"gold": [0.1, 0.3]}})
    args = argparse.Namespace(smooth=1, results_dir=str(tmp_path), report_only=True)
    lines, result = study.report(args, "real_kl", records)
    m = result[n5.name]["matched_kl"]
    assert m["final_kl"][0] == pytest.approx(0.8) and (m["pairs_matched"], m["pairs"]) == (2, 2)   # last 5: 26-30
    assert m["gap_vs_ppo"]["mean"] == pytest.approx(0.0) and m["gap_vs_ppo"]["seeds"] == 2   # seed 1: +0.1, 2: -0.1
    assert m["reach"] == {"0.4": "10 (2/2)", "0.5": "10 (2/2)", "0.6": "15 (2/2)"}   # median of 10 and 20
    assert result[n1.name]["matched_kl"]["reach"]["0.5"] == "30 (1/2)"
    assert result[n1.name]["matched_kl"]["reach"]["0.6"] == "never (0/2)"
    assert result["sft"]["final_mean"] == pytest.approx(0.2)
    assert result[n5_high.name]["matched_kl"]["gap_vs_ppo"]["mean"] == 1.0          # against PPO at 1.5
    verdicts = [line for line in lines if line.startswith(("- KL ", "- beta "))]
    assert "at matched KL on every pair" in verdicts[0] and verdicts[0].endswith(
        f"level detectable within ±{m['gap_vs_ppo']['mde_level']:.3f}): **{m['gap_vs_ppo']['verdict']}**.")
    assert "NOT at matched KL (0 of 1 pairs within 1.2x)" in verdicts[1] and "one seed: no verdict" in verdicts[1]
    # the beta pair: seed 1 at 1.0 / 0.9 (matched), seed 2 at 0.6 / 0.8 (1.33 apart); gaps +0.3 and +0.1
    b = result[n5_beta.name]["matched_kl"]
    assert b["held_at"] == f"beta {n5_beta.flag('--beta')}" and (b["pairs_matched"], b["pairs"]) == (1, 2)
    assert b["gap_vs_ppo"]["mean"] == pytest.approx(0.2) and b["gap_vs_ppo"]["seeds"] == 2
    assert b["gap_vs_ppo"]["verdict"] == "no verdict: not at equal KL"        # the stored result says so too
    assert verdicts[2].startswith(f"- beta {n5_beta.flag('--beta')} (PPO at beta {n1_beta.flag('--beta')}): "
                                  "final KL 0.85 against PPO's 0.80, NOT at matched KL (1 of 2 pairs within 1.2x)")
    # a pair that ended apart gets its interval and detectable effect, never one of the rules' words
    assert verdicts[2].endswith(f"detectable difference {b['gap_vs_ppo']['mde']:.3f}): **no verdict: not at equal "
                                "KL**, "
                                "at the KLs these runs ended at.")
    assert (f"| {study.held_at(n5_beta)} | {study.held_at(n1_beta)} | 2 | 0.60 / 0.80 | 1.33 | no | 0.400 / 0.500 | "
            "+0.100 |") in lines
    # at equal KL over every run: the matched pairs alone are KL 0.7's two seeds and the beta pair's seed 1
    assert result["equal_kl"]["matched_pairs"]["pairs"] == 3 and result["equal_kl"]["matched_pairs"]["seeds"] == 2
    assert result["equal_kl"]["matched_pairs"]["mean"] == pytest.approx(((0.1 + 0.3) / 2 - 0.1) / 2)
    assert result["equal_kl"]["fit"]["seeds"] == 2
    assert f"| beta {n1_beta.flag('--beta')} | PPO (n=1), beta" in "\n".join(lines)


def test_score_at_kl_reads_the_curve_sorted_by_kl_by_hand():
    """Evaluations sorted by their KL, linear between the two around the point; None outside the KLs evaluated."""
    rows = [{"kl": 1.0, "eval/gold": 0.6}, {"kl": 0.2, "eval/gold": 0.2}, {"kl": 0.6, "eval/gold": 0.4},
            {"kl": 0.4, "eval/rm": 9.0}]
    assert study.score_at_kl(rows, 0.4) == pytest.approx(0.3)          # between (0.2, 0.2) and (0.6, 0.4)
    assert study.score_at_kl(rows, 0.8) == pytest.approx(0.5)
    assert study.score_at_kl(rows, 0.2) == pytest.approx(0.2) and study.score_at_kl(rows, 1.0) == pytest.approx(0.6)
    assert study.score_at_kl(rows, 0.1) is None and study.score_at_kl(rows, 1.5) is None
    assert study.score_at_kl([{"kl": 0.5, "eval/gold": 0.3}, {"kl": 0.5, "eval/gold": 0.7}], 0.5) in (0.3, 0.7)


def test_the_kl_reading_pairs_fixed_beta_and_controlled_runs_by_seed_and_pools_them_by_hand(tmp_path):
    """real_kl's KL table: real_n5 against real_n1 and each controlled MA-PPO against its PPO, paired by seed at
    each KL point where both runs passed through it, and `all` averaging each seed's pairs into one gap per seed."""
    args = argparse.Namespace(smooth=1, results_dir=str(tmp_path), report_only=True)

    def run(seed, points, traced=True):      # the 5 iterations up to each evaluation at its KL: run_kl is that KL
        trace = [{"step": 5 * i - j, "kl": k} for i, (k, _) in enumerate(points, 1) for j in (4, 3, 2, 1, 0)]
        return {"seed": seed,
                "rows": [{"step": 5 * i, "kl": 9.0, "eval/gold": g} for i, (_, g) in enumerate(points, 1)],
                **({"trace": trace} if traced else {})}
    for name, seed, points in (("real_n1", 1, [(0.0, 0.2), (2.0, 0.6)]), ("real_n5", 1, [(0.0, 0.1), (2.0, 0.3)]),
                               ("real_n1", 2, [(0.6, 0.5), (0.8, 0.5)]), ("real_n5", 2, [(0.0, 0.0), (3.0, 0.9)])):
        study.write_record(study.record_path(args, name, seed), run(seed, points))
    n1, n5, *_ = study.HYPOTHESES["real_kl"].configs
    records = {n1.name: [run(1, [(0.4, 0.3), (1.2, 0.5)]), run(2, [(0.0, 0.4), (1.0, 0.4)])],
               n5.name: [run(1, [(0.2, 0.6), (1.6, 0.6)]), run(2, [(0.0, 0.5), (1.0, 0.5)])]}
    result = {}
    lines = study.kl_points_table(args, "real_kl", records, result)
    at = result["at_kl"]
    fixed = "MA-PPO (n=5) vs PPO (n=1), fixed beta"
    assert at[fixed]["0.5"]["pairs"] == 1                                # seed 2: PPO evaluated at 0.6-0.8 only
    assert at[fixed]["0.5"]["gap"][0] == pytest.approx(0.15 - 0.3)     # seed 1: 0.15 against 0.3
    assert at[fixed]["1.0"]["gap"][0] == pytest.approx(0.2 - 0.4) and at[fixed]["1.0"]["pairs"] == 1
    controlled = f"{n5.label} vs {n1.label}"
    assert at[controlled]["0.5"]["gap"][0] == pytest.approx(((0.6 - 0.325) + 0.1) / 2)   # seeds 1 and 2
    assert "1.5" not in at[controlled]                                  # PPO stopped at 1.2
    # `all`: seed 1's two pairs (fixed beta, controlled) averaged into one, then seed 2's: two seeds, not 3 pairs
    assert at["all"]["0.5"]["pairs"] == 2
    assert at["all"]["0.5"]["gap"][0] == pytest.approx((((0.15 - 0.3) + (0.6 - 0.325)) / 2 + 0.1) / 2)
    assert any(line.startswith("| all, one gap per seed | 2, ") for line in lines)
    # the fixed-beta runs recorded without a trace have no run_kl: left out, and the table says so
    for name, seed, points in (("real_n1", 1, [(0.0, 0.2), (2.0, 0.6)]), ("real_n5", 1, [(0.0, 0.1), (2.0, 0.3)])):
        study.write_record(study.record_path(args, name, seed), run(seed, points, traced=False))
    result = {}
    lines = study.kl_points_table(args, "real_kl", records, result)
    assert fixed not in result["at_kl"] and "The fixed-beta pair (real_n5 against real_n1) is left out" in lines[1]


def test_the_kl_picture_gives_each_method_one_colour_and_marks_the_controller(tmp_path):
    """real_kl.png: one legend entry per method and beta rule ("PPO (n=1), KL 0.7" is PPO under the controller,
    the sigma=first variant its own method, never cut to "MA-PPO (n=5"), written only once a real_kl run exists."""
    configs = {c.name: c for c in (*study.HYPOTHESES["real"].configs, *study.HYPOTHESES["real_kl"].configs)}
    assert {study.frontier_method(c) for c in configs.values()} == {
        ("PPO (n=1)", False), ("MA-PPO (n=5)", False), ("MA-PPO (n=5, sigma=first)", False),
        ("PPO (n=1)", True), ("MA-PPO (n=5)", True)}
    args = argparse.Namespace(results_dir=str(tmp_path))

    def record(name):
        study.write_record(study.record_path(args, name, 1), {"rows": [{"step": 5, "kl": 0.5, "eval/gold": 0.4}]})
    record("real_n1")
    assert study.kl_frontier(args, "real_kl", {}) is None and not os.path.exists(tmp_path / "real_kl.png")
    record("real_kl_n1_0.7")
    assert study.kl_frontier(args, "real_kl", {}) == str(tmp_path / "real_kl.png")
    assert os.path.getsize(tmp_path / "real_kl.png") > 0


def test_dirty_means_changed_code_not_the_studys_own_page(tmp_path):
    """A record's `dirty`: tracked files differ from the commit, except the pages and pictures the report
    rewrites between runs (a real git work tree)."""
    git = (lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path,
                                     check=True, capture_output=True))
    git("init", "-q")
    (tmp_path / "docs" / "study").mkdir(parents=True)
    (tmp_path / "ppo.py").write_text("x = 1\n")
    (tmp_path / "docs" / "study" / "README.md").write_text("table\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    results = str(tmp_path / "docs" / "study")
    assert study.tracked_changes(str(tmp_path), results) == []
    (tmp_path / "docs" / "study" / "README.md").write_text("new table\n")
    (tmp_path / "docs" / "study" / "new.json").write_text("{}")                        # untracked: never counted
    assert study.tracked_changes(str(tmp_path), results) == []
    assert study.tracked_changes(str(tmp_path)) == ["docs/study/README.md"]
    (tmp_path / "ppo.py").write_text("x = 2\n")
    assert study.tracked_changes(str(tmp_path), results) == ["ppo.py"]


def test_a_record_says_what_produced_it(tmp_path):
    """Provenance: the commit that ran, whether tracked files differed from it, versions, threads, jobs and
    the hashes of the model folders (a change to one byte changes the hash)."""
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "config.json").write_text("{}")
    before = study.folder_hash(str(tmp_path / "sft"))
    p = study.provenance(argparse.Namespace(jobs=2), (str(tmp_path / "sft"), None))
    assert len(p["commit"]) == 40 and isinstance(p["dirty"], bool) and p["jobs"] == 2 and p["threads"] >= 1
    assert p["sft_hash"] == before and p["rm_hash"] is None and p["torch"].startswith("2.")
    import torch
    assert p["cpu_capability"] == torch.backends.cpu.get_cpu_capability()            # AVX2, AVX512, ...
    with open("/proc/cpuinfo") as f:                                                  # Linux, here and in CI
        assert p["cpu"] == next(ln for ln in f if ln.startswith("model name")).partition(":")[2].strip()
    (tmp_path / "sft" / "config.json").write_text("{ }")
    assert study.folder_hash(str(tmp_path / "sft")) != before
    assert study.folder_hash(str(tmp_path / "no_rm")) is None             # the code task has no RM
    assert study.committed_seeds(argparse.Namespace(results_dir=str(tmp_path)), "x") == set()
    study.write_record(study.record_path(argparse.Namespace(results_dir=str(tmp_path)), "x", 7), {})
    assert study.committed_seeds(argparse.Namespace(results_dir=str(tmp_path)), "x") == {7}


def test_a_records_hashes_are_of_the_folders_its_command_line_trains_with():
    """A segment configuration overrides the study's --rm_path: its record hashes the segment RM, not the task's RM."""
    args = argparse.Namespace(steps=3, eval_every=1, n_eval_prompts=4, ppo_args="", count_args="", code_args="",
                              models={"chitchat": ("runs/chitchat/sft", "runs/chitchat/rm")})
    config = next(c for c in study.HYPOTHESES["segment_beta"].configs if c.name == "segment_beta_quick_2.0")
    argv = study.ppo_flags(args, config, 1, "out")
    assert study.models_of(argv) == ("runs/chitchat/sft", "runs/chitchat/rm_segment")
    assert study.models_of(study.ppo_flags(args, study.HYPOTHESES["segment_beta"].configs[0], 1, "out"))[1] == \
        "runs/chitchat/rm_segment"
    assert study.models_of(["--sft_path", "a"]) == ("a", None)


def test_the_segment_beta_sweep_runs_the_readmes_segment_quick_start_at_each_beta():
    """segment_beta: the README's quick-start command (its ppo.py flags, read from the README) at each beta, on
    the segment RM beside the SFT model; the table reports gold_strict, gold, KL and the final distinct-2 beside
    the SFT model's, by hand."""
    import re
    import shlex
    from transformers import HfArgumentParser
    import ppo
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(root, "README.md")).read()
    quick = shlex.split(re.search(r"accelerate launch ppo\.py (--rm_path runs/chitchat/rm_segment --reward "
                                  r"segment[^\n#]*)",
                                  readme).group(1))
    h = study.HYPOTHESES["segment_beta"]
    args = argparse.Namespace(steps=120, eval_every=10, n_eval_prompts=128, ppo_args="", count_args="", code_args="",
                              models={"chitchat": ("runs/chitchat/sft", "runs/chitchat/rm")})
    betas = []
    for config in h.configs[1:]:
        parsed = ppo_namespace(
            args=study.ppo_flags(args, config, 1, "out"))
        readme_run = ppo_namespace(
            args=study.ppo_flags(args, study.Config("x", "x", (*quick, "--beta", config.flag("--beta")), partner="n1"),
                                 1, "out"))
        assert parsed == readme_run and parsed.rm_path == os.path.join("runs/chitchat", "rm_segment")
        betas.append(parsed.beta)
    assert betas == [0.05, 0.5, 1.0, 2.0] and h.configs[0].metrics == ("eval/gold_strict", "eval/gold")

    def run(seed, distinct_2):
        return {"seed": seed, "final": {"gold": [0.5] * 4},
                "rows": [{"step": s, "eval/gold_strict": 0.1, "eval/gold": 0.5, "kl": 1.0, "macro/mean_len": 1.0,
                          "response/len": 20.0, "eval/distinct_2": distinct_2, "eval/sft_distinct_2": 0.8}
                         for s in (10, 20)]}
    records = {h.configs[0].name: [run(1, 0.03), run(2, 0.05)], h.configs[-1].name: [run(1, 0.7), run(2, 0.7)]}
    lines, result = study.report(argparse.Namespace(smooth=1, results_dir="nowhere"), "segment_beta", records)
    assert result[h.configs[0].name]["early"]["distinct_2"][0] == pytest.approx(0.04)
    assert any(line.startswith("| quick start, beta 2.0 |") and line.endswith("| 0.700 ± 0.000 (0.80) |")
               for line in lines)


def test_the_study_builds_each_tasks_models_before_its_sft_record(tmp_path, monkeypatch):
    """A fresh clone has no runs/: train_all builds every task's SFT model and sequence RM (none for code) with
    the study's flags (for chitchat sft.py's and reward_model.py's own defaults, not ppo.py's shorter first-run
    build), before the SFT record reads them; models already there are not rebuilt."""
    stages = []
    monkeypatch.setattr(study, "run_stages", lambda s: stages.extend(s))
    monkeypatch.setattr(study, "ROOT", str(tmp_path))
    (tmp_path / "runs/chitchat/sft").mkdir(parents=True)
    (tmp_path / "runs/chitchat/sft/config.json").write_text("{}")
    args = argparse.Namespace(ppo_args="", count_args="--reward gold", code_args="", chitchat_args="",
                              models={t: (f"runs/{t}/sft", f"runs/{t}/rm") for t in ("chitchat", "count", "code")})
    todo = [(c, 1) for c in (study.PPO, study.COUNT_PPO, study.HYPOTHESES["code"].configs[0])]
    study.build_task_models(args, todo)
    assert stages == [
        ["reward_model.py", "--task", "chitchat", "--sft_path", "runs/chitchat/sft", "--output_dir",
         "runs/chitchat/rm"],
        ["sft.py", "--task", "count", "--output_dir", "runs/count/sft", *data.BUILD_ARGS["count"][0].split()],
        ["reward_model.py", "--task", "count", "--sft_path", "runs/count/sft", "--output_dir", "runs/count/rm",
         *data.BUILD_ARGS["count"][1].split()],
        ["sft.py", "--task", "code", "--output_dir", "runs/code/sft"]]


def test_the_study_will_not_train_on_a_model_folder_built_with_other_flags(tmp_path, monkeypatch):
    """ppo.py's first run builds chitchat's models into runs/chitchat/ with fewer steps than the study's build: a
    folder there whose checkpoint says it was trained with other steps stops the study, naming both values; one
    trained with the study's flags is reused, not rebuilt."""
    import dataclasses
    import sft
    import torch
    stages = []
    monkeypatch.setattr(study, "run_stages", lambda s: stages.extend(s))
    monkeypatch.setattr(study, "ROOT", str(tmp_path))
    folder = tmp_path / "runs/chitchat/sft"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    args = argparse.Namespace(ppo_args="", chitchat_args="", models={"chitchat": ("runs/chitchat/sft",
                                                                                  "runs/chitchat/rm")})
    todo = [(study.PPO, 1)]
    for max_steps, stops in ((200, True), (400, False)):
        first_run = dataclasses.asdict(sft.SFTArgs(task="chitchat", max_steps=max_steps))
        torch.save({"step": max_steps, "args": first_run}, folder / "checkpoint/trainer_state.pt")
        if stops:
            with pytest.raises(SystemExit, match=r"runs/chitchat/sft was built by sft.py with --max_steps 200 "
                                                 r"\(the study's: 400\)"):
                study.build_task_models(args, todo)
            assert stages == []
        else:
            study.build_task_models(args, todo)
            assert stages == [["reward_model.py", "--task", "chitchat", "--sft_path", "runs/chitchat/sft",
                               "--output_dir", "runs/chitchat/rm"]]


def test_the_sft_line_cites_its_rm_figures_from_the_record(tmp_path):
    """The SFT record carries its RM's rm_eval.json; the report prints those figures, never typed ones."""
    h = study.HYPOTHESES["count"]
    rows = [{"step": s, "eval/gold": 0.4, "eval/rm": 1.0, "kl": 1.0, "macro/mean_len": 1.0, "response/len": 20.0}
            for s in (10, 20)]
    record = {"config": "count_sft", "seed": 0, "final": {"gold": [0.25, 0.75]},
              "rm_eval": {"accuracy": 0.5512, "n_eval": 1024, "gold_agreement": 0.6123, "gold_pairs": 256},
              "sft_hash": "abc"}
    args = argparse.Namespace(smooth=1, results_dir=str(tmp_path))
    study.write_record(study.record_path(args, "count_sft", 0), record)
    lines, result = study.report(args, "count", {h.configs[0].name: [{"seed": 1, "final": {"gold": [0.5]},
                                                                      "rows": rows}]})
    line = next(line for line in lines if line.startswith("The SFT model"))
    assert "mean gold 0.500" in line and "held-out pairwise accuracy 0.551 on 1024 pairs" in line
    assert "agreement with the gold judge 0.612 on 256 pairs" in line and result["sft"]["rm_eval"]["accuracy"] == 0.5512
    assert "1 of the 1 runs above record no SFT / RM hashes" in line        # a run made before hashes
    runs = [{"seed": 1, "final": {"gold": [0.5]}, "rows": rows, "sft_hash": h} for h in ("abc", "abd")]
    line = next(line for line in study.report(args, "count", {h.configs[0].name: runs})[0]
                if line.startswith("The SFT"))
    assert "1 of the 2 runs above record no SFT / RM hashes or others than this record's" in line
    runs[1]["sft_hash"], runs[0]["rm_hash"] = "abc", "rm2"                   # the same SFT, another RM build
    line = next(line for line in study.report(args, "count", {h.configs[0].name: runs})[0]
                if line.startswith("The SFT"))
    assert "1 of the 2 runs above" in line
    del runs[0]["rm_hash"]
    runs[1]["sft_hash"] = "abc"
    line = next(line for line in study.report(args, "count", {h.configs[0].name: runs})[0]
                if line.startswith("The SFT"))
    assert "runs above" not in line


def test_a_task_whose_runs_are_all_committed_still_gets_its_sft_record(tmp_path, monkeypatch):
    """`learning_efficiency.py code` with every code run committed but no code_sft record: the code SFT model is
    built and its record made, no run is trained; with the record there, nothing happens."""
    made, stages = [], []
    monkeypatch.setattr(study, "run_stages", lambda s: stages.extend(s))
    monkeypatch.setattr(study, "ROOT", str(tmp_path))
    monkeypatch.setattr(study, "sft_record", lambda args, config: made.append(study.sft_record_name(config)))
    monkeypatch.setattr(study, "train", lambda *a: pytest.fail("a committed run was trained again"))
    args = argparse.Namespace(results_dir=str(tmp_path), report_only=False, jobs=1, threads=0, ppo_args="",
                              code_args="",
                              models={"code": ("runs/code/sft", "runs/code/rm")})
    todo = [(c, 1) for c in study.HYPOTHESES["code"].configs]
    for config, seed in todo:
        study.write_record(study.record_path(args, config.name, seed), {})
    study.train_all(args, todo)
    assert made == ["code_sft"] and stages == [["sft.py", "--task", "code", "--output_dir", "runs/code/sft"]]
    study.write_record(study.record_path(args, "code_sft", 0), {})
    made.clear()
    study.train_all(args, todo)
    assert made == []


def test_configs_runs_only_those_configurations(tmp_path, monkeypatch):
    """`--configs n5 --seeds 1` with n5's record there: nothing is trained (n1, not asked for and without a
    record in this folder, is left out of the tables rather than run)."""
    monkeypatch.setattr(study, "train", lambda *a: pytest.fail(f"trained {a[1].name}"))
    args = argparse.Namespace(results_dir=str(tmp_path))
    rows = [{"step": s, "eval/rm": 1.0, "eval/gold": 0.5, "kl": 1.0, "macro/mean_len": 5.0, "response/len": 20.0}
            for s in (10, 20)]
    study.write_record(study.record_path(args, "n5", 1), {"seed": 1, "final": {"gold": [0.5]}, "rows": rows})
    study.write_record(study.record_path(args, "chitchat_sft", 0), {"config": "chitchat_sft", "final": {"gold": [0.2]}})
    result = study.main(["baseline", "--configs", "n5", "--seeds", "1", "--results_dir", str(tmp_path),
                         "--runs_dir", str(tmp_path / "runs")])
    assert result["baseline"]["n5"]["seeds"] == [1] and "n1" not in result["baseline"]


# ---------------------------------------------------------------- no figure in the prose without a record
# A figure is a decimal or a percentage, with its sign where it has one, and each end of a range (counts of seeds,
# iterations and tokens are not checked). Each one in the prose of these pages must be a figure of the generated
# tables (docs/study/study.md, written from the records by `learning_efficiency.py report`) of a hypothesis its
# paragraph is about: named in backticks or linked as #name, or, on the study page, the hypothesis of its section.
# The prose may round a table's figure, never change it; a signed figure keeps its sign (an unsigned one is read as
# a size: "PPO ahead by 0.04" for a table's -0.040).
PROSE = ("README.md", "docs/study/README.md", "docs/real_models.md")
# a sign only after a space or a bracket: the "-" of "0.988-0.998" or "45%-55%" joins a range, its second end unsigned
FIGURE = re.compile(r"(?<![\w.#/§%)])([+\-−]?)(\d+\.\d+%?(?![\w.]*\d)|\d+%)")   # not §3.3, v1.2.3
# Figures allowed in any paragraph, each with the reason it needs no record.
ANYWHERE = {
    "50%": "even odds: the line every win rate is read against",
    "0.05": "the margin (MARGIN) and the recipe's beta (a flag)",
    "1.2": "the matching rule (MATCH)",
    "95%": "the interval's level", "90%": "the equivalence test's interval", "80%": "the detectable effect's power",
    "5%": "the tests' level",
    "1.7": "the paper's claim (Fig. 1-2: 1.7-2x)",
    "1.3": "the tiny model's size, 1.3M parameters (its config)",
    "0.774": "0.95^5, the lambda of MA-PPO in `lambda` (its flag, 0.7738)",
    "10%": "the real-model controller's largest step an iteration (--kl_horizon 32 over 16 samples)",
    "2%": "the tiny tasks' controller's largest step an iteration (--kl_horizon 320 over 32 samples)",
    "0.8": "the sampling temperature (ppo.py's --temperature)",
}
# Paragraphs whose figures come from a committed record other than the study's tables, or are no measurement, by
# (file, how the paragraph begins), with the reason: where they come from. A figure in any other paragraph that no
# generated table gives fails the test.
UNRECORDED = {
    ("docs/real_models.md", "| model | full fine-tuning"): "Gemma's memory, estimated from the models' and their "
    "adapters' parameter counts (2.5B, 8.5B; 20M, 50M) at 16 bytes a trained parameter, the arithmetic in the "
    "table's cells: not a measurement",
    ("docs/real_models.md", "| side | generate | forwards"): "bench/records/real_ppo.json and real_ppo_full.json "
    "(bench/real_ppo.py --show, tested)",
    ("docs/real_models.md", "ours / TRL: "): "bench/records/real_ppo.json and real_ppo_full.json, printed by "
    "bench/real_ppo.py --show (tested)",
    ("docs/real_models.md", "Measured on the 2-core CPU with the study's"): "bench/records/real_ppo.json's sitting "
    "and the one before it, bench/records/real_ppo_d3f2e1d.json, and their ratios; 0.75x is the project's aim, "
    "not a measurement",
    ("docs/real_models.md", "**Where the memory went.**"): "the peak RSS of bench/records/real_ppo.json "
    "(its table tested)",
    ("docs/real_models.md", "Here ours is the slower side"): "bench/records/real_ppo_full.json and real_ppo.json "
    "(their tables tested), and differences of their medians",
    ("docs/real_models.md", "**GRPO beside it**"): "bench/records/real_grpo_1.json and real_grpo_2.json: their load "
    "averages at the start",
    ("docs/real_models.md", "Under GRPO ours is the slower side"): "bench/records/real_grpo_1.json and real_grpo_2.json "
    "(their tables tested), their iterations' response lengths, and sums and differences of their medians",
    ("docs/real_models.md", "**One learning rate on both sides"): "bench/records/real_ppo_samelr_loaded.json and "
    "real_ppo_full_samelr_loaded.json: the learning rate of their sizes, their load averages at the start, and the "
    "count of same_numbers' flag sets",
    ("docs/real_models.md", "Generation, the same `generate()`"): "bench/records/real_ppo_samelr_loaded.json (its "
    "table tested) and real_ppo.json's ratios, and differences of their medians",
    ("docs/real_models.md", "With full fine-tuning ours is now"): "bench/records/real_ppo_full_samelr_loaded.json and "
    "real_ppo_full.json (their tables tested): their ratios, forwards and response lengths",
    ("docs/real_models.md", "**The same two, on a quiet machine**"): "bench/records/real_ppo_samelr.json and "
    "real_ppo_full_samelr.json: their load averages at the start",
    ("docs/real_models.md", "**Each forward apart**"): "bench/records/scoring_forwards_r16.json and "
    "scoring_forwards_r0.json: their sizes (rows, tokens, repeats)",
    ("docs/real_models.md", "| forward / backward | LoRA r=16"): "bench/records/scoring_forwards_r16.json and "
    "scoring_forwards_r0.json (bench/scoring_forwards.py --show, tested)",
    ("docs/real_models.md", "| operator (LoRA r=16"): "bench/records/scoring_forwards_r16.json "
    "(bench/scoring_forwards.py --show, tested)",
    ("docs/real_models.md", "Step 2's four forwards as ours runs them"): "bench/records/scoring_forwards_r16.json and "
    "scoring_forwards_r0.json (their tables tested): sums and differences of their medians, the operators' seconds "
    "and calls, SmolLM2's 30 layers x 7 adapted linear layers; real_ppo_samelr.json's and real_ppo_full_samelr.json's "
    "iterations and generation, and their sums with those; 0.75x is the issue's aim",
    ("docs/real_models.md", "Quiet, ours takes 0.85x"): "bench/records/real_ppo_samelr.json and "
    "real_ppo_full_samelr.json (their tables tested): their ratios, medians, sums of medians and response lengths; "
    "0.75x and TRL's time are the issue's aims, not measurements",
}


def generated_figures():
    """{hypothesis: its generated section's figures} from docs/study/study.md."""
    text = open(os.path.join(ROOT, "docs", "study", "study.md")).read()
    return {part.split(":", 1)[0]: re.findall(r"(?<![\w.])[+\-−]?\d+(?:\.\d+)?%?", part)
            for part in text.split("### ")[1:]}


def rounds_to(figure, generated):
    """`figure` ("0.91", "46.7%", "-0.05") is one of `generated` as printed or rounded to the figure's decimals; a
    signed figure only with its sign ("+" or none: positive), an unsigned one with either."""
    percent, signed = figure.endswith("%"), figure[0] in "+-−"
    value = figure.rstrip("%").replace("−", "-")
    decimals = len(value.split(".")[1]) if "." in value else 0
    number = float(value)

    def same(g):
        g = float(g.rstrip("%").replace("−", "-"))
        return f"{(g if signed else abs(g)):.{decimals}f}" == f"{number:.{decimals}f}"
    return any(g.endswith("%") == percent and same(g) for g in generated)


def unsourced_figures(path):
    """[(heading, figure, paragraph start)] of `path`'s prose (generated blocks and code blocks left out)."""
    text = open(os.path.join(ROOT, path)).read()
    text = re.sub(r"<!-- study:(\S+) -->.*?<!-- /study:\1 -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    generated, heading, named_by_heading, out = generated_figures(), None, set(), []
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.startswith("#"):
            heading = paragraph.splitlines()[0]
            named_by_heading = set(re.findall(r"`(\w+)`", heading)) if path == "docs/study/README.md" else set()
        if any(paragraph.startswith(start) for file, start in UNRECORDED if file == path):
            continue
        anchors = [w for a in re.findall(r"#([\w-]+)\)", paragraph) for w in (a, *a.split("-"))]
        named = named_by_heading | set(re.findall(r"`(\w+)`", paragraph)) | set(anchors)
        allowed = [g for name in named for g in generated.get(name, [])]
        out += [(heading, sign + f, paragraph[:60]) for sign, f in FIGURE.findall(paragraph)
                if f not in ANYWHERE and not rounds_to(sign + f, allowed)]
    return out


def test_rounds_to_accepts_a_tables_figure_rounded_never_another():
    assert rounds_to("11.3", ["11.304"]) and rounds_to("0.91", ["0.914"]) and rounds_to("46.7%", ["46.7%"])
    assert not rounds_to("0.87", ["0.889", "0.914"]) and not rounds_to("0.5", ["50%"])
    assert not rounds_to("47%", ["0.47"])


def unsourced_in(tmp_path, monkeypatch, tables, page):
    """unsourced_figures of a page `page` beside generated tables `tables` (study.md's text), both in tmp_path."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (tmp_path / "docs" / "study").mkdir(parents=True)
    (tmp_path / "docs" / "study" / "study.md").write_text(tables)
    (tmp_path / "page.md").write_text(page)
    return [f for _, f, _ in unsourced_figures("page.md")]


def test_a_figure_outside_its_hypothesis_tables_is_caught(tmp_path, monkeypatch):
    """The check itself: a figure the `real_kl` tables give passes in a paragraph about `real_kl`, fails in one about
    `kl`, and a figure no table gives fails."""
    assert unsourced_in(tmp_path, monkeypatch, "### real_kl: q\n| a | 0.914 ± 0.640 |\n### kl: q\n| 6.164 |\n",
                        "# t\n\n`real_kl` ends at 0.91 against 6.2.\n\nIn `kl`, 0.91.\n\n"
                        "[it](x.md#kl) ends at 6.16; 0.87 in none.\n") == ["6.2", "0.91", "0.87"]


def test_a_figures_sign_and_a_ranges_second_end_are_checked(tmp_path, monkeypatch):
    """A signed figure must keep its table's sign (an unsigned one is read as a size); the end of a range and a
    negative figure are figures like any other."""
    assert unsourced_in(tmp_path, monkeypatch, "### real_kl: q\n| -0.054 [-0.089, +0.001] | 0.988 | 45.0% [40.0%, "
                                               "51.2%] |\n",
                        "# t\n\n`real_kl`: -0.054 [-0.09, +0.00], PPO ahead by 0.054, +0.054 flipped; "
                        "0.988-0.998 over seeds, 45.0%-51.2% a range, -0.33 in none.\n") == ["+0.054", "0.998", "-0.33"]


@pytest.mark.parametrize("path", PROSE)
def test_every_figure_in_the_prose_comes_from_a_generated_table(path):
    missing = unsourced_figures(path)
    assert not missing, "\n".join(f"{h} | {f} | {p!r}" for h, f, p in missing)


def test_every_unrecorded_paragraph_is_still_there():
    """An exemption outlives its paragraph only by mistake: each UNRECORDED start begins a paragraph of its file."""
    for path, start in UNRECORDED:
        assert re.search(r"(^|\n\s*\n)" + re.escape(start), open(os.path.join(ROOT, path)).read()), (path, start)


def test_the_ten_seed_rerun_trains_the_headline_pair_on_one_build_of_its_own(tmp_path, monkeypatch):
    """real_kl10: PPO at 0.05 and MA-PPO at 0.077 as in real_kl, on runs/smollm2_kl10 (built before its first
    run, the old build left alone), with its own SFT record; not part of `all`."""
    from transformers import HfArgumentParser
    import ppo
    h = study.HYPOTHESES["real_kl10"]
    old = {c.name: c for c in study.HYPOTHESES["real_kl"].configs}
    args = argparse.Namespace(steps=120, eval_every=10, n_eval_prompts=128, ppo_args="", count_args="", code_args="",
                              models={"smollm2": study.REAL_MODELS, "smollm2_kl10": study.REAL_KL10_MODELS})
    for config, before in zip(h.configs, ("real_kl_n1_beta0.05", "real_kl_n5_beta0.077")):
        new_flags = ppo_namespace(
            args=study.ppo_flags(args, config, 7, "o"))
        old_flags = ppo_namespace(
            args=study.ppo_flags(args, old[before], 7, "o"))
        assert vars(new_flags) == {**vars(old_flags), "sft_path": "runs/smollm2_kl10/sft",
                                   "rm_path": "runs/smollm2_kl10/rm"}
        assert study.sft_record_name(config) == "real_kl10_sft" and study.is_real(config)
    assert h.configs[1].partner == h.configs[0].name and "real_kl10" in study.OPTIONAL
    stages = []
    monkeypatch.setattr(study, "run_stages", lambda s: stages.extend(s))
    monkeypatch.setattr(study, "smollm2_gguf", lambda: "m.gguf")
    monkeypatch.setattr(study, "ROOT", str(tmp_path))                     # a fresh clone: no build yet
    study.build_real_models(args, [(c, 1) for c in h.configs])
    assert [s[s.index("--output_dir") + 1] for s in stages] == list(study.REAL_KL10_MODELS)


# ---------------------------------------------------------------- several methods against PPO: one comparison per arm

def test_an_arm_is_a_method_whatever_kl_target_or_beta_holds_it():
    """real_kl's MA-PPO at two KL targets and four betas is one arm; critic_free's five non-PPO arms are five, each
    named by its own label; within every matched-KL hypothesis the arms' short names differ."""
    real_kl = study.arms_of(study.HYPOTHESES["real_kl"])
    assert len(real_kl) == 1 and len(real_kl[0]) == sum(not c.is_ppo for c in study.HYPOTHESES["real_kl"].configs) == 6
    for name in ("critic_free", "critic_free_code"):
        arms = study.arms_of(study.HYPOTHESES[name])
        assert [len(a) for a in arms] == [1] * 5
        assert [study.arm_name(a[0]) for a in arms] == ["MA-PPO", "GRPO", "MA-group", "GSPO-style", "MC macro values"]
    assert study.method_of(study.Config("x", "x", ("--n", "5", "--beta", "0.1", "--kl_target", "6", "--lora_r", "8"))) \
        == ("--n", "5", "--lora_r", "8")
    for name, h in study.HYPOTHESES.items():
        if h.matched_kl:
            names = [study.arm_name(a[0]) for a in study.arms_of(h)]
            assert len(set(names)) == len(names), name


def kl_record(seed, kl, golds):
    """A controlled run that stayed at `kl` (every iteration's batch), evaluated at 10, 20, 30; final scores `golds`."""
    mean = float(numpy.mean(golds))
    return {"seed": seed, "trace": [{"step": s, "kl": kl, "beta": 0.05} for s in range(1, 31)],
            "rows": [{"step": s, "eval/gold": mean, "eval/rm": 0.0, "kl": kl, "macro/mean_len": 1.0,
                      "response/len": 20.0}
                     for s in (10, 20, 30)], "final": {"gold": list(golds), "rm": list(golds)}}


def reference_fit(runs):
    """Arm minus PPO at equal KL, by a plain loop: least squares of each run's mean score on [is the arm, log KL, one
    indicator per seed] over the seeds that have both. `runs`: [(seed, is the arm, KL, scores)]."""
    seeds = sorted({s for s, arm, _, _ in runs if arm} & {s for s, arm, _, _ in runs if not arm})
    x, y = [], []
    for seed, arm, kl, scores in runs:
        if seed in seeds:
            x.append([float(arm), math.log(kl)] + [float(seed == s) for s in seeds])
            y.append(sum(scores) / len(scores))
    return numpy.linalg.lstsq(numpy.array(x), numpy.array(y), rcond=None)[0][:2]


def test_several_methods_get_a_verdict_and_a_fit_per_arm_naming_each_arm(tmp_path):
    """critic_free with hand-made records: MA-PPO truly +0.04 above PPO at equal KL, GRPO -0.08, over 3 seeds, every
    run at its own KL (gold rises 0.1 per unit of log KL), noisy prompts; MC one seed; GSPO-style only a seed PPO
    lacks; MA-group not run.
    Each arm's fit uses its runs and PPO's only (checked against reference_fit), and every line names its arm."""
    h = study.HYPOTHESES["critic_free"]
    ppo, ma, grpo, ma_group, gspo, mc = h.configs
    rng = numpy.random.default_rng(3)
    kls = {ppo.name: (6.0, 5.5, 6.6), ma.name: (5.2, 6.4, 5.8), grpo.name: (6.9, 5.1, 6.2), mc.name: (6.1,)}
    effect = {ppo.name: 0.0, ma.name: 0.04, grpo.name: -0.08, mc.name: 0.0}
    records, runs = {c.name: [] for c in h.configs}, {}
    for name, per_seed in kls.items():
        for seed, kl in enumerate(per_seed, 1):
            golds = 0.5 + 0.02 * seed + 0.1 * math.log(kl) + effect[name] + rng.normal(0, 0.05, 16)
            records[name].append(kl_record(seed, kl, golds.tolist()))
            runs.setdefault(name, []).append((seed, kl, golds.tolist()))
    records[gspo.name] = [kl_record(9, 6.0, [0.7] * 16)]
    args = argparse.Namespace(smooth=1, results_dir=str(tmp_path), report_only=True)
    lines, result = study.report(args, "critic_free", records)
    by_arm = result["equal_kl_by_arm"]
    assert "equal_kl" not in result and set(by_arm) == {c.label for c in (ma, grpo, ma_group, gspo, mc)}
    for config in (ma, grpo):
        fit = by_arm[config.label]["fit"]
        mine = [(s, True, kl, g) for s, kl, g in runs[config.name]] + [(s, False, kl, g) for s, kl, g in runs[ppo.name]]
        d, slope = reference_fit(mine)
        assert fit["mean"] == pytest.approx(d) and fit["slope"] == pytest.approx(slope) and fit["seeds"] == 3
        assert abs(fit["mean"] - effect[config.name]) < 0.03                  # the noise is small: near the truth
    everything = [(s, name != ppo.name, kl, g) for name in (ppo.name, ma.name, grpo.name) for s, kl, g in runs[name]]
    assert abs(reference_fit(everything)[0] - by_arm[grpo.label]["fit"]["mean"]) > 0.03   # pooling would mix the arms
    assert by_arm[mc.label]["fit"] is None and by_arm[mc.label]["seeds"] == 1 and by_arm[ma_group.label]["seeds"] == 0
    text = "\n".join(lines)
    # the verdict bullets, the by-seed rows and the fits name their arm; nothing calls GRPO "MA-PPO"
    bullet = next(line for line in lines if line.startswith(f"- {grpo.label}, KL 6: final KL"))
    assert "; GRPO minus PPO gold " in bullet and "MA-PPO" not in bullet
    assert f"| {grpo.label}, KL 6 | {ppo.label}, KL 6 | 2 | 5.50 / 5.10 | 1.08 | yes |" in text
    fit_line = next(line for line in lines if line.startswith(f"- {grpo.label}: fit of each run's final mean gold"))
    assert "a GRPO term" in fit_line and "GRPO minus PPO " + study.fmt_verdict(by_arm[grpo.label]["fit"]) in fit_line
    assert any(line.startswith(f"- {ma.label}: the pairs at matched KL alone") and "MA-PPO minus PPO" in line
               for line in lines)
    assert "all, one gap per seed" not in text and "MA-PPO minus PPO paired by seed" not in text
    # the table of arms: one row each, the fit's and the matched pairs' figures and verdicts
    g, m = by_arm[grpo.label]["fit"], by_arm[grpo.label]["matched_pairs"]
    assert (f"| {grpo.label} | 3 | {study.fmt(*study.t_interval([6.9, 5.1, 6.2]))} | 3 of 3 | {study.fmt_cmp(g)} | "
            f"{g['verdict']} | {g['mde']:.3f} | {study.fmt_cmp(m)} | {m['verdict']} | {m['mde']:.3f} |") in lines
    assert m["seeds"] == 3 and m["pairs"] == 3                              # GRPO's KLs within 1.2x of PPO's
    assert f"| {mc.label} | 1 | 6.100 | 1 of 1 | - | one seed: no verdict | - | - | one seed: no verdict | - |" in lines
    assert (f"| {gspo.label} | 1 | 6.000 | 0 of 0 | - | no seed beside PPO's | - | - | no seed beside PPO's | - |"
            in lines)
    assert f"| {ma_group.label} | 0 | not run yet | | | | | | | |" in lines


def reference_joint_fit(runs):
    """Every arm minus PPO and the slope, by a plain loop: least squares of each run's mean score on [one indicator
    per arm, log KL, one indicator per seed] over the seeds that have PPO and an arm. `runs`: [(seed, arm or None,
    KL, scores)]."""
    seeds = sorted({s for s, a, _, _ in runs if a is None} & {s for s, a, _, _ in runs if a is not None})
    arms = list(dict.fromkeys(a for s, a, _, _ in runs if a is not None and s in seeds))
    x, y = [], []
    for seed, arm, kl, scores in runs:
        if seed in seeds:
            x.append([float(arm == a) for a in arms] + [math.log(kl)] + [float(seed == s) for s in seeds])
            y.append(sum(scores) / len(scores))
    coef = numpy.linalg.lstsq(numpy.array(x), numpy.array(y), rcond=None)[0]
    return dict(zip(arms, coef[:len(arms)])), coef[len(arms)]


def test_the_joint_fit_shares_one_slope_and_recovers_each_arms_difference():
    """Gold = seed level + 0.1 log KL + each arm's effect, no noise: one fit over every arm returns each effect and
    the slope exactly, also for an arm whose every run ended above PPO's KL (in a fit of its own such an arm and the
    KL cannot be told apart when they move together); a seed without PPO is left out; noisy prompts match the loop."""
    effect, runs = {None: 0.0, "A": 0.04, "B": -0.06, "C": 0.01}, []
    for seed, level in ((1, 0.4), (2, 0.5), (3, 0.45)):
        for arm, kl in ((None, 5.0), ("A", 4.0 + seed), ("B", 9.0 + seed), ("C", 6.0 / seed)):
            runs.append((seed, arm, kl, [level + 0.1 * math.log(kl) + effect[arm]] * 8))
    runs.append((4, "A", 3.0, [0.9] * 8))
    joint = study.joint_equal_kl_fit(runs)
    assert joint["slope"] == pytest.approx(0.1) and joint["seeds"] == 3 and joint["runs"] == 12
    for arm in "ABC":
        assert joint["arms"][arm]["mean"] == pytest.approx(effect[arm]) and joint["arms"][arm]["seeds"] == 3
        assert joint["arms"][arm]["se"] == pytest.approx(0, abs=1e-9)
    rng = numpy.random.default_rng(5)
    noisy = [(s, a, kl, (numpy.array(g) + rng.normal(0, 0.05, 8)).tolist()) for s, a, kl, g in runs]
    want, slope = reference_joint_fit(noisy)
    got = study.joint_equal_kl_fit(noisy)
    assert got["slope"] == pytest.approx(slope)
    assert {a: v["mean"] for a, v in got["arms"].items()} == pytest.approx(want)
    assert all(v["se"] > 0 for v in got["arms"].values())
    assert study.joint_equal_kl_fit([r for r in runs if r[0] == 1]) is None          # one seed: no fit
    assert got["arms"]["A"]["df"] == 12 - 3 - 1 - 3                                   # runs - arms - slope - seeds
    # an arm beside PPO on 2 seeds of 3 keeps its term, its seeds counted as 2
    sparse = study.joint_equal_kl_fit([r for r in noisy if not (r[1] == "C" and r[0] == 3)])
    assert sparse["arms"]["C"]["seeds"] == 2 and numpy.isfinite(sparse["arms"]["C"]["se"])


def test_a_fit_that_cannot_tell_the_arm_from_the_kl_says_so():
    """Every seed's MA-PPO run at twice its PPO's KL: the MA-PPO term and the slope move together (rank 4 of 5 with
    three seeds), so there is no difference at equal KL to report, and the rank check says so rather than a number."""
    runs = [(s, ma, (2.0 if ma else 1.0) * s, [0.1 * s + 0.05 * ma + 0.01 * k for k in range(4)])
            for s in (1, 2, 3) for ma in (False, True)]
    fit = study.equal_kl_fit(runs)
    assert fit["verdict"].startswith("no verdict: the fit cannot tell its terms apart (rank 4 of 5)")
    joint = study.joint_equal_kl_fit([(s, "A" if ma else None, kl, sc) for s, ma, kl, sc in runs])
    assert joint["arms"] == {} and "rank 4 of 5" in joint["rank"]
    assert "no verdict" in study.joint_fit_lines(joint, "gold")[0]


def test_the_equal_kl_fit_by_hand_two_runs_a_seed():
    """Two runs a seed: the fit is the regression of each seed's gap on its log KL ratio, the MA-PPO term its
    intercept. Its seed part by hand: residual variance over seeds - 2 degrees of freedom times the intercept's
    (X'X)^-1 entry; prompts identical within each run (no prompt effect), so the prompt part is 0."""
    gaps, ratios = [0.02, -0.05, 0.01, 0.04, -0.01], [1.1, 0.9, 1.3, 1.0, 0.8]
    runs = []
    for s, (g, r) in enumerate(zip(gaps, ratios), 1):
        runs += [(s, False, 2.0, [0.5] * 6), (s, True, 2.0 * r, [0.5 + g] * 6)]
    x = numpy.array([[1.0, math.log(r)] for r in ratios])
    coef, rss = numpy.linalg.lstsq(x, numpy.array(gaps), rcond=None)[:2]
    se = math.sqrt(rss[0] / (5 - 2) * numpy.linalg.inv(x.T @ x)[0, 0])
    fit = study.equal_kl_fit(runs)
    assert fit["mean"] == pytest.approx(coef[0]) and fit["slope"] == pytest.approx(coef[1])
    assert fit["se"] == pytest.approx(se) and fit["df"] == 3 and fit["se_parts"][1] == 0.0
    assert fit["ci95"][1] == pytest.approx(coef[0] + 3.182 * se, abs=1e-4)


def test_on_the_five_seed_records_the_fit_moves_as_little_as_leaving_a_seed_out_says():
    """critic_free's MC and GSPO-style arms, five seeds each: the fit's standard error is near the leave-one-seed-out
    jackknife's (within a factor of 2, where the bootstrap it replaces gave detectable effects of 0.72 and 0.48 gold
    from draws of two or fewer distinct seeds), and its detectable difference below 0.15."""
    args = argparse.Namespace(results_dir=os.path.join(ROOT, "docs", "study"))
    for arm in ("cf_mc_n5", "cf_group_sequence"):
        runs = []
        for name, ma in (("cf_n1", False), (arm, True)):
            for seed in range(1, 6):
                r = study.committed_record(args, name, seed)
                runs.append((seed, ma, study.run_kl(r), r["final"]["gold"]))
        fit = study.equal_kl_fit(runs)
        loo = [study.equal_kl_fit([r for r in runs if r[0] != s])["mean"] for s in range(1, 6)]
        jackknife = math.sqrt(4 / 5 * sum((v - numpy.mean(loo)) ** 2 for v in loo))
        assert 0.5 < fit["se"] / jackknife < 2 and fit["mde"] < 0.15 and fit["df"] == 3


def test_the_report_of_several_arms_prints_the_joint_fit(tmp_path):
    """critic_free with hand-made records (3 seeds of PPO, MA-PPO and GRPO): the joint fit is in the result and in one
    bullet per arm, against the plain loop."""
    h = study.HYPOTHESES["critic_free"]
    ppo, ma, grpo = h.configs[:3]
    rng = numpy.random.default_rng(7)
    records, runs = {c.name: [] for c in h.configs}, []
    for config, arm, effect, kls in ((ppo, None, 0.0, (6.0, 5.5, 6.6)), (ma, study.frontier_method(ma)[0], 0.04,
                                     (5.2, 6.4, 5.8)), (grpo, study.frontier_method(grpo)[0], -0.08, (6.9, 5.1, 6.2))):
        for seed, kl in enumerate(kls, 1):
            golds = (0.5 + 0.02 * seed + 0.1 * math.log(kl) + effect + rng.normal(0, 0.05, 16)).tolist()
            records[config.name].append(kl_record(seed, kl, golds))
            runs.append((seed, arm, kl, golds))
    args = argparse.Namespace(smooth=1, results_dir=str(tmp_path), report_only=True)
    lines, result = study.report(args, "critic_free", records)
    joint = result["equal_kl_joint"]
    want, slope = reference_joint_fit(runs)
    assert joint["slope"] == pytest.approx(slope)
    assert {a: v["mean"] for a, v in joint["arms"].items()} == pytest.approx(want) and len(want) == 2
    assert any(line.startswith("- one fit over every arm (9 runs of 3 seeds; one slope shared") for line in lines)
    for arm, v in joint["arms"].items():
        assert f"  - {arm} minus PPO " + study.fmt_verdict(v) + "." in lines


def test_one_method_at_several_kls_keeps_its_pooled_fit(tmp_path):
    """real_kl: MA-PPO at KL 0.7 and at 1.5 is one method, so its fit pools every run of the hypothesis (both targets
    and both PPOs, reference_fit over all of them), not one fit per target; the lines still say MA-PPO minus PPO."""
    h = study.HYPOTHESES["real_kl"]
    n1, n5, n1_high, n5_high = h.configs[:4]
    rng = numpy.random.default_rng(5)
    kls = {n1.name: (0.7, 0.8, 0.6), n5.name: (0.75, 0.6, 0.7), n1_high.name: (1.4, 1.6, 1.5),
           n5_high.name: (1.2, 1.7, 1.6)}
    records, everything = {c.name: [] for c in h.configs}, []
    for name, per_seed in kls.items():
        for seed, kl in enumerate(per_seed, 1):
            golds = 0.3 + 0.05 * seed + 0.2 * math.log(kl) + (0.03 if "n5" in name else 0) + rng.normal(0, 0.05, 8)
            records[name].append(kl_record(seed, kl, golds.tolist()))
            everything.append((seed, "n5" in name, kl, golds.tolist()))
    lines, result = study.report(argparse.Namespace(smooth=1, results_dir=str(tmp_path), report_only=True), "real_kl",
                                 records)
    assert "equal_kl_by_arm" not in result
    fit = result["equal_kl"]["fit"]
    assert fit["runs"] == 12 and fit["seeds"] == 3 and fit["mean"] == pytest.approx(reference_fit(everything)[0])
    one_target = [r for r in everything if r[2] < 1.0]                      # what a per-target fit would use
    assert abs(reference_fit(one_target)[0] - fit["mean"]) > 1e-3
    assert any(line.startswith("- fit of each run's final mean gold on log final KL, a MA-PPO term") and
               "MA-PPO minus PPO" in line for line in lines)
    assert "| MA-PPO | PPO | seed | final KL |" in "\n".join(lines) and any("all, one gap per seed" in x for x in lines)


# ---------------------------------------------------------------- the held-out KL, measured after the runs
def test_the_held_out_kl_is_each_replys_summed_log_ratio_and_zero_for_the_sft_model(tiny_models, parrot):
    """bench/heldout_kl.heldout_kl against a loop over the replies one at a time, each unpadded: the policy's minus the
    reference's log-probability of every reply token at the sampling temperature, summed over the reply (its EOS
    included, the padding after it not); a model's KL from itself is 0. The policy: the SFT model with its EOS row
    scaled up, so that some replies end early; the reference: the parrot."""
    import torch
    import evaluate
    import heldout_kl
    ctx = evaluate.Context(evaluate.EvalArgs(task="chitchat", n_prompts=16, sft_path=str(tiny_models / "sft"),
                                             rm_path=str(tiny_models / "rm"), temperature=0.7))
    sft, parrot = ctx.model("sft"), ctx.model(str(parrot))
    with torch.no_grad():
        sft.get_output_embeddings().weight[ctx.tokenizer.eos_token_id] *= 10
    kls, texts = heldout_kl.heldout_kl(ctx, sft, parrot, 11)
    assert texts == ctx.responses(sft, seed=11)                        # the final scores' replies, sampled alike
    assert heldout_kl.heldout_kl(ctx, sft, sft, 11)[0] == [0.0] * 16
    with torch.random.fork_rng():
        torch.manual_seed(11)
        p_ids, p_mask, r_ids, r_mask, _ = data.sample(sft, ctx.tokenizer, ctx.prompts, ctx.args.max_prompt_len,
                                                      ctx.args.max_response_len, 0.7)
    assert (r_mask == 0).any() and (p_mask == 0).any(), "no reply ended early or no prompt padded: not exercised"
    for i, kl in enumerate(kls):
        prompt, reply = p_ids[i][p_mask[i].bool()], r_ids[i][r_mask[i].bool()]
        ids = torch.cat([prompt, reply]).unsqueeze(0)
        total = 0.0
        for model, sign in ((sft, 1), (parrot, -1)):
            logp = (model(ids).logits[0, len(prompt) - 1:-1] / 0.7).log_softmax(-1)
            total += sign * logp.gather(-1, reply.unsqueeze(-1)).sum().item()
        assert kl == pytest.approx(total, abs=1e-3)
    assert sum(kls) / len(kls) > 1                                     # the parrot is far from the SFT model


def test_the_held_out_kl_is_written_beside_a_record_whose_replies_it_reproduces_and_refused_otherwise(
        tmp_path, tiny_models, parrot):
    """bench/heldout_kl.measure on a committed run: the replies sampled again must score as the record's final scores
    did, every judge prompt by prompt; then the per-prompt KLs go beside the record with what measured them. Refused:
    another policy in the run folder than the one scored, a record whose RM scores differ on one prompt, another
    SFT build than the record's. And the report refuses a held-out KL once its record has changed."""
    import shutil
    import heldout_kl
    config = study.HYPOTHESES["kl"].configs[0]                         # a chitchat run
    args = argparse.Namespace(results_dir=str(tmp_path / "study"), runs_dir=str(tmp_path / "runs"), win_prompts=5,
                              seed_eval=4321, jobs=1, models={"chitchat": (str(tiny_models / "sft"),
                                                                           str(tiny_models / "rm"))})
    run_dir = tmp_path / "runs" / config.name / "seed3"
    shutil.copytree(parrot, run_dir / "policy")
    final = study.final_scores(args, str(run_dir), config)
    import torch
    threads = torch.get_num_threads()
    record = {"config": config.name, "seed": 3, "final": final, "trace": [{"step": 1, "kl": 2.0}],
              **study.provenance(args, args.models["chitchat"]), "threads": threads + 1}   # the run's, not ours
    study.write_record(study.record_path(args, config.name, 3), record)
    try:
        sidecar = heldout_kl.measure(args, config, 3)
    finally:
        torch.set_num_threads(threads)
    assert sidecar["threads"] == threads + 1                          # the thread count it measured at
    assert json.load(open(heldout_kl.sidecar_path(args, config.name, 3))) == sidecar
    assert len(sidecar["kl"]) == 5 and sidecar["policy_hash"] == study.folder_hash(str(parrot))
    assert sidecar["replies_checked_by"] == ["rm", "gold"] and sidecar["seed_eval"] == 4321
    assert sum(sidecar["kl"]) / 5 == pytest.approx(study.heldout_kl(args, record)) and sum(sidecar["kl"]) > 5
    shutil.rmtree(run_dir / "policy")                                  # the run folder now holds the SFT model
    shutil.copytree(tiny_models / "sft", run_dir / "policy")
    with pytest.raises(SystemExit, match="not the ones its record scored"):
        heldout_kl.measure(args, config, 3)
    shutil.rmtree(run_dir / "policy")
    shutil.copytree(parrot, run_dir / "policy")
    rm = final["rm"][:2] + [final["rm"][2] + 0.01] + final["rm"][3:]
    study.write_record(study.record_path(args, config.name, 3), {**record, "final": {**final, "rm": rm}})
    with pytest.raises(SystemExit, match="prompt 2: rm"):
        heldout_kl.measure(args, config, 3)
    with pytest.raises(SystemExit, match="another version of its record"):                 # the sidecar above is stale
        study.heldout_kl(args, record)
    study.write_record(study.record_path(args, config.name, 3), {**record, "sft_hash": "0" * 64})
    with pytest.raises(SystemExit, match="sft_hash"):
        heldout_kl.measure(args, config, 3)


def test_the_report_compares_again_at_the_held_out_kl_once_every_run_has_one(tmp_path):
    """real_kl10's table at the held-out KL: pairs matched by it (not by run_kl), the matched pairs' gap MA-PPO minus
    PPO, the fit on log held-out KL, a run at or below 0 left out of the fit, and nothing but a count while some run
    is not measured."""
    args = argparse.Namespace(results_dir=str(tmp_path))
    h = study.HYPOTHESES["real_kl10"]
    ppo, ma = h.configs
    rng = numpy.random.default_rng(0)
    done, measured = {ppo.name: [], ma.name: []}, {}
    held = {1: (1.0, 1.1), 2: (1.0, 3.0), 3: (1.0, 4.0)}               # matched on seed 1 only; run_kl on every seed
    for seed in (1, 2, 3):
        for c, kl in zip((ppo, ma), held[seed]):
            r = {"config": c.name, "seed": seed, "final": {"gold": list(rng.uniform(0, 1, 8))},
                 "trace": [{"step": s, "kl": 1.0} for s in range(1, 6)]}
            study.write_record(study.record_path(args, c.name, seed), r)
            done[c.name].append(r)
            measured[(c.name, seed)] = kl

    def sidecar(name, seed, kls):
        study.write_record(os.path.join(str(tmp_path), "runs", name, f"seed{seed}.heldout_kl.json"),
                           {"kl": kls, "record_sha256": study.record_digest(args, name, seed)})
    assert study.heldout_kl_lines(args, h, done, "gold", {}) == []                     # none measured: nothing
    for (name, seed), kl in measured.items():
        if seed < 3:
            sidecar(name, seed, [kl - 0.5, kl + 0.5])
    partial = study.heldout_kl_lines(args, h, done, "gold", {})
    assert partial[1].startswith("Held-out KL (bench/heldout_kl.py): 4 of 6")
    assert f"| {ma.label} | 2 | 3.00 | 1.00 |" in partial and not any(f"| {ma.label} | 3 |" in x for x in partial)
    sidecar(ppo.name, 3, [1.0])
    sidecar(ma.name, 3, [4.0])
    result = {}
    lines = study.heldout_kl_lines(args, h, done, "gold", result)
    out = result["equal_kl_heldout"]
    assert out["pairs_matched"] == 1 and out["pairs"] == 3 and out["left_out"] == 0
    assert "| 2 | 1.00 / 3.00 | 3.00 | no | 1.00 / 1.00 |" in lines
    assert "| 1 | 1.00 / 1.10 | 1.10 | yes | 1.00 / 1.00 |" in lines
    ppo1, ma1 = done[ppo.name][0], done[ma.name][0]
    assert out["matched_pairs"]["mean"] == pytest.approx(
        numpy.mean(ma1["final"]["gold"]) - numpy.mean(ppo1["final"]["gold"]))
    expected = study.equal_kl_fit([(r["seed"], c is ma, measured[(c.name, r["seed"])], r["final"]["gold"])
                                   for c in h.configs for r in done[c.name]])
    assert out["fit"]["mean"] == pytest.approx(expected["mean"])
    assert out["fit"]["slope"] == pytest.approx(expected["slope"])
    assert any(line.startswith("- held-out KL: fit of each run's final mean gold on log final KL") for line in lines)
    sidecar(ma.name, 3, [-0.5, 0.1])                                   # a mean below 0: no log, out of the fit
    result = {}
    lines = study.heldout_kl_lines(args, h, done, "gold", result)
    assert result["equal_kl_heldout"]["left_out"] == 1                                  # seed 3 unpaired
    assert result["equal_kl_heldout"]["fit"]["runs"] == 4
    assert "1 run(s) with a held-out KL at or below 0 left out of the fit." in lines[1]


def test_heldout_kl_measures_only_the_configurations_asked_for(tmp_path, capsys):
    """bench/heldout_kl.py --configs: a run of another configuration with no policy folder is not touched (without
    the flag it is refused); a name that is no configuration of the hypotheses is an error that names it."""
    import heldout_kl
    ppo, ma = study.HYPOTHESES["kl"].configs
    results = tmp_path / "study"
    study.write_record(os.path.join(str(results), "runs", ma.name, "seed3.json"),
                       {"config": ma.name, "seed": 3, "final": {"gold": [0.5]}})
    common = ["kl", "--results_dir", str(results), "--runs_dir", str(tmp_path / "runs")]
    assert heldout_kl.main([*common, "--configs", ppo.name]) == []
    with pytest.raises(SystemExit, match="no final policy"):
        heldout_kl.main(common)
    with pytest.raises(SystemExit):
        heldout_kl.main([*common, "--configs", f"{ppo.name},kl_n9_6"])
    assert "'kl_n9_6' is not a configuration of kl" in capsys.readouterr().err


def test_runs_of_another_build_are_compared_again_without_them(tmp_path):
    """real_kl10's report when some runs were trained from another SFT / RM build than its SFT record's: the fit and
    the matched pairs again over that build's runs alone, equal to the fit over those runs; nothing when every run is
    of the record's build."""
    args = argparse.Namespace(results_dir=str(tmp_path))
    h = study.HYPOTHESES["real_kl10"]
    ppo, ma = h.configs
    rng = numpy.random.default_rng(1)
    study.write_record(study.record_path(args, study.sft_record_name(ppo), 0),
                       {"config": "real_kl10_sft", "seed": 0, "final": {"gold": [0.2] * 8}, "sft_hash": "a",
                        "rm_hash": "b"})
    records = {ppo.name: [], ma.name: []}
    for seed in (1, 2, 3, 4):
        for c in (ppo, ma):
            kl = float(rng.uniform(0.5, 1.0))          # each pair matched or not, as it falls
            records[c.name].append({"config": c.name, "seed": seed, "final": {"gold": list(rng.uniform(0, 1, 8))},
                                    "rows": [{"step": 30, "eval/gold": 0.5}], "sft_hash": "a", "rm_hash": "b",
                                    "trace": [{"step": s, "kl": kl} for s in range(1, 6)]})
    result = {}
    lines = study.matched_kl_table(args, h, records, result)
    assert "equal_kl_one_build" not in result and not any("build alone" in x for x in lines)
    records[ma.name][3]["sft_hash"] = "c"                         # seed 4's MA-PPO run: another build
    result = {}
    lines = study.matched_kl_table(args, h, records, result)
    one = result["equal_kl_one_build"]
    assert (one["runs"], one["of"]) == (7, 8) and any("(7 of 8 runs" in x for x in lines)
    expected = study.equal_kl_fit([(r["seed"], c is ma, study.run_kl(r), r["final"]["gold"])
                                   for c in h.configs for r in records[c.name] if r["sft_hash"] == "a"])
    assert one["fit"]["mean"] == pytest.approx(expected["mean"]) and one["fit"]["seeds"] == 3
    assert result["equal_kl"]["fit"]["seeds"] == 4                # the verdict's fit still counts every run


def test_a_study_stopped_by_sigterm_stops_the_runs_it_started(tmp_path):
    """A real study (its first step builds the SFT model: an sft.py child) sent SIGTERM: the child gets it too, saves
    and exits, and the study exits after it, rather than leaving the child writing checkpoints into the folders of a
    study started again."""
    import signal
    import time
    import psutil
    study_proc = subprocess.Popen([sys.executable, "bench/learning_efficiency.py", "kl", "--seeds", "1",
                                   "--sft_path", str(tmp_path / "sft"), "--rm_path", str(tmp_path / "rm"),
                                   "--results_dir", str(tmp_path / "results"), "--runs_dir", str(tmp_path / "runs")],
                                  cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def cmdline(proc):         # () for a child that has exited but is not reaped yet (a zombie, e.g. a git call)
        try:
            return proc.cmdline()
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            return ()
    child = None
    try:
        deadline = time.time() + 300
        while child is None and time.time() < deadline and study_proc.poll() is None:
            child = next((c for c in psutil.Process(study_proc.pid).children() if "sft.py" in cmdline(c)), None)
            time.sleep(0.5)
        assert child is not None, "the study started no sft.py"
        time.sleep(3)                                     # past its start, into its steps
        study_proc.send_signal(signal.SIGTERM)
        assert study_proc.wait(timeout=300) == 128 + signal.SIGTERM
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert "stopping 1 process(es) it started" in study_proc.stderr.read()
    finally:
        for proc in ([child] if child else []):
            if proc.is_running():
                proc.kill()
        if study_proc.poll() is None:
            study_proc.kill()


def test_a_task_whose_scores_do_not_move_by_the_margin_gets_no_verdict_by_hand(tmp_path):
    """The margin means something where PPO's final score moved from the SFT model's by at least MOVES margins: a
    gain of 0.15 against 4 x 0.05 leaves every comparison of the hypothesis its numbers and no rule word (the code
    task's pass rate today); a gain of 0.3 keeps the words, under the hypothesis' own margin."""
    h = study.dataclasses.replace(study.HYPOTHESES["kl_decided"], planned=())       # its margin, every seed in
    ppo = [{"seed": s, "final": {"gold": [0.3 + 0.1 * s, 0.3 - 0.1 * s]}} for s in (1, 2)]      # mean 0.3
    sft = {"final": {"gold": [0.15, 0.15]}}
    rules = study.rules_for(h, ppo, sft)
    assert rules["gain"] == pytest.approx(0.15) and rules["margin"] == study.KL_DECIDED_MARGIN == 0.055
    assert rules["void"] == ("the task's scores do not move by the margin (PPO's final gold +0.150 from the SFT "
                             "model's, under 4 x ±0.055)")
    assert study.rules_for(h, ppo, {"final": {"gold": [0.0, 0.0]}})["void"] is None
    study.RULES.update(rules)
    try:
        c = study.verdict(0.0, 0.001, 6)
    finally:
        study.RULES.clear()
        study.RULES.update(margin=study.MARGIN, void=None)
    assert c["verdict"].startswith("no verdict: the task's scores") and c["ci95"][1] > 0 and c["margin"] == 0.055
    assert study.verdict(0.0, 0.001, 6)["verdict"] == "level"


def test_a_record_counts_the_iterations_its_command_line_runs():
    """The code task's runs add --steps 80 after the study's 120 (--code_args): the record's `steps` is the last
    one, what ppo.py ran (the code records before this said 120); a chitchat run keeps the study's."""
    args = argparse.Namespace(steps=120, eval_every=10, n_eval_prompts=128, ppo_args="",
                              models={"code": ("runs/code/sft", "runs/code/rm"), "chitchat": ("sft", "rm")},
                              code_args="--sft_args '--max_steps 200' --steps 80 --policy_lr 1e-4")
    argv = study.ppo_flags(args, study.HYPOTHESES["critic_free_code"].configs[0], 1, "runs/x")
    assert argv.count("--steps") == 2 and study.run_steps(argv) == 80
    assert study.run_steps(study.ppo_flags(args, study.HYPOTHESES["kl_decided"].configs[0], 1, "runs/x")) == 120


def test_kl_decided_was_sized_from_kls_five_pairs():
    """The plan kl_decided's rule quotes, recomputed from `kl`'s records: the margin a tenth of PPO's gold gain, 9
    seeds at the pilot's variance and 25 at its 80% bound (chi-square, 3 degrees of freedom) to bring the
    level-detectable effect under it, 20 between."""
    args = argparse.Namespace(results_dir=os.path.join(ROOT, "docs", "study"))
    records = study.load_records(args, ["kl_n1_6", "kl_n5_6"])
    plan = study.decided_plan(records["kl_n1_6"], records["kl_n5_6"], study.committed_sft_record(
        args, study.HYPOTHESES["kl"].configs[0]))
    assert round(plan["margin"], 3) == study.KL_DECIDED_MARGIN and plan["df"] == 3
    assert study.chi2_quantile(0.2, 3) == pytest.approx(1.005, abs=1e-3)          # the chi-square table's
    at = {n: (a < study.KL_DECIDED_MARGIN, b < study.KL_DECIDED_MARGIN) for n, (a, b) in plan["at"].items()}
    assert at == {9: (True, False), 15: (True, False), 20: (True, False), 25: (True, True)}
    assert len(study.KL_DECIDED_SEEDS) == 20 and not set(study.KL_DECIDED_SEEDS) & {1, 2, 3, 4, 5}


def test_runs_that_logged_eval_kl_are_compared_again_at_it_by_hand(tmp_path):
    """kl_decided's records keep eval/kl at the last evaluation: the report's held-out check matches the pairs by
    it (here seed 1 matched by run_kl but not by eval/kl, seed 2 the other way) without any sidecar."""
    h = study.HYPOTHESES["kl_decided"]
    ppo, ma = h.configs

    def record(config, seed, kl, eval_kl, gold):
        return {"config": config.name, "seed": seed, "steps": 120, "trace": [{"step": 120, "kl": kl}],
                "rows": [{"step": 120, "eval/gold": gold, "eval/kl": eval_kl, "kl": kl}],
                "final": {"gold": [gold, gold + 0.1]}}
    done = {ppo.name: [record(ppo, 1, 6.0, 6.0, 0.8), record(ppo, 2, 6.0, 6.0, 0.7)],
            ma.name: [record(ma, 1, 6.5, 9.0, 0.75), record(ma, 2, 9.0, 6.5, 0.72)]}
    assert study.final_eval_kl(done[ma.name][0]) == 9.0
    assert study.final_eval_kl({**done[ma.name][0], "steps": 80}) is None          # not the final policy's
    result = {}
    lines = study.heldout_kl_lines(argparse.Namespace(results_dir=str(tmp_path)), h, done, "gold", result)
    assert "eval/kl" in lines[1] and "1 of 2 pairs at matched held-out KL" in lines[1]
    assert "| 1 | 6.00 / 9.00 | 1.50 | no | 6.00 / 6.50 |" in lines
    assert "| 2 | 6.00 / 6.50 | 1.08 | yes | 6.00 / 9.00 |" in lines
    assert result["equal_kl_heldout"]["matched_pairs"]["mean"] == pytest.approx(0.02)


def test_a_hypothesis_with_planned_seeds_gets_no_verdict_until_all_are_in():
    h = study.HYPOTHESES["kl_decided"]
    records = {c.name: [{"seed": s, "final": {"gold": [0.8]}} for s in h.planned] for c in h.configs}
    sft = {"final": {"gold": [0.2]}}
    assert study.rules_for(h, records[h.configs[0].name], sft, records)["void"] is None
    records[h.configs[1].name] = records[h.configs[1].name][:-1]
    assert study.rules_for(h, records[h.configs[0].name], sft, records)["void"].startswith("in progress (19 of 20")


def test_no_one_build_check_when_no_run_is_of_the_sft_records_build(tmp_path):
    """kl_decided's runs all train on a rebuild of the chitchat recipe: the check over the SFT record's build alone
    would have no run, so the report leaves it out rather than print a comparison of 0 runs."""
    args = argparse.Namespace(results_dir=str(tmp_path))
    study.write_record(study.record_path(args, "chitchat_sft", 0), {"config": "chitchat_sft", "seed": 0,
                                                                     "sft_hash": "a", "rm_hash": "b", "final": {}})
    h = study.HYPOTHESES["kl_decided"]
    run = {"seed": 6, "sft_hash": "c", "rm_hash": "d", "trace": [{"step": 1, "kl": 6.0}], "final": {"gold": [0.5]}}
    done = {c.name: [run] for c in h.configs}
    assert study.one_build_lines(args, h, done, "gold", {}) == []
    done[h.configs[0].name] = [{**run, "sft_hash": "a", "rm_hash": "b"}]                # one of two: the check
    assert study.one_build_lines(args, h, done, "gold", {})[1].startswith("The same over the runs of the SFT record")
