"""Stage 3: PPO and MA-PPO (paper Algorithm 1); `--n 1` is vanilla token-level PPO.

    accelerate launch ppo.py --n 5       # builds (or reuses) runs/chitchat/{sft,rm}, then trains MA-PPO

One iteration, as numbered below: 1. rollout, 2. score, 3. rewards, 4. macro actions,
5. advantages, 6. PPO update, 7. log / evaluate / checkpoint.
"""
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

import data
import macro_actions as ma
import reward_model as rm
import sandbox
import sft


@dataclass
class PPOArgs:
    task: str = field(default="chitchat", metadata={"help": "chitchat, tldr, tldr_carper, hh, webgpt, code, apps, or a local json/jsonl/parquet file"})
    sft_path: str = field(default="", metadata={"help": "SFT model (policy init and frozen reference); default runs/<task>/sft, built on chitchat if missing"})
    rm_path: str = field(default="", metadata={"help": "reward model (also the critic's init); default runs/<task>/rm, built on chitchat if missing; unused for code tasks"})
    critic_path: str = field(default="", metadata={"help": "critic init: default the RM (App. B.2; the SFT model for code tasks); any causal LM or RM folder, a fresh value head on an LM"})
    output_dir: str = field(default="", metadata={"help": "default runs/<task>/ppo_n<n>_<termination>"})
    sft_args: str = field(default="", metadata={"help": "extra sft.py flags used when the default SFT model is built, e.g. '--max_steps 600'"})
    rm_args: str = field(default="", metadata={"help": "extra reward_model.py flags used when the default RM is built"})
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
    temperature: float = field(default=0.8, metadata={"help": "sampling temperature (logprobs are taken under the same distribution)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling, 0 = off"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling, 1 = off"})
    cutoff: int = field(default=5, metadata={"help": "parsing termination: largest node kept as one macro action"})
    entropy_threshold: float = field(default=2.0, metadata={"help": "entropy termination: a token above this entropy (nats) starts a macro action"})
    max_prompt_len: int = field(default=48, metadata={"help": "prompt tokens kept (truncated from the left, counted)"})
    max_response_len: int = field(default=32, metadata={"help": "generated tokens at most"})
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
    resume: bool = field(default=False, metadata={"help": "continue from <output_dir>/checkpoint"})
    report_to: str = field(default="none", metadata={"help": "accelerate trackers: none | tensorboard | wandb"})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPUs)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations to save memory (GPUs)"})


# ---------------------------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------------------------

def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def token_rewards(kl_rewards, score, r_mask, starts, reward_agg="sum"):
    """Per-token rewards whose sum over a macro action is its reward R_tau: the KL rewards with the
    sequence score added at the last real token. `mean` reproduces the released code: each macro
    action's KL rewards are averaged (divided by its length) and the score is never divided."""
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
        return rm.token_values(self.model, ids, mask)


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
    if args.ratio == "macro":                        # log pi(omega)/pi_old(omega), on every token of omega
        log_ratio = ma.macro_sum(log_ratio, starts) * mask
    ratio = log_ratio.exp()
    pg = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - args.clip, 1 + args.clip))
    v_clipped = old_values + (values - old_values).clamp(-args.value_clip, args.value_clip)
    vf = 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2)
    stats = {"policy/clipfrac": masked_mean(((ratio - 1).abs() > args.clip).float(), mask),
             "policy/approxkl": masked_mean(0.5 * log_ratio ** 2, mask), "policy/ratio": masked_mean(ratio, mask)}
    return masked_mean(pg, mask), masked_mean(vf, mask), stats


# ---------------------------------------------------------------------------------------------
# The default pipeline: build the SFT and reward models of the embedded task when missing
# ---------------------------------------------------------------------------------------------

