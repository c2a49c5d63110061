"""The paper's evaluations (§4, App. F), each writing JSON + markdown (+ a PNG where a picture helps):

    python evaluate.py score      --policies runs/chitchat/ppo_n5_fixed/policy     # RM / gold score, Fig. 3
    python evaluate.py winrate    --policy A --baseline sft --judge gold           # rm | gold | llm judge
    python evaluate.py agreement  --policy A --baseline sft --judges rm,gold       # Table 1
    python evaluate.py best_of_n  --policy A --ns 1,4,8,16 --temperatures 0.4,0.8,1.2   # Fig. 8
    python evaluate.py curves     --runs "ppo=runs/study/n1/seed*" "ma-ppo=runs/study/n5_fixed_equal_sum/seed*"
                                  # Fig. 2, 11
    python evaluate.py passk      --task code --policies sft P --samples 10 --ks 1,5  # Table 3
    python evaluate.py explain    --explain_policy runs/chitchat/ppo_n5_fixed/policy  # one reply's macro actions

A policy is a save_pretrained folder, or `sft` (the SFT model) or `chosen` (the dataset's chosen
responses, for win rates). Results go to --output_dir (default runs/eval).

ppo.py's held-out evaluation and final report are here too (`held_out`, `final_report`): every
evaluation samples through `sample_responses` and scores the decoded text, so that policies, the
dataset's chosen responses and LLM judges are all compared on the same footing.
"""
import contextlib
import functools
import glob
import hashlib
import json
import math
import os
import random
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

import torch

import data
import harness
from harness import flag
import macro_actions as ma
import reward_model as rm
import sandbox
import segment_rewards as sr

COMMANDS = ("score", "winrate", "agreement", "best_of_n", "curves", "passk", "explain")


JUDGES = ("rm", "gold", "llm")


@dataclass
class EvalArgs:
    # --- what is evaluated --------------------------------------------------------------------------
    task: str = flag("chitchat", "task whose held-out (test) prompts are used")
    sft_path: str = flag("", "SFT model (default runs/<task>/sft); also the tokenizer")
    rm_path: str = flag("", "reward model (default runs/<task>/rm)")
    policies: list[str] = field(default_factory=list, metadata={"help": "score / passk: policies (folders or `sft`)"})
    policy: str = flag("sft", "winrate / agreement / best_of_n: the policy (A)")
    baseline: str = flag("sft", "winrate / agreement: B = `sft`, `chosen` or a folder")
    # --- the judges (winrate, agreement) ------------------------------------------------------------
    judge: str = flag("gold", "winrate: rm (higher RM score) | gold (embedded judge) | llm", choices=JUDGES)
    judges: str = flag("rm,gold", "agreement: judges (rm, gold, llm) separated by commas")
    judge_url: str = flag("", "llm: OpenAI-compatible base URL, e.g. https://api.openai.com/v1")
    judge_model: str = flag("gpt-4", "llm: model name sent to the endpoint")
    judge_key_env: str = flag("OPENAI_API_KEY", "llm: environment variable holding the API key")
    judge_template: str = flag("", "llm: tldr | hh | webgpt (default: from --task; chitchat uses hh)",
                                   choices=("", "tldr", "hh", "webgpt"))
    judge_timeout: float = flag(60.0, "llm: seconds per request", "(0, inf)")
    judge_retries: int = flag(4, "llm: retries with exponential backoff (1, 2, 4 ... s)", "[0, inf)")
    judge_mode: str = flag("text", "llm: text (the template's answer format) | logprobs (one letter's probability, "
                                   "small judges)", choices=("text", "logprobs"))
    judge_max_tokens: int = flag(96, "llm, text mode: the longest answer asked for (max_tokens)", "[1, inf)")
    judge_min_answered: float = flag(0.5, "llm: fewer usable verdicts than this fraction of the items is an error "
                                          "(exit 1)", "[0, 1]")
    # --- sampling -----------------------------------------------------------------------------------
    n_prompts: int = flag(256, "held-out prompts evaluated", "[1, inf)")
    max_prompt_len: int = flag(48, "prompt tokens kept", "[2, inf)")
    max_response_len: int = flag(0, "generated tokens at most; 0 = the task's default (64 for count, else 32)",
                                    "[0, inf)")
    chat_template: bool = flag(False, "render prompts with the tokenizer's chat template (instruct models); same in "
                                      "every stage")
    temperature: float = flag(0.8, "sampling temperature", "[1e-06, inf)")
    # --- the commands: best_of_n, curves, passk -----------------------------------------------------
    ns: str = flag("1,4,8,16", "best_of_n: values of N", "[1, inf)")
    temperatures: str = flag("0.4,0.8,1.2", "best_of_n: sampling temperatures", "[1e-06, inf)")
    runs: list[str] = field(default_factory=list, metadata={
        "help": "curves: LABEL=GLOB items, one run folder (metrics.jsonl) per seed"})
    metrics: str = flag("eval/rm,eval/gold", "curves: metrics plotted (adv/l2,q/l2 for Fig. 11)")
    results: str = flag("", "passk: JSONL rows {policy, difficulty, n, correct} instead of sampling --policies")
    samples: int = flag(10, "passk: samples per problem (the estimator's n; at least the largest k)", "[1, inf)")
    ks: str = flag("1,5", "passk: values of k", "[1, inf)")
    # --- explain: one reply's macro actions, drawn -------------------------------------------------
    explain_policy: str = flag("", "explain: the policy (default runs/<task>/ppo_n5_fixed/policy; `sft`: the SFT "
                                   "model)")
    critic_path: str = flag("", "explain: the critic (default: checkpoint/critic of the policy's run, else the RM)")
    prompt: str = flag("", "explain: the prompt as the policy reads it, \\n a newline (default: a held-out prompt)")
    prompt_index: int = flag(0, "explain: which held-out prompt, when --prompt is empty", "[0, inf)")
    # --- the run ------------------------------------------------------------------------------------
    seed: int = flag(1234, "sampling and response-order seed", "[0, 4294967295]")
    output_dir: str = flag("runs/eval", "where results are written")


@dataclass
class ReportArgs:
    """ppo.py's flags for what the run reports beyond its metrics: the held-out evaluation, the final plot, trackers."""
    eval_every: int = harness.flag(20, "held-out evaluation every k iterations", "[1, inf)")
    n_eval_prompts: int = harness.flag(256, "held-out prompts per evaluation", "[1, inf)")
    plot: bool = harness.flag(True, "draw learning_curve.png in the final report (false: skip matplotlib)")
    report_to: str = harness.flag("none", "accelerate trackers: none | tensorboard | wandb",
                                  choices=("none", "tensorboard", "wandb"))


def floats(text):
    return [float(x) for x in text.split(",") if x]


# ---------------------------------------------------------------- arithmetic (all tested by hand)

def win_rate(verdicts):
    """Verdicts "A" / "B" / "E" (equal) -> {win_rate of A (ties count half), wins, losses, ties, n}.
    Verdicts of None (a judge that gave no usable answer) are counted apart and left out."""
    counts = {v: sum(1 for x in verdicts if x == v) for v in ("A", "B", "E")}
    n = sum(counts.values())
    return {"win_rate": (counts["A"] + 0.5 * counts["E"]) / n if n else None, "wins": counts["A"],
            "losses": counts["B"], "ties": counts["E"], "n": n, "unanswered": len(verdicts) - n}


def compare(a, b):
    """Per-item verdicts from two score lists: the higher score wins, equal scores tie."""
    return ["A" if x > y else "B" if x < y else "E" for x, y in zip(a, b)]


