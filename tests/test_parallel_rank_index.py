"""Per-rank index rows (issue #17): `rows_from_lines` gives exactly the rows of `SparseIndex.from_lines`, with the
whole index's work, density and column union from the lines; across a CP group (gloo, CP 2/4/8, every layout)
each rank's `estimate_rank_index` holds the global index's rows of its shard, its ring plan equals the one made
from the global index, and the gathered imbalance equals the global measure."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mtrain.ops.index import SparseIndex, rows_from_lines
from mtrain.parallel import LAYOUT_NAMES, Layout, SparseSettings, imbalance


def _lines(S: int, nv: int, ns: int, seed: int, B: int = 2, H: int = 3):
    g = torch.Generator().manual_seed(seed)
    vertical = torch.randint(-1, S, (B, H, nv), generator=g)
    slash = torch.cat([torch.arange(3).expand(B, H, 3), torch.randint(-1, S, (B, H, ns), generator=g)], -1)
    return vertical, slash


def _same_rows(full_t: torch.Tensor, rows_t: torch.Tensor) -> bool:
    """Equal lists up to the trailing -1 padding (widths fit the rows each holds)."""
    width = max(full_t.shape[-1], rows_t.shape[-1])
    return torch.equal(F.pad(full_t, (0, width - full_t.shape[-1]), value=-1),
                       F.pad(rows_t, (0, width - rows_t.shape[-1]), value=-1))


@pytest.mark.parametrize("S,bs", [(256, 16), (250, 16), (100, 32), (1000, 64), (64, 64), (33, 16)])
@pytest.mark.parametrize("nv,ns", [(0, 2), (5, 3), (40, 20)])
def test_rows_from_lines_are_the_rows_of_from_lines(S, bs, nv, ns):
    for seed in range(2):
        vertical, slash = _lines(S, nv, ns, seed)
        full = SparseIndex.from_lines(vertical, slash, S, bs)
        n = full.n_blocks
        for rows in (torch.arange(n), torch.arange(0, n, 3), torch.tensor([n - 1]), torch.arange(1, n, 2)):
            if rows.numel() == 0:
                continue
            part = rows_from_lines(vertical, slash, S, bs, rows)
            for name in ("block_ids", "col_ids"):
                assert _same_rows(getattr(full, name)[:, :, rows], getattr(part, name)), (name, rows)
            assert torch.equal(full.block_counts[:, :, rows], part.block_counts)
            assert torch.equal(full.col_counts[:, :, rows], part.col_counts)
            assert torch.allclose(part.work_tensor(), full.work_tensor())
            assert torch.allclose(part.pair_counts(), full.pair_counts())
            assert abs(part.density() - full.density()) < 1e-12
            assert torch.equal(part.column_union, torch.unique(full.col_ids[full.col_ids >= 0].long()))


@pytest.mark.parametrize("S,bs", [(256, 16), (250, 16), (100, 32), (64, 64), (33, 16)])
@pytest.mark.parametrize("nv,ns", [(0, 2), (5, 3), (40, 20)])
@pytest.mark.parametrize("widths", [True, "static"])
def test_rows_from_lines_bounded_widths_hold_the_same_lists(S, bs, nv, ns, widths):
    """bound_widths (True: one host read, list widths from the lines' bounds; "static": no host read, widths from
    the lines' shapes) lists the same entries, counts, totals and column union as the trimmed lists, and its widths
    are the bounds (True: offsets + 1 and the most verticals of a head; "static": the slash and vertical slots)."""
    for seed in range(2):
        vertical, slash = _lines(S, nv, ns, seed)
        n = -(-S // bs)
        for rows in (torch.arange(n), torch.arange(0, n, 3), torch.tensor([n - 1])):
            want = rows_from_lines(vertical, slash, S, bs, rows)
            got = rows_from_lines(vertical, slash, S, bs, rows, bound_widths=widths)
            assert got._cache.get("bounded_widths") and not want._cache.get("bounded_widths")
            for name in ("block_ids", "col_ids"):
                assert _same_rows(getattr(want, name), getattr(got, name)), (name, rows)
                assert getattr(got, name).shape[-1] >= getattr(want, name).shape[-1]
            assert torch.equal(want.block_counts, got.block_counts) and torch.equal(want.col_counts, got.col_counts)
            assert torch.equal(want.totals, got.totals)
            if widths == "static":  # nothing read back: the union padded with seq_len to the verticals' slots
                assert got._cache.get("static_widths") and "host_read" not in got._cache
                union = got.column_union
                assert union.numel() == min(S, max(1, vertical.numel()))
                assert torch.equal(union[union < S], want.column_union) and bool((union[want.column_union.numel():]
                                                                                  == S).all())
                assert got.col_ids.shape[-1] == max(1, nv) and got.block_ids.shape[-1] <= 2 * slash.shape[-1] + 2
            else:
                assert torch.equal(want.column_union, got.column_union)
                distinct_v = max(int(((vertical >= 0) & (vertical < S)).sum(-1).max()), 1)
                assert got.col_ids.shape[-1] <= distinct_v


def test_bounded_rows_read_the_choice_statistics_with_their_widths():
    """The one host read of bound_widths also carries the whole index's work and the values asked for: what a
    layer's dense/sparse choice reads (`_choice_stats`), so a CP layer reads back once."""
    from mtrain.models.policy import _choice_stats
    from mtrain.attention_settings import PolicySettings
    from mtrain.models.runtime import AttentionRuntime, AttentionSettings

    vertical, slash = _lines(256, 12, 5, 3)
    rows = torch.arange(1, 16, 2)
    est = torch.rand(1, vertical.shape[1], dtype=torch.float32)
    index = rows_from_lines(vertical, slash, 256, 16, rows, bound_widths=True, read_also=(est.double().mean(),))
    index._cache["est_recall"] = est
    assert index._cache["host_read"] == index.work_tensor().tolist() + [est.double().mean().item()]
    plain = rows_from_lines(vertical, slash, 256, 16, rows)
    plain._cache["est_recall"] = est
    q = torch.zeros(1, 8, vertical.shape[1], 4)
    rt = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
    assert _choice_stats(rt, index, q, 0.99, None) == _choice_stats(rt, plain, q, 0.99, None)
    assert _choice_stats(rt, index, q, None, None) == _choice_stats(rt, plain, q, None, None)


def test_rows_from_lines_rejects_bad_rows():
    vertical, slash = _lines(128, 4, 2, 0)
    for rows in (torch.tensor([3, 1]), torch.tensor([0, 8]), torch.tensor([2, 2]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match="ascending list of distinct query blocks"):
            rows_from_lines(vertical, slash, 128, 16, rows)


def test_plan_rejects_a_row_index_of_another_rank():
    from mtrain.errors import MtrainError
    from mtrain.parallel.estimate import rank_rows
    from mtrain.parallel.plan import sparse_plan

    vertical, slash = _lines(256, 4, 2, 0)
    layout = Layout.create("block-stripe", world_size=4, granularity=16)
    part = rows_from_lines(vertical, slash, 256, 16, rank_rows(layout.indices(256, 1), 16))
    with pytest.raises(MtrainError, match="does not hold the query blocks of rank 2"):
        sparse_plan(part, layout, 2, torch.device("cpu"))
    with pytest.raises(MtrainError, match="column_origin 4 is not a rank"):
        sparse_plan(part, layout, 1, torch.device("cpu"), column_origin=4)


SEQ, BLOCK = 512, 16


def _planted(seed: int):
    """q/k [1, SEQ, 4/2, 16] with a few strong key columns and a local band, so the estimate keeps a sparse mix."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, SEQ, 4, 16, generator=g)
    k = torch.randn(1, SEQ, 2, 16, generator=g) * 0.3
    k[:, [70, 200, 333]] += 2.5 * q.mean(dim=(1, 2), keepdim=True)[:, :, :2].expand(1, 3, 2, 16)
    return q, k


def _gathers_each_slot_from_its_owner(cols) -> bool:
    """Every real slot of the off-ring columns is read from the gathered row its owner sends (src -> by_rank)."""
    real = cols.owner >= 0
    src = cols.src[real]
    sender, j = src // cols.per_rank, src % cols.per_rank
    return bool(torch.equal(sender, cols.owner[real])
                and torch.equal(cols.by_rank[sender, j], torch.nonzero(real).flatten()))


def _plan_equal(a, b) -> bool:
    """Same steps, lists (up to -1 padding: widths follow the rows an index holds), columns and gathers. A step
    skipped in one plan has no entries in the other (a bounded plan runs every step); the gather tables may be
    sized differently (a bounded plan's per_rank is every slot) but each must read every slot from its owner."""
    if a.column_origin != b.column_origin:
        return False
    for origin in a.steps:
        sa, sb = a.steps[origin], b.steps[origin]
        # key positions: equal, up to more padding (seq_len) after the columns of a union built without a host read
        pa, pb = sorted((sa.k_pos, sb.k_pos), key=len)
        if not (_same_rows(sa.ids, sb.ids) and torch.equal(sa.counts, sb.counts) and torch.equal(pa, pb[:len(pa)])
                and bool((pb[len(pa):] == a.seq_len).all())):
            return False
    for x, y in ((a, b), (b, a)):
        if any(o not in y.skip and int(y.steps[o].counts.sum()) and y.steps[o].columns is None for o in x.skip):
            return False
    ca, cb = a.columns, b.columns
    if not (_same_rows(ca.ids, cb.ids) and torch.equal(ca.counts, cb.counts)):
        return False
    # the column slots: the same real ones; a union built without a host read has more padding slots after them
    short, long_ = sorted((ca, cb), key=lambda c: c.positions.numel())
    n = short.positions.numel()
    for f, pad in (("positions", a.seq_len), ("owner", -1), ("local", -1)):
        mine, theirs = getattr(short, f), getattr(long_, f)
        real = short.owner >= 0
        if not (torch.equal(mine[real], theirs[:n][real]) and bool((theirs[:n][~real] == pad).all())
                and bool((theirs[n:] == pad).all())):
            return False
    if a.bounded == b.bounded and ca.positions.numel() == cb.positions.numel() and not all(
            torch.equal(getattr(ca, f), getattr(cb, f)) for f in ("send_local", "src", "by_rank")):
        return False
    return _gathers_each_slot_from_its_owner(ca) and _gathers_each_slot_from_its_owner(cb)


def _worker(rank, world, init_file, out_file):
    import torch.distributed as dist

    from mtrain.parallel.estimate import estimate_index, estimate_rank_index
    from mtrain.parallel.imbalance import gathered_imbalance
    from mtrain.parallel.plan import sparse_plan

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    q, k = _planted(11)
    docs = torch.zeros(1, SEQ, dtype=torch.long)
    docs[:, 150:], docs[:, 380:] = 1, 2
    results = {}
    cases = [(name, None, None) for name in LAYOUT_NAMES] + [("block-stripe", 2, None), ("block-stripe", None, docs)]
    for name, nodes, doc_ids in cases:
        if nodes is not None and (nodes >= world or world % nodes):
            continue
        layout = Layout.create(name, world_size=world, granularity=BLOCK, local_world_size=nodes)
        pos = layout.indices(SEQ, rank)
        settings = SparseSettings(recall=0.9, last_q=16, max_vertical=8, max_slash=64, block_size=BLOCK,
                                  min_vertical=2, min_slash=16, sample_blocks=4)
        args = (layout.shard(q, rank), layout.shard(k, rank), pos, pos, SEQ, settings, 1.0 / math.sqrt(16), None)
        full = estimate_index(*args, doc_ids=doc_ids)
        mine = estimate_rank_index(*args, doc_ids=doc_ids)
        blocks = torch.unique(pos // BLOCK)
        same = (torch.equal(mine.rows, blocks)
                and all(_same_rows(getattr(full, f)[:, :, blocks], getattr(mine, f)) for f in ("block_ids", "col_ids"))
                and torch.equal(full.block_counts[:, :, blocks], mine.block_counts)
                and torch.equal(full.col_counts[:, :, blocks], mine.col_counts))
        cpu = torch.device("cpu")
        plan_same = _plan_equal(sparse_plan(full, layout, rank, cpu, (rank + 1) % world),
                                sparse_plan(mine, layout, rank, cpu, (rank + 1) % world))
        # the same rows without column lists (the ring's form at large caps): its columns are the list plan's
        free = rows_from_lines(*mine._cache["lines"][:2], SEQ, BLOCK, blocks, check=False, bound_widths=True,
                               columns=False)
        free._cache["lines"] = mine._cache["lines"]
        listed = sparse_plan(mine, layout, rank, cpu, (rank + 1) % world)
        form = sparse_plan(free, layout, rank, cpu, (rank + 1) % world).steps[(rank + 1) % world].columns
        if hasattr(form, "to_lists"):  # (a layout whose ring blocks are smaller than the index's keeps lists)
            ids, counts = form.to_lists()
            want_ids, want_counts = listed.steps[(rank + 1) % world].columns
            plan_same = plan_same and torch.equal(counts, want_counts) and _same_rows(want_ids, ids)
        measured = gathered_imbalance(mine, layout, rank, None, local_world_size=nodes)
        want = imbalance(full, layout, local_world_size=nodes)
        results[f"{name}/{nodes}/{doc_ids is not None}"] = {
            "rows": same, "plan": plan_same,
            "work": torch.allclose(mine.work_tensor(), full.work_tensor()),
            "density": abs(mine.density() - full.density()),
            "recall": float((mine._cache["est_recall"] - full._cache["est_recall"]).abs().max()),
            "imbalance": max(abs(measured["worker"] - want["worker"]), abs(measured["step"] - want["step"])),
            "held": mine.block_ids.shape[2], "total": full.block_ids.shape[2], "full_density": full.density(),
        }
    results["first_round"] = _first_round_cases(rank, world, q, k)
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _first_round_cases(rank, world, q, k) -> dict:
    """Vertical candidates in two rounds (a few per rank first): for first-round sizes from 1 to 16 per head
    the index equals the one of the full exchange; records how often the first round sufficed."""
    import mtrain.ops.estimate as ops_estimate
    from mtrain.parallel import estimate

    layout = Layout.create("block-stripe", world_size=world, granularity=BLOCK)
    pos = layout.indices(SEQ, rank)
    settings = SparseSettings(recall=0.9, last_q=16, max_vertical=24, max_slash=64, block_size=BLOCK,
                              min_vertical=1, min_slash=16, sample_blocks=4)
    args = (layout.shard(q, rank), layout.shard(k, rank), pos, pos, SEQ, settings, 1.0 / math.sqrt(16), None)
    saved = estimate.FIRST_ROUND, estimate.FIRST_ROUND_MIN, ops_estimate.choose_verticals, estimate.ONE_ROUND_WORLD
    widths = []

    def recording(cand_mass, *a, **kw):
        widths.append(cand_mass.shape[-1])
        return saved[2](cand_mass, *a, **kw)

    try:
        estimate.FIRST_ROUND, estimate.FIRST_ROUND_MIN = 0, 10**9  # the full exchange: every rank sends its best cap
        want = estimate.estimate_rank_index(*args)
        estimate.ONE_ROUND_WORLD = 1  # the two rounds at every CP size here
        ops_estimate.choose_verticals = recording
        same, accepted = True, 0
        for first in (1, 2, 4, 8, 16):
            estimate.FIRST_ROUND_MIN = first
            widths.clear()
            got = estimate.estimate_rank_index(*args)
            same &= all(torch.equal(getattr(got, f), getattr(want, f))
                        for f in ("block_ids", "block_counts", "col_ids", "col_counts", "column_union"))
            accepted += widths[-1] == first * world
    finally:
        estimate.FIRST_ROUND, estimate.FIRST_ROUND_MIN, ops_estimate.choose_verticals, estimate.ONE_ROUND_WORLD = saved
    return {"same": same, "accepted": accepted}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_rank_index_rows_equal_the_global_rows(tmp_path, world):
    from ranks import run_ranks

    run_ranks(_worker, world, (world, str(tmp_path / "init"), str(tmp_path / "out")))
    accepted = 0
    for rank in range(world):
        results = json.loads((tmp_path / f"out.{rank}").read_text())
        first_round = results.pop("first_round")
        assert first_round["same"], f"CP={world} rank {rank}: a first round of candidates changed the index"
        accepted += first_round["accepted"]
        assert len(results) >= len(LAYOUT_NAMES) + 1, results.keys()
        for case, r in results.items():
            assert r["rows"], f"CP={world} rank {rank} {case}: rank rows differ from the global index's"
            assert r["plan"], f"CP={world} rank {rank} {case}: ring plan differs from the global index's"
            assert r["work"] and r["density"] < 1e-12, f"CP={world} rank {rank} {case}: whole-index totals differ"
            assert r["recall"] < 1e-6, f"CP={world} rank {rank} {case}: est_recall differs by {r['recall']:.2e}"
            assert r["imbalance"] < 1e-9, f"CP={world} rank {rank} {case}: gathered imbalance differs"
            assert r["full_density"] < 0.9, f"{case}: the estimate kept nearly everything; the test is too weak"
            if case.startswith("block-stripe"):  # a rank holds 1/CP of the query blocks
                assert r["held"] * world == r["total"], (case, r["held"], r["total"])
    # both branches ran: some first rounds were proven exact, some fell back to the full exchange
    assert 0 < accepted < 5 * world, accepted


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_cached_rank_blocks_are_the_query_blocks_of_the_shard(name):
    from mtrain.parallel.estimate import rank_rows
    from mtrain.parallel.plan import rank_blocks

    layout = Layout.create(name, world_size=4, granularity=16)
    for rank in range(4):
        want = rank_rows(layout.indices(512, rank), 32)
        assert torch.equal(rank_blocks(layout, 512, rank, 32, torch.device("cpu")), want)


@pytest.mark.parametrize("world", [8, 16])
def test_a_node_exchanges_the_vertical_candidates_in_one_round(world):
    """Up to `ONE_ROUND_WORLD` (8) ranks every rank sends its best cap at once: no first round, so no check of it
    read back to the host (what keeps a CUDA graph from holding the estimate); beyond, the first round sends fewer
    (one rank of the group run alone, `emulated_group`: the collectives' shapes are the group's)."""
    import torch.distributed as dist

    from mtrain.bench.emulate import emulated_group
    from mtrain.parallel.estimate import ONE_ROUND_WORLD, estimate_rank_index

    assert ONE_ROUND_WORLD == 8
    seq, bs = 256 * world, 16
    layout = Layout.create("block-stripe", world_size=world, granularity=bs)
    pos = layout.indices(seq, 0)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 256, 4, 16, generator=g), torch.randn(1, 256, 2, 16, generator=g)
    settings = SparseSettings(block_size=bs, max_vertical=200, max_slash=1024, cap_fraction=None)
    widths = []
    with emulated_group(world, 0):
        emulated = dist.all_gather

        def recording(parts, t, group=None, async_op=False):
            widths.append(t.shape[-1])
            return emulated(parts, t, group=group, async_op=async_op)

        dist.all_gather = recording  # (emulated_group puts the real one back)
        index = estimate_rank_index(q, k, pos, pos, seq, settings, 0.25, None, scorer="torch")
    full = min(200, 256)
    assert index.block_ids.shape[2] == 256 // bs
    if world <= ONE_ROUND_WORLD:
        assert widths == [full]  # one gather of every rank's best cap, no last-sent masses to check
    else:
        assert widths[:2] == [64, 1]  # the first round's candidates and each rank's last sent mass
