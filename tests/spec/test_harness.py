"""harness.py: batches resume exactly, checkpoints are atomic and have one layout, Ctrl-C and SIGTERM
ask the loop to stop at the end of a step."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import data
import harness
import sft


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=1).eval()


def test_batches_split_across_ranks_and_repeat_on_resume():
    n, bs = 103, 8
    a = data.batch_indices(n, bs, step=5, seed=1, rank=0, world=2)
    b = data.batch_indices(n, bs, step=5, seed=1, rank=1, world=2)
    assert len(a) == len(b) == bs and not set(a) & set(b)
    assert a == data.batch_indices(n, bs, step=5, seed=1, rank=0, world=2)
    epoch = [i for s in range(n // bs) for i in data.batch_indices(n, bs, s, seed=1)]
    assert len(set(epoch)) == len(epoch)                               # no repeats within an epoch


def test_atomic_save_keeps_the_last_good_checkpoint_when_saving_fails(tmp_path, model, tokenizer):
    path = tmp_path / "ckpt"
    harness.atomic_save(str(path), model, tokenizer, {"step": 1})
    before = sorted(os.listdir(path))

    class Broken:
        def save_pretrained(self, where, state_dict=None):
            open(os.path.join(where, "partial.bin"), "w").write("half")
            raise OSError("disk full")

    with pytest.raises(OSError):
        harness.atomic_save(str(path), Broken(), tokenizer, {"step": 2})
    assert sorted(os.listdir(path)) == before
    assert torch.load(path / "trainer_state.pt")["step"] == 1


def test_one_checkpoint_layout_saves_and_restores_every_part_and_the_random_state(tmp_path, model, tokenizer):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    opt.step()
    args = sft.SFTArgs(output_dir=str(out))
    torch.manual_seed(7)
    harness.save_checkpoint(str(out), {"policy": model, "critic": model}, tokenizer, 12, args, {"opt": opt})
    expected = torch.rand(3)                                           # drawn after the save
    for part in ("policy", "critic"):                                  # each part loads on its own
        folder = harness.checkpoint_part(str(out), part)
        assert AutoModelForCausalLM.from_pretrained(folder) is not None and data.load_tokenizer(folder) is not None
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    state = harness.load_checkpoint(str(out), {"opt": fresh})
    assert state["step"] == 12 and state["args"]["output_dir"] == str(out)
    assert torch.equal(torch.rand(3), expected)                        # the RNG continues where it was saved
    assert fresh.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_resuming_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint to resume"):
        harness.load_checkpoint(str(tmp_path / "nothing"))


def test_a_final_save_keeps_the_checkpoint_inside_the_model_folder(tmp_path, model, tokenizer):
    out = str(tmp_path / "sft")
    harness.save_checkpoint(out, {"model": model}, tokenizer, 3, sft.SFTArgs(output_dir=out))
    harness.atomic_save(out, model, tokenizer, keep=(harness.CHECKPOINT,))
    assert os.path.exists(os.path.join(out, "config.json"))
    assert os.path.exists(os.path.join(out, "checkpoint", "trainer_state.pt"))


def test_responses_are_cut_after_the_first_eos(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = torch.tensor([[5, 6, eos, 7, eos], [5, 6, 7, 8, 9]])
    cut, mask = data.cut_after_eos(ids, eos, pad)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert cut[0].tolist() == [5, 6, eos, pad, pad]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_is_a_request_to_stop_and_a_later_second_one_quits_at_once(signum):
    saves = []
    with pytest.raises(SystemExit) as quit_now:
        with harness.GracefulStop(harness.make_accelerator(), "t", ckpt_dir="ckpt", grace=0.3) as stop:
            assert "no checkpoint" in stop.kept()
            assert [stop.stop_after(d, 10, 3, saves.append) for d in (1, 2, 3, 4)] == [False] * 4
            assert saves == [3] and "step 3 in ckpt" in stop.kept()          # the periodic save only
            os.kill(os.getpid(), signum)                           # no exception: the step goes on
            assert stop.stop_after(5, 10, 3, saves.append) and saves == [3, 5]    # stop, with a checkpoint here
            assert stop.stop_after(6, 10, 3, saves.append) and saves == [3, 5, 6]  # periodic: not saved twice
            assert not stop.stop_after(10, 10, 3, saves.append)    # the last step: the run ends normally
            os.kill(os.getpid(), signum)                           # a repeat within the grace (a launcher's forward)
            assert stop.stop_after(7, 10, 3, saves.append) and saves == [3, 5, 6, 7]    # still a request, no quit
            time.sleep(0.4)
            os.kill(os.getpid(), signum)
            time.sleep(1)                                          # the handler runs at the next bytecode
            raise AssertionError("a late second signal must quit at once")
    assert quit_now.value.code == 130                               # quit without saving
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL      # handlers released on the way out
    with pytest.raises(KeyboardInterrupt):                          # released: Ctrl-C raises again
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)


def test_end_of_step_exits_with_the_signal_s_code_after_saving():
    saves = []
    with pytest.raises(SystemExit) as stopped:
        with harness.GracefulStop(harness.make_accelerator(), "t", "iteration", "ckpt") as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            stop.end_of_step(4, 10, 100, saves.append)
    assert stopped.value.code == 128 + signal.SIGTERM and saves == [4]


def test_a_launched_cpu_process_gets_its_share_of_the_cores_not_the_launchers_one_thread(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    launched = {"ACCELERATE_DYNAMO_BACKEND": "NO", "OMP_NUM_THREADS": "1"}     # what `accelerate launch` sets
    assert harness.cpu_threads(1, launched) == 8 and harness.cpu_threads(2, launched) == 4
    assert harness.cpu_threads(16, launched) == 1
    assert harness.cpu_threads(1, {**launched, "OMP_NUM_THREADS": "3"}) is None     # asked for: kept
    assert harness.cpu_threads(1, {"OMP_NUM_THREADS": "1"}) is None                 # plain python: the user's
    assert harness.cpu_threads(2, {**launched, "MA_RLHF_CPU_THREADS": "3"}) == 3


@pytest.mark.parametrize("n_rows", [1, 5, 13])
def test_every_rank_gets_a_full_batch_even_with_fewer_rows_than_batch_times_processes(n_rows):
    for step in range(3):
        batches = [data.batch_indices(n_rows, 4, step, seed=1, rank=r, world=4) for r in range(4)]
        assert all(len(b) == 4 and all(0 <= i < n_rows for i in b) for b in batches), batches
    with pytest.raises(ValueError, match="no rows"):
        data.batch_indices(0, 4, 0, seed=1)


def test_parameter_checksums_tell_apart_one_changed_or_moved_weight(model):
    import copy
    same, changed, moved = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[0].mlp.up_proj.weight[3, 5] += 1e-3
        w = moved.model.layers[0].mlp.up_proj.weight.view(-1)
        w[0], w[1] = w[1].clone(), w[0].clone()                    # the same values, two of them swapped
    base = harness.parameter_checksums(model)
    assert base.shape == (len(list(model.parameters())), 3)
    assert torch.equal(base, harness.parameter_checksums(same))
    assert not torch.equal(base, harness.parameter_checksums(changed))
    assert not torch.equal(base, harness.parameter_checksums(moved))


@pytest.mark.parametrize("n_rows,batch_size,world", [(10, 4, 1), (10, 4, 2), (5, 2, 3), (64, 32, 3), (1, 8, 2), (12, 3, 2)])
def test_held_out_batches_are_as_many_on_every_rank_and_count_each_row_once(n_rows, batch_size, world):
    per_rank = [harness.eval_batches(n_rows, batch_size, rank, world) for rank in range(world)]
    assert len({len(b) for b in per_rank}) == 1                 # a sharded forward needs every rank
    counted = [row for batches in per_rank for start, weight in batches if weight
               for row in range(start, min(start + batch_size, n_rows))]
    assert sorted(counted) == list(range(n_rows))
    assert all(start < n_rows for batches in per_rank for start, _ in batches)      # no empty batch


FRAGMENTED_HEAP = """
import sys
sys.path.insert(0, {root!r})
import torch, harness
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
harness.GLIBC.mallopt(-3, 16 * 2 ** 20)      # M_MMAP_THRESHOLD: blocks under 16 MB come from the heap (where
start = rss_mb()                             # glibc's own threshold goes after the first large free)
kept, freed = [], []
for _ in range(100):                         # a forward's pattern: temporaries between the tensors kept
    freed.append(torch.ones(2 ** 20))        # 4 MB, touched
    kept.append(torch.ones(2 ** 14))         # 64 kB
