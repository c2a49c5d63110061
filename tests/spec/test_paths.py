"""Default paths: every stage reads and writes runs/<task>/..., decided in one function (data.resolve_paths)."""
import pytest
from transformers import HfArgumentParser

import data
import evaluate
import ppo
import reward_model
import sft
from stages import run_stage


def parsed(args_class, *argv):
    return HfArgumentParser(args_class).parse_args_into_dataclasses(list(argv))[0]


@pytest.mark.parametrize("task", ["chitchat", "count"])
def test_every_stage_defaults_to_the_folders_of_its_task(task):
    assert data.resolve_paths(parsed(sft.SFTArgs, "--task", task), "sft").output_dir == f"runs/{task}/sft"
    rm_args = data.resolve_paths(parsed(reward_model.RMArgs, "--task", task), "rm")
    assert (rm_args.sft_path, rm_args.output_dir) == (f"runs/{task}/sft", f"runs/{task}/rm")
    ppo_args, *extensions = HfArgumentParser(ppo.ARGS).parse_args_into_dataclasses(["--task", task])
    models = ppo.resolve(ppo_args, *extensions)[2]
    assert (ppo_args.sft_path, ppo_args.rm_path, models.critic_path, ppo_args.output_dir) == (
        f"runs/{task}/sft", f"runs/{task}/rm", f"runs/{task}/rm", f"runs/{task}/ppo_n5_fixed")
    eval_args = data.resolve_paths(evaluate.EvalArgs(task=task))
    assert (eval_args.sft_path, eval_args.rm_path, eval_args.output_dir) == (f"runs/{task}/sft", f"runs/{task}/rm",
                                                                             "runs/eval")


def test_paths_given_are_kept():
    args = data.resolve_paths(parsed(reward_model.RMArgs, "--task", "count", "--sft_path", "a", "--output_dir", "b"), "rm")
    assert (args.sft_path, args.output_dir) == ("a", "b")


@pytest.mark.parametrize("flags, name", [(["--n", "5"], "ppo_n5_fixed"), (["--n", "1"], "ppo_n1_fixed"),
                                         (["--termination", "ppl"], "ppo_ppl"),
                                         (["--n", "3", "--termination", "parsing"], "ppo_parsing")])
def test_ppo_run_names_carry_n_only_where_the_termination_uses_it(flags, name):
    args = parsed(ppo.PPOArgs, "--task", "count", *flags)
    ppo.resolve(args)
    assert args.output_dir == f"runs/count/{name}"


def test_sft_and_rm_of_count_read_and_write_runs_count(tmp_path, monkeypatch):
    """The stages themselves resolve the defaults: each stops at the first missing input, named by its path."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="runs/count/sft"):
        run_stage("reward_model.py", "--task", "count")
    with pytest.raises(SystemExit, match="runs/count/sft/checkpoint"):
        run_stage("sft.py", "--task", "count", "--resume")
    assert not (tmp_path / "runs" / "chitchat").exists()
