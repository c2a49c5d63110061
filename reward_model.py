"""Stage 2: a Bradley-Terry reward model on the preference pairs of the RM split.

    python reward_model.py                          # from runs/chitchat/sft, ~2 min CPU
    accelerate launch reward_model.py --task tldr --sft_path runs/tldr/sft --output_dir runs/tldr/rm --bf16

The RM is `AutoModelForSequenceClassification(num_labels=1)` initialised from the SFT checkpoint;
its loss is -log sigmoid(r(x, y+) - r(x, y-)) (Ouyang et al. 2022, Eq. 1), its score the head's
output at the last real token of prompt + response. Reported: held-out pairwise accuracy, and on
tasks with a gold judge (chitchat, count) the agreement of the RM with it on pairs of SFT samples
(the distribution PPO will show it). `score()` and `token_values()` are what ppo.py and evaluate.py use.
"""
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import data
import harness


@dataclass
class RMArgs:
    task: str = field(default="chitchat", metadata={"help": "chitchat, count, tldr, tldr_carper, hh, webgpt, or a local json/jsonl/parquet file"})
    sft_path: str = field(default="", metadata={"help": "SFT checkpoint (save_pretrained folder) or HF model id to start from; default runs/<task>/sft"})
    output_dir: str = field(default="", metadata={"help": "where the reward model + tokenizer are saved; default runs/<task>/rm"})
    max_prompt_len: int = field(default=48, metadata={"help": "prompt tokens kept (truncated from the left)"})
    max_response_len: int = field(default=0, metadata={"help": "response tokens kept, EOS included; 0 = the task's default (64 for count, else 32)"})
    batch_size: int = field(default=32, metadata={"help": "preference pairs per process per micro-step"})
    grad_accum: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate (~5e-6 for Gemma-2B)"})
    warmup_ratio: float = field(default=0.05, metadata={"help": "fraction of the steps spent warming up, then cosine decay"})
    max_steps: int = field(default=200, metadata={"help": "optimizer steps; 0 = `epochs` passes over the RM split"})
    epochs: float = field(default=1.0, metadata={"help": "passes over the RM split when max_steps is 0"})
    eval_every: int = field(default=100, metadata={"help": "held-out accuracy every k steps"})
    save_every: int = field(default=100, metadata={"help": "resumable checkpoint every k steps"})
    n_eval: int = field(default=1024, metadata={"help": "held-out pairs for the pairwise accuracy"})
    n_gold_prompts: int = field(default=256, metadata={"help": "tasks with a gold judge (chitchat, count): held-out prompts whose two SFT samples test RM-gold agreement (0 = skip)"})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPUs)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations to save memory (GPUs)"})
    chat_template: bool = field(default=False, metadata={"help": "render prompts with the tokenizer's own chat template (instruct models); off: the raw HH / TL;DR formats of the paper's base models. Use the same choice in every stage"})
    skip_bad_rows: bool = field(default=False, metadata={"help": "drop malformed dataset rows (and report how many) instead of stopping"})
    seed: int = field(default=1234, metadata={"help": "random seed (data split seed is fixed at 1234)"})
    resume: bool = field(default=False, metadata={"help": "continue from <output_dir>/checkpoint"})


# ---------------------------------------------------------------------------------------------
# Scoring: the head's scalar at every position; the reward is the one at the last real token
# ---------------------------------------------------------------------------------------------

