"""Per-step attention calls (mtrain.ops.partial with global positions, local block lists, the shards' document
ids and the step's cached kernel data, or dense rectangles) and the off-ring columns' all-gather and gradient
reduce-scatter, shared by every ring schedule. One step (`RingPlan.column_origin`) also attends the gathered
sink + vertical columns."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.ops import partial
from mtrain.parallel import fa4_steps
from mtrain.parallel.dense_rects import rect_backward, rect_forward
from mtrain.parallel.merge import GradSum, PartialAccumulator
from mtrain.parallel.plan import RingPlan


def step_kwargs(plan: RingPlan, origin: int, q, k) -> dict:
    """Keyword arguments of the partial kernels for the step of `origin` whose keys `k` are already laid out as the
    step's `k_pos` says (the shard's, then the gathered columns' on the column step; the gathered schedule's one
    step holds the group's rows and then the columns' slots)."""
    step = plan.steps[origin]
    if step is None:  # dense: every key block of the shard
        k_pos, blocks, columns = plan.positions[origin], None, None
    else:
        k_pos, blocks, columns = step.k_pos, step.as_blocks(), step.columns
    return dict(q_pos=plan.q_pos, k_pos=k_pos, blocks=blocks, columns=columns, block_size=plan.block_size,
                causal=True, plans=plan.kernel_cache(origin, q, k), q_doc=plan.docs(plan.q_pos), k_doc=plan.docs(k_pos))


def _step_args(plan: RingPlan, origin: int, q, k, v, columns_kv):
    """(k, v, keyword arguments) of the partial kernels for the step of `origin`; the keys of the step carrying
    the columns (`RingPlan.column_origin`) are the shard's own followed by the gathered columns."""
    step = plan.steps[origin]
    if step is not None and step.columns is not None:
        k, v = torch.cat([k, columns_kv[0]], 1), torch.cat([v, columns_kv[1]], 1)
    return k, v, step_kwargs(plan, origin, q, k)


def step_forward(acc: PartialAccumulator, q, k, v, plan: RingPlan, origin: int, scale: float, aux: dict,
                 columns_kv=None, final: bool = False) -> None:
    """Merge into `acc` the local queries' attention to the KV shard that originated at `origin` (the step of
    `plan.column_origin`: plus the gathered columns `columns_kv` = (kc, vc) [B, U, Hkv, D]); `aux` collects what
    fused dense kernels need again in backward (keyed by origin and rectangle); final: no later step follows."""
    rects = plan.rects.get(origin)
    if rects is not None:
        for n, rect in enumerate(rects):
            out, lse, aux[origin, n] = rect_forward(q, k, v, rect, scale)
            acc.add(out, lse, rows=slice(rect.q0, rect.q1), final=final and len(rects) == 1)
        return
    k, v, kwargs = _step_args(plan, origin, q, k, v, columns_kv)
    if plan.engine == "fa4":
        acc.add(*fa4_steps.forward(q, k, v, plan, origin, kwargs["k_pos"], kwargs["columns"], scale), final=final)
        return
    acc.add(*partial.attention_forward(q, k, v, softmax_scale=scale, **kwargs), final=final)


def step_backward(dq: GradSum, dk: GradSum, dv: GradSum, dout, q, k, v, out, lse, plan: RingPlan, origin: int,
                  scale: float, aux: dict, columns_kv=None):
    """Add one ring step's gradients into dq [B, S_local, Hq, D] and the visiting shard's dk, dv, given the
    final merged out and lse and the forward's `aux`. Returns the columns' (dk, dv) [B, U, Hkv, D] fp32 of
    the step that carries them (to be summed over ranks, `start_column_grad_reduce`), else None."""
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
    if plan.engine == "fa4":
        dq_s, dk_s, dv_s = fa4_steps.backward(dout, q, k, v, out, lse, plan, origin, kwargs["k_pos"],
                                              kwargs["columns"], scale)
    else:
        dq_s, dk_s, dv_s = partial.attention_backward(dout, q, k, v, out, lse, softmax_scale=scale, **kwargs)
    dq.add(dq_s)
    dk.add(dk_s[:, :n_local])
    dv.add(dv_s[:, :n_local])
    if k.shape[1] == n_local:
        return None
    return dk_s[:, n_local:], dv_s[:, n_local:]


