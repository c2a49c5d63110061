"""The launch tests of test_audit5.py: ppo.py, reward_model.py and sft.py run in processes of their own."""
import json
from stages import ppo_config
import subprocess
import sys

import pytest

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
