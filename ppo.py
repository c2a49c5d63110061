"""Stage 3: PPO and MA-PPO (paper Algorithm 1); `--n 1` is vanilla token-level PPO.

    accelerate launch ppo.py --n 5       # builds (or reuses) runs/chitchat/{sft,rm}, then trains MA-PPO

Top to bottom: the arguments, the helpers of the steps, the setup, then `main()`: Algorithm 1 as numbered steps (1.
rollout, 2. score, 3. rewards, 4. macro actions, 5. advantages, 6. PPO update, 7. log); the macro-action math is in
macro_actions.py. Each extension joins the loop at one call site that does nothing by default, its flags beside its
code (segment_rewards.py, critic_free.py, reward_model.py's scorers, harness.py's LoRA and engines, evaluate.py).
"""
import functools
import os
import sys
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

import critic_free as cf
import data
import evaluate
import harness
import macro_actions as ma
import reward_model as rm
import segment_rewards as sr
from harness import flag


@dataclass
class PPOArgs:
    # --- the task and its models -----------------------------------------------------------------------------
    task: str = flag("chitchat", "chitchat, count, tldr, tldr_carper, hh, webgpt, code, apps, or a json/jsonl/parquet "
                                 "file")
    sft_path: str = flag("", "SFT model: policy init and frozen reference (default runs/<task>/sft, built if missing)")
    rm_path: str = flag("", "reward model: the score, the critic's init (default runs/<task>/rm, built if missing)")
    max_prompt_len: int = flag(48, "prompt tokens kept (cut from the left, counted)", "[2, inf)")
    max_response_len: int = flag(0, "generated tokens at most; 0 = the task's default (64 for count, else 32)",
                                 "[0, inf)")
    # --- the paper: macro actions (§3.2-3.3) -----------------------------------------------------------------
    n: int = flag(5, "--termination fixed: n-gram length; 1 = vanilla PPO, 0 = the whole response", "[0, inf)")
    termination: str = flag("fixed", "where macro actions start (§3.2.1): fixed | randomized | parsing | ppl | "
                            "entropy | segment", choices=ma.TERMINATIONS)
    cutoff: int = flag(5, "--termination parsing: the largest parse node kept as one macro action", "[1, inf)")
    entropy_threshold: float = flag(2.0, "--termination entropy: a token above this entropy (nats) starts a macro "
                                    "action", "[0, inf)")
    sigma: str = flag("equal", "macro value weights (App. D.1): equal | unit | position | first",
                      choices=("equal", "unit", "position", "first"))
    reward_agg: str = flag("sum", "macro reward: sum (the paper) | mean | released (the released code's)",
                           choices=("sum", "mean", "released"))
    ratio: str = flag("token", "policy ratio: token | macro (pi(omega) / pi_old(omega), §3.3) | sequence (GSPO)",
                      choices=("token", "macro", "sequence"))
    # --- PPO (§2; Table 5) -----------------------------------------------------------------------------------
    beta: float = flag(0.05, "KL penalty coefficient (the first one under --kl_target)", "[0, inf)")
    kl_estimator: str = flag("k1", "per-token KL: k1 = logp - logp_ref | k3 = (r - 1) - log r, r = p_ref / p",
                             choices=("k1", "k3"))
    kl_target: float = flag(0.0, "adaptive KL controller (Ziegler et al. 2019): per-sequence KL to hold; 0 = fixed "
                            "--beta", "[0, inf)")
    kl_horizon: int = flag(10000, "adaptive KL controller: its horizon in samples (larger = slower)", "[1, inf)")
    clip: float = flag(0.2, "policy ratio clip range", "(0, inf)")
    value_clip: float = flag(0.2, "value clip range", "(0, inf)")
    gamma: float = flag(1.0, "discount", "[0, 1]")
    lam: float = flag(0.95, "GAE lambda", "[0, 1]")
    temperature: float = flag(0.8, "sampling temperature (the logprobs are taken at the same temperature)",
                              "[1e-06, inf)")
    top_k: int = flag(0, "top-k sampling, 0 = off (on: the logprobs no longer follow the sampling distribution)",
                      "[0, inf)")
    top_p: float = flag(1.0, "nucleus sampling, 1 = off (on: the logprobs no longer follow the sampling "
                        "distribution)", "(0, 1]")
    rollout_batch_size: int = flag(32, "samples per process per iteration (--advantage group: K of each prompt)",
                                   "[1, inf)")
    mini_batch_size: int = flag(16, "rollouts per PPO minibatch", "[1, inf)")
    grad_accum: int = flag(1, "minibatches per optimizer step (an iteration's remainder steps on its own)", "[1, inf)")
    max_grad_norm: float = flag(0.0, "clip each model's gradient L2 norm to this, every engine alike; 0 = never",
                                "[0, inf)")
    ppo_epochs: int = flag(1, "passes over each rollout batch", "[1, inf)")
    steps: int = flag(120, "PPO iterations", "[1, inf)")
    policy_lr: float = flag(3e-4, "policy learning rate (~1e-6 for Gemma-2B)", "[0, inf)")
    critic_lr: float = flag(1e-3, "critic learning rate", "[0, inf)")
    warmup_steps: int = flag(5, "linear warmup iterations for both optimizers", "[0, inf)")
    critic_warmup: int = flag(0, "value-only updates for the first k iterations (the policy is not stepped)",
                              "[0, inf)")
    whiten_advantages: bool = flag(True, "normalise advantages over the batch (group / mc: divided by its std, never "
                                   "shifted)")
    missing_eos_penalty: float = flag(0.0, "added to the score of a response without EOS (e.g. -1)", "(-inf, inf)")
    reward: str = flag("rm", "the score: rm | gold (the task's judge) | segment (a segment RM's); code tasks run the "
                       "program", choices=("rm", "gold", "segment"))
    # --- the run ---------------------------------------------------------------------------------------------
    output_dir: str = flag("", "default runs/<task>/ppo_n<n>_fixed, or runs/<task>/ppo_<termination>")
    save_every: int = flag(40, "checkpoint every k iterations (also on Ctrl-C and SIGTERM)", "[1, inf)")
    seed: int = flag(1234, "random seed", "[0, 4294967295]")
    resume: bool = flag(False, "continue from <output_dir>/checkpoint")


