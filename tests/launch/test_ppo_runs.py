"""The launch tests of test_ppo.py: ppo.py, reward_model.py and sft.py run in subprocesses or as whole stages."""
import json
import os
import subprocess
import sys

import pytest
import torch

import ppo
from stages import ppo_config
from stages import comparable, run_stage


@pytest.mark.parametrize("flags", [
    {"n": 1}, {"n": 0, "plot": True}, {"termination": "randomized"}, {"termination": "ppl"}, {"termination": "parsing"},
    {"termination": "entropy", "entropy_threshold": 1.0}, {"sigma": "unit"}, {"sigma": "position"},
    {"sigma": "first", "n": 3, "plot": True}, {"reward_agg": "mean"}, {"reward_agg": "released"}, {"ratio": "macro"},
    {"critic_path": "SFT", "plot": True}, {"kl_estimator": "k3", "kl_target": 1e-6, "kl_horizon": 8, "plot": True},
    {"top_k": 5, "top_p": 0.9, "missing_eos_penalty": -1.0, "whiten_advantages": False, "ppo_epochs": 2, "plot": True},
    {"lora_r": 4, "bf16": True, "plot": True}, {"advantage": "group", "kl_penalty": "loss", "plot": True},
])
@pytest.mark.launch
def test_every_flag_runs_one_iteration(tiny_models, tmp_path, flags):
    """One iteration and the final report under each flag. The pictures (`plot`) under the flags the macro-action
    picture reads itself (n, sigma, the critic, the KL estimator and the beta the controller reached, the missing-EOS
    penalty; a --bf16 LoRA critic; no critic); the terminations it draws all of, whatever the run's."""
    flags = {k: str(tiny_models / "sft") if v == "SFT" else v for k, v in flags.items()}
    args = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                       steps=1, rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=8,
                       n_eval_prompts=4, **flags)
    from accelerate.state import AcceleratorState, GradientState
    for state in (AcceleratorState, GradientState):     # --bf16: accelerate's process-wide state afresh (and after)
        state._reset_state()
    try:
        ppo.main(*args)
    finally:
        for state in (AcceleratorState, GradientState):
            state._reset_state()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 1 and all(v == v for v in rows[0].values())           # no NaN
    assert os.path.exists(tmp_path / "policy" / "model.safetensors")
    pictures = [(tmp_path / png).exists() for png in ("learning_curve.png", "macro_actions.png")]
    assert pictures == [flags.get("plot", False)] * 2
    if flags.get("plot"):       # drawn with the run's settings and its critic as it ends (no checkpoint at 1 of 40)
        drawn = json.load(open(tmp_path / "macro_actions.json"))
        critic = "the run's critic" if args.advantage == "gae" else "the RM (no critic trained)"
        assert not (tmp_path / "checkpoint").exists() and drawn["critic"] == critic
        assert (drawn["n"], drawn["sigma_kind"]) == (5 if args.n == 1 else args.n, args.sigma)   # n=0: the whole reply
        beta = ppo.adaptive_beta(args.beta, rows[0]["kl"], args.kl_target, 4, args.kl_horizon)    # after iteration 1
        assert drawn["beta"] == pytest.approx(beta, rel=1e-3) and all(v == v for v in drawn["values"])
    column = f"n={args.n}, fixed" if args.termination == "fixed" else args.termination    # --n: fixed n-grams only
    assert f"| SFT | policy ({column}) |" in open(tmp_path / "summary.md").read()
    K = args.group_size if args.advantage == "group" else 1
    assert rows[0]["prompts/truncated"] <= 4 // K       # prompts drawn, each counted once, not its K samples
    if flags.get("n") == 1:
        assert rows[0]["macro/mean_len"] == 1.0
        assert rows[0]["adv/l2_macro"] == pytest.approx(rows[0]["adv/l2"], rel=1e-4)


