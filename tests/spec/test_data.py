"""data.py: one preference schema for every task, splits without leakage, careful tokenization."""
import json
import pathlib

import pytest
import torch

import data

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(scope="module")
def chitchat():
    return data.load_chitchat()


def groups(rows):
    return {r["group"] for r in rows}


# --- the embedded default ---------------------------------------------------------------------

def test_chitchat_splits_are_disjoint_by_conversation_and_sized_20_40_40(chitchat):
    names = ["sft", "rm", "ppo", "test"]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not groups(chitchat[a]) & groups(chitchat[b]), f"{a} and {b} share conversations"
    n = {k: len(groups(chitchat[k])) for k in names}
    train = n["sft"] + n["rm"] + n["ppo"]
    assert abs(n["sft"] / train - 0.2) < 0.03 and abs(n["rm"] / train - 0.4) < 0.03
    assert 0.03 < n["test"] / (train + n["test"]) < 0.07


def test_chitchat_is_deterministic_and_its_cache_gives_the_same_rows(chitchat, tmp_path, monkeypatch):
    monkeypatch.setenv("MA_RLHF_CACHE", str(tmp_path))
    data._chitchat_split.cache_clear()                             # the conversations read and split again,
    fresh = data.load_chitchat()                                   # an empty cache: labelled by the judge again
    assert len(list(tmp_path.glob("gold-*.json"))) == 2            # the rm and test splits' labels
    assert len(list(tmp_path.glob("chitchat-*.json"))) == 1        # the split, kept for the next process
    data._chitchat_split.cache_clear()                             # the next process: the split read from disk
    cached = data.load_chitchat()
    assert all(fresh[k] == chitchat[k] and cached[k] == chitchat[k] for k in chitchat)
    data._chitchat_split.cache_clear()                             # the next tests: this process's own again


def test_a_cached_value_is_built_once_and_a_corrupt_or_foreign_file_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MA_RLHF_CACHE", str(tmp_path))
    builds = []

    def build():
        builds.append(1)
        return {"rows": [1, 2, 3]}
    valid = (lambda value: isinstance(value["rows"], list))        # trips (TypeError) on JSON of another shape
    (tmp_path / "x-0.json").write_text('{"rows": [0]}')             # an older build's file, another hash
    assert data.cached_json("x-1.json", build, valid, replaces="x-*.json") == {"rows": [1, 2, 3]} and len(builds) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-1.json"]   # the older file gone, no temporary left
    assert data.cached_json("x-1.json", build, valid) == {"rows": [1, 2, 3]} and len(builds) == 1    # read back
    for bad in ('{"rows": [1, 2', '[1, 2, 3]'):                    # truncated; JSON of another shape
        (tmp_path / "x-1.json").write_text(bad)
        assert data.cached_json("x-1.json", build, valid) == {"rows": [1, 2, 3]}
    assert len(builds) == 3 and json.loads((tmp_path / "x-1.json").read_text()) == {"rows": [1, 2, 3]}
    monkeypatch.setenv("MA_RLHF_CACHE", str(tmp_path / "file" / "under"))
    (tmp_path / "file").write_text("not a folder")                # unwritable: built, handed back, not kept
    assert data.cached_json("x-1.json", build, valid) == {"rows": [1, 2, 3]} and len(builds) == 4


def test_the_gold_cache_is_read_and_a_corrupt_one_is_scored_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MA_RLHF_CACHE", str(tmp_path))
    texts = ["what a lovely day", "this is awful", "ok"]
    expected = data.gold_score(texts)
    assert data.cached_gold_score(texts) == expected
    path = next(tmp_path.glob("gold-*.json"))
    path.write_text(json.dumps([0.5, 0.5, 0.5]))
    assert data.cached_gold_score(texts) == [0.5, 0.5, 0.5]        # read from disk, not scored again
    assert data.cached_gold_score(texts[:2]) == expected[:2]       # other texts, another key
    path.write_text("[0.5, 0.")                                    # truncated
    assert data.cached_gold_score(texts) == expected


