"""The measured figures the planner and the cost model compute with come from the result rows: the asset
mtrain/assets/measured.json is what scripts/measured_asset.py writes from benchmarks/results.jsonl, the tables and
runs built from it hold the figures measured (written out below as the independent reference), and a row that
changes changes the figure.

Reads files only, plus the planner and cost modules; well under a second after their import.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from mtrain import measured, planner
from mtrain.bench.results import append_rows, render_markdown
from mtrain.ops import cost

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results.jsonl"

sys.path.insert(0, str(ROOT / "scripts"))
import measured_asset  # noqa: E402  (scripts/ is not a package)


def test_asset_is_generated_from_the_current_rows():
    text = measured.ASSET.read_text(encoding="utf-8")
    assert text == measured_asset.generate(), "mtrain/assets/measured.json differs from the rows: run " \
                                              "python scripts/measured_asset.py (make benchmarks)"
    assert measured_asset.main(["--check"]) == 0


def test_the_asset_prefixes_are_the_ones_benchmarks_md_leaves_out():
    sections = yaml.safe_load((ROOT / "benchmarks" / "sections.yaml").read_text(encoding="utf-8"))
    assert tuple(sections["constants"]) == measured_asset.PREFIXES


def test_constants_leave_the_reference_and_are_named_on_the_retired_line():
    row = {"date": "2026-12-01", "commit": None, "gpu": "1x H200", "versions": "torch", "command": "c",
           "measure": "gate.seconds", "value": 172, "unit": "s", "peer": None, "note": ""}
    sections = {"title": "t", "preface": "p", "retired": {"old.": "superseded"},
                "constants": {"gate.fit.": "the gate's fit"},
                "sections": [{"title": "Gate", "prefixes": ["gate."], "intro": "i"}]}
    text = render_markdown([row, {**row, "measure": "gate.fit.ms0", "value": 999}], sections)
    assert "| `gate.seconds` | 172 s |" in text and "999" not in text
    assert ("Retired (still in the rows): `old.*` (superseded). Not printed, the figures the code computes with "
            "(`python scripts/measured_asset.py` copies them into `mtrain/assets/measured.json`): `gate.fit.*` "
            "(the gate's fit).\n") in text


class _Reads(dict):
    """A dict that records the keys read from it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def test_every_asset_figure_is_used():
    """Each figure of the asset goes into a cost table (table_from rejects one it cannot place) or a planner run."""
    figures = measured.load()
    cost_figures = {m: v for m, v in figures.items() if m.startswith(("cost.h200.", "cost.cpu."))}
    assert len(cost_figures) == 91
    reads = _Reads({m: v for m, v in figures.items() if m not in cost_figures})
    planner.measured_runs(reads)
    assert reads.read == set(reads) and len(reads) == 2 + 22 + 8  # the old estimate's two, one per run


def test_cost_tables_hold_the_measured_coefficients():
    h, c = cost.H200, cost.CPU
    assert (h.name, c.name) == ("cuda (H200)", "cpu")
    assert h.dense[64] == {"train": (0.5881, 31.5157), "eval": (0.297, 8.4706)}
    assert h.dense[128]["train"] == (0.4931, 24.2342)
    assert list(h.sparse) == [(64, 64), (64, 128), (128, 64), (128, 128)]
    assert h.sparse[(64, 64)]["train"] == (1.1619, 0.7599, 56.2294, 106.9363)
    assert h.sparse[(128, 128)]["eval"] == (0.2719, 0.2234, 11.9352, 17.2914)
    assert h.index == (2.0754, 0.0, 0.0, 0.0186)
    assert h.estimate == (4.3726, 1.8161) and h.graphed == (1.964, 2.0683)
    assert list(h.engines) == ["fa4"] and list(h.engines["fa4"]) == [(64, 128), (128, 128)]
    assert h.engines["fa4"][(64, 128)]["train"] == (0.8134, 2.4678, 23.2355, 110.831)
    assert h.dense_engines == {"fa4": {64: {"train": (1.0711, 23.7402), "eval": (0.2758, 7.8034)},
                                       128: {"train": (0.8198, 22.2261), "eval": (0.228, 6.1444)}}}
    assert h.document_break_even == {(64, 128, "fa4"): 32768}
    assert c.dense == {32: {"train": (0.0, 267886.0248), "eval": (0.0, 71155.7291)}}
    assert c.sparse == {(32, 64): {"train": (0.6148, 0.0, 573988.8701, 915806.3729),
                                   "eval": (0.0, 0.0, 228095.5965, 299461.9548)}}
    assert c.index == (0.368, 0.2239, 13.2548, 42.9433)
    assert c.estimate == (0.0, 15201.4686) and c.graphed == (0.0, 0.0)
    assert c.engines == {} and c.dense_engines == {} and c.document_break_even == {}


