"""Stage 2: a Bradley-Terry reward model on the preference pairs of the RM split.

    python reward_model.py                          # from runs/chitchat/sft, ~2 min CPU
    accelerate launch reward_model.py --task tldr --sft_path runs/tldr/sft --output_dir runs/tldr/rm --bf16

The RM is `AutoModelForSequenceClassification(num_labels=1)` initialised from the SFT checkpoint;
its loss is -log sigmoid(r(x, y+) - r(x, y-)) (Ouyang et al. 2022, Eq. 1), its score the head's
output at the last real token of prompt + response. Reported: held-out pairwise accuracy, and on
tasks with a gold judge (chitchat, count) the agreement of the RM with it on pairs of SFT samples
(the replies PPO starts from, at temperature 1; PPO samples at its --temperature, 0.8 by default). `score()` and
`token_values()` are what ppo.py and evaluate.py use; `Scorer` is ppo.py's step 2, one call whatever the score (the
RM, a gold judge, running the program, a segment RM).

`--unit segment` (Yin et al. 2025) reads the same head at the last token of each segment of the
response (segments from the SFT model's entropy; `--unit token`: one token each), scores a response
by the mean of its segment rewards, and saves its settings and location-aware normalizer beside it:
the segments, normalizers and settings live in segment_rewards.py.
"""
import functools
import json
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import data
import harness
from harness import flag
import sandbox
import segment_rewards as sr


@dataclass
class RMArgs:
    # --- the task and the models --------------------------------------------------------------------
    task: str = flag("chitchat", "chitchat, count, tldr, tldr_carper, hh, webgpt, or a local json/jsonl/parquet file")
    sft_path: str = flag("", "SFT checkpoint (save_pretrained folder) or HF model id to start from; default "
                             "runs/<task>/sft")
    output_dir: str = flag("", "where the reward model + tokenizer are saved; default runs/<task>/rm")
    # --- Bradley-Terry training ---------------------------------------------------------------------
    max_prompt_len: int = flag(48, "prompt tokens kept (truncated from the left)", "[2, inf)")
    max_response_len: int = flag(0, "response tokens kept, EOS included; 0 = the task's default (64 for count, else "
                                    "32)", "[0, inf)")
    batch_size: int = flag(32, "preference pairs per process per micro-step", "[1, inf)")
    grad_accum: int = flag(1, "micro-steps per optimizer step", "[1, inf)")
    max_grad_norm: float = flag(0.0, "clip the gradients' global L2 norm to this (every engine alike); 0 = never",
                                     "[0, inf)")
    lr: float = flag(1e-3, "peak learning rate (~5e-6 for Gemma-2B)", "[0, inf)")
    warmup_ratio: float = flag(0.05, "fraction of the steps spent warming up, then cosine decay", "[0, 1]")
    max_steps: int = flag(200, "optimizer steps; 0 = `epochs` passes over the RM split", "[0, inf)")
    epochs: float = flag(1.0, "passes over the RM split when max_steps is 0", "(0, inf)")
    eval_every: int = flag(200, "held-out accuracy every k steps (and at the end)", "[1, inf)")
    save_every: int = flag(100, "resumable checkpoint every k steps", "[1, inf)")
    n_eval: int = flag(1024, "held-out pairs for the pairwise accuracy", "[1, inf)")
    n_gold_prompts: int = flag(256, "held-out prompts whose two SFT samples test RM-gold agreement (chitchat, count); "
                                    "0 = skip", "[0, inf)")
    # --- the run ------------------------------------------------------------------------------------
    bf16: bool = flag(False, "bf16 mixed precision (GPUs)")
    gradient_checkpointing: bool = flag(False, "recompute activations to save memory (GPUs)")
    chat_template: bool = flag(False, "render prompts with the tokenizer's chat template (instruct models); same in "
                                      "every stage")
    skip_bad_rows: bool = flag(False, "drop malformed dataset rows (and report how many) instead of stopping")
    seed: int = flag(1234, "random seed (data split seed is fixed at 1234)", "[0, 4294967295]")
    resume: bool = flag(False, "continue from <output_dir>/checkpoint")
    # --- extension: segment-level rewards (Yin et al. 2025) -----------------------------------------
    unit: str = flag("sequence", "what the head scores (Yin et al. 2025): sequence (the ordinary RM) | segment | token",
                                 choices=("sequence", "segment", "token"))
    c_ent: float = flag(6.0, "--unit segment: a token whose SFT entropy (nats, T=1) exceeds it starts a segment",
                             "[0, inf)")
    n_calibration: int = flag(1024, "--unit segment/token: RM-split pairs (chosen and rejected) the location "
                                    "normalizer is fitted on", "[1, inf)")


