import pytest

SAMPLE_TEXT = [
    "The quick brown fox (a clever one) jumped over the lazy dog.\nThen it ran away, fast!",
    "Héllo wörld, naïve café [brackets] {braces} <angles> — unicode “quotes”.",
    "def add(a, b):\n    total = a + b\n    return total\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
    "I think we should meet tomorrow at the library because it is quiet there.",
]


@pytest.fixture(scope="session")
def tokenizer():
    """A real byte-level BPE tokenizer, trained offline in a fraction of a second."""
    from sft import train_tokenizer
    return train_tokenizer(SAMPLE_TEXT * 20, vocab_size=400)
