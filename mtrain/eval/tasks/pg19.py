"""PG-19 perplexity: per length L, exp(sum NLL / sum tokens) over the first L tokens of every document of >= L tokens.

Books come from the PG-19 test split (`pg19_path`: a folder of .txt files); `pg19_path: synthetic` uses held-out
documents of the embedded default's corpus kind instead.
"""

from __future__ import annotations

import os

from mtrain.errors import MtrainError
from mtrain.eval.registry import BuildContext, Sample, Task, register
from mtrain.eval.text import SYNTHETIC, require_path, synthetic_documents


def _documents(ctx: BuildContext, length: int, requested: int) -> list[str]:
    path = ctx.params.get("pg19_path")
    if path == SYNTHETIC:
        key = f"pg19-synthetic/{length}"
        if key not in ctx.memo:
            ctx.memo[key] = synthetic_documents(ctx.seed, requested, 2 * length)
        return ctx.memo[key]
    if "pg19-books" not in ctx.memo:
        folder = require_path(path, "pg19", "pg19_path")
        names = sorted(n for n in os.listdir(folder) if n.endswith(".txt")) if os.path.isdir(folder) else []
        if not names:
            raise MtrainError(f"pg19_path {folder!r} holds no .txt books; point it at the PG-19 test/ folder")
        books = []
        for name in names:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                books.append(f.read())
        ctx.memo["pg19-books"] = books
    return ctx.memo["pg19-books"]


def _first_tokens(ctx: BuildContext, text: str, length: int) -> list[int] | None:
    """The first `length` token ids of `text`, or None if it has fewer (tokenizing only a prefix when it suffices)."""
    chars = 12 * length  # no tokenizer here packs more than ~12 characters per token on prose
    ids = ctx.encode(text[:chars])
    if len(ids) < length and chars < len(text):
        ids = ctx.encode(text)
    return ids[:length] if len(ids) >= length else None


def _eligible(ctx: BuildContext, length: int, requested: int) -> list[tuple[int, list[int]]]:
    """(document index, first `length` ids) of the first `requested` documents with at least `length` tokens."""
    key = f"pg19-eligible/{length}/{requested}"
    if key not in ctx.memo:
        chosen = []
        for doc, text in enumerate(_documents(ctx, length, requested)):
            ids = _first_tokens(ctx, text, length)
            if ids is not None:
                chosen.append((doc, ids))
                if len(chosen) == requested:
                    break
        ctx.memo[key] = chosen
    return ctx.memo[key]


def count(ctx: BuildContext, length: int, requested: int) -> int:
    return len(_eligible(ctx, length, requested))


def build(ctx: BuildContext, length: int, index: int) -> Sample:
    doc, ids = _eligible(ctx, length, ctx.params["samples"])[index]
    return Sample(index, length, ids, [], {"document": doc})


register(Task(
    name="pg19", family="pg19", kind="loglik", metric="perplexity", max_new_tokens=0, stop=(), build=build,
    count=count, source="pg19_path (PG-19 test books, or synthetic)",
    check_data=lambda p: p.get("pg19_path") == SYNTHETIC or require_path(p.get("pg19_path"), "pg19", "pg19_path"),
))
