"""Stage 1: supervised fine-tuning (SFT) on the demonstrations (`chosen`) of the SFT split.

    python sft.py                                   # tiny Gemma + BPE tokenizer on chitchat, ~3 min CPU
    accelerate launch sft.py --task tldr --model google/gemma-2b --bf16 --gradient_checkpointing \
        --max_steps 0 --epochs 1 --lr 2e-5 --batch_size 8

The loss is next-token cross-entropy on response tokens only (prompt and padding masked with
-100), with a cosine schedule and warmup. The result is a `save_pretrained` folder (model +
tokenizer) that reward_model.py and ppo.py start from; `<output_dir>/checkpoint` holds the state
to `--resume` from (written atomically every `--save_every` steps, on Ctrl-C and on SIGTERM).
"""
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerFast

import data
import harness
from harness import flag

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}


@dataclass
class SFTArgs:
    # --- the task and the model ---------------------------------------------------------------------
    task: str = flag("chitchat", "chitchat, count, tldr, tldr_carper, hh, webgpt, code, apps, or a local "
                                 "json/jsonl/parquet file")
    model: str = flag("tiny", "'tiny' (a small Gemma + BPE tokenizer, built offline), an HF model id, a folder, or a "
                              ".gguf file")
    output_dir: str = flag("", "where the final model + tokenizer are saved; default runs/<task>/sft")
    # --- supervised fine-tuning ---------------------------------------------------------------------
    max_prompt_len: int = flag(48, "prompt tokens kept (truncated from the left)", "[2, inf)")
    max_response_len: int = flag(0, "response tokens kept, EOS included; 0 = the task's default (64 for count, else "
                                    "32)", "[0, inf)")
    batch_size: int = flag(32, "examples per process per micro-step", "[1, inf)")
    grad_accum: int = flag(1, "micro-steps per optimizer step", "[1, inf)")
    max_grad_norm: float = flag(0.0, "clip the gradients' global L2 norm to this (every engine alike); 0 = never",
                                     "[0, inf)")
    lr: float = flag(2e-3, "peak learning rate (the tiny model trains from scratch; ~1e-5 for Gemma-2B)", "[0, inf)")
    warmup_ratio: float = flag(0.05, "fraction of the steps spent warming up, then cosine decay", "[0, 1]")
    weight_decay: float = flag(0.0, "AdamW weight decay", "[0, inf)")
    max_steps: int = flag(400, "optimizer steps; 0 = `epochs` passes over the SFT split", "[0, inf)")
    epochs: float = flag(1.0, "passes over the SFT split when max_steps is 0", "(0, inf)")
    eval_every: int = flag(200, "held-out loss / perplexity every k steps", "[1, inf)")
    save_every: int = flag(200, "resumable checkpoint every k steps", "[1, inf)")
    n_eval: int = flag(512, "held-out examples for loss / perplexity", "[1, inf)")
    # --- the tiny default model (--model tiny) ------------------------------------------------------
    vocab_size: int = flag(2048, "tiny model: BPE vocabulary size", "[1, inf)")
    hidden_size: int = flag(128, "tiny model: hidden size (4 heads of hidden // 4 dimensions)", "[4, inf)")
    num_layers: int = flag(4, "tiny model: transformer layers", "[1, inf)")
    # --- the run ------------------------------------------------------------------------------------
    bf16: bool = flag(False, "bf16 mixed precision (GPUs)")
    gradient_checkpointing: bool = flag(False, "recompute activations to save memory (GPUs)")
    lora_r: int = flag(0, "LoRA rank (peft); 0 = train every weight. Needs a pretrained --model", "[0, inf)")
    lora_alpha: int = flag(16, "LoRA scale alpha (the update is scaled by alpha / r)", "(0, inf)")
    lora_target_modules: str = flag("all-linear", "LoRA: all-linear, or module names separated by commas (e.g. "
                                                  "q_proj,v_proj)")
    chat_template: bool = flag(False, "render prompts with the tokenizer's chat template (instruct models); same in "
                                      "every stage")
    skip_bad_rows: bool = flag(False, "drop malformed dataset rows (and report how many) instead of stopping")
    seed: int = flag(1234, "random seed (data split seed is fixed at 1234)", "[0, 4294967295]")
    resume: bool = flag(False, "continue from <output_dir>/checkpoint")


