"""Stage 3: PPO and MA-PPO (paper Algorithm 1); `--n 1` is vanilla token-level PPO.

    accelerate launch ppo.py --n 5       # builds (or reuses) runs/chitchat/{sft,rm}, then trains MA-PPO

Read top to bottom: the arguments; the helpers in the order of the steps they serve; the setup; `main()`,
whose loop is Algorithm 1 as numbered steps (1. rollout, 2. score, 3. rewards, 4. macro actions, 5. advantages,
6. PPO update, 7. log); `finish()`. Elsewhere: the macro-action math in macro_actions.py, the score of step 2
in reward_model.py (`Scorer`) and segment_rewards.py, the metrics and held-out evaluation in evaluate.py, the
plumbing (accelerators, signals, checkpoints, the run log, the default models) in harness.py.
"""
import contextlib
import os
import sys
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

import data
import evaluate
import harness
import macro_actions as ma
import reward_model as rm
import sandbox
import segment_rewards as sr


@dataclass
class PPOArgs:
    # --- the task and its models -------------------------------------------------------------
    task: str = field(default="chitchat", metadata={"help": "chitchat, count, tldr, tldr_carper, hh, webgpt, code, apps, or a json/jsonl/parquet file"})
    sft_path: str = field(default="", metadata={"help": "SFT model: policy init and frozen reference (default runs/<task>/sft, built if missing)"})
    rm_path: str = field(default="", metadata={"help": "reward model: the score, the critic's init (default runs/<task>/rm, built if missing)"})
    critic_path: str = field(default="", metadata={"help": "critic init: default the RM (App. B.2; code tasks: the SFT model); an LM gets a fresh head"})
    sft_args: str = field(default="", metadata={"help": "extra sft.py flags used when the default SFT model is built, e.g. '--max_steps 600'"})
    rm_args: str = field(default="", metadata={"help": "extra reward_model.py flags used when the default RM is built"})
    chat_template: bool = field(default=False, metadata={"help": "render prompts with the tokenizer's chat template (instruct models); same in every stage"})
    max_prompt_len: int = field(default=48, metadata={"help": "prompt tokens kept (cut from the left, counted)", "metavar": "[2, inf)"})
    max_response_len: int = field(default=0, metadata={"help": "generated tokens at most; 0 = the task's default (64 for count, else 32)", "metavar": "[0, inf)"})
    # --- the paper: macro actions (§3.2-3.3) -------------------------------------------------
    n: int = field(default=5, metadata={"help": "--termination fixed: n-gram length; 1 = vanilla PPO, 0 = the whole response", "metavar": "[0, inf)"})
    termination: str = field(default="fixed", metadata={"help": "where macro actions start (§3.2.1): fixed | randomized | parsing | ppl | entropy | segment", "choices": ("fixed", "randomized", "parsing", "ppl", "entropy", "segment")})
    cutoff: int = field(default=5, metadata={"help": "--termination parsing: the largest parse node kept as one macro action", "metavar": "[1, inf)"})
    entropy_threshold: float = field(default=2.0, metadata={"help": "--termination entropy: a token above this entropy (nats) starts a macro action", "metavar": "[0, inf)"})
    sigma: str = field(default="equal", metadata={"help": "macro value weights (App. D.1): equal | unit | position | first", "choices": ("equal", "unit", "position", "first")})
    reward_agg: str = field(default="sum", metadata={"help": "macro reward: sum (the paper) | mean | released (the released code's)", "choices": ("sum", "mean", "released")})
    ratio: str = field(default="token", metadata={"help": "policy ratio: token | macro (pi(omega) / pi_old(omega), §3.3) | sequence (GSPO)", "choices": ("token", "macro", "sequence")})
    # --- PPO (§2; Table 5) --------------------------------------------------------------------
    beta: float = field(default=0.05, metadata={"help": "KL penalty coefficient (the first one under --kl_target)", "metavar": "[0, inf)"})
    kl_estimator: str = field(default="k1", metadata={"help": "per-token KL: k1 = logp - logp_ref | k3 = (r - 1) - log r, r = p_ref / p", "choices": ("k1", "k3")})
    kl_target: float = field(default=0.0, metadata={"help": "adaptive KL controller (Ziegler et al. 2019): per-sequence KL to hold; 0 = fixed --beta", "metavar": "[0, inf)"})
    kl_horizon: int = field(default=10000, metadata={"help": "adaptive KL controller: its horizon in samples (larger = slower)", "metavar": "[1, inf)"})
    kl_penalty: str = field(default="reward", metadata={"help": "where the KL goes: reward (-beta * KL per token) | loss (beta * k3, GRPO)", "choices": ("reward", "loss")})
    clip: float = field(default=0.2, metadata={"help": "policy ratio clip range", "metavar": "(0, inf)"})
    value_clip: float = field(default=0.2, metadata={"help": "value clip range", "metavar": "(0, inf)"})
    gamma: float = field(default=1.0, metadata={"help": "discount", "metavar": "[0, 1]"})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda", "metavar": "[0, 1]"})
    temperature: float = field(default=0.8, metadata={"help": "sampling temperature (the logprobs are taken at the same temperature)", "metavar": "[1e-06, inf)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling, 0 = off (on: the logprobs no longer follow the sampling distribution)", "metavar": "[0, inf)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling, 1 = off (on: the logprobs no longer follow the sampling distribution)", "metavar": "(0, 1]"})
    rollout_batch_size: int = field(default=32, metadata={"help": "samples per process per iteration (--advantage group: K of each prompt)", "metavar": "[1, inf)"})
    mini_batch_size: int = field(default=16, metadata={"help": "rollouts per PPO minibatch", "metavar": "[1, inf)"})
    grad_accum: int = field(default=1, metadata={"help": "minibatches per optimizer step (an iteration's remainder steps on its own)", "metavar": "[1, inf)"})
    max_grad_norm: float = field(default=0.0, metadata={"help": "clip each model's gradient L2 norm to this, every engine alike; 0 = never", "metavar": "[0, inf)"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each rollout batch", "metavar": "[1, inf)"})
    steps: int = field(default=120, metadata={"help": "PPO iterations", "metavar": "[1, inf)"})
    policy_lr: float = field(default=3e-4, metadata={"help": "policy learning rate (~1e-6 for Gemma-2B)", "metavar": "[0, inf)"})
    critic_lr: float = field(default=1e-3, metadata={"help": "critic learning rate", "metavar": "[0, inf)"})
    warmup_steps: int = field(default=5, metadata={"help": "linear warmup iterations for both optimizers", "metavar": "[0, inf)"})
    critic_warmup: int = field(default=0, metadata={"help": "value-only updates for the first k iterations (the policy is not stepped)", "metavar": "[0, inf)"})
    whiten_advantages: bool = field(default=True, metadata={"help": "normalise advantages over the batch (group / mc: divided by its std, never shifted)"})
    missing_eos_penalty: float = field(default=0.0, metadata={"help": "added to the score of a response without EOS (e.g. -1)", "metavar": "(-inf, inf)"})
    # --- extensions: other scores, segment rewards (Yin et al. 2025) -------------------------
    reward: str = field(default="rm", metadata={"help": "the score: rm | gold (the task's judge) | segment (a segment RM's); code tasks run the program", "choices": ("rm", "gold", "segment")})
    rm_norm: bool = field(default=False, metadata={"help": "--reward rm: the RM's score standardized by its calibration mean and std"})
    c_ent: float = field(default=0.0, metadata={"help": "segments at this SFT entropy (nats) instead of the RM's own c_ent; 0 = the RM's", "metavar": "[0, inf)"})
    seg_norm: str = field(default="regression", metadata={"help": "--reward segment: normalizer: regression (the paper's) | global | last | none", "choices": ("regression", "global", "last", "none")})
    seg_interp: str = field(default="even", metadata={"help": "--reward segment: a segment's reward on its tokens: even | repeat | end | bandit", "choices": ("even", "repeat", "end", "bandit")})
    reward_clip: float = field(default=10.0, metadata={"help": "--reward segment: per-token segment rewards clipped to [-c, c]; 0 = off", "metavar": "[0, inf)"})
    # --- credit without a critic: group baselines, Monte Carlo values (SPO) -----------------
    advantage: str = field(default="gae", metadata={"help": "gae (the critic, the paper) | group (a group baseline) | mc (Monte Carlo values)", "choices": ("gae", "group", "mc")})
    group_size: int = field(default=4, metadata={"help": "--advantage group: samples per prompt K; it divides --rollout_batch_size", "metavar": "[2, inf)"})
    group_norm: str = field(default="std", metadata={"help": "--advantage group: std (GRPO) | none (Dr. GRPO) | loo (RLOO: leave-one-out)", "choices": ("std", "none", "loo")})
    mc_rollouts: int = field(default=4, metadata={"help": "--advantage mc: continuations sampled from each estimation point", "metavar": "[1, inf)"})
    mc_points: int = field(default=4, metadata={"help": "--advantage mc: estimation points per response at most, evenly spaced; 0 = all", "metavar": "[0, inf)"})
    # --- the run ------------------------------------------------------------------------------
    output_dir: str = field(default="", metadata={"help": "default runs/<task>/ppo_n<n>_fixed, or runs/<task>/ppo_<termination>"})
    eval_every: int = field(default=20, metadata={"help": "held-out evaluation every k iterations", "metavar": "[1, inf)"})
    save_every: int = field(default=40, metadata={"help": "checkpoint every k iterations (also on Ctrl-C and SIGTERM)", "metavar": "[1, inf)"})
    n_eval_prompts: int = field(default=256, metadata={"help": "held-out prompts per evaluation", "metavar": "[1, inf)"})
    seed: int = field(default=1234, metadata={"help": "random seed", "metavar": "[0, 4294967295]"})
    resume: bool = field(default=False, metadata={"help": "continue from <output_dir>/checkpoint"})
    plot: bool = field(default=True, metadata={"help": "draw learning_curve.png in the final report (false: skip matplotlib)"})
    report_to: str = field(default="none", metadata={"help": "accelerate trackers: none | tensorboard | wandb", "choices": ("none", "tensorboard", "wandb")})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank for the policy and the critic (the reference: adapters off); 0 = full", "metavar": "[0, inf)"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scale alpha (the update is scaled by alpha / r)", "metavar": "(0, inf)"})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "LoRA: all-linear, or module names separated by commas"})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPUs)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations to save memory (GPUs)"})
    gather_for_generation: bool = field(default=True, metadata={"help": "ZeRO-3 / FSDP: gather the whole policy for generate() (false: sharded, slow)"})


