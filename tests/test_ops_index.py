"""SparseIndex.from_lines against a loop-based statement of the vertical-slash rule, plus density, the
transposed index and the column plan that the deterministic backward reads; the GPU builder (Triton, run in
the CPU interpreter here) against the reference builder."""

import pytest
import torch

from mtrain.ops import SparseIndex
from mtrain.ops import index as index_module
from mtrain.ops.index import ColumnPlan, column_plan, compact, kernel_column_chunk, pad_groups, transpose_blocks_csr

# the Triton builder tests run in the interpreter's processes of tests/test_ops_interpreter.py
from test_ops_interpreter import IN_INTERPRETER, needs_interpreter


def loop_mask(vertical, slash, S, bs):
    """Pairs a block kernel computes: causal, and the key block is the diagonal, the first, or crossed by a
    slash inside this query block, or the key is a vertical."""
    B, H, _ = vertical.shape
    m = torch.zeros(B, H, S, S, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            verts = {int(x) for x in vertical[b, h] if 0 <= int(x) < S}
            offs = {int(x) for x in slash[b, h] if 0 <= int(x) < S}
            for i in range(-(-S // bs)):
                rows = range(i * bs, min(S, (i + 1) * bs))
                blocks = {0, i} | {(r - d) // bs for r in rows for d in offs if r - d >= 0}
                for r in rows:
                    for c in range(r + 1):
                        if c // bs in blocks or c in verts:
                            m[b, h, r, c] = True
    return m


@pytest.mark.parametrize("S,bs", [(64, 16), (70, 16), (45, 8)])
def test_from_lines_matches_loop_rule(S, bs):
    gen = torch.Generator().manual_seed(S)
    vertical = torch.randint(-1, S, (2, 3, 6), generator=gen)
    slash = torch.randint(-1, S, (2, 3, 4), generator=gen)
    index = SparseIndex.from_lines(vertical, slash, S, bs)
    mask = index.to_mask()
    assert torch.equal(mask, loop_mask(vertical, slash, S, bs))
    causal = S * (S + 1) / 2
    assert index.density() == pytest.approx(float(mask.double().sum(dim=(-1, -2)).mean()) / causal)
    n = -(-S // bs)
    for b in range(2):
        for h in range(3):
            for i in range(n):
                ids = index.block_ids[b, h, i, : index.block_counts[b, h, i]].tolist()
                assert ids == sorted(set(ids)) and 0 in ids and i in ids and max(ids) <= i
                assert (index.block_ids[b, h, i, index.block_counts[b, h, i]:] == -1).all()
                cols = index.col_ids[b, h, i, : index.col_counts[b, h, i]].tolist()
                assert cols == sorted(set(cols))
                assert all(c // bs not in ids and c < i * bs for c in cols)  # not inside a listed block


def test_transposed_and_column_plan_are_consistent():
    gen = torch.Generator().manual_seed(0)
    S, bs = 96, 16
    index = SparseIndex.from_lines(torch.randint(0, S, (1, 2, 9), generator=gen),
                                   torch.randint(0, S, (1, 2, 3), generator=gen), S, bs)
    t_ids, t_counts = index.transposed()
    n = S // bs
    for h in range(2):
        pairs = {(i, int(j)) for i in range(n) for j in index.block_ids[0, h, i, : index.block_counts[0, h, i]]}
        t_pairs = {(int(i), j) for j in range(n) for i in t_ids[0, h, j, : t_counts[0, h, j]]}
        assert pairs == t_pairs
    plan = index.column_plan(4)
    for h in range(2):
        universe = plan.universe[0, h]
        want = {(i, int(c)) for i in range(n) for c in index.col_ids[0, h, i, : index.col_counts[0, h, i]]}
        got = set()
        for c in range(plan.q_ids.shape[2]):
            for e in range(int(plan.counts[0, h, c])):
                i, bits = int(plan.q_ids[0, h, c, e]), int(plan.bits[0, h, c, e])
                got |= {(i, int(universe[c * 4 + t])) for t in range(4) if bits >> t & 1}
        assert got == want and len(want) > 0


def _plan_pairs(plan: ColumnPlan, h: int) -> set:
    """(query block, column token) pairs a ColumnPlan lists for head h of batch row 0."""
    got = set()
    for c in range(plan.q_ids.shape[2]):
        for e in range(int(plan.counts[0, h, c])):
            i, bits = int(plan.q_ids[0, h, c, e]), int(plan.bits[0, h, c, e])
            got |= {(i, int(plan.universe[0, h, c * plan.chunk + t])) for t in range(plan.chunk) if bits >> t & 1}
    return got


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("width", [None, 90])
def test_column_plan_lists_every_pair_within_the_counts(chunk, width):
    """The plan's (query block, column) pairs are those of the lists up to their counts (entries past a count are
    stale, not read), with up to 90 distinct columns per head: a 64-slot chunk whose top bit (1 << 63) is set for
    some query blocks."""
    gen = torch.Generator().manual_seed(7)
    S, bs = 640, 16
    index = SparseIndex.from_lines(torch.randint(-3, S, (1, 2, 90), generator=gen),
                                   torch.randint(0, S, (1, 2, 2), generator=gen), S, bs)
    counts = (index.col_counts - torch.arange(S // bs) % 2).clamp(min=0).to(index.col_counts.dtype)  # every other
    plan = column_plan(index.col_ids, counts, S, chunk, width=width)
    top = 0
    for h in range(2):
        want = {(i, int(c)) for i in range(S // bs) for c in index.col_ids[0, h, i, : counts[0, h, i]]}
        assert _plan_pairs(plan, h) == want and len(want) > 0
        top += int((plan.bits[0, h] < 0).sum())  # bit 63 set: the int64 is negative
    assert top > 0 or chunk < 64


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_column_plan_with_a_known_width_lists_the_same_pairs(chunk):
    """The bounded column plan (no host read: universe as wide as the bound, q_ids as wide as the query blocks)
    holds the same universe and (query block, column) pairs as the trimmed one."""
    gen = torch.Generator().manual_seed(chunk)
    S, bs = 160, 16
    index = SparseIndex.from_lines(torch.randint(-3, S, (2, 3, 11), generator=gen),
                                   torch.randint(0, S, (2, 3, 4), generator=gen), S, bs)
    want = column_plan(index.col_ids, index.col_counts, S, chunk)
    got = column_plan(index.col_ids, index.col_counts, S, chunk, width=11)  # a head's columns are among its 11 lines
    assert got.universe.shape[-1] == 11 and got.q_ids.shape[-1] == S // bs
    for b in range(2):
        for h in range(3):
            u = want.universe[b, h]
            assert torch.equal(got.universe[b, h, : u.numel()], u) and (got.universe[b, h, u.numel():] == -1).all()
    for h in range(3):
        assert _plan_pairs(got, h) == _plan_pairs(want, h) and _plan_pairs(want, h)
    assert torch.equal(got.counts[..., : want.counts.shape[-1]], want.counts)


@pytest.mark.parametrize("width", [None, 11])
def test_column_plan_from_a_base_equals_the_whole_key_range(width):
    """Columns that all lie at or after key `base` (the ring's gathered column slots): the plan built over keys
    base.. (`base=`) equals the one over every key, universe positions included."""
    gen = torch.Generator().manual_seed(3)
    S, bs, base = 160, 16, 96
    index = SparseIndex.from_lines(torch.randint(-3, S, (2, 3, 11), generator=gen),
                                   torch.randint(0, S, (2, 3, 4), generator=gen), S, bs)
    shift = 200  # the lists' columns moved to keys base.. of a longer key range
    col_ids = torch.where(index.col_ids >= 0, index.col_ids + shift, -1).to(index.col_ids.dtype)
    want = column_plan(col_ids, index.col_counts, S + shift, 4, width=width)
    got = column_plan(col_ids, index.col_counts, S + shift, 4, width=width, base=base)
    for field in ("universe", "q_ids", "bits", "counts"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert int(got.universe.max()) >= shift  # the universe holds key positions, not positions from base


def test_compact_keeps_order_and_pads():
    flags = torch.tensor([[True, False, True, True], [False, False, False, False]])
    ids, counts = compact(flags)
    assert ids.tolist() == [[0, 2, 3], [-1, -1, -1]] and counts.tolist() == [3, 0]
    vals, _ = compact(flags, torch.tensor([10, 11, 12, 13]))
    assert vals.tolist() == [[10, 12, 13], [-1, -1, -1]]
    ids, counts = compact(flags, width=5)  # a known bound: wider, the same entries
    assert ids.tolist() == [[0, 2, 3, -1, -1], [-1] * 5] and counts.tolist() == [3, 0]
    vals, _ = compact(flags, torch.tensor([10, 11, 12, 13]), width=3)
    assert vals.tolist() == [[10, 12, 13], [-1, -1, -1]]


def test_bad_lines_are_refused():
    with pytest.raises(ValueError, match="vertical must be"):
        SparseIndex.from_lines(torch.zeros(2, 3), torch.zeros(1, 2, 3), 16, 4)


def flag_matrix_from_lines(vertical, slash, S, bs):
    """The previous builder (a dense [B, H, nQB, nQB + 1] flag matrix), kept as an independent reference."""
    B, H, _ = vertical.shape
    n = -(-S // bs)
    qb = torch.arange(n)
    flags = torch.zeros(B, H, n, n + 1, dtype=torch.bool)
    flags[:, :, qb, qb] = True
    flags[:, :, :, 0] = True
    if slash.shape[-1] > 0:
        d = slash.long()[:, :, None, :]
        row_lo = (qb * bs)[None, None, :, None]
        row_hi = torch.clamp((qb + 1) * bs, max=S)[None, None, :, None] - 1
        ok = (d >= 0) & (d < S) & (row_hi - d >= 0)
        flags.scatter_(-1, torch.where(ok, (row_lo - d).clamp(min=0) // bs, n).expand(B, H, n, -1), True)
        flags.scatter_(-1, torch.where(ok, (row_hi - d).clamp(min=0) // bs, n).expand(B, H, n, -1), True)
    flags = flags[..., :n]
    block_ids, block_counts = compact(flags)
    if vertical.shape[-1] == 0:
        return block_ids, block_counts, torch.full((B, H, n, 1), -1, dtype=torch.int32), torch.zeros(B, H, n).int()
    v, _ = torch.sort(torch.where((vertical >= 0) & (vertical < S), vertical.long(), S), dim=-1)
    dup = torch.zeros_like(v, dtype=torch.bool)
    dup[..., 1:] = v[..., 1:] == v[..., :-1]
    v_ok = (v < S) & ~dup
    v_blk = torch.where(v_ok, v // bs, 0)
    covered = torch.gather(flags, -1, v_blk[:, :, None, :].expand(B, H, n, -1))
    active = v_ok[:, :, None, :] & (v_blk[:, :, None, :] < qb[None, None, :, None]) & ~covered
    col_ids, col_counts = compact(active, v[:, :, None, :].expand(B, H, n, -1).clamp(max=S - 1))
    return block_ids, block_counts, col_ids, col_counts


def flag_matrix_transpose(block_ids, block_counts, n_kblocks):
    """The previous transpose (dense [B, H, nKB, nQB] flags), kept as an independent reference."""
    B, H, nqb, maxb = block_ids.shape
    valid = (torch.arange(maxb) < block_counts[..., None].long()) & (block_ids >= 0)
    flags = torch.zeros(B, H, n_kblocks + 1, nqb, dtype=torch.bool)
    q_idx = torch.arange(nqb)[None, None, :, None].expand_as(block_ids)
    b_idx = torch.arange(B)[:, None, None, None].expand_as(block_ids)
    h_idx = torch.arange(H)[None, :, None, None].expand_as(block_ids)
    flags[b_idx, h_idx, torch.where(valid, block_ids.long(), n_kblocks), q_idx] = True
    return compact(flags[:, :, :n_kblocks])


@pytest.mark.parametrize("S,bs,nv,ns", [(1000, 16, 12, 9), (1024, 64, 40, 30), (777, 32, 0, 5), (300, 7, 9, 0),
                                        (130, 64, 3, 2), (64, 64, 2, 2), (2000, 8, 50, 200)])
def test_offset_builder_equals_flag_matrix_builder(S, bs, nv, ns, monkeypatch):
    """The list-proportional builder gives the previous builder's tensors exactly (shapes included),
    for ragged lengths, duplicates, padding, offsets past the sequence, and the transposed view."""
    monkeypatch.setattr(index_module, "_SCATTER_ELEMS", 6 * max(nv, 1) * 5)  # several scatter steps
    gen = torch.Generator().manual_seed(S + bs)
    for trial in range(3):
        vertical = torch.randint(-2, S + 3, (2, 3, nv), generator=gen)
        near = torch.randint(0, 3 * bs, (2, 3, ns // 2), generator=gen)  # many offsets share blocks
        slash = torch.cat([near, torch.randint(-2, S + 3, (2, 3, ns - ns // 2), generator=gen)], -1)
        index = SparseIndex.from_lines(vertical, slash, S, bs)
        want = flag_matrix_from_lines(vertical, slash, S, bs)
        for got, ref in zip((index.block_ids, index.block_counts, index.col_ids, index.col_counts), want):
            assert got.dtype == ref.dtype and torch.equal(got, ref)
        t_ids, t_counts = index.transposed()
        r_ids, r_counts = flag_matrix_transpose(index.block_ids, index.block_counts, index.n_blocks)
        assert torch.equal(t_ids, r_ids) and torch.equal(t_counts, r_counts)


def random_lines(S, bs, nv, ns, gen, batch=2, heads=3):
    """Verticals and slashes with padding (-2, -1, >= S), duplicates, and half the slashes near the diagonal
    (many share blocks)."""
    vertical = torch.randint(-2, S + 3, (batch, heads, nv), generator=gen)
    near = torch.randint(0, 3 * bs, (batch, heads, ns // 2), generator=gen)
    slash = torch.cat([near, torch.randint(-2, S + 3, (batch, heads, ns - ns // 2), generator=gen)], -1)
    return vertical, slash


def assert_same_lists(ref: SparseIndex, new: SparseIndex):
    """`new` (GPU builder, bound-width padding) holds exactly the reference's lists, transposed lists and
    column plan: equal up to the reference's width, only padding (-1, or 0 bits) beyond it."""

    def same_padded(a, b, pad):
        assert a.dtype == b.dtype and b.shape[:-1] == a.shape[:-1] and b.shape[-1] >= a.shape[-1]
        assert torch.equal(a, b[..., : a.shape[-1]]) and bool((b[..., a.shape[-1]:] == pad).all())

    assert torch.equal(ref.block_counts, new.block_counts) and torch.equal(ref.col_counts, new.col_counts)
    same_padded(ref.block_ids, new.block_ids, -1)
    same_padded(ref.col_ids, new.col_ids, -1)
    r_ids, r_starts, r_counts = transpose_blocks_csr(ref.block_ids, ref.block_counts, ref.n_blocks)
    n_ids, n_starts, n_counts = new.transposed_csr()
    assert n_ids.dtype == r_ids.dtype and n_starts.dtype == r_starts.dtype
    assert torch.equal(r_counts, n_counts)
    assert torch.equal(pad_groups(r_ids, r_starts, r_counts), pad_groups(n_ids, n_starts, n_counts))
    # Each (b, h, key block) list lies inside the flat array, the lists do not overlap.
    ends = n_starts + n_counts
    assert int(ends.max()) <= n_ids.numel()
    order = torch.argsort(n_starts.flatten())
    assert bool((n_starts.flatten()[order][1:] >= ends.flatten()[order][:-1]).all())
    chunk = kernel_column_chunk(ref.block_size)
    assert ("c", chunk) in new._cache  # built in the same pass
    r_plan, n_plan = column_plan(ref.col_ids, ref.col_counts, ref.seq_len, chunk), new.column_plan(chunk)
    same_padded(r_plan.universe, n_plan.universe, -1)
    k = r_plan.q_ids.shape[2]  # the GPU plan may have more (empty) chunks: its universe is wider
    assert torch.equal(r_plan.counts, n_plan.counts[:, :, :k]) and bool((n_plan.counts[:, :, k:] == 0).all())
    same_padded(r_plan.q_ids, n_plan.q_ids[:, :, :k], -1)
    same_padded(r_plan.bits, n_plan.bits[:, :, :k], 0)
    assert bool((n_plan.q_ids[:, :, k:] == -1).all())


BUILDER_CASES = [(64, 16, 6, 4), (70, 16, 6, 4), (45, 8, 9, 5), (1000, 16, 12, 9), (1024, 64, 40, 30),
                 (130, 64, 3, 2), (64, 64, 2, 2), (30, 64, 3, 3), (777, 32, 0, 5), (300, 7, 9, 0), (200, 16, 0, 0)]


@needs_interpreter
@pytest.mark.parametrize("S,bs,nv,ns", BUILDER_CASES)
def test_triton_builder_equals_reference(S, bs, nv, ns):
    gen = torch.Generator().manual_seed(S * 7 + bs)
    # The interpreter runs one program at a time: fewer heads for the longer sequences.
    vertical, slash = random_lines(S, bs, nv, ns, gen, batch=2 if S < 300 else 1, heads=3 if S < 300 else 2)
    ref = SparseIndex.from_lines(vertical, slash, S, bs, impl="torch")
    assert_same_lists(ref, SparseIndex.from_lines(vertical, slash, S, bs, impl="triton"))
    # int32 lines, and the transposed view through the padded form.
    new = SparseIndex.from_lines(vertical.int(), slash.int(), S, bs, impl="triton")
    assert_same_lists(ref, new)
    for got, want in zip(new.transposed(), ref.transposed()):
        assert torch.equal(got, want)


@needs_interpreter
def test_triton_builder_covers_full_and_empty_patterns():
    """Every offset listed (dense causal lists, no columns) and all lines padding (diagonal + sink only)."""
    S, bs = 96, 16
    n = S // bs
    dense = SparseIndex.from_lines(torch.arange(S).expand(1, 2, S), torch.arange(S).expand(1, 2, S), S, bs,
                                   impl="triton")
    assert dense.block_counts.tolist() == [[list(range(1, n + 1))] * 2]
    assert int(dense.col_counts.sum()) == 0 and int(dense.column_plan(16).counts.sum()) == 0
    assert_same_lists(SparseIndex.from_lines(torch.arange(S).expand(1, 2, S), torch.arange(S).expand(1, 2, S), S, bs,
                                             impl="torch"), dense)
    pad = torch.full((1, 2, 5), -1)
    empty = SparseIndex.from_lines(pad, pad, S, bs, impl="triton")
    assert_same_lists(SparseIndex.from_lines(pad, pad, S, bs, impl="torch"), empty)
    assert empty.block_counts[0, 0].tolist() == [1] + [2] * (n - 1)


@needs_interpreter
def test_triton_column_lists_scan_the_right_slice_of_the_verticals():
    """Each query block scans only the sorted verticals in [0, i * bs): negative padding in front, padding
    >= S behind, duplicates, block-0 verticals, and heads with different valid counts; a vertical at
    i * bs - 1 is a column of block i, one at i * bs is not (it is in block i's diagonal block)."""
    S, bs = 100, 8  # 13 query blocks, a short last one
    n = -(-S // bs)
    heads = [
        [-7, -1, 0, 5, 15, 16, 16, 23, 24, 95, 96, 99, 100, 150],  # both boundaries of blocks 2, 3 and n - 1
        [-3, -3, -2, -1, -1, -1, S, S, S + 1, S + 5, 2 * S, 10**6, -10**6, -9],  # all padding
        [-2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 9],  # the first valid entry is a candidate
        [8, 8, 9, 31, 32, 33, 47, 64, 64, 71, 88, 90, 95, 95],  # no padding, many duplicates
        [0, 1, 2, 3, 7, 7, 7, S - 1, S, S, S, S + 1, S + 2, S + 3],  # block 0 and the last block only
        [-1, 3, 10, 20, 30, 40, 50, 60, 70, 80, 90, 98, 99, S],
    ]
    gen = torch.Generator().manual_seed(11)
    vertical = torch.tensor(heads)[None]
    vertical = vertical[..., torch.randperm(vertical.shape[-1], generator=gen)]  # the builder sorts
    slash = torch.full((1, len(heads), 4), -1)
    slash[0, 5] = torch.tensor([0, 9, 30, -1])  # one head with slash-covered blocks too
    ref = SparseIndex.from_lines(vertical, slash, S, bs, impl="torch")
    for lines in (vertical, vertical.int()):
        new = SparseIndex.from_lines(lines, slash, S, bs, impl="triton")
        assert_same_lists(ref, new)
        for h, verts in enumerate(heads[:5]):  # no slashes: every earlier vertical outside block 0 is a column
            for i in range(n):
                got = new.col_ids[0, h, i, : int(new.col_counts[0, h, i])].tolist()
                assert got == sorted({v for v in verts if bs <= v < i * bs}), (h, i, got)
        cols = [new.col_ids[0, 0, i, : int(new.col_counts[0, 0, i])].tolist() for i in range(n)]
        assert 15 in cols[2] and 16 not in cols[2] and 16 in cols[3] and 23 in cols[3] and 24 not in cols[3]
        assert 95 in cols[n - 1] and 96 not in cols[n - 1] and cols[n - 1][-1] == 95
        assert cols[1] == [] and int(new.col_counts[0, 1].sum()) == 0
        assert new.col_ids[0, 2, 2].tolist()[:1] == [9] and new.col_counts[0, 3, 1] == 0


if IN_INTERPRETER:  # the interpreter resolves a kernel's callees in its module's globals
    import triton
    import triton.language as tl

    from mtrain.ops._triton_index import _count_below

    @triton.jit
    def _count_below_kernel(ROW, T, OUT, size):
        k = tl.program_id(0)
        tl.store(OUT + k, _count_below(ROW, size, tl.load(T + k).to(tl.int64)))


@needs_interpreter
def test_triton_count_below_is_searchsorted():
    """The rows kernel's slice bounds: #{entries < t} of a sorted row, exactly (wider bounds would still
    give the same lists, only slower), for empty, one-entry and odd-length rows."""
    gen = torch.Generator().manual_seed(5)
    for size in (0, 1, 2, 7, 16, 33):
        row = torch.randint(-4, 12, (max(size, 1),), generator=gen, dtype=torch.int32).sort().values
        t = torch.arange(-6, 15, dtype=torch.int32)
        out = torch.empty_like(t)
        _count_below_kernel[(t.numel(),)](row, t, out, size)
        assert out.tolist() == torch.searchsorted(row[:size], t, right=False).tolist(), size


@needs_interpreter
def test_triton_built_index_drives_the_kernels_like_the_reference():
    """The wider padding is tolerated by the attention kernels: fp32 forward and deterministic backward
    through the Triton kernels give bit-identical results with either index."""
    from mtrain.ops import vertical_slash_attention

    gen = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D, bs = 1, 150, 2, 1, 16, 16  # GQA; 10 query blocks, the last one short
    vertical = torch.randint(-1, S, (B, Hq, 7), generator=gen)
    slash = torch.randint(0, 2 * bs, (B, Hq, 3), generator=gen)  # local: later blocks keep columns
    q, k, v = (torch.randn(B, S, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
    results = []
    for impl in ("torch", "triton"):
        index = SparseIndex.from_lines(vertical, slash, S, bs, impl=impl)
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        out = vertical_slash_attention(qi, ki, vi, index, impl="triton", deterministic=True)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), qi.grad, ki.grad, vi.grad))
    assert int(SparseIndex.from_lines(vertical, slash, S, bs).col_counts.sum()) > 0  # columns are exercised
    for got, want in zip(*results):
        assert torch.equal(got, want)


def split_reference(work: torch.Tensor, item_limit, min_items=0):
    """The backward's work items written plainly (host loop): per target, ceil(w / L) items (at least 1),
    L = item_limit or max(256, 2 * total // (targets with work) + 1), or with min_items M > 0
    max(32, min(2 * total // busy + 1, total // M + 1)); extra slots numbered in item order."""
    w = [int(x) for x in work.flatten()]
    busy = sum(x > 0 for x in w)
    limit = 2 * sum(w) // max(1, busy) + 1
    limit = max(32, min(limit, sum(w) // min_items + 1)) if min_items else max(256, limit)
    limit = item_limit or limit
    items, heavy, n_extra = [], [], 0
    for t, x in enumerate(w):
        n = max(1, -(-x // limit))
        if n > 1:
            heavy.append((t, n_extra, n - 1))
        for r in range(n):
            items.append((t, r * limit, min(r * limit + limit, x), -1 if r == 0 else n_extra + r - 1))
        n_extra += n - 1
    return items, heavy, n_extra


@needs_interpreter
@pytest.mark.parametrize("item_limit, min_items", [(None, 0), (3, 0), (None, 64)])
def test_triton_split_work_matches_reference(item_limit, min_items, monkeypatch):
    """`_split_work` builds fixed-size tables on the device (padding: target -1, reduce count 0) holding
    exactly the items and split targets of the plain rule, whatever the empty targets; with MIN_ITEMS the few
    targets split into shorter items (as the column pass on a big GPU)."""
    from mtrain.ops import _triton_attention as ta

    monkeypatch.setattr(ta, "ITEM_LIMIT", item_limit)
    monkeypatch.setattr(ta, "MIN_ITEMS", min_items)
    gen = torch.Generator().manual_seed(5)
    n_inner, n_heads, rows_per, rows_total = 7, 2, 16, 100
    for trial in range(4):
        work = torch.randint(0, 40, (2, n_heads, n_inner), generator=gen, dtype=torch.int32)
        work[work < 10] = 0  # empty targets
        if min_items:
            work *= 4  # lists of 40-160 entries: above the short item length M asks for
        if item_limit is None:
            work[0, 0, 0] = 1500 + 700 * trial  # one long list, as the sink block's: split above 256
        rows = (n_inner, n_heads, 1000, 100, 10, rows_per, rows_total)
        plan = ta._split_work(work, int(work.max()), rows)
        items, heavy, n_extra = split_reference(work, item_limit, min_items)
        got = list(zip(*(plan[k].tolist() for k in ("target", "start", "end", "slot"))))
        assert got[: len(items)] == items
        assert all(t == -1 for t, *_ in got[len(items):]) and plan["grid"] >= len(items)
        assert int(plan["n_extra"]) == n_extra <= plan["extra_cap"]
        count = plan["extra_count"].tolist()
        assert [(s, c) for s, c in zip(plan["extra_start"].tolist(), count) if c] == [(s, c) for _, s, c in heavy]
        assert count[len(heavy):] == [0] * (len(count) - len(heavy))
        for k, (t, _, _) in enumerate(heavy):
            bh, x = divmod(t, n_inner)
            b, h = divmod(bh, n_heads)
            assert int(plan["off"][k]) == b * 1000 + h * 100 + x * 10
            assert int(plan["nrows"][k]) == min(rows_total - x * rows_per, rows_per)
        if item_limit is None:
            assert heavy  # the long list really split
        if min_items:
            assert len(heavy) > 1 and len(items) > work.numel() + 10  # many targets split, not only the long one


@needs_interpreter
def test_triton_column_add_matches_indexed_adds():
    """The column gradients are added to dK/dV rows head by head in group order (bitwise as a plain loop),
    keys found through each head's key -> slot map of its sorted, -1 padded universe; keys in no universe are left
    alone. Into bf16 dK/dV (the fa4 engine adds into FA4's): the fp32 sum, rounded once."""
    from mtrain.ops._triton_attention import column_add, universe_slots

    gen = torch.Generator().manual_seed(2)
    B, Sk, Hkv, group, D, U = 2, 150, 2, 3, 16, 9
    universe = torch.full((B, Hkv * group, U), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv * group):
            n = int(torch.randint(0, U + 1, (1,), generator=gen))  # some heads have fewer, or none
            universe[b, h, :n] = torch.randperm(Sk, generator=gen)[:n].sort().values
    universe[0, 0, :U] = torch.arange(Sk - U, Sk)  # the last keys, a full universe
    dk, dv = torch.randn(B, Sk, Hkv, D, generator=gen), torch.randn(B, Sk, Hkv, D, generator=gen)
    dkc, dvc = torch.randn(B, Hkv * group, U, D, generator=gen), torch.randn(B, Hkv * group, U, D, generator=gen)

    def indexed_adds(k0, v0):  # head by head in group order, slot by slot
        want_k, want_v = k0.clone(), v0.clone()
        for b in range(B):
            for hk in range(Hkv):
                for g in range(group):
                    h = hk * group + g
                    for slot, key in enumerate(universe[b, h].tolist()):
                        if key >= 0:
                            want_k[b, key, hk] += dkc[b, h, slot]
                            want_v[b, key, hk] += dvc[b, h, slot]
        return want_k, want_v

    want_k, want_v = indexed_adds(dk, dv)
    slots = universe_slots(ColumnPlan(universe, None, None, None, 4), Sk, {})
    for b in range(B):
        for h in range(Hkv * group):
            keys = universe[b, h][universe[b, h] >= 0].long()
            assert torch.equal(slots[b, h, keys], torch.arange(keys.numel(), dtype=torch.int32))
            assert int((slots[b, h] >= 0).sum()) == keys.numel()
    low_k, low_v = dk.to(torch.bfloat16), dv.to(torch.bfloat16)
    want_low = indexed_adds(low_k.float(), low_v.float())
    column_add(dk, dv, dkc, dvc, slots, group)
    assert torch.equal(dk, want_k) and torch.equal(dv, want_v)
    column_add(low_k, low_v, dkc, dvc, slots, group)
    for got, want in zip((low_k, low_v), want_low):
        torch.testing.assert_close(got, want.to(torch.bfloat16), atol=0, rtol=2 ** -7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_triton_builder_on_gpu_matches_reference_without_host_sync():
    from mtrain.ops import _triton_attention

    gen = torch.Generator().manual_seed(1)
    for S, bs, nv, ns in [(32768, 64, 500, 200), (20000, 128, 300, 120)]:
        vertical, slash = random_lines(S, bs, nv, ns, gen, batch=1, heads=9)
        vertical, slash = vertical.cuda(), slash.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            new = SparseIndex.from_lines(vertical, slash, S, bs)
            _triton_attention.prepare_backward(new, 3, 64)  # the backward's work plans
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_same_lists(SparseIndex.from_lines(vertical, slash, S, bs, impl="torch"), new)


def test_column_chunk_is_the_kernels_chunk():
    from mtrain.ops._triton_attention import _tile

    for bs in (1, 7, 8, 16, 17, 32, 64, 100, 128, 256):
        assert kernel_column_chunk(bs) == min(_tile(bs), 64)


def test_bad_builder_is_refused():
    with pytest.raises(ValueError, match="impl must be"):
        SparseIndex.from_lines(torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 3, dtype=torch.long), 16, 4,
                               impl="cuda")


def test_list_bytes_as_held_and_as_wide_as_used():
    # B=1, H=2, 4 query blocks; block lists padded to 8 slots with at most 3 used, column lists padded to 10 with
    # at most 4 used (int32 ids, int32 counts)
    from mtrain.ops.index import list_bytes, used_list_bytes

    block_ids = torch.full((1, 2, 4, 8), -1, dtype=torch.int32)
    block_counts = torch.tensor([[[1, 2, 3, 1], [1, 1, 2, 2]]], dtype=torch.int32)
    col_ids = torch.full((1, 2, 4, 10), -1, dtype=torch.int32)
    col_counts = torch.tensor([[[0, 4, 1, 0], [2, 0, 0, 3]]], dtype=torch.int32)
    for b in range(2):
        for r in range(4):
            block_ids[0, b, r, :int(block_counts[0, b, r])] = torch.arange(int(block_counts[0, b, r]))
            col_ids[0, b, r, :int(col_counts[0, b, r])] = torch.arange(int(col_counts[0, b, r]))
    index = SparseIndex(block_ids, block_counts, col_ids, col_counts, seq_len=64, block_size=16)
    counts = 2 * 8 * 4  # two [1, 2, 4] int32 count tensors
    assert list_bytes(index) == 8 * 8 * 4 + 8 * 10 * 4 + counts  # 8 (batch, head, block) rows
    assert used_list_bytes(index) == 8 * 3 * 4 + 8 * 4 * 4 + counts