def test_a_text_said_twice_is_scored_once_and_gets_the_same_score_in_each_place(tmp_path, monkeypatch):
    monkeypatch.setenv("MA_RLHF_CACHE", str(tmp_path))
    scored = []
    judge = data.gold_score
    monkeypatch.setattr(data, "gold_score", lambda texts: scored.append(list(texts)) or judge(texts))
    texts = ["what a lovely day", "ok", "what a lovely day", "this is awful", "ok"]
    assert data.cached_gold_score(texts) == judge(texts)
    assert scored == [["what a lovely day", "ok", "this is awful"]]


def test_chitchat_rm_and_test_pairs_are_labelled_by_the_gold_judge(chitchat):
    for split in ("rm", "test"):
        rows = chitchat[split][:300]
        chosen = data.gold_score([r["chosen"] for r in rows])
        rejected = data.gold_score([r["rejected"] for r in rows])
        assert all(c - r >= data.CHITCHAT_MARGIN for c, r in zip(chosen, rejected))


def test_chitchat_prompts_use_the_hh_template_and_end_with_the_assistant(chitchat):
    for r in chitchat["ppo"][:200]:
        assert r["prompt"].startswith("\n\n") and r["prompt"].endswith("\n\nAssistant:")
        speakers = [line.split(":")[0] for line in r["prompt"].split("\n\n")[1:]]
        assert all(a != b for a, b in zip(speakers, speakers[1:]))       # turns alternate
        assert r["chosen"].startswith(" ") and 1 <= len(r["chosen"].split()) <= data.CHITCHAT_MAX_RESPONSE_WORDS


def test_hh_prompt_alternates_speakers_ending_with_the_human():
    assert data.hh_prompt(["hi", "hello there"]) == "\n\nAssistant: hi\n\nHuman: hello there\n\nAssistant:"
    assert data.hh_prompt(["a", "b", "c"]) == "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant:"


# --- the embedded long-horizon task -------------------------------------------------------------

@pytest.fixture(scope="module")
def count():
    return data.load_count()


def test_count_gold_reads_the_whole_response_by_hand():
    prompt = data.COUNT_PROMPT.format(3, 7)                                   # target 3, 4, 5, 6, 7
    texts = [" 3, 4, 5, 6, 7.", " 3, 4, 5, 6.", " 3, 4, 5, 6, 7, 8.", " 3, 4, 4, 5, 6, 7.", " 3 4 5 6 7 great",
             " 3, 5, 6, 7, 9.", " 3, 4, 9, 9, 7.", " 7, 6, 5, 4, 3.", " wonderful", ""]
    # errors, 0.2 each: 0; 1 (stops early); 1 (+8); 1 (4 twice); 1 (a word); 2 (4 skipped, +9);
    # 2 (5, 6 replaced by 9, 9); 8 (reversed: one number aligned, 4 inserted and 4 deleted); 5 (a word for
    # five numbers); 5 (nothing)
    expected = [1.0, 0.8, 0.8, 0.8, 0.8, 0.6, 0.6, 0.0, 0.0, 0.0]
    assert data.count_gold([prompt] * len(texts), texts) == pytest.approx(expected)
    assert data.gold("count", [prompt], [" 3, 4, 5, 6, 7."]) == [1.0]
    with pytest.raises(data.DataError, match="Count from a to b"):
        data.count_gold(["\n\nHuman: hello\n\nAssistant:"], [" 1, 2."])
    with pytest.raises(data.DataError, match="no gold judge"):
        data.gold("tldr", [prompt], [" 3."])


