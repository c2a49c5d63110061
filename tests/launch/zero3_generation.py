"""Run last by tests/launch/zero_stages.py under its 2-process DeepSpeed launch, with ZeRO-3 and without zero.Init
(or alone under a `--zero_stage 3 --zero3_init_flag false` launch through tests/launch/deepspeed_cpu.py): generation
from the partitioned policy, gathered once (harness.generation_model) or sharded (synced_gpus), against an
unsharded copy of the same weights, same seed. Prints one JSON line from rank 0. It wraps the process's
all-gathers with a counter, so it runs last in a process.

    python tests/launch/zero3_generation.py SFT_DIR
"""
import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import data
import harness

PROMPTS = ["\n\nHuman: how are you\n\nAssistant:", "hi", "\n\nHuman: tell me about the fox\n\nAssistant:", "ok"]


def count_all_gathers():
    """Wrap the all-gathers of torch.distributed and deepspeed.comm with one counter (nested calls count
    more than once, the same way in every mode)."""
    import deepspeed.comm
    counter = {"n": 0}
    for module in (dist, deepspeed.comm):          # ZeRO-3 calls deepspeed.comm (on CPU: a shared-memory op)
        for name in ("all_gather_into_tensor", "allgather_fn", "all_gather", "_all_gather_base", "all_gather_base"):
            if hasattr(module, name):
                original = getattr(module, name)

                def counted(*args, _original=original, **kwargs):
                    counter["n"] += 1
                    return _original(*args, **kwargs)
                setattr(module, name, counted)
    return counter


def generate(acc, policy, tokenizer, gather, new_tokens, counter):
    before = counter["n"]
    with harness.generation_model(acc, policy, gather) as (model, synced):
        torch.manual_seed(7)
        ids = data.sample(model.eval(), tokenizer, PROMPTS[acc.process_index::acc.num_processes] * 2, 16, new_tokens,
                          temperature=1.0, synced_gpus=synced)[2]
    return ids.tolist(), synced, counter["n"] - before


def main(sft_dir):
    acc = harness.make_accelerator()
    tokenizer = data.load_tokenizer(sft_dir)
    policy = AutoModelForCausalLM.from_pretrained(sft_dir)
    config = acc.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = 2                     # no dataloader
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0   # the tiny model's weights would
    # all stay whole otherwise (small parameters are kept, not partitioned)
    policy, _ = acc.prepare(policy, torch.optim.AdamW(policy.parameters(), lr=1e-4))
    with harness.loading_whole():
        plain = AutoModelForCausalLM.from_pretrained(sft_dir).eval()
    torch.manual_seed(7)
    reference = data.sample(plain, tokenizer, PROMPTS[acc.process_index::acc.num_processes] * 2, 16, 12,
                            temperature=1.0)[2].tolist()
    counter = count_all_gathers()
    gathered, synced_g, gathers_12 = generate(acc, policy, tokenizer, True, 12, counter)
    _, _, gathers_4 = generate(acc, policy, tokenizer, True, 4, counter)
    sharded, synced_s, sharded_12 = generate(acc, policy, tokenizer, False, 12, counter)
    _, _, sharded_4 = generate(acc, policy, tokenizer, False, 4, counter)
    result = {"rank": acc.process_index, "gathered_equals_unsharded": gathered == reference,
              "sharded_equals_unsharded": sharded == reference, "synced_gpus": [synced_g, synced_s],
              "all_gathers": {"gathered_12": gathers_12, "gathered_4": gathers_4, "sharded_12": sharded_12,
                              "sharded_4": sharded_4}}
    every = [None] * acc.num_processes
    dist.all_gather_object(every, result)
    if acc.is_main_process:
        print("RESULT " + json.dumps(every))


if __name__ == "__main__":
    main(sys.argv[1])
