"""Per-step attention calls (mtrain.ops.partial with global positions, local block lists, the shards' document
ids and the step's cached kernel data, or dense rectangles) and the off-ring columns' gather and gradient
reduction, shared by every ring schedule. The local step also attends the gathered sink + vertical columns."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.ops import partial
from mtrain.parallel.dense_rects import rect_backward, rect_forward
from mtrain.parallel.merge import GradSum, PartialAccumulator
from mtrain.parallel.plan import RingPlan


def _step_args(plan: RingPlan, origin: int, q, k, v, columns_kv):
    """(k, v, keyword arguments) of the partial kernels for the step of `origin`; the local step's keys are
    the shard's own followed by the gathered columns."""
    step = plan.steps[origin]
    if step is None:  # dense: every key block of the shard
        k_pos, blocks, columns = plan.positions[origin], None, None
    else:
        k_pos, blocks, columns = step.k_pos, step.as_blocks(), step.columns
        if columns is not None:
            k, v = torch.cat([k, columns_kv[0]], 1), torch.cat([v, columns_kv[1]], 1)
    kwargs = dict(q_pos=plan.q_pos, k_pos=k_pos, blocks=blocks, columns=columns, block_size=plan.block_size,
                  causal=True, plans=plan.kernel_cache(origin, q, k), q_doc=plan.docs(plan.q_pos),
                  k_doc=plan.docs(k_pos))
    return k, v, kwargs


def step_forward(acc: PartialAccumulator, q, k, v, plan: RingPlan, origin: int, scale: float, aux: dict,
                 columns_kv=None, final: bool = False) -> None:
    """Merge into `acc` the local queries' attention to the KV shard that originated at `origin` (the local
    step: plus the gathered columns `columns_kv` = (kc, vc) [B, U, Hkv, D]); `aux` collects what fused dense
    kernels need again in backward (keyed by origin and rectangle); final: no later step follows."""
    rects = plan.rects.get(origin)
    if rects is not None:
        for n, rect in enumerate(rects):
            out, lse, aux[origin, n] = rect_forward(q, k, v, rect, scale)
            acc.add(out, lse, rows=slice(rect.q0, rect.q1), final=final and len(rects) == 1)
        return
    k, v, kwargs = _step_args(plan, origin, q, k, v, columns_kv)
    acc.add(*partial.attention_forward(q, k, v, softmax_scale=scale, **kwargs), final=final)


def step_backward(dq: GradSum, dk: GradSum, dv: GradSum, dout, q, k, v, out, lse, plan: RingPlan, origin: int,
                  scale: float, aux: dict, columns_kv=None):
    """Add one ring step's gradients into dq [B, S_local, Hq, D] and the visiting shard's dk, dv, given the
    final merged out and lse and the forward's `aux`. Returns the columns' (dk, dv) [B, U, Hkv, D] fp32 of
    the local step when it carries them (to be summed over ranks, `start_column_grad_reduce`), else None."""
    rects = plan.rects.get(origin)
    if rects is not None:
        for n, rect in enumerate(rects):
            dq_r, dk_r, dv_r = rect_backward(dout, q, k, v, out, lse, rect, scale, aux[origin, n])
            dq.add(dq_r, rows=slice(rect.q0, rect.q1))
            dk.add(dk_r, rows=slice(rect.k0, rect.k1))
            dv.add(dv_r, rows=slice(rect.k0, rect.k1))
        return None
    n_local = k.shape[1]
    k, v, kwargs = _step_args(plan, origin, q, k, v, columns_kv)
    dq_s, dk_s, dv_s = partial.attention_backward(dout, q, k, v, out, lse, softmax_scale=scale, **kwargs)
    dq.add(dq_s)
    dk.add(dk_s[:, :n_local])
    dv.add(dv_s[:, :n_local])
    if k.shape[1] == n_local:
        return None
    return dk_s[:, n_local:], dv_s[:, n_local:]


class ColumnGather:
    """The off-ring columns' K/V rows, gathered from their owners by an all-reduce of a zero-filled buffer
    each owner writes its rows into (exact: one rank contributes each row); started before the ring."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group):
        cols = plan.columns
        b, _, hkv, d = k.shape
        self.buf = k.new_zeros(2, b, cols.positions.numel(), hkv, d)
        self.buf[0][:, cols.mine_slots] = k[:, cols.mine_local]
        self.buf[1][:, cols.mine_slots] = v[:, cols.mine_local]
        self.work = dist.all_reduce(self.buf, group=group, async_op=True)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buf[0], self.buf[1]


def ring_step_backward(dq: GradSum, dout, q, k, v, out, lse, plan: RingPlan, origin: int, scale: float, aux: dict,
                       columns_kv, grads_in_flight, group):
    """One backward ring step on the held shard of rank `origin`: its dK/dV share is queued first, then the
    partial sum for that shard that arrives from the neighbour (`grads_in_flight`, or None) is added.
    Returns (dk, dv GradSums to send on, the started column-gradient reduction of the local step or None)."""
    dk, dv = GradSum(k), GradSum(k)
    column_reduce = None
    if origin not in plan.skip:
        dcols = step_backward(dq, dk, dv, dout, q, k, v, out, lse, plan, origin, scale, aux,
                              columns_kv if origin == plan.rank else None)
        if dcols is not None:
            column_reduce = start_column_grad_reduce(dcols, group)
    if grads_in_flight is not None:  # waited for only after this step's kernels are queued
        earlier = grads_in_flight.wait()
        dk.add(earlier[0])
        dv.add(earlier[1])
    return dk, dv, column_reduce


def start_column_grad_reduce(dcols, group):
    """Start summing the local steps' column gradients over the group: (buffer [2, B, U, Hkv, D], work)."""
    buf = torch.stack(dcols)
    return buf, dist.all_reduce(buf, group=group, async_op=True)


def finish_column_grads(reduce, plan: RingPlan, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add the group's summed column gradients of the columns this rank owns into its fp32 dk, dv."""
    buf, work = reduce
    work.wait()
    cols = plan.columns
    dk.index_add_(1, cols.mine_local, buf[0][:, cols.mine_slots].to(dk.dtype))
    dv.index_add_(1, cols.mine_local, buf[1][:, cols.mine_slots].to(dv.dtype))
