"""tools/sweep_quality.py: its settings parse (bad ones refused before any run) and its one table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed: the repository root
from tools import sweep_quality  # noqa: E402


def test_settings_parse_and_bad_ones_are_refused():
    assert sweep_quality.parse_setting("default") == {}
    assert sweep_quality.parse_setting("last_q=256,recall=0.995,share_kv_group=true") == {
        "last_q": 256, "recall": 0.995, "share_kv_group": True}
    with pytest.raises(SystemExit, match="not FIELD=VALUE"):
        sweep_quality.parse_setting("lastq=256")
    with pytest.raises(Exception, match="recall"):
        sweep_quality.parse_setting("recall=1.5")  # SparseSettings refuses it


def test_table_merges_runs_in_length_and_text_order(tmp_path):
    def cell(seq_len, text, setting, rise):
        return {"seq_len": seq_len, "text": text, "setting": setting, "ppl_dense": 10.0, "ppl": 10.0 * (1 + rise),
                "rise": rise, "density": 0.5, "true_recall_mean": 0.99, "true_recall_worst_layer": 0.985,
                "true_recall_worst_head": 0.98, "seconds": 80.0}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"cells": [cell(8192, "prose", "default", 0.01), cell(4096, "dialogue", "default", 0.0114)]}))
    b.write_text(json.dumps({"cells": [cell(4096, "prose", "last_q=256", -0.0004)]}))
    run = subprocess.run([sys.executable, "-m", "tools.sweep_quality", "--table", str(a), str(b)],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=True)
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("| S | text | setting |") and len(lines) == 5
    assert [line.split(" | ")[:3] for line in lines[2:]] == [["| 4K", "prose", "last_q=256"],
                                                             ["| 4K", "dialogue", "default"],
                                                             ["| 8K", "prose", "default"]]
    assert "| +1.14% |" in lines[3] and "| -0.04% |" in lines[2]


def test_predictions_rank_the_measures_by_how_they_follow_the_rise():
    """A measure whose worst layer tracks the rise correlates 1 at its maximum; a constant one gives NaN (no
    information), as the estimate's row mass does when every layer sits at the target."""
    import math

    passes = []
    for worst, rise in ((0.03, 0.011), (0.02, 0.004), (0.05, 0.02), (0.01, -0.001)):
        layers = [{"est_recall": 0.99, "true_recall": 0.99, "err_scored": e, "err_sampled": e}
                  for e in (0.01, worst, 0.005)]
        passes.append((layers, rise))
    found = sweep_quality.predictions(passes)
    assert found["output error, scored rows", "max"][0] > 0.9
    assert found["output error, scored rows", "max"][1] == pytest.approx(1.0)
    assert math.isnan(found["1 - est_recall", "sum"][0])
