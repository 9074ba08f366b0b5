"""attention.kind xattention: the one-device op and the sparse ring (gloo, CP 2 and 4, zigzag and block-stripe, with
and without packed documents) against a float64 reference with the XAttention mask built from its definition: out
1e-5, grads 1e-4; the recipe keys are checked at load; two training steps run through the trainer."""

import pytest
import torch

from baselines_common import (CP_CASES, GRAD_TOL, OUT_TOL, check_cp_case, load_kind, run_cp, single_device_errors,
                              train_steps)
from mtrain.errors import ConfigError


@pytest.mark.parametrize("docs, seq", [(False, 256), (True, 256), (False, 248)])  # 248: a short last block
def test_xattention_matches_reference_on_one_device(docs, seq):
    err = single_device_errors("xattention", docs, seq)
    assert err["out"] < OUT_TOL, err
    assert max(err["dq"], err["dk"], err["dv"]) < GRAD_TOL, err
    assert err["density"] < 0.9 and err["gap_to_dense"] > 1e-2, err  # the threshold really drops blocks


def test_xattention_threshold_orders_density_and_keeps_diagonal_and_sink():
    from mtrain.ops.xattention import xattention_index

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 512, 2, 16, generator=g), torch.randn(1, 512, 1, 16, generator=g)
    densities = []
    for threshold in (0.3, 0.6, 0.9, 1.0):
        index = xattention_index(q, k, stride=8, threshold=threshold, block_size=32)
        ids, counts = index.block_ids, index.block_counts
        for i in range(16):
            listed = set(ids[0, 0, i, :counts[0, 0, i]].tolist())
            assert {0, i} <= listed and max(listed) <= i
        densities.append(index.density())
    assert densities == sorted(densities) and densities[0] < densities[-1], densities
    assert densities[-1] == 1.0  # threshold 1 keeps every causal block


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    return run_cp("xattention", tmp_path_factory)


@pytest.mark.parametrize("case", CP_CASES)
def test_xattention_ring_matches_reference(cp_results, case):
    check_cp_case(cp_results, case)


def test_xattention_recipe_keys_checked_at_load(tmp_path):
    recipe = load_kind("xattention", tmp_path, "attention.xattn_stride=16", "attention.xattn_threshold=0.95")
    assert (recipe.attention.xattn_stride, recipe.attention.xattn_threshold) == (16, 0.95)
    with pytest.raises(ConfigError, match=r"attention.xattn_stride: 12 does not divide attention.block_size \(64\); use a divisor of it, e.g. 8"):
        load_kind("xattention", tmp_path, "attention.xattn_stride=12")
    with pytest.raises(ConfigError, match=r"attention.xattn_threshold: must be in \(0, 1\]"):
        load_kind("xattention", tmp_path, "attention.xattn_threshold=1.5")


def test_xattention_under_cp_needs_whole_query_blocks():
    """A layout that splits query blocks over ranks is refused in one line that names the fix."""
    from mtrain.errors import MtrainError
    from mtrain.parallel import Layout
    from mtrain.parallel.selection import _check_whole_blocks

    _check_whole_blocks(Layout.create("zigzag", world_size=2), 256, 64, "xattention")
    with pytest.raises(MtrainError, match="parallel.granularity a multiple of 64") as err:
        _check_whole_blocks(Layout.create("block-stripe", world_size=2, granularity=32), 256, 64, "xattention")
    assert "\n" not in str(err.value)


def test_xattention_cp_layout_checked_at_load(tmp_path):
    with pytest.raises(ConfigError, match="needs whole query blocks of attention.block_size=64") as err:
        load_kind("xattention", tmp_path, "parallel.cp_size=2", "parallel.layout=block-stripe", "parallel.granularity=32")
    assert "\n" not in str(err.value)
    assert load_kind("xattention", tmp_path, "parallel.cp_size=2", "parallel.layout=zigzag").parallel.layout == "zigzag"


def test_xattention_trains(tmp_path):
    rows = train_steps("xattention", tmp_path, "attention.xattn_stride=8", "attention.xattn_threshold=0.5")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert all(0 < r["attention_density"] < 0.9 for r in rows), rows
