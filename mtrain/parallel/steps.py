"""Per-step attention calls (mtrain.ops.partial with global positions, local block lists and the shards'
document ids, or dense rectangles) and the off-ring sink + vertical-column pass, shared by every ring schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.ops import partial
from mtrain.parallel.dense_rects import rect_backward, rect_forward
from mtrain.parallel.merge import PartialAccumulator
from mtrain.parallel.plan import RingPlan


def step_forward(acc: PartialAccumulator, q, k, v, plan: RingPlan, origin: int, scale: float, aux: dict) -> None:
    """Merge into `acc` the local queries' attention to the KV shard that originated at `origin`; `aux`
    collects what fused dense kernels need again in backward (keyed by origin and rectangle)."""
    rects = plan.rects.get(origin)
    if rects is not None:
        for n, rect in enumerate(rects):
            out, lse, aux[origin, n] = rect_forward(q, k, v, rect, scale)
            acc.add(out, lse, rows=slice(rect.q0, rect.q1))
        return
    blocks = plan.steps[origin]
    acc.add(*partial.attention_forward(
        q, k, v, q_pos=plan.q_pos, k_pos=plan.positions[origin],
        blocks=None if blocks is None else blocks.as_blocks(),
        block_size=plan.block_size, softmax_scale=scale, causal=True,
        q_doc=plan.docs(plan.q_pos), k_doc=plan.docs(plan.positions[origin]),
    ))


def step_backward(dq, dk, dv, dout, q, k, v, out, lse, plan: RingPlan, origin: int, scale: float, aux: dict) -> None:
    """Add one ring step's gradients (fp32) into dq [B, S_local, Hq, D] and the visiting shard's dk, dv,
    given the final merged out and lse and the forward's `aux`."""
    rects = plan.rects.get(origin)
    if rects is not None:
        for n, rect in enumerate(rects):
            dq_r, dk_r, dv_r = rect_backward(dout, q, k, v, out, lse, rect, scale, aux[origin, n])
            dq[:, rect.q0:rect.q1] += dq_r
            dk[:, rect.k0:rect.k1] += dk_r
            dv[:, rect.k0:rect.k1] += dv_r
        return
    blocks = plan.steps[origin]
    dq_s, dk_s, dv_s = partial.attention_backward(
        dout, q, k, v, out, lse, q_pos=plan.q_pos, k_pos=plan.positions[origin],
        blocks=None if blocks is None else blocks.as_blocks(),
        block_size=plan.block_size, softmax_scale=scale, causal=True,
        q_doc=plan.docs(plan.q_pos), k_doc=plan.docs(plan.positions[origin]),
    )
    dq += dq_s
    dk += dk_s
    dv += dv_s


def start_column_gather(k: torch.Tensor, v: torch.Tensor, plan: RingPlan, group):
    """Start gathering the K/V rows of the off-ring columns from their owners (an all-reduce of a
    zero-filled buffer each owner writes into: exact, since one rank contributes each row).
    Returns (buffer [2, B, U, Hkv, D], work) — wait on work before use."""
    cols = plan.columns
    mine = cols.owner == plan.rank
    b, _, hkv, d = k.shape
    buf = k.new_zeros(2, b, cols.positions.numel(), hkv, d)
    buf[0][:, mine] = k[:, cols.local[mine]]
    buf[1][:, mine] = v[:, cols.local[mine]]
    return buf, dist.all_reduce(buf, group=group, async_op=True)


def _column_blocks(q: torch.Tensor, plan: RingPlan):
    ids = plan.columns.ids
    empty_ids = torch.full((*ids.shape[:3], 1), -1, dtype=torch.int32, device=ids.device)
    empty_counts = torch.zeros(ids.shape[:3], dtype=torch.int32, device=ids.device)
    return (empty_ids, empty_counts), (ids, plan.columns.counts)


def columns_forward(acc: PartialAccumulator, q, kc, vc, plan: RingPlan, scale: float) -> None:
    """Merge into `acc` the local queries' attention to the gathered sink + vertical columns."""
    blocks, columns = _column_blocks(q, plan)
    acc.add(*partial.attention_forward(
        q, kc, vc, q_pos=plan.q_pos, k_pos=plan.columns.positions, blocks=blocks, columns=columns,
        block_size=plan.block_size, softmax_scale=scale, causal=True,
        q_doc=plan.docs(plan.q_pos), k_doc=plan.docs(plan.columns.positions),
    ))


def columns_backward(dout, q, kc, vc, out, lse, plan: RingPlan, scale: float, group, dk, dv):
    """Backward of the off-ring pass: returns dq (fp32) and adds the columns' dK/dV, summed over all ranks'
    queries, into this rank's own fp32 `dk`, `dv` [B, S_local, Hkv, D]."""
    blocks, columns = _column_blocks(q, plan)
    dq, dkc, dvc = partial.attention_backward(
        dout, q, kc, vc, out, lse, q_pos=plan.q_pos, k_pos=plan.columns.positions, blocks=blocks,
        columns=columns, block_size=plan.block_size, softmax_scale=scale, causal=True,
        q_doc=plan.docs(plan.q_pos), k_doc=plan.docs(plan.columns.positions),
    )
    grads = torch.stack([dkc.to(dk.dtype), dvc.to(dv.dtype)])
    dist.all_reduce(grads, group=group)
    cols = plan.columns
    mine = cols.owner == plan.rank
    dk.index_add_(1, cols.local[mine], grads[0][:, mine])
    dv.index_add_(1, cols.local[mine], grads[1][:, mine])
    return dq.to(dk.dtype)
