"""Segment-level rewards (Yin et al., 2025), the one home of the extension: a response is cut into segments
where the SFT model's next-token entropy (temperature 1) is high, a segment / token reward model is read at each
segment's last token, its rewards are normalized at their location p = k / K and spread over the segment's tokens.

    segments      `segment_mask` (EOS in none), `segment_starts`, `segment_ends`, `segment_positions`,
                  `segment_layout` (a collated batch, the RM's training), `rollout_segments` (PPO's rollouts)
    rewards       `segment_evaluation` e(x, y), `spread_segment_rewards`, `segment_rewards` (PPO's dense rewards)
    normalizers   Mean(p), Std(p) Huber-fitted on log p (`fit_location_normalizer`, `normalize_segment_rewards`)
    settings      what a segment RM saves beside its weights (`calibrate`, `SEGMENT_FILE`) and a PPO run's
                  checked settings (`segment_settings`)

A segment is a macro action read as a reward unit: the segment tensors follow macro_actions.py's conventions
(response-only, right-padded [B, R]; `starts` where a segment begins). reward_model.py trains the RM
(`--unit segment|token`), ppo.py scores with it (`--reward segment`, `--termination segment`).
"""
import functools
import json
import math
import os
import sys
from dataclasses import dataclass

import torch

import data
import harness
import macro_actions as ma
from harness import flag


@dataclass
class SegmentArgs:
    """ppo.py's flags for segment rewards (Yin et al. 2025), read where --reward segment, --termination segment or a
    segment / token RM asks for them."""
    rm_norm: bool = flag(False, "--reward rm: the RM's score standardized by its calibration mean and std")
    c_ent: float = flag(0.0, "segments at this SFT entropy (nats) instead of the RM's own c_ent; 0 = the RM's",
                        "[0, inf)")
    seg_norm: str = flag("regression", "--reward segment: normalizer: regression (the paper's) | global | last | none",
                         choices=("regression", "global", "last", "none"))
    seg_interp: str = flag("even", "--reward segment: a segment's reward on its tokens: even | repeat | end | bandit",
                           choices=("even", "repeat", "end", "bandit"))
    reward_clip: float = flag(10.0, "--reward segment: per-token segment rewards clipped to [-c, c]; 0 = off",
                              "[0, inf)")

SEGMENT_FILE = "segment_reward.json"     # beside a segment / token RM's weights: its settings and normalizer
NORMALIZER_KIND = "segment_location"
STD_FLOOR = 0.1          # Std(p) >= 0.1 x the global std: at most 10x the global normalization's gain


# ---------------------------------------------------------------------------------------------
# Segments: where they begin and end. `mask` here marks the tokens that belong to segments.
# ---------------------------------------------------------------------------------------------

def segment_mask(response_ids, mask, eos_token_id):
    """The released code's rule: EOS belongs to no segment, so the last segment ends at the token
    before it; nothing after the first EOS belongs to one either (dataset text may hold an EOS
    inside a response). A response that is EOS alone keeps it, as one segment. Segments by entropy
    are then `entropy_starts(entropy, segment_mask(ids, mask, eos), c_ent)`."""
    m = mask.bool()
    eos = (response_ids == eos_token_id) & m & (mask.long().cumsum(-1) > 1)
    return m & (eos.long().cumsum(-1) == 0)


def segment_starts(response_ids, response_mask, unit, c_ent, eos_token_id, entropy=None):
    """(starts, inside), bool [B, R], of right-padded responses: `inside` the tokens that belong to
    segments, `starts` where one begins. `segment`: a token whose SFT entropy at temperature 1
    (`entropy` [B, R]) exceeds c_ent; `token`: every token; EOS belongs to none of them. `sequence`:
    the whole response, EOS included, is one segment (the ordinary RM). Training (`segment_layout`) and
    PPO's rollouts segment with this one function."""
    if unit == "sequence":
        inside = response_mask.bool()
        return ma.fixed_ngram_starts(inside, None), inside
    inside = segment_mask(response_ids, response_mask, eos_token_id)
    if unit == "segment":
        return ma.entropy_starts(entropy, inside, c_ent), inside
    if unit == "token":
        return inside, inside
    raise ValueError(f"unknown unit {unit!r}; choose sequence, segment or token")