# ppo.py's flags, parsed together in this order (`python ppo.py --help`): PPOArgs, then each extension's
ARGS = (PPOArgs, sr.SegmentArgs, cf.CreditArgs, harness.ModelArgs, evaluate.ReportArgs)


# --- Helpers, in the order of the steps they serve --------------------------------------------------------------------

def response_logprobs(model, ids, attention_mask, prompt_width, temperature, with_entropy=False):
    """2, 6. log pi(y_t | x, y_<t) of each response token under the sampling distribution (logits / temperature),
    and the policy's entropy there (no graph) if `with_entropy`, else None: both [B, R]."""
    # the LM head only where a response token is predicted (positions P-1 .. T-2), its logits freed once read
    logp_all = (model(input_ids=ids, attention_mask=attention_mask, position_ids=data.position_ids(attention_mask),
                      logits_to_keep=ids.shape[1] - prompt_width + 1).logits[:, :-1].float() / temperature
                ).log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, prompt_width:].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = ma.entropy(logp_all) if with_entropy else None    # -inf-safe: a token of probability 0 adds 0
    return logp, entropy


def scoring_forwards(policy, critic, ids, attention_mask, prompt_width, temperature, reuse):
    """2. The policy's logprobs and entropy, the critic's values V(s_t) (None: no critic), [B, R] each; with `reuse`
    (`reusable_forwards`) they keep their graphs for the update, in train mode as there."""
    policy.train(reuse)
    with torch.set_grad_enabled(reuse):
        logp, entropy = response_logprobs(policy, ids, attention_mask, prompt_width, temperature, True)
        values = critic(ids, attention_mask, prompt_width) if critic is not None else None
    policy.eval()
    return logp, entropy, values


