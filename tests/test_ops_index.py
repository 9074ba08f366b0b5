"""SparseIndex.from_lines against a loop-based statement of the vertical-slash rule, plus density, the
transposed index and the column plan that the deterministic backward reads."""

import pytest
import torch

from mtrain.ops import SparseIndex
from mtrain.ops.index import compact


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


def test_compact_keeps_order_and_pads():
    flags = torch.tensor([[True, False, True, True], [False, False, False, False]])
    ids, counts = compact(flags)
    assert ids.tolist() == [[0, 2, 3], [-1, -1, -1]] and counts.tolist() == [3, 0]
    vals, _ = compact(flags, torch.tensor([10, 11, 12, 13]))
    assert vals.tolist() == [[10, 12, 13], [-1, -1, -1]]


def test_bad_lines_are_refused():
    with pytest.raises(ValueError, match="vertical must be"):
        SparseIndex.from_lines(torch.zeros(2, 3), torch.zeros(1, 2, 3), 16, 4)
