"""The launch tests of test_pipeline.py: reward_model.py and sft.py run in subprocesses or as whole stages."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from stages import run_stage
from test_pipeline import ROOT, TINY


def weights(path):
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    """An uninterrupted SFT run (from the command line, in this process), and one stopped with SIGINT (its
    own process) at its first checkpoint then resumed. Only the stopped run saves checkpoints on the way
    (every 5 steps): saving does not move the weights, and 30 saves cost more than the 150 steps."""
    tmp = tmp_path_factory.mktemp("pipeline")
    steps = ["--max_steps", "150", "--eval_every", "50"]
    whole = str(tmp / "whole")
    out = run_stage("sft.py", *TINY, *steps, "--save_every", "1000", "--output_dir", whole)
    split = str(tmp / "split")
    proc = subprocess.Popen([sys.executable, "sft.py", *TINY, *steps, "--save_every", "5", "--output_dir", split],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(split, "checkpoint", "trainer_state.pt")) and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    interrupted, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"the run was not interrupted (rc {proc.returncode}): {err[-2000:]}"
    saved = os.path.getmtime(os.path.join(split, "checkpoint", "trainer_state.pt"))
    with pytest.raises(SystemExit, match="checkpoint of an interrupted run. Continue it with --resume"):
        run_stage("sft.py", *TINY, *steps, "--output_dir", split)      # a fresh start would replace it
    assert os.path.getmtime(os.path.join(split, "checkpoint", "trainer_state.pt")) == saved
    resumed = run_stage("sft.py", *TINY, *steps, "--save_every", "1000", "--output_dir", split, "--resume")
    return whole, split, out, interrupted, resumed


@pytest.mark.launch
def test_sft_runs_end_to_end_and_reports_held_out_loss(sft_runs):
    whole, _, out, _, _ = sft_runs
    assert "held-out loss" in out and "sample:" in out
    assert os.path.exists(os.path.join(whole, "config.json")) and os.path.exists(os.path.join(whole, "tokenizer.json"))


@pytest.mark.launch
def test_ctrl_c_then_resume_gives_the_uninterrupted_weights(sft_runs):
    whole, split, _, interrupted, resumed = sft_runs
    assert "checkpoint saved" in interrupted and "resumed at step" in resumed
    assert "differ from the checkpoint" not in resumed           # --save_every may change: nothing said of it
    a, b = weights(whole), weights(split)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.launch
def test_reward_model_trains_from_the_sft_checkpoint(sft_runs, tmp_path):
    whole = sft_runs[0]
    out = run_stage("reward_model.py", "--sft_path", whole, "--output_dir", str(tmp_path / "rm"), "--batch_size", "4",
              "--max_prompt_len", "24", "--max_response_len", "12", "--max_steps", "6", "--eval_every", "3",
              "--n_eval", "16", "--n_gold_prompts", "8")
    assert "held-out pairwise accuracy" in out and "RM-gold agreement" in out
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert model.config.num_labels == 1
