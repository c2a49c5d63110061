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
    sft_path: str = field(default="", metadata={"help": "SFT model (policy init and frozen reference); default runs/<task>/sft, built if missing on chitchat, count and code"})
    rm_path: str = field(default="", metadata={"help": "reward model (also the critic's init); default runs/<task>/rm, built if missing on chitchat and count; unused for code tasks"})
    reward: str = field(default="rm", metadata={"help": "the sequence score: rm (the reward model, the paper; a segment or token RM scores e(x, y), the mean of its segment rewards) | gold (the task's gold judge as a verifiable reward: chitchat, count) | segment (a segment or token RM's rewards spread over each segment's tokens, Yin et al. 2025; needs the RM's segment_reward.json); code tasks always run the program", "choices": ("rm", "gold", "segment")})
    critic_path: str = field(default="", metadata={"help": "critic init: default the RM (App. B.2; the SFT model for code tasks); any causal LM or RM folder, a fresh value head on an LM"})
    output_dir: str = field(default="", metadata={"help": "default runs/<task>/ppo_n<n>_fixed, or runs/<task>/ppo_<termination> for the other terminations"})
    sft_args: str = field(default="", metadata={"help": "extra sft.py flags used when the default SFT model is built, e.g. '--max_steps 600' (count: '--max_steps 1600 ...' when empty)"})
    rm_args: str = field(default="", metadata={"help": "extra reward_model.py flags used when the default RM is built (count: '--max_steps 1000 ...' when empty)"})
    n: int = field(default=5, metadata={"help": "macro action length for --termination fixed: 1 = vanilla PPO, 0 = the whole response"})
    termination: str = field(default="fixed", metadata={"help": "fixed | randomized | parsing | ppl | entropy (paper §3.2.1) | segment (the segment RM's entropy segments, c_ent from its segment_reward.json, or --c_ent)", "choices": ("fixed", "randomized", "parsing", "ppl", "entropy", "segment")})
    c_ent: float = field(default=0.0, metadata={"help": "--termination segment with --reward rm or gold: the SFT entropy threshold (nats) of the segments, e.g. a segment RM's c_ent to compare on the same segments; 0 = read the --rm_path's segment_reward.json. With --reward segment and a sequence RM (and --seg_norm none): its head read at the end of each of these segments (Yin et al. 2025, Table 1's bandit as segment)"})
    rm_norm: bool = field(default=False, metadata={"help": "--reward rm: the RM's score standardized, (r - mean) / std, with the mean and std of its score on its calibration pairs (Yin et al. 2025, §2.1): score_norm.json beside the RM, written by reward_model.py (fitted here on the RM split's first 1024 pairs and written there when missing); eval/rm stays the raw score"})
    seg_norm: str = field(default="regression", metadata={"help": "--reward segment: normalizer of the segment rewards: regression (Mean(p), Std(p) on log p, the paper's) | global | last (one mean and std) | none", "choices": ("regression", "global", "last", "none")})
    seg_interp: str = field(default="even", metadata={"help": "--reward segment: a segment's reward on its tokens: even (divided by its length, the paper's) | repeat (on every token) | end (on its last token) | bandit (none of them: e(x, y), the mean raw segment reward, as one score at the last token; Yin et al. 2025, Table 1's segment as bandit)", "choices": ("even", "repeat", "end", "bandit")})
    reward_clip: float = field(default=10.0, metadata={"help": "--reward segment: the per-token segment rewards clipped to [-c, c] before the KL penalty is added, as in the released code; 0 = off"})
    critic_warmup: int = field(default=0, metadata={"help": "value-only updates for the first k iterations, the policy not stepped (OpenRLHF's --freezing_actor_steps)"})
    sigma: str = field(default="equal", metadata={"help": "macro value weights: equal | unit | position | first (App. D.1)", "choices": ("equal", "unit", "position", "first")})
    reward_agg: str = field(default="sum", metadata={"help": "macro reward: sum (the paper's equation) | mean (each macro action's KL penalty averaged, the score kept whole) | released (the released code: mean, and the final token a macro action of its own, for every termination)", "choices": ("sum", "mean", "released")})
    ratio: str = field(default="token", metadata={"help": "token: per-token ratios with macro advantages (released code), the loss a mean over tokens | macro: the paper's pi(omega)/pi_old(omega), the loss a mean over macro actions (each weighs the same, whatever its length)", "choices": ("token", "macro")})
    kl_estimator: str = field(default="k1", metadata={"help": "per-token KL: k1 = logp - logp_ref | k3 = (r - 1) - log r, r = p_ref/p", "choices": ("k1", "k3")})
    beta: float = field(default=0.05, metadata={"help": "KL penalty coefficient (the first one, under --kl_target)"})
    kl_target: float = field(default=0.0, metadata={"help": "adaptive KL controller (Ziegler et al. 2019): the per-sequence KL to hold. After each iteration beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / --kl_horizon), KL the batch's mean per-sequence KL over every process, n its samples; 0 = off (--beta fixed)"})
    kl_horizon: int = field(default=10000, metadata={"help": "adaptive KL controller: its horizon in samples (larger = slower; at most 0.2 * n / horizon of change per iteration)"})
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
    grad_accum: int = field(default=1, metadata={"help": "minibatches per optimizer step; an iteration whose minibatches it does not divide steps once more on its remainder (a mean over those), so no step mixes two iterations' gradients"})
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
    report_to: str = field(default="none", metadata={"help": "accelerate trackers: none | tensorboard | wandb", "choices": ("none", "tensorboard", "wandb")})
    bf16: bool = field(default=False, metadata={"help": "bf16 mixed precision (GPUs)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations to save memory (GPUs)"})
    gather_for_generation: bool = field(default=True, metadata={"help": "ZeRO-3 / FSDP: gather the policy's whole weights once for each generate() (fast; the whole policy on every GPU while generating); --gather_for_generation false: sharded generation (least memory, slow)"})


