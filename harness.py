"""The plumbing of the three stages. Nothing in this file is in the paper: it is what any PyTorch
trainer needs to run on a laptop CPU or on many GPUs and to survive being stopped.

- accelerators: one `Accelerator` (CPU processes synchronised over gloo when there is no GPU), or
  under DeepSpeed one engine per trained model (ppo.py trains two); frozen models loaded whole;
- stopping: Ctrl-C (SIGINT) and SIGTERM (what SLURM and Kubernetes send before preempting a job)
  end the run at the end of the current step, with a checkpoint; all ranks agree on it;
- checkpoints: one layout for every stage, written atomically, resumed to the same numbers;
- batch order and random state, so that a resumed run sees what an uninterrupted one would;
- `Trainer`: the loop that SFT and reward modelling share.

Checkpoint layout, the same for every stage:

    <output_dir>/checkpoint/
        <part>/             one save_pretrained folder (weights + tokenizer) per trained model:
                            `model` for sft.py and reward_model.py, `policy` and `critic` for ppo.py
        trainer_state.pt    step, optimizer / schedule states, RNG states (every process's), the run's arguments
    optimizer_shards/   under DeepSpeed ZeRO: each process's part of the optimizer states, <name>.rank<r>.pt
"""
import contextlib
import copy
import dataclasses
import gc
import ctypes
import ctypes.util
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
import weakref
from dataclasses import asdict

import torch

import data

CHECKPOINT = "checkpoint"


# ---------------------------------------------------------------------------------------------
# Accelerators
# ---------------------------------------------------------------------------------------------

def deepspeed_launch():
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def deepspeed_plugin(micro_batch_size, grad_accum=1, max_grad_norm=0.0):
    """A DeepSpeedPlugin from the launch config, told what accelerate cannot infer here: the micro-batch
    (no dataloader is prepared), and under ZeRO-3 to gather whole weights for saving (every save of ours
    is a from_pretrained folder, never a sharded DeepSpeed checkpoint). The script's --grad_accum and
    --max_grad_norm become the engine's: a DeepSpeed engine counts its own accumulation steps and clips in
    its own step, and accelerate lets a launch config's values override the script's, silently. A launch
    that sets either to another value stops here, naming both (our configs leave them to the script)."""
    from accelerate.utils import DeepSpeedPlugin
    plugin = DeepSpeedPlugin()
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch_size
    for key, ours, flag in (("gradient_accumulation_steps", grad_accum, "--grad_accum"),
                            ("gradient_clipping", max_grad_norm, "--max_grad_norm")):
        launch = config.get(key, "auto")
        if launch != "auto" and float(launch) != float(ours):
            sys.exit(f"error: {flag} {ours}, but the launch's DeepSpeed config sets {key}: {launch}. Drop {key} from "
                     f"the launch (configs/zero2.yaml and zero3.yaml leave it to {flag}) or pass {flag} {launch}.")
        config[key] = ours
    plugin.gradient_accumulation_steps, plugin.gradient_clipping = grad_accum, max_grad_norm
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return plugin


def make_accelerator(bf16=False, grad_accum=1, micro_batch_size=1, max_grad_norm=0.0, **kwargs):
    """Accelerator(cpu=True) without a GPU: `accelerate launch --multi_gpu --num_processes 2` on a
    CPU then runs two synchronised gloo processes instead of two independent ones. (Not under a
    DeepSpeed launch: cpu=True would silently turn DeepSpeed off.) `micro_batch_size`: examples per
    process per micro-step, which a DeepSpeed engine must be told; `grad_accum`, `max_grad_norm`: the
    script's flags, which no launch setting may change (`deepspeed_plugin`, `same_accumulation`)."""
    from accelerate import Accelerator
    check_accelerate_version()
    if not torch.cuda.is_available():       # a DeepSpeed launch on a CPU: named, deepspeed does not warn
        os.environ.setdefault("DS_ACCELERATOR", "cpu")   # that it guessed the accelerator
    if deepspeed_launch() and "deepspeed_plugins" not in kwargs:
        kwargs["deepspeed_plugins"] = deepspeed_plugin(micro_batch_size, grad_accum, max_grad_norm)
    accelerator = Accelerator(cpu=not torch.cuda.is_available() and not deepspeed_launch(),
                              gradient_accumulation_steps=grad_accum, mixed_precision="bf16" if bf16 else "no", **kwargs)
    refuse_fallback_from_fsdp(accelerator)
    return same_accumulation(accelerator, grad_accum)


def same_accumulation(accelerator, grad_accum):
    """`accelerator` if it accumulates --grad_accum micro-steps; else a stop naming both numbers. accelerate takes
    $ACCELERATE_GRADIENT_ACCUMULATION_STEPS (which `accelerate launch` exports from a config) over the script's
    argument: the optimizer would step at another rhythm than the loss scaling assumes, with nothing said."""
    if accelerator.gradient_accumulation_steps != grad_accum:
        sys.exit(f"error: --grad_accum {grad_accum}, but the launch sets gradient_accumulation_steps "
                 f"{accelerator.gradient_accumulation_steps} (ACCELERATE_GRADIENT_ACCUMULATION_STEPS or the launch "
                 "config): drop it from the launch, or pass the same --grad_accum")
    return accelerator


# accelerate's behaviour that harness.py relies on beyond its documented API, checked against this version by
# tests/spec/test_audit5.py: the accumulation grouping (`start_accumulation` sets Accelerator.step, the counter that
# accumulate() reads) and `saving_without_deepspeed` (accelerate.utils.other.is_deepspeed_available).
ACCELERATE_CHECKED = "1.15."


def check_accelerate_version():
    import accelerate
    if not accelerate.__version__.startswith(ACCELERATE_CHECKED):
        sys.exit(f"error: accelerate {accelerate.__version__}: harness.py groups gradient accumulation through "
                 f"accelerate's Accelerator.step counter, checked against accelerate {ACCELERATE_CHECKED}x only; "
                 "install the version pinned in requirements.txt, or run tests/spec/test_audit5.py against yours and "
                 "update harness.ACCELERATE_CHECKED")