def reference_logprobs(ref, accelerator, policy, ids, attention_mask, prompt_width, temperature, t1_entropy=False):
    """2. log pi_ref of the response tokens [B, R] (the frozen SFT model; under LoRA, `ref` None, the policy with its
    adapters off), and with `t1_entropy` the SFT entropy at temperature 1 that segments read, else None."""
    if t1_entropy:      # segment rewards (Yin et al. 2025): both from one forward
        return sr.reference_logprobs_and_entropy(ref, accelerator, policy, ids, attention_mask, prompt_width,
                                                 temperature)
    with harness.reference_forward(accelerator, ref, policy) as model:
        return response_logprobs(model, ids, attention_mask, prompt_width, temperature)[0], None


def reusable_forwards(accelerator, policy, critic, args):
    """2, 6. Graph reuse, a speed-up, the same numbers: one epoch over one minibatch, no accumulation, unsharded models
    without dropout (a row's forward then depends on no other row, nor on train() / eval()); docs/training.md."""
    return (args.ppo_epochs == 1 and args.mini_batch_size >= args.rollout_batch_size and args.grad_accum == 1
            and not harness.is_sharded(accelerator)
            and not any(harness.has_dropout(m) for m in (policy, critic) if m is not None))


def policy_loss(logp, b, clip=0.2, ratio="token", kl_coef=0.0, budget=0):
    """6. The clipped policy loss of minibatch `b` at its new `logp` (token, macro or sequence ratio, §3.3; `budget`:
    Dr. GRPO's divisor) and its stats; with b["ref_logp"] plus kl_coef x the mean k3 (GRPO, Shao et al. 2024, Eq. 4)."""
    mask = b["response_mask"]
    loss, ratios, log_ratio = ma.clipped_policy_loss(logp, b["old_logp"], b["advantages"], mask, b["starts"], clip,
                                                     ratio, budget)
    stats = {"policy/clipfrac": ma.masked_mean(((ratios - 1).abs() > clip).float(), mask),
             "policy/approxkl": ma.masked_mean(0.5 * log_ratio ** 2, mask),
             "policy/ratio": ma.masked_mean(ratios, mask)}
    if "ref_logp" in b:     # k3 = e^u - u - 1, u = log pi_ref - log pi
        u = (b["ref_logp"] - logp) * mask
        kl = ma.masked_mean(torch.exp(u) - u - 1, mask)
        loss, stats["loss/kl"] = loss + kl_coef * kl, kl.detach()
    return loss, stats


def value_loss(values, b, value_clip=0.2):
    """6. The clipped value loss of minibatch `b` (App. B.2, Table 5): the new values [B, R] against the returns."""
    v_clipped = b["old_values"] + (values - b["old_values"]).clamp(-value_clip, value_clip)
    return ma.masked_mean(0.5 * torch.max((values - b["returns"]) ** 2, (v_clipped - b["returns"]) ** 2),
                          b["response_mask"])


def minibatches(n_rows, size, epochs, generator):
    """6. The rows of each minibatch, in order: every epoch a fresh random order of the rollouts, cut in `size`s."""
    orders = [torch.randperm(n_rows, generator=generator) for _ in range(epochs)]
    return [order[k:k + size] for order in orders for k in range(0, n_rows, size)]


def backward(model, loss, scale, where):
    """6. Every process stops unless `loss` is finite on every one (`where`: accelerator, iteration, output folder);
    then `model`'s backward (a harness.Trained; None: not stepping). Returns the loss, detached, to log."""
    harness.stop_unless_finite(where[0], f"loss at iteration {where[1]}", where[2], loss)
    if model is not None:
        model.accelerator.backward(loss * scale)
    return loss.detach()