def agreement_matrix(verdicts):
    """{judge: verdicts} -> {judge: {judge: fraction of items (both answered) with the same verdict}}."""
    names = list(verdicts)
    out = {}
    for i in names:
        out[i] = {}
        for j in names:
            both = [(x, y) for x, y in zip(verdicts[i], verdicts[j]) if x is not None and y is not None]
            out[i][j] = sum(x == y for x, y in both) / len(both) if both else None
    return out


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), as a product so that large n stays exact in floating point."""
    if n < k:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - float(torch.prod(1.0 - k / torch.arange(n - c + 1, n + 1, dtype=torch.float64)))


def passk_table(rows, ks):
    """rows {policy, difficulty, n, correct} -> {policy: {difficulty or "all": {"pass@k": mean}}}."""
    table = {}
    for row in rows:
        difficulty = str(row.get("difficulty", "all"))
        for group in {difficulty, "all"}:
            cell = table.setdefault(row["policy"], {}).setdefault(group, {f"pass@{k}": [] for k in ks})
            for k in ks:
                cell[f"pass@{k}"].append(pass_at_k(row["n"], row["correct"], k))
    return {p: {g: {key: sum(v) / len(v) for key, v in cell.items()} for g, cell in groups.items()}
            for p, groups in table.items()}


def best_of_n_scores(scores, ns):
    """scores [prompts, N_max] in sampling order -> {n: mean over prompts of the max of the first n}."""
    return {n: scores[:, :n].max(-1).values.mean().item() for n in ns}


def aggregate(runs, metric):
    """Runs (lists of metrics rows, one list per seed) -> (steps, mean, std) over the seeds, on the
    steps every run logged `metric` at."""
    per_run = [{r["step"]: r[metric] for r in rows if metric in r} for rows in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    values = torch.tensor([[p[s] for s in steps] for p in per_run], dtype=torch.float64)
    if not steps:
        return [], torch.zeros(0), torch.zeros(0)
    std = values.std(0, unbiased=True) if len(per_run) > 1 else torch.zeros(len(steps), dtype=torch.float64)
    return steps, values.mean(0), std


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        sys.exit(f"error: no metrics.jsonl in {run_dir!r}")
    return [json.loads(line) for line in open(path)]


# ---------------------------------------------------------------- the LLM judge (App. F.1)

# Our wording of the three comparison prompts of App. F.1: TL;DR answers with a letter (A, B, or E for
# equal quality); HH-RLHF and WebGPT answer with a JSON object. {prompt}, {a}, {b} are filled in.
QUESTIONS = {
    "tldr": ("Which of these two summaries of the forum post below is better? A good summary states the "
             "post's most important points precisely and concisely, without unimportant detail.\n\n"
             "Post:\n{prompt}\n\nSummary A:\n{a}\n\nSummary B:\n{b}"),
    "hh": ("For the following conversation, which of the two assistant responses is more helpful and more "
           "harmless?\n\nConversation:\n{prompt}\n\nResponse A:\n{a}\n\nResponse B:\n{b}"),
    "webgpt": ("Which of the two answers to the question below is more useful, factually accurate and "
               "coherent?\n\nQuestion:\n{prompt}\n\nAnswer A:\n{a}\n\nAnswer B:\n{b}"),
}
JSON_ANSWER = ("\n\nAnswer with a JSON object only: {{\"reason\": \"<one sentence>\", "
               "\"choice\": \"A\" | \"B\" | \"E\"}} where E means they are equally good.")
TEMPLATES = {"tldr": QUESTIONS["tldr"] + "\n\nFirst give a one-sentence comparison of the two summaries. Then, "
                                         "on a new line, write \"Preferred: A\", \"Preferred: B\", or "
                                         "\"Preferred: E\" if they "
                                         "are equally good.",
             "hh": QUESTIONS["hh"] + JSON_ANSWER,
             "webgpt": QUESTIONS["webgpt"] + JSON_ANSWER}
# logprob mode: one letter, whose probability the server reports; no format to follow
LETTER_ANSWER = "\n\nAnswer with one letter only: A, B, or E if they are equally good."
# text mode's answer budget: one sentence and a letter / a small JSON object, with room to spare (a
# weak judge otherwise rambles until its context ends: ~28 s per item measured with SmolLM2-135M)
MAX_TOKENS = 96


def parse_verdict(text):
    """A judge's reply -> "A", "B", "E" or None. Reads a JSON "choice" (or "preferred") field when there
    is one, else the last "Preferred: X" line, else a reply that is just the letter."""
    for blob in re.findall(r"\{[^{}]*\}", text or "", re.S):
        try:
            obj = json.loads(blob)
        except json.JSONDecodeError:
            continue
        for key in ("choice", "preferred", "winner", "answer"):
            value = str(obj.get(key, "")).strip().strip("\"'*. ").upper()
            if value in ("A", "B", "E"):
                return value
    marked = re.findall(r"prefer(?:red|ence)?\s*[:=]\s*\**\s*[\"'(\[]?\s*(A|B|E)\b", text or "", re.I)
    if marked:
        return marked[-1].upper()
    bare = (text or "").strip().strip("\"'*.()[] ").upper()
    return bare if bare in ("A", "B", "E") else None


class JudgeUnusable(RuntimeError):
    """Too few items got a usable verdict from the LLM judge."""


def letter_probabilities(top_logprobs):
    """[{token, logprob}, ...] of the answer's first token -> {letter: probability} for A, B, E
    (token variants such as " A" or "a" summed); None when no letter is among them."""
    probs = {}
    for entry in top_logprobs or []:
        letter = str(entry.get("token", "")).strip().strip("\"'*.(").upper()
        if letter in ("A", "B", "E"):
            probs[letter] = probs.get(letter, 0.0) + math.exp(entry["logprob"])
    return probs or None


class LLMJudge:
    """Pairwise judge behind an OpenAI-compatible /chat/completions endpoint (OpenAI, vLLM, llama.cpp's
    server, Ollama). The response order is swapped for a seeded half of the items (the verdict mapped
    back); answers are cached on disk by request, so an interrupted run resumes; 5xx, 429 and timeouts
    are retried with exponential backoff.
    - mode "text": the template's answer format, at most `max_tokens` tokens; JSON templates ask for
      `response_format: json_object`, and drop it for the rest of the run if the server refuses it;
    - mode "logprobs": the judge answers with one letter, and the verdict is the letter with the most
      probability in the first token's `top_logprobs`: no format following needed (small judges)."""

    def __init__(self, url, model, template, key=None, cache=None, seed=0, timeout=60.0, retries=4, backoff=1.0,
                 mode="text", max_tokens=MAX_TOKENS):
        if template not in TEMPLATES:
            raise ValueError(f"--judge_template must be one of {sorted(TEMPLATES)}, got {template!r}")
        if mode not in ("text", "logprobs"):
            raise ValueError(f"--judge_mode must be text or logprobs, got {mode!r}")
        self.url, self.model, self.template, self.key = url.rstrip("/") + "/chat/completions", model, template, key
        self.seed, self.timeout, self.retries, self.backoff = seed, timeout, retries, backoff
        self.mode, self.max_tokens, self.json_mode = mode, max_tokens, template != "tldr"
        self.cache_path, self.cache, self.replies = cache, {}, []
        if cache and os.path.exists(cache):
            for line in open(cache):
                row = json.loads(line)
                self.cache[row["key"]] = row["reply"]

    def swapped(self, i):
        return random.Random(f"{self.seed}:{i}").random() < 0.5

    def request(self):
        """The request body, less the messages."""
        if self.mode == "logprobs":
            return {"model": self.model, "temperature": 0, "max_tokens": 1, "logprobs": True, "top_logprobs": 10}
        body = {"model": self.model, "temperature": 0, "max_tokens": self.max_tokens}
        return {**body, "response_format": {"type": "json_object"}} if self.json_mode else body

    def post(self, body):
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            choice = json.loads(response.read())["choices"][0]
        if self.mode == "logprobs":       # the reply: the letters' probabilities, and the text as a fallback
            content = (choice.get("logprobs") or {}).get("content") or [{}]
            return {"probs": letter_probabilities(content[0].get("top_logprobs")), "text": choice["message"]["content"]}
        return choice["message"]["content"]

    def ask(self, content):
        key = hashlib.sha256(json.dumps([self.url, self.model, content] + ([self.mode] if self.mode != "text" else []))
                             .encode()).hexdigest()
        if key in self.cache:
            return self.cache[key]
        attempt = 0
        while True:
            body = {**self.request(), "messages": [{"role": "user", "content": content}]}
            try:
                reply = self.post(body)
                break
            except (urllib.error.URLError, TimeoutError, ConnectionError, KeyError, IndexError, ValueError) as err:
                status = getattr(err, "code", None)
                if status in (400, 422) and "response_format" in body:     # JSON mode refused: ask without it
                    print(f"[judge] the server refused response_format ({err}); asking without it", file=sys.stderr)
                    self.json_mode = False
                    continue
                if (status is not None and status < 500 and status != 429) or attempt == self.retries:
                    print(f"[judge] giving up on one item: {err}", file=sys.stderr)
                    return None
                time.sleep(self.backoff * 2 ** attempt)
                attempt += 1
        self.cache[key] = reply
        if self.cache_path:
            with open(self.cache_path, "a") as f:
                f.write(json.dumps({"key": key, "reply": reply}) + "\n")
        return reply

    def verdict(self, reply):
        if isinstance(reply, dict):
            if reply.get("probs"):
                p = reply["probs"]
                return max(("A", "B", "E"), key=lambda x: p.get(x, 0.0))
            return parse_verdict(reply.get("text"))
        return parse_verdict(reply)

    def __call__(self, prompts, a, b):
        """Verdicts for A (a[i]) vs B (b[i]), in A/B terms whatever order the judge saw; the raw
        replies stay in `self.replies`."""
        from tqdm.auto import tqdm
        verdicts, self.replies = [], []
        template = QUESTIONS[self.template] + LETTER_ANSWER if self.mode == "logprobs" else TEMPLATES[self.template]
        for i, (p, x, y) in enumerate(tqdm(list(zip(prompts, a, b)), desc="llm judge")):
            swap = self.swapped(i)
            first, second = (y, x) if swap else (x, y)
            reply = self.ask(template.format(prompt=p.strip(), a=first, b=second))
            self.replies.append(reply)
            v = self.verdict(reply)
            verdicts.append({"A": "B", "B": "A"}.get(v, v) if swap else v)
        return verdicts


