"""Kinds of real text that need no download, for measuring sparse attention's quality on more than one kind.

Every kind is read from files that ship with this Python or with a package mtrain installs, in a fixed order, so
one installation always yields the same text:

- ``prose``: English expository prose, CPython's reference documentation topics (`pydoc_data.topics`), then the
  standard library's long docstrings (`mtrain.data.prose`; the text the real-model benchmark has always read).
  No long narrative or literary text ships with Python or with mtrain's packages, so this is the nearest kind.
- ``docs``: technical API documentation, the standard library's module, class and function docstrings of 200
  characters or more, read with `ast` (no module is imported): parameter lists, return values, examples.
- ``code``: Python source, the standard library's ``.py`` files whole (tests, site-packages and idlelib left out).
- ``dialogue``: machine dialogue, two-speaker conversations between NLTK's rule-based chatbots (ELIZA, Iesha,
  Rude, Sun Tzu, Zen; `nltk.chat`, installed with rouge-score), each answering the other's last line with
  Python's `random` seeded: short conversational turns, repetitive, generated rather than written by people.
"""

from __future__ import annotations

import ast
import os
import random
import sysconfig
from collections.abc import Callable, Iterator

from mtrain.data.prose import tokens_of
from mtrain.errors import MtrainError

TEXT_KINDS = ("prose", "docs", "code", "dialogue")
"""The kinds `text_tokens` reads, in the order the benchmarks list them."""

TEXT_LABELS = {
    "prose": "English prose (CPython's reference documentation topics)",
    "docs": "API documentation (the standard library's docstrings)",
    "code": "Python source (the standard library's .py files)",
    "dialogue": "machine dialogue (NLTK's rule-based chatbots talking to each other)",
}


def _stdlib_files() -> Iterator[str]:
    """The standard library's .py files in a fixed order, without tests, site-packages and idlelib."""
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def _docs() -> Iterator[str]:
    from mtrain.data.prose import stdlib_docstrings

    yield from stdlib_docstrings()


def _prose() -> Iterator[str]:
    from mtrain.data.prose import reference_topics, stdlib_docstrings

    yield from reference_topics()
    yield from stdlib_docstrings()


def _code() -> Iterator[str]:
    for path in _stdlib_files():
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        if source.strip():
            yield source.rstrip() + "\n\n\n"


def _dialogue(turns: int = 12, seed: int = 0) -> Iterator[str]:
    """Conversations of `turns` lines between every ordered pair of NLTK's chatbots, round after round: the
    first speaker opens with one of its own answers to "Hello.", then each answers the other's last line."""
    try:
        from nltk.chat.eliza import eliza_chatbot
        from nltk.chat.iesha import iesha_chatbot
        from nltk.chat.rude import rude_chatbot
        from nltk.chat.suntsu import suntsu_chatbot
        from nltk.chat.zen import zen_chatbot
    except ImportError as exc:
        raise MtrainError(f"text kind 'dialogue' reads nltk's chatbots (nltk comes with rouge-score): {exc}") from exc
    bots = {"ELIZA": eliza_chatbot, "IESHA": iesha_chatbot, "RUDE": rude_chatbot, "SUN TZU": suntsu_chatbot,
            "ZEN": zen_chatbot}
    pairs = [(a, b) for a in bots for b in bots if a != b]
    state = random.getstate()  # Chat.respond draws from the module's generator: seed it, give it back untouched
    try:
        random.seed(seed)
        while True:
            for a, b in pairs:
                line = bots[a].respond("Hello.") or "Hello."
                lines = [f"{a}: {line}"]
                speakers = (b, a)
                for turn in range(turns - 1):
                    name = speakers[turn % 2]
                    answer = bots[name].respond(line)
                    if not answer:
                        break
                    line = answer
                    lines.append(f"{name}: {line}")
                yield "\n".join(lines) + "\n\n"
    finally:
        random.setstate(state)


SOURCES: dict[str, Callable[[], Iterator[str]]] = {"prose": _prose, "docs": _docs, "code": _code,
                                                   "dialogue": _dialogue}


def kind_text(kind: str, min_chars: int) -> str:
    """At least `min_chars` characters of text of `kind` (fewer only if the installation holds less; then all of
    it; `dialogue` never runs out)."""
    if kind not in SOURCES:
        raise MtrainError(f"text kind '{kind}' is not one of {', '.join(TEXT_KINDS)}")
    parts: list[str] = []
    total = 0
    for piece in SOURCES[kind]():
        parts.append(piece)
        total += len(piece)
        if total >= min_chars:
            break
    return "".join(parts)


def text_tokens(tokenizer, n_tokens: int, kind: str = "prose", *, bos: bool = True) -> list[int]:
    """`n_tokens` token ids of text of `kind` (TEXT_KINDS), with the tokenizer's BOS first when it has one and
    `bos`. `prose` gives exactly `mtrain.data.prose.prose_tokens`."""
    out = tokens_of(tokenizer, n_tokens, lambda chars: kind_text(kind, chars), bos=bos)
    if len(out) < n_tokens:
        raise MtrainError(f"this installation holds only {len(out)} tokens of {kind}; asked for {n_tokens}")
    return out
