"""The launch tests of test_critic_free.py: ppo.py and sandbox.py run in processes of their own."""
import pytest
import torch

from test_critic_free import ppo_args


def metrics_of(out):
    import json
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.launch
def test_group_rollout_samples_each_prompt_k_times_in_adjacent_rows(tiny_models, tmp_path, monkeypatch):
    """--rollout_batch_size 4 --group_size 2: two prompts, each twice, side by side (data.encode_prompts, spied on)."""
    import data
    import ppo
    asked, encode = [], data.encode_prompts
    monkeypatch.setattr(data, "encode_prompts", lambda tokenizer, prompts, *a, **k: asked.append(prompts) or
                        encode(tokenizer, prompts, *a, **k))
    ppo.main(*ppo_args(tiny_models, tmp_path, steps=1, advantage="group", group_size=2))
    prompts = asked[0]
    assert len(prompts) == 4 and prompts[0] == prompts[1] != prompts[2] == prompts[3]


@pytest.mark.launch
@pytest.mark.parametrize("flags", [
    {"advantage": "group"}, {"advantage": "group", "group_norm": "none", "ratio": "macro"},
    {"advantage": "group", "group_norm": "loo", "ratio": "sequence", "kl_estimator": "k3"},
    {"advantage": "mc", "mc_points": 2, "mc_rollouts": 2},
    {"advantage": "mc", "mc_points": 0, "mc_rollouts": 1, "termination": "ppl", "ratio": "sequence"},
    {"advantage": "mc", "mc_rollouts": 2, "termination": "parsing", "ratio": "macro", "lora_r": 4},
    {"advantage": "group", "group_size": 2, "lora_r": 4, "termination": "randomized"},
    {"advantage": "group", "kl_penalty": "loss"}, {"advantage": "mc", "mc_rollouts": 2, "kl_penalty": "loss"},
    {"advantage": "group", "group_size": 2, "termination": "entropy"},
    {"advantage": "mc", "mc_rollouts": 2, "termination": "segment", "c_ent": 2.0, "ratio": "macro"},
    {"advantage": "group", "group_size": 2, "task": "count", "reward": "gold", "ratio": "sequence"},
    {"advantage": "mc", "mc_rollouts": 2, "mc_points": 2, "task": "count", "reward": "gold"},
])
def test_every_advantage_kind_runs_without_a_critic(tiny_models, tmp_path, flags):
    import ppo
    ppo.main(*ppo_args(tiny_models, tmp_path, steps=1, **flags))
    [row] = metrics_of(tmp_path)
    assert all(v == v for v in row.values())                                       # no NaN
    assert not {"loss/value", "value/explained_variance", "q/l2", "value/grad_norm"} & row.keys()   # no critic
    if flags["advantage"] == "mc":
        cap = flags.get("mc_points", 4) or float("inf")
        assert 1 <= row["mc/points"] <= min(cap, row["response/len"]) and row["time/mc"] > 0


@pytest.mark.launch
def test_kl_penalty_loss_takes_the_kl_out_of_the_rewards_and_into_the_loss(tiny_models, tmp_path):
    """Iteration 2 (the policy has moved): under --kl_penalty reward the rewards hold -beta * KL beside the score,
    under loss they hold the score alone and the loss logs its k3."""
    import ppo
    rows = {}
    for where in ("reward", "loss"):
        ppo.main(*ppo_args(tiny_models, tmp_path / where, steps=2, advantage="group", kl_penalty=where, beta=0.5,
                          policy_lr=0.05))
        rows[where] = metrics_of(tmp_path / where)[1]
    reward, loss = rows["reward"], rows["loss"]
    assert reward["kl"] != 0 and loss["kl"] != 0 and "loss/kl" not in reward and loss["loss/kl"] > 0
    assert reward["reward/total"] == pytest.approx(reward["reward/rm"] - 0.5 * reward["kl"], abs=1e-4)
    assert loss["reward/total"] == pytest.approx(loss["reward/rm"], abs=1e-5)


