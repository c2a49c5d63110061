"""sft.py: the loss sees response tokens only."""

import pytest
import torch
import torch.nn.functional as F

import data
import sft

PROMPTS = ["\n\nHuman: how are you\n\nAssistant:", "\n\nHuman: The quick brown fox (a clever one) jumped over the lazy dog, then what?\n\nAssistant:", "hi"]
RESPONSES = [" fine, thanks", " it ran away, fast!", " hello there, friend, how was your day today"]


@pytest.fixture(scope="module")
def model(tiny_lm):
    return tiny_lm


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
