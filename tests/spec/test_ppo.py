"""ppo.py: rollout and training forwards agree; n=1 is token-level PPO; every flag runs a step."""
import json
import time

import pytest
import torch

import data
import evaluate
import harness
import macro_actions as ma
import ppo
from stages import ppo_config, ppo_losses
import sandbox
from reference import macro_policy_loss_loop, token_gae
from stages import run_stage

PROMPTS = ["\n\nHuman: how are you\n\nAssistant:", "hi", "\n\nHuman: tell me about the quick brown fox please\n\nAssistant:",
           "\n\nHuman: The quick brown fox (a clever one) jumped over the lazy dog, then what?\n\nAssistant:"]


@pytest.fixture(scope="module")
def policy(tiny_lm):
    return tiny_lm


def test_rollout_logprobs_equal_training_forward_so_the_first_ratio_is_one(policy, tokenizer):
    """generate()'s own (temperature-scaled) scores vs ppo's forward over left-padded prompts."""
    torch.manual_seed(1)
    p_ids, p_mask, _ = data.encode_prompts(tokenizer, PROMPTS, 32)
    out = policy.generate(input_ids=p_ids, attention_mask=p_mask, max_new_tokens=10, do_sample=True,
                          temperature=0.7, top_k=None, top_p=None, output_scores=True, return_dict_in_generate=True,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    r_ids, r_mask = data.cut_after_eos(out.sequences[:, p_ids.shape[1]:], tokenizer.eos_token_id,
                                             tokenizer.pad_token_id)
    gen_logp = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, r_ids.unsqueeze(-1)).squeeze(-1)
    ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
    with torch.no_grad():
        logp, _ = ppo.response_logprobs(policy, ids, mask, p_ids.shape[1], 0.7)
        mb_logp, _ = ppo.response_logprobs(policy, ids[1:3], mask[1:3], p_ids.shape[1], 0.7)
    m = r_mask.bool()
    assert torch.allclose(logp[m], gen_logp[m], atol=1e-4)
    assert torch.allclose((mb_logp - logp[1:3]).exp()[m[1:3]], torch.ones(int(m[1:3].sum())), atol=1e-5)


def reference_token_ppo(logp, old_logp, values, old_values, rewards, mask, clip, value_clip, gamma, lam):
    """Plain token-level PPO, one sample at a time (the textbook losses)."""
    pg_terms, vf_terms = [], []
    for b in range(len(mask)):
        n = int(mask[b].sum())
        adv, returns = token_gae(old_values[b], rewards[b], n, gamma, lam)
        for t in range(n):
            a, ret = adv[t], returns[t]
            ratio = torch.exp(logp[b, t] - old_logp[b, t])
            pg_terms.append(torch.max(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip)))
            vc = old_values[b, t] + (values[b, t] - old_values[b, t]).clamp(-value_clip, value_clip)
            vf_terms.append(0.5 * torch.max((values[b, t] - ret) ** 2, (vc - ret) ** 2))
    return torch.stack(pg_terms).mean(), torch.stack(vf_terms).mean()


def test_n1_is_exactly_token_level_ppo_loss_and_gradients():
    torch.manual_seed(0)
    B, T = 3, 7
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5]).float()
    old_logp, old_values, rewards = -torch.rand(B, T) * mask, torch.randn(B, T) * mask, torch.randn(B, T) * mask
    logp = (old_logp + 0.3 * torch.randn(B, T)).requires_grad_()
    values = (old_values + 0.3 * torch.randn(B, T)).requires_grad_()
    args = ppo_config(n=1, whiten_advantages=False)
    starts = ma.fixed_ngram_starts(mask, 1)
    adv, ret = ma.macro_advantages(old_values, rewards, mask, starts, args.gamma, args.lam)
    pg, vf, _ = ppo_losses(logp, old_logp, values, old_values, adv, ret, mask, starts, clip=args.clip,
                               value_clip=args.value_clip)
    ref_pg, ref_vf = reference_token_ppo(logp, old_logp, values, old_values, rewards, mask, args.clip,
                                         args.value_clip, args.gamma, args.lam)
    assert torch.allclose(pg, ref_pg, atol=1e-6) and torch.allclose(vf, ref_vf, atol=1e-6)
    grads = torch.autograd.grad(pg + vf, [logp, values])
    ref_grads = torch.autograd.grad(ref_pg + ref_vf, [logp, values])
    assert all(torch.allclose(g, r, atol=1e-6) for g, r in zip(grads, ref_grads))