def ppo_update(policy, critic, batch, args, credit, *, train_policy, generator, prompt_width, beta, step):
    """6. PPO epochs over minibatches of the rollout `batch`: the policy loss steps the policy (unless the critic warms
    up: `train_policy`), the value loss the critic; --grad_accum minibatches a step. Each minibatch's stats, norms."""
    trained, stepping = [t for t in (policy, critic) if t], [t for t in (train_policy and policy, critic) if t]
    where = (policy.accelerator, step, args.output_dir)     # a non-finite loss stops every process, naming these
    budget = args.max_response_len if credit.advantage == "group" and credit.group_norm == "none" else 0  # Dr. GRPO
    for t in trained:
        t.model.train()
    order, stats = minibatches(len(batch["ids"]), args.mini_batch_size, args.ppo_epochs, generator), []
    for g in range(0, len(order), args.grad_accum):
        group, grouped = order[g:g + args.grad_accum], []
        harness.start_accumulation([t.accelerator for t in trained], len(group))
        for rows in group:
            b = {name: tensor[rows] for name, tensor in batch.items() if tensor is not None}
            with harness.accumulate(trained):       # backward divides by --grad_accum: scale makes a group's mean
                # the policy, then the critic: the policy's graph is gone before the critic's forward builds one
                logp = b["reused_logp"] if "reused_logp" in b else response_logprobs(
                    policy.model, b["ids"], b["attention_mask"], prompt_width, args.temperature)[0]
                loss, s = policy_loss(logp, b, args.clip, args.ratio, beta, budget)
                s["loss/policy"] = backward(train_policy and policy or None, loss, args.grad_accum / len(group), where)
                if critic:
                    values = b["reused_values"] if "reused_values" in b else critic.model(
                        b["ids"], b["attention_mask"], prompt_width)
                    loss = value_loss(values, b, args.value_clip)
                    s["loss/value"] = backward(critic, loss, args.grad_accum / len(group), where)
                grouped.append(s)
                if rows is group[-1]:       # the group's last minibatch: its step's gradient norms, then the step
                    norms = {f"{'policy' if t is policy else 'value'}/grad_norm": torch.tensor(
                        harness.clip_gradients(t.accelerator, t.model, args.max_grad_norm)) for t in stepping}
                    stats += [{**s, **norms} for s in grouped]
                for t in stepping:
                    t.optimizer.step()
                for t in trained:
                    t.optimizer.zero_grad()
    for t in stepping:       # the policy's warmup starts with it
        t.scheduler.step()
    return stats


def iteration_metrics(name, score, kl, rewards, mask, starts, entropy, has_eos, advantages, returns, old_values, stats,
                      update_stats):
    """7. This process's metrics of an iteration: the score (reward/<name>), KL, rewards, norms of advantages and
    Q-values over tokens and macro actions (Fig. 11), lengths, `stats` and the update's (means over minibatches)."""
    lengths = mask.sum(-1)
    metrics = {**stats, f"reward/{name}": score.mean(), "reward/total": rewards.sum(-1).mean(),
               "kl": (kl * mask).sum(-1).mean(),
               "entropy": ma.masked_mean(entropy, mask), "adv/l2": (advantages ** 2 * mask).sum(-1).sqrt().mean(),
               "adv/l2_macro": (advantages ** 2 * starts).sum(-1).sqrt().mean(), "response/len": lengths.mean(),
               "macro/mean_len": (lengths / starts.sum(-1).clamp(min=1).float()).mean(),
               "response/eos_rate": has_eos.float().mean(),
               **{k: torch.stack([u[k] for u in update_stats]).mean() for k in update_stats[0]}}
    if returns is not None:      # the critic's: none under --advantage group / mc
        var = ma.masked_mean((returns - ma.masked_mean(returns, mask)) ** 2, mask)
        metrics.update({"value/explained_variance": 1 - ma.masked_mean((returns - old_values) ** 2, mask)
                        / var.clamp(min=1e-8), "q/l2": (returns ** 2 * mask).sum(-1).sqrt().mean(),
                        "q/l2_macro": (returns ** 2 * starts).sum(-1).sqrt().mean()})
    return metrics


def adaptive_beta(beta, kl, target, n, horizon):
    """7. The next KL coefficient (Ziegler et al. 2019, §2.2): the batch's per-sequence `kl` steered to `target` (0:
    fixed), the error clipped to +-20%, times min(n / horizon, 1): at most 20% an iteration, beta stays positive."""
    if not target:
        return beta
    error = min(max(kl / target - 1, -0.2), 0.2)
    return beta * (1 + error * min(n / horizon, 1.0))


