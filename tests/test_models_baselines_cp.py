"""The baseline kinds inside the HF model (the trainer's path: recipe_runtime + attach_runtime): one step with CP=2/4
gives the one-rank loss and gradients (fp32, relative 1e-5), moba and xattention really sparse."""

import json

import pytest

from test_models_cp import torchrun


# CP=4 under slow (four ranks on 2 cores): CP=2 runs the same cases quick
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_baseline_cp_step_matches_single_rank(tmp_path, world):
    out = tmp_path / "rows.jsonl"
    proc = torchrun(world, "tests/workers/baselines_cp_step.py", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["kind"], r["layout"], r["documents"]) for r in rows} == {
        (k, lay, d) for k, lay in (("moba", "zigzag"), ("moba", "block-stripe"), ("xattention", "zigzag"),
                                   ("xattention", "block-stripe"), ("ulysses", "block-stripe")) for d in (False, True)}
    for r in rows:
        assert r["loss_rel"] < 1e-5, r
        assert r["grad_rel"] < 1e-5, r
        assert (r["density"] < 0.9) if r["kind"] != "ulysses" else r["density"] == 1.0, r
