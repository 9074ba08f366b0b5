"""Long real documents that need no download, of the two kinds ProLong's 512K stage is made of: code
repositories and books.

- code repositories: every Python source file of a package concatenated into one document (files in sorted
  order, each after a `# file: PATH` line), first the standard library's packages (its top-level modules
  together as one more repository), then installed packages named by the caller (e.g. torch, transformers);
  a repository longer than `max_doc_chars` is cut at file boundaries into several documents;
- books: long English prose this Python carries: the reference documentation (`pydoc_data.topics`) as one
  book, the standard library's docstrings as another (both from `mtrain.data.prose`), and the license texts
  of the standard library and of the installed distributions as a third.

Everything is read as text (no module is imported); the order is fixed, so a given installation always gives
the same documents. `write_long_docs` writes them as two jsonl sources (field `text`) for `mtrain pack`
(see data/smollm2-512k.yaml).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator

from mtrain.data.prose import reference_topics, stdlib_docstrings
from mtrain.atomic import write_json_atomic
from mtrain.errors import MtrainError

SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages"}
# pydoc_data's one module holds the reference documentation as a string: it is a book (`books`), not code
NOT_CODE = {"pydoc_data"}


def _python_files(root: str) -> list[str]:
    """The .py files under `root`, sorted, without caches and installed packages."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return found


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _repository(name: str, files: Iterable[str], base: str, max_doc_chars: int) -> Iterator[tuple[str, str]]:
    """(name, text) documents of one repository: its files concatenated (each after its path relative to
    `base`), cut at file boundaries so that no
    document passes `max_doc_chars` (unless one file alone does); parts are named NAME#1, NAME#2, ..."""
    parts, size, part = [], 0, 0
    for path in files:
        text = _read(path)
        if not text or not text.strip():
            continue
        piece = f"# file: {os.path.relpath(path, base)}\n{text.rstrip()}\n\n"
        if parts and size + len(piece) > max_doc_chars:
            part += 1
            yield f"{name}#{part}", "".join(parts)
            parts, size = [], 0
        parts.append(piece)
        size += len(piece)
    if parts:
        yield (f"{name}#{part + 1}" if part else name), "".join(parts)


def code_repos(packages: Iterable[str] = (), *, min_doc_chars: int = 50_000,
               max_doc_chars: int = 4_000_000, stdlib: str | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) code-repository documents: the standard library's packages in sorted order, then its
    top-level modules as one repository, then each of `packages` (import names of installed packages;
    missing ones are skipped). Repositories shorter than `min_doc_chars` are left out."""
    root = stdlib or sysconfig.get_paths()["stdlib"]
    repos = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_dir() and entry.name not in SKIP_DIRS | NOT_CODE and not entry.name.startswith((".", "_")):
            repos.append((f"cpython/{entry.name}", _python_files(entry.path), root))
    modules = sorted(e.path for e in os.scandir(root) if e.is_file() and e.name.endswith(".py"))
    repos.append(("cpython/modules", modules, root))
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        location = list(spec.submodule_search_locations)[0]
        repos.append((package, _python_files(location), os.path.dirname(location)))
    for name, files, base in repos:
        for doc_name, text in _repository(name, files, base, max_doc_chars):
            if len(text) >= min_doc_chars:
                yield doc_name, text


def _license_texts(stdlib: str | None = None) -> str:
    root = stdlib or sysconfig.get_paths()["stdlib"]
    texts = []
    own = _read(os.path.join(root, "LICENSE.txt"))
    if own:
        texts.append(f"# CPython license\n{own.strip()}\n\n")
    seen = set()
    for where in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
        if not os.path.isdir(where):
            continue
        for dist in sorted(e.name for e in os.scandir(where) if e.name.endswith(".dist-info")):
            folder = os.path.join(where, dist)
            for dirpath, dirnames, filenames in os.walk(folder):
                dirnames.sort()
                for name in sorted(filenames):
                    if not name.upper().startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE")):
                        continue
                    text = _read(os.path.join(dirpath, name))
                    if text and text.strip() and text not in seen:
                        seen.add(text)
                        texts.append(f"# {dist.removesuffix('.dist-info')}: {name}\n{text.strip()}\n\n")
    return "".join(texts)


def books(*, min_doc_chars: int = 50_000, stdlib: str | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) book-length prose documents: the reference documentation, the standard library's
    docstrings, the license texts (each left out when shorter than `min_doc_chars`)."""
    for name, text in (("python-reference", "".join(reference_topics())),
                       ("stdlib-docstrings", "".join(stdlib_docstrings())),
                       ("licenses", _license_texts(stdlib))):
        if len(text) >= min_doc_chars:
            yield name, text


