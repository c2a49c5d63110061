"""Credit without a critic, as a specification: group baselines (GRPO, Dr. GRPO, RLOO), Monte Carlo values at
macro-action starts (SPO-chain) and the sequence ratio (GSPO), each checked against a plain loop written from
its paper."""
import math
from stages import ppo_config, ppo_losses
import os

import pytest
import torch

import macro_actions as ma

GROUPS = [[1.0, 0.0, 0.0, 1.0], [0.5, -2.0, 3.0, 0.25], [2.0, 2.0, 2.0, 2.0]]     # 3 prompts x K = 4; one ties


# --- plain-loop references ---------------------------------------------------------------------

def group_loop(groups, norm):
    """One group at a time, from the papers' formulas."""
    out = []
    for g in groups:
        K, mean = len(g), sum(g) / len(g)
        std = math.sqrt(sum((r - mean) ** 2 for r in g) / (K - 1))
        for i, r in enumerate(g):
            if std == 0:
                out.append(0.0)                                     # a tie says nothing
            elif norm == "std":
                out.append((r - mean) / std)                        # GRPO
            elif norm == "none":
                out.append(r - mean)                                # Dr. GRPO
            else:
                out.append(r - sum(g[j] for j in range(K) if j != i) / (K - 1))    # RLOO
    return out


def spo_chain_loop(points, rewards, values, length):
    """One response: segments begin at its points; A_k = (the segment's rewards) + V(next point) - V(point),
    the last segment's V(next) being 0 (its score is in its rewards)."""
    begin = [t for t in range(length) if points[t]]
    adv = [0.0] * length
    for k, a in enumerate(begin):
        b = begin[k + 1] if k + 1 < len(begin) else length
        next_value = values[b] if b < length else 0.0
        for t in range(a, b):
            adv[t] = sum(rewards[a:b]) + next_value - values[a]
    return adv


def batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    mask = (torch.arange(T) < torch.tensor(lengths).unsqueeze(1)).long()
    return mask, torch.randn(len(lengths), T, generator=g) * mask


# --- group baselines ---------------------------------------------------------------------------

@pytest.mark.parametrize("norm", ["std", "none", "loo"])
def test_group_advantages_match_the_papers_formulas_on_hand_made_groups(norm):
    scores = torch.tensor(GROUPS).flatten()
    assert torch.allclose(ma.group_advantages(scores, 4, norm), torch.tensor(group_loop(GROUPS, norm)), atol=1e-6)


def test_rloo_on_a_hand_worked_group():
    """[1, 0, 0, 1]: each 1 is compared with the mean of (0, 0, 1) = 1/3, each 0 with (1, 0, 1) = 2/3."""
    adv = ma.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, "loo")
    assert torch.allclose(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


@pytest.mark.parametrize("norm", ["std", "none", "loo"])
def test_a_group_whose_scores_tie_gets_exactly_zero(norm):
    tied = torch.full((7,), 0.1)          # 0.1 seven times: R - mean is -7.5e-9 in float32, not 0, and std 8e-9
    assert torch.equal(ma.group_advantages(tied, 7, norm), torch.zeros(7))


def test_groups_are_independent_and_each_mean_baseline_sums_to_zero():
    scores = torch.tensor(GROUPS).flatten()
    other = scores.clone()
    other[4:8] = torch.tensor([9.0, -1.0, 0.0, 7.0])
    for norm in ("std", "none", "loo"):
        a, b = ma.group_advantages(scores, 4, norm), ma.group_advantages(other, 4, norm)
        assert torch.equal(a[:4], b[:4]) and torch.equal(a[8:], b[8:])
        assert torch.allclose(a.view(3, 4).sum(-1), torch.zeros(3), atol=1e-6)


def test_group_size_that_does_not_divide_the_batch_or_is_one_is_refused():
    with pytest.raises(ValueError, match="group_size 3"):
        ma.group_advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="group_size 1"):
        ma.group_advantages(torch.zeros(8), 1)
    with pytest.raises(ValueError, match="choose std, none or loo"):
        ma.group_advantages(torch.zeros(8), 4, "mean")


# --- what reaches the loss: whitening scales, never shifts; Dr. GRPO's constant divisor -----------

