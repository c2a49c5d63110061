"""Correctness round 5: the scale path's silent faults. --grad_accum and --max_grad_norm mean the same under every
launch; a ZeRO-2 + bf16 resume keeps the fp32 master weights; every numeric flag is refused outside its range at
start; the KL controller keeps beta positive; FSDP2 gets its launch settings back after generation; the
library behaviour harness.py relies on beyond public APIs is pinned; bf16 policy and reference agree.

Its launches are parts of others: zero_main runs last in tests/launch/zero_stages.py's DeepSpeed launch (test_scale.py),
fsdp_main last in test_gpu_paths_on_cpu_runs.py's FSDP2 launch; alone, `python tests/spec/test_audit5.py zero OUT`
under tests/launch/deepspeed_cpu.py, `... fsdp OUT` under tests/launch/fsdp_cpu.py."""
import dataclasses
from stages import ppo_config
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
import harness  # noqa: E402

STAGES = ("sft.SFTArgs", "reward_model.RMArgs", "ppo.PPOArgs", "segment_rewards.SegmentArgs", "critic_free.CreditArgs",
          "harness.ModelArgs", "evaluate.ReportArgs", "evaluate.EvalArgs")     # ppo.py's flags: its ARGS


def stage_classes():
    import importlib
    return {path: getattr(importlib.import_module(path.split(".")[0]), path.split(".")[1]) for path in STAGES}


def outside(interval, kind):
    """Values just outside `interval` ("[1, inf)", "(0, 1]"), of the field's type, and NaN for a float."""
    lo, hi = (float(b) for b in interval[1:-1].split(","))
    step = 1 if kind is int else 0.5
    values = []
    if math.isfinite(lo):
        values.append(lo if interval[0] == "(" else lo - step)
    if math.isfinite(hi):
        values.append(hi if interval[-1] == ")" else hi + step)
    values = [kind(v) for v in values]
    return values + ([float("nan")] if kind is float else [])


# ---------------------------------------------------------------------------------------------
# 5. Every numeric flag declares its range, checked at start
# ---------------------------------------------------------------------------------------------

LIST_FLAGS = {("evaluate.EvalArgs", "ns"), ("evaluate.EvalArgs", "temperatures"), ("evaluate.EvalArgs", "ks")}


def test_every_numeric_flag_of_every_stage_declares_a_range_its_default_lies_in():
    """Numbers and lists of numbers ("1,4,8"); the range is the flag's metavar, which --help shows."""
    lists = set()
    for path, cls in stage_classes().items():
        for f in dataclasses.fields(cls):
            if f.type in (int, float):
                assert "metavar" in f.metadata, f"{path} --{f.name} declares no range"
            if "metavar" in f.metadata:
                harness.check_ranges(cls())                          # every default lies in its range
            if f.type is str and "metavar" in f.metadata:
                lists.add((path, f.name))
    assert lists == LIST_FLAGS


def test_a_value_outside_a_flags_range_is_refused_naming_the_flag_its_value_and_its_range():
    walked = 0
    for path, cls in stage_classes().items():
        for f in dataclasses.fields(cls):
            if "metavar" not in f.metadata:
                continue
            kind = float if f.type is str else f.type                  # a list flag: one bad number after a good one
            for value in outside(f.metadata["metavar"], kind):
                value = f"{f.default.split(',')[0]},{value}" if f.type is str else value
                with pytest.raises(SystemExit) as stopped:
                    harness.check_flags(cls(**{f.name: value}))
                assert str(stopped.value) == f"error: --{f.name} {value!r}: outside its range {f.metadata['metavar']}"
                walked += 1
    assert walked > 60


@pytest.mark.parametrize("flag,value", [("eval_every", 0), ("save_every", 0), ("mini_batch_size", 0),
                                        ("rollout_batch_size", 0), ("ppo_epochs", 0), ("n_eval_prompts", 0),
                                        ("n", -1), ("n", -5), ("beta", -0.1)])
