"""Segment-level rewards (Yin et al., 2025) as a specification: entropy segments with EOS left out,
segment ends and positions, rewards spread over segments, and the location-aware normalizers."""
import json
from stages import ppo_config
import math

import pytest
import torch

import macro_actions as ma
import reward_model as rm
import segment_rewards as sr
from reference import bucket_stats_loop, pad_right, segment_rewards_loop, segments_loop

EOS = 2
HOWS = ["even", "repeat", "end"]


def close(x, rows, atol=1e-6):
    return torch.allclose(x.double(), torch.tensor(rows, dtype=torch.float64), atol=atol)


def mixed_batch(seed=0):
    """Rows of mixed lengths: truncated (no EOS), ending in EOS, EOS alone, one token, empty, an EOS inside."""
    g = torch.Generator().manual_seed(seed)
    rows = [[5, 6, 7, 8, 9, 10, 11, EOS], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [EOS], [7], [], [9, 9, EOS],
            [3] * 15 + [EOS], [5, EOS, 6, 7, EOS]]
    ids, mask = pad_right(rows)
    entropy = torch.rand(ids.shape, generator=g) * 3 + 5 * (1 - mask)         # padding: high entropy
    values = torch.randn(ids.shape, generator=g)
    return ids, mask, entropy, values


# --- the worked example, by hand -------------------------------------------------------------

