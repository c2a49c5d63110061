"""macro_actions.py, as a specification: paper §3.2, §3.3 and App. D.1."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import macro_actions as ma
from reference import (fixed_ngram_loop, macro_gae_loop, macro_lengths, macro_rewards_loop, perplexity_loop,
                       sigma_loop, token_gae)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LENGTHS = [7, 1, 12, 0, 5]          # rows of different lengths, one empty


def random_batch(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    mask = (torch.arange(T) < torch.tensor(lengths).unsqueeze(1)).long()
    values = torch.randn(len(lengths), T, generator=g) * mask
    rewards = torch.randn(len(lengths), T, generator=g) * mask
    logprobs = -torch.rand(len(lengths), T, generator=g) * 3 * mask
    return values, rewards, logprobs, mask


def all_terminations(mask, logprobs):
    return {
        "n1": ma.fixed_ngram_starts(mask, 1),
        "n3": ma.fixed_ngram_starts(mask, 3),
        "whole": ma.fixed_ngram_starts(mask, None),
        "randomized": ma.randomized_ngram_starts(mask, generator=torch.Generator().manual_seed(1)),
        "ppl": ma.perplexity_starts(logprobs, mask),
        "entropy": ma.entropy_starts(-logprobs, mask, threshold=1.5),
    }


# --- GAE -------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_n1_equals_token_level_gae(gamma, lam):
    values, rewards, _, mask = random_batch()
    starts = ma.fixed_ngram_starts(mask, 1)
    assert torch.equal(starts, mask.bool())
    adv, ret = ma.macro_advantages(values, rewards, mask, starts, gamma=gamma, lam=lam)
    for b, L in enumerate(LENGTHS):
        ref_adv, ref_ret = token_gae(values[b], rewards[b], L, gamma, lam)
        # the same float32 operations in the same order: bit-for-bit equal
        assert torch.equal(adv[b, :L], ref_adv) and torch.equal(ret[b, :L], ref_ret)
        assert torch.equal(adv[b, L:], torch.zeros_like(adv[b, L:]))


@pytest.mark.parametrize("n", [None, 0])
def test_whole_response_is_one_macro_action(n):
    values, rewards, _, mask = random_batch()
    starts = ma.fixed_ngram_starts(mask, n)
    assert starts.sum(-1).tolist() == [1 if L else 0 for L in LENGTHS]
    adv, ret = ma.macro_advantages(values, rewards, mask, starts, lam=0.5, sigma="equal")
    for b, L in enumerate(LENGTHS):
        if L:
            v_macro = values[b, :L].mean()
            assert torch.allclose(adv[b, :L], (rewards[b, :L].sum() - v_macro).expand(L), atol=1e-6)
            assert torch.allclose(ret[b, :L], rewards[b, :L].sum().expand(L), atol=1e-6)


@pytest.mark.parametrize("sigma", ["equal", "unit", "position", "first"])
@pytest.mark.parametrize("termination", ["n3", "randomized", "ppl", "entropy"])
def test_macro_gae_matches_reference_loop(sigma, termination):
    values, rewards, logprobs, mask = random_batch(seed=3)
    starts = all_terminations(mask, logprobs)[termination]
    adv, ret = ma.macro_advantages(values, rewards, mask, starts, gamma=0.99, lam=0.9, sigma=sigma)
    ref_adv, ref_ret = macro_gae_loop(values, rewards, mask, starts, 0.99, 0.9, sigma)
    assert torch.allclose(adv, ref_adv, atol=1e-5) and torch.allclose(ret, ref_ret, atol=1e-5)


# --- macro rewards ---------------------------------------------------------------------------

@pytest.mark.parametrize("agg", ["sum", "mean"])
@pytest.mark.parametrize("termination", ["n1", "n3", "whole", "randomized", "ppl"])
def test_macro_rewards_match_reference_loop(agg, termination):
    _, kl_rewards, logprobs, mask = random_batch(seed=4)
    score = torch.randn(len(LENGTHS), generator=torch.Generator().manual_seed(2))
    starts = all_terminations(mask, logprobs)[termination]
    rewards = ma.macro_rewards(kl_rewards, score, mask, starts, agg)
    assert torch.allclose(rewards * mask, macro_rewards_loop(kl_rewards, score, mask, starts, agg), atol=1e-6)


def test_macro_rewards_sum_is_the_paper_and_mean_the_released_code_on_a_hand_case():
    """Macro actions of 3 and 2 tokens, KL rewards -0.3 -0.6 -0.9 | -0.2 -0.4, score 2.
    sum:  R = -1.8, 1.4 (the paper);  mean: R = -0.6, -0.3 + 2 = 1.7 (the released code)."""
    mask = torch.ones(1, 5)
    starts = torch.tensor([[True, False, False, True, False]])
    kl_rewards, score = torch.tensor([[-0.3, -0.6, -0.9, -0.2, -0.4]]), torch.tensor([2.0])
    zeros = torch.zeros(1, 5)
    for agg, (r1, r2) in {"sum": (-1.8, 1.4), "mean": (-0.6, 1.7)}.items():
        rewards = ma.macro_rewards(kl_rewards, score, mask, starts, agg)
        assert torch.allclose(ma.macro_sum(rewards, starts)[0, [0, 3]], torch.tensor([r1, r2]))
        adv, _ = ma.macro_advantages(zeros, rewards, mask, starts, gamma=1.0, lam=1.0)   # V = 0: A = sum of later R
        assert torch.allclose(adv[0], torch.tensor([r1 + r2] * 3 + [r2] * 2))
    with pytest.raises(ValueError, match="'max'"):
        ma.macro_rewards(kl_rewards, score, mask, starts, "max")


def test_final_token_apart_is_the_released_split_and_keeps_the_score_whole():
    """The released code's `split_list += [1]`: 12 tokens at n=5 are [5, 5, 1, 1] (ours alone: [5, 5, 2]); with
    the mean macro reward the last token's KL reward is not averaged and the score is added whole."""
    lengths = [12, 7, 2, 1]
    mask = torch.tensor([[1] * L + [0] * (12 - L) for L in lengths]).float()
    fixed = ma.fixed_ngram_starts(mask, 5)
    starts = ma.final_token_apart(fixed, mask)
    assert macro_lengths(fixed[0].tolist(), 12) == [5, 5, 2]
    assert [macro_lengths(starts[b].tolist(), L) for b, L in enumerate(lengths)] == [[5, 5, 1, 1], [5, 1, 1], [1, 1], [1]]
    assert not (starts & ~mask.bool()).any()
    torch.manual_seed(0)
    kl_rewards, score = -torch.rand(4, 12) * mask, torch.randn(4)
    rewards = ma.macro_rewards(kl_rewards, score, mask, starts, "mean")
    assert torch.allclose(rewards * mask, macro_rewards_loop(kl_rewards, score, mask, starts, "mean"), atol=1e-6)
    assert torch.allclose(rewards[0, 11], kl_rewards[0, 11] + score[0])        # the final macro action: one token


