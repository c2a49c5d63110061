"""The launch tests of test_segments.py (tests/spec): evaluate.py and ppo.py run in subprocesses or as whole stages."""
import json
import math

import pytest
import torch

import reward_model as rm
from test_segments import ppo_args, segment_rm  # noqa: F401, F811 (fixtures: segment_rm)


@pytest.mark.launch
def test_segment_ppo_on_segment_macro_actions_with_a_critic_warmup(tiny_models, segment_rm, tmp_path):
    """ppo.py --reward segment --termination segment --critic_warmup 2, two iterations: the segment metrics
    are there and finite, the policy is the SFT model still, the critic has moved."""
    import ppo
    from safetensors.torch import load_file
    ppo.main(*ppo_args(tiny_models, segment_rm, tmp_path, reward="segment", termination="segment", critic_warmup=2))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2
    for row in rows:
        for key in ("segment/mean_len", "segment/count", "reward/segment", "segment/norm_mean", "segment/norm_std"):
            assert math.isfinite(row[key]), key
        assert row["segment/count"] >= 1 and row["segment/mean_len"] >= 1 and "reward/rm" not in row
    assert math.isfinite(rows[-1]["eval/rm"])              # held out: e(x, y) of the segment RM
    policy, sft_weights = load_file(tmp_path / "policy" / "model.safetensors"), load_file(tiny_models / "sft" / "model.safetensors")
    assert policy.keys() == sft_weights.keys() and all(torch.equal(policy[k], sft_weights[k]) for k in policy)
    assert rows[-1]["loss/value"] != rows[0]["loss/value"]


@pytest.mark.launch
def test_termination_segment_under_a_sequence_rm_takes_its_segments_from_c_ent(tiny_models, tmp_path):
    """--reward rm --termination segment --c_ent C: MA-PPO's macro actions are the SFT entropy segments
    at C, with no segment RM: a threshold below every entropy makes each token a macro action, one above
    every entropy makes the response one (EOS joins it)."""
    import ppo
    lengths = {}
    for c_ent in (1e-6, 1e6):
        ppo.main(*ppo_args(tiny_models, tiny_models / "rm", tmp_path / str(c_ent), termination="segment", c_ent=c_ent))
        rows = [json.loads(line) for line in open(tmp_path / str(c_ent) / "metrics.jsonl")]
        lengths[c_ent] = [(row["macro/mean_len"], row["response/len"], row["response/eos_rate"]) for row in rows]
    for macro, _, eos in lengths[1e-6]:      # every token but EOS starts one; EOS joins the last
        assert macro == 1.0 if eos == 0 else 1.0 < macro <= 2.0
    assert all(macro == length for macro, length, _ in lengths[1e6]) and any(length > 1 for _, length, _ in lengths[1e6])