def test_the_issues_bad_numbers_are_refused_by_ppo(flag, value):
    import ppo
    with pytest.raises(SystemExit, match=f"--{flag} {value!r}: outside its range"):
        for part in ppo_config(**{flag: value}):
            harness.check_flags(part)


# ---------------------------------------------------------------------------------------------
# 1, 3. --grad_accum and --max_grad_norm: the script's, under every launch
# ---------------------------------------------------------------------------------------------

def test_the_launch_configs_leave_accumulation_and_clipping_to_the_script():
    import yaml
    for name in ("zero2", "zero3", "ddp", "fsdp"):
        config = yaml.safe_load(open(ROOT / "configs" / f"{name}.yaml"))
        ds = config.get("deepspeed_config", {})
        assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds, name


def test_a_launch_that_accumulates_otherwise_stops_naming_both_values(monkeypatch):
    """accelerate takes $ACCELERATE_GRADIENT_ACCUMULATION_STEPS (exported by `accelerate launch` from a config)
    over the script's argument: it used to step at the launch's rhythm with the script's loss scaling."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    with pytest.raises(SystemExit, match="--grad_accum 3, but the launch sets gradient_accumulation_steps 1"):
        harness.make_accelerator(grad_accum=3)


@pytest.mark.parametrize("key,env,kwargs,flag", [
    ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", {"grad_accum": 3}, "--grad_accum 3"),
    ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", {"max_grad_norm": 0.5}, "--max_grad_norm 0.5")])
def test_a_deepspeed_launch_setting_another_value_stops_and_one_setting_none_takes_the_scripts(monkeypatch, key, env,
                                                                                                  kwargs, flag):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    plugin = harness.deepspeed_plugin(4, **kwargs)
    assert plugin.deepspeed_config[key] == next(iter(kwargs.values()))
    monkeypatch.setenv(env, "1")
    with pytest.raises(SystemExit, match=f"{flag}, but the launch's DeepSpeed config sets {key}: 1"):
        harness.deepspeed_plugin(4, **kwargs)


def test_clip_gradients_returns_the_norm_and_clips_only_above_max_norm():
    acc = harness.make_accelerator()
    model = torch.nn.Linear(3, 2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    for max_norm, scale in ((0.0, 1.0), (100.0, 1.0), (0.5, None)):
        opt.zero_grad()
        acc.backward(model(torch.ones(4, 3)).pow(2).sum())
        grads = [p.grad.clone() for p in model.parameters()]
        norm = torch.cat([g.flatten() for g in grads]).norm().item()
        assert harness.clip_gradients(acc, model, max_norm) == pytest.approx(norm, rel=1e-6)
        scale = scale or max_norm / norm
        for p, g in zip(model.parameters(), grads):
            assert torch.allclose(p.grad, g * scale, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# 8. accelerate's behaviour beyond its documented API, pinned
# ---------------------------------------------------------------------------------------------

def test_the_accumulation_grouping_syncs_at_the_last_micro_step_of_every_group():
    """start_accumulation sets accelerate's Accelerator.step so that accumulate() syncs (and the optimizer
    steps) at the end of each group: 5 minibatches at --grad_accum 3 sync after the 3rd and the 5th, and the
    next iteration's groups start afresh. A change in accelerate's counter would mis-group silently."""
    acc = harness.make_accelerator(grad_accum=3)
    model = acc.prepare(torch.nn.Linear(2, 1))
    synced = []
    for n_minibatches in (5, 4):
        for j in range(n_minibatches):
            if j % 3 == 0:
                harness.start_accumulation((acc,), min(3, n_minibatches - j))
            with acc.accumulate(model):
                synced.append(acc.sync_gradients)
    assert synced == [False, False, True, False, True] + [False, False, True, True]


def test_another_accelerate_version_is_refused_with_a_clear_error(monkeypatch):
    import accelerate
    harness.check_accelerate_version()                       # the pinned version passes
    monkeypatch.setattr(accelerate, "__version__", "1.99.0")
    with pytest.raises(SystemExit, match="accelerate 1.99.0: .*Accelerator.step counter"):
        harness.check_accelerate_version()


def test_saving_without_deepspeed_still_keeps_deepspeed_out_of_a_save(tmp_path):
    """The other pinned behaviour: save_pretrained asks accelerate.utils.other.is_deepspeed_available, which
    harness.saving_without_deepspeed answers False outside a DeepSpeed launch (no deepspeed import on a save)."""
    code = ("import sys, torch, harness\nfrom transformers import GPT2Config, GPT2LMHeadModel\n"
            "m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10))\n"
            f"harness.atomic_save({str(tmp_path / 'm')!r}, m)\nprint('deepspeed' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "False"


def test_no_private_torch_transformers_or_accelerate_api_is_called_on_the_training_path():
    private = ("_get_fsdp_state", "_lazy_init", "_DropoutNd", "_hf_deepspeed_config_weak_ref")
    for name in ("harness.py", "ppo.py", "sft.py", "reward_model.py"):
        text = open(ROOT / name).read()
        assert not [p for p in private if p in text], name


# ---------------------------------------------------------------------------------------------
# 4. The KL controller
# ---------------------------------------------------------------------------------------------

def test_beta_stays_positive_and_moves_at_most_20_percent_whatever_the_horizon():
    import ppo
    beta = 0.05
    for kl in (10.0, 0.0, 10.0, 3.0, 0.0):
        new = ppo.adaptive_beta(beta, kl, target=1.0, n=8, horizon=1)
        assert 0.8 * beta - 1e-12 <= new <= 1.2 * beta + 1e-12 and new > 0
        beta = new


def test_kl_target_with_beta_0_is_refused():
    """beta 0 never moves: beta * (1 + e) = 0 whatever the error e."""
    import ppo
    with pytest.raises(SystemExit, match="--kl_target 1.0 with --beta 0.0"):
        ppo.resolve(*ppo_config(beta=0.0, kl_target=1.0, task="count"))


# ---------------------------------------------------------------------------------------------
# 6. --reward_agg released reproduces the released code, or is refused
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sigma", ["position", "unit", "first"])
def test_released_aggregation_with_a_sigma_the_released_code_weighs_otherwise_is_refused(sigma):
    import ppo
    with pytest.raises(SystemExit, match=f"--reward_agg released with --sigma {sigma}"):
        ppo.resolve(*ppo_config(reward_agg="released", sigma=sigma, task="count"))


# ---------------------------------------------------------------------------------------------
# 10. The diversity metrics say what they compute
# ---------------------------------------------------------------------------------------------

def test_distinct_n_divides_by_the_n_grams_and_gold_strict_prices_only_repeated_pairs_in_one_reply():
    import data
    assert data.distinct_n(["a b a b"], 2) == 2 / 3                 # 2 distinct pairs of 3 pairs (not of 4 words)
    assert "generated tokens" in data.distinct_n.__doc__ and "Li et al. 2016" in data.distinct_n.__doc__
    twice, list_of_praise = data.strict_sentiment(["love love", "great wonderful happy lovely nice"])
    assert twice == pytest.approx(data.gold_score(["love love"])[0])                   # one pair: nothing repeats
    assert "love love" in data.strict_sentiment.__doc__
    doc = open(ROOT / "docs" / "evaluation.md").read()
    assert "generated tokens" in doc and "love love" in doc


# ---------------------------------------------------------------------------------------------
# 9. bf16: the policy and the reference in the same precision
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The launches: ZeRO-2 / ZeRO-3 (1, 2, 3) and FSDP2 (7)
# ---------------------------------------------------------------------------------------------

TINY = ["--hidden_size", "32", "--num_layers", "1", "--vocab_size", "300", "--batch_size", "2", "--max_prompt_len",
        "16", "--max_response_len", "8", "--n_eval", "8", "--seed", "3", "--save_every", "1", "--eval_every", "1"]
PPO = ["--rollout_batch_size", "8", "--mini_batch_size", "2", "--max_prompt_len", "16", "--max_response_len", "8",
       "--n_eval_prompts", "4", "--eval_every", "1", "--save_every", "1", "--plot", "false", "--steps", "1"]


def zero_main(out):
    """Under a 2-process DeepSpeed launch of configs/zero2.yaml (tests/launch/zero_stages.py's): --grad_accum 3 under
    ZeRO-2 and ZeRO-3 (sft.py and reward_model.py 1 step, ppo.py 1 iteration of 4 minibatches), each with its
    checkpoint; then under ZeRO-2 ppo.py --bf16 at lr 1e-5: 1 iteration and --resume to 2, and 2 at once."""
    from accelerate.state import AcceleratorState, GradientState
    from stages import run_stage

    def stage(script, *argv):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        run_stage(script, *argv)

    for zero in ("2", "3"):
        os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = zero
        base = os.path.join(out, f"zero{zero}")
        sft, rm = os.path.join(base, "sft"), os.path.join(base, "rm")
        stage("sft.py", *TINY, "--max_steps", "1", "--grad_accum", "3", "--output_dir", sft)
        stage("reward_model.py", *TINY[6:], "--max_steps", "1", "--grad_accum", "3", "--sft_path", sft,
              "--output_dir", rm, "--n_gold_prompts", "0")
        stage("ppo.py", *PPO, "--grad_accum", "3", "--sft_path", sft, "--rm_path", rm,
              "--output_dir", os.path.join(base, "ppo"))
    os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = "2"
    base = os.path.join(out, "zero2")
    bf16 = [*PPO[:-2], "--bf16", "--policy_lr", "1e-5", "--critic_lr", "1e-5", "--sft_path", os.path.join(base, "sft"),
            "--rm_path", os.path.join(base, "rm")]
    stage("ppo.py", *bf16, "--steps", "1", "--output_dir", os.path.join(out, "bf16_resumed"))
    stage("ppo.py", *bf16, "--steps", "2", "--output_dir", os.path.join(out, "bf16_resumed"), "--resume")
    stage("ppo.py", *bf16, "--steps", "2", "--output_dir", os.path.join(out, "bf16_whole"))


def fsdp_main(out):
    """Under a 2-process FSDP2 launch (tests/launch/fsdp_cpu.py, --fsdp_reshard_after_forward false, or its variable
    set by tests/launch/launched_stages.py): whether each FSDP module reshards after forward, before and after a
    generation inside harness.generation_model; then the gradient norm harness.clip_gradients reports and clips to,
    against the whole gradient's."""
    import sft
    acc = harness.make_accelerator()
    tokenizer = sft.train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)
    torch.manual_seed(0)
    model = sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=2)
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))

    def reshards():      # test-side reading of FSDP2's state: a post-forward mesh means "reshard after forward"
        return [g.post_forward_mesh_info is not None for m in model.modules() if hasattr(m, "unshard")
                for g in m._get_fsdp_state()._fsdp_param_groups]
    model(input_ids=torch.ones(1, 3, dtype=torch.long))          # a training forward: the root initialised
    before = reshards()
    with harness.generation_model(acc, model) as (unwrapped, synced):
        unwrapped.generate(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=3, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    result = {"before": before, "after": reshards(), "launch": acc.state.fsdp_plugin.reshard_after_forward}

    def full_norm():     # every rank's shards of every gradient, gathered
        return torch.cat([p.grad.full_tensor().flatten() for p in model.parameters() if p.grad is not None]).norm().item()
    model.train()
    acc.backward(model(input_ids=torch.ones(2, 4, dtype=torch.long), labels=torch.ones(2, 4, dtype=torch.long)).loss)
    whole = full_norm()
    result["norm"] = [harness.clip_gradients(acc, model, 0.0), whole]             # reported, nothing clipped
    result["clipped"] = [harness.clip_gradients(acc, model, whole / 2), full_norm(), whole / 2]
    if acc.is_main_process:
        json.dump(result, open(os.path.join(out, "fsdp.json"), "w"))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests" / "spec"))
    {"zero": zero_main, "fsdp": fsdp_main}[sys.argv[1]](sys.argv[2])
