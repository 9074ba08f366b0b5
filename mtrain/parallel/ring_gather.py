"""Gathered schedule (`parallel.schedule: gather`) for the sparse layers of a context-parallel group: every rank
all-gathers the group's K/V once and runs its query rows against them in ONE sparse call (all the ring's steps in
one list per query block), instead of W ring steps whose partial results are merged by LSE.

What it saves against the ring: the LSE merge of W partial outputs (fp32 passes over the whole output), W - 1
kernel launches of every kind per call, and the per-step pre/post-processing of the block kernels' backward.
What it costs: the group's K/V of the layer in memory on every rank (W x the shard's; held from forward to
backward, so with activation checkpointing one layer's at a time), one all-gather of K/V (started before the
estimate, so it overlaps it) and one point-to-point return of dK/dV (summed by each owner in fp32 in rank order).
Within one node (NVLink) the traffic is small against the attention; across nodes the ring's bounded memory and
overlapped transfers are the better schedule, so the ring stays the default.

The gathered K/V are laid out in the ring's step order (this rank's shard first, then the shards of ranks r - 1,
r - 2, ...), so step s's local key block j is block s * nLB + j of the gathered keys, and the local step's diagonal
block keeps its place (FA4's causal mask block). The plan maps each listed global block there directly
(`mtrain.parallel.plan.gathered_sparse_plan`; the sink block is a listed block there, as on one device, or under
FA4's backward copies of it, parallel.gather_sink), or, for layouts whose global blocks span ranks, merges the ring
plan's steps (`gathered_plan`; the sink's tokens are columns there, as on the ring). The off-ring columns are copied
from the gathered rows into slots after them: no column gather of their own, and their gradients fold back into
their rows before dK/dV go back to the owners.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError
from mtrain.ops import partial
from mtrain.ops.switches import Switches, or_defaults
from mtrain.parallel import fa4_steps
from mtrain.parallel.comm import TAG_GRAD, TAG_KV
from mtrain.parallel.merge import RankParts, accum_dtype
from mtrain.parallel.plan import RingPlan, StepBlocks, gathered_columns
from mtrain.parallel.saved_state import load_state, save_state
from mtrain.parallel.steps import step_kwargs

SCHEDULES = ("ring", "gather")

# The backward of the gathered step under the fa4 engine (parallel.gather_backward, `Switches.gather_backward`): "fa4",
# FA4's block-sparse backward (atomic dQ) plus our column backward, or "triton", our deterministic backward over the
# step's blocks and columns at once from FA4's merged out / lse (what the one-device fa4 engine runs by default), or
# "auto" (the default): FA4's in groups of up to
# FA4_GATHER_MAX_WORLD ranks, ours in larger ones. One rank of a CP group at 128K tokens per GPU timed alone on one
# H200 (BENCHMARKS.md, "Ring attention on several GPUs"): FA4's backward is 1-13% faster at CP 2 and 4, ours 14%
# faster at CP=8, where the gathered keys hold 8 shards and FA4's backward, which runs each key block's query blocks
# in turn, walks 8 times the key blocks (and the sink's copies) for the same pairs. The ring schedule's steps always
# run FA4's backward.
FA4_GATHER_MAX_WORLD = 4
GATHER_BACKWARDS = ("auto", "fa4", "triton")


def gathered_backward(engine: str, world: int, *, switches: Switches | None = None) -> str:
    """The backward the gathered step of a `world`-rank group runs when its forward runs on `engine`, under
    parallel.gather_backward (`switches`; None = the defaults)."""
    chosen = or_defaults(switches).gather_backward
    if chosen not in GATHER_BACKWARDS:
        raise MtrainError(f"parallel.gather_backward must be one of {GATHER_BACKWARDS}; got {chosen!r}")
    if engine != "fa4":
        return "triton"
    if chosen == "auto":
        return "fa4" if world <= FA4_GATHER_MAX_WORLD else "triton"
    return chosen


# How the gathered plan holds the sink block (`mtrain.parallel.plan.SINK_FORMS`) under FA4's backward, which runs each
# key block's query blocks in turn: "replicas" (copies read by a few query blocks each), or "columns" (its tokens as
# columns of every query block, as on the ring); under every other backward it is a listed block. Chosen by
# parallel.gather_sink (`Switches.gather_sink`; "replicas" by default).


def gathered_sink_form(engine: str, world: int, *, switches: Switches | None = None) -> str:
    """The sink form of the gathered plan for a step of a `world`-rank group run by `engine` ("fa4" or "triton"),
    under parallel.gather_backward and parallel.gather_sink (`switches`; None = the defaults)."""
    if gathered_backward(engine, world, switches=switches) != "fa4":
        return "listed"
    sink = or_defaults(switches).gather_sink
    if sink not in ("replicas", "columns"):  # a listed sink overflows FA4's bounded backward lists
        raise MtrainError(f"parallel.gather_sink must be 'replicas' or 'columns'; got {sink!r}")
    return sink


class KVGather:
    """The group's K/V shards gathered into K and V buffers [B, W * S_local + spare, Hkv, D] in the ring's step order
    (this rank's shard first), with `spare` rows after them for the off-ring columns. Point-to-point: every rank
    sends its shard to each other rank and receives theirs straight into their place (one NCCL group of sends and
    receives; no reordering copy where B = 1), started at once, waited for by `wait()`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, group, spare: int = 0):
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        b, s, h, d = k.shape
        self.n_local = s
        self.bufs = [k.new_empty(b, self.world * s + spare, h, d), v.new_empty(b, self.world * s + spare, h, d)]
        sent = [k.detach().contiguous(), v.detach().contiguous()]
        for buf, t in zip(self.bufs, sent):
            buf[:, :s] = t
        self.staged = []  # (receive buffer, destination view) where a step's rows are not contiguous (B > 1)
        ops = []
        for step in range(1, self.world):
            peer = dist.get_global_rank(self.group, (self.rank - step) % self.world)
            to_peer = dist.get_global_rank(self.group, (self.rank + step) % self.world)
            for t in sent:
                ops.append(dist.P2POp(dist.isend, t, peer=to_peer, group=self.group, tag=TAG_KV))
            for buf in self.bufs:
                dst = buf[:, step * s:(step + 1) * s]
                if not dst.is_contiguous():
                    tmp = torch.empty_like(sent[0])
                    self.staged.append((tmp, dst))
                    dst = tmp
                ops.append(dist.P2POp(dist.irecv, dst, peer=peer, group=self.group, tag=TAG_KV))
        self.works = dist.batch_isend_irecv(ops) if ops else []
        self.sent = sent  # kept alive until the sends complete
        self.spare = spare

    def drop(self) -> None:
        """Finish the transfers and free the buffers without using them (a layer that runs the ring after all)."""
        for work in self.works:
            work.wait()
        self.works, self.sent, self.bufs, self.staged = [], None, None, []

    def wait(self, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [B, W * S_local + spare, Hkv, D], contiguous; the spare rows are uninitialised. Views of the
        buffers where they were started with at least that room (and B = 1), else one copy."""
        for work in self.works:
            work.wait()
        for tmp, dst in self.staged:
            dst.copy_(tmp)
        self.works, self.sent, self.staged = [], None, []
        rows = self.world * self.n_local
        if spare > self.spare:
            return tuple(torch.cat([buf[:, :rows], buf.new_empty(buf.shape[0], spare, *buf.shape[2:])], 1)
                         for buf in self.bufs)
        return tuple(buf[:, :rows + spare].contiguous() for buf in self.bufs)


def spare_bound(settings, lists: int, seq_len: int, n_local: int = 0) -> int:
    """Rows to reserve after the gathered shards for the off-ring columns of an index estimated with `settings`
    (`SparseSettings`) before it exists: the sink block and the verticals of `lists` (batch x heads) lists, in whole
    blocks, and with `n_local` (the shard's tokens) the sink's copies of a plan with `sink="replicas"` at lists at
    least `SINK_SHARE` wide. (A plan that outgrows it still works, at the cost of one copy.)"""
    from mtrain.parallel.plan import SINK_SHARE, sink_copies

    bs = settings.block_size
    copies = sink_copies(-(-n_local // bs), SINK_SHARE) if n_local else 0
    return (min(-(-(bs + lists * settings.max_vertical) // bs), -(-seq_len // bs) + 1) + copies) * bs


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
    columns, slots = gathered_columns(plan.columns, plan.rank, world, n_local)
    if plan.columns is not None:
        k_pos = torch.cat([k_pos, plan.columns.positions])
    merged = dataclasses.replace(plan, steps={plan.rank: StepBlocks(ids, counts, k_pos, columns)}, skip=set(),
                                 rects={}, kernel_caches={}, column_origin=plan.rank if columns is not None else None,
                                 gather_slots=slots)
    cache[key] = {"plan": merged}
    return dataclasses.replace(merged, engine=plan.engine)


def _spare_rows(plan: RingPlan) -> int:
    """Rows after the gathered shards: the column slots and the sink's copies (`RingPlan.gather_slots`)."""
    copies = plan.gather_slots[3] if plan.gather_slots is not None else None
    return ((0 if plan.columns is None else plan.columns.positions.numel())
            + (0 if copies is None else copies[1] * plan.block_size))


class RingGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, group, scale: float, gather: KVGather | None, switches: Switches):
        world = dist.get_world_size(group)
        merged = plan if plan.gather_slots is not None else gathered_plan(plan, world)
        col_src, col_dst, n_local, copies = merged.gather_slots
        n_rows = world * n_local
        gather = gather if gather is not None else KVGather(k, v, group, spare=_spare_rows(merged))
        keys, values = gather.wait(spare=_spare_rows(merged))
        n_cols = 0 if col_src is None else col_src.numel()
        if col_src is not None:  # the off-ring columns: copies of gathered rows in the slots after the shards
            keys[:, n_rows:n_rows + n_cols] = keys[:, col_src]
            values[:, n_rows:n_rows + n_cols] = values[:, col_src]
        if copies is not None:  # the sink block's copies, after the column slots
            src, n_copies = copies
            for t in (keys, values):
                t[:, n_rows + n_cols:].unflatten(1, (n_copies, src.numel())).copy_(t[:, src].unsqueeze(1))
        args = step_kwargs(merged, merged.rank, q, keys)
        if merged.engine == "fa4":
            out, lse = fa4_steps.forward(q, keys, values, merged, plan.rank, args["k_pos"], args["columns"], scale)
        else:
            out, lse = partial.attention_forward(q, keys, values, softmax_scale=scale, **args)
        out = out.to(q.dtype)
        save_state(ctx, [q, out, lse, keys, values], merged)  # see mtrain.parallel.saved_state
        ctx.group, ctx.scale, ctx.n_rows = group, scale, n_rows
        ctx.kdtype = k.dtype
        ctx.switches = switches  # the backward runs outside the attention call: it reads the forward's switches
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        (q, out, lse, keys, values), (merged,) = load_state(ctx)
        group, scale, n_rows = ctx.group, ctx.scale, ctx.n_rows
        col_dst, copies = merged.gather_slots[1], merged.gather_slots[3]
        dout = dout.contiguous()
        args = step_kwargs(merged, merged.rank, q, keys)
        if gathered_backward(merged.engine, dist.get_world_size(group), switches=ctx.switches) == "fa4":
            dq, dk, dv = fa4_steps.backward(dout, q, keys, values, out, lse, merged, merged.rank, args["k_pos"],
                                            args["columns"], scale)
        else:
            dq, dk, dv = partial.attention_backward(dout, q, keys, values, out, lse, softmax_scale=scale, **args)
        return (dq.to(q.dtype), *_reduce_kv_grads(dk, dv, col_dst, n_rows, group, ctx.kdtype, copies, ctx.switches),
                None, None, None, None, None)


def _fold_columns(t: torch.Tensor, col_dst: torch.Tensor | None, n_rows: int, copies=None) -> None:
    """Add the column slots' gradients (the col_dst.numel() rows from n_rows of t) into the gathered rows they were
    copied from, then the sink copies' (the rows after them, `RingPlan.gather_slots`) summed over the copies, each in
    fp32 and rounded once to t's dtype (column targets are distinct: padding slots add onto themselves)."""
    acc = accum_dtype(t)
    n_cols = 0
    if col_dst is not None:
        n_cols = col_dst.numel()
        t[:, col_dst] = (t[:, col_dst].to(acc) + t[:, n_rows:n_rows + n_cols].to(acc)).to(t.dtype)
    if copies is not None:
        src, n_copies = copies
        parts = t[:, n_rows + n_cols:n_rows + n_cols + n_copies * src.numel()].unflatten(1, (n_copies, src.numel()))
        t[:, src] = (t[:, src].to(acc) + parts.to(acc).sum(1)).to(t.dtype)


def _reduce_kv_grads(dk, dv, col_dst, n_rows: int, group, dtype, copies=None, switches: Switches | None = None):
    """Sum every shard's dK/dV over the group, each rank receiving its own shard's: the column slots' and sink copies'
    gradients are first folded into the gathered rows they copy (`_fold_columns`), then the shards' rows go
    point-to-point in the kernels' dtype (each rank's part of a row rounded once, as one ring step's part is) and are
    summed in fp32 by the owner in rank order (under parallel.fused_merge, `switches`, in one pass on the GPU). One
    exchange: the columns need no collective of their own.
    Returns (dk, dv) [B, S_local, Hkv, D] in `dtype`."""
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    s = n_rows // world
    if col_dst is not None or copies is not None:
        _fold_columns(dk, col_dst, n_rows, copies)
        _fold_columns(dv, col_dst, n_rows, copies)
    # the shard of rank o sits at step (rank - o) % W of this rank's gathered rows
    rows = lambda t, o: t[:, ((rank - o) % world) * s:((rank - o) % world + 1) * s]  # noqa: E731
    sums = [RankParts.receiving(rows(t, rank), world, rank) for t in (dk, dv)]
    ops = []
    for o in range(world):
        if o == rank:
            continue
        peer = dist.get_global_rank(group, o)
        for t in (dk, dv):
            ops.append(dist.P2POp(dist.isend, rows(t, o).contiguous(), peer=peer, group=group, tag=TAG_GRAD))
        for parts in sums:
            ops.append(dist.P2POp(dist.irecv, parts.part(o), peer=peer, group=group, tag=TAG_GRAD))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    # a fixed order (rank 0 first): the same sum on every run
    return sums[0].sum(dtype, switches=switches), sums[1].sum(dtype, switches=switches)


def ring_gather_attention(q, k, v, plan: RingPlan, group, scale: float, gather: KVGather | None = None, *,
                          switches: Switches | None = None):
    """Sparse attention of the local queries over the group's gathered K/V in one call: q [B, S_local, Hq, D],
    k/v [B, S_local, Hkv, D] -> (out, lse). `gather`: a `KVGather` of k, v already started (e.g. before the
    estimate), else one is started here. The plan must be a sparse one (every step has block lists). switches: the
    run's (`mtrain.ops.switches`; None = the defaults): the backward (parallel.gather_backward, the owners' sum under
    parallel.fused_merge) reads the ones this forward ran with."""
    if any(s is None for s in plan.steps.values()) or plan.rects:
        raise ValueError("the gathered schedule runs sparse plans only; dense layers run the ring")
    return RingGatherAttention.apply(q, k, v, plan, group, scale, gather, or_defaults(switches))