def metrics_of(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.launch
def test_reward_rm_on_a_segment_rm_scores_e_as_evaluate_does(tiny_models, segment_rm, tmp_path, capsys):
    """--reward rm on a segment RM scores with e(x, y), the mean of its segment rewards, never the head at
    EOS (a position it never trained): the rollouts' score is --reward segment's e of the same rollouts (one
    seed, the SFT policy), the held-out score is evaluate.py's of the same responses, and the run says so at
    start. --reward segment --seg_interp bandit (segment as bandit) gives the same per-token rewards."""
    import evaluate
    import ppo
    rows = {}

    def run(name, **flags):
        ppo.main(*ppo_args(tiny_models, segment_rm, tmp_path / name, steps=1, eval_every=1, policy_lr=0.0, **flags))
        rows[name] = metrics_of(tmp_path / name)[0]
    run("rm")
    run("segment", reward="segment")
    assert rows["rm"]["reward/rm"] == rows["segment"]["reward/segment"]
    assert "is a segment RM; its score is e(x, y)" in capsys.readouterr().out
    # held out: evaluate.py's score of the responses ppo.py sampled (the SFT policy, ppo.py's seed)
    args, *extensions = ppo_args(tiny_models, segment_rm, tmp_path / "rm")
    ppo.resolve(args, *extensions)
    ctx = evaluate.Context(evaluate.EvalArgs(sft_path=args.sft_path, rm_path=args.rm_path, n_prompts=4,
                                             max_prompt_len=16, max_response_len=8, output_dir=str(tmp_path)))
    texts = evaluate.sample_responses(ctx.model("sft").eval(), ctx.tokenizer, ctx.prompts, args.seed, 16, 8,
                                      args.temperature)
    e = torch.tensor(ctx.rm_scores(texts))
    last = rm.score(ctx.rm, ctx.tokenizer, ctx.prompts, texts, 16, 8)
    assert rows["rm"]["eval/rm"] == round(e.mean().item(), 4) != round(last.mean().item(), 4)
    run("bandit", reward="segment", seg_interp="bandit")           # segment as bandit: the same rewards
    assert rows["bandit"]["reward/segment"] == rows["rm"]["reward/rm"]
    assert rows["rm"]["reward/total"] == rows["bandit"]["reward/total"] != rows["segment"]["reward/total"]


@pytest.mark.launch
def test_bandit_as_segment_reads_a_sequence_rm_at_the_ends_of_c_ent_segments(tiny_models, tmp_path):
    """--reward segment --c_ent C --seg_norm none on a sequence RM (Table 1's bandit as segment): it runs, its
    segments are the SFT entropy segments at C (a threshold above every entropy: one segment per response),
    and the held-out score stays the sequence RM's own (the head at the last token, as evaluate.py reads it).
    A normalizer it does not have, or --c_ent on a segment RM, is refused naming the flag."""
    import ppo
    out = tmp_path / "run"
    ppo.main(*ppo_args(tiny_models, tiny_models / "rm", out, reward="segment", c_ent=1e6, seg_norm="none",
                      seg_interp="end", eval_every=2))
    rows = metrics_of(out)
    assert len(rows) == 2 and all(r["segment/count"] == 1.0 for r in rows) and math.isfinite(rows[-1]["eval/rm"])
    with pytest.raises(SystemExit, match="--seg_norm regression"):
        ppo.main(*ppo_args(tiny_models, tiny_models / "rm", tmp_path / "norm", reward="segment", c_ent=1.0))


@pytest.mark.launch
def test_rm_norm_standardizes_the_rm_score_and_keeps_eval_raw(tiny_models, tmp_path):
    """ppo.py --rm_norm: the rollouts' RM score is (r - mean) / std with the RM's score_norm.json (fitted on
    the RM split's pairs and written beside an RM that has none, again under other limits); the same seed without
    it logs r. The
    held-out eval/rm stays the raw score. Off by default; refused outside --reward rm, naming the flag."""
    import shutil
    import ppo
    rm_path = tmp_path / "rm"
    shutil.copytree(tiny_models / "rm", rm_path)
    rows = {}
    for name, flags in (("raw", {}), ("norm", {"rm_norm": True})):
        ppo.main(*ppo_args(tiny_models, rm_path, tmp_path / name, steps=1, eval_every=1, policy_lr=0.0, **flags))
        rows[name] = metrics_of(tmp_path / name)[0]
        assert (rm_path / rm.SCORE_FILE).exists() == (name == "norm")
    mean, std = rm.read_score_normalizer(str(rm_path))
    assert std != 1.0 and mean != 0.0
    assert rows["norm"]["reward/rm"] == pytest.approx((rows["raw"]["reward/rm"] - mean) / std, abs=1e-4)
    assert rows["norm"]["eval/rm"] == rows["raw"]["eval/rm"]
    # a run under other limits fits it again (the scores it standardizes are cut at those), and says so
    from stages import ppo_config
    ppo.main(*ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(rm_path), output_dir=str(tmp_path / "longer"),
                         rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=12,
                         n_eval_prompts=4, steps=1, rm_norm=True))
    norm = json.load(open(rm_path / rm.SCORE_FILE))
    assert norm["fitted_with"]["max_response_len"] == 12 and (norm["mean"], norm["std"]) != (mean, std)
    with pytest.raises(SystemExit, match="--rm_norm"):
        ppo.main(*ppo_args(tiny_models, rm_path, tmp_path / "gold", reward="gold", rm_norm=True))
    (rm_path / rm.SCORE_FILE).write_text(json.dumps({"kind": "score", "mean": 0.0, "std": 0.0}))
    with pytest.raises(SystemExit, match="field 'std'"):
        ppo.main(*ppo_args(tiny_models, rm_path, tmp_path / "broken", rm_norm=True))
