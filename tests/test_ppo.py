"""ppo.py: rollout and training forwards agree; n=1 is token-level PPO; every flag runs a step."""
import json
import os
import subprocess
import sys

import pytest
import torch

import data
import macro_actions as ma
import ppo
import sandbox
from reference import macro_policy_loss_loop, token_gae
from stages import comparable, run_stage

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
    args = ppo.PPOArgs(n=1, whiten_advantages=False)
    starts = ma.fixed_ngram_starts(mask, 1)
    adv, ret = ma.macro_advantages(old_values, rewards, mask, starts, args.gamma, args.lam)
    pg, vf, _ = ppo.ppo_losses(logp, old_logp, values, old_values, adv, ret, mask, starts, clip=args.clip,
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
    _, _, stats = ppo.ppo_losses(logp, old, old, old, adv, old, mask, starts, clip=10.0, ratio="macro")
    expected = torch.tensor([0.25] * 3 + [0.3] * 2).exp().mean()
    assert torch.allclose(stats["policy/ratio"], expected)


def test_macro_ratio_loss_is_a_mean_over_macro_actions_whatever_their_length():
    """Two macro actions, 5 tokens at A = +1 and 1 token at A = -1, at ratio 1: the paper's mean over macro
    actions is 0 (a mean over tokens would give -(5 - 1) / 6). Token ratios stay a mean over tokens."""
    mask, starts = torch.ones(1, 6), torch.tensor([[True, False, False, False, False, True]])
    zeros, adv = torch.zeros(1, 6), torch.tensor([[1.0] * 5 + [-1.0]])
    macro, _, _ = ppo.ppo_losses(zeros, zeros, zeros, zeros, adv, zeros, mask, starts, ratio="macro")
    token, _, _ = ppo.ppo_losses(zeros, zeros, zeros, zeros, adv, zeros, mask, starts, ratio="token")
    assert macro.item() == pytest.approx(0.0, abs=1e-7) and token.item() == pytest.approx(-4 / 6)


def test_macro_ratio_loss_and_gradient_match_a_loop_over_macro_actions():
    torch.manual_seed(0)
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4, [1] * 2 + [0] * 7, [1] * 7 + [0] * 2]).float()
    starts = ma.randomized_ngram_starts(mask, generator=torch.Generator().manual_seed(1))
    old_logp = -torch.rand(4, 9) * mask
    logp = (old_logp + 0.2 * torch.randn(4, 9)).requires_grad_()
    adv = ma.macro_advantages(torch.randn(4, 9) * mask, torch.randn(4, 9) * mask, mask, starts)[0]
    zeros = torch.zeros(4, 9)
    pg, _, _ = ppo.ppo_losses(logp, old_logp, zeros, zeros, adv, zeros, mask, starts, clip=0.2, ratio="macro")
    ref = macro_policy_loss_loop(logp, old_logp, adv, mask, starts, 0.2)
    assert torch.allclose(pg, ref, atol=1e-6)
    assert torch.allclose(torch.autograd.grad(pg, logp)[0], torch.autograd.grad(ref, logp)[0], atol=1e-6)


def test_macro_level_norms_count_each_macro_action_once():
    """adv/l2 counts a macro advantage once per token; adv/l2_macro once per macro action (Fig. 11)."""
    response_mask = torch.ones(1, 4)
    starts = torch.tensor([[True, False, False, True]])
    adv, returns = torch.tensor([[2.0, 2.0, 2.0, 1.0]]), torch.tensor([[3.0, 3.0, 3.0, 0.0]])
    it = ppo.Iteration(score=torch.zeros(1), passed=None, token_rewards=torch.zeros(1, 4), kl=torch.zeros(1, 4),
                       entropy=torch.zeros(1, 4), response_mask=response_mask, starts=starts, old_values=torch.zeros(1, 4),
                       advantages=adv, returns=returns, has_eos=torch.ones(1, dtype=torch.bool), parse_fallback=0.0,
                       update_stats=[{"loss/policy": torch.tensor(0.0)}])
    metrics = ppo.iteration_metrics(it, "rm")
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


