"""One rank of a context-parallel group run alone (`mtrain.bench.emulate.emulated_group`, `mtrain bench ring
--emulate-cp N`): the stand-in collectives do what its docstring says (this rank's part in its slot, zeros for the
others, receives zero-filled), and the ring under it computes, for that rank's rows, the attention of a float64
reference in which every other rank's keys and values are zero: under both schedules, two layouts, CP 2 and 4."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from mtrain.bench.emulate import emulated_group
from mtrain.errors import MtrainError
from mtrain.parallel import Layout, ring_attention

from emulated import BLOCK, DIM, SEQ, sample_case, zero_peer_reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_emulated_collectives_keep_this_ranks_part_and_zero_the_others():
    real = dist.get_world_size
    with emulated_group(4, rank=2) as group:
        assert dist.get_world_size() == 4 and dist.get_rank(group) == 2 and dist.group.WORLD is group
        assert dist.get_global_rank(group, 3) == 3
        t = torch.tensor([1.0, 2.0])
        out = torch.full((8,), 7.0)
        dist.all_gather_into_tensor(out, t)
        assert out.tolist() == [0, 0, 0, 0, 1, 2, 0, 0]
        parts = [torch.full((2,), 7.0) for _ in range(4)]
        dist.all_gather(parts, t, async_op=True).wait()
        assert [p.tolist() for p in parts] == [[0, 0], [0, 0], [1, 2], [0, 0]]
        s = torch.tensor([3.0, -1.0])
        dist.all_reduce(s, op=dist.ReduceOp.MAX)
        assert s.tolist() == [3.0, -1.0]  # the others add the op's identity
        got = torch.empty(2)
        dist.reduce_scatter(got, [torch.full((2,), float(r)) for r in range(4)])
        assert got.tolist() == [2.0, 2.0]
        recv, send = torch.full((3,), 5.0), torch.ones(3)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer=3), dist.P2POp(dist.irecv, recv, peer=1)])
        assert all(w.wait() for w in works) and recv.tolist() == [0, 0, 0] and send.tolist() == [1, 1, 1]
        node = dist.new_group([2, 3])  # a subgroup holding this rank, and one without it
        assert (dist.get_world_size(node), dist.get_rank(node), dist.get_global_rank(node, 1)) == (2, 0, 3)
        assert dist.get_rank(dist.new_group([0, 1])) == -1
        objects = [None] * 4
        dist.all_gather_object(objects, ("cp", 4))
        assert objects == [("cp", 4)] * 4  # every rank of the one CP group holds what this one does
    assert dist.get_world_size is real  # restored on leaving
    with pytest.raises(MtrainError, match="0 <= rank < world"):
        with emulated_group(2, rank=2):
            pass


@pytest.mark.parametrize("world", [2, 4])
def test_ring_of_one_emulated_rank_is_its_attention_against_zero_peers(world):
    q, k, v, dout, index = sample_case(4)
    mask = index.to_mask()
    checked = 0
    for name in ("block-stripe", "zigzag"):
        layout = Layout.create(name, world_size=world, granularity=BLOCK)
        for rank in range(world):
            mine = layout.indices(SEQ, rank)
            ref, ref_dq, _, _ = zero_peer_reference(q, k, v, dout, mask, 1.0 / math.sqrt(DIM), mine)
            for schedule in ("ring", "gather"):
                shards = [layout.shard(t.float(), rank).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
                with emulated_group(world, rank):
                    out = ring_attention(*shards[:3], group=None, layout=layout, index=index, schedule=schedule)
                    out.backward(shards[3])
                err_out = float((out.detach().double() - ref).abs().max())
                err_dq = float((shards[0].grad.double() - ref_dq).abs().max())
                assert err_out < 1e-5 and err_dq < 1e-4, (name, rank, schedule, err_out, err_dq)
                checked += 1
    assert checked == 2 * world * 2


def test_hierarchical_ring_of_one_emulated_rank_against_zero_peers():
    """The hierarchical ring (2 nodes of 2 ranks, node-aware block-stripe) with its inner and outer groups made under
    the emulation: each rank's out and dQ are its attention with the other ranks' keys zero."""
    from mtrain.parallel.comm import hierarchical_groups

    q, k, v, dout, index = sample_case(5)
    layout = Layout.create("block-stripe", world_size=4, granularity=BLOCK, local_world_size=2)
    for rank in range(4):
        mine = layout.indices(SEQ, rank)
        ref, ref_dq, _, _ = zero_peer_reference(q, k, v, dout, index.to_mask(), 1.0 / math.sqrt(DIM), mine)
        shards = [layout.shard(t.float(), rank).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
        with emulated_group(4, rank):
            inner, outer = hierarchical_groups(None, 2)
            assert (dist.get_world_size(inner), dist.get_rank(inner)) == (2, rank % 2)
            out = ring_attention(*shards[:3], group=None, layout=layout, index=index, inner_group=inner,
                                 outer_group=outer)
            out.backward(shards[3])
        assert float((out.detach().double() - ref).abs().max()) < 1e-5, rank
        assert float((shards[0].grad.double() - ref_dq).abs().max()) < 1e-4, rank


def _bench_ring(*args: str) -> subprocess.Popen:
    """`python -m mtrain.bench.ring --cpu ARGS` in Triton's interpreter, started (its output piped)."""
    return subprocess.Popen([sys.executable, "-m", "mtrain.bench.ring", "--cpu", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"})


@pytest.mark.slow  # two scripts in the interpreter, ~40 s on 2 cores; the emulated ring runs quick above
def test_bench_ring_emulated_reports_a_bound(tmp_path):
    """`--emulate-cp 2` on the CPU (Triton interpreter, tiny sizes): one process, no torchrun; the given index's
    cases (both schedules) match one device with the other rank's keys zero, every asked variant runs and the headline
    reads as a bound. The flat run and the hierarchical one (below) run at once, one process a core."""
    out, out_h = tmp_path / "emu.json", tmp_path / "emu-h.json"
    flat = _bench_ring("--emulate-cp", "2", "--tokens-per-gpu", "128", "--heads", "2", "--kv-heads", "1", "--dim", "16",
                       "--block-size", "32", "--window", "32", "--far-slashes", "2", "--verticals", "4", "--iters", "1",
                       "--warmup", "0", "--schedules", "gather", "--skip-phases", "--check-len", "128", "--json",
                       str(out))
    # the hierarchical ring over emulated nodes: checked against zero peers, then timed beside the flat ring
    hier_run = _bench_ring("--emulate-cp", "4", "--node-size", "2", "--tokens-per-gpu", "64", "--heads", "2",
                           "--kv-heads", "1", "--dim", "16", "--block-size", "16", "--window", "16", "--far-slashes",
                           "2", "--verticals", "4", "--iters", "1", "--warmup", "0", "--schedules", "ring",
                           "--skip-phases", "--check-len", "256", "--json", str(out_h))
    try:
        (stdout, stderr), (stdout_h, stderr_h) = flat.communicate(timeout=600), hier_run.communicate(timeout=600)
    finally:
        for proc in (flat, hier_run):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert flat.returncode == 0, stdout[-2000:] + stderr[-4000:]
    rows = json.loads(out.read_text())
    checks = [r for r in rows if "check" in r]
    # the given index under the ring's and the gathered schedule, then the estimated index under the engine (here our
    # kernels: auto off the GPU) against our kernels
    assert [c["check"] for c in checks] == ["sparse", "sparse-g", "estimated-g vs triton"]
    for c in checks:
        assert "error" not in c and c["max_err_out"] < 1e-4 and c["max_err_dq"] < 1e-4, c
        assert (c["max_err_dk"] is None) == (c["check"] != "estimated-g vs triton"), c
    (row,) = [r for r in rows if "tokens_per_gpu" in r]
    assert row["emulated"] and row["cp"] == 2
    for key in ("cp1_sparse_ms", "ring_sparse_gather_ms", "cp1_sparse_estimated_ms", "ring_sparse_estimated_gather_ms"):
        assert row[key] > 0, (key, row.get(key + "_error"))
    assert "EMULATED rank 0 of CP=2" in stdout
    assert "BOUND (rank alone, transfers as local fills: --emulate-cp) sparse CP=2" in stdout
    assert hier_run.returncode == 0, stdout_h[-2000:] + stderr_h[-4000:]
    rows = json.loads(out_h.read_text())
    (hier,) = [r for r in rows if r.get("check") == "sparse-h"]
    assert "error" not in hier and hier["max_err_out"] < 1e-4 and hier["max_err_dq"] < 1e-4, hier
    (row,) = [r for r in rows if "tokens_per_gpu" in r]
    assert row["ring_sparse_hierarchical_ms"] > 0 and row["ring_sparse_ms"] > 0, row


def test_bench_ring_emulation_refuses_a_bad_group(capsys):
    """`--emulate-cp 1` and an `--emulate-rank` outside the group stop the script before it starts (in this process:
    the script checks them before it imports or sets up anything more)."""
    from mtrain.bench.ring import main

    with pytest.raises(SystemExit, match="at least 2 ranks"):
        main(["--cpu", "--emulate-cp", "1"])
    with pytest.raises(SystemExit, match="--emulate-rank must be in 0..1"):
        main(["--cpu", "--emulate-cp", "2", "--emulate-rank", "2"])
