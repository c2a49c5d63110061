"""reward_model.py: the score sits at the last real token whatever the padding; BT loss learns."""
import pytest
import torch
import torch.nn.functional as F

import data
import reward_model as rm

PROMPTS = ["\n\nHuman: how are you\n\nAssistant:", "hi", "\n\nHuman: tell me about the quick brown fox please\n\nAssistant:"]
RESPONSES = [" fine", " hello there, friend, how was your day", " it jumped over the lazy dog"]


def tiny_rm(tokenizer, seed=0):
    from transformers import GemmaConfig, GemmaForSequenceClassification
    torch.manual_seed(seed)
    config = GemmaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return GemmaForSequenceClassification(config).eval()


def unpadded_score(model, tokenizer, prompt, response):
    b = data.collate(tokenizer, [prompt], [response], 48, 32)
    ids = b["input_ids"][b["attention_mask"].bool()].unsqueeze(0)
    with torch.no_grad():
        return rm.token_values(model, ids, torch.ones_like(ids))[0, -1]


def test_last_token_under_left_right_and_both_paddings():
    values = torch.arange(12.0).view(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert rm.last_token(values, mask).tolist() == [4.0, 11.0]
    assert rm.last_token(values, torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0]])).tolist() == [5.0, 7.0]


def test_score_is_invariant_to_padding_and_batch_composition(tokenizer):
    model = tiny_rm(tokenizer)
    together = rm.score(model, tokenizer, PROMPTS, RESPONSES)
    alone = torch.stack([unpadded_score(model, tokenizer, p, r) for p, r in zip(PROMPTS, RESPONSES)])
    assert torch.allclose(together, alone, atol=1e-5)
    reordered = rm.score(model, tokenizer, PROMPTS[::-1], RESPONSES[::-1])
    assert torch.allclose(reordered, together.flip(0), atol=1e-5)
    # right padding only (the same real tokens packed to the left): the same scores
    b = data.collate(tokenizer, PROMPTS, RESPONSES, 48, 32)
    rows = [ids[m.bool()] for ids, m in zip(b["input_ids"], b["attention_mask"])]
    width = max(len(r) for r in rows)
    ids = torch.stack([F.pad(r, (0, width - len(r)), value=tokenizer.pad_token_id) for r in rows])
    mask = (torch.arange(width) < torch.tensor([len(r) for r in rows]).unsqueeze(1)).long()
    with torch.no_grad():
        right = rm.last_token(rm.token_values(model, ids, mask), mask)
    assert torch.allclose(right, alone, atol=1e-5)


def test_bradley_terry_is_minus_log_sigmoid_of_the_score_gap(tokenizer):
    model = tiny_rm(tokenizer)
    chosen, rejected = RESPONSES, RESPONSES[1:] + RESPONSES[:1]
    batch = data.collate(tokenizer, PROMPTS * 2, chosen + rejected, 48, 32)
    with torch.no_grad():
        loss, acc = rm.bradley_terry(model, batch)
    gap = rm.score(model, tokenizer, PROMPTS, chosen) - rm.score(model, tokenizer, PROMPTS, rejected)
    assert torch.allclose(loss, -F.logsigmoid(gap).mean(), atol=1e-5)
    assert acc.item() == pytest.approx((gap > 0).float().mean().item())


def test_reward_model_learns_a_separable_preference(tokenizer):
    """Chosen replies say something kind, rejected ones something unkind; held-out prompts."""
    kind = [" that is great", " I love it", " wonderful, thanks", " happy to help"]
    unkind = [" that is awful", " I hate it", " terrible, go away", " sad and angry"]
    prompts = [f"\n\nHuman: question number {i}\n\nAssistant:" for i in range(24)]
    model = tiny_rm(tokenizer, seed=1).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    train, held = prompts[:16], prompts[16:]

    def batch(ps, offset):
        c = [kind[(i + offset) % 4] for i in range(len(ps))]
        r = [unkind[(i + 2 * offset) % 4] for i in range(len(ps))]
        return data.collate(tokenizer, ps * 2, c + r, 48, 32)

    with torch.no_grad():
        first_loss, _ = rm.bradley_terry(model, batch(held, 0))
    for step in range(40):
        loss, _ = rm.bradley_terry(model, batch(train, step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        held_loss, held_acc = rm.bradley_terry(model.eval(), batch(held, 1))
    assert held_acc.item() == 1.0 and held_loss < first_loss


def test_two_micro_steps_of_16_pairs_are_one_step_of_32_at_half_the_activations(tokenizer):
    """--batch_size 16 --grad_accum 2 (docs/training.md): the same rows as 32 x 1 in the first epoch (consecutive slices
    of one permutation) and, the loss of each half divided by the accumulation, the same gradient up to float rounding."""
    import harness
    for step in (0, 1, 7, 199):
        whole = data.batch_indices(21810, 32, step, 1234, 0, 1)
        halves = [i for micro in range(2) for i in data.batch_indices(21810, 16, 2 * step + micro, 1234, 0, 1)]
        assert halves == whole
    prompts = [f"\n\nHuman: question number {i}\n\nAssistant:" for i in range(8)]
    chosen, rejected = [f" kind reply {i}" for i in range(8)], [f" rude reply {i} !" for i in range(8)]
    model = tiny_rm(tokenizer, seed=2)

    def grads(rows):
        model.zero_grad()
        for part in rows:
            loss, _ = rm.bradley_terry(model, data.collate(tokenizer, [prompts[i] for i in part] * 2,
                                                           [chosen[i] for i in part] + [rejected[i] for i in part], 48, 32))
            (loss / len(rows)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    one, two = grads([range(8)]), grads([range(4), range(4, 8)])
    assert one.abs().max() > 0 and torch.allclose(one, two, atol=1e-6, rtol=1e-4)
    assert not torch.allclose(one, grads([range(4)]), atol=1e-6, rtol=1e-4)     # half the rows is another gradient


def test_gold_agreement_samples_a_chunk_of_prompts_per_generate_call(tokenizer, monkeypatch):
    """The RM stage's RM-gold agreement samples its SFT replies GOLD_SAMPLE_CHUNK prompts per generate call (all
    512 at once took the stage's peak ~300 MB higher), every prompt twice and in order, and scores each pair."""
    import argparse
    import sft
    torch.manual_seed(0)
    policy = sft.tiny_gemma(tokenizer, hidden_size=32, num_layers=2).eval()
    rows = [{"prompt": f"\n\nHuman: tell me about day {i}\n\nAssistant:"} for i in range(5)]
    calls, real_sample = [], data.sample
    monkeypatch.setattr(rm, "GOLD_SAMPLE_CHUNK", 4)
    monkeypatch.setattr(data, "sample", lambda model, tok, prompts, *a, **k: calls.append(list(prompts))
                        or real_sample(model, tok, prompts, *a, **k))
    args = argparse.Namespace(task="chitchat", max_prompt_len=48, max_response_len=8)
    agreement, n = rm.gold_agreement(tiny_rm(tokenizer), policy, tokenizer, rows, args)
    assert [len(c) for c in calls] == [4, 4, 2]
    assert sum(calls, []) == [r["prompt"] for r in rows for _ in range(2)]
    assert 0 <= n <= len(rows) and (n == 0 or 0.0 <= agreement <= 1.0)