def test_reward_sum_preserves_total_and_mean_shrinks_it_n_fold():
    # KL-only rewards of -1 on every token, zero values: with gamma = lam = 1 the first token's
    # advantage is the total reward the policy sees.
    mask = torch.ones(1, 10, dtype=torch.long)
    kl_rewards, values, score = -torch.ones(1, 10), torch.zeros(1, 10), torch.zeros(1)
    starts = ma.fixed_ngram_starts(mask, 5)
    a_sum, _ = ma.macro_advantages(values, ma.macro_rewards(kl_rewards, score, mask, starts, "sum"), mask, starts, lam=1.0)
    a_mean, _ = ma.macro_advantages(values, ma.macro_rewards(kl_rewards, score, mask, starts, "mean"), mask, starts,
                                    lam=1.0)
    assert a_sum[0, 0].item() == pytest.approx(-10.0)        # sum: the total reward is kept
    assert a_mean[0, 0].item() == pytest.approx(-2.0)        # the released code's mean: n-fold less


def test_batch_rows_are_independent():
    values, rewards, logprobs, mask = random_batch(seed=5)
    for name, starts in all_terminations(mask, logprobs).items():
        for sigma in ["equal", "position"]:
            adv, ret = ma.macro_advantages(values, rewards, mask, starts, sigma=sigma)
            for b, L in enumerate(LENGTHS):
                row = slice(b, b + 1), slice(0, max(L, 1))
                alone = all_terminations(mask[row], logprobs[row])[name]
                if name != "randomized":        # its row draws depend on the generator's position
                    assert torch.equal(alone, starts[row]), name
                a1, r1 = ma.macro_advantages(values[row], rewards[row], mask[row], starts[row], sigma=sigma)
                assert torch.allclose(a1, adv[row], atol=1e-6) and torch.allclose(r1, ret[row], atol=1e-6)


