"""The GPU builder of `SparseIndex.from_lines`: block lists, column lists, the transposed block lists and the
column plan from vertical / slash lines in three Triton launches and one sort, with no host synchronisation.

List widths come from bounds known on the host (the line counts and the sequence), not from the data, so
the lists carry more -1 padding than the reference builder's; every consumer reads the counts, not the width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows of a query block's list and of a column tile written per step (powers of two).
_PREP_TILE = 1024
_LIST_TILE = 128
_COL_TILE = 256
_PLAN_ROWS = 64


@triton.jit
def _prep_kernel(
    SL, V, FLAGS, CSUM, OSORT, VKEY, UNIV, TCNT, TSTART,
    NS, NV, S, n, bs, tail, NF, UW, CAP,
    T: tl.constexpr,
):
    """Per (batch, head): the block-offset sets, their prefix counts and sorted members, the vertical keys,
    the column universe and the transposed counts/starts.

    Set 0 serves every query block but the last, set 1 the last one (a short last block of `tail` rows
    crosses fewer blocks). A slash d = a*bs + r adds offsets a (set 1: only when r < tail) and a + 1 (r > 0);
    offset 0 (the diagonal) is always in. FLAGS[s, o] = o in set s; CSUM[s, o] = #{members <= o};
    OSORT[s, :CSUM[s, -1]] = the members, ascending.
    """
    bh = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, T)
    f0 = FLAGS + bh * 2 * NF
    f1 = f0 + NF
    zeros = tl.zeros([T], tl.int32)
    ones = zeros + 1
    for o0 in range(0, 2 * NF, T):
        o = o0 + offs
        tl.store(f0 + o, tl.where(o % NF == 0, ones, zeros), mask=o < 2 * NF)
    # Stores of this program must be visible to all its threads before they are read back.
    tl.debug_barrier()
    for s0 in range(0, NS, T):
        idx = s0 + offs
        m = idx < NS
        d = tl.load(SL + bh * NS + idx, mask=m, other=-1).to(tl.int64)
        ok = m & (d >= 0) & (d < S)
        a = tl.where(ok, d // bs, 0)
        r = tl.where(ok, d % bs, 0)
        tl.store(f0 + a, ones, mask=ok)
        tl.store(f0 + a + 1, ones, mask=ok & (r > 0))
        tl.store(f1 + a, ones, mask=ok & (r < tail))
        tl.store(f1 + a + 1, ones, mask=ok & (r > 0))
    tl.debug_barrier()
    for s in tl.static_range(2):
        base = tl.zeros([], tl.int32)
        for o0 in range(0, NF, T):
            o = o0 + offs
            m = o < NF
            f = tl.load(f0 + s * NF + o, mask=m, other=0)
            c = tl.cumsum(f, 0) + base
            tl.store(CSUM + (bh * 2 + s) * NF + o, c, mask=m)
            tl.store(OSORT + (bh * 2 + s) * NF + c - 1, o.to(tl.int32), mask=m & (f != 0))
            base += tl.sum(f, 0)
    tl.debug_barrier()
    c0 = CSUM + bh * 2 * NF
    # Transposed counts: key block 0 is in every list; key block j > 0 is in the list of query block
    # i = j + o for o in set 0 with i <= n - 2, and in the last one when n - 1 - j is in set 1.
    base64 = tl.zeros([], tl.int64)
    for j0 in range(0, n, T):
        j = j0 + offs
        m = j < n
        below = n - 2 - j
        c = tl.load(c0 + below, mask=m & (below >= 0), other=0)
        last = tl.load(f1 + (n - 1 - j), mask=m, other=0)
        tc = tl.where(m, tl.where(j == 0, n, c + last), 0)
        tc64 = tc.to(tl.int64)
        tl.store(TCNT + bh * n + j, tc, mask=m)
        tl.store(TSTART + bh * n + j, bh * CAP + base64 + tl.cumsum(tc64, 0) - tc64, mask=m)
        base64 += tl.sum(tc64, 0)
    # Verticals (sorted, any padding): VKEY = the key block of a valid, first-of-its-value vertical outside
    # block 0, else n (no query block is later than n). A vertical joins the universe when some later query
    # block misses its key block: fewer of the n - 1 - vb offsets 1..n-1-vb are members than there are rows.
    ubase = tl.zeros([], tl.int32)
    for p0 in range(0, NV, T):
        p = p0 + offs
        m = p < NV
        v = tl.load(V + bh * NV + p, mask=m, other=-1).to(tl.int64)
        prev = tl.load(V + bh * NV + p - 1, mask=m & (p > 0), other=-1).to(tl.int64)
        ok = m & (v >= 0) & (v < S) & (v != prev)
        vb = tl.where(ok, v // bs, n)
        key = tl.where(ok & (vb > 0), vb, n)
        tl.store(VKEY + bh * NV + p, key.to(tl.int32), mask=m)
        below = n - 2 - vb
        cand = (key < n) & (below >= 0)
        c = tl.load(c0 + below, mask=cand, other=0)
        last = tl.load(f1 + (n - 1 - vb), mask=cand, other=0)
        used = cand & ((c - 1 + last) < (n - 1 - vb))
        u = tl.cumsum(used.to(tl.int32), 0) + ubase
        tl.store(UNIV + bh * UW + u - 1, v.to(tl.int32), mask=used)
        ubase += tl.sum(used.to(tl.int32), 0)
    for q0 in range(0, UW, T):
        q = q0 + offs
        tl.store(UNIV + bh * UW + q, zeros - 1, mask=(q >= ubase) & (q < UW))


@triton.jit
def _count_below(ROW, size, t):
    """#{entries < t} of the ascending ROW[:size]: a scalar binary search (about log2(size) loads)."""
    lo = tl.zeros([], tl.int32)
    hi = lo + size
    while lo < hi:
        mid = (lo + hi) // 2
        below = tl.load(ROW + mid).to(tl.int64) < t
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _rows_kernel(
    FLAGS, CSUM, OSORT, V, VKEY, BI, BC, CI, CC, TQ, TSTART,
    n, NF, NV, WB, WC, bs,
    TB: tl.constexpr, TV: tl.constexpr,
):
    """Query block i of one (batch, head): its key-block list ([0 if the sink is extra] + [i - o for the
    set's members o <= i, largest first]), its extra columns (verticals whose key block is earlier and not
    listed, ascending), and the transposed list of key block j = i (query blocks ascending).

    Only verticals 0 <= v < i * bs can have a key block before i: in the sorted list they are the slice
    [#{v < 0}, #{v < i * bs}), found by binary search, and only that slice is scanned."""
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    s = (i == n - 1).to(tl.int64)
    fs = FLAGS + (bh * 2 + s) * NF
    pick = tl.load(CSUM + (bh * 2 + s) * NF + i)  # members <= i, at least 1 (offset 0)
    sink = 1 - tl.load(fs + i)  # block 0 is listed apart when offset i is not a member
    count = pick + sink
    row = bh * n + i
    tl.store(BC + row, count)
    offs_b = tl.arange(0, TB)
    osort = OSORT + (bh * 2 + s) * NF
    for t0 in range(0, WB, TB):
        t = t0 + offs_b
        src = pick - 1 - t + sink
        listed = t < count
        o = tl.load(osort + src, mask=listed & (src >= 0), other=0)
        val = tl.where(listed, tl.where((t == 0) & (sink == 1), 0, i - o), -1)
        tl.store(BI + row * WB + t, val, mask=t < WB)
    offs_v = tl.arange(0, TV)
    base = tl.zeros([], tl.int32)
    # Padding sorts to the ends (negatives first, >= S last), so the slice holds every candidate (key < i);
    # inside it, duplicates and block-0 verticals still have key n and drop out below.
    vrow = V + bh * NV
    lo = _count_below(vrow, NV, tl.zeros([], tl.int64))
    hi = _count_below(vrow, NV, i.to(tl.int64) * bs)
    for p0 in range(lo, hi, TV):
        p = p0 + offs_v
        m = p < hi
        key = tl.load(VKEY + bh * NV + p, mask=m, other=n)
        cand = key < i
        covered = tl.load(fs + (i - key), mask=cand, other=1)
        act = (cand & (covered == 0)).to(tl.int32)
        v = tl.load(V + bh * NV + p, mask=act != 0, other=0)
        tl.store(CI + row * WC + base + tl.cumsum(act, 0) - 1, v.to(tl.int32), mask=act != 0)
        base += tl.sum(act, 0)
    for q0 in range(0, WC, TV):
        q = q0 + offs_v
        tl.store(CI + row * WC + q, tl.zeros([TV], tl.int32) - 1, mask=(q >= base) & (q < WC))
    tl.store(CC + row, base)
    # Transposed list of key block j = i (its count and start come from _prep_kernel).
    start = tl.load(TSTART + bh * n + i)
    if i == 0:
        for t0 in range(0, n, TB):
            t = t0 + offs_b
            tl.store(TQ + start + t, t, mask=t < n)
    else:
        below = n - 2 - i
        n_main = tl.where(below >= 0, tl.load(CSUM + bh * 2 * NF + tl.maximum(below, 0)), 0)
        for t0 in range(0, n_main, TB):
            t = t0 + offs_b
            mt = t < n_main
            o = tl.load(OSORT + bh * 2 * NF + t, mask=mt, other=0)
            tl.store(TQ + start + t, i + o, mask=mt)
        last = tl.load(FLAGS + (bh * 2 + 1) * NF + n - 1 - i)
        if last != 0:
            tl.store(TQ + start + n_main, n - 1)