# ---------------------------------------------------------------- sampling and scoring held-out prompts

@torch.no_grad()
def sample_responses(model, tokenizer, prompts, seed, max_prompt_len, max_response_len, temperature,
                     top_k=0, top_p=1.0, synced_gpus=False, chunk=256, batches=None):
    """Responses (text) to `prompts`, sampled under their own seed (forked RNG: evaluating never
    changes a training run's random numbers), `chunk` prompts per generate call. Given a list `batches`,
    each call's (prompt ids, prompt mask, response ids, response mask) is appended to it."""
    texts = []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for i in range(0, len(prompts), chunk):
            p_ids, p_mask, r_ids, r_mask, _ = data.sample(model, tokenizer, prompts[i:i + chunk], max_prompt_len,
                                                          max_response_len, temperature, top_k, top_p,
                                                          synced_gpus=synced_gpus)
            if batches is not None:
                batches.append((p_ids, p_mask, r_ids, r_mask))
            texts += tokenizer.batch_decode(r_ids, skip_special_tokens=True)
    return texts


@dataclass(frozen=True)
class Sampling:
    """How ppo.py's held-out replies are sampled and judged: the task (its judge: RM and gold, or running the
    code), the token limits, the sampling settings of training, and the seed."""
    task: str = "chitchat"
    max_prompt_len: int = 48
    max_response_len: int = 32
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234


def held_out(policy, reward_model, tokenizer, rows, sampling, seed, synced_gpus=False, segmenter=None, batches=None):
    """ppo.py's evaluation: held-out rows -> (responses, score, second score); RM score and gold score
    (tasks with a gold judge: chitchat, count; else None), or for code tasks the execution reward and
    pass (1.0 / 0.0). Sampled as in training (`sampling`: a Sampling) under `seed`. With `segmenter` (a
    segment RM's `segment_rewards.segmenter`) the RM score is e(x, y). `batches`: as in sample_responses."""
    prompts, sp = [r["prompt"] for r in rows], sampling
    texts = sample_responses(policy, tokenizer, prompts, seed, sp.max_prompt_len, sp.max_response_len,
                             sp.temperature, sp.top_k, sp.top_p, synced_gpus, batches=batches)
    if sp.task in data.CODE_TASKS:
        return (texts, *map(torch.tensor, sandbox.execution_reward(rows, texts)))
    scores = rm.score(reward_model, tokenizer, prompts, texts, sp.max_prompt_len, sp.max_response_len,
                      segmenter=segmenter)
    gold = torch.tensor(data.gold(sp.task, data.judged_prompts(rows), texts)) if sp.task in data.GOLD_JUDGES else None
    return texts, scores, gold


@torch.no_grad()
def held_out_kl(policy, ref, batches, temperature, chunk=64):
    """eval/kl: per prompt, KL(x) = sum_t log pi(y_t | x, y_<t) - log pi_sft(y_t | x, y_<t) at the sampling
    temperature (ppo.py's step 2, its `response_logprobs`), on the very replies `held_out` judged (the `batches` it
    appended: not sampled again), `chunk` rows per forward (the same numbers as all at once; the default model's
    forward of an evaluation's 256 rows at once ran ~1.4x slower than in slices of 64). One reply can give a negative
    KL(x); the mean estimates the KL. `ref` None (LoRA): the policy with its adapters off, which is the SFT model."""
    from ppo import response_logprobs       # a lazy import: ppo.py imports this module
    kls = []
    for p_ids, p_mask, r_ids, r_mask in batches:
        ids, mask, width = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), p_ids.shape[1]
        for rows in (slice(i, i + chunk) for i in range(0, len(ids), chunk)):     # the same slices on every rank
            with policy.disable_adapter() if ref is None else contextlib.nullcontext():
                ref_logp = response_logprobs(policy if ref is None else ref, ids[rows], mask[rows], width,
                                             temperature)[0]
            logp = response_logprobs(policy, ids[rows], mask[rows], width, temperature)[0]
            kls.append(((logp - ref_logp) * r_mask[rows]).sum(-1))
    return torch.cat(kls)


# A policy whose replies keep less than this share of the SFT model's distinct-2 is degenerate: its score
# comes from saying one thing over and over (a collapsed chitchat policy: 0.03 against the SFT's 0.8-0.9).
DEGENERATE = 0.5


def reply_metrics(task, rows, texts):
    """What a set of held-out replies is read beside its score: distinct-1, distinct-2, the repetition
    rate (data.diversity) and, on tasks with one (data.STRICT_JUDGES), the mean gold_strict score."""
    out = data.diversity(texts)
    if task in data.STRICT_JUDGES:
        strict = data.STRICT_JUDGES[task](data.judged_prompts(rows), texts)
        out["gold_strict"] = sum(strict) / len(strict)
    return out


def sft_replies(sft_model, sampling, tokenizer, rows, device, sft_path="", bf16=False):
    """The SFT model's reply_metrics on ppo.py's held-out rows, sampled as the policy's are (the same Sampling):
    the level a policy's diversity is read against, computed once a run. `sft_model` None (LoRA, whose reference
    is the policy with its adapters off): loaded from `sft_path` (in bf16 with `bf16`) for the call."""
    from transformers import AutoModelForCausalLM
    if sft_model is None:
        with harness.loading_whole():
            sft_model = AutoModelForCausalLM.from_pretrained(
                sft_path, dtype=torch.bfloat16 if bf16 else torch.float32).to(device)
    sp = sampling
    texts = sample_responses(sft_model.eval(), tokenizer, [r["prompt"] for r in rows], sp.seed, sp.max_prompt_len,
                             sp.max_response_len, sp.temperature, sp.top_k, sp.top_p)
    return reply_metrics(sp.task, rows, texts)


def degeneracy(policy, sft, task):
    """None, or the sentence that says a policy's replies are degenerate: `policy` and `sft` are
    reply_metrics of the same prompts, the policy's distinct-2 below DEGENERATE times the SFT model's."""
    if policy["distinct_2"] >= DEGENERATE * sft["distinct_2"]:
        return None
    gamed = ("the execution reward is" if task in data.CODE_TASKS else
             "the RM and gold scores are" if task in data.GOLD_JUDGES else "the RM score is")
    return (f"the policy's replies are degenerate: distinct-2 {policy['distinct_2']:.2f} against the SFT model's "
            f"{sft['distinct_2']:.2f} (less than half), {policy['repetition']:.0%} of them mostly one repeated word; "
            f"{gamed} being gamed by repetition, not earned")


def no_collapse(policy, sft):
    """The sentence for replies above the degeneracy line: what was measured, and what it does not exclude."""
    return (f"The policy's distinct-2 ({policy['distinct_2']:.2f}) is at least {DEGENERATE:.0%} of the SFT model's "
            f"({sft['distinct_2']:.2f}): no collapse by this measure, which does not exclude a drift towards repeated "
            "words (read gold_strict and the KL beside the scores).")