AUDIT_LENGTHS, AUDIT_SCORES = [16, 3, 9, 5, 16, 2, 2, 2], [0.25] * 4 + [1.0, 0.0, 0.6, 0.5]     # an audit's example


def audit_batch():
    mask = (torch.arange(16) < torch.tensor(AUDIT_LENGTHS)[:, None]).float()
    raw = ma.group_advantages(torch.tensor(AUDIT_SCORES), 4, "std").unsqueeze(-1) * mask
    return raw, mask


def test_whitening_shifted_the_audits_tied_group_and_flipped_a_sign():
    """The fault, pinned: the full whitening (gae's) moves the tied group to -0.4885 per token and gives the 7th sample,
    above its group's mean (+0.182), a negative advantage."""
    raw, mask = audit_batch()
    assert raw[6, 0].item() == pytest.approx(0.1823, abs=1e-4) and (raw[:4] == 0).all()
    shifted = ma.whiten(raw, mask)
    assert shifted[0, 0].item() == pytest.approx(-0.4885, abs=1e-4)
    assert shifted[6, 0].item() == pytest.approx(-0.185, abs=1e-3)


def test_scale_only_whitening_leaves_a_tied_group_at_zero_and_every_sign_as_the_estimator_gave_it():
    """--advantage group / mc: the batch's std divides, nothing is subtracted: the audit's tied group stays exactly 0
    on every token, and every advantage is the estimator's times one positive number (1 / the batch's token std)."""
    raw, mask = audit_batch()
    scaled = ma.whiten(raw, mask, shift=False)
    assert (scaled[:4] == 0).all() and (scaled[mask == 0] == 0).all()
    tokens = mask.bool()
    mean = raw[tokens].mean()
    std = ((raw[tokens] - mean) ** 2).mean().sqrt()                  # the biased token std, as the full whitening's
    assert torch.allclose(scaled[tokens], raw[tokens] / std, atol=1e-5)
    assert (torch.sign(scaled) == torch.sign(raw)).all()


def dr_grpo_loop(logp, old_logp, adv, mask, clip, budget):
    """Dr. GRPO (Liu et al. 2025, §3.1, Listing 1): sum_i sum_t of the clipped terms, divided by B x the budget."""
    total = 0.0
    for b in range(len(mask)):
        for t in range(int(mask[b].sum())):
            w = torch.exp(logp[b, t] - old_logp[b, t])
            total = total - torch.min(w * adv[b, t], w.clamp(1 - clip, 1 + clip) * adv[b, t])
    return total / (len(mask) * budget)


def test_dr_grpos_loss_is_the_token_sum_over_a_constant_and_a_short_responses_tokens_weigh_as_a_long_ones():
    logp, old, adv, mask = ratio_batch()
    starts = mask.bool()
    loss, _, _ = ma.clipped_policy_loss(logp, old, adv, mask, starts, 0.2, "token", budget=16)
    assert torch.allclose(loss, dr_grpo_loop(logp, old, adv, mask, 0.2, 16), atol=1e-6)
    loss.backward()
    grad = logp.grad.clone()
    # at ratio 1 every token's gradient is -A / (B x 16), a 1-token response's as a 12-token one's (GRPO: -A / (B L_i))
    at_one = logp.detach().clone().requires_grad_()
    ma.clipped_policy_loss(at_one, at_one.detach(), adv, mask, starts, 0.2, "token", budget=16)[0].backward()
    assert torch.allclose(at_one.grad, -adv * mask / (4 * 16), atol=1e-7)
    assert not torch.allclose(grad, at_one.grad)
    # budget 0: the token mean, as before
    plain, _, _ = ma.clipped_policy_loss(logp, old, adv, mask, starts, 0.2, "token")
    assert torch.allclose(plain, -(torch.min(torch.exp(logp - old) * adv, torch.exp(logp - old).clamp(0.8, 1.2) * adv)
                                   * mask).sum() / mask.sum(), atol=1e-6)


# --- Monte Carlo values at macro starts (SPO-chain) --------------------------------------------