# ---------------------------------------------------------------------------------------------
# The tiny default model and its tokenizer
# ---------------------------------------------------------------------------------------------

def train_tokenizer(texts, vocab_size=2048):
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
    """A small GemmaForCausalLM (~1.3M parameters at the defaults: 2048 tokens, hidden 128, 4 layers).
    head_dim is set explicitly: Gemma's default of 256 would make the tiny model mostly attention
    projections."""
    from transformers import GemmaConfig, GemmaForCausalLM
    heads = 4
    config = GemmaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=hidden_size // heads, max_position_embeddings=max_len,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    return GemmaForCausalLM(config)


# ---------------------------------------------------------------------------------------------
# Real models: any causal LM from the hub, a folder or a GGUF file
# ---------------------------------------------------------------------------------------------

def load_pretrained(source, bf16=False):
    """(tokenizer, model) of a hub id, a save_pretrained folder, or a .gguf file, which transformers
    dequantizes through the `gguf` package (a 4-bit 135M model becomes a float model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dtype = torch.bfloat16 if bf16 else torch.float32
    kwargs = {}
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise SystemExit(f"error: no GGUF file at {source!r}")
        source, kwargs["gguf_file"] = os.path.split(os.path.abspath(source))
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    if not kwargs:
        return tokenizer, AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    from transformers import GgufConfig
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, quantization_config=GgufConfig(dequantize=True),
                                                 **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:     # float weights: trainable and savable
        model.hf_quantizer.remove_quantization_config(model)
    return tokenizer, model


def add_pad_token(tokenizer, model, log=print):
    """Llama, Qwen, SmolLM2 and Mistral tokenizers have no pad token, or pad = EOS: padding would then
    erase the EOS of every response. A distinct `<pad>` is added and the embeddings resized; both are
    saved with the SFT model, so that the later stages just load them. Pad is never a target (its
    positions are masked out of attention and loss); EOS keeps its own row and stays learnable."""
    if tokenizer.eos_token_id is None:
        raise SystemExit("error: the tokenizer has no EOS token; set one (tokenizer.eos_token) before training")
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    old = tokenizer.pad_token
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    log(f"[sft] the tokenizer's pad token was {old!r} (EOS is {tokenizer.eos_token!r}): added '<pad>' "
        f"(id {tokenizer.pad_token_id}), embeddings resized to {len(tokenizer)}")


# ---------------------------------------------------------------------------------------------
# Stage 1
# ---------------------------------------------------------------------------------------------

def sft_loss(model, batch):
    """Mean next-token cross-entropy over response tokens; returns (loss, n_tokens). Only the positions that
    predict a response token go through the output layer (`logits_to_keep`): the prompt's, most of each row, are
    never scored, and the vocabulary projection is a quarter of the tiny model's compute."""
    labels = batch["labels"]
    first = max(1, int((labels != -100).any(0).int().argmax()))   # the first labelled column (the response's)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False,
                   logits_to_keep=labels.shape[1] - first + 1).logits[:, :-1].float()
    labels = labels[:, first:]
    n = (labels != -100).sum()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss / n.clamp(min=1), n


def split_holdout(rows, fraction=0.05, seed=data.SEED):
    """SFT rows -> (train, held-out) by document, for held-out loss and perplexity."""
    held = [data._group_hash("sft-eval:" + r["group"], seed) < fraction for r in rows]
    return [r for r, h in zip(rows, held) if not h], [r for r, h in zip(rows, held) if h]


