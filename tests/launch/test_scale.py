"""The scale path on a CPU: every stage under DeepSpeed ZeRO-2 and ZeRO-3 with two gloo processes (one launch
for both ZeRO stages, tests/launch/zero_stages.py): whatever is saved loads with from_pretrained, key for key, and holds
the trained weights; --resume continues under each; LoRA's final policy is the plain merged model; ZeRO-3
generation gathers the partitioned policy once and samples the unsharded tokens; --grad_accum makes the AdamW steps
it means and a bf16 resume keeps the fp32 masters (test_audit5.py's runs, in the same launch)."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
LAUNCH = (sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "3",
          "--gradient_accumulation_steps", "1", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no", "tests/launch/deepspeed_cpu.py")
ONE_MACHINE = (sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/zero2.yaml",
               "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no")


def free_port():
    """A port for a launch's rendezvous: launches that run at once must not share accelerate's default one."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_machines_launch(out):
    """The two `accelerate launch` commands (machine ranks 0 and 1, one process each) of tests/launch/zero_stages.py's
    ZeRO-2 two-machine stages: DeepSpeed's standard multi-node launcher, 127.0.0.1 as the main address."""
    port = free_port()
    launch = [a if a != "3" else "2" for a in LAUNCH]          # --zero_stage 2
    i = launch.index("--num_processes")
    launch[i:i + 4] = ["--num_processes", "2", "--num_machines", "2"]
    return [[*launch[:i], "--deepspeed_multinode_launcher", "standard", "--machine_rank", str(rank),
             "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *launch[i:],
             "tests/launch/zero_stages.py", str(out), "2"] for rank in (0, 1)]


@pytest.fixture(scope="module")
def zero_launches(tmp_path_factory, gold_labels):
    """This file's DeepSpeed launches, all at once (each leaves the 2 cores idle at times, e.g. while rank 0
    alone saves and reports): tests/launch/zero_stages.py on 1 machine x 2 processes (a launch of configs/zero2.yaml,
    which leaves --grad_accum to the scripts), and five of its ZeRO-2 stages on 2 machines x 1 process.
    {"one": (output folder, stdout), "two": output folder of the two machines}."""
    one, two = tmp_path_factory.mktemp("zero"), tmp_path_factory.mktemp("zero2_machines")
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in [[*ONE_MACHINE, "--main_process_port", str(free_port()), LAUNCH[-1],
                          "tests/launch/zero_stages.py", str(one)], *two_machines_launch(two)]]
    printed = [proc.communicate(timeout=900) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, printed):
        assert proc.returncode == 0, stdout[-3000:] + stderr[-4000:]
    return {"one": (one, printed[0][0]), "two": two / "zero2"}


@pytest.fixture(scope="module")
def zero_launch(zero_launches):
    """(output folder, stdout) of tests/launch/zero_stages.py: ZeRO-2, then ZeRO-3, then test_audit5's runs (its
    subfolder "audit5"), then ZeRO-3 generation."""
    return zero_launches["one"]


@pytest.fixture(scope="module")
def zero_runs(zero_launch):
    """{ZeRO stage: (its output folder, what its stages printed)}."""
    out, stdout = zero_launch
    two, three = stdout.split("ZERO STAGE 2", 1)[1].split("ZERO STAGE 3", 1)
    return {"2": (out / "zero2", two), "3": (out / "zero3", three.split("AUDIT5", 1)[0])}


def loads_key_for_key(path, auto_class):
    """from_pretrained of a saved folder: no missing, unexpected or resized weights."""
    import transformers
    model, info = getattr(transformers, auto_class).from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], (path, info)
    return model


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.launch
@pytest.mark.parametrize("stage", ["2", "3"])
def test_sft_and_rm_save_whole_weights_that_load_key_for_key_and_resume(zero_runs, stage):
    out, stdout = zero_runs[stage]
    ran_under = [line.split(" under ")[-1] for line in stdout.splitlines() if line.startswith("STAGE ")]
    assert ran_under == [f"ZeRO-{stage}"] * 10                        # every stage's engines (variants too)
    assert "resumed at step 2" in stdout and "2 process(es)" in stdout
    for part, auto_class in (("sft", "AutoModelForCausalLM"), ("rm", "AutoModelForSequenceClassification")):
        final, last = (loads_key_for_key(f, auto_class) for f in (out / part, out / part / "checkpoint" / "model"))
        # the final save (final_model) and the last checkpoint (whole_state_dicts) gather the same step's weights
        assert_same(final.state_dict(), last.state_dict())
    sft, rm = load_file(out / "sft" / "model.safetensors"), load_file(out / "rm" / "model.safetensors")
    assert not torch.equal(sft["model.embed_tokens.weight"], rm["model.embed_tokens.weight"])     # the RM trained on


