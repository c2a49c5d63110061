"""The launch tests of test_audit5.py: ppo.py, reward_model.py and sft.py run in processes of their own. Its DeepSpeed
and FSDP2 runs are parts of the launches of test_scale.py and test_gpu_paths_on_cpu_runs.py, whose files hold their
tests."""
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