@pytest.mark.launch
def test_a_fresh_start_over_a_finished_run_removes_its_checkpoint(tiny_models, tmp_path, capsys):
    """A run started afresh (no --resume) in a finished run's folder replaces that run's model at its end; the
    finished run's checkpoint goes at its start: a later --resume would otherwise continue the earlier run (its
    weights, optimizers, generator) as this one's and splice it into this run's metrics, and `evaluate.py explain`
    would draw this run's policy with the earlier run's settings and critic."""
    common = dict(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                  rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=8, n_eval_prompts=4)
    ppo.main(*ppo_config(**common, steps=2, save_every=1, n=3))
    assert (tmp_path / "checkpoint" / "trainer_state.pt").exists() and (tmp_path / "policy").exists()
    capsys.readouterr()
    ppo.main(*ppo_config(**common, steps=1))                  # no checkpoint of its own: 1 is no multiple of 40
    assert "the finished run's checkpoint there removed" in capsys.readouterr().out
    assert not (tmp_path / "checkpoint").exists() and len(open(tmp_path / "metrics.jsonl").readlines()) == 1
    with pytest.raises(SystemExit, match="checkpoint to resume"):
        ppo.main(*ppo_config(**common, steps=3, resume=True))
    capsys.readouterr()
    ppo.main(*ppo_config(**{**common, "output_dir": str(tmp_path / "new")}, steps=1))   # nothing there: nothing said
    assert "checkpoint there removed" not in capsys.readouterr().out


@pytest.mark.launch
def test_a_resume_with_other_flags_names_each_one_that_changed(tiny_models, tmp_path, capsys):
    """--resume goes on with the flags it is given; those that differ from the checkpoint's run (beyond how long it
    runs, how often it saves and reports) are named in a warning: with them the numbers are no uninterrupted run's."""
    common = dict(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                  rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=8, n_eval_prompts=4)
    ppo.main(*ppo_config(**common, steps=1, save_every=1))
    capsys.readouterr()
    ppo.main(*ppo_config(**common, steps=2, save_every=2, resume=True, eval_every=7))     # the same run, longer
    assert "differ from the checkpoint" not in capsys.readouterr().out
    ppo.main(*ppo_config(**common, steps=3, resume=True, policy_lr=1e-3, sigma="unit"))
    out = capsys.readouterr().out
    assert "resuming with flags that differ from the checkpoint's run: --sigma 'equal' -> 'unit', --policy_lr " \
           "0.0003 -> 0.001;" in out and "resumed at iteration 2" in out


@pytest.mark.launch
def test_a_lora_runs_picture_draws_its_critic_and_leaves_the_reports_scores_alone(tiny_models, tmp_path):
    """Under LoRA the critic reads the frozen RM's own base weights (harness.twin): the report's picture takes the
    critic as the run ends without merging its adapters into them, so the table's RM scores are those of the same
    run without pictures (a large critic step makes any merge show in them)."""
    def table(out, plot):
        ppo.main(*ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(out),
                             steps=1, rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=8,
                             n_eval_prompts=4, lora_r=4, critic_lr=0.1, warmup_steps=0, plot=plot))
        return open(out / "summary.md").read().split("\nmetrics:")[0]
    assert table(tmp_path / "drawn", True) == table(tmp_path / "plain", False)
    assert json.load(open(tmp_path / "drawn" / "macro_actions.json"))["critic"] == "the run's critic"


@pytest.mark.launch
@pytest.mark.parametrize("flags", [{"termination": "randomized"}, {"critic_warmup": 1}, {"lora_r": 4}])
def test_one_minibatch_reuses_the_scoring_forwards_with_the_numbers_of_separate_ones(tiny_models, tmp_path,
                                                                                  monkeypatch, flags):
    """One epoch over one minibatch: the update takes the policy's and critic's rows of step 2's forwards.
    The metrics of two iterations equal those of the same run with separate update forwards (the
    minibatch order, drawn after the randomized n-grams, gathers the rows), and the only ratio of each
    iteration is exactly 1 (old = detached new). Under the critic warm-up the policy's graph is dropped."""
    def metrics(out):
        args = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(out),
                           steps=2, rollout_batch_size=4, mini_batch_size=4, max_prompt_len=16, max_response_len=8,
                           n_eval_prompts=4, **flags)
        ppo.main(*args)
        return [comparable(json.loads(line)) for line in open(out / "metrics.jsonl")]

    fused_update, taken = ppo.reusable_forwards, []
    monkeypatch.setattr(ppo, "reusable_forwards", lambda *a: taken.append(fused_update(*a)) or taken[-1])
    fused = metrics(tmp_path / "fused")
    assert taken == [True]              # decided once, at setup
    monkeypatch.setattr(ppo, "reusable_forwards", lambda *a: False)
    separate = metrics(tmp_path / "separate")
    assert fused == separate
    for row in fused:
        assert row["policy/ratio"] == 1.0 and row["policy/approxkl"] == 0.0 and row["policy/clipfrac"] == 0.0


