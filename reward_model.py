"""Stage 2: a Bradley-Terry reward model on the preference pairs of the RM split.

    python reward_model.py                          # from runs/chitchat/sft, ~2 min CPU
    accelerate launch reward_model.py --task tldr --sft_path runs/tldr/sft --output_dir runs/tldr/rm --bf16

The RM is `AutoModelForSequenceClassification(num_labels=1)` initialised from the SFT checkpoint;
its loss is -log sigmoid(r(x, y+) - r(x, y-)) (Ouyang et al. 2022, Eq. 1), its score the head's
output at the last real token of prompt + response. Reported: held-out pairwise accuracy, and on
tasks with a gold judge (chitchat, count) the agreement of the RM with it on pairs of SFT samples
(the distribution PPO will show it). `score()` and `token_values()` are what ppo.py and evaluate.py use.

`--unit segment` (Yin et al. 2025) reads the same head at the last token of each segment of the
response (segments from the SFT model's entropy; `--unit token`: one token each), scores a response
by the mean of its segment rewards, and saves its settings and location-aware normalizer beside it.
"""
import functools
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import data
import harness
import macro_actions as ma


@dataclass
class RMArgs:
    task: str = field(default="chitchat", metadata={"help": "chitchat, count, tldr, tldr_carper, hh, webgpt, or a local json/jsonl/parquet file"})
    sft_path: str = field(default="", metadata={"help": "SFT checkpoint (save_pretrained folder) or HF model id to start from; default runs/<task>/sft"})
    output_dir: str = field(default="", metadata={"help": "where the reward model + tokenizer are saved; default runs/<task>/rm"})
    max_prompt_len: int = field(default=48, metadata={"help": "prompt tokens kept (truncated from the left)", "metavar": "[1, inf)"})
    max_response_len: int = field(default=0, metadata={"help": "response tokens kept, EOS included; 0 = the task's default (64 for count, else 32)", "metavar": "[0, inf)"})
    batch_size: int = field(default=32, metadata={"help": "preference pairs per process per micro-step", "metavar": "[1, inf)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-steps per optimizer step", "metavar": "[1, inf)"})
    max_grad_norm: float = field(default=0.0, metadata={"help": "clip the gradients' global L2 norm to this (every engine alike); 0 = never", "metavar": "[0, inf)"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (~5e-6 for Gemma-2B)", "metavar": "(0, inf)"})
    warmup_ratio: float = field(default=0.05, metadata={"help": "fraction of the steps spent warming up, then cosine decay", "metavar": "[0, 1]"})
    max_steps: int = field(default=200, metadata={"help": "optimizer steps; 0 = `epochs` passes over the RM split", "metavar": "[0, inf)"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the RM split when max_steps is 0", "metavar": "(0, inf)"})
    eval_every: int = field(default=100, metadata={"help": "held-out accuracy every k steps", "metavar": "[1, inf)"})
    save_every: int = field(default=100, metadata={"help": "resumable checkpoint every k steps", "metavar": "[1, inf)"})
    n_eval: int = field(default=1024, metadata={"help": "held-out pairs for the pairwise accuracy", "metavar": "[1, inf)"})
    n_gold_prompts: int = field(default=256, metadata={"help": "tasks with a gold judge (chitchat, count): held-out prompts whose two SFT samples test RM-gold agreement (0 = skip)", "metavar": "[0, inf)"})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPUs)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations to save memory (GPUs)"})
    chat_template: bool = field(default=False, metadata={"help": "render prompts with the tokenizer's own chat template (instruct models); off: the raw HH / TL;DR formats of the paper's base models. Use the same choice in every stage"})
    skip_bad_rows: bool = field(default=False, metadata={"help": "drop malformed dataset rows (and report how many) instead of stopping"})
    seed: int = field(default=1234, metadata={"help": "random seed (data split seed is fixed at 1234)", "metavar": "[0, inf)"})
    resume: bool = field(default=False, metadata={"help": "continue from <output_dir>/checkpoint"})
    unit: str = field(default="sequence", metadata={"help": "what the head scores (Yin et al. 2025): sequence (the whole response, EOS included: the ordinary RM) | segment (entropy segments, each scored at its last token; a response's score e is their mean) | token (one token per segment). EOS belongs to no segment", "choices": ("sequence", "segment", "token")})
    c_ent: float = field(default=6.0, metadata={"help": "--unit segment: a response token whose SFT next-token entropy (nats, temperature 1) exceeds c_ent starts a segment. 6.0 gives the tiny chitchat SFT model (median entropy 5.5 nats) segments of about 3 tokens; a pretrained model's entropies are far lower: check the logged mean segment length", "metavar": "[0, inf)"})
    n_calibration: int = field(default=1024, metadata={"help": "RM-split pairs whose chosen and rejected responses fit the score's mean and std (score_norm.json, every unit) and, --unit segment/token, the location normalizer", "metavar": "[1, inf)"})


SEGMENT_FILE = "segment_reward.json"     # beside a segment / token RM's weights: its settings and normalizer
SCORE_FILE = "score_norm.json"           # beside any RM's weights: the mean and std of its score (ppo.py --rm_norm)
EVAL_FILE = "rm_eval.json"               # beside any RM's weights: its held-out accuracy and gold agreement
SCORE_NORMALIZER_KIND = "score"


# ---------------------------------------------------------------------------------------------
# Scoring: the head's scalar at every position; the reward is the one at the last real token
# ---------------------------------------------------------------------------------------------

def token_values(model, input_ids, attention_mask):
    """The score head applied to every hidden state: [B, T]. For the RM only the last real token
    matters; the PPO critic (initialised from the RM) reads a value at every response token.
    The model runs its own forward, through whatever wraps it (DDP syncs the gradients only of a forward
    through the wrapper; accelerate's bf16 autocast is on that forward), and the head's output is read
    on the way: the [B, T, 1] the model then pools at the last token."""
    head = (model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model).score
    read = []
    hook = head.register_forward_hook(lambda module, inputs, output: read.append(output))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=data.position_ids(attention_mask))
    finally:
        hook.remove()
    return read[-1].squeeze(-1).float()


def last_token(values, attention_mask):
    """values[b, last t with attention_mask 1]: right for left padding, right padding and both."""
    T = attention_mask.shape[1]
    last = T - 1 - attention_mask.flip(-1).long().argmax(-1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


@torch.no_grad()
def score(model, tokenizer, prompts, responses, max_prompt_len=48, max_response_len=32, batch_size=64,
          segmenter=None):
    """Reward of each (prompt, response) pair as a float tensor [N] (EOS appended to responses
    that fit, as in training); with `segmenter` (a `segment_layout` partial) e(x, y)."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(prompts), batch_size):
        b = data.collate(tokenizer, prompts[i:i + batch_size], responses[i:i + batch_size],
                         max_prompt_len, max_response_len)
        ids, mask = b["input_ids"].to(device), b["attention_mask"].to(device)
        values = token_values(model, ids, mask)
        if segmenter:
            out.append(segment_evaluation(values, segmenter({**b, "input_ids": ids, "attention_mask": mask})[0]).cpu())
        else:
            out.append(last_token(values, mask).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def segment_evaluation(values, ends):
    """e(x, y): the mean of the segment rewards, the head read at each segment's last token
    (Yin et al. 2025, Eq. 3-4). values, ends [B, L]; returns [B]."""
    ends = ends.to(values.dtype)
    return (values * ends).sum(-1) / ends.sum(-1).clamp(min=1)


def entropy(logp):
    """Entropy (nats) of the distributions whose log-probabilities are `logp` (last dimension). A token of
    probability 0 (a logit of -inf) adds 0, not 0 * -inf = NaN."""
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)


def next_token_entropy(logits):
    """Entropy (nats) of softmax(logits) over the last dimension; logits at temperature 1 give the
    entropy that segments a response."""
    return entropy(logits.log_softmax(-1))


def segment_starts(response_ids, response_mask, unit, c_ent, eos_token_id, entropy=None):
    """(starts, inside), bool [B, R], of right-padded responses: `inside` the tokens that belong to
    segments, `starts` where one begins. `segment`: a token whose SFT entropy at temperature 1
    (`entropy` [B, R]) exceeds c_ent; `token`: every token; EOS belongs to none of them. `sequence`:
    the whole response, EOS included, is one segment (the ordinary RM). Training (`segment_layout`) and
    PPO's rollouts segment with this one function."""
    if unit == "sequence":
        inside = response_mask.bool()
        return ma.fixed_ngram_starts(inside, None), inside
    inside = ma.segment_mask(response_ids, response_mask, eos_token_id)
    if unit == "segment":
        return ma.entropy_starts(entropy, inside, c_ent), inside
    if unit == "token":
        return inside, inside
    raise ValueError(f"unknown unit {unit!r}; choose sequence, segment or token")


@torch.no_grad()
def segment_layout(sft, batch, unit, c_ent, eos_token_id):
    """Segments of the responses of a collated batch [prompt | response], as (ends bool, positions
    p = k / K float), both [B, L] and 0 on the prompt. `segment`: a token whose SFT next-token entropy
    at temperature 1 exceeds c_ent starts a segment; `token`: every token does. EOS is in none
    (`macro_actions.segment_mask`)."""
    P, ids, mask = batch["prompt_width"], batch["input_ids"], batch["attention_mask"]
    entropy = None
    if unit == "segment":
        logits = sft(input_ids=ids, attention_mask=mask, position_ids=data.position_ids(mask)).logits
        entropy = next_token_entropy(logits[:, P - 1:-1].float())
    starts, inside = segment_starts(ids[:, P:], mask[:, P:], unit, c_ent, eos_token_id, entropy)
    ends, p = ma.segment_ends(starts, inside), ma.segment_positions(starts, inside)
    return torch.cat([ends.new_zeros(len(ends), P), ends], 1), torch.cat([p.new_zeros(len(p), P), p], 1)


def bradley_terry(model, batch):
    """-log sigmoid(r+ - r-) over a batch whose first half holds the chosen responses and second
    half the rejected ones (same prompts); r is the score at the last real token, or e(x, y) when the
    batch carries `segment_ends`. Returns (loss, accuracy)."""
    values = token_values(model, batch["input_ids"], batch["attention_mask"])
    if "segment_ends" in batch:
        r = segment_evaluation(values, batch["segment_ends"])
    else:
        r = last_token(values, batch["attention_mask"])
    r_chosen, r_rejected = r.chunk(2)
    diff = r_chosen - r_rejected
    return -F.logsigmoid(diff).mean(), (diff > 0).float().mean()


def load_reward_model(path, bf16=False):
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.bfloat16 if bf16 else torch.float32)
    tokenizer = data.load_tokenizer(path)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


@torch.no_grad()
def gold_agreement(rm, policy, tokenizer, rows, args, segmenter=None):
    """Two SFT samples per held-out prompt (one row per prompt); how often the RM prefers the one the
    gold judge prefers (pairs the gold judge scores equal are left out); with `segmenter`, the RM's
    e(x, y). Returns (agreement, n_pairs)."""
    twice = [r for r in rows for _ in range(2)]
    prompts = [r["prompt"] for r in twice]
    r_ids = data.sample(policy, tokenizer, prompts, args.max_prompt_len, args.max_response_len)[2]
    texts = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
    gold = torch.tensor(data.gold(args.task, data.judged_prompts(twice), texts)).view(-1, 2)
    rm_scores = score(rm, tokenizer, prompts, texts, args.max_prompt_len, args.max_response_len,
                      segmenter=segmenter).view(-1, 2)
    decided = gold[:, 0] != gold[:, 1]
    agree = ((gold[:, 0] > gold[:, 1]) == (rm_scores[:, 0] > rm_scores[:, 1]))[decided]
    return agree.float().mean().item() if len(agree) else float("nan"), int(decided.sum())


# ---------------------------------------------------------------------------------------------
# Location-aware normalizers of segment rewards (Yin et al. 2025, §2): Mean(p), Std(p) on log p
# ---------------------------------------------------------------------------------------------

NORMALIZER_KIND = "segment_location"
STD_FLOOR = 0.1          # Std(p) >= 0.1 x the global std: at most 10x the global normalization's gain


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


def _field(norm, *path):
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
    floor = _field(norm, "std_floor")
    if floor <= 0:
        raise ValueError(f"segment normalizer: field 'std_floor' must be positive, got {floor}")
    if how == "regression":
        log_p = p.clamp(min=1e-12).log()
        mean = _field(norm, "mean", "w") * log_p + _field(norm, "mean", "b")
        std = (_field(norm, "std", "w") * log_p + _field(norm, "std", "b")).clamp(min=floor)
    elif how in ("global", "last"):
        mean, std = _field(norm, how, "mean"), max(_field(norm, how, "std"), floor)
    else:
        raise ValueError(f"unknown normalization {how!r}; choose regression, global, last or none")
    return torch.where(p > 0, (r - mean) / std, 0.0)


@torch.no_grad()
def calibrate(model, batches, args):
    """The settings a segment / token RM scores with, and its location normalizer fitted on the
    segment rewards of calibration batches (Yin et al. 2025, §2): the JSON saved beside it."""
    p, r, tokens = [], [], 0
    for batch in batches:
        ends = batch["segment_ends"]
        r.append(token_values(model, batch["input_ids"], batch["attention_mask"])[ends].cpu())
        p.append(batch["segment_p"][ends].cpu())
        tokens += (batch["segment_p"] > 0).sum().item()
    p, r = torch.cat(p), torch.cat(r)
    return {"unit": args.unit, "c_ent": args.c_ent if args.unit == "segment" else None, "sft_path": args.sft_path,
            "segments": "a token whose SFT next-token entropy (nats, temperature 1) exceeds c_ent starts a segment; "
                        "the first always does; EOS belongs to none", "evaluation": "mean of the segment rewards",
            "mean_segment_len": tokens / len(r), "normalizer": fit_location_normalizer(p, r)}


# ---------------------------------------------------------------------------------------------
# Scoring with a segment / token RM: its settings, a rollout's segments, dense rewards
# ---------------------------------------------------------------------------------------------

def rollout_segments(settings, response_ids, response_mask, eos_token_id, sft_entropy):
    """(starts, inside) [B, R] of the segments that the RM's training (`reward_model.segment_layout`)
    makes of the same text: one function, the SFT entropy at temperature 1; (None, None) without settings."""
    if settings is None:
        return None, None
    return segment_starts(response_ids, response_mask, settings["unit"], settings.get("c_ent"), eos_token_id,
                             sft_entropy)


def segment_rewards(values, starts, inside, settings, how="regression", interp="even"):
    """Segment rewards (Yin et al. 2025, §2): the RM's head `values` [B, R] read at each segment's
    last token, normalized at its location p = k / K (`settings["normalizer"]`, the RM's), spread over
    its tokens by `interp`. Returns (dense per-token rewards [B, R], e = each response's mean raw segment
    reward [B], their stats). `interp="bandit"` (Table 1, segment as bandit): no dense rewards (None), e is
    the sequence score, one reward at the last token."""
    ends = ma.segment_ends(starts, inside)
    r_hat = normalize_segment_rewards(values, ma.segment_positions(starts, inside), settings.get("normalizer"), how)
    count = ends.sum(-1).float()
    normalized = r_hat[ends]
    stats = {"segment/count": count.mean(), "segment/mean_len": (inside.sum(-1) / count.clamp(min=1)).mean(),
             "segment/norm_mean": normalized.mean(), "segment/norm_std": normalized.std(correction=0)}
    dense = None if interp == "bandit" else ma.spread_segment_rewards(r_hat, starts, inside, interp)
    return dense, segment_evaluation(values, ends), stats


def segmenter(settings, sft, eos_token_id):
    """What `score` needs to score e(x, y) with a segment / token RM (`settings`, its own): the segments of the
    SFT model `sft` (`segment_layout`, as in its training); None for a sequence RM (settings None)."""
    if settings is None:
        return None
    return functools.partial(segment_layout, sft, unit=settings["unit"], c_ent=settings.get("c_ent"),
                             eos_token_id=eos_token_id)


@torch.no_grad()
def fit_score_normalizer(model, tokenizer, rows, max_prompt_len, max_response_len, segmenter=None, batch_size=64):
    """The mean and std (ddof 0, floored at 1e-6) of the RM's score, the head at the last token or with
    `segmenter` e(x, y), over the chosen and the rejected responses of calibration pairs `rows` (Yin et al.
    2025, §2.1: the reward normalized by its mean and std): named JSON fields."""
    prompts = [r["prompt"] for r in rows] * 2
    scores = score(model, tokenizer, prompts, [r["chosen"] for r in rows] + [r["rejected"] for r in rows],
                   max_prompt_len, max_response_len, batch_size, segmenter).double()
    return {"kind": SCORE_NORMALIZER_KIND, "mean": scores.mean().item(),
            "std": max(scores.std(correction=0).item(), 1e-6), "n_responses": len(scores),
            "score": "e(x, y), the mean of the segment rewards" if segmenter else "the head at the last token"}


def write_json(path, value):
    """`value` as JSON at `path`, atomically (a temp file renamed)."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=1)
    os.replace(path + ".tmp", path)


def read_score_normalizer(rm_path):
    """The mean and std of an RM's score (`SCORE_FILE` beside it) as (mean, std); None when there is no file.
    A file without a finite mean and a positive std is an error naming the field."""
    path = os.path.join(rm_path, SCORE_FILE)
    if not os.path.exists(path):
        return None
    norm = json.load(open(path))
    if not isinstance(norm, dict) or norm.get("kind") != SCORE_NORMALIZER_KIND:
        sys.exit(f"error: {path}: field 'kind' is {norm.get('kind') if isinstance(norm, dict) else norm!r}, "
                 f"expected {SCORE_NORMALIZER_KIND!r}")
    try:
        mean, std = _field(norm, "mean"), _field(norm, "std")
    except ValueError as e:
        sys.exit(f"error: {path}: {str(e).replace('segment normalizer: ', '')}")
    if std <= 0:
        sys.exit(f"error: {path}: field 'std' must be positive, got {std}")
    return mean, std


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


def main(args):
    harness.check_flags(args)
    data.resolve_paths(args, "rm")
    args.max_response_len = data.response_len(args.task, args.max_response_len)
    accelerator = harness.make_accelerator(args.bf16, args.grad_accum, args.batch_size, args.max_grad_norm)
    harness.start("rm", args, accelerator)
    log = accelerator.print
    source = harness.checkpoint_part(args.output_dir, "model") if args.resume else args.sft_path
    if args.resume:
        harness.require_model_dir(source, "checkpoint to resume", "Run without --resume to start afresh.")
    elif os.sep in source or source.startswith("."):
        harness.require_model_dir(source, "SFT model", "Train one first: python sft.py")
    splits = data.load_task(args.task, skip_bad_rows=args.skip_bad_rows, only=("rm", "test"))
    train_rows, eval_rows = splits["rm"], splits["test"][:args.n_eval]
    log(f"[rm] {args.task}: {len(train_rows)} training pairs, {len(eval_rows)} held-out pairs")
    model, tokenizer = load_reward_model(source)     # trained: fp32 master weights, --bf16 autocasts
    train_rows, eval_rows = (data.with_chat_template(r, tokenizer, args.chat_template) for r in (train_rows, eval_rows))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    world, rank = accelerator.num_processes, accelerator.process_index
    trainer = harness.Trainer("rm", accelerator, model, tokenizer, args, len(train_rows), args.resume)
    segmenter = None
    if args.unit != "sequence":                 # segments from the SFT model's entropy, as PPO will see them
        from transformers import AutoModelForCausalLM
        with harness.loading_whole():            # frozen: whole on every rank, outside ZeRO-3's partitioning
            sft = AutoModelForCausalLM.from_pretrained(args.sft_path, dtype=model.dtype).to(accelerator.device).eval()
        segmenter = functools.partial(segment_layout, sft, unit=args.unit, c_ent=args.c_ent,
                                      eos_token_id=tokenizer.eos_token_id)

    def pairs_of(rows):
        b = data.collate(tokenizer, [r["prompt"] for r in rows] * 2,
                         [r["chosen"] for r in rows] + [r["rejected"] for r in rows],
                         args.max_prompt_len, args.max_response_len)
        batch = {k: v.to(accelerator.device) for k, v in b.items() if torch.is_tensor(v)}
        if segmenter:
            batch["segment_ends"], batch["segment_p"] = segmenter({**batch, "prompt_width": b["prompt_width"]})
        return batch

    def evaluate():
        total = torch.zeros(2, device=accelerator.device)
        for i, weight in harness.eval_batches(len(eval_rows), args.batch_size, rank, world):
            rows = eval_rows[i:i + args.batch_size]
            _, acc = bradley_terry(trainer.model, pairs_of(rows))
            total += weight * torch.tensor([acc.item() * len(rows), len(rows)], device=accelerator.device)
        total = accelerator.reduce(total, "sum")
        accuracy = (total[0] / total[1].clamp(min=1)).item()
        return accuracy, f"held-out accuracy {accuracy:.3f}"

    accuracy = trainer.fit(train_rows, lambda rows: bradley_terry(trainer.model, pairs_of(rows))[0], evaluate)
    log(f"[rm] held-out pairwise accuracy {accuracy:.3f}")
    if accelerator.is_main_process:     # the score's mean and std on the calibration pairs (ppo.py --rm_norm)
        final = trainer.final.to(accelerator.device).eval()                  # the whole trained RM
        write_json(os.path.join(args.output_dir, SCORE_FILE), fit_score_normalizer(
            final, tokenizer, train_rows[:args.n_calibration], args.max_prompt_len, args.max_response_len, segmenter))
    if segmenter and accelerator.is_main_process:
        rows = train_rows[:args.n_calibration]
        batches = (pairs_of(rows[i:i + args.batch_size]) for i in range(0, len(rows), args.batch_size))
        settings = calibrate(trainer.final.to(accelerator.device).eval(), batches, args)   # the whole trained RM
        path = os.path.join(args.output_dir, SEGMENT_FILE)
        write_json(path, settings)
        log(f"[rm] {args.unit} RM: mean segment length {settings['mean_segment_len']:.2f} tokens over "
            f"{settings['normalizer']['n_segments']} calibration segments; settings and normalizer in {path}")
    figures = {"accuracy": accuracy, "n_eval": len(eval_rows)}
    if args.task in data.GOLD_JUDGES and args.n_gold_prompts and accelerator.is_main_process:
        from transformers import AutoModelForCausalLM
        with harness.loading_whole():
            policy = AutoModelForCausalLM.from_pretrained(args.sft_path).to(accelerator.device).eval()
        rows = data.first_row_per_prompt(data.with_chat_template(splits["test"], tokenizer, args.chat_template))
        rm_whole = trainer.final.to(accelerator.device).eval()
        agreement, n = gold_agreement(rm_whole, policy, tokenizer, rows[:args.n_gold_prompts], args,
                                      segmenter)
        log(f"[rm] RM-gold agreement on {n} pairs of SFT samples: {agreement:.3f}")
        figures.update(gold_agreement=agreement, gold_pairs=n)
    if accelerator.is_main_process:     # the figures above as a file, for the records that cite them
        write_json(os.path.join(args.output_dir, EVAL_FILE), figures)
    return accuracy


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(HfArgumentParser(RMArgs).parse_args_into_dataclasses()[0])
