"""Every Markdown link and every file path a Markdown document cites (README.md, BENCHMARKS.md, docs/, ...) exists
in the repository; no file cites documents that live outside it.

Reads tracked files only (`git ls-files` is the truth for what exists), so it takes well under a second.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import subprocess
import unicodedata
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What a path in a document may name without it being tracked: outputs that commands create (runs, packed and
# synthetic data, converted models, eval results, the parts carried to a GPU machine) and data a user downloads.
GENERATED = ("runs/", "data/packed/", "data/synthetic/", "data/longdocs/", "data/eval/", "data/cache/",
             "models/", "eval/results/", "eval/cache/", ".carry/", ".fa4carry/", "wandb/", ".venv/")

# Top-level folders of the repository: a backticked token starting with one of them is read as a path.
REPO_DIRS = ("scripts/", "mtrain/", "recipes/", "configs/", "tests/", "data/", "eval/", "docs/")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".sh")

# Documents that were never in the repository (written split, so this file does not mention them itself).
OUTSIDE = ("../" + "shared", "PERF" + ".md", "DESIGN" + ".md", "STYLE" + ".md", "ENV" + ".md", "KINDS" + ".md")
OUTSIDE_SECTION = re.compile(r"\bDESIGN" + r"\s*§?\s*\d")  # a design-section citation: the word, an optional section sign, a number


@functools.lru_cache(maxsize=1)
def tracked() -> tuple[str, ...]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: what is tracked is unknown")
    return tuple(p for p in out.decode().split("\0") if p)


@functools.lru_cache(maxsize=1)
def tracked_dirs() -> frozenset[str]:
    return frozenset(str(parent) for p in tracked() for parent in PurePosixPath(p).parents if str(parent) != ".")


def markdown_files() -> list[str]:
    return [p for p in tracked() if p.endswith(".md") and (ROOT / p).is_file()]


def read(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


FENCE = re.compile(r"^\s*(```|~~~)")


def split_fenced(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose lines, lines inside fenced code blocks), each as (line number, text)."""
    prose, code, fence = [], [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            continue
        (code if fence else prose).append((n, line))
    return prose, code


CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)")  # [name]: path, for [text][name] links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower().strip()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: str) -> frozenset[str]:
    prose, _ = split_fenced(read(path))
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose:
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(path: str):
    prose, _ = split_fenced(read(path))
    for n, line in prose:
        line = CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)
        for m in (*LINK.finditer(line), *LINK_DEFINITION.finditer(line)):
            yield n, m.group(1)


def broken_link(source: str, target: str) -> str | None:
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    if path:
        if path.startswith("/"):
            return "absolute path (a link into the repository is relative)"
        resolved = PurePosixPath(source).parent / path
        parts: list[str] = []
        for part in resolved.parts:
            if part == "..":
                if not parts:
                    return "leaves the repository"
                parts.pop()
            elif part != ".":
                parts.append(part)
        name = "/".join(parts)
        if name not in tracked() and name.rstrip("/") not in tracked_dirs():
            return "no such tracked file"
    else:
        name = source
    if anchor and name.endswith(".md") and anchor.lower() not in anchors(name):
        return f"no heading '#{anchor}' in {name}"
    return None


def test_markdown_links_resolve():
    bad = [f"{md}:{n}: ({target}): {why}"
           for md in markdown_files() for n, target in links(md)
           if (why := broken_link(md, target))]
    assert not bad, "broken Markdown links:\n" + "\n".join(bad)


TOKEN_EDGE = "\"'`,;:()[]<>"


def path_tokens(span: str):
    """Tokens of a code span that look like repository file paths."""
    for raw in re.split(r"[\s=]+", span):
        token = re.sub(r":[\w-]*$", "", raw.strip(TOKEN_EDGE).rstrip("."))  # data.jsonl:jsonl, config.py:12
        if token.startswith("./"):
            token = token[2:]
        if not token or "://" in token or token.startswith(("/", "~", "$", "-")):
            continue
        if re.fullmatch(r"[A-Z][A-Z0-9_]*|<[^>]*>", token.split("/", 1)[0]):  # RUN_DIR/..., OUT/...: a user's folder
            continue
        if token.startswith(REPO_DIRS) or ("/" in token and token.endswith(FILE_SUFFIXES)):
            yield token


def expand_braces(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in expand_braces(token[:m.start()] + alt + token[m.end():])]


def as_pattern(token: str) -> str:
    """Placeholders (`KIND`, `DIR`, `<name>`, `...`, `N`) as glob wildcards."""
    token = re.sub(r"<[^>]*>|\.\.\.|…", "*", token)
    return re.sub(r"(?<![A-Za-z])[A-Z][A-Z_]*(?![A-Za-z])", "*", token)


def path_exists(token: str) -> bool:
    if token.startswith(GENERATED):
        return True
    files, dirs = tracked(), tracked_dirs()
    for name in expand_braces(token):
        name = name.rstrip("/")
        if name in files or name in dirs:
            continue
        pattern = as_pattern(name)
        if any(c in pattern for c in "*?[") and any(fnmatch.fnmatchcase(p, pattern) for p in (*files, *dirs)):
            continue
        return False
    return True


def cited_paths(path: str):
    prose, code = split_fenced(read(path))
    for n, line in prose:
        for m in CODE_SPAN.finditer(line):
            for token in path_tokens(m.group(2)):
                yield n, token
    for n, line in code:  # commands and their comments
        for token in path_tokens(line):
            yield n, token


def test_documents_cite_only_files_that_exist():
    bad = [f"{md}:{n}: {token}" for md in markdown_files() for n, token in cited_paths(md) if not path_exists(token)]
    assert not bad, "paths cited in Markdown that are not in the repository:\n" + "\n".join(bad)


def test_no_file_cites_documents_outside_the_repository():
    bad = []
    for p in tracked():
        try:
            text = (ROOT / p).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if any(name in line for name in OUTSIDE) or OUTSIDE_SECTION.search(line):
                bad.append(f"{p}:{n}: {line.strip()[:120]}")
    assert not bad, "mentions of documents that are not in the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("heading, expected", [
    ("Set-up and tests", "set-up-and-tests"),
    ("Quickstart: the embedded default", "quickstart-the-embedded-default"),
    ("Baseline attention kinds: moba, xattention, ulysses", "baseline-attention-kinds-moba-xattention-ulysses"),
    ("Ring attention on 2 GPUs (`scripts/bench_ring.py`)", "ring-attention-on-2-gpus-scriptsbench_ringpy"),
    ("Fidelity: SmolLM2-135M 8K→32K (issue #14)", "fidelity-smollm2-135m-8k32k-issue-14"),
])
def test_slug_is_githubs(heading, expected):
    assert slug(heading) == expected
