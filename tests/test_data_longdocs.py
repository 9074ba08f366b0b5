"""mtrain.data.longdocs: long real documents from the Python installation (code repositories, books), packed with
SmolLM2's tokenizer through data/smollm2-512k.yaml as the 4-GPU runs read them."""

import json

import pytest
import shutil
from pathlib import Path

import numpy as np

from mtrain.data.longdocs import code_repos, write_long_docs
from ranks import run_cli
from real_model import require_real_model

REPO = Path(__file__).resolve().parents[1]


def _docs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_code_repositories_and_books(tmp_path):
    stats = write_long_docs(tmp_path / "a", code_chars=600_000, packages=["mtrain"], min_doc_chars=20_000,
                            max_doc_chars=150_000)
    code, books = _docs(tmp_path / "a" / "code.jsonl"), _docs(tmp_path / "a" / "books.jsonl")
    assert stats["code"]["documents"] == len(code) >= 4 and stats["books"]["documents"] == len(books) >= 2
    assert stats["code"]["characters"] == sum(len(d["text"]) for d in code) >= 600_000
    for d in code:  # whole files, each after its path; cut only at file boundaries
        assert d["text"].startswith("# file: ") and len(d["text"]) >= 20_000
        pieces = d["text"].split("\n# file: ")
        assert len(d["text"]) - len(pieces[-1]) <= 150_000, d["name"]  # only a last file may pass the cap
        assert "def " in d["text"] or "class " in d["text"]
    assert len({d["name"] for d in code}) == len(code)
    assert not any("pydoc_data" in d["name"] for d in code)  # the reference documentation is a book
    names = [d["name"] for d in books]
    assert names[:2] == ["python-reference", "stdlib-docstrings"]
    from pydoc_data.topics import topics

    assert topics["assert"].strip()[:200] in books[0]["text"]
    # the same installation gives the same bytes
    write_long_docs(tmp_path / "b", code_chars=600_000, packages=["mtrain"], min_doc_chars=20_000,
                    max_doc_chars=150_000)
    assert (tmp_path / "a" / "code.jsonl").read_bytes() == (tmp_path / "b" / "code.jsonl").read_bytes()
    assert not list(tmp_path.rglob("*.tmp"))
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == stats  # written last: both files are there


def test_stopped_between_the_two_outputs_writes_both_again(tmp_path, monkeypatch):
    """Killed while writing books.jsonl (after code.jsonl was complete): no manifest is left, and the next run writes
    both and the manifest (before: code.jsonl alone was in place, the Makefile's target, so `make data-long` never
    wrote books.jsonl)."""
    from mtrain.data import longdocs

    out = tmp_path / "docs"
    real_books = longdocs.books

    def killed(**kwargs):
        yield from ()
        raise KeyboardInterrupt

    monkeypatch.setattr(longdocs, "books", killed)
    with pytest.raises(KeyboardInterrupt):
        longdocs.write_long_docs(out, code_chars=300_000, packages=["mtrain"], min_doc_chars=20_000)
    assert not (out / "manifest.json").exists() and not (out / "code.jsonl").exists()
    monkeypatch.setattr(longdocs, "books", real_books)
    stats = longdocs.write_long_docs(out, code_chars=300_000, packages=["mtrain"], min_doc_chars=20_000)
    assert (out / "code.jsonl").exists() and (out / "books.jsonl").exists()
    assert json.loads((out / "manifest.json").read_text()) == stats


def test_repositories_in_order(tmp_path):
    """The standard library's packages (sorted), its top-level modules as one repository, then the named
    installed packages (missing ones skipped); short repositories left out."""
    lib = tmp_path / "lib"
    for pkg, size in (("zeta", 3000), ("alpha", 3000), ("tiny", 10), ("__phello__", 3000), ("site-packages", 3000)):
        (lib / pkg).mkdir(parents=True)
        (lib / pkg / "__init__.py").write_text(f"# {pkg}\n" + "x = 1\n" * size)
    (lib / "mod.py").write_text("def f():\n    return 1\n" * 1000)
    docs = list(code_repos(["mtrain", "no_such_package_xyz"], min_doc_chars=1000, stdlib=str(lib)))
    assert [name for name, _ in docs] == ["cpython/alpha", "cpython/zeta", "cpython/modules", "mtrain"]
    assert docs[0][1].startswith("# file: alpha/__init__.py\n# alpha\n")
    assert "# file: mtrain/data/longdocs.py\n" in docs[-1][1]


@pytest.mark.slow
def test_pack_long_documents_with_the_real_tokenizer(tmp_path):
    """The CLI writes the sources data/smollm2-512k.yaml names; `mtrain pack` of that manifest with SmolLM2's
    tokenizer gives samples of exactly seq_len tokens in which documents longer than a sample fill it whole
    (document spans as ProLong's `indices`), in the mixture's shares."""
    model = require_real_model()
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(REPO / "data" / "smollm2-512k.yaml", data)
    run = run_cli("--out", str(data / "longdocs"), "--code-chars", "400000", "--min-doc-chars", "30000",
                  module="mtrain.data.longdocs")  # python -m, forked from the CLI's server (tests/ranks.py)
    assert run.returncode == 0, run.stderr
    assert "code:" in run.stdout and "books:" in run.stdout
    seq = 16384
    pack = run_cli("pack", str(data / "smollm2-512k.yaml"), "--tokenizer", str(model), "--seq-len", str(seq),
                   "--total-tokens", str(6 * seq), "--out", str(data / "packed"), "--no-progress", "--workers", "1")
    assert pack.returncode == 0, pack.stderr[-2000:]
    summary = json.loads(pack.stdout.strip().splitlines()[-1])
    assert summary["num_samples"] >= 6 and summary["seq_len"] == seq
    assert set(summary["shares"]) == {"code-repos", "books"}  # (shares are coarse: a document may pass its budget)
    from mtrain.data.mds import MDSFolder

    folder = MDSFolder(str(data / "packed"))
    whole = 0
    for i in range(len(folder)):
        sample = folder[i]
        ids, spans = np.asarray(sample["input_ids"]), np.asarray(sample["indices"]).reshape(-1, 2)
        assert len(ids) == seq and ids.max() < 49152  # SmolLM2's vocabulary
        assert spans[0][0] == 0 and spans[-1][1] == seq and (spans[1:, 0] == spans[:-1, 1]).all()
        whole += len(spans) == 1
    assert whole >= 2  # long documents fill whole samples
