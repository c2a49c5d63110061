"""The launch tests of test_audit5.py: ppo.py, reward_model.py and sft.py run in processes of their own."""
import json
from stages import ppo_config
import math
import subprocess
import sys

import pytest
import torch

from test_audit5 import ROOT


@pytest.mark.launch
def test_a_number_out_of_range_on_the_command_line_stops_ppo_before_anything_runs(tiny_models, tmp_path):
    proc = subprocess.run([sys.executable, "ppo.py", "--eval_every", "0", "--output_dir", str(tmp_path / "out"),
                           "--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--steps", "1"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "error: --eval_every 0: outside its range [1, inf)" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.launch
def test_ppo_logs_the_gradient_norms_it_clips_with(tiny_models, tmp_path):
    """--max_grad_norm 1e-3 on the tiny models: each step's norm before clipping is logged, well above the bound."""
    from accelerate.state import AcceleratorState
    import ppo
    AcceleratorState._reset_state()
    ppo.main(*ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                         max_grad_norm=1e-3, steps=1, rollout_batch_size=4, mini_batch_size=2, max_response_len=8,
                         n_eval_prompts=4, plot=False, task="count"))
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["policy/grad_norm"] > 1e-3 and row["value/grad_norm"] > 1e-3, row


@pytest.mark.launch
def test_bf16_kl_is_exactly_0_at_the_first_iteration(tiny_models, tmp_path):
    """Before the first update the policy is the reference: the same weights, the same precision, KL 0. (It was
    -0.0028: the reference ran bf16 weights, the policy fp32 weights under bf16 autocast.)"""
    from accelerate.state import AcceleratorState
    import ppo
    AcceleratorState._reset_state()         # this run's own mixed precision (as tests/launch/launched_stages.py)
    try:
        ppo.main(*ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                             bf16=True, steps=1, rollout_batch_size=4, mini_batch_size=4, max_response_len=8,
                             n_eval_prompts=4, plot=False, task="count"))
    finally:
        AcceleratorState._reset_state()     # the next test's accelerator starts without bf16
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["kl"] == 0.0


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
def zero_launch(tmp_path_factory):
    from test_scale import free_port
    out = tmp_path_factory.mktemp("zero_audit")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/zero2.yaml",
           "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), "tests/launch/deepspeed_cpu.py", "tests/spec/test_audit5.py", "zero", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return out


@pytest.mark.launch
@pytest.mark.parametrize("zero", ["2", "3"])
def test_grad_accum_3_makes_the_adamw_steps_it_means_under_zero(zero_launch, zero):
    """sft.py / reward_model.py: 1 step of 3 micro-steps = 1 AdamW step; ppo.py: 4 minibatches at --grad_accum 3
    = a group of 3 and the remainder = 2 AdamW steps per model (the config's 1 used to give 3 and 4)."""
    base = zero_launch / f"zero{zero}"
    expected = {("sft", "optimizer"): 1, ("rm", "optimizer"): 1, ("ppo", "policy_opt"): 2, ("ppo", "critic_opt"): 2}
    for (run, name), steps in expected.items():
        for rank in (0, 1):
            shard = torch.load(base / run / "checkpoint" / "optimizer_shards" / f"{name}.rank{rank}.pt",
                               weights_only=False)
            counts = adam_steps(shard)
            assert counts and set(counts) == {steps}, (run, name, rank, counts)


@pytest.mark.launch
@pytest.mark.parametrize("zero", ["2", "3"])
def test_ppo_logs_each_models_gradient_norm_under_zero_as_elsewhere(zero_launch, zero):
    """The norm before clipping, read from the DeepSpeed engine that clipped (harness.clip_gradients), logged under
    the names a one-process run logs (test_ppo_logs_the_gradient_norms_it_clips_with)."""
    row = json.loads(open(zero_launch / f"zero{zero}" / "ppo" / "metrics.jsonl").readline())
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("policy/grad_norm", "value/grad_norm")), row


@pytest.mark.launch
def test_a_zero2_bf16_resume_keeps_the_fp32_master_weights_of_an_uninterrupted_run(zero_launch):
    """ppo.py --bf16 at lr 1e-5, 1 + 1 iterations: the fp32 masters (and AdamW moments) of the policy and the critic
    equal those of 2 at once; the resume loads the masters saved in the shards instead of rebuilding them from
    the bf16 weights (which lost the updates below bf16's resolution: most of them at this lr)."""
    for name in ("policy_opt", "critic_opt"):
        for rank in (0, 1):
            resumed, whole = (torch.load(zero_launch / run / "checkpoint" / "optimizer_shards" / f"{name}.rank{rank}.pt",
                                         weights_only=False) for run in ("bf16_resumed", "bf16_whole"))
            masters = list(zip(resumed["single_partition_of_fp32_groups"], whole["single_partition_of_fp32_groups"]))
            assert masters and all(torch.equal(a, b) for a, b in masters), (name, rank)


@pytest.mark.launch
def test_fsdp2_gets_the_launchs_reshard_setting_back_after_generation_and_clips_the_whole_gradient(tmp_path):
    from test_scale import free_port
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/fsdp.yaml",
           "--fsdp_reshard_after_forward", "false", "--num_processes", "2", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()), "tests/launch/fsdp_cpu.py",
           "tests/spec/test_audit5.py", "fsdp", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.load(open(tmp_path / "fsdp.json"))
    assert result["launch"] is False and result["before"] and not any(result["before"])
    assert result["after"] == result["before"]
    # --max_grad_norm under FSDP2: the norm of the whole gradient (every rank's shards), clipped to the bound
    reported, whole = result["norm"]
    assert reported == pytest.approx(whole, rel=1e-5) and whole > 0
    reported, after, bound = result["clipped"]
    assert reported == pytest.approx(whole, rel=1e-5) and after == pytest.approx(bound, rel=1e-4)
