"""What bench/gpu_check.sh runs on GPUs, run on CPU processes first: two machines (one `accelerate launch` per
machine, 127.0.0.1 as the main address) against one machine with two processes, bf16 autocast, gradient
checkpointing, and an FSDP launch, which accelerate cannot start on a CPU and which therefore stops; FSDP2
itself runs on CPU processes through tests/launch/fsdp_cpu.py, against DDP.

Two launches of tests/launch/launched_stages.py run the same stage command lines: one machine x 2 processes, and
2 machines x 1 process (both "machines" at once, each its own launcher with its --machine_rank). The
one-machine launch also runs the bf16 and gradient-checkpointing variants and PPO with LoRA; a third launch
runs its SFT and PPO command lines under FSDP2, compared with it."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from stages import comparable, run_stage

TINY = ["--batch_size", "4", "--max_prompt_len", "24", "--max_response_len", "12", "--n_eval", "16", "--seed", "3",
        "--save_every", "1", "--eval_every", "2", "--max_steps", "2"]


def ppo_flags(tiny_models):
    return ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--rollout_batch_size", "4",
            "--mini_batch_size", "2", "--max_prompt_len", "16", "--max_response_len", "8", "--n_eval_prompts", "4",
            "--eval_every", "2", "--save_every", "1", "--policy_lr", "1e-4", "--plot", "false"]


def metrics(output_dir):
    return [json.loads(line) for line in open(output_dir / "metrics.jsonl")]


def weights(folder):
    return load_file(folder / "model.safetensors")


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def one_process(tiny_models, tmp_path_factory):
    """{name: (output folder, what it printed)}: the same stages in this process (one process, no launch)."""
    out = tmp_path_factory.mktemp("one_process")
    ppo = [*ppo_flags(tiny_models), "--steps", "2"]
    runs = {"ppo": ["ppo.py", *ppo], "ppo_gc": ["ppo.py", *ppo, "--gradient_checkpointing"],
            "ppo_lora": ["ppo.py", *ppo, "--lora_r", "4"],
            "ppo_lora_gc": ["ppo.py", *ppo, "--lora_r", "4", "--gradient_checkpointing"],
            "ppo_bf16": ["ppo.py", *ppo_flags(tiny_models), "--steps", "1", "--bf16", "--policy_lr", "1e-6"],
            "sft_bf16": ["sft.py", "--model", str(tiny_models / "sft"), *TINY, "--bf16"],
            "rm_bf16": ["reward_model.py", "--sft_path", str(tiny_models / "sft"), "--n_gold_prompts", "4", *TINY,
                        "--bf16"]}
    from accelerate.state import AcceleratorState, GradientState
    printed = {}
    for name, argv in runs.items():
        AcceleratorState._reset_state()         # each stage's own mixed precision (as tests/launch/launched_stages.py)
        GradientState._reset_state()
        printed[name] = (out / name, run_stage(*argv, "--output_dir", out / name))
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return printed


def test_gradient_checkpointing_in_one_process_with_and_without_lora_changes_no_number(one_process):
    """One process, full weights and LoRA: --gradient_checkpointing gives the metrics and weights of the run
    without it, bitwise."""
    for plain, checkpointed in (("ppo", "ppo_gc"), ("ppo_lora", "ppo_lora_gc")):
        assert [comparable(r) for r in metrics(one_process[checkpointed][0])] == \
               [comparable(r) for r in metrics(one_process[plain][0])], plain
        assert_same_weights(weights(one_process[plain][0] / "policy"), weights(one_process[checkpointed][0] / "policy"))


def test_generation_keeps_its_kv_cache_under_gradient_checkpointing(tiny_models, tokenizer):
    """A policy with gradient checkpointing on samples in eval mode (as ppo.py's rollout does): the KV cache is
    used (every forward after the prompt's reads one new token) and the tokens are those of the same model
    without checkpointing. In train mode transformers would turn the cache off."""
    import data
    from transformers import AutoModelForCausalLM
    tokens, widths = {}, {}
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_models / "sft")
        if checkpointing:
            model.gradient_checkpointing_enable()
        seen = widths[checkpointing] = []
        model.model.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: seen.append((args or [kwargs.get("hidden_states")])[0].shape[1]), with_kwargs=True)
        torch.manual_seed(0)
        tokens[checkpointing] = data.sample(model.eval(), tokenizer, ["hello there", "I think we should"], 16, 6,
                                            temperature=0.8)[2]
    assert torch.equal(tokens[False], tokens[True])
    assert widths[True] == widths[False] and widths[True][0] > 1 and set(widths[True][1:]) == {1}


def test_bf16_in_one_process_steps_fp32_master_weights(one_process, tiny_models):
    """--bf16 in one process: finite losses; the trained models are saved in fp32, and PPO at lr 1e-6 moves
    every weight of a layer. Before, the trained models were loaded and stepped in bf16, where such an update
    rounds away (and the policy was saved in bf16)."""
    for name in ("sft_bf16", "rm_bf16"):
        losses = [float(line.split("train loss ")[1].split()[0]) for line in one_process[name][1].splitlines()
                  if "train loss " in line]
        assert losses and all(torch.isfinite(torch.tensor(losses)))
        assert {t.dtype for t in weights(one_process[name][0]).values()} == {torch.float32}
    policy, sft = weights(one_process["ppo_bf16"][0] / "policy"), weights(tiny_models / "sft")
    assert {t.dtype for t in policy.values()} == {torch.float32}
    key = "model.layers.0.mlp.down_proj.weight"
    assert (policy[key] != sft[key]).float().mean() > 0.9
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics(one_process["ppo_bf16"][0])[0].values())


def test_keep_going_records_a_stage_that_stops_and_runs_the_next(tiny_models, tmp_path):
    """bench/gpu_check.sh --cpu runs a configuration's stages in one launch of tests/launch/launched_stages.py
    --keep_going: a stage that stops (here argparse's exit 2 on a bad choice) is recorded with its exit status and
    what it printed, and the next stage still runs, recorded as passed."""
    import launched_stages
    lines = [["ppo.py", "--kl_estimator", "k2", "--output_dir", str(tmp_path / "ppo")],
             ["sft.py", "--model", str(tiny_models / "sft"), *TINY[:-2], "--max_steps", "1", "--output_dir",
              str(tmp_path / "sft")]]
    launched_stages.main(str(tmp_path), lines, keep_going=True)
    status = [json.loads((tmp_path / f"{i}.0.json").read_text()) for i in (0, 1)]
    assert [s["rc"] for s in status] == [2, 0] and all(s["seconds"] >= 0 for s in status)
    printed = (tmp_path / "0.0.txt").read_text()
    assert "--kl_estimator" in printed and "SystemExit: 2" in printed
    assert (tmp_path / "sft" / "model.safetensors").exists() and not (tmp_path / "ppo").exists()