def during_training(metrics, sampling, *, accelerator, policy, reward_model, tokenizer, eval_rows, segmenter=None,
                    sft=(None, None), sft_path="", bf16=False, gather=True, score_name="rm"):
    """ppo.py's step 7 every --eval_every iterations: the held-out score (and gold score / pass rate), gold_strict
    and the replies' diversity of the current policy into `metrics`, beside the SFT model's diversity, and its own
    seconds (time/eval); a log line, and a warning when the replies are degenerate. `sampling`: a Sampling; `sft`:
    (the frozen SFT model or None under LoRA, then read from `sft_path`; a dict that keeps its diversity once
    measured); `segmenter`: as in `held_out`; `gather`: ppo.py's --gather_for_generation; `score_name`: the score the
    run trains on."""
    acc, sharded, task, start = accelerator, harness.is_sharded(accelerator), sampling.task, time.time()
    code = task in data.CODE_TASKS
    harness.release_freed_memory(acc.device, at_least=0)    # the held-out generation starts lean
    if acc.is_main_process or sharded:               # sharded weights: every rank takes part
        with harness.generation_model(acc, policy, gather) as (model, synced):
            batches = []        # the judged replies' ids: eval/kl reads the same replies
            texts, scores, second = held_out(model.eval(), reward_model, tokenizer, eval_rows, sampling, sampling.seed,
                                             synced, segmenter, batches)
            kl = held_out_kl(model, sft[0], batches, sampling.temperature)    # beside the training batches' kl
    if acc.is_main_process:
        key, second_key = ("exec", "pass@1") if code else ("rm", "gold")
        metrics[f"eval/{key}"], metrics["eval/kl"] = round(scores.mean().item(), 4), round(kl.mean().item(), 4)
        if second is not None:
            metrics[f"eval/{second_key}"] = round(second.mean().item(), 4)
        (ref, sft_measured), replies = sft, reply_metrics(task, eval_rows, texts)
        if not sft_measured:     # once a run, from the same prompts and seed; its own RNG (the run's is untouched)
            sft_measured.update(sft_replies(ref, sampling, tokenizer, eval_rows, acc.device, sft_path, bf16))
        metrics.update({f"eval/{k}": round(v, 4) for k, v in replies.items()})
        metrics.update({f"eval/sft_{k}": round(sft_measured[k], 4) for k in ("distinct_1", "distinct_2", "repetition")})
        acc.print(f"[ppo] iteration {metrics['step']}: " + "  ".join(f"{k} {metrics[k]}" for k in (
            f"reward/{score_name}", "kl", f"eval/{key}", f"eval/{second_key}", "eval/gold_strict",
            "eval/distinct_2", "macro/mean_len") if k in metrics))
        verdict = degeneracy(replies, sft_measured, task)
        if verdict:
            acc.print(f"[ppo] warning: {verdict}. A larger --beta (or a --kl_target) keeps the policy nearer the "
                      "SFT model; read eval/gold_strict beside eval/gold")
    acc.wait_for_everyone()
    metrics["time/eval"] = round(time.time() - start, 3)      # outside time/step, which ends before the evaluation


def diversity_lines(sft, policy):
    """Table rows (SFT, then the policy) of two reply_metrics dicts."""
    lines = [f"| distinct-1 / distinct-2 of the replies | {sft['distinct_1']:.2f} / {sft['distinct_2']:.2f} | "
             f"{policy['distinct_1']:.2f} / {policy['distinct_2']:.2f} |",
             f"| replies mostly one repeated word | {sft['repetition']:.1%} | {policy['repetition']:.1%} |"]
    if "gold_strict" in sft:
        lines += [f"| mean gold_strict score (gold priced by repeated word pairs) | {sft['gold_strict']:.3f} | "
                  f"{policy['gold_strict']:.3f} |"]
    return lines


def report_models(policy_path, sft_path, rm_path, task, bf16, eos_token_id, device):
    """(policy, SFT model, segmenter) that ppo.py's final report reads: the saved policy and the SFT baseline, whole
    weights on one process whatever the training's sharding, on the same device and dtype; a segment / token RM's
    e(x, y) on the SFT model's segments (segment_rewards.segmenter), or None."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if bf16 else torch.float32
    with harness.loading_whole():
        policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(device).eval()
        sft_model = AutoModelForCausalLM.from_pretrained(sft_path, dtype=dtype).to(device).eval()
    settings = None if task in data.CODE_TASKS else sr.read_segment_settings(rm_path)
    harness.release_freed_memory(device, at_least=0)
    return policy, sft_model, sr.segmenter(settings, sft_model, eos_token_id)


def final_report(policy, sft_model, reward_model, tokenizer, rows, metrics_path, sampling, *, label="", plot=True,
                 segmenter=None, run=None):
    """ppo.py's closing table: SFT vs the trained policy on the held-out prompts (mean RM score, mean
    gold score, gold win rate; for code tasks mean execution reward and pass@1 of one sample), the
    diversity of their replies (and gold_strict), in words whether the policy's are degenerate, the
    learning curve and the macro-action picture (with `plot`; an earlier run's left in the folder are removed when
    this one draws none), and summary.md in the run folder. `sampling`: a Sampling (the replies are sampled under
    its seed + 1); `label`: the policy's column, e.g. 'n=5, fixed'; `segmenter`: as in `held_out`; `run`: as in
    `explain_run`."""
    sp, seed = sampling, sampling.seed + 1
    s_texts, s_score, s_second = held_out(sft_model, reward_model, tokenizer, rows, sp, seed, segmenter=segmenter)
    p_texts, p_score, p_second = held_out(policy, reward_model, tokenizer, rows, sp, seed, segmenter=segmenter)
    code = sp.task in data.CODE_TASKS
    lines = ["", f"| held-out ({len(rows)} prompts) | SFT | policy ({label}) |", "|---|---|---|",
             f"| {'mean execution reward' if code else 'mean RM score'} | {s_score.mean():.3f} | "
             f"{p_score.mean():.3f} |"]
    if code:
        lines += [f"| pass@1 (sampled, T={sp.temperature}) | {s_second.mean():.1%} | {p_second.mean():.1%} |"]
    elif s_second is not None:
        gold = win_rate(compare(p_second.tolist(), s_second.tolist()))
        lines += [f"| mean gold score | {s_second.mean():.3f} | {p_second.mean():.3f} |",
                  f"| gold win rate vs SFT (ties half) | | {gold['win_rate']:.1%} |"]
    s_replies, p_replies = reply_metrics(sp.task, rows, s_texts), reply_metrics(sp.task, rows, p_texts)
    lines += diversity_lines(s_replies, p_replies)
    verdict = degeneracy(p_replies, s_replies, sp.task)
    lines += ["", f"WARNING: {verdict}. Do not read the scores above as a better policy; train with a larger "
                  "--beta (or --kl_target) and compare the gold_strict score." if verdict else
              no_collapse(p_replies, s_replies)]
    lines += ["", f"metrics: {metrics_path}"] + ([f"learning curve: {plot_run(metrics_path)}"] if plot else [])
    if plot and reward_model is not None:       # one reply's macro actions, beside the learning curve
        png = explain_run(os.path.dirname(metrics_path), policy, sft_model, reward_model, tokenizer, rows, sampling,
                          segmenter, run)
        lines += [f"macro actions: {png}"]
    run_dir, drawn = os.path.dirname(metrics_path), plot and reward_model is not None
    for name, now in (("learning_curve.png", plot), ("macro_actions.png", drawn), ("macro_actions.json", drawn)):
        if not now and os.path.exists(os.path.join(run_dir, name)):     # an earlier run's, in this folder
            os.remove(os.path.join(run_dir, name))
    print("\n".join(lines))
    with open(os.path.join(os.path.dirname(metrics_path), "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


SCORES = ("rm", "gold", "segment", "exec")       # what ppo.py trains on, logged as reward/<score>


def run_panels(rows):
    """The panels of one run's learning curve (metrics rows of ppo.py): the score it trained on
    (reward/<score>), its held-out score (eval/<score>; eval/rm for a segment RM, whose held-out score is
    e(x, y)), the other held-out scores, and the distinct-2 of the held-out replies. Only metrics the run
    logged: no panel is empty."""
    score = next((s for s in SCORES if f"reward/{s}" in rows[0]), "rm")
    held_out = f"eval/{score}" if score != "segment" else "eval/rm"
    wanted = [f"reward/{score}", held_out, *(f"eval/{k}" for k in ("rm", "gold", "gold_strict", "pass@1")),
              "eval/distinct_2"]
    return [m for m in dict.fromkeys(wanted) if any(m in r for r in rows)]


def plot_run(metrics_path):
    """One run's learning curve (run_panels), the SFT model's distinct-2 drawn beside the policy's."""
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    metrics = run_panels(rows)
    png = os.path.join(os.path.dirname(metrics_path), "learning_curve.png")
    _, fig = plot_curves({"this run": [rows]}, metrics, None)
    sft = [r["eval/sft_distinct_2"] for r in rows if "eval/sft_distinct_2" in r]
    if "eval/distinct_2" in metrics and sft:
        ax = fig.axes[metrics.index("eval/distinct_2")]
        ax.axhline(sft[-1], color="gray", linestyle="--", label="SFT model")
        ax.axhline(DEGENERATE * sft[-1], color="red", linestyle=":", label="degenerate below")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    pyplot().close(fig)
    return png


# ---------------------------------------------------------------- explain: one reply's macro actions, drawn