# ---------------------------------------------------------------------------------------------
# Small helpers (the math of one iteration)
# ---------------------------------------------------------------------------------------------

def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def response_logprobs(model, ids, attention_mask, prompt_width, temperature, with_entropy=False, t1_entropy=False):
    """(log pi(y_t | x, y_<t) of every response token under the sampling distribution (logits /
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
            entropy = rm.next_token_entropy(logits)
    logp_all = (logits / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, prompt_width:].unsqueeze(-1)).squeeze(-1)
    if with_entropy:
        with torch.no_grad():
            entropy = rm.entropy(logp_all)      # -inf-safe: a token of probability 0 adds 0
    harness.release_freed_memory(ids.device)        # the forward's temporaries, out of the CPU's resident memory
    return logp, entropy


class Critic(torch.nn.Module):
    """The reward model read at every position (critic initialised from the RM, App. B.2); a module
    of its own so that DDP / FSDP wrap the forward that computes the values."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask):
        model = self.model.get_base_model() if harness.is_lora(self.model) else self.model   # LoRA layers inside
        return rm.token_values(model, ids, attention_mask)


def reference_logprobs(ref, accelerator, policy, ids, attention_mask, prompt_width, temperature, t1_entropy=False):
    """(log pi_ref of the response tokens, the SFT entropy at temperature 1 if `t1_entropy` else None):
    the frozen SFT model's, or under LoRA (ref None) the policy's with its adapters switched off, which
    is the SFT model."""
    if ref is not None:
        return response_logprobs(ref, ids, attention_mask, prompt_width, temperature, t1_entropy=t1_entropy)
    with harness.unwrap(accelerator, policy).disable_adapter():
        return response_logprobs(policy, ids, attention_mask, prompt_width, temperature, t1_entropy=t1_entropy)


def has_dropout(model):
    """Whether `model` drops anything in train mode: a Dropout module or a config's *dropout* rate above 0."""
    configs = [getattr(m, "config", None) for m in model.modules()]
    rates = [v for c in configs if hasattr(c, "__dict__") for k, v in vars(c).items() if "dropout" in k]
    return (any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
            or any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in rates))


def fused_update(args, accelerator, batch_size, policy, critic):
    """Whether the update reuses step 2's policy and critic forwards instead of running its own: one
    epoch over one minibatch holding the whole rollout batch, no gradient accumulation, unsharded
    models without dropout. Then both forwards run once, with their graphs: detached they are the old
    logprobs and values, and the update gathers its minibatch's rows of them. One forward fewer per
    model, and the first ratio is exactly 1 (old = detached new). The numbers equal those of separate
    forwards because a row's forward does not depend on the other rows nor, without dropout, on
    train() / eval()."""
    return (args.ppo_epochs == 1 and args.mini_batch_size >= batch_size and args.grad_accum == 1
            and not harness.is_sharded(accelerator) and not has_dropout(policy) and not has_dropout(critic))


def critic_values(critic, ids, attention_mask, prompt_width):
    """V(s_t) for the state before each response token: the head at the preceding position [B, R]."""
    values = critic(ids, attention_mask)[:, prompt_width - 1:-1]
    harness.release_freed_memory(ids.device)
    return values


def macro_starts(termination, response_ids, response_mask, *, n=5, logprobs=None, entropy=None,
                 entropy_threshold=2.0, tokenizer=None, cutoff=5, language="text", generator=None, segments=None):
    """4. Which response tokens begin a macro action ([B, R] bool), and the share of rows whose parse
    fell back to n=1. ppl reads `logprobs`, entropy `entropy`, parsing `tokenizer`, segment the
    segments' `starts` (EOS joins the last segment's macro action) ([B, R] inputs)."""
    if termination == "segment":
        return segments, 0.0
    if termination == "fixed":
        return ma.fixed_ngram_starts(response_mask, n), 0.0
    if termination == "randomized":
        return ma.randomized_ngram_starts(response_mask, generator=generator), 0.0
    if termination == "ppl":
        return ma.perplexity_starts(logprobs, response_mask), 0.0
    if termination == "entropy":
        return ma.entropy_starts(entropy, response_mask, entropy_threshold), 0.0
    if termination == "parsing":
        starts, fallback = ma.parsing_starts(response_ids, response_mask, tokenizer, cutoff, language,
                                             return_fallback=True)
        return starts, fallback.float().mean().item()
    raise ValueError(f"unknown --termination {termination!r}")


