"""Run a script under a CPU DeepSpeed launch, for tests only:

    accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 ... tests/launch/deepspeed_cpu.py ppo.py ...

accelerate does not support DeepSpeed on CPU: it starts DeepSpeed's process group (gloo, world size
2) but then reports one process per rank. This corrects accelerate's process count and rank from the
process group and runs the script; everything else (the DeepSpeed engines, ZeRO partitioning,
gathers) is the real thing. DeepSpeed's shared-memory collectives for CPUs are left out: a C++ op
compiled on first use (about 100 s on 2 cores); gloo runs the same collectives.
"""
import os
import runpy
import sys

import deepspeed.ops
import torch.distributed as dist
from accelerate import state

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

_init = state.PartialState.__init__


def _init_with_world(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if dist.is_initialized() and self.num_processes != dist.get_world_size():
        self.num_processes, self.process_index = dist.get_world_size(), dist.get_rank()
        self.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))    # per machine


state.PartialState.__init__ = _init_with_world
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
if dist.is_initialized():   # leave together, the process group taken down first: a rank whose gloo group died with the
    dist.barrier()          # interpreter while its peer still talked to it aborted once in CI ("terminate called
    dist.destroy_process_group()   # without an active exception", SIGABRT)
