"""Text sources for prompts: RULER's noise sentences, word lists, a deterministic synthetic prose generator,
readers for external files (essays, SQuAD, HotpotQA, PG-19, InfiniteBench jsonl) with one clear error when absent.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import uuid

from mtrain.errors import MtrainError

# RULER's noise haystack: the same five sentences repeated
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

SYNTHETIC = "synthetic"  # essay_path / pg19_path value selecting generated text instead of files

# where each kind of external file comes from, for the error message
SOURCES = {
    "essay": "Paul Graham essays as a folder of .txt files or RULER's PaulGrahamEssays.json "
    "(RULER's scripts/data/synthetic/json/download_paulgraham_essay.py builds it)",
    "squad": "SQuAD v2.0 dev set JSON (dev-v2.0.json from the SQuAD 2.0 site, as RULER's "
    "download_qa_dataset.sh fetches)",
    "hotpotqa": "HotpotQA dev distractor JSON (hotpot_dev_distractor_v1.json from the HotpotQA site)",
    "pg19": "the PG-19 test split: a folder of one .txt file per book (deepmind/pg19, test/)",
    "infbench": "InfiniteBench data: the task's .jsonl file (xinrongzhang2022/InfiniteBench on the HF hub, "
    "e.g. en_sum.jsonl)",
}


class MissingDataError(MtrainError):
    """An external data file named in the suite does not exist."""


def require_path(path: str | None, kind: str, key: str) -> str:
    """Return `path` if it exists; otherwise raise one line naming it, the suite key, and where such files come from."""
    if not path:
        raise MissingDataError(f"suite key {key!r} is not set: it must point to {SOURCES[kind]}")
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise MissingDataError(f"missing {kind} data {path!r} (suite key {key!r}); get {SOURCES[kind]}")
    return path


def check_essays(params: dict) -> None:
    """Essay haystacks need `essay_path` (files, or "synthetic")."""
    if params.get("haystack", "essay") == "essay" and params.get("essay_path") != SYNTHETIC:
        require_path(params.get("essay_path"), "essay", "essay_path")


@functools.lru_cache(maxsize=None)
def word_lists() -> dict[str, list[str]]:
    """Lower-case single-word nouns, adjectives and verbs from wonderwords' bundled lists (sorted, deterministic)."""
    from wonderwords import RandomWord

    words = RandomWord()
    out = {}
    for cat in ("noun", "adjective", "verb"):
        out[cat] = sorted({w.lower() for w in words.filter(include_categories=[cat]) if w.isalpha()})
    return out


def key_word(rng: random.Random) -> str:
    """RULER's needle key: an adjective-noun pair such as "stormy-cracker"."""
    lists = word_lists()
    return f"{rng.choice(lists['adjective'])}-{rng.choice(lists['noun'])}"


def number_value(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def uuid_value(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def synthetic_sentences(seed: int, n_sentences: int) -> list[str]:
    """Held-out filler in the style of the embedded default's training corpus (`mtrain.data.synthetic`).

    Seeds here are offset far from the corpus' own so the text is new to the model; deterministic.
    """
    from mtrain.data.synthetic import filler

    return filler(random.Random(f"eval-heldout/{seed}"), n_sentences)


def synthetic_documents(seed: int, count: int, min_tokens_hint: int) -> list[str]:
    """`count` held-out documents of the training corpus' kind, each about `min_tokens_hint` tokens or more."""
    from mtrain.data.synthetic import CorpusSpec, make_document

    sentences = max(8, min_tokens_hint // 4)  # filler sentences are ~8 tokens for the tiny tokenizer
    spec = CorpusSpec(num_docs=count, min_sentences=sentences, max_sentences=sentences)
    rng = random.Random(f"eval-heldout-docs/{seed}")
    return [make_document(rng, spec) for _ in range(count)]


def split_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


@functools.lru_cache(maxsize=8)
def load_essay_words(path: str | None, min_words: int = 0, seed: int = 0) -> list[str]:
    """All essays' words in one stream: a folder of .txt files (sorted by name) or a json/jsonl with "text".

    `path == "synthetic"` gives at least `min_words` words of held-out synthetic filler instead (offline suites).
    """
    if path == SYNTHETIC:
        words: list[str] = []
        n = 64
        while len(words) < min_words:
            n *= 2
            words = " ".join(synthetic_sentences(seed, n)).split(" ")
        return words
    path = require_path(path, "essay", "essay_path")
    if os.path.isdir(path):
        texts = []
        for name in sorted(os.listdir(path)):
            if name.endswith(".txt"):
                with open(os.path.join(path, name), encoding="utf-8") as f:
                    texts.append(f.read())
    else:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
        try:
            data = json.loads(raw)
            texts = [data["text"]] if isinstance(data, dict) else [d["text"] for d in data]
        except json.JSONDecodeError:
            texts = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
    words = re.sub(r"\s+", " ", " ".join(texts)).split(" ")
    if len(words) < 100:
        raise MtrainError(f"essay data {path!r} holds only {len(words)} words")
    return words


def read_jsonl(path: str, kind: str, key: str) -> list[dict]:
    path = require_path(path, kind, key)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path: str, kind: str, key: str):
    path = require_path(path, kind, key)
    with open(path, encoding="utf-8") as f:
        return json.load(f)
