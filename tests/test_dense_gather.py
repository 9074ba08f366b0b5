"""The gathered dense call of a CP group (`mtrain.parallel.dense_gather`): every rank fetches only the keys its rows
read. The plan is checked by simulating every rank's exchange in one process (each key carries its own sequence
position, so the keys a rank's call reads can be compared with the positions its entries name); the call itself
against a float64 reference over the whole sequence under gloo at CP 2 and 4, with documents crossing the shards'
edges, documents each inside one shard run (no keys move: no all-to-all), and none."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mtrain.ops.varlen import Documents
from mtrain.parallel.dense_gather import _key_ranges, _Plan, query_runs
from mtrain.parallel.layout import Layout

SEQ = 256
HQ, HKV, DIM = 4, 2, 16
OUT_TOL, GRAD_TOL = 1e-5, 1e-4


def _docs(kind: str, world: int, batch: int = 2):
    """Document ids [batch, SEQ]: "cross" (starts off every shard edge, a one-token document, rows differ),
    "aligned" (every document inside one zigzag chunk of SEQ / (2 * world) tokens), or None."""
    if kind == "none":
        return None
    ids = torch.zeros(batch, SEQ, dtype=torch.long)
    if kind == "cross":
        starts = ([0, 37, 38, 100, 171, 230], [0, 23, 90, 91, 150, 255])
    else:
        chunk = SEQ // (2 * world)
        starts = ([c * chunk + off for c in range(2 * world) for off in (0, chunk // 2)],
                  [c * chunk for c in range(2 * world)])
    for row in range(batch):
        for n, start in enumerate(starts[row % 2]):
            ids[row, start:] = n
    return ids


def _expected_keys(runs, batch, documents):
    """The sequence positions (row, position) of the keys the rank's call reads, in entry order."""
    _, _, ranges = _key_ranges(runs, batch, documents)
    return [(b, p) for b, a, c in ranges for p in range(a, c)]