# --- Setup: derived settings, the four models of PPO, the scorer, optimizers ------------------------------------------

def resolve(args, *extensions):
    """Derived settings in one place, flags that cannot go together refused at start (each extension's by its module).
    Returns each extension's arguments (defaults where not given) and whether the score is running code."""
    seg, credit, models, report = harness.split_flags(ARGS[1:], {}) if not extensions else extensions
    harness.check_flags(args, seg, credit, models, report)
    # runs/<task>/ppo_n<n>_fixed for fixed n-grams, else ppo_<termination> (the other terminations ignore --n)
    data.resolve_paths(args, f"ppo_n{args.n}_fixed" if args.termination == "fixed" else f"ppo_{args.termination}")
    args.max_response_len = data.response_len(args.task, args.max_response_len)
    code_task = args.task in data.CODE_TASKS       # score = running the program; critic from SFT (App. B.2)
    models.critic_path = models.critic_path or (args.sft_path if code_task else args.rm_path)
    sr.check_flags(args.task, code_task, reward=args.reward, termination=args.termination, lora_r=models.lora_r,
                   c_ent=seg.c_ent, rm_norm=seg.rm_norm)
    cf.check_flags(credit, args.rollout_batch_size, critic_warmup=args.critic_warmup, reward=args.reward)
    if args.kl_target and not args.beta:
        sys.exit(f"error: --kl_target {args.kl_target} with --beta {args.beta}: the controller multiplies beta, so a "
                 "beta of 0 never moves; start it above 0 (e.g. --beta 0.05)")
    if args.reward_agg == "released" and args.sigma != "equal":
        sys.exit(f"error: --reward_agg released with --sigma {args.sigma}: the released code weights each macro "
                 "action's rewards with the sigma of its values, its own position weights largest on the first "
                 "token (and unit crashes there); only --sigma equal reproduces it (docs/training.md)")
    if args.reward == "gold" and args.task not in data.GOLD_JUDGES:
        sys.exit(f"error: --reward gold needs a task with a gold judge ({', '.join(data.GOLD_JUDGES)}), "
                 f"not {args.task!r}")
    return seg, credit, models, report, code_task


@dataclass
class Setup:       # what `setup` builds for `main`
    tokenizer: object
    trained: dict                   # {"policy": harness.Trained, "critic": harness.Trained}; no critic: no key
    ref: object                     # the frozen SFT model; None under LoRA (the policy with its adapters off)
    reward_model: object            # frozen; None for code tasks
    scorer: rm.Scorer               # step 2's score
    rows: list                      # training prompts (one row per prompt)
    eval_rows: list                 # held-out prompts (code rows carry their tests)
    segmenter: object               # a segment / token RM's held-out e(x, y) (segment_rewards.segmenter) or None
    sampling: evaluate.Sampling     # how the held-out replies are sampled and judged
    config: dict                    # every flag of the run, as the log and the checkpoints keep it
    generation: object              # step 1's GenerationConfig (--temperature, --top_k, --top_p), the policy's own
    reuse: bool                     # step 2's forwards keep their graphs for step 6 (`reusable_forwards`)
    sft_replies: dict = field(default_factory=dict)     # the SFT model's held-out replies' diversity, measured once


