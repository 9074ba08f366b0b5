"""FA4's lists of a ring step (`mtrain.parallel.fa4_steps.step_block_lists`), built on the CPU (FA4 itself runs on the
GPU only): they list exactly the step's block entries, the diagonal as the local step's one mask block, the backward's
per key block lists the same pairs transposed; and no index tensor is wider than the blocks it lists from, which FA4
refuses. A bounded plan (an estimated rank index) sizes its lists from the lines' bounds, which on a short shard (a
small sequence over many ranks) can exceed the shard's blocks: the case that failed on the GPU at CP=8."""

from __future__ import annotations

import pytest
import torch

from mtrain.ops.index import rows_from_lines
from mtrain.parallel import Layout
from mtrain.parallel.fa4_steps import step_block_lists
from mtrain.parallel.plan import gathered_sparse_plan, rank_blocks, sparse_plan

SEQ, BLOCK = 512, 16


def _pairs(cnt: torch.Tensor, idx: torch.Tensor) -> set:
    """(b, h, row, listed) of every counted entry."""
    out = set()
    for b, h, r in torch.nonzero(cnt >= 0).tolist():
        out.update((b, h, r, int(x)) for x in idx[b, h, r, : int(cnt[b, h, r])])
    return out


def _check(plan, origin: int, n_keys: int) -> bool:
    """Asserts the lists of one step; returns whether the step's plan lists were wider than its key blocks."""
    step = plan.steps[origin]
    (m_cnt, m_idx, f_cnt, f_idx), (mq_cnt, mq_idx, fq_cnt, fq_idx) = step_block_lists(plan, origin, n_keys)
    nq, nk = step.ids.shape[2], -(-n_keys // BLOCK)
    assert f_idx.shape[-1] <= nk and fq_idx.shape[-1] <= nq and m_idx.shape[-1] == 1 and mq_idx.shape[-1] == 1
    assert fq_cnt.shape[-1] == nk and mq_cnt.shape[-1] == nk
    want = _pairs(step.counts, step.ids.long())
    full, mask = _pairs(f_cnt, f_idx), _pairs(m_cnt, m_idx)
    assert not full & mask and full | mask == want
    assert all(r == k for (_, _, r, k) in mask) and (not mask or origin == plan.rank)
    # the backward's lists: per key block the query blocks, the same pairs
    assert {(b, h, q, k) for (b, h, k, q) in _pairs(fq_cnt, fq_idx)} == full
    assert {(b, h, q, k) for (b, h, k, q) in _pairs(mq_cnt, mq_idx)} == mask
    for b, h, k in torch.nonzero(fq_cnt > 1).tolist():  # ascending, as FA4 walks them
        got = fq_idx[b, h, k, : int(fq_cnt[b, h, k])]
        assert bool((got[1:] > got[:-1]).all())
    return step.ids.shape[-1] > nk


@pytest.mark.parametrize("world", [4, 8])
def test_step_lists_hold_the_steps_entries_within_fa4s_widths(world):
    g = torch.Generator().manual_seed(world)
    nv, ns = 12, 9
    vertical = torch.randint(-1, SEQ, (1, 2, nv), generator=g)
    slash = torch.cat([torch.arange(3).expand(1, 2, 3), torch.randint(-1, SEQ, (1, 2, ns), generator=g)], -1)
    layout = Layout.create("block-stripe", world_size=world, granularity=BLOCK)
    cpu = torch.device("cpu")
    wider = 0
    for rank in range(world):
        index = rows_from_lines(vertical, slash, SEQ, BLOCK, rank_blocks(layout, SEQ, rank, BLOCK, cpu),
                                bound_widths="static")
        ring = sparse_plan(index, layout, rank, cpu)
        assert ring.bounded
        n_local = ring.positions[rank].numel()
        for origin, step in ring.steps.items():
            wider += _check(ring, origin, step.k_pos.numel() if step.k_pos is not None else n_local)
        for sink in ("listed", "replicas"):
            gathered = gathered_sparse_plan(index, layout, rank, cpu, sink=sink)
            wider += _check(gathered, rank, gathered.steps[rank].k_pos.numel())
    if world == 8:  # 4 blocks a shard against lists as wide as the slash tensor (12 + the sink)
        assert wider > 0