def token_rewards_of(kl_rewards, score, response_mask, starts, agg="sum", dense=None, penalty=None, clip=0.0):
    """3. Per-token rewards [B, R]: the KL rewards with the sequence `score` [B] at the last real token
    (`macro_rewards`). With `dense` segment rewards [B, R] the score (e, their mean) is only logged:
    the tokens get the KL rewards plus `dense`, clipped to [-clip, clip] (0 = off; the released code
    clips the segment rewards, not the KL term), plus the missing-EOS `penalty` [B] at the last real
    token. So a segment reward equal to the score at the last token gives exactly the score's rewards."""
    if dense is None:
        return ma.macro_rewards(kl_rewards, score, response_mask, starts, agg)
    dense = dense.clamp(-clip, clip) if clip else dense
    penalty = torch.zeros_like(score) if penalty is None else penalty
    return (ma.macro_rewards(kl_rewards, torch.zeros_like(score), response_mask, starts, agg)
            + ma.macro_rewards(dense, penalty, response_mask, starts))


def adaptive_beta(beta, kl, target, n, horizon):
    """7. The KL coefficient of the next iteration (Ziegler et al. 2019, §2.2): proportional control of the
    per-sequence KL towards `target`, the error clipped to +-20%, the step scaled by the `n` samples seen
    out of a `horizon`. `target` 0 keeps `beta` fixed."""
    if not target:
        return beta
    error = min(max(kl / target - 1, -0.2), 0.2)
    return beta * (1 + error * n / horizon)


def ppo_losses(logp, old_logp, values, old_values, advantages, returns, response_mask, starts, *,
               clip=0.2, value_clip=0.2, ratio="token"):
    """6. Clipped policy loss (token or macro ratio) and clipped value loss, masked means, and their
    stats. Every tensor [B, R]; `response_mask` 1.0 on real response tokens, `starts` where macro
    actions begin."""
    log_ratio = (logp - old_logp) * response_mask
    weights = response_mask         # token ratios: a mean over tokens
    if ratio == "macro":            # §3.3 MA-PPO: pi(omega)/pi_old(omega) = product of its token ratios
        log_ratio = ma.macro_sum(log_ratio, starts) * response_mask
        # the objective is a mean over macro actions: each weighs the same, whatever its length
        weights = response_mask / ma.macro_sum(response_mask, starts).clamp(min=1)
    ratios = log_ratio.exp()
    # §2 PPO clipped surrogate (Schulman et al. 2017, Eq. 7): max of the two negated terms = min of the objectives
    pg = torch.max(-advantages * ratios, -advantages * ratios.clamp(1 - clip, 1 + clip))
    # clipped value loss around the rollout's values (value clip 0.2, App. B.2 / Table 5)
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    vf = 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2)
    stats = {"policy/clipfrac": masked_mean(((ratios - 1).abs() > clip).float(), response_mask),
             "policy/approxkl": masked_mean(0.5 * log_ratio ** 2, response_mask),
             "policy/ratio": masked_mean(ratios, response_mask)}
    return masked_mean(pg, weights), masked_mean(vf, response_mask), stats


# ---------------------------------------------------------------------------------------------
# Derived settings and the metrics of one iteration
# ---------------------------------------------------------------------------------------------

def run_name(args):
    """ppo_n<n>_fixed for fixed n-grams, else ppo_<termination> (the other terminations ignore --n)."""
    return f"ppo_n{args.n}_fixed" if args.termination == "fixed" else f"ppo_{args.termination}"


def resolve(args):
    """Derived settings, in one place: default paths, and whether the task's score is running its code."""
    harness.check_choices(args)
    data.resolve_paths(args, run_name(args))
    args.max_response_len = data.response_len(args.task, args.max_response_len)
    code = args.task in data.CODE_TASKS       # score = running the program; critic from SFT (App. B.2)
    args.critic_path = args.critic_path or (args.sft_path if code else args.rm_path)
    if code and "segment" in (args.reward, args.termination):
        sys.exit(f"error: --reward / --termination segment need a reward model; {args.task!r} runs its code")
    if args.reward == "segment" and args.lora_r:
        sys.exit("error: --reward segment scores held-out responses with the frozen SFT model's segments; "
                 "it has none under --lora_r (the reference is the policy with its adapters off)")
    if args.c_ent and args.reward != "segment" and args.termination != "segment":
        sys.exit("error: --c_ent sets the segments of --termination segment, or those a sequence RM is read on "
                 "under --reward segment (bandit as segment)")
    if args.rm_norm and (code or args.reward != "rm"):
        sys.exit(f"error: --rm_norm normalizes the reward model's score under --reward rm, not --reward {args.reward}"
                 + (f" (task {args.task!r} runs its code)" if code else ""))
    if args.kl_target < 0 or args.kl_horizon < 1:
        sys.exit(f"error: --kl_target {args.kl_target} / --kl_horizon {args.kl_horizon}: a target >= 0 (0 = a fixed "
                 "--beta) and a horizon of at least 1 sample")
    if args.reward_clip < 0:
        sys.exit(f"error: --reward_clip {args.reward_clip}: a bound (> 0) or 0 for none")
    if args.reward == "gold" and args.task not in data.GOLD_JUDGES:
        sys.exit(f"error: --reward gold needs a task with a gold judge ({', '.join(data.GOLD_JUDGES)}), not {args.task!r}")
    return args, code