def test_padding_never_starts_and_gets_zero_advantage():
    values, rewards, logprobs, mask = random_batch(seed=7)
    values, rewards = values + 5 * (1 - mask), rewards + 5 * (1 - mask)   # garbage in padding
    for name, starts in all_terminations(mask, logprobs).items():
        assert not (starts & ~mask.bool()).any(), name
        first = torch.tensor([L > 0 for L in LENGTHS])
        assert torch.equal(starts[:, 0], first), name                      # first real token starts
        adv, ret = ma.macro_advantages(values, rewards, mask, starts)
        assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all(), name


# --- terminations ----------------------------------------------------------------------------

def test_fixed_ngram_matches_loop_and_last_macro_may_be_shorter():
    _, _, _, mask = random_batch()
    starts = ma.fixed_ngram_starts(mask, 5)
    assert torch.equal(starts, fixed_ngram_loop(mask, 5))
    assert macro_lengths(starts[2].tolist(), 12) == [5, 5, 2]


def test_randomized_lengths_come_from_the_list_and_cover_the_response():
    lengths, repeats = (2, 3, 5, 10), 3
    mask = (torch.arange(80) < torch.randint(1, 81, (200, 1), generator=torch.Generator().manual_seed(0))).long()
    starts = ma.randomized_ngram_starts(mask, lengths, repeats, generator=torch.Generator().manual_seed(0))
    pool = sorted(list(lengths) * repeats)
    orders = set()
    for b in range(mask.shape[0]):
        L = int(mask[b].sum())
        lens = macro_lengths(starts[b].tolist(), L)
        assert sum(lens) == L and lens                          # covers the response exactly
        drawn = lens if sum(lens[:-1]) < sum(pool) else lens[:-1]
        for n in drawn[:-1]:
            assert n in lengths                                # never 1 (released code's bug)
        assert all(drawn[:-1].count(n) <= repeats for n in lengths)
        if sum(lens) > sum(pool):                              # list used up: the rest is one macro
            assert sorted(lens[:-1]) == pool
        orders.add(tuple(lens[:4]))
    assert len(orders) > 50                                    # rows are shuffled independently
    again = ma.randomized_ngram_starts(mask, lengths, repeats, generator=torch.Generator().manual_seed(0))
    assert torch.equal(starts, again)                          # seeded: deterministic
    with pytest.raises(ValueError, match="lengths"):
        ma.randomized_ngram_starts(mask, (0, 2))


