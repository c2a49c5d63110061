"""Models from other families, as a new user brings them: a Llama whose tokenizer has no pad token goes
through sft.py -> reward_model.py -> ppo.py without manual edits; the slow SmolLM2 GGUF end to end."""
import pathlib
from stages import ppo_config

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def test_a_missing_gguf_file_is_a_clear_error(tmp_path):
    import sft
    with pytest.raises(SystemExit, match="no GGUF file"):
        sft.load_pretrained(str(tmp_path / "nothing.gguf"))


TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_template_renders_hh_dialogues_as_messages(tokenizer):
    import copy
    import data
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    hh = "\n\nHuman: hi there\n\nAssistant: hello!\n\nHuman: how are you?\n\nAssistant:"
    assert data.chat_prompt(tok, hh) == "<|user|>hi there\n<|assistant|>hello!\n<|user|>how are you?\n<|assistant|>"
    assert data.chat_prompt(tok, "SUBREDDIT: r/x\nPOST: y\nTL;DR:") == "<|user|>SUBREDDIT: r/x\nPOST: y\nTL;DR:\n<|assistant|>"
    rows = data.with_chat_template([{"prompt": hh, "chosen": " ok"}], tok)
    assert rows[0]["chosen"] == " ok" and rows[0]["prompt"].endswith("<|assistant|>")
    with pytest.raises(SystemExit, match="no chat template"):
        data.with_chat_template(rows, tokenizer)                 # the tiny tokenizer has none


    # (reward_model.py and sft.py render their rows with the same data.with_chat_template call)


def test_lora_reference_is_the_sft_model_with_adapters_off(tiny_models):
    import data
    import harness
    import ppo
    from transformers import AutoModelForCausalLM
    sft_model = AutoModelForCausalLM.from_pretrained(tiny_models / "sft").eval()
    policy = harness.with_lora(AutoModelForCausalLM.from_pretrained(tiny_models / "sft"), 4, 8, "q_proj,v_proj", "CAUSAL_LM")
    torch.manual_seed(0)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.data.normal_()                                          # trained adapters: not a no-op
    tokenizer = data.load_tokenizer(tiny_models / "sft")
    ids, mask, _ = data.encode_prompts(tokenizer, ["\n\nHuman: hi there, how are you\n\nAssistant: fine"] * 2, 24)
    with torch.no_grad():
        expected = ppo.response_logprobs(sft_model, ids, mask, 10, 0.8)[0]
        ref = ppo.reference_logprobs(None, harness.make_accelerator(), policy.eval(), ids, mask, 10, 0.8)[0]
        adapted = ppo.response_logprobs(policy, ids, mask, 10, 0.8)[0]
    assert torch.equal(ref, expected)
    assert not torch.allclose(adapted, expected)


def test_lora_critic_reads_the_reward_models_own_weights(tiny_models, tmp_path):
    """Under LoRA the critic initialised from the RM is the RM's weights plus adapters: no copy of the base
    (two copies of the base weights in all, the policy's and the RM's), and training the critic leaves
    the frozen RM's weights and scores as they were."""
    import data
    import ppo
    import reward_model as rm
    args, *extensions = ppo_config(sft_path=str(tiny_models / "sft"), rm_path=str(tiny_models / "rm"),
                                   output_dir=str(tmp_path / "ppo"), lora_r=4)
    _, _, models, _, code = ppo.resolve(args, *extensions)
    _, policy, critic, ref, reward_model = ppo.harness.load_ppo_models(models, args.sft_path, args.rm_path,
                                                                       models.critic_path, rm, code_task=code)
    frozen = {p.data_ptr() for p in critic.parameters() if not p.requires_grad}
    assert ref is None and frozen == {p.data_ptr() for p in reward_model.parameters()}
    assert not frozen & {p.data_ptr() for p in policy.parameters()}
    tokenizer = data.load_tokenizer(tiny_models / "sft")
    ids, mask, _ = data.encode_prompts(tokenizer, ["\n\nHuman: hi there, how are you\n\nAssistant: fine"] * 2, 24)
    before = {k: v.clone() for k, v in reward_model.state_dict().items()}
    with torch.no_grad():
        score = rm.last_token(rm.token_values(reward_model, ids, mask), mask)
        values = critic(ids, mask)
    assert torch.equal(rm.last_token(values, mask), score)          # adapters start as a no-op
    opt = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        critic.train()
        (critic(ids, mask) - 5).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        assert not torch.allclose(critic(ids, mask), values)
        assert torch.equal(rm.last_token(rm.token_values(reward_model, ids, mask), mask), score)
    assert all(torch.equal(v, before[k]) for k, v in reward_model.state_dict().items())