def setup(args, seg, credit, models, report, code_task):
    """The accelerators, the default models built if missing, the four models of PPO (the trained two prepared with
    AdamW and a linear warmup), the scorer of step 2, the training and held-out rows: a `Setup`."""
    acc, critic_acc = harness.make_accelerators(models.bf16, args.grad_accum, args.mini_batch_size,
                                                args.max_grad_norm, project_dir=args.output_dir,
                                                log_with=None if report.report_to == "none" else report.report_to)
    config = harness.config_of(args, seg, credit, models, report)
    harness.start("ppo", args, acc, final=os.path.join("policy", "config.json"), config=config)
    if args.top_k or args.top_p < 1:
        acc.print("[ppo] warning: --top_k / --top_p truncate the sampling distribution; the logprobs (temperature "
                  "only) do not: the first ratio is not 1 and the KL is off-policy")
    harness.build_default(acc, args.task, args.sft_path, None if code_task else args.rm_path, models.sft_args,
                          models.rm_args)
    tokenizer, policy, critic, ref, reward_model = harness.load_ppo_models(     # critic: from the RM (App. B.2)
        models, args.sft_path, args.rm_path, models.critic_path if credit.advantage == "gae" else "", rm,
        code_task=code_task, resume_dir=args.output_dir if args.resume else None, sharded=harness.is_sharded(acc))
    generation = data.own_generation_config(policy, tokenizer, args.max_response_len, args.temperature, args.top_k,
                                            args.top_p)     # step 1's sampling, and nothing of the saved file's
    own = None if code_task else sr.read_segment_settings(args.rm_path)     # a segment / token RM's own settings
    segmenter = sr.segmenter(own, ref, tokenizer.eos_token_id)      # the held-out score: the RM's own e(x, y)
    splits = data.load_task(args.task, only=("ppo", "test"))
    rows, eval_rows = (data.with_chat_template(data.first_row_per_prompt(splits[k])[:n], tokenizer,
                                               models.chat_template)
                       for k, n in (("ppo", None), ("test", report.n_eval_prompts)))     # code rows carry their tests
    acc.print(f"[ppo] {len(rows)} training prompts, {len(eval_rows)} held-out prompts, {acc.num_processes} process(es)"
              + ("" if critic is not None else f"; --advantage {credit.advantage}: no critic (none built or saved)"))
    opts, scheds = harness.adamw_with_warmup([(policy, args.policy_lr), (critic, args.critic_lr)], args.warmup_steps)
    policy, policy_opt, critic, critic_opt = harness.prepare_pair(acc, critic_acc, policy, opts[0], critic, opts[1])
    trained = {"policy": harness.Trained(policy, acc, policy_opt, scheds[0]),
               **({} if critic is None else {"critic": harness.Trained(critic, critic_acc, critic_opt, scheds[1])})}
    for frozen in [m for m in (ref, reward_model) if m is not None]:
        frozen.to(acc.device)
    scorer = rm.ppo_scorer("exec" if code_task else args.reward, tokenizer, args, seg, models, acc, reward_model, own,
                           segmenter, functools.partial(sr.sft_entropy, ref, acc, policy,
                                                        chunk=args.rollout_batch_size))
    sampling = evaluate.Sampling(args.task, args.max_prompt_len, args.max_response_len, args.temperature, args.top_k,
                                 args.top_p, args.seed)
    return Setup(tokenizer, trained, ref, reward_model, scorer, rows, eval_rows, segmenter, sampling, config,
                 generation, reusable_forwards(acc, policy, critic, args))


# --- Algorithm 1 ------------------------------------------------------------------------------------------------------

