"""Stage 1: supervised fine-tuning (SFT) on the demonstrations (`chosen`) of the SFT split.

    python sft.py                                   # tiny Gemma + BPE tokenizer on chitchat, ~3 min CPU
    accelerate launch sft.py --task tldr --model google/gemma-2b --bf16 --gradient_checkpointing \
        --max_steps 0 --epochs 1 --lr 2e-5 --batch_size 8

The loss is next-token cross-entropy on response tokens only (prompt and padding masked with
-100), with a cosine schedule and warmup. The result is a `save_pretrained` folder (model +
tokenizer) that reward_model.py and ppo.py start from; `<output_dir>.checkpoint` holds the state
to `--resume` from (written atomically every `--save_every` steps and on Ctrl-C).
"""
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
from transformers import PreTrainedTokenizerFast

import data

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}


@dataclass
class SFTArgs:
    task: str = field(default="chitchat", metadata={"help": "chitchat, tldr, tldr_carper, hh, webgpt, code, apps, or a local json/jsonl/parquet file"})
    model: str = field(default="tiny", metadata={"help": "'tiny' builds a small Gemma + BPE tokenizer offline; otherwise an HF model id or local path"})
    output_dir: str = field(default="runs/chitchat/sft", metadata={"help": "where the final model + tokenizer are saved"})
    max_prompt_len: int = field(default=48, metadata={"help": "prompt tokens kept (truncated from the left)"})
    max_response_len: int = field(default=32, metadata={"help": "response tokens kept, EOS included"})
    batch_size: int = field(default=32, metadata={"help": "examples per process per micro-step"})
    grad_accum: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate (the tiny model trains from scratch; ~1e-5 for Gemma-2B)"})
    warmup_ratio: float = field(default=0.05, metadata={"help": "fraction of the steps spent warming up, then cosine decay"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_steps: int = field(default=400, metadata={"help": "optimizer steps; 0 = `epochs` passes over the SFT split"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the SFT split when max_steps is 0"})
    eval_every: int = field(default=100, metadata={"help": "held-out loss / perplexity every k steps"})
    save_every: int = field(default=200, metadata={"help": "resumable checkpoint every k steps"})
    n_eval: int = field(default=512, metadata={"help": "held-out examples for loss / perplexity"})
    vocab_size: int = field(default=2048, metadata={"help": "tiny model: BPE vocabulary size"})
    hidden_size: int = field(default=128, metadata={"help": "tiny model: hidden size"})
    num_layers: int = field(default=4, metadata={"help": "tiny model: transformer layers"})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPUs)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations to save memory (GPUs)"})
    skip_bad_rows: bool = field(default=False, metadata={"help": "drop malformed dataset rows (and report how many) instead of stopping"})
    seed: int = field(default=1234, metadata={"help": "random seed (data split seed is fixed at 1234)"})
    resume: bool = field(default=False, metadata={"help": "continue from <output_dir>.checkpoint"})


# ---------------------------------------------------------------------------------------------
# The tiny default model and its tokenizer (DESIGN §5)
# ---------------------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size=2000):
    """A byte-level BPE tokenizer trained offline on `texts` (any unicode round-trips), with
    pad != eos. Wrapped as a fast HF tokenizer, so `return_offsets_mapping` works."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def tiny_gemma(tokenizer, hidden_size=128, num_layers=4, max_len=256):
    """A small GemmaForCausalLM (~1.5M parameters at the defaults). head_dim is set explicitly:
    Gemma's default of 256 would make the tiny model mostly attention projections."""
    from transformers import GemmaConfig, GemmaForCausalLM
    heads = 4
    config = GemmaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=hidden_size // heads, max_position_embeddings=max_len,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    return GemmaForCausalLM(config)


# ---------------------------------------------------------------------------------------------
# Helpers shared by the three stages: accelerator, atomic checkpoints, batches, sampling
# ---------------------------------------------------------------------------------------------

class CtrlC:
    """Ctrl-C (SIGINT) asks the training loop to stop at the end of the current step, where the
    weights, optimizer, schedule and RNG all agree with the step counter, so the checkpoint saved
    there resumes to exactly the uninterrupted run. (A KeyboardInterrupt raised mid-step, after an
    optimizer step, would save weights one step ahead of their counter.)
    - `requested()` is collective: every rank calls it at the same point and they agree (any rank
      interrupted -> all stop), so no rank is left waiting in a collective the others have left;
    - `accelerate launch` forwards the terminal's SIGINT to its workers, which thus get it twice:
      a repeat within `grace` seconds is the same request, a later one raises KeyboardInterrupt
      to quit at once without saving (the last periodic checkpoint stays). The launcher kills its
      workers 30 s after the signal: under it, a step longer than that ends before its checkpoint;
    - installed explicitly, so it also works in a process started with SIGINT ignored (`cmd &`).
    Call `stop_after(done, ...)` at the end of every step, and `release()` after the loop: Ctrl-C
    then raises KeyboardInterrupt again."""

    def __init__(self, accelerator, unit="step", saved=0, grace=2.0):
        self.accelerator, self.unit, self.saved, self.grace, self.first = accelerator, unit, saved, grace, None
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame):
        if self.first is None:
            self.first = time.monotonic()
            # os.write, not print: the handler may run while the main thread is inside a print
            os.write(2, f"\n[ctrl-c] finishing this {self.unit}, then saving a checkpoint "
                        f"(Ctrl-C again to quit now without saving)\n".encode())
        elif time.monotonic() - self.first > self.grace:
            raise KeyboardInterrupt

    def requested(self):
        """True on every rank once any rank was interrupted."""
        flag = torch.tensor([float(self.first is not None)], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, "sum")
        return flag.item() > 0

    def stop_after(self, done, last, save_every, save):
        """At the end of step `done`, on every rank: the periodic `save(done)`, and if Ctrl-C was
        pressed before the last step, a checkpoint here; True when the loop should stop."""
        if done % save_every == 0:
            save(done)
            self.saved = done
        if self.requested() and done < last:
            if self.saved != done:
                save(done)
            return True
        return False

    def kept(self, where):
        """What a second Ctrl-C leaves behind."""
        if not self.saved:
            return "no checkpoint had been saved yet"
        return f"the checkpoint of {self.unit} {self.saved} in {where} is kept"

    def release(self):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def make_accelerator(bf16=False, grad_accum=1, **kwargs):
    """Accelerator(cpu=True) without a GPU: `accelerate launch --multi_gpu --num_processes 2` on a
    CPU then runs two synchronised gloo processes instead of two independent ones. (Not under a
    DeepSpeed launch: cpu=True would silently turn DeepSpeed off.)"""
    from accelerate import Accelerator
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return Accelerator(cpu=not torch.cuda.is_available() and not deepspeed, gradient_accumulation_steps=grad_accum,
                       mixed_precision="bf16" if bf16 else "no", **kwargs)


def atomic_save(path, model=None, tokenizer=None, state=None, parts=None, state_dicts=None):
    """Write a save_pretrained folder to a temporary sibling, then swap it in with a rename: an
    interruption never leaves a half-written checkpoint where the last good one was.
    `parts` {name: model} go to sub-folders (ppo.py's policy and critic); `state_dicts` {name or
    "model": weights} replaces a model's own weights (the gathered whole weights of a ZeRO-3 / FSDP
    sharded model)."""
    path = os.path.abspath(path)
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if model is not None:
        model.save_pretrained(tmp, state_dict=(state_dicts or {}).get("model"))
    for name, part in (parts or {}).items():
        part.save_pretrained(os.path.join(tmp, name), state_dict=(state_dicts or {}).get(name))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if state is not None:
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def rng_state():
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def batch_indices(n_rows, batch_size, step, seed, rank=0, world=1):
    """Row indices of this process's batch at optimizer micro-step `step`: a seeded permutation per
    epoch, so a resumed run sees exactly the batches an uninterrupted one would have."""
    per_epoch = max(1, n_rows // (batch_size * world))
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch))
    start = (k * world + rank) * batch_size
    return order[start:start + batch_size].tolist()


def response_logits_mask(ids, eos_id, pad_id):
    """Right-padded responses cut after their first EOS: (ids with pad after EOS, mask [B, R])."""
    is_eos = ids == eos_id
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    mask = (~after_eos).long()
    return ids.masked_fill(mask == 0, pad_id), mask


@torch.no_grad()
def sample(model, tokenizer, prompts, max_prompt_len, max_new_tokens, temperature=1.0, top_k=0,
           top_p=1.0, greedy=False, synced_gpus=False):
    """Sample responses; returns (prompt_ids, prompt_mask, response_ids, response_mask), the
    responses right-padded and cut after the first EOS."""
    p_ids, p_mask, _ = data.encode_prompts(tokenizer, prompts, max_prompt_len)
    device = next(model.parameters()).device
    p_ids, p_mask = p_ids.to(device), p_mask.to(device)
    out = model.generate(input_ids=p_ids, attention_mask=p_mask, max_new_tokens=max_new_tokens,
                         do_sample=not greedy, temperature=temperature if not greedy else None,
                         top_k=top_k if not greedy else None, top_p=top_p if not greedy else None,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         synced_gpus=synced_gpus)
    r_ids, r_mask = response_logits_mask(out[:, p_ids.shape[1]:], tokenizer.eos_token_id, tokenizer.pad_token_id)
    return p_ids, p_mask, r_ids, r_mask


def load_tokenizer(path):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    data.check_tokenizer(tokenizer)
    return tokenizer


def require_model_dir(path, what, hint):
    if not os.path.exists(os.path.join(path, "config.json")):
        sys.exit(f"error: no {what} at {path!r} (no config.json there). {hint}")


class Trainer:
    """What SFT and RM training share: the optimizer and cosine schedule, resuming, micro-batches
    with accumulation, held-out evaluation, atomic checkpoints every `save_every` steps and on
    Ctrl-C, and a stop on a non-finite loss. `loss_fn(rows) -> loss`, `evaluate() -> (value, text)`."""

    def __init__(self, name, accelerator, model, tokenizer, args, n_rows, state=None):
        from transformers import get_cosine_schedule_with_warmup
        self.name, self.accelerator, self.tokenizer, self.args, self.n_rows = name, accelerator, tokenizer, args, n_rows
        self.ckpt_dir = args.output_dir.rstrip("/") + ".checkpoint"
        world = accelerator.num_processes
        self.steps = args.max_steps or math.ceil(args.epochs * n_rows / (args.batch_size * world * args.grad_accum))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=getattr(args, "weight_decay", 0.0))
        self.scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * self.steps), self.steps)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.start = 0
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            self.start = state["step"]
            accelerator.print(f"[{name}] resumed at step {self.start}")

    def save(self, path, step, final=False):
        if self.accelerator.is_main_process:
            atomic_save(path, self.accelerator.unwrap_model(self.model), self.tokenizer, None if final else {
                "step": step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(), "args": asdict(self.args)})
        self.accelerator.wait_for_everyone()

    def fit(self, rows, loss_fn, evaluate):
        """Train to the last step, then save the final model; returns the last evaluation value."""
        from tqdm.auto import tqdm
        acc, args, name = self.accelerator, self.args, self.name
        world, rank = acc.num_processes, acc.process_index
        self.model.train()
        t0, value = time.time(), float("nan")
        bar = tqdm(range(self.start, self.steps), desc=name, disable=not acc.is_local_main_process)
        ctrl_c = CtrlC(acc, saved=self.start)
        try:
            for step in bar:
                for micro in range(args.grad_accum):
                    idx = batch_indices(self.n_rows, args.batch_size, step * args.grad_accum + micro, args.seed,
                                        rank, world)
                    with acc.accumulate(self.model):
                        loss = loss_fn([rows[i] for i in idx])
                        if not torch.isfinite(loss):
                            raise FloatingPointError(f"non-finite {name} loss at step {step}; last good "
                                                     f"checkpoint kept at {self.ckpt_dir}")
                        acc.backward(loss)
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                self.scheduler.step()
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{self.scheduler.get_last_lr()[0]:.1e}")
                if (step + 1) % args.eval_every == 0 or step + 1 == self.steps:
                    self.model.eval()
                    with torch.no_grad():
                        value, text = evaluate()
                    self.model.train()
                    acc.print(f"[{name}] step {step + 1}/{self.steps}  train loss {loss.item():.3f}  {text}  "
                              f"({time.time() - t0:.0f}s)")
                if ctrl_c.stop_after(step + 1, self.steps, args.save_every, partial(self.save, self.ckpt_dir)):
                    acc.print(f"[{name}] interrupted after step {step + 1}: checkpoint saved to {self.ckpt_dir}; "
                              f"continue with --resume")
                    sys.exit(130)
        except KeyboardInterrupt:
            acc.print(f"[{name}] quit without saving: {ctrl_c.kept(self.ckpt_dir)}")
            sys.exit(130)
        ctrl_c.release()
        self.save(args.output_dir, self.steps, final=True)
        acc.print(f"[{name}] saved {args.output_dir}")
        return value


