"""Triton kernels for block-sparse + column attention with global positions (forward, dQ, dK/dV) and
their launchers; `mtrain.ops.partial` and `vertical_slash_attention` are the public doors to them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from mtrain.ops._triton_estimate import dot_precision
from mtrain.ops.columns import RingColumns, VerticalColumns
from mtrain.ops.index import BOUNDED, COLUMN_BASE, ColumnPlan, column_plan, compact, transpose_blocks_csr
from mtrain.ops.lists import check_list_entries, doc_ranges, left_pack

_LOG2E = 1.4426950408889634
# Positions of padded keys: larger than any real position, so the causal test drops them.
_FAR = tl.constexpr(1 << 60)

# Kernel tiles are decoupled from index blocks: an index block of BS tokens runs as query sub-tiles of QT
# rows (separate programs) and key sub-tiles of KT keys (looped). NQS = ceil(BS / QT), NKS = ceil(BS / KT);
# a sub-tile row/key is real when its offset inside the block is < BS (odd block sizes run padded, NQS = 1).


@triton.jit
def _last_keep(KP, j, qmax, Sk, BS: tl.constexpr, KT: tl.constexpr, NKS: tl.constexpr):
    """How many leading key sub-tiles of key block j to run for queries whose largest position is qmax:
    up to the last sub-tile holding a key at or before qmax (the causal upper right of a diagonal block
    is skipped; exact for positions in any order, since only trailing invisible sub-tiles are cut)."""
    offs_k = tl.arange(0, KT)
    keep = 0
    for t in tl.static_range(NKS):
        kin = t * KT + offs_k
        keys = j * BS + kin
        kp = tl.load(KP + keys, mask=(kin < BS) & (keys < Sk), other=_FAR)
        keep = tl.where(tl.min(kp, 0) <= qmax, t + 1, keep)
    return keep


@triton.jit
def _first_keep(QP, i, kmin, Sq, BS: tl.constexpr, QT: tl.constexpr, NQS: tl.constexpr):
    """The first query sub-tile of query block i holding a query at or after kmin (NQS if none): the
    leading sub-tiles a key sub-tile cannot reach causally are skipped (any position order)."""
    offs_q = tl.arange(0, QT)
    first = NQS
    for s in tl.static_range(NQS):
        rin = s * QT + offs_q
        rows = i * BS + rin
        qp = tl.load(QP + rows, mask=(rin < BS) & (rows < Sq), other=-1)
        first = tl.minimum(first, tl.where(tl.max(qp, 0) >= kmin, s, NQS))
    return first


@triton.jit
def _softmax_step(q, k, v, ok, scale_log2, m_i, l_i, acc, PREC: tl.constexpr):
    """One online-softmax update of (m_i, l_i, acc) with a key tile; `ok` masks the pairs."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _query_tile(pid, bh, H, GROUP, Sq, BS: tl.constexpr, QT: tl.constexpr, NQS: tl.constexpr):
    """Where program (pid, bh) works: query block i, batch b (int64: offsets can pass 2**31 elements),
    head h and its KV head, the QT rows of its sub-tile and which of them are real."""
    i = pid // NQS
    b = (bh // H).to(tl.int64)
    h = bh % H
    rin = (pid % NQS) * QT + tl.arange(0, QT)
    rows = i * BS + rin
    return i, b, h, h // GROUP, rows, (rin < BS) & (rows < Sq)


@triton.jit
def _list_iters(list_base, n_blk, KP, qp, Sk, BS: tl.constexpr, KT: tl.constexpr, NKS: tl.constexpr,
                CAUSAL: tl.constexpr):
    """Key sub-tile iterations over a query block's sorted list of n_blk key blocks: NKS per block, and
    causally only the leading sub-tiles of its last (diagonal) block that the rows can see."""
    n_iter = n_blk * NKS
    if CAUSAL:
        if n_blk > 0:
            j_last = tl.load(list_base + n_blk - 1)
            n_iter = (n_blk - 1) * NKS + _last_keep(KP, j_last, tl.max(qp, 0), Sk, BS, KT, NKS)
    return n_iter


@triton.jit
def _kv_tile(k_base, v_base, KP, KD, ids, valid, row_ok, qp, qd, sks, svs, kd_base,
             D: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr):
    """K and V rows `ids` (key positions in this shard; `valid` masks padding) and the [rows, keys] mask
    of the pairs a query tile may score: real rows and keys, causal by global position, same document."""
    offs_d = tl.arange(0, D)
    k = tl.load(k_base + ids[:, None] * sks + offs_d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_base + ids[:, None] * svs + offs_d[None, :], mask=valid[:, None], other=0.0)
    ok = valid[None, :] & row_ok[:, None]
    if CAUSAL:
        kp = tl.load(KP + ids, mask=valid, other=_FAR)
        ok = ok & (kp[None, :] <= qp[:, None])
    if HAS_DOC:
        kd = tl.load(kd_base + ids, mask=valid, other=-1)
        ok = ok & (kd[None, :] == qd[:, None])
    return k, v, ok


@triton.jit
def _uncovered_at(cov_base, vb, ok, gi, NQB, SINK: tl.constexpr):
    """Which columns (key blocks vb, query block gi, both global) the listed blocks of the query block leave
    uncovered: vb > 0 and the block offset gi - vb not one of the head's (flag row 1 for the last query block,
    NQB = the flags' length); with SINK (a ring's columns, where the sink block's tokens are columns) vb = 0 too."""
    flagged = ok & (vb > 0)
    row = tl.where(gi == NQB - 1, NQB, 0)
    hit = tl.load(cov_base + row + tl.where(flagged, gi - vb, 0), mask=flagged, other=1)
    active = flagged & (hit == 0)
    if SINK:
        active = active | (ok & (vb == 0))
    return active


@triton.jit
def _uncovered(cov_base, cid, c_ok, i, NQB, BS: tl.constexpr, KP, QP, VCOLS: tl.constexpr):
    """The list-free columns: of the columns before query block i, those its listed blocks do not cover. VCOLS 1
    (`mtrain.ops.columns.VerticalColumns`, one device): column ids are key positions and i the global query block.
    VCOLS 2 (`mtrain.ops.columns.RingColumns`, a context-parallel rank): the blocks come from the keys' and the
    query block's global positions, and the sink block's tokens are columns."""
    if VCOLS == 2:
        vb = tl.load(KP + cid, mask=c_ok, other=0) // BS
        gi = tl.load(QP + i * BS) // BS
    else:
        vb = cid // BS
        gi = i
    return _uncovered_at(cov_base, vb, c_ok, gi, NQB, VCOLS == 2)


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, QP, KP, BI, BC, CI, CC, QD, KD, COV,
    scale_log2,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
    sbib, sbih, sbii, sbcb, sbch, scib, scih, scii, sccb, scch, sqdb, skdb, scvb, scvh,
    Sq, Sk, H, GROUP, NQB,
    BS: tl.constexpr, QT: tl.constexpr, KT: tl.constexpr, NQS: tl.constexpr, NKS: tl.constexpr,
    D: tl.constexpr, HAS_COLS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, HAS_DOC: tl.constexpr,
    MERGE: tl.constexpr = False, VCOLS: tl.constexpr = 0,
):
    """Out and LSE of one query sub-tile (QT rows of query block i) over its block's key list (each key
    block as NKS sub-tiles) and columns; with MERGE, merged by LSE into the result O and LSE already hold (the
    same rows over other keys)."""
    i, b, h, hk, rows, row_ok = _query_tile(tl.program_id(0), tl.program_id(1), H, GROUP, Sq, BS, QT, NQS)
    offs_k = tl.arange(0, KT)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + rows[:, None] * sqs + h * sqh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    qp = tl.load(QP + rows, mask=row_ok, other=-1)
    qd = qp  # read only with HAS_DOC
    if HAS_DOC:
        qd = tl.load(QD + b * sqdb + rows, mask=row_ok, other=-1)
    m_i = tl.full([QT], float("-inf"), tl.float32)
    l_i = tl.zeros([QT], tl.float32)
    acc = tl.zeros([QT, D], tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    list_base = BI + b * sbib + h * sbih + i * sbii
    n_iter = _list_iters(list_base, tl.load(BC + b * sbcb + h * sbch + i), KP, qp, Sk, BS, KT, NKS, CAUSAL)
    for n in range(0, n_iter):
        j = tl.load(list_base + n // NKS)
        kin = (n % NKS) * KT + offs_k
        keys = j * BS + kin
        key_ok = (kin < BS) & (keys < Sk)
        k, v, ok = _kv_tile(k_base, v_base, KP, KD, keys, key_ok, row_ok, qp, qd, sks, svs, KD + b * skdb,
                            D, CAUSAL, HAS_DOC)
        m_i, l_i, acc = _softmax_step(q, k, v, ok, scale_log2, m_i, l_i, acc, PREC)
    if HAS_COLS:
        n_cols = tl.load(CC + b * sccb + h * scch + i)
        for c0 in range(0, n_cols, KT):
            slot = c0 + offs_k
            c_ok = slot < n_cols
            cid = tl.load(CI + b * scib + h * scih + i * scii + slot, mask=c_ok, other=0)
            if VCOLS:
                c_ok = _uncovered(COV + b * scvb + h * scvh, cid, c_ok, i, NQB, BS, KP, QP, VCOLS)
            k, v, ok = _kv_tile(k_base, v_base, KP, KD, cid, c_ok, row_ok, qp, qd, sks, svs, KD + b * skdb,
                                D, CAUSAL, HAS_DOC)
            m_i, l_i, acc = _softmax_step(q, k, v, ok, scale_log2, m_i, l_i, acc, PREC)
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_at = b * sob + rows[:, None] * sos + h * soh + offs_d[None, :]
    l_at = b * slb + h * slh + rows
    if MERGE:  # weights from the larger lse, so nothing overflows; a row neither side saw stays 0 / -inf
        l_o = tl.load(LSE + l_at, mask=row_ok, other=float("-inf"))
        o_o = tl.load(O + o_at, mask=row_ok[:, None], other=0.0).to(tl.float32)
        m = tl.maximum(l_o, lse)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_o, w = tl.exp(l_o - m), tl.exp(lse - m)
        total = w_o + w
        inv = tl.where(total > 0, 1.0 / total, 0.0)
        out = o_o * (w_o * inv)[:, None] + out * (w * inv)[:, None]
        lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
    tl.store(O + o_at, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + l_at, lse, mask=row_ok)


@triton.jit
def _dq_step(q, do, k, v, ok, lse2, delta, scale_log2, dq, PREC: tl.constexpr):
    """dQ contribution of one key tile (before the softmax scale)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
    p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DO, O, LSE, DELTA, DQ, DQI, QP, KP, BI, BC, CI, CC, QD, KD, COV,
    scale_log2, scale,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, slb, slh, sob, sos, soh, sgb, sgs, sgh,
    sbib, sbih, sbii, sbcb, sbch, scib, scih, scii, sccb, scch, sqdb, skdb, scvb, scvh,
    Sq, Sk, H, GROUP, NQB,
    BS: tl.constexpr, QT: tl.constexpr, KT: tl.constexpr, NQS: tl.constexpr, NKS: tl.constexpr,
    D: tl.constexpr, HAS_COLS: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_INIT: tl.constexpr, VCOLS: tl.constexpr = 0,
):
    """dQ of one query sub-tile (the deterministic backward's dQ pass); with HAS_INIT plus DQI's rows (laid out as
    DQ), stored in DQ's dtype. It also computes the rows' delta = rowsum(dO * O) and stores it in DELTA (laid out
    as LSE) for the dK/dV passes that follow."""
    i, b, h, hk, rows, row_ok = _query_tile(tl.program_id(0), tl.program_id(1), H, GROUP, Sq, BS, QT, NQS)
    offs_k = tl.arange(0, KT)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + rows[:, None] * sqs + h * sqh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * sdb + rows[:, None] * sds + h * sdh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + rows, mask=row_ok, other=float("inf"))
    # A row that saw no key (lse = -inf) gets p = 0 everywhere.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    o = tl.load(O + b * sob + rows[:, None] * sos + h * soh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + b * slb + h * slh + rows, delta, mask=row_ok)
    qp = tl.load(QP + rows, mask=row_ok, other=-1)
    qd = qp  # read only with HAS_DOC
    if HAS_DOC:
        qd = tl.load(QD + b * sqdb + rows, mask=row_ok, other=-1)
    dq = tl.zeros([QT, D], tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    list_base = BI + b * sbib + h * sbih + i * sbii
    n_iter = _list_iters(list_base, tl.load(BC + b * sbcb + h * sbch + i), KP, qp, Sk, BS, KT, NKS, CAUSAL)
    for n in range(0, n_iter):
        j = tl.load(list_base + n // NKS)
        kin = (n % NKS) * KT + offs_k
        keys = j * BS + kin
        key_ok = (kin < BS) & (keys < Sk)
        k, v, ok = _kv_tile(k_base, v_base, KP, KD, keys, key_ok, row_ok, qp, qd, sks, svs, KD + b * skdb,
                            D, CAUSAL, HAS_DOC)
        dq = _dq_step(q, do, k, v, ok, lse2, delta, scale_log2, dq, PREC)
    if HAS_COLS:
        n_cols = tl.load(CC + b * sccb + h * scch + i)
        for c0 in range(0, n_cols, KT):
            slot = c0 + offs_k
            c_ok = slot < n_cols
            cid = tl.load(CI + b * scib + h * scih + i * scii + slot, mask=c_ok, other=0)
            if VCOLS:
                c_ok = _uncovered(COV + b * scvb + h * scvh, cid, c_ok, i, NQB, BS, KP, QP, VCOLS)
            k, v, ok = _kv_tile(k_base, v_base, KP, KD, cid, c_ok, row_ok, qp, qd, sks, svs, KD + b * skdb,
                                D, CAUSAL, HAS_DOC)
            dq = _dq_step(q, do, k, v, ok, lse2, delta, scale_log2, dq, PREC)
    at = b * sgb + rows[:, None] * sgs + h * sgh + offs_d[None, :]
    dq = dq * scale
    if HAS_INIT:
        dq += tl.load(DQI + at, mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(DQ + at, dq, mask=row_ok[:, None])


@triton.jit
def _dkdv_step(Q, DO, LSE, DELTA, QP, QD, DQ, k, v, kp, kd, key_ok, dk, dv, b, h, rows, row_ok, scale_log2, scale,
               sqb, sqs, sqh, sdb, sds, sdh, slb, slh, sqdb, sgb, sgs, sgh,
               D: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, HAS_DOC: tl.constexpr,
               DQ_ATOMIC: tl.constexpr):
    """dK/dV contribution of one query tile (rows of head h) to a key tile (key_ok masks its keys). DQ_ATOMIC:
    also add the tile's dQ share to DQ (fp32, [B, Sq, Hq, D] strides sgb/sgs/sgh) with atomics (the fused
    backward)."""
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * sqb + rows[:, None] * sqs + h * sqh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * sdb + rows[:, None] * sds + h * sdh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + rows, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + b * slb + h * slh + rows, mask=row_ok, other=0.0)
    st = tl.dot(k, tl.trans(q), input_precision=PREC) * scale_log2
    ok = key_ok[:, None] & row_ok[None, :]
    if CAUSAL:
        qp = tl.load(QP + rows, mask=row_ok, other=-1)
        ok = ok & (kp[:, None] <= qp[None, :])
    if HAS_DOC:
        qd = tl.load(QD + b * sqdb + rows, mask=row_ok, other=-1)
        ok = ok & (kd[:, None] == qd[None, :])
    pt = tl.where(ok, tl.exp2(st - lse2[None, :]), 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
    dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
    if DQ_ATOMIC:
        dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=PREC) * scale
        tl.atomic_add(DQ + b * sgb + rows[:, None] * sgs + h * sgh + offs_d[None, :], dq, mask=row_ok[:, None],
                      sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, EXK, EXV, QP, KP, TI, TS, PRE, IT, IS, IE, ISL, QD, KD,
    scale_log2, scale,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, slb, slh, sgb, sgs, sgh, sqgb, sqgs, sqgh,
    stsb, stsh, sqdb, skdb,
    Sq, Sk, HKV, GROUP, n_kblocks,
    BS: tl.constexpr, QT: tl.constexpr, KT: tl.constexpr, NQS: tl.constexpr, NKS: tl.constexpr,
    D: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, HAS_DOC: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):
    """dK, dV of one key sub-tile (program axis 1) of one work item: a slice of the (head, query block)
    pairs that use its key block, each query block as NQS sub-tiles, summed over the query heads of the
    GQA group in registers. The first item of a key block writes dK/dV; the rest write to extra slots that
    `_reduce_kernel` adds in a fixed order (no atomics). The transposed index is ragged: head h's list of
    key block j is TI[TS[b, h, j] :][: count]. The grid is a bound on the item count (`_split_work`): an
    item with target -1 is padding and exits."""
    item = tl.program_id(0)
    ks = tl.program_id(1)
    t = tl.load(IT + item)
    if t < 0:
        return
    start = tl.load(IS + item)
    end = tl.load(IE + item)
    slot = tl.load(ISL + item)
    j = t % n_kblocks
    bh = t // n_kblocks
    b = (bh // HKV).to(tl.int64)  # batch offsets can pass 2**31 elements
    hk = bh % HKV
    offs_q = tl.arange(0, QT)
    offs_k = tl.arange(0, KT)
    offs_d = tl.arange(0, D)
    kin = ks * KT + offs_k
    keys = j * BS + kin
    key_ok = (kin < BS) & (keys < Sk)
    kp = tl.load(KP + keys, mask=key_ok, other=_FAR)
    kd = kp  # never read without HAS_DOC
    if HAS_DOC:
        kd = tl.load(KD + b * skdb + keys, mask=key_ok, other=-1)
    k = tl.load(K + b * skb + keys[:, None] * sks + hk * skh + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(V + b * svb + keys[:, None] * svs + hk * svh + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    kmin = tl.min(kp, 0)
    dk = tl.zeros([KT, D], tl.float32)
    dv = tl.zeros([KT, D], tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        # PRE holds, per key block, where each head's list starts in the item numbering.
        p0 = tl.load(PRE + t * (GROUP + 1) + g)
        p1 = tl.load(PRE + t * (GROUP + 1) + g + 1)
        t_base = tl.load(TS + b * stsb + h * stsh + j)
        lo = tl.maximum(start, p0) - p0
        hi = tl.minimum(end, p1) - p0
        m0 = lo * NQS
        if CAUSAL:
            if (lo == 0) & (hi > 0):
                # The list is sorted: only its first query block (the diagonal one) can start with
                # sub-tiles that lie wholly before this key sub-tile.
                m0 = _first_keep(QP, tl.load(TI + t_base), kmin, Sq, BS, QT, NQS)
        for m in range(m0, hi * NQS):
            i = tl.load(TI + t_base + m // NQS)
            rin = (m % NQS) * QT + offs_q
            rows = i * BS + rin
            row_ok = (rin < BS) & (rows < Sq)
            dk, dv = _dkdv_step(Q, DO, LSE, DELTA, QP, QD, DQ, k, v, kp, kd, key_ok, dk, dv, b, h, rows, row_ok,
                                scale_log2, scale, sqb, sqs, sqh, sdb, sds, sdh, slb, slh, sqdb, sqgb, sqgs, sqgh,
                                D, CAUSAL, PREC, HAS_DOC, DQ_ATOMIC)
    if slot < 0:
        out_off = b * sgb + keys[:, None] * sgs + hk * sgh + offs_d[None, :]
        tl.store(DK + out_off, dk * scale, mask=key_ok[:, None])
        tl.store(DV + out_off, dv, mask=key_ok[:, None])
    else:
        ex_off = slot.to(tl.int64) * (NKS * KT * D) + kin[:, None] * D + offs_d[None, :]
        tl.store(EXK + ex_off, dk * scale)
        tl.store(EXV + ex_off, dv)


@triton.jit
def _col_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DKC, DVC, DQ, EXK, EXV, QP, KP, U, TQ, TB, IT, IS, IE, ISL, QD, KD, COV,
    scale_log2, scale,
    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, slb, slh, sqgb, sqgs, sqgh,
    sub, suh, stqb, stqh, stqc, scb, sch, scu, sqdb, skdb, scvb, scvh,
    Sq, H, GROUP, u_cap, n_chunks, NQB,
    BS: tl.constexpr, QT: tl.constexpr, NQS: tl.constexpr, CH: tl.constexpr, D: tl.constexpr,
    CAUSAL: tl.constexpr, PREC: tl.constexpr, HAS_DOC: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    VCOLS: tl.constexpr = 0,
):
    """dK, dV of one work item: a chunk of a query head's vertical columns against a slice of the query
    blocks that use them, each as NQS query sub-tiles (first item writes, the rest go to extra slots, as
    in `_dkdv_kernel`; padding items, target -1, exit). With VCOLS (list-free columns) TQ holds each chunk's first
    query block, the chunk's query blocks are the ones from it on, and each block's columns of the chunk come from
    the coverage flags (`_uncovered`) instead of a bit mask."""
    item = tl.program_id(0)
    t = tl.load(IT + item)
    if t < 0:
        return
    start = tl.load(IS + item)
    end = tl.load(IE + item)
    item_slot = tl.load(ISL + item)
    c = t % n_chunks
    bh = t // n_chunks
    b = (bh // H).to(tl.int64)  # batch offsets can pass 2**31 elements
    h = bh % H
    hk = h // GROUP
    offs_c = tl.arange(0, CH)
    offs_q = tl.arange(0, QT)
    offs_d = tl.arange(0, D)
    slot = c * CH + offs_c
    cid = tl.load(U + b * sub + h * suh + slot, mask=slot < u_cap, other=-1)
    c_ok = cid >= 0
    cid = tl.where(c_ok, cid, 0)
    kp = tl.load(KP + cid, mask=c_ok, other=_FAR)
    kd = kp  # never read without HAS_DOC
    if HAS_DOC:
        kd = tl.load(KD + b * skdb + cid, mask=c_ok, other=-1)
    k = tl.load(K + b * skb + cid[:, None] * sks + hk * skh + offs_d[None, :], mask=c_ok[:, None], other=0.0)
    v = tl.load(V + b * svb + cid[:, None] * svs + hk * svh + offs_d[None, :], mask=c_ok[:, None], other=0.0)
    dk = tl.zeros([CH, D], tl.float32)
    dv = tl.zeros([CH, D], tl.float32)
    for m in range(start * NQS, end * NQS):
        n = m // NQS
        if VCOLS == 2:  # a ring's columns: blocks from the global positions, the sink block's tokens active
            i = tl.load(TQ + b * stqb + h * stqh + c * stqc) + n
            gi = tl.load(QP + i * BS) // BS
            vb = kp // BS
            active = _uncovered_at(COV + b * scvb + h * scvh, vb, c_ok & ((vb < gi) | (vb == 0)), gi, NQB, True)
        elif VCOLS:
            i = tl.load(TQ + b * stqb + h * stqh + c * stqc) + n
            active = _uncovered(COV + b * scvb + h * scvh, cid, c_ok & (cid // BS < i), i, NQB, BS, KP, QP, VCOLS)
        else:
            i = tl.load(TQ + b * stqb + h * stqh + c * stqc + n)
            bits = tl.load(TB + b * stqb + h * stqh + c * stqc + n)
            active = ((bits >> offs_c.to(tl.int64)) & 1) != 0
        rin = (m % NQS) * QT + offs_q
        rows = i * BS + rin
        row_ok = (rin < BS) & (rows < Sq)
        dk, dv = _dkdv_step(Q, DO, LSE, DELTA, QP, QD, DQ, k, v, kp, kd, active & c_ok, dk, dv, b, h, rows, row_ok,
                            scale_log2, scale, sqb, sqs, sqh, sdb, sds, sdh, slb, slh, sqdb, sqgb, sqgs, sqgh,
                            D, CAUSAL, PREC, HAS_DOC, DQ_ATOMIC)
    if item_slot < 0:
        out_off = b * scb + h * sch + slot[:, None] * scu + offs_d[None, :]
        tl.store(DKC + out_off, dk * scale, mask=(slot < u_cap)[:, None])
        tl.store(DVC + out_off, dv, mask=(slot < u_cap)[:, None])
    else:
        ex_off = item_slot.to(tl.int64) * (CH * D) + offs_c[:, None] * D + offs_d[None, :]
        tl.store(EXK + ex_off, dk * scale)
        tl.store(EXV + ex_off, dv)


@triton.jit
def _delta_kernel(DO, O, DELTA, Sq, H, sdb, sds, sdh, sob, sos, soh, D: tl.constexpr, DP: tl.constexpr,
                  ROWS: tl.constexpr):
    """delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d] in fp32, ROWS rows of one (batch, head) per program:
    the backward's row term, from one read of dout and out (no fp32 copies of either)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DP)
    ok = (r < Sq)[:, None] & (d < D)[None, :]
    ri = r.to(tl.int64)[:, None]
    do = tl.load(DO + b * sdb + ri * sds + h * sdh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    o = tl.load(O + b * sob + ri * sos + h * soh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * Sq + r, tl.sum(do * o, 1), mask=r < Sq)


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) in fp32, [B, S, H, D] each (last dim contiguous) -> [B, H, S] contiguous."""
    B, S, H, D = out.shape
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    out = out if out.stride(-1) == 1 else out.contiguous()
    delta = torch.empty(B, H, S, dtype=torch.float32, device=out.device)
    rows = 64
    _delta_kernel[(triton.cdiv(S, rows), B * H)](
        dout, out, delta, S, H, dout.stride(0), dout.stride(1), dout.stride(2), out.stride(0), out.stride(1),
        out.stride(2), D=D, DP=triton.next_power_of_2(D), ROWS=rows, num_warps=4)
    return delta


@triton.jit
def _reduce_kernel(DK, DV, EXK, EXV, OFF, NROWS, ES, EC, rstride, ROWS: tl.constexpr, SUB: tl.constexpr,
                   D: tl.constexpr):
    """Add the extra slots (ROWS rows each) of one split target to its rows, in slot order
    (deterministic); program axis 1 picks a sub-tile of SUB rows. Entries without extra slots are the
    padding of a fixed-size table (`_split_work`) and exit."""
    p = tl.program_id(0)
    r0 = tl.program_id(1) * SUB
    count = tl.load(EC + p)
    if count == 0:
        return
    off = tl.load(OFF + p)
    nrows = tl.load(NROWS + p)
    first = tl.load(ES + p)
    offs_r = r0 + tl.arange(0, SUB)
    offs_d = tl.arange(0, D)
    ptr = off + offs_r[:, None] * rstride + offs_d[None, :]
    m = (offs_r < nrows)[:, None]
    ak = tl.load(DK + ptr, mask=m, other=0.0)
    av = tl.load(DV + ptr, mask=m, other=0.0)
    base = first.to(tl.int64) * (ROWS * D) + offs_r[:, None] * D + offs_d[None, :]
    for e in range(0, count):
        ak += tl.load(EXK + base + e * (ROWS * D))
        av += tl.load(EXV + base + e * (ROWS * D))
    tl.store(DK + ptr, ak, mask=m)
    tl.store(DV + ptr, av, mask=m)


# Shapes and strides are not specialised on: one compile serves every shape (they are read a few times only).
@triton.jit(do_not_specialize=["N", "CAP", "HCAP", "fixed_limit", "min_items", "floor", "n_inner", "n_heads", "s_batch",
                               "s_head", "s_inner", "rows_per", "rows_total"])
def _split_kernel(
    WORK, IT, IS, IE, ISL, NEXTRA, HS, HC, HOFF, HNR,
    N, CAP, HCAP, fixed_limit, min_items, floor, n_inner, n_heads, s_batch, s_head, s_inner, rows_per, rows_total,
    T: tl.constexpr,
):
    """The work items of `_split_work` in one program, on the device (no host sync).

    Per target t (WORK[t] entries of work): item length `limit` = fixed_limit, or when that is 0
    max(floor, 2 * total // busy + 1) with `busy` the targets that have work, capped by total // min_items + 1
    when min_items > 0 (the floor still applies); ceil(WORK[t] / limit) items
    (at least 1), numbered target by target. Item k: target IT, entries [IS, IE), extra slot ISL (-1 for a
    target's first item, which writes the result; the rest are numbered in item order). Items past the
    last are padding (IT = -1) up to CAP. Per target with extra items ("heavy"), in target order up to
    HCAP (padding HC = 0): its first extra slot HS, their count HC, and where its result rows lie: target
    t = bh * n_inner + x writes rows_per rows (fewer at the end of rows_total) at
    (bh // n_heads) * s_batch + (bh % n_heads) * s_head + x * s_inner. NEXTRA = the real extra count."""
    offs = tl.arange(0, T)
    limit = tl.zeros([], tl.int64) + fixed_limit
    if fixed_limit <= 0:
        total = tl.zeros([], tl.int64)
        busy = tl.zeros([], tl.int64)
        for t0 in range(0, N, T):
            w = tl.load(WORK + t0 + offs, mask=t0 + offs < N, other=0).to(tl.int64)
            total += tl.sum(w, 0)
            busy += tl.sum((w > 0).to(tl.int64), 0)
        limit = 2 * total // tl.maximum(busy, 1) + 1
        if min_items > 0:
            limit = tl.minimum(limit, total // min_items + 1)
        limit = tl.maximum(limit, floor)
    base = tl.zeros([], tl.int64)  # items before this tile of targets
    hbase = tl.zeros([], tl.int64)  # heavy targets before it
    for t0 in range(0, N, T):
        tg = t0 + offs
        m = tg < N
        w = tl.load(WORK + tg, mask=m, other=0).to(tl.int64)
        n_it = tl.where(m, tl.maximum((w + limit - 1) // limit, 1), 0)
        first = base + tl.cumsum(n_it, 0) - n_it
        for r in range(0, tl.max(n_it, 0).to(tl.int32)):
            k = first + r
            mr = m & (r < n_it) & (k < CAP)  # k < CAP holds by the bound; never write past the table
            start = r * limit
            tl.store(IT + k, tg, mask=mr)
            tl.store(IS + k, start.to(tl.int32), mask=mr)
            tl.store(IE + k, tl.minimum(start + limit, w).to(tl.int32), mask=mr)
            tl.store(ISL + k, tl.where(r > 0, k - tg - 1, -1).to(tl.int32), mask=mr)
        heavy = m & (n_it > 1)
        hpos = hbase + tl.cumsum(heavy.to(tl.int64), 0) - 1
        hm = heavy & (hpos < HCAP)
        bh = tg // n_inner
        x = (tg % n_inner).to(tl.int64)
        off = (bh // n_heads).to(tl.int64) * s_batch + (bh % n_heads).to(tl.int64) * s_head + x * s_inner
        tl.store(HS + hpos, (first - tg).to(tl.int32), mask=hm)
        tl.store(HC + hpos, (n_it - 1).to(tl.int32), mask=hm)
        tl.store(HOFF + hpos, off, mask=hm)
        tl.store(HNR + hpos, tl.minimum(rows_total - x * rows_per, rows_per).to(tl.int32), mask=hm)
        base += tl.sum(n_it, 0)
        hbase += tl.sum(heavy.to(tl.int64), 0)
    for k0 in range(0, CAP, T):
        k = k0 + offs
        tl.store(IT + k, tl.full([T], -1, tl.int32), mask=(k >= base) & (k < CAP))
    for k0 in range(0, HCAP, T):
        k = k0 + offs
        tl.store(HC + k, tl.zeros([T], tl.int32), mask=(k >= hbase) & (k < HCAP))
    tl.store(NEXTRA, base - N)


@triton.jit(do_not_specialize=["Sk", "HKV", "GROUP", "sdb", "sds", "sdh", "scb", "sch", "scu", "smb", "smh"])
def _column_add_kernel(
    DK, DV, DKC, DVC, SLOT, Sk, HKV, GROUP,
    sdb, sds, sdh, scb, sch, scu, smb, smh,
    KT: tl.constexpr, D: tl.constexpr,
):
    """Add the vertical columns' dK/dV (DKC/DVC [B, Hq, U, D], per query head and universe slot) to the rows
    of KT keys of KV head hk, in DK/DV's dtype (fp32 arithmetic): dK[key] + col(g = 0) + col(g = 1) + ... over
    the heads of the group in order (a fixed order: deterministic). SLOT [B, Hq, Sk] holds each key's slot in
    head h's universe (-1: not a column of h); tiles whose keys are no head's column load nothing."""
    keys = tl.program_id(0) * KT + tl.arange(0, KT)
    bhk = tl.program_id(1)
    b = (bhk // HKV).to(tl.int64)
    hk = bhk % HKV
    key_ok = keys < Sk
    offs_d = tl.arange(0, D)
    hit = key_ok & False
    for g in range(0, GROUP):
        slot = tl.load(SLOT + b * smb + (hk * GROUP + g) * smh + keys, mask=key_ok, other=-1)
        hit = hit | (slot >= 0)
    if tl.max(hit.to(tl.int32), 0) > 0:
        ptr = b * sdb + keys[:, None] * sds + hk * sdh + offs_d[None, :]
        ak = tl.load(DK + ptr, mask=hit[:, None], other=0.0).to(tl.float32)
        av = tl.load(DV + ptr, mask=hit[:, None], other=0.0).to(tl.float32)
        for g in range(0, GROUP):
            h = hk * GROUP + g
            slot = tl.load(SLOT + b * smb + h * smh + keys, mask=key_ok, other=-1)
            found = slot >= 0
            src = b * scb + h * sch + slot[:, None].to(tl.int64) * scu + offs_d[None, :]
            ak = tl.where(found[:, None], ak + tl.load(DKC + src, mask=found[:, None], other=0.0), ak)
            av = tl.where(found[:, None], av + tl.load(DVC + src, mask=found[:, None], other=0.0), av)
        tl.store(DK + ptr, ak.to(DK.dtype.element_ty), mask=hit[:, None])
        tl.store(DV + ptr, av.to(DV.dtype.element_ty), mask=hit[:, None])


def _tile(block_size: int) -> int:
    # tl.dot needs tiles of at least 16; smaller or odd blocks run in a padded, masked tile.
    return max(16, triton.next_power_of_2(block_size))


# Kernel sub-tiles (query rows, keys) per kernel for index blocks larger than them: a 128- or 256-token
# index block runs as 64-row query tiles against 64-key tiles, except dK/dV, whose programs hold 128 keys
# and loop over 64-row query tiles (the fastest measured with 128-token blocks and head dim 128: BENCHMARKS.md,
# "Kernels: variants tried, launch settings, work split"). A block that is not a multiple of the sub-tile runs as
# one padded tile.
SUBTILE = {"fwd": (64, 64), "dq": (64, 64), "dkdv": (64, 128), "col": (32, 64), "colfwd": (128, 32),
           "coldq": (64, 32)}
# Head dims <= 64 (less matrix work per tile): the forward runs a 128-token block as one 128-row query tile with
# 4 warps (faster with SmolLM2's 9 q / 3 KV heads x 64 at 128-token blocks, bit for bit the same;
# tools/bench_kernel_variants.py). The dQ and dK/dV choices above are the fastest there too.
SUBTILE_SMALL_HEADS = {"fwd": (128, 64), "colfwd": (128, 64)}
# "colfwd" / "coldq": the forward and dQ passes of a column-only index (plans[NO_BLOCKS], the fa4 engine's
# columns): a few gathered key columns per query tile, where the list-walking passes read whole key blocks.
# "col": the column dK/dV pass (query rows per step; its chunks are 64 columns). Each the fastest of the variants
# tried on the H200 at 128K, 16 / 2 heads x 128 (tools/bench_columns.py).
# (num_warps, num_stages) per kernel on CUDA; mtrain/bench/attention.py measures the choices.
CUDA_LAUNCH = {"fwd": (4, 3), "dq": (4, 2), "dkdv": (4, 3), "col": (4, 3), "colfwd": (4, 1), "coldq": (4, 1)}
# Work-item length of the dK/dV passes (entries of a transposed list): None = max(256, 2x the mean list);
# tests set a small number to force splitting.
ITEM_LIMIT: int | None = None
# Items a dK/dV pass is cut into at least, where its targets are too few to fill the GPU (the column pass: one
# target per head and 64-column chunk, ~30 long lists at 128K for 132 SMs): the item length then falls to
# total / MIN_ITEMS (not below MIN_ITEM_LENGTH). None = 4 per SM on CUDA, 0 (off) elsewhere; tests set it.
MIN_ITEMS: int | None = None
MIN_ITEM_LENGTH = 32


def _subtile(block_size: int, want: int) -> int:
    """The largest power-of-two tile <= want (and >= 16) that divides a block larger than `want`; one
    padded tile for blocks up to `want` or without such a divisor."""
    t = want
    while block_size > want and t >= 16:
        if block_size % t == 0:
            return t
        t //= 2
    return _tile(block_size)


# Sub-tile sides for fp32 inputs on CUDA at most: their tf32x3 dots (`_prec`) keep split copies of each operand in
# shared memory, and 64-wide tiles at head dim 128 ask for more than a Hopper SM's shared memory even at one stage.
FP32_TILE = 32


def _tile_cap(q: torch.Tensor) -> int | None:
    return FP32_TILE if q.dtype == torch.float32 and q.device.type == "cuda" else None


def _subtiles(block_size: int, kernel: str, head_dim: int = 128, cap: int | None = None) -> dict:
    """QT, KT, NQS, NKS for `kernel` on index blocks of `block_size` tokens (see SUBTILE, SUBTILE_SMALL_HEADS);
    `cap` bounds both sides (`_tile_cap`)."""
    wants = (SUBTILE_SMALL_HEADS.get(kernel) if head_dim <= 64 else None) or SUBTILE[kernel]
    if cap:
        wants = tuple(min(w, cap) for w in wants)
    qt, kt = (_subtile(block_size, want) for want in wants)
    return {"QT": qt, "KT": kt, "NQS": -(-block_size // qt), "NKS": -(-block_size // kt)}


# (num_warps, num_stages) per kernel when a sub-tile side is 128 or more; None = twice CUDA_LAUNCH's warps and one
# stage less (128x128 tiles with a 128 head dim: registers and shared memory).
CUDA_LAUNCH_WIDE: dict = {"colfwd": (4, 1)}
# The same for head dims <= 64 (see SUBTILE_SMALL_HEADS).
CUDA_LAUNCH_WIDE_SMALL_HEADS = {"fwd": (4, 3), "colfwd": (4, 3)}


def _opts(q: torch.Tensor, kernel: str, tile: int = 64) -> dict:
    if q.device.type != "cuda":
        return {}
    warps, stages = CUDA_LAUNCH[kernel]
    if tile >= 128:
        small = CUDA_LAUNCH_WIDE_SMALL_HEADS.get(kernel) if q.shape[-1] <= 64 else None
        warps, stages = CUDA_LAUNCH_WIDE.get(kernel) or small or (2 * warps, max(1, stages - 1))
    return {"num_warps": warps, "num_stages": stages}


def _launch(kernel, grid, *args, **kwargs) -> None:
    """Launch; when a pipelining depth does not fit in shared memory (large tiles, fp32), retry shallower."""
    while True:
        try:
            kernel[grid](*args, **kwargs)
            return
        except triton.runtime.errors.OutOfResources:
            if kwargs.get("num_stages", 1) <= 1:
                raise
            kwargs["num_stages"] -= 1


def _prec(q: torch.Tensor) -> str:
    """tl.dot's input precision (`dot_precision`): fp32 inputs run three tf32 products per dot, 16-bit inputs
    one. Full-precision fp32 dots ("ieee", FMA loops) took up to ~4 minutes of Triton compiles per case at head dim
    128 in mtrain/bench/check.py."""
    return dot_precision(q.dtype)


def _check_inputs(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not isinstance(_fwd_kernel, InterpretedFunction):
        # triton.jit reads TRITON_INTERPRET when this module is first imported.
        raise ValueError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before mtrain.ops' Triton module is "
            "first imported; set it at process start, or use impl='torch'"
        )
    D = q.shape[-1]
    if D < 16 or D & (D - 1):
        raise ValueError(f"the Triton attention kernels need a power-of-two head dim >= 16; got {D}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the Triton attention kernels take fp16, bf16 or fp32, not {q.dtype}; use impl='torch'")


def _visible_blocks(q_pos, k_pos, block_size, causal):
    """[nQB, nKB] bool: key blocks holding at least one key some query of the block may see."""
    Sq, Sk = q_pos.numel(), k_pos.numel()
    nqb, nkb = -(-Sq // block_size), -(-Sk // block_size)
    if not causal:
        return torch.ones(nqb, nkb, dtype=torch.bool, device=q_pos.device)
    q_pad = torch.full((nqb * block_size,), -1, dtype=torch.int64, device=q_pos.device)
    q_pad[:Sq] = q_pos
    k_pad = torch.full((nkb * block_size,), 1 << 62, dtype=torch.int64, device=q_pos.device)
    k_pad[:Sk] = k_pos
    q_max = q_pad.view(nqb, block_size).amax(-1)
    k_min = k_pad.view(nkb, block_size).amin(-1)
    return k_min[None, :] <= q_max[:, None]


def dense_plan(q_pos, k_pos, block_size: int, causal: bool = True) -> tuple:
    """What `blocks=None` runs on, shared by all heads: (ids [nQB, M] int32, -1 padded, counts [nQB] int32) of every
    key block some query of each query block sees, and their ragged transpose (flat query blocks int32, starts int64,
    counts int32; see `transpose_blocks_csr`), on the positions' device. Built on the device it reads host values
    back three times (a wait for the GPU's queue each); a caller whose positions repeat plans it once on the host and
    passes it in `plans["dense"]` (`mtrain.ops.recall.scored_blocks` does)."""
    vis = _visible_blocks(q_pos, k_pos, block_size, causal)
    ids, counts = compact(vis)
    _, t_flat = torch.nonzero(vis.t(), as_tuple=True)  # row-major: per key block, query blocks in order
    t_counts = vis.sum(0, dtype=torch.int32)
    t_starts = torch.cumsum(t_counts, 0, dtype=torch.int64) - t_counts
    return ids, counts, (t_flat.to(torch.int32), t_starts, t_counts)


def _dense_lists(q_pos, k_pos, block_size, causal, B, H, plans):
    """Block lists (and their ragged transpose) for `blocks=None` (`dense_plan`, kept in plans["dense"]), as
    zero-stride views over the batch and the heads."""
    if "dense" not in plans:
        plans["dense"] = dense_plan(q_pos, k_pos, block_size, causal)
    ids, counts, (t_flat, t_starts, t_counts) = plans["dense"]
    # Zero strides over batch and heads: one list in memory for every (b, h).
    return (ids.expand(B, H, *ids.shape), counts.expand(B, H, *counts.shape),
            (t_flat, t_starts.expand(B, H, *t_starts.shape), t_counts.expand(B, H, *t_counts.shape)))


def _int32(t: torch.Tensor, device) -> torch.Tensor:
    t = t.to(device=device, dtype=torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _keep_left(ids: torch.Tensor, keep: torch.Tensor, trim: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the kept entries of each -1 padded list [..., M] to the left, in order; trim the padding (a host
    read), or keep the width M (trim=False)."""
    if not trim:
        width = max(ids.shape[-1], 1)
    else:
        counts = keep.sum(-1, dtype=torch.int32)
        width = max(int(counts.max()) if counts.numel() else 0, 1)
    return left_pack(ids, keep, width, fill=-1)


def _doc_filter(bi, bc, ci, cc, has_cols, qd, kd, block_size, trim: bool = True):
    """Drop listed key blocks and columns whose document ids cannot meet the query block's: a block is
    kept only when its doc-id range overlaps the query block's (exact for any ids: equal ids need
    overlapping ranges). Tiles that survive still test the ids pair by pair in the kernels."""
    B = qd.shape[0]
    q_lo, q_hi = doc_ranges(qd, block_size)  # [B, nqb]
    k_lo, k_hi = doc_ranges(kd, block_size)  # [B, nkb]
    # Lists shared by all heads (blocks=None) are filtered once per batch row, not once per head.
    H = bi.shape[1]
    shared = bi.stride(1) == 0 and bc.stride(1) == 0
    ids = (bi[:, :1] if shared else bi).expand(B, -1, -1, -1)
    cnt = (bc[:, :1] if shared else bc).expand(B, -1, -1)
    valid = (torch.arange(ids.shape[-1], device=ids.device) < cnt[..., None].long()) & (ids >= 0)
    j = ids.long().clamp(min=0)
    bidx = torch.arange(B, device=ids.device)[:, None, None, None]
    keep = valid & (k_lo[bidx, j] <= q_hi[:, None, :, None]) & (k_hi[bidx, j] >= q_lo[:, None, :, None])
    bi, bc = _keep_left(ids, keep, trim)
    if shared:
        bi, bc = bi.expand(B, H, *bi.shape[2:]), bc.expand(B, H, bc.shape[2])
    if has_cols:
        valid = (torch.arange(ci.shape[-1], device=ci.device) < cc[..., None].long()) & (ci >= 0)
        cdoc = kd[bidx, ci.long().clamp(min=0)]
        keep = valid & (cdoc >= q_lo[:, None, :, None]) & (cdoc <= q_hi[:, None, :, None])
        ci, cc = _keep_left(ci, keep, trim)
    return bi, bc, ci, cc


def _prepare(q, k, v, q_pos, k_pos, blocks, columns, block_size, causal, plans, q_doc=None, k_doc=None):
    """Lists, positions and document ids on q's device. With document ids the lists are filtered
    (`_doc_filter`) and everything derived from them is cached in plans["doc"], apart from the
    doc-free entries."""
    B, Sq, Hq, D = q.shape
    _check_inputs(q)
    if blocks is None:
        bi, bc, tr = _dense_lists(q_pos.to(q.device), k_pos.to(q.device), block_size, causal, B, Hq, plans)
    else:
        bi, bc = _int32(blocks[0], q.device), _int32(blocks[1], q.device)
        tr = None
    vcols = columns if isinstance(columns, VerticalColumns) else None
    if columns is None:
        ci = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=q.device)
        cc = torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device)
    elif vcols is not None:  # the list-free form: a zero-stride view of the verticals, the kernels skip covered ones
        if vcols.verts.device != q.device or plans.get(COLUMN_BASE) or vcols.block_size != block_size \
                or vcols.seq_len != k.shape[1]:
            raise ValueError(f"VerticalColumns of {vcols.seq_len} tokens in blocks of {vcols.block_size} on "
                             f"{vcols.verts.device} cannot serve {k.shape[1]} keys in blocks of {block_size} on "
                             f"{q.device}: it is one device's index, keys from 0")
        ci, cc = vcols
    elif isinstance(columns, RingColumns):  # a ring's list-free columns: ids into the step's keys, from their base
        if columns.ids.device != q.device or columns.block_size != block_size or columns.counts.shape[-1] != -(
                -q.shape[1] // block_size) or columns.base != plans.get(COLUMN_BASE, 0):
            raise ValueError(f"RingColumns of {columns.counts.shape[-1]} query blocks of {columns.block_size} tokens "
                             f"(columns from key {columns.base}) on {columns.ids.device} cannot serve {q.shape[1]} "
                             f"queries in blocks of {block_size} with columns from key {plans.get(COLUMN_BASE, 0)} "
                             f"on {q.device}")
        ci, cc = columns
    else:
        ci, cc = _int32(columns[0], q.device), _int32(columns[1], q.device)
        check_list_entries(ci, "the column lists")
    check_list_entries(bi, "the block lists")
    qp = q_pos.to(device=q.device, dtype=torch.int64).contiguous()
    kp = k_pos.to(device=q.device, dtype=torch.int64).contiguous()
    if q_doc is None:
        qd = kd = torch.zeros(1, dtype=torch.int64, device=q.device)  # never read (HAS_DOC=False)
    else:
        qd = q_doc.to(device=q.device, dtype=torch.int64).contiguous()
        kd = k_doc.to(device=q.device, dtype=torch.int64).contiguous()
        bounded = bool(plans.get(BOUNDED))
        plans = plans.setdefault("doc", {BOUNDED: True} if bounded else {})
        if "lists" not in plans:  # (list-free columns are not filtered: the kernels test the ids pair by pair)
            listed = columns is not None and not isinstance(columns, (VerticalColumns, RingColumns))
            plans["lists"] = _doc_filter(bi, bc, ci, cc, listed, qd, kd, block_size,
                                         trim=not bounded)
        bi, bc, ci, cc = plans["lists"]
        tr = None
    return bi, bc, tr, ci, cc, columns is not None, qp, kp, qd, kd, plans


def _cov_args(columns, device, nqb: int) -> tuple:
    """(covered flags, their batch and head strides, VCOLS, the flags' length) for the kernels: a `VerticalColumns`'
    flags (VCOLS 1) or a `RingColumns`' (VCOLS 2), or a placeholder that no kernel reads (VCOLS 0)."""
    if isinstance(columns, (VerticalColumns, RingColumns)):
        cov = columns.covered
        if not cov.is_contiguous():
            raise ValueError(f"{type(columns).__name__}.covered must be contiguous [B, H, 2, nQB]")
        return cov, cov.stride(0), cov.stride(1), 2 if isinstance(columns, RingColumns) else 1, cov.shape[-1]
    return torch.zeros(1, dtype=torch.uint8, device=device), 0, 0, 0, nqb


def forward(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, plans=None, *, q_doc=None,
            k_doc=None, merge_into=None):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    plans = {} if plans is None else plans
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bi, bc, _, ci, cc, has_cols, qp, kp, qd, kd, plans = _prepare(
        q, k, v, q_pos, k_pos, blocks, columns, block_size, causal, plans, q_doc, k_doc)
    nqb = -(-Sq // block_size)
    cov, scvb, scvh, vcols, ncov = _cov_args(columns, q.device, nqb)
    if merge_into is None:
        out = torch.empty_like(q)
        lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    else:  # merged in place (partial.attention_forward checked shapes, dtypes and contiguity)
        out, lse = merge_into
    kern = "colfwd" if plans.get(NO_BLOCKS) else "fwd"
    sub = _subtiles(block_size, kern, D, _tile_cap(q))
    _launch(
        _fwd_kernel, (nqb * sub["NQS"], B * Hq),
        q, k, v, out, lse, qp, kp, bi, bc, ci, cc, qd, kd, cov,
        scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        bi.stride(0), bi.stride(1), bi.stride(2), bc.stride(0), bc.stride(1),
        ci.stride(0), ci.stride(1), ci.stride(2), cc.stride(0), cc.stride(1), qd.stride(0), kd.stride(0),
        scvb, scvh, Sq, Sk, Hq, Hq // Hkv, ncov,
        BS=block_size, **sub, D=D, HAS_COLS=has_cols, CAUSAL=causal, PREC=_prec(q),
        HAS_DOC=q_doc is not None, MERGE=merge_into is not None, VCOLS=vcols,
        **_opts(q, kern, max(sub["QT"], sub["KT"])),
    )
    return out, lse


def backward(dout, q, k, v, out, lse, q_pos, k_pos, blocks, columns, block_size, scale, causal,
             deterministic=True, plans=None, q_doc=None, k_doc=None, grad_init=None):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    plans = {} if plans is None else plans
    q, k, v, dout, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, dout, out))
    bi, bc, tr, ci, cc, has_cols, qp, kp, qd, kd, plans = _prepare(
        q, k, v, q_pos, k_pos, blocks, columns, block_size, causal, plans, q_doc, k_doc)
    has_doc = q_doc is not None
    nqb, nkb = -(-Sq // block_size), -(-Sk // block_size)
    prec = _prec(q)
    lse = lse.float().contiguous()
    fused = not deterministic
    # delta = rowsum(dout * out) [B, Hq, Sq] (laid out as lse): the dQ pass computes it on the way (it reads the
    # rows' dout anyway); the fused backward has no dQ pass.
    delta = row_delta(dout, out) if fused else torch.empty_like(lse)
    # The backward without `deterministic` (fused): the dK/dV passes of the deterministic backward also add each
    # tile's dQ share with fp32 atomics, so no dQ pass recomputes the scores: about as fast as the deterministic
    # backward at head dim 64, slower at head dim 128 (the dQ atomics; BENCHMARKS.md, "Kernels: variants tried").
    # Training uses the deterministic backward.
    dq_init = None
    if grad_init is not None:  # (partial.attention_backward checked shapes, contiguity and deterministic)
        dq = dq_init = grad_init[0]  # the dQ pass reads each row's dq and stores the sum in place
    else:
        dq = (torch.zeros if fused else torch.empty)(B, Sq, Hq, D, dtype=torch.float32, device=q.device)
    if grad_init is not None and plans.get(NO_BLOCKS):  # columns only: added into grad_init's dK/dV in place
        dk, dv = grad_init[1], grad_init[2]
    else:
        dk = torch.empty(B, Sk, Hkv, D, dtype=torch.float32, device=q.device)
        dv = torch.empty(B, Sk, Hkv, D, dtype=torch.float32, device=q.device)
    common = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        lse.stride(0), lse.stride(1),
    )
    cov, scvb, scvh, vcols, ncov = _cov_args(columns, q.device, nqb)
    if not fused:
        kern = "coldq" if plans.get(NO_BLOCKS) else "dq"
        sub = _subtiles(block_size, kern, D, _tile_cap(q))
        _launch(
            _dq_kernel, (nqb * sub["NQS"], B * Hq),
            q, k, v, dout, out, lse, delta, dq, dq if dq_init is None else dq_init, qp, kp, bi, bc, ci, cc, qd, kd,
            cov, scale * _LOG2E, scale, *common, out.stride(0), out.stride(1), out.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            bi.stride(0), bi.stride(1), bi.stride(2), bc.stride(0), bc.stride(1),
            ci.stride(0), ci.stride(1), ci.stride(2), cc.stride(0), cc.stride(1), qd.stride(0), kd.stride(0),
            scvb, scvh, Sq, Sk, Hq, group, ncov,
            BS=block_size, **sub, D=D, HAS_COLS=has_cols, CAUSAL=causal, PREC=prec,
            HAS_DOC=has_doc, HAS_INIT=dq_init is not None, VCOLS=vcols,
            **_opts(q, kern, max(sub["QT"], sub["KT"])),
        )
    if plans.get(NO_BLOCKS):  # a column-only call (the fa4 engine's columns): no block adds to dK/dV
        if grad_init is None:
            dk.zero_()
            dv.zero_()
    else:
        _block_dkdv(q, k, v, dout, lse, delta, dk, dv, dq, qp, kp, qd, kd, bi, bc, tr, common, plans, scale, causal,
                    has_doc, fused, prec, block_size, nqb, nkb, group)
        if grad_init is not None:
            dk.add_(grad_init[1])
            dv.add_(grad_init[2])
    if has_cols:
        chunk = min(_tile(block_size), 64)
        sub = _subtiles(block_size, "col", D, _tile_cap(q))
        base = plans.get(COLUMN_BASE, 0)  # the columns lie at keys base.. (the ring's gathered column slots)
        key = ("vc" if vcols else "c", chunk)  # an index's cache may hold both forms' plans
        if key not in plans:
            plans[key] = columns.column_plan(chunk) if vcols else column_plan(
                ci, cc, Sk, chunk, width=ci.shape[-1] if plans.get(BOUNDED) else None, base=base)
        plan = plans[key]
        universe = plan.universe
        u_cap = universe.shape[-1]
        n_chunks = plan.q_ids.shape[2]
        dkc = torch.empty(B, Hq, u_cap, D, dtype=torch.float32, device=q.device)
        dvc = torch.empty_like(dkc)
        col_plan = _col_work_plan(plan, nqb, dkc, plans)
        extra_k = torch.empty(col_plan["extra_cap"], chunk, D, dtype=torch.float32, device=q.device)
        extra_v = torch.empty_like(extra_k)
        _launch(
            _col_dkdv_kernel, (col_plan["grid"],),
            q, k, v, dout, lse, delta, dkc, dvc, dq, extra_k, extra_v, qp, kp, universe, plan.q_ids, plan.bits,
            col_plan["target"], col_plan["start"], col_plan["end"], col_plan["slot"], qd, kd, cov,
            scale * _LOG2E, scale, *common, dq.stride(0), dq.stride(1), dq.stride(2),
            universe.stride(0), universe.stride(1), plan.q_ids.stride(0), plan.q_ids.stride(1),
            plan.q_ids.stride(2), dkc.stride(0), dkc.stride(1), dkc.stride(2), qd.stride(0), kd.stride(0),
            scvb, scvh, Sq, Hq, group, u_cap, n_chunks, ncov,
            BS=block_size, QT=sub["QT"], NQS=sub["NQS"], CH=chunk, D=D, CAUSAL=causal, PREC=prec,
            HAS_DOC=has_doc, DQ_ATOMIC=fused, VCOLS=vcols, **_opts(q, "col", max(sub["QT"], chunk)),
        )
        _reduce(dkc, dvc, extra_k, extra_v, col_plan, dkc.stride(2), chunk, chunk, D)
        column_add(dk[:, base:], dv[:, base:], dkc, dvc, universe_slots(plan, Sk, plans, base), group)
    if grad_init is not None and not plans.get(NO_BLOCKS):  # the fp32 dK/dV into grad_init's tensors
        grad_init[1].copy_(dk)
        grad_init[2].copy_(dv)
        dk, dv = grad_init[1], grad_init[2]
    return dq, dk, dv


def _block_dkdv(q, k, v, dout, lse, delta, dk, dv, dq, qp, kp, qd, kd, bi, bc, tr, common, plans, scale, causal,
                has_doc, fused, prec, block_size, nqb, nkb, group) -> None:
    """The listed blocks' dK/dV (and with `fused` their dQ share): work items over the transposed lists, then the
    reduce of split items."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    if tr is None:
        if "t" not in plans:
            plans["t"] = transpose_blocks_csr(bi, bc, nkb, every_slot=bool(plans.get(BOUNDED)))
        tr = plans["t"]
    ti, ts, tc = tr
    kv_plan = _kv_work_plan(tc, B, Hkv, group, nqb, nkb, dk, block_size, plans)
    sub = _subtiles(block_size, "dkdv", D, _tile_cap(q))
    ex_rows = sub["NKS"] * sub["KT"]  # rows of one extra slot: a whole (padded) key block
    # Sized by the plan's bound, not its count (reading the count would wait for the GPU).
    extra_k = torch.empty(kv_plan["extra_cap"], ex_rows, D, dtype=torch.float32, device=q.device)
    extra_v = torch.empty_like(extra_k)
    _launch(
        _dkdv_kernel, (kv_plan["grid"], sub["NKS"]),
        q, k, v, dout, lse, delta, dk, dv, dq, extra_k, extra_v, qp, kp, ti, ts, kv_plan["pre"],
        kv_plan["target"], kv_plan["start"], kv_plan["end"], kv_plan["slot"], qd, kd,
        scale * _LOG2E, scale, *common, dk.stride(0), dk.stride(1), dk.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), ts.stride(0), ts.stride(1), qd.stride(0), kd.stride(0),
        Sq, Sk, Hkv, group, nkb,
        BS=block_size, **sub, D=D, CAUSAL=causal, PREC=prec, HAS_DOC=has_doc, DQ_ATOMIC=fused,
        **_opts(q, "dkdv", max(sub["QT"], sub["KT"])),
    )
    _reduce(dk, dv, extra_k, extra_v, kv_plan, dk.stride(1), ex_rows, sub["KT"], D)


# plans[NO_BLOCKS] = True marks a column-only index (every block list empty, known without reading the counts):
# the backward then skips the block dK/dV pass, whose grid would otherwise run over every key block for nothing
# (measurable in the fa4 engine's column backward).
NO_BLOCKS = "no_blocks"


def prepare_backward(index, num_kv_heads: int, head_dim: int) -> None:
    """Build, and cache in `index._cache`, all the deterministic backward derives from a SparseIndex:
    the transposed index, the column plan and the work items (so it can be timed with the index). With the
    GPU builder's index this queues device work only: no host synchronisation."""
    B, Hq, nqb = index.block_counts.shape
    S, bs, plans = index.seq_len, index.block_size, index._cache
    group = Hq // num_kv_heads
    if not plans.get(NO_BLOCKS):
        _, _, tc = index.transposed_csr()
        dk = torch.empty(B, S, num_kv_heads, head_dim, device="meta")
        _kv_work_plan(tc, B, num_kv_heads, group, nqb, nqb, dk, bs, plans)
    chunk = min(_tile(bs), 64)
    plan = index.column_plan(chunk)
    _col_work_plan(plan, nqb, torch.empty(B, Hq, plan.universe.shape[-1], head_dim, device="meta"), plans)
    universe_slots(plan, S, plans)


# Targets per step of `_split_kernel` (one program walks them all).
_SPLIT_TILE = 1024


def _min_items(device) -> int:
    if MIN_ITEMS is not None:
        return MIN_ITEMS
    if device.type != "cuda":
        return 0
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _split_work(work: torch.Tensor, max_work: int, rows: tuple) -> dict:
    """Cut per-target work (list lengths) into items of at most ~2x the mean over the targets that have work
    (so one long list, the sink block every query block uses, does not serialize the backward, and targets
    without work, e.g. a wider column plan's empty chunks, change nothing), and shorter where the targets are
    too few to fill the GPU: the item length L = max(MIN_ITEM_LENGTH, min(2 * total // busy + 1,
    total // M + 1)) with M = `_min_items` (M = 0: L = max(256, 2 * total // busy + 1)). Built by `_split_kernel`
    on the device without a host sync: the tables have a size the host knows, a bound on the count (padding
    items have target -1 and exit in the kernels; padding reduce entries have no extra slot).

    The bound: L > min(2 * total / busy, total / M), so the extra items sum(ceil(w / L) - 1) < total / L <
    max(busy / 2, M), and fewer than max(busy / 2, M) targets have w > L. With ITEM_LIMIT (tests) every target may split, into at most
    ceil(max_work / ITEM_LIMIT) items. rows = (n_inner, n_heads, s_batch, s_head, s_inner, rows_per,
    rows_total): where each target's result rows lie (see `_split_kernel`), for the reduce of split targets.
    """
    dev = work.device
    work = work.reshape(-1).to(torch.int32).contiguous()
    n = work.numel()
    m = _min_items(dev)
    if ITEM_LIMIT:
        cap, heavy_cap = n * max(1, -(-max_work // ITEM_LIMIT)), n
    else:
        cap, heavy_cap = n + max(n // 2, m), max(1, min(n, max(n // 2, m)))
    i32 = dict(dtype=torch.int32, device=dev)
    plan = {
        "grid": cap, "extra_cap": max(1, cap - n), "heavy_cap": heavy_cap,
        "target": torch.empty(cap, **i32), "start": torch.empty(cap, **i32), "end": torch.empty(cap, **i32),
        "slot": torch.empty(cap, **i32), "n_extra": torch.empty((), dtype=torch.int64, device=dev),
        "extra_start": torch.empty(heavy_cap, **i32), "extra_count": torch.empty(heavy_cap, **i32),
        "off": torch.empty(heavy_cap, dtype=torch.int64, device=dev), "nrows": torch.empty(heavy_cap, **i32),
    }
    _split_kernel[(1,)](
        work, plan["target"], plan["start"], plan["end"], plan["slot"], plan["n_extra"], plan["extra_start"],
        plan["extra_count"], plan["off"], plan["nrows"], n, cap, heavy_cap, ITEM_LIMIT or 0, m,
        MIN_ITEM_LENGTH if m else 256, *rows, T=_SPLIT_TILE,
    )
    return plan


def _kv_work_plan(tc, B, Hkv, group, nqb, nkb, dk, block_size, plans) -> dict:
    """Work items of the dK/dV pass: one target per (batch, KV head, key block), its work the transposed
    lists of the group's heads (PRE: where each head's list starts in the target's numbering)."""
    key = ("kv_items", tuple(dk.stride()))
    if key not in plans:
        counts = tc.expand(B, Hkv * group, nkb).reshape(B, Hkv, group, nkb).permute(0, 1, 3, 2)
        pre = torch.zeros(B, Hkv, nkb, group + 1, dtype=torch.int32, device=tc.device)
        torch.cumsum(counts, -1, dtype=torch.int32, out=pre[..., 1:])
        rows = (nkb, Hkv, dk.stride(0), dk.stride(2), block_size * dk.stride(1), block_size, dk.shape[1])
        plan = _split_work(pre[..., -1], group * nqb, rows)
        plan["pre"] = pre
        plans[key] = plan
    return plans[key]


def _col_work_plan(plan: ColumnPlan, nqb: int, dkc, plans) -> dict:
    """Work items of the column dK/dV pass: one target per (batch, query head, chunk of its columns)."""
    key = ("col_items" if not plan.list_free else "col_items_vc", plan.chunk, tuple(dkc.stride()))
    if key not in plans:
        B, H, n_chunks = plan.counts.shape
        rows = (n_chunks, H, dkc.stride(0), dkc.stride(1), plan.chunk * dkc.stride(2), plan.chunk, dkc.shape[2])
        plans[key] = _split_work(plan.counts, nqb, rows)
    return plans[key]


def _reduce(dst_k, dst_v, extra_k, extra_v, plan, row_stride, rows, sub, D) -> None:
    _reduce_kernel[(plan["heavy_cap"], rows // sub)](
        dst_k, dst_v, extra_k, extra_v, plan["off"], plan["nrows"], plan["extra_start"], plan["extra_count"],
        row_stride, ROWS=rows, SUB=sub, D=D)


# Keys per program of `_column_add_kernel`.
_COLUMN_ADD_KEYS = 64


def universe_slots(plan: ColumnPlan, seq_k: int, plans: dict, base: int = 0) -> torch.Tensor:
    """[B, H, seq_k - base] int32: each key's (from key `base` on) slot in head h's column universe (`plan.universe`
    [B, H, U], -1 padded), -1 where it is not one of h's columns (cached in `plans` beside the plan; one fill and one
    scatter, no host synchronisation)."""
    key = ("slots" if not plan.list_free else "slots_vc", plan.chunk, seq_k, base)
    if key not in plans:
        universe = plan.universe
        B, H, U = universe.shape
        u = universe.long() - base
        n = seq_k - base
        slots = torch.full((B, H, n + 1), -1, dtype=torch.int32, device=universe.device)
        at = torch.where((u >= 0) & (u < n), u, n)  # padding lands in the spare last slot
        slots.scatter_(-1, at, torch.arange(U, dtype=torch.int32, device=universe.device).expand(B, H, U))
        plans[key] = slots[..., :n]
    return plans[key]


def column_add(dk, dv, dkc, dvc, slots, group) -> None:
    """dK/dV rows += the columns' dK/dV of every query head of their group (see `_column_add_kernel`)."""
    B, Sk, Hkv, D = dk.shape
    _column_add_kernel[(-(-Sk // _COLUMN_ADD_KEYS), B * Hkv)](
        dk, dv, dkc, dvc, slots, Sk, Hkv, group,
        dk.stride(0), dk.stride(1), dk.stride(2), dkc.stride(0), dkc.stride(1), dkc.stride(2),
        slots.stride(0), slots.stride(1), KT=_COLUMN_ADD_KEYS, D=D,
    )
