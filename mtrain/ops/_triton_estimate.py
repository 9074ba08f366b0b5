"""The GPU side of the pattern estimator, in Triton: the scored query rows against every visible key, never
materialising the [rows x S] probabilities, and the mass of chosen columns recomputed from q and k.

`score_rows` runs two kernels over (row tile, batch x head, key chunk) programs; the key axis is split so that
the ~1K scored rows of a long sequence still fill the GPU. Pass 1 takes each row's softmax max and sum over
the visible keys of its chunk (causal, same document). Pass 2 combines every chunk's max and sum into the
row's normaliser, recomputes the probabilities tile by tile and writes only what the estimator reads: the
mass per (row, key block) and, per row tile, the mass per key column outside the always-kept blocks (sink
block 0 and the row's own block). Those column partials are summed over row tiles afterwards in a fixed
order, so the result does not depend on scheduling.

`group_column_mass` gives, per query block of the scored rows, the probabilities of a list of key columns
summed over the block's rows: what the chosen verticals take from each block offset, and what the final
index's column lists hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS = 64  # scored rows per program
_LOG2E = 1.4426950408889634


@triton.jit
def _tile_logits(q, kbase, start, gstart, rpos, r_ok, rdoc, docs, S, sks, d, d_ok, scale_log2,
                 HAS_DOCS: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """The row tile's scaled logits (log2 units) against the keys stored at start .. start + BLOCK_N - 1 (global
    positions gstart .. gstart + BLOCK_N - 1; the same numbers unless a shard's key blocks are mapped), -inf where a
    row does not see the key (causal, padding, another document); and the keys' storage index and in-range mask."""
    kpos = start + tl.arange(0, BLOCK_N)
    gpos = gstart + tl.arange(0, BLOCK_N)
    k_ok = kpos < S
    kt = tl.load(kbase + kpos[None, :] * sks + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, kt, input_precision=PREC) * scale_log2
    vis = (gpos[None, :] <= rpos[:, None]) & k_ok[None, :] & r_ok[:, None]
    if HAS_DOCS:
        kdoc = tl.load(docs + gpos, mask=k_ok, other=-2)
        vis = vis & (kdoc[None, :] == rdoc[:, None])
    return tl.where(vis, s, float("-inf")), kpos, k_ok


