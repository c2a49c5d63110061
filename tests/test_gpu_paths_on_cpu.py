"""What bench/gpu_check.sh runs on GPUs, run on CPU processes first: two machines (one `accelerate launch` per
machine, 127.0.0.1 as the main address) against one machine with two processes, bf16 autocast, gradient
checkpointing, and an FSDP launch, which accelerate cannot start on a CPU and which therefore stops; FSDP2
itself runs on CPU processes through tests/fsdp_cpu.py, against DDP.

Two launches of tests/launched_stages.py run the same stage command lines: one machine x 2 processes, and
2 machines x 1 process (both "machines" at once, each its own launcher with its --machine_rank). The
one-machine launch also runs the bf16 and gradient-checkpointing variants and PPO with LoRA; a third launch
runs its SFT and PPO command lines under FSDP2, compared with it."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from stages import LAUNCH, comparable, run_stage

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--batch_size", "4", "--max_prompt_len", "24", "--max_response_len", "12", "--n_eval", "16", "--seed", "3",
        "--save_every", "1", "--eval_every", "2", "--max_steps", "2"]
# bf16 against fp32 on the first iteration (the same seed): the rollouts are sampled from bf16 logits, so
# a few tokens may differ; every number here stays within this
BF16_RTOL, BF16_ATOL = 0.05, 0.02
BF16_METRICS = ("reward/rm", "kl", "entropy", "response/len", "loss/value", "value/explained_variance")


def ppo_flags(tiny_models):
    return ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--rollout_batch_size", "4",
            "--mini_batch_size", "2", "--max_prompt_len", "16", "--max_response_len", "8", "--n_eval_prompts", "4",
            "--eval_every", "2", "--save_every", "1", "--policy_lr", "1e-4", "--plot", "false"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_machines(machine_rank, port):
    """`accelerate launch` of one of two machines with one process each, the main one on 127.0.0.1."""
    launch = [a for a in LAUNCH if a not in ("--num_processes", "2", "--num_machines", "1")]
    return [*launch, "--num_processes", "2", "--num_machines", "2", "--machine_rank", str(machine_rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]


def command_lines(tiny_models, out, machines):
    """{name: argv} of one launch; the 2-machine launch stops PPO after 2 iterations and resumes it to 3."""
    ppo = ppo_flags(tiny_models)
    runs = {"sft": ["sft.py", "--model", str(tiny_models / "sft"), *TINY],
            "rm": ["reward_model.py", "--sft_path", str(tiny_models / "sft"), "--n_gold_prompts", "4", *TINY]}
    if machines == 2:
        runs["ppo_first"] = ["ppo.py", *ppo, "--steps", "2"]
        runs["ppo"] = ["ppo.py", *ppo, "--steps", "3", "--resume"]
    else:
        runs["ppo"] = ["ppo.py", *ppo, "--steps", "3"]
        runs["ppo_gc"] = ["ppo.py", *ppo, "--steps", "3", "--gradient_checkpointing"]
        runs["ppo_lora"] = ["ppo.py", *ppo, "--steps", "1", "--lora_r", "4"]
        runs["ppo_bf16"] = ["ppo.py", *ppo, "--steps", "1", "--bf16"]
        runs["sft_bf16"] = ["sft.py", "--model", str(tiny_models / "sft"), *TINY, "--bf16"]
        runs["rm_bf16"] = ["reward_model.py", "--sft_path", str(tiny_models / "sft"), "--n_gold_prompts", "4", *TINY,
                           "--bf16"]
    return {name: [*argv, "--output_dir", str(out / name.removesuffix("_first"))] for name, argv in runs.items()}


@pytest.fixture(scope="module")
def launches(tiny_models, tmp_path_factory):
    """{1 or 2 machines: {name: (output folder, [what rank 0 printed, rank 1])}}; both launches run at once."""
    procs, runs = {}, {}
    port = free_port()
    for machines in (1, 2):
        out = tmp_path_factory.mktemp(f"machines{machines}")
        runs[machines] = (out, command_lines(tiny_models, out, machines))
        script = ["tests/launched_stages.py", str(out), json.dumps(list(runs[machines][1].values()))]
        launchers = ([[*LAUNCH, "--main_process_port", str(free_port()), *script]] if machines == 1 else
                     [[*two_machines(r, port), *script] for r in (0, 1)])
        procs[machines] = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                           for cmd in launchers]
    for machines, ps in procs.items():
        for p in ps:
            out, err = p.communicate(timeout=900)
            assert p.returncode == 0, f"{machines} machine(s): " + out[-3000:] + err[-4000:]
    return {machines: {name: (pathlib.Path(argv[-1]), [(out / f"{i}.{rank}.txt").read_text() for rank in (0, 1)])
                       for i, (name, argv) in enumerate(lines.items())}
            for machines, (out, lines) in runs.items()}


def metrics(output_dir):
    return [json.loads(line) for line in open(output_dir / "metrics.jsonl")]


def weights(folder):
    return load_file(folder / "model.safetensors")


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.launch
def test_two_machines_train_what_one_machine_with_two_processes_trains(launches):
    """2 machines x 1 process: sft.py, reward_model.py and ppo.py (stopped after 2 iterations, resumed to 3) give
    the weights and metrics of 1 machine x 2 processes, value for value; the main process of the main machine
    alone writes (one checkpoint, one metrics line per iteration; accelerate prints once per machine). reward_model.py under DDP
    (1 machine or 2) failed before token_values ran the wrapped model's own forward."""
    one, two = launches[1], launches[2]
    assert "2 process(es)" in one["sft"][1][0] and "2 process(es)" in two["sft"][1][0]
    for name in ("sft", "rm"):
        assert_same_weights(weights(one[name][0]), weights(two[name][0]))
        assert_same_weights(weights(two[name][0] / "checkpoint" / "model"), weights(two[name][0]))
    assert "resumed at iteration 2" in two["ppo"][1][0] and "ranks in sync: True" in two["ppo"][1][0]
    assert [comparable(r) for r in metrics(two["ppo"][0])] == [comparable(r) for r in metrics(one["ppo"][0])]
    assert [r["step"] for r in metrics(two["ppo"][0])] == [1, 2, 3]
    assert_same_weights(weights(one["ppo"][0] / "policy"), weights(two["ppo"][0] / "policy"))
    assert not [p for p in two["ppo"][0].iterdir() if p.name.endswith((".tmp", ".old"))]