def token_values(model, input_ids, attention_mask):
    """The score head applied to every hidden state: [B, T]. For the RM only the last real token
    matters; the PPO critic (initialised from the RM) reads a value at every response token."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=data.position_ids(attention_mask)).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


def last_token(values, attention_mask):
    """values[b, last t with attention_mask 1]: right for left padding, right padding and both."""
    T = attention_mask.shape[1]
    last = T - 1 - attention_mask.flip(-1).long().argmax(-1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


@torch.no_grad()
def score(model, tokenizer, prompts, responses, max_prompt_len=48, max_response_len=32, batch_size=64):
    """Reward of each (prompt, response) pair as a float tensor [N] (EOS appended to responses
    that fit, as in training)."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(prompts), batch_size):
        b = data.collate(tokenizer, prompts[i:i + batch_size], responses[i:i + batch_size],
                         max_prompt_len, max_response_len)
        ids, mask = b["input_ids"].to(device), b["attention_mask"].to(device)
        out.append(last_token(token_values(model, ids, mask), mask).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def bradley_terry(model, batch):
    """-log sigmoid(r+ - r-) over a batch whose first half holds the chosen responses and second
    half the rejected ones (same prompts); returns (loss, accuracy)."""
    r = last_token(token_values(model, batch["input_ids"], batch["attention_mask"]), batch["attention_mask"])
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
def gold_agreement(rm, policy, tokenizer, rows, args):
    """Two SFT samples per held-out prompt (one row per prompt); how often the RM prefers the one the
    gold judge prefers (pairs the gold judge scores equal are left out). Returns (agreement, n_pairs)."""
    twice = [r for r in rows for _ in range(2)]
    r_ids = data.sample(policy, tokenizer, [r["prompt"] for r in twice], args.max_prompt_len, args.max_response_len)[2]
    texts = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
    gold = torch.tensor(data.gold(args.task, data.judged_prompts(twice), texts)).view(-1, 2)
    rm_scores = score(rm, tokenizer, [r["prompt"] for r in twice], texts, args.max_prompt_len, args.max_response_len).view(-1, 2)
    decided = gold[:, 0] != gold[:, 1]
    agree = ((gold[:, 0] > gold[:, 1]) == (rm_scores[:, 0] > rm_scores[:, 1]))[decided]
    return agree.float().mean().item() if len(agree) else float("nan"), int(decided.sum())


def main(args):
    data.resolve_paths(args, "rm")
    args.max_response_len = data.response_len(args.task, args.max_response_len)
    accelerator = harness.make_accelerator(args.bf16, args.grad_accum, args.batch_size)
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
    model, tokenizer = load_reward_model(source, args.bf16)
    train_rows, eval_rows = (data.with_chat_template(r, tokenizer, args.chat_template) for r in (train_rows, eval_rows))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    world, rank = accelerator.num_processes, accelerator.process_index
    trainer = harness.Trainer("rm", accelerator, model, tokenizer, args, len(train_rows), args.resume)

    def pairs_of(rows):
        b = data.collate(tokenizer, [r["prompt"] for r in rows] * 2,
                         [r["chosen"] for r in rows] + [r["rejected"] for r in rows],
                         args.max_prompt_len, args.max_response_len)
        return {k: v.to(accelerator.device) for k, v in b.items() if torch.is_tensor(v)}

    def evaluate():
        total = torch.zeros(2, device=accelerator.device)
        for i in range(rank * args.batch_size, len(eval_rows), world * args.batch_size):
            rows = eval_rows[i:i + args.batch_size]
            _, acc = bradley_terry(trainer.model, pairs_of(rows))
            total += torch.tensor([acc.item() * len(rows), len(rows)], device=accelerator.device)
        total = accelerator.reduce(total, "sum")
        accuracy = (total[0] / total[1].clamp(min=1)).item()
        return accuracy, f"held-out accuracy {accuracy:.3f}"

    accuracy = trainer.fit(train_rows, lambda rows: bradley_terry(trainer.model, pairs_of(rows))[0], evaluate)
    log(f"[rm] held-out pairwise accuracy {accuracy:.3f}")
    if args.task in data.GOLD_JUDGES and args.n_gold_prompts and accelerator.is_main_process:
        from transformers import AutoModelForCausalLM
        with harness.loading_whole():
            policy = AutoModelForCausalLM.from_pretrained(args.sft_path).eval()
        rows = data.first_row_per_prompt(data.with_chat_template(splits["test"], tokenizer, args.chat_template))
        agreement, n = gold_agreement(trainer.final.eval(), policy, tokenizer, rows[:args.n_gold_prompts], args)
        log(f"[rm] RM-gold agreement on {n} pairs of SFT samples: {agreement:.3f}")
    return accuracy


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(HfArgumentParser(RMArgs).parse_args_into_dataclasses()[0])