def main(args, *extensions):
    seg, credit, models, report, code_task = resolve(args, *extensions)
    s = setup(args, seg, credit, models, report, code_task)
    policy, critic, scorer, tokenizer = s.trained["policy"], s.trained.get("critic"), s.scorer, s.tokenizer
    acc, generator = policy.accelerator, torch.Generator().manual_seed(args.seed)   # minibatches, randomized n-grams
    world, K = acc.num_processes, credit.group_size if credit.advantage == "group" else 1     # K samples a prompt
    first_step, truncated, beta = harness.resume(args, s.trained, generator, s.config)
    run_log = harness.RunLog(acc, args.output_dir, first_step, report.report_to, s.config)
    bar = tqdm(range(first_step, args.steps), os.path.basename(args.output_dir), disable=not acc.is_local_main_process)
    with harness.GracefulStop(acc, "ppo", "iteration", harness.checkpoint_dir(args.output_dir), first_step) as stop:
        for step in bar:
            clock = harness.Stopwatch(acc.device)     # each phase's seconds; the freed heap handed back after each
            with clock.phase("generate"):
                # 1. Rollout: sample responses to this rank's prompts (a prompt's K samples in adjacent rows)
                idx = data.batch_indices(len(s.rows), args.rollout_batch_size // K, step, args.seed,
                                         acc.process_index, world, K)
                p_ids, p_mask, n_cut = data.encode_prompts(tokenizer, [s.rows[i]["prompt"] for i in idx],
                                                           args.max_prompt_len, acc.device)   # left-padded, [B, P]
                P, truncated = p_ids.shape[1], truncated + n_cut // K     # prompts, not their K samples
                policy.model.eval()
                with harness.generation_model(acc, policy.model, models.gather_for_generation) as (m, synced):
                    out = m.generate(input_ids=p_ids, attention_mask=p_mask, generation_config=s.generation,
                                     synced_gpus=synced)
                r_ids, r_mask = data.cut_after_eos(out[:, P:], tokenizer.eos_token_id, tokenizer.pad_token_id)  # [B, R]
            ids, attention_mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
            mask, rows = r_mask.float(), [s.rows[i] for i in idx]      # [B, R]; ids, attention_mask [B, P + R]
            with clock.phase("forward"):
                # 2. Score: the reference logprobs and the score, then (graphs last) the policy's and the values V(s_t)
                with torch.no_grad():
                    ref_logp, sft_entropy = reference_logprobs(s.ref, acc, policy.model, ids, attention_mask, P,
                                                               args.temperature, scorer.reads_sft_entropy)
                    score, dense, segments, stats = scorer(ids, attention_mask, P, rows, sft_entropy)
                logp, entropy, values = scoring_forwards(policy.model, critic and critic.model, ids, attention_mask, P,
                                                         args.temperature, s.reuse)
                old_logp, old_values = logp.detach(), values.detach() * mask if critic else None
                # 3. Rewards (§2): r_t = -beta * KL_t per token; the score, a missing EOS penalized, at the last token
                has_eos = ((r_ids == tokenizer.eos_token_id) & mask.bool()).any(-1)
                penalty = args.missing_eos_penalty * (~has_eos).float()
                score = score + penalty
                log_r = old_logp - ref_logp
                kl = log_r if args.kl_estimator == "k1" else (torch.exp(-log_r) - 1) + log_r    # k1 or k3
                kl_rewards = -beta * kl * mask if credit.kl_penalty == "reward" else torch.zeros_like(kl)
                harness.stop_unless_finite(acc, f"reward at iteration {step}", args.output_dir, kl_rewards, score)
            with clock.phase("macro"):
                # 4. Macro actions (§3.2.1): which response tokens begin one
                starts, stats["macro/parse_fallback"] = ma.termination_starts(
                    args.termination, mask, n=args.n, logprobs=old_logp, entropy=entropy,
                    threshold=args.entropy_threshold, response_ids=r_ids, tokenizer=tokenizer, cutoff=args.cutoff,
                    language="python" if code_task else "text", generator=generator, segments=segments)
                if args.reward_agg == "released":    # the released code: the final token a macro action of its own
                    starts = ma.final_token_apart(starts, mask)
                # 5. Advantages (§3.3, Eq. 4-5): macro rewards R_tau, sigma-weighted macro values, macro GAE
                agg = "mean" if args.reward_agg == "released" else args.reward_agg
                agg = "sum" if credit.advantage == "group" else agg     # a group's R_i = score - beta * sum_t KL_t
                rewards = ma.macro_rewards(kl_rewards, score, mask, starts, agg)
                if dense is not None:       # segment rewards (Yin et al. 2025) on their tokens
                    rewards = sr.token_rewards(kl_rewards, score, mask, starts, agg, dense, penalty, seg.reward_clip)
                if credit.advantage == "gae":
                    advantages, returns = ma.macro_advantages(old_values, rewards, mask, starts, args.gamma, args.lam,
                                                              args.sigma)
            if credit.advantage != "gae":   # credit without a critic: a group baseline, or Monte Carlo values
                advantages, returns = cf.advantages(credit, s, clock, rewards, mask, starts,
                                                    (p_ids, p_mask, r_ids, rows), args, models, stats)
            with clock.phase("update"):     # 6. PPO update: epochs over minibatches (value-only while the critic warms)
                batch = {"ids": ids, "attention_mask": attention_mask, "old_logp": old_logp, "response_mask": mask,
                         "advantages": ma.whiten(advantages, mask, shift=credit.advantage == "gae")
                         if args.whiten_advantages else advantages,      # group / mc: scaled, never shifted
                         "starts": starts, **({"old_values": old_values, "returns": returns} if critic else {}),
                         **({"ref_logp": ref_logp} if credit.kl_penalty == "loss" else {}),
                         **({"reused_logp": logp, "reused_values": values} if s.reuse else {})}
                update_stats = ppo_update(policy, critic, batch, args, credit, train_policy=step >= args.critic_warmup,
                                          generator=generator, prompt_width=P, beta=beta, step=step)
                logp = values = batch = None        # step 2's graphs (if reused) not kept into the next rollout
            # 7. Log (means over every process), evaluate on held-out prompts, checkpoint
            means = harness.mean_over_processes(acc, iteration_metrics(scorer.name, score, kl, rewards, mask, starts,
                entropy, has_eos, advantages, returns, old_values, stats, update_stats))
            metrics = {**{k: round(v, 5) for k, v in means.items()}, "step": step + 1, "beta": beta,
                       "prompts/truncated": truncated, **clock.metrics(float(mask.sum()) * world)}
            if (step + 1) % report.eval_every == 0 or step + 1 == args.steps:
                evaluate.during_training(metrics, s.sampling, accelerator=acc, policy=policy.model,
                                         reward_model=s.reward_model, tokenizer=tokenizer, eval_rows=s.eval_rows,
                                         segmenter=s.segmenter, sft=(s.ref, s.sft_replies), sft_path=args.sft_path,
                                         bf16=models.bf16, gather=models.gather_for_generation, score_name=scorer.name)
            run_log.write(metrics)
            bar.set_postfix(score=f"{metrics[f'reward/{scorer.name}']:.2f}", kl=f"{metrics['kl']:.2f}")
            beta = adaptive_beta(beta, means["kl"], args.kl_target, len(idx) * world, args.kl_horizon)
            stop.end_of_step(step + 1, args.steps, args.save_every, functools.partial(harness.save_trained, s.trained,
                             args.output_dir, s.config, tokenizer, truncated=truncated, generator=generator.get_state(),
                             beta=beta))
    finish(args, models, report, s, truncated, beta, run_log)


