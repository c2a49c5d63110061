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


# ---------------------------------------------------------------------------------------------
# Every numeric flag's range, walked at its boundaries
# ---------------------------------------------------------------------------------------------

RANGED = {"sft.py": (sft.SFTArgs,), "reward_model.py": (reward_model.RMArgs,), "ppo.py": ppo.ARGS}   # seed: the first's


def boundaries(interval, kind):
    """(inside, outside): at each finite bound of `interval` ("[2, inf)", "(0, 1]"), the value of type `kind` nearest
    to it on each side: the bound itself where it is included, else the next int or float past it."""
    import math
    inside, outside = [], []
    for bound, closed, inward in ((interval[1:-1].split(",")[0], interval[0] == "[", 1),
                                  (interval[1:-1].split(",")[1], interval[-1] == "]", -1)):
        bound = float(bound)
        if not math.isfinite(bound):
            continue
        if kind is int:
            first = int(bound) if closed else int(bound) + inward
            inside.append(first)
            outside.append(first - inward)
        else:
            toward = bound + inward
            inside.append(bound if closed else math.nextafter(bound, toward))
            outside.append(math.nextafter(bound, bound - inward) if closed else bound)
    return inside, outside


def numeric_flags():
    return [(stage, cls, f) for stage, classes in RANGED.items() for cls in classes for f in dataclasses.fields(cls)
            if f.type in (int, float)]


def test_every_numeric_flag_of_every_stage_is_accepted_at_its_bounds_and_refused_just_past_them():
    """Each finite bound walked from both sides (the ints next to it, the floats next to it), with the refusal's exact
    message; a flag without a finite bound still takes a huge int (compared exactly, no float overflow)."""
    walked = 0
    for stage, cls, f in numeric_flags():
        interval = f.metadata["metavar"]
        inside, outside = boundaries(interval, f.type)
        for value in inside:
            harness.check_flags(cls(**{f.name: value}))
        for value in outside:
            with pytest.raises(SystemExit) as stopped:
                harness.check_flags(cls(**{f.name: value}))
            assert str(stopped.value) == f"error: --{f.name} {value!r}: outside its range {interval}", (stage, f.name)
        walked += len(inside) + len(outside)
    assert walked > 120


@pytest.mark.parametrize("stage", sorted(RANGED))
def test_the_seed_takes_what_torch_and_numpy_take_with_seed_plus_one(stage):
    """--seed, seed + 1 (the final report's) and seed + epoch (the batch order's) are torch seeds, and a numpy
    seed is 32 bits: 2^32 - 1 at most; 2^64 - 1 used to train and then crash at seed + 1, 2^64 to crash at start."""
    import numpy
    import torch
    cls = RANGED[stage][0]
    harness.check_flags(cls(seed=2 ** 32 - 1))
    for seed in (2 ** 32 - 1, 2 ** 32 - 1 + 1):
        torch.Generator().manual_seed(seed)
    numpy.random.RandomState(2 ** 32 - 1)
    for seed in (2 ** 32, 2 ** 64 - 1, 2 ** 64, -1):
        with pytest.raises(SystemExit, match=rf"--seed {seed}: outside its range \[0, 4294967295\]"):
            harness.check_flags(cls(seed=seed))


@pytest.mark.parametrize("stage", sorted(RANGED))
def test_max_prompt_len_keeps_a_token_after_bos(stage, tokenizer):
    """--max_prompt_len 1 kept every prompt whole (ids[-0:]) and counted it as cut: refused at start in every stage;
    encode_prompts (which serves them all) refuses a length that leaves no token after BOS."""
    import data
    with pytest.raises(SystemExit, match=r"--max_prompt_len 1: outside its range \[2, inf\)"):
        harness.check_flags(RANGED[stage][0](max_prompt_len=1))
    assert tokenizer.bos_token_id is not None                       # the tiny tokenizer's BOS, as sft.py's
    ids, mask, cut = data.encode_prompts(tokenizer, ["the quick brown fox", "the lazy dog"], 2)
    assert ids.shape == (2, 2) and cut == 2 and (ids[:, 0] == tokenizer.bos_token_id).all()
    assert ids[:, 1].tolist() == [i[-1] for i in tokenizer(["the quick brown fox", "the lazy dog"],
                                                           add_special_tokens=False)["input_ids"]]
    with pytest.raises(ValueError, match="max_len 1: keeps no prompt token after BOS"):
        data.encode_prompts(tokenizer, ["the quick brown fox"], 1)


def test_check_flags_checks_every_field_of_several_dataclasses():
    """A stage whose flags are grouped in several dataclasses hands them all: each one's fields by their metadata."""
    harness.check_flags(ppo.PPOArgs(), sft.SFTArgs())
    with pytest.raises(SystemExit, match=r"--seed -1: outside its range"):
        harness.check_flags(ppo.PPOArgs(), sft.SFTArgs(seed=-1))
    with pytest.raises(SystemExit, match="--sigma 'bogus': choose from"):
        harness.check_flags(sft.SFTArgs(), ppo.PPOArgs(sigma="bogus"))
