"""Plain per-sample Python loops: the readable specification the vectorized code is checked
against (and the released code's style, timed by bench/macro_overhead.py)."""
import torch


def pad_right(rows, pad=0, dtype=torch.long):
    """List of lists -> ([B, T] tensor right-padded with `pad`, [B, T] mask)."""
    T = max([len(r) for r in rows] + [1])
    x = torch.full((len(rows), T), pad, dtype=dtype)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        x[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
        mask[i, : len(r)] = 1
    return x, mask


def token_gae(values, rewards, length, gamma, lam):
    """Token-level GAE of one response (1-D float32 tensors), one time step at a time."""
    adv, last = torch.zeros(length), torch.tensor(0.0)
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else torch.tensor(0.0)
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, adv + values[:length]


def macro_lengths(starts_row, length):
    """Lengths of the macro actions of one response from its starts."""
    begin = [t for t in range(length) if starts_row[t]]
    return [b - a for a, b in zip(begin, begin[1:] + [length])]


def sigma_loop(n, kind):
    """Sigma weights of one macro action of n tokens, written from App. D.1."""
    if kind == "equal":
        return [1.0 / n] * n
    if kind == "unit":
        return [0.0] * (n - 1) + [1.0]
    if kind == "first":
        return [1.0] + [0.0] * (n - 1)
    H = sum(1.0 / (n - i) for i in range(n))
    return [1.0 / ((n - i) * H) for i in range(n)]


def macro_rewards_loop(kl_rewards, score, mask, starts, agg="sum"):
    """Per-token rewards, one sample and one macro action at a time: the KL rewards (each macro
    action's averaged for "mean"), the score added once at the last real token."""
    out = torch.zeros(kl_rewards.shape)
    for b in range(len(mask)):
        length = int(mask[b].sum())
        begin = 0
        for n in macro_lengths(starts[b].tolist(), length):
            for i in range(begin, begin + n):
                out[b, i] = kl_rewards[b, i] / n if agg == "mean" else kl_rewards[b, i]
            begin += n
        if length:
            out[b, length - 1] += score[b]
    return out


def macro_policy_loss_loop(logp, old_logp, advantages, mask, starts, clip):
    """The paper's MA-PPO policy loss, one macro action at a time: its ratio pi(omega)/pi_old(omega) is the
    product of its token ratios, its advantage that of its first token, the clipped objective counted once
    per macro action, and the loss the mean over every macro action of the batch."""
    terms = []
    for b in range(len(mask)):
        begin = 0
        for n in macro_lengths(starts[b].tolist(), int(mask[b].sum())):
            ratio = torch.exp(sum(logp[b, i] - old_logp[b, i] for i in range(begin, begin + n)))
            a = advantages[b, begin]
            terms.append(-torch.min(a * ratio, a * ratio.clamp(1 - clip, 1 + clip)))
            begin += n
    return torch.stack(terms).mean()


def macro_gae_loop(values, rewards, mask, starts, gamma=1.0, lam=0.95, sigma="equal"):
    """Macro-level GAE, one sample and one macro action at a time (batched tensors in and out)."""
    B, T = values.shape
    adv_out, ret_out = torch.zeros(B, T), torch.zeros(B, T)
    for b in range(B):
        length = int(mask[b].sum())
        lens = macro_lengths(starts[b].tolist(), length)
        V, R, begin = [], [], 0
        for n in lens:
            w = sigma_loop(n, sigma)
            V.append(sum(w[i] * float(values[b, begin + i]) for i in range(n)))
            R.append(sum(float(rewards[b, begin + i]) for i in range(n)))
            begin += n
        A, last = [0.0] * len(lens), 0.0
        for k in reversed(range(len(lens))):
            next_v = V[k + 1] if k + 1 < len(lens) else 0.0
            last = R[k] + gamma * next_v - V[k] + gamma * lam * last
            A[k] = last
        begin = 0
        for k, n in enumerate(lens):
            adv_out[b, begin:begin + n] = A[k]
            ret_out[b, begin:begin + n] = A[k] + V[k]
            begin += n
    return adv_out, ret_out


def fixed_ngram_loop(mask, n):
    starts = torch.zeros(mask.shape, dtype=torch.bool)
    for b in range(mask.shape[0]):
        for t in range(int(mask[b].sum())):
            starts[b, t] = t % n == 0
    return starts


def perplexity_loop(logprobs, mask):
    """§3.2.1 one sample at a time, tensor element by element (the released code's style)."""
    starts = torch.zeros(mask.shape, dtype=torch.bool)
    for b in range(mask.shape[0]):
        total, count = 0.0, 0
        for t in range(int(mask[b].sum())):
            nll = -logprobs[b, t]
            if count == 0 or nll > total / count:
                starts[b, t], total, count = True, nll, 1
            else:
                total, count = total + nll, count + 1
    return starts


def segments_loop(entropy, response_ids, mask, c_ent, eos_token_id):
    """Entropy segments, one token at a time: a token starts a segment if it is the first or its
    entropy exceeds c_ent; EOS belongs to no segment unless it is the whole response.
    Returns (starts, the tokens in segments), bool [B, T]."""
    starts = torch.zeros(mask.shape, dtype=torch.bool)
    inside = torch.zeros(mask.shape, dtype=torch.bool)
    for b in range(mask.shape[0]):
        for t in range(int(mask[b].sum())):
            if t > 0 and int(response_ids[b, t]) == eos_token_id:
                break
            inside[b, t] = True
            starts[b, t] = t == 0 or float(entropy[b, t]) > c_ent
    return starts, inside


def segment_rewards_loop(r_end, starts, inside, how):
    """(ends, positions k/K, rewards spread `how`), one segment at a time."""
    ends = torch.zeros(inside.shape, dtype=torch.bool)
    positions, spread = torch.zeros(inside.shape), torch.zeros(inside.shape)
    for b in range(inside.shape[0]):
        length = int(inside[b].sum())
        begins = [t for t in range(length) if starts[b, t]]
        bounds = list(zip(begins, begins[1:] + [length]))
        for k, (first, stop) in enumerate(bounds):
            ends[b, stop - 1] = True
            r = float(r_end[b, stop - 1])
            for t in range(first, stop):
                positions[b, t] = (k + 1) / len(bounds)
                if how == "even":
                    spread[b, t] = r / (stop - first)
                elif how == "repeat" or t == stop - 1:
                    spread[b, t] = r
    return ends, positions, spread


def bucket_stats_loop(p, r, decimals):
    """{rounded p: (count, mean, std with ddof 0)} from a dict of lists."""
    groups = {}
    for pi, ri in zip(p, r):
        groups.setdefault(round(float(pi), decimals), []).append(float(ri))
    stats = {}
    for key, rs in groups.items():
        mean = sum(rs) / len(rs)
        stats[key] = (len(rs), mean, (sum((x - mean) ** 2 for x in rs) / len(rs)) ** 0.5)
    return stats
