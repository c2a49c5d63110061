"""The launch tests of test_choices.py (tests/spec): ppo.py run in subprocesses or as whole stages."""
import subprocess
import sys

import pytest

import harness


@pytest.mark.launch
def test_a_bad_choice_on_the_command_line_exits_2_before_anything_runs(tiny_models, tmp_path):
    proc = subprocess.run([sys.executable, "ppo.py", "--kl_estimator", "k2", "--output_dir", str(tmp_path / "out"),
                           "--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--steps", "1",
                           "--rollout_batch_size", "4", "--mini_batch_size", "2", "--max_response_len", "8",
                           "--n_eval_prompts", "4"], capture_output=True, text=True,
                          cwd=harness.os.path.dirname(harness.__file__))
    assert proc.returncode == 2 and "--kl_estimator" in proc.stderr and "'k1', 'k3'" in proc.stderr
    assert not (tmp_path / "out").exists()