@pytest.mark.launch
def test_gradient_checkpointing_under_ddp_changes_no_number(launches):
    """ppo.py --gradient_checkpointing with 2 processes: the metrics and trained weights of the run without it,
    bitwise (the rollouts come from the same tokens: generation runs in eval mode, KV cache on)."""
    one = launches[1]
    assert [comparable(r) for r in metrics(one["ppo_gc"][0])] == [comparable(r) for r in metrics(one["ppo"][0])]
    assert_same_weights(weights(one["ppo_gc"][0] / "policy"), weights(one["ppo"][0] / "policy"))


@pytest.mark.launch
def test_bf16_under_ddp_trains_fp32_master_weights_within_tolerance_of_fp32(launches):
    """--bf16 with 2 processes: every stage finishes with finite losses; the trained models keep fp32 weights
    (bf16 autocast steps fp32 master weights; before, they were loaded and stepped in bf16) and are saved in
    fp32; PPO's first iteration is within BF16_RTOL / BF16_ATOL of fp32's."""
    one = launches[1]
    for name in ("sft_bf16", "rm_bf16"):
        printed = one[name][1][0]
        losses = [float(line.split("train loss ")[1].split()[0]) for line in printed.splitlines() if "train loss " in line]
        assert losses and all(torch.isfinite(torch.tensor(losses))), printed[-2000:]
        assert {t.dtype for t in weights(one[name][0]).values()} == {torch.float32}
    assert {t.dtype for t in weights(one["ppo_bf16"][0] / "policy").values()} == {torch.float32}
    bf16, fp32 = metrics(one["ppo_bf16"][0])[0], metrics(one["ppo"][0])[0]
    for k in BF16_METRICS:
        assert abs(bf16[k] - fp32[k]) <= BF16_ATOL + BF16_RTOL * abs(fp32[k]), (k, bf16[k], fp32[k])
    assert all(torch.isfinite(torch.tensor(v)) for k, v in bf16.items() if k.startswith("loss/"))


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
        AcceleratorState._reset_state()         # each stage's own mixed precision (as tests/launched_stages.py)
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
    """bench/gpu_check.sh --cpu runs a configuration's stages in one launch of tests/launched_stages.py
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


@pytest.mark.launch
def test_an_fsdp_launch_on_a_cpu_stops_instead_of_running_ddp(tmp_path):
    """accelerate starts FSDP only on an accelerator: configs/fsdp.yaml on a CPU ran plain DDP with nothing
    said (exit 0). Now every rank stops at its accelerator with an error that says so."""
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/fsdp.yaml",
                           "--num_processes", "2", "sft.py", "--hidden_size", "32", "--num_layers", "1", "--vocab_size",
                           "300", *TINY, "--output_dir", tmp_path / "sft"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "this is an FSDP launch, but accelerate started MULTI_CPU" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "sft" / "config.json").exists()


# FSDP2 (tests/fsdp_cpu.py) against DDP from the same seed: 2 ranks average gradients exactly either way (one
# sum of two values, halved) and AdamW is elementwise, so the numbers may differ only by reduction order
FSDP_RTOL, FSDP_ATOL = 1e-5, 1e-6


def loaded(folder, kind):
    """model.state_dict() of a saved folder read back by from_pretrained, which must report nothing missing,
    unexpected or mismatched."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    auto = AutoModelForCausalLM if kind == "lm" else AutoModelForSequenceClassification
    model, info = auto.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), (folder, info)
    return model.state_dict()


