"""The launch tests of test_harness.py (tests/spec): they start processes of their own."""
import os

import pytest

import harness


@pytest.mark.launch
def test_a_non_finite_loss_on_one_process_is_seen_by_every_process(tmp_path):
    """harness.stop_unless_finite reduces over the processes: under a 2-process launch, a NaN on rank 1 alone makes
    both ranks stop (a rank that raised alone would leave the other waiting in its next collective)."""
    import subprocess
    import textwrap
    from stages import launch
    script = tmp_path / "nan_on_rank1.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(harness.__file__))!r})
        import torch
        import harness
        acc = harness.make_accelerator()
        loss = torch.tensor(float("nan") if acc.process_index == 1 else 1.0)
        ok = torch.tensor(2.0)

        def stops(*tensors):
            try:
                harness.stop_unless_finite(acc, "loss at iteration 3", "out", *tensors)
            except FloatingPointError as e:
                return "loss at iteration 3" in str(e) and "out/checkpoint" in str(e)
            return False
        print(f"rank {{acc.process_index}}: nan seen {{stops(ok, loss)}}, finite seen {{not stops(ok)}}", flush=True)
        acc.wait_for_everyone()                      # neither rank leaves while the other still talks to it
        torch.distributed.destroy_process_group()
    """))
    out = subprocess.run(launch(script), capture_output=True, text=True, timeout=300)
    for rank in (0, 1):
        assert f"rank {rank}: nan seen True, finite seen True" in out.stdout, out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