@pytest.mark.launch
@pytest.mark.parametrize("flags", [{"n": 10}, {"termination": "parsing"}])
def test_code_task_uses_the_execution_reward(tiny_models, tmp_path, flags):
    """No reward model: the critic starts from the SFT model and the score is running the program."""
    args = ppo_config(task="code", sft_path=str(tiny_models / "sft"), rm_path=str(tmp_path / "no_rm"),
                       output_dir=str(tmp_path), steps=1, rollout_batch_size=4, mini_batch_size=2,
                       max_prompt_len=48, max_response_len=8, n_eval_prompts=4, **flags)
    ppo.main(*args)
    row = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][0]
    assert -1.0 <= row["reward/exec"] <= 1.0 and 0.0 <= row["reward/pass_rate"] <= 1.0
    assert "eval/pass@1" in row and "reward/rm" not in row
    assert "pass@1" in open(tmp_path / "summary.md").read()
    if flags.get("termination") == "parsing":
        assert 0.0 <= row["macro/parse_fallback"] <= 1.0


@pytest.mark.launch
def test_count_task_trains_on_its_gold_judge_and_generates_its_longer_default(tiny_models, tmp_path):
    """The long-horizon task with --reward gold: the training score is the gold judge reading each whole
    response against its own prompt, and the task's default response length (64) when --max_response_len
    is left at 0."""
    args = ppo_config(task="count", reward="gold", sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                       output_dir=str(tmp_path), steps=1, rollout_batch_size=4, mini_batch_size=2, n_eval_prompts=4,
                       plot=True)
    ppo.main(*args)
    row = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][0]
    assert args.max_response_len == 64 and "reward/rm" not in row
    assert 0.0 <= row["reward/gold"] <= 1.0 and 0.0 <= row["eval/gold"] <= 1.0 and "eval/rm" in row
    assert row["response/len"] > 32                 # the random policy seldom says EOS: it runs past chitchat's 32
    assert "mean gold score" in open(tmp_path / "summary.md").read()
    assert json.load(open(tmp_path / "macro_actions.json"))["score_kind"] == "gold"    # the picture's score: the judge's