@pytest.mark.launch
@pytest.mark.parametrize("kind", ["group", "mc"])
def test_no_critic_is_checkpointed_and_a_resume_is_exact(tiny_models, tmp_path, kind):
    import ppo
    from stages import comparable
    flags = {"advantage": kind, "mc_rollouts": 2, "mc_points": 2, "group_size": 2, "eval_every": 1000}
    ppo.main(*ppo_args(tiny_models, tmp_path / "whole", steps=4, **flags))
    ppo.main(*ppo_args(tiny_models, tmp_path / "split", steps=2, save_every=2, **flags))
    checkpoint = tmp_path / "split" / "checkpoint"
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    assert (checkpoint / "policy").exists() and not [p for p in checkpoint.iterdir() if "critic" in p.name]
    assert "policy_opt" in state and not [k for k in state if "critic" in k]
    ppo.main(*ppo_args(tiny_models, tmp_path / "split", steps=4, resume=True, **flags))
    whole, split = metrics_of(tmp_path / "whole"), metrics_of(tmp_path / "split")
    assert len(split) == 4 and [comparable(r) for r in split] == [comparable(r) for r in whole]


@pytest.mark.launch
@pytest.mark.parametrize("kind", ["group", "mc"])
def test_the_code_task_runs_its_programs_for_every_sample_and_continuation(tiny_models, tmp_path, kind):
    """The execution reward (sandbox.py) scores the rollout and, under mc, every continuation."""
    import ppo
    ppo.main(*ppo_args(tiny_models, tmp_path, steps=1, task="code", advantage=kind, group_size=2, mc_rollouts=2,
                      mc_points=2))
    [row] = metrics_of(tmp_path)
    assert "reward/exec" in row and "reward/pass_rate" in row and "loss/value" not in row


@pytest.mark.launch
@pytest.mark.parametrize("kind", ["group", "mc"])
def test_one_minibatch_reuses_the_policys_scoring_forward_without_a_critic(tiny_models, tmp_path, monkeypatch, kind):
    """One epoch over one minibatch: the update takes its rows of step 2's policy forward (there is no critic's);
    the numbers of two iterations are those of separate forwards."""
    import ppo
    from stages import comparable

    def run(out):
        ppo.main(*ppo_args(tiny_models, out, steps=2, mini_batch_size=4, advantage=kind, group_size=2, mc_rollouts=2))
        return [comparable(r) for r in metrics_of(out)]

    fused_update, taken = ppo.reusable_forwards, []
    monkeypatch.setattr(ppo, "reusable_forwards", lambda *a: taken.append(fused_update(*a)) or taken[-1])
    fused = run(tmp_path / "fused")
    monkeypatch.setattr(ppo, "reusable_forwards", lambda *a: False)
    assert taken == [True] and fused == run(tmp_path / "separate")     # decided once, at setup


@pytest.mark.launch
def test_a_critics_advantages_under_the_sequence_ratio(tiny_models, tmp_path):
    """--ratio sequence is one more ratio for every advantage kind, gae with its critic too: both models train, and
    after the first minibatch's step (the second minibatch's ratios are no longer 1) the policy's loss is not the
    token ratio's."""
    import ppo
    rows = {}
    for ratio in ("sequence", "token"):
        ppo.main(*ppo_args(tiny_models, tmp_path / ratio, steps=2, ratio=ratio, policy_lr=0.05))
        rows[ratio] = metrics_of(tmp_path / ratio)
    assert all(v == v for row in rows["sequence"] for v in row.values())
    assert rows["sequence"][1]["value/grad_norm"] > 0 and rows["sequence"][1]["policy/grad_norm"] > 0
    assert rows["sequence"][0]["loss/policy"] != pytest.approx(rows["token"][0]["loss/policy"], abs=1e-7)


@pytest.fixture(scope="module")
def stopper(tiny_models, tmp_path_factory):
    """The tiny SFT model with its EOS logit raised (the EOS row of the tied embeddings moved along the mean final
    hidden state): its responses end at many lengths, as a trained model's do, where the random model's all run to
    --max_response_len. A batch of equal lengths hides a re-centring: each group's advantages sum to 0, and so the
    batch's token mean is 0."""
    import harness
    from transformers import AutoModelForCausalLM
    import data
    tokenizer = data.load_tokenizer(str(tiny_models / "sft"))
    model = AutoModelForCausalLM.from_pretrained(tiny_models / "sft").eval()
    batch = tokenizer(["\n\nHuman: how are you\n\nAssistant:", "hi", "Then it ran"], return_tensors="pt", padding=True)
    with torch.no_grad():
        direction = model.model(**batch).last_hidden_state[batch.attention_mask.bool()].mean(0)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] += 3 * direction / direction.norm() ** 2
    path = tmp_path_factory.mktemp("stopper") / "sft"
    harness.atomic_save(str(path), model, tokenizer)
    return path