def refuse_fallback_from_fsdp(accelerator):
    """An FSDP launch that accelerate did not start as FSDP stops here. accelerate (1.15) starts FSDP only
    on an accelerator (CUDA, XPU, ...): on a CPU a `--config_file configs/fsdp.yaml` launch runs every
    process as plain DDP over gloo (MULTI_CPU), with nothing said, so a run meant to test FSDP tests DDP.
    tests/launch/fsdp_cpu.py sets accelerate's state to FSDP on a CPU (torch's FSDP2 runs on gloo): that launch passes."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator.distributed_type.value != "FSDP":
        sys.exit(f"error: this is an FSDP launch, but accelerate started {accelerator.distributed_type.value} on "
                 f"{accelerator.device}: it starts FSDP only on GPUs (or another accelerator), never on a CPU. "
                 "On a CPU, launch DDP (--multi_gpu), DeepSpeed ZeRO-3, or FSDP2 through tests/launch/fsdp_cpu.py "
                 "(docs/distributed.md).")


def make_accelerators(bf16, grad_accum, micro_batch_size, max_grad_norm=0.0, **kwargs):
    """(policy accelerator, critic accelerator) for two trained models: one and the same, except under
    DeepSpeed, where each trained model needs its own engine. accelerate's multi-model recipe: one
    DeepSpeedPlugin per model (both from the launch config), a second Accelerator for the critic."""
    if not deepspeed_launch():
        accelerator = make_accelerator(bf16, grad_accum, max_grad_norm=max_grad_norm, **kwargs)
        return accelerator, accelerator
    from accelerate import Accelerator
    plugins = {name: deepspeed_plugin(micro_batch_size, grad_accum, max_grad_norm) for name in ("policy", "critic")}
    accelerator = make_accelerator(bf16, grad_accum, deepspeed_plugins=plugins, **kwargs)
    return accelerator, same_accumulation(Accelerator(gradient_accumulation_steps=grad_accum), grad_accum)


def checkpoint_names(trained):
    """The optimizers and schedules of `trained` ({name: Trained}) by their names in a checkpoint:
    ({<name>_opt: optimizer}, {<name>_sched: schedule})."""
    return ({f"{name}_opt": t.optimizer for name, t in trained.items()},
            {f"{name}_sched": t.scheduler for name, t in trained.items()})


def adamw_with_warmup(models, warmup_steps):
    """An AdamW optimizer and a linear-warmup schedule (over `warmup_steps`) for each (model, learning rate) of
    `models` (None for a model that is None), on the parameters that train (all of them, or LoRA's). foreach: a few
    multi-tensor ops a step instead of a Python loop over the tensors (torch picks it by itself on GPUs only): the
    same numbers, a step about a quarter faster on a CPU (docs/training.md). fused=True would be faster still but
    rounds differently, and the runs' sampling would drift from the recorded ones."""
    warmup = (lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))
    opts = [None if model is None else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                                         foreach=True)
            for model, lr in models]
    return opts, [None if opt is None else torch.optim.lr_scheduler.LambdaLR(opt, warmup) for opt in opts]


@dataclasses.dataclass
class Trained:
    """A model that trains, with what trains it: its accelerator, optimizer and learning-rate schedule."""
    model: torch.nn.Module
    accelerator: object
    optimizer: torch.optim.Optimizer
    scheduler: object


def prepare_pair(accelerator, critic_accelerator, policy, policy_opt, critic, critic_opt):
    """accelerator.prepare for the policy and the critic (under DeepSpeed, each with its own engine); a critic
    that is None (PPO without one) stays None."""
    policy, policy_opt = accelerator.prepare(policy, policy_opt)
    if critic is None:
        return policy, policy_opt, None, None
    if critic_accelerator is not accelerator:
        accelerator.state.select_deepspeed_plugin("critic")
    critic, critic_opt = critic_accelerator.prepare(critic, critic_opt)
    return policy, policy_opt, critic, critic_opt


def is_sharded(accelerator):
    """DeepSpeed / FSDP may partition the trained models (ZeRO-3 does even with one process): their
    forwards (generate included) are collective, and saving gathers the whole weights first."""
    return accelerator.distributed_type.value in ("FSDP", "DEEPSPEED")


def unwrap(accelerator, model):
    """The module inside its DDP / DeepSpeed / FSDP wrapper. Only DeepSpeed and FSDP runs ask accelerate:
    its unwrap_model imports deepspeed whenever it is installed (about 100 MB resident and a "Setting
    accelerator to CPU" warning in a run that never uses it)."""
    if accelerator.distributed_type.value in ("DEEPSPEED", "FSDP"):
        return accelerator.unwrap_model(model)
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


_FSDP_ROOTS = weakref.WeakSet()       # FSDP2 models whose root has run a forward (generation_model)


@contextlib.contextmanager
def generation_model(accelerator, model, gather=True):
    """Yields (module to call generate() on, synced_gpus for generate()).
    Unsharded, ZeRO-2: the module as it is. ZeRO-3 / FSDP with `gather`: every parameter gathered once
    before generate() and released after, so each rank generates on its own from whole weights (the
    whole policy sits on every GPU meanwhile). Without `gather`: sharded forwards, every rank in lockstep
    (synced_gpus=True) and every layer gathered again for every generated token, the ZeRO-3 trap that
    makes generation 10x slower (TRL PR 1483; DeepSpeed issue 4354)."""
    if not is_sharded(accelerator):     # the module itself, or inside DDP's wrapper
        yield model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model, False
        return
    unwrapped = unwrap(accelerator, model)
    kind = accelerator.distributed_type.value
    zero3 = kind == "DEEPSPEED" and accelerator.state.deepspeed_plugin.zero_stage == 3
    if kind == "FSDP" and hasattr(model, "unshard") and model not in _FSDP_ROOTS:
        # FSDP2 takes the first module to run forward as its root. A LoRA policy's generate() (peft's) calls
        # the model inside the root PeftModel, so before any training forward the first would be the tied
        # embedding / lm_head group ("FSDP requires a single root module"): the root runs one forward first
        # (one token, no gradient: every rank, as a sharded forward needs).
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=accelerator.device))
        _FSDP_ROOTS.add(model)
    if kind == "DEEPSPEED" and not zero3:
        yield unwrapped, False
    elif not gather and hasattr(model, "unshard"):
        # FSDP2, sharded: each layer gathers itself in its forward, but the root's own parameters (with LoRA those
        # outside every layer, e.g. the final norm) are gathered by the root's forward, which peft's generate()
        # skips ("mixed torch.Tensor and DTensor"): they are gathered here, for the whole generate()
        model.unshard()
        try:
            yield unwrapped, True
        finally:
            model.reshard()
    elif not gather:
        yield unwrapped, True
    elif zero3:   # DeepSpeed's own recipe: one GatheredParameters, ZeRO-3's per-module hooks off meanwhile
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
        with unwrap_model_for_generation(model):
            yield unwrapped, False
    elif hasattr(model, "unshard"):    # FSDP2 (configs/fsdp.yaml): unshard every FSDP module, keep it so
        parts = [m for m in model.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")]
        model.set_reshard_after_forward(False)
        for m in parts:
            m.unshard()
        try:
            yield unwrapped, False
        finally:
            # back to what the launch set (fsdp_reshard_after_forward: accelerate passes it to every module)
            model.set_reshard_after_forward(bool(accelerator.state.fsdp_plugin.reshard_after_forward))
            for m in parts:
                m.reshard()
    else:                               # FSDP1
        from torch.distributed.fsdp import FullyShardedDataParallel
        with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True):
            yield unwrapped, False


@contextlib.contextmanager
def reference_forward(accelerator, ref, policy):
    """Yields the model whose forward is ppo.py's reference: the frozen SFT model `ref`, computing as the policy does
    (unsharded under --bf16: fp32 weights under the same autocast, so the first KL is exactly 0), or under LoRA (`ref`
    None) the `policy` with its adapters switched off, which is the SFT model. The freed heap is handed back first."""
    release_freed_memory(accelerator.device)
    if ref is None:
        with unwrap(accelerator, policy).disable_adapter():
            yield policy
    else:
        with accelerator.autocast() if not is_sharded(accelerator) else contextlib.nullcontext():
            yield ref


@contextlib.contextmanager
def saving_without_deepspeed():
    """Context for save_pretrained outside a DeepSpeed launch. transformers' save_pretrained unwraps the model
    with accelerate's extract_model_from_parallel, which imports deepspeed whenever it is installed, only to ask
    whether the model is a DeepSpeedEngine: resident memory and, on a CPU, a "Setting accelerator to CPU"
    warning in a run that never uses DeepSpeed. Without a DeepSpeed launch no model is one, so accelerate is
    told, while the model saves, that DeepSpeed is not installed."""
    if deepspeed_launch() or "deepspeed" in sys.modules:
        yield
        return
    from accelerate.utils import other
    installed = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = installed


