"""Prompt sizing with the model's own tokenizer and needle insertion at sentence boundaries.

Prompts are built as text, tokenized once (so needles never carry their own BOS), and sized to the length.
"""

from __future__ import annotations

from typing import Callable, Sequence

from mtrain.errors import MtrainError


def fit_largest(make_ids: Callable[[int], list[int]], budget: int, guess: int = 1,
                upper: int | None = None) -> tuple[int, list[int]]:
    """Largest n in [0, upper] with len(make_ids(n)) <= budget (token count nondecreasing in n), and its ids.

    Gallops from `guess` (the previous sample's n, so neighbours cost a few tokenizations) then bisects.
    `upper` bounds a finite filler (documents of a QA set); without it the filler is unbounded.
    """
    base = make_ids(0)
    if len(base) > budget:
        raise MtrainError(f"the prompt without any filler is {len(base)} tokens, over the budget of {budget}; "
                          f"evaluate at a longer length")
    if upper is not None and upper <= 0:
        return 0, base
    n = max(1, guess) if upper is None else min(max(1, guess), upper)
    ids = make_ids(n)
    step = max(1, n // 64)
    if len(ids) <= budget:
        lo, lo_ids = n, ids
        while True:
            if lo == upper:
                return lo, lo_ids
            hi = lo + step if upper is None else min(lo + step, upper)
            hi_ids = make_ids(hi)
            if len(hi_ids) > budget:
                break
            lo, lo_ids, step = hi, hi_ids, step * 2
    else:
        hi = n
        lo, lo_ids = 0, base
        while hi - step > 0:
            cand_ids = make_ids(hi - step)
            if len(cand_ids) <= budget:
                lo, lo_ids = hi - step, cand_ids
                break
            hi, step = hi - step, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        mid_ids = make_ids(mid)
        if len(mid_ids) <= budget:
            lo, lo_ids = mid, mid_ids
        else:
            hi = mid
    return lo, lo_ids


def insert_at_depths(sentences: Sequence[str], needles: Sequence[str], depths: Sequence[float]) -> list[str]:
    """Insert each needle before sentence index int(len(sentences) * depth), depth in [0, 1]; order kept."""
    positions = sorted((min(int(len(sentences) * d), len(sentences)), i) for i, d in enumerate(depths))
    out: list[str] = []
    prev = 0
    for pos, i in positions:
        out += sentences[prev:pos]
        out.append(needles[i])
        prev = pos
    return out + list(sentences[prev:])
