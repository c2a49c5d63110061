"""Stage 3: PPO and MA-PPO (paper Algorithm 1); `--n 1` is vanilla token-level PPO.

    accelerate launch ppo.py --n 5       # builds (or reuses) runs/chitchat/{sft,rm}, then trains MA-PPO

Read top to bottom: the arguments, the math of one iteration as small pure functions, the setup
(models, data, optimizers), then `main()`, whose loop is the paper's Algorithm 1 as numbered steps:
1. rollout, 2. score, 3. rewards, 4. macro actions, 5. advantages, 6. PPO update, 7. log.
The plumbing (accelerators, Ctrl-C / SIGTERM, checkpoints) lives in harness.py, evaluation and the
final report in evaluate.py, the macro-action math in macro_actions.py.
"""
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import torch

import data
import evaluate
import harness
import macro_actions as ma
import reward_model as rm
import sandbox


@dataclass
class PPOArgs:
    task: str = field(default="chitchat", metadata={"help": "chitchat, count, tldr, tldr_carper, hh, webgpt, code, apps, or a local json/jsonl/parquet file"})
    sft_path: str = field(default="", metadata={"help": "SFT model (policy init and frozen reference); default runs/<task>/sft, built on chitchat if missing"})
    rm_path: str = field(default="", metadata={"help": "reward model (also the critic's init); default runs/<task>/rm, built on chitchat if missing; unused for code tasks"})
    reward: str = field(default="rm", metadata={"help": "the sequence score: rm (the reward model, the paper) | gold (the task's gold judge as a verifiable reward: chitchat, count); code tasks always run the program"})
    critic_path: str = field(default="", metadata={"help": "critic init: default the RM (App. B.2; the SFT model for code tasks); any causal LM or RM folder, a fresh value head on an LM"})
    output_dir: str = field(default="", metadata={"help": "default runs/<task>/ppo_n<n>_<termination>"})
    sft_args: str = field(default="", metadata={"help": "extra sft.py flags used when the default SFT model is built, e.g. '--max_steps 600' (count: '--max_steps 1600 ...' when empty)"})
    rm_args: str = field(default="", metadata={"help": "extra reward_model.py flags used when the default RM is built (count: '--max_steps 1000 ...' when empty)"})
    n: int = field(default=5, metadata={"help": "macro action length for --termination fixed: 1 = vanilla PPO, 0 = the whole response"})
    termination: str = field(default="fixed", metadata={"help": "fixed | randomized | parsing | ppl | entropy (paper §3.2.1)"})
    sigma: str = field(default="equal", metadata={"help": "macro value weights: equal | unit | position | first (App. D.1)"})
    reward_agg: str = field(default="sum", metadata={"help": "macro reward: sum (the paper's equation) | mean (the released code: each macro action's KL penalty averaged, the RM score kept whole)"})
    ratio: str = field(default="token", metadata={"help": "token: per-token ratios with macro advantages (released code) | macro: pi(omega)/pi_old(omega)"})
    kl_estimator: str = field(default="k1", metadata={"help": "per-token KL: k1 = logp - logp_ref | k3 = (r - 1) - log r, r = p_ref/p"})
    beta: float = field(default=0.05, metadata={"help": "KL penalty coefficient"})
    clip: float = field(default=0.2, metadata={"help": "policy ratio clip range"})
    value_clip: float = field(default=0.2, metadata={"help": "value clip range"})
    gamma: float = field(default=1.0, metadata={"help": "discount"})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (peft); 0 = train every weight. policy and critic adapters; the reference is the policy with its adapters off"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scale alpha (the update is scaled by alpha / r)"})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "LoRA: all-linear, or module names separated by commas (e.g. q_proj,v_proj)"})
    chat_template: bool = field(default=False, metadata={"help": "render prompts with the tokenizer's own chat template (instruct models); off: the raw HH / TL;DR formats of the paper's base models. Use the same choice in every stage"})
    temperature: float = field(default=0.8, metadata={"help": "sampling temperature; logprobs are taken at the same temperature, so they follow the sampling distribution only while --top_k and --top_p are off"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling, 0 = off; on, the logprobs are no longer those of the sampling distribution (a warning says so)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling, 1 = off; on, the logprobs are no longer those of the sampling distribution (a warning says so)"})
    cutoff: int = field(default=5, metadata={"help": "parsing termination: largest node kept as one macro action"})
    entropy_threshold: float = field(default=2.0, metadata={"help": "entropy termination: a token above this entropy (nats) starts a macro action"})
    max_prompt_len: int = field(default=48, metadata={"help": "prompt tokens kept (truncated from the left, counted)"})
    max_response_len: int = field(default=0, metadata={"help": "generated tokens at most; 0 = the task's default (64 for count, else 32)"})
    rollout_batch_size: int = field(default=32, metadata={"help": "prompts per process per iteration"})
    mini_batch_size: int = field(default=16, metadata={"help": "rollouts per PPO minibatch"})
    grad_accum: int = field(default=1, metadata={"help": "minibatches per optimizer step"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each rollout batch"})
    steps: int = field(default=120, metadata={"help": "PPO iterations"})
    policy_lr: float = field(default=3e-4, metadata={"help": "policy learning rate (~1e-6 for Gemma-2B)"})
    critic_lr: float = field(default=1e-3, metadata={"help": "critic learning rate"})
    warmup_steps: int = field(default=5, metadata={"help": "linear warmup iterations for both optimizers"})
    missing_eos_penalty: float = field(default=0.0, metadata={"help": "added to the score of a response without EOS (e.g. -1)"})
    whiten_advantages: bool = field(default=True, metadata={"help": "normalise advantages over the batch"})
    eval_every: int = field(default=20, metadata={"help": "held-out RM / gold score every k iterations"})
    save_every: int = field(default=40, metadata={"help": "checkpoint every k iterations"})
    n_eval_prompts: int = field(default=256, metadata={"help": "held-out prompts per evaluation"})
    seed: int = field(default=1234, metadata={"help": "random seed"})
    resume: bool = field(default=False, metadata={"help": "continue from <output_dir>/checkpoint (written every --save_every iterations, on Ctrl-C and on SIGTERM)"})
    report_to: str = field(default="none", metadata={"help": "accelerate trackers: none | tensorboard | wandb"})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPUs)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations to save memory (GPUs)"})
    gather_for_generation: bool = field(default=True, metadata={"help": "ZeRO-3 / FSDP: gather the policy's whole weights once for each generate() (fast; the whole policy on every GPU while generating); --gather_for_generation false: sharded generation (least memory, slow)"})


# ---------------------------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------------------------



# ---------------------------------------------------------------------------------------------
# Small pure helpers (the math of one iteration)
# ---------------------------------------------------------------------------------------------

def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def token_rewards(kl_rewards, score, r_mask, starts, reward_agg="sum"):
    """Per-token rewards whose sum over a macro action is its reward R_tau (§3.3: the sum of the
    rewards of its tokens): the KL rewards with the sequence score added at the last real token.
    `mean` reproduces the released code: each macro action's KL rewards are averaged (divided by its
    length) and the score is never divided."""
    if reward_agg == "mean":
        kl_rewards = kl_rewards / ma.macro_sum(r_mask.to(kl_rewards.dtype), starts).clamp(min=1)
    elif reward_agg != "sum":
        raise ValueError(f"unknown --reward_agg {reward_agg!r}; choose sum or mean")
    rewards = kl_rewards.clone()
    last = (r_mask.long().sum(-1) - 1).clamp(min=0)
    rewards[torch.arange(len(last)), last] += score
    return rewards


def response_logprobs(model, ids, mask, prompt_width, temperature):
    """log pi(y_t | x, y_<t) of every response token under the sampling distribution (logits /
    temperature), and the entropy there: both [B, R]."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=data.position_ids(mask)).logits
    logits = logits[:, prompt_width - 1:-1].float() / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, prompt_width:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class Critic(torch.nn.Module):
    """The reward model read at every position (critic initialised from the RM, App. B.2); a module
    of its own so that DDP / FSDP wrap the forward that computes the values."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        model = self.model.get_base_model() if harness.is_lora(self.model) else self.model   # LoRA layers inside
        return rm.token_values(model, ids, mask)


def reference_logprobs(ref, accelerator, policy, ids, mask, prompt_width, temperature):
    """log pi_ref of the response tokens: the frozen SFT model's, or under LoRA (ref None) the policy's
    with its adapters switched off, which is the SFT model."""
    if ref is not None:
        return response_logprobs(ref, ids, mask, prompt_width, temperature)[0]
    with accelerator.unwrap_model(policy).disable_adapter():
        return response_logprobs(policy, ids, mask, prompt_width, temperature)[0]


def critic_values(critic, ids, mask, prompt_width):
    """V(s_t) for the state before each response token: the head at the preceding position [B, R]."""
    return critic(ids, mask)[:, prompt_width - 1:-1]


def macro_starts(args, r_ids, r_mask, logprobs, entropy, tokenizer, generator):
    """4. Which response tokens begin a macro action, and the parse fallback rate."""
    if args.termination == "fixed":
        return ma.fixed_ngram_starts(r_mask, args.n), 0.0
    if args.termination == "randomized":
        return ma.randomized_ngram_starts(r_mask, generator=generator), 0.0
    if args.termination == "ppl":
        return ma.perplexity_starts(logprobs, r_mask), 0.0
    if args.termination == "entropy":
        return ma.entropy_starts(entropy, r_mask, args.entropy_threshold), 0.0
    if args.termination == "parsing":
        language = "python" if args.task in data.CODE_TASKS else "text"
        starts, fallback = ma.parsing_starts(r_ids, r_mask, tokenizer, args.cutoff, language, return_fallback=True)
        return starts, fallback.float().mean().item()
    raise ValueError(f"unknown --termination {args.termination!r}")


def ppo_losses(args, logp, old_logp, values, old_values, advantages, returns, mask, starts):
    """6. Clipped policy loss (token or macro ratio) and clipped value loss, masked means."""
    log_ratio = (logp - old_logp) * mask
    if args.ratio == "macro":       # §3.3 MA-PPO: pi(omega)/pi_old(omega) = product of its token ratios
        log_ratio = ma.macro_sum(log_ratio, starts) * mask
    ratio = log_ratio.exp()
    # §2 PPO clipped surrogate (Schulman et al. 2017, Eq. 7): max of the two negated terms = min of the objectives
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip, 1 + args.clip))
    # clipped value loss around the rollout's values (value clip 0.2, App. B.2 / Table 5)
    v_clipped = old_values + (values - old_values).clamp(-args.value_clip, args.value_clip)
    vf = 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2)
    stats = {"policy/clipfrac": masked_mean(((ratio - 1).abs() > args.clip).float(), mask),
             "policy/approxkl": masked_mean(0.5 * log_ratio ** 2, mask), "policy/ratio": masked_mean(ratio, mask)}
    return masked_mean(pg, mask), masked_mean(vf, mask), stats