def test_perplexity_rule_on_a_hand_worked_sequence():
    # NLL 2 | 1 -> mean 1.5 | 3 > 1.5 new | 1.5, 1.5, 0.5 (means 2.25, 2.0, 1.625) | 4 > 1.625 new
    # | 4 == mean 4: equal NLL keeps perplexity flat, so it joins
    nll = torch.tensor([[2.0, 1.0, 3.0, 1.5, 1.5, 0.5, 4.0, 4.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0]])
    starts = ma.perplexity_starts(-nll, mask)
    assert starts.int().tolist() == [[1, 0, 1, 0, 0, 0, 1, 0, 0]]


def test_perplexity_never_increases_inside_a_macro_action_and_matches_loop():
    _, _, logprobs, mask = random_batch(lengths=[40, 33, 1, 17], seed=11)
    starts = ma.perplexity_starts(logprobs, mask)
    assert torch.equal(starts, perplexity_loop(logprobs, mask))
    for b in range(mask.shape[0]):
        L = int(mask[b].sum())
        ppl_prev = None
        for t in range(L):
            if starts[b, t]:
                total, count, ppl_prev = 0.0, 0, None
                if t > 0:   # a start means this token would have raised the previous macro's PPL
                    assert -logprobs[b, t] > prev_total / prev_count
            total, count = total - float(logprobs[b, t]), count + 1
            ppl = torch.exp(torch.tensor(total / count))
            assert ppl_prev is None or ppl <= ppl_prev * (1 + 1e-6)
            ppl_prev, prev_total, prev_count = ppl, total, count


