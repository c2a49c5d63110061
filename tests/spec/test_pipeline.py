"""sft.py -> reward_model.py as a user runs them: real subprocesses on the embedded task, small sizes.
Ctrl-C saves a checkpoint and --resume ends with the same weights as an uninterrupted run."""
import pathlib
import subprocess
import sys

import pytest

from stages import run_stage

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
TINY = ["--hidden_size", "32", "--num_layers", "1", "--vocab_size", "300", "--batch_size", "4",
        "--max_prompt_len", "24", "--max_response_len", "12", "--n_eval", "16", "--seed", "3"]


def run(script, *args, timeout=240):
    proc = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_missing_sft_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no SFT model at .*python sft.py"):
        run_stage("reward_model.py", "--sft_path", tmp_path / "nowhere")


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint to resume"):
        run_stage("sft.py", *TINY, "--output_dir", tmp_path / "x", "--resume")
