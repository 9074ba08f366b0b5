"""Ring plans on one process: the remapped local block lists and off-ring columns reproduce the global
sparse mask exactly once, and dense steps' rectangles reproduce the causal mask."""

from __future__ import annotations

import pytest
import torch

from mtrain.ops import SparseIndex
from mtrain.ops.reference import partial_mask
from mtrain.parallel import LAYOUT_NAMES, Layout
from mtrain.parallel.plan import dense_plan, sparse_plan

SEQ, BLOCK, WORLD = 128, 16, 4


def _index() -> SparseIndex:
    g = torch.Generator().manual_seed(3)
    vertical = torch.randint(0, SEQ, (2, 3, 5), generator=g)
    slash = torch.cat([torch.arange(3).expand(2, 3, 3), torch.randint(10, SEQ, (2, 3, 2), generator=g)], -1)
    return SparseIndex.from_lines(vertical, slash, SEQ, BLOCK)


@pytest.mark.parametrize("name,granularity", [(n, 16) for n in LAYOUT_NAMES] + [("block-stripe", 8), ("block-stripe", 32)])
def test_sparse_plan_covers_the_global_mask_once(name, granularity):
    index = _index()
    layout = Layout.create(name, world_size=WORLD, granularity=granularity)
    want = index.to_mask()  # [B, H, S, S] global
    b, h = want.shape[:2]
    for rank in range(WORLD):
        plan = sparse_plan(index, layout, rank, torch.device("cpu"))
        q_pos = plan.q_pos
        hits = torch.zeros(b, h, q_pos.numel(), SEQ, dtype=torch.int32)
        for origin in range(WORLD):
            k_pos = plan.positions[origin]
            local = partial_mask(q_pos, k_pos, batch=b, heads=h, blocks=plan.steps[origin].as_blocks(),
                                 block_size=plan.block_size)
            assert origin not in plan.skip or not local.any()
            ids = plan.steps[origin].ids.long()
            valid = ids >= 0
            assert torch.equal(valid.sum(-1), plan.steps[origin].counts.long())  # packed to the front
            nxt = torch.where(valid[..., 1:], ids[..., 1:], ids.max() + 1)
            assert bool((nxt > ids[..., :-1]).all()), "local block lists must be strictly ascending"
            hits[..., k_pos] += local.int()
        cols = plan.columns
        col_ids, counts = cols.ids, cols.counts
        c = col_ids.long()
        nxt = torch.where(c[..., 1:] >= 0, c[..., 1:], c.max() + 1)
        assert bool((nxt > c[..., :-1]).all()), "column lists must be strictly ascending"
        valid = c >= 0  # front-packed: the kernels read the first `counts` entries
        assert torch.equal(valid.sum(-1), counts.long()) and not bool((valid[..., 1:] & ~valid[..., :-1]).any())
        empty = (torch.full((*col_ids.shape[:3], 1), -1, dtype=torch.int32), torch.zeros_like(counts))
        local = partial_mask(q_pos, cols.positions, batch=b, heads=h, blocks=empty, columns=(col_ids, counts),
                             block_size=plan.block_size)
        real = cols.positions < SEQ
        hits[..., cols.positions[real]] += local[..., real].int()
        assert not local[..., ~real].any()
        assert hits.max() <= 1, "a pair is computed twice"
        assert torch.equal(hits.bool(), want[:, :, q_pos]), f"{name} rank {rank}"
        # the sink block never travels the ring
        for origin in range(WORLD):
            ids = plan.steps[origin].ids
            sink_local = (plan.positions[origin].view(-1, plan.block_size)[:, 0] < BLOCK).nonzero().flatten()
            assert not torch.isin(ids, sink_local.int()).any()


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_dense_rects_reproduce_the_causal_mask(name):
    layout = Layout.create(name, world_size=WORLD, granularity=8)
    for rank in range(WORLD):
        plan = dense_plan(layout, SEQ, rank, torch.device("cpu"))
        q_pos = plan.q_pos
        for origin in range(WORLD):
            k_pos = plan.positions[origin]
            want = k_pos[None, :] <= q_pos[:, None]
            if origin in plan.skip:
                assert not want.any()
                continue
            rects = plan.rects[origin]
            if name in ("contiguous", "zigzag") or origin == rank:
                assert rects is not None, (name, rank, origin)
            if rects is None:
                continue
            got = torch.zeros_like(want, dtype=torch.int32)
            for r in rects:
                n, m = r.q1 - r.q0, r.k1 - r.k0
                block = torch.ones(n, m, dtype=torch.bool).tril() if r.causal else torch.ones(n, m, dtype=torch.bool)
                got[r.q0:r.q1, r.k0:r.k1] += block.int()
            assert got.max() <= 1
            assert torch.equal(got.bool(), want), (name, rank, origin)
            if name == "zigzag":
                assert len(rects) == 1  # one fused call per step, as PyTorch's own zigzag ring makes