def run_capturing(tiny_models, out, monkeypatch, **flags):
    """ppo.main for 2 iterations (the second's KL not 0), the advantages of each: as the estimator gave them
    (macro_actions.macro_advantages under gae, critic_free.advantages without a critic) and as the update received
    them, with the response mask and the policy loss's Dr. GRPO budget."""
    import critic_free
    import macro_actions
    import ppo
    seen = []
    estimator = critic_free if flags.get("advantage", "gae") != "gae" else macro_actions
    name = "advantages" if estimator is critic_free else "macro_advantages"
    estimate, ppo_update, policy_loss = getattr(estimator, name), ppo.ppo_update, ppo.policy_loss

    def spy(*a, **k):
        out = estimate(*a, **k)
        seen.append({"raw": out[0]})
        return out
    monkeypatch.setattr(estimator, name, spy)
    monkeypatch.setattr(ppo, "ppo_update", lambda policy, critic, batch, *a, **k: seen[-1].update(
        sent=batch["advantages"], mask=batch["response_mask"]) or ppo_update(policy, critic, batch, *a, **k))
    monkeypatch.setattr(ppo, "policy_loss", lambda *a: seen[-1].update(budget=a[-1]) or policy_loss(*a))
    ppo.main(*ppo_args(tiny_models, out, steps=2, policy_lr=0.05, beta=0.5, **flags))
    return seen


@pytest.mark.launch
@pytest.mark.parametrize("flags", [{"advantage": "group", "group_size": 2}, {"advantage": "group", "group_norm": "none",
                                   "group_size": 2}, {"advantage": "mc", "mc_rollouts": 2, "mc_points": 2}])
def test_whitening_scales_the_critic_free_advantages_and_never_shifts_them(tiny_models, stopper, tmp_path, monkeypatch,
                                                                           flags):
    """What the update reads is the estimator's advantages times one positive number per iteration (a zero
    stays zero, a sign stays), where the full whitening subtracted the batch's mean: responses of many lengths
    (`stopper`), so that the mean is not 0. --group_norm none divides its policy loss by rows x --max_response_len
    (Dr. GRPO); the others by the tokens."""
    shifted = 0
    for it in run_capturing(tiny_models, tmp_path, monkeypatch, sft_path=str(stopper), rollout_batch_size=8,
                            mini_batch_size=4, **flags):
        raw, sent, tokens = it["raw"], it["sent"], it["mask"].bool()
        shifted += abs(raw[tokens].mean().item()) > 1e-3          # a mean the full whitening would subtract
        scale = (sent[tokens] / raw[tokens])[raw[tokens] != 0]      # none when every group ties
        assert (scale > 0).all() and torch.allclose(scale, scale[:1].expand_as(scale), rtol=1e-4)
        assert (sent[tokens][raw[tokens] == 0] == 0).all() and (sent[~tokens] == 0).all()
        assert it["budget"] == (8 if flags.get("group_norm") == "none" else 0)
    assert shifted


@pytest.mark.launch
def test_gae_advantages_are_still_whitened_to_mean_zero(tiny_models, tmp_path, monkeypatch):
    for it in run_capturing(tiny_models, tmp_path, monkeypatch):
        tokens = it["mask"].bool()
        assert abs(it["sent"][tokens].mean().item()) < 1e-5 and it["budget"] == 0


@pytest.mark.launch
def test_a_groups_rewards_are_score_minus_beta_times_the_summed_kl_under_every_reward_agg(tiny_models, tmp_path,
                                                                                         monkeypatch):
    """Under --reward_agg mean / released R_i used to sum each macro action's averaged KL; R_i is the documented
    score - beta sum_t KL_t whatever --reward_agg says (it aggregates macro rewards: a group has one per sample), so
    the three give the same advantages, at iteration 2 where the KL is not 0 (at n = 5, beta 0.5)."""
    got = {agg: run_capturing(tiny_models, tmp_path / agg, monkeypatch, advantage="group", group_size=2, reward_agg=agg,
                              whiten_advantages=False)
           for agg in ("sum", "mean", "released")}
    assert metrics_of(tmp_path / "sum")[1]["kl"] != 0
    for agg in ("mean", "released"):
        for a, b in zip(got["sum"], got[agg]):
            assert torch.equal(a["raw"], b["raw"]), agg