def segment_ends(starts, mask):
    """bool [B, T]: True at the last real token of each segment."""
    m = mask.bool()
    after = torch.cat([starts[:, 1:] | ~m[:, 1:], torch.ones_like(m[:, :1])], dim=1)
    return m & after


def segment_positions(starts, mask):
    """float [B, T]: p = k / K on every token of segment k (1-based) of a row with K segments;
    the normalizers' location (Yin et al. 2025, §2); 0 on padding."""
    m = mask.bool()
    K = (starts & m).sum(-1, keepdim=True).clamp(min=1)
    return (ma.macro_ids(starts & m) + 1).float() / K * m


def next_token_entropy(logits):
    """Entropy (nats) of softmax(logits) over the last dimension; logits at temperature 1 give the
    entropy that segments a response."""
    return ma.entropy(logits.log_softmax(-1))


@torch.no_grad()
def segment_layout(sft, batch, unit, c_ent, eos_token_id):
    """Segments of the responses of a collated batch [prompt | response], as (ends bool, positions
    p = k / K float), both [B, L] and 0 on the prompt. `segment`: a token whose SFT next-token entropy
    at temperature 1 exceeds c_ent starts a segment; `token`: every token does. EOS is in none
    (`segment_mask`)."""
    P, ids, mask = batch["prompt_width"], batch["input_ids"], batch["attention_mask"]
    entropy = None
    if unit == "segment":
        logits = sft(input_ids=ids, attention_mask=mask, position_ids=data.position_ids(mask)).logits
        entropy = next_token_entropy(logits[:, P - 1:-1].float())
    starts, inside = segment_starts(ids[:, P:], mask[:, P:], unit, c_ent, eos_token_id, entropy)
    ends, p = segment_ends(starts, inside), segment_positions(starts, inside)
    return torch.cat([ends.new_zeros(len(ends), P), ends], 1), torch.cat([p.new_zeros(len(p), P), p], 1)


def rollout_segments(settings, response_ids, response_mask, eos_token_id, sft_entropy):
    """(starts, inside) [B, R] of the segments that the RM's training (`segment_layout`)
    makes of the same text: one function, the SFT entropy at temperature 1; (None, None) without settings."""
    if settings is None:
        return None, None
    return segment_starts(response_ids, response_mask, settings["unit"], settings.get("c_ent"), eos_token_id,
                             sft_entropy)


def reference_logprobs_and_entropy(ref, accelerator, policy, ids, attention_mask, prompt_width, temperature):
    """ppo.py's step 2 where segments are read: from one forward of its reference (harness.reference_forward), the
    logprobs of the response tokens at `temperature` and the SFT model's next-token entropy at temperature 1 (the
    segments' threshold is on it), both [B, R]."""
    with harness.reference_forward(accelerator, ref, policy) as model:
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=data.position_ids(attention_mask),
                       logits_to_keep=ids.shape[1] - prompt_width + 1).logits[:, :-1].float()
        entropy = next_token_entropy(logits)
        logp = (logits / temperature).log_softmax(-1).gather(-1, ids[:, prompt_width:].unsqueeze(-1)).squeeze(-1)
    return logp, entropy


def sft_entropy(ref, accelerator, policy, ids, attention_mask, prompt_width, chunk):
    """The SFT model's next-token entropy at temperature 1 on the response tokens [B, R] of other sequences than a
    rollout (ppo.py's Monte Carlo continuations: rollouts x continuations of them), without a graph, in forwards of
    `chunk` rows (as many on every rank: harness.in_chunks)."""
    with torch.no_grad():
        return harness.in_chunks(accelerator, lambda rows: reference_logprobs_and_entropy(
            ref, accelerator, policy, ids[rows], attention_mask[rows], prompt_width, 1.0)[1], len(ids), chunk)


# ---------------------------------------------------------------------------------------------
# Rewards: e(x, y), and the segment rewards PPO spreads over their tokens (§2)
# ---------------------------------------------------------------------------------------------

def segment_evaluation(values, ends):
    """e(x, y): the mean of the segment rewards, the head read at each segment's last token
    (Yin et al. 2025, Eq. 3-4). values, ends [B, L]; returns [B]."""
    ends = ends.to(values.dtype)
    return (values * ends).sum(-1) / ends.sum(-1).clamp(min=1)