def test_planner_runs_hold_the_measured_values():
    runs = {label: (metric, value, spec) for label, spec, metric, value in planner.MEASURED + planner.OUT_OF_SAMPLE}
    assert runs["1 GPU 0.5B dense 64K"][:2] == ("step", 2.80)
    assert runs["1 GPU 0.5B dense 128K peak"][:2] == ("mem", 23.4)
    assert runs["1 GPU 3B offload 384K peak"][:2] == ("mem", 128.6)
    assert runs["1 GPU 3B offload 256K (1.6%)"][:2] == ("step", 19.4)
    assert runs["2 GPU CP=2 0.5B sparse 128K (1.6%)"][1] == 131072 / 62000
    assert runs["CPU gloo 2 ranks ring attention dense 4K/rank"][:2] == ("attn", 11036.2)
    assert runs["2 GPU ring attention dense 64K/GPU"][1] == 231.4
    assert runs["4 GPU ring attention sparse 128K/GPU (2.1%)"][1] == 116.3
    assert runs["4 H100 CP=4 SmolLM2-135M mtraining 256K"][1] == 262144 / 37098
    assert runs["4 H100 CP=4 SmolLM2-135M dense ring 512K peak"][1] == 26.3 * 2 ** 30 / 1e9
    assert runs["1 GPU 0.5B dense 64K"][2]["estimate_cost"] == (10.9573, 11.5444)
    assert [label for label, *_ in planner.MEASURED][-1] == "4 GPU ring attention sparse 128K/GPU (2.1%)"


def _row(measure: str, value: float) -> dict:
    return {"date": "2099-01-01", "commit": None, "gpu": "1x H200", "versions": "torch", "command": "a test",
            "measure": measure, "value": value, "unit": "ms", "peer": None, "note": "a newer figure"}


def test_a_changed_row_changes_the_loaded_figure(tmp_path):
    rows, asset = tmp_path / "results.jsonl", tmp_path / "measured.json"
    rows.write_text(ROWS.read_text(encoding="utf-8"), encoding="utf-8")
    append_rows(rows, [_row("cost.h200.dense.d64.train.per_unit", 40.0),
                       _row("cost.cpu.index.ms0", 0.5),
                       _row("planner.measured.in_sample.qwen25_05b.dense_64k.step_s", 3.1),
                       _row("planner.measured.out_of_sample.smollm2_cp4_h100.mtraining_256k.tokens_per_s", 40000)])
    # the shipped asset no longer matches these rows
    assert measured_asset.main(["--rows", str(rows), "--check"]) == 1
    assert measured_asset.main(["--rows", str(rows), "--out", str(asset)]) == 0
    figures = measured.load(asset)
    h200 = cost.table_from(figures, "cost.h200.", name="h", source="s", path=asset)
    assert h200.dense[64]["train"] == (0.5881, 40.0)
    assert h200.dense[128] == cost.H200.dense[128] and h200.sparse == cost.H200.sparse
    assert cost.table_from(figures, "cost.cpu.", name="c", source="s", path=asset).index == (0.5, 0.2239, 13.2548,
                                                                                            42.9433)
    ins, outs = planner.measured_runs(figures, asset)
    assert ins[0][3] == 3.1 and ins[1:] == planner.MEASURED[1:]
    assert outs[0][3] == 262144 / 40000 and outs[1:] == planner.OUT_OF_SAMPLE[1:]


def _write(path: Path, figures: dict) -> Path:
    path.write_text(json.dumps({"figures": {m: {"value": v} for m, v in figures.items()}}), encoding="utf-8")
    return path


def test_a_missing_or_malformed_asset_names_the_file_and_the_fix(tmp_path):
    for name, text, why in (("missing.json", None, "missing"), ("bad.json", "{not json", "not JSON"),
                            ("empty.json", "{}", "no 'figures' object"),
                            ("nan.json", '{"figures": {"a.b": {"value": "1"}}}', "'a.b' has no finite 'value'")):
        path = tmp_path / name
        if text is not None:
            path.write_text(text, encoding="utf-8")
        with pytest.raises(measured.MeasuredAssetError, match=why) as err:
            measured.load(path)
        assert str(path) in str(err.value) and "python scripts/measured_asset.py" in str(err.value)
    figures = measured.load()
    path = _write(tmp_path / "short.json", {m: v for m, v in figures.items()
                                            if m != "planner.measured.in_sample.ring_cp4.dense_64k_per_gpu.attn_ms"})
    with pytest.raises(measured.MeasuredAssetError, match="no figure 'planner.measured.in_sample.ring_cp4.dense_64k"):
        planner.measured_runs(measured.load(path), path)
    incomplete = {m: v for m, v in figures.items() if m != "cost.h200.sparse.d128_bs64.eval.per_column"}
    with pytest.raises(measured.MeasuredAssetError, match=r"cost.h200.sparse.d128_bs64.eval: needs ms0, per_row, "
                                                          r"per_block, per_column, has ms0, per_row, per_block;"):
        cost.table_from(incomplete, "cost.h200.", name="h", source="s", path=path)
    for measure in ("cost.h200.sparse.d64.train.ms0", "cost.h200.dense.d64_bs64.train.ms0",
                    "cost.h200.dense.d64.train.ms1", "cost.h200.dense.d64.test.ms0", "cost.h200.kernels.ms0",
                    "cost.h200.dense.x64.train.ms0", "cost.h200.document_break_even.d64.fa4"):
        with pytest.raises(measured.MeasuredAssetError, match=measure.replace(".", r"\.")):
            cost.table_from({**figures, measure: 1.0}, "cost.h200.", name="h", source="s", path=path)
