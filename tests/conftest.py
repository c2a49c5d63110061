import os

import pytest


def pytest_configure(config):
    """One thread per process, for this process and every process it starts (OMP_NUM_THREADS; and
    MA_RLHF_CPU_THREADS for the stages ppo.py starts, which do not inherit OMP_ variables; a user's own
    values are kept): the tests' models are tiny, a second thread gains nothing on them, and where other
    processes share the cores (the suite's own launches, a busy CI runner) threads waiting for each other make
    small ops many times slower. The thread count does not change the numbers. The slow real-model test keeps
    torch's default."""
    if "slow" not in (config.getoption("markexpr") or ""):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MA_RLHF_CPU_THREADS", "1")
    if hasattr(config.option, "loadscopereorder"):      # pytest-xdist: hand out files in FIRST's order
        config.option.loadscopereorder = False


@pytest.fixture(autouse=True)
def collector_back():
    """A stage run in the test's own process leaves the objects alive before its loop out of the cycle collector's
    reach (harness.out_of_the_collectors_way: right for a process that trains once and exits); after each test the
    collector gets them back, so that the tests' leftovers are collected as before."""
    yield
    import gc
    gc.unfreeze()


# The files that start first. `pytest -n 2 --dist loadfile` hands whole files to its two workers in collection
# order, each worker taking the next file as it finishes one; these go first, the many short files last, so that
# the two workers end together instead of one of them alone with a long file at the end. Most of the long files'
# time is multi-process launches, which keep both cores busy (seconds in a suite run, in FIRST's order: about 36,
# 42, 79, 55, 32, 22, 20; test_sandbox.py 26, in sandboxed programs); test_sandbox_hostile.py starts beside the
# first: most of its ~40 s waits on sandboxed programs that sleep or hold threads, which at the end of the run left
# a core idle (the launches' processes take that core now). Without -n the order changes nothing but the order.
FIRST = ("test_gpu_paths_on_cpu_runs.py", "test_sandbox_hostile.py", "test_ppo_runs.py", "test_scale.py",
         "test_two_processes.py", "test_bench_runs.py", "test_critic_free_runs.py", "test_sandbox.py")


def pytest_collection_modifyitems(config, items):
    """Slow tests run only when -m names them (python -m pytest -m slow); any other selection leaves them out.
    The files of FIRST go first, in its order, each file's tests in their own order."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]

SAMPLE_TEXT = [
    "The quick brown fox (a clever one) jumped over the lazy dog.\nThen it ran away, fast!",
    "Héllo wörld, naïve café [brackets] {braces} <angles> — unicode “quotes”.",
    "def add(a, b):\n    total = a + b\n    return total\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
    "I think we should meet tomorrow at the library because it is quiet there.",
]


@pytest.fixture(scope="session")
def tokenizer():
    """A real byte-level BPE tokenizer, trained offline in a fraction of a second."""
    from sft import train_tokenizer
    return train_tokenizer(SAMPLE_TEXT * 20, vocab_size=400)


@pytest.fixture(scope="session")
def tiny_lm(tokenizer):
    """A random 2-layer Gemma in eval mode, read by the tests of losses and log-probabilities (never trained)."""
    import torch
    import sft
    torch.manual_seed(0)
    return sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=2).eval()


@pytest.fixture(scope="session")
def gold_labels():
    """The embedded task's gold labels (its rm and test splits), labelled in this process into the cache that every
    stage reads (data.cached_gold_score: runs/cache, or $MA_RLHF_CACHE), unless it holds them already. On a fresh
    clone a launch that starts several processes at once (test_gpu_paths_on_cpu_runs.py's four, test_scale.py's
    four) had each of them label the same ~80k texts (~3 CPU-s each)."""
    import data
    data.load_chitchat(only=("rm", "test"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer):
    """A random 1-layer SFT model and a reward model from it, saved as ppo.py / evaluate.py load them."""
    import torch
    from transformers import AutoModelForSequenceClassification
    import harness
    import sft
    root = tmp_path_factory.mktemp("tiny_models")
    torch.manual_seed(0)
    harness.atomic_save(str(root / "sft"), sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=1), tokenizer)
    reward = AutoModelForSequenceClassification.from_pretrained(root / "sft", num_labels=1)
    harness.atomic_save(str(root / "rm"), reward, tokenizer)
    return root


@pytest.fixture(scope="session")
def parrot(tiny_models, tokenizer, tmp_path_factory):
    """The tiny SFT model trained (40 Adam steps, about 2 s) to answer anything with " clever" over and over, a
    word the chitchat gold judge likes: the collapse of a policy that games it, saved as a policy folder."""
    import torch
    from transformers import AutoModelForCausalLM
    import harness
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_models / "sft")
    prompts = ["\n\nHuman: how are you\n\nAssistant:", "hi", "\n\nHuman: tell me about the fox\n\nAssistant:", "Then it ran"]
    batch = tokenizer([p + " clever" * 12 for p in prompts], return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path_factory.mktemp("parrot") / "policy"
    harness.atomic_save(str(path), model.eval(), tokenizer)
    return path
