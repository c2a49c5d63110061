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


def run_stage(script, *argv, printed=None):
    """`python script *argv` in this process; returns what it printed (stdout and stderr). `printed`: a stream
    to print to instead (a file keeps what a stage printed before it raised)."""
    from transformers import HfArgumentParser
    name = script.removesuffix(".py")
    module = importlib.import_module(name)
    args = HfArgumentParser(getattr(module, ARGS[name])).parse_args_into_dataclasses(list(map(str, argv)))[0]
    stream = printed or io.StringIO()
    with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        module.main(args)
    return None if printed else stream.getvalue()


def comparable(row):
    """A metrics row without what depends on time or on when the run evaluated."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "tokens_per_s", "eval/"))}


def bench_module(name):
    """bench/<name>.py imported as a module (bench/ is not a package): its functions, not its command line."""
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).resolve().parents[2] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