class ColumnGather:
    """The off-ring columns' K/V rows, gathered from their owners: an all-gather in which every rank sends the
    rows it owns (`OffRingColumns.send_local`, padded to the most one rank owns), started as soon as the plan
    exists and waited for only by the step that attends the columns (`RingPlan.column_origin`)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group):
        self.cols = plan.columns
        sent = torch.stack([k[:, self.cols.send_local], v[:, self.cols.send_local]])  # [2, B, P, Hkv, D]
        self.received = sent.new_empty(dist.get_world_size(group), *sent.shape)
        self.work = dist.all_gather(list(self.received.unbind(0)), sent, group=group, async_op=True)
        self.sent = sent  # kept alive until the gather completes
        self.buf = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work, self.sent = None, None
            w, two, b, p, h, d = self.received.shape
            rows = self.received.permute(1, 2, 0, 3, 4, 5).reshape(two, b, w * p, h, d)
            self.buf = rows.index_select(2, self.cols.src)  # [2, B, U, Hkv, D] in slot order
            self.received = None
        return self.buf[0], self.buf[1]


def ring_step_backward(dq: GradSum, dout, q, k, v, out, lse, plan: RingPlan, origin: int, scale: float, aux: dict,
                       columns_kv, grads_in_flight, group):
    """One backward ring step on the held shard of rank `origin`: its dK/dV share is queued first, then the
    partial sum for that shard that arrives from the neighbour (`grads_in_flight`, or None) is added.
    Returns (dk, dv GradSums to send on, the started column-gradient reduction of the columns' step or None)."""
    dk, dv = GradSum(k), GradSum(k)
    column_reduce = None
    if origin not in plan.skip:
        dcols = step_backward(dq, dk, dv, dout, q, k, v, out, lse, plan, origin, scale, aux,
                              columns_kv if origin == plan.column_origin else None)
        if dcols is not None:
            column_reduce = start_column_grad_reduce(dcols, plan, group)
    if grads_in_flight is not None:  # waited for only after this step's kernels are queued
        earlier = grads_in_flight.wait()
        dk.add(earlier[0])
        dv.add(earlier[1])
    return dk, dv, column_reduce


def start_column_grad_reduce(dcols, plan: RingPlan, group):
    """Start summing the column gradients (dk, dv) [B, U, Hkv, D] over the group, each owner receiving only its
    own rows (a reduce-scatter in the all-gather's order): (received [2, B, P, Hkv, D], work)."""
    cols = plan.columns
    grads = torch.stack(dcols)  # [2, B, U, Hkv, D] fp32
    two, b, u, h, d = grads.shape
    world = cols.by_rank.shape[0]
    padded = torch.cat([grads, grads.new_zeros(two, b, 1, h, d)], 2)  # slot U: the padding's zero row
    chunks = padded.index_select(2, cols.by_rank.flatten()).view(two, b, world, cols.per_rank, h, d)
    chunks = chunks.permute(2, 0, 1, 3, 4, 5).contiguous()
    received = grads.new_empty(two, b, cols.per_rank, h, d)
    return received, dist.reduce_scatter(received, list(chunks.unbind(0)), group=group, async_op=True), chunks


def finish_column_grads(reduce, plan: RingPlan, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add the group's summed column gradients of the columns this rank owns into its fp32 dk, dv (padding
    entries add zeros to local row 0)."""
    received, work, _ = reduce
    work.wait()
    cols = plan.columns
    dk.index_add_(1, cols.send_local, received[0].to(dk.dtype))
    dv.index_add_(1, cols.send_local, received[1].to(dv.dtype))