def build_default(args, accelerator):
    """chitchat / code with no paths given: run sft.py (and reward_model.py, not for code: its reward
    is running the program) once on the main process, reuse them afterwards."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMP_"))}
    stages = [(args.sft_path, "sft.py", ["--task", args.task, *args.sft_args.split()])]
    if args.task not in data.CODE_TASKS:
        stages.append((args.rm_path, "reward_model.py", ["--sft_path", args.sft_path, *args.rm_args.split()]))
    for path, script, extra in stages:
        if accelerator.is_main_process and not os.path.exists(os.path.join(path, "config.json")):
            if args.task not in ("chitchat", "code"):
                sys.exit(f"error: no model at {path!r}; train it with {script} or pass its path")
            accelerator.print(f"[ppo] {path} missing: running {script}")
            subprocess.run([sys.executable, script, "--output_dir", path, *extra], check=True, env=env,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
        accelerator.wait_for_everyone()


def execution_reward(problems, texts):
    """Code tasks: each problem's prefix + response run against its tests in sandbox.py, concurrently.
    Returns (the paper's execution reward [B], 1.0 where every test passed [B])."""
    results = sandbox.run_many([(row["prefix"] + t, row["tests"]) for row, t in zip(problems, texts)])
    return (torch.tensor([r.reward for r in results]), torch.tensor([float(r.outcome == "passed") for r in results]))


@torch.no_grad()
def evaluate_policy(policy, rm_model, tokenizer, prompts, args, seed, synced_gpus=False, problems=None):
    """Held-out prompts -> (responses, RM scores, gold scores), or for code tasks (`problems` given)
    (responses, execution rewards, passed); sampling as in training, under its own seed so that
    evaluating never changes the training run's random numbers."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        *_, r_ids, _ = sft.sample(policy, tokenizer, prompts, args.max_prompt_len, args.max_response_len,
                                  args.temperature, args.top_k, args.top_p, synced_gpus=synced_gpus)
    texts = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
    if problems is not None:
        return (texts, *execution_reward(problems, texts))
    scores = rm.score(rm_model, tokenizer, prompts, texts, args.max_prompt_len, args.max_response_len)
    gold = torch.tensor(data.gold_score(texts)) if args.task == "chitchat" else None
    return texts, scores, gold


def make_accelerators(args):
    """(policy accelerator, critic accelerator): one and the same, except under DeepSpeed, where each
    trained model needs its own engine. accelerate's multi-model recipe: one DeepSpeedPlugin per model
    (both from the launch config) and a second Accelerator for the critic."""
    kwargs = dict(log_with=None if args.report_to == "none" else args.report_to, project_dir=args.output_dir)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        accelerator = sft.make_accelerator(args.bf16, args.grad_accum, **kwargs)
        return accelerator, accelerator
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    plugins = {"policy": DeepSpeedPlugin(), "critic": DeepSpeedPlugin()}
    for plugin in plugins.values():   # no dataloader is prepared, so DeepSpeed is told the micro-batch
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.mini_batch_size
    accelerator = sft.make_accelerator(args.bf16, args.grad_accum, deepspeed_plugins=plugins, **kwargs)
    return accelerator, Accelerator(gradient_accumulation_steps=args.grad_accum)


@contextlib.contextmanager
def whole_weights():
    """Loading context for the frozen reference and reward models: under ZeRO-3, transformers would
    partition them as they load (zero.Init), though no engine ever gathers them again. transformers
    decides that from one module-level DeepSpeed config, set aside here while they load."""
    from transformers.integrations import deepspeed as hf_deepspeed
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def accumulate(accelerator, policy, critic_accelerator, critic):
    """Gradient accumulation context for both models (one accelerator counts the steps once)."""
    if critic_accelerator is accelerator:
        return accelerator.accumulate(policy, critic)
    stack = contextlib.ExitStack()
    stack.enter_context(accelerator.accumulate(policy))
    stack.enter_context(critic_accelerator.accumulate(critic))
    return stack


def full_weights(accelerator, policy, critic_accelerator, critic):
    """Whole state dicts of the trained models, gathered from ZeRO-3 / FSDP shards (a collective call:
    every rank must make it); the critic's keys lose their wrapper's "model." prefix."""
    critic_sd = critic_accelerator.get_state_dict(critic)
    return {"policy": accelerator.get_state_dict(policy),
            "critic": {k.removeprefix("model."): v for k, v in critic_sd.items()} if critic_sd else critic_sd}


def main(args):
    args.sft_path = args.sft_path or f"runs/{args.task}/sft"
    args.rm_path = args.rm_path or f"runs/{args.task}/rm"
    args.output_dir = args.output_dir or f"runs/{args.task}/ppo_n{args.n}_{args.termination}"
    accelerator, critic_accelerator = make_accelerators(args)
    log = accelerator.print
    log(f"[ppo] config: {asdict(args)}")
    build_default(args, accelerator)
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    ckpt = os.path.join(args.output_dir, "checkpoint")
    if args.resume:
        sft.require_model_dir(os.path.join(ckpt, "policy"), "checkpoint to resume", "Run without --resume.")
    policy_src = os.path.join(ckpt, "policy") if args.resume else args.sft_path
    code = args.task in data.CODE_TASKS         # reward = running the program; critic from SFT (App. B.2)
    critic_src = os.path.join(ckpt, "critic") if args.resume else args.critic_path or (args.sft_path if code else args.rm_path)
    tokenizer = sft.load_tokenizer(args.sft_path)
    policy = AutoModelForCausalLM.from_pretrained(policy_src, dtype=dtype)
    critic = Critic(rm.load_reward_model(critic_src, args.bf16)[0])
    with whole_weights():       # the frozen models are never handed to a ZeRO-3 engine
        ref = AutoModelForCausalLM.from_pretrained(args.sft_path, dtype=dtype).eval().requires_grad_(False)
        reward = None if code else rm.load_reward_model(args.rm_path, args.bf16)[0].eval().requires_grad_(False)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        critic.model.gradient_checkpointing_enable()
    splits = data.load_task(args.task, only=("ppo", "test"))
    problems, eval_problems = data.first_row_per_prompt(splits["ppo"]), data.first_row_per_prompt(splits["test"])
    prompts = [r["prompt"] for r in problems]
    eval_problems = eval_problems[:args.n_eval_prompts]
    eval_prompts = [r["prompt"] for r in eval_problems]
    eval_code = eval_problems if code else None           # evaluation runs their programs
    score_key, second_key = ("exec", "pass@1") if code else ("rm", "gold")
    world, rank = accelerator.num_processes, accelerator.process_index
    log(f"[ppo] {len(prompts)} training prompts, {len(eval_prompts)} held-out prompts, {world} process(es)")

    def schedule(step):
        return min(1.0, (step + 1) / max(1, args.warmup_steps))
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=args.policy_lr)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr)
    policy_sched = torch.optim.lr_scheduler.LambdaLR(policy_opt, schedule)
    critic_sched = torch.optim.lr_scheduler.LambdaLR(critic_opt, schedule)
    policy, policy_opt = accelerator.prepare(policy, policy_opt)
    if critic_accelerator is not accelerator:              # DeepSpeed: the critic's own engine
        accelerator.state.select_deepspeed_plugin("critic")
    critic, critic_opt = critic_accelerator.prepare(critic, critic_opt)
    # ZeRO-3 / FSDP shard the trained models: forwards (generate included) are collective, so every
    # rank runs them; generate() uses synced_gpus=True so ranks that finish early keep answering
    sharded = world > 1 and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED")
    ref.to(accelerator.device)
    if reward is not None:
        reward.to(accelerator.device)
    start = 0
    if args.resume:
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
        for obj, key in [(policy_opt, "policy_opt"), (critic_opt, "critic_opt"), (policy_sched, "policy_sched"),
                         (critic_sched, "critic_sched")]:
            if key in state:
                obj.load_state_dict(state[key])
            else:
                log(f"[ppo] warning: the checkpoint holds no {key} state (saved under ZeRO/FSDP): it starts afresh")
        sft.set_rng_state(state["rng"])
        start = state["step"]
        log(f"[ppo] resumed at iteration {start}")
    generator = torch.Generator().manual_seed(args.seed)
    if args.resume:
        generator.set_state(state["generator"])
    if args.report_to != "none":
        accelerator.init_trackers("ma-rlhf", config=asdict(args))
    os.makedirs(args.output_dir, exist_ok=True)
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if args.resume and accelerator.is_main_process and os.path.exists(metrics_path):
        kept = [line for line in open(metrics_path) if json.loads(line)["step"] <= start]
        with open(metrics_path, "w") as f:                # drop iterations the checkpoint does not hold
            f.writelines(kept)

    def save(step, path=ckpt):
        weights = full_weights(accelerator, policy, critic_accelerator, critic)    # collective: every rank
        if accelerator.is_main_process:
            # optimizer states are per-rank shards under ZeRO/FSDP: kept only when they are whole
            optim = {} if sharded else {k: o.state_dict() for k, o in [("policy_opt", policy_opt), ("critic_opt", critic_opt)]}
            sft.atomic_save(path, tokenizer=tokenizer, parts={
                "policy": accelerator.unwrap_model(policy), "critic": critic_accelerator.unwrap_model(critic).model},
                state_dicts=weights, state={
                "step": step, "truncated": truncated_total, "rng": sft.rng_state(), "generator": generator.get_state(),
                "args": asdict(args), "policy_sched": policy_sched.state_dict(), "critic_sched": critic_sched.state_dict(), **optim})
        accelerator.wait_for_everyone()

    from tqdm.auto import tqdm
    truncated_total = state["truncated"] if args.resume else 0
    bar = tqdm(range(start, args.steps), desc=f"ppo n={args.n}", disable=not accelerator.is_local_main_process)
    ctrl_c = sft.CtrlC(accelerator, "iteration", saved=start)
    try:
        for step in bar:
            t0 = time.time()
            # 1. Rollout: sample responses; logprobs under the sampling distribution
            idx = sft.batch_indices(len(prompts), args.rollout_batch_size, step, args.seed, rank, world)
            batch_prompts = [prompts[i] for i in idx]
            truncated_total += data.encode_prompts(tokenizer, batch_prompts, args.max_prompt_len)[2]
            policy.eval()
            p_ids, p_mask, r_ids, r_mask = sft.sample(accelerator.unwrap_model(policy), tokenizer, batch_prompts,
                                                      args.max_prompt_len, args.max_response_len,
                                                      args.temperature, args.top_k, args.top_p, synced_gpus=sharded)
            t_gen = time.time() - t0
            P = p_ids.shape[1]
            ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)
            m = r_mask.float()
            # 2. Score: old logprobs, reference logprobs, values, RM score at the last real token
            with torch.no_grad():
                old_logp, entropy = response_logprobs(policy, ids, mask, P, args.temperature)
                ref_logp, _ = response_logprobs(ref, ids, mask, P, args.temperature)
                old_values = critic_values(critic, ids, mask, P) * m
                if code:
                    texts = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
                    score, passed = execution_reward([problems[i] for i in idx], texts)
                    score = score.to(accelerator.device)
                else:
                    score = rm.last_token(rm.token_values(reward, ids, mask), mask)
            has_eos = ((r_ids == tokenizer.eos_token_id) & r_mask.bool()).any(-1)
            score = score + args.missing_eos_penalty * (~has_eos).float()
            # 3. Rewards: -beta * KL per token, the score added at the last real token
            log_r = old_logp - ref_logp
            kl = log_r if args.kl_estimator == "k1" else (torch.exp(-log_r) - 1) + log_r
            kl_rewards = -args.beta * kl * m
            if not (torch.isfinite(kl_rewards).all() and torch.isfinite(score).all()):
                raise FloatingPointError(f"non-finite reward at iteration {step}; last good checkpoint in {ckpt}")
            t_forward = time.time() - t0 - t_gen
            # 4. Macro actions
            t1 = time.time()
            starts, fallback = macro_starts(args, r_ids, r_mask, old_logp, entropy, tokenizer, generator)
            # 5. Macro-level GAE, broadcast to tokens
            rewards = token_rewards(kl_rewards, score, r_mask, starts, args.reward_agg)
            advantages, returns = ma.macro_advantages(old_values, rewards, r_mask, starts, args.gamma, args.lam,
                                                      args.sigma)
            t_macro = time.time() - t1
            raw_adv = advantages
            if args.whiten_advantages:
                advantages = masked_whiten(advantages, m)
            # 6. PPO epochs over minibatches; separate policy and critic optimizers
            t2 = time.time()
            policy.train()
            critic.train()
            stats = []
            for _ in range(args.ppo_epochs):
                order = torch.randperm(len(idx), generator=generator)
                for k in range(0, len(idx), args.mini_batch_size):
                    mb = order[k:k + args.mini_batch_size]
                    with accumulate(accelerator, policy, critic_accelerator, critic):
                        logp, _ = response_logprobs(policy, ids[mb], mask[mb], P, args.temperature)
                        values = critic_values(critic, ids[mb], mask[mb], P)
                        pg_loss, vf_loss, s = ppo_losses(args, logp, old_logp[mb], values, old_values[mb],
                                                         advantages[mb], returns[mb], m[mb], starts[mb])
                        if not (torch.isfinite(pg_loss) and torch.isfinite(vf_loss)):
                            raise FloatingPointError(f"non-finite loss at iteration {step}; last good checkpoint in {ckpt}")
                        accelerator.backward(pg_loss)            # the two graphs are disjoint:
                        critic_accelerator.backward(vf_loss)     # one backward per model
                        policy_opt.step()
                        critic_opt.step()
                        policy_opt.zero_grad()
                        critic_opt.zero_grad()
                    stats.append({"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(), **s})
            policy_sched.step()
            critic_sched.step()
            t_update = time.time() - t2
            # 7. Log (averaged over processes), evaluate, checkpoint
            n_macro = starts.sum(-1).clamp(min=1).float()
            var_r = masked_mean((returns - masked_mean(returns, m)) ** 2, m)
            local = {f"reward/{score_key}": score.mean(), **({"reward/pass_rate": passed.mean()} if code else {}), "reward/total": (rewards.sum(-1)).mean(),
                     "kl": (kl * m).sum(-1).mean(), "entropy": masked_mean(entropy, m),
                     "value/explained_variance": 1 - masked_mean((returns - old_values) ** 2, m) / var_r.clamp(min=1e-8),
                     "adv/l2": (raw_adv ** 2 * m).sum(-1).sqrt().mean(), "q/l2": (returns ** 2 * m).sum(-1).sqrt().mean(),
                     "adv/l2_macro": (raw_adv ** 2 * starts).sum(-1).sqrt().mean(),
                     "q/l2_macro": (returns ** 2 * starts).sum(-1).sqrt().mean(),
                     "macro/mean_len": (r_mask.sum(-1) / n_macro).mean(), "macro/parse_fallback": torch.tensor(fallback),
                     "response/len": r_mask.sum(-1).float().mean(), "response/eos_rate": has_eos.float().mean(),
                     **{k: torch.stack([s[k] for s in stats]).mean() for k in stats[0]}}
            keys = sorted(local)
            values_all = accelerator.reduce(torch.stack([local[k].float().to(accelerator.device) for k in keys]), "mean")
            metrics = {k: round(v, 5) for k, v in zip(keys, values_all.tolist())}
            metrics.update({"step": step + 1, "time/step": round(time.time() - t0, 3), "time/generate": round(t_gen, 3),
                            "time/forward": round(t_forward, 3), "time/macro": round(t_macro, 4),
                            "time/update": round(t_update, 3), "prompts/truncated": truncated_total,
                            "tokens_per_s": round(float(r_mask.sum()) * world / (time.time() - t0), 1)})
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                if accelerator.is_main_process or sharded:       # sharded forwards need every rank
                    _, ev_scores, ev_gold = evaluate_policy(accelerator.unwrap_model(policy).eval(), reward, tokenizer,
                                                            eval_prompts, args, args.seed, sharded, eval_code)
                if accelerator.is_main_process:
                    metrics[f"eval/{score_key}"] = round(ev_scores.mean().item(), 4)
                    if ev_gold is not None:
                        metrics[f"eval/{second_key}"] = round(ev_gold.mean().item(), 4)
                    log(f"[ppo] iteration {step + 1}: " + "  ".join(f"{k} {metrics[k]}" for k in (
                        f"reward/{score_key}", "kl", f"eval/{score_key}", f"eval/{second_key}", "macro/mean_len") if k in metrics))
                accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            if args.report_to != "none":
                accelerator.log(metrics, step=step + 1)
            bar.set_postfix(score=f"{metrics[f'reward/{score_key}']:.2f}", kl=f"{metrics['kl']:.2f}")
            if ctrl_c.stop_after(step + 1, args.steps, args.save_every, save):
                log(f"[ppo] interrupted after iteration {step + 1}: checkpoint in {ckpt}; continue with --resume")
                sys.exit(130)
    except KeyboardInterrupt:
        log(f"[ppo] quit without saving: {ctrl_c.kept(ckpt)}")
        sys.exit(130)
    ctrl_c.release()
    if truncated_total:
        log(f"[ppo] warning: {truncated_total} prompts (this process) were longer than {args.max_prompt_len} "
            f"tokens and lost their beginning")
    if not sharded:
        log(f"[ppo] ranks in sync: {ranks_in_sync(accelerator, policy) and ranks_in_sync(accelerator, critic)}")
    weights = full_weights(accelerator, policy, critic_accelerator, critic)["policy"]
    if accelerator.is_main_process:
        final = os.path.join(args.output_dir, "policy")
        sft.atomic_save(final, tokenizer=tokenizer, model=accelerator.unwrap_model(policy), state_dicts={"model": weights})
        # the report reads the saved policy back: whole weights on one process, whatever the sharding
        with whole_weights():
            final_report(args, AutoModelForCausalLM.from_pretrained(final, dtype=dtype).to(accelerator.device).eval(),
                         reward, tokenizer, eval_prompts, metrics_path, eval_code)
    accelerator.wait_for_everyone()
    if args.report_to != "none":
        accelerator.end_training()


@torch.no_grad()
def ranks_in_sync(accelerator, model):
    """True when every process holds the same parameters (a checksum gathered over ranks)."""
    params = [p.detach().float().flatten() for p in accelerator.unwrap_model(model).parameters()]
    flat = torch.cat(params)
    checksum = torch.stack([flat.sum(), (flat * torch.arange(len(flat), device=flat.device) % 7).sum()])
    every = accelerator.gather(checksum.unsqueeze(0))
    return bool((every == every[0]).all())


def final_report(args, policy, reward, tokenizer, prompts, metrics_path, problems=None):
    """SFT vs policy on the held-out prompts: mean RM score, mean gold score, gold win rate; for code
    tasks mean execution reward and pass@1 (one sample per problem)."""
    from transformers import AutoModelForCausalLM
    sft_model = AutoModelForCausalLM.from_pretrained(args.sft_path).eval()
    _, s_score, s_second = evaluate_policy(sft_model, reward, tokenizer, prompts, args, args.seed + 1, problems=problems)
    _, p_score, p_second = evaluate_policy(policy, reward, tokenizer, prompts, args, args.seed + 1, problems=problems)
    score_name = "mean execution reward" if problems is not None else "mean RM score"
    lines = ["", f"| held-out ({len(prompts)} prompts) | SFT | policy (n={args.n}, {args.termination}) |",
             "|---|---|---|", f"| {score_name} | {s_score.mean():.3f} | {p_score.mean():.3f} |"]
    if problems is not None:
        lines += [f"| pass@1 (sampled, T={args.temperature}) | {s_second.mean():.1%} | {p_second.mean():.1%} |"]
    elif s_second is not None:
        win = ((p_second > s_second).float() + 0.5 * (p_second == s_second).float()).mean()
        lines += [f"| mean gold score | {s_second.mean():.3f} | {p_second.mean():.3f} |",
                  f"| gold win rate vs SFT (ties half) | | {win:.1%} |"]
    png = plot_curves(metrics_path)
    lines += ["", f"metrics: {metrics_path}", f"learning curve: {png}"]
    print("\n".join(lines))
    with open(os.path.join(args.output_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def plot_curves(metrics_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(metrics_path)]
    key, second, name = ("exec", "pass@1", "execution reward") if "reward/exec" in rows[0] else ("rm", "gold", "RM score")
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    ax[0].plot([r["step"] for r in rows], [r[f"reward/{key}"] for r in rows], label=f"train {name}")
    ev = [r for r in rows if f"eval/{key}" in r]
    ax[0].plot([r["step"] for r in ev], [r[f"eval/{key}"] for r in ev], "o-", label=f"held-out {name}")
    if ev and f"eval/{second}" in ev[0]:
        ax[1].plot([r["step"] for r in ev], [r[f"eval/{second}"] for r in ev], "o-", color="C2")
    ax[1].set_title(f"held-out {second} score" if second == "gold" else "held-out pass@1")
    ax[0].legend()
    for a in ax:
        a.set_xlabel("iteration")
    png = os.path.join(os.path.dirname(metrics_path), "learning_curve.png")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return png


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(HfArgumentParser(PPOArgs).parse_args_into_dataclasses()[0])