def test_macro_ratio_is_the_product_of_the_token_ratios_of_the_macro_action():
    mask = torch.ones(1, 5)
    starts = torch.tensor([[True, False, False, True, False]])
    old = torch.zeros(1, 5)
    logp = torch.tensor([[0.1, 0.2, -0.05, 0.3, 0.0]])
    adv = torch.ones(1, 5)
    _, _, stats = ppo_losses(logp, old, old, old, adv, old, mask, starts, clip=10.0, ratio="macro")
    expected = torch.tensor([0.25] * 3 + [0.3] * 2).exp().mean()
    assert torch.allclose(stats["policy/ratio"], expected)


def test_macro_ratio_loss_is_a_mean_over_macro_actions_whatever_their_length():
    """Two macro actions, 5 tokens at A = +1 and 1 token at A = -1, at ratio 1: the paper's mean over macro
    actions is 0 (a mean over tokens would give -(5 - 1) / 6). Token ratios stay a mean over tokens."""
    mask, starts = torch.ones(1, 6), torch.tensor([[True, False, False, False, False, True]])
    zeros, adv = torch.zeros(1, 6), torch.tensor([[1.0] * 5 + [-1.0]])
    macro, _, _ = ppo_losses(zeros, zeros, zeros, zeros, adv, zeros, mask, starts, ratio="macro")
    token, _, _ = ppo_losses(zeros, zeros, zeros, zeros, adv, zeros, mask, starts, ratio="token")
    assert macro.item() == pytest.approx(0.0, abs=1e-7) and token.item() == pytest.approx(-4 / 6)


def test_macro_ratio_loss_and_gradient_match_a_loop_over_macro_actions():
    torch.manual_seed(0)
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4, [1] * 2 + [0] * 7, [1] * 7 + [0] * 2]).float()
    starts = ma.randomized_ngram_starts(mask, generator=torch.Generator().manual_seed(1))
    old_logp = -torch.rand(4, 9) * mask
    logp = (old_logp + 0.2 * torch.randn(4, 9)).requires_grad_()
    adv = ma.macro_advantages(torch.randn(4, 9) * mask, torch.randn(4, 9) * mask, mask, starts)[0]
    zeros = torch.zeros(4, 9)
    pg, _, _ = ppo_losses(logp, old_logp, zeros, zeros, adv, zeros, mask, starts, clip=0.2, ratio="macro")
    ref = macro_policy_loss_loop(logp, old_logp, adv, mask, starts, 0.2)
    assert torch.allclose(pg, ref, atol=1e-6)
    assert torch.allclose(torch.autograd.grad(pg, logp)[0], torch.autograd.grad(ref, logp)[0], atol=1e-6)


def test_macro_level_norms_count_each_macro_action_once():
    """adv/l2 counts a macro advantage once per token; adv/l2_macro once per macro action (Fig. 11)."""
    response_mask = torch.ones(1, 4)
    starts = torch.tensor([[True, False, False, True]])
    adv, returns = torch.tensor([[2.0, 2.0, 2.0, 1.0]]), torch.tensor([[3.0, 3.0, 3.0, 0.0]])
    zeros = torch.zeros(1, 4)
    metrics = ppo.iteration_metrics("rm", torch.zeros(1), zeros, zeros, response_mask, starts, zeros,
                                    torch.ones(1, dtype=torch.bool), adv, returns, zeros, {},
                                    [{"loss/policy": torch.tensor(0.0)}])
    assert metrics["adv/l2"].item() == pytest.approx(13 ** 0.5) and metrics["adv/l2_macro"].item() == pytest.approx(5 ** 0.5)
    assert metrics["q/l2"].item() == pytest.approx(27 ** 0.5) and metrics["q/l2_macro"].item() == pytest.approx(3.0)
    assert metrics["macro/mean_len"].item() == pytest.approx(2.0) and "reward/rm" in metrics