# ---------------------------------------------------------------------------------------------
# Helpers, in the order of the steps they serve
# ---------------------------------------------------------------------------------------------

def response_logprobs(model, ids, attention_mask, prompt_width, temperature, with_entropy=False, t1_entropy=False):
    """2, 6. (log pi(y_t | x, y_<t) of every response token under the sampling distribution (logits /
    temperature), the entropy there or None): both [B, R]. The entropy is computed without a graph,
    and only `with_entropy`: the update needs no [B, R, V] tensor kept alive for it. `t1_entropy`:
    the entropy at temperature 1 instead (segments), from the same logits before the division."""
    # the LM head only where a response token is predicted: positions P-1 .. T-2 (no [B, P, V] prompt logits)
    logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=data.position_ids(attention_mask),
                   logits_to_keep=ids.shape[1] - prompt_width + 1).logits
    logits = logits[:, :-1].float()
    entropy = None
    if t1_entropy:
        with torch.no_grad():
            entropy = sr.next_token_entropy(logits)
    logp_all = (logits / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, prompt_width:].unsqueeze(-1)).squeeze(-1)
    if with_entropy:
        with torch.no_grad():
            entropy = ma.entropy(logp_all)      # -inf-safe: a token of probability 0 adds 0
    return logp, entropy


def fused_update(accelerator, policy, critic, batch_size, mini_batch_size, epochs, grad_accum):
    """2, 6. Whether the update reuses step 2's policy and critic forwards instead of running its own: one epoch
    over one minibatch holding the whole rollout batch, no gradient accumulation, unsharded models without dropout.
    Then both forwards run once, with their graphs: detached they are the old logprobs and values, and the update
    gathers its minibatch's rows of them. One forward fewer per model, and the first ratio is exactly 1 (old =
    detached new). The numbers equal those of separate forwards because a row's forward does not depend on the
    other rows nor, without dropout, on train() / eval(). `critic` None: there is none (--advantage group / mc)."""
    return (epochs == 1 and mini_batch_size >= batch_size and grad_accum == 1 and not harness.is_sharded(accelerator)
            and not harness.has_dropout(policy) and not (critic is not None and harness.has_dropout(critic)))


