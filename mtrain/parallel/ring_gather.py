"""Gathered schedule (`parallel.schedule: gather`) for the sparse layers of a context-parallel group: every rank
all-gathers the group's K/V once and runs its query rows against them in ONE sparse call (all the ring's steps in
one list per query block), instead of W ring steps whose partial results are merged by LSE.

What it saves against the ring: the LSE merge of W partial outputs (fp32 passes over the whole output), W - 1
kernel launches of every kind per call, and the per-step pre/post-processing of the block kernels' backward.
What it costs: the group's K/V of the layer in memory on every rank (W x the shard's; held from forward to
backward, so with activation checkpointing one layer's at a time), one all-gather of K/V (started before the
estimate, so it overlaps it) and one reduce-scatter of dK/dV in fp32 (summed over the ranks in a fixed order).
Within one node (NVLink) the traffic is small against the attention; across nodes the ring's bounded memory and
overlapped transfers are the better schedule, so the ring stays the default.

The plan is the ring's (`mtrain.parallel.plan.sparse_plan`): the gathered K/V are laid out in the ring's step order
(this rank's shard first, then the shards of ranks r - 1, r - 2, ...), so step s's local key block j is block
s * nLB + j of the gathered keys, and the local step's diagonal block keeps its place (FA4's causal mask block). The
off-ring columns (sink block + verticals) are copied from the gathered rows into slots after them: no column
gather of their own, and their gradients fold back into their rows before the reduce-scatter.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mtrain.ops import partial
from mtrain.parallel import fa4_steps
from mtrain.parallel.merge import accum_dtype
from mtrain.parallel.plan import RingPlan, StepBlocks

SCHEDULES = ("ring", "gather")


class KVGather:
    """The group's K/V shards gathered into one buffer [2, B, W * S_local + U, Hkv, D] in the ring's step order, with
    `spare` (U) rows left after them for the off-ring columns; started at once (async), waited for by `wait()`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, group):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sent = torch.stack([k.detach(), v.detach()])  # [2, B, S, H, D]
        self.received = self.sent.new_empty(self.world, *self.sent.shape)
        self.work = dist.all_gather(list(self.received.unbind(0)), self.sent, group=group, async_op=True)

    def drop(self) -> None:
        """Finish the transfer and free its buffers without using them (a layer that runs the ring after all)."""
        if self.work is not None:
            self.work.wait()
        self.work, self.received, self.sent = None, None, None

    def wait(self, spare: int = 0) -> torch.Tensor:
        self.work.wait()
        w, two, b, s, h, d = self.received.shape
        buf = self.received.new_empty(two, b, w * s + spare, h, d)
        for step in range(w):  # [W, 2, B, S, H, D] by rank -> [2, B, W * S, H, D] in step order: one pass
            buf[:, :, step * s:(step + 1) * s].copy_(self.received[(self.rank - step) % w])
        self.received, self.sent = None, None
        return buf