def test_worked_example_by_hand():
    ids = torch.tensor([[5, 6, 7, 8, 9, EOS], [5, 6, 7, EOS, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    entropy = torch.tensor([[2.0, 0.3, 1.5, 0.2, 0.1, 3.0], [0.5, 1.2, 1.1, 0.4, 9.0, 9.0]])
    values = torch.tensor([[0.1, 0.8, 0.3, 0.5, -0.4, 9.0], [1.0, -2.0, 0.4, 7.0, 0.0, 0.0]])
    # entropies -> segments: c_ent = 1; EOS (entropy 3.0) belongs to no segment
    inside = sr.segment_mask(ids, mask, EOS)
    starts = ma.entropy_starts(entropy, inside, 1.0)
    assert inside.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]
    assert starts.tolist() == [[1, 0, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    ends = sr.segment_ends(starts, inside)
    assert ends.tolist() == [[0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]]
    # head values at segment ends -> segment rewards; e = their mean
    r_end = values * ends
    assert close(r_end, [[0, 0.8, 0, 0, -0.4, 0], [1.0, -2.0, 0.4, 0, 0, 0]])
    assert sr.segment_evaluation(values, ends).tolist() == pytest.approx([0.2, -0.2])     # e: (0.8 - 0.4) / 2, ...
    # p = k / K
    p = sr.segment_positions(starts, inside)
    assert close(p, [[0.5, 0.5, 1, 1, 1, 0], [1 / 3, 2 / 3, 1, 0, 0, 0]])
    # normalized: Mean = 0.5 log p + 0.1, Std = -log p + 0.5 floored at 0.6 (Std(1) = 0.5 -> 0.6)
    norm = {"kind": "segment_location", "mean": {"w": 0.5, "b": 0.1}, "std": {"w": -1.0, "b": 0.5},
            "global": {"mean": 0.0, "std": 1.0}, "last": {"mean": 0.0, "std": 1.0}, "std_floor": 0.6}
    r_hat = sr.normalize_segment_rewards(r_end, p, norm) * ends
    a, b = 1.046574 / 1.193147, -0.5 / 0.6                  # (0.8 + 0.246574) / 1.193147, (-0.4 - 0.1) / 0.6
    c, d, f = 1.449306 / 1.598612, -1.897267 / 0.905465, 0.3 / 0.6
    assert close(r_hat, [[0, a, 0, 0, b, 0], [c, d, f, 0, 0, 0]], atol=1e-5)
    # spread over the segments' tokens; EOS and padding get nothing
    expected = {"even": [[a / 2, a / 2, b / 3, b / 3, b / 3, 0], [c, d, f, 0, 0, 0]],
                "repeat": [[a, a, b, b, b, 0], [c, d, f, 0, 0, 0]],
                "end": [[0, a, 0, 0, b, 0], [c, d, f, 0, 0, 0]]}
    for how, want in expected.items():
        assert close(sr.spread_segment_rewards(r_hat, starts, inside, how), want, atol=1e-5)


# --- the vectorized functions against plain loops --------------------------------------------

@pytest.mark.parametrize("c_ent", [-math.inf, 0.5, 1.5, 2.5, math.inf])
def test_entropy_segments_with_eos_rule_match_loop(c_ent):
    ids, mask, entropy, _ = mixed_batch()
    inside = sr.segment_mask(ids, mask, EOS)
    starts = ma.entropy_starts(entropy, inside, c_ent)
    ref_starts, ref_inside = segments_loop(entropy, ids, mask, c_ent, EOS)
    assert torch.equal(inside, ref_inside) and torch.equal(starts, ref_starts)
    assert inside.sum(-1).tolist() == [7, 10, 1, 1, 0, 2, 15, 1]      # EOS out unless alone; nothing after the first


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("c_ent", [-math.inf, 1.0, 2.0, math.inf])
@pytest.mark.parametrize("seed", [0, 1])
def test_segment_functions_match_loop(how, c_ent, seed):
    ids, mask, entropy, values = mixed_batch(seed)
    inside = sr.segment_mask(ids, mask, EOS)
    starts = ma.entropy_starts(entropy, inside, c_ent)
    ends = sr.segment_ends(starts, inside)
    ref_ends, ref_p, ref_spread = segment_rewards_loop(values, starts, inside, how)
    assert torch.equal(ends, ref_ends)
    assert torch.allclose(sr.segment_positions(starts, inside), ref_p, atol=1e-7)
    # the head's values at every token go in; only those at segment ends count
    assert torch.allclose(sr.spread_segment_rewards(values, starts, inside, how), ref_spread, atol=1e-6)
    assert torch.allclose(sr.spread_segment_rewards(values * ends, starts, inside, how), ref_spread, atol=1e-6)


def test_even_spread_keeps_each_segments_total():
    ids, mask, entropy, values = mixed_batch(3)
    inside = sr.segment_mask(ids, mask, EOS)
    starts = ma.entropy_starts(entropy, inside, 1.5)
    ends = sr.segment_ends(starts, inside)
    spread = sr.spread_segment_rewards(values, starts, inside, "even")
    assert torch.allclose(spread.sum(-1), (values * ends).sum(-1), atol=1e-5)
    assert torch.allclose(ma.macro_sum(spread, starts) * ends, values * ends, atol=1e-6)


def test_rows_are_independent():
    ids, mask, entropy, values = mixed_batch(4)
    inside = sr.segment_mask(ids, mask, EOS)
    starts = ma.entropy_starts(entropy, inside, 1.0)
    whole = [sr.spread_segment_rewards(values, starts, inside, how) for how in HOWS]
    for b in range(len(ids)):
        row = [sr.spread_segment_rewards(values[b:b + 1], starts[b:b + 1], inside[b:b + 1], how) for how in HOWS]
        assert all(torch.equal(w[b:b + 1], r) for w, r in zip(whole, row))
        assert torch.equal(sr.segment_positions(starts, inside)[b:b + 1],
                           sr.segment_positions(starts[b:b + 1], inside[b:b + 1]))


def test_whole_response_with_eos_is_the_sequence_rm():
    # c_ent = infinity with EOS kept: one segment, its reward the head at the last real token
    ids, mask, _, values = mixed_batch(5)
    starts = ma.fixed_ngram_starts(mask, None)
    ends = sr.segment_ends(starts, mask)
    real = mask.sum(-1) > 0
    assert torch.equal(ends.sum(-1), real.long())
    end_rewards = sr.spread_segment_rewards(values, starts, mask, "end").sum(-1)
    assert torch.equal(end_rewards[real], rm.last_token(values, mask)[real])
    assert torch.equal(sr.segment_positions(starts, mask), mask.float())


def test_unknown_interpolation_is_refused():
    mask = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="interpolation 'linear'"):
        sr.spread_segment_rewards(torch.ones(1, 3), ma.fixed_ngram_starts(mask, 1), mask, "linear")


# --- location-aware normalizers --------------------------------------------------------------

def on_a_line(Ks=(1, 2, 3, 4, 5, 8), w_mu=0.3, b_mu=1.0, w_sd=-0.2, b_sd=0.5):
    """Two segment rewards per position k / K, at Mean(p) -/+ Std(p): every bucket on the lines."""
    p, r = [], []
    for K in Ks:
        for k in range(1, K + 1):
            mean, std = w_mu * math.log(k / K) + b_mu, w_sd * math.log(k / K) + b_sd
            p += [k / K, k / K]
            r += [mean - std, mean + std]
    return torch.tensor(p), torch.tensor(r, dtype=torch.float64)


def test_bucket_statistics_match_loop():
    g = torch.Generator().manual_seed(0)
    K = torch.randint(1, 30, (400,), generator=g)
    p = (torch.randint(0, 1000, (400,), generator=g) % K + 1) / K
    r = torch.randn(400, generator=g, dtype=torch.float64)
    norm = sr.fit_location_normalizer(p, r)
    ref = bucket_stats_loop(p.tolist(), r.tolist(), 3)
    assert norm["buckets"]["p"] == pytest.approx(sorted(ref))
    for key, count, mean, std in zip(*(norm["buckets"][k] for k in ("p", "count", "mean", "std"))):
        assert (count, mean, std) == pytest.approx(ref[round(key, 3)], abs=1e-12)
    assert norm["global"] == pytest.approx({"mean": r.mean().item(), "std": r.std(correction=0).item()})
    assert norm["last"]["mean"] == pytest.approx(r[p == 1].mean().item())
    assert norm["n_segments"] == 400 and norm["decimals"] == 3 and norm["epsilon"] == 1.35


def test_buckets_round_positions_like_the_loop_where_the_product_by_1000_ties():
    """k / K with K = 80, 160, 400 (1/80 = 0.0125 as a float is a little above the half: 0.013), the
    long segments of long answers: the buckets are Python's round() of each position."""
    p = torch.tensor([k / K for K in (80, 160, 400) for k in range(1, K + 1)], dtype=torch.float64)
    r = torch.randn(len(p), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    norm = sr.fit_location_normalizer(p, r)
    ref = bucket_stats_loop(p.tolist(), r.tolist(), 3)
    assert 0.013 in norm["buckets"]["p"] and norm["buckets"]["p"] == pytest.approx(sorted(ref), abs=0)
    assert norm["buckets"]["count"] == [ref[k][0] for k in sorted(ref)]


def test_exact_line_when_bucket_statistics_are_collinear_in_log_p():
    p, r = on_a_line()
    norm = sr.fit_location_normalizer(p, r)
    assert (norm["mean"]["w"], norm["mean"]["b"]) == pytest.approx((0.3, 1.0), abs=1e-9)
    assert (norm["std"]["w"], norm["std"]["b"]) == pytest.approx((-0.2, 0.5), abs=1e-9)
    # so every calibration segment is normalized to -1 or +1
    assert sr.normalize_segment_rewards(r, p, norm).abs().tolist() == pytest.approx([1.0] * len(r), abs=1e-7)


def test_one_bucket_gives_a_flat_line():
    norm = sr.fit_location_normalizer(torch.ones(4), torch.tensor([1.0, 2.0, 3.0, 6.0]))
    assert norm["mean"] == pytest.approx({"w": 0.0, "b": 3.0})
    assert norm["std"] == pytest.approx({"w": 0.0, "b": 3.5 ** 0.5})          # deviations -2, -1, 0, 3


def test_huber_fit_resists_an_outlier_bucket_where_least_squares_does_not():
    g = torch.Generator().manual_seed(1)
    x = torch.linspace(-3, 0, 40, dtype=torch.float64)
    y = 0.3 * x + 1.0 + 0.02 * torch.randn(40, generator=g, dtype=torch.float64)
    y[0] += 20.0                                             # one bucket far off the line
    w, b, _ = sr.huber_fit(x, y)
    w_ls, b_ls = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), y[:, None]).solution[:, 0].tolist()
    assert abs(w - 0.3) < 0.02 and abs(b - 1.0) < 0.02
    assert abs(w_ls - 0.3) > 0.5 and abs(b_ls - 1.0) > 0.5


def test_huber_fit_is_the_minimum_of_its_loss_and_scale_free():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(60, generator=g, dtype=torch.float64).log()
    y = -0.5 * x + 0.2 + 0.1 * torch.randn(60, generator=g, dtype=torch.float64) ** 3   # heavy tails
    w, b, s = sr.huber_fit(x, y)
    best = sr.huber_loss(y - w * x - b, s)
    for dw, db, ds in [(1e-4, 0, 1), (-1e-4, 0, 1), (0, 1e-4, 1), (0, -1e-4, 1), (0, 0, 1.001), (0, 0, 0.999)]:
        assert sr.huber_loss(y - (w + dw) * x - (b + db), s * ds) > best
    # rewards in other units (c r + d): the same fit in those units
    w2, b2, s2 = sr.huber_fit(x, 7.0 * y - 3.0)
    assert (w2, b2, s2) == pytest.approx((7.0 * w, 7.0 * b - 3.0, 7.0 * s), rel=1e-6)


def test_normalizer_is_json_and_std_is_floored():
    p, r = on_a_line()
    norm = json.loads(json.dumps(sr.fit_location_normalizer(p, r)))
    assert norm["std_floor"] == pytest.approx(0.1 * r.std(correction=0).item())
    tiny_p = torch.tensor([1e-6])                 # Std(p) = -0.2 log p + 0.5 < 0 far left of the data
    norm["std"]["w"] = 0.2
    out = sr.normalize_segment_rewards(torch.tensor([5.0]), tiny_p, norm)
    mean = 0.3 * math.log(1e-6) + 1.0
    assert out.item() == pytest.approx((5.0 - mean) / norm["std_floor"], rel=1e-5)


def test_global_last_and_none_normalizations():
    p, r = on_a_line()
    norm = sr.fit_location_normalizer(p, r)
    x, q = torch.tensor([[2.0, 3.0, 0.0]]), torch.tensor([[0.5, 1.0, 0.0]])     # last column: padding
    g, last = norm["global"], norm["last"]
    assert close(sr.normalize_segment_rewards(x, q, norm, "global"),
                 [[(2 - g["mean"]) / g["std"], (3 - g["mean"]) / g["std"], 0]])
    assert last == pytest.approx({"mean": 1.0, "std": 0.5})          # p = 1: Mean 1.0, Std 0.5
    assert close(sr.normalize_segment_rewards(x, q, norm, "last"), [[2.0, 4.0, 0]])
    assert sr.normalize_segment_rewards(x, q, None, "none").tolist() == [[2.0, 3.0, 0.0]]


@pytest.mark.parametrize("broken,message", [
    (None, "kind 'NoneType'"),
    ({}, "kind None"),
    ("mean", "kind 'str'"),
    ({"kind": "sequence"}, "kind 'sequence'"),
    ({"kind": "segment_location"}, "missing field 'std_floor'"),
    ({"kind": "segment_location", "std_floor": 0.1, "mean": {"w": 1.0}}, "missing field 'mean.b'"),
    ({"kind": "segment_location", "std_floor": 0.1, "mean": {"w": 1.0, "b": 0.0}}, "missing field 'std'"),
    ({"kind": "segment_location", "std_floor": 0.1, "mean": {"w": "1", "b": 0.0}}, "'mean.w' must be a finite number"),
    ({"kind": "segment_location", "std_floor": math.inf}, "'std_floor' must be a finite number"),
    ({"kind": "segment_location", "std_floor": 0.0}, "'std_floor' must be positive"),
    ({"kind": "segment_location", "std_floor": -0.1}, "'std_floor' must be positive"),
])
def test_missing_or_mismatched_normalizer_is_refused(broken, message):
    with pytest.raises(ValueError, match=message):
        sr.normalize_segment_rewards(torch.ones(2), torch.ones(2), broken)


def test_bad_calibration_data_is_refused():
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        sr.fit_location_normalizer(torch.tensor([0.0, 1.0]), torch.ones(2))
    with pytest.raises(ValueError, match="same non-zero length"):
        sr.fit_location_normalizer(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match="no last segment"):
        sr.fit_location_normalizer(torch.tensor([0.5]), torch.ones(1))
    with pytest.raises(ValueError, match="unknown normalization 'zscore'"):
        norm = sr.fit_location_normalizer(torch.ones(2), torch.ones(2))
        sr.normalize_segment_rewards(torch.ones(1), torch.ones(1), norm, "zscore")


# --- segment and token reward models ---------------------------------------------------------

PROMPTS = ["\n\nHuman: how are you\n\nAssistant:", "hi", "\n\nHuman: tell me about the quick brown fox\n\nAssistant:"]
RESPONSES = [" fine", " hello there, friend, how was your day", ""]


def test_one_segment_with_eos_is_bit_for_bit_the_sequence_rm(tokenizer):
    from test_reward_model import tiny_rm
    import data
    model = tiny_rm(tokenizer)
    batch = data.collate(tokenizer, PROMPTS * 2, RESPONSES + RESPONSES[::-1], 48, 32)
    P, mask = batch["prompt_width"], batch["attention_mask"]
    whole = ma.fixed_ngram_starts(mask[:, P:], None)                  # c_ent = infinity, EOS kept
    ends = torch.cat([torch.zeros_like(mask[:, :P]), sr.segment_ends(whole, mask[:, P:])], 1).bool()
    grads = []
    for b in (batch, {**batch, "segment_ends": ends}):
        model.zero_grad()
        loss, acc = rm.bradley_terry(model, b)
        loss.backward()
        grads.append((loss, acc, [p.grad.clone() for p in model.parameters()]))
    (l1, a1, g1), (l2, a2, g2) = grads
    assert torch.equal(l1, l2) and torch.equal(a1, a2) and all(torch.equal(x, y) for x, y in zip(g1, g2))


def test_segment_layout_matches_rows_segmented_alone(tokenizer):
    """A padded batch segments each response as that response alone, by the loop's rule."""
    import data
    import sft
    torch.manual_seed(0)
    model = sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=1).eval()
    batch = data.collate(tokenizer, PROMPTS, RESPONSES, 48, 32)
    P, ids, mask = batch["prompt_width"], batch["input_ids"], batch["attention_mask"]
    alone = []
    for b in range(len(PROMPTS)):
        row = ids[b][mask[b].bool()].unsqueeze(0)
        n_prompt = int(mask[b, :P].sum())
        with torch.no_grad():
            logp = model(input_ids=row).logits[0, n_prompt - 1:-1].float().log_softmax(-1)
        alone.append((-(logp.exp() * logp).sum(-1)).tolist())
    c_ent = sorted(h for row in alone for h in row)[len(sum(alone, [])) // 2]
    entropy, _ = pad_right(alone, dtype=torch.float32)
    entropy = torch.cat([entropy, torch.zeros(len(alone), ids.shape[1] - P - entropy.shape[1])], 1)
    ref_starts, ref_inside = segments_loop(entropy, ids[:, P:], mask[:, P:], c_ent - 1e-4, tokenizer.eos_token_id)
    ref_ends, ref_p, _ = segment_rewards_loop(torch.zeros(ref_inside.shape), ref_starts, ref_inside, "end")
    ends, p = sr.segment_layout(model, batch, "segment", c_ent - 1e-4, tokenizer.eos_token_id)
    assert not ends[:, :P].any() and torch.equal(ends[:, P:], ref_ends)
    assert torch.allclose(p[:, P:], ref_p, atol=1e-7)
    assert 1 < ends.sum() < ref_inside.sum()                    # the threshold splits, not everywhere
    token_ends, _ = sr.segment_layout(None, batch, "token", None, tokenizer.eos_token_id)
    assert torch.equal(token_ends[:, P:], ref_inside)           # EOS is in no segment; "" keeps its EOS


def train_small(tiny_models, out, *flags):
    from stages import run_stage
    return run_stage("reward_model.py", "--sft_path", tiny_models / "sft", "--output_dir", out, "--batch_size", "4",
                     "--max_prompt_len", "24", "--max_response_len", "12", "--max_steps", "2", "--eval_every", "2",
                     "--n_eval", "8", "--n_gold_prompts", "4", "--n_calibration", "6", *flags)


def test_segment_and_token_rms_save_their_settings_and_normalizer(tiny_models, tmp_path):
    out = train_small(tiny_models, tmp_path / "segment", "--unit", "segment", "--c_ent", "1e9")
    assert "held-out pairwise accuracy" in out and "RM-gold agreement" in out and "mean segment length" in out
    settings = json.loads((tmp_path / "segment" / sr.SEGMENT_FILE).read_text())
    assert settings["unit"] == "segment" and settings["c_ent"] == 1e9
    assert settings["normalizer"]["n_segments"] == 12                     # no split: one per response
    assert settings["normalizer"]["buckets"]["p"] == [1.0]
    sr.normalize_segment_rewards(torch.ones(3), torch.ones(3), settings["normalizer"])   # a usable normalizer
    figures = json.loads((tmp_path / "segment" / rm.EVAL_FILE).read_text())     # the logged figures, as a file
    assert f"held-out pairwise accuracy {figures['accuracy']:.3f}" in out and figures["n_eval"] == 8
    assert f"agreement on {figures['gold_pairs']} pairs of SFT samples: {figures['gold_agreement']:.3f}" in out
    train_small(tiny_models, tmp_path / "token", "--unit", "token")
    settings = json.loads((tmp_path / "token" / sr.SEGMENT_FILE).read_text())
    assert settings["unit"] == "token" and settings["c_ent"] is None and settings["mean_segment_len"] == 1.0
    assert settings["normalizer"]["n_segments"] > 12


def test_unknown_unit_is_refused(tiny_models, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_small(tiny_models, tmp_path, "--unit", "paragraph")
    assert "--unit" in capsys.readouterr().err


# --- PPO on segment rewards (ppo.py --reward segment, --termination segment, --critic_warmup) ----------

@pytest.mark.parametrize("n", [1, 5, None])
@pytest.mark.parametrize("agg", ["sum", "mean"])
def test_sequence_rm_through_the_segment_path_is_exactly_reward_rm(n, agg):
    """The bandit identity: one segment holding the whole response (EOS included), its reward on its last
    token, no normalization, gives the per-token rewards and the advantages of --reward rm exactly, called
    as ppo.main calls segment_rewards.token_rewards (the score with the missing-EOS penalty in it, the penalty apart)."""
    import ppo
    ids, mask, _, _ = mixed_batch(3)
    g = torch.Generator().manual_seed(3)
    P = 4
    attention = torch.cat([torch.ones(len(ids), P, dtype=mask.dtype), mask], 1)
    head = torch.randn(attention.shape, generator=g)                    # the RM's head at every position
    kl_rewards = torch.randn(ids.shape, generator=g) * 0.05 * mask
    old_values = torch.randn(ids.shape, generator=g) * mask
    starts = ma.fixed_ngram_starts(mask, n)
    penalty = -0.7 * ~((ids == EOS) & mask.bool()).any(-1)             # --missing_eos_penalty -0.7
    # --reward rm: the head at the last real token; an empty response's last real token is a prompt token
    raw = rm.last_token(head, attention)
    score = raw + penalty
    seq_rewards = sr.token_rewards(kl_rewards, score, mask, starts, agg)
    settings = {"unit": "sequence", "normalizer": None}
    seg_starts, inside = sr.rollout_segments(settings, ids, mask, EOS, None)
    dense, e, _ = sr.segment_rewards(head[:, P:], seg_starts, inside, settings, how="none", interp="end")
    seg_rewards = sr.token_rewards(kl_rewards, e + penalty, mask, starts, agg, dense, penalty, clip=0.0)
    real = mask.sum(-1) > 0
    assert torch.equal(e[real], raw[real]) and (penalty[real] != 0).any()
    assert torch.equal(seg_rewards[real], seq_rewards[real])
    adv_seq = ma.macro_advantages(old_values, seq_rewards, mask, starts)
    adv_seg = ma.macro_advantages(old_values, seg_rewards, mask, starts)
    assert all(torch.equal(a[real], b[real]) for a, b in zip(adv_seq, adv_seg))


def test_reward_clip_bounds_the_segment_rewards_not_the_kl_penalty():
    """--reward_clip c as in the released code: the segment rewards clipped to [-c, c], then the KL rewards
    (unclipped) and the missing-EOS penalty added."""
    import ppo
    ids, mask, _, values = mixed_batch(2)
    starts = ma.fixed_ngram_starts(mask, 1)
    kl_rewards = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4)) * 30 * mask   # beyond the clip
    dense, penalty = values * 100 * mask, torch.full((len(ids),), -1.0)
    got = sr.token_rewards(kl_rewards, torch.zeros(len(ids)), mask, starts, dense=dense, penalty=penalty, clip=10.0)
    last = torch.nn.functional.one_hot((mask.sum(-1) - 1).clamp(min=0), ids.shape[1]).float()
    assert torch.allclose(got, kl_rewards + dense.clamp(-10, 10) - last, atol=1e-5)
    assert (dense.abs() > 10).any() and (kl_rewards.abs() > 10).any()
    assert torch.equal(sr.token_rewards(kl_rewards, torch.zeros(len(ids)), mask, starts, dense=dense, clip=0.0),
                       kl_rewards + dense)


def test_segment_rewards_spread_normalized_rewards_and_report_their_stats():
    ids, mask, entropy, values = mixed_batch(1)
    import ppo
    positions = torch.tensor([k / K for K in (1, 2, 3, 4, 5) for k in range(1, K + 1)] * 3)
    norm = sr.fit_location_normalizer(positions, torch.randn(len(positions), generator=torch.Generator().manual_seed(0)))
    settings = {"unit": "segment", "c_ent": 6.0, "normalizer": norm}
    starts, inside = sr.rollout_segments(settings, ids, mask, EOS, entropy)
    ref_starts, ref_inside = segments_loop(entropy, ids, mask, 6.0, EOS)
    assert torch.equal(starts, ref_starts) and torch.equal(inside, ref_inside)
    dense, e, stats = sr.segment_rewards(values, starts, inside, settings, "regression", "even")
    p = sr.segment_positions(starts, inside)
    r_hat = sr.normalize_segment_rewards(values, p, norm)
    assert torch.allclose(dense, sr.spread_segment_rewards(r_hat, starts, inside, "even"))
    ends = sr.segment_ends(starts, inside)
    assert stats["segment/count"].item() == pytest.approx(ends.sum().item() / len(ids))
    assert stats["segment/norm_mean"].item() == pytest.approx(r_hat[ends].mean().item(), abs=1e-6)
    assert torch.allclose(e, sr.segment_evaluation(values, ends))


def tiny_sft_batch(tokenizer):
    import data
    import sft
    torch.manual_seed(0)
    model = sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=1).eval()
    return model, data.collate(tokenizer, PROMPTS, RESPONSES, 48, 32)