@pytest.mark.launch
@pytest.mark.parametrize("stage", ["2", "3"])
def test_ppo_policy_and_critic_engines_save_gathered_trained_weights(zero_runs, stage):
    out, stdout = zero_runs[stage]
    ppo = out / "ppo_full"
    assert len(open(ppo / "metrics.jsonl").readlines()) == 1
    policy = loads_key_for_key(ppo / "policy", "AutoModelForCausalLM").state_dict()
    assert_same(policy, loads_key_for_key(ppo / "checkpoint" / "policy", "AutoModelForCausalLM").state_dict())
    loads_key_for_key(ppo / "checkpoint" / "critic", "AutoModelForSequenceClassification")
    sft = load_file(out / "sft" / "model.safetensors")
    assert not torch.equal(policy["model.embed_tokens.weight"], sft["model.embed_tokens.weight"])     # trained
    if stage == "3":    # the report's picture, its values drawn by the critic gathered whole from its shards
        drawn = json.load(open(ppo / "macro_actions.json"))
        assert drawn["critic"] == "the run's critic" and all(v == v for v in drawn["values"])


def assert_merged(final, base, adapter_dir):
    """`final` (a saved model folder) = the `base` weights + alpha / r * B A of the adapters in `adapter_dir`,
    under the plain model's key names."""
    loads_key_for_key(final, "AutoModelForCausalLM")
    merged, base = load_file(final / "model.safetensors"), load_file(base / "model.safetensors")
    adapters = load_file(adapter_dir / "adapter_model.safetensors")
    config = json.load(open(adapter_dir / "adapter_config.json"))
    scale = config["lora_alpha"] / config["r"]
    assert merged.keys() == base.keys()
    adapted = set()
    for key in adapters:
        if key.endswith("lora_A.weight"):
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
            B = adapters[key.replace("lora_A", "lora_B")]
            assert B.abs().sum() > 0                                       # trained (B starts at zero)
            assert torch.allclose(merged[name], base[name] + scale * B @ adapters[key], atol=1e-6), name
            adapted.add(name)
    assert adapted and all(torch.equal(merged[k], base[k]) for k in merged.keys() - adapted)


@pytest.mark.launch
@pytest.mark.parametrize("stage", ["2", "3"])
def test_lora_sft_and_ppo_save_the_merged_plain_model_and_ppo_resumes(zero_runs, stage):
    """The final model = the SFT weights + alpha / r * B A of the last checkpoint's adapters; PPO's report
    scored it."""
    out, stdout = zero_runs[stage]
    assert_merged(out / "sft_lora", out / "sft", out / "sft_lora" / "checkpoint" / "model")
    ppo = out / "ppo"
    assert "resumed at iteration 1" in stdout
    assert [json.loads(line)["step"] for line in open(ppo / "metrics.jsonl")] == [1, 2]
    assert os.path.exists(ppo / "summary.md")
    assert_merged(ppo / "policy", out / "sft", ppo / "checkpoint" / "policy")


@pytest.mark.launch
def test_zero2_and_zero3_train_the_same_weights(zero_runs):
    """Parameters whole (ZeRO-2) or partitioned (ZeRO-3): the same seed gives the same trained models."""
    for folder in ("sft", "sft_lora", "rm", "ppo_full/policy", "ppo/policy"):
        two, three = (load_file(zero_runs[s][0] / folder / "model.safetensors") for s in ("2", "3"))
        assert two.keys() == three.keys()
        for k in two:
            assert torch.allclose(two[k], three[k], atol=1e-5), (folder, k)