@pytest.mark.parametrize("layout_name", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("kind", ["cross", "aligned", "none"])
def test_plan_reads_exactly_the_keys_of_every_entry(layout_name, world, kind):
    batch = 2
    layout = Layout.create(layout_name, world_size=world)
    ids = _docs(kind, world, batch)
    documents = None if ids is None else Documents.from_doc_ids(ids)
    shard = SEQ // world
    # each rank's own keys, flattened [B * S_local]: their (row, position) as two integer columns
    own = []
    for r in range(world):
        pos = layout.indices(SEQ, r)
        own.append(torch.stack((torch.arange(batch).repeat_interleave(shard), pos.repeat(batch)), dim=1))
    plans = [_Plan(layout, query_runs(layout, SEQ, r), r, batch, SEQ, documents, "cpu") for r in range(world)]
    # the exchange every rank's plan implies: rank r receives from s what s sends to r, in s's order
    for r, plan in enumerate(plans):
        sent_by = []
        for s, other in enumerate(plans):
            rows = other.send_rows.split(other.send_counts)[r]
            assert rows.numel() == plan.recv_counts[s], f"rank {s} sends {rows.numel()} to {r}, which expects " \
                f"{plan.recv_counts[s]}"
            sent_by.append(own[s][rows])
        received = torch.cat(sent_by)
        if plan.pieces is None:
            got = own[r]
        else:  # the slice copies, and the one indexed gather past MAX_PIECES
            got = torch.cat([(received if src else own[r])[lo:hi] for src, lo, hi, _ in plan.pieces])
            assert [at for *_, at in plan.pieces] == [0, *torch.tensor([hi - lo for _, lo, hi, _ in plan.pieces])
                                                     .cumsum(0).tolist()[:-1]]
            # the backward's sums over own rows read twice use an index built with the plan (no copy per layer)
            assert plan.own_once or plan.index is not None
            if plan.index is not None:
                assert torch.equal(torch.cat([own[r], received])[plan.index], got)
        want = _expected_keys(query_runs(layout, SEQ, r), batch, documents)
        assert [tuple(x) for x in got.tolist()] == want, f"rank {r}: the call's keys are not its entries' keys"
        assert plan.segments.total_k == len(want)
        # nothing is received twice, and nothing a rank already holds
        assert sum(plan.recv_counts) == len(set(want) - {tuple(x) for x in own[r].tolist()})
    if kind == "aligned":  # (zigzag's chunks are halves of contiguous shards)
        assert not any(p.exchange for p in plans), "documents inside the shard runs must move no keys"
        assert all(p.pieces is None for p in plans), "each rank's call must read its own keys in place"
    if kind in ("cross", "none"):
        assert all(p.exchange for p in plans)


def test_emulated_all_to_all_keeps_the_own_part_of_uneven_splits():
    import torch.distributed as dist

    from mtrain.bench.emulate import emulated_group
    from mtrain.errors import MtrainError

    with emulated_group(3, 1):
        out = torch.full((6,), -1.0)
        dist.all_to_all_single(out, torch.arange(5.0), output_split_sizes=[1, 2, 3], input_split_sizes=[2, 2, 1])
        assert out.tolist() == [0.0, 2.0, 3.0, 0.0, 0.0, 0.0]
        with pytest.raises(MtrainError, match="own part"):
            dist.all_to_all_single(out, torch.arange(5.0), output_split_sizes=[1, 3, 2], input_split_sizes=[2, 2, 1])


def _reference(q, k, v, ids, dout, scale):
    """float64 causal attention within documents over the whole sequence, and its gradients."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    B, S, Hq, D = q.shape
    kk, vv = (t.repeat_interleave(Hq // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    if ids is not None:
        mask = mask & (ids[:, :, None] == ids[:, None, :])[:, None]
    out = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank, world, init_file, out_file):
    import torch.distributed as dist

    from mtrain.parallel.dense_gather import gathered_dense_attention

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    calls = []
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_to_all_single = counted
    results = {}
    torch.manual_seed(3)
    q, dout = torch.randn(2, SEQ, HQ, DIM), torch.randn(2, SEQ, HQ, DIM)
    k, v = torch.randn(2, SEQ, HKV, DIM), torch.randn(2, SEQ, HKV, DIM)
    scale = 1 / math.sqrt(DIM)
    import mtrain.parallel.dense_gather as dense_gather

    for layout_name in ("zigzag", "contiguous"):
        layout = Layout.create(layout_name, world_size=world)
        for kind in ("cross", "aligned", "none", "cross-index", "none-index"):
            # "-index": the call's keys as one indexed gather (past MAX_PIECES) instead of slice copies
            dense_gather.MAX_PIECES = 0 if kind.endswith("-index") else 32
            dense_gather._PLANS.clear()
            ids = _docs(kind.removesuffix("-index"), world)
            want = _reference(q, k, v, ids, dout, scale)
            shards = [layout.shard(t, rank).clone().requires_grad_(True) for t in (q, k, v)]
            before = len(calls)
            out = gathered_dense_attention(*shards, query_runs(layout, SEQ, rank), layout, None, scale,
                                           None if ids is None else Documents.from_doc_ids(ids))
            out.backward(layout.shard(dout, rank))
            got = (out.detach(), *(t.grad for t in shards))
            results[f"{layout_name}/{kind}"] = {
                "errors": [float((g.double() - layout.shard(w, rank)).abs().max()) for g, w in zip(got, want)],
                "exchanges": len(calls) - before}
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    from ranks import run_ranks

    results = {}
    for world in (2, 4):
        out = tmp_path_factory.mktemp(f"dense_gather{world}")
        run_ranks(_worker, world, (world, str(out / "init"), str(out / "rank")))
        for rank in range(world):
            with open(out / f"rank.{rank}") as f:
                for case, record in json.load(f).items():
                    results.setdefault(f"{world}/{case}", []).append(record)
    return results


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout_name", ["zigzag", "contiguous"])
@pytest.mark.parametrize("kind", ["cross", "aligned", "none", "cross-index", "none-index"])
def test_gathered_dense_call_equals_float64_over_the_whole_sequence(gloo_results, world, layout_name, kind):
    records = gloo_results[f"{world}/{layout_name}/{kind}"]
    assert len(records) == world
    for rank, record in enumerate(records):
        for name, err, tol in zip(("out", "dq", "dk", "dv"), record["errors"], (OUT_TOL, GRAD_TOL, GRAD_TOL, GRAD_TOL)):
            assert err < tol, f"CP={world} {layout_name} {kind} rank {rank}: {name} differs by {err:.2e}"
        # documents inside the zigzag chunks (so inside the contiguous shards too) move no keys; otherwise one
        # all-to-all forward and one backward
        moved = 0 if kind == "aligned" else 2
        assert record["exchanges"] == moved, f"rank {rank}: {record['exchanges']} all-to-alls, expected {moved}"