def run_ppo(tiny_models, out, *extra, here=False):
    """ppo.py on the tiny models: its own process, or in this one (`here`)."""
    cmd = ["ppo.py", "--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"),
           "--output_dir", str(out), "--rollout_batch_size", "4", "--mini_batch_size", "2", "--max_prompt_len", "16",
           "--max_response_len", "8", "--n_eval_prompts", "4", "--eval_every", "2", "--plot", "false", *extra]
    if here:
        return run_stage(*cmd), [json.loads(line) for line in open(out / "metrics.jsonl")]
    proc = subprocess.run([sys.executable, *cmd], cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout, [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.launch
def test_resume_continues_with_the_numbers_of_an_uninterrupted_run(tiny_models, tmp_path, uninterrupted):
    run_ppo(tiny_models, tmp_path / "split", "--steps", "3", "--save_every", "3", here=True)
    out, rest = run_ppo(tiny_models, tmp_path / "split", "--steps", "5", "--save_every", "3", "--resume", here=True)
    assert "resumed at iteration 3" in out
    assert [comparable(r) for r in rest] == [comparable(r) for r in uninterrupted[:5]]   # the same file, appended


@pytest.mark.launch
def test_kl_controller_moves_beta_the_right_way_logs_it_and_resumes_it(tiny_models, tmp_path):
    """A target far below the policy's KL raises beta, one far above lowers it, each iteration by 20% of
    n / horizon (here 4 prompts of 8: 10%), from the batch's logged KL; without a target beta is logged fixed;
    --resume continues with the saved beta. k3 is never negative, so the policy's KL exceeds the low target
    once the policy has moved (the first iteration's KL is exactly 0: beta falls once)."""
    flags = ("--kl_horizon", "8", "--steps", "5", "--kl_estimator", "k3")
    _, fixed = run_ppo(tiny_models, tmp_path / "fixed", "--steps", "2", "--beta", "0.07", here=True)
    assert [r["beta"] for r in fixed] == [0.07, 0.07]
    _, low = run_ppo(tiny_models, tmp_path / "low", *flags, "--kl_target", "1e-6", here=True)
    _, high = run_ppo(tiny_models, tmp_path / "high", *flags, "--kl_target", "1e6", here=True)
    assert low[0]["beta"] == high[0]["beta"] == 0.05                             # the first iteration uses --beta
    assert low[0]["kl"] == high[0]["kl"] == 0.0                                  # the policy is the reference
    factors = {name: [b["beta"] / a["beta"] for a, b in zip(rows, rows[1:])] for name, rows in (("low", low),
                                                                                                ("high", high))}
    assert factors["low"] == pytest.approx([0.9, 1.1, 1.1, 1.1], rel=1e-9)
    assert factors["high"] == pytest.approx([0.9] * 4, rel=1e-9)
    run_ppo(tiny_models, tmp_path / "split", *flags[:2], *flags[4:], "--kl_target", "1e-6", "--steps", "3",
            "--save_every", "3", here=True)
    out, rest = run_ppo(tiny_models, tmp_path / "split", *flags, "--kl_target", "1e-6", "--save_every", "3",
                        "--resume", here=True)
    assert "resumed at iteration 3" in out and "beta 0.05 -> " in out
    assert [comparable(r) for r in rest] == [comparable(r) for r in low]


@pytest.mark.launch
def test_a_run_is_quiet_no_deepspeed_warning_no_shard_bars_no_deprecation(tiny_models, tmp_path):
    """Without a DeepSpeed config nothing imports DeepSpeed (so nothing says it guessed a CPU), checkpoints draw no
    "Writing model shards" bars, and LoRA, new or resumed, raises no transformers deprecation warning (peft reads
    is_gradient_checkpointing). Both runs in one fresh process (one interpreter start less): ppo.py's command line
    twice through stages.run_stage, new then --resume, every warning shown (-W always), what each printed passed on."""
    flags = ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--output_dir",
             str(tmp_path / "run"), "--rollout_batch_size", "4", "--mini_batch_size", "2", "--max_prompt_len", "16",
             "--max_response_len", "8", "--n_eval_prompts", "4", "--save_every", "1", "--lora_r", "4"]
    runs = "import json, sys\nsys.path.insert(0, 'tests/spec')\nfrom stages import run_stage\n" \
           "for argv in json.loads(sys.argv[1]):\n    print(run_stage('ppo.py', *argv), flush=True)\n"
    proc = subprocess.run([sys.executable, "-W", "always", "-X", "importtime", "-c", runs,
                           json.dumps([[*flags, "--steps", "2"], [*flags, "--steps", "3", "--resume"]])],
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "peft" in imported and not {m for m in imported if m.split(".")[0] == "deepspeed"}
    out = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("import time:"))
    assert (tmp_path / "run" / "checkpoint").exists() and "resumed at iteration 2" in out
    for noise in ("Setting accelerator to CPU", "Writing model shards", "is_gradient_checkpointing", "FutureWarning"):
        assert noise not in out, noise


@pytest.mark.launch
def test_non_finite_rewards_stop_with_a_clear_message(tiny_models, tmp_path):
    """A reward model whose head gives NaN (a --beta nan is refused at start: harness.check_ranges)."""
    from transformers import AutoModelForSequenceClassification
    broken = AutoModelForSequenceClassification.from_pretrained(tiny_models / "rm")
    broken.score.weight.data.fill_(float("nan"))
    ppo.harness.atomic_save(str(tmp_path / "nan_rm"), broken, ppo.data.load_tokenizer(str(tiny_models / "rm")))
    args = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tmp_path / "nan_rm"), output_dir=str(tmp_path / "out"),
                       steps=1, rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=8)
    with pytest.raises(FloatingPointError, match="non-finite reward at iteration 0"):
        ppo.main(*args)


