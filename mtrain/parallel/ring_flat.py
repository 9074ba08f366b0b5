"""Flat ring schedule: step s on rank r attends the KV shard of rank r - s while the next shard is in flight.
Backward runs the steps in reverse, starting on the shard the forward ended with, so dK/dV partial sums
travel W - 1 hops in fp32 and reach their owner while it computes its own (last) step."""

from __future__ import annotations

import torch

from mtrain.ops.switches import Switches
from mtrain.parallel.comm import TAG_GRAD, RingComm
from mtrain.parallel.merge import GradSum, PartialAccumulator
from mtrain.parallel.plan import RingPlan
from mtrain.parallel.saved_state import load_state, save_state
from mtrain.parallel.steps import (
    ColumnGather, finish_column_grads, ring_step_backward, step_forward,
)


def column_origin(rank: int, world: int) -> int:
    """The origin whose step attends the gathered columns: the last forward step (origin r + 1), which is the
    first backward step, so the columns' all-gather overlaps W - 1 forward steps and their gradients'
    reduce-scatter W - 1 backward steps."""
    return (rank + 1) % world


def _forward(q, k, v, plan: RingPlan, group, scale: float, switches):
    comm = RingComm(group)
    gather = ColumnGather(k, v, plan, group) if plan.columns is not None else None
    acc = PartialAccumulator(q, switches=switches)
    aux: dict = {}  # per-call state fused dense kernels hand from forward to backward
    origins = [(comm.rank - step) % comm.size for step in range(comm.size)]
    last = max((s for s, o in enumerate(origins) if o not in plan.skip), default=-1)
    held = [k, v]
    for step, origin in enumerate(origins):
        incoming = comm.shift(held) if step < comm.size - 1 else None
        if origin not in plan.skip:
            columns_kv = gather.wait() if gather is not None and origin == plan.column_origin else None
            step_forward(acc, q, held[0], held[1], plan, origin, scale, aux, columns_kv, final=step == last)
        if incoming is not None:
            held = incoming.wait()
    out, lse = acc.result(q.dtype)
    # `held` is now the shard of step W - 1, where backward starts; the columns are needed there again
    return out, lse, held, gather.wait() if gather is not None else None, aux


def _backward(dout, q, k, v, out, lse, last_kv, columns_kv, aux, plan: RingPlan, group, scale: float):
    comm = RingComm(group)
    prev, nxt = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    dq = GradSum(q)
    held = last_kv
    grads_in_flight = None
    column_reduce = None
    # step s attends the shard of rank r - s; its dK/dV partial sum arrives from rank r + 1 (which attended
    # that shard at step s + 1) and moves on to rank r - 1, reaching the owner at its step 0
    for s in range(comm.size - 1, -1, -1):
        origin = (comm.rank - s) % comm.size
        incoming = comm.shift(held, send_to=prev, recv_from=nxt) if s > 1 else None
        kv = held if s > 0 else [k, v]
        dk, dv, started = ring_step_backward(dq, dout, q, kv[0], kv[1], out, lse, plan, origin, scale, aux,
                                             columns_kv, grads_in_flight, group)
        if started is not None:
            column_reduce = started
        if s > 0:
            grads_in_flight = comm.shift([dk.value(), dv.value()], tag=TAG_GRAD, send_to=prev, recv_from=nxt)
        if incoming is not None:
            held = incoming.wait()
    dk, dv = dk.value(), dv.value()
    if column_reduce is not None:
        finish_column_grads(column_reduce, plan, dk, dv)
    return dq.value().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingFlatAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, group, scale: float, switches):
        out, lse, last_kv, columns_kv, aux = _forward(q, k, v, plan, group, scale, switches)
        saved = [q, k, v, out, lse, *last_kv] + (list(columns_kv) if columns_kv is not None else [])
        save_state(ctx, saved, plan, aux)  # the plan through save_for_backward: see mtrain.parallel.saved_state
        ctx.group, ctx.scale = group, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        (q, k, v, out, lse, last_k, last_v, *columns_kv), (plan, aux) = load_state(ctx)
        grads = _backward(dout.contiguous(), q, k, v, out, lse, [last_k, last_v], tuple(columns_kv) or None,
                          aux, plan, ctx.group, ctx.scale)
        return (*grads, None, None, None, None)  # (the backward reads no switch)


def ring_flat_attention(q, k, v, plan: RingPlan, group, scale: float, *, switches: Switches | None = None):
    """Flat ring attention on local shards: q [B, S_local, Hq, D], k/v [B, S_local, Hkv, D] -> (out, lse).
    switches: the run's (`mtrain.ops.switches`; None = the defaults): the forward's merge (parallel.fused_merge)."""
    return RingFlatAttention.apply(q, k, v, plan, group, scale, switches)