# ---------------------------------------------------------------------------------------------
# Derived settings and the metrics of one iteration
# ---------------------------------------------------------------------------------------------

def resolve(args):
    """Derived settings, in one place: default paths, and what the task's reward is."""
    args.sft_path = args.sft_path or f"runs/{args.task}/sft"
    args.rm_path = args.rm_path or f"runs/{args.task}/rm"
    args.output_dir = args.output_dir or f"runs/{args.task}/ppo_n{args.n}_{args.termination}"
    args.max_response_len = data.response_len(args.task, args.max_response_len)
    code = args.task in data.CODE_TASKS       # reward = running the program; critic from SFT (App. B.2)
    args.critic_path = args.critic_path or (args.sft_path if code else args.rm_path)
    if args.reward not in ("rm", "gold"):
        sys.exit(f"error: --reward {args.reward!r}: choose rm or gold")
    if args.reward == "gold" and args.task not in data.GOLD_JUDGES:
        sys.exit(f"error: --reward gold needs a task with a gold judge ({', '.join(data.GOLD_JUDGES)}), not {args.task!r}")
    args.reward = "exec" if code else args.reward       # the name of the score in the metrics
    return args, code


def iteration_metrics(t, reward):
    """7. The metrics of one iteration from its tensors `t` (masked: no padding in any average)."""
    m, starts = t["m"], t["starts"]
    n_macro = starts.sum(-1).clamp(min=1).float()
    var_r = masked_mean((t["returns"] - masked_mean(t["returns"], m)) ** 2, m)
    lengths = t["r_mask"].sum(-1)
    return {f"reward/{reward}": t["score"].mean(),
            **({"reward/pass_rate": t["passed"].mean()} if reward == "exec" else {}), "reward/total": t["rewards"].sum(-1).mean(),
            "kl": (t["kl"] * m).sum(-1).mean(), "entropy": masked_mean(t["entropy"], m),
            "value/explained_variance": 1 - masked_mean((t["returns"] - t["old_values"]) ** 2, m) / var_r.clamp(min=1e-8),
            # Fig. 11: L2 norms per response, over tokens (a macro counted once per token) and over macro actions
            "adv/l2": (t["raw_adv"] ** 2 * m).sum(-1).sqrt().mean(), "q/l2": (t["returns"] ** 2 * m).sum(-1).sqrt().mean(),
            "adv/l2_macro": (t["raw_adv"] ** 2 * starts).sum(-1).sqrt().mean(),
            "q/l2_macro": (t["returns"] ** 2 * starts).sum(-1).sqrt().mean(),
            "macro/mean_len": (lengths / n_macro).mean(), "macro/parse_fallback": torch.tensor(t["fallback"]),
            "response/len": lengths.float().mean(), "response/eos_rate": t["has_eos"].float().mean(),
            **{k: torch.stack([s[k] for s in t["stats"]]).mean() for k in t["stats"][0]}}