@pytest.mark.launch
def test_default_pipeline_builds_sft_and_rm_then_trains(tmp_path):
    """The zero-argument path, with small sizes: missing models are built by sft.py / reward_model.py."""
    small = "--max_prompt_len 16 --max_response_len 8 --batch_size 4 --max_steps 4 --eval_every 2 --n_eval 8"
    out, rows = run_ppo(tmp_path, tmp_path / "ppo", "--steps", "2", "--sft_args",             # sft.py and
                        small + " --hidden_size 32 --num_layers 1 --vocab_size 300", "--rm_args",   # reward_model.py:
                        small + " --n_gold_prompts 4", "--plot", "true", here=True)                 # subprocesses
    assert "sft missing: running sft.py" in out and "rm missing: running reward_model.py" in out
    assert "gold win rate vs SFT" in out and len(rows) == 2
    assert os.path.exists(tmp_path / "ppo" / "learning_curve.png")


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, tmp_path_factory):
    """An uninterrupted single-process run of 8 iterations: the numbers a resumed run must reproduce."""
    return run_ppo(tiny_models, tmp_path_factory.mktemp("uninterrupted"), "--steps", "8", here=True)[1]


# SIGTERM here; SIGINT (Ctrl-C) takes the same path through harness.GracefulStop, tested end to end on
# sft.py (one process, test_pipeline.py; a 2-process launch, test_two_processes.py) and for both signals in test_harness.py
@pytest.mark.launch
@pytest.mark.parametrize("signame,code", [("SIGTERM", 143)])
def test_sigterm_saves_a_checkpoint_that_resumes(tiny_models, tmp_path, uninterrupted, signame, code):
    import signal
    import time
    out = tmp_path / "run"
    cmd = [sys.executable, "ppo.py", "--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"),
           "--output_dir", str(out), "--rollout_batch_size", "4", "--mini_batch_size", "2", "--max_prompt_len", "16",
           "--max_response_len", "8", "--n_eval_prompts", "4", "--eval_every", "1000", "--save_every", "1000",
           "--steps", "1000"]
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(getattr(signal, signame))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-2000:]
    done = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)["step"]
    assert f"interrupted after iteration {done}" in stdout and done >= 2
    assert done + 2 <= len(uninterrupted)
    logged = metrics.read_text()
    fresh = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))), capture_output=True, text=True, timeout=120)
    assert fresh.returncode != 0 and "checkpoint of an interrupted run" in fresh.stderr and "--resume" in fresh.stderr
    assert metrics.read_text() == logged          # a fresh start over it is refused before it replaces anything
    resumed, rows = run_ppo(tiny_models, out, "--steps", str(done + 2), "--resume", here=True)
    assert f"resumed at iteration {done}" in resumed
    whole = uninterrupted[:done + 2]              # (the schedule does not depend on --steps; evaluation aside)
    assert [comparable(r) for r in rows] == [comparable(r) for r in whole]     # the numbers, not only the steps


@pytest.mark.launch
@pytest.mark.parametrize("flags", [{}, {"lora_r": 4}])
def test_held_out_rows_carry_the_diversity_of_the_policy_and_of_the_sft_model(tiny_models, tmp_path, flags):
    """Every evaluation row: distinct-1/2, the repetition rate and gold_strict of the policy's held-out replies,
    and the SFT model's diversity on the same prompts and seed (measured once: the same in every row). Under a
    critic warm-up the policy is the SFT model, so the two agree exactly (under LoRA the SFT model is loaded for
    it, its reference being the policy with its adapters off)."""
    args = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                       steps=2, eval_every=1, critic_warmup=2, rollout_batch_size=4, mini_batch_size=4,
                       max_prompt_len=16, max_response_len=8, n_eval_prompts=8, **flags)
    ppo.main(*args)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2
    for row in rows:
        assert -1.0 <= row["eval/gold_strict"] <= 1.0 and 0.0 <= row["eval/repetition"] <= 1.0
        for key in ("distinct_1", "distinct_2", "repetition"):
            assert row[f"eval/{key}"] == row[f"eval/sft_{key}"] == rows[0][f"eval/sft_{key}"]
        assert 0.0 < row["eval/distinct_2"] <= 1.0