@dataclass
class Iteration:
    """The tensors of one iteration that its metrics read; B rollouts of R response tokens."""
    score: torch.Tensor             # [B] the sequence score (RM, gold judge or execution)
    passed: torch.Tensor | None     # [B] 1.0 where every test passed (code tasks), else None
    token_rewards: torch.Tensor     # [B, R] per-token rewards: KL rewards and the score (macro_rewards)
    kl: torch.Tensor                # [B, R] per-token KL estimate
    entropy: torch.Tensor           # [B, R] the policy's entropy at each response token
    response_mask: torch.Tensor     # [B, R] 1.0 on real response tokens
    starts: torch.Tensor            # [B, R] bool, where a macro action begins
    old_values: torch.Tensor        # [B, R] V(s_t) at rollout time
    advantages: torch.Tensor        # [B, R] macro advantages before whitening
    returns: torch.Tensor           # [B, R] the critic's targets
    has_eos: torch.Tensor           # [B] bool, the response ended with EOS
    parse_fallback: float           # share of rows whose parse fell back to n=1
    update_stats: list              # one dict of losses and ratio stats per minibatch
    segment_stats: dict = field(default_factory=dict)      # --reward segment: segment counts and normalized rewards


def iteration_metrics(it, score_name):
    """7. The metrics of one Iteration (masked: no padding in any average); the score is logged as
    reward/<score_name> (rm, gold or exec)."""
    m, starts = it.response_mask, it.starts
    n_macro = starts.sum(-1).clamp(min=1).float()
    var_r = masked_mean((it.returns - masked_mean(it.returns, m)) ** 2, m)
    lengths = m.sum(-1)
    return {f"reward/{score_name}": it.score.mean(),
            **({"reward/pass_rate": it.passed.mean()} if it.passed is not None else {}),
            "reward/total": it.token_rewards.sum(-1).mean(),
            "kl": (it.kl * m).sum(-1).mean(), "entropy": masked_mean(it.entropy, m),
            "value/explained_variance": 1 - masked_mean((it.returns - it.old_values) ** 2, m) / var_r.clamp(min=1e-8),
            # Fig. 11: L2 norms per response, over tokens (a macro counted once per token) and over macro actions
            "adv/l2": (it.advantages ** 2 * m).sum(-1).sqrt().mean(), "q/l2": (it.returns ** 2 * m).sum(-1).sqrt().mean(),
            "adv/l2_macro": (it.advantages ** 2 * starts).sum(-1).sqrt().mean(),
            "q/l2_macro": (it.returns ** 2 * starts).sum(-1).sqrt().mean(),
            "macro/mean_len": (lengths / n_macro).mean(), "macro/parse_fallback": torch.tensor(it.parse_fallback),
            "response/len": lengths.mean(), "response/eos_rate": it.has_eos.float().mean(),
            **{k: torch.stack([s[k] for s in it.update_stats]).mean() for k in it.update_stats[0]}, **it.segment_stats}


# ---------------------------------------------------------------------------------------------
# Setup: the default models (built when missing), the four models of PPO, optimizers
# ---------------------------------------------------------------------------------------------

def build_default(args, accelerator, code):
    """Embedded tasks (chitchat, count, code) with no model at the default paths: run sft.py (and
    reward_model.py, not for code: its score is running the program) once on the main process, reuse
    them afterwards."""
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