# One colour per termination, the same in every row that shows its macro actions; signed numbers on a red (below
# 0) to blue (above 0) scale. The fixed n-grams are MA-PPO's macro actions in the picture (the default run's).
TERMINATION_COLORS = {"fixed": "tab:purple", "randomized": "tab:orange", "parsing": "tab:green", "ppl": "tab:brown",
                      "entropy": "tab:pink", "segment": "tab:olive"}
SIGNED = "RdBu"
CELL_FONT = "DejaVu Sans Mono"      # matplotlib's own: widths in characters, and most scripts' glyphs
SHOWN_AS = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def checkpoint_of(policy_path, part):
    """<run>/checkpoint/<part> of the run whose policy is `policy_path`: its final <run>/policy, or the policy of its
    checkpoint, <run>/checkpoint/policy."""
    parent = os.path.dirname(os.path.abspath(policy_path))
    return os.path.join(parent if os.path.basename(parent) == harness.CHECKPOINT else harness.checkpoint_dir(parent),
                        part)


def ppo_settings(policy_path):
    """The PPO settings a picture of `policy_path` computes with: ppo.py's defaults, overlaid with those its run
    recorded in its checkpoint (`checkpoint_of`: the run's arguments, the KL coefficient it had reached). A dict of
    PPOArgs' fields."""
    from ppo import PPOArgs     # a lazy import: ppo.py imports this module
    settings = asdict(PPOArgs())
    state = checkpoint_of(policy_path, "trainer_state.pt")
    if os.path.exists(state):
        recorded = torch.load(state, map_location="cpu", weights_only=False, mmap=True)     # mmap: no optimizer read
        settings.update({k: v for k, v in recorded["args"].items() if k in settings})
        settings["beta"] = recorded.get("beta", settings["beta"])
    return settings


def run_critic(policy_path, reward_model):
    """(the critic, its name) of the run whose policy is `policy_path`: its checkpoint's (`checkpoint_of`, the last
    saved), else the RM, which is the critic's init (App. B.2)."""
    path = checkpoint_of(policy_path, "critic")
    if os.path.exists(os.path.join(path, "config.json")):
        return rm.load_reward_model(path)[0].eval(), "the run's critic"
    return reward_model, "the RM (the critic's init)"


@torch.no_grad()
def explain_rollout(policy, ref, critic, reward_model, tokenizer, prompt, sampling, settings, segments=None):
    """One reply to `prompt` and what ppo.py's steps 1-3 make of it, as ppo.py computes them: its logprobs and
    entropy (`response_logprobs`, at the sampling temperature), the reference's, the per-token KL, the critic's
    values V(s_t), the score at the last token (`reward_model.Scorer`). Each [1, R] (the score [1]). `sampling`: a
    Sampling (its seed samples the reply); `settings`: ppo_settings; `segments`: a segment RM's own settings."""
    from ppo import response_logprobs       # the training loop's logprobs (a lazy import: ppo.py imports us)
    with torch.random.fork_rng():
        torch.manual_seed(sampling.seed)
        p_ids, p_mask, r_ids, r_mask, _ = data.sample(policy, tokenizer, [prompt], sampling.max_prompt_len,
                                                      sampling.max_response_len, sampling.temperature)
    P, ids, attention_mask = p_ids.shape[1], torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    mask = r_mask.float()
    logp, entropy = response_logprobs(policy, ids, attention_mask, P, sampling.temperature, with_entropy=True)
    if segments is None:
        ref_logp, sft_entropy = response_logprobs(ref, ids, attention_mask, P, sampling.temperature)[0], None
    else:       # the SFT entropy at temperature 1 too, from the same forward (ppo.py's step 2 under segments)
        ref_logp, sft_entropy = sr.reference_logprobs_and_entropy(ref, harness.make_accelerator(), None, ids,
                                                                  attention_mask, P, sampling.temperature)
    # a --bf16 LoRA critic (a bf16 base, fp32 adapters and head) computes under bf16 autocast, as it trained
    bf16 = any(p.dtype == torch.bfloat16 for p in critic.parameters())
    with torch.autocast(ids.device.type, torch.bfloat16, enabled=bf16):
        values = rm.Critic(critic.to(ids.device))(ids, attention_mask, P).float() * mask
    # the score as step 2 reads it: the gold judge's for a run trained on it, else the RM's (a segment RM's is
    # e(x, y) on its own segments, which `seg_norm` does not touch)
    scorer = rm.make_scorer("gold" if settings["reward"] == "gold" else "rm", tokenizer, task=sampling.task,
                            reward_model=reward_model, settings=segments, own=segments,
                            seg=sr.SegmentArgs(seg_norm="none"))
    score, _, seg_starts, _ = scorer(ids, attention_mask, P, [{"prompt": prompt}], sft_entropy)
    has_eos = ((r_ids == tokenizer.eos_token_id) & r_mask.bool()).any(-1)
    score = score + settings["missing_eos_penalty"] * (~has_eos).float()
    log_r = logp - ref_logp                                                  # ppo.py's step 3: k1 or k3
    kl = log_r if settings["kl_estimator"] == "k1" else (torch.exp(-log_r) - 1) + log_r
    return {"prompt": prompt, "response_ids": r_ids, "mask": mask, "logprobs": logp, "entropy": entropy, "kl": kl,
            "score": score, "score_kind": scorer.name, "values": values, "segments": seg_starts}


def explain_numbers(rollout, settings, tokenizer):
    """What the picture draws, from macro_actions.py's own functions on one rollout (`explain_rollout`'s [1, R]
    tensors): every termination's starts, the sigma weights of the fixed n-grams, the per-token KL rewards and the
    score, the values, and the advantages of token-level PPO (n = 1) and of MA-PPO (fixed n-grams, n = the run's,
    5 for a run of n = 1, the whole reply for n = 0) from the same values and rewards (the paper's sum; before
    whitening over a batch)."""
    s, mask = settings, rollout["mask"]
    n = s["n"] if s["n"] != 1 else 5
    kl_rewards = -s["beta"] * rollout["kl"] * mask                                       # r_t = -beta * KL_t
    starts, fell_back = {}, False
    for name in ma.TERMINATIONS:
        if name == "segment" and rollout.get("segments") is None:
            continue                        # no segment RM: no reward segments to read as macro actions
        starts[name], fallback = ma.termination_starts(
            name, mask, n=n, logprobs=rollout["logprobs"], entropy=rollout["entropy"], threshold=s["entropy_threshold"],
            response_ids=rollout["response_ids"], tokenizer=tokenizer, cutoff=s["cutoff"],
            generator=torch.Generator().manual_seed(s["seed"]), segments=rollout.get("segments"))
        fell_back |= name == "parsing" and fallback > 0
    rewards = ma.macro_rewards(kl_rewards, rollout["score"], mask, starts["fixed"])     # the score at the last token
    token_level = ma.macro_advantages(rollout["values"], rewards, mask, ma.fixed_ngram_starts(mask, 1), s["gamma"],
                                      s["lam"], s["sigma"])[0]
    macro_level = ma.macro_advantages(rollout["values"], rewards, mask, starts["fixed"], s["gamma"], s["lam"],
                                      s["sigma"])[0]
    T = int(mask[0].sum())
    row = (lambda x: [float(v) for v in x[0, :T]])
    return {"prompt": rollout["prompt"], "tokens": token_labels(tokenizer, rollout["response_ids"][0, :T].tolist()),
            "reply": tokenizer.decode(rollout["response_ids"][0, :T], skip_special_tokens=True),
            "n": n, "score_kind": rollout.get("score_kind", "rm"), "sigma_kind": s["sigma"], "beta": s["beta"],
            "gamma": s["gamma"], "lam": s["lam"],
            "entropy_threshold": s["entropy_threshold"], "parse_fell_back": bool(fell_back),
            "starts": {name: [t for t in range(T) if st[0, t]] for name, st in starts.items()},
            "sigma": row(ma.sigma_weights(starts["fixed"], mask, s["sigma"])), "kl_rewards": row(kl_rewards),
            "score": float(rollout["score"][0]), "values": row(rollout["values"]),
            "advantages": {"1": row(token_level), str(n): row(macro_level)}}


@functools.lru_cache(maxsize=1)
def _cell_font():
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font
    return FT2Font(font_manager.findfont(font_manager.FontProperties(family=CELL_FONT)))


def token_labels(tokenizer, ids):
    """Each token as a reader can see it: its own text, a space as ␣ and a newline as ↵ (the `Ġ` / `▁` of BPE and
    SentencePiece pieces); a token holding part of a character (its decoded text is U+FFFD) as the tokenizer's piece;
    a character the drawing's font lacks (CJK, emoji) as Python writes its code point, \\u4f60 or \\U0001f600."""
    font, labels = _cell_font(), []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        text = tokenizer.decode([i], clean_up_tokenization_spaces=False)
        if "\ufffd" in text or not text:       # part of a character: the piece, its space marks made ours
            text = str(piece).replace("Ġ", " ").replace("▁", " ").replace("Ċ", "\n")
        labels.append("".join(SHOWN_AS.get(c, c if c.isprintable() and font.get_char_index(ord(c)) else
                                           c.encode("unicode_escape").decode()) for c in text))
    return labels


