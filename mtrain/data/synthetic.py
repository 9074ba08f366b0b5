"""Synthetic long-context corpus for the embedded default: filler prose with planted facts.

Facts (passkeys, key->value needles, variable chains) are stated early in a document and asked about
near its end, so a model only predicts the answers by retrieving across the gap. Fully deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

# A small closed vocabulary keeps the tiny tokenizer small and the filler cheap to model.
_NOUNS = (
    "river mountain garden library village harbor forest window engine lantern market bridge "
    "castle meadow island valley orchard station tower canyon desert glacier workshop theater "
    "museum kitchen school temple compass mirror ladder bottle basket candle blanket pillow"
).split()
_ADJECTIVES = (
    "quiet bright ancient gentle distant golden hidden narrow silver wooden steady hollow "
    "crowded humble restless careful curious patient silent sudden tired vivid warm wild"
).split()
_VERBS = (
    "watched followed crossed painted carried opened visited measured described remembered "
    "repaired guarded counted gathered noticed explored"
).split()
_ADVERBS = "slowly quickly often rarely softly early late twice again nearly".split()
_NAMES = (
    "alpha bravo cedar delta ember falcon garnet harbor indigo juniper kestrel lotus maple "
    "nectar onyx pepper quartz raven sable tulip umber violet willow xenon yarrow zephyr"
).split()

NEEDLE_TEMPLATE = "One of the special magic numbers for {key} is: {value}."
QUESTION_TEMPLATE = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_TEMPLATE = "The special magic number for {key} mentioned in the provided text is {value}."
PASSKEY_TEMPLATE = "The pass key is {value}. Remember it. {value} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is {value}."
CHAIN_START = "VAR {name} = {value} ."
CHAIN_LINK = "VAR {name} = VAR {prev} ."
CHAIN_QUESTION = "Which value does VAR {name} hold? VAR {name} holds {value} ."


def filler_sentence(rng: random.Random) -> str:
    """One grammatical-looking sentence drawn from the closed vocabulary."""
    shape = rng.randrange(3)
    a, b = rng.choice(_ADJECTIVES), rng.choice(_ADJECTIVES)
    n1, n2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
    v, adv = rng.choice(_VERBS), rng.choice(_ADVERBS)
    if shape == 0:
        return f"The {a} {n1} {v} the {b} {n2}."
    if shape == 1:
        return f"A {a} {n1} {adv} {v} a {n2} near the {b} {rng.choice(_NOUNS)}."
    return f"They {v} the {n1} {adv}, and the {n2} was {b}."


def filler(rng: random.Random, n_sentences: int) -> list[str]:
    return [filler_sentence(rng) for _ in range(n_sentences)]


@dataclass(frozen=True)
class CorpusSpec:
    """How many documents and how long (in filler sentences, ~8 tokens each for the tiny tokenizer)."""

    num_docs: int = 2000
    min_sentences: int = 8
    max_sentences: int = 400
    facts_per_doc: int = 3
    seed: int = 0


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_NAMES)}-{rng.choice(_NAMES)}"


def _number(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def make_document(rng: random.Random, spec: CorpusSpec) -> str:
    """A document: filler with facts planted in its first half and questions about them at its end.

    Lengths are drawn log-uniformly so the corpus holds both short documents and long ones whose
    facts sit thousands of tokens before their questions.
    """
    lo, hi = spec.min_sentences, spec.max_sentences
    n = int(round(lo * (hi / lo) ** rng.random()))
    body = filler(rng, n)
    questions: list[str] = []
    for _ in range(spec.facts_per_doc):
        kind = rng.randrange(3)
        if kind == 0:
            key, value = _key(rng), _number(rng, 7)
            fact = NEEDLE_TEMPLATE.format(key=key, value=value)
            questions.append(QUESTION_TEMPLATE.format(key=key) + " " + ANSWER_TEMPLATE.format(key=key, value=value))
        elif kind == 1:
            value = _number(rng, 5)
            fact = PASSKEY_TEMPLATE.format(value=value)
            questions.append(PASSKEY_QUESTION.format(value=value))
        else:
            names = [f"{rng.choice('XYZQW')}{rng.randrange(100)}" for _ in range(3)]
            value = _number(rng, 5)
            links = [CHAIN_START.format(name=names[0], value=value)]
            links += [CHAIN_LINK.format(name=names[i], prev=names[i - 1]) for i in range(1, len(names))]
            fact = " ".join(links)
            questions.append(CHAIN_QUESTION.format(name=names[-1], value=value))
        body.insert(rng.randrange(0, max(1, len(body) // 2) + 1), fact)
    rng.shuffle(questions)
    return " ".join(body + questions)


def generate(spec: CorpusSpec) -> list[str]:
    rng = random.Random(spec.seed)
    return [make_document(rng, spec) for _ in range(spec.num_docs)]


def write_jsonl(path: str | os.PathLike, docs: list[str], field: str = "text") -> Path:
    """Write one JSON object per document, atomically (a temp file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({field: doc}) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mtrain.data.synthetic",
        description="Write the synthetic long-context corpus (jsonl, field 'text') used by the embedded default.",
    )
    parser.add_argument("--out", required=True, help="output .jsonl file")
    parser.add_argument("--docs", type=int, default=CorpusSpec.num_docs, help="number of documents")
    parser.add_argument("--min-sentences", type=int, default=CorpusSpec.min_sentences)
    parser.add_argument("--max-sentences", type=int, default=CorpusSpec.max_sentences)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.docs <= 0 or args.min_sentences <= 0 or args.max_sentences < args.min_sentences:
        parser.error("need --docs > 0 and 0 < --min-sentences <= --max-sentences")
    spec = CorpusSpec(args.docs, args.min_sentences, args.max_sentences, seed=args.seed)
    out = write_jsonl(args.out, generate(spec))
    print(f"wrote {spec.num_docs} documents to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