def test_mc_points_keep_every_start_without_a_cap_and_evenly_spaced_ones_under_it():
    mask, _ = batch([12, 3, 0])
    starts = ma.fixed_ngram_starts(mask, 1)                   # 12, 3 and 0 starts
    assert torch.equal(ma.mc_points(starts, mask, 0), starts)
    assert torch.equal(ma.mc_points(starts, mask, 12), starts)
    kept = ma.mc_points(starts, mask, 5)
    # 12 starts in 5 runs: the first of each is start ceil(j * 12 / 5), j = 0..4; 3 starts under a cap of 5: all
    assert kept[0].nonzero().flatten().tolist() == [math.ceil(j * 12 / 5) for j in range(5)] == [0, 3, 5, 8, 10]
    assert kept[1].nonzero().flatten().tolist() == [0, 1, 2] and not kept[2].any()
    assert torch.equal(ma.mc_points(starts, mask, 1), ma.fixed_ngram_starts(mask, None))    # the prompt alone


def test_mc_points_are_a_subset_of_the_starts_with_the_first_always_kept():
    mask, x = batch([7, 1, 12, 5], seed=3)
    for starts in (ma.fixed_ngram_starts(mask, 2), ma.entropy_starts(x, mask, 0.3)):
        for cap in (1, 2, 3, 100):
            kept = ma.mc_points(starts, mask, cap)
            assert not (kept & ~starts).any() and torch.equal(kept[:, 0], starts[:, 0])
            assert torch.equal(kept.sum(-1), starts.sum(-1).clamp(max=cap))


def test_mc_advantages_match_a_loop_over_segments():
    mask, rewards = batch([7, 1, 12, 5])
    _, values = batch([7, 1, 12, 5], seed=1)
    for points in (ma.fixed_ngram_starts(mask, 1), ma.fixed_ngram_starts(mask, 3), ma.fixed_ngram_starts(mask, None)):
        adv = ma.mc_advantages(values * points, rewards, mask, points)
        for b, L in enumerate(mask.sum(-1).tolist()):
            ref = spo_chain_loop(points[b].tolist(), rewards[b].tolist(), values[b].tolist(), L)
            assert torch.allclose(adv[b, :L], torch.tensor(ref), atol=1e-6) and not adv[b, L:].any()


def test_mc_values_from_a_deterministic_scorer_give_spo_chain_advantages():
    """Each point's K continuations completed and scored by a fixed rule (the share of token 7 in the response):
    V is their mean; with the score alone as reward, A_k = V(next point) - V(point), the last R - V(point), and a
    row's advantages at its points sum to R - V(s_0) (the chain telescopes)."""
    g = torch.Generator().manual_seed(5)
    responses = [[7, 1, 7, 7, 2, 3, 7, 1], [2, 7, 3], [7, 7, 7, 1, 2, 7]]
    T, K, cap = 8, 3, 2
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in responses])
    ids = torch.tensor([r + [0] * (T - len(r)) for r in responses])
    score = (lambda tokens: sum(t == 7 for t in tokens) / len(tokens))
    points = ma.mc_points(ma.fixed_ngram_starts(mask, 2), mask, cap)
    continuations, loop_values = [], {}
    for b, t in points.nonzero().tolist():              # the order mc_values reads the scores in
        conts = [responses[b][:t] + torch.randint(0, 9, (T - t,), generator=g).tolist() for _ in range(K)]
        continuations += [score(c) for c in conts]
        loop_values[b, t] = sum(score(c) for c in conts) / K
    values = ma.mc_values(torch.tensor(continuations), points, K)
    R = torch.tensor([score(r) for r in responses])
    adv = ma.mc_advantages(values, ma.macro_rewards(torch.zeros(3, T), R, mask, points), mask, points)
    for b, r in enumerate(responses):
        begin = [t for t in range(len(r)) if points[b, t]]
        for k, t in enumerate(begin):
            assert values[b, t].item() == pytest.approx(loop_values[b, t])
            after = loop_values[b, begin[k + 1]] if k + 1 < len(begin) else R[b].item()
            assert adv[b, t].item() == pytest.approx(after - loop_values[b, t])
        assert adv[b][points[b]].sum().item() == pytest.approx(R[b].item() - loop_values[b, 0])


def test_mc_values_refuse_a_wrong_number_of_scores():
    mask, _ = batch([4, 2])
    points = ma.fixed_ngram_starts(mask, 2)                     # 3 points
    with pytest.raises(ValueError, match="5 continuation scores for 3 points x 2"):
        ma.mc_values(torch.zeros(5), points, 2)