def spread_segment_rewards(r_end, starts, mask, how="even"):
    """Each segment's reward, read at its last token, spread over its tokens ([B, T], 0 on
    padding): `even` r / len on every token (the paper's), `repeat` r on every token, `end` r on
    the last token only. Values of r_end off the segment ends are ignored."""
    if how not in ("even", "repeat", "end"):
        raise ValueError(f"unknown interpolation {how!r}; choose even, repeat or end")
    m = mask.to(r_end.dtype)
    r = r_end * segment_ends(starts, mask).to(r_end.dtype)
    if how == "end":
        return r
    per_token = ma.macro_sum(r, starts) * m
    return per_token / ma.macro_sum(m, starts).clamp(min=1) if how == "even" else per_token


def segment_rewards(values, starts, inside, settings, how="regression", interp="even"):
    """Segment rewards (Yin et al. 2025, §2): the RM's head `values` [B, R] read at each segment's
    last token, normalized at its location p = k / K (`settings["normalizer"]`, the RM's), spread over
    its tokens by `interp`. Returns (dense per-token rewards [B, R], e = each response's mean raw segment
    reward [B], their stats). `interp="bandit"` (Table 1, segment as bandit): no dense rewards (None), e is
    the sequence score, one reward at the last token."""
    ends = segment_ends(starts, inside)
    r_hat = normalize_segment_rewards(values, segment_positions(starts, inside), settings.get("normalizer"), how)
    count = ends.sum(-1).float()
    normalized = r_hat[ends]
    stats = {"segment/count": count.mean(), "segment/mean_len": (inside.sum(-1) / count.clamp(min=1)).mean(),
             "segment/norm_mean": normalized.mean(), "segment/norm_std": normalized.std(correction=0)}
    dense = None if interp == "bandit" else spread_segment_rewards(r_hat, starts, inside, interp)
    return dense, segment_evaluation(values, ends), stats


def token_rewards(kl_rewards, score, response_mask, starts, agg="sum", dense=None, penalty=None, clip=0.0):
    """ppo.py's step 5: per-token rewards [B, R] whose macro sums are the rewards R_tau: the KL rewards with the sequence
    `score` [B] at the last real token (`macro_rewards`). With `dense` segment rewards [B, R] the score (e,
    their mean) is only logged: the tokens get the KL rewards plus `dense`, clipped to [-clip, clip] (0 = off;
    the released code clips the segment rewards, not the KL term), plus the missing-EOS `penalty` [B] at the
    last real token. So a segment reward equal to the score at the last token gives exactly the score's rewards."""
    if dense is None:
        return ma.macro_rewards(kl_rewards, score, response_mask, starts, agg)
    dense = dense.clamp(-clip, clip) if clip else dense
    penalty = torch.zeros_like(score) if penalty is None else penalty
    return (ma.macro_rewards(kl_rewards, torch.zeros_like(score), response_mask, starts, agg)
            + ma.macro_rewards(dense, penalty, response_mask, starts))


def segmenter(settings, sft, eos_token_id):
    """What `score` needs to score e(x, y) with a segment / token RM (`settings`, its own): the segments of the
    SFT model `sft` (`segment_layout`, as in its training); None for a sequence RM (settings None)."""
    if settings is None:
        return None
    return functools.partial(segment_layout, sft, unit=settings["unit"], c_ent=settings.get("c_ent"),
                             eos_token_id=eos_token_id)


# ---------------------------------------------------------------------------------------------
# Location-aware normalizers of segment rewards (§2): Mean(p), Std(p) on log p
# ---------------------------------------------------------------------------------------------

def huber_loss(residuals, sigma, epsilon=1.35):
    """sum_i sigma + sigma * H((y_i - f(x_i)) / sigma), H(z) = z^2 if |z| <= eps else 2 eps |z| - eps^2:
    the loss of scikit-learn's HuberRegressor (Owen 2007) without its ridge term. Broadcasts over
    sigma [..., 1] against residuals [n]; sigma = 0 is its limit, 2 eps sum |r|."""
    a, s = residuals.abs(), torch.as_tensor(sigma, dtype=residuals.dtype)
    inside = a <= epsilon * s
    per = torch.where(inside, a ** 2 / s.clamp(min=1e-300), 2 * epsilon * a - epsilon ** 2 * s)
    return (s + per).sum(-1)