def test_the_careless_counter_slips_at_its_rates_and_never_at_scale_zero():
    import random
    rng = random.Random(0)
    assert all(data.count_response(a, a + 9, rng, scale=0.0) == " " + ", ".join(map(str, range(a, a + 10))) + "."
               for a in range(50))
    prompt = data.COUNT_PROMPT.format(10, 29)
    golds = data.count_gold([prompt] * 2000, [data.count_response(10, 29, rng) for _ in range(2000)])
    exact = sum(g == 1.0 for g in golds) / len(golds)
    assert all(g == 1.0 - 0.2 * round((1.0 - g) / 0.2) for g in golds)             # whole errors only
    # no slip in 20 numbers and no end slip: (1 - 2 * 0.03) ** 20 * (1 - 2 * 0.15) = 0.203 (+ skip-then-repeat luck)
    assert 0.16 < exact < 0.26


def test_count_splits_are_disjoint_by_prompt_and_rm_pairs_follow_the_gold_judge(count):
    names = ["sft", "rm", "ppo", "test"]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not groups(count[a]) & groups(count[b]), f"{a} and {b} share prompts"
    assert len(groups(count["sft"])) * data.COUNT_SFT_SAMPLES == len(count["sft"])
    for split in ("rm", "test"):
        rows = count[split]
        chosen = data.count_gold([r["prompt"] for r in rows], [r["chosen"] for r in rows])
        rejected = data.count_gold([r["prompt"] for r in rows], [r["rejected"] for r in rows])
        assert all(c > r for c, r in zip(chosen, rejected))
    assert data.load_count() == count and data.load_count(seed=7) != count           # seeded


def test_the_response_length_default_is_the_tasks():
    assert data.response_len("count", 0) == 64 and data.response_len("chitchat", 0) == 32
    assert data.response_len("count", 12) == 12


def test_gold_judge_prefers_positive_replies():
    good, bad = data.gold_score(["That is wonderful, I love it!", "That is awful, I hate it."])
    assert good > 0.5 and bad < -0.5


def test_distinct_n_and_the_repetition_rate_by_hand():
    replies = ["Oh favorite favorite favorite favorite!", "I like it, I like it.", "Yes", ""]
    assert data.words(replies[1]) == ["i", "like", "it", "i", "like", "it"]
    # words: oh favorite x4 | i like it i like it | yes: 12, distinct oh favorite i like it yes: 6
    assert data.distinct_n(replies, 1) == 0.5
    # pairs: (oh fav) (fav fav) x3 | (i like) (like it) (it i) (i like) (like it): 9, distinct 5
    assert data.distinct_n(replies, 2) == pytest.approx(5 / 9)
    assert data.distinct_n(["Yes", "no"], 2) == 0.0 and data.distinct_n([], 1) == 0.0   # no pair said at all
    # the most frequent word fills more than half: favorite 4 of 5 yes; i 2 of 6 no; one word repeats nothing
    assert data.repetition_rate(replies) == 0.25 and data.repetition_rate(["no no", "no yes"]) == 0.5
    assert data.diversity(replies) == {"distinct_1": data.distinct_n(replies, 1), "distinct_2": data.distinct_n(replies, 2),
                                       "repetition": 0.25}


def test_gold_strict_prices_repeated_word_pairs_and_is_gold_on_a_reply_without_any():
    plain, parrot, short = "That is wonderful, I love it!", "wonderful " * 30, "Wonderful"
    gold = dict(zip((plain, parrot, short), data.gold_score([plain, parrot, short])))
    strict = dict(zip((plain, parrot, short), data.STRICT_JUDGES["chitchat"](["p"] * 3, [plain, parrot, short])))
    assert strict[plain] == pytest.approx(gold[plain]) and strict[short] == pytest.approx(gold[short])
    assert gold[parrot] > 0.9 and strict[parrot] == pytest.approx((1 / 29) * (gold[parrot] + 1) - 1)   # 1 pair of 29
    assert strict[parrot] < -0.9
    assert all(-1.0 <= v <= 1.0 for v in data.strict_sentiment(["awful " * 10, "bad", "ok ok", plain]))
    assert "count" not in data.STRICT_JUDGES           # count's judge already reads the whole answer