SCORE_FILE = "score_norm.json"           # beside an RM: its score's mean and std, fitted by ppo.py --rm_norm
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


class Critic(torch.nn.Module):
    """The reward model read at every position (critic initialised from the RM, App. B.2); a module
    of its own so that DDP / FSDP wrap the forward that computes the values."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask, prompt_width=None):
        """V(s_t) for the state before each response token of [prompt | response] `ids`: the head at the
        preceding position, [B, R]; without `prompt_width`, the head at every position [B, T]."""
        harness.release_freed_memory(ids.device)     # what the forward before this one freed, back to the OS
        model = self.model.get_base_model() if harness.is_lora(self.model) else self.model   # LoRA layers inside
        values = token_values(model, ids, attention_mask)
        return values if prompt_width is None else values[:, prompt_width - 1:-1]




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
            ends = segmenter({**b, "input_ids": ids, "attention_mask": mask})[0]
            out.append(sr.segment_evaluation(values, ends).cpu())
        else:
            out.append(last_token(values, mask).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def bradley_terry(model, batch):
    """-log sigmoid(r+ - r-) over a batch whose first half holds the chosen responses and second
    half the rejected ones (same prompts); r is the score at the last real token, or e(x, y) when the
    batch carries `segment_ends`. Returns (loss, accuracy)."""
    values = token_values(model, batch["input_ids"], batch["attention_mask"])
    if "segment_ends" in batch:
        r = sr.segment_evaluation(values, batch["segment_ends"])
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


# Prompts per generate call in gold_agreement: the default 512 replies at once took the RM stage's peak ~300 MB
# higher (the KV cache of all 512, and the freed copies of it that every decoding step leaves in the heap).
GOLD_SAMPLE_CHUNK = 128


@torch.no_grad()
def gold_agreement(rm, policy, tokenizer, rows, args, segmenter=None):
    """Two SFT samples per held-out prompt (one row per prompt, GOLD_SAMPLE_CHUNK prompts per generate call); how
    often the RM prefers the one the gold judge prefers (pairs the gold judge scores equal are left out); with
    `segmenter`, the RM's e(x, y). Returns (agreement, n_pairs)."""
    twice = [r for r in rows for _ in range(2)]
    prompts = [r["prompt"] for r in twice]
    texts = []
    for i in range(0, len(prompts), GOLD_SAMPLE_CHUNK):
        r_ids = data.sample(policy, tokenizer, prompts[i:i + GOLD_SAMPLE_CHUNK], args.max_prompt_len,
                            args.max_response_len)[2]
        texts += tokenizer.batch_decode(r_ids, skip_special_tokens=True)
    gold = torch.tensor(data.gold(args.task, data.judged_prompts(twice), texts)).view(-1, 2)
    rm_scores = score(rm, tokenizer, prompts, texts, args.max_prompt_len, args.max_response_len,
                      segmenter=segmenter).view(-1, 2)
    decided = gold[:, 0] != gold[:, 1]
    agree = ((gold[:, 0] > gold[:, 1]) == (rm_scores[:, 0] > rm_scores[:, 1]))[decided]
    return agree.float().mean().item() if len(agree) else float("nan"), int(decided.sum())


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
        mean, std = sr.number_field(norm, "mean"), sr.number_field(norm, "std")
    except ValueError as e:
        sys.exit(f"error: {path}: {str(e).replace('segment normalizer: ', '')}")
    if std <= 0:
        sys.exit(f"error: {path}: field 'std' must be positive, got {std}")
    return mean, std


class Scorer:
    """ppo.py's step 2: the sequence score of a rollout batch, of the one kind chosen at setup (`name`, logged as
    reward/<name>). This one is the paper's: the reward model's head at the last real token. The others, each a
    subclass below: `GoldScorer` (the task's judge), `ExecScorer` (the program run against its tests, App. B.5),
    `SegmentScorer` (Yin et al. 2025: segments, segment rewards, a standardized score). A call returns (score [B],
    dense per-token rewards [B, R] or None, the rollout's segment starts [B, R] or None, stats)."""
    name, reads_sft_entropy = "rm", False     # reads_sft_entropy: wants the SFT entropy of step 2's reference forward

    def __init__(self, tokenizer, *, task=None, reward_model=None):
        self.tokenizer, self.task, self.reward_model = tokenizer, task, reward_model

    def __call__(self, ids, attention_mask, prompt_width, rows, sft_entropy=None):
        """The score of the rollout [B, P + R]; `rows`: its problems (prompt, tests) as the data gave them."""
        harness.release_freed_memory(ids.device)     # what the forward before this one freed, back to the OS
        return last_token(token_values(self.reward_model, ids, attention_mask), attention_mask), None, None, {}