def test_update_forward_builds_no_entropy(policy, tokenizer):
    """The entropy is computed only where it is logged, and never with a graph."""
    p_ids, p_mask, _ = data.encode_prompts(tokenizer, PROMPTS, 32)
    logp, entropy = ppo.response_logprobs(policy, p_ids, p_mask, 4, 0.7)
    assert entropy is None and logp.requires_grad
    logp, entropy = ppo.response_logprobs(policy, p_ids, p_mask, 4, 0.7, with_entropy=True)
    assert not entropy.requires_grad and entropy.shape == logp.shape and (entropy >= 0).all()


def test_entropy_is_finite_when_a_logit_is_minus_infinity():
    """A model that rules tokens out with a logit of -inf (a masked or padded vocabulary): the entropy of
    logits [0, 0, -inf] is log 2, not NaN (0 * log 0 counts as 0)."""
    class Masked(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
            logits = torch.tensor([0.0, 0.0, float("-inf")]).expand(*input_ids.shape[:1], logits_to_keep, 3)
            return type("Out", (), {"logits": logits})
    ids, mask = torch.tensor([[2, 0, 1]]), torch.ones(1, 3, dtype=torch.long)
    logp, entropy = ppo.response_logprobs(Masked(), ids, mask, 1, 1.0, with_entropy=True)
    assert torch.allclose(entropy, torch.full((1, 2), torch.log(torch.tensor(2.0)).item()))
    assert torch.allclose(logp, torch.full((1, 2), -torch.log(torch.tensor(2.0)).item()))


def test_dropout_is_found_in_a_module_or_a_config(policy):
    """A model that drops anything in train mode is never fused: its update forward would differ from step 2's."""
    import copy
    assert not harness.has_dropout(policy)
    dropping = copy.deepcopy(policy)
    dropping.config.attention_dropout = 0.1
    assert harness.has_dropout(dropping)
    dropping.config.attention_dropout = 0.0
    dropping.model.layers[0].mlp.act_fn = torch.nn.Sequential(dropping.model.layers[0].mlp.act_fn, torch.nn.Dropout(0.1))
    assert harness.has_dropout(dropping)


def test_several_minibatches_epochs_or_accumulation_run_their_own_forwards(tiny_lm, tiny_models):
    import dataclasses
    args = ppo.PPOArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), mini_batch_size=4,
                       rollout_batch_size=4)
    acc = ppo.harness.make_accelerator()
    assert ppo.reusable_forwards(acc, tiny_lm, tiny_lm, args)
    for changed in [{"mini_batch_size": 2}, {"ppo_epochs": 2}, {"grad_accum": 2}]:
        assert not ppo.reusable_forwards(acc, tiny_lm, tiny_lm, dataclasses.replace(args, **changed))