def huber_fit(x, y, epsilon=1.35, iters=1000):
    """Linear Huber regression y ~ w x + b with the scale sigma estimated jointly (`huber_loss`), so
    epsilon is counted in units of the residuals' spread and the fit does not depend on the rewards'
    units (a fixed scale would). Block descent on the jointly convex loss: sigma exactly given the
    residuals (the loss is piecewise smooth in sigma; each piece's stationary point is a candidate),
    then one reweighted least squares step (weights min(1, eps sigma / |r|) majorize H). float64;
    rank-deficient x (one bucket) gives w = 0. Returns (w, b, sigma)."""
    X = torch.stack([x, torch.ones_like(x)], 1)
    n = len(y)
    k = torch.arange(n + 1, dtype=y.dtype)
    beta, sigma = torch.linalg.lstsq(X, y[:, None], driver="gelsd").solution[:, 0], 0.0
    for _ in range(iters):
        r = y - X @ beta
        edges = torch.cat([torch.zeros(1, dtype=y.dtype), r.abs().sort().values, torch.full((1,), torch.inf)])
        denom = n - epsilon ** 2 * (n - k)            # k smallest |r| inside: sigma^2 = sum r^2 / denom
        candidates = torch.where(denom > 0, (edges[:-1] ** 2).cumsum(0) / denom.clamp(min=1e-300), 0.0).sqrt()
        slack = 1e-9 * (1 + edges[-2])                # keep the pieces whose root lies inside them
        own = (edges[:-1] <= epsilon * candidates + slack) & (epsilon * candidates <= edges[1:] + slack)
        candidates = candidates[own] if own.any() else candidates
        sigma = candidates[huber_loss(r, candidates[:, None], epsilon).argmin()]
        weight = torch.where(r.abs() <= epsilon * sigma, 1.0, epsilon * sigma / r.abs().clamp(min=1e-300))
        root = weight.sqrt()[:, None]
        new = torch.linalg.lstsq(root * X, root * y[:, None], driver="gelsd").solution[:, 0]
        done = (new - beta).abs().max() <= 1e-13 * (1 + beta.abs().max())
        beta = new
        if done:
            break
    return beta[0].item(), beta[1].item(), float(sigma)


def fit_location_normalizer(p, r, decimals=3, epsilon=1.35):
    """Segment rewards r at positions p = t / T (1-D, padding dropped) -> the normalizer as named
    JSON fields: per bucket (p rounded to `decimals`) the mean and std (ddof 0) of r, each
    Huber-fitted on log p (`mean`, `std`: {"w", "b"}); `global` and `last` (p = 1) statistics for
    the ablations; `std_floor`; the bucket table."""
    p = torch.as_tensor(p, dtype=torch.float64).flatten()
    r = torch.as_tensor(r, dtype=torch.float64).flatten()
    if p.shape != r.shape or not len(p):
        raise ValueError(f"p and r must have the same non-zero length, got {len(p)} and {len(r)}")
    if not ((p > 0) & (p <= 1)).all() or not torch.isfinite(r).all():
        raise ValueError("positions p must lie in (0, 1] (drop padding) and rewards r must be finite")
    if not (p == 1).any():
        raise ValueError("no last segment (p = 1) in the calibration data")
    # rounded as Python's round() does (the decimal nearest to each float), once per distinct position
    distinct, index = torch.unique(p, return_inverse=True)
    key = torch.tensor([max(round(x, decimals), 10.0 ** -decimals) for x in distinct.tolist()], dtype=p.dtype)[index]
    buckets, index = torch.unique(key, return_inverse=True)
    zeros = torch.zeros_like(buckets)
    count = zeros.scatter_add(0, index, torch.ones_like(r))
    mean = zeros.scatter_add(0, index, r) / count
    std = (zeros.scatter_add(0, index, (r - mean[index]) ** 2) / count).sqrt()
    (w_mu, b_mu, _), (w_sd, b_sd, _) = (huber_fit(buckets.log(), y, epsilon) for y in (mean, std))
    last = r[p == 1]
    return {"kind": NORMALIZER_KIND, "mean": {"w": w_mu, "b": b_mu}, "std": {"w": w_sd, "b": b_sd},
            "global": {"mean": r.mean().item(), "std": r.std(correction=0).item()},
            "last": {"mean": last.mean().item(), "std": last.std(correction=0).item()},
            "std_floor": max(STD_FLOOR * r.std(correction=0).item(), 1e-6), "decimals": decimals,
            "epsilon": epsilon, "n_segments": len(r),
            "buckets": {"p": buckets.tolist(), "count": count.long().tolist(), "mean": mean.tolist(),
                        "std": std.tolist()}}


