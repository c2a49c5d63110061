"""eval/kl: the held-out KL that ppo.py's evaluation logs beside the training batches' kl (evaluate.held_out_kl)."""
import pytest
import torch

import data


def run_evaluation(tiny_models, policy, sft_model):
    """ppo.py's held-out evaluation (evaluate.during_training) of `policy` against `sft_model` (None: LoRA's
    adapters off) on 12 chitchat prompts; returns (its metrics, the Sampling, the rows, the tokenizer)."""
    import evaluate
    import harness
    import reward_model as rm
    tokenizer = data.load_tokenizer(str(tiny_models / "sft"))
    rows = data.first_row_per_prompt(data.load_task("chitchat", only=("test",))["test"])[:12]
    sampling = evaluate.Sampling("chitchat", 16, 10, seed=7)
    metrics = {"step": 10, "kl": 1.0, "reward/rm": 0.0}
    evaluate.during_training(metrics, sampling, accelerator=harness.make_accelerator(), policy=policy,
                             reward_model=rm.load_reward_model(str(tiny_models / "rm"))[0], tokenizer=tokenizer,
                             eval_rows=rows, sft=(sft_model, {}), sft_path=str(tiny_models / "sft"))
    return metrics, sampling, rows, tokenizer


def load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).eval()


def test_eval_kl_is_the_mean_sequence_kl_of_the_replies_it_judged(tiny_models, parrot):
    """The parrot's eval/kl equals a one-reply-at-a-time loop over the same sampled replies (each reply's own
    unpadded forward under both models, log-probabilities at the sampling temperature, summed over the reply's
    tokens, its EOS included)."""
    policy, sft_model = load(parrot), load(tiny_models / "sft")
    metrics, sp, rows, tokenizer = run_evaluation(tiny_models, policy, sft_model)
    torch.manual_seed(sp.seed)           # the evaluation's replies: its seed, one chunk of prompts
    p_ids, p_mask, r_ids, r_mask, _ = data.sample(policy, tokenizer, [r["prompt"] for r in rows], sp.max_prompt_len,
                                                  sp.max_response_len, sp.temperature)
    kls = []
    for b in range(len(rows)):
        prompt, reply = p_ids[b][p_mask[b].bool()], r_ids[b][r_mask[b].bool()]
        ids = torch.cat([prompt, reply])[None]
        kl = 0.0
        for model, sign in ((policy, 1), (sft_model, -1)):
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / sp.temperature
            kl += sign * logits.log_softmax(-1).gather(-1, reply[:, None]).sum().item()
        kls.append(kl)
    assert metrics["eval/kl"] > 1.0          # the parrot is far from the SFT model
    assert metrics["eval/kl"] == pytest.approx(round(sum(kls) / len(kls), 4), abs=2e-4)


def test_eval_kl_of_the_sft_model_is_zero_and_the_run_rng_untouched(tiny_models):
    """The SFT model against itself: eval/kl exactly 0; and the evaluation draws none of the run's random numbers
    (the training's numbers cannot move)."""
    state = torch.get_rng_state()
    metrics, *_ = run_evaluation(tiny_models, load(tiny_models / "sft"), load(tiny_models / "sft"))
    assert metrics["eval/kl"] == 0.0
    assert torch.equal(torch.get_rng_state(), state)


def test_eval_kl_under_lora_reads_the_policy_with_its_adapters_off(tiny_models, parrot):
    """LoRA (no separate SFT model): a fresh adapter (B = 0) is the SFT model, eval/kl 0; with its weights moved the
    KL is positive and equals that against the base model loaded on its own."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    policy = get_peft_model(load(tiny_models / "sft"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert run_evaluation(tiny_models, policy.eval(), None)[0]["eval/kl"] == 0.0
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(10 * torch.randn_like(p))
    moved = run_evaluation(tiny_models, policy.eval(), None)[0]["eval/kl"]
    assert moved > 0 and moved == run_evaluation(tiny_models, policy.eval(), load(tiny_models / "sft"))[0]["eval/kl"]


def test_an_evaluation_samples_the_policy_once(tiny_models, parrot, monkeypatch):
    """eval/kl reads the replies the evaluation judged (their ids kept), not a second sampling of them: one
    data.sample call of the policy per evaluation (the SFT model's replies aside, measured once a run)."""
    policy = load(parrot)
    sampled, sample = [], data.sample
    monkeypatch.setattr(data, "sample", lambda model, *a, **k: sampled.append(model) or sample(model, *a, **k))
    metrics, *_ = run_evaluation(tiny_models, policy, load(tiny_models / "sft"))
    assert sum(m is policy for m in sampled) == 1 and metrics["eval/kl"] > 1.0


def test_eval_kl_in_slices_is_the_kl_of_all_rows_at_once(tiny_models, parrot):
    """held_out_kl's forwards in slices of `chunk` rows (the last one short) give each reply the very KL that one
    forward of all the rows gives."""
    import evaluate
    tokenizer = data.load_tokenizer(str(tiny_models / "sft"))
    rows = data.first_row_per_prompt(data.load_task("chitchat", only=("test",))["test"])[:12]
    batches, policy = [], load(parrot)
    evaluate.sample_responses(policy, tokenizer, [r["prompt"] for r in rows], 7, 16, 10, 1.0, batches=batches)
    whole = evaluate.held_out_kl(policy, load(tiny_models / "sft"), batches, 1.0, chunk=12)
    sliced = evaluate.held_out_kl(policy, load(tiny_models / "sft"), batches, 1.0, chunk=5)
    assert whole.shape == (12,) and whole.abs().sum() > 1.0
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-6)      # bit for bit here; a BLAS may round apart
