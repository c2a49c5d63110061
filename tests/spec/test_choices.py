"""Every choice flag of every stage refuses an unknown value at start, naming the flag and its choices: on the
command line (argparse) and in a dataclass built in Python (harness.check_choices, at each stage's start)."""
import dataclasses

import pytest
from transformers import HfArgumentParser

import evaluate
import harness
import ppo
from stages import ppo_config
import reward_model
import sft

STAGES = {"sft.py": (sft.SFTArgs,), "reward_model.py": (reward_model.RMArgs,), "ppo.py": ppo.ARGS,
          "evaluate.py": (evaluate.EvalArgs,)}      # each stage's arguments dataclasses, parsed together


def holder(stage, flag):
    """The dataclass of `stage` that holds `flag`."""
    return next(cls for cls in STAGES[stage] if flag in {f.name for f in dataclasses.fields(cls)})
CHOICE_FLAGS = {
    ("ppo.py", "reward"): ("rm", "gold", "segment"),
    ("ppo.py", "termination"): ("fixed", "randomized", "parsing", "ppl", "entropy", "segment"),
    ("ppo.py", "seg_norm"): ("regression", "global", "last", "none"),
    ("ppo.py", "seg_interp"): ("even", "repeat", "end", "bandit"),
    ("ppo.py", "sigma"): ("equal", "unit", "position", "first"),
    ("ppo.py", "reward_agg"): ("sum", "mean", "released"),
    ("ppo.py", "ratio"): ("token", "macro", "sequence"),
    ("ppo.py", "advantage"): ("gae", "group", "mc"),
    ("ppo.py", "group_norm"): ("std", "none", "loo"),
    ("ppo.py", "kl_penalty"): ("reward", "loss"),
    ("ppo.py", "kl_estimator"): ("k1", "k3"),
    ("ppo.py", "report_to"): ("none", "tensorboard", "wandb"),
    ("reward_model.py", "unit"): ("sequence", "segment", "token"),
    ("evaluate.py", "judge"): ("rm", "gold", "llm"),
    ("evaluate.py", "judge_template"): ("", "tldr", "hh", "webgpt"),
    ("evaluate.py", "judge_mode"): ("text", "logprobs"),
}


def test_every_flag_whose_help_lists_alternatives_declares_its_choices():
    """A string flag whose help reads 'a | b | c' is a choice flag: found in every stage's arguments."""
    declared = {}
    for stage, classes in STAGES.items():
        for f in (f for cls in classes for f in dataclasses.fields(cls)):
            if "choices" in f.metadata:
                declared[stage, f.name] = tuple(f.metadata["choices"])
                assert f.default in f.metadata["choices"], (stage, f.name)
            elif f.type in (str, "str"):
                assert " | " not in f.metadata["help"], f"{stage} --{f.name} lists alternatives but declares no choices"
    assert declared == CHOICE_FLAGS


@pytest.mark.parametrize("stage,flag", sorted(CHOICE_FLAGS))
def test_an_unknown_choice_is_refused_by_the_parser_naming_the_flag_and_its_choices(stage, flag, capsys):
    parser = HfArgumentParser(STAGES[stage])
    for value in CHOICE_FLAGS[stage, flag]:                   # every choice parses
        parsed = parser.parse_args_into_dataclasses([f"--{flag}", value])
        assert getattr(next(p for p in parsed if isinstance(p, holder(stage, flag))), flag) == value
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses([f"--{flag}", "bogus"])
    err = capsys.readouterr().err
    assert f"--{flag}" in err and "invalid choice: 'bogus'" in err
    assert all(repr(c) in err for c in CHOICE_FLAGS[stage, flag])


@pytest.mark.parametrize("stage,flag", sorted(CHOICE_FLAGS))
def test_an_unknown_choice_in_a_dataclass_built_in_python_is_refused(stage, flag):
    args = holder(stage, flag)(**{flag: "bogus"})
    with pytest.raises(SystemExit) as stopped:
        harness.check_choices(args)
    assert str(stopped.value) == (f"error: --{flag} 'bogus': choose from "
                                  + ", ".join(map(repr, CHOICE_FLAGS[stage, flag])))


def test_kl_estimator_k2_stops_ppo_at_start_instead_of_running_k3(tiny_models, tmp_path):
    """It used to run k3 for any value but k1."""
    args = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                       kl_estimator="k2", steps=1, rollout_batch_size=4, mini_batch_size=2)
    with pytest.raises(SystemExit, match="--kl_estimator 'k2': choose from 'k1', 'k3'"):
        ppo.main(*args)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unknown_unit_and_judges_are_refused_at_start(tiny_models, tmp_path):
    with pytest.raises(SystemExit, match="--unit 'paragraph': choose from 'sequence', 'segment', 'token'"):
        reward_model.main(reward_model.RMArgs(sft_path=str(tiny_models / "sft"), output_dir=str(tmp_path), unit="paragraph"))
    with pytest.raises(SystemExit, match="--judges 'rm,bogus': 'bogus' is not a judge; choose from rm, gold, llm"):
        evaluate.main(["agreement", "--judges", "rm,bogus", "--sft_path", str(tiny_models / "sft"),
                       "--rm_path", str(tiny_models / "rm"), "--output_dir", str(tmp_path)])