def policy_and_critic_forwards(policy, critic, ids, attention_mask, prompt_width, temperature, keep_graphs):
    """2. The policy's logprobs and entropy and the critic's values V(s_t) of the rollout, [B, R] each (values None
    without a critic). `keep_graphs` (`fused_update`): both forwards keep their graphs and the update reuses them."""
    if keep_graphs:
        policy.train()      # as in the update: gradient checkpointing acts in train mode only
    with torch.set_grad_enabled(keep_graphs):
        logp, entropy = response_logprobs(policy, ids, attention_mask, prompt_width, temperature, with_entropy=True)
        # each large forward's freed temporaries go back to the OS before the next forward's land above them
        # (a trim only at the end of step 2 let them pile up: SmolLM2's bench/real_ppo.py peaked 2 GB higher)
        harness.release_freed_memory(ids.device)
        values = None if critic is None else critic(ids, attention_mask, prompt_width)
        harness.release_freed_memory(ids.device)
    policy.eval()
    return logp, entropy, values


def reference_logprobs(ref, accelerator, policy, ids, attention_mask, prompt_width, temperature, t1_entropy=False):
    """2. (log pi_ref of the response tokens, the SFT entropy at temperature 1 if `t1_entropy` else None):
    the frozen SFT model's, or under LoRA (ref None) the policy's with its adapters switched off, which
    is the SFT model. The reference computes as the policy does (`load_models`), so that before the first
    update the KL is exactly 0: under --bf16 unsharded, fp32 weights under the same bf16 autocast."""
    if ref is not None:
        with accelerator.autocast() if not harness.is_sharded(accelerator) else contextlib.nullcontext():
            out = response_logprobs(ref, ids, attention_mask, prompt_width, temperature, t1_entropy=t1_entropy)
    else:
        with harness.unwrap(accelerator, policy).disable_adapter():
            out = response_logprobs(policy, ids, attention_mask, prompt_width, temperature, t1_entropy=t1_entropy)
    harness.release_freed_memory(ids.device)        # its temporaries, as after the policy's and the critic's
    return out


def monte_carlo_values(s, args, prompt_ids, prompt_mask, response_ids, starts, response_mask, rows):
    """5. --advantage mc: (V(s) at each estimation point [B, R], 0 elsewhere; the points, bool [B, R]): at most
    --mc_points of the macro `starts`, V the mean score of --mc_rollouts continuations of the policy from there
    (SPO, Guo et al. 2025, §4): every point's in one generate call, scored by the run's own scorer (a segment /
    token RM's e(x, y) on the continuation's segments, as step 2 scores a rollout), a missing EOS penalized as in
    step 3. `s`: the Setup; `rows`: the rollout's rows."""
    acc, points = s.policy.accelerator, ma.mc_points(starts, response_mask, args.mc_points)
    with harness.generation_model(acc, s.policy.model, args.gather_for_generation) as (model, synced):
        p_ids, p_mask, c_ids, c_mask = data.sample_continuations(
            model, s.tokenizer, prompt_ids, prompt_mask, response_ids, points, args.mc_rollouts, args.temperature,
            args.top_k, args.top_p, max_len=args.max_response_len, synced_gpus=synced)
    which = points.nonzero()[:, 0].repeat_interleave(args.mc_rollouts).tolist()     # the row of each continuation
    ids, mask, P = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), p_ids.shape[1]
    with torch.no_grad():
        seg_starts = inside = None
        if s.scorer.reads_segments:     # a segment / token RM's e(x, y): each continuation on its own SFT segments
            sft_entropy = harness.in_chunks(acc, lambda rows: reference_logprobs(
                s.ref, acc, s.policy.model, ids[rows], mask[rows], P, args.temperature, t1_entropy=True)[1],
                len(ids), args.rollout_batch_size)
            seg_starts, inside = s.scorer.segments(c_ids, c_mask, sft_entropy)
        score = s.scorer(ids, mask, P, [rows[i] for i in which], seg_starts, inside)[0]
    has_eos = ((c_ids == s.tokenizer.eos_token_id) & c_mask.bool()).any(-1)
    return ma.mc_values(score + args.missing_eos_penalty * (~has_eos).float(), points, args.mc_rollouts), points