def number_field(norm, *path):
    """The finite number at `path` inside the JSON object `norm`; a clear error naming the field otherwise."""
    value = norm
    for i, name in enumerate(path):
        if not isinstance(value, dict) or name not in value:
            raise ValueError(f"segment normalizer: missing field {'.'.join(path[:i + 1])!r}")
        value = value[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"segment normalizer: field {'.'.join(path)!r} must be a finite number, got {value!r}")
    return float(value)


def normalize_segment_rewards(r, p, norm, how="regression"):
    """(r - Mean(p)) / Std(p), Std floored at `std_floor`; 0 where p = 0 (padding). `how`: the
    paper's `regression` on log p, one `global` or `last`-segment (mean, std), or `none`. A missing
    or mismatched normalizer is an error, never a silent (0, 1)."""
    if how == "none":
        return torch.where(p > 0, r, 0.0)
    if not isinstance(norm, dict) or norm.get("kind") != NORMALIZER_KIND:
        kind = norm.get("kind") if isinstance(norm, dict) else type(norm).__name__
        raise ValueError(f"segment normalizer: kind {kind!r}, expected {NORMALIZER_KIND!r} (fit_location_normalizer)")
    floor = number_field(norm, "std_floor")
    if floor <= 0:
        raise ValueError(f"segment normalizer: field 'std_floor' must be positive, got {floor}")
    if how == "regression":
        log_p = p.clamp(min=1e-12).log()
        mean = number_field(norm, "mean", "w") * log_p + number_field(norm, "mean", "b")
        std = (number_field(norm, "std", "w") * log_p + number_field(norm, "std", "b")).clamp(min=floor)
    elif how in ("global", "last"):
        mean, std = number_field(norm, how, "mean"), max(number_field(norm, how, "std"), floor)
    else:
        raise ValueError(f"unknown normalization {how!r}; choose regression, global, last or none")
    return torch.where(p > 0, (r - mean) / std, 0.0)


@torch.no_grad()
def calibrate(head, batches, unit, c_ent, sft_path):
    """The settings a segment / token RM scores with, and its location normalizer fitted on the segment
    rewards of calibration `batches` (§2): the JSON saved beside it. `head(batch)`: the RM's head at every
    position [B, L] (reward_model.token_values)."""
    p, r, tokens = [], [], 0
    for batch in batches:
        ends = batch["segment_ends"]
        r.append(head(batch)[ends].cpu())
        p.append(batch["segment_p"][ends].cpu())
        tokens += (batch["segment_p"] > 0).sum().item()
    p, r = torch.cat(p), torch.cat(r)
    return {"unit": unit, "c_ent": c_ent if unit == "segment" else None, "sft_path": sft_path,
            "segments": "a token whose SFT next-token entropy (nats, temperature 1) exceeds c_ent starts a segment; "
                        "the first always does; EOS belongs to none", "evaluation": "mean of the segment rewards",
            "mean_segment_len": tokens / len(r), "normalizer": fit_location_normalizer(p, r)}


# ---------------------------------------------------------------------------------------------
# Settings: what a segment / token RM saved beside its weights, and a PPO run's segments
# ---------------------------------------------------------------------------------------------

def read_segment_settings(rm_path):
    """The settings a segment / token RM saved beside its weights (`SEGMENT_FILE`); None for a sequence RM."""
    path = os.path.join(rm_path, SEGMENT_FILE)
    return json.load(open(path)) if os.path.exists(path) else None