def test_rollout_and_training_segment_the_same_text(tokenizer):
    """ppo.py's segments (the T=1 entropy of the reference forward, taken before the division by the
    sampling temperature) are those reward_model.py trained on; the logprobs do not change."""
    import harness
    import ppo
    model, batch = tiny_sft_batch(tokenizer)
    P, ids, mask = batch["prompt_width"], batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logp, entropy = ppo.reference_logprobs(model, harness.make_accelerator(), None, ids, mask, P, 0.7,
                                               t1_entropy=True)
        plain, _ = ppo.response_logprobs(model, ids, mask, P, 0.7)
    assert torch.equal(logp, plain)
    real = entropy[mask[:, P:].bool()]
    c_ent = real.median().item()
    starts, inside = sr.rollout_segments({"unit": "segment", "c_ent": c_ent}, ids[:, P:], mask[:, P:],
                                          tokenizer.eos_token_id, entropy)
    ends, p = sr.segment_layout(model, batch, "segment", c_ent, tokenizer.eos_token_id)
    assert torch.equal(ends[:, P:], sr.segment_ends(starts, inside))
    assert torch.equal(p[:, P:], sr.segment_positions(starts, inside))
    assert 1 < starts.sum() < inside.sum()                      # the threshold splits, not everywhere


@pytest.fixture(scope="module")
def segment_rm(tiny_models, tmp_path_factory, tokenizer):
    """The tiny RM with a segment_reward.json: c_ent at the tiny SFT model's median entropy, a normalizer
    fitted on its segment rewards of a few texts."""
    import shutil
    from transformers import AutoModelForCausalLM
    out = tmp_path_factory.mktemp("segment_rm") / "rm"
    shutil.copytree(tiny_models / "rm", out)
    sft_model = AutoModelForCausalLM.from_pretrained(tiny_models / "sft").eval()
    import data
    batch = data.collate(tokenizer, PROMPTS, RESPONSES, 48, 32)
    P, ids, mask = batch["prompt_width"], batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = sft_model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"]).logits
    entropy = sr.next_token_entropy(logits[:, P - 1:-1].float())
    c_ent = entropy[mask[:, P:].bool()].median().item()
    reward, _ = rm.load_reward_model(str(out))
    ends, p = sr.segment_layout(sft_model, batch, "segment", c_ent, tokenizer.eos_token_id)
    with torch.no_grad():
        values = rm.token_values(reward, ids, mask)
    settings = {"unit": "segment", "c_ent": c_ent, "normalizer": sr.fit_location_normalizer(p[ends], values[ends])}
    (out / sr.SEGMENT_FILE).write_text(json.dumps(settings))
    return out