class GoldScorer(Scorer):
    """A verifiable reward: the task's gold judge reads the whole response."""
    name = "gold"

    def __call__(self, ids, attention_mask, prompt_width, rows, sft_entropy=None):
        texts = self.tokenizer.batch_decode(ids[:, prompt_width:], skip_special_tokens=True)
        score = torch.tensor(data.gold(self.task, data.judged_prompts(rows), texts), device=ids.device)
        return score, None, None, {}


class ExecScorer(Scorer):
    """App. B.5: the compiler / test signal of running prefix + response (code tasks); reward/pass_rate logged."""
    name = "exec"

    def __call__(self, ids, attention_mask, prompt_width, rows, sft_entropy=None):
        texts = self.tokenizer.batch_decode(ids[:, prompt_width:], skip_special_tokens=True)
        score, passed = map(torch.tensor, sandbox.execution_reward(rows, texts))
        return score.to(ids.device), None, None, {"reward/pass_rate": passed.mean()}


class SegmentScorer(Scorer):
    """Yin et al. 2025, a score of `kind` (rm, segment or gold; `inner`: the plain scorer of rm or gold): the rollout's
    segments, cut as the RM's training cut its own from the SFT entropy at temperature 1 (`settings`,
    segment_rewards.segment_settings; None: none), which --termination segment reads; a segment / token RM
    (`reads_segments`) read at each segment's end: under --reward segment its normalized rewards spread over their
    tokens as `dense` rewards, under --reward rm their mean e(x, y) as the score; `score_norm` (--rm_norm): (mean,
    std) that standardize the score. `sft_entropy_of(ids, mask, P)`: the SFT entropy of other sequences than step
    2's (Monte Carlo continuations)."""
    reads_sft_entropy = True

    def __init__(self, kind, inner, settings, reads_segments, seg_norm, seg_interp, score_norm, sft_entropy_of):
        super().__init__(inner.tokenizer, task=inner.task, reward_model=inner.reward_model)
        self.name, self.inner, self.settings, self.reads_segments = kind, inner, settings, reads_segments
        self.seg_norm, self.score_norm, self.sft_entropy_of = seg_norm, score_norm, sft_entropy_of
        self.seg_interp = "bandit" if kind == "rm" else seg_interp      # e(x, y) as one reward at the last token
        self.reads_sft_entropy = settings is not None

    def __call__(self, ids, attention_mask, prompt_width, rows, sft_entropy=None):
        if sft_entropy is None and self.reads_segments:
            sft_entropy = self.sft_entropy_of(ids, attention_mask, prompt_width)
        starts, inside = (None, None) if sft_entropy is None else sr.rollout_segments(
            self.settings, ids[:, prompt_width:], attention_mask[:, prompt_width:], self.tokenizer.eos_token_id,
            sft_entropy)
        dense, stats = None, {}
        if self.reads_segments:      # the head at each segment's end; e(x, y), their mean
            head = token_values(self.reward_model, ids, attention_mask)[:, prompt_width:]
            dense, score, stats = sr.segment_rewards(head, starts, inside, self.settings, self.seg_norm,
                                                     self.seg_interp)
        else:
            score = self.inner(ids, attention_mask, prompt_width, rows)[0]
        if self.score_norm is not None:     # Yin et al. 2025, §2.1: the RM's score over its calibration mean and std
            score = (score - self.score_norm[0]) / self.score_norm[1]
        return score, dense, starts, stats


