"""bench/learning_efficiency.py: the study's statistics, checked by hand."""
import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import learning_efficiency as study  # noqa: E402


def test_t_interval_by_hand():
    mean, half = study.t_interval([1.0, 2.0, 3.0])          # sd 1, n 3: 4.303 / sqrt(3)
    assert mean == 2.0 and half == pytest.approx(4.303 / 3 ** 0.5)
    assert study.t_interval([5.0])[1] != study.t_interval([5.0])[1]          # nan for one seed


def test_steps_to_parity_by_hand():
    base = ([10, 20, 30, 40], [0.0, 1.0, 2.0, 2.0])          # reaches its final 2.0 at 30
    fast = ([10, 20, 30, 40], [0.0, 2.0, 2.0, 2.0])
    slow = ([10, 20, 30, 40], [0.0, 0.5, 1.0, 1.5])
    assert study.steps_to_parity(base, fast, 1) == (30, 20)
    assert study.steps_to_parity(base, slow, 1) == (30, None)


def runs_of(curves):
    return [[{"step": s, "eval/rm": v} for s, v in zip([10, 20, 30], c)] for c in curves]


def test_bootstrap_parity_interval_covers_the_point_and_counts_never():
    base = runs_of([[0, 1, 2], [0, 1, 2]])
    same = study.bootstrap_parity(base, runs_of([[0, 2, 2], [0, 2, 2]]), "eval/rm", 1, draws=200)
    assert same["steps"] == 20 and same["low"] == same["high"] == 20 and same["never"] == 0
    mixed = study.bootstrap_parity(base, runs_of([[0, 3, 3], [0, 0, 0]]), "eval/rm", 1, draws=400)
    assert mixed["ppo_steps"] == 30 and mixed["steps"] is None        # mean curve 0, 1.5, 1.5 < 2
    assert 0.6 < mixed["never"] < 0.9          # reached only when both draws are the good run: ~3/4 never


def test_bootstrap_win_rate_pools_seeds_with_ties_half():
    rate, low, high = study.bootstrap_win_rate([(6, 2, 10), (2, 0, 10)], draws=400)
    assert rate == pytest.approx((8 + 1) / 20) and low <= rate <= high
    assert low == pytest.approx(0.2) and high == pytest.approx(0.7)   # all-seed-2 and all-seed-1 draws


def test_every_hypothesis_starts_with_its_baseline_and_names_are_unique():
    for name, (question, configs) in study.HYPOTHESES.items():
        assert configs[0][2][-1] == "1", name                         # PPO first: the parity baseline
        assert len({c[0] for c in configs}) == len(configs)


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
    assert study.per_seed_wins(ppo, ma, "gold") == [(1, 1, 3), (1, 1, 3)]       # seed 3 has no partner
    gap, half = study.paired_gap(ppo, ma, "eval/rm")                             # seed 2: 1 - 2, seed 1: 2 - 1
    assert gap == 0.0 and half == pytest.approx(12.706)   # sd sqrt(2) over 2 seeds


def test_report_pairs_configurations_with_their_own_ppo(tmp_path):
    def run(seed, level):
        return {"seed": seed, "rows": [{"step": s, "eval/rm": level, "eval/gold": 0.5, "kl": 1.0} for s in (10, 20)],
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
