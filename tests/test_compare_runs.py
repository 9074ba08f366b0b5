"""`mtrain compare`: a continued run on its parent's token axis, and the eval scores of runs side by side."""

from __future__ import annotations

import json

import yaml

from mtrain.compare import format_eval_table, summarize, token_offsets


def _run(root, name, tokens, model_path=None, results=None):
    run = root / name
    run.mkdir()
    rows = [{"step": s, "tokens": s * tokens, "loss": 5.0 / s, "tokens_per_s": 100.0} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"train": {"output_dir": str(run)}, "model": {"path": model_path} if model_path else {"config": "x"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    if results is not None:
        (run / "eval").mkdir()
        (run / "eval" / "results.json").write_text(json.dumps(results))
    return str(run)


def test_stage_two_continues_stage_one_token_axis(tmp_path):
    one = _run(tmp_path, "tiny", 1000)
    two = _run(tmp_path, "tiny-extend", 8000, model_path=str(tmp_path / "tiny" / "final"))
    twin = _run(tmp_path, "tiny-extend-dense", 8000, model_path=str(tmp_path / "tiny" / "checkpoints" / "step-2"))
    other = _run(tmp_path, "other", 10, model_path=str(tmp_path / "elsewhere" / "final"))
    summaries = [summarize(r) for r in (one, two, twin, other)]
    assert token_offsets(summaries) == [0, 2000, 2000, 0]
    assert token_offsets(summaries[1:]) == [0, 0, 0]  # the parent is not compared: no offset


def test_eval_scores_side_by_side(tmp_path, capsys):
    from mtrain.cli import main

    niah = {"1024": {"0.0": 100.0, "50.0": 50.0}, "8192": {"0.0": 100.0, "50.0": 100.0}}
    ruler = {"1024": {"average": 12.5, "tasks": 13}, "8192": {"average": 4.0, "tasks": 13}}
    one = _run(tmp_path, "tiny", 1000)
    two = _run(tmp_path, "tiny-extend", 8000, str(tmp_path / "tiny" / "final"), {"tasks": {}, "niah": niah,
                                                                                   "ruler": ruler})
    twin = _run(tmp_path, "tiny-extend-dense", 8000, str(tmp_path / "tiny" / "final"),
                {"tasks": {}, "niah": {"1024": {"0.0": 0.0}}})
    table = format_eval_table([summarize(r) for r in (one, two, twin)]).splitlines()
    assert table[0].split() == ["run", "NIAH", "1K", "NIAH", "8K", "RULER", "avg", "1K", "RULER", "avg", "8K"]
    assert table[2].split() == ["tiny-extend", "75.0", "100.0", "12.5", "4.0"]
    assert table[3].split() == ["tiny-extend-dense", "0.0", "-", "-", "-"]
    assert format_eval_table([summarize(one)]) is None
    plot = tmp_path / "cmp.png"
    assert main(["compare", one, two, twin, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "eval scores" in out and "tiny-extend-dense" in out and plot.stat().st_size > 0