def advantages_of(args, token_rewards, response_mask, starts, values, points=None):
    """5. (advantages, returns or None) [B, R] of --advantage: gae, macro GAE on the critic's `values` (§3.3, Eq.
    4-5); group, each sample's total reward R_i (its score and KL rewards: RLOO's sequence KL, §2.1) against its
    group's, on every token; mc, SPO-chain on the Monte Carlo `values` at `points` (macro GAE with lambda 0)."""
    if args.advantage == "gae":
        return ma.macro_advantages(values, token_rewards, response_mask, starts, args.gamma, args.lam, args.sigma)
    if args.advantage == "group":
        adv = ma.group_advantages(token_rewards.sum(-1), args.group_size, args.group_norm)
        return adv.unsqueeze(-1) * response_mask, None
    return ma.mc_advantages(values, token_rewards, response_mask, points), None


def ppo_losses(logp, old_logp, values, old_values, advantages, returns, response_mask, starts, *,
               clip=0.2, value_clip=0.2, ratio="token", ref_logp=None, kl_coef=0.0, budget=0):
    """6. The clipped policy loss (token, macro or sequence ratio: `macro_actions.clipped_policy_loss`; with
    `ref_logp`, --kl_penalty loss: plus `kl_coef` times the mean k3 to the reference) and the clipped value loss
    (`value_loss`; None without a critic: `values` None), and their stats. Every tensor [B, R]; `response_mask` 1.0
    on real response tokens, `starts` where macro actions begin."""
    pg_loss, ratios, log_ratio = ma.clipped_policy_loss(logp, old_logp, advantages, response_mask, starts, clip, ratio,
                                                        budget)
    vf_loss = None if values is None else value_loss(values, old_values, returns, response_mask, value_clip)
    stats = {"policy/clipfrac": ma.masked_mean(((ratios - 1).abs() > clip).float(), response_mask),
             "policy/approxkl": ma.masked_mean(0.5 * log_ratio ** 2, response_mask),
             "policy/ratio": ma.masked_mean(ratios, response_mask)}
    if ref_logp is not None:    # GRPO (Shao et al. 2024, Eq. 4): k3 = e^u - u - 1, u = log pi_ref - log pi, in the loss
        u = (ref_logp - logp) * response_mask
        stats["loss/kl"] = ma.masked_mean(torch.exp(u) - u - 1, response_mask)
        pg_loss = pg_loss + kl_coef * stats["loss/kl"]
        stats["loss/kl"] = stats["loss/kl"].detach()
    return pg_loss, vf_loss, stats


def value_loss(values, old_values, returns, response_mask, value_clip=0.2):   # 6. clipped (App. B.2, Table 5)
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    return ma.masked_mean(0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2), response_mask)


@dataclass
class UpdateSettings:
    """6. How `ppo_update` steps: epochs over minibatches, accumulation, the clip ranges and the ratio, the
    sampling temperature its logprobs are taken at."""
    epochs: int = 1
    mini_batch_size: int = 16
    grad_accum: int = 1
    clip: float = 0.2
    value_clip: float = 0.2
    ratio: str = "token"
    temperature: float = 0.8
    max_grad_norm: float = 0.0
    budget: int = 0             # > 0: Dr. GRPO's policy loss, the token sum divided by rows x this budget