def finish(args, models, report, s, truncated, beta, run_log):
    """After the last iteration: warnings, the rank-sync check, the final policy, the report (`s`: the run's Setup)."""
    acc = s.trained["policy"].accelerator
    if truncated:
        acc.print(f"[ppo] warning: {truncated} prompts (this process) cut to their last {args.max_prompt_len} tokens")
    if args.kl_target:
        acc.print(f"[ppo] adaptive KL: beta {args.beta} -> {beta:.5g} (--kl_target {args.kl_target})")
    harness.print_ranks_in_sync(acc, [t.model for t in s.trained.values()], beta)
    end = harness.final_models(s.trained, critic=report.plot and s.reward_model is not None)    # its picture's critic
    if acc.is_main_process:
        final = os.path.join(args.output_dir, "policy")
        harness.atomic_save(final, end.pop("policy"), s.tokenizer)     # a gathered copy freed once saved
        policy, sft_model, segmenter = evaluate.report_models(final, args.sft_path, args.rm_path, args.task,
                                                              models.bf16, s.tokenizer.eos_token_id, acc.device)
        evaluate.final_report(policy, sft_model, s.reward_model, s.tokenizer, s.eval_rows, run_log.path, s.sampling,
                              label=f"n={args.n}, fixed" if args.termination == "fixed" else args.termination,
                              run=(s.config | {"beta": beta}, end.get("critic")), segmenter=segmenter, plot=report.plot)
    acc.wait_for_everyone()
    run_log.close()


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(*HfArgumentParser(ARGS).parse_args_into_dataclasses())