# --- the sequence ratio (GSPO) -----------------------------------------------------------------

def test_sequence_ratio_is_gspo_length_normalised():
    mask, log_w = batch([7, 1, 12, 5])
    s = ma.sequence_log_ratio(log_w, mask)
    for b, L in enumerate(mask.sum(-1).tolist()):
        ref = math.exp(sum(log_w[b, :L].tolist()) / L)          # (pi / pi_old)^(1 / L), Eq. 7
        assert torch.allclose(s[b, :L].exp(), torch.full((L,), ref)) and not s[b, L:].any()


@pytest.mark.parametrize("n", [12, 50, None])
def test_macro_ratio_with_n_at_least_the_length_is_the_unnormalised_sequence_ratio(n):
    mask, log_w = batch([7, 1, 12, 5])
    macro = ma.macro_sum(log_w * mask, ma.fixed_ngram_starts(mask, n)) * mask
    assert torch.allclose(macro, ma.sequence_log_ratio(log_w, mask, length_normalized=False), atol=1e-6)


# --- continuations from macro starts (data.sample_continuations) -------------------------------

def greedy_alone(tiny_lm, tokenizer, prefix, max_new_tokens):
    """The greedy continuation of one prefix alone (no padding, no batch), cut after its EOS."""
    import data
    alone = tiny_lm.generate(input_ids=prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    tail, tail_mask = data.cut_after_eos(alone[:, prefix.shape[1]:], tokenizer.eos_token_id, tokenizer.pad_token_id)
    return tail[0][tail_mask[0].bool()].tolist()


def test_continuations_keep_their_prefix_and_continue_it_as_one_prompt_would(tiny_lm, tokenizer):
    """top_k 1 makes sampling greedy: each continuation, batched with prefixes of every length (left-padded), equals
    the greedy continuation of its own prefix alone, and its response keeps the first t tokens and max_len at most."""
    import data
    prompts = ["\n\nHuman: how are you\n\nAssistant:", "hi", "\n\nHuman: tell me about the quick brown fox\n\nAssistant:"]
    torch.manual_seed(2)
    p_ids, p_mask, r_ids, r_mask, _ = data.sample(tiny_lm, tokenizer, prompts, 32, 10, temperature=1.0)
    L = 14                                          # --max_response_len above the rollout's width
    points = ma.mc_points(ma.fixed_ngram_starts(r_mask, 3), r_mask, 3)
    cp_ids, cp_mask, c_ids, c_mask = data.sample_continuations(tiny_lm, tokenizer, p_ids, p_mask, r_ids, points, 2,
                                                               temperature=1.0, top_k=1, max_len=L)
    assert c_ids.shape[1] <= L and torch.equal(cp_ids, p_ids[points.nonzero()[:, 0].repeat_interleave(2)])
    for i, (b, t) in enumerate(points.nonzero().repeat_interleave(2, dim=0).tolist()):
        prefix = torch.cat([p_ids[b][p_mask[b].bool()], r_ids[b, :t]]).unsqueeze(0)
        n = int(c_mask[i].sum())
        assert torch.equal(c_ids[i, :t], r_ids[b, :t]) and c_mask[i, :n].all() and not c_mask[i, n:].any()
        assert c_ids[i, t:n].tolist() == greedy_alone(tiny_lm, tokenizer, prefix, L - t) and 0 < n - t <= L - t


def test_continuations_run_to_max_response_len_whatever_the_batchs_longest_rollout(tiny_lm, tokenizer):
    """The audit's case: rollouts of 6, 4, 5 and 2 tokens, --max_response_len 10. Each continuation runs until EOS or
    until its whole response holds 10 tokens (not 6, the batch's longest: a continuation cut there was counted as
    missing its EOS), the greedy continuation of its prefix alone; without EOS it is exactly 10 tokens long."""
    import data
    p_ids, p_mask, _ = data.encode_prompts(tokenizer, ["hi", "the quick brown fox", "def add(a, b):", "I think"], 16)
    lengths, L, eos = [6, 4, 5, 2], 10, tokenizer.eos_token_id
    words = tokenizer("quick brown fox jumped over the lazy dog", add_special_tokens=False)["input_ids"]
    assert eos not in words and len(words) >= 6
    r_ids = torch.full((4, 6), tokenizer.pad_token_id)
    for b, n in enumerate(lengths):
        r_ids[b, :n] = torch.tensor(words[:n])
    r_mask = (torch.arange(6) < torch.tensor(lengths)[:, None]).long()
    points = ma.fixed_ngram_starts(r_mask, 2)
    _, _, c_ids, c_mask = data.sample_continuations(tiny_lm, tokenizer, p_ids, p_mask, r_ids, points, 1,
                                                    temperature=1.0, top_k=1, max_len=L)
    cut = 0
    for i, (b, t) in enumerate(points.nonzero().tolist()):
        n = int(c_mask[i].sum())
        prefix = torch.cat([p_ids[b][p_mask[b].bool()], r_ids[b, :t]]).unsqueeze(0)
        expected = greedy_alone(tiny_lm, tokenizer, prefix, L - t)
        assert c_ids[i, :t].tolist() == words[:t] and c_ids[i, t:n].tolist() == expected
        has_eos = bool((c_ids[i, :n] == eos).any())
        assert n == L or has_eos                   # a continuation without EOS holds --max_response_len tokens
        cut += not has_eos
    assert cut > 0                                 # the random model seldom says EOS: most run to 10 tokens


def test_continuations_refuse_a_limit_below_the_rollouts_width(tiny_lm, tokenizer):
    import data
    p_ids, p_mask, _ = data.encode_prompts(tokenizer, ["hi"], 8)
    r_ids, r_mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="max_len 2: below the rollout's 3 response tokens"):
        data.sample_continuations(tiny_lm, tokenizer, p_ids, p_mask, r_ids, r_mask.bool(), 1, max_len=2)


