"""Haystacks shared by the needle tasks: noise, essays (files or synthetic prose), distractor needles.

`needle_prompt` sizes the filler with the tokenizer so prompt + answer fits the length, needles placed by depth.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from mtrain.errors import MtrainError
from mtrain.eval.prompting import fit_largest, insert_at_depths
from mtrain.eval.registry import BuildContext
from mtrain.eval.text import NOISE, load_essay_words, split_sentences

HAYSTACKS = ("noise", "essay", "needle")


def essay_words(ctx: BuildContext, length: int) -> list[str]:
    """The essay haystack's word stream: the suite's essay files, or (essay_path: synthetic) generated filler.

    Every word is at least one token, so `length` words always suffice to fill `length` tokens.
    """
    return load_essay_words(ctx.params.get("essay_path"), length, ctx.seed)


def needle_prompt(
    ctx: BuildContext,
    length: int,
    max_new_tokens: int,
    *,
    haystack: str,
    make_prompt: Callable[[str], str],
    needles: Sequence[str],
    depths: Sequence[float] | None,
    rng: random.Random,
    distractor: Callable[[random.Random], str] | None = None,
    offset: int = 0,
) -> tuple[list[int], dict, str]:
    """Ids, metadata and text of the longest prompt with `needles` in a haystack within `length - max_new_tokens`.

    depths: fractions in [0, 1] per needle; None places them at random unit boundaries (RULER's noise/needle
    haystacks). Essay haystacks insert at sentence boundaries and join with spaces; noise and needle
    haystacks are lists of items joined by newlines (as RULER builds them).
    """
    if haystack not in HAYSTACKS:
        raise MtrainError(f"unknown haystack {haystack!r}; choose one of {', '.join(HAYSTACKS)}")
    budget = length - max_new_tokens
    if haystack == "essay":
        words = essay_words(ctx, length)
        # the same fraction of the way into the haystack whatever its size: fix relative draws once
        fixed = list(depths) if depths is not None else [rng.random() for _ in needles]

        def units(n: int) -> tuple[list[str], str]:
            stream = [words[(offset + i) % len(words)] for i in range(n)]
            return insert_at_depths(split_sentences(" ".join(stream)), needles, fixed), " "
    else:
        pool_rng = random.Random(rng.random())
        draws = [rng.random() for _ in needles]
        pool: list[str] = []

        def units(n: int) -> tuple[list[str], str]:
            if haystack == "noise":
                items = [NOISE] * n
            else:
                while len(pool) < n:  # a prefix-stable list of distractors, so n and n+1 differ by one item
                    pool.append(distractor(pool_rng))
                items = pool[:n]
            chosen = list(depths) if depths is not None else draws
            return insert_at_depths(items, needles, chosen), "\n"

    def make_text(n: int) -> str:
        items, sep = units(n)
        return make_prompt(sep.join(items))

    memo_key = f"fit/{haystack}/{length}"
    n, ids = fit_largest(lambda n: ctx.encode(make_text(n)), budget, ctx.memo.get(memo_key, max(1, budget // 16)))
    ctx.memo[memo_key] = n
    return ids, {"haystack_units": n}, make_text(n)
