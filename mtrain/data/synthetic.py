"""Synthetic long-context corpus for the embedded default: filler prose with planted facts, and retrieval prompts.

Facts documents state passkeys, key->value needles and variable chains early and ask about them near the end.
Retrieval documents are the eval's own needle prompts (NIAH, RULER's single needle, InfiniteBench's passkey)
over filler or RULER's noise, each followed by its answer and more questions: a model only predicts the
answers by finding the needle across the gap, the skill `mtrain eval` measures. Fully deterministic.
"""

from __future__ import annotations

import argparse
import functools
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

WORDS = sorted({*_NOUNS, *_ADJECTIVES, *_VERBS, *_ADVERBS, *_NAMES})

NEEDLE_TEMPLATE = "One of the special magic numbers for {key} is: {value}."
QUESTION_TEMPLATE = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_TEMPLATE = "The special magic number for {key} mentioned in the provided text is {value}."
PASSKEY_TEMPLATE = "The pass key is {value}. Remember it. {value} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is {value}."
CHAIN_START = "VAR {name} = {value} ."
CHAIN_LINK = "VAR {name} = VAR {prev} ."
CHAIN_QUESTION = "Which value does VAR {name} hold? VAR {name} holds {value} ."

# The eval's prompt formats, word for word (mtrain/eval/tasks: niah's defaults, RULER's single-needle niah with
# its singular wording, InfiniteBench's passkey); tests/test_data_synthetic.py checks they still match the eval.
NIAH_NEEDLE = "The special magic number for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the number afterwards.\n{context}\n"
    "What is the special magic number for {key} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic number for {key} mentioned in the provided text is"
RULER_NEEDLE = "One of the special magic numbers for {key} is: {value}."
RULER_TEMPLATE = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.\n{context}\n"
    "What is the special magic number for {query} mentioned in the provided text?"
    " The special magic number for {query} mentioned in the provided text is"
)
RULER_QUESTION = (
    "What is the special magic number for {query} mentioned in the provided text?"
    " The special magic number for {query} mentioned in the provided text is"
)
PASSKEY_PROMPT = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe pass key is"
)
PASSKEY_INPUT = "What is the pass key?"
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
# RULER's noise haystack unit (mtrain.eval.text.NOISE), items joined by newlines
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# a copy drill: needles, then the same needles again (every token of the repeat is predictable by copying)
REPEAT_JOIN = "\nOnce more, word for word:\n"
# retrieval document formats and their default shares (`make train` passes --formats niah=1: its copying is taught
# by the --copy-period drills, CopySpec below)
RETRIEVAL_FORMATS = {"niah": 0.25, "ruler": 0.1, "passkey": 0.05, "repeat": 0.6}


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
    retrieval: float = 0.0
    """Share of documents that are retrieval prompts in the eval's formats (the rest are facts documents)."""
    formats: tuple = tuple(RETRIEVAL_FORMATS.items())
    """(format, weight) pairs the retrieval documents are drawn from: niah, ruler, passkey, repeat."""
    fit_tokens: tuple = ()
    """Token counts (EOS included) niah and ruler retrieval documents are fitted to exactly, one drawn per document
    (repeat a count to draw it more often); empty: lengths from min/max_sentences. A document that fills 8192 tokens
    asks its question where the eval's 8K prompt does, and with `mtrain pack --order length` counts that divide the
    sample length keep every document whole in one sample (a document cut by a sample boundary loses its needle
    or its question)."""
    tokenizer: str | None = None
    """Tokenizer fit_tokens counts in (default: the tiny tokenizer)."""
    value_digits: tuple = (7, 7)
    """(lo, hi): niah and ruler needle values have lo..hi digits, drawn uniformly (the eval's have 7). Longer values
    give each prompt more digits to copy across the haystack, most of them after a digit that came before."""
    edge_depths: float = 0.0
    """Share of fitted documents whose needle sits at an end of the haystack (depth 0 or 1, as the eval's first
    and last depths); the rest at a uniform depth."""
    value_repeats: float = 0.0
    """Share of niah and ruler needle values built of repeats (`repeat_digits`: doubled digits and fragments of the
    value said again), where a copy that matches on one digit jumps to the wrong place in the value."""


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_NAMES)}-{rng.choice(_NAMES)}"