def test_a_reference_forward_in_chunks_equals_it_at_once(tiny_lm, tokenizer):
    """harness.in_chunks (the Monte Carlo continuations' reference forward under a segment RM): slices of 2 rows give
    the entropies of all rows at once; one process runs ceil(n / chunk) forwards."""
    import data
    import harness
    import segment_rewards as sr
    from accelerate import Accelerator
    texts = ["hi there", "the quick brown fox jumped", "def add(a, b):", "I think", "naive cafe"]
    p_ids, p_mask, _ = data.encode_prompts(tokenizer, texts, 12)
    r_ids, r_mask = data.encode_responses(tokenizer, texts[::-1], 8)
    ids, mask, P = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), p_ids.shape[1]
    acc, calls = Accelerator(cpu=True), []

    def entropy_of(rows):
        calls.append(rows)
        return sr.reference_logprobs_and_entropy(tiny_lm, acc, None, ids[rows], mask[rows], P, 1.0)[1]
    with torch.no_grad():
        whole = entropy_of(slice(0, 5))
        chunked = harness.in_chunks(acc, entropy_of, 5, 2)
    assert calls[1:] == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert chunked.shape == whole.shape and torch.allclose(chunked, whole, atol=1e-5)
    assert torch.allclose(sr.sft_entropy(tiny_lm, acc, None, ids, mask, P, chunk=2), whole, atol=1e-5)  # MC's own


# --- the objective: token, macro and sequence ratios -------------------------------------------

def gspo_loop(logp, old_logp, adv, mask, clip, normalized=True):
    """One ratio per response, s_i = exp(sum_t log w_t / L_i) (or without / L_i), one clipped term each, the mean
    over responses (Zheng et al. 2025, Eq. 5-7); the advantage of the response's first token."""
    terms = []
    for b in range(len(mask)):
        L = int(mask[b].sum())
        log_s = sum(logp[b, t] - old_logp[b, t] for t in range(L)) / (L if normalized else 1)
        s, a = torch.exp(log_s), adv[b, 0]
        terms.append(-torch.min(s * a, s.clamp(1 - clip, 1 + clip) * a))
    return torch.stack(terms).mean()


def ratio_batch():
    mask, _ = batch([7, 1, 12, 5])
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(mask.shape, generator=g) * mask
    logp = (old + 0.05 * torch.randn(mask.shape, generator=g)) * mask
    adv = torch.randn(len(mask), 1, generator=g) * mask           # one advantage per response, as a group's
    return logp.requires_grad_(), old, adv, mask.float()


