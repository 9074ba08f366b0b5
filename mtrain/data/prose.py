"""Real English prose that needs no download: the text every CPython installation carries.

First the reference documentation in `pydoc_data.topics` (about 465K characters of English prose about
the language), then, where more is wanted, the docstrings of the standard library's Python sources read
with `ast` (no module is imported). The order is fixed, so a given Python version always yields the same
text; tests and benchmarks that compare dense with sparse attention use it as held-out real text.
"""

from __future__ import annotations

import ast
import collections
import functools
import os
import sysconfig
from collections.abc import Iterator


def reference_topics() -> Iterator[str]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key].strip() + "\n\n"


def stdlib_docstrings() -> Iterator[str]:
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield from _file_docstrings(os.path.join(dirpath, name))


# the nodes a docstring's owner can sit under: statements, and the except / case clauses whose bodies hold them
_HOLDS_DEFS = (ast.stmt, ast.excepthandler, ast.match_case)


@functools.lru_cache(maxsize=None)
def _file_docstrings(path: str) -> tuple[str, ...]:
    """The docstrings of one source file of at least 200 characters (paragraphs, not one-line summaries), in
    `ast.walk`'s breadth-first order; parsed once per process (the standard library does not change under it)."""
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return ()
    docs, todo = [], collections.deque([tree])
    while todo:  # ast.walk's order, without descending into expressions (no def or class lies inside one)
        node = todo.popleft()
        todo.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, _HOLDS_DEFS))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 200:
                docs.append(doc.strip() + "\n\n")
    return tuple(docs)


def stdlib_prose(min_chars: int) -> str:
    """At least `min_chars` characters of English prose from this Python's own files (fewer only if the
    installation holds less; then the whole of it)."""
    parts: list[str] = []
    total = 0
    for source in (reference_topics, stdlib_docstrings):
        for piece in source():
            parts.append(piece)
            total += len(piece)
            if total >= min_chars:
                return "".join(parts)
    return "".join(parts)


def tokens_of(tokenizer, n_tokens: int, text_of, *, bos: bool = True) -> list[int]:
    """Up to `n_tokens` token ids of `text_of(min_chars)` (with the tokenizer's BOS first when it has one and
    `bos`), asking for twice the characters until the tokens suffice or the text runs out; fewer when it ran out
    (the caller names what ran short)."""
    ids: list[int] = []
    if bos and getattr(tokenizer, "bos_token_id", None) is not None:
        ids.append(tokenizer.bos_token_id)
    chars = 6 * n_tokens
    while True:
        text = text_of(chars)
        body = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) + len(body) >= n_tokens or len(text) < chars:
            break
        chars *= 2
    return (ids + body)[:n_tokens]


def prose_tokens(tokenizer, n_tokens: int, *, bos: bool = True) -> list[int]:
    """`n_tokens` token ids of stdlib prose (with the tokenizer's BOS first when it has one and `bos`)."""
    out = tokens_of(tokenizer, n_tokens, stdlib_prose, bos=bos)
    if len(out) < n_tokens:
        raise ValueError(f"this Python's files hold only {len(out)} tokens of prose; asked for {n_tokens}")
    return out


def split_prose(train_jsonl: str, heldout_dir: str, *, books: int = 2, doc_chars: int = 20000) -> tuple[int, int]:
    """Write this Python's prose as a training corpus and a held-out set that shares no text with it: the
    standard-library docstrings as `train_jsonl` (field 'text', documents of about `doc_chars` characters), and
    the reference documentation (`pydoc_data.topics`) as `books` .txt files in `heldout_dir` (the layout the
    eval's pg19 task reads). Both written atomically. Returns (training documents, held-out characters)."""
    import json

    os.makedirs(heldout_dir, exist_ok=True)
    topics = "".join(reference_topics())
    size = -(-len(topics) // books)
    for i in range(books):
        path = os.path.join(heldout_dir, f"pydoc-topics-{i}.txt")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(topics[i * size:(i + 1) * size])
        os.replace(path + ".tmp", path)
    docs, part = [], []
    for piece in stdlib_docstrings():
        part.append(piece)
        if sum(map(len, part)) >= doc_chars:
            docs.append("".join(part))
            part = []
    if part:
        docs.append("".join(part))
    os.makedirs(os.path.dirname(os.path.abspath(train_jsonl)), exist_ok=True)
    with open(train_jsonl + ".tmp", "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps({"text": doc}) + "\n")
    os.replace(train_jsonl + ".tmp", train_jsonl)
    return len(docs), len(topics)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write this Python's own prose as a training corpus (stdlib "
                                 "docstrings, jsonl) and a held-out set (the reference documentation, .txt books "
                                 "for the eval's pg19 task). No download.")
    ap.add_argument("--train", required=True, help="output .jsonl of training documents")
    ap.add_argument("--heldout", required=True, help="output folder of held-out .txt books")
    ap.add_argument("--books", type=int, default=2, help="held-out books (default 2)")
    args = ap.parse_args(argv)
    if args.books < 1:
        ap.error("--books must be >= 1")
    n, chars = split_prose(args.train, args.heldout, books=args.books)
    print(f"{n} training documents -> {args.train}; {chars} held-out characters in {args.books} books -> "
          f"{args.heldout}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
