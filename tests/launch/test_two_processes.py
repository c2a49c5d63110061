"""sft.py and ppo.py with two CPU processes under `accelerate launch` (gloo): the ranks stay in sync and the
main process alone prints; a signal stops every rank at the same step with one checkpoint, and --resume
continues with the numbers of an uninterrupted 2-process run: SIGINT to one rank alone (sft.py), and SIGTERM
to the launcher, which passes it on to its workers, as SLURM / Kubernetes do before preempting (ppo.py).

A launch costs 5-6 s of imports and setup on a quiet 2-core machine (more beside a second test worker): the two
interrupted runs are launches of their own (a signal ends the process); the rest is one launch of
tests/launch/critic_free_ranks.py (launched_stages.py's runs, with spies that keep each rank's prompts and group
advantages): the two resumed runs first, then the uninterrupted runs they are compared with, a PPO run with
LoRA, the runs that check each rank's own random numbers across a resume, the two critic-free runs
(--advantage group and mc), then harness.in_chunks across ranks (tests/launch/in_chunks_ranks.py)."""
import json
import os
import pathlib
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

import macro_actions as ma
from stages import comparable, launch
from test_critic_free import ppo_args

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SFT = ["--hidden_size", "32", "--num_layers", "1", "--vocab_size", "300", "--batch_size", "4", "--max_prompt_len",
       "24", "--max_response_len", "12", "--n_eval", "16", "--seed", "3", "--max_steps", "60"]


def ppo_flags(tiny_models):
    return ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--rollout_batch_size", "4",
            "--mini_batch_size", "2", "--max_prompt_len", "16", "--max_response_len", "8", "--n_eval_prompts", "4",
            "--kl_target", "1e-6", "--kl_horizon", "8", "--kl_estimator", "k3",     # beta moves every iteration
            "--plot", "false"]


def checkpoint_step(output_dir):
    state = output_dir / "checkpoint" / "trainer_state.pt"
    return torch.load(state, weights_only=False)["step"] if state.exists() else None


def worker(launcher_pid, rank):
    import psutil
    for child in psutil.Process(launcher_pid).children(recursive=True):
        if child.environ().get("RANK") == str(rank):
            return child.pid
    raise AssertionError(f"no worker of rank {rank}")


def signal_launch(argv, ready, send):
    """Start `accelerate launch` with two processes, wait until `ready()`, then `send(launcher)` a signal;
    returns (returncode, stdout, stderr)."""
    proc = subprocess.Popen(launch(*argv), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 180
    while not ready() and time.time() < deadline:
        time.sleep(0.02)
    try:
        send(proc)
        out, err = proc.communicate(timeout=120)
    except (AssertionError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)                             # e.g. a rank left hanging in a collective
        raise
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def sft_interrupted(tmp_path_factory):
    """sft.py under a 2-process launch, SIGINT to the worker of rank 1 alone once the first checkpoint is
    there: (output_dir, returncode, stdout, stderr, the step of its checkpoint)."""
    split = tmp_path_factory.mktemp("sft") / "split"
    rc, out, err = signal_launch(["sft.py", *SFT, "--eval_every", "1000", "--save_every", "5", "--output_dir", split],
                                 lambda: (split / "checkpoint" / "trainer_state.pt").exists(),
                                 lambda launcher: os.kill(worker(launcher.pid, 1), signal.SIGINT))
    return split, rc, out, err, checkpoint_step(split)


@pytest.fixture(scope="module")
def ppo_interrupted(tiny_models, tmp_path_factory):
    """ppo.py under a 2-process launch, SIGTERM to the launcher only after two iterations:
    (output_dir, returncode, stdout, stderr, the iteration of its checkpoint)."""
    split = tmp_path_factory.mktemp("ppo") / "split"
    metrics = split / "metrics.jsonl"
    rc, out, err = signal_launch(["ppo.py", *ppo_flags(tiny_models), "--eval_every", "1000", "--save_every", "1000",
                                  "--steps", "1000", "--output_dir", split],
                                 lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
                                 lambda launcher: launcher.send_signal(signal.SIGTERM))
    return split, rc, out, err, checkpoint_step(split)


@pytest.fixture(scope="module")
def eos_prone(tiny_models, tmp_path_factory):
    """(a task file, an SFT model) whose responses end at lengths that depend on the prompt, so that the two
    ranks' sampling draws different counts of random numbers and their RNG states part: prompts of random
    words (the chitchat prompts all end in "Assistant:", and the tiny model reads little more), and the tiny
    SFT model with its EOS embedding (tied to the LM head) along the mean of its final hidden states."""
    import random
    import data
    import harness
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("eos_prone")
    words = "the quick brown fox jumped over lazy dog then ran away fast hello world class stack push items".split()
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(200)]
    with open(root / "task.jsonl", "w") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"prompt": f"{prompt} {i}", "chosen": " hello", "rejected": " dog"}) + "\n")
    tokenizer = data.load_tokenizer(str(tiny_models / "sft"))
    model = AutoModelForCausalLM.from_pretrained(tiny_models / "sft").eval()
    batch = data.collate(tokenizer, prompts[:64], prompts[:64], 16, 8)
    with torch.no_grad():
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       output_hidden_states=True).hidden_states[-1][batch["attention_mask"].bool()].mean(0)
        model.get_input_embeddings().weight[tokenizer.eos_token_id] = 4.0 * hidden / hidden.dot(hidden)
    harness.atomic_save(str(root / "sft"), model, tokenizer)
    return root / "task.jsonl", root / "sft"