@pytest.mark.launch
def test_zero3_generation_gathers_the_weights_once_and_samples_the_unsharded_tokens(zero_launch):
    """Under a 2-process ZeRO-3 launch: generation inside harness.generation_model gives the tokens of an
    unsharded copy for the same seed, needs no synced_gpus, and its number of all-gathers does not grow with
    the number of generated tokens; sharded generation (the fallback) gives the same tokens, gathering
    again for every token (tests/launch/zero3_generation.py)."""
    printed = zero_launch[1].split("ZERO3 GENERATION", 1)[1]
    ranks = json.loads(next(line for line in printed.splitlines() if line.startswith("RESULT "))[7:])
    assert len(ranks) == 2
    for r in ranks:
        assert r["gathered_equals_unsharded"] and r["sharded_equals_unsharded"], r
        assert r["synced_gpus"] == [False, True]
        g = r["all_gathers"]
        assert g["gathered_12"] == g["gathered_4"] > 0, g               # once per generate(), whatever the length
        assert g["sharded_12"] > g["sharded_4"] > 0, g                  # sharded: again for every token


@pytest.mark.launch
@pytest.mark.parametrize("stage", ["2", "3"])
def test_a_zero_checkpoint_keeps_each_ranks_adamw_state_and_resumes_exactly(zero_runs, stage):
    """ZeRO partitions the AdamW moments: each rank saves its own part in the checkpoint, and --resume gives
    it back, so PPO's 1 + 1 iterations end with the weights and numbers of 2 at once (AdamW started afresh
    at the resume would take another second step). No "holds no ... state" warning."""
    from stages import comparable
    out, stdout = zero_runs[stage]
    assert "holds no" not in stdout and "resumed at iteration 1" in stdout
    for run, names in (("sft", ["optimizer"]), ("ppo", ["critic_opt", "policy_opt"])):
        assert sorted(os.listdir(out / run / "checkpoint" / "optimizer_shards")) == [
            f"{name}.rank{rank}.pt" for name in names for rank in (0, 1)]
    resumed, whole = out / "ppo", out / "ppo_whole"
    assert_same(load_file(resumed / "policy" / "model.safetensors"), load_file(whole / "policy" / "model.safetensors"))
    rows = [[comparable(json.loads(line)) for line in open(run / "metrics.jsonl")] for run in (resumed, whole)]
    assert rows[0] == rows[1] and len(rows[0]) == 2


@pytest.fixture(scope="module")
def zero2_two_machines(zero_launches):
    """The output folder of five of the ZeRO-2 stages of tests/launch/zero_stages.py on 2 machines x 1 process, one
    `accelerate launch` per machine, both at once."""
    return zero_launches["two"]


@pytest.mark.launch
def test_zero2_on_two_machines_trains_what_one_machine_with_two_processes_trains(zero2_two_machines, zero_runs):
    """2 machines x 1 process under ZeRO-2 (sft.py and its --resume, reward_model.py, ppo.py --lora_r 4 and its
    --resume): the saved weights (final and checkpoint) and PPO's metrics of 1 machine x 2 processes, one
    metrics line per iteration. (Full-weight PPO on two machines: the DDP test in test_gpu_paths_on_cpu.py.)"""
    from stages import comparable
    one, two = zero_runs["2"][0], zero2_two_machines
    for file in ("sft/model.safetensors", "sft/checkpoint/model/model.safetensors", "rm/model.safetensors",
                 "ppo/policy/model.safetensors", "ppo/checkpoint/policy/adapter_model.safetensors",
                 "ppo/checkpoint/critic/adapter_model.safetensors"):
        assert_same(*(load_file(out / file) for out in (one, two)))
    rows = [[comparable(json.loads(line)) for line in open(base / "ppo" / "metrics.jsonl")] for base in (one, two)]
    assert rows[0] == rows[1] and [r["step"] for r in rows[1]] == [1, 2]
    assert not [p for p in (two / "ppo").iterdir() if p.name.endswith((".tmp", ".old"))]


@pytest.mark.launch
@pytest.mark.parametrize("stage", ["2", "3"])
def test_gradient_checkpointing_under_zero_changes_no_number(zero_runs, stage):
    """ppo.py --gradient_checkpointing under ZeRO-2 / ZeRO-3: the metrics and trained policy of the run without it."""
    from stages import comparable
    out = zero_runs[stage][0]
    plain, checkpointed = ([comparable(json.loads(line)) for line in open(out / run / "metrics.jsonl")]
                           for run in ("ppo_full", "ppo_full_gc"))
    assert plain == checkpointed
    assert_same(load_file(out / "ppo_full" / "policy" / "model.safetensors"),
                load_file(out / "ppo_full_gc" / "policy" / "model.safetensors"))