def test_entropy_rule_on_a_hand_worked_sequence():
    entropy = torch.tensor([[0.1, 2.0, 0.5, 3.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    starts = ma.entropy_starts(entropy, mask, threshold=1.0)
    assert starts.int().tolist() == [[1, 1, 0, 1, 0, 0]]      # 1.0 is not above the threshold


# --- sigma -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["equal", "unit", "position", "first"])
def test_sigma_weights_sum_to_one_inside_each_macro_action(kind):
    _, _, logprobs, mask = random_batch(seed=2)
    for starts in all_terminations(mask, logprobs).values():
        w = ma.sigma_weights(starts, mask, kind)
        ids = ma.macro_ids(starts)
        sums = torch.zeros_like(w).scatter_add(1, ids, w)
        n_macros = starts.sum(-1, keepdim=True)
        expected = (torch.arange(w.shape[1]) < n_macros).float()
        assert torch.allclose(sums, expected, atol=1e-6)
        assert (w[mask == 0] == 0).all()


def test_sigma_weights_match_paper_d1_on_worked_examples():
    starts = torch.tensor([[1, 0, 0, 1, 0, 1]], dtype=torch.bool)   # macros of 3, 2, 1 tokens
    mask = torch.ones(1, 6, dtype=torch.long)
    # App. D.1 for |w| = 3: H = 1/3 + 1/2 + 1 = 11/6 -> sigma = (2/11, 3/11, 6/11); |w| = 2: (1/3, 2/3)
    position = [2 / 11, 3 / 11, 6 / 11, 1 / 3, 2 / 3, 1.0]
    assert ma.sigma_weights(starts, mask, "position")[0].tolist() == pytest.approx(position)
    assert ma.sigma_weights(starts, mask, "equal")[0].tolist() == pytest.approx([1 / 3] * 3 + [0.5] * 2 + [1])
    assert ma.sigma_weights(starts, mask, "unit")[0].tolist() == [0, 0, 1, 0, 1, 1]
    assert ma.sigma_weights(starts, mask, "first")[0].tolist() == [1, 0, 0, 1, 0, 1]
    for n in range(1, 8):
        assert ma.sigma_weights(torch.tensor([[True] + [False] * (n - 1)]), torch.ones(1, n), "position")[0].tolist() \
            == pytest.approx(sigma_loop(n, "position"))
    with pytest.raises(ValueError, match="sigma"):
        ma.sigma_weights(starts, mask, "uniform")


def test_macro_ids_are_segment_ids():
    starts = torch.tensor([[1, 0, 1, 1, 0, 0]], dtype=torch.bool)
    assert ma.macro_ids(starts).tolist() == [[0, 0, 1, 2, 2, 2]]


def test_the_file_runs_alone_with_torch_and_without_numpy(tmp_path):
    """macro_actions.py is the file people copy: it needs torch alone. Loaded from a copy outside the checkout,
    in a fresh interpreter where numpy cannot be imported, every n-gram / perplexity / GAE path runs."""
    shutil.copy(os.path.join(ROOT, "macro_actions.py"), tmp_path / "macro_actions.py")
    code = """
import sys, importlib.abc
class NoNumpy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "numpy":
            raise ModuleNotFoundError("No module named 'numpy' (blocked)")
sys.meta_path.insert(0, NoNumpy())
import torch
import macro_actions as ma
lp = torch.log(torch.tensor([[0.5, 0.5, 0.1, 0.9, 0.2, 0.9, 0.9, 0.9]]))
mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
starts = ma.perplexity_starts(lp, mask)
adv, ret = ma.macro_advantages(torch.zeros(1, 8), ma.macro_rewards(lp, torch.ones(1), mask, starts), mask, starts)
print(starts.int().tolist(), ma.fixed_ngram_starts(mask, 2).int().tolist(), "numpy" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[[1,", "0,", "1,", "0,", "1,", "0,", "0,", "0]]", "[[1,", "0,", "1,", "0,", "1,",
                                   "0,", "0,", "0]]", "False"]


def test_macro_actions_py_alone_with_torch_runs_its_docstring_example(tmp_path):
    """The copy path: macro_actions.py in a folder of its own, nothing of ours beside it, passes
    `python -m doctest` (terminations -> macro rewards -> macro advantages -> the clipped macro loss)."""
    shutil.copy(os.path.join(ROOT, "macro_actions.py"), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "doctest", "-v", "macro_actions.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "0 failed" in proc.stdout and "passed" in proc.stdout


def test_termination_starts_picks_each_termination_by_name_and_refuses_an_unknown_one(tokenizer):
    """The picker returns what the termination's own function returns, for every name it knows."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1.0] * 9, [1.0] * 4 + [0.0] * 5])
    logprobs, entropy = -torch.rand(2, 9, generator=g) * 3, torch.rand(2, 9, generator=g) * 4
    expected = {"fixed": ma.fixed_ngram_starts(mask, 3), "ppl": ma.perplexity_starts(logprobs, mask),
                "entropy": ma.entropy_starts(entropy, mask, 2.0), "segment": mask.bool() & (torch.arange(9) % 2 == 0)}
    for name, want in expected.items():
        got, fallback = ma.termination_starts(name, mask, n=3, logprobs=logprobs, entropy=entropy, threshold=2.0,
                                              segments=want)
        assert torch.equal(got, want) and fallback == 0.0, name
    randomized, _ = ma.termination_starts("randomized", mask, generator=torch.Generator().manual_seed(1))
    assert torch.equal(randomized, ma.randomized_ngram_starts(mask, generator=torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="unknown termination 'bigram'"):
        ma.termination_starts("bigram", mask)


def test_entropy_in_place_is_the_plain_formula_bit_for_bit():
    """ma.entropy multiplies in one buffer of its own: the same bits as -(p * logp, 0 where p is 0).sum(-1), the input
    untouched, no gradient; a logit of -inf (probability 0) adds 0."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 4096, requires_grad=True)
    logp = (logits / 0.8).log_softmax(-1)
    with torch.no_grad():
        logp_inf = logp.clone()
        logp_inf[0, 0, :7] = float("-inf")
    for x in (logp, logp_inf):
        before = x.detach().clone()
        p = x.detach().exp()
        plain = -(p * x.detach().masked_fill(p == 0, 0.0)).sum(-1)
        got = ma.entropy(x)
        assert torch.equal(got, plain) and torch.isfinite(got).all() and not got.requires_grad
        assert torch.equal(x.detach(), before)
