"""Argument types shared by the `mtrain bench` subcommands (no torch import)."""

from __future__ import annotations

import argparse

_SIZES = {"K": 1 << 10, "M": 1 << 20}


def token_count(text: str) -> int:
    """An argparse type: a token count (131072, 128K, 1M). argparse reports a bad one as a usage error naming the
    option (an MtrainError raised here would escape parse_args as a traceback)."""
    text = text.strip().upper()
    try:
        return int(text[:-1]) * _SIZES[text[-1]] if text[-1:] in _SIZES else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a token count; write e.g. 131072, 128K or 1M") from None


def token_counts(text: str) -> list[int]:
    """An argparse type: comma-separated token counts."""
    return [token_count(x) for x in text.split(",") if x.strip()]


def format_tokens(n: int) -> str:
    """128K, 1M, or the plain count when it is not a multiple of 1024."""
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % (1 << 10) == 0 else str(n)
