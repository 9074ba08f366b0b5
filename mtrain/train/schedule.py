"""Learning-rate schedules: warmup + cosine to a floor, and rewarm-then-decay for midtraining."""

from __future__ import annotations

import math


def lr_factor(step: int, total: int, *, schedule: str, warmup: int, min_ratio: float, start_ratio: float = 0.0) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based) of `total`.

    cosine: linear warmup from 0 over `warmup` steps, then cosine from 1 down to `min_ratio`.
    rewarm: the same shape, but the warmup starts from `start_ratio` (the LR the previous stage ended
    on), which is how midtraining re-raises the LR for a data-distribution shift before decaying.
    constant: 1 after warmup.
    """
    if warmup > 0 and step < warmup:
        lo = start_ratio if schedule == "rewarm" else 0.0
        return lo + (1.0 - lo) * (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_steps(total: int, warmup_steps: int, warmup_ratio: float) -> int:
    return warmup_steps if warmup_steps > 0 else int(round(total * warmup_ratio))
