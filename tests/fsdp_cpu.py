"""Run a script under a CPU FSDP2 launch, for tests only:

    accelerate launch --config_file configs/fsdp.yaml --num_processes 2 --mixed_precision no ... tests/fsdp_cpu.py sft.py ...

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

from accelerate import state
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def _init_as_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
        # every later AcceleratorState() copies PartialState's fields over its own: FSDP there too
        state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP


state.AcceleratorState.__init__ = _init_as_fsdp
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