@pytest.mark.parametrize("flags", [
    {"n": 1}, {"n": 0}, {"termination": "randomized"}, {"termination": "ppl"}, {"termination": "parsing"},
    {"termination": "entropy", "entropy_threshold": 1.0}, {"sigma": "unit"}, {"sigma": "position"},
    {"sigma": "first"}, {"reward_agg": "mean"}, {"reward_agg": "released"}, {"ratio": "macro"}, {"critic_path": "SFT"}, {"kl_estimator": "k3"},
    {"top_k": 5, "top_p": 0.9, "missing_eos_penalty": -1.0, "whiten_advantages": False, "ppo_epochs": 2},
])
@pytest.mark.launch
def test_every_flag_runs_one_iteration(tiny_models, tmp_path, flags):
    flags = {k: str(tiny_models / "sft") if v == "SFT" else v for k, v in flags.items()}
    args = ppo.PPOArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                       steps=1, rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=8,
                       n_eval_prompts=4, **flags)
    ppo.main(args)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 1 and all(v == v for v in rows[0].values())           # no NaN
    assert os.path.exists(tmp_path / "policy" / "model.safetensors")
    if flags.get("n") == 1:
        assert rows[0]["macro/mean_len"] == 1.0
        assert rows[0]["adv/l2_macro"] == pytest.approx(rows[0]["adv/l2"], rel=1e-4)


def test_dropout_is_found_in_a_module_or_a_config(policy):
    """A model that drops anything in train mode is never fused: its update forward would differ from step 2's."""
    import copy
    assert not ppo.has_dropout(policy)
    dropping = copy.deepcopy(policy)
    dropping.config.attention_dropout = 0.1
    assert ppo.has_dropout(dropping)
    dropping.config.attention_dropout = 0.0
    dropping.model.layers[0].mlp.act_fn = torch.nn.Sequential(dropping.model.layers[0].mlp.act_fn, torch.nn.Dropout(0.1))
    assert ppo.has_dropout(dropping)


@pytest.mark.launch
@pytest.mark.parametrize("flags", [{"termination": "randomized"}, {"critic_warmup": 1}, {"lora_r": 4}])
def test_one_minibatch_reuses_the_scoring_forwards_with_the_numbers_of_separate_ones(tiny_models, tmp_path,
                                                                                  monkeypatch, flags):
    """One epoch over one minibatch: the update takes the policy's and critic's rows of step 2's forwards.
    The metrics of two iterations equal those of the same run with separate update forwards (the
    minibatch order, drawn after the randomized n-grams, gathers the rows), and the only ratio of each
    iteration is exactly 1 (old = detached new). Under the critic warm-up the policy's graph is dropped."""
    def metrics(out):
        args = ppo.PPOArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(out),
                           steps=2, rollout_batch_size=4, mini_batch_size=4, max_prompt_len=16, max_response_len=8,
                           n_eval_prompts=4, **flags)
        ppo.main(args)
        return [comparable(json.loads(line)) for line in open(out / "metrics.jsonl")]

    fused_update, taken = ppo.fused_update, []
    monkeypatch.setattr(ppo, "fused_update", lambda *a: taken.append(fused_update(*a)) or taken[-1])
    fused = metrics(tmp_path / "fused")
    assert taken == [True, True]
    monkeypatch.setattr(ppo, "fused_update", lambda *a: False)
    separate = metrics(tmp_path / "separate")
    assert fused == separate
    for row in fused:
        assert row["policy/ratio"] == 1.0 and row["policy/approxkl"] == 0.0 and row["policy/clipfrac"] == 0.0


def test_several_minibatches_epochs_or_accumulation_run_their_own_forwards(tiny_lm, tiny_models):
    args = ppo.PPOArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), mini_batch_size=4)
    acc = ppo.harness.make_accelerator()
    fused = (lambda a: ppo.fused_update(acc, tiny_lm, tiny_lm, 4, a.mini_batch_size, a.ppo_epochs, a.grad_accum))
    assert fused(args)
    for changed in [{"mini_batch_size": 2}, {"ppo_epochs": 2}, {"grad_accum": 2}]:
        assert not fused(ppo.PPOArgs(**{**vars(args), **changed}))


def test_grad_accum_never_steps_across_iterations(tiny_models, tmp_path):
    """Two minibatches an iteration and --grad_accum 3: each iteration steps once on its own two (their
    mean), so 3 iterations make 3 AdamW steps per model, never one on two iterations' gradients."""
    args = ppo.PPOArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                       steps=3, rollout_batch_size=8, mini_batch_size=4, grad_accum=3, save_every=3,
                       max_prompt_len=16, max_response_len=8, n_eval_prompts=4, eval_every=100)
    ppo.main(args)
    state = torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=False)
    for opt in ("policy_opt", "critic_opt"):
        steps = {int(s["step"]) for s in state[opt]["state"].values()}
        assert steps == {3}, (opt, steps)


