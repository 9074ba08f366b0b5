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
    # the scored rows of q alone (what the CUDA graph copies in) give the Triton scorer the same index
    from mtrain.ops.estimate import estimate_rows

    c = estimate_vertical_slash(q[:, estimate_rows(S, block_size=bs, **kw)], k, scorer="triton", block_size=bs,
                                scored_q=True, **kw)
    for f in FIELDS:
        assert torch.equal(getattr(b, f), getattr(c, f)), f
    assert torch.equal(b._cache["est_recall"], c._cache["est_recall"])


@pytest.mark.parametrize("keys_per_program", [4096, 48])  # 48: several key chunks, rounded to the block size
def test_triton_scorer_with_documents_matches_and_reaches_recall(keys_per_program, monkeypatch):
    monkeypatch.setattr("mtrain.ops._triton_estimate.KEYS_PER_PROGRAM", keys_per_program)
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


def _scored_case(seed: int):
    """q [2, 96, 4, 16], k [2, 96, 2, 16], two documents in batch row 0, and 8 scored rows over 16-token blocks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 96, 4, 16, generator=gen)
    k = torch.randn(2, 96, 2, 16, generator=gen)
    docs = torch.tensor([[0] * 40 + [1] * 56, [0] * 96])
    return q, k, docs, torch.tensor([16, 17, 18, 40, 41, 80, 90, 95]), 16


def _f64_softmax(q, k, docs, rows, scale):
    """Float64 (logsumexp [B, Hq, n], probabilities [B, Hq, n, S]) of the rows over the keys they see (causal, same
    document)."""
    S = k.shape[1]
    kk = k.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double()[:, rows], kk) * scale
    pos = torch.arange(S)
    vis = (pos[None, :] <= rows[:, None]) & (docs[:, rows, None] == docs[:, None, :])[:, None]
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    return lse, torch.exp(s - lse[..., None])


@pytest.mark.parametrize("keys_per_program", [4096, 32])  # 32: the key axis split over three programs
def test_score_rows_sums_against_float64(keys_per_program, monkeypatch):
    from mtrain.ops._triton_estimate import score_rows

    monkeypatch.setattr("mtrain.ops._triton_estimate.KEYS_PER_PROGRAM", keys_per_program)

    q, k, docs, rows, bs = _scored_case(3)
    B, S, Hq, _ = q.shape
    lse, pooled, vert = score_rows(q[:, rows], k, rows, bs, 0.25, docs)
    ref_lse, p = _f64_softmax(q, k, docs, rows, 0.25)
    pos = torch.arange(S)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    ref_pooled = p.view(B, Hq, rows.numel(), S // bs, bs).sum(-1)
    assert torch.allclose(pooled.double(), ref_pooled, atol=1e-6)
    outside = ((pos // bs)[None, :] != (rows // bs)[:, None]) & (pos >= bs)[None, :]
    assert torch.allclose(vert.double(), (p * outside).sum(-2), atol=1e-6)


@pytest.mark.parametrize("config", [dict(split=False), dict(split=True), dict(rows=16, warps=2),
                                    dict(rows=16, split=False), dict(rows=128, warps=4, stages=2)])
def test_score_rows_launch_settings_against_float64(config):
    """Every launch setting gives the float64 sums; with split (the keys below a tile's first row's block run
    without masks) the rows start late, so most keys take that path, and a 16-row tile ends mid-list."""
    from mtrain.ops._triton_estimate import score_rows

    gen = torch.Generator().manual_seed(11)
    B, S, Hq, Hkv, D, bs = 1, 112, 4, 2, 16, 16
    q, k = torch.randn(B, S, Hq, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    rows = torch.tensor([50, 51, 52, 60, 70, 71, 80, 81, 82, 83, 90, 95, 96, 97, 100, 105, 108, 109, 110, 111])
    docs = torch.zeros(B, S, dtype=torch.long)
    lse, pooled, vert = score_rows(q[:, rows], k, rows, bs, 0.25, config=config)
    ref_lse, p = _f64_softmax(q, k, docs, rows, 0.25)
    pos = torch.arange(S)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    assert torch.allclose(pooled.double(), p.view(B, Hq, rows.numel(), S // bs, bs).sum(-1), atol=1e-6)
    outside = ((pos // bs)[None, :] != (rows // bs)[:, None]) & (pos >= bs)[None, :]
    assert torch.allclose(vert.double(), (p * outside).sum(-2), atol=1e-6)
    if config.get("split") is not False and "rows" not in config:  # the masks were all-true there: same sums
        same = score_rows(q[:, rows], k, rows, bs, 0.25, config=dict(split=False))
        for a, b in zip((lse, pooled, vert), same):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_score_rows_rejects_unknown_settings():
    from mtrain.ops._triton_estimate import score_rows

    q, k, docs, rows, bs = _scored_case(3)
    with pytest.raises(ValueError, match="unknown scorer config keys \\['block'\\]"):
        score_rows(q[:, rows], k, rows, bs, 0.25, config=dict(block=32))


@pytest.mark.parametrize("skip_kept,shared,n_cols,lead_pad", [(False, False, 7, 0), (True, True, 7, 0),
                                                             (True, True, 150, 140)])
def test_group_column_mass_against_float64(skip_kept, shared, n_cols, lead_pad):
    """Per query block and column, the scored rows' probabilities summed (causal, same document, and outside
    block 0 and the row's own block with skip_kept), against float64 softmax over all keys. lead_pad: a wide list
    padded in front (sorted lists put -1 first), so whole 64-column tiles hold padding only (stored as zeros)."""
    from mtrain.ops._triton_estimate import group_column_mass, score_rows
    from mtrain.ops.estimate import row_groups

    q, k, docs, rows, bs = _scored_case(5)
    B, S, Hq, _ = q.shape
    gen = torch.Generator().manual_seed(6)
    blocks, table = row_groups(rows, bs)
    lse, _, _ = score_rows(q[:, rows], k, rows, bs, 0.25, docs)
    U = blocks.numel()
    cols = torch.randint(0, S, (B, Hq, 1 if shared else U, n_cols), generator=gen)
    cols[..., -2:] = -1  # padding
    cols[..., :lead_pad] = -1
    got = group_column_mass(q[:, rows], k, lse, rows, table, cols, 0.25, bs, docs, skip_kept=skip_kept)
    _, p = _f64_softmax(q, k, docs, rows, 0.25)  # [B, Hq, n, S]
    pos = torch.arange(S)
    if skip_kept:
        kept = ((pos // bs)[None, :] == (rows // bs)[:, None]) | (pos < bs)[None, :]
        p = p.masked_fill(kept, 0.0)
    want = torch.zeros(B, Hq, U, n_cols, dtype=torch.float64)
    for u in range(U):
        members = table[u][table[u] >= 0]
        c = cols[:, :, 0 if shared else u]  # [B, Hq, C]
        vals = torch.gather(p[:, :, members], -1, c.clamp(min=0)[:, :, None].expand(-1, -1, members.numel(), -1))
        want[:, :, u] = torch.where(c >= 0, vals.sum(-2), 0.0)
    assert want.abs().sum() > 0.1
    assert torch.allclose(got.double(), want, atol=1e-6)


def test_offset_mass_matches_the_scatter_of_uncovered_blocks():
    """Mass per block offset from per-block column sums equals subtracting the columns row by row
    (`uncovered_blocks`, the materialising scorer's way) and pooling by offset."""
    from mtrain.ops.estimate import (block_slash_mass, kept_split, offset_mass, pool_blocks, row_groups,
                                     uncovered_blocks)

    gen = torch.Generator().manual_seed(9)
    B, H, S, bs = 1, 3, 160, 16
    n_kb = S // bs
    rows = torch.tensor([32, 33, 47, 96, 100, 150, 159])
    probs = torch.rand(B, H, rows.numel(), S, generator=gen, dtype=torch.float64)
    probs = torch.where(torch.arange(S)[None, :] <= rows[:, None], probs, 0.0)
    _, rest = kept_split(pool_blocks(probs, torch.arange(S), bs, n_kb), rows, bs)
    vert = torch.sort(torch.randint(-1, S, (B, H, 9), generator=gen), -1).values
    want = block_slash_mass(rest, rows, bs) - block_slash_mass(
        uncovered_blocks(probs, rest, rows, torch.arange(S), vert, S, bs), rows, bs)
    blocks, table = row_groups(rows, bs)
    outside = ((torch.arange(S) // bs)[None, :] != (rows // bs)[:, None]) & (torch.arange(S) >= bs)[None, :]
    cut = probs * outside
    colsum = torch.stack([torch.gather(cut[:, :, table[u][table[u] >= 0]].sum(-2), -1, vert.clamp(min=0))
                          .where(vert >= 0, 0.0) for u in range(blocks.numel())], 2)
    got = offset_mass(colsum, vert, blocks, bs, n_kb)
    assert want.abs().sum() > 0.1
    assert torch.allclose(got.double(), want, atol=1e-5)