MANIFEST = "manifest.json"


def write_long_docs(out_dir: str | os.PathLike, *, code_chars: int = 40_000_000, packages: Iterable[str] = (),
                    min_doc_chars: int = 50_000, max_doc_chars: int = 4_000_000) -> dict:
    """Write OUT/code.jsonl (code repositories, stopping after the document that reaches `code_chars`
    characters) and OUT/books.jsonl (fields `text` and `name`), then OUT/manifest.json (their statistics), and return
    the statistics. Atomic as a whole: both files are written aside and put in place together, the manifest last, so
    a run stopped anywhere leaves no manifest and the next one writes everything again (`make data-long` waits on
    the manifest)."""
    os.makedirs(out_dir, exist_ok=True)
    manifest = os.path.join(out_dir, MANIFEST)
    if os.path.exists(manifest):
        os.remove(manifest)  # what follows replaces the files it vouched for
    stats, written = {}, []
    sources = {
        "code": code_repos(packages, min_doc_chars=min_doc_chars, max_doc_chars=max_doc_chars),
        "books": books(min_doc_chars=min_doc_chars),
    }
    for kind, docs in sources.items():
        path = os.path.join(out_dir, f"{kind}.jsonl")
        n = chars = longest = 0
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            for name, text in docs:
                fh.write(json.dumps({"name": name, "text": text}) + "\n")
                n, chars, longest = n + 1, chars + len(text), max(longest, len(text))
                if kind == "code" and chars >= code_chars:
                    break
        if n == 0:
            for tmp in [path, *written]:
                os.remove(tmp + ".tmp")
            raise MtrainError(f"no {kind} documents of at least {min_doc_chars} characters in this installation")
        written.append(path)
        stats[kind] = {"documents": n, "characters": chars, "longest": longest}
    for path in written:
        os.replace(path + ".tmp", path)
    write_json_atomic(manifest, stats, indent=1)
    return stats


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write long real documents from this Python installation (no "
                                 "download): code repositories (a package's source files concatenated) as "
                                 "OUT/code.jsonl and books (reference documentation, docstrings, licenses) as "
                                 "OUT/books.jsonl, for `mtrain pack` (data/smollm2-512k.yaml).")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--code-chars", type=int, default=40_000_000,
                    help="stop adding code repositories past this many characters (default 40M, ~12M tokens)")
    ap.add_argument("--packages", default="",
                    help="comma-separated installed packages to add as repositories after the standard library "
                         "(e.g. torch,transformers,numpy; missing ones are skipped)")
    ap.add_argument("--min-doc-chars", type=int, default=50_000, help="leave out shorter documents (default 50K)")
    ap.add_argument("--max-doc-chars", type=int, default=4_000_000,
                    help="cut longer repositories at file boundaries (default 4M characters, ~1M tokens)")
    args = ap.parse_args(argv)
    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    stats = write_long_docs(args.out, code_chars=args.code_chars, packages=packages,
                            min_doc_chars=args.min_doc_chars, max_doc_chars=args.max_doc_chars)
    for kind, s in stats.items():
        print(f"{kind}: {s['documents']} documents, {s['characters']:,} characters (longest {s['longest']:,}) -> "
              f"{os.path.join(args.out, kind + '.jsonl')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
