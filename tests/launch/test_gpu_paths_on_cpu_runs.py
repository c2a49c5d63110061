"""The launch tests of test_gpu_paths_on_cpu.py: ppo.py, reward_model.py and sft.py run in processes of their own."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from stages import LAUNCH, comparable, free_port
from test_gpu_paths_on_cpu import TINY, assert_same_weights, metrics, ppo_flags, weights

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent

# bf16 against fp32 on the first iteration (the same seed): the rollouts are sampled from bf16 logits, so
# a few tokens may differ; every number here stays within this
BF16_RTOL, BF16_ATOL = 0.05, 0.02
BF16_METRICS = ("reward/rm", "kl", "entropy", "response/len", "loss/value", "value/explained_variance")


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
def launches(tiny_models, tmp_path_factory, gold_labels):
    """{1 or 2 machines: {name: (output folder, [what rank 0 printed, rank 1])}}; both launches run at once."""
    procs, runs = {}, {}
    port = free_port()
    for machines in (1, 2):
        out = tmp_path_factory.mktemp(f"machines{machines}")
        runs[machines] = (out, command_lines(tiny_models, out, machines))
        script = ["tests/launch/launched_stages.py", str(out), json.dumps(list(runs[machines][1].values()))]
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


@pytest.mark.launch
def test_an_fsdp_launch_on_a_cpu_stops_instead_of_running_ddp(tmp_path):
    """accelerate starts FSDP only on an accelerator: configs/fsdp.yaml on a CPU ran plain DDP with nothing
    said (exit 0). Now every rank stops at its accelerator with an error that says so."""
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/fsdp.yaml",
                           "--num_processes", "2", "--main_process_port", str(free_port()), "sft.py", "--hidden_size",
                           "32", "--num_layers", "1", "--vocab_size", "300", *TINY, "--output_dir", tmp_path / "sft"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "this is an FSDP launch, but accelerate started MULTI_CPU" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "sft" / "config.json").exists()


# FSDP2 (tests/launch/fsdp_cpu.py) against DDP from the same seed: 2 ranks average gradients exactly either way (one
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
    configs/fsdp.yaml through tests/launch/fsdp_cpu.py, the command lines of the one-machine DDP launch above (the
    LoRA run with its report's pictures); and ppo.py --lora_r 4 --gather_for_generation false (sharded generation);
    then "reshard": the folder of test_audit5.fsdp_main's fsdp.json, run last as a launch with
    --fsdp_reshard_after_forward false runs it."""
    out = tmp_path_factory.mktemp("fsdp")
    lines = {name: argv for name, argv in command_lines(tiny_models, out, 1).items()
             if name in ("sft", "ppo", "ppo_lora")}
    lines["ppo_lora_sharded"] = [*lines["ppo_lora"][:-2], "--gather_for_generation", "false", "--output_dir",
                                 str(out / "ppo_lora_sharded")]
    lines["ppo_lora"] = [*lines["ppo_lora"][:-2], "--plot", "true", *lines["ppo_lora"][-2:]]    # and its pictures
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/fsdp.yaml",
              "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              str(free_port()), "tests/launch/fsdp_cpu.py"]
    (out / "reshard").mkdir()
    reshard = {"call": "test_audit5.fsdp_main", "args": [str(out / "reshard")],
               "env": {"FSDP_RESHARD_AFTER_FORWARD": "false"}}
    stages = json.dumps([*lines.values(), reshard])
    proc = subprocess.run([*launch, "tests/launch/launched_stages.py", str(out), stages], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return {"reshard": out / "reshard", **{name: (pathlib.Path(argv[-1]), [(out / f"{i}.{rank}.txt").read_text()
                                                                         for rank in (0, 1)])
                                         for i, (name, argv) in enumerate(lines.items())}}


@pytest.mark.launch
def test_fsdp2_on_two_cpu_processes_shards_and_trains_what_ddp_trains(fsdp_launch, launches):
    """configs/fsdp.yaml through tests/launch/fsdp_cpu.py (accelerate's real FSDP2 preparation, gloo): sft.py 2 steps,
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
    drawn = json.load(open(fsdp["ppo_lora"][0] / "macro_actions.json"))    # the critic gathered whole from its shards
    assert drawn["critic"] == "the run's critic" and all(v == v for v in drawn["values"])
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


@pytest.mark.launch
def test_fsdp2_gets_the_launchs_reshard_setting_back_after_generation_and_clips_the_whole_gradient(fsdp_launch):
    """test_audit5.fsdp_main, last in the FSDP2 launch, as a launch with --fsdp_reshard_after_forward false runs it."""
    result = json.load(open(fsdp_launch["reshard"] / "fsdp.json"))
    assert result["launch"] is False and result["before"] and not any(result["before"])
    assert result["after"] == result["before"]
    # --max_grad_norm under FSDP2: the norm of the whole gradient (every rank's shards), clipped to the bound
    reported, whole = result["norm"]
    assert reported == pytest.approx(whole, rel=1e-5) and whole > 0
    reported, after, bound = result["clipped"]
    assert reported == pytest.approx(whole, rel=1e-5) and after == pytest.approx(bound, rel=1e-4)
