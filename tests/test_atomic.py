"""mtrain.atomic: a write lands whole or not at all."""

from __future__ import annotations

import json

import pytest

from mtrain.atomic import atomic_path, write_json_atomic, write_text_atomic


def test_write_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.txt"  # the folder is made
    write_text_atomic(path, "first\n")
    write_text_atomic(path, "second\n")
    assert path.read_text() == "second\n"
    write_json_atomic(tmp_path / "o.json", {"b": 1, "a": [2]}, sort_keys=True)
    assert json.loads((tmp_path / "o.json").read_text()) == {"a": [2], "b": 1}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["o.json", "out.txt", "sub"]


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("mid-write")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