@pytest.mark.launch
@pytest.mark.parametrize("stage", ["2", "3"])
def test_bf16_under_zero_runs_within_tolerance_of_fp32(zero_runs, stage):
    """ppo.py --bf16 under ZeRO-2 (full weights) and ZeRO-3 (LoRA: its adapters and the critic's score head
    once failed ZeRO-3's partitioning, an fp32 and a bf16 trained tensor in one engine): finite losses, the
    final policy loads key for key, the first iteration within BF16_RTOL / BF16_ATOL of fp32's."""
    from test_gpu_paths_on_cpu_runs import BF16_ATOL, BF16_METRICS, BF16_RTOL
    out = zero_runs[stage][0]
    fp32 = "ppo" if stage == "3" else "ppo_full"                          # LoRA under ZeRO-3, as ppo_bf16
    bf16, fp32 = (json.loads(open(out / run / "metrics.jsonl").readline()) for run in ("ppo_bf16", fp32))
    assert all(torch.isfinite(torch.tensor(v)) for k, v in bf16.items() if k.startswith("loss/"))
    for k in BF16_METRICS:
        assert abs(bf16[k] - fp32[k]) <= BF16_ATOL + BF16_RTOL * abs(fp32[k]), (k, bf16[k], fp32[k])
    loads_key_for_key(out / "ppo_bf16" / "policy", "AutoModelForCausalLM")


def adam_steps(shard):
    """The AdamW step counts held in a saved ZeRO optimizer shard (one per parameter group)."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "step":
                    found.append(int(v))
                else:
                    walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(shard)
    return found


@pytest.fixture(scope="module")
def audit5_runs(zero_launch):
    """The output folder of test_audit5.zero_main, run last in tests/launch/zero_stages.py's launch (of
    configs/zero2.yaml): --grad_accum 3 under ZeRO-2 and ZeRO-3 (zero2/, zero3/), ppo.py --bf16 1 + 1 iterations
    and 2 at once."""
    return zero_launch[0] / "audit5"


@pytest.mark.launch
@pytest.mark.parametrize("zero", ["2", "3"])
def test_grad_accum_3_makes_the_adamw_steps_it_means_under_zero(audit5_runs, zero):
    """sft.py / reward_model.py: 1 step of 3 micro-steps = 1 AdamW step; ppo.py: 4 minibatches at --grad_accum 3
    = a group of 3 and the remainder = 2 AdamW steps per model (the config's 1 used to give 3 and 4)."""
    base = audit5_runs / f"zero{zero}"
    expected = {("sft", "optimizer"): 1, ("rm", "optimizer"): 1, ("ppo", "policy_opt"): 2, ("ppo", "critic_opt"): 2}
    for (run, name), steps in expected.items():
        for rank in (0, 1):
            shard = torch.load(base / run / "checkpoint" / "optimizer_shards" / f"{name}.rank{rank}.pt",
                               weights_only=False)
            counts = adam_steps(shard)
            assert counts and set(counts) == {steps}, (run, name, rank, counts)


@pytest.mark.launch
@pytest.mark.parametrize("zero", ["2", "3"])
def test_ppo_logs_each_models_gradient_norm_under_zero_as_elsewhere(audit5_runs, zero):
    """The norm before clipping, read from the DeepSpeed engine that clipped (harness.clip_gradients), logged under
    the names a one-process run logs (test_ppo_logs_the_gradient_norms_it_clips_with)."""
    row = json.loads(open(audit5_runs / f"zero{zero}" / "ppo" / "metrics.jsonl").readline())
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("policy/grad_norm", "value/grad_norm")), row


@pytest.mark.launch
def test_a_zero2_bf16_resume_keeps_the_fp32_master_weights_of_an_uninterrupted_run(audit5_runs):
    """ppo.py --bf16 at lr 1e-5, 1 + 1 iterations: the fp32 masters (and AdamW moments) of the policy and the critic
    equal those of 2 at once; the resume loads the masters saved in the shards instead of rebuilding them from
    the bf16 weights (which lost the updates below bf16's resolution: most of them at this lr)."""
    for name in ("policy_opt", "critic_opt"):
        for rank in (0, 1):
            resumed, whole = (torch.load(audit5_runs / run / "checkpoint" / "optimizer_shards" /
                                         f"{name}.rank{rank}.pt", weights_only=False)
                              for run in ("bf16_resumed", "bf16_whole"))
            masters = list(zip(resumed["single_partition_of_fp32_groups"], whole["single_partition_of_fp32_groups"]))
            assert masters and all(torch.equal(a, b) for a, b in masters), (name, rank)