def ppo_args(tiny_models, rm_path, out, **flags):
    import ppo
    return ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(rm_path), output_dir=str(out),
                       rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=8,
                       n_eval_prompts=4, **{"steps": 2, "plot": False, **flags})


def test_eos_joins_the_last_segments_macro_action():
    import ppo
    ids, mask = pad_right([[5, 6, 7, EOS], [5, 6, 7, 8], [EOS], [5, EOS, 6]])
    starts, _ = sr.rollout_segments({"unit": "segment", "c_ent": 1e-6}, ids, mask, EOS, torch.full(ids.shape, 0.5))
    macro, _ = ma.termination_starts("segment", mask, segments=starts)
    assert macro.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
    assert (mask.sum(-1) / macro.sum(-1)).tolist() == pytest.approx([4 / 3, 1.0, 1.0, 3.0])


def test_c_ent_is_refused_where_the_segments_are_the_segment_rms(tiny_models, segment_rm, tmp_path):
    import ppo
    for flags in ({"reward": "segment", "c_ent": 2.0}, {"c_ent": 2.0}):
        with pytest.raises(SystemExit, match="--c_ent"):
            ppo.main(*ppo_args(tiny_models, segment_rm, tmp_path / "out", **flags))


@pytest.mark.parametrize("settings, message", [
    (None, "segment_reward.json"),
    ({"unit": "sequence"}, "field 'unit'"),
    ({"unit": "segment", "c_ent": "high"}, "field 'c_ent'"),
    ({"unit": "segment", "c_ent": 6.0, "normalizer": {"kind": "segment_location"}}, "field 'normalizer'"),
])
def test_reward_segment_refuses_a_sequence_rm_or_a_broken_settings_file(tiny_models, tmp_path, settings, message):
    import shutil
    import ppo
    rm_path = tmp_path / "rm"
    shutil.copytree(tiny_models / "rm", rm_path)
    if settings is not None:
        (rm_path / sr.SEGMENT_FILE).write_text(json.dumps(settings))
    with pytest.raises(SystemExit, match=message):
        ppo.main(*ppo_args(tiny_models, rm_path, tmp_path / "out", reward="segment"))


