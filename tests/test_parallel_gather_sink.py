"""The gathered schedule's three forms of the sink block (`mtrain.parallel.plan.SINK_FORMS`): "listed" (a listed block,
as on one device), "replicas" (copies in slots after the columns, each read by a few query blocks: FA4's backward runs
a key block's query blocks in turn) and "columns" (its tokens as columns, as on the ring). The replicas' plan lists
what the listed plan lists, with the sink swapped for copies of it at the copies' own key positions, no copy read by
more than its share; and the gathered step on each form (one rank of CP 2 and 4 run alone, `emulated_group`, our
kernels' torch path) computes a float64 reference's attention of the rank's rows with the other ranks' keys zero,
its dQ, and on rank 0 (which owns the sink block) its dK/dV from its own rows."""

from __future__ import annotations

import math

import pytest
import torch

from mtrain.bench.emulate import emulated_group
from mtrain.parallel import Layout, plan as plan_module
from mtrain.parallel.plan import SINK_FORMS, gathered_sparse_plan
from mtrain.parallel.ring_gather import ring_gather_attention

from emulated import BLOCK, DIM, HQ, SEQ, sample_case, sample_index, zero_peer_reference

@pytest.mark.parametrize("world", [2, 4])
def test_replicas_plan_lists_copies_of_the_sink_within_their_share(world, monkeypatch):
    monkeypatch.setattr(plan_module, "SINK_SHARE", 3)
    cpu = torch.device("cpu")
    for name in ("block-stripe", "zigzag"):
        layout = Layout.create(name, world_size=world, granularity=BLOCK)
        for rank in range(world):
            index = sample_index()
            listed = gathered_sparse_plan(index, layout, rank, cpu, sink="listed")
            copied = gathered_sparse_plan(index, layout, rank, cpu, sink="replicas")
            a, b = listed.steps[rank], copied.steps[rank]
            src, n_copies = copied.gather_slots[3]
            assert listed.gather_slots[3] is None
            first = a.k_pos.numel() // BLOCK  # the copies' blocks follow the shards and the column slots
            assert b.k_pos.numel() == a.k_pos.numel() + n_copies * BLOCK
            assert torch.equal(b.k_pos[a.k_pos.numel():], torch.arange(BLOCK).repeat(n_copies))
            assert torch.equal(a.k_pos[src], torch.arange(BLOCK))  # src: the gathered rows of the sink's tokens
            sink_block = int(src[0]) // BLOCK
            nq = a.ids.shape[2]
            my_blocks = layout.indices(SEQ, rank).view(-1, BLOCK)[:, 0] // BLOCK
            assert n_copies == -(-nq // 3)
            for h in range(HQ):
                reads = torch.zeros(n_copies, dtype=torch.long)
                for i in range(nq):
                    got = b.ids[0, h, i, : b.counts[0, h, i]].tolist()
                    want = a.ids[0, h, i, : a.counts[0, h, i]].tolist()
                    assert got == sorted(got) and int(a.counts[0, h, i]) == int(b.counts[0, h, i])
                    copies = [g for g in got if g >= first]
                    if sink_block in want and int(my_blocks[i]) != 0:  # the sink, not on its own diagonal
                        assert copies == [first + i % n_copies]
                        assert sorted(g for g in want if g != sink_block) == [g for g in got if g < first]
                        reads[i % n_copies] += 1
                    else:
                        assert got == want
                assert int(reads.max()) <= 3 and int(reads.sum()) > 0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sink", SINK_FORMS)
def test_gathered_step_on_each_sink_form_matches_the_reference(world, sink, monkeypatch):
    monkeypatch.setattr(plan_module, "SINK_SHARE", 3)
    q, k, v, dout, index = sample_case(6)
    mask = index.to_mask()
    scale = 1.0 / math.sqrt(DIM)
    cpu = torch.device("cpu")
    for name in ("block-stripe", "zigzag"):
        layout = Layout.create(name, world_size=world, granularity=BLOCK)
        for rank in range(world):
            mine = layout.indices(SEQ, rank)
            ref, *grads = zero_peer_reference(q, k, v, dout, mask, scale, mine)
            shards = [layout.shard(t.float(), rank).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
            with emulated_group(world, rank):
                plan = gathered_sparse_plan(index, layout, rank, cpu, sink=sink)
                out, _ = ring_gather_attention(*shards[:3], plan, None, scale)
                out.backward(shards[3])
            errs = [float((out.detach().double() - ref).abs().max()),
                    float((shards[0].grad.double() - grads[0]).abs().max())]
            if rank == 0:  # its dK/dV: its own rows' share (the others' shares are zero-filled receives)
                errs += [float((shards[i].grad.double() - grads[i]).abs().max()) for i in (1, 2)]
            assert max(errs) < 1e-4, (name, rank, errs)


def test_fa4_backward_takes_the_sink_as_copies_or_columns_only(monkeypatch):
    """Under FA4's backward the gathered plan's sink is "replicas" (the default) or "columns": a listed sink block would
    have more query blocks than FA4's bounded backward lists hold, so it is refused with the setting's name; our
    backward (or FA4's forward with ours) takes it listed. The default backward ("auto") is FA4's in groups of up to
    FA4_GATHER_MAX_WORLD ranks and ours beyond; a backward name outside GATHER_BACKWARDS is refused."""
    from mtrain.errors import MtrainError
    from mtrain.ops.switches import DEFAULTS, Switches
    from mtrain.parallel import ring_gather

    assert DEFAULTS.gather_backward == "auto" and ring_gather.FA4_GATHER_MAX_WORLD == 4
    assert [ring_gather.gathered_backward("fa4", w) for w in (2, 4, 8)] == ["fa4", "fa4", "triton"]
    assert [ring_gather.gathered_backward("triton", w) for w in (2, 8)] == ["triton", "triton"]
    assert [ring_gather.gathered_sink_form("fa4", w) for w in (2, 4, 8)] == ["replicas", "replicas", "listed"]
    assert ring_gather.gathered_sink_form("triton", 4) == "listed"
    assert ring_gather.gathered_sink_form("fa4", 4, switches=Switches(gather_backward="triton")) == "listed"
    assert ring_gather.gathered_sink_form("fa4", 8, switches=Switches(gather_backward="fa4")) == "replicas"
    with pytest.raises(MtrainError, match="parallel.gather_sink"):
        ring_gather.gathered_sink_form("fa4", 4, switches=Switches(gather_backward="fa4", gather_sink="listed"))
    with pytest.raises(MtrainError, match="parallel.gather_backward"):
        ring_gather.gathered_backward("fa4", 4, switches=Switches(gather_backward="atomic"))