@pytest.mark.launch
@pytest.mark.parametrize("flags", [{"n": 10}, {"termination": "parsing"}])
def test_code_task_uses_the_execution_reward(tiny_models, tmp_path, flags):
    """No reward model: the critic starts from the SFT model and the score is running the program."""
    args = ppo.PPOArgs(task="code", sft_path=str(tiny_models / "sft"), rm_path=str(tmp_path / "no_rm"),
                       output_dir=str(tmp_path), steps=1, rollout_batch_size=4, mini_batch_size=2,
                       max_prompt_len=48, max_response_len=8, n_eval_prompts=4, **flags)
    ppo.main(args)
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
    args = ppo.PPOArgs(task="count", reward="gold", sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                       output_dir=str(tmp_path), steps=1, rollout_batch_size=4, mini_batch_size=2, n_eval_prompts=4)
    ppo.main(args)
    row = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][0]
    assert args.max_response_len == 64 and "reward/rm" not in row
    assert 0.0 <= row["reward/gold"] <= 1.0 and 0.0 <= row["eval/gold"] <= 1.0 and "eval/rm" in row
    assert row["response/len"] > 32                 # the random policy seldom says EOS: it runs past chitchat's 32
    assert "mean gold score" in open(tmp_path / "summary.md").read()


def test_gold_reward_needs_a_task_with_a_gold_judge(tiny_models, tmp_path):
    args = ppo.PPOArgs(task="tldr", reward="gold", sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                       output_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="needs a task with a gold judge"):
        ppo.main(args)


def test_execution_reward_runs_prefix_plus_response():
    problems = [{"prefix": "def inc(x):\n", "tests": {"fn_name": "inc", "inputs": [[1]], "outputs": [2]}},
                {"prefix": "", "tests": {"inputs": ["3\n"], "outputs": ["6\n"]}},
                {"prefix": "def inc(x):\n", "tests": {"fn_name": "inc", "inputs": [[1]], "outputs": [2]}}]
    reward, passed = sandbox.execution_reward(problems, ["    return x + 1\n", "print(int(input()) * 2)", "    return (\n"])
    assert reward == [1.0, 1.0, -1.0] and passed == [1.0, 1.0, 0.0]