def load_models(args, code, sharded=False):
    """(tokenizer, policy, critic, frozen reference, frozen reward model or None): the policy and the
    reference from the SFT model, the critic from --critic_path (App. B.2); on --resume the trained
    two from the checkpoint. `sharded`: ZeRO-3 / FSDP will partition the trained models."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.resume:
        harness.require_part(harness.checkpoint_part(args.output_dir, "policy"), "checkpoint to resume",
                             "Run without --resume.")
    part = (lambda name, default: harness.checkpoint_part(args.output_dir, name) if args.resume else default)
    tokenizer = data.load_tokenizer(args.sft_path)
    with harness.loading_whole():       # the frozen models are never handed to a ZeRO-3 engine
        reward_model = None if code else rm.load_reward_model(args.rm_path, args.bf16)[0].eval().requires_grad_(False)
    if args.lora_r:     # adapters on the SFT model and on the critic's init: two copies of the base weights in all
        policy = AutoModelForCausalLM.from_pretrained(args.sft_path, dtype=dtype)
        # the reference is the policy with its adapters off; a critic initialised from the RM reads the RM's
        # own weights (a twin of it), unless the weights are sharded (ZeRO-3 / FSDP partition the critic's)
        shared = reward_model is not None and not sharded and os.path.realpath(args.critic_path) == os.path.realpath(args.rm_path)
        critic = harness.twin(reward_model) if shared else rm.load_reward_model(args.critic_path, args.bf16)[0]
        lora = (args.lora_r, args.lora_alpha, args.lora_target_modules)
        policy = harness.load_lora(policy, part("policy", "")) if args.resume else harness.with_lora(policy, *lora, "CAUSAL_LM")
        critic = Critic(harness.load_lora(critic, part("critic", "")) if args.resume else
                        harness.with_lora(critic, *lora, "SEQ_CLS"))      # SEQ_CLS: the score head trains too
    else:       # trained weights in fp32 (the master copy); --bf16 autocasts their forwards
        policy = AutoModelForCausalLM.from_pretrained(part("policy", args.sft_path), dtype=torch.float32)
        critic = Critic(rm.load_reward_model(part("critic", args.critic_path))[0])
    with harness.loading_whole():
        ref = None if args.lora_r else AutoModelForCausalLM.from_pretrained(args.sft_path, dtype=dtype).eval().requires_grad_(False)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        critic.model.gradient_checkpointing_enable()
    return tokenizer, policy, critic, ref, reward_model


def score_normalizer(args, accelerator, reward_model, tokenizer, segmenter):
    """--rm_norm: (mean, std) of the RM's score on its calibration pairs, from score_norm.json beside it;
    an RM without one (trained before reward_model.py wrote it) gets it fitted on the first 1024 pairs of the
    RM split, as reward_model.py does, and written there, once, by the main process."""
    path = os.path.join(args.rm_path, rm.SCORE_FILE)
    if accelerator.is_main_process and not os.path.exists(path):
        rows = data.with_chat_template(data.load_task(args.task, only=("rm",))["rm"][:1024], tokenizer, args.chat_template)
        rm.write_json(path, rm.fit_score_normalizer(reward_model, tokenizer, rows, args.max_prompt_len,
                                                    args.max_response_len, segmenter))
        accelerator.print(f"[ppo] --rm_norm: {path} missing: fitted on {len(rows)} RM-split pairs and written")
    accelerator.wait_for_everyone()
    mean, std = rm.read_score_normalizer(args.rm_path)
    accelerator.print(f"[ppo] --rm_norm: the RM's score as (r - {mean:.4g}) / {std:.4g}")
    return mean, std


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
    harness.start("ppo", args, acc, final=os.path.join("policy", "config.json"))
    log = acc.print
    if args.top_k or args.top_p < 1:
        log("[ppo] warning: --top_k / --top_p truncate the sampling distribution; the logprobs (temperature only) "
            "do not: the first ratio is not 1 and the KL is off-policy")
    build_default(args, acc, code)
    tokenizer, policy, critic, ref, reward_model = load_models(args, code, harness.is_sharded(acc))
    own = None if code else rm.read_segment_settings(args.rm_path)     # a segment / token RM's own settings
    segment_rm_as_bandit = args.reward == "rm" and own is not None     # scored with e(x, y), as evaluate.py does
    if own is not None and args.lora_r:
        sys.exit(f"error: --lora_r: {args.rm_path} is a {own.get('unit')} RM, scored with e(x, y) on the frozen SFT "
                 "model's segments; under --lora_r there is none (the reference is the policy with its adapters off)")
    segments = (rm.load_segment_settings(args) if "segment" in (args.reward, args.termination) or segment_rm_as_bandit
                else None)
    if segment_rm_as_bandit:    # its head at EOS never trained (zero gradient there): Yin et al. 2025's segment as bandit
        log(f"[ppo] --reward rm: {args.rm_path} is a {own['unit']} RM; its score is e(x, y), the mean of its segment "
            f"rewards on the SFT model's segments (as in its training and in evaluate.py), one reward at the last token")
    trained_on = (segments or {}).get("sft_path")
    if trained_on and os.path.realpath(trained_on) != os.path.realpath(args.sft_path):
        log(f"[ppo] warning: the segment RM's segments come from the SFT model {trained_on}, this run's is "
            f"{args.sft_path}: its entropies, and so its segments, may differ from the RM's training")
    scorer = rm.segment_scorer(own, ref, tokenizer.eos_token_id)      # the held-out score: the RM's own
    seg_interp = "bandit" if segment_rm_as_bandit else args.seg_interp
    score_name = "exec" if code else args.reward          # reward/<score_name> in the metrics
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
    for frozen in (ref, reward_model):
        if frozen is not None:
            frozen.to(acc.device)
    score_norm = score_normalizer(args, acc, reward_model, tokenizer, scorer) if args.rm_norm else None
    generator = torch.Generator().manual_seed(args.seed)       # minibatch order, randomized n-grams
    start, truncated, beta = 0, 0, args.beta
    if args.resume:
        # optimizer states are per-rank shards under ZeRO/FSDP: restored from each rank's file under ZeRO
        state = harness.load_checkpoint(args.output_dir, opts, scheds, log, rank, world)
        start, truncated, beta = state["step"], state["truncated"], state.get("beta", args.beta)
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
        weights = harness.whole_state_dicts({"policy": (acc, policy), "critic": (critic_acc, critic)}) if sharded else None
        rng = harness.rng_states(acc)                       # collective: every rank's own random numbers
        shards = harness.save_optimizer_shards(acc, args.output_dir, opts) if sharded else None    # ZeRO: per rank
        if acc.is_main_process:
            harness.save_checkpoint(args.output_dir, {"policy": harness.unwrap(acc, policy),
                                                      "critic": harness.unwrap(critic_acc, critic).model}, tokenizer,
                                    step, args, {} if sharded else opts, scheds, weights, shards,
                                    truncated=truncated, generator=generator.get_state(), beta=beta, rng_ranks=rng)
        acc.wait_for_everyone()

    sft_replies = {}        # the SFT model's diversity on the held-out prompts, measured at the first evaluation
    from tqdm.auto import tqdm
    bar = tqdm(range(start, args.steps), desc=run_name(args), disable=not acc.is_local_main_process)
    with harness.GracefulStop(acc, "ppo", "iteration", harness.checkpoint_dir(args.output_dir), start) as stop:
        for step in bar:
            clock = harness.Stopwatch()
            # 1. Rollout: sample responses to this rank's prompts; logprobs under the sampling distribution
            idx = harness.batch_indices(len(prompts), args.rollout_batch_size, step, args.seed, rank, world)
            policy.eval()
            with harness.generation_model(acc, policy, args.gather_for_generation) as (model, synced):
                p_ids, p_mask, r_ids, r_mask, n_cut = data.sample(
                    model, tokenizer, [prompts[i] for i in idx], args.max_prompt_len, args.max_response_len,
                    args.temperature, args.top_k, args.top_p, synced_gpus=synced)
            truncated += n_cut
            harness.release_freed_memory(acc.device)
            clock.lap("generate")
            P = p_ids.shape[1]
            ids, attention_mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1)    # [B, P + R]
            response_mask = r_mask.float()                                                        # [B, R]
            # 2. Score: old and reference logprobs, values V(s_t), the sequence score
            fused = fused_update(args, acc, len(idx), policy, critic)   # the graphs kept for the update
            if fused:
                policy.train()      # as in the update: gradient checkpointing acts in train mode only
            with torch.set_grad_enabled(fused):
                new_logp, entropy = response_logprobs(policy, ids, attention_mask, P, args.temperature, with_entropy=True)
                new_values = critic_values(critic, ids, attention_mask, P)
            old_logp, old_values = new_logp.detach(), new_values.detach() * response_mask
            policy.eval()
            with torch.no_grad():
                ref_logp, sft_entropy = reference_logprobs(ref, acc, policy, ids, attention_mask, P, args.temperature,
                                                           t1_entropy=segments is not None)
                seg_starts, inside = rm.rollout_segments(segments, r_ids, r_mask, tokenizer.eos_token_id, sft_entropy)
                dense, seg_stats, passed = None, {}, None
                if score_name in ("exec", "gold"):      # scores of the decoded text
                    texts = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
                if code:    # App. B.5: the compiler / test signal of running prefix + response
                    score, passed = map(torch.tensor, sandbox.execution_reward([problems[i] for i in idx], texts))
                    score = score.to(acc.device)
                elif score_name == "gold":     # a verifiable reward: the gold judge reads the whole response
                    score = torch.tensor(data.gold(args.task, data.judged_prompts([problems[i] for i in idx]), texts),
                                         device=acc.device)
                elif score_name == "segment" or segment_rm_as_bandit:   # the head at each segment's end; e, their mean
                    values = rm.token_values(reward_model, ids, attention_mask)[:, P:]
                    dense, score, seg_stats = rm.segment_rewards(values, seg_starts, inside, segments, args.seg_norm, seg_interp)
                else:       # the RM's head at the last real token
                    score = rm.last_token(rm.token_values(reward_model, ids, attention_mask), attention_mask)
                if score_norm is not None:      # Yin et al. 2025, §2.1: the RM's score over its calibration mean and std
                    score = (score - score_norm[0]) / score_norm[1]
            has_eos = ((r_ids == tokenizer.eos_token_id) & response_mask.bool()).any(-1)
            penalty = args.missing_eos_penalty * (~has_eos).float()
            score = score + penalty
            # 3. Rewards (§2): r_t = -beta * KL_t per token, the score added at the last token (in step 5)
            log_r = old_logp - ref_logp
            kl = log_r if args.kl_estimator == "k1" else (torch.exp(-log_r) - 1) + log_r    # k1 or k3
            kl_rewards = -beta * kl * response_mask
            if not harness.all_finite(acc, kl_rewards, score):     # on any process: every one stops
                raise FloatingPointError(f"non-finite reward at iteration {step}; last good checkpoint in "
                                         f"{harness.checkpoint_dir(args.output_dir)}")
            clock.lap("forward")
            # 4. Macro actions (§3.2.1): which response tokens begin one
            starts, fallback = macro_starts(args.termination, r_ids, response_mask, n=args.n, logprobs=old_logp,
                                            entropy=entropy, entropy_threshold=args.entropy_threshold,
                                            tokenizer=tokenizer, cutoff=args.cutoff, generator=generator,
                                            language="python" if code else "text", segments=seg_starts)
            if args.reward_agg == "released":    # the released code: the final token a macro action of its own
                starts = ma.final_token_apart(starts, response_mask)
            # 5. Advantages (§3.3, Eq. 4-5): macro rewards R_tau, sigma-weighted macro values, macro GAE
            agg = "mean" if args.reward_agg == "released" else args.reward_agg
            token_rewards = token_rewards_of(kl_rewards, score, response_mask, starts, agg, dense, penalty, args.reward_clip)
            advantages, returns = ma.macro_advantages(old_values, token_rewards, response_mask, starts, args.gamma,
                                                      args.lam, args.sigma)
            raw_adv = advantages
            if args.whiten_advantages:
                advantages = masked_whiten(advantages, response_mask)
            clock.lap("macro")
            # 6. PPO update: epochs over minibatches, the policy and the critic each with its optimizer
            frozen = ("policy_opt", "policy_sched") if step < args.critic_warmup else ()    # value-only updates
            policy.train()
            critic.train()
            stats = []
            # accumulation groups of --grad_accum minibatches, the iteration's remainder a group of its own: the
            # optimizers step at the end of every iteration, never on gradients of an older policy's rollout
            n_minibatches = args.ppo_epochs * -(-len(idx) // args.mini_batch_size)
            j = 0
            for _ in range(args.ppo_epochs):
                order = torch.randperm(len(idx), generator=generator)
                for k in range(0, len(idx), args.mini_batch_size):
                    mb = order[k:k + args.mini_batch_size]
                    group = min(args.grad_accum, n_minibatches - j // args.grad_accum * args.grad_accum)
                    if j % args.grad_accum == 0:
                        harness.start_accumulation((acc, critic_acc), group)
                    j += 1
                    with harness.accumulate(acc, policy, critic_acc, critic):
                        if fused:       # the rows of step 2's forwards, in the minibatch's order
                            logp, values = new_logp[mb], new_values[mb]
                        else:
                            logp, _ = response_logprobs(policy, ids[mb], attention_mask[mb], P, args.temperature)
                            values = critic_values(critic, ids[mb], attention_mask[mb], P)
                        pg_loss, vf_loss, s = ppo_losses(logp, old_logp[mb], values, old_values[mb], advantages[mb],
                                                         returns[mb], response_mask[mb], starts[mb], clip=args.clip,
                                                         value_clip=args.value_clip, ratio=args.ratio)
                        if not harness.all_finite(acc, pg_loss, vf_loss):
                            raise FloatingPointError(f"non-finite loss at iteration {step}; last good checkpoint "
                                                     f"in {harness.checkpoint_dir(args.output_dir)}")
                        scale = args.grad_accum / group     # backward divides by --grad_accum: a mean over the group
                        if not frozen:
                            acc.backward(pg_loss * scale)      # the two graphs are disjoint: one backward per model
                        critic_acc.backward(vf_loss * scale)
                        for opt in [o for k, o in opts.items() if k not in frozen]:
                            opt.step()
                        for opt in opts.values():
                            opt.zero_grad()
                    stats.append({"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(), **s})
            new_logp = new_values = None        # step 2's graphs (if fused) not kept into the next rollout
            harness.release_freed_memory(acc.device)
            for sched in [s for k, s in scheds.items() if k not in frozen]:   # the policy's warmup starts with it
                sched.step()
            clock.lap("update")
            # 7. Log (averaged over processes), evaluate on held-out prompts, checkpoint
            local = iteration_metrics(Iteration(score, passed, token_rewards, kl, entropy, response_mask, starts,
                                                old_values, raw_adv, returns, has_eos, fallback, stats, seg_stats), score_name)
            keys = sorted(local)
            reduced = acc.reduce(torch.stack([local[k].float().to(acc.device) for k in keys]), "mean")
            metrics = {k: round(v, 5) for k, v in zip(keys, reduced.tolist())}
            metrics.update({"step": step + 1, "beta": beta, "time/step": round(clock.total(), 3), "prompts/truncated": truncated,
                            **{f"time/{k}": round(v, 4 if k == "macro" else 3) for k, v in clock.laps.items()},
                            "tokens_per_s": round(float(response_mask.sum()) * world / clock.total(), 1),
                            **({"memory/peak_gb": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)}
                               if torch.cuda.is_available() else {})})
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                evaluate_now(args, metrics, accelerator=acc, policy=policy, reward_model=reward_model,
                             tokenizer=tokenizer, eval_rows=eval_rows, segmenter=scorer, sft=(ref, sft_replies))
            if acc.is_main_process:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            if args.report_to != "none":
                acc.log(metrics, step=step + 1)
            bar.set_postfix(score=f"{metrics[f'reward/{score_name}']:.2f}", kl=f"{metrics['kl']:.2f}")
            # the next iteration's KL coefficient, from this batch's KL over every process (the same on every rank)
            beta = adaptive_beta(beta, reduced[keys.index("kl")].item(), args.kl_target, len(idx) * world, args.kl_horizon)
            stop.end_of_step(step + 1, args.steps, args.save_every, save)
    finish(args, truncated, accelerators=(acc, critic_acc), policy=policy, critic=critic, reward_model=reward_model,
           tokenizer=tokenizer, eval_rows=eval_rows, beta=beta)


def evaluate_now(args, metrics, *, accelerator, policy, reward_model, tokenizer, eval_rows, segmenter=None, sft=(None, None)):
    """7. Held-out score (and gold score / pass rate), gold_strict and the replies' diversity of the current
    policy into `metrics`, beside the SFT model's diversity; a log line, and a warning when the replies are
    degenerate. `sft`: (the frozen SFT model or None under LoRA, a dict that keeps its diversity once measured)."""
    acc, sharded, code = accelerator, harness.is_sharded(accelerator), args.task in data.CODE_TASKS
    if acc.is_main_process or sharded:               # sharded weights: every rank takes part
        with harness.generation_model(acc, policy, args.gather_for_generation) as (model, synced):
            texts, scores, second = evaluate.held_out(model.eval(), reward_model, tokenizer, eval_rows, args, args.seed,
                                                      synced, segmenter)
    if acc.is_main_process:
        key, second_key = ("exec", "pass@1") if code else ("rm", "gold")
        metrics[f"eval/{key}"] = round(scores.mean().item(), 4)
        if second is not None:
            metrics[f"eval/{second_key}"] = round(second.mean().item(), 4)
        (ref, sft_replies), replies = sft, evaluate.reply_metrics(args.task, eval_rows, texts)
        if not sft_replies:     # once a run, from the same prompts and seed; its own RNG (the run's is untouched)
            sft_replies.update(evaluate.sft_replies(ref, args, tokenizer, eval_rows, acc.device))
        metrics.update({f"eval/{k}": round(v, 4) for k, v in replies.items()})
        metrics.update({f"eval/sft_{k}": round(sft_replies[k], 4) for k in ("distinct_1", "distinct_2", "repetition")})
        acc.print(f"[ppo] iteration {metrics['step']}: " + "  ".join(f"{k} {metrics[k]}" for k in (
            f"reward/{'exec' if code else args.reward}", "kl", f"eval/{key}", f"eval/{second_key}", "eval/gold_strict",
            "eval/distinct_2", "macro/mean_len") if k in metrics))
        verdict = evaluate.degeneracy(replies, sft_replies, args.task)
        if verdict:
            acc.print(f"[ppo] warning: {verdict}. A larger --beta (or a --kl_target) keeps the policy nearer the "
                      "SFT model; read eval/gold_strict beside eval/gold")
    acc.wait_for_everyone()


def finish(args, truncated, *, accelerators, policy, critic, reward_model, tokenizer, eval_rows, beta):
    """After the last iteration: warnings, the rank-sync check, the final policy, the report.
    `truncated`: prompts of this process that lost their beginning; `accelerators`: (policy's, critic's);
    `beta`: the KL coefficient the controller ended with."""
    from transformers import AutoModelForCausalLM
    (acc, critic_acc), sharded = accelerators, harness.is_sharded(accelerators[0])
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    if truncated:
        acc.print(f"[ppo] warning: {truncated} prompts (this process) were longer than {args.max_prompt_len} "
                  f"tokens and lost their beginning")
    if args.kl_target:
        acc.print(f"[ppo] adaptive KL: beta {args.beta} -> {beta:.5g} (--kl_target {args.kl_target})")
    same_beta = harness.same_on_every_rank(acc, beta)
    if not sharded:
        acc.print(f"[ppo] ranks in sync: {harness.ranks_in_sync(acc, policy) and harness.ranks_in_sync(acc, critic) and same_beta}")
    final_policy = harness.final_model(acc, policy)        # collective: whole weights, LoRA merged (a plain model)
    if acc.is_main_process:
        final = os.path.join(args.output_dir, "policy")
        harness.atomic_save(final, final_policy, tokenizer)
        # the report reads the saved policy back: whole weights on one process, whatever the sharding; the
        # SFT baseline on the same device and dtype, sampled the same way
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        with harness.loading_whole():
            policy = AutoModelForCausalLM.from_pretrained(final, dtype=dtype).to(acc.device).eval()
            sft_model = AutoModelForCausalLM.from_pretrained(args.sft_path, dtype=dtype).to(acc.device).eval()
        scorer = rm.segment_scorer(None if args.task in data.CODE_TASKS else rm.read_segment_settings(args.rm_path),
                                   sft_model, tokenizer.eos_token_id)
        evaluate.final_report(args, policy, sft_model, reward_model, tokenizer, eval_rows, metrics_path, scorer)
    acc.wait_for_everyone()
    if args.report_to != "none":
        acc.end_training()


if __name__ == "__main__":
    from transformers import HfArgumentParser
    main(HfArgumentParser(PPOArgs).parse_args_into_dataclasses()[0])
