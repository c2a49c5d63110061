"""Run by tests/launch/critic_free_ranks.py after its stages, in test_two_processes.py's 2-process `accelerate
launch` (gloo, CPU), or alone under such a launch: harness.in_chunks with a different number of rows on each rank (5 on
rank 0, 2 on rank 1, slices of 2), whose forward is a collective (an all-gather, as a sharded model's forward is): with
a different number of forwards per rank the launch would hang. Rank r writes OUT/<r>.json: its forwards, and whether
the chunked result equals the forward over all its rows at once.

    python tests/launch/in_chunks_ranks.py OUT
"""
import json
import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import harness  # noqa: E402


def main(out):
    acc = Accelerator(cpu=True)
    rows = torch.arange(5.0 if acc.process_index == 0 else 2.0).unsqueeze(-1) + 10 * acc.process_index
    calls = []

    def forward(part):          # a collective each call, then a row-wise function of the rows
        calls.append([part.start, part.stop])
        acc.gather(torch.ones(1))
        return rows[part] * 2 + 1
    chunked = harness.in_chunks(acc, forward, len(rows), 2)
    with open(os.path.join(out, f"{acc.process_index}.json"), "w") as f:
        json.dump({"calls": calls, "equal": torch.equal(chunked, rows * 2 + 1)}, f)
    acc.wait_for_everyone()                             # neither rank leaves while the other still talks to it
    torch.distributed.destroy_process_group()           # else gloo's threads may end the process: "terminate called
                                                        # without an active exception", SIGABRT


if __name__ == "__main__":
    main(sys.argv[1])
