"""tools/train_rows.py: a pair of training runs' metrics.jsonl files as result rows."""

from __future__ import annotations

import json

import pytest

from mtrain.bench.results import read_rows
from tools import train_rows


def _metrics(path, rows, torn=False):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
        if torn:
            fh.write('{"step": 9, "lo')
    return str(path)


def test_rows_of_a_pair(tmp_path):
    sparse = [{"step": s, "loss": 2.0 + 0.01 * s, "tokens_per_s": 300.0 + s, "peak_mem_gb": 12.0,
               "attention_density": 0.2, "attention_true_recall": 0.98 if s % 2 else None} for s in range(1, 6)]
    dense = [{"step": s, "loss": 2.0, "tokens_per_s": 100.0, "peak_mem_gb": 10.0} for s in range(1, 6)]
    a = _metrics(tmp_path / "a.jsonl", [{"event": "start"}, *sparse], torn=True)
    b = _metrics(tmp_path / "b.jsonl", dense)
    out = tmp_path / "rows.jsonl"
    assert train_rows.main(["--measure", "train_docs.m", "--label", "1k.long", "--mtraining", a, "--dense", b,
                            "--gpu", "CPU", "--versions", "v", "--command", "c", "--commit", "", "--out", str(out),
                            "--date", "2026-12-02"]) == 0
    rows = {r["measure"].rsplit(".", 1)[1]: r for r in read_rows(out)}
    assert rows["mtrain_tokens_s"]["value"] == pytest.approx(304.0)  # median of steps 3-5 (2 warm-up steps left out)
    assert rows["speedup"]["value"] == pytest.approx(3.04) and rows["speedup"]["peer"] == "the dense kind"
    assert rows["loss_diff"]["value"] == pytest.approx(statistics_mean([0.5 * s for s in range(1, 6)]))
    assert rows["loss_diff_max"]["value"] == pytest.approx(2.5)
    assert rows["mtrain_peak_gib"]["value"] == 12.0 and rows["dense_peak_gib"]["value"] == 10.0
    assert rows["true_recall"]["value"] == pytest.approx(0.98) and rows["density"]["value"] == pytest.approx(0.2)
    assert rows["speedup"]["commit"] is None


def statistics_mean(values):
    return sum(values) / len(values)
