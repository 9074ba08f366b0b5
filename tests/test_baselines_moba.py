"""attention.kind moba: the one-device op and the sparse ring (gloo, CP 2 and 4, zigzag and block-stripe, with and
without packed documents) against a float64 reference with the MoBA mask built from its definition: out 1e-5,
grads 1e-4; the recipe keys are checked at load; two training steps run through the trainer."""

import pytest
import torch

from baselines_common import (CP_CASES, GRAD_TOL, OUT_TOL, check_cp_case, load_kind, run_cp, single_device_errors,
                              train_steps)
from mtrain.errors import ConfigError


@pytest.mark.parametrize("docs, seq", [(False, 256), (True, 256), (False, 250)])  # 250: a short last block
def test_moba_matches_reference_on_one_device(docs, seq):
    err = single_device_errors("moba", docs, seq)
    assert err["out"] < OUT_TOL, err
    assert max(err["dq"], err["dk"], err["dv"]) < GRAD_TOL, err
    assert err["density"] < 0.9 and err["gap_to_dense"] > 1e-2, err  # the gate really drops chunks


def test_moba_lists_keep_own_chunk_and_topk():
    from mtrain.ops.moba import moba_index

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 512, 2, 8, generator=g), torch.randn(1, 512, 1, 8, generator=g)
    index = moba_index(q, k, chunk_size=64, topk=2, block_size=32)
    ids, counts = index.block_ids[0, 0], index.block_counts[0, 0]
    for i in range(16):
        listed = set(ids[i, :counts[i]].tolist())
        own = i // 2
        assert set(range(own * 2, i + 1)) <= listed  # own chunk up to the diagonal
        earlier = {b // 2 for b in listed if b // 2 < own}
        assert len(earlier) == min(2, own)  # exactly top-k earlier chunks, each whole
        assert all({2 * c, 2 * c + 1} <= listed for c in earlier)


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    return run_cp("moba", tmp_path_factory)


@pytest.mark.parametrize("case", CP_CASES)
def test_moba_ring_matches_reference(cp_results, case):
    check_cp_case(cp_results, case)


def test_moba_recipe_keys_checked_at_load(tmp_path):
    recipe = load_kind("moba", tmp_path, "attention.moba_chunk_size=128", "attention.moba_topk=3")
    assert (recipe.attention.moba_chunk_size, recipe.attention.moba_topk) == (128, 3)
    with pytest.raises(ConfigError, match=r"attention.moba_chunk_size: 100 is not a multiple of attention.block_size"):
        load_kind("moba", tmp_path, "attention.moba_chunk_size=100")
    with pytest.raises(ConfigError, match=r"attention.moba_topk: must be >= 0"):
        load_kind("moba", tmp_path, "attention.moba_topk=-1")
    with pytest.raises(ConfigError, match="unknown key 'attention.moba_chunk'"):
        load_kind("moba", tmp_path, "attention.moba_chunk=64")


def test_moba_trains(tmp_path):
    rows = train_steps("moba", tmp_path, "attention.moba_chunk_size=64", "attention.moba_topk=1")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert all(0 < r["attention_density"] < 0.9 for r in rows), rows
