"""The real-model benchmark (`scripts/bench_attention.py --model`) end to end on the CPU at a short length: one layer
of the converted SmolLM2, its per-layer record and the whole-model summary the GPU runs report, written atomically."""

import json
import math

import pytest

from real_model import require_real_model


@pytest.mark.slow
def test_bench_real_reports_what_the_gpu_table_needs(tmp_path):
    from mtrain import bench_real
    from mtrain.parallel import SparseSettings

    lines = []
    summary = bench_real.run(str(require_real_model()), 256, settings=SparseSettings(block_size=64, last_q=32),
                             layers=[1], iters=1, hold=2, recall_rows=32, out_dir=str(tmp_path), log=lines.append)
    (layer,) = summary["layers"]
    assert layer["layer"] == 1 and layer["path"] in ("sparse", "dense")
    for name in ("dense_ms", "mtrain_ms", "steady_ms", "long_run_ms", "fwd_ms", "bwd_ms"):
        assert math.isfinite(layer[name]) and layer[name] > 0, name
    assert 0.0 < layer["true_recall"] <= 1.0 + 1e-6
    # as run: a dense layer keeps all of its attention
    want = 1.0 if layer["path"] == "dense" else layer["true_recall"]
    assert summary["as_run_true_recall"] == pytest.approx(want)
    assert summary["as_run_min_layer_true_recall"] == pytest.approx(want)
    assert summary["long_run_speedup"] == pytest.approx(summary["dense_ms"] / summary["long_run_ms"])
    over = summary["percent_over_dense"]
    assert set(over) == {"every_step", "steady", "long_run"}
    assert (1 in over["steady"]) == (layer["steady_ms"] > layer["dense_ms"])
    assert math.isfinite(summary["ppl_dense"]) and math.isfinite(summary["ppl_mtrain"])
    # how much of the vertical cap the estimate used: a row never lists more columns than its head has verticals,
    # nor than its list is wide
    extra = layer["extra"]
    assert extra["verticals_max"] >= 16 and extra["column_list_width"] == summary["column_list_width"]
    assert 0 <= extra["columns_per_row_mean"] <= extra["columns_per_row_max"] <= extra["verticals_max"]
    assert extra["columns_per_row_max"] <= extra["column_list_width"]
    saved = json.loads((tmp_path / "real_256.json").read_text())
    assert saved["seq_len"] == 256 and saved["layers"][0]["layer"] == 1
    assert not list(tmp_path.glob("*.tmp"))
    assert any(line.startswith("whole model (1 layers)") for line in lines)