@triton.jit
def _tile_logits_full(q, kbase, start, sks, d, d_ok, scale_log2, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """`_tile_logits` for keys every row of the tile sees (below the tile's first row's block, no documents): no
    masks. Rows past the end of the list hold q = 0 (logit 0); the callers weigh them 0."""
    kpos = start + tl.arange(0, BLOCK_N)
    kt = tl.load(kbase + kpos[None, :] * sks + d[:, None], mask=d_ok[:, None], other=0.0)
    return tl.dot(q, kt, input_precision=PREC) * scale_log2, kpos


@triton.jit
def _key_ranges(ROWS, TILE_MID, tile, c, chunk, end, HAS_DOCS: tl.constexpr, HAS_MAP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """(lo, mid, hi): the program's keys lo .. hi - 1 (storage order), of which lo .. mid - 1 every row of the tile
    sees (whole key blocks before the block of its first, lowest row; none with documents or without SPLIT). With
    mapped key blocks (a shard's), the tile's split point comes from TILE_MID."""
    lo = c * chunk
    hi = tl.minimum(end, lo + chunk)
    mid = lo
    if SPLIT and not HAS_DOCS:
        if HAS_MAP:
            first_key = tl.load(TILE_MID + tile)
        else:
            first_key = tl.load(ROWS + tile * BLOCK_M) // BLOCK_N * BLOCK_N
        mid = tl.maximum(lo, tl.minimum(hi, first_key))
    return lo, mid, hi


@triton.jit
def _global_start(KMAP, start, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr):
    """The global position of the key stored at `start` (a multiple of BLOCK_N): mapped through KMAP (each stored key
    block's global block) when the keys are a shard's, else `start` itself."""
    if HAS_MAP:
        return tl.load(KMAP + start // BLOCK_N) * BLOCK_N
    return start


@triton.jit
def _tile_rows(Q, ROWS, DOCS, TILE_END, H, n, D, sqb, sqn, sqh, sdb,
               HAS_DOCS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """The program's (row tile, batch x head, key chunk) and batch / head; the tile's row indices, validity,
    positions, own blocks, documents and queries; and the first key position no row of the tile sees (rows are
    sorted)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    c = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = bh % H
    r_idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r_idx < n
    rpos = tl.load(ROWS + r_idx, mask=r_ok, other=-1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + b * sqb + r_idx[:, None] * sqn + h * sqh + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0)
    rdoc = rpos  # unused without documents
    if HAS_DOCS:
        rdoc = tl.load(DOCS + b * sdb + tl.maximum(rpos, 0), mask=r_ok, other=-1)
    if HAS_MAP:  # stored keys before the first one no row of the tile sees
        end = tl.load(TILE_END + tile)
    else:
        end = tl.load(ROWS + tl.minimum(tile * BLOCK_M + BLOCK_M, n) - 1) + 1
    return tile, bh, c, b, h, r_idx, r_ok, rpos, rpos // BLOCK_N, rdoc, q, d, d_ok, end


@triton.jit
def _score_stats_kernel(
    Q, K, ROWS, DOCS, MPART, LPART, KMAP, TILE_MID, TILE_END,
    n, S, H, G, D, scale_log2, chunk,
    sqb, sqn, sqh, skb, sks, skh, sdb,
    HAS_DOCS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
):
    """Pass 1, per (row tile, batch x head, key chunk): each row's max and sum (log2 units) over the visible
    keys of the chunk."""
    tile, bh, c, b, h, r_idx, r_ok, rpos, rblk, rdoc, q, d, d_ok, end = _tile_rows(
        Q, ROWS, DOCS, TILE_END, H, n, D, sqb, sqn, sqh, sdb, HAS_DOCS, HAS_MAP, BLOCK_M, BLOCK_N, BLOCK_D)
    kbase = K + b * skb + (h // G) * skh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo, mid, hi = _key_ranges(ROWS, TILE_MID, tile, c, chunk, end, HAS_DOCS, HAS_MAP, BLOCK_M, BLOCK_N, SPLIT)
    for start in range(lo, mid, BLOCK_N):  # keys every row sees: no masks, and no -inf to guard
        s, kpos = _tile_logits_full(q, kbase, start, sks, d, d_ok, scale_log2, BLOCK_N, PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    for start in range(mid, hi, BLOCK_N):
        s, kpos, k_ok = _tile_logits(q, kbase, start, _global_start(KMAP, start, HAS_MAP, BLOCK_N), rpos, r_ok, rdoc,
                                     DOCS + b * sdb, S, sks, d, d_ok, scale_log2, HAS_DOCS, BLOCK_N, PREC)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    at = (c * tl.num_programs(1) + bh) * n + r_idx
    tl.store(MPART + at, m_i, mask=r_ok)
    tl.store(LPART + at, l_i, mask=r_ok)


@triton.jit
def _score_sums_kernel(
    Q, K, ROWS, DOCS, MPART, LPART, LSE, POOLED, VPART, KMAP, TILE_MID, TILE_END,
    n, S, nKB, H, G, D, scale_log2, chunk, n_chunks,
    sqb, sqn, sqh, skb, sks, skh, sdb,
    HAS_DOCS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
):
    """Pass 2, per (row tile, batch x head, key chunk): the rows' normalisers from every chunk's max and sum
    (chunk 0 stores them), then the probabilities of the chunk's keys, summed per (row, key block) and, over
    the tile's rows, per key column outside the always-kept blocks. n_chunks: the max / sum partials per row
    (MPART / LPART hold that many; one when they were already combined, e.g. across a CP group)."""
    tile, bh, c, b, h, r_idx, r_ok, rpos, rblk, rdoc, q, d, d_ok, end = _tile_rows(
        Q, ROWS, DOCS, TILE_END, H, n, D, sqb, sqn, sqh, sdb, HAS_DOCS, HAS_MAP, BLOCK_M, BLOCK_N, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for j in range(0, n_chunks):  # the same order in every program: one normaliser per row
        at = (j * tl.num_programs(1) + bh) * n + r_idx
        mj = tl.load(MPART + at, mask=r_ok, other=float("-inf"))
        lj = tl.load(LPART + at, mask=r_ok, other=0.0)
        m_new = tl.maximum(m_i, mj)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + lj * tl.exp2(mj - m_safe)
        m_i = m_new
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    if c == 0:
        tl.store(LSE + bh * n + r_idx, (m_safe + tl.log2(tl.maximum(l_i, 1e-30))) / 1.4426950408889634, mask=r_ok)
    kbase = K + b * skb + (h // G) * skh
    prow = POOLED + (bh * n + r_idx).to(tl.int64) * nKB
    vrow = VPART + (tile * (tl.num_programs(1)) + bh).to(tl.int64) * S
    lo, mid, hi = _key_ranges(ROWS, TILE_MID, tile, c, chunk, end, HAS_DOCS, HAS_MAP, BLOCK_M, BLOCK_N, SPLIT)
    for start in range(lo, mid, BLOCK_N):  # keys every row sees, outside every row's own block
        s, kpos = _tile_logits_full(q, kbase, start, sks, d, d_ok, scale_log2, BLOCK_N, PREC)
        p = tl.exp2(s - m_safe[:, None]) * inv[:, None]  # rows past the list: inv = 0
        kb = start // BLOCK_N  # stored block; pooled is per stored block, the kept-block tests use the global one
        gkb = _global_start(KMAP, start, HAS_MAP, BLOCK_N) // BLOCK_N
        tl.store(prow + kb, tl.sum(p, 1), mask=r_ok)
        if gkb != 0:  # block 0 is always kept: its columns stay 0
            tl.store(vrow + kpos, tl.sum(p, 0))
    for start in range(mid, hi, BLOCK_N):
        gstart = _global_start(KMAP, start, HAS_MAP, BLOCK_N)
        s, kpos, k_ok = _tile_logits(q, kbase, start, gstart, rpos, r_ok, rdoc, DOCS + b * sdb, S, sks, d, d_ok,
                                     scale_log2, HAS_DOCS, BLOCK_N, PREC)
        p = tl.exp2(s - m_safe[:, None]) * inv[:, None]  # hidden pairs: exp2(-inf) = 0
        kb = start // BLOCK_N
        gkb = gstart // BLOCK_N
        tl.store(prow + kb, tl.sum(p, 1), mask=r_ok)
        outside = (rblk[:, None] != gkb) & (gkb != 0)
        tl.store(vrow + kpos, tl.sum(tl.where(outside, p, 0.0), 0), mask=k_ok)


# Keys one program of the scorer walks (a multiple of the block size): the key axis is split into chunks so
# that a few thousand rows still fill the GPU.
KEYS_PER_PROGRAM = 4096


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for q/k of `dtype`: three tf32 products for fp32 (errors near fp32's own; the
    full-precision FMA dots compiled for minutes), one for 16-bit inputs."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def scorer_config(block_size: int, head_dim: int, dtype: torch.dtype | None = None) -> dict:
    """The scorer's launch settings for a block size and head dim: rows per program (`rows`), warps, pipeline
    stages, whether the keys every row of a program sees run without masks (`split`; the same sums up to float
    rounding), and the keys one program walks (`keys`, rounded to the block size; None: KEYS_PER_PROGRAM).

    Chosen on an H200 (`tools/bench_scorer.py`; the figures: BENCHMARKS.md "The scorer's launch
    settings"): at 128-token blocks 128 rows and 4 warps beat 64 rows and 8 warps; at 64-token blocks 64 rows and 4
    warps stay the fastest. Summing a tile's columns on the tensor cores was slower everywhere or ran out of shared
    memory; block-major stores of the masses were no faster. fp32 inputs (tf32x3 dots, split copies of each operand
    in shared memory): 32 rows and one stage, which fit where 128 rows did not (block 128, head dim 128)."""
    if dtype == torch.float32:
        return dict(rows=32, warps=4, stages=1, split=True, keys=None)
    if block_size >= 128:
        return dict(rows=128, warps=4, stages=2 if head_dim > 64 else None, split=True, keys=None)
    return dict(rows=_ROWS, warps=4, stages=None, split=True, keys=None)


def combine_stats(m: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax max / sum partials [P, ...] (log2 units, max -inf and sum 0 where a part saw no key) combined over
    the first axis in its order, as the scorer's second pass combines its chunks: (max, sum) [...]."""
    top = m.amax(0)
    safe = torch.where(top == float("-inf"), 0.0, top)
    return top, (l * torch.exp2(m - safe)).sum(0)


def shard_key_plan(rows: torch.Tensor, key_blocks: torch.Tensor, block_size: int, tile_rows: int):
    """Per row tile of the scorer over a shard's keys (stored as whole blocks whose global block ids `key_blocks`
    [nKB_local] ascend): (first stored key of a block at or after the block of the tile's first row, stored keys
    before the first block past its last row's block) int32 [tiles] each: `_key_ranges`' split point and the
    tile's end."""
    firsts = rows[::tile_rows] // block_size
    lasts = rows[torch.clamp(torch.arange(tile_rows - 1, rows.numel() + tile_rows - 1, tile_rows, device=rows.device),
                             max=rows.numel() - 1)] // block_size
    kb = key_blocks.to(torch.int64)
    mid = torch.searchsorted(kb, firsts) * block_size
    end = torch.searchsorted(kb, lasts, right=True) * block_size
    return mid.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def score_rows(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, block_size: int, scale: float,
               doc_ids: torch.Tensor | None = None, config: dict | None = None,
               key_blocks: torch.Tensor | None = None, combine=None):
    """q [B, n, Hq, D]: the queries at positions `rows` (sorted LongTensor [n]); k [B, S, Hkv, D]. Returns fp32
    (lse [B, Hq, n] natural-log softmax normaliser of each row's visible scaled logits, pooled [B, Hq, n, nKB]
    mass per key block, vert [B, Hq, S] column mass summed over rows outside the kept blocks, 0 in block 0).
    config: launch settings over `scorer_config`'s (keys rows, warps, stages, split; tools/bench_scorer.py).

    A shard's keys (context parallelism): key_blocks [S / block_size], the ascending global block id of each stored
    key block (S a multiple of block_size; doc_ids are then the whole sequence's); pooled and vert are then per
    stored block and key. combine: a function of the rows' softmax (max, sum) [B * Hq, n] over these keys (log2
    units) returning those over all keys (e.g. gathered over the CP group and `combine_stats`), so that the
    probabilities are normalised over the whole sequence."""
    B, n, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    n_kb = -(-S // block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton scorer needs a power-of-two block_size >= 16; got {block_size}")
    if rows.numel() != n:
        raise ValueError(f"q holds {n} rows but rows lists {rows.numel()}")
    if key_blocks is not None and (S % block_size or key_blocks.numel() != n_kb):
        raise ValueError(f"key_blocks must list the global block of each of the {n_kb} stored key blocks "
                         f"({S} keys, a multiple of block_size={block_size}); got {key_blocks.numel()}")
    qr = q if q.stride(-1) == 1 else q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cfg = {**scorer_config(block_size, D, q.dtype if q.is_cuda else None), **(config or {})}
    unknown = set(cfg) - {"rows", "warps", "stages", "split", "keys"}
    if unknown:
        raise ValueError(f"unknown scorer config keys {sorted(unknown)}: use rows, warps, stages, split, keys")
    tiles = -(-n // cfg["rows"])
    chunk = max(block_size, (cfg["keys"] or KEYS_PER_PROGRAM) // block_size * block_size)
    n_chunks = -(-S // chunk)
    dev = q.device
    lse = torch.empty(B, Hq, n, device=dev, dtype=torch.float32)
    mpart = torch.empty(n_chunks, B * Hq, n, device=dev, dtype=torch.float32)
    lpart = torch.empty_like(mpart)
    pooled = torch.zeros(B, Hq, n, n_kb, device=dev, dtype=torch.float32)
    vpart = torch.zeros(tiles, B * Hq, S, device=dev, dtype=torch.float32)
    rows32 = rows.to(torch.int32).contiguous()
    docs = doc_ids.to(device=dev, dtype=torch.int32).contiguous() if doc_ids is not None else rows32
    strides = (qr.stride(0), qr.stride(1), qr.stride(2), k.stride(0), k.stride(1), k.stride(2),
               docs.stride(0) if doc_ids is not None else 0)
    meta = dict(HAS_DOCS=doc_ids is not None, HAS_MAP=key_blocks is not None, BLOCK_M=cfg["rows"],
                BLOCK_N=block_size, BLOCK_D=max(16, triton.next_power_of_2(D)), PREC=dot_precision(q.dtype),
                SPLIT=bool(cfg["split"]), num_warps=cfg["warps"])
    if cfg["stages"] is not None:
        meta["num_stages"] = cfg["stages"]
    if key_blocks is not None:
        kmap = key_blocks.to(device=dev, dtype=torch.int32).contiguous()
        tile_mid, tile_end = shard_key_plan(rows, kmap, block_size, cfg["rows"])
    else:
        kmap = tile_mid = tile_end = rows32  # unread
    grid = (tiles, B * Hq, n_chunks)
    _score_stats_kernel[grid](qr, k, rows32, docs, mpart, lpart, kmap, tile_mid, tile_end, n, S, Hq, Hq // Hkv, D,
                              scale * _LOG2E, chunk, *strides, **meta)
    n_stats = n_chunks
    if combine is not None:
        m, l = combine(*combine_stats(mpart, lpart))
        mpart, lpart, n_stats = m[None].contiguous(), l[None].contiguous(), 1
    _score_sums_kernel[grid](qr, k, rows32, docs, mpart, lpart, lse, pooled, vpart, kmap, tile_mid, tile_end, n, S,
                             n_kb, Hq, Hq // Hkv, D, scale * _LOG2E, chunk, n_stats, *strides, **meta)
    vert = vpart.sum(0).view(B, Hq, S)
    return lse, pooled, vert



@triton.jit
def _group_cols_kernel(
    QR, K, ROWS, TABLE, LSE, COLS, CLOC, DOCS, OUT,
    n, P, U, C, H, G, D, scale_log2, block_size,
    sqb, sqn, sqh, skb, sks, skh, sdb, scb, sch, scu,
    HAS_DOCS: tl.constexpr, HAS_LOCAL: tl.constexpr, SKIP_KEPT: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    """Per (column tile, query block u, batch x head): the tile's columns' probabilities summed over u's rows. A tile
    of padding only (the -1 entries of a wide, mostly empty column list) stores zeros without loading q or k.
    HAS_LOCAL: CLOC (laid out as COLS) holds where each column's key is stored (a shard's keys); COLS its position."""
    ct = tl.program_id(0)
    u = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // G
    c = ct * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = c < C
    cpos = tl.load(COLS + b * scb + h * sch + u * scu + c, mask=c_in, other=-1)
    if tl.max(cpos, 0) < 0:
        tl.store(OUT + (bh * U + u).to(tl.int64) * C + c, tl.zeros([BLOCK_C], dtype=tl.float32), mask=c_in)
        return
    p = tl.arange(0, BLOCK_P)
    t = tl.load(TABLE + u * P + p, mask=p < P, other=-1)
    r_ok = t >= 0
    tt = tl.maximum(t, 0)
    rpos = tl.load(ROWS + tt, mask=r_ok, other=-1)
    lse = tl.load(LSE + bh * n + tt, mask=r_ok, other=0.0) * 1.4426950408889634
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(QR + b * sqb + tt[:, None] * sqn + h * sqh + d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0)
    c_ok = cpos >= 0
    cidx = cpos
    if HAS_LOCAL:
        cidx = tl.load(CLOC + b * scb + h * sch + u * scu + c, mask=c_in, other=-1)
    kt = tl.load(K + b * skb + tl.maximum(cidx, 0)[None, :].to(tl.int64) * sks + hk * skh + d[:, None],
                 mask=c_ok[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, kt, input_precision=PREC) * scale_log2
    vis = (cpos[None, :] <= rpos[:, None]) & c_ok[None, :] & r_ok[:, None]
    if SKIP_KEPT:
        cblk = cpos // block_size
        vis = vis & (cblk[None, :] != 0) & (cblk[None, :] != (rpos // block_size)[:, None])
    if HAS_DOCS:
        rdoc = tl.load(DOCS + b * sdb + tl.maximum(rpos, 0), mask=r_ok, other=-1)
        cdoc = tl.load(DOCS + b * sdb + tl.maximum(cpos, 0), mask=c_ok, other=-2)
        vis = vis & (cdoc[None, :] == rdoc[:, None])
    pr = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
    tl.store(OUT + (bh * U + u).to(tl.int64) * C + c, tl.sum(pr, 0), mask=c_in)


def group_column_mass(q_rows: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor,
                      table: torch.Tensor, cols: torch.Tensor, scale: float, block_size: int,
                      doc_ids: torch.Tensor | None = None, skip_kept: bool = False,
                      cols_local: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax mass of chosen key columns, summed over the scored rows of each query block.

    q_rows [B, n, Hq, D]: the scored rows' queries (positions `rows` [n], sorted); k [B, S, Hkv, D]; lse
    [B, Hq, n]: each row's natural-log softmax normaliser (`score_rows`); table [U, P]: the rows of each of U
    query blocks (indices into rows, -1 padded; `estimate.row_groups`); cols [B, Hq, U or 1, C]: key positions
    per block (or one set for all), -1 padded. A (row, column) pair counts when the row sees the key (causal,
    same document) and, with skip_kept, the key lies outside block 0 and the row's own block. cols_local (shaped as
    cols): where each column's key is stored in k when k holds a shard (context parallelism), else None.
    Returns fp32 [B, Hq, U, C]: per block and column, the summed probabilities (0 for padding)."""
    B, n, Hq, D = q_rows.shape
    Hkv = k.shape[2]
    U, P = table.shape
    C = cols.shape[-1]
    out = torch.empty(B, Hq, U, C, device=q_rows.device, dtype=torch.float32)
    if C == 0 or U == 0:
        return out.zero_()
    cols = cols.to(torch.int32)
    if cols.stride(-1) != 1:
        cols = cols.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if q_rows.stride(-1) != 1:
        q_rows = q_rows.contiguous()
    if cols_local is not None:
        cols_local = cols_local.to(torch.int32).expand(cols.shape).contiguous()
        cols = cols.contiguous()
    rows32 = rows.to(torch.int32).contiguous()
    table32 = table.to(device=q_rows.device, dtype=torch.int32).contiguous()
    docs = doc_ids.to(device=q_rows.device, dtype=torch.int32).contiguous() if doc_ids is not None else rows32
    block_c = 64
    _group_cols_kernel[(triton.cdiv(C, block_c), U, B * Hq)](
        q_rows, k, rows32, table32, lse.contiguous(), cols, cols if cols_local is None else cols_local, docs, out,
        n, P, U, C, Hq, Hq // Hkv, D, scale * _LOG2E, block_size,
        q_rows.stride(0), q_rows.stride(1), q_rows.stride(2), k.stride(0), k.stride(1), k.stride(2),
        docs.stride(0) if doc_ids is not None else 0, cols.stride(0), cols.stride(1),
        cols.stride(2) if cols.shape[2] > 1 else 0,
        HAS_DOCS=doc_ids is not None, HAS_LOCAL=cols_local is not None, SKIP_KEPT=skip_kept, BLOCK_P=max(16, triton.next_power_of_2(P)),
        BLOCK_C=block_c, BLOCK_D=max(16, triton.next_power_of_2(D)),
        PREC=dot_precision(q_rows.dtype), num_warps=4,
    )
    return out