@pytest.fixture(scope="module")
def launched(tiny_models, tmp_path_factory, sft_interrupted, ppo_interrupted, eos_prone):
    """One 2-process launch of tests/launch/critic_free_ranks.py: {name: (output_dir, [what rank 0 printed, rank 1])}
    for the resumed runs (where the interrupted ones left a checkpoint), an uninterrupted SFT run of 60 steps
    (held-out loss at 30 and 60), an uninterrupted PPO run of 6 iterations, a PPO run with --lora_r 4, the
    per-rank RNG runs on the eos_prone task: 4 iterations at once, and 2 then --resume to 4, and the critic-free runs
    ("group", "mc": 2 iterations of 2 prompts x 2 samples a rank); and "spied": the launch's folder, where stage i of
    rank r left <i>.<r>.pt (its prompts and group advantages), and in_chunks/ (in_chunks_ranks.py's check)."""
    tmp = tmp_path_factory.mktemp("launched")
    runs = {}
    if sft_interrupted[-1] is not None:
        runs["sft_resumed"] = (sft_interrupted[0], ["sft.py", *SFT, "--eval_every", "1000", "--save_every", "1000",
                                                    "--resume"])
    done = ppo_interrupted[-1]
    if done is not None:                          # (the schedule does not depend on --steps)
        runs["ppo_resumed"] = (ppo_interrupted[0], ["ppo.py", *ppo_flags(tiny_models), "--eval_every", "2",
                                                    "--steps", str(done + 2), "--resume"])
    runs["sft"] = (tmp / "sft", ["sft.py", *SFT, "--eval_every", "30", "--save_every", "1000"])
    runs["ppo"] = (tmp / "ppo", ["ppo.py", *ppo_flags(tiny_models), "--eval_every", "2", "--steps", "6"])
    runs["ppo_lora"] = (tmp / "ppo_lora", ["ppo.py", *ppo_flags(tiny_models), "--eval_every", "2", "--steps", "3",
                                           "--lora_r", "4"])
    task, sft_path = eos_prone
    rng = [*ppo_flags(tiny_models), "--task", str(task), "--sft_path", str(sft_path), "--eval_every", "1000"]
    runs["rng_whole"] = (tmp / "rng_whole", ["ppo.py", *rng, "--steps", "4"])
    runs["rng_split"] = (tmp / "rng_split", ["ppo.py", *rng, "--steps", "2", "--save_every", "2"])
    runs["rng_resumed"] = (tmp / "rng_split", ["ppo.py", *rng, "--steps", "4", "--resume"])
    critic_free = ["--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--mini_batch_size",
                   "2", "--max_prompt_len", "16", "--max_response_len", "8", "--n_eval_prompts", "4", "--eval_every",
                   "1000", "--plot", "false", "--steps", "2", "--group_size", "2", "--mc_rollouts", "2", "--mc_points",
                   "2", "--rollout_batch_size", "4"]
    for kind in ("group", "mc"):
        runs[kind] = (tmp / kind, ["ppo.py", *critic_free, "--advantage", kind])
    lines = [[*argv, "--output_dir", str(out)] for out, argv in runs.values()]
    (tmp / "in_chunks").mkdir()
    proc = subprocess.run(launch("tests/launch/critic_free_ranks.py", tmp, json.dumps(lines), tmp / "in_chunks"),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"spied": tmp, **{name: (out, [(tmp / f"{i}.{rank}.txt").read_text() for rank in (0, 1)])
                             for i, (name, (out, _)) in enumerate(runs.items())}}