def make_scorer(kind, tokenizer, *, task, reward_model, settings=None, own=None, seg=None, score_norm=None,
                sft_entropy_of=None):
    """ppo.py's scorer of `kind` (rm, gold, segment, exec). A SegmentScorer around it where segments are read
    (`settings`, segment_rewards.segment_settings) or the score standardized (`score_norm`); `own`: the RM's own
    segment settings (a segment / token RM) or None; `seg`: segment_rewards.SegmentArgs."""
    inner = {"exec": ExecScorer, "gold": GoldScorer}.get(kind, Scorer)(tokenizer, task=task,
                                                                        reward_model=reward_model)
    if settings is None and score_norm is None:
        return inner
    reads_segments = kind == "segment" or (kind == "rm" and own is not None)
    return SegmentScorer(kind, inner, settings, reads_segments, seg.seg_norm, seg.seg_interp, score_norm,
                         sft_entropy_of)


def ppo_scorer(kind, tokenizer, args, seg, models, accelerator, reward_model, own, segmenter, sft_entropy_of):
    """ppo.py's scorer: `make_scorer` of `kind` with the run's segments (segment_rewards.segment_settings: where the
    rollouts' segments are cut, or None) and, under --rm_norm, the RM's score standardized (`score_normalizer`).
    `args`, `seg`, `models`: ppo.py's PPOArgs, segment_rewards.SegmentArgs, harness.ModelArgs; `own`: the RM's own
    segment settings or None; `segmenter`: its held-out e(x, y) or None."""
    settings = sr.segment_settings(own, args.rm_path, args.sft_path, reward=args.reward, termination=args.termination,
                                   c_ent=seg.c_ent, seg_norm=seg.seg_norm, lora_r=models.lora_r, log=accelerator.print)
    score_norm = score_normalizer(accelerator, args.rm_path, reward_model, tokenizer, segmenter, task=args.task,
                                  chat_template=models.chat_template, max_prompt_len=args.max_prompt_len,
                                  max_response_len=args.max_response_len) if seg.rm_norm else None
    return make_scorer(kind, tokenizer, task=args.task, reward_model=reward_model, settings=settings, own=own, seg=seg,
                       score_norm=score_norm, sft_entropy_of=sft_entropy_of)


def score_normalizer(accelerator, rm_path, reward_model, tokenizer, segmenter, *, task, chat_template,
                     max_prompt_len, max_response_len):
    """ppo.py --rm_norm: (mean, std) of the RM's score on its calibration pairs, from score_norm.json beside it. The
    first run that asks fits it on the first 1024 pairs of the RM split (the main process, once) and writes it
    there, with the settings the scores depend on (`fitted_with`: the task, the chat template, the prompt and response
    limits); a run under other settings fits it again. A file that records none (written by hand) is taken as it
    is. reward_model.py spends nothing on a file that only this flag reads."""
    path = os.path.join(rm_path, SCORE_FILE)
    fitted_with = {"task": task, "chat_template": chat_template, "max_prompt_len": max_prompt_len,
                   "max_response_len": max_response_len}
    recorded = json.load(open(path)) if accelerator.is_main_process and os.path.exists(path) else None
    # kept as it is: a file without settings (written by hand), or not a JSON object (read_score_normalizer's error)
    earlier = recorded.get("fitted_with", fitted_with) if isinstance(recorded, dict) else fitted_with
    if accelerator.is_main_process and (recorded is None or earlier != fitted_with):
        rows = data.with_chat_template(data.load_task(task, only=("rm",))["rm"][:1024], tokenizer, chat_template)
        write_json(path, {**fit_score_normalizer(reward_model, tokenizer, rows, max_prompt_len, max_response_len,
                                                 segmenter), "fitted_with": fitted_with})
        accelerator.print(f"[ppo] --rm_norm: {path} {'missing' if recorded is None else f'fitted under {earlier}'}"
                          f": fitted on {len(rows)} RM-split pairs under {fitted_with} and written")
    accelerator.wait_for_everyone()
    mean, std = read_score_normalizer(rm_path)
    accelerator.print(f"[ppo] --rm_norm: the RM's score as (r - {mean:.4g}) / {std:.4g}")
    return mean, std


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
        segmenter = functools.partial(sr.segment_layout, sft, unit=args.unit, c_ent=args.c_ent,
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
    if segmenter and accelerator.is_main_process:
        rows = train_rows[:args.n_calibration]
        batches = (pairs_of(rows[i:i + args.batch_size]) for i in range(0, len(rows), args.batch_size))
        final = trainer.final.to(accelerator.device).eval()                  # the whole trained RM
        settings = sr.calibrate(lambda b: token_values(final, b["input_ids"], b["attention_mask"]), batches,
                                args.unit, args.c_ent, args.sft_path)
        path = os.path.join(args.output_dir, sr.SEGMENT_FILE)
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