@contextlib.contextmanager
def loading_whole():
    """Loading context for frozen models: under ZeRO-3, transformers would partition them as they load
    (zero.Init), though no engine ever gathers them again. transformers decides that from one
    module-level DeepSpeed config, unset here while they load and set again from the launch's plugin."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config
    if not is_deepspeed_zero3_enabled():
        yield
        return
    from accelerate.state import AcceleratorState
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        AcceleratorState().deepspeed_plugin.set_deepspeed_weakref()


def accumulate(trained):
    """Gradient accumulation context for the `trained` models (Trained bundles): each accelerator counts the
    steps once, for all of its models."""
    stack = contextlib.ExitStack()
    for accelerator in dict.fromkeys(t.accelerator for t in trained):
        stack.enter_context(accelerator.accumulate(*[t.model for t in trained if t.accelerator is accelerator]))
    return stack


def has_dropout(model):
    """Whether `model` drops anything in train mode: a Dropout module or a config's *dropout* rate above 0."""
    configs = [getattr(m, "config", None) for m in model.modules()]
    rates = [v for c in configs if hasattr(c, "__dict__") for k, v in vars(c).items() if "dropout" in k]
    dropouts = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
                torch.nn.FeatureAlphaDropout)
    return (any(isinstance(m, dropouts) and m.p > 0 for m in model.modules())
            or any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in rates))


def start_accumulation(accelerators, group):
    """The next `group` micro-steps (at most the accelerators' gradient_accumulation_steps) end in one
    optimizer step: accelerate's counter is set so that the last of them syncs and steps. Called at the
    start of every group, so that a group never spans two calls' worth of data (e.g. two PPO iterations)."""
    for accelerator in set(accelerators):
        accelerator.step = accelerator.gradient_accumulation_steps - group