def test_the_update_backpropagates_the_policy_before_the_critics_forward(tiny_models):
    """One model's graph alive at a time in the update (its peak memory holds one, not both): in every minibatch the
    policy's forward, its backward, then the critic's forward. The numbers are those of both forwards first
    (bench/same_numbers.py): the two graphs share nothing."""
    from transformers import AutoModelForCausalLM
    import reward_model as rm
    acc = harness.make_accelerator()
    policy = AutoModelForCausalLM.from_pretrained(tiny_models / "sft")
    critic = rm.Critic(rm.load_reward_model(str(tiny_models / "rm"))[0])
    events = []
    policy.register_forward_pre_hook(lambda *a: events.append("policy forward"))
    policy.model.norm.weight.register_hook(lambda g: events.append("policy backward"))
    critic.register_forward_pre_hook(lambda *a: events.append("critic forward"))
    opts, scheds = harness.adamw_with_warmup([(policy, 1e-3), (critic, 1e-3)], 1)
    trained = []
    for model, opt, sched in zip((policy, critic), opts, scheds):
        model, opt = acc.prepare(model, opt)
        trained.append(harness.Trained(model, acc, opt, sched))
    torch.manual_seed(0)
    B, P, R = 4, 5, 6
    mask = torch.ones(B, R)
    batch = {"ids": torch.randint(5, 300, (B, P + R)), "attention_mask": torch.ones(B, P + R, dtype=torch.long),
             "old_logp": torch.full((B, R), -5.0), "advantages": torch.randn(B, R), "response_mask": mask,
             "starts": mask.bool(), "old_values": torch.zeros(B, R), "returns": torch.randn(B, R)}
    ppo.ppo_update(*trained, batch, ppo.PPOArgs(ppo_epochs=2, mini_batch_size=2), ppo.cf.CreditArgs(),
                   train_policy=True,
                   generator=torch.Generator().manual_seed(0), prompt_width=P, beta=0.0, step=0)
    assert events == ["policy forward", "policy backward", "critic forward"] * 4


def test_grad_accum_never_steps_across_iterations(tiny_models, tmp_path):
    """Two minibatches an iteration and --grad_accum 3: each iteration steps once on its own two (their
    mean), so 3 iterations make 3 AdamW steps per model, never one on two iterations' gradients."""
    args = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                       steps=3, rollout_batch_size=8, mini_batch_size=4, grad_accum=3, save_every=3,
                       max_prompt_len=16, max_response_len=8, n_eval_prompts=4, eval_every=100)
    ppo.main(*args)
    state = torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=False)
    for opt in ("policy_opt", "critic_opt"):
        steps = {int(s["step"]) for s in state[opt]["state"].values()}
        assert steps == {3}, (opt, steps)


def test_gold_reward_needs_a_task_with_a_gold_judge(tiny_models, tmp_path):
    args = ppo_config(task="tldr", reward="gold", sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                       output_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="needs a task with a gold judge"):
        ppo.main(*args)


def test_execution_reward_runs_prefix_plus_response():
    problems = [{"prefix": "def inc(x):\n", "tests": {"fn_name": "inc", "inputs": [[1]], "outputs": [2]}},
                {"prefix": "", "tests": {"inputs": ["3\n"], "outputs": ["6\n"]}},
                {"prefix": "def inc(x):\n", "tests": {"fn_name": "inc", "inputs": [[1]], "outputs": [2]}}]
    reward, passed = sandbox.execution_reward(problems, ["    return x + 1\n", "print(int(input()) * 2)", "    return (\n"])
    assert reward == [1.0, 1.0, -1.0] and passed == [1.0, 1.0, 0.0]