def main(args):
    harness.check_flags(args)
    data.resolve_paths(args, "sft")
    args.max_response_len = data.response_len(args.task, args.max_response_len)
    accelerator = harness.make_accelerator(args.bf16, args.grad_accum, args.batch_size, args.max_grad_norm)
    harness.start("sft", args, accelerator)
    log = accelerator.print
    source = harness.checkpoint_part(args.output_dir, "model") if args.resume else args.model
    if args.resume:
        harness.require_part(source, "checkpoint to resume", "Run without --resume to start afresh.")
    if args.lora_r and args.model == "tiny":
        raise SystemExit("error: --lora_r adapts a pretrained --model; the tiny model trains from scratch")
    splits = data.load_task(args.task, skip_bad_rows=args.skip_bad_rows, only=("sft", "test"))
    train_rows, eval_rows = split_holdout(splits["sft"])
    eval_rows = eval_rows[:args.n_eval]
    log(f"[sft] {args.task}: {len(train_rows)} training, {len(eval_rows)} held-out examples")
    if source == "tiny":
        # one process trains the tokenizer, the others load it: every rank has the same vocabulary
        tok_dir = os.path.join(args.output_dir, "tokenizer")
        if accelerator.is_main_process:
            harness.atomic_save(tok_dir, tokenizer=train_tokenizer([r["prompt"] + r["chosen"] for r in train_rows],
                                                                   args.vocab_size))
        accelerator.wait_for_everyone()
        tokenizer = data.load_tokenizer(tok_dir)
        model = tiny_gemma(tokenizer, args.hidden_size, args.num_layers,
                           max_len=2 * (args.max_prompt_len + args.max_response_len))
    else:          # with LoRA the checkpoint holds adapters: they go back on the pretrained model
        # --bf16 autocasts; the trained weights stay fp32 (the master copy), only LoRA's frozen base is bf16
        tokenizer, model = load_pretrained(args.model if args.lora_r else source, args.bf16 and args.lora_r > 0)
        add_pad_token(tokenizer, model, log)
        data.check_tokenizer(tokenizer)
        if args.lora_r:
            model = (harness.load_lora(model, source) if args.resume else
                     harness.with_lora(model, args.lora_r, args.lora_alpha, args.lora_target_modules, "CAUSAL_LM"))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if args.lora_r:
            model.enable_input_require_grads()      # frozen embeddings: checkpointed layers still need grads
    train_rows, eval_rows = (data.with_chat_template(r, tokenizer, args.chat_template) for r in (train_rows, eval_rows))
    world, rank = accelerator.num_processes, accelerator.process_index
    log(f"[sft] model {source}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"({sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6:.2f}M trained), "
        f"{world} process(es) on {accelerator.device}")
    trainer = harness.Trainer("sft", accelerator, model, tokenizer, args, len(train_rows), args.resume)

    def batch_of(rows):
        b = data.collate(tokenizer, [r["prompt"] for r in rows], [r["chosen"] for r in rows],
                         args.max_prompt_len, args.max_response_len)
        return {k: v.to(accelerator.device) for k, v in b.items() if torch.is_tensor(v)}

    def evaluate():
        total = torch.zeros(2, device=accelerator.device)
        for i, weight in harness.eval_batches(len(eval_rows), args.batch_size, rank, world):
            loss, n = sft_loss(trainer.model, batch_of(eval_rows[i:i + args.batch_size]))
            total += weight * torch.stack([loss * n, n.float()])
        total = accelerator.reduce(total, "sum")
        loss = (total[0] / total[1].clamp(min=1)).item()
        return loss, f"held-out loss {loss:.3f}  ppl {math.exp(loss):.1f}"

    trainer.fit(train_rows, lambda rows: sft_loss(trainer.model, batch_of(rows))[0], evaluate)
    if accelerator.is_main_process:
        unwrapped = trainer.final.to(accelerator.device).eval()     # whole weights (merged, if LoRA)
        prompts = data.prompts_of(data.with_chat_template(splits["test"][:8], tokenizer, args.chat_template))[:4]
        r_ids = data.sample(unwrapped, tokenizer, prompts, args.max_prompt_len, args.max_response_len,
                            temperature=0.8)[2]
        for p, r in zip(prompts, tokenizer.batch_decode(r_ids, skip_special_tokens=True)):
            log(f"[sft] sample: ...{p[-80:]!r} -> {r!r}")
    return args.output_dir


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(HfArgumentParser(SFTArgs).parse_args_into_dataclasses()[0])