def checked_segment_settings(rm_path, seg_norm="regression"):
    """The settings a segment / token RM saved beside its weights (`SEGMENT_FILE`), checked before any rollout:
    a clear exit, naming the file and field, when they are missing or unusable (its normalizer with `seg_norm`)."""
    path = os.path.join(rm_path, SEGMENT_FILE)
    if not os.path.exists(path):
        sys.exit(f"error: --reward segment / --termination segment need a segment or token RM: no {path} "
                 f"(train one with reward_model.py --unit segment; or read a sequence RM at the segment ends of "
                 f"--c_ent C with --seg_norm none)")
    settings = json.load(open(path))
    unit, c_ent = settings.get("unit"), settings.get("c_ent")
    if unit not in ("segment", "token"):
        sys.exit(f"error: {path}: field 'unit' is {unit!r}, expected segment or token")
    if unit == "segment" and (not isinstance(c_ent, (int, float)) or isinstance(c_ent, bool)):
        sys.exit(f"error: {path}: field 'c_ent' is {c_ent!r}, expected a number")
    try:                                                     # fail here, not at the first rollout
        normalize_segment_rewards(torch.ones(1), torch.ones(1), settings.get("normalizer"), seg_norm)
    except ValueError as e:
        sys.exit(f"error: {path}: field 'normalizer': {e}")
    return settings


def check_flags(task, code_task, *, reward, termination, lora_r, c_ent, rm_norm=False):
    """ppo.py's segment flags that cannot go together, refused at start with the flags named: segments need a
    reward model (not a code task's program), the frozen SFT model (not LoRA's adapters-off policy), and --c_ent
    only where segments are read."""
    if code_task and "segment" in (reward, termination):
        sys.exit(f"error: --reward / --termination segment need a reward model; {task!r} runs its code")
    if reward == "segment" and lora_r:
        sys.exit("error: --reward segment scores held-out responses with the frozen SFT model's segments; "
                 "it has none under --lora_r (the reference is the policy with its adapters off)")
    if c_ent and reward != "segment" and termination != "segment":
        sys.exit("error: --c_ent sets the segments of --termination segment, or those a sequence RM is read on "
                 "under --reward segment (bandit as segment)")
    if rm_norm and (code_task or reward != "rm"):
        sys.exit(f"error: --rm_norm normalizes the reward model's score under --reward rm, not --reward {reward}"
                 + (f" (task {task!r} runs its code)" if code_task else ""))


def segment_settings(own, rm_path, sft_path, *, reward, termination, c_ent, seg_norm, lora_r, log):
    """ppo.py's segments (read in its step 2), or None when it reads none: a segment / token RM's `own`
    settings (its segment_reward.json, or None) under --reward segment or --termination segment, and under
    --reward rm, whose score is then e(x, y); with `c_ent` > 0, the SFT entropy segments at that threshold (no
    file: --termination segment under another reward, or a sequence RM read at segment ends under --reward
    segment, Table 1's bandit as segment). Every check and warning at setup, none mid-run."""
    if own is not None and lora_r:
        sys.exit(f"error: --lora_r: {rm_path} is a {own.get('unit')} RM, scored with e(x, y) on the frozen SFT "
                 "model's segments; under --lora_r there is none (the reference is the policy with its adapters off)")
    segment_rm_as_bandit = reward == "rm" and own is not None
    if "segment" not in (reward, termination) and not segment_rm_as_bandit:
        return None
    if c_ent:
        if own is not None and reward in ("segment", "rm"):
            sys.exit(f"error: --c_ent: {rm_path} is a segment / token RM ({os.path.join(rm_path, SEGMENT_FILE)}), "
                     f"read on its own segments under --reward {reward}; drop --c_ent")
        if reward == "segment" and seg_norm != "none":
            sys.exit(f"error: --seg_norm {seg_norm}: a sequence RM read at segment ends (--reward segment --c_ent) "
                     "has no segment normalizer; pass --seg_norm none")
        return {"unit": "segment", "c_ent": c_ent}
    settings = checked_segment_settings(rm_path, seg_norm)
    if segment_rm_as_bandit:    # its head at EOS never trained (zero gradient there): segment as bandit
        log(f"[ppo] --reward rm: {rm_path} is a {own['unit']} RM; its score is e(x, y), the mean of its segment "
            f"rewards on the SFT model's segments (as in its training and in evaluate.py), one reward at the last token")
    trained_on = settings.get("sft_path")
    if trained_on and os.path.realpath(trained_on) != os.path.realpath(sft_path):
        log(f"[ppo] warning: the segment RM's segments come from the SFT model {trained_on}, this run's is "
            f"{sft_path}: its entropies, and so its segments, may differ from the RM's training")
    return settings