@triton.jit
def _column_plan_kernel(
    FLAGS, UNIV, QI, QB, QC,
    n, NF, UW, n_chunks, bs,
    CH: tl.constexpr, TR: tl.constexpr,
):
    """Chunk c of one (batch, head)'s column universe: the query blocks using any of its columns, ascending,
    with a bit mask of which (bit t = universe entry c*CH + t)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_c = tl.arange(0, CH)
    slot = c * CH + offs_c
    cid = tl.load(UNIV + bh * UW + slot, mask=slot < UW, other=-1)
    ok = cid >= 0
    kb = tl.where(ok, cid // bs, n)
    bit = tl.where(ok, tl.full([CH], 1, tl.int64) << offs_c.to(tl.int64), 0)
    out = (bh * n_chunks + c) * n
    f0 = FLAGS + bh * 2 * NF
    offs_r = tl.arange(0, TR)
    base = tl.zeros([], tl.int32)
    # A chunk of universe padding (most of a cap-wide universe) uses no query block: skip the scan.
    n_scan = tl.where(tl.max(ok.to(tl.int32), 0) > 0, n, 0)
    for r0 in range(0, n_scan, TR):
        i = r0 + offs_r
        s = (i == n - 1).to(tl.int64)
        cand = (kb[None, :] < i[:, None]) & (i[:, None] < n)
        covered = tl.load(f0 + s[:, None] * NF + (i[:, None] - kb[None, :]), mask=cand, other=1)
        # Distinct powers of two: their sum is their OR.
        bits = tl.sum(tl.where(cand & (covered == 0), bit[None, :], 0), 1)
        nz = (bits != 0).to(tl.int32)
        pos = base + tl.cumsum(nz, 0) - 1
        tl.store(QI + out + pos, i, mask=nz != 0)
        tl.store(QB + out + pos, bits, mask=nz != 0)
        base += tl.sum(nz, 0)
    for q0 in range(0, n, TR):
        q = q0 + offs_r
        m = (q >= base) & (q < n)
        tl.store(QI + out + q, tl.zeros([TR], tl.int32) - 1, mask=m)
        tl.store(QB + out + q, tl.zeros([TR], tl.int64), mask=m)
    tl.store(QC + bh * n_chunks + c, base)


def list_widths(n_vertical: int, n_slash: int, seq_len: int, block_size: int) -> tuple[int, int]:
    """Widths of the block and column lists the GPU builder writes: bounds, not the data's maxima. A row
    lists at most the sink plus the distinct block offsets (<= 1 + 2 per slash) and at most all n blocks;
    it has at most every distinct vertical as a column."""
    n = -(-seq_len // block_size)
    return max(1, min(n, 2 * n_slash + 2)), max(1, min(n_vertical, seq_len))


def build_from_lines(vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int, chunk: int):
    """Everything `SparseIndex` holds for lines (vertical [B, H, Nv] key positions, slash [B, H, Ns] offsets,
    anything out of range is padding), on their device, without host synchronisation.

    Returns (block_ids, block_counts, col_ids, col_counts, transposed, plan_fields): the lists as
    `SparseIndex.from_lines` gives them but padded to `list_widths`; transposed = (q_ids int32 [E'],
    starts int64 [B, H, nKB], counts int32 [B, H, nKB]) with each head's lists in its own segment of E'
    (as many entries as its block lists can hold at most); plan_fields = (universe [B, H, max(Nv, 1)],
    q_ids [B, H, nChunks, nQB], bits, counts) of `ColumnPlan` for `chunk`.
    """
    B, H, nv = vertical.shape
    ns = slash.shape[-1]
    dev = vertical.device
    bh = B * H
    n = -(-seq_len // block_size)
    tail = seq_len - (n - 1) * block_size
    nf = n + 2  # block offsets 0..n, slot n + 1 spare
    wb, wc = list_widths(nv, ns, seq_len, block_size)
    uw = max(1, nv)
    # A head's transposed entries = its listed blocks: query block i lists at most min(i + 1, wb).
    cap = wb * (wb + 1) // 2 + (n - wb) * wb
    if not 1 <= chunk <= 64 or chunk & (chunk - 1):
        raise ValueError(f"column chunk must be a power of two in 1..64 (one int64 bit mask per entry); got {chunk}")
    i32 = dict(dtype=torch.int32, device=dev)
    # The sort keeps the padding (negative or >= seq_len) apart from the valid positions, which come out
    # ascending; duplicates end up adjacent (the kernels keep the first of each value).
    v_sorted = torch.sort(vertical.reshape(bh, nv), dim=-1).values if nv else torch.zeros(bh, 1, **i32)
    sl = slash.reshape(bh, ns).contiguous() if ns else torch.zeros(bh, 1, **i32)
    flags = torch.empty(bh, 2, nf, **i32)
    csum = torch.empty(bh, 2, nf, **i32)
    osort = torch.empty(bh, 2, nf, **i32)
    vkey = torch.empty(bh, max(nv, 1), **i32)
    universe = torch.empty(bh, uw, **i32)
    t_counts = torch.empty(bh, n, **i32)
    t_starts = torch.empty(bh, n, dtype=torch.int64, device=dev)
    _prep_kernel[(bh,)](
        sl, v_sorted, flags, csum, osort, vkey, universe, t_counts, t_starts,
        ns, nv, seq_len, n, block_size, tail, nf, uw, cap, T=_PREP_TILE,
    )
    block_ids = torch.empty(bh, n, wb, **i32)
    block_counts = torch.empty(bh, n, **i32)
    col_ids = torch.empty(bh, n, wc, **i32)
    col_counts = torch.empty(bh, n, **i32)
    t_ids = torch.empty(bh * cap, **i32)
    _rows_kernel[(n, bh)](
        flags, csum, osort, v_sorted, vkey, block_ids, block_counts, col_ids, col_counts, t_ids, t_starts,
        n, nf, nv, wb, wc, block_size, TB=_LIST_TILE, TV=_COL_TILE,
    )
    n_chunks = -(-uw // chunk)
    plan_q = torch.empty(bh, n_chunks, n, **i32)
    plan_bits = torch.empty(bh, n_chunks, n, dtype=torch.int64, device=dev)
    plan_counts = torch.empty(bh, n_chunks, **i32)
    _column_plan_kernel[(n_chunks, bh)](
        flags, universe, plan_q, plan_bits, plan_counts, n, nf, uw, n_chunks, block_size,
        CH=chunk, TR=_PLAN_ROWS,
    )
    transposed = (t_ids, t_starts.view(B, H, n), t_counts.view(B, H, n))
    plan = (universe.view(B, H, uw), plan_q.view(B, H, n_chunks, n), plan_bits.view(B, H, n_chunks, n),
            plan_counts.view(B, H, n_chunks))
    return (block_ids.view(B, H, n, wb), block_counts.view(B, H, n), col_ids.view(B, H, n, wc),
            col_counts.view(B, H, n), transposed, plan)
