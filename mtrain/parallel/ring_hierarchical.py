"""Hierarchical ring schedule: an inner ring over a node's ranks, an outer ring across nodes; every
inter-node transfer (KV forward, dK/dV backward) is in flight during a whole inner ring."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain.errors import MtrainError
from mtrain.ops.switches import Switches
from mtrain.parallel.comm import TAG_GRAD, TAG_KV, RingComm
from mtrain.parallel.merge import GradSum, PartialAccumulator
from mtrain.parallel.plan import RingPlan
from mtrain.parallel.saved_state import load_state, save_state
from mtrain.parallel.steps import (
    ColumnGather, finish_column_grads, ring_step_backward, step_forward,
)


@dataclass(frozen=True)
class NodeGrid:
    """CP rank g = node * L + local (inner groups are consecutive CP ranks); on the ring, the process sits
    at slot s = local * N + node. The inner ring moves KV by N slots, the outer ring (slot s -> s + 1,
    always across nodes) by 1, so at outer step o, inner step i each process holds the KV of slot
    s - o - i * N. With a layout built with local_world_size = L (slot s holds stripe s) every rank then
    attends at the same diagonal distance o + i * N: the flat ring's balance, in another step order."""

    nodes: int
    local_size: int
    node: int
    local: int

    @property
    def slot(self) -> int:
        return self.local * self.nodes + self.node

    def cp_rank_of_slot(self, slot: int) -> int:
        slot %= self.nodes * self.local_size
        return (slot % self.nodes) * self.local_size + slot // self.nodes