def clip_gradients(accelerator, model, max_norm):
    """--max_grad_norm, the same in every engine: the L2 norm of all of `model`'s gradients (every process's part,
    after the all-reduce), returned as a float, and the gradients scaled down to `max_norm` when above it (0 =
    never). Call it once the last micro-step of an accumulation group has run its backward, before
    optimizer.step(). DDP and FSDP clip here (accelerate's clip_grad_norm_, DTensor-aware); a DeepSpeed engine
    clips inside the step its backward took at that point (its gradient_clipping is `max_norm`, set by
    `deepspeed_plugin`), and the norm it returns is the one it clipped with."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    return float(norm) if norm is not None else float("nan")


def whole_state_dicts(models):
    """{name: (accelerator, model)} -> {name: whole state dict}, gathered from ZeRO-3 / FSDP shards (a
    collective call: every rank must make it). A wrapper module's "model." prefix is dropped. Under FSDP
    a tied weight (Gemma's lm_head, the embedding) comes back as its own copy, which save_pretrained
    cannot recognise as an alias and would write twice: it is left out, as a whole model's save leaves it."""
    out = {}
    for name, (accelerator, model) in models.items():
        sd = accelerator.get_state_dict(model)
        unwrapped = unwrap(accelerator, model)
        wrapped = not hasattr(unwrapped, "save_pretrained")
        sd = {k.removeprefix("model."): v for k, v in sd.items()} if sd and wrapped else sd
        if sd and accelerator.distributed_type.value == "FSDP":
            for tied, source in (getattr(unwrapped, "all_tied_weights_keys", None) or {}).items():
                if tied in sd and source in sd and torch.equal(sd[tied], sd[source]):
                    del sd[tied]
        out[name] = sd
    return out


def final_model(accelerator, model, in_place=True):
    """The trained model as a whole module to save_pretrained: on the main process (None elsewhere), a
    collective call. Sharded weights (ZeRO-3 / FSDP) are gathered into a fresh copy; LoRA adapters are
    merged into the weights (W + alpha / r * B A, peft's merge) from whole weights: a plain model whose
    keys any from_pretrained reads. Not `in_place`: unsharded weights are left as they are, adapters and all
    (a LoRA critic reads the frozen RM's own base weights). A critic (reward_model.Critic) gives its model."""
    weights = whole_state_dicts({"m": (accelerator, model)})["m"] if is_sharded(accelerator) else None
    unwrapped = unwrap(accelerator, model)
    unwrapped = unwrapped if hasattr(unwrapped, "save_pretrained") else unwrapped.model     # a Critic: its model
    if not accelerator.is_main_process:
        return None
    if weights is None:
        return merged(unwrapped) if in_place else unwrapped
    base = unwrapped.get_base_model() if is_lora(unwrapped) else unwrapped
    with loading_whole():
        copy = type(base)(base.config).to(next(iter(weights.values())).dtype)
    if getattr(base, "generation_config", None) is not None:
        copy.generation_config = base.generation_config
    if is_lora(unwrapped):
        from peft import get_peft_model
        copy = get_peft_model(copy, unwrapped.peft_config[unwrapped.active_adapter])
    missing, unexpected = copy.load_state_dict(weights, strict=False)
    tied = set(getattr(copy.get_base_model() if is_lora(copy) else copy, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - {k for k in missing if k.split("base_model.model.")[-1] in tied}:
        raise RuntimeError(f"gathered weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return merged(copy)


def final_models(trained, critic=True):
    """ppo.py's trained models as the run ends (`final_model`, a collective call), {"policy": merged in place to
    save; with `critic`, "critic": for the report's picture, never merged in place}: None on other processes."""
    return {name: final_model(t.accelerator, t.model, in_place=name == "policy") for name, t in trained.items()
            if name == "policy" or critic}


def parameter_checksums(model):
    """[n_tensors, 3] float64: per parameter tensor its sum, L2 norm and the sum of every 7th element
    (order-sensitive). Reductions over views: no copy of the weights, frozen ones included."""
    rows = [torch.stack([p.sum(dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64),
                         p.flatten()[::7].sum(dtype=torch.float64)]) for p in model.parameters()]
    return torch.stack(rows)


@torch.no_grad()
def ranks_in_sync(accelerator, model):
    """True when every process holds the same parameters (per-tensor checksums gathered over ranks)."""
    every = accelerator.gather(parameter_checksums(unwrap(accelerator, model)).unsqueeze(0))
    return bool((every == every[0]).all())


@torch.no_grad()
def same_on_every_rank(accelerator, value):
    """True when the number `value` is bitwise the same on every process (e.g. an adaptive KL coefficient)."""
    every = accelerator.gather(torch.tensor([value], dtype=torch.float64, device=accelerator.device))
    return bool((every == every[0]).all())


def print_ranks_in_sync(accelerator, models, *values):
    """The end of a run: print whether every process holds the same weights of each of `models` (unsharded: a sharded
    model has one copy) and the same `values` (e.g. the adaptive KL coefficient). Collective."""
    same = all([same_on_every_rank(accelerator, v) for v in values])
    if not is_sharded(accelerator):
        in_sync = all([ranks_in_sync(accelerator, m) for m in models])
        accelerator.print(f"[ppo] ranks in sync: {in_sync and same}")


def in_chunks(accelerator, forward, n_rows, chunk):
    """`forward(rows)` (a tensor, rows first) over rows 0 .. n_rows - 1 in slices of at most `chunk` rows, concatenated:
    the memory of one slice's forward, not of all rows at once. Every process runs the same number of forwards, the
    most slices any process has (a sharded model's forward is a collective): one with fewer runs its last slice again
    and drops the result."""
    count = -(-n_rows // chunk)
    most = int(accelerator.gather(torch.tensor([count], device=accelerator.device)).max())
    out = [forward(slice(i * chunk, min(n_rows, (i + 1) * chunk))) for i in range(count)]
    for _ in range(most - count):
        forward(slice((count - 1) * chunk, n_rows))
    return torch.cat(out)


def stop_unless_finite(accelerator, what, output_dir, *tensors):
    """Every process stops (FloatingPointError) unless every tensor is finite on every one; the message names
    `what` (e.g. "loss at iteration 3") and the last good checkpoint, which stays in place. One reduction over the
    processes, so that all of them stop together: a process that raised alone would leave the others waiting for it
    in their next collective (a hang instead of an error)."""
    finite = torch.tensor([float(all(bool(torch.isfinite(t).all()) for t in tensors))], device=accelerator.device)
    if accelerator.reduce(finite, "sum").item() < accelerator.num_processes:
        raise FloatingPointError(f"non-finite {what}; last good checkpoint in {checkpoint_dir(output_dir)}")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc():
    """The C library when it is glibc 2.33 or later (malloc_trim, mallinfo2), else None (macOS, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("malloc_trim", "mallinfo2", "mallopt")):
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


GLIBC = _glibc()


def release_freed_memory(device, at_least=2 ** 30):
    """Hand the pages of freed CPU tensors back to the operating system, when glibc's heap holds at
    least `at_least` free bytes (resident or already handed back). On a CPU PyTorch allocates through
    malloc, and glibc returns only the top of its heap: a block freed below live tensors stays resident
    until a later allocation reuses it, and a forward leaves many (each layer's temporaries, between the
    activations kept for the backward). With SmolLM2-135M in bench/real_ppo.py (16 x 112 tokens, the
    policy's and the critic's graphs alive at once) those freed blocks stack up on top of the live ones;
    trimming after each large forward, after generation and after the update, the process peaks at the
    8.2 GB of bench/records/real_ppo.json (its iterations' timings include the trims). Below a GiB it is
    not worth it: the tiny default model frees a few hundred MB per forward, and handing that back and
    faulting it in again slowed its iterations. The numbers do not change (no tensor moves). A no-op off
    the CPU and off glibc (and for `device` None)."""
    if GLIBC is not None and device is not None and torch.device(device).type == "cpu" \
            and GLIBC.mallinfo2().fordblks >= at_least:
        GLIBC.malloc_trim(0)


def out_of_the_collectors_way():
    """Before a training loop: every object alive now (modules, models, the dataset's rows: ~0.5M in ppo.py) moved
    out of the reach of Python's cycle collector (gc.freeze). They stay alive anyway; the full collections the loop
    triggers, and the ones at the interpreter's exit, no longer walk them (in the default run each took ~0.1 s, the
    exit's a second a stage). Garbage is collected first, so that none is kept. Nothing computed changes. For a
    process that trains once and exits: one that goes on to other work (a test session) hands them back with
    gc.unfreeze()."""
    gc.collect()
    gc.freeze()


def cpu_threads(num_processes, environ=os.environ):
    """Threads a CPU process should use, or None to keep torch's choice. `accelerate launch` without
    --num_cpu_threads_per_process sets OMP_NUM_THREADS=1 in every process, so `accelerate launch ppo.py`
    on a CPU would train on one core of many: a launched process gets its share of the cores instead.
    $MA_RLHF_CPU_THREADS sets the number by hand. (The thread count does not change the numbers.)"""
    if environ.get("MA_RLHF_CPU_THREADS"):
        return int(environ["MA_RLHF_CPU_THREADS"])
    launched = "ACCELERATE_DYNAMO_BACKEND" in environ                  # set by `accelerate launch`
    if launched and environ.get("OMP_NUM_THREADS") == "1":
        return max(1, (os.cpu_count() or 1) // num_processes)
    return None


def flag(default, help, range=None, choices=None):
    """A field of a stage's arguments dataclass: its default, its one-line `help`, and either the numeric `range` it
    takes ("[1, inf)": `--help` shows it as the value; check_ranges enforces it) or its `choices` (check_choices)."""
    metadata = {"help": help, **({"metavar": range} if range else {}), **({"choices": choices} if choices else {})}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class ModelArgs:
    """ppo.py's flags for the models beyond the paper's: the critic's init, how the default models are built, chat
    templates, LoRA, precision and the sharded engines (all of them this file's plumbing)."""
    critic_path: str = flag("", "critic init: default the RM (App. B.2; code tasks: the SFT model); an LM gets a fresh "
                            "head")
    sft_args: str = flag("", "extra sft.py flags used when the default SFT model is built, e.g. '--max_steps 600'")
    rm_args: str = flag("", "extra reward_model.py flags used when the default RM is built")
    chat_template: bool = flag(False, "render prompts with the tokenizer's chat template (instruct models); same in "
                               "every stage")
    lora_r: int = flag(0, "LoRA rank for the policy and the critic (the reference: adapters off); 0 = full",
                       "[0, inf)")
    lora_alpha: int = flag(16, "LoRA scale alpha (the update is scaled by alpha / r)", "(0, inf)")
    lora_target_modules: str = flag("all-linear", "LoRA: all-linear, or module names separated by commas")
    bf16: bool = flag(False, "bf16 mixed precision (GPUs)")
    gradient_checkpointing: bool = flag(False, "recompute activations to save memory (GPUs)")
    gather_for_generation: bool = flag(True, "ZeRO-3 / FSDP: gather the whole policy for generate() (false: "
                                       "sharded, slow)")


def split_flags(classes, flags):
    """One instance of each arguments dataclass of `classes`, each given the `flags` {name: value} it holds: a
    stage's arguments built in Python, as its command line would parse them. An unknown flag is a TypeError."""
    owner = {f.name: cls for cls in classes for f in dataclasses.fields(cls)}
    if set(flags) - set(owner):
        raise TypeError(f"no flag {', '.join(sorted(set(flags) - set(owner)))}")
    return tuple(cls(**{k: v for k, v in flags.items() if owner[k] is cls}) for cls in classes)


def config_of(*parts):
    """One dict of every field of the arguments dataclasses `parts` (a stage's flags, as printed and saved)."""
    return {k: v for part in parts for k, v in asdict(part).items()}


def check_choices(args):
    """Every choice flag of a stage's arguments dataclass (a field with "choices" in its metadata, which
    argparse also enforces on the command line) holds one of its choices, also when the dataclass was built
    in Python: an unknown value stops the run at start, naming the flag and its choices."""
    for f in dataclasses.fields(args):
        choices = f.metadata.get("choices")
        if choices is not None and getattr(args, f.name) not in choices:
            sys.exit(f"error: --{f.name} {getattr(args, f.name)!r}: choose from {', '.join(map(repr, choices))}")


def in_range(value, interval):
    """Whether the number `value` lies in `interval`, written as in mathematics: "[1, inf)", "(0, 1]" (a square
    bracket includes its bound, a round one excludes it). NaN lies in none."""
    lo, hi = (float(b) for b in interval[1:-1].split(","))
    above = value >= lo if interval[0] == "[" else value > lo
    below = value <= hi if interval[-1] == "]" else value < hi
    return above and below


def check_ranges(args):
    """Every numeric flag of a stage's arguments dataclass (and every number of a list flag such as "1,4,8")
    declares its range as its metavar ("metavar": "[1, inf)"
    in the field's metadata, which HfArgumentParser hands to argparse: `--help` shows it as the flag's value): a
    value outside it stops the run at start, naming the flag, its value and its range, also when the dataclass
    was built in Python (instead of a ZeroDivisionError or an IndexError mid-run, or a silent misreading such
    as --n -5 run as 5)."""
    for f in dataclasses.fields(args):
        interval, value = f.metadata.get("metavar"), getattr(args, f.name)
        if interval is None:
            continue
        numbers = value.split(",") if isinstance(value, str) else [value]     # a list flag: "1,4,8"
        try:        # a number as it is: Python compares an int with a float bound exactly, however large the int
            inside = all(in_range(float(x) if isinstance(x, str) else x, interval) for x in numbers)
        except (ValueError, TypeError):
            inside = False
        if not inside:
            sys.exit(f"error: --{f.name} {value!r}: outside its range {interval}")


def check_flags(*args):
    """A stage's first call: the choice flags (check_choices) and numeric flags (check_ranges) of its arguments
    dataclass, or of each of several (a stage whose flags are grouped in more than one): every field by its metadata."""
    for group in args:
        check_choices(group)
        check_ranges(group)


def start(name, args, accelerator, final="config.json", config=None):
    """Every stage's preamble: a fresh start refused over an interrupted run (it would replace that
    run's checkpoint and metrics); over a finished run, whose model it replaces, that run's checkpoint removed (a
    later --resume would continue it, and `evaluate.py explain` read its settings, as this run's); the seed, CPU
    threads, then the resolved configuration printed once. `final` is the file of the finished run's model, under
    --output_dir; `config`: what to print (default `args`)."""
    if interrupted(args.output_dir, final) and not args.resume:
        sys.exit(f"error: {args.output_dir!r} holds the checkpoint of an interrupted run. Continue it with "
                 "--resume, or start afresh in another --output_dir (or delete this one).")
    earlier = checkpoint_dir(args.output_dir)
    if not args.resume and os.path.isdir(earlier):
        accelerator.wait_for_everyone()             # every process has looked before one removes it
        if accelerator.is_local_main_process:       # each machine its own copy, if its disk is its own
            shutil.rmtree(earlier, ignore_errors=True)
        accelerator.print(f"[{name}] starting afresh in {args.output_dir}: the finished run's checkpoint there "
                          "removed (its model is replaced at the end)")
        accelerator.wait_for_everyone()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    import transformers
    transformers.utils.logging.disable_progress_bar()   # no "Writing model shards" bar at every checkpoint
    threads = cpu_threads(accelerator.num_processes) if accelerator.device.type == "cpu" else None
    if threads:
        torch.set_num_threads(threads)
    accelerator.print(f"[{name}] config: {config or asdict(args)}")
    if accelerator.device.type == "cpu":
        accelerator.print(f"[{name}] CPU threads per process: {torch.get_num_threads()}")


def build_default(accelerator, task, sft_path, rm_path=None, sft_args="", rm_args="", name="ppo"):
    """The models a stage starts from, built when missing on an embedded task (chitchat, count, code): sft.py at
    `sft_path`, then reward_model.py at `rm_path` (None: no RM, as for code, whose score is running the
    program), each run once as a subprocess of the main process, reused afterwards; `sft_args` / `rm_args`:
    their extra flags (empty: the task's data.BUILD_ARGS); `name`: the stage that asks, in its log line."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMP_"))}
    default_sft, default_rm = data.BUILD_ARGS.get(task, ("", ""))
    stages = [(sft_path, "sft.py", ["--task", task, *(sft_args or default_sft).split()])]
    if rm_path is not None:
        stages.append((rm_path, "reward_model.py", ["--task", task, "--sft_path", sft_path, *(rm_args or default_rm).split()]))
    for path, script, extra in stages:
        if accelerator.is_main_process and not os.path.exists(os.path.join(path, "config.json")):
            if task not in data.EMBEDDED_TASKS:
                sys.exit(f"error: no model at {path!r}; train it with {script} or pass its path")
            accelerator.print(f"[{name}] {path} missing: running {script}")
            subprocess.run([sys.executable, script, "--output_dir", path, *extra], check=True, env=env,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
        accelerator.wait_for_everyone()


class Stopwatch:
    """Seconds spent per phase of an iteration: `with clock.phase(name):` around it (a phase timed in two parts adds
    them up). With a `device`, each phase ends by handing the freed heap back (`release_freed_memory`), inside its
    time: the next phase's tensors then do not land above what this one freed."""

    def __init__(self, device=None):
        self.t0, self.device, self.laps = time.time(), device, {}

    @contextlib.contextmanager
    def phase(self, name):
        start = time.time()
        yield
        release_freed_memory(self.device)
        self.laps[name] = self.laps.get(name, 0.0) + time.time() - start

    def metrics(self, tokens):
        """The timing metrics of a step that produced `tokens` tokens (over every process): seconds per step and
        per phase, tokens per second, and on a GPU the peak memory allocated."""
        total, gpu = time.time() - self.t0, torch.cuda.is_available()
        laps = {f"time/{k}": round(v, 4 if k == "macro" else 3) for k, v in self.laps.items()}
        return {"time/step": round(total, 3), **laps, "tokens_per_s": round(tokens / total, 1),
                **({"memory/peak_gb": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)} if gpu else {})}


# ---------------------------------------------------------------------------------------------
# The run log: metrics.jsonl and the trackers
# ---------------------------------------------------------------------------------------------

class RunLog:
    """One JSON line of metrics per iteration in <output_dir>/metrics.jsonl, written by the main process, and
    accelerate's trackers when asked (`report_to`: tensorboard, wandb). A run that resumes after `first_step`
    iterations drops the lines of later ones, which its checkpoint does not hold: the file reads as one run."""

    def __init__(self, accelerator, output_dir, first_step=0, report_to="none", config=None):
        self.accelerator, self.report_to = accelerator, report_to
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if report_to != "none":
            accelerator.init_trackers("ma-rlhf", config=config)
        if accelerator.is_main_process:
            os.makedirs(output_dir, exist_ok=True)
            kept = []
            if os.path.exists(self.path):
                with open(self.path) as f:
                    kept = [line for line in f if json.loads(line)["step"] <= first_step]
            with open(self.path, "w") as f:
                f.writelines(kept)

    def write(self, metrics):
        """One iteration's metrics (its "step" among them)."""
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if self.report_to != "none":
            self.accelerator.log(metrics, step=metrics["step"])

    def close(self):
        if self.report_to != "none":
            self.accelerator.end_training()


def mean_over_processes(accelerator, values):
    """{name: scalar tensor or number} of this process -> {name: float}, each the mean over every process (one reduction,
    the names in sorted order on every rank): the same numbers on every rank."""
    names = sorted(values)
    means = accelerator.reduce(torch.stack([torch.as_tensor(values[k]).float().to(accelerator.device) for k in names]),
                               "mean")
    return dict(zip(names, means.tolist()))


# ---------------------------------------------------------------------------------------------
# LoRA (peft): the memory lever for real models
# ---------------------------------------------------------------------------------------------

def with_lora(model, r, alpha, target_modules, task_type):
    """`model` with LoRA adapters (rank r, scale alpha / r) on `target_modules` ("all-linear" or names
    separated by commas); only the adapters train (and, for a reward model / critic, the score head)."""
    from peft import LoraConfig, get_peft_model
    targets = target_modules if target_modules == "all-linear" else target_modules.split(",")
    with peft_quietly():
        return trained_dtype(get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                             target_modules=targets, task_type=task_type)))


def lora(model, models, task_type, adapters=""):
    """ppo.py's LoRA: `model` with new adapters of `models` (ModelArgs: --lora_r, --lora_alpha,
    --lora_target_modules), or with the saved `adapters` of a checkpoint part put back."""
    if adapters:
        return load_lora(model, adapters)
    return with_lora(model, models.lora_r, models.lora_alpha, models.lora_target_modules, task_type)


def load_ppo_models(models, sft_path, rm_path, critic_path, rm, *, code_task, resume_dir=None, sharded=False):
    """ppo.py's four models, (tokenizer, policy, critic or None, frozen reference, frozen RM or None): policy and
    reference from the SFT model, the critic from `critic_path` ("": none); under --lora_r adapters on both, the
    reference the policy with its adapters off (None); `resume_dir`: the trained two from its checkpoint. `models`:
    ModelArgs; `rm`: the reward_model module (its loader and its Critic); `sharded`: ZeRO-3 / FSDP partitions."""
    from transformers import AutoModelForCausalLM
    part = (lambda name, default: checkpoint_part(resume_dir, name) if resume_dir else default)
    if resume_dir:
        require_part(part("policy", ""), "checkpoint to resume", "Run without --resume.")
    tokenizer, bf16 = data.load_tokenizer(sft_path), models.bf16
    with loading_whole():       # the frozen models are never handed to a ZeRO-3 engine
        reward_model = None if code_task else rm.load_reward_model(rm_path, bf16)[0].eval().requires_grad_(False)
    if models.lora_r:   # adapters on the SFT model and on the critic's init: two copies of the base weights in all
        policy = AutoModelForCausalLM.from_pretrained(sft_path, dtype=torch.bfloat16 if bf16 else torch.float32)
        # a critic initialised from the RM reads the RM's own weights (a twin of it), unless sharded
        shared = reward_model is not None and not sharded and os.path.realpath(critic_path) == os.path.realpath(rm_path)
        critic = (twin(reward_model) if shared else rm.load_reward_model(critic_path, bf16)[0]) \
            if critic_path else None
        policy = lora(policy, models, "CAUSAL_LM", part("policy", ""))
        critic = None if critic is None else rm.Critic(lora(critic, models, "SEQ_CLS", part("critic", "")))
    else:       # trained weights in fp32 (the master copy); --bf16 autocasts their forwards
        policy = AutoModelForCausalLM.from_pretrained(part("policy", sft_path), dtype=torch.float32)
        critic = rm.Critic(rm.load_reward_model(part("critic", critic_path))[0]) if critic_path else None
    # the reference in the precision the policy computes in: bf16 where the engine runs the policy's in bf16
    # (DeepSpeed, FSDP2's mixed precision), else fp32 under the policy's autocast (reference_forward)
    with loading_whole():
        ref = None if models.lora_r else AutoModelForCausalLM.from_pretrained(
            sft_path, dtype=torch.bfloat16 if bf16 and sharded else torch.float32).eval().requires_grad_(False)
    if models.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        if critic is not None:
            critic.model.gradient_checkpointing_enable()
    return tokenizer, policy, critic, ref, reward_model


@contextlib.contextmanager
def peft_quietly():
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it puts adapters on a model (new
    ones or saved ones): a FutureWarning that is neither ours nor the user's to fix, left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def twin(model):
    """A second module tree over `model`'s own parameter and buffer tensors: no copy of the weights.
    Under LoRA the critic is a twin of the frozen reward model with adapters (and its own score head)
    on top: both read one copy of the base weights, which neither changes (the base stays frozen)."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)


def load_lora(base, adapters):
    """A LoRA checkpoint part (adapters only) put back on its base model, trainable."""
    from peft import PeftModel
    with peft_quietly():
        return trained_dtype(PeftModel.from_pretrained(base, adapters, is_trainable=True))


def trained_dtype(model):
    """`model` with its trained parameters (adapters, a score head copied from the base) in the dtype they
    step in. Outside DeepSpeed fp32, whatever the base's (a --bf16 base stays bf16, frozen): bf16 autocast
    needs fp32 weights to step (mixed precision's master weights), since an AdamW step on bf16 weights rounds
    away any update below 2^-8 of the weight (at lr 1e-6, nearly all of them). Under DeepSpeed the frozen
    base's dtype: the engine keeps the fp32 master copy itself, and ZeRO-3 takes the trained parameters of one
    engine in one dtype (peft's fp32 adapters beside a bf16 score head failed its partitioning)."""
    dtype = torch.float32
    if deepspeed_launch():
        dtype = next((p.dtype for p in model.parameters() if not p.requires_grad), dtype)
    for p in model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def is_lora(model):
    return hasattr(model, "disable_adapter") and hasattr(model, "merge_and_unload")


def merged(model):
    """The model to save at the end: LoRA adapters merged into the weights (a plain model any
    from_pretrained loads), or the model itself."""
    return model.merge_and_unload() if is_lora(model) else model


def require_part(path, what, hint):
    """A checkpoint part: a model folder (config.json) or LoRA adapters (adapter_config.json)."""
    if not os.path.exists(os.path.join(path, "adapter_config.json")):
        require_model_dir(path, what, hint)


# ---------------------------------------------------------------------------------------------
# Stopping: Ctrl-C and SIGTERM end the run at the end of a step, with a checkpoint
# ---------------------------------------------------------------------------------------------

class GracefulStop:
    """SIGINT (Ctrl-C) or SIGTERM asks the loop to stop at the end of the current step, where the
    weights, optimizer, schedule and RNG all agree with the step counter, so the checkpoint saved
    there resumes to exactly the uninterrupted run. (An exception raised mid-step, after an optimizer
    step, would save weights one step ahead of their counter.)
    - `stop_after()` is collective: every rank calls it at the same point and they agree (any rank
      signalled -> all stop), so no rank is left waiting in a collective the others have left;
    - `accelerate launch` forwards the terminal's SIGINT (and its own SIGTERM) to its workers, which
      thus get it twice: a repeat within `grace` seconds is the same request; a later one raises
      KeyboardInterrupt to quit at once without saving (the last periodic checkpoint stays). The
      launcher kills its workers 30 s after the signal: a longer step ends before its checkpoint;
    - handlers are installed explicitly, so they work in a process started with SIGINT ignored (`&`).
    Use it as a context manager around the loop and call `end_of_step(...)` after every step. Entering it also
    takes what is alive then out of the cycle collector's way (`out_of_the_collectors_way`)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, accelerator, name, unit="step", ckpt_dir="", saved=0, grace=2.0):
        self.accelerator, self.name, self.unit, self.ckpt_dir = accelerator, name, unit, ckpt_dir
        self.saved, self.grace, self.first, self.signum = saved, grace, None, None
        for s in self.SIGNALS:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame):
        if self.first is None:
            self.first, self.signum = time.monotonic(), signum
            # os.write, not print: the handler may run while the main thread is inside a print
            os.write(2, f"\n[{signal.Signals(signum).name}] finishing this {self.unit}, then saving a checkpoint "
                        f"(signal again to quit now without saving)\n".encode())
        elif time.monotonic() - self.first > self.grace:
            raise KeyboardInterrupt

    def stop_after(self, done, last, save_every, save):
        """At the end of step `done`, on every rank: the periodic `save(done)`, or a checkpoint here if any rank was
        signalled before the last step; True when the loop should stop (then on every rank)."""
        signalled = torch.tensor([float(self.first is not None)], device=self.accelerator.device)
        stop = self.accelerator.reduce(signalled, "sum").item() > 0 and done < last
        if stop or done % save_every == 0:
            save(done)
            self.saved = done
        return stop

    def end_of_step(self, done, last, save_every, save):
        """stop_after, and when stopping: say where the checkpoint is and exit (130, or 143 for SIGTERM)."""
        if self.stop_after(done, last, save_every, save):
            self.accelerator.print(f"[{self.name}] interrupted after {self.unit} {done}: checkpoint saved to "
                                   f"{self.ckpt_dir}; continue with --resume")
            sys.exit(128 + (self.signum or signal.SIGINT))

    def kept(self):
        """What a second signal leaves behind."""
        if not self.saved:
            return "no checkpoint had been saved yet"
        return f"the checkpoint of {self.unit} {self.saved} in {self.ckpt_dir} is kept"

    def __enter__(self):
        out_of_the_collectors_way()         # the loop begins: what is alive now lives through it
        return self

    def __exit__(self, kind, value, traceback):
        for s in self.SIGNALS:
            signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        if kind is KeyboardInterrupt:
            self.accelerator.print(f"[{self.name}] quit without saving: {self.kept()}")
            sys.exit(130)
        return False


# ---------------------------------------------------------------------------------------------
# Checkpoints: one layout, atomic writes, one save / resume pair
# ---------------------------------------------------------------------------------------------

def atomic_save(path, model=None, tokenizer=None, state=None, parts=None, state_dicts=None, keep=(), moved=None):
    """Write a save_pretrained folder to a temporary sibling, then swap it in with a rename: an
    interruption never leaves a half-written folder where the last good one was.
    `parts` {name: model} go to sub-folders, each with the tokenizer; `state_dicts` {name or "model":
    weights} replaces a model's own weights (the gathered whole weights of a ZeRO-3 / FSDP sharded
    model); the sub-folders named in `keep` (a checkpoint inside a final model folder) move over, and
    `moved` {name: folder} folders move in under `name`."""
    path = os.path.abspath(path)
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    state_dicts = state_dicts or {}
    with saving_without_deepspeed():
        if model is not None:
            model.save_pretrained(tmp, state_dict=state_dicts.get("model"))
        for name, part in (parts or {}).items():
            part.save_pretrained(os.path.join(tmp, name), state_dict=state_dicts.get(name))
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(tmp, name))
    if tokenizer is not None and not parts:
        tokenizer.save_pretrained(tmp)
    if state is not None:
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    for name, folder in (moved or {}).items():
        os.rename(folder, os.path.join(tmp, name))
    for name in keep:
        if os.path.exists(os.path.join(path, name)):
            os.rename(os.path.join(path, name), os.path.join(tmp, name))
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_dir(output_dir):
    return os.path.join(output_dir, CHECKPOINT)


def interrupted(output_dir, final="config.json"):
    """Whether `output_dir` holds an interrupted run: a checkpoint (its trainer state; a LoRA checkpoint
    holds adapters, not a config.json) and no finished model (`final`, under output_dir)."""
    return (os.path.exists(os.path.join(checkpoint_dir(output_dir), "trainer_state.pt"))
            and not os.path.exists(os.path.join(output_dir, final)))


def checkpoint_part(output_dir, part):
    return os.path.join(output_dir, CHECKPOINT, part)


def save_checkpoint(output_dir, parts, tokenizer, step, args, optimizers=None, schedulers=None,
                    state_dicts=None, shards=None, **extra):
    """The one checkpoint writer (main process only): the parts, and the trainer state of `step`;
    `shards`: the folder of `save_optimizer_shards`, moved in."""
    state = {"step": step, "rng": rng_state(), "args": args if isinstance(args, dict) else asdict(args), **extra,
             **{k: o.state_dict() for k, o in (optimizers or {}).items()},
             **{k: s.state_dict() for k, s in (schedulers or {}).items()}}
    atomic_save(checkpoint_dir(output_dir), tokenizer=tokenizer, parts=parts, state=state, state_dicts=state_dicts,
                moved={SHARDS: shards} if shards else None)


def save_training(accelerator, output_dir, step, args, tokenizer, models, optimizers, schedulers, **extra):
    """The checkpoint of `step` for a stage's trained `models` {name: (accelerator, model)} with their
    `optimizers` and `schedulers` {name: ...} and `extra` trainer state; a collective call. Sharded (ZeRO /
    FSDP): the whole weights gathered, every rank's optimizer states in its own file; every rank's RNG state."""
    sharded = is_sharded(accelerator)
    weights = whole_state_dicts(models) if sharded else None
    rng = rng_states(accelerator)                                       # collective: every rank's own
    shards = save_optimizer_shards(accelerator, output_dir, optimizers) if sharded else None
    if accelerator.is_main_process:
        parts = {name: unwrap(acc, model) for name, (acc, model) in models.items()}
        parts = {name: m if hasattr(m, "save_pretrained") else m.model for name, m in parts.items()}  # in a wrapper
        save_checkpoint(output_dir, parts, tokenizer, step, args, {} if sharded else optimizers, schedulers,
                        weights, shards, rng_ranks=rng, **extra)
    accelerator.wait_for_everyone()


def save_trained(trained, output_dir, config, tokenizer, step, **extra):
    """ppo.py's checkpoint of iteration `step` (collective): the `trained` models {name: Trained} with their optimizers
    and schedules, the run's `config`, and `extra` state of its loop."""
    optimizers, schedulers = checkpoint_names(trained)
    save_training(trained["policy"].accelerator, output_dir, step, config, tokenizer,
                  {name: (t.accelerator, t.model) for name, t in trained.items()}, optimizers, schedulers, **extra)


def resume(args, trained, generator, config):
    """ppo.py --resume: the optimizers, schedules and RNG of the `trained` models back from the checkpoint in
    args.output_dir (a fresh start without args.resume: (0, 0, args.beta)), the `generator`'s state too; returns (the
    iteration to continue at, prompts truncated so far, the KL coefficient: the checkpoint's, else --beta).
    `config`: every flag of this run, compared with the checkpoint's (`load_checkpoint`)."""
    if not args.resume:
        return 0, 0, args.beta
    acc = trained["policy"].accelerator
    optimizers, schedulers = checkpoint_names(trained)
    state = load_checkpoint(args.output_dir, optimizers, schedulers, acc.print, acc.process_index, acc.num_processes,
                            config)
    generator.set_state(state["generator"])
    acc.print(f"[ppo] resumed at iteration {state['step']}")
    return state["step"], state["truncated"], state.get("beta", args.beta)


SHARDS = "optimizer_shards"


def save_optimizer_shards(accelerator, output_dir, optimizers):
    """DeepSpeed ZeRO partitions the optimizer states (the AdamW moments of each rank's part of the
    parameters): every rank writes its own, `<name>.rank<r>.pt`, into a folder beside the checkpoint that
    `save_checkpoint` then moves into it. A collective. Returns the folder; None where the states are
    not partitioned (saved whole by `save_checkpoint`) or under FSDP (not saved: resume warns)."""
    if accelerator.distributed_type.value != "DEEPSPEED":
        return None
    folder = checkpoint_dir(output_dir) + ".shards"
    if accelerator.is_main_process:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    accelerator.wait_for_everyone()
    for name, optimizer in optimizers.items():
        torch.save(optimizer.state_dict(), os.path.join(folder, f"{name}.rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    return folder


def _optimizer_shard(path, name, rank, world):
    """Every rank's saved ZeRO optimizer state of `name`, in rank order, for DeepSpeed's loader (it reads its own
    rank's entry, and every rank's fp32 master partition to rebuild its own), or None unless every one of
    `world` ranks saved one. The other ranks' files are memory-mapped: read where the loader needs them."""
    folder = os.path.join(path, SHARDS)
    saved = [f for f in os.listdir(folder) if f.startswith(f"{name}.rank")] if os.path.isdir(folder) else []
    if len(saved) != world:
        return None
    return [torch.load(os.path.join(folder, f"{name}.rank{r}.pt"), weights_only=False, mmap=r != rank)
            for r in range(world)]


# flags a resumed run may change without a word: how long it runs, how often it saves and reports
RESUME_MAY_CHANGE = {"steps", "max_steps", "epochs", "resume", "save_every", "eval_every", "plot", "report_to"}


def load_checkpoint(output_dir, optimizers=None, schedulers=None, log=print, rank=0, world=1, flags=None):
    """The one checkpoint reader: restores optimizers, schedules and RNG from `<output_dir>/checkpoint`
    and returns the trainer state (its "step" is where to continue). A clear error when it is missing.
    Process `rank` of `world` gets its own RNG state back (`rng_ranks`, saved by `rng_states`). `flags`: this
    run's, as a dict: a warning names each that differs from the checkpoint's run (beyond RESUME_MAY_CHANGE)."""
    path = checkpoint_dir(output_dir)
    if not os.path.exists(os.path.join(path, "trainer_state.pt")):
        sys.exit(f"error: no checkpoint to resume at {path!r}. Run without --resume to start afresh.")
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    saved = state.get("args", {})
    changed = [f"--{k} {saved[k]!r} -> {v!r}" for k, v in (flags or {}).items()
               if k in saved and k not in RESUME_MAY_CHANGE and saved[k] != v]
    if changed:
        log(f"warning: resuming with flags that differ from the checkpoint's run: {', '.join(changed)}; it goes on "
            "with these (the same numbers as an uninterrupted run only with the same flags)")
    for key, obj in {**(optimizers or {}), **(schedulers or {})}.items():
        shard = None if key in state else _optimizer_shard(path, key, rank, world)
        if key in state:
            obj.load_state_dict(state[key])
        elif shard is not None:     # DeepSpeed ZeRO: this rank's partition, its fp32 master weights included
            # (accelerate's load_state_dict would rebuild them from the bf16 weights: every update below bf16's
            # resolution since the last checkpoint lost, and under bf16 most of them are)
            obj.optimizer.load_state_dict(shard, load_from_fp32_weights=True)
        else:
            log(f"warning: the checkpoint holds no {key} state (saved under FSDP, or ZeRO with another "
                "number of processes): it starts afresh")
    ranks = state.get("rng_ranks")
    if ranks is not None and len(ranks) == world:
        set_rng_state(ranks[rank])
    else:       # every process restarts from the main process's random numbers, which only it had drawn
        if world > 1:
            log(f"warning: the checkpoint holds the RNG states of {len(ranks) if ranks else 'only the main'} "
                f"process(es), not of these {world}: each starts from the main process's, so the numbers after "
                "this resume differ from an uninterrupted run's (resume with as many processes as saved it)")
        set_rng_state(state["rng"])
    return state


def require_model_dir(path, what, hint):
    if not os.path.exists(os.path.join(path, "config.json")):
        sys.exit(f"error: no {what} at {path!r} (no config.json there). {hint}")


def rng_state():
    """This process's random number generators: torch's (CPU, and CUDA's current device: sampling on a GPU
    draws from it) and Python's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_states(accelerator):
    """Every process's `rng_state()`, in rank order, on every process (a collective). Each rank draws its
    own random numbers (its prompts' samples end at different lengths), so a checkpoint keeps them all."""
    if accelerator.num_processes == 1:
        return [rng_state()]
    from accelerate.utils import gather_object
    return gather_object([rng_state()])


def eval_batches(n_rows, batch_size, rank=0, world=1):
    """(start, weight) of this process's held-out batches rows[start:start + batch_size]: every rank
    gets the same number of batches, since a sharded forward needs every rank; a rank past the end
    repeats the first batch with weight 0, so each row is counted exactly once."""
    n_batches = -(-n_rows // (batch_size * world))
    starts = [(k * world + rank) * batch_size for k in range(n_batches)]
    return [(start, 1.0) if start < n_rows else (0, 0.0) for start in starts]


# ---------------------------------------------------------------------------------------------
# The loop SFT and reward modelling share
# ---------------------------------------------------------------------------------------------

class Trainer:
    """The optimizer and cosine schedule, resuming, micro-batches with accumulation, held-out
    evaluation, atomic checkpoints every `save_every` steps and on Ctrl-C / SIGTERM, and a stop on a
    non-finite loss. `loss_fn(rows) -> loss`, `evaluate() -> (value, text)`. After `fit`, `final` is the
    saved model as one whole module on the main process (None on the others)."""

    def __init__(self, name, accelerator, model, tokenizer, args, n_rows, resume=False):
        from transformers import get_cosine_schedule_with_warmup
        self.name, self.accelerator, self.tokenizer, self.args, self.n_rows = name, accelerator, tokenizer, args, n_rows
        world = accelerator.num_processes
        self.steps = args.max_steps or math.ceil(args.epochs * n_rows / (args.batch_size * world * args.grad_accum))
        trained = [p for p in model.parameters() if p.requires_grad]          # all of them, or LoRA's
        optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=getattr(args, "weight_decay", 0.0))
        self.scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * self.steps), self.steps)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.start = 0
        if resume:
            self.start = load_checkpoint(args.output_dir, {"optimizer": self.optimizer},
                                         {"scheduler": self.scheduler}, accelerator.print,
                                         accelerator.process_index, world, asdict(args))["step"]
            accelerator.print(f"[{name}] resumed at step {self.start}")

    def save(self, step):
        save_training(self.accelerator, self.args.output_dir, step, self.args, self.tokenizer,
                      {"model": (self.accelerator, self.model)}, {"optimizer": self.optimizer}, {"scheduler": self.scheduler})

    def fit(self, rows, loss_fn, evaluate):
        """Train to the last step, then save the final model; returns the last evaluation value."""
        from tqdm.auto import tqdm
        acc, args, name = self.accelerator, self.args, self.name
        world, rank = acc.num_processes, acc.process_index
        self.model.train()
        t0, value = time.time(), float("nan")
        bar = tqdm(range(self.start, self.steps), desc=name, disable=not acc.is_local_main_process)
        with GracefulStop(acc, name, "step", checkpoint_dir(args.output_dir), saved=self.start) as stop:
            for step in bar:
                for micro in range(args.grad_accum):
                    idx = data.batch_indices(self.n_rows, args.batch_size, step * args.grad_accum + micro, args.seed,
                                        rank, world)
                    with acc.accumulate(self.model):
                        loss = loss_fn([rows[i] for i in idx])
                        stop_unless_finite(acc, f"{name} loss at step {step}", args.output_dir, loss)
                        acc.backward(loss)
                        if acc.sync_gradients:      # the group's last micro-step: the step's gradients
                            grad_norm = clip_gradients(acc, self.model, args.max_grad_norm)
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                self.scheduler.step()
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{self.scheduler.get_last_lr()[0]:.1e}")
                if (step + 1) % args.eval_every == 0 or step + 1 == self.steps:
                    self.model.eval()
                    with torch.no_grad():
                        value, text = evaluate()
                    self.model.train()
                    acc.print(f"[{name}] step {step + 1}/{self.steps}  train loss {loss.item():.3f}  "
                              f"grad norm {grad_norm:.3g}  {text}  "
                              f"({time.time() - t0:.0f}s)")
                stop.end_of_step(step + 1, self.steps, args.save_every, self.save)
        self.final = final_model(acc, self.model)       # whole, LoRA merged; on the main process
        if acc.is_main_process:
            atomic_save(args.output_dir, self.final, self.tokenizer, keep=(CHECKPOINT,))
        acc.wait_for_everyone()
        acc.print(f"[{name}] saved {args.output_dir}")
        return value