def run_ppo(tiny_models, out, *extra, here=False):
    """ppo.py on the tiny models: its own process, or in this one (`here`)."""
    cmd = ["ppo.py", "--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"),
           "--output_dir", str(out), "--rollout_batch_size", "4", "--mini_batch_size", "2", "--max_prompt_len", "16",
           "--max_response_len", "8", "--n_eval_prompts", "4", "--eval_every", "2", "--plot", "false", *extra]
    if here:
        return run_stage(*cmd), [json.loads(line) for line in open(out / "metrics.jsonl")]
    proc = subprocess.run([sys.executable, *cmd], cwd=os.path.dirname(os.path.dirname(__file__)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout, [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.launch
def test_resume_continues_with_the_numbers_of_an_uninterrupted_run(tiny_models, tmp_path, uninterrupted):
    run_ppo(tiny_models, tmp_path / "split", "--steps", "3", "--save_every", "3", here=True)
    out, rest = run_ppo(tiny_models, tmp_path / "split", "--steps", "5", "--save_every", "3", "--resume", here=True)
    assert "resumed at iteration 3" in out
    assert [comparable(r) for r in rest] == [comparable(r) for r in uninterrupted[:5]]   # the same file, appended


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
    is_gradient_checkpointing)."""
    def run(*flags):
        cmd = [sys.executable, "-W", "always", "-X", "importtime", "ppo.py", "--sft_path", str(tiny_models / "sft"),
               "--rm_path", str(tiny_models / "rm"), "--output_dir", str(tmp_path / "run"), "--rollout_batch_size", "4",
               "--mini_batch_size", "2", "--max_prompt_len", "16", "--max_response_len", "8", "--n_eval_prompts", "4",
               "--save_every", "1", "--lora_r", "4", *flags]
        proc = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
        assert "peft" in imported and not {m for m in imported if m.split(".")[0] == "deepspeed"}
        return "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("import time:"))
    out = run("--steps", "2") + run("--steps", "3", "--resume")
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
    args = ppo.PPOArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tmp_path / "nan_rm"), output_dir=str(tmp_path / "out"),
                       steps=1, rollout_batch_size=4, mini_batch_size=2, max_prompt_len=16, max_response_len=8)
    with pytest.raises(FloatingPointError, match="non-finite reward at iteration 0"):
        ppo.main(args)


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
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(__file__)), stdout=subprocess.PIPE,
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
    fresh = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, text=True, timeout=120)
    assert fresh.returncode != 0 and "checkpoint of an interrupted run" in fresh.stderr and "--resume" in fresh.stderr
    assert metrics.read_text() == logged          # a fresh start over it is refused before it replaces anything
    resumed, rows = run_ppo(tiny_models, out, "--steps", str(done + 2), "--resume", here=True)
    assert f"resumed at iteration {done}" in resumed
    whole = uninterrupted[:done + 2]              # (the schedule does not depend on --steps; evaluation aside)
    assert [comparable(r) for r in rows] == [comparable(r) for r in whole]     # the numbers, not only the steps


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
    args = ppo.PPOArgs(task="count", reward="gold", chat_template=True, sft_path=str(tmp_path / "sft"),
                       rm_path=str(tmp_path / "rm"), output_dir=str(tmp_path / "ppo"), steps=1, rollout_batch_size=4,
                       mini_batch_size=2, max_prompt_len=32, max_response_len=8, n_eval_prompts=4)
    ppo.main(args)
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


@pytest.mark.launch
@pytest.mark.parametrize("flags", [{}, {"lora_r": 4}])
def test_held_out_rows_carry_the_diversity_of_the_policy_and_of_the_sft_model(tiny_models, tmp_path, flags):
    """Every evaluation row: distinct-1/2, the repetition rate and gold_strict of the policy's held-out replies,
    and the SFT model's diversity on the same prompts and seed (measured once: the same in every row). Under a
    critic warm-up the policy is the SFT model, so the two agree exactly (under LoRA the SFT model is loaded for
    it, its reference being the policy with its adapters off)."""
    args = ppo.PPOArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"), output_dir=str(tmp_path),
                       steps=2, eval_every=1, critic_warmup=2, rollout_batch_size=4, mini_batch_size=4,
                       max_prompt_len=16, max_response_len=8, n_eval_prompts=8, **flags)
    ppo.main(args)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2
    for row in rows:
        assert -1.0 <= row["eval/gold_strict"] <= 1.0 and 0.0 <= row["eval/repetition"] <= 1.0
        for key in ("distinct_1", "distinct_2", "repetition"):
            assert row[f"eval/{key}"] == row[f"eval/sft_{key}"] == rows[0][f"eval/sft_{key}"]
        assert 0.0 < row["eval/distinct_2"] <= 1.0


def test_training_warns_when_the_policys_replies_are_degenerate(tiny_models, parrot, capsys):
    """ppo.py's held-out evaluation (evaluate.during_training) of a policy that says one word over and over: its distinct-2 is below half
    the SFT model's, and the log says so, what it means and what to do."""
    from transformers import AutoModelForCausalLM
    import evaluate
    import harness
    import reward_model as rm
    args, _ = ppo.resolve(ppo.PPOArgs(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                                      max_prompt_len=16, max_response_len=12))
    tokenizer = data.load_tokenizer(args.sft_path)
    rows = data.first_row_per_prompt(data.load_task("chitchat", only=("test",))["test"])[:16]
    load = (lambda path: AutoModelForCausalLM.from_pretrained(path).eval())
    sft_replies, metrics = {}, {"step": 20, "kl": 40.0, "reward/rm": 0.5}
    for policy in (load(tiny_models / "sft"), load(parrot)):
        sampling = evaluate.Sampling(args.task, args.max_prompt_len, args.max_response_len, seed=args.seed)
        evaluate.during_training(metrics, sampling, accelerator=harness.make_accelerator(), policy=policy,
                         reward_model=rm.load_reward_model(args.rm_path)[0], tokenizer=tokenizer, eval_rows=rows,
                         sft=(load(tiny_models / "sft"), sft_replies))
        printed = capsys.readouterr().out
        if policy.name_or_path.endswith("sft"):
            assert "warning" not in printed and metrics["eval/distinct_2"] == metrics["eval/sft_distinct_2"]
    assert metrics["eval/distinct_2"] < 0.5 * metrics["eval/sft_distinct_2"] and metrics["eval/repetition"] > 0.5
    assert "[ppo] warning: the policy's replies are degenerate" in printed and "being gamed" in printed
    assert "--beta" in printed and "eval/gold_strict" in printed