def node_grid(cp_rank: int, cp_size: int, inner_size: int, inner_rank: int) -> NodeGrid:
    if cp_size % inner_size or cp_rank != (cp_rank // inner_size) * inner_size + inner_rank:
        raise MtrainError(
            f"hierarchical ring: CP rank {cp_rank} of {cp_size} is not node x {inner_size} + local {inner_rank}; "
            "the inner groups must be runs of consecutive CP ranks (see mtrain.parallel.comm.hierarchical_groups)"
        )
    return NodeGrid(cp_size // inner_size, inner_size, cp_rank // inner_size, inner_rank)


def _comms(group, inner_group, outer_group) -> tuple[RingComm, RingComm, NodeGrid]:
    """(inner ring, communicator for the outer ring, grid). The outer ring links slot s to s + 1, across
    nodes; an outer_group over all CP ranks carries it on its own communicator. The other common form, the
    ranks with equal node-local index, lacks the wrap links (last node, local l -> first node, local l + 1),
    so then the CP group's own communicator carries the outer ring (still beside the inner ring's)."""
    cp, inner, outer = RingComm(group), RingComm(inner_group), RingComm(outer_group)
    grid = node_grid(cp.rank, cp.size, inner.size, inner.rank)
    if (outer.size, outer.rank) == (cp.size, cp.rank):
        return inner, outer, grid
    if (outer.size, outer.rank) == (grid.nodes, grid.node):
        return inner, cp, grid
    raise MtrainError(
        f"hierarchical ring: outer_group (rank {outer.rank} of {outer.size}) is neither a copy of the CP group "
        f"(rank {cp.rank} of {cp.size}) nor the ranks with this node-local index (node {grid.node} of {grid.nodes})"
    )


def _outer_shift(outer: RingComm, grid: NodeGrid, tensors, by: int = 1, tag: int = TAG_KV):
    """Send to the process at slot s + by, receive from the one at s - by."""
    return outer.shift(tensors, tag=tag, send_to=grid.cp_rank_of_slot(grid.slot + by),
                       recv_from=grid.cp_rank_of_slot(grid.slot - by))


def origin_rank(grid: NodeGrid, outer_step: int, inner_step: int) -> int:
    """CP rank whose KV shard this process holds at (outer_step, inner_step)."""
    return grid.cp_rank_of_slot(grid.slot - outer_step - inner_step * grid.nodes)


def column_origin(grid: NodeGrid) -> int:
    """The origin whose step attends the gathered columns: the second step (forward and backward run the steps
    in the same order here), so the columns' all-gather overlaps the first step and their gradients'
    reduce-scatter all backward steps but the first two."""
    if grid.nodes * grid.local_size == 1:
        return origin_rank(grid, 0, 0)
    return origin_rank(grid, 0, 1) if grid.local_size > 1 else origin_rank(grid, 1, 0)


def _forward(q, k, v, plan: RingPlan, group, inner_group, outer_group, scale: float, switches):
    inner, outer, grid = _comms(group, inner_group, outer_group)
    gather = ColumnGather(k, v, plan, group) if plan.columns is not None else None
    acc = PartialAccumulator(q, switches=switches)
    aux: dict = {}  # per-call state fused dense kernels hand from forward to backward
    order = [(o, i) for o in range(grid.nodes) for i in range(grid.local_size)]
    last = max((n for n, (o, i) in enumerate(order) if origin_rank(grid, o, i) not in plan.skip), default=-1)
    base = [k, v]
    for o in range(grid.nodes):
        next_base = _outer_shift(outer, grid, base) if o < grid.nodes - 1 else None  # overlaps the inner ring
        held = base
        for i in range(grid.local_size):
            incoming = inner.shift(held) if i < grid.local_size - 1 else None
            origin = origin_rank(grid, o, i)
            if origin not in plan.skip:
                columns_kv = gather.wait() if gather is not None and origin == plan.column_origin else None
                step_forward(acc, q, held[0], held[1], plan, origin, scale, aux, columns_kv,
                             final=o * grid.local_size + i == last)
            if incoming is not None:
                held = incoming.wait()
        if next_base is not None:
            base = next_base.wait()
    out, lse = acc.result(q.dtype)
    return out, lse, gather.wait() if gather is not None else None, aux


def _inner_ring_backward(dout, q, base, out, lse, plan, inner, grid, o, scale, dq, aux, columns_kv, group):
    """One inner ring of backward: returns this node's fp32 (dK, dV) for the base shard, back at its holder,
    and the started reduction of the column gradients when the local step ran in this inner ring."""
    held = base
    in_flight = None
    column_reduce = None
    for i in range(grid.local_size):
        incoming = inner.shift(held) if i < grid.local_size - 1 else None
        origin = origin_rank(grid, o, i)
        dk, dv, started = ring_step_backward(dq, dout, q, held[0], held[1], out, lse, plan, origin, scale, aux,
                                             columns_kv, in_flight, group)
        if started is not None:
            column_reduce = started
        in_flight = inner.shift([dk.value(), dv.value()], tag=TAG_GRAD)  # the last one returns it to the base's holder
        if incoming is not None:
            held = incoming.wait()
    return in_flight.wait(), column_reduce


def _backward(dout, q, k, v, out, lse, columns_kv, aux, plan: RingPlan, group, inner_group, outer_group, scale):
    inner, outer, grid = _comms(group, inner_group, outer_group)
    dq = GradSum(q)
    base = [k, v]
    node_grads_in_flight = None
    column_reduce = None
    for o in range(grid.nodes):
        next_base = _outer_shift(outer, grid, base) if o < grid.nodes - 1 else None
        node_acc, reduce = _inner_ring_backward(dout, q, base, out, lse, plan, inner, grid, o, scale, dq, aux,
                                                columns_kv, group)
        column_reduce = reduce or column_reduce
        # the earlier nodes' sum for this base shard left the previous node one inner ring ago
        if node_grads_in_flight is not None:
            earlier = node_grads_in_flight.wait()
            node_acc = [node_acc[0].add_(earlier[0]), node_acc[1].add_(earlier[1])]
        # forward to the holder of this base at the next outer step; after the last, straight home
        # (the base of outer step N-1 came from slot s - (N-1))
        by = 1 if o < grid.nodes - 1 else -(grid.nodes - 1)
        node_grads_in_flight = _outer_shift(outer, grid, node_acc, by=by, tag=TAG_GRAD)
        if next_base is not None:
            base = next_base.wait()
    dk, dv = node_grads_in_flight.wait()
    if column_reduce is not None:
        finish_column_grads(column_reduce, plan, dk, dv)
    return dq.value().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingHierarchicalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, group, inner_group, outer_group, scale: float, switches):
        out, lse, columns_kv, aux = _forward(q, k, v, plan, group, inner_group, outer_group, scale, switches)
        saved = [q, k, v, out, lse] + (list(columns_kv) if columns_kv is not None else [])
        save_state(ctx, saved, plan, aux)  # the plan through save_for_backward: see mtrain.parallel.saved_state
        ctx.groups, ctx.scale = (group, inner_group, outer_group), scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        (q, k, v, out, lse, *columns_kv), (plan, aux) = load_state(ctx)
        grads = _backward(
            dout.contiguous(), q, k, v, out, lse, tuple(columns_kv) or None, aux, plan, *ctx.groups, ctx.scale
        )
        return (*grads, None, None, None, None, None, None)  # (the backward reads no switch)


def ring_hierarchical_attention(q, k, v, plan: RingPlan, group, inner_group, outer_group, scale: float, *,
                                switches: Switches | None = None):
    """Hierarchical ring attention on local shards: q [B, S_local, Hq, D], k/v [B, S_local, Hkv, D] -> (out, lse).
    switches: the run's (`mtrain.ops.switches`; None = the defaults): the forward's merge (parallel.fused_merge)."""
    return RingHierarchicalAttention.apply(q, k, v, plan, group, inner_group, outer_group, scale, switches)
