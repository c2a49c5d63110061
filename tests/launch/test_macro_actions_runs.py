"""The launch tests of test_macro_actions.py (tests/spec): macro_actions.py run in subprocesses or as whole stages."""
import os
import shutil
import subprocess
import sys

import pytest

ALONE = """
import sys, torch
import macro_actions as ma
assert not set(sys.modules) & {"transformers", "spacy", "nltk", "data", "ppo", "harness"}, "imports beyond torch"
mask = torch.ones(1, 5)
starts = torch.tensor([[True, False, False, True, False]])
kl = torch.tensor([[-0.3, -0.6, -0.9, -0.2, -0.4]])
for agg, expected in [("sum", [-1.8, 1.4]), ("mean", [-0.6, 1.7])]:
    R = ma.macro_sum(ma.macro_rewards(kl, torch.tensor([2.0]), mask, starts, agg), starts)[0, [0, 3]]
    assert torch.allclose(R, torch.tensor(expected)), (agg, R)
    adv, _ = ma.macro_advantages(torch.zeros(1, 5), ma.macro_rewards(kl, torch.tensor([2.0]), mask, starts, agg),
                                 mask, starts, gamma=1.0, lam=1.0)
    assert torch.allclose(adv[0, 0], torch.tensor(sum(expected))), (agg, adv)
print("alone ok")
"""


@pytest.mark.launch
def test_macro_actions_copied_alone_gives_the_paper_sum_and_the_released_mean(tmp_path):
    """The file is copyable: alone in a folder (no other file of the project importable), with torch only."""
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "macro_actions.py"), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n{ALONE}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "alone ok" in proc.stdout, proc.stderr[-2000:]