def resume_state(args):
    """The trainer state of `<output_dir>.checkpoint` when --resume, else None (clear error if absent)."""
    if not args.resume:
        return None
    ckpt_dir = args.output_dir.rstrip("/") + ".checkpoint"
    require_model_dir(ckpt_dir, "checkpoint to resume", "Run without --resume to start afresh.")
    return torch.load(os.path.join(ckpt_dir, "trainer_state.pt"), weights_only=False)


# ---------------------------------------------------------------------------------------------
# Stage 1
# ---------------------------------------------------------------------------------------------

def sft_loss(model, batch):
    """Mean next-token cross-entropy over response tokens; returns (loss, n_tokens)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    n = (labels != -100).sum()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss / n.clamp(min=1), n


def split_holdout(rows, fraction=0.05, seed=data.SEED):
    """SFT rows -> (train, held-out) by document, for held-out loss and perplexity."""
    held = [data._group_hash("sft-eval:" + r["group"], seed) < fraction for r in rows]
    return [r for r, h in zip(rows, held) if not h], [r for r, h in zip(rows, held) if h]


def main(args):
    accelerator = make_accelerator(args.bf16, args.grad_accum)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    log = accelerator.print
    log(f"[sft] config: {asdict(args)}")
    state = resume_state(args)
    source = args.output_dir.rstrip("/") + ".checkpoint" if state else args.model
    splits = data.load_task(args.task, skip_bad_rows=args.skip_bad_rows, only=("sft", "test"))
    train_rows, eval_rows = split_holdout(splits["sft"])
    eval_rows = eval_rows[:args.n_eval]
    log(f"[sft] {args.task}: {len(train_rows)} training, {len(eval_rows)} held-out examples")
    if source == "tiny":
        # one process trains the tokenizer, the others load it: every rank has the same vocabulary
        tok_dir = args.output_dir.rstrip("/") + ".tokenizer"
        if accelerator.is_main_process:
            atomic_save(tok_dir, tokenizer=train_tokenizer([r["prompt"] + r["chosen"] for r in train_rows],
                                                           args.vocab_size))
        accelerator.wait_for_everyone()
        tokenizer = load_tokenizer(tok_dir)
        model = tiny_gemma(tokenizer, args.hidden_size, args.num_layers,
                           max_len=2 * (args.max_prompt_len + args.max_response_len))
    else:
        from transformers import AutoModelForCausalLM
        tokenizer = load_tokenizer(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    world, rank = accelerator.num_processes, accelerator.process_index
    log(f"[sft] model {source}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{world} process(es) on {accelerator.device}")
    trainer = Trainer("sft", accelerator, model, tokenizer, args, len(train_rows), state)

    def batch_of(rows):
        b = data.collate(tokenizer, [r["prompt"] for r in rows], [r["chosen"] for r in rows],
                         args.max_prompt_len, args.max_response_len)
        return {k: v.to(accelerator.device) for k, v in b.items() if torch.is_tensor(v)}

    def evaluate():
        total = torch.zeros(2, device=accelerator.device)
        for i in range(rank * args.batch_size, len(eval_rows), world * args.batch_size):
            loss, n = sft_loss(trainer.model, batch_of(eval_rows[i:i + args.batch_size]))
            total += torch.stack([loss * n, n.float()])
        total = accelerator.reduce(total, "sum")
        loss = (total[0] / total[1].clamp(min=1)).item()
        return loss, f"held-out loss {loss:.3f}  ppl {math.exp(loss):.1f}"

    trainer.fit(train_rows, lambda rows: sft_loss(trainer.model, batch_of(rows))[0], evaluate)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(trainer.model).eval()
        prompts = data.prompts_of(splits["test"])[:4]
        *_, r_ids, r_mask = sample(unwrapped, tokenizer, prompts, args.max_prompt_len,
                                   args.max_response_len, temperature=0.8)
        for p, r in zip(prompts, tokenizer.batch_decode(r_ids, skip_special_tokens=True)):
            log(f"[sft] sample: ...{p[-80:]!r} -> {r!r}")
    return args.output_dir


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(HfArgumentParser(SFTArgs).parse_args_into_dataclasses()[0])
