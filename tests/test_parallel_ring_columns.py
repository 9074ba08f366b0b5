"""The ring's off-ring columns read list-free (`mtrain.ops.columns.RingColumns`, issue #27): a rank index built
without column lists (`rows_from_lines(columns=False)`, what `estimate_rank_index` builds where the cap-wide lists
would pass the static width limit, `parallel.static_width_mib`) gives plans whose columns are, entry for entry, the
lists the list-built plans hold, for every layout, rank, schedule and short last block; and the ring on it (CP 2
and 4, gloo, our Triton kernels in
the interpreter and the torch path) computes the attention of a float64 reference and the gradients of the list
path."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from mtrain.ops.columns import RingColumns, ring_columns
from mtrain.ops.index import SparseIndex, rows_from_lines
from mtrain.parallel import LAYOUT_NAMES, Layout, SparseSettings


def _lines(S: int, nv: int, ns: int, seed: int, B: int = 1, H: int = 2):
    g = torch.Generator().manual_seed(seed)
    vertical = torch.randint(-1, S, (B, H, nv), generator=g)
    slash = torch.cat([torch.arange(3).expand(B, H, 3), torch.randint(-1, S, (B, H, ns), generator=g)], -1)
    return vertical, slash


def _rank_index(vertical, slash, S, bs, rows, columns: bool):
    index = rows_from_lines(vertical, slash, S, bs, rows, bound_widths=True, columns=columns)
    index._cache["lines"] = (vertical, slash, rows)
    return index


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t, (0, width - t.shape[-1]), value=-1)


def _same_columns(form, lists) -> bool:
    got_ids, got_counts = form.to_lists()
    ids, counts = lists
    width = max(got_ids.shape[-1], ids.shape[-1])
    return torch.equal(got_counts, counts) and torch.equal(_padded(got_ids, width), _padded(ids.to(torch.int32), width))


@pytest.mark.parametrize("name", LAYOUT_NAMES)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("S,bs", [(512, 16), (1024, 32)])
def test_list_free_ring_columns_are_the_list_plans_columns(name, world, S, bs):
    """Both schedules' plans, from one rank index with column lists and one without: the same slots, and the
    list-free form's columns (`to_lists`) are the list plan's, entry for entry, on the step that attends them."""
    from mtrain.parallel.estimate import rank_rows
    from mtrain.parallel.plan import gathered_sparse_plan, sparse_plan

    cpu = torch.device("cpu")
    layout = Layout.create(name, world_size=world, granularity=bs)
    checked = 0
    for seed in range(3):
        vertical, slash = _lines(S, 6 + 5 * seed, 4, seed)
        for rank in range(world):
            rows = rank_rows(layout.indices(S, rank), bs)
            lists = _rank_index(vertical, slash, S, bs, rows, True)
            free = _rank_index(vertical, slash, S, bs, rows, False)
            assert free.col_ids is None and torch.equal(free.col_counts, lists.col_counts)
            origin = (rank + 1) % world
            a, b = sparse_plan(lists, layout, rank, cpu, origin), sparse_plan(free, layout, rank, cpu, origin)
            assert torch.equal(a.columns.positions, b.columns.positions)
            assert torch.equal(a.columns.src, b.columns.src) and torch.equal(a.columns.send_local, b.columns.send_local)
            for o in range(world):
                assert torch.equal(a.steps[o].ids, b.steps[o].ids) and torch.equal(a.steps[o].k_pos, b.steps[o].k_pos)
            if layout.local_block_size(S, bs) != bs:  # ring blocks smaller than the index's: lists from the lines
                width = max(a.columns.ids.shape[-1], b.columns.ids.shape[-1])
                assert b.columns.form is None and torch.equal(a.columns.counts, b.columns.counts)
                assert torch.equal(_padded(a.columns.ids, width), _padded(b.columns.ids, width))
                continue
            assert b.columns.form is not None and b.columns.ids is None
            step = b.steps[origin].columns
            assert isinstance(step, RingColumns) and step.base == layout.indices(S, rank).numel()
            assert _same_columns(step, a.steps[origin].columns)
            ga, gb = gathered_sparse_plan(lists, layout, rank, cpu), gathered_sparse_plan(free, layout, rank, cpu)
            if ga is None:
                assert gb is None
                continue
            assert _same_columns(gb.steps[rank].columns, ga.steps[rank].columns)
            assert all(torch.equal(x, y) for x, y in zip(ga.gather_slots[:2], gb.gather_slots[:2]))
            checked += 1
    assert checked > 0 or layout.local_block_size(S, bs) != bs


@pytest.mark.parametrize("S,bs", [(250, 16), (1000, 32), (64, 16)])
def test_ring_columns_of_one_rank_holding_every_row(S, bs):
    """One rank holding every query block (short last blocks included): the form's columns are the sink's tokens
    followed by the global index's column lists (in slots of the union), row for row; and the column backward's plan
    never starts a chunk after a query block that reads one of its entries."""
    n = -(-S // bs)
    rows = torch.arange(n)
    for seed in range(4):
        vertical, slash = _lines(S, 3 + 7 * seed, 3 + seed, seed, B=2, H=3)
        full = SparseIndex.from_lines(vertical, slash, S, bs)
        part = rows_from_lines(vertical, slash, S, bs, rows)
        n_sink = min(bs, S)
        form = ring_columns(vertical, slash, S, bs, part.column_union, rows, n_sink)
        union = torch.cat([torch.arange(n_sink), part.column_union])
        slot_ids, counts = form.to_lists()
        got = torch.where(slot_ids >= 0, union[slot_ids.long().clamp(min=0)], -1)
        sink = torch.arange(n_sink).expand(*full.col_ids.shape[:3], n_sink)
        want = torch.cat([sink, full.col_ids.long()], -1)
        want_counts = full.col_counts + n_sink
        width = max(got.shape[-1], want.shape[-1])
        assert torch.equal(counts, want_counts)
        assert torch.equal(_padded(got, width), _padded(want, width))
        active = form.active()
        plan = form.column_plan(4)
        for c in range(plan.q_ids.shape[2]):
            used = active[:, :, :, c * 4:(c + 1) * 4].any(-1)  # [B, H, R]: rows reading an entry of chunk c
            first = plan.q_ids[:, :, c, 0].long()
            before = torch.arange(n)[None, None, :] < first[..., None]
            assert not bool((used & before).any()), (seed, c)
            assert torch.equal(plan.counts[:, :, c].long(), n - first)


def test_ring_columns_name_only_gathered_slots_of_their_own_positions():
    """Every entry of the form is a slot whose gathered position is the entry's own (the sink's tokens, then the head's
    verticals), distinct per head and inside the slots: a vertical that is a column of no query block (in the blocks
    the head's window covers for every later query block) is not in the union and is dropped, not mapped onto a
    neighbouring slot (which would misroute the column gradients, or read past the slots)."""
    S, bs = 512, 16
    n = S // bs
    vertical = torch.tensor([[[40, 200, 300, 505, 510], [17, 60, 499, 500, 511]]])  # 499-511: inside every window
    slash = torch.tensor([[[0, 16, 32, 100], [0, 16, 32, 48]]])  # offsets 0..2(3): the last blocks never columns
    rows = torch.arange(n)
    part = rows_from_lines(vertical, slash, S, bs, rows)
    form = ring_columns(vertical, slash, S, bs, part.column_union, rows, bs)
    slots = torch.cat([torch.arange(bs), part.column_union])
    for h in range(2):
        ids = form.ids[0, h]
        real = ids[ids >= 0].long()
        assert bool((real < slots.numel()).all()) and real.unique().numel() == real.numel()
        got = slots[real]
        want = torch.cat([torch.arange(bs), torch.tensor([v for v in vertical[0, h].tolist()
                                                          if v in set(part.column_union.tolist())])])
        assert torch.equal(got, want), (h, got, want)
    assert 505 not in part.column_union.tolist() and 511 not in part.column_union.tolist()


def test_ring_columns_refuse_bad_shapes():
    vertical, slash = _lines(256, 4, 2, 0)
    form = ring_columns(vertical, slash, 256, 16, torch.tensor([40, 90]), torch.arange(0, 16, 2), 16)
    with pytest.raises(ValueError, match="RingColumns wants"):
        RingColumns(form.ids, form.blocks[..., :-1], form.counts, form.covered, form.row_blocks, 256, 16)
    with pytest.raises(ValueError, match="chunk"):
        form.column_plan(65)


# 16 query blocks: 8 a rank at CP 2, 4 at CP 4 (each layout's smallest whole split at CP 4 is 2 zigzag chunks of 2)
SEQ, BLOCK, HQ, HKV, DIM = 256, 16, 2, 1, 16


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    from mtrain.ops import reference
    from mtrain.parallel import ring_attention
    from mtrain.parallel.estimate import rank_index_from_lines, rank_rows

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, SEQ, HQ, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, SEQ, HKV, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    # 8 verticals (neighbours among them) and 5 slashes a head, inside the 256 tokens
    vertical = torch.tensor([[[3, 20, 21, 65, 100, 166, 167, 235], [17, 50, 130, 131, 132, 200, 201, 252]]])
    slash = torch.tensor([[[0, 1, 35, 96, 125], [0, 16, 50, 64, 150]]])
    mask = SparseIndex.from_lines(vertical, slash, SEQ, BLOCK).to_mask()
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref, _ = reference.attention(*full, mask, 1.0 / math.sqrt(DIM))
    ref.backward(dout)
    want = [ref.detach()] + [t.grad for t in full]
    settings = SparseSettings(block_size=BLOCK)
    record = {}
    for name in ("block-stripe", "zigzag"):
        layout = Layout.create(name, world_size=world, granularity=BLOCK)
        pos = layout.indices(SEQ, rank)
        # the gathered schedule also with static widths: a limit the rank's block lists fit under (2 heads x R rows
        # x 12 block slots x 4 bytes) but not its column lists (8 more slots): list-free, no host read, the union
        # as wide as the verticals' slots
        rows_per_rank = SEQ // BLOCK // world
        for schedule, limit in (("ring", -1), ("gather", -1), ("gather", 100 * rows_per_rank)):
            runs = {}
            for list_free in (False, True):
                from mtrain.ops.switches import Switches

                # over the limit: the list-free columns' regime
                index = rank_index_from_lines((vertical, slash, torch.ones(1, HQ), None), pos, pos, SEQ, settings,
                                              None, rows=rank_rows(pos, BLOCK), schedule=schedule,
                                              switches=Switches(static_width_bytes=limit, list_free_columns=list_free))
                shards = [layout.shard(t.float(), rank).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
                out = ring_attention(*shards[:3], group=None, layout=layout, index=index, schedule=schedule,
                                     engine="triton")
                out.backward(shards[3])
                runs[list_free] = ([out.detach()] + [t.grad for t in shards[:3]], index.col_ids is None)
                static = bool(index._cache.get("static_widths"))
            got, free = runs[True]
            lists, listed = runs[False]
            record[f"{name}/{schedule}/{'static' if limit > 0 else 'read'}"] = {
                "list_free_index": free and not listed, "static": static,
                "errors": [float((a.double() - layout.shard(b, rank)).abs().max()) for a, b in zip(got, want)],
                "vs_lists": [float((a - b).abs().max()) for a, b in zip(got, lists)],
            }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
# the kernels in the interpreter: ~30 s a world size on 2 cores (slow); the torch path runs the same plans quick
@pytest.mark.parametrize("interpret", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["torch", "triton-interpreter"])
def test_ring_on_list_free_columns_matches_the_reference_and_the_lists(tmp_path, world, interpret):
    from ranks import run_ranks

    run_ranks(_worker, world, (world, str(tmp_path / "init"), str(tmp_path)), interpret=interpret)
    for rank in range(world):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(record) == 6
        for case, r in record.items():
            assert r["list_free_index"], (rank, case)
            assert r["static"] == case.endswith("static"), (rank, case)
            out_err, *grad_errs = r["errors"]
            assert out_err < 1e-5 and max(grad_errs) < 1e-4, (rank, case, r["errors"])
            assert max(r["vs_lists"]) < 1e-5, (rank, case, r["vs_lists"])


@pytest.mark.parametrize("world", [2])
def test_checkpointed_cp_model_on_list_free_columns_matches_one_rank(tmp_path, world):
    """A training step of the tiny model under gradient checkpointing, CP=2, every rank index without column lists
    (first forwards and the recomputation's rebuilds from the remembered lines alike): CP=1's loss and gradients."""
    from ranks import run_script

    out = tmp_path / "rows.jsonl"
    proc = run_script(world, "tests/workers/cp_ckpt_columns.py", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["documents"] for r in rows] == [False, True]
    for r in rows:
        assert r["loss_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r
        assert r["density"] < 0.9, r  # the layers ran sparse
        # every sparse layer's index, in the forward and again in the recomputation, held no column lists
        assert r["calls"] >= 2 * 2 and r["list_free"] == r["calls"], r


def test_widening_limit_counts_what_a_rank_index_holds():
    """`mtrain.models.policy.list_bytes` (attention.widen_max_list_mib): a CP rank's lists at caps whose column lists
    would pass the static width limit (`parallel.static_width_mib`) are list-free, so the limit counts its block lists
    and each head's verticals (with their blocks); below that, and with parallel.list_free_columns off, the block and
    column lists."""
    from mtrain.models.policy import list_bytes
    from mtrain.ops.switches import Switches

    vertical, slash = _lines(512, 6, 4, 0)
    index = rows_from_lines(vertical, slash, 512, 16, torch.arange(0, 32, 4))
    b, h, r = index.block_ids.shape[:3]
    assert list_bytes(index, 8, 4) == b * h * r * (2 * 4 + 2 + 8) * 4
    wide = 1 << 21  # column lists of 8 rows x 2 heads past 64 MiB
    assert list_bytes(index, wide, 4) == b * h * r * (2 * 4 + 2) * 4 + b * h * wide * 8
    assert list_bytes(index, wide, 4, switches=Switches(list_free_columns=False)) == b * h * r * (2 * 4 + 2 + wide) * 4
