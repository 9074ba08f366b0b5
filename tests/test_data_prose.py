"""mtrain.data.prose: this Python's own prose as training documents and a held-out set that shares no text."""

import json
import subprocess
import sys

from mtrain.data.prose import split_prose, stdlib_prose


def test_split_prose_writes_disjoint_training_and_heldout_text(tmp_path):
    train, heldout = tmp_path / "p" / "train.jsonl", tmp_path / "heldout"
    n_docs, chars = split_prose(str(train), str(heldout), books=3, doc_chars=50000)
    docs = [json.loads(line)["text"] for line in train.read_text().splitlines()]
    books = sorted(heldout.glob("*.txt"))
    assert len(docs) == n_docs > 5 and len(books) == 3
    held = "".join(b.read_text() for b in books)
    assert len(held) == chars and stdlib_prose(chars).startswith(held)  # the reference topics, whole, in order
    assert all(len(d) >= 50000 for d in docs[:-1])
    sample = held[1000:1200]  # a passage of the held-out text occurs in no training document
    assert not any(sample in d for d in docs)
    assert not list(tmp_path.rglob("*.tmp"))  # written atomically


def test_cli_refuses_zero_books(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mtrain.data.prose", "--train", str(tmp_path / "t.jsonl"),
                          "--heldout", str(tmp_path / "h"), "--books", "0"], capture_output=True, text=True)
    assert run.returncode == 2 and "--books must be >= 1" in run.stderr