del freed
before = rss_mb()
harness.release_freed_memory("meta", at_least=0)   # not a CPU tensor's memory: nothing to do
harness.release_freed_memory("cpu")                 # 400 MB freed, below the default GiB: kept
untouched = rss_mb()
harness.release_freed_memory("cpu", at_least=300 * 2 ** 20)
print(start, before, untouched, rss_mb())
"""


@pytest.mark.skipif(harness.GLIBC is None, reason="the C library is not glibc 2.33+ (no malloc_trim / mallinfo2)")
def test_freed_cpu_tensor_memory_goes_back_to_the_os():
    """The holes a forward's temporaries leave in glibc's heap stay resident until trimmed (a fresh
    process: the heap of this one is the test suite's; no allocator settings or other allocator)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
    proc = subprocess.run([sys.executable, "-c", FRAGMENTED_HEAP.format(root=root)], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start, before, untouched, after = map(float, proc.stdout.split())
    assert before > start + 350, (start, before)           # the freed blocks are still resident
    assert untouched > before - 50, (before, untouched)     # another device, or less freed than asked: no trim
    assert after < before - 300, (before, after)            # of the 400 MB freed, most is handed back


def test_an_accumulation_group_shorter_than_grad_accum_steps_once_on_the_mean_of_its_gradients():
    """--grad_accum 3 and an iteration of 5 minibatches: groups of 3 and 2, each ending in one step; the loss
    scaled by grad_accum / group, the remainder's step is on the mean of its two gradients (SGD at lr 1: the
    weights move by minus that mean), and nothing is left accumulated for the next iteration."""
    torch.manual_seed(0)
    acc = harness.make_accelerator(grad_accum=3)
    model = torch.nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = acc.prepare(model, opt)
    xs = torch.randn(5, 4, 3)

    def grad(w, x):
        w = w.clone().requires_grad_()
        return torch.autograd.grad((x @ w.T).pow(2).mean(), w)[0]

    w, weights = model.weight.detach().clone(), []
    for j, x in enumerate(xs):
        group = min(3, 5 - j // 3 * 3)
        if j % 3 == 0:
            harness.start_accumulation((acc, acc), group)
        with acc.accumulate(model):
            acc.backward(model(x).pow(2).mean() * 3 / group)
            opt.step()
            opt.zero_grad()
        weights.append(model.weight.detach().clone())
    expected = w - sum(grad(w, x) for x in xs[:3]) / 3
    assert torch.allclose(weights[1], w) and torch.allclose(weights[2], expected, atol=1e-6)     # one step after 3
    expected = expected - (grad(expected, xs[3]) + grad(expected, xs[4])) / 2
    assert torch.allclose(weights[3], weights[2]) and torch.allclose(weights[4], expected, atol=1e-6)   # and after 2


def test_what_is_alive_before_a_loop_is_left_out_of_the_cycle_collectors_walks():
    """Entering a loop's GracefulStop (harness.out_of_the_collectors_way): the objects alive before it (here a list
    made for the test) are no longer among those the collector's generations hold, and are still alive; objects made
    after it are."""
    import gc
    before = [object()]
    try:
        with harness.GracefulStop(harness.make_accelerator(), "test"):
            after = [object()]
        tracked = {id(o) for o in gc.get_objects()}
        assert gc.get_freeze_count() > 0 and id(before) not in tracked and id(after) in tracked
        assert isinstance(before[0], object)
    finally:
        gc.unfreeze()