# ---------------------------------------------------------------------------------------------
# Setup: the default models (built when missing), the four models of PPO, optimizers
# ---------------------------------------------------------------------------------------------

def build_default(args, accelerator, code):
    """chitchat / code with no paths given: run sft.py (and reward_model.py, not for code: its reward
    is running the program) once on the main process, reuse them afterwards."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMP_"))}
    sft_args, rm_args = data.BUILD_ARGS.get(args.task, ("", ""))
    stages = [(args.sft_path, "sft.py", ["--task", args.task, *(args.sft_args or sft_args).split()])]
    if not code:
        stages.append((args.rm_path, "reward_model.py", ["--task", args.task, "--sft_path", args.sft_path,
                                                         *(args.rm_args or rm_args).split()]))
    for path, script, extra in stages:
        if accelerator.is_main_process and not os.path.exists(os.path.join(path, "config.json")):
            if args.task not in data.EMBEDDED_TASKS:
                sys.exit(f"error: no model at {path!r}; train it with {script} or pass its path")
            accelerator.print(f"[ppo] {path} missing: running {script}")
            subprocess.run([sys.executable, script, "--output_dir", path, *extra], check=True, env=env,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
        accelerator.wait_for_everyone()


def load_models(args, code):
    """(tokenizer, policy, critic, frozen reference, frozen reward model or None): the policy and the
    reference from the SFT model, the critic from --critic_path (App. B.2); on --resume the trained
    two from the checkpoint."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.resume:
        harness.require_part(harness.checkpoint_part(args.output_dir, "policy"), "checkpoint to resume",
                             "Run without --resume.")
    part = (lambda name, default: harness.checkpoint_part(args.output_dir, name) if args.resume else default)
    tokenizer = data.load_tokenizer(args.sft_path)
    if args.lora_r:     # adapters on the SFT model and the critic's init; no third copy for the reference
        policy = AutoModelForCausalLM.from_pretrained(args.sft_path, dtype=dtype)
        critic = rm.load_reward_model(args.critic_path, args.bf16)[0]
        lora = (args.lora_r, args.lora_alpha, args.lora_target_modules)
        policy = harness.load_lora(policy, part("policy", "")) if args.resume else harness.with_lora(policy, *lora, "CAUSAL_LM")
        critic = Critic(harness.load_lora(critic, part("critic", "")) if args.resume else
                        harness.with_lora(critic, *lora, "SEQ_CLS"))      # SEQ_CLS: the score head trains too
    else:
        policy = AutoModelForCausalLM.from_pretrained(part("policy", args.sft_path), dtype=dtype)
        critic = Critic(rm.load_reward_model(part("critic", args.critic_path), args.bf16)[0])
    with harness.whole_weights():       # the frozen models are never handed to a ZeRO-3 engine
        ref = None if args.lora_r else AutoModelForCausalLM.from_pretrained(args.sft_path, dtype=dtype).eval().requires_grad_(False)
        reward = None if code else rm.load_reward_model(args.rm_path, args.bf16)[0].eval().requires_grad_(False)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        critic.model.gradient_checkpointing_enable()
    return tokenizer, policy, critic, ref, reward


