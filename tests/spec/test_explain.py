"""evaluate.py explain: the picture of one reply's macro actions. What it draws is read back from the figure's
artists and checked against macro_actions.py's functions on the same tensors; the command runs on tiny models."""
import json
import os
import warnings

import pytest
import torch

import evaluate
import macro_actions as ma

TEXT = ("The quick brown fox (a clever one) jumped over the lazy dog.\nThen it ran away, fast! "
        "Héllo wörld, naïve café")


def fixed_rollout(tokenizer, pad=3):
    """One reply of the tokenizer's own text, EOS at its end and `pad` padding columns, with seeded logprobs,
    entropies, KL, values and score: `explain_rollout`'s layout, without the models."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    T = len(ids)
    g = torch.Generator().manual_seed(7)
    mask = torch.tensor([[1.0] * T + [0.0] * pad])
    noise = (lambda scale: torch.randn(1, T + pad, generator=g) * scale * mask)
    return {"prompt": "\n\nHuman: tell me about the fox\n\nAssistant:",
            "response_ids": torch.tensor([ids + [tokenizer.pad_token_id] * pad]), "mask": mask,
            "logprobs": -noise(1.0).abs() - 0.1 * mask, "entropy": noise(2.0).abs(), "kl": noise(0.3),
            "values": noise(0.5), "score": torch.tensor([0.8]), "segments": None}


def drawn(fig, row):
    """{t: the number drawn in `row`'s cell of token t}, from the figure's Text artists."""
    return {int(a.get_gid().split(":")[1]): float(a.get_text()) for a in fig.axes[0].texts
            if (a.get_gid() or "").startswith(row + ":")}


def drawn_starts(fig, name):
    return sorted(int(a.get_gid().split(":")[2]) for a in fig.axes[0].lines
                  if (a.get_gid() or "").startswith(f"start:{name}:"))


@pytest.mark.parametrize("sigma", ["equal", "position"])
def test_the_picture_draws_the_librarys_starts_sigma_rewards_values_and_advantages(tokenizer, sigma):
    rollout = fixed_rollout(tokenizer)
    settings = {**evaluate.ppo_settings("no-such-run/policy"), "sigma": sigma}
    numbers = evaluate.explain_numbers(rollout, settings, tokenizer)
    fig = evaluate.draw_macro_actions(numbers, width=40)                # narrow: the reply wraps over lines
    mask, values, score, beta = rollout["mask"], rollout["values"], rollout["score"], settings["beta"]
    T = int(mask.sum())
    # every termination's starts, as macro_actions.py gives them on the same tensors
    for name in ("fixed", "randomized", "parsing", "ppl", "entropy"):
        starts, _ = ma.termination_starts(
            name, mask, n=5, logprobs=rollout["logprobs"], entropy=rollout["entropy"],
            threshold=settings["entropy_threshold"], response_ids=rollout["response_ids"], tokenizer=tokenizer,
            cutoff=settings["cutoff"], generator=torch.Generator().manual_seed(settings["seed"]))
        assert drawn_starts(fig, name) == starts[0].nonzero().flatten().tolist(), name
    assert drawn_starts(fig, "fixed") == list(range(0, T, 5)) and not drawn_starts(fig, "segment")
    fixed = ma.fixed_ngram_starts(mask, 5)
    kl_rewards = -beta * rollout["kl"] * mask
    rewards = ma.macro_rewards(kl_rewards, score, mask, fixed)
    expected = {
        "sigma": ma.sigma_weights(fixed, mask, sigma),
        "kl_reward": kl_rewards, "value": values,
        "adv1": ma.macro_advantages(values, rewards, mask, ma.fixed_ngram_starts(mask, 1), sigma=sigma)[0],
        "adv5": ma.macro_advantages(values, rewards, mask, fixed, sigma=sigma)[0]}
    for row, tensor in expected.items():
        cells = drawn(fig, row)
        assert sorted(cells) == list(range(T)), row                      # one number per real token, none on pad
        assert all(abs(cells[t] - tensor[0, t].item()) <= 5e-4 for t in range(T)), row     # 3 decimals drawn
    assert drawn(fig, "score") == {T - 1: pytest.approx(0.8)}
    adv1, adv5 = drawn(fig, "adv1"), drawn(fig, "adv5")
    assert len({adv5[t] for t in range(5)}) == 1 and len({adv1[t] for t in range(5)}) > 1   # one per macro action
    tokens = [a for a in fig.axes[0].texts if (a.get_gid() or "").startswith("token:")]
    assert len(tokens) == T and len({a.get_position()[1] for a in tokens}) >= 3              # wrapped
    evaluate.pyplot().close(fig)


def test_token_labels_show_spaces_newlines_split_characters_and_characters_the_font_lacks(tmp_path):
    """Spaces and newlines get a visible mark; a character split over byte tokens shows their pieces (not U+FFFD);
    a CJK character or an emoji (not in the drawing's font) is its code point as Python writes it; drawing them
    (and a prompt with $ and braces, which matplotlib would read as math) raises and warns nothing."""
    from sft import train_tokenizer
    tok = train_tokenizer(["你好 世界 😀 hello\nworld"] * 50, vocab_size=300)
    ids = tok("你好 世界 😀 hello\nworld ж", add_special_tokens=False)["input_ids"]
    labels = evaluate.token_labels(tok, ids)
    assert labels[:6] == ["\\u4f60\\u597d", "␣\\u4e16\\u754c", "␣\\U0001f600", "␣hello", "↵", "world"]
    assert labels[6:] == [str(p).replace("Ġ", "␣") for p in tok.convert_ids_to_tokens(ids[6:])] != ["␣ж"]
    assert "\ufffd" not in "".join(labels) and len(labels[6:]) > 1      # " ж": bytes the tokenizer never merged
    numbers = {"prompt": "hi $x$ {", "tokens": labels, "n": 5, "sigma_kind": "equal", "beta": 0.05, "gamma": 1.0,
               "lam": 0.95, "entropy_threshold": 2.0, "parse_fell_back": False,
               "starts": {"fixed": list(range(0, len(ids), 5))}, "sigma": [0.2] * len(ids),
               "kl_rewards": [0.0] * len(ids), "score": 1.0, "values": [0.5] * len(ids),
               "advantages": {"1": [0.1] * len(ids), "5": [0.1] * len(ids)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate.pyplot().close(evaluate.draw_macro_actions(numbers, str(tmp_path / "p.png")))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_explain_command_draws_a_policys_reply_from_its_folders(tiny_models, parrot, tmp_path, capsys):
    """`evaluate.py explain` on saved folders: the parrot policy's reply to a held-out prompt, the KL of each
    token against the SFT model, the RM (no run checkpoint beside the policy) as the critic; the same seed draws
    the same numbers. The SFT model as the policy has a KL of exactly 0 on every token."""
    sft, rm_path = str(tiny_models / "sft"), str(tiny_models / "rm")
    common = ["--sft_path", sft, "--rm_path", rm_path, "--n_prompts", "4", "--max_response_len", "12"]
    evaluate.main(["explain", "--explain_policy", str(parrot), "--output_dir", str(tmp_path / "a"), *common])
    evaluate.main(["explain", "--explain_policy", str(parrot), "--output_dir", str(tmp_path / "b"), *common])
    a = json.load(open(tmp_path / "a" / "macro_actions.json"))
    assert a == json.load(open(tmp_path / "b" / "macro_actions.json"))
    assert os.path.getsize(tmp_path / "a" / "macro_actions.png") > 0
    assert a["critic"].startswith("the RM") and a["policy"] == str(parrot)
    assert f"warning: no checkpoint of {parrot}'s run: ppo.py's default settings" in capsys.readouterr().out
    assert len(a["tokens"]) == len(a["values"]) <= 12
    assert "clever" in a["reply"] and any(r != 0 for r in a["kl_rewards"])
    evaluate.main(["explain", "--explain_policy", sft, "--output_dir", str(tmp_path / "c"), "--prompt",
                   "\\n\\nHuman: how are you\\n\\nAssistant:", *common])
    c = json.load(open(tmp_path / "c" / "macro_actions.json"))
    assert c["prompt"] == "\n\nHuman: how are you\n\nAssistant:" and set(c["kl_rewards"]) == {0.0}
    with pytest.raises(SystemExit, match="--prompt_index 9: there are 4 held-out prompts"):
        evaluate.main(["explain", "--explain_policy", sft, "--prompt_index", "9", *common])


def test_ppos_final_report_draws_the_picture_beside_the_learning_curve_as_the_command_does(tiny_models, parrot,
                                                                                          tmp_path):
    """ppo.py's final report writes macro_actions.png (and its numbers) into the run folder beside
    learning_curve.png: the first held-out prompt's reply under the run's seed, the same numbers that
    `evaluate.py explain` draws from the same folders."""
    import shutil
    from transformers import AutoModelForCausalLM
    import data
    import reward_model as rm
    sft, rm_path = str(tiny_models / "sft"), str(tiny_models / "rm")
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "runs", "rm.jsonl")     # a run's metrics
    shutil.copy(fixture, tmp_path / "metrics.jsonl")
    tokenizer = data.load_tokenizer(sft)
    rows = data.first_row_per_prompt(data.load_task("chitchat", only=("test",))["test"])[:4]
    load = (lambda path: AutoModelForCausalLM.from_pretrained(path).eval())
    sampling = evaluate.Sampling("chitchat", 48, 12, 0.8, seed=1234)
    evaluate.final_report(load(parrot), load(sft), rm.load_reward_model(rm_path)[0].eval(), tokenizer, rows,
                          str(tmp_path / "metrics.jsonl"), sampling)
    assert (tmp_path / "learning_curve.png").exists() and (tmp_path / "macro_actions.png").exists()
    assert f"macro actions: {tmp_path / 'macro_actions.png'}" in open(tmp_path / "summary.md").read()
    report = json.load(open(tmp_path / "macro_actions.json"))
    evaluate.main(["explain", "--explain_policy", str(parrot), "--sft_path", sft, "--rm_path", rm_path, "--n_prompts",
                   "4", "--max_response_len", "12", "--output_dir", str(tmp_path / "explain")])
    command = json.load(open(tmp_path / "explain" / "macro_actions.json"))
    assert report.pop("policy") == str(tmp_path / "policy") and command.pop("policy") == str(parrot)
    assert report == command and report["prompt"] == rows[0]["prompt"]


def test_a_run_and_its_checkpoint_read_the_same_checkpoint():
    """The settings and critic of <run>/policy and of <run>/checkpoint/policy are both <run>/checkpoint's."""
    for policy in ("runs/x/ppo/policy", "runs/x/ppo/checkpoint/policy"):
        assert evaluate.checkpoint_of(policy, "critic") == os.path.abspath("runs/x/ppo/checkpoint/critic")