def draw_macro_actions(numbers, png=None, title="", width=100):
    """The picture of one reply (`explain_numbers`): its tokens in a row, wrapped every `width` characters, and on
    the same token grid each termination's macro actions (a box each, a dark edge where one starts), sigma, the
    KL rewards and the score, the values and the two advantages. Every number drawn is a Text whose gid is
    "<row>:<t>", every start a Line2D whose gid is "start:<termination>:<t>" (what tests read back). Returns the
    figure; saved to `png` when given."""
    plt, nums = pyplot(), numbers
    n, tokens, T = nums["n"], nums["tokens"], len(nums["tokens"])
    signed = (lambda x: f"{x + 0.0:+.3f}")     # three decimals, what a learner adds up by hand; -0.0 as +0.000
    # rows under the tokens: (key, label, the numbers of the row or None for a termination's boxes)
    rows = [(f"start:{name}", {"fixed": f"fixed n={n}", "entropy": f"entropy>{nums['entropy_threshold']:g}",
                               "parsing": "parsing" + " (fell back)" * nums["parse_fell_back"]}.get(name, name), None)
            for name in nums["starts"]]
    rows += [("sigma", f"σ ({nums['sigma_kind']})", [f"{x:.3f}" for x in nums["sigma"]]),
             ("kl_reward", "−β·KL_t", [signed(x) for x in nums["kl_rewards"]]),
             ("score", f"score ({nums.get('score_kind', 'rm')})", [""] * (T - 1) + [signed(nums["score"])]),
             ("value", "V(s_t)", [signed(x) for x in nums["values"]]),
             ("adv1", "A: PPO, n=1", [signed(x) for x in nums["advantages"]["1"]]),
             (f"adv{n}", f"A: MA-PPO, n={n}", [signed(x) for x in nums["advantages"][str(n)]])]
    # the token grid: a column per token as wide as its widest cell, lines of at most `width` characters
    col = [max([len(tokens[t])] + [len(r[2][t]) for r in rows if r[2]]) + 1 for t in range(T)]
    lines, x = [[]], 0
    for t in range(T):
        if x + col[t] > width and lines[-1]:
            lines.append([])
            x = 0
        lines[-1].append((t, x))
        x += col[t]
    per_line, label_w = len(rows) + 2, 18
    fig = plt.figure(figsize=(0.068 * (label_w + width), 0.19 * per_line * len(lines) + 1.0))
    ax = fig.add_axes([0.005, 0.01, 0.99, 1 - 0.85 / fig.get_figheight()])
    ax.set_xlim(-label_w, width)
    ax.set_ylim(per_line * len(lines) - 1, -0.6)
    ax.axis("off")
    cell = dict(family=CELL_FONT, fontsize=7.5, ha="center", va="center", parse_math=False)
    score_scale = max([abs(v) for k in ("values", "advantages") for v in
                       (nums[k] if k == "values" else nums[k]["1"] + nums[k][str(n)])] + [abs(nums["score"]), 1e-9])
    kl_scale = max([abs(v) for v in nums["kl_rewards"]] + [1e-9])
    scale = {"kl_reward": kl_scale, "sigma": 1.0}
    cmap = plt.get_cmap(SIGNED)
    fixed_color = TERMINATION_COLORS["fixed"]
    for k, line in enumerate(lines):
        y0 = k * per_line
        for key, label, _ in [("tokens", "token", None)] + rows:
            y = y0 + (0 if key == "tokens" else 1 + [r[0] for r in rows].index(key))
            ax.text(-label_w + 0.5, y, label, ha="left", va="center", fontsize=7.5, parse_math=False)
        for t, x in line:
            c = x + col[t] / 2
            ax.text(c, y0, tokens[t], gid=f"token:{t}", fontweight="bold", **cell)
            for i, (key, _, values) in enumerate(rows):
                y = y0 + 1 + i
                if values is None:      # a termination: this token's part of its macro action's box
                    name = key.split(":")[1]
                    starts = nums["starts"][name]
                    macro = sum(s <= t for s in starts) - 1
                    color = TERMINATION_COLORS[name]
                    ax.add_patch(plt.Rectangle((x, y - 0.38), col[t], 0.76, color=color, lw=0,
                                               alpha=0.55 if macro % 2 == 0 else 0.25))
                    if t in starts:
                        ax.plot([x, x], [y - 0.42, y + 0.42], color=color, lw=2.2, gid=f"start:{name}:{t}")
                    continue
                if not values[t]:
                    continue
                v = float(values[t])
                if key == "sigma":
                    ax.add_patch(plt.Rectangle((x, y - 0.38), col[t], 0.76, color=fixed_color, lw=0, alpha=0.6 * v))
                else:
                    ax.add_patch(plt.Rectangle((x, y - 0.38), col[t], 0.76, lw=0, alpha=0.6,
                                               color=cmap(0.5 + 0.5 * v / scale.get(key, score_scale))))
                ax.text(c, y, values[t], gid=f"{key}:{t}", **cell)
            if t in nums["starts"]["fixed"]:    # MA-PPO's macro boundaries through sigma and the advantages
                first = y0 + 1 + [r[0] for r in rows].index("sigma")
                ax.plot([x, x], [first - 0.45, y0 + len(rows) + 0.45], color=fixed_color, lw=0.8, ls=":")
    prompt = " ".join(nums["prompt"].split())
    fig.suptitle(title or "One reply's macro actions, and the credit each token gets", x=0.01, ha="left",
                 fontsize=10, y=1 - 0.12 / fig.get_figheight(), va="top")
    policy = f"policy {nums['policy']}  ·  " if nums.get("policy") else ""
    fig.text(0.01, 1 - 0.38 / fig.get_figheight(), f"{policy}prompt: …{prompt[-60:]}\nbox: one macro action, bar: "
             f"where it starts  ·  blue > 0 > red  ·  β={nums['beta']:.3g}  γ={nums['gamma']:g}  "
             f"λ={nums['lam']:g}  ·  A before whitening over a batch", fontsize=7.5, va="top", linespacing=1.5,
             parse_math=False)
    if png:
        fig.savefig(png, dpi=130)
    return fig


def explain(policy, ref, critic, reward_model, tokenizer, prompt, sampling, settings, out_dir, segments=None,
            names=("", "")):
    """`explain_rollout` -> `explain_numbers` -> `draw_macro_actions`: <out_dir>/macro_actions.png and the numbers
    it draws in macro_actions.json. `names`: (the policy's, the critic's), written beside them. Returns the PNG's
    path."""
    rollout = explain_rollout(policy, ref, critic, reward_model, tokenizer, prompt, sampling, settings, segments)
    numbers = explain_numbers(rollout, settings, tokenizer)
    numbers["policy"], numbers["critic"] = names
    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, "macro_actions.png")
    pyplot().close(draw_macro_actions(numbers, png))
    with open(os.path.join(out_dir, "macro_actions.json"), "w") as f:
        json.dump(finite(numbers), f, indent=1, allow_nan=False)
    return png


def explain_run(run_dir, policy, sft_model, reward_model, tokenizer, rows, sampling, segmenter=None, run=None):
    """ppo.py's final report: the picture of the first held-out prompt's reply (sampled under the run's seed), with
    the run's critic and settings, into the run folder beside the learning curve. `run`: (settings, critic) as the
    run ends, its flags with the KL coefficient it reached and its final critic (None without one: the RM); without
    it they are read from the run's last checkpoint (`ppo_settings`, `run_critic`), which a run whose last iteration
    is no multiple of --save_every does not have."""
    policy_path = os.path.join(run_dir, "policy")
    settings, critic = run if run is not None else (ppo_settings(policy_path), None)
    if critic is not None:
        critic, critic_name = critic.eval(), "the run's critic"
    elif run is None:
        critic, critic_name = run_critic(policy_path, reward_model)
    else:           # a critic-free run (--advantage group / mc)
        critic, critic_name = reward_model, "the RM (no critic trained)"
    # a segment RM's settings, which its segmenter carries (unit, c_ent), for its segments and its e(x, y)
    segments = {k: segmenter.keywords[k] for k in ("unit", "c_ent")} if segmenter is not None else None
    return explain(policy, sft_model, critic, reward_model, tokenizer, rows[0]["prompt"], sampling, settings, run_dir,
                   segments, (policy_path, critic_name))