def metrics(output_dir):
    return [json.loads(line) for line in open(output_dir / "metrics.jsonl")]


def weights(output_dir):
    return load_file(output_dir / "model.safetensors")


@pytest.mark.launch
def test_sft_under_accelerate_launch_with_two_cpu_processes(launched):
    out, printed = launched["sft"]
    assert "2 process(es)" in printed[0]
    assert "".join(printed).count("held-out loss") == 2                # printed by the main process only
    assert os.path.exists(out / "model.safetensors")


@pytest.mark.launch
def test_two_cpu_processes_stay_in_sync(launched):
    out, printed = launched["ppo"]
    assert "2 process(es)" in printed[0] and "ranks in sync: True" in printed[0]    # weights and the KL beta
    assert len(metrics(out)) == 6                                      # one metrics line per iteration
    betas = [r["beta"] for r in metrics(out)]                          # the controller's, from both ranks' KL
    assert len(set(betas)) == 6 and "adaptive KL: beta 0.05 -> " in printed[0]


@pytest.mark.launch
def test_two_cpu_processes_with_lora_stay_in_sync(launched):
    out, printed = launched["ppo_lora"]
    assert "2 process(es)" in printed[0] and "ranks in sync: True" in printed[0]
    assert len(metrics(out)) == 3


@pytest.mark.launch
def test_ctrl_c_to_one_rank_under_accelerate_launch_stops_both_at_one_step_and_resumes_exactly(sft_interrupted,
                                                                                                 launched):
    """SIGINT to rank 1 alone must also stop rank 0 at the same step (not leave it waiting for rank 1
    in a collective), and --resume then ends with the weights of an uninterrupted 2-process run. (A
    terminal's Ctrl-C reaches every process and the launcher forwards it again: the repeat is covered
    in test_harness.py.) Evaluations and checkpoints do not move the weights: the interrupted run evaluates
    never and saves every 5 steps, the others evaluate and save only at the end."""
    split, rc, out, err, step = sft_interrupted
    assert rc != 0 and "interrupted after step" in out, err[-3000:]      # printed by rank 0
    assert "exitcode: -9" not in err and "Signals.SIGKILL" not in err   # no rank had to be killed
    assert f"interrupted after step {step}:" in out and 5 <= step < 60
    assert f"resumed at step {step}" in launched["sft_resumed"][1][0]
    a, b = weights(launched["sft"][0]), weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.launch