def gathered_plan(plan: RingPlan, world: int) -> RingPlan:
    """The ring plan's steps as one step over the gathered keys (cached in the plan): block lists of step s offset
    by s * nLB and concatenated (ascending, as each step's lists are), the key positions in step order, the columns
    in slots after the W shards. Its one step is keyed by this rank (the local step's causal diagonal is block i of
    query block i, as on the ring)."""
    key = ("gathered", world)
    cache = plan.kernel_caches
    if key in cache:  # the engine is set per call on a copy of the plan: the merged plan follows it
        return dataclasses.replace(cache[key]["plan"], engine=plan.engine)
    order = [(plan.rank - step) % world for step in range(world)]
    n_local = plan.positions[plan.rank].numel()
    nlb = -(-n_local // plan.block_size)
    parts = []
    for step, origin in enumerate(order):
        ids = plan.steps[origin].ids.long()
        parts.append(torch.where(ids >= 0, ids + step * nlb, -1))
    ids = torch.cat(parts, -1)
    # each step's lists are packed left and ascending; keep that order with the valid entries first
    valid = ids >= 0
    shuffle = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
    ids = torch.gather(ids, -1, shuffle).to(torch.int32)
    counts = valid.sum(-1, dtype=torch.int32)
    k_pos = torch.cat([plan.positions[o] for o in order])
    columns, col_src = None, None
    if plan.columns is not None:
        cols = plan.columns
        step_of = torch.empty(world, dtype=torch.long, device=k_pos.device)
        step_of[torch.tensor(order, device=k_pos.device)] = torch.arange(world, device=k_pos.device)
        real = cols.owner >= 0
        col_src = torch.where(real, step_of[cols.owner.clamp(min=0)] * n_local + cols.local.clamp(min=0), 0)
        columns = (torch.where(cols.ids >= 0, cols.ids + world * n_local, -1).to(torch.int32), cols.counts)
        k_pos = torch.cat([k_pos, cols.positions])
    merged = dataclasses.replace(plan, steps={plan.rank: StepBlocks(ids, counts, k_pos, columns)}, skip=set(),
                                 rects={}, kernel_caches={}, column_origin=plan.rank if columns is not None else None)
    cache[key] = {"plan": merged, "col_src": col_src, "n_local": n_local}
    return dataclasses.replace(merged, engine=plan.engine)


def _kernel_args(plan: RingPlan, q, keys):
    step = plan.steps[plan.rank]
    return dict(q_pos=plan.q_pos, k_pos=step.k_pos, blocks=step.as_blocks(), columns=step.columns,
                block_size=plan.block_size, causal=True, plans=plan.kernel_cache(plan.rank, q, keys),
                q_doc=plan.docs(plan.q_pos), k_doc=plan.docs(step.k_pos))


def _fill_columns(buf: torch.Tensor, col_src: torch.Tensor | None, n_rows: int) -> None:
    if col_src is not None:
        buf[:, :, n_rows:] = buf[:, :, col_src]


class RingGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, group, scale: float, gather: KVGather | None):
        world = dist.get_world_size(group)
        merged = gathered_plan(plan, world)
        info = plan.kernel_caches[("gathered", world)]
        col_src, n_rows = info["col_src"], world * info["n_local"]
        gather = gather if gather is not None else KVGather(k, v, group)
        buf = gather.wait(spare=0 if col_src is None else col_src.numel())
        _fill_columns(buf, col_src, n_rows)
        keys, values = buf[0], buf[1]
        args = _kernel_args(merged, q, keys)
        if merged.engine == "fa4":
            out, lse = fa4_steps.forward(q, keys, values, merged, plan.rank, args["k_pos"], args["columns"], scale)
        else:
            out, lse = partial.attention_forward(q, keys, values, softmax_scale=scale, **args)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, buf)
        ctx.plan, ctx.merged, ctx.group, ctx.scale, ctx.n_rows = plan, merged, group, scale, n_rows
        ctx.col_src, ctx.kdtype = col_src, k.dtype
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, buf = ctx.saved_tensors
        merged, group, scale, n_rows = ctx.merged, ctx.group, ctx.scale, ctx.n_rows
        keys, values = buf[0], buf[1]
        dout = dout.contiguous()
        args = _kernel_args(merged, q, keys)
        if merged.engine == "fa4":
            dq, dk, dv = fa4_steps.backward(dout, q, keys, values, out, lse, merged, merged.rank, args["k_pos"],
                                            args["columns"], scale)
        else:
            dq, dk, dv = partial.attention_backward(dout, q, keys, values, out, lse, softmax_scale=scale, **args)
        return (dq.to(q.dtype), *_reduce_kv_grads(dk, dv, ctx.col_src, n_rows, group, ctx.kdtype), None, None, None,
                None)


def _reduce_kv_grads(dk, dv, col_src, n_rows: int, group, dtype):
    """Fold the column slots' gradients into their rows, then sum every shard's dK/dV over the group (fp32), each
    rank receiving its own shard's: (dk, dv) [B, S_local, Hkv, D] in `dtype`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = accum_dtype(dk)
    grads = torch.stack([dk[:, :n_rows], dv[:, :n_rows]]).to(acc)  # [2, B, W * S, H, D]
    if col_src is not None:
        grads.index_add_(2, col_src, torch.stack([dk[:, n_rows:], dv[:, n_rows:]]).to(acc))
    two, b, _, h, d = grads.shape
    s = n_rows // world
    by_step = grads.view(two, b, world, s, h, d)
    # the shard of rank o sits at step (rank - o) % W of this rank's gathered rows
    chunks = [by_step[:, :, (rank - o) % world].contiguous() for o in range(world)]
    received = grads.new_empty(two, b, s, h, d)
    dist.reduce_scatter(received, chunks, group=group)
    return received[0].to(dtype), received[1].to(dtype)


def ring_gather_attention(q, k, v, plan: RingPlan, group, scale: float, gather: KVGather | None = None):
    """Sparse attention of the local queries over the group's gathered K/V in one call: q [B, S_local, Hq, D],
    k/v [B, S_local, Hkv, D] -> (out, lse). `gather`: a `KVGather` of k, v already started (e.g. before the
    estimate), else one is started here. The plan must be a sparse one (every step has block lists)."""
    if any(s is None for s in plan.steps.values()) or plan.rects:
        raise ValueError("the gathered schedule runs sparse plans only; dense layers run the ring")
    return RingGatherAttention.apply(q, k, v, plan, group, scale, gather)