@pytest.mark.parametrize("nodes,local", [(2, 2), (2, 4), (4, 2), (3, 4), (1, 4), (4, 1)])
def test_hierarchical_schedule_keeps_every_step_at_one_distance(nodes, local):
    from mtrain.parallel.ring_hierarchical import node_grid, origin_rank

    world = nodes * local
    layout = Layout.create("block-stripe", world_size=world, granularity=16, local_world_size=local)
    grids = [node_grid(r, world, local, r % local) for r in range(world)]
    assert all(layout.slot(r) == g.slot and g.cp_rank_of_slot(g.slot) == r for r, g in enumerate(grids))
    for o in range(nodes):
        for i in range(local):
            # diagonal distance in stripes between a rank and the shard it holds: the same on every rank
            distances = {(layout.slot(r) - layout.slot(origin_rank(g, o, i))) % world for r, g in enumerate(grids)}
            assert distances == {o + i * nodes}, (o, i, distances)
    for g in grids:  # each process attends every shard exactly once
        assert sorted(origin_rank(g, o, i) for o in range(nodes) for i in range(local)) == list(range(world))


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("form", ["global", "rows", "rows-static"])
def test_gathered_plan_from_the_index_equals_the_merged_ring_plan(name, world, form):
    """The gathered schedule's plan built straight from the index (`gathered_sparse_plan`: one sort per list) lists
    the same gathered key blocks, key positions, columns and column slots as the ring plan's steps merged into one
    (`ring_gather.gathered_plan`), for a global index and for a rank's rows (read or static widths), but for the sink
    block: a listed block of the direct plan (at the gathered place of global block 0) where the merged plan has its
    tokens as the first columns (with `sink="columns"` the same as the merged plan); None
    where a global block is not one local block of one rank."""
    import torch.nn.functional as F

    from mtrain.ops.index import rows_from_lines
    from mtrain.parallel.plan import gathered_sparse_plan, rank_blocks
    from mtrain.parallel.ring_gather import gathered_plan

    g = torch.Generator().manual_seed(5)
    vertical = torch.randint(-1, SEQ, (2, 3, 6), generator=g)
    slash = torch.cat([torch.arange(3).expand(2, 3, 3), torch.randint(-1, SEQ, (2, 3, 3), generator=g)], -1)
    layout = Layout.create(name, world_size=world, granularity=BLOCK)
    cpu = torch.device("cpu")

    def same(a, b):
        width = max(a.shape[-1], b.shape[-1])
        return torch.equal(F.pad(a, (0, width - a.shape[-1]), value=-1), F.pad(b, (0, width - b.shape[-1]), value=-1))

    vertical_columns = 0
    for rank in range(world):
        if form == "global":
            index = SparseIndex.from_lines(vertical, slash, SEQ, BLOCK)
        else:
            rows = rank_blocks(layout, SEQ, rank, BLOCK, cpu)
            index = rows_from_lines(vertical, slash, SEQ, BLOCK, rows, bound_widths="static" if form == "rows-static"
                                    else True)
        direct = gathered_sparse_plan(index, layout, rank, cpu)
        if name == "stripe":  # 1-token stripes: no global block is one rank's local block
            assert direct is None
            continue
        merged = gathered_plan(sparse_plan(index, layout, rank, cpu, rank), world)
        a, b = direct.steps[rank], merged.steps[rank]
        assert list(direct.steps) == [rank] and direct.bounded == merged.bounded
        # where global block 0 sits among the gathered keys (rank o's shard is at step (rank - o) % W)
        shards = [layout.indices(SEQ, r) for r in range(world)]
        owner = next(r for r in range(world) if bool((shards[r] == 0).any()))
        sink_at = ((rank - owner) % world) * shards[rank].numel() // BLOCK + int(torch.nonzero(shards[owner] == 0)) // BLOCK
        base = world * shards[rank].numel()  # the column slots' first key, after the W shards
        had_sink = (b.columns[0] == base).any(-1)  # the merged plan's lists whose first columns are the sink's slots
        want_ids = torch.sort(torch.cat([b.ids, torch.where(had_sink, sink_at, -1)[..., None].to(b.ids.dtype)], -1),
                              -1).values
        want_ids = torch.sort(torch.where(want_ids >= 0, want_ids, 2**30), -1).values
        want_ids = torch.where(want_ids < 2**30, want_ids, -1)
        assert same(a.ids, want_ids) and torch.equal(a.counts, b.counts + had_sink.int())
        assert torch.equal(a.k_pos, b.k_pos)
        verts = torch.where(b.columns[0] >= base + BLOCK, b.columns[0], -1)  # the sink's tokens: the first slots
        verts = torch.gather(verts, -1, torch.sort((verts < 0).to(torch.uint8), dim=-1, stable=True).indices)
        assert same(a.columns[0], verts) and torch.equal(a.columns[1], b.columns[1] - BLOCK * had_sink.int())
        for x, y in zip(direct.gather_slots, merged.gather_slots):
            assert x == y if x is None or isinstance(x, int) else torch.equal(x, y)
        # with the sink's tokens as columns (for FA4's backward) it is the merged ring plan, entry for entry
        ring_like = gathered_sparse_plan(index, layout, rank, cpu, sink="columns").steps[rank]
        assert same(ring_like.ids, b.ids) and torch.equal(ring_like.counts, b.counts)
        assert same(ring_like.columns[0], b.columns[0]) and torch.equal(ring_like.columns[1], b.columns[1])
        assert int(a.counts.sum()) > 0 and int(b.columns[1].sum()) > 0  # the case is not empty
        vertical_columns += int(a.columns[1].sum())
    assert name == "stripe" or vertical_columns > 0  # some rank's rows have verticals for columns
