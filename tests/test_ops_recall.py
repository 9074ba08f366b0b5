"""true_recall against an independent float64 reference built from SparseIndex.to_mask() (all rows, sampled
rows, GQA, documents, row chunking), and index_row_mask against to_mask."""

import math

import pytest
import torch

import mtrain.ops.recall as recall_mod
from mtrain.ops import SparseIndex, index_row_mask, true_recall


def make_case(B=2, S=150, Hq=6, Hkv=2, D=16, bs=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=gen, dtype=torch.float64) * 1.5
    k = torch.randn(B, S, Hkv, D, generator=gen, dtype=torch.float64)
    vertical = torch.randint(0, S, (B, Hq, 5), generator=gen)
    vertical[..., 0] = -1
    slash = torch.cat([torch.arange(3).expand(B, Hq, 3), torch.randint(20, S, (B, Hq, 2), generator=gen)], -1)
    return q, k, SparseIndex.from_lines(vertical, slash, S, bs)


def reference_recall(q, k, index, doc_ids=None, rows=None):
    """Mean over rows of the float64 causal softmax mass on the pairs of index.to_mask()."""
    B, S, Hq, D = q.shape
    kk = k.double().repeat_interleave(Hq // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) / math.sqrt(D)
    visible = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    if doc_ids is not None:
        visible = visible & (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    per_row = (p * index.to_mask()).sum(-1)  # [B, Hq, S]
    if rows is not None:
        per_row = per_row[..., rows]
    return per_row.mean(-1)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_all_rows_match_float64_reference(dtype, atol):
    q, k, index = make_case()
    got = true_recall(q.to(dtype), k.to(dtype), index)
    want = reference_recall(q, k, index)
    assert got.dtype == torch.float32 and got.shape == (2, 6)
    assert torch.allclose(got.double(), want, atol=max(atol, 1e-7)), (got.double() - want).abs().max()
    assert 0.3 < float(want.min()) < 0.99  # the index drops real mass: the comparison is not trivial


def test_sampled_rows_documents_and_chunking(monkeypatch):
    q, k, index = make_case(seed=1)
    docs = torch.zeros(2, 150, dtype=torch.long)
    docs[0, 40:] = 1
    docs[0, 97:] = 2
    docs[1, 120:] = 7
    rows = torch.tensor([149, 3, 64, 65, 100, 40])
    want = reference_recall(q, k, index, doc_ids=docs, rows=rows)
    assert not torch.allclose(want, reference_recall(q, k, index, rows=rows), atol=1e-3)  # documents matter
    monkeypatch.setattr(recall_mod, "_CHUNK_ELEMS", 2 * 6 * 150 * 2)  # two rows per chunk
    got = true_recall(q, k, index, doc_ids=docs, rows=rows)
    assert torch.allclose(got.double(), want, atol=1e-7)
    full = true_recall(q, k, index, doc_ids=docs)
    assert torch.allclose(full.double(), reference_recall(q, k, index, doc_ids=docs), atol=1e-7)


def test_sampled_recall_from_host_rows_reads_nothing_back(monkeypatch):
    """Rows given on the host (as a training step's sampled rows are): their checks and each chunk's key count are
    host arithmetic, so no op that would make the host wait for a GPU runs (the old code read the rows' min / max
    and every chunk's last row back from the device); the same recall as the float64 reference."""
    from syncs import CountSyncs

    from mtrain.ops.recall import sampled_rows

    q, k, index = make_case(seed=2)
    rows = sampled_rows(150, 16)
    monkeypatch.setattr(recall_mod, "_CHUNK_ELEMS", 2 * 6 * 150 * 3)  # three rows per chunk: six chunks
    mode = CountSyncs()
    with mode:
        got = true_recall(q, k, index, rows=rows)
    assert not mode.sites, dict(mode.sites)
    assert torch.allclose(got.double(), reference_recall(q, k, index, rows=rows), atol=1e-7)


def test_dense_index_has_recall_one_and_row_mask_matches_to_mask():
    from mtrain.ops.index import blocks_for_causal_dense

    q, k, index = make_case(B=1, S=70, seed=2)
    dense = blocks_for_causal_dense(70, 16, 1, 6)
    assert torch.allclose(true_recall(q, k, dense), torch.ones(1, 6), atol=1e-6)
    rows = torch.tensor([0, 17, 69, 33])
    assert torch.equal(index_row_mask(index, rows), index.to_mask()[:, :, rows])


def test_bad_inputs_are_refused():
    q, k, index = make_case(B=1, S=70, seed=3)
    with pytest.raises(ValueError, match="index is for"):
        true_recall(q[:, :64], k[:, :64], index)
    with pytest.raises(ValueError, match="rows must be"):
        true_recall(q, k, index, rows=torch.tensor([70]))
    with pytest.raises(ValueError, match="doc_ids must be"):
        true_recall(q, k, index, doc_ids=torch.zeros(1, 70))
