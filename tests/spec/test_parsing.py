"""parsing_starts: constituency-style macro actions on real text and real code (paper §3.2.1)."""
import io
import tokenize

import pytest
import torch

import macro_actions as ma
from reference import pad_right

SENTENCES = [
    "The quick brown fox (a clever one) jumped over the lazy dog.\nThen it ran away, fast!",
    "I think we should meet tomorrow at the library because it is quiet there, don't you?",
    "Héllo wörld, naïve café [brackets] {braces} — unicode “quotes”.\n\n\nNew paragraph here.",
    "((( )))] [[ unbalanced ]] ((",
]
CODE = [
    "def add(a, b):\n    total = a + b\n    if total > 10:\n        return [x for x in range(total)]\n    return total\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n        return len(self.items)\n",
    "if (n := len(xs)) > 3:\n    print(n)\n",                       # walrus: RedBaron fails, ast parses
    "def f(a, /, b, *, c):\n    match a:\n        case 1:\n            return b\n    return c\n",
    "import os\ndef g(x):\n    return [x,\n",                     # truncated mid-expression
]


def encode(tokenizer, texts, eos=True):
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
            for t in texts]
    return pad_right(rows, tokenizer.pad_token_id)


def start_chars(tokenizer, ids, starts):
    """Char offset (in the decoded response) of the first non-space char of each start token,
    from the tokenizer's own offsets of the canonical encoding."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == [i for i in ids if i not in tokenizer.all_special_ids]
    out = []
    for (a, b), s in zip(enc["offset_mapping"], starts):
        if s and text[a:b].strip():
            out.append(a + len(text[a:b]) - len(text[a:b].lstrip()))
    return text, out


def word_starts(text):
    import spacy
    nlp = ma._spacy("spacy")
    return {t.idx for t in nlp(text) if not t.is_space}


def code_token_starts(text):
    lines = text.splitlines(keepends=True)
    offset = [0]
    for line in lines:
        offset.append(offset[-1] + len(line))
    found = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.string.strip():
                found.add(offset[tok.start[0] - 1] + tok.start[1])
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return found


def test_real_sentences_start_on_word_boundaries(tokenizer):
    ids, mask = encode(tokenizer, SENTENCES)
    starts, fallback = ma.parsing_starts(ids, mask, tokenizer, cutoff=3, return_fallback=True)
    assert not fallback.any()
    for b in range(len(SENTENCES)):
        L = int(mask[b].sum())
        row = ids[b, :L].tolist()
        text, chars = start_chars(tokenizer, row, starts[b, :L].tolist())
        assert text == SENTENCES[b]
        assert set(chars) <= word_starts(text), (text, chars)
        n = int(starts[b].sum())
        assert 1 < n < L - 1                       # real structure: neither n=1 nor one macro
        assert starts[b, 0] and not starts[b, L - 1]   # EOS joins the last macro action


def test_cutoff_controls_granularity(tokenizer):
    ids, mask = encode(tokenizer, SENTENCES[:2])
    counts = [int(ma.parsing_starts(ids, mask, tokenizer, cutoff=c).sum()) for c in (2, 5, 1000)]
    assert counts[0] > counts[1] > counts[2] == 2   # a huge cutoff: each row is one macro action


def test_real_code_starts_on_python_token_boundaries(tokenizer):
    ids, mask = encode(tokenizer, CODE)
    starts, fallback = ma.parsing_starts(ids, mask, tokenizer, cutoff=4, language="python",
                                         return_fallback=True)
    assert not fallback.any()                       # RedBaron, else ast, else whole lines
    for b in range(len(CODE)):
        L = int(mask[b].sum())
        text, chars = start_chars(tokenizer, ids[b, :L].tolist(), starts[b, :L].tolist())
        boundaries = code_token_starts(text) | {0}
        line_starts = {i + 1 for i, ch in enumerate(text) if ch == "\n"}
        for c in chars:      # a start is at a Python token, or at the first char of a line's code
            assert c in boundaries or any(text[s:c].strip() == "" for s in line_starts if s <= c), (text, c)
        assert 1 < int(starts[b].sum()) < L - 1


def test_unparsable_code_falls_back_to_n1_and_is_counted(tokenizer):
    ids, mask = encode(tokenizer, ["))) def (:: ]]", CODE[0]])
    starts, fallback = ma.parsing_starts(ids, mask, tokenizer, language="python", return_fallback=True)
    assert fallback.tolist() == [True, False]
    assert torch.equal(starts[0], mask[0].bool())


def test_no_eos_empty_and_eos_only_responses(tokenizer):
    ids, mask = encode(tokenizer, [SENTENCES[0], "", ""], eos=False)
    mask[2, 0], ids[2, 0] = 1, tokenizer.eos_token_id            # row 2: only EOS
    starts, fallback = ma.parsing_starts(ids, mask, tokenizer, return_fallback=True)
    assert not fallback.any()
    assert starts[0, 0] and starts[0].sum() > 1
    assert not starts[1].any()                                  # empty: nothing starts
    assert starts[2].tolist() == [True] + [False] * (starts.shape[1] - 1)


def test_parsing_rows_are_independent_and_padding_never_starts(tokenizer):
    texts = SENTENCES[:3]
    ids, mask = encode(tokenizer, texts)
    batch = ma.parsing_starts(ids, mask, tokenizer, cutoff=3)
    assert not (batch & ~mask.bool()).any()
    for b, t in enumerate(texts):
        one_ids, one_mask = encode(tokenizer, [t])
        alone = ma.parsing_starts(one_ids, one_mask, tokenizer, cutoff=3)
        assert torch.equal(alone[0], batch[b, : alone.shape[1]])


def test_tokens_that_do_not_match_the_text_fall_back(tokenizer):
    # Non-canonical ids (a word spelled byte by byte) still align through incremental decoding.
    word = tokenizer("quick fox jumped over the dog", add_special_tokens=False)["input_ids"]
    spelled = tokenizer.convert_tokens_to_ids(list("quick")) + word[1:]
    ids, mask = pad_right([spelled])
    starts, fallback = ma.parsing_starts(ids, mask, tokenizer, cutoff=2, return_fallback=True)
    assert not fallback.any() and starts[0, 0] and starts.sum() > 1


def test_unknown_language_and_missing_benepar_are_clear_errors(tokenizer):
    ids, mask = encode(tokenizer, ["hi"])
    with pytest.raises(ValueError, match="language"):
        ma.parsing_starts(ids, mask, tokenizer, language="java")
    try:
        import benepar  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            ma.parsing_starts(ids, mask, tokenizer, parser="benepar")