@pytest.mark.parametrize("clip", [0.2, 0.01])
def test_sequence_ratio_loss_and_gradient_are_gspo(clip):
    logp, old, adv, mask = ratio_batch()
    loss, _, _ = ma.clipped_policy_loss(logp, old, adv, mask, mask.bool(), clip, "sequence")
    ref = gspo_loop(logp, old, adv, mask, clip)
    assert torch.allclose(loss, ref, atol=1e-6)
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0], atol=1e-6)


def test_macro_ratio_with_n_at_least_the_length_is_the_unnormalised_sequence_ratio_loss():
    logp, old, adv, mask = ratio_batch()
    for n in (12, 0):
        loss, _, _ = ma.clipped_policy_loss(logp, old, adv, mask, ma.fixed_ngram_starts(mask, n), 0.2, "macro")
        assert torch.allclose(loss, gspo_loop(logp, old, adv, mask, 0.2, normalized=False), atol=1e-6)


def test_macro_ratio_at_n1_is_the_token_ratio():
    logp, old, _, mask = ratio_batch()
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(6)) * mask     # per-token advantages
    starts = ma.fixed_ngram_starts(mask, 1)
    macro, _, _ = ma.clipped_policy_loss(logp, old, adv, mask, starts, 0.2, "macro")
    token, _, _ = ma.clipped_policy_loss(logp, old, adv, mask, starts, 0.2, "token")
    assert torch.equal(macro, token)
    assert torch.equal(torch.autograd.grad(macro, logp)[0], torch.autograd.grad(token, logp)[0])


def test_kl_in_the_loss_is_grpos_k3_term_with_its_gradient():
    """--kl_penalty loss: the policy loss gains beta * the token mean of k3 = e^u - u - 1, u = log pi_ref - log pi
    (Shao et al. 2024, Eq. 4), written here one token at a time."""
    import ppo
    logp, old, adv, mask = ratio_batch()
    ref = old - 0.3 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(8)) * mask
    starts = mask.bool()
    plain = ppo_losses(logp, old, None, None, adv, None, mask, starts)[0]
    with_kl, _, stats = ppo_losses(logp, old, None, None, adv, None, mask, starts, ref_logp=ref, kl_coef=0.04)
    k3 = [torch.exp(ref[b, t] - logp[b, t]) - (ref[b, t] - logp[b, t]) - 1
          for b in range(len(mask)) for t in range(int(mask[b].sum()))]
    expected = plain + 0.04 * torch.stack(k3).mean()
    assert torch.allclose(with_kl, expected) and torch.allclose(stats["loss/kl"], torch.stack(k3).mean())
    assert torch.allclose(torch.autograd.grad(with_kl, logp)[0], torch.autograd.grad(expected, logp)[0])


# --- ppo.py: --advantage group | mc, no critic -------------------------------------------------

def ppo_args(tiny_models, out, **flags):
    import ppo
    return ppo_config(**{"sft_path": str(tiny_models / "sft"), "rm_path": str(tiny_models / "rm"), "output_dir": str(out),
                          "rollout_batch_size": 4, "mini_batch_size": 2, "max_prompt_len": 16, "max_response_len": 8,
                          "n_eval_prompts": 4, "plot": False, **flags})


@pytest.mark.parametrize("flags,message", [
    ({"advantage": "group", "group_size": 3}, "--group_size 3: a divisor of --rollout_batch_size 4"),
    ({"advantage": "group", "group_size": 1}, "--group_size 1: outside its range [2, inf)"),
    ({"advantage": "mc", "mc_rollouts": 0}, "--mc_rollouts 0: outside its range [1, inf)"),
    ({"advantage": "mc", "mc_points": -1}, "--mc_points -1: outside its range [0, inf)"),
    ({"advantage": "mc", "critic_warmup": 2}, "no critic to warm up (--critic_warmup)"),
    ({"advantage": "group", "reward": "segment"}, "not --reward segment"),
    ({"advantage": "critic"}, "--advantage 'critic': choose from 'gae', 'group', 'mc'"),
    ({"group_norm": "mean"}, "--group_norm 'mean': choose from 'std', 'none', 'loo'"),
    ({"ratio": "seq"}, "--ratio 'seq': choose from 'token', 'macro', 'sequence'"),
])
def test_bad_settings_are_refused_at_start_naming_the_flag(tiny_models, tmp_path, flags, message):
    import ppo
    with pytest.raises(SystemExit) as stop:
        ppo.resolve(*ppo_args(tiny_models, tmp_path, **flags))
    assert message in str(stop.value)


