"""Run by test_scale.py under a 2-process DeepSpeed launch (through tests/launch/deepspeed_cpu.py): the three stages
one after the other in this process, each as its command line runs it, each stopped and resumed once, first
under ZeRO-2, then under ZeRO-3 (OUT_DIR/zero2, OUT_DIR/zero3):

    sft.py (2 steps, then --resume to 3) -> sft.py --lora_r 4 on that model (2 steps) -> reward_model.py
    (2 steps) -> ppo.py (1 iteration) and ppo.py --lora_r 4 (1 iteration, then --resume to 2; and 2 at once)

each followed by ppo.py with --gradient_checkpointing and with --bf16 (variants()); then test_audit5.py's
--grad_accum 3 and bf16-resume runs as configs/zero2.yaml launches them (OUT_DIR/audit5, test_audit5.zero_main);
last, tests/launch/zero3_generation.py on the ZeRO-3 SFT model (it counts the launch's all-gathers).

    python tests/launch/zero_stages.py OUT_DIR          # all of it
    python tests/launch/zero_stages.py OUT_DIR 2        # test_scale.py's two machines: ZeRO-2, five of the stages

The launch is one of configs/zero2.yaml (test_scale.py's; the two machines': `--zero_stage 2` on the command line).
One launch instead of twenty-four (a DeepSpeed launch costs 5-6 s of imports and setup on a quiet 2-core machine,
more beside a second test worker). accelerate's process-wide state is reset between stages, as accelerate's own
tests do, so that each stage builds its accelerators and DeepSpeed plugins afresh from the launch's environment;
the variables of that environment that differ between the parts are set here before each stage's accelerator
reads them: the ZeRO stage (ACCELERATE_DEEPSPEED_ZERO_STAGE, as `--zero_stage` sets it) and zero.Init
(ACCELERATE_DEEPSPEED_ZERO3_INIT: on for the ZeRO-3 stages, as a `--zero_stage 3` launch without
`--zero3_init_flag` has it: the models load partitioned; off for the generation check and test_audit5's runs, as
configs/zero2.yaml and zero3.yaml have it).
"""
import os
import sys

from accelerate.state import AcceleratorState, GradientState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the stage modules
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec"))   # stages.py
from stages import run_stage  # noqa: E402

TINY = ["--hidden_size", "32", "--num_layers", "1", "--vocab_size", "300", "--batch_size", "4", "--max_prompt_len",
        "24", "--max_response_len", "12", "--n_eval", "16", "--seed", "3", "--save_every", "1", "--eval_every", "2"]
PPO = ["--lora_r", "4", "--rollout_batch_size", "4", "--mini_batch_size", "2", "--max_prompt_len", "16",
       "--max_response_len", "8", "--n_eval_prompts", "4", "--eval_every", "1", "--save_every", "1", "--plot", "false"]


def mark(title):
    """A line that splits the launch's output (rank 0's: what the stages print, they print on rank 0)."""
    if os.environ.get("RANK", "0") == "0":
        print(title, flush=True)


def reset():
    AcceleratorState._reset_state()
    GradientState._reset_state()


def stage(script, *argv):
    reset()
    out = run_stage(script, *argv)
    zero = AcceleratorState().deepspeed_plugin.zero_stage        # the stage its engines ran under
    mark(f"STAGE {script} {' '.join(a for a in argv if a.startswith('--resume'))} under ZeRO-{zero}\n{out}")


def stages(out, all_of_them=True):
    """The stages above; not `all_of_them` (the two-machine launch): sft.py and its --resume, reward_model.py,
    ppo.py --lora_r 4 and its --resume, without the LoRA SFT, full-weight PPO and uninterrupted PPO runs."""
    sft, rm, ppo = (os.path.join(out, name) for name in ("sft", "rm", "ppo"))
    stage("sft.py", *TINY, "--max_steps", "2", "--output_dir", sft)
    stage("sft.py", *TINY, "--max_steps", "3", "--output_dir", sft, "--resume")
    if all_of_them:
        stage("sft.py", *TINY[6:], "--model", sft, "--lora_r", "4", "--max_steps", "2", "--output_dir", sft + "_lora")
    stage("reward_model.py", *TINY[6:], "--max_steps", "2", "--sft_path", sft,
          "--output_dir", rm, "--n_gold_prompts", "4")
    if all_of_them:     # under ZeRO-3 with its report's pictures: the critic drawn is gathered from its shards
        pictures = ["--plot", "true"] if os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3" else []
        stage("ppo.py", *PPO[2:], *pictures, "--steps", "1", "--sft_path", sft, "--rm_path", rm,
              "--output_dir", ppo + "_full")
    stage("ppo.py", *PPO, "--steps", "1", "--sft_path", sft, "--rm_path", rm, "--output_dir", ppo)
    stage("ppo.py", *PPO, "--steps", "2", "--sft_path", sft, "--rm_path", rm, "--output_dir", ppo, "--resume")
    if all_of_them:
        stage("ppo.py", *PPO, "--steps", "2", "--sft_path", sft, "--rm_path", rm, "--output_dir", ppo + "_whole")


def variants(out, zero):
    """ppo.py as in stages(), with --gradient_checkpointing, and with --bf16 (under ZeRO-3 with LoRA: one
    trained dtype per engine)."""
    sft, rm, ppo = (os.path.join(out, name) for name in ("sft", "rm", "ppo"))
    bf16 = ["--bf16", *PPO] if zero == "3" else ["--bf16", *PPO[2:]]
    for name, extra in (("_full_gc", ["--gradient_checkpointing", *PPO[2:]]), ("_bf16", bf16)):
        stage("ppo.py", *extra, "--steps", "1", "--sft_path", sft, "--rm_path", rm, "--output_dir", ppo + name)


def main(out, only=None):
    """Every stage under ZeRO-2 and ZeRO-3 with their variants, test_audit5's runs, then the generation check;
    `only` ("2"): the two-machine launch of test_scale.py, stages(all_of_them=False) under that ZeRO stage alone."""
    for zero in [only] if only else ("2", "3"):
        os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = zero
        os.environ["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = str(zero == "3").lower()
        mark(f"ZERO STAGE {zero}")
        stages(os.path.join(out, f"zero{zero}"), all_of_them=not only)
        if not only:
            variants(os.path.join(out, f"zero{zero}"), zero)
    if only:
        return
    os.environ["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = "false"     # as configs/zero2.yaml and zero3.yaml have it
    import test_audit5
    mark("AUDIT5")
    test_audit5.zero_main(os.path.join(out, "audit5"))      # it resets the state before each of its stages
    import zero3_generation     # last: it wraps the process's all-gathers with a counter
    os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] = "3"     # test_audit5's runs end under ZeRO-2
    reset()                     # without zero.Init (as `--zero3_init_flag false`): the policy loads whole, then the
    mark("ZERO3 GENERATION")    # engine partitions it
    zero3_generation.main(os.path.join(out, "zero3", "sft"))


if __name__ == "__main__":
    main(*sys.argv[1:])
