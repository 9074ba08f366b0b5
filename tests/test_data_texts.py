"""mtrain.data.texts: kinds of real text that ship with Python or an installed package, deterministic and long
enough for the real-model benchmarks (8K tokens at about 4 characters a token, with room to spare)."""

import random

import pytest

from mtrain.data.prose import prose_tokens
from mtrain.data.texts import TEXT_KINDS, TEXT_LABELS, _stdlib_files, kind_text, text_tokens
from mtrain.errors import MtrainError

CHARS = 120_000  # ~30K tokens of SmolLM2's tokenizer on English (fewer characters a token on code)


class CharTokenizer:
    """One token per character (ids = code points), BOS 1: enough to count and compare."""

    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


@pytest.fixture(scope="module")
def texts():
    return {kind: kind_text(kind, CHARS) for kind in TEXT_KINDS}


@pytest.mark.parametrize("kind", TEXT_KINDS)
def test_each_kind_is_long_enough_and_deterministic(kind, texts):
    text = texts[kind]
    assert len(text) >= CHARS and kind in TEXT_LABELS
    assert kind_text(kind, CHARS) == text  # the same installation always yields the same text
    ids = text_tokens(CharTokenizer(), 8192, kind)
    assert len(ids) == 8192 and ids[0] == 1 and ids == text_tokens(CharTokenizer(), 8192, kind)


def test_the_kinds_are_what_they_say(texts):
    assert texts["prose"].startswith(kind_text("prose", 1000)) and "The" in texts["prose"][:5000]
    assert texts["docs"][:2000] not in texts["prose"][:CHARS // 2]  # docstrings, not the reference topics
    code = texts["code"]
    assert code.count("\ndef ") + code.count("    def ") > 50 and "import " in code
    first = next(_stdlib_files())  # whole source files, in a fixed order
    with open(first, encoding="utf-8") as fh:
        assert code.startswith(fh.read().rstrip() + "\n\n\n")
    turns = [line for line in texts["dialogue"].splitlines() if line]
    speakers = {line.split(":", 1)[0] for line in turns}
    assert speakers == {"ELIZA", "IESHA", "RUDE", "SUN TZU", "ZEN"}
    assert len(turns) > 1000 and all(": " in line for line in turns)


def test_prose_is_the_benchmarks_prose():
    tok = CharTokenizer()
    assert text_tokens(tok, 5000, "prose") == prose_tokens(tok, 5000)


def test_dialogue_leaves_the_global_random_state_alone():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    kind_text("dialogue", 20_000)
    assert random.random() == expected


def test_unknown_kind_is_refused():
    with pytest.raises(MtrainError, match="not one of prose, docs, code, dialogue"):
        kind_text("poetry", 10)