def test_adaptive_beta_follows_ziegler_et_al_against_a_hand_written_reference():
    """beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon), written out case by case."""
    def reference(beta, kl, target, n, horizon):
        error = kl / target - 1
        if error > 0.2:
            error = 0.2
        if error < -0.2:
            error = -0.2
        return beta * (1 + error * n / horizon)

    for kl in (0.0, 0.5, 0.9, 1.0, 1.1, 1.19, 3.0, 100.0):
        for n, horizon in ((16, 10000), (16, 32), (64, 64)):
            assert ppo.adaptive_beta(0.05, kl, 1.0, n, horizon) == pytest.approx(reference(0.05, kl, 1.0, n, horizon),
                                                                                 rel=1e-12)
    assert ppo.adaptive_beta(0.05, 3.0, 1.0, 16, 16) == pytest.approx(0.06)      # +20% at most per horizon
    assert ppo.adaptive_beta(0.05, 0.0, 1.0, 16, 16) == pytest.approx(0.04)      # -20% at most
    assert ppo.adaptive_beta(0.05, 7.0, 0.0, 16, 16) == 0.05                     # target 0: a fixed beta


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_count_with_a_chat_template_gives_the_gold_judge_the_raw_prompt(tiny_models, tmp_path):
    """--chat_template renders "Count from a to b." into the template's own turns; the gold judge parses the
    task's raw prompt, in PPO's training score, its evaluation and final report, and the RM's agreement."""
    import shutil
    from transformers import AutoTokenizer
    for part in ("sft", "rm"):
        shutil.copytree(tiny_models / part, tmp_path / part)
        tok = AutoTokenizer.from_pretrained(tmp_path / part)
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(tmp_path / part)
    args = ppo_config(task="count", reward="gold", chat_template=True, sft_path=str(tmp_path / "sft"),
                       rm_path=str(tmp_path / "rm"), output_dir=str(tmp_path / "ppo"), steps=1, rollout_batch_size=4,
                       mini_batch_size=2, max_prompt_len=32, max_response_len=8, n_eval_prompts=4)
    ppo.main(*args)
    row = [json.loads(line) for line in open(tmp_path / "ppo" / "metrics.jsonl")][0]
    assert 0.0 <= row["reward/gold"] <= 1.0 and 0.0 <= row["eval/gold"] <= 1.0
    out = run_stage("reward_model.py", "--task", "count", "--sft_path", tmp_path / "sft", "--output_dir",
                    tmp_path / "rm2", "--chat_template", "--max_steps", "1", "--batch_size", "2", "--n_eval", "4",
                    "--n_gold_prompts", "4", "--max_response_len", "8")
    assert "RM-gold agreement on" in out


def test_sampling_ignores_a_saved_generation_config_that_would_change_the_distribution(policy, tokenizer, tmp_path):
    """A model whose generation_config.json says repetition_penalty=1.3: data.sample draws the same tokens as
    from the plain model (same seed), with a warning, and generate()'s distribution under the config data.sample
    builds is the one ppo's logprobs take (so the first PPO ratio is exactly 1)."""
    import copy
    peaked = copy.deepcopy(policy)
    with torch.no_grad():
        peaked.model.embed_tokens.weight.mul_(30)          # peaked logits: repeats likely, the penalty bites
    penalized = copy.deepcopy(peaked)
    penalized.generation_config.repetition_penalty = 1.3
    penalized.save_pretrained(tmp_path / "penalized")
    penalized = type(policy).from_pretrained(tmp_path / "penalized").eval()
    assert penalized.generation_config.repetition_penalty == 1.3
    draws = []
    for model in (peaked, penalized):
        torch.manual_seed(3)
        draws.append(data.sample(model, tokenizer, PROMPTS, 32, 24, temperature=0.7)[2])
    assert torch.equal(draws[0], draws[1])
    with pytest.warns(UserWarning, match="repetition_penalty"):
        config = data.generation_config(penalized, 12, 0.7, 0, 1.0, False, tokenizer.pad_token_id, tokenizer.eos_token_id)
    p_ids, p_mask, _ = data.encode_prompts(tokenizer, PROMPTS, 32)
    torch.manual_seed(4)
    with data.saved_generation_config_off(penalized):
        out = penalized.generate(input_ids=p_ids, attention_mask=p_mask, generation_config=config,
                                 output_scores=True, return_dict_in_generate=True)
    r_ids, r_mask = data.cut_after_eos(out.sequences[:, p_ids.shape[1]:], tokenizer.eos_token_id, tokenizer.pad_token_id)
    gen_logp = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, r_ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        logp, _ = ppo.response_logprobs(penalized, torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1),
                                        p_ids.shape[1], 0.7)
    assert torch.allclose(logp[r_mask.bool()], gen_logp[r_mask.bool()], atol=1e-4)