def ppo_update(policy, critic, batch, hp, *, train_policy, reused, generator, prompt_width, step, output_dir,
               kl_coef=0.0):
    """6. PPO epochs over minibatches: the clipped policy and value losses, the policy and the critic (harness.Trained;
    `critic` None under --advantage group / mc) each stepping its own optimizer; value-only while not `train_policy`
    (critic warm-up). `batch`: the rollout's tensors by name, rows first; `hp`: UpdateSettings; `reused`: step 2's
    (logprobs, values) with their graphs (`fused_update`) or None; `kl_coef`: beta (--kl_penalty loss, with the
    batch's ref_logp). Each step clips its model's gradients to `hp.max_grad_norm` (harness.clip_gradients). Returns
    the stats of every minibatch, each with the gradient norms of its group's step."""
    trained = [t for t in (policy, critic) if t is not None]
    stepping = [(policy, "policy")] * train_policy + [(critic, "value")] * (critic is not None)   # model, its loss
    for t in trained:
        t.model.train()
    stats, n_rows = [], len(batch["ids"])

    def checked_backward(t, name, loss, scale):      # the loss finite on every process; a stepping model's backward
        harness.stop_unless_finite(policy.accelerator, f"loss at iteration {step}", output_dir, loss)
        if name in [n for _, n in stepping]:
            t.accelerator.backward(loss * scale)
        return loss.detach()
    # accumulation groups of `grad_accum` minibatches, the iteration's remainder a group of its own: the
    # optimizers step at the end of every iteration, never on gradients of an older policy's rollout
    n_minibatches = hp.epochs * -(-n_rows // hp.mini_batch_size)
    j = 0
    for _ in range(hp.epochs):
        order = torch.randperm(n_rows, generator=generator)
        for k in range(0, n_rows, hp.mini_batch_size):
            mb = order[k:k + hp.mini_batch_size]
            b = {name: tensor[mb] for name, tensor in batch.items()}
            group = min(hp.grad_accum, n_minibatches - j // hp.grad_accum * hp.grad_accum)
            if j % hp.grad_accum == 0:
                harness.start_accumulation([t.accelerator for t in trained], group)
                grouped = []        # this group's minibatch stats, given the norms of its step at its end
            j += 1
            with harness.accumulate(trained):
                scale = hp.grad_accum / group      # backward divides by grad_accum: a mean over the group
                # the policy, then the critic, each its forward (or its rows of step 2's, graph and all) then its
                # backward: the graphs are disjoint, and the policy's is freed before the critic's forward builds one
                logp = reused[0][mb] if reused else response_logprobs(policy.model, b["ids"], b["attention_mask"],
                                                                       prompt_width, hp.temperature)[0]
                harness.release_freed_memory(b["ids"].device)        # the forward's temporaries
                pg_loss, _, s = ppo_losses(logp, b["old_logp"], None, None, b["advantages"], None, b["response_mask"],
                                           b["starts"], clip=hp.clip, ratio=hp.ratio, ref_logp=b.get("ref_logp"),
                                           kl_coef=kl_coef, budget=hp.budget)
                losses = {"policy": checked_backward(policy, "policy", pg_loss, scale)}
                if critic is not None:
                    values = reused[1][mb] if reused else critic.model(b["ids"], b["attention_mask"], prompt_width)
                    harness.release_freed_memory(b["ids"].device)
                    vf_loss = value_loss(values, b["old_values"], b["returns"], b["response_mask"], hp.value_clip)
                    losses["value"] = checked_backward(critic, "value", vf_loss, scale)
                grouped.append({**{f"loss/{name}": loss for name, loss in losses.items()}, **s})
                if trained[-1].accelerator.sync_gradients:       # the group's last minibatch: its step's gradients
                    norms = {f"{name}/grad_norm": torch.tensor(harness.clip_gradients(t.accelerator, t.model,
                                                                                      hp.max_grad_norm))
                             for t, name in stepping}
                    stats += [{**g, **norms} for g in grouped]
                for t, _ in stepping:
                    t.optimizer.step()
                for t in trained:
                    t.optimizer.zero_grad()
    for t, _ in stepping:       # the policy's warmup starts with it
        t.scheduler.step()
    return stats


def adaptive_beta(beta, kl, target, n, horizon):
    """7. The KL coefficient of the next iteration (Ziegler et al. 2019, §2.2): proportional control of the
    per-sequence KL towards `target`, the error clipped to +-20%, the step scaled by the `n` samples seen
    out of a `horizon`, at most 1: beta moves by at most 20% per iteration and stays positive (with n above
    5 x the horizon the formula's factor 1 - 0.2 n / horizon would flip its sign). `target` 0 keeps `beta` fixed."""
    if not target:
        return beta
    error = min(max(kl / target - 1, -0.2), 0.2)
    return beta * (1 + error * min(n / horizon, 1.0))


# ---------------------------------------------------------------------------------------------
# Setup: derived settings, the four models of PPO, the scorer, optimizers
# ---------------------------------------------------------------------------------------------

def resolve(args):
    """Derived settings, in one place: default paths, and whether the task's score is running its code
    (returned: `code_task`)."""
    harness.check_flags(args)
    # runs/<task>/ppo_n<n>_fixed for fixed n-grams, else ppo_<termination> (the other terminations ignore --n)
    data.resolve_paths(args, f"ppo_n{args.n}_fixed" if args.termination == "fixed" else f"ppo_{args.termination}")
    args.max_response_len = data.response_len(args.task, args.max_response_len)
    code_task = args.task in data.CODE_TASKS       # score = running the program; critic from SFT (App. B.2)
    args.critic_path = args.critic_path or (args.sft_path if code_task else args.rm_path)
    sr.check_flags(args.task, code_task, reward=args.reward, termination=args.termination, lora_r=args.lora_r,
                   c_ent=args.c_ent)
    if args.rm_norm and (code_task or args.reward != "rm"):
        sys.exit(f"error: --rm_norm normalizes the reward model's score under --reward rm, not --reward {args.reward}"
                 + (f" (task {args.task!r} runs its code)" if code_task else ""))
    if args.kl_target and not args.beta:
        sys.exit(f"error: --kl_target {args.kl_target} with --beta {args.beta}: the controller multiplies beta, so a "
                 "beta of 0 never moves; start it above 0 (e.g. --beta 0.05)")
    if args.reward_agg == "released" and args.sigma != "equal":
        sys.exit(f"error: --reward_agg released with --sigma {args.sigma}: the released code weights each macro "
                 "action's rewards with the sigma of its values, its own position weights largest on the first "
                 "token (and unit crashes there); only --sigma equal reproduces it (docs/training.md)")
    if args.reward == "gold" and args.task not in data.GOLD_JUDGES:
        sys.exit(f"error: --reward gold needs a task with a gold judge ({', '.join(data.GOLD_JUDGES)}), not {args.task!r}")
    if args.advantage == "group" and args.rollout_batch_size % args.group_size:
        sys.exit(f"error: --group_size {args.group_size}: a divisor of --rollout_batch_size {args.rollout_batch_size} "
                 "(the samples of a process: its prompts x K)")
    if args.advantage != "gae" and (args.critic_warmup or args.reward == "segment"):
        sys.exit(f"error: --advantage {args.advantage} has no critic to warm up (--critic_warmup) and reads one score "
                 "per sample, not --reward segment's per-token rewards")
    return args, code_task


def load_models(sft_path, rm_path, critic_path, *, code_task, bf16=False, lora=None, resume_dir=None,
                gradient_checkpointing=False, sharded=False):
    """(tokenizer, policy, critic, frozen reference, frozen reward model or None): the policy and the
    reference from the SFT model, the critic from `critic_path` (App. B.2; None: no critic); `resume_dir`: the
    trained two from its checkpoint. `lora`: (r, alpha, target modules) or None. `sharded`: ZeRO-3 / FSDP will
    partition the trained models."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if bf16 else torch.float32
    if resume_dir:
        harness.require_part(harness.checkpoint_part(resume_dir, "policy"), "checkpoint to resume", "Run without --resume.")
    part = (lambda name, default: harness.checkpoint_part(resume_dir, name) if resume_dir else default)
    tokenizer = data.load_tokenizer(sft_path)
    with harness.loading_whole():       # the frozen models are never handed to a ZeRO-3 engine
        reward_model = None if code_task else rm.load_reward_model(rm_path, bf16)[0].eval().requires_grad_(False)
    if lora:    # adapters on the SFT model and on the critic's init: two copies of the base weights in all
        policy = AutoModelForCausalLM.from_pretrained(sft_path, dtype=dtype)
        # the reference is the policy with its adapters off; a critic initialised from the RM reads the RM's
        # own weights (a twin of it), unless the weights are sharded (ZeRO-3 / FSDP partition the critic's)
        shared = reward_model is not None and not sharded and os.path.realpath(critic_path) == os.path.realpath(rm_path)
        critic = (harness.twin(reward_model) if shared else rm.load_reward_model(critic_path, bf16)[0]) if critic_path else None
        policy = harness.load_lora(policy, part("policy", "")) if resume_dir else harness.with_lora(policy, *lora, "CAUSAL_LM")
        if critic is not None:      # SEQ_CLS: the score head trains too
            critic = rm.Critic(harness.load_lora(critic, part("critic", "")) if resume_dir else
                               harness.with_lora(critic, *lora, "SEQ_CLS"))
    else:       # trained weights in fp32 (the master copy); --bf16 autocasts their forwards
        policy = AutoModelForCausalLM.from_pretrained(part("policy", sft_path), dtype=torch.float32)
        critic = rm.Critic(rm.load_reward_model(part("critic", critic_path))[0]) if critic_path else None
    # the reference in the precision the policy computes in: bf16 weights where the engine runs the policy's in
    # bf16 (DeepSpeed, FSDP2's mixed precision), else fp32 weights under the policy's autocast (reference_logprobs)
    ref_dtype = dtype if sharded else torch.float32
    with harness.loading_whole():
        ref = None if lora else AutoModelForCausalLM.from_pretrained(sft_path, dtype=ref_dtype).eval().requires_grad_(False)
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        if critic is not None:
            critic.model.gradient_checkpointing_enable()
    return tokenizer, policy, critic, ref, reward_model


@dataclass
class Setup:
    """What `setup` builds for `main`: the four models of PPO (the trained two as harness.Trained bundles), the
    scorer of step 2, the prompts, and the settings of the update and of the held-out evaluation."""
    tokenizer: object
    policy: harness.Trained
    critic: harness.Trained | None  # None under --advantage group / mc: no critic at all
    ref: object                     # the frozen SFT model; None under LoRA (the policy with its adapters off)
    reward_model: object            # frozen; None for code tasks
    scorer: rm.Scorer
    rows: list                      # training prompts (one row per prompt)
    eval_rows: list                 # held-out prompts
    segmenter: object               # a segment / token RM's held-out e(x, y) (segment_rewards.segmenter) or None
    update: UpdateSettings
    sampling: evaluate.Sampling     # how the held-out replies are sampled and judged


def setup(args, code_task, accelerators):
    """The default models built if missing, the four models of PPO (the trained two prepared with their
    optimizers), the scorer of step 2, the training and held-out rows: a `Setup`."""
    acc, critic_acc = accelerators
    log = acc.print
    if args.top_k or args.top_p < 1:
        log("[ppo] warning: --top_k / --top_p truncate the sampling distribution; the logprobs (temperature only) "
            "do not: the first ratio is not 1 and the KL is off-policy")
    harness.build_default(acc, args.task, args.sft_path, None if code_task else args.rm_path, args.sft_args, args.rm_args)
    tokenizer, policy, critic, ref, reward_model = load_models(
        args.sft_path, args.rm_path, args.critic_path if args.advantage == "gae" else "", code_task=code_task, bf16=args.bf16,
        lora=(args.lora_r, args.lora_alpha, args.lora_target_modules) if args.lora_r else None,
        resume_dir=args.output_dir if args.resume else None, gradient_checkpointing=args.gradient_checkpointing,
        sharded=harness.is_sharded(acc))
    own = None if code_task else sr.read_segment_settings(args.rm_path)     # a segment / token RM's own settings
    settings = sr.segment_settings(own, args.rm_path, args.sft_path, reward=args.reward, termination=args.termination,
                                   c_ent=args.c_ent, seg_norm=args.seg_norm, lora_r=args.lora_r, log=log)
    segmenter = sr.segmenter(own, ref, tokenizer.eos_token_id)      # the held-out score: the RM's own e(x, y)
    splits = data.load_task(args.task, only=("ppo", "test"))
    rows = data.with_chat_template(data.first_row_per_prompt(splits["ppo"]), tokenizer, args.chat_template)
    eval_rows = data.with_chat_template(data.first_row_per_prompt(splits["test"])[:args.n_eval_prompts], tokenizer,
                                        args.chat_template)                # code rows carry their tests
    log(f"[ppo] {len(rows)} training prompts, {len(eval_rows)} held-out prompts, {acc.num_processes} process(es)")
    opts, scheds = harness.adamw_with_warmup([(policy, args.policy_lr), (critic, args.critic_lr)], args.warmup_steps)
    if critic is None:
        log(f"[ppo] --advantage {args.advantage}: no critic (none built, trained, saved or resumed)")
    policy, policy_opt, critic, critic_opt = harness.prepare_pair(acc, critic_acc, policy, opts[0], critic, opts[1])
    for frozen_model in (ref, reward_model):
        if frozen_model is not None:
            frozen_model.to(acc.device)
    score_norm = rm.score_normalizer(acc, args.rm_path, reward_model, tokenizer, segmenter, task=args.task,
                                     chat_template=args.chat_template, max_prompt_len=args.max_prompt_len,
                                     max_response_len=args.max_response_len) if args.rm_norm else None
    scorer = rm.Scorer("exec" if code_task else args.reward, tokenizer, task=args.task, reward_model=reward_model,
                    segment_settings=settings, segment_rm=own is not None, seg_norm=args.seg_norm,
                    seg_interp=args.seg_interp, score_norm=score_norm)
    update = UpdateSettings(args.ppo_epochs, args.mini_batch_size, args.grad_accum, args.clip, args.value_clip,
                            args.ratio, args.temperature, args.max_grad_norm,
                            args.max_response_len if args.advantage == "group" and args.group_norm == "none" else 0)
    sampling = evaluate.Sampling(args.task, args.max_prompt_len, args.max_response_len, args.temperature, args.top_k,
                                 args.top_p, args.seed)
    return Setup(tokenizer, harness.Trained(policy, acc, policy_opt, scheds[0]),
                 None if critic is None else harness.Trained(critic, critic_acc, critic_opt, scheds[1]), ref,
                 reward_model, scorer, rows, eval_rows, segmenter, update, sampling)


# ---------------------------------------------------------------------------------------------
# Algorithm 1
# ---------------------------------------------------------------------------------------------

def main(args):
    args, code_task = resolve(args)
    acc, critic_acc = harness.make_accelerators(args.bf16, args.grad_accum, args.mini_batch_size, args.max_grad_norm,
                                                project_dir=args.output_dir,
                                                log_with=None if args.report_to == "none" else args.report_to)
    harness.start("ppo", args, acc, final=os.path.join("policy", "config.json"))
    log, world, rank = acc.print, acc.num_processes, acc.process_index
    s = setup(args, code_task, (acc, critic_acc))
    policy, critic, scorer, tokenizer = s.policy, s.critic, s.scorer, s.tokenizer
    trained = {name: t for name, t in (("policy", policy), ("critic", critic)) if t is not None}
    optimizers, schedulers = harness.checkpoint_names(trained)      # {policy_opt: ...}, {policy_sched: ...}
    generator = torch.Generator().manual_seed(args.seed)       # minibatch order, randomized n-grams
    first_step, truncated, beta = 0, 0, args.beta
    if args.resume:     # optimizer states are per-rank shards under ZeRO: each rank restores its own
        state = harness.load_checkpoint(args.output_dir, optimizers, schedulers, log, rank, world)
        first_step, truncated, beta = state["step"], state["truncated"], state.get("beta", args.beta)
        generator.set_state(state["generator"])
        log(f"[ppo] resumed at iteration {first_step}")
    run_log = harness.RunLog(acc, args.output_dir, first_step, args.report_to, asdict(args))
    prompts, sft_replies = [r["prompt"] for r in s.rows], {}     # sft_replies: the SFT model's diversity, measured once
    bar = tqdm(range(first_step, args.steps), desc=os.path.basename(args.output_dir), disable=not acc.is_local_main_process)
    with harness.GracefulStop(acc, "ppo", "iteration", harness.checkpoint_dir(args.output_dir), first_step) as stop:
        for step in bar:
            clock = harness.Stopwatch()     # each phase's seconds; the freed heap handed back after the large ones
            # 1. Rollout: sample responses to this rank's prompts; logprobs under the sampling distribution
            with clock.phase("generate", release=acc.device):
                K = args.group_size if args.advantage == "group" else 1     # a prompt's K samples in adjacent rows:
                idx = harness.batch_indices(len(prompts), args.rollout_batch_size // K, step, args.seed, rank, world, K)
                policy.model.eval()
                with harness.generation_model(acc, policy.model, args.gather_for_generation) as (model, synced):
                    p_ids, p_mask, r_ids, r_mask, n_cut = data.sample(
                        model, tokenizer, [prompts[i] for i in idx], args.max_prompt_len, args.max_response_len,
                        args.temperature, args.top_k, args.top_p, synced_gpus=synced)
                truncated += n_cut
            P, ids, attention_mask = p_ids.shape[1], torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
            response_mask = r_mask.float()                       # [B, R]; ids, attention_mask [B, P + R]
            with clock.phase("forward", release=acc.device):   # and after each large forward
                # 2. Score: the policy's logprobs and the critic's values V(s_t) (with their graphs when the update
                # reuses these forwards), the reference logprobs, the sequence score
                critic_model = critic and critic.model      # None under --advantage group / mc
                reuse = fused_update(acc, policy.model, critic_model, len(idx), args.mini_batch_size, args.ppo_epochs,
                                     args.grad_accum)
                logp, entropy, values = policy_and_critic_forwards(policy.model, critic_model, ids, attention_mask, P,
                                                                   args.temperature, keep_graphs=reuse)
                old_logp, old_values = logp.detach(), None if critic is None else values.detach() * response_mask
                with torch.no_grad():
                    ref_logp, sft_entropy = reference_logprobs(s.ref, acc, policy.model, ids, attention_mask, P,
                                                               args.temperature, t1_entropy=scorer.segment_settings is not None)
                    seg_starts, inside = scorer.segments(r_ids, r_mask, sft_entropy)
                    score, dense, passed, score_stats = scorer(ids, attention_mask, P, [s.rows[i] for i in idx],
                                                               seg_starts, inside)
                # 3. Rewards (§2): r_t = -beta * KL_t per token; the score, a missing EOS penalized, at the last token
                has_eos = ((r_ids == tokenizer.eos_token_id) & response_mask.bool()).any(-1)
                penalty = args.missing_eos_penalty * (~has_eos).float()
                score = score + penalty
                log_r = old_logp - ref_logp
                kl = log_r if args.kl_estimator == "k1" else (torch.exp(-log_r) - 1) + log_r    # k1 or k3
                kl_rewards = -beta * kl * response_mask if args.kl_penalty == "reward" else torch.zeros_like(kl)
                harness.stop_unless_finite(acc, f"reward at iteration {step}", args.output_dir, kl_rewards, score)
            with clock.phase("macro"):
                # 4. Macro actions (§3.2.1): which response tokens begin one
                starts, fallback = ma.termination_starts(
                    args.termination, response_mask, n=args.n, logprobs=old_logp, entropy=entropy,
                    threshold=args.entropy_threshold, response_ids=r_ids, tokenizer=tokenizer, cutoff=args.cutoff,
                    language="python" if code_task else "text", generator=generator, segments=seg_starts)
                if args.reward_agg == "released":    # the released code: the final token a macro action of its own
                    starts = ma.final_token_apart(starts, response_mask)
            points = None
            if args.advantage == "mc":      # 5a. no critic: Monte Carlo values at (at most --mc_points) macro starts
                with clock.phase("mc", release=acc.device):
                    old_values, points = monte_carlo_values(s, args, p_ids, p_mask, r_ids, starts, response_mask,
                                                            [s.rows[i] for i in idx])
            with clock.phase("macro"):
                # 5. Advantages (§3.3, Eq. 4-5): macro rewards R_tau, sigma-weighted macro values, macro GAE (or
                # --advantage group / mc: a group baseline, SPO-chain)
                agg = "mean" if args.reward_agg == "released" else args.reward_agg
                agg = "sum" if args.advantage == "group" else agg       # R_i = score - beta sum_t KL_t, always
                token_rewards = sr.token_rewards(kl_rewards, score, response_mask, starts, agg, dense, penalty,
                                                  args.reward_clip)
                advantages, returns = advantages_of(args, token_rewards, response_mask, starts, old_values, points)
                raw_adv = advantages        # logged as they are; the update reads them normalised over the batch
                if args.whiten_advantages:      # a critic-free estimator's advantages scaled, never shifted
                    advantages = ma.whiten(advantages, response_mask, shift=args.advantage == "gae")
            with clock.phase("update", release=acc.device):
                # 6. PPO update: epochs over minibatches; value-only while the critic warms up
                batch = {"ids": ids, "attention_mask": attention_mask, "old_logp": old_logp, "advantages": advantages,
                         "response_mask": response_mask, "starts": starts, **({} if critic is None else {
                             "old_values": old_values, "returns": returns}), **({"ref_logp": ref_logp} if args.kl_penalty == "loss" else {})}
                stats = ppo_update(policy, critic, batch, s.update, train_policy=step >= args.critic_warmup,
                                   reused=(logp, values) if reuse else None, generator=generator, prompt_width=P,
                                   step=step, output_dir=args.output_dir, kl_coef=beta)
                logp = values = None        # step 2's graphs (if reused) not kept into the next rollout
            # 7. Log (means over every process), evaluate on held-out prompts, checkpoint
            means = harness.mean_over_processes(acc, evaluate.iteration_metrics(evaluate.Iteration(
                score, passed, token_rewards, kl, entropy, response_mask, starts, None if critic is None else old_values,
                raw_adv, returns, has_eos, fallback, stats, score_stats, points), scorer.name))
            metrics = {**harness.rounded(means), "step": step + 1, "beta": beta, "prompts/truncated": truncated,
                       **clock.metrics(float(response_mask.sum()) * world)}
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                harness.release_freed_memory(acc.device, at_least=0)    # the 256-prompt generation starts lean
                evaluate.during_training(metrics, s.sampling, accelerator=acc, policy=policy.model,
                                         reward_model=s.reward_model, tokenizer=tokenizer, eval_rows=s.eval_rows,
                                         segmenter=s.segmenter, sft=(s.ref, sft_replies), sft_path=args.sft_path,
                                         bf16=args.bf16, gather=args.gather_for_generation, score_name=scorer.name)
            run_log.write(metrics)
            bar.set_postfix(score=f"{metrics[f'reward/{scorer.name}']:.2f}", kl=f"{metrics['kl']:.2f}")
            # the next iteration's KL coefficient, from this batch's KL over every process (the same on every rank)
            beta = adaptive_beta(beta, means["kl"], args.kl_target, len(idx) * world, args.kl_horizon)
            stop.end_of_step(step + 1, args.steps, args.save_every, lambda done: harness.save_training(
                acc, args.output_dir, done, args, tokenizer, {name: (t.accelerator, t.model) for name, t in trained.items()},
                optimizers, schedulers, truncated=truncated, generator=generator.get_state(), beta=beta))
    finish(args, s, truncated, beta, run_log)


def finish(args, s, truncated, beta, run_log):
    """After the last iteration: warnings, the rank-sync check, the final policy, the report. `s`: the run's
    Setup; `truncated`: prompts of this process that lost their beginning; `beta`: the KL coefficient the
    controller ended with."""
    acc, sharded = s.policy.accelerator, harness.is_sharded(s.policy.accelerator)
    if truncated:
        acc.print(f"[ppo] warning: {truncated} prompts (this process) were longer than {args.max_prompt_len} "
                  f"tokens and lost their beginning")
    if args.kl_target:
        acc.print(f"[ppo] adaptive KL: beta {args.beta} -> {beta:.5g} (--kl_target {args.kl_target})")
    same_beta = harness.same_on_every_rank(acc, beta)
    if not sharded:
        in_sync = all(harness.ranks_in_sync(acc, t.model) for t in (s.policy, s.critic) if t is not None)
        acc.print(f"[ppo] ranks in sync: {in_sync and same_beta}")
    final_policy = harness.final_model(acc, s.policy.model)        # collective: whole weights, LoRA merged
    if acc.is_main_process:
        final = os.path.join(args.output_dir, "policy")
        harness.atomic_save(final, final_policy, s.tokenizer)
        policy, sft_model, segmenter = evaluate.report_models(final, args.sft_path, args.rm_path, args.task, args.bf16,
                                                              s.tokenizer.eos_token_id, acc.device)
        evaluate.final_report(policy, sft_model, s.reward_model, s.tokenizer, s.eval_rows, run_log.path, s.sampling,
                              label=f"n={args.n}, {args.termination}", plot=args.plot, segmenter=segmenter)
    acc.wait_for_everyone()
    run_log.close()


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(HfArgumentParser(PPOArgs).parse_args_into_dataclasses()[0])
