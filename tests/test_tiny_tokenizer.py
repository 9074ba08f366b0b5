"""The tiny tokenizer builder (`python -m mtrain.data.tiny_tokenizer`) rebuilds the shipped tokenizer exactly."""

from __future__ import annotations

import json

import pytest

from mtrain.data.tiny_tokenizer import main
from mtrain.tiny import TOKENIZER_DIR


def test_rebuild_gives_the_shipped_tokenizer(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "tok")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text()) == \
        json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())


def test_old_command_names_the_new_one(capsys):
    from mtrain.tiny import main as tiny_main

    with pytest.raises(SystemExit) as exc:
        tiny_main(["--rebuild-tokenizer"])
    assert exc.value.code == 2
    assert "python -m mtrain.data.tiny_tokenizer" in capsys.readouterr().err
