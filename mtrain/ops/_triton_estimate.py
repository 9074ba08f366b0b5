"""The GPU scorer of the pattern estimator: the scored query rows against every visible key in two passes of
one Triton program per (row tile, batch x head), never materialising the [rows x S] probabilities.

Pass 1 takes each row's softmax max and sum over its visible keys (causal, same document). Pass 2
recomputes the probabilities tile by tile and writes only what the estimator reads: the mass per (row, key
block) and, per row tile, the mass per key column outside the always-kept blocks (sink block 0 and the
row's own block). The column partials are summed over row tiles afterwards, in a fixed order, so the
result does not depend on scheduling.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_ROWS = 64  # scored rows per program
_LOG2E = 1.4426950408889634


@triton.jit
def _tile_logits(q, kbase, start, rpos, r_ok, rdoc, docs, S, sks, d, d_ok, scale_log2,
                 HAS_DOCS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """The row tile's scaled logits (log2 units) against keys start .. start + BLOCK_N - 1, -inf where a row
    does not see the key (causal, padding, another document); and the key positions and their in-range mask."""
    kpos = start + tl.arange(0, BLOCK_N)
    k_ok = kpos < S
    kt = tl.load(kbase + kpos[None, :] * sks + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, kt, input_precision=PREC) * scale_log2
    vis = (kpos[None, :] <= rpos[:, None]) & k_ok[None, :] & r_ok[:, None]
    if HAS_DOCS:
        kdoc = tl.load(docs + kpos, mask=k_ok, other=-2)
        vis = vis & (kdoc[None, :] == rdoc[:, None])
    return tl.where(vis, s, float("-inf")), kpos, k_ok


@triton.jit
def _score_kernel(
    Q, K, ROWS, DOCS, LSE, POOLED, VPART,
    n, S, nKB, H, G, D, scale_log2,
    sqb, sqn, sqh, skb, sks, skh, sdb,
    HAS_DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    r_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r_idx < n
    rpos = tl.load(ROWS + r_idx, mask=r_ok, other=-1)
    rblk = rpos // BLOCK_N
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * sqb + r_idx[:, None] * sqn + h * sqh + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0)
    rdoc = rpos  # unused without documents
    if HAS_DOCS:
        rdoc = tl.load(DOCS + b * sdb + tl.maximum(rpos, 0), mask=r_ok, other=-1)
    # rows are sorted: this tile sees keys up to its last row
    last = tl.load(ROWS + tl.minimum(tile * BLOCK_M + BLOCK_M, n) - 1)
    hi = last + 1
    kbase = K + b * skb + hk * skh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, hi, BLOCK_N):
        s, kpos, k_ok = _tile_logits(q, kbase, start, rpos, r_ok, rdoc, DOCS + b * sdb, S, sks, d, d_ok, scale_log2,
                                     HAS_DOCS, BLOCK_N, PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    tl.store(LSE + bh * n + r_idx, (m_safe + tl.log2(tl.maximum(l_i, 1e-30))) / 1.4426950408889634, mask=r_ok)
    prow = POOLED + (bh * n + r_idx) * nKB
    vrow = VPART + (tile * (tl.num_programs(1)) + bh).to(tl.int64) * S
    for start in range(0, hi, BLOCK_N):
        s, kpos, k_ok = _tile_logits(q, kbase, start, rpos, r_ok, rdoc, DOCS + b * sdb, S, sks, d, d_ok, scale_log2,
                                     HAS_DOCS, BLOCK_N, PREC)
        p = tl.exp2(s - m_safe[:, None]) * inv[:, None]  # hidden pairs: exp2(-inf) = 0
        kb = start // BLOCK_N
        tl.store(prow + kb, tl.sum(p, 1), mask=r_ok)
        outside = (rblk[:, None] != kb) & (kb != 0)
        tl.store(vrow + kpos, tl.sum(tl.where(outside, p, 0.0), 0), mask=k_ok)


def score_rows(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, block_size: int, scale: float,
               doc_ids: torch.Tensor | None = None):
    """q [B, S, Hq, D], k [B, S, Hkv, D]; rows: sorted LongTensor [n] of query positions. Returns fp32
    (lse [B, Hq, n] natural-log softmax normaliser of each row's visible scaled logits, pooled [B, Hq, n, nKB]
    mass per key block, vert [B, Hq, S] column mass summed over rows outside the kept blocks, 0 in block 0)."""
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    n = rows.numel()
    n_kb = -(-S // block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton scorer needs a power-of-two block_size >= 16; got {block_size}")
    qr = q[:, rows]  # [B, n, Hq, D]
    if k.stride(-1) != 1:
        k = k.contiguous()
    tiles = -(-n // _ROWS)
    dev = q.device
    lse = torch.empty(B, Hq, n, device=dev, dtype=torch.float32)
    pooled = torch.zeros(B, Hq, n, n_kb, device=dev, dtype=torch.float32)
    vpart = torch.zeros(tiles, B * Hq, S, device=dev, dtype=torch.float32)
    rows32 = rows.to(torch.int32).contiguous()
    docs = doc_ids.to(device=dev, dtype=torch.int32).contiguous() if doc_ids is not None else rows32
    _score_kernel[(tiles, B * Hq)](
        qr, k, rows32, docs, lse, pooled, vpart,
        n, S, n_kb, Hq, Hq // Hkv, D, scale * _LOG2E,
        qr.stride(0), qr.stride(1), qr.stride(2), k.stride(0), k.stride(1), k.stride(2),
        docs.stride(0) if doc_ids is not None else 0,
        HAS_DOCS=doc_ids is not None, BLOCK_M=_ROWS, BLOCK_N=block_size,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4 if block_size <= 64 else 8,
    )
    vert = vpart.sum(0).view(B, Hq, S)
    return lse, pooled, vert


def default_scale(D: int, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
