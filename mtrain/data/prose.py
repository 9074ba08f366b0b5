"""Real English prose that needs no download: the text every CPython installation carries.

First the reference documentation in `pydoc_data.topics` (about 465K characters of English prose about
the language), then, where more is wanted, the docstrings of the standard library's Python sources read
with `ast` (no module is imported). The order is fixed, so a given Python version always yields the same
text; tests and benchmarks that compare dense with sparse attention use it as held-out real text.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from collections.abc import Iterator


def _topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key].strip() + "\n\n"


def _docstrings() -> Iterator[str]:
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as fh:
                    tree = ast.parse(fh.read())
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 200:  # paragraphs, not one-line summaries
                        yield doc.strip() + "\n\n"


def stdlib_prose(min_chars: int) -> str:
    """At least `min_chars` characters of English prose from this Python's own files (fewer only if the
    installation holds less; then the whole of it)."""
    parts: list[str] = []
    total = 0
    for source in (_topics, _docstrings):
        for piece in source():
            parts.append(piece)
            total += len(piece)
            if total >= min_chars:
                return "".join(parts)
    return "".join(parts)


def prose_tokens(tokenizer, n_tokens: int, *, bos: bool = True) -> list[int]:
    """`n_tokens` token ids of stdlib prose (with the tokenizer's BOS first when it has one and `bos`)."""
    ids: list[int] = []
    if bos and getattr(tokenizer, "bos_token_id", None) is not None:
        ids.append(tokenizer.bos_token_id)
    chars = 6 * n_tokens
    while True:
        text = stdlib_prose(chars)
        body = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) + len(body) >= n_tokens or len(text) < chars:
            break
        chars *= 2
    out = (ids + body)[:n_tokens]
    if len(out) < n_tokens:
        raise ValueError(f"this Python's files hold only {len(out)} tokens of prose; asked for {n_tokens}")
    return out