def test_a_negative_reward_clip_is_refused(tiny_models, segment_rm, tmp_path):
    import ppo
    with pytest.raises(SystemExit, match="--reward_clip -5"):
        ppo.main(*ppo_args(tiny_models, segment_rm, tmp_path, reward="segment", reward_clip=-5.0))


def test_evaluate_scores_a_segment_rm_with_e_on_its_segments(tiny_models, segment_rm, tmp_path):
    """evaluate.py's RM score of a segment RM is e(x, y) on the SFT model's segments, as in its training
    and in ppo.py's held-out score, not the head at the last token."""
    import evaluate
    from transformers import AutoModelForCausalLM
    ctx = evaluate.Context(evaluate.EvalArgs(sft_path=str(tiny_models / "sft"), rm_path=str(segment_rm), n_prompts=4,
                                             output_dir=str(tmp_path)))
    texts = [r["chosen"] for r in ctx.rows]
    settings = sr.read_segment_settings(str(segment_rm))
    sft_model = AutoModelForCausalLM.from_pretrained(tiny_models / "sft").eval()
    segmenter = sr.segmenter(settings, sft_model, ctx.tokenizer.eos_token_id)
    want = rm.score(ctx.rm, ctx.tokenizer, ctx.prompts, texts, 48, ctx.args.max_response_len, segmenter=segmenter)
    last = rm.score(ctx.rm, ctx.tokenizer, ctx.prompts, texts, 48, ctx.args.max_response_len)
    assert ctx.rm_scores(texts) == want.tolist() and not torch.allclose(want, last)
    plain = evaluate.Context(evaluate.EvalArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                                               n_prompts=4, output_dir=str(tmp_path)))
    assert plain.segmenter is None