def test_sigterm_to_a_two_process_launch_checkpoints_and_resumes_to_the_same_numbers(ppo_interrupted, launched):
    """What SLURM / Kubernetes do before preempting: SIGTERM to the launcher, which passes it on to its
    workers; both stop at the end of the same iteration with one checkpoint, and --resume continues
    with the numbers of an uninterrupted 2-process run."""
    split, rc, out, err, done = ppo_interrupted
    assert done is not None and f"interrupted after iteration {done}" in out and done >= 2, err[-3000:]
    assert "Signals.SIGKILL" not in err                                 # no worker had to be killed
    whole = metrics(launched["ppo"][0])
    assert done + 2 <= len(whole)
    resumed = launched["ppo_resumed"][1][0]
    assert f"resumed at iteration {done}" in resumed and "ranks in sync: True" in resumed
    # an uninterrupted 2-process run (evaluation aside, same numbers)
    assert [comparable(r) for r in metrics(split)] == [comparable(r) for r in whole[:done + 2]]


@pytest.mark.launch
def test_a_resumed_two_process_run_draws_each_ranks_own_random_numbers(launched):
    """Each rank samples its own prompts, whose responses end at different lengths, so the ranks' RNG states
    part. A checkpoint keeps every rank's, and --resume gives each its own back: 2 + 2 iterations resumed
    log the numbers of 4 uninterrupted ones (with rank 0's state on both ranks, rank 1's samples differ)."""
    whole, split = metrics(launched["rng_whole"][0]), metrics(launched["rng_resumed"][0])
    assert "resumed at iteration 2" in launched["rng_resumed"][1][0]
    assert any(0 < r["response/eos_rate"] < 1 for r in whole)                   # lengths differ within a batch
    assert [comparable(r) for r in split] == [comparable(r) for r in whole]


@pytest.mark.launch
def test_two_processes_hold_one_processs_groups_whole_and_stay_in_sync(tiny_models, tmp_path, monkeypatch, launched):
    """Under `accelerate launch` with 2 processes of 4 samples, group: each iteration's groups are those of one
    process with 8 samples, every group whole on one rank (the ranks' prompts together are the one process's, in
    order), and the advantages each rank computes on its own rows are those of all the rows at once. The sampled
    responses differ (each process draws its own random numbers, as under gae); mc runs too. Both end in sync."""
    import data
    import ppo
    stage = list(launched).index("group") - 1           # its place among the launch's stages ("spied" first)
    ranks = [torch.load(launched["spied"] / f"{stage}.{r}.pt", weights_only=False) for r in (0, 1)]
    asked, encode = [], data.encode_prompts   # one process, 8 samples: the same seed, the same prompt order
    monkeypatch.setattr(data, "encode_prompts", lambda tokenizer, prompts, *a, **k: asked.append(list(prompts)) or
                        encode(tokenizer, prompts, *a, **k))
    ppo.main(*ppo_args(tiny_models, tmp_path / "one", steps=2, advantage="group", group_size=2, rollout_batch_size=8,
                      eval_every=1000))
    for step in range(2):
        assert ranks[0]["prompts"][step] + ranks[1]["prompts"][step] == asked[step]
        (s0, a0), (s1, a1) = ranks[0]["groups"][step], ranks[1]["groups"][step]
        assert torch.equal(ma.group_advantages(torch.cat([s0, s1]), 2), torch.cat([a0, a1]))
    for kind in ("group", "mc"):
        assert "2 process(es)" in launched[kind][1][0] and "ranks in sync: True" in launched[kind][1][0]


@pytest.mark.launch
def test_a_chunked_forward_runs_as_many_times_on_every_rank(launched):
    """harness.in_chunks under 2 processes, 5 rows on one and 2 on the other, slices of 2: both run 3 forwards (the one
    with fewer rows repeats its last slice), so a collective forward never waits for a rank that stopped; each gets
    its own rows' result whole (tests/launch/in_chunks_ranks.py, at the end of the launch of `launched`)."""
    ranks = [json.loads((launched["spied"] / "in_chunks" / f"{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == {"calls": [[0, 2], [2, 4], [4, 5]], "equal": True}
    assert ranks[1] == {"calls": [[0, 2], [0, 2], [0, 2]], "equal": True}
