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


# ---------------------------------------------------------------------------------------------
# Each stage runs at the bounds of its numeric flags: a range is what the code can take
# ---------------------------------------------------------------------------------------------

def at_bounds(cls, upper=False, **fixed):
    """Every numeric flag of `cls` at its lower bound (`upper`: its upper bound where it has one, else the default),
    the value nearest to it inside its range (test_choices.boundaries), except the `fixed` ones. `cls`: an arguments
    dataclass, or a stage's several (ppo.ARGS: then their instances, each flag to its own)."""
    import dataclasses
    import harness
    from test_choices import boundaries
    values = {}
    for f in (f for c in (cls if isinstance(cls, tuple) else (cls,)) for f in dataclasses.fields(c)):
        if f.type in (int, float) and f.name not in fixed:
            inside, _ = boundaries(f.metadata["metavar"], f.type)
            finite = f.metadata["metavar"].split(",")[int(upper)].strip(" [(])") not in ("inf", "-inf")
            if finite:
                values[f.name] = inside[-1 if upper else 0]
    return harness.split_flags(cls, {**values, **fixed}) if isinstance(cls, tuple) else cls(**{**values, **fixed})


def ran(out, stage):
    import os
    return os.path.exists(os.path.join(out, "config.json" if stage != "ppo" else os.path.join("policy", "config.json")))


@pytest.mark.launch
@pytest.mark.parametrize("upper", [False, True])
def test_sft_and_the_reward_model_run_at_the_bounds_of_every_numeric_flag(tiny_models, tmp_path, upper):
    """sft.py (the tiny model built: --hidden_size 4, --vocab_size 1) and reward_model.py (segment unit: --c_ent,
    --n_calibration), at the lower bounds (--max_prompt_len 2, --batch_size 1, --lr 0, --seed 0, ...) or the upper
    ones (--warmup_ratio 1, --seed 2^32 - 1: the batch order's seed + epoch), one step each, on the count task."""
    import reward_model
    import sft
    steps = {"max_steps": 1, "max_response_len": 2, "n_eval": 2, "epochs": 1.0}
    args = at_bounds(sft.SFTArgs, upper, task="count", output_dir=str(tmp_path / "sft"), num_layers=1, **steps)
    assert args.max_prompt_len == (48 if upper else 2) and args.seed == (2 ** 32 - 1 if upper else 0)
    sft.main(args)
    assert ran(tmp_path / "sft", "sft")
    args = at_bounds(reward_model.RMArgs, upper, task="count", sft_path=str(tiny_models / "sft"), unit="segment",
                     output_dir=str(tmp_path / "rm"), n_gold_prompts=2 if upper else 0, n_calibration=1 if not upper
                     else 4, **steps)
    reward_model.main(args)
    assert ran(tmp_path / "rm", "rm")


# each numeric flag at its bounds where the code reads it: under its termination, advantage, LoRA, KL controller
PPO_RUNS = {
    "gae": {},
    "group": {"advantage": "group", "group_norm": "none", "group_size": 2, "rollout_batch_size": 2,
              "mini_batch_size": 1},
    "mc": {"advantage": "mc", "termination": "parsing"},
    "entropy_lora_kl_target": {"termination": "entropy", "lora_r": 1, "kl_target": 1.0, "beta": 0.05},
}


@pytest.mark.launch
@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("run", sorted(PPO_RUNS))
def test_ppo_runs_at_the_bounds_of_every_numeric_flag(tiny_models, tmp_path, run, upper):
    """ppo.py, one iteration through the final report (seed + 1), every numeric flag at a bound: --max_prompt_len 2,
    --max_response_len 1, --rollout_batch_size 1, --n_eval_prompts 1, --temperature / --clip / --top_p just above 0,
    --seed 0, ... or --seed 2^32 - 1, --gamma 1, --lam 1, --top_p 1; under the run's termination and advantage."""
    import ppo
    flags = {"steps": 1, "n_eval_prompts": 2, "plot": False, "max_response_len": 1, **PPO_RUNS[run]}
    if upper:
        flags = {"max_prompt_len": 16, "max_response_len": 4, "rollout_batch_size": 2, "mini_batch_size": 2, **flags}
    args = at_bounds(ppo.ARGS, upper, sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                     output_dir=str(tmp_path), **flags)
    ppo.main(*args)
    assert ran(tmp_path, "ppo")
