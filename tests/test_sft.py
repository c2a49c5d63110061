"""sft.py: the loss sees response tokens only, batches resume exactly, checkpoints are atomic."""
import os

import pytest
import torch
import torch.nn.functional as F

import data
import sft

PROMPTS = ["\n\nHuman: how are you\n\nAssistant:", "\n\nHuman: The quick brown fox (a clever one) jumped over the lazy dog, then what?\n\nAssistant:", "hi"]
RESPONSES = [" fine, thanks", " it ran away, fast!", " hello there, friend, how was your day today"]


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=2).eval()


def reference_loss(model, tokenizer, prompts, responses, max_prompt_len, max_response_len):
    """One unpadded example at a time; cross-entropy summed over response targets only."""
    total, count = 0.0, 0
    for p, r in zip(prompts, responses):
        p_ids, p_mask, _ = data.encode_prompts(tokenizer, [p], max_prompt_len)
        r_ids, r_mask = data.encode_responses(tokenizer, [r], max_response_len)
        ids = torch.cat([p_ids[p_mask.bool()], r_ids[r_mask.bool()]]).unsqueeze(0)
        logits = model(input_ids=ids).logits[0]
        n_prompt = int(p_mask.sum())
        for t in range(n_prompt, ids.shape[1]):
            total += F.cross_entropy(logits[t - 1], ids[0, t], reduction="sum")
            count += 1
    return total / count


def test_sft_loss_is_response_only_and_padding_free(model, tokenizer):
    batch = data.collate(tokenizer, PROMPTS, RESPONSES, max_prompt_len=24, max_response_len=12)
    loss, n = sft.sft_loss(model, batch)
    expected = reference_loss(model, tokenizer, PROMPTS, RESPONSES, 24, 12)
    assert int(n) == int((batch["labels"] != -100).sum())
    assert torch.allclose(loss, expected, atol=1e-5)


def test_sft_loss_does_not_depend_on_the_prompt_tokens_being_predicted(model, tokenizer):
    """Changing which prompt tokens are 'predictable' must not matter: only response targets count."""
    batch = data.collate(tokenizer, PROMPTS, RESPONSES, 24, 12)
    labels_with_prompt = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    wrong = dict(batch, labels=labels_with_prompt)
    assert not torch.allclose(sft.sft_loss(model, batch)[0], sft.sft_loss(model, wrong)[0])


def test_batches_split_across_ranks_and_repeat_on_resume():
    n, bs = 103, 8
    a = sft.batch_indices(n, bs, step=5, seed=1, rank=0, world=2)
    b = sft.batch_indices(n, bs, step=5, seed=1, rank=1, world=2)
    assert len(a) == len(b) == bs and not set(a) & set(b)
    assert a == sft.batch_indices(n, bs, step=5, seed=1, rank=0, world=2)
    epoch = [i for s in range(n // bs) for i in sft.batch_indices(n, bs, s, seed=1)]
    assert len(set(epoch)) == len(epoch)                               # no repeats within an epoch


def test_atomic_save_keeps_the_last_good_checkpoint_when_saving_fails(tmp_path, model, tokenizer):
    path = tmp_path / "ckpt"
    sft.atomic_save(str(path), model, tokenizer, {"step": 1})
    before = sorted(os.listdir(path))

    class Broken:
        def save_pretrained(self, where, state_dict=None):
            open(os.path.join(where, "partial.bin"), "w").write("half")
            raise OSError("disk full")

    with pytest.raises(OSError):
        sft.atomic_save(str(path), Broken(), tokenizer, {"step": 2})
    assert sorted(os.listdir(path)) == before
    assert torch.load(path / "trainer_state.pt")["step"] == 1


def test_responses_are_cut_after_the_first_eos(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = torch.tensor([[5, 6, eos, 7, eos], [5, 6, 7, 8, 9]])
    cut, mask = sft.response_logits_mask(ids, eos, pad)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert cut[0].tolist() == [5, 6, eos, pad, pad]


def test_ctrl_c_is_a_request_to_stop_and_a_later_second_one_quits_at_once():
    import signal
    import time
    ctrl_c, saves = sft.CtrlC(sft.make_accelerator(), grace=0.3), []
    try:
        assert not ctrl_c.requested() and "no checkpoint" in ctrl_c.kept("ckpt")
        assert [ctrl_c.stop_after(d, 10, 3, saves.append) for d in (1, 2, 3, 4)] == [False] * 4
        assert saves == [3] and "step 3 in ckpt" in ctrl_c.kept("ckpt")     # the periodic save only
        os.kill(os.getpid(), signal.SIGINT)                    # no KeyboardInterrupt: the step goes on
        assert ctrl_c.requested()
        assert ctrl_c.stop_after(5, 10, 3, saves.append) and saves == [3, 5]    # stop, with a checkpoint here
        assert ctrl_c.stop_after(6, 10, 3, saves.append) and saves == [3, 5, 6]  # periodic: not saved twice
        assert not ctrl_c.stop_after(10, 10, 3, saves.append)  # the last step: the run ends normally
        os.kill(os.getpid(), signal.SIGINT)                    # a repeat within the grace (a launcher's forward)
        assert ctrl_c.requested()
        time.sleep(0.4)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)                                      # the handler runs at the next bytecode
    finally:
        ctrl_c.release()
    with pytest.raises(KeyboardInterrupt):                     # released: Ctrl-C raises again
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