def test_split_depends_on_group_and_seed_only():
    rows = [{"group": f"doc{i % 50}", "i": i} for i in range(500)]
    a = data.split_by_group(rows, seed=1234, test_fraction=0.1)
    b = data.split_by_group(list(reversed(rows)), seed=1234, test_fraction=0.1)
    assert all(groups(a[k]) == groups(b[k]) for k in a)
    c = data.split_by_group(rows, seed=7, test_fraction=0.1)
    assert any(groups(a[k]) != groups(c[k]) for k in a)


# --- real datasets, through the same code path as the hub -------------------------------------

def everything(splits):
    return [r for rows in splits.values() for r in rows]


def test_tldr_comparisons_map_to_the_reddit_template_and_the_chosen_summary():
    splits = data.load_task("tldr", data_files={"train": str(FIXTURES / "tldr_comparisons_train.jsonl"),
                                                 "test": str(FIXTURES / "tldr_comparisons_valid.jsonl")})
    assert len(everything(splits)) == 8 and len(splits["test"]) == 2
    for r in everything(splits):
        assert r["prompt"].startswith("SUBREDDIT: r/") and r["prompt"].endswith("\nTL;DR:")
        assert "\nTITLE: " in r["prompt"] and "\nPOST: " in r["prompt"]
        assert len(r["chosen"]) > len(r["rejected"])     # fixture: the longer summary is the chosen one
    for split in ("sft", "rm", "ppo"):                      # both orders of a post stay in one split
        for g in groups(splits[split]):
            assert sum(r["group"] == g for r in everything(splits)) == 2


def test_tldr_carper_variant_does_not_repeat_tldr():
    splits = data.load_task(str(FIXTURES / "tldr_carper.jsonl"))
    rows = everything(splits)
    assert len(rows) == 4
    assert all(r["prompt"].endswith("TL;DR:") and "TL;DR" not in r["chosen"] + r["rejected"] for r in rows)
    assert all(r["chosen"].startswith(" ") for r in rows)


def test_hh_keeps_prompt_and_responses():
    splits = data.load_task("hh", data_files={"train": str(FIXTURES / "hh_train.jsonl"),
                                               "test": str(FIXTURES / "hh_test.jsonl")})
    assert [r["chosen"] for r in splits["test"]] == [" About 9-12 minutes for hard-boiled, 6-7 for a jammy yolk."]
    assert len(everything(splits)) == 5
    assert all(r["prompt"].endswith("\n\nAssistant:") for r in everything(splits))


def test_webgpt_drops_ties_strips_citations_and_holds_out_a_test_split():
    splits = data.load_task("webgpt", data_files={"train": str(FIXTURES / "webgpt.jsonl")})
    rows = everything(splits)
    assert len(rows) == 3                                             # one tie dropped
    assert "test" in splits
    assert not any("[" in r["chosen"] + r["rejected"] for r in rows)
    bread = next(r for r in rows if "bread" in r["prompt"])
    assert bread["chosen"] == " Yeast makes gas that gets trapped in gluten, so the dough rises."
    assert bread["prompt"] == "\n\nHuman: Why is bread fluffy?\n\nAssistant:"


def test_local_parquet_in_any_known_schema(tmp_path):
    import datasets
    rows = [json.loads(line) for line in open(FIXTURES / "webgpt.jsonl")]
    path = tmp_path / "webgpt.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    assert len(everything(data.load_task(str(path)))) == 3


