"""Run a script under a CPU FSDP2 launch, for tests only:

    accelerate launch --config_file configs/fsdp.yaml --num_processes 2 --mixed_precision no ... tests/launch/fsdp_cpu.py sft.py ...

accelerate (1.15) starts FSDP only for accelerator process groups: on a CPU it starts the processes as
plain DDP over gloo (MULTI_CPU) although the launch asked for FSDP and the FSDP plugin was built from the
launch config. torch's FSDP2 (`fully_shard`) itself runs on gloo; this makes accelerate's state what the
launch asked for (FSDP, with that plugin) and runs the script. Everything else (accelerate's FSDP2
preparation, sharded DTensor parameters, the all-gathers and reduce-scatters, the state-dict gathers) is
the real thing.
"""
import os
import runpy
import sys

import accelerate.accelerator
import torch.distributed as dist
from accelerate import state
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def _init_as_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    # MULTI_CPU on a fresh state; FSDP already after a reset of AcceleratorState alone (tests/launch/launched_stages.py)
    if fsdp_plugin is not None and self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.FSDP):
        self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
        if self._mixed_precision != "no":     # as accelerate's FSDP branch does: --bf16 is FSDP's param_dtype
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        # every later AcceleratorState() copies PartialState's fields over its own: FSDP there too
        state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP


_prepare = accelerate.accelerator.fsdp2_prepare_model


def _prepare_and_report(accelerator, model):
    """accelerate's FSDP2 preparation, then one line per rank on what this rank holds: the proof, for a
    test, that the model was sharded rather than replicated."""
    model = _prepare(accelerator, model)
    whole = sum(p.numel() for p in model.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    print(f"[fsdp_cpu] rank {accelerator.process_index}: {type(model).__name__} holds {local} of {whole} "
          "parameter values", flush=True)
    return model


state.AcceleratorState.__init__ = _init_as_fsdp
accelerate.accelerator.fsdp2_prepare_model = _prepare_and_report
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
if dist.is_initialized():   # leave together, the process group taken down first: a rank whose gloo group died with the
    dist.barrier()          # interpreter while its peer still talked to it aborted once in CI ("terminate called
    dist.destroy_process_group()   # without an active exception", SIGABRT)
sys.stdout.flush()          # and no interpreter teardown after it: the abort came back once more (a gloo thread still
sys.stderr.flush()          # joinable when the interpreter's destructors ran); the script's results are written by now
os._exit(0)