def test_reward_segment_refuses_lora(tiny_models, segment_rm, tmp_path):
    import ppo
    with pytest.raises(SystemExit, match="--lora_r"):
        ppo.main(*ppo_args(tiny_models, segment_rm, tmp_path, reward="segment", lora_r=4))


def test_next_token_entropy_is_finite_where_a_logit_is_minus_infinity():
    """A token of probability 0 adds nothing: [0, 0, -inf] is two equal choices, log 2 nats (NaN before,
    and a NaN entropy never exceeds c_ent, so that token silently never started a segment)."""
    logits = torch.tensor([[[0.0, 0.0, -math.inf], [0.0, 0.0, 0.0], [1.0, -math.inf, -math.inf]]])
    entropy = sr.next_token_entropy(logits)
    assert torch.allclose(entropy, torch.tensor([[math.log(2), math.log(3), 0.0]]))
    starts, _ = sr.segment_starts(torch.tensor([[5, 6, 7]]), torch.ones(1, 3), "segment", 0.5, eos_token_id=2,
                                  entropy=entropy)
    assert starts.tolist() == [[True, True, False]]


# --- a segment RM under --reward rm, and Table 1's rows (segment as bandit, bandit as segment) ---------------


def test_segment_as_bandit_and_bandit_as_segment_by_hand():
    """Table 1 of Yin et al. 2025 on the worked example's tensors. Segment as bandit: no dense rewards, e(x, y)
    (the mean raw segment reward: (0.8 - 0.4) / 2, (1.0 - 2.0 + 0.4) / 3) is one reward at the last real token
    (EOS included). Bandit as segment: a sequence RM's head read at each segment's end, not normalized
    (--seg_norm none), spread evenly over the segment's tokens."""
    import ppo
    ids = torch.tensor([[5, 6, 7, 8, 9, EOS], [5, 6, 7, EOS, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    entropy = torch.tensor([[2.0, 0.3, 1.5, 0.2, 0.1, 3.0], [0.5, 1.2, 1.1, 0.4, 9.0, 9.0]])
    values = torch.tensor([[0.1, 0.8, 0.3, 0.5, -0.4, 9.0], [1.0, -2.0, 0.4, 7.0, 0.0, 0.0]])
    settings = {"unit": "segment", "c_ent": 1.0}                       # what ppo.py --c_ent 1.0 reads with
    starts, inside = sr.rollout_segments(settings, ids, mask, EOS, entropy)
    dense, e, _ = sr.segment_rewards(values, starts, inside, settings, "none", "bandit")
    assert dense is None and e.tolist() == pytest.approx([0.2, -0.2])
    rewards = sr.token_rewards(torch.zeros(2, 6), e, mask.float(), ma.fixed_ngram_starts(mask, 1), "sum", dense)
    assert close(rewards, [[0, 0, 0, 0, 0, 0.2], [0, 0, 0, -0.2, 0, 0]])
    dense, e, _ = sr.segment_rewards(values, starts, inside, settings, "none", "even")
    assert close(dense, [[0.4, 0.4, -0.4 / 3, -0.4 / 3, -0.4 / 3, 0], [1.0, -2.0, 0.4, 0, 0, 0]])


# --- the plain RM score normalized (ppo.py --rm_norm; Yin et al. 2025, §2.1) ---------------------------------

def test_rm_stage_writes_no_score_norm_and_the_fit_is_the_mean_and_std_of_the_rm_score(tiny_models, tmp_path):
    """reward_model.py spends nothing on score_norm.json (only ppo.py --rm_norm reads it, and fits it when it is
    missing): no RM folder holds one. rm.fit_score_normalizer, which ppo.py calls, gives the mean and std (ddof 0)
    of the RM's score (the head at the last token; a segment RM's e(x, y)) over the chosen and the rejected
    responses of the pairs: here against rm.score run on one response at a time."""
    import data
    from transformers import AutoModelForCausalLM
    rows = data.load_task("chitchat", only=("rm",))["rm"][:6]
    prompts, texts = [r["prompt"] for r in rows] * 2, [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    sft_model = AutoModelForCausalLM.from_pretrained(tiny_models / "sft").eval()
    for unit in ("sequence", "segment"):
        out = tmp_path / unit
        train_small(tiny_models, out, "--unit", unit, "--c_ent", "1.0")
        assert not (out / rm.SCORE_FILE).exists()
        model, tokenizer = rm.load_reward_model(str(out))
        segmenter = sr.segmenter(sr.read_segment_settings(str(out)), sft_model, tokenizer.eos_token_id)
        scores = torch.tensor([rm.score(model.eval(), tokenizer, [p], [t], 24, 12, batch_size=1,
                                        segmenter=segmenter).item() for p, t in zip(prompts, texts)], dtype=torch.float64)
        fitted = rm.fit_score_normalizer(model, tokenizer, rows, 24, 12, segmenter)
        assert fitted["kind"] == "score" and fitted["n_responses"] == 12
        assert fitted["mean"] == pytest.approx(scores.mean().item(), abs=1e-5)
        assert fitted["std"] == pytest.approx(scores.std(correction=0).item(), abs=1e-5) and fitted["std"] > 0
        assert (segmenter is None) == (unit == "sequence")


def test_mc_values_score_each_continuation_with_the_segment_rms_e(tiny_models, segment_rm, tmp_path):
    """--advantage mc under --reward rm with a segment RM: a continuation is scored as step 2 scores a rollout, e(x, y)
    on its own segments (the SFT model's entropy of the continuation), not on the sampled response's. The same
    continuations (the same seed) scored through step 2's calls give the same values."""
    import data
    import harness
    import ppo
    ppo.main(*ppo_args(tiny_models, segment_rm, tmp_path / "run", steps=1, advantage="mc", mc_rollouts=2, mc_points=2))
    [row] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["mc/points"] >= 1 and all(v == v for v in row.values())
    import critic_free
    args, *extensions = ppo_args(tiny_models, segment_rm, tmp_path / "one", advantage="mc", mc_rollouts=2, mc_points=3)
    seg, credit, models, report, code_task = ppo.resolve(args, *extensions)
    s = ppo.setup(args, seg, credit, models, report, code_task)
    policy = s.trained["policy"]
    assert s.scorer.reads_segments
    rows = s.rows[:3]
    torch.manual_seed(0)
    p_ids, p_mask, r_ids, r_mask, _ = data.sample(policy.model, s.tokenizer, [r["prompt"] for r in rows],
                                                  args.max_prompt_len, args.max_response_len)
    starts = ma.fixed_ngram_starts(r_mask, 2)
    torch.manual_seed(1)
    values, points = critic_free.monte_carlo_values(s, credit, args, True, p_ids, p_mask, r_ids, starts,
                                                    r_mask.float(), rows)
    # step 2 on the very continuations: its reference entropy, its segments, its scorer
    torch.manual_seed(1)
    c_p_ids, c_p_mask, c_ids, c_mask = data.sample_continuations(policy.model, s.tokenizer, p_ids, p_mask, r_ids,
                                                                 points, 2, args.temperature,
                                                                 max_len=args.max_response_len)
    ids, mask, P = torch.cat([c_p_ids, c_ids], 1), torch.cat([c_p_mask, c_mask], 1), c_p_ids.shape[1]
    with torch.no_grad():
        _, entropy = ppo.reference_logprobs(s.ref, policy.accelerator, policy.model, ids, mask, P,
                                            args.temperature, t1_entropy=True)
        score = s.scorer(ids, mask, P, [rows[i] for i in points.nonzero()[:, 0].repeat_interleave(2)], entropy)[0]
    assert torch.allclose(values, ma.mc_values(score, points, 2), atol=1e-6)
    # the sampled responses' own segments would give other values: the check can tell them apart
    with torch.no_grad():
        _, r_entropy = ppo.reference_logprobs(s.ref, policy.accelerator, policy.model,
                                              torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1),
                                              p_ids.shape[1], args.temperature, t1_entropy=True)
    assert not torch.equal(entropy, r_entropy[points.nonzero()[:, 0].repeat_interleave(2)])
