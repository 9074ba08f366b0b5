"""Flat ring schedule: step s on rank r attends the KV shard of rank r - s while the next shard is in flight;
backward sends dK/dV home on a second ring in fp32. Sink and verticals run once, off the ring."""

from __future__ import annotations

import torch

from mtrain.parallel.comm import TAG_GRAD, RingComm
from mtrain.parallel.merge import PartialAccumulator, accum_dtype
from mtrain.parallel.plan import RingPlan
from mtrain.parallel.steps import (
    columns_backward, columns_forward, start_column_gather, step_backward, step_forward,
)


def _forward(q, k, v, plan: RingPlan, group, scale: float):
    comm = RingComm(group)
    gather = start_column_gather(k, v, plan, group) if plan.columns is not None else None
    acc = PartialAccumulator(q)
    aux: dict = {}  # per-call state fused dense kernels hand from forward to backward
    held = [k, v]
    for step in range(comm.size):
        incoming = comm.shift(held) if step < comm.size - 1 else None
        origin = (comm.rank - step) % comm.size
        if origin not in plan.skip:
            step_forward(acc, q, held[0], held[1], plan, origin, scale, aux)
        if incoming is not None:
            held = incoming.wait()
    columns_kv = None
    if gather is not None:
        buf, work = gather
        work.wait()
        columns_kv = (buf[0], buf[1])
        columns_forward(acc, q, buf[0], buf[1], plan, scale)
    return acc.out.to(q.dtype), acc.lse, columns_kv, aux


def _backward(dout, q, k, v, out, lse, columns_kv, aux, plan: RingPlan, group, scale: float):
    comm = RingComm(group)
    dq = torch.zeros(q.shape, dtype=accum_dtype(q), device=q.device)
    held = [k, v]
    grads_in_flight = None
    for step in range(comm.size):
        incoming = comm.shift(held) if step < comm.size - 1 else None
        origin = (comm.rank - step) % comm.size
        # the dK/dV accumulator of shard `origin` arrives from the previous rank, gains this step's part,
        # and moves on; after W sends it is back at its owner
        if step == 0:
            acc = [torch.zeros(k.shape, dtype=accum_dtype(k), device=k.device) for _ in range(2)]
        else:
            acc = grads_in_flight.wait()
        if origin not in plan.skip:
            step_backward(dq, acc[0], acc[1], dout, q, held[0], held[1], out, lse, plan, origin, scale, aux)
        grads_in_flight = comm.shift(acc, tag=TAG_GRAD)
        if incoming is not None:
            held = incoming.wait()
    dk, dv = grads_in_flight.wait()
    if columns_kv is not None:
        dq += columns_backward(dout, q, columns_kv[0], columns_kv[1], out, lse, plan, scale, group, dk, dv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingFlatAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, group, scale: float):
        out, lse, columns_kv, aux = _forward(q, k, v, plan, group, scale)
        saved = [q, k, v, out, lse] + (list(columns_kv) if columns_kv is not None else [])
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.group, ctx.scale, ctx.aux = plan, group, scale, aux
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *columns_kv = ctx.saved_tensors
        grads = _backward(
            dout.contiguous(), q, k, v, out, lse, tuple(columns_kv) or None, ctx.aux, ctx.plan, ctx.group, ctx.scale
        )
        return (*grads, None, None, None)


def ring_flat_attention(q, k, v, plan: RingPlan, group, scale: float):
    """Flat ring attention on local shards: q [B, S_local, Hq, D], k/v [B, S_local, Hkv, D] -> (out, lse)."""
    return RingFlatAttention.apply(q, k, v, plan, group, scale)