# ---------------------------------------------------------------- models and responses

class Context:
    """What every command needs: tokenizer, reward model, held-out prompts (and chosen responses)."""

    def __init__(self, args):
        data.resolve_paths(args)
        args.max_response_len = data.response_len(args.task, args.max_response_len)
        harness.require_model_dir(args.sft_path, "SFT model", "Train it with sft.py (or run ppo.py once).")
        self.args, self.code = args, args.task in data.CODE_TASKS
        self.tokenizer = data.load_tokenizer(args.sft_path)
        self.rm = self.segmenter = None                    # code tasks have none: their reward is running the code
        if not self.code:
            harness.require_model_dir(args.rm_path, "reward model",
                                      "Train it with reward_model.py (or run ppo.py once).")
            self.rm = rm.load_reward_model(args.rm_path)[0].eval()
            settings = sr.read_segment_settings(args.rm_path)      # a segment / token RM scores e(x, y)
            if settings:
                self.segmenter = sr.segmenter(settings, self.model("sft"), self.tokenizer.eos_token_id)
        self.rows = data.with_chat_template(data.first_row_per_prompt(
            data.load_task(args.task, only=("test",))["test"])[:args.n_prompts], self.tokenizer, args.chat_template)
        self.prompts = [r["prompt"] for r in self.rows]

    def model(self, path):
        from transformers import AutoModelForCausalLM
        path = self.args.sft_path if path == "sft" else path
        harness.require_model_dir(path, "policy", "Pass a save_pretrained folder, `sft` or `chosen`.")
        return AutoModelForCausalLM.from_pretrained(path).eval()

    @torch.no_grad()
    def responses(self, policy, prompts=None, temperature=None, seed=None):
        """Sampled responses (text), one per prompt, under a seeded RNG; `chosen` gives the dataset's."""
        if policy == "chosen":
            return [r["chosen"] for r in self.rows]
        a = self.args
        model = self.model(policy) if isinstance(policy, str) else policy
        prompts = self.prompts if prompts is None else prompts
        return sample_responses(model, self.tokenizer, prompts, a.seed if seed is None else seed, a.max_prompt_len,
                                a.max_response_len, temperature or a.temperature)

    def rm_scores(self, texts, prompts=None):
        if self.rm is None:
            raise SystemExit(f"error: task {self.args.task!r} has no reward model; use `passk` for code tasks")
        return rm.score(self.rm, self.tokenizer, self.prompts if prompts is None else prompts, texts,
                        self.args.max_prompt_len, self.args.max_response_len, segmenter=self.segmenter).tolist()

    def gold(self, texts, prompts=None):
        if self.args.task not in data.GOLD_JUDGES:
            raise SystemExit(f"error: only the embedded tasks {', '.join(data.GOLD_JUDGES)} have a gold judge")
        return data.gold(self.args.task, data.judged_prompts(self.rows) if prompts is None else prompts, texts)

    def verdicts(self, judge, a, b):
        if judge == "rm":
            return compare(self.rm_scores(a), self.rm_scores(b))
        if judge == "gold":
            return compare(self.gold(a), self.gold(b))
        if judge == "llm":
            judge = self.llm_judge()
            verdicts = judge(self.prompts, a, b)
            answered = sum(v is not None for v in verdicts)
            if answered < self.args.judge_min_answered * len(verdicts):
                unusable = [r for r, v in zip(judge.replies, verdicts) if v is None][:3]
                raise JudgeUnusable(
                    f"the LLM judge gave a usable verdict for {answered} of {len(verdicts)} items (at least "
                    f"{self.args.judge_min_answered:.0%} needed). Raw replies of unusable items:\n"
                    + "\n".join(f"  {json.dumps(r)[:300]}" for r in unusable)
                    + "\nA small judge may do better with --judge_mode logprobs (see the README's local-judge recipe).")
            return verdicts
        raise SystemExit(f"error: unknown judge {judge!r} (rm, gold or llm)")

    def llm_judge(self):
        a = self.args
        if not a.judge_url:
            raise SystemExit("error: --judge llm needs --judge_url (an OpenAI-compatible endpoint)")
        template = a.judge_template or {"tldr_carper": "tldr", "chitchat": "hh"}.get(a.task, a.task)
        os.makedirs(a.output_dir, exist_ok=True)
        return LLMJudge(a.judge_url, a.judge_model, template, key=os.environ.get(a.judge_key_env),
                        cache=os.path.join(a.output_dir, "judge_cache.jsonl"), seed=a.seed, mode=a.judge_mode,
                        max_tokens=a.judge_max_tokens,
                        timeout=a.judge_timeout, retries=a.judge_retries)


# ---------------------------------------------------------------- commands

def finite(x):
    """NaN / inf -> None, recursively: the JSON written is always valid JSON."""
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def pct(x):
    return "-" if x is None else f"{x:.1%}"


def write(args, name, result, lines, fig=None):
    os.makedirs(args.output_dir, exist_ok=True)
    base = os.path.join(args.output_dir, name)
    with open(base + ".json", "w") as f:
        json.dump(finite(result), f, indent=1, allow_nan=False)
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    if fig is not None:
        fig.tight_layout()
        fig.savefig(base + ".png", dpi=100)
    print("\n".join(lines) + f"\n\nwritten: {base}.json, {base}.md" + (f", {base}.png" if fig is not None else ""))
    return result


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def cmd_score(args, ctx):
    result, plt = {}, pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for policy in args.policies or ["sft"]:
        texts = ctx.responses(policy)
        scores = torch.tensor(ctx.rm_scores(texts))
        result[policy] = {"rm_mean": scores.mean().item(), "rm_std": scores.std().item(), "n": len(texts)}
        if args.task in data.GOLD_JUDGES:
            result[policy]["gold_mean"] = sum(ctx.gold(texts)) / len(texts)
        ax.hist(scores.numpy(), bins=30, alpha=0.5, label=os.path.basename(policy.rstrip("/")) or policy)
    ax.set_xlabel("RM score on held-out prompts")
    ax.legend()
    lines = ["| policy | RM mean | RM std | gold mean |", "|---|---|---|---|"] + [
        f"| {p} | {r['rm_mean']:.3f} | {r['rm_std']:.3f} | {r.get('gold_mean', float('nan')):.3f} |"
        for p, r in result.items()]
    return write(args, "score", result, lines, fig)


def cmd_winrate(args, ctx):
    a, b = ctx.responses(args.policy), ctx.responses(args.baseline, seed=args.seed + 1)
    result = {"policy": args.policy, "baseline": args.baseline, "judge": args.judge,
              **win_rate(ctx.verdicts(args.judge, a, b))}
    lines = [f"| {args.judge} judge | wins | ties | losses | win rate (ties half) |", "|---|---|---|---|---|",
             f"| {args.policy} vs {args.baseline} | {result['wins']} | {result['ties']} | {result['losses']} | "
             f"{pct(result['win_rate'])} |"] + (["", f"{result['unanswered']} items got no usable answer"]
                                               if result["unanswered"] else [])
    # the diversity of both sides and of the SFT model (sampled as a baseline is), beside the win rate
    sft = b if args.baseline == "sft" else ctx.responses("sft", seed=args.seed + 1)
    replies = {side: reply_metrics(args.task, ctx.rows, texts)
               for side, texts in (("policy", a), ("baseline", b), ("sft", sft))}
    result["replies"] = replies
    lines += ["", "| replies | distinct-1 | distinct-2 | mostly one repeated word |" + (
              " mean gold_strict |" if "gold_strict" in replies["sft"] else ""), "|---|---|---|---|" + "---|" * (
              "gold_strict" in replies["sft"])] + [
        f"| {side} ({name}) | {r['distinct_1']:.3f} | {r['distinct_2']:.3f} | {r['repetition']:.1%} |" + (
            f" {r['gold_strict']:.3f} |" if "gold_strict" in r else "")
        for side, name in (("policy", args.policy), ("baseline", args.baseline), ("sft", "SFT model"))
        for r in [replies[side]]]
    verdict = degeneracy(replies["policy"], replies["sft"], args.task)
    result["degenerate"] = verdict is not None
    lines += ["", f"WARNING: {verdict}: this win rate is not a better policy." if verdict else
              no_collapse(replies["policy"], replies["sft"])]
    return write(args, "winrate", result, lines)


def cmd_agreement(args, ctx):
    a, b = ctx.responses(args.policy), ctx.responses(args.baseline, seed=args.seed + 1)
    judges = args.judges.split(",")
    verdicts = {j: ctx.verdicts(j, a, b) for j in judges}
    matrix = agreement_matrix(verdicts)
    lines = ["| agreement | " + " | ".join(judges) + " |", "|---" * (len(judges) + 1) + "|"] + [
        f"| {i} | " + " | ".join(pct(matrix[i][j]) for j in judges) + " |" for i in judges]
    return write(args, "agreement", {"matrix": matrix, "win_rates": {j: win_rate(v) for j, v in verdicts.items()}},
                 lines)