def test_unknown_columns_and_unknown_names_are_clear_errors(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(data.DataError, match="match no known schema"):
        data.load_task(str(path))
    with pytest.raises(data.DataError, match="unknown task 'nope'"):
        data.load_task("nope")


def test_a_bad_row_names_dataset_row_and_field():
    with pytest.raises(data.DataError, match=r"pairs_bad.jsonl\[train\]: row 1: missing field 'rejected'"):
        data.load_task(str(FIXTURES / "pairs_bad.jsonl"))


def test_bad_rows_can_be_skipped_and_are_counted(capsys):
    rows = everything(data.load_task(str(FIXTURES / "pairs_bad.jsonl"), skip_bad_rows=True))
    assert sorted(r["chosen"] for r in rows) == [" sure", " yes"]
    assert "skipped 2 malformed rows" in capsys.readouterr().out


def test_wrong_type_and_empty_field_messages():
    bad = [{"prompt": "p", "chosen": 3, "rejected": "r"}, {"prompt": "p", "chosen": " ", "rejected": "r"}]
    with pytest.raises(data.DataError, match="row 0: field 'chosen' should be str, got int"):
        data.map_rows(bad[:1], data._pairs_row, "mine")
    with pytest.raises(data.DataError, match="row 0: field 'chosen' is empty"):
        data.map_rows(bad[1:], data._pairs_row, "mine")


# --- tokenization -------------------------------------------------------------------------------

def test_tokenizer_round_trips_with_pad_different_from_eos(tokenizer):
    text = "Héllo wörld, naïve café — “quotes”\n  and spaces"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    data.check_tokenizer(tokenizer)


def test_a_tokenizer_whose_pad_is_eos_is_refused(tokenizer):
    import copy
    broken = copy.deepcopy(tokenizer)
    broken.pad_token = broken.eos_token
    with pytest.raises(ValueError, match="pad token different from its EOS"):
        data.check_tokenizer(broken)


def test_prompts_are_left_padded_and_keep_their_end(tokenizer):
    long_prompt = "one two three four five six seven eight nine ten eleven twelve"
    ids, mask, truncated = data.encode_prompts(tokenizer, [long_prompt, "hi"], max_len=6)
    assert ids.shape == (2, 6) and truncated == 1
    assert ids[0, 0] == tokenizer.bos_token_id                       # BOS survives truncation
    assert tokenizer.decode(ids[0, 1:]).endswith("twelve")
    assert mask[1].tolist()[:3] == [0, 0, 0] and mask[1, -1] == 1 and ids[1, 0] == tokenizer.pad_token_id


def test_responses_are_right_padded_with_eos_when_it_fits(tokenizer):
    ids, mask = data.encode_responses(tokenizer, [" quick", " the quick brown fox jumped over"], max_len=4)
    short = ids[0][mask[0].bool()].tolist()
    assert short[-1] == tokenizer.eos_token_id and ids[0, -1] == tokenizer.pad_token_id
    assert mask[1].sum() == 4 and tokenizer.eos_token_id not in ids[1].tolist()   # cut: no EOS


def test_collate_labels_only_response_tokens(tokenizer):
    b = data.collate(tokenizer, ["a short prompt", "a much much longer prompt here"], [" yes", " no way"], 16, 8)
    labels, ids, mask = b["labels"], b["input_ids"], b["attention_mask"]
    P = b["prompt_width"]
    assert (labels[:, :P] == -100).all()
    assert torch.equal(labels[:, P:] != -100, mask[:, P:].bool())
    assert torch.equal(labels[:, P:][mask[:, P:].bool()], ids[:, P:][mask[:, P:].bool()])
    assert torch.equal(b["position_ids"][0][mask[0].bool()], torch.arange(int(mask[0].sum())))


# ---- code tasks

def test_code_task_is_deterministic_split_20_80_by_prompt_and_its_references_pass():
    import sandbox
    splits = data.load_task("code")
    assert set(splits) == {"sft", "ppo", "test"}
    assert [r["prompt"] for r in data.load_task("code")["sft"]] == [r["prompt"] for r in splits["sft"]]
    prompts = {name: {r["prompt"] for r in rows} for name, rows in splits.items()}
    assert not (prompts["sft"] & prompts["ppo"]) and not (prompts["test"] & (prompts["sft"] | prompts["ppo"]))
    share = len(splits["sft"]) / (len(splits["sft"]) + len(splits["ppo"]))
    assert 0.15 < share < 0.25                                             # SFT / RLHF 20 / 80 (App. B.2)
    assert {r["difficulty"] for r in splits["test"]} == {"introductory", "interview", "competition"}
    sample = splits["test"][:40]
    results = sandbox.run_many([(r["prompt"] + r["chosen"], r["tests"]) for r in sample])
    assert all(res.outcome == "passed" for res in results)
    wrong = sandbox.run_many([(r["prompt"] + "    return 0\n", r["tests"]) for r in sample[:10]])
    assert sum(res.outcome == "passed" for res in wrong) < 10


def test_apps_schema_both_formats_and_the_hendrycks_prompt():
    splits = data.load_task("apps", data_files={"train": str(FIXTURES / "apps_train.jsonl"),
                                                 "test": str(FIXTURES / "apps_test.jsonl")})
    assert len(splits["sft"]) + len(splits["ppo"]) == 4 and len(splits["test"]) == 2
    call = next(r for r in splits["sft"] + splits["ppo"] if "fn_name" in r["tests"])
    assert call["prompt"].startswith("\nQUESTION:\nReturn the number of vowels")
    assert "class Solution:" in call["prompt"] and "Use Call-Based format" in call["prompt"]
    assert call["prompt"].endswith("\nANSWER:\n") and call["difficulty"] == "interview"
    stdio = next(r for r in splits["test"] if "fn_name" not in r["tests"])
    assert "Use Standard Input format" in stdio["prompt"] and stdio["tests"]["outputs"] == ["6\n", "-4\n"]
    import sandbox
    every = splits["sft"] + splits["ppo"] + splits["test"]
    assert all(r.outcome == "passed" for r in sandbox.run_many([(x["chosen"], x["tests"]) for x in every]))


def test_a_bad_apps_row_names_the_row_and_field():
    with pytest.raises(data.DataError, match=r"apps\[train\]: row 1: field 'input_output' needs as many"):
        data.load_task("apps", data_files={"train": str(FIXTURES / "apps_bad.jsonl"),
                                            "test": str(FIXTURES / "apps_test.jsonl")})


def test_humaneval_task_is_all_test_problems():
    splits = data.load_task("humaneval")
    assert len(splits["test"]) == 164 and not splits["sft"] and not splits["ppo"]
    assert splits["test"][0]["tests"]["entry_point"] and "def check" in splits["test"][0]["tests"]["test"]


def test_first_row_per_prompt_keeps_the_order_of_prompts_of():
    rows = [{"prompt": "b", "k": 1}, {"prompt": "a", "k": 2}, {"prompt": "b", "k": 3}, {"prompt": "c", "k": 4}]
    assert [r["k"] for r in data.first_row_per_prompt(rows)] == [1, 2, 4]
    assert [r["prompt"] for r in data.first_row_per_prompt(rows)] == data.prompts_of(rows)


def test_count_gold_scores_unicode_digits_as_words_and_never_raises():
    """'²' and '③' are str.isdigit() but not int(): they are items that are not the count's numbers."""
    prompt = "\n\nHuman: Count from 1 to 3.\n\nAssistant:"
    exact, slipped, circled = data.count_gold([prompt] * 3, [" 1, 2, 3.", " 1, ², 3.", " ①, ②, ③."])
    assert exact == 1.0 and slipped == pytest.approx(1.0 - data.COUNT_ERROR_COST)
    assert circled == pytest.approx(max(0.0, 1.0 - 3 * data.COUNT_ERROR_COST))


def test_chitchat_conversations_keep_every_messages_text_and_nothing_else():
    """Reading each message as its text alone (a third less memory) gives the turns of a plain json.load:
    consecutive messages of one speaker joined, per conversation, in order."""
    import chitchat_dataset
    with open(chitchat_dataset._PATH) as f:
        raw = json.load(f)
    reference = {cid: [" ".join(m["text"] for m in turn).strip() for turn in conv["messages"]]
                 for cid, conv in raw.items()}
    assert data.chitchat_conversations() == reference and len(reference) > 7000
