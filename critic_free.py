"""Credit without a critic: ppo.py's step 5 from a group baseline or from Monte Carlo values, instead of macro GAE
on a learned critic's values. The estimators themselves are pure tensor functions in macro_actions.py
(`group_advantages`, `mc_points`, `mc_values`, `mc_advantages`); this file holds their flags and what they need
from the run: the Monte Carlo continuations sampled from the policy and scored by the run's own scorer.

    --advantage group   K samples of each prompt (adjacent rows, never split across processes): GRPO's
                        group-normalized score, Dr. GRPO's centred one, or RLOO's leave-one-out baseline
    --advantage mc      V(s) at (at most --mc_points) macro-action starts, the mean score of --mc_rollouts
                        continuations from there (SPO-chain, Guo et al. 2025)

Under either, no critic exists: nothing is built, trained, saved or resumed for it. ppo.py enters here at one call
site, after step 4, only when --advantage is not gae.
"""
import sys
from dataclasses import dataclass

import torch

import data
import harness
import macro_actions as ma
from harness import flag


@dataclass
class CreditArgs:
    """ppo.py's flags for credit without a critic, and where the KL penalty goes (GRPO puts it in the loss)."""
    advantage: str = flag("gae", "gae (the critic, the paper) | group (a group baseline) | mc (Monte Carlo values)",
                          choices=("gae", "group", "mc"))
    group_size: int = flag(4, "--advantage group: samples per prompt K; it divides --rollout_batch_size", "[2, inf)")
    group_norm: str = flag("std", "--advantage group: std (GRPO) | none (Dr. GRPO) | loo (RLOO: leave-one-out)",
                           choices=("std", "none", "loo"))
    mc_rollouts: int = flag(4, "--advantage mc: continuations sampled from each estimation point", "[1, inf)")
    mc_points: int = flag(4, "--advantage mc: estimation points per response at most, evenly spaced; 0 = all",
                          "[0, inf)")
    kl_penalty: str = flag("reward", "where the KL goes: reward (-beta * KL per token) | loss (beta * k3, GRPO)",
                           choices=("reward", "loss"))


def check_flags(credit, rollout_batch_size, *, critic_warmup, reward):
    """The flags that cannot go together with credit without a critic, refused at start with the flags named."""
    if credit.advantage == "group" and rollout_batch_size % credit.group_size:
        sys.exit(f"error: --group_size {credit.group_size}: a divisor of --rollout_batch_size {rollout_batch_size} "
                 "(the samples of a process: its prompts x K)")
    if credit.advantage != "gae" and (critic_warmup or reward == "segment"):
        sys.exit(f"error: --advantage {credit.advantage} has no critic to warm up (--critic_warmup) and reads one "
                 "score per sample, not --reward segment's per-token rewards")


def advantages(credit, s, clock, token_rewards, mask, starts, rollout, args, models, stats):
    """ppo.py's step 5 without a critic: (advantages [B, R], None: no returns, no critic to train). group: each
    sample's total reward R_i (its score and KL rewards: RLOO's sequence KL, §2.1) against its group's, on every
    token; mc: SPO-chain on Monte Carlo values at macro starts (macro GAE with lambda 0), "mc/points" into `stats`.
    `s`: ppo.py's Setup; `clock`: the iteration's Stopwatch (the continuations timed as phase "mc"); `rollout`:
    (prompt ids, prompt mask, response ids, rows); `args`, `models`: ppo.py's PPOArgs and harness.ModelArgs."""
    if credit.advantage == "group":
        with clock.phase("macro"):
            adv = ma.group_advantages(token_rewards.sum(-1), credit.group_size, credit.group_norm)
            return adv.unsqueeze(-1) * mask, None
    with clock.phase("mc"):
        values, points = monte_carlo_values(s, credit, args, models.gather_for_generation, *rollout[:3], starts, mask,
                                            rollout[3])
    with clock.phase("macro"):
        stats["mc/points"] = points.sum(-1).float().mean()
        return ma.mc_advantages(values, token_rewards, mask, points), None


def monte_carlo_values(s, credit, args, gather, prompt_ids, prompt_mask, response_ids, starts, response_mask, rows):
    """(V(s) at each estimation point [B, R], 0 elsewhere; the points, bool [B, R]): at most --mc_points of the macro
    `starts`, V the mean score of --mc_rollouts continuations of the policy from there (SPO, Guo et al. 2025, §4):
    every point's in one generate call, scored by the run's own scorer (a segment / token RM's e(x, y) on the
    continuation's own SFT segments, as step 2 scores a rollout), a missing EOS penalized as in step 3. `s`: ppo.py's
    Setup; `args`: its PPOArgs; `gather`: --gather_for_generation; `rows`: the rollout's rows."""
    policy = s.trained["policy"]
    points = ma.mc_points(starts, response_mask, credit.mc_points)
    with harness.generation_model(policy.accelerator, policy.model, gather) as (model, synced):
        p_ids, p_mask, c_ids, c_mask = data.sample_continuations(
            model, s.tokenizer, prompt_ids, prompt_mask, response_ids, points, credit.mc_rollouts, args.temperature,
            args.top_k, args.top_p, max_len=args.max_response_len, synced_gpus=synced)
    which = points.nonzero()[:, 0].repeat_interleave(credit.mc_rollouts).tolist()   # the row of each continuation
    ids, mask, P = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), p_ids.shape[1]
    with torch.no_grad():
        score = s.scorer(ids, mask, P, [rows[i] for i in which])[0]
    has_eos = ((c_ids == s.tokenizer.eos_token_id) & c_mask.bool()).any(-1)
    return ma.mc_values(score + args.missing_eos_penalty * (~has_eos).float(), points, credit.mc_rollouts), points