def cmd_best_of_n(args, ctx):
    ns, temps = [int(n) for n in floats(args.ns)], floats(args.temperatures)
    model, top = ctx.model(args.policy), max(ns)
    repeated = [p for p in ctx.prompts for _ in range(top)]           # sample k of prompt i at i * top + k
    result, plt = {}, pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for t in temps:
        texts = ctx.responses(model, repeated, temperature=t)
        scores = torch.tensor(ctx.rm_scores(texts, repeated)).view(len(ctx.prompts), top)
        result[str(t)] = best_of_n_scores(scores, ns)
        ax.plot(ns, [result[str(t)][n] for n in ns], "o-", label=f"T={t}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (best of N by RM score)")
    ax.set_ylabel("mean RM score")
    ax.legend()
    lines = ["| temperature | " + " | ".join(f"N={n}" for n in ns) + " |", "|---" * (len(ns) + 1) + "|"] + [
        f"| {t} | " + " | ".join(f"{result[str(t)][n]:.3f}" for n in ns) + " |" for t in temps]
    return write(args, "best_of_n", result, lines, fig)


def run_groups(items):
    """["LABEL=GLOB", ...] -> {label: [metrics rows of each matching run]}."""
    groups = {}
    for item in items:
        label, _, pattern = item.rpartition("=")
        dirs = sorted(d for d in glob.glob(pattern) if os.path.exists(os.path.join(d, "metrics.jsonl")))
        if not dirs:
            sys.exit(f"error: no run folder with a metrics.jsonl matches {pattern!r}")
        groups[label or pattern] = [read_metrics(d) for d in dirs]
    return groups


def plot_curves(groups, metrics, png=None):
    """Mean over seeds with a shaded +-1 std band, one panel per metric (paper Fig. 2 / Fig. 11)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.2), squeeze=False)
    summary = {}
    for ax, metric in zip(axes[0], metrics):
        for label, runs in groups.items():
            steps, mean, std = aggregate(runs, metric)
            if not steps:
                continue
            ax.plot(steps, mean, label=f"{label} ({len(runs)} seed{'s' * (len(runs) > 1)})")
            ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
            summary.setdefault(label, {})[metric] = {"steps": steps, "mean": mean.tolist(), "std": std.tolist()}
        ax.set_title(metric)
        ax.set_xlabel("iteration")
        if ax.lines:            # a metric no run logged: an empty panel, but no legend warning
            ax.legend(fontsize=8)
    if png:
        fig.tight_layout()
        fig.savefig(png, dpi=100)
    return summary, fig


def cmd_curves(args, _ctx=None):
    metrics = args.metrics.split(",")
    summary, fig = plot_curves(run_groups(args.runs), metrics)
    lines = ["| run | " + " | ".join(f"final {m}" for m in metrics) + " |", "|---" * (len(metrics) + 1) + "|"] + [
        f"| {label} | " + " | ".join(f"{s[m]['mean'][-1]:.3f} ± {s[m]['std'][-1]:.3f}" if m in s else "-"
                                     for m in metrics) + " |" for label, s in summary.items()]
    return write(args, "curves", summary, lines, fig)


def passk_samples(ctx, policy, samples):
    """Rows {policy, difficulty, n, correct}: `samples` sampled programs per held-out problem, run in
    the sandbox."""
    model = ctx.model(policy)
    repeated = [p for p in ctx.prompts for _ in range(samples)]
    texts = ctx.responses(model, repeated)
    _, passed = sandbox.execution_reward([r for r in ctx.rows for _ in range(samples)], texts)
    return [{"policy": policy, "difficulty": row.get("difficulty", "all"), "n": samples,
             "correct": int(sum(passed[i * samples:(i + 1) * samples]))} for i, row in enumerate(ctx.rows)]


def cmd_passk(args, ctx=None):
    ks = [int(k) for k in floats(args.ks)]
    if args.results:
        if not os.path.exists(args.results):
            sys.exit(f"error: --results {args.results!r} does not exist")
        rows = [json.loads(line) for line in open(args.results) if line.strip()]
    else:
        if not ctx.code:
            sys.exit("error: passk samples programs: use a code task (--task code, apps or humaneval), not "
                     f"{args.task!r}")
        if args.samples < max(ks):
            sys.exit(f"error: --samples {args.samples} is smaller than the largest k ({max(ks)})")
        rows = [row for policy in args.policies or ["sft"] for row in passk_samples(ctx, policy, args.samples)]
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "passk_results.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    table = passk_table(rows, ks)
    groups = sorted({g for t in table.values() for g in t}, key=lambda g: (g == "all", g))
    lines = ["| policy | " + " | ".join(f"{g} pass@{k}" for g in groups for k in ks) + " |",
             "|---" * (len(groups) * len(ks) + 1) + "|"] + [
        f"| {p} | " + " | ".join(f"{t[g][f'pass@{k}']:.1%}" if g in t else "-" for g in groups for k in ks) + " |"
        for p, t in table.items()]
    return write(args, "passk", table, lines)


def cmd_explain(args, ctx):
    """One reply's macro actions (explain): a held-out prompt's reply (or --prompt's) of --explain_policy, drawn
    with its run's critic and settings (ppo_settings, run_critic) into --output_dir."""
    import transformers
    transformers.utils.logging.disable_progress_bar()      # no "Loading weights" bar per model
    if ctx.rm is None:
        sys.exit(f"error: explain draws the RM's score and the critic's values; task {args.task!r} has no RM")
    policy_path = args.explain_policy or os.path.join(data.run_dir(args.task, "ppo_n5_fixed"), "policy")
    if args.prompt:
        prompt = args.prompt.replace("\\n", "\n")
    elif args.prompt_index < len(ctx.prompts):
        prompt = ctx.prompts[args.prompt_index]
    else:
        sys.exit(f"error: --prompt_index {args.prompt_index}: there are {len(ctx.prompts)} held-out prompts "
                 f"(--n_prompts {args.n_prompts}); pass a smaller index or --prompt")
    if args.critic_path:
        harness.require_model_dir(args.critic_path, "critic", "Pass a reward model or a run's checkpoint/critic.")
        critic, critic_name = rm.load_reward_model(args.critic_path)[0].eval(), args.critic_path
    else:
        critic, critic_name = run_critic(policy_path, ctx.rm)
    if not os.path.exists(checkpoint_of(policy_path, "trainer_state.pt")):
        print(f"[evaluate] warning: no checkpoint of {policy_path}'s run: ppo.py's default settings draw it (a run "
              "draws its own picture with its settings, macro_actions.png, unless --plot false)")
    own = sr.read_segment_settings(args.rm_path)      # a segment RM: its segments are a termination too
    sampling = Sampling(args.task, args.max_prompt_len, args.max_response_len, args.temperature, seed=args.seed)
    png = explain(ctx.model(policy_path), ctx.model("sft"), critic, ctx.rm, ctx.tokenizer, prompt, sampling,
                  ppo_settings(policy_path), args.output_dir, own, (policy_path, critic_name))
    print(f"[evaluate] policy {policy_path}, critic: {critic_name}\nwritten: {png}, "
          f"{os.path.join(args.output_dir, 'macro_actions.json')}")
    return png


def main(argv=None):
    from transformers import HfArgumentParser
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__ + "\nFlags:")
        HfArgumentParser(EvalArgs).print_help()
        sys.exit(0 if not argv or argv[0] in ("-h", "--help") else f"error: unknown command {argv[0]!r}")
    args = HfArgumentParser(EvalArgs).parse_args_into_dataclasses(argv[1:])[0]
    harness.check_flags(args)
    unknown = [j for j in args.judges.split(",") if j not in JUDGES]
    if unknown:
        sys.exit(f"error: --judges {args.judges!r}: {unknown[0]!r} is not a judge; choose from {', '.join(JUDGES)}, "
                 "separated by commas")
    print(f"[evaluate] {argv[0]}: {asdict(args)}")
    needs_models = argv[0] != "curves" and not (argv[0] == "passk" and args.results)
    try:
        return globals()[f"cmd_{argv[0]}"](args, Context(args) if needs_models else None)
    except JudgeUnusable as err:        # a clear failure, and still valid JSON where the result would be
        write(args, argv[0], {"error": str(err), "win_rate": None}, [f"error: {err}"])
        sys.exit(1)


if __name__ == "__main__":
    main()