def random_number(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _value(rng: random.Random, spec: CorpusSpec) -> str:
    """A needle value of spec.value_digits digits (no draw of the count when it is fixed), a share
    spec.value_repeats of them built of repeats (no draw for that share when it is 0)."""
    lo, hi = spec.value_digits
    n = lo if lo == hi else rng.randint(lo, hi)
    if spec.value_repeats and rng.random() < spec.value_repeats:
        first = str(rng.randrange(1, 10))  # no leading zero, as random_number's values
        return first + "".join(repeat_digits(rng, list("0123456789"), n - 1, [first]))
    return random_number(rng, n)


# repeat_digits: the chance that the next piece is a fragment of what came before, and that it is a doubled digit
REPEAT_FRAGMENT, REPEAT_DOUBLE = 0.2, 0.1


def repeat_digits(rng: random.Random, alphabet: list, n: int, before: list | None = None) -> list:
    """n digits (items of `alphabet`) full of repeats: each piece is a fragment of 2-5 of the digits so far
    (`before` included) said again, or the last digit doubled, or a fresh random digit. Copying such a run right
    needs more than the current digit's context: after a repeated digit or fragment a copy that matches on one
    digit alone jumps back to its earlier place (the eval's misses: 15500784333 for 1500784) or skips the double."""
    seq = list(before or [])
    out: list = []
    while len(out) < n:
        draw = rng.random()
        if draw < REPEAT_FRAGMENT and len(seq) >= 2:
            size = rng.randint(2, min(5, len(seq)))
            start = rng.randrange(len(seq) - size + 1)
            piece = seq[start:start + size]
        elif draw < REPEAT_FRAGMENT + REPEAT_DOUBLE and seq:
            piece = [seq[-1]]
        else:
            piece = [rng.choice(alphabet)]
        seq += piece
        out += piece
    return out[:n]


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
            key, value = _key(rng), random_number(rng, 7)
            fact = NEEDLE_TEMPLATE.format(key=key, value=value)
            questions.append(QUESTION_TEMPLATE.format(key=key) + " " + ANSWER_TEMPLATE.format(key=key, value=value))
        elif kind == 1:
            value = random_number(rng, 5)
            fact = PASSKEY_TEMPLATE.format(value=value)
            questions.append(PASSKEY_QUESTION.format(value=value))
        else:
            names = [f"{rng.choice('XYZQW')}{rng.randrange(100)}" for _ in range(3)]
            value = random_number(rng, 5)
            links = [CHAIN_START.format(name=names[0], value=value)]
            links += [CHAIN_LINK.format(name=names[i], prev=names[i - 1]) for i in range(1, len(names))]
            fact = " ".join(links)
            questions.append(CHAIN_QUESTION.format(name=names[-1], value=value))
        body.insert(rng.randrange(0, max(1, len(body) // 2) + 1), fact)
    rng.shuffle(questions)
    return " ".join(body + questions)


@functools.lru_cache(maxsize=1)
def _key_words() -> tuple[list[str], list[str]]:
    """Adjectives and nouns for needle keys: wonderwords' lists, as RULER's (and the eval's) keys are drawn."""
    from wonderwords import RandomWord

    words = RandomWord()
    return tuple(sorted({w.lower() for w in words.filter(include_categories=[cat]) if w.isalpha()})
                 for cat in ("adjective", "noun"))


def needle_key(rng: random.Random) -> str:
    """A RULER-style needle key, an adjective-noun pair such as "stormy-cracker"."""
    adjectives, nouns = _key_words()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


def _plant(items: list[str], needles: list[str], rng: random.Random) -> list[str]:
    """`items` with each needle inserted at a uniformly drawn boundary (the very start and end included)."""
    out = list(items)
    for needle in needles:
        out.insert(rng.randint(0, len(out)), needle)
    return out


def make_retrieval_document(rng: random.Random, spec: CorpusSpec) -> str:
    """One of the eval's needle prompts, answered, then more questions about the other needles, answered.

    The haystack is filler (log-uniform in [min_sentences, max_sentences] sentences) or RULER's noise of
    about the same length; niah and ruler documents plant 1..facts_per_doc keyed needles and ask about
    every one (the first question in the eval's exact wording), passkey documents plant one pass key.
    A repeat document (a copy drill) is random words with one needle among them, then the same again.
    """
    lo, hi = spec.min_sentences, spec.max_sentences
    n = int(round(lo * (hi / lo) ** rng.random()))
    fmt = rng.choices([f for f, _ in spec.formats], [w for _, w in spec.formats])[0]
    if spec.fit_tokens and fmt in ("niah", "ruler"):
        return fitted_retrieval_document(rng, spec, fmt, rng.choice(spec.fit_tokens))
    if fmt == "repeat":  # random words (one token each: whole-token matches teach copying fastest) and a needle
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 8 + 2 * n))]
        words.insert(rng.randint(0, len(words)), NIAH_NEEDLE.format(key=needle_key(rng), value=random_number(rng, 7)))
        return " ".join(words) + REPEAT_JOIN + " ".join(words)
    noise = fmt == "passkey" or (fmt == "ruler" and rng.random() < 0.5)
    # a noise unit is five short sentences, about twice a filler sentence's tokens
    items, sep = ([NOISE] * max(1, n // 2), "\n") if noise else (filler(rng, n), " ")
    if fmt == "passkey":
        value = random_number(rng, 5)
        context = sep.join(_plant(items, [PASSKEY_NEEDLE.format(key=value)], rng))
        return PASSKEY_PROMPT.format(context=context, input=PASSKEY_INPUT) + f" {value}."
    facts = [(needle_key(rng), _value(rng, spec)) for _ in range(rng.randint(1, max(1, spec.facts_per_doc)))]
    needle = NIAH_NEEDLE if fmt == "niah" else RULER_NEEDLE
    context = sep.join(_plant(items, [needle.format(key=k, value=v) for k, v in facts], rng))
    rng.shuffle(facts)
    (key, value), rest = facts[0], facts[1:]
    if fmt == "niah":
        text = NIAH_TEMPLATE.format(context=context, key=key) + NIAH_ANSWER_PREFIX.format(key=key) + f" {value}."
        follow = NIAH_TEMPLATE.split("\n")[-1] + NIAH_ANSWER_PREFIX
    else:
        text = RULER_TEMPLATE.format(context=context, query=key) + f" {value}."
        follow = RULER_QUESTION.replace("{query}", "{key}")
    return text + "".join("\n" + follow.format(key=k) + f" {v}." for k, v in rest)


def fitted_retrieval_document(rng: random.Random, spec: CorpusSpec, fmt: str, tokens: int) -> str:
    """A niah or ruler prompt over filler, answered, of exactly `tokens - 1` tokens (its EOS makes `tokens`).

    The haystack is the most whole filler sentences that fit, then words of one more (the eval's haystacks end
    mid-sentence too) until the count is exact; one needle at a uniform depth, one question."""
    _, _, tok = copy_pool(spec.tokenizer)
    target = tokens - 1
    key, value = needle_key(rng), _value(rng, spec)
    if fmt == "niah":
        needle = NIAH_NEEDLE.format(key=key, value=value)
        wrap = NIAH_TEMPLATE.replace("{key}", key) + NIAH_ANSWER_PREFIX.format(key=key) + f" {value}."
    else:
        needle = RULER_NEEDLE.format(key=key, value=value)
        wrap = RULER_TEMPLATE.replace("{query}", key) + f" {value}."
    count = lambda items: len(tok.encode(wrap.replace("{context}", " ".join(items))))  # noqa: E731
    fixed = count([needle])
    if fixed > target:
        raise ValueError(f"fit_tokens {tokens}: the prompt alone takes {fixed + 1} tokens")
    pool = filler(rng, max(1, (target - fixed) // 6 + 8))
    depth = rng.random()
    if spec.edge_depths and rng.random() < spec.edge_depths:
        depth = float(depth < 0.5)
    place = lambda n: _insert(pool[:n], needle, depth)  # noqa: E731
    # a space-joined sentence adds its own tokens (the byte-level pre-tokenizer splits at spaces), so the
    # counts add up; each guess below is checked with one exact count
    sizes = [len(tok.encode(" " + s)) for s in pool]
    room, lo = target - fixed, 0
    while lo < len(pool) and sizes[lo] <= room:
        room -= sizes[lo]
        lo += 1
    while lo > 0 and count(place(lo)) > target:
        lo -= 1
    items = place(lo)
    words = pool[lo].rstrip(".").split() if lo < len(pool) else []
    candidates = words + list(_SINGLE_TOKEN_FILL) * 8
    tail: list[str] = []
    have = count(items)
    for word in candidates:  # additive guess first, then exact
        extra = len(tok.encode(" " + word))
        if have + extra <= target:
            tail.append(word)
            have += extra
        if have == target:
            break
    text = wrap.replace("{context}", " ".join(items + ([" ".join(tail)] if tail else [])))
    if len(tok.encode(text)) != target:  # the guess was off: add words one exact count at a time
        tail = []
        for word in candidates:
            n = count(items + [" ".join(tail + [word])])
            if n <= target:  # a word that overshoots is skipped; a later shorter one may still fit
                tail.append(word)
            if n == target:
                break
        text = wrap.replace("{context}", " ".join(items + ([" ".join(tail)] if tail else [])))
    if len(tok.encode(text)) != target:
        raise ValueError(f"fit_tokens {tokens}: could not fit a document exactly ({len(tok.encode(text))} tokens)")
    return text


# words the fitting above ends a haystack with when the cut sentence's own words overshoot (one token each)
_SINGLE_TOKEN_FILL = ("the", "a", "and")


def _insert(items: list[str], needle: str, depth: float) -> list[str]:
    out = list(items)
    out.insert(int(round(depth * len(out))), needle)
    return out


@functools.lru_cache(maxsize=4)
def copy_pool(tokenizer_path: str | None = None) -> tuple[list[int], list[int], object]:
    """Token ids a copy drill draws from: the tokenizer's single-token whole words (" river"), the ten digits
    and the lone space, which the eval's needle values use (" 1234567" is the space, then one token a digit).

    Returns (pool, digit ids, tokenizer); a run of these ids decodes to text that encodes back to the same ids.
    """
    from mtrain.tiny import TOKENIZER_DIR, load_tokenizer

    tok = load_tokenizer(tokenizer_path or TOKENIZER_DIR)
    vocab = tok.get_vocab()
    digits = [vocab[str(d)] for d in range(10)]
    words = sorted(i for w, i in vocab.items() if w.startswith("\u0120") and w[1:].isalpha())
    return words + digits + [vocab["\u0120"]], digits, tok


@dataclass(frozen=True)
class CopySpec:
    """Copy drills (the induction curriculum): a random run of `period` tokens, repeated to `tokens` tokens.

    Every token after the first period is predictable only by finding the same context earlier and copying
    what followed it, the circuit retrieval needs. A period is drawn uniformly in [min_period, max_period];
    its run is random pool tokens, or (with these shares) random digits (repeated digits force matching on
    more than one token, as a 7-digit value needs) or a stretch of filler prose (so copying also works amid
    the haystack's text), or prose with the eval's needle sentences planted in it (`needles`: about one
    sentence in NEEDLE_EVERY is "The special magic number for KEY is: VALUE.", so a long period copies many
    7-digit values, most with a repeated digit, across the whole distance, amid the haystack's text).
    """

    num_docs: int = 1000
    tokens: int = 127
    min_period: int = 8
    max_period: int = 40
    digits: float = 0.0
    prose: float = 0.0
    seed: int = 0
    tokenizer: str | None = None
    needles: float = 0.0
    far: bool = False
    """The run once, then filler prose, then the run again, to exactly `tokens` tokens: one copy, across
    `tokens - period` tokens (the distance of a needle at the start of a haystack from its question)."""
    spread: bool = False
    """With `far`: the filler between the two runs takes a uniform share of the room (0 to all of it) and
    filler before the first run takes the rest, so the copy spans any distance from `period` to
    `tokens - period` and still ends the drill (as a question ends a prompt, its needle at any depth)."""
    repeats: float = 0.0
    """Share of drills whose run is digits full of repeats (`repeat_digits`: doubled digits, fragments said
    again), which a copy matching on one digit gets wrong."""


# a needle drill's run: one sentence in this many (on average) is a needle
NEEDLE_EVERY = 8


def needle_prose(rng: random.Random, n_sentences: int) -> list[str]:
    """Filler sentences with the eval's needle sentence (a key and a 7-digit value) as about one in NEEDLE_EVERY."""
    return [NIAH_NEEDLE.format(key=needle_key(rng), value=random_number(rng, 7)) if rng.random() < 1 / NEEDLE_EVERY
            else filler_sentence(rng) for _ in range(n_sentences)]


def copy_document(rng: random.Random, spec: CopySpec) -> str:
    pool, digits, tok = copy_pool(spec.tokenizer)
    period = rng.randint(spec.min_period, spec.max_period)
    draw = rng.random()
    if draw < spec.digits:
        run = [rng.choice(digits) for _ in range(period)]
    elif draw < spec.digits + spec.prose:
        run = tok.encode(" " + " ".join(filler(rng, period // 6 + 2)))[:period]
    elif draw < spec.digits + spec.prose + spec.needles:  # needle sentences take ~27 tokens, filler ~8
        run = tok.encode(" " + " ".join(needle_prose(rng, period // 9 + 2)))[:period]
    elif draw < spec.digits + spec.prose + spec.needles + spec.repeats:
        run = repeat_digits(rng, digits, period)
    else:
        run = [rng.choice(pool) for _ in range(period)]
    if spec.far:
        room = spec.tokens - 2 * period
        gap = rng.randint(0, room) if spec.spread else room
        before = _filler_ids(rng, tok, room - gap)
        return tok.decode(before + run + _filler_ids(rng, tok, gap) + run)
    return tok.decode((run * (spec.tokens // period + 1))[:spec.tokens])


def _filler_ids(rng: random.Random, tok, n: int) -> list[int]:
    """Exactly n ids of filler: whole sentences, then single-token words (as a fitted haystack ends), ids that
    decode and encode back."""
    if n == 0:
        return []
    sentences = tok.encode(" " + " ".join(filler(rng, n // 6 + 2)))
    vocab = tok.get_vocab()  # a fresh dict per call: read once (once per token made --copy-far's 48 drills take a minute)
    cut = max(i for i in range(n + 1) if i == 0 or sentences[i - 1] == vocab["."])
    fill = [vocab["\u0120" + w] for w in _SINGLE_TOKEN_FILL]
    return sentences[:cut] + [rng.choice(fill) for _ in range(n - cut)]


def generate_copies(spec: CopySpec) -> list[str]:
    rng = random.Random(spec.seed)
    return [copy_document(rng, spec) for _ in range(spec.num_docs)]


def generate(spec: CorpusSpec) -> list[str]:
    rng = random.Random(spec.seed)
    return [make_retrieval_document(rng, spec) if spec.retrieval and rng.random() < spec.retrieval
            else make_document(rng, spec) for _ in range(spec.num_docs)]


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


def _parser() -> argparse.ArgumentParser:
    """The command line of `python -m mtrain.data.synthetic`: the corpus's options, the copy drills' group."""
    parser = argparse.ArgumentParser(
        prog="python -m mtrain.data.synthetic",
        description="Write the synthetic long-context corpus (jsonl, field 'text') used by the embedded default.",
    )
    parser.add_argument("--out", required=True, help="output .jsonl file")
    parser.add_argument("--docs", type=int, default=CorpusSpec.num_docs, help="number of documents")
    parser.add_argument("--min-sentences", type=int, default=CorpusSpec.min_sentences)
    parser.add_argument("--max-sentences", type=int, default=CorpusSpec.max_sentences)
    parser.add_argument("--facts", type=int, default=CorpusSpec.facts_per_doc,
                        help="facts per document (retrieval documents: at most this many needles)")
    parser.add_argument("--retrieval", type=float, default=CorpusSpec.retrieval,
                        help="share of documents that are the eval's retrieval prompts, answered (0 to 1)")
    parser.add_argument("--formats", default=",".join(f"{k}={v:g}" for k, v in RETRIEVAL_FORMATS.items()),
                        help="weights of the retrieval formats, e.g. niah=0.6,ruler=0.2,passkey=0.2,repeat=0 "
                        "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    copy = parser.add_argument_group("copy drills (instead of the corpus above)")
    copy.add_argument("--copy-period", metavar="LO:HI",
                      help="write copy drills: a random run of LO..HI tokens repeated to --copy-tokens tokens")
    copy.add_argument("--copy-tokens", type=int, default=CopySpec.tokens,
                      help="tokens per drill (seq_len - 1: one drill and its EOS fill a packed sample)")
    copy.add_argument("--copy-digits", type=float, default=0.0, help="share of drills whose run is digits")
    copy.add_argument("--copy-prose", type=float, default=0.0, help="share of drills whose run is filler prose")
    copy.add_argument("--copy-needles", type=float, default=0.0,
                      help="share of drills whose run is filler prose with the eval's needle sentences (7-digit "
                      f"values) as about one sentence in {NEEDLE_EVERY}")
    copy.add_argument("--copy-repeats", type=float, default=0.0,
                      help="share of drills whose run is digits full of repeats (doubled digits, fragments of the "
                      "run said again), which a copy matching on one digit gets wrong")
    copy.add_argument("--copy-far", action="store_true",
                      help="the run once, filler prose, the run again (one copy across --copy-tokens minus the "
                      "period; needs HI <= --copy-tokens / 2) instead of the run repeated back to back")
    copy.add_argument("--copy-spread", action="store_true",
                      help="with --copy-far: the copy spans a uniform distance from the period to --copy-tokens minus "
                      "the period (filler before the first run takes the rest), still ending the drill")
    parser.add_argument("--fit-tokens", default="",
                        help="comma-separated token counts, EOS included (e.g. 8192,4096): each niah/ruler document is "
                        "fitted to exactly one of them, drawn uniformly (repeat one to weight it); with `mtrain pack "
                        "--order length` and counts that divide --seq-len, no document is cut")
    parser.add_argument("--value-digits", default="7:7", metavar="LO:HI",
                        help="digits of niah/ruler needle values, drawn uniformly in LO..HI (default: the eval's 7)")
    parser.add_argument("--edge-depths", type=float, default=0.0, metavar="SHARE",
                        help="share of --fit-tokens documents with the needle at depth 0 or 1 (an end of the haystack)")
    parser.add_argument("--value-repeats", type=float, default=0.0, metavar="SHARE",
                        help="share of niah/ruler needle values built of repeats (doubled digits, fragments of the "
                        "value said again)")
    copy.add_argument("--tokenizer", help="tokenizer the drills (and --fit-tokens) are counted in "
                      "(default: the tiny tokenizer)")
    return parser


def _copy_spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CopySpec:
    """The copy drills `args` ask for (--copy-period and the --copy-* options), checked: a bad value stops the
    command through `parser.error`."""
    try:
        lo, hi = (int(v) for v in args.copy_period.split(":"))
    except ValueError:
        parser.error(f"--copy-period {args.copy_period!r}: expected LO:HI")
    if not 0 < lo <= hi or args.copy_tokens <= hi or args.docs <= 0:
        parser.error("need 0 < LO <= HI < --copy-tokens and --docs > 0")
    if args.copy_far and 2 * hi > args.copy_tokens:
        parser.error("--copy-far: need 2 * HI <= --copy-tokens")
    if args.copy_spread and not args.copy_far:
        parser.error("--copy-spread needs --copy-far")
    shares = (args.copy_digits, args.copy_prose, args.copy_needles, args.copy_repeats)
    if not (min(shares) >= 0 and sum(shares) <= 1):
        parser.error("need --copy-digits, --copy-prose, --copy-needles, --copy-repeats >= 0 with a sum <= 1")
    return CopySpec(args.docs, args.copy_tokens, lo, hi, args.copy_digits, args.copy_prose, args.seed,
                    args.tokenizer, args.copy_needles, args.copy_far,
                    args.copy_spread, args.copy_repeats)


def _corpus_spec(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CorpusSpec:
    """The corpus `args` ask for (sizes, retrieval share and formats, fitted lengths, needle values), checked: a
    bad value stops the command through `parser.error`."""
    if args.docs <= 0 or args.min_sentences <= 0 or args.max_sentences < args.min_sentences:
        parser.error("need --docs > 0 and 0 < --min-sentences <= --max-sentences")
    if args.facts <= 0 or not 0.0 <= args.retrieval <= 1.0:
        parser.error("need --facts > 0 and --retrieval in [0, 1]")
    formats = []
    for item in args.formats.split(","):
        name, _, weight = item.partition("=")
        try:
            formats.append((name, float(weight)))
        except ValueError:
            parser.error(f"--formats {item!r}: expected FORMAT=WEIGHT")
        if name not in RETRIEVAL_FORMATS or formats[-1][1] < 0:
            parser.error(f"--formats {item!r}: formats are {', '.join(RETRIEVAL_FORMATS)} with weights >= 0")
    if not sum(w for _, w in formats) > 0:
        parser.error("--formats: give at least one format a positive weight")
    try:
        fit = tuple(int(v) for v in args.fit_tokens.split(",") if v.strip())
    except ValueError:
        parser.error(f"--fit-tokens {args.fit_tokens!r}: expected comma-separated integers")
    if any(v < 2 for v in fit):
        parser.error("--fit-tokens: counts must be at least 2")
    try:
        digits = tuple(int(v) for v in args.value_digits.split(":"))
    except ValueError:
        parser.error(f"--value-digits {args.value_digits!r}: expected LO:HI")
    if len(digits) != 2 or not 1 <= digits[0] <= digits[1]:
        parser.error("--value-digits: need 1 <= LO <= HI")
    if not 0.0 <= args.edge_depths <= 1.0:
        parser.error("--edge-depths: need a share in [0, 1]")
    if not 0.0 <= args.value_repeats <= 1.0:
        parser.error("--value-repeats: need a share in [0, 1]")
    return CorpusSpec(args.docs, args.min_sentences, args.max_sentences, args.facts, args.seed, args.retrieval,
                      tuple(formats), fit, args.tokenizer, digits, args.edge_depths, args.value_repeats)


def main(argv: list[str] | None = None) -> int:
    """Write the copy drills (with --copy-period) or the corpus to --out, and say how many; returns 0."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.copy_period:
        cspec = _copy_spec(parser, args)
        out = write_jsonl(args.out, generate_copies(cspec))
        print(f"wrote {cspec.num_docs} copy drills to {out}")
        return 0
    spec = _corpus_spec(parser, args)
    out = write_jsonl(args.out, generate(spec))
    print(f"wrote {spec.num_docs} documents to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