def optimizers(args, policy, critic):
    """AdamW for the policy and for the critic, each with a linear warmup over --warmup_steps."""
    trained = (lambda model: [p for p in model.parameters() if p.requires_grad])     # all of them, or LoRA's
    opts = {"policy_opt": torch.optim.AdamW(trained(policy), lr=args.policy_lr),
            "critic_opt": torch.optim.AdamW(trained(critic), lr=args.critic_lr)}
    warmup = (lambda step: min(1.0, (step + 1) / max(1, args.warmup_steps)))
    return opts, {"policy_sched": torch.optim.lr_scheduler.LambdaLR(opts["policy_opt"], warmup),
                  "critic_sched": torch.optim.lr_scheduler.LambdaLR(opts["critic_opt"], warmup)}


# ---------------------------------------------------------------------------------------------
# Algorithm 1
# ---------------------------------------------------------------------------------------------

def main(args):
    args, code = resolve(args)
    acc, critic_acc = harness.make_accelerators(args.bf16, args.grad_accum, args.mini_batch_size, project_dir=args.output_dir,
                                                log_with=None if args.report_to == "none" else args.report_to)
    harness.start("ppo", args, acc)
    log = acc.print
    if args.top_k or args.top_p < 1:
        log("[ppo] warning: --top_k / --top_p truncate the sampling distribution; the logprobs (temperature only) "
            "do not: the first ratio is not 1 and the KL is off-policy")
    build_default(args, acc, code)
    tokenizer, policy, critic, ref, reward = load_models(args, code)
    splits = data.load_task(args.task, only=("ppo", "test"))
    problems = data.with_chat_template(data.first_row_per_prompt(splits["ppo"]), tokenizer, args.chat_template)
    eval_rows = data.with_chat_template(data.first_row_per_prompt(splits["test"])[:args.n_eval_prompts], tokenizer,
                                        args.chat_template)                # code rows carry their tests
    prompts = [r["prompt"] for r in problems]
    world, rank = acc.num_processes, acc.process_index
    log(f"[ppo] {len(prompts)} training prompts, {len(eval_rows)} held-out prompts, {world} process(es)")
    opts, scheds = optimizers(args, policy, critic)
    policy, opts["policy_opt"], critic, opts["critic_opt"] = harness.prepare_pair(
        acc, critic_acc, policy, opts["policy_opt"], critic, opts["critic_opt"])
    sharded = harness.is_sharded(acc)   # ZeRO-3 / FSDP: every rank runs every forward, generate included
    for frozen in (ref, reward):
        if frozen is not None:
            frozen.to(acc.device)
    generator = torch.Generator().manual_seed(args.seed)       # minibatch order, randomized n-grams
    start, truncated = 0, 0
    if args.resume:
        # optimizer states are per-rank shards under ZeRO/FSDP: they are saved (and restored) only when whole
        state = harness.load_checkpoint(args.output_dir, opts, scheds, log)
        start, truncated = state["step"], state["truncated"]
        generator.set_state(state["generator"])
        log(f"[ppo] resumed at iteration {start}")
    if args.report_to != "none":
        acc.init_trackers("ma-rlhf", config=asdict(args))
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if acc.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        resumed = args.resume and os.path.exists(metrics_path)
        kept = [line for line in open(metrics_path) if json.loads(line)["step"] <= start] if resumed else []
        with open(metrics_path, "w") as f:          # drop iterations the checkpoint does not hold
            f.writelines(kept)

    def save(step):
        weights = harness.full_weights({"policy": (acc, policy), "critic": (critic_acc, critic)}) if sharded else None
        if acc.is_main_process:
            harness.save_checkpoint(args.output_dir, {"policy": acc.unwrap_model(policy),
                                                      "critic": critic_acc.unwrap_model(critic).model}, tokenizer,
                                    step, args, {} if sharded else opts, scheds, weights,
                                    truncated=truncated, generator=generator.get_state())
        acc.wait_for_everyone()

    from tqdm.auto import tqdm
    bar = tqdm(range(start, args.steps), desc=f"ppo n={args.n}", disable=not acc.is_local_main_process)
    with harness.GracefulStop(acc, "ppo", "iteration", harness.checkpoint_dir(args.output_dir), start) as stop:
        for step in bar:
            clock = harness.Stopwatch()
            # 1. Rollout: sample responses to this rank's prompts; logprobs under the sampling distribution
            idx = harness.batch_indices(len(prompts), args.rollout_batch_size, step, args.seed, rank, world)
            policy.eval()
            with harness.generation_weights(acc, policy, args.gather_for_generation) as (model, synced):
                p_ids, p_mask, r_ids, r_mask, n_cut = data.sample(
                    model, tokenizer, [prompts[i] for i in idx], args.max_prompt_len, args.max_response_len,
                    args.temperature, args.top_k, args.top_p, synced_gpus=synced)
            truncated += n_cut
            clock.lap("generate")
            P = p_ids.shape[1]
            ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
            m = r_mask.float()
            # 2. Score: old and reference logprobs, values V(s_t), the sequence score
            with torch.no_grad():
                old_logp, entropy = response_logprobs(policy, ids, mask, P, args.temperature)
                ref_logp = reference_logprobs(ref, acc, policy, ids, mask, P, args.temperature)
                old_values = critic_values(critic, ids, mask, P) * m
                if args.reward in ("exec", "gold"):      # scores of the decoded text
                    texts = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
                if code:    # App. B.5: the compiler / test signal of running prefix + response
                    score, passed = map(torch.tensor, sandbox.execution_reward([problems[i] for i in idx], texts))
                    score = score.to(acc.device)
                elif args.reward == "gold":     # a verifiable reward: the gold judge reads the whole response
                    score, passed = torch.tensor(data.gold(args.task, data.judged_prompts([problems[i] for i in idx]), texts),
                                                 device=acc.device), None
                else:       # the RM's head at the last real token
                    score, passed = rm.last_token(rm.token_values(reward, ids, mask), mask), None
            has_eos = ((r_ids == tokenizer.eos_token_id) & r_mask.bool()).any(-1)
            score = score + args.missing_eos_penalty * (~has_eos).float()
            # 3. Rewards (§2): r_t = -beta * KL_t per token, the score added at the last token (in step 5)
            log_r = old_logp - ref_logp
            kl = log_r if args.kl_estimator == "k1" else (torch.exp(-log_r) - 1) + log_r    # k1 or k3
            kl_rewards = -args.beta * kl * m
            if not (torch.isfinite(kl_rewards).all() and torch.isfinite(score).all()):
                raise FloatingPointError(f"non-finite reward at iteration {step}; last good checkpoint in "
                                         f"{harness.checkpoint_dir(args.output_dir)}")
            clock.lap("forward")
            # 4. Macro actions (§3.2.1): which response tokens begin one
            starts, fallback = macro_starts(args, r_ids, r_mask, old_logp, entropy, tokenizer, generator)
            # 5. Advantages (§3.3, Eq. 4-5): macro rewards R_tau, sigma-weighted macro values, macro GAE
            rewards = token_rewards(kl_rewards, score, r_mask, starts, args.reward_agg)
            advantages, returns = ma.macro_advantages(old_values, rewards, r_mask, starts, args.gamma, args.lam,
                                                      args.sigma)
            raw_adv = advantages
            if args.whiten_advantages:
                advantages = masked_whiten(advantages, m)
            clock.lap("macro")
            # 6. PPO update: epochs over minibatches, the policy and the critic each with its optimizer
            policy.train()
            critic.train()
            stats = []
            for _ in range(args.ppo_epochs):
                order = torch.randperm(len(idx), generator=generator)
                for k in range(0, len(idx), args.mini_batch_size):
                    mb = order[k:k + args.mini_batch_size]
                    with harness.accumulate(acc, policy, critic_acc, critic):
                        logp, _ = response_logprobs(policy, ids[mb], mask[mb], P, args.temperature)
                        values = critic_values(critic, ids[mb], mask[mb], P)
                        pg_loss, vf_loss, s = ppo_losses(args, logp, old_logp[mb], values, old_values[mb],
                                                         advantages[mb], returns[mb], m[mb], starts[mb])
                        if not (torch.isfinite(pg_loss) and torch.isfinite(vf_loss)):
                            raise FloatingPointError(f"non-finite loss at iteration {step}; last good checkpoint "
                                                     f"in {harness.checkpoint_dir(args.output_dir)}")
                        acc.backward(pg_loss)          # the two graphs are disjoint: one backward per model
                        critic_acc.backward(vf_loss)
                        for opt in opts.values():
                            opt.step()
                        for opt in opts.values():
                            opt.zero_grad()
                    stats.append({"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(), **s})
            for sched in scheds.values():
                sched.step()
            clock.lap("update")
            # 7. Log (averaged over processes), evaluate on held-out prompts, checkpoint
            local = iteration_metrics(dict(score=score, passed=passed, rewards=rewards, kl=kl, entropy=entropy, m=m,
                                           returns=returns, old_values=old_values, raw_adv=raw_adv, starts=starts,
                                           r_mask=r_mask, has_eos=has_eos, fallback=fallback, stats=stats), args.reward)
            keys = sorted(local)
            reduced = acc.reduce(torch.stack([local[k].float().to(acc.device) for k in keys]), "mean")
            metrics = {k: round(v, 5) for k, v in zip(keys, reduced.tolist())}
            metrics.update({"step": step + 1, "time/step": round(clock.total(), 3), "prompts/truncated": truncated,
                            **{f"time/{k}": round(v, 4 if k == "macro" else 3) for k, v in clock.laps.items()},
                            "tokens_per_s": round(float(r_mask.sum()) * world / clock.total(), 1),
                            **({"memory/peak_gb": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)}
                               if torch.cuda.is_available() else {})})
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                evaluate_now(args, acc, policy, reward, tokenizer, eval_rows, sharded, code, metrics)
            if acc.is_main_process:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            if args.report_to != "none":
                acc.log(metrics, step=step + 1)
            bar.set_postfix(score=f"{metrics[f'reward/{args.reward}']:.2f}", kl=f"{metrics['kl']:.2f}")
            stop.end_of_step(step + 1, args.steps, args.save_every, save)
    finish(args, acc, critic_acc, policy, critic, reward, tokenizer, eval_rows, metrics_path, sharded, truncated)


def evaluate_now(args, acc, policy, reward, tokenizer, eval_rows, sharded, code, metrics):
    """7. Held-out score (and gold score / pass rate) of the current policy into `metrics`; a log line."""
    if acc.is_main_process or sharded:               # sharded weights: every rank takes part
        with harness.generation_weights(acc, policy, args.gather_for_generation) as (model, synced):
            _, scores, second = evaluate.held_out(model.eval(), reward, tokenizer, eval_rows, args, args.seed, synced)
    if acc.is_main_process:
        key, second_key = ("exec", "pass@1") if code else ("rm", "gold")
        metrics[f"eval/{key}"] = round(scores.mean().item(), 4)
        if second is not None:
            metrics[f"eval/{second_key}"] = round(second.mean().item(), 4)
        acc.print(f"[ppo] iteration {metrics['step']}: " + "  ".join(f"{k} {metrics[k]}" for k in (
            f"reward/{args.reward}", "kl", f"eval/{key}", f"eval/{second_key}", "macro/mean_len") if k in metrics))
    acc.wait_for_everyone()


def finish(args, acc, critic_acc, policy, critic, reward, tokenizer, eval_rows, metrics_path, sharded, truncated):
    """After the last iteration: warnings, the rank-sync check, the final policy, the report."""
    from transformers import AutoModelForCausalLM
    if truncated:
        acc.print(f"[ppo] warning: {truncated} prompts (this process) were longer than {args.max_prompt_len} "
                  f"tokens and lost their beginning")
    if not sharded:
        acc.print(f"[ppo] ranks in sync: {harness.ranks_in_sync(acc, policy) and harness.ranks_in_sync(acc, critic)}")
    final_policy = harness.final_model(acc, policy)        # collective: whole weights, LoRA merged (a plain model)
    if acc.is_main_process:
        final = os.path.join(args.output_dir, "policy")
        harness.atomic_save(final, final_policy, tokenizer)
        # the report reads the saved policy back: whole weights on one process, whatever the sharding; the
        # SFT baseline on the same device and dtype, sampled the same way
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        with harness.whole_weights():
            policy = AutoModelForCausalLM.from_pretrained(final, dtype=dtype).to(acc.device).eval()
            sft_model = AutoModelForCausalLM.from_pretrained(args.sft_path, dtype=dtype).to(acc.device).eval()
        evaluate.final_report(args, policy, sft_model, reward, tokenizer, eval_rows, metrics_path)
    acc.wait_for_everyone()
    if args.report_to != "none":
        acc.end_training()


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(HfArgumentParser(PPOArgs).parse_args_into_dataclasses()[0])