@pytest.fixture(scope="module")
def fsdp_launch(tiny_models, tmp_path_factory):
    """{name: (output folder, [what rank 0 printed, rank 1])}: sft.py, ppo.py and ppo.py --lora_r 4 under
    configs/fsdp.yaml through tests/fsdp_cpu.py, the command lines of the one-machine DDP launch above; and
    ppo.py --lora_r 4 --gather_for_generation false (sharded generation)."""
    out = tmp_path_factory.mktemp("fsdp")
    lines = {name: argv for name, argv in command_lines(tiny_models, out, 1).items()
             if name in ("sft", "ppo", "ppo_lora")}
    lines["ppo_lora_sharded"] = [*lines["ppo_lora"][:-2], "--gather_for_generation", "false", "--output_dir",
                                 str(out / "ppo_lora_sharded")]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/fsdp.yaml",
              "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "tests/fsdp_cpu.py"]
    proc = subprocess.run([*launch, "tests/launched_stages.py", str(out), json.dumps(list(lines.values()))], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return {name: (pathlib.Path(argv[-1]), [(out / f"{i}.{rank}.txt").read_text() for rank in (0, 1)])
            for i, (name, argv) in enumerate(lines.items())}


@pytest.mark.launch
def test_fsdp2_on_two_cpu_processes_shards_and_trains_what_ddp_trains(fsdp_launch, launches):
    """configs/fsdp.yaml through tests/fsdp_cpu.py (accelerate's real FSDP2 preparation, gloo): sft.py 2 steps,
    ppo.py 3 iterations and ppo.py --lora_r 4 1 iteration, its generation gathered and sharded. Every trained
    model is sharded (each rank holds part of its values), losses are finite, every saved folder (final and
    checkpoint) holds the keys of DDP's (a tied lm_head once: FSDP's gathered state dict held it twice) and loads
    key for key, and the weights (LoRA: the merged policy and the adapters) and PPO metrics are those of the
    one-machine DDP launch of the same command lines within FSDP_RTOL / FSDP_ATOL. PPO with LoRA failed at its
    first generate(), peft's, which enters below the root FSDP module ("FSDP requires a single root module";
    sharded: "mixed torch.Tensor and DTensor")."""
    fsdp, ddp = fsdp_launch, {**launches[1], "ppo_lora_sharded": launches[1]["ppo_lora"]}
    for stage, n_models in (("sft", 1), ("ppo", 2), ("ppo_lora", 2), ("ppo_lora_sharded", 2)):  # policy, critic
        for rank in (0, 1):
            shards = [line.split(": ")[1].split() for line in fsdp[stage][1][rank].splitlines()
                      if line.startswith(f"[fsdp_cpu] rank {rank}: ")]
            assert len(shards) == n_models, fsdp[stage][1][rank][-2000:]
            for cls, _, local, _, whole, *_ in shards:
                assert cls.startswith("FSDP") and 0 < int(local) < int(whole), shards
        assert "[fsdp_cpu]" not in ddp[stage][1][0]
    losses = [float(line.split("train loss ")[1].split()[0]) for line in fsdp["sft"][1][0].splitlines()
              if "train loss " in line]
    assert losses and all(torch.isfinite(torch.tensor(losses))), fsdp["sft"][1][0][-2000:]
    for stage, iterations in (("ppo", 3), ("ppo_lora", 1), ("ppo_lora_sharded", 1)):
        rows = [comparable(r) for r in metrics(fsdp[stage][0])], [comparable(r) for r in metrics(ddp[stage][0])]
        assert len(rows[0]) == len(rows[1]) == iterations
        assert all(torch.isfinite(torch.tensor(v)) for r in rows[0] for k, v in r.items() if k.startswith("loss/"))
        for a, b in zip(*rows):
            assert a.keys() == b.keys()
            for k, v in b.items():
                assert v == pytest.approx(a[k], rel=FSDP_RTOL, abs=FSDP_ATOL), (stage, k, a[k], v)
    for stage, folder, kind in (("sft", "", "lm"), ("sft", "checkpoint/model", "lm"), ("ppo", "policy", "lm"),
                                ("ppo", "checkpoint/policy", "lm"), ("ppo", "checkpoint/critic", "score"),
                                ("ppo_lora", "policy", "lm"), ("ppo_lora_sharded", "policy", "lm")):
        a, b = fsdp[stage][0] / folder, ddp[stage][0] / folder
        assert weights(a).keys() == weights(b).keys(), (stage, folder)
        a, b = loaded(a, kind), loaded(b, kind)
        assert a.keys() == b.keys(), (stage, folder)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=FSDP_RTOL, atol=FSDP_ATOL, msg=f"{stage}/{folder}: {k}")
    for stage, part in [(s, p) for s in ("ppo_lora", "ppo_lora_sharded") for p in ("policy", "critic")]:
        # the LoRA checkpoint: adapters (and the critic's score head)
        a, b = (load_file(run[0] / "checkpoint" / part / "adapter_model.safetensors") for run in (fsdp[stage],
                                                                                                   ddp[stage]))
        assert a.keys() == b.keys() and a, part
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=FSDP_RTOL, atol=FSDP_ATOL, msg=f"{stage}/{part}: {k}")