def test_the_policys_own_generation_config_leaves_nothing_to_the_saved_one(policy, tokenizer, tmp_path):
    """ppo.py's step 1: data.own_generation_config makes the rollout's config the model's own, so that a plain
    generate() with it (no swap) draws what data.sample draws from the plain model, whatever the saved file says
    (repetition_penalty=1.3 here), with the warning; without it, generate() would take the saved penalty."""
    import copy
    peaked = copy.deepcopy(policy)
    with torch.no_grad():
        peaked.model.embed_tokens.weight.mul_(30)          # peaked logits: repeats likely, the penalty bites
    peaked.save_pretrained(tmp_path / "penalized")
    peaked.generation_config.repetition_penalty = 1.3
    peaked.generation_config.save_pretrained(tmp_path / "penalized")
    p_ids, p_mask, _ = data.encode_prompts(tokenizer, PROMPTS, 32)
    P, draws = p_ids.shape[1], []
    for own in (False, True):
        penalized = type(policy).from_pretrained(tmp_path / "penalized").eval()
        with pytest.warns(UserWarning, match="repetition_penalty"):
            config = (data.own_generation_config(penalized, tokenizer, 24, 0.7, 0, 1.0) if own else
                      data.generation_config(penalized, 24, 0.7, 0, 1.0, False, tokenizer.pad_token_id,
                                             tokenizer.eos_token_id))
        assert (penalized.generation_config is config) == own
        torch.manual_seed(3)
        draws.append(penalized.generate(input_ids=p_ids, attention_mask=p_mask, generation_config=config)[:, P:])
    torch.manual_seed(3)
    plain = data.sample(type(policy).from_pretrained(tmp_path / "penalized").eval(), tokenizer, PROMPTS, 32, 24,
                        temperature=0.7)[2]
    assert torch.equal(data.cut_after_eos(draws[1], tokenizer.eos_token_id, tokenizer.pad_token_id)[0], plain)
    assert not torch.equal(draws[0], draws[1])      # the saved penalty, had the config not been the model's own


def test_training_warns_when_the_policys_replies_are_degenerate(tiny_models, parrot, capsys):
    """ppo.py's held-out evaluation (evaluate.during_training) of a policy that says one word over and over: its distinct-2 is below half
    the SFT model's, and the log says so, what it means and what to do."""
    from transformers import AutoModelForCausalLM
    import evaluate
    import harness
    import reward_model as rm
    args, *extensions = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                                      max_prompt_len=16, max_response_len=12)
    ppo.resolve(args, *extensions)
    tokenizer = data.load_tokenizer(args.sft_path)
    rows = data.first_row_per_prompt(data.load_task("chitchat", only=("test",))["test"])[:16]
    load = (lambda path: AutoModelForCausalLM.from_pretrained(path).eval())
    sft_replies, metrics = {}, {"step": 20, "kl": 40.0, "reward/rm": 0.5}
    for policy in (load(tiny_models / "sft"), load(parrot)):
        sampling = evaluate.Sampling(args.task, args.max_prompt_len, args.max_response_len, seed=args.seed)
        metrics.pop("time/eval", None)
        start = time.time()
        evaluate.during_training(metrics, sampling, accelerator=harness.make_accelerator(), policy=policy,
                         reward_model=rm.load_reward_model(args.rm_path)[0], tokenizer=tokenizer, eval_rows=rows,
                         sft=(load(tiny_models / "sft"), sft_replies))
        printed = capsys.readouterr().out
        assert 0 < metrics["time/eval"] <= time.time() - start + 1e-3       # the evaluation's own seconds
        if policy.name_or_path.endswith("sft"):
            assert "warning" not in printed and metrics["eval/distinct_2"] == metrics["eval/sft_distinct_2"]
    assert metrics["eval/distinct_2"] < 0.5 * metrics["eval/sft_distinct_2"] and metrics["eval/repetition"] > 0.5
    assert "[ppo] warning: the policy's replies are degenerate" in printed and "being gamed" in printed
    assert "--beta" in printed and "eval/gold_strict" in printed
