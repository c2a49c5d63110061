"""A stage's command line run in the test's own process: the argv parsing and main() of `python <stage>.py
...`, without starting another interpreter (imports alone take ~5 s on 2 cores). Tests that are about the
process itself (signals, exit codes, accelerate launch, the zero-argument pipeline) still start one."""
import contextlib
import importlib
import importlib.util
import io
import pathlib
import sys

ARGS = {"sft": "SFTArgs", "reward_model": "RMArgs", "ppo": "PPOArgs"}

# `accelerate launch` with two CPU processes (gloo), no config file: the multi-process tests' launcher
LAUNCH = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no")


def free_port():
    """A port for a launch's rendezvous: launches that run at once (the two pytest workers' files) must not share
    accelerate's default one, 29500 (the second fails: address already in use)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*argv):
    """LAUNCH on a port of its own (free_port), then argv: the script and its arguments."""
    return [*LAUNCH, "--main_process_port", str(free_port()), *map(str, argv)]


def run_stage(script, *argv, printed=None):
    """`python script *argv` in this process; returns what it printed (stdout and stderr). `printed`: a stream
    to print to instead (a file keeps what a stage printed before it raised)."""
    from transformers import HfArgumentParser
    name = script.removesuffix(".py")
    module = importlib.import_module(name)
    classes = getattr(module, "ARGS", None) or getattr(module, ARGS[name])     # ppo.py: several dataclasses
    parsed = HfArgumentParser(classes).parse_args_into_dataclasses(list(map(str, argv)))
    stream = printed or io.StringIO()
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        module.main(*parsed)
    return None if printed else stream.getvalue()


class PPOConfig(tuple):
    """ppo.py's arguments dataclasses (ppo.config), each flag also readable as an attribute of the whole:
    `ppo.main(*c)`, `c.output_dir`."""

    def __getattr__(self, name):
        for part in self:
            if hasattr(part, name):
                return getattr(part, name)
        raise AttributeError(name)


def ppo_config(**flags):
    """ppo.py's arguments from flags by name (ppo.config), as a PPOConfig. Without its pictures unless `plot=True`
    is asked for: on a quiet machine the learning curve and the macro-action picture add ~0.5 s to a tiny run that
    takes ~0.3 s without them (the first in a process ~1.5 s more: matplotlib's import and fonts), and the tests
    that ask are those about the report and its pictures."""
    import ppo
    return PPOConfig(ppo.harness.split_flags(ppo.ARGS, {"plot": False, **flags}))


def ppo_losses(logp, old_logp, values, old_values, advantages, returns, mask, starts, clip=0.2, value_clip=0.2,
               ratio="token", ref_logp=None, kl_coef=0.0):
    """(policy loss, value loss or None without `values`, the policy's stats) of one minibatch of these tensors, by
    ppo.policy_loss and ppo.value_loss."""
    import ppo
    b = {"old_logp": old_logp, "advantages": advantages, "response_mask": mask, "starts": starts,
         "old_values": old_values, "returns": returns, **({} if ref_logp is None else {"ref_logp": ref_logp})}
    pg_loss, stats = ppo.policy_loss(logp, b, clip, ratio, kl_coef)
    return pg_loss, None if values is None else ppo.value_loss(values, b, value_clip), stats


def comparable(row):
    """A metrics row without what depends on time or on when the run evaluated."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "tokens_per_s", "eval/"))}


def bench_module(name):
    """bench/<name>.py imported as a module (bench/ is not a package): its functions, not its command line."""
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).resolve().parents[2] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
