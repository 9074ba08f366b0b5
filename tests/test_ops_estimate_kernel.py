"""The Triton scorer of the pattern estimator (`scorer="triton"`, run here in Triton's CPU interpreter) against
the PyTorch scorer that materialises the probabilities: the same index and the same est_recall, with documents,
GQA, shared KV-group budgets and every block size the kernel takes; and its per-block / per-column sums against
a float64 reference."""

import math

import pytest
import torch

from mtrain.ops.estimate import estimate_vertical_slash, scored_rows
from test_ops_estimate import planted, rows_recall
from test_ops_interpreter import needs_interpreter

pytestmark = needs_interpreter

FIELDS = ("block_ids", "block_counts", "col_ids", "col_counts")


def both(q, k, **kw):
    a = estimate_vertical_slash(q, k, scorer="torch", **kw)
    b = estimate_vertical_slash(q, k, scorer="triton", **kw)
    return a, b


@pytest.mark.parametrize("S,Hq,Hkv,D,bs,kw", [
    (256, 4, 2, 16, 16, dict(recall=0.9, last_q=16, sample_blocks=4)),
    (200, 2, 1, 32, 32, dict(recall=0.95, last_q=24, sample_blocks=3)),  # S not a multiple of the block
    (256, 4, 2, 16, 16, dict(recall=0.9, last_q=16, sample_blocks=4, share_kv_group=True)),
    (640, 2, 2, 24, 64, dict(recall=0.8, last_q=64, sample_blocks=2)),  # head dim not a power of two
])
def test_triton_scorer_gives_the_torch_index(S, Hq, Hkv, D, bs, kw):
    gen = torch.Generator().manual_seed(S + D)
    q = torch.randn(1, S, Hq, D, generator=gen)
    k = torch.randn(1, S, Hkv, D, generator=gen)
    a, b = both(q, k, block_size=bs, **kw)
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.col_counts.sum() > 0  # the case exercises verticals
    assert torch.allclose(a._cache["est_recall"], b._cache["est_recall"], atol=1e-6)


@pytest.mark.parametrize("chunk", [None, 1000])  # 1000: the q/k recomputations run in many small chunks
def test_triton_scorer_with_documents_matches_and_reaches_recall(chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr("mtrain.ops.estimate._CHUNK", chunk)
    q, k = planted(S=256)
    docs = torch.tensor([0] * 70 + [1] * 100 + [2] * 86)[None]
    a, b = both(q, k, recall=0.95, last_q=32, block_size=16, sample_blocks=4, doc_ids=docs)
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert torch.allclose(a._cache["est_recall"], b._cache["est_recall"], atol=1e-6)


def test_triton_scorer_est_recall_against_float64():
    q, k = planted()
    index = estimate_vertical_slash(q, k, recall=0.95, last_q=32, block_size=16, sample_blocks=4, scorer="triton")
    rows = scored_rows(q.shape[1], 32, 4, 16)
    want = rows_recall(q, k, index, rows)
    assert (want >= 0.95 - 1e-5).all()
    assert torch.allclose(index._cache["est_recall"].double(), want, atol=1e-5)


def test_score_rows_sums_against_float64():
    from mtrain.ops._triton_estimate import score_rows

    gen = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D, bs = 2, 96, 4, 2, 16, 16
    q = torch.randn(B, S, Hq, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    docs = torch.tensor([[0] * 40 + [1] * 56, [0] * 96])
    rows = torch.tensor([16, 17, 18, 40, 41, 80, 90, 95])
    lse, pooled, vert = score_rows(q, k, rows, bs, 0.25, docs)
    kk = k.double().repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double()[:, rows], kk) * 0.25
    pos = torch.arange(S)
    vis = (pos[None, :] <= rows[:, None]) & (docs[:, rows, None] == docs[:, None, :])[:, None]
    s = s.masked_fill(~vis, -math.inf)
    ref_lse = torch.logsumexp(s, -1)
    p = torch.exp(s - ref_lse[..., None])
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    ref_pooled = p.view(B, Hq, rows.numel(), S // bs, bs).sum(-1)
    assert torch.allclose(pooled.double(), ref_pooled, atol=1e-6)
    outside = ((pos // bs)[None, :] != (rows // bs)[:, None]) & (pos >= bs)[None, :]
    assert torch.allclose(vert.double(), (p * outside).sum(-2), atol=1e-6)