def test_the_prepared_study_arms_parse_and_pair_each_with_its_tasks_ppo():
    """bench/learning_efficiency.py's CRITIC_FREE: six arms a task, PPO first, every other paired with it by seed, each
    command line one ppo.py parses, every arm at the task's KL target."""
    import sys
    from transformers import HfArgumentParser
    import ppo
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
    import learning_efficiency as study
    for name, h in study.CRITIC_FREE.items():
        base, *arms = h.configs
        assert base.is_ppo and len(arms) == 5 and all(a.partner == base.name and a.task == base.task for a in arms)
        kinds = set()
        for c in h.configs:
            args, _, credit, *_ = HfArgumentParser(ppo.ARGS).parse_args_into_dataclasses(c.argv("sft"))
            assert args.kl_target == float(study.CRITIC_FREE_KL[c.task][0])
            kinds.add((credit.advantage, args.ratio))
        assert kinds == {("gae", "token"), ("group", "token"), ("group", "macro"), ("group", "sequence"), ("mc", "token")}


class RowScorer:
    """A deterministic scorer for the Monte Carlo glue: a continuation scores its problem's `value`, whatever it says
    (step 2's scorer interface: ids, mask, prompt width, rows -> (score, dense, segments, stats))."""
    reads_sft_entropy = False

    def __call__(self, ids, attention_mask, prompt_width, rows, sft_entropy=None):
        return torch.tensor([float(r["value"]) for r in rows]), None, None, {}


@pytest.mark.parametrize("penalty, always_eos", [(0.0, False), (-1.0, False), (-1.0, True)])
def test_mc_values_score_each_continuation_against_its_own_rows_problem(tiny_models, tmp_path, penalty, always_eos):
    """critic_free.monte_carlo_values: the continuations from row b's points are scored with row b's problem (the `rows` of
    the rollout), V(point) is their mean, and a continuation that ends without EOS takes --missing_eos_penalty; one
    that ends with it (`always_eos`: the policy's head made to put all its weight on EOS) takes none."""
    import critic_free
    import data
    import ppo
    args, *extensions = ppo_args(tiny_models, tmp_path, advantage="mc", mc_rollouts=3, mc_points=2,
                                 missing_eos_penalty=penalty)
    seg, credit, models, report, code_task = ppo.resolve(args, *extensions)
    s = ppo.setup(args, seg, credit, models, report, code_task)
    s.scorer, policy = RowScorer(), s.trained["policy"]
    rows = [{**s.rows[i], "value": 10.0 * (i + 1)} for i in range(3)]
    torch.manual_seed(0)
    p_ids, p_mask, r_ids, r_mask, _ = data.sample(policy.model, s.tokenizer, [r["prompt"] for r in rows],
                                                  args.max_prompt_len, args.max_response_len)
    starts = ma.fixed_ngram_starts(r_mask, 3)
    if always_eos:      # every continuation ends at its first token, with EOS
        eos = s.tokenizer.eos_token_id
        policy.model.get_output_embeddings().register_forward_hook(
            lambda module, inputs, logits: logits.index_fill(-1, torch.tensor([eos]), 1e4))
    values, points = critic_free.monte_carlo_values(s, credit, args, True, p_ids, p_mask, r_ids, starts,
                                                    r_mask.float(), rows)
    assert points.sum() >= 3 and (values[~points] == 0).all()
    for b, row in enumerate(rows):
        got = values[b][points[b]]
        assert (got <= row["value"]).all() and (got >= row["value"] + penalty).all()   # row b's problem, no other's
        if not penalty or always_eos:
            assert torch.equal(got, torch.full_like(got, row["value"]))
    if penalty and not always_eos:     # random weights seldom sample EOS within 8 tokens: some continuations pay
        assert (values[points] < torch.tensor([r["value"] for r in rows])[points.nonzero()[:, 0]]).any()
