"""Dense layers of a context-parallel group as one varlen call per rank (`parallel.dense_schedule: gather`): every
rank all-gathers the group's K/V once per layer (small under GQA) and runs its query rows against the keys they
read with the dense kernel of one device (`mtrain.ops.varlen`: FlashAttention-4's varlen kernel where it runs),
documents or not. This is the all-gather scheme Llama 3 trained with: no ring steps, no LSE merge.

It needs a layout whose shard is a few runs of consecutive positions (contiguous: one, zigzag: two, balanced for
causal work); a run [g0, g1) and a document [d0, d1) crossing it give one varlen entry, queries [max(d0, g0),
min(d1, g1)) against keys [d0, min(d1, g1)), causal from the bottom right. The keys each entry reads are copied out
of the gathered shards into one packed tensor (a key two runs read is copied twice), so the whole rank is one call.
dK/dV are added back in fp32 and go to their owners in one reduce-scatter. Memory: the group's K/V of the layer on
every rank (cp_size x the shard's), and an fp32 buffer of that size in the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError
from mtrain.ops.varlen import Segments, varlen_attention

DENSE_SCHEDULES = ("auto", "ring", "gather")
# the most runs of consecutive positions a shard may have for the gathered dense call
MAX_RUNS = 4

_RUNS: dict = {}
_SEGMENTS: dict = {}


def query_runs(layout, seq_len: int, rank: int) -> tuple[tuple[int, int, int], ...] | None:
    """This rank's rows as runs of consecutive positions, (local start, local stop, global start) each, or None when
    the layout's shard has more than MAX_RUNS of them (stripe and block-stripe layouts). Cached per layout."""
    key = (layout.spec, seq_len, rank)
    if key not in _RUNS:
        pos = layout.indices(seq_len, rank).cpu()
        breaks = (torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1).tolist()
        edges = [0, *breaks, pos.numel()]
        runs = tuple((a, b, int(pos[a])) for a, b in zip(edges[:-1], edges[1:]))
        _RUNS[key] = runs if len(runs) <= MAX_RUNS else None
    return _RUNS[key]


def gather_runs(layout, seq_len: int, rank: int, dense_schedule: str):
    """The runs the gathered dense call runs for `dense_schedule` (DENSE_SCHEDULES), or None for the ring."""
    if dense_schedule not in DENSE_SCHEDULES:
        raise MtrainError(f"parallel.dense_schedule must be one of {', '.join(DENSE_SCHEDULES)}; got {dense_schedule!r}")
    if dense_schedule == "ring":
        return None
    runs = query_runs(layout, seq_len, rank)
    if runs is None and dense_schedule == "gather":
        raise MtrainError(f"parallel.dense_schedule gather needs a layout whose shards are at most {MAX_RUNS} runs of "
                          f"consecutive positions (contiguous, zigzag); {layout!r} is not: use dense_schedule auto "
                          "(the ring there) or parallel.layout zigzag")
    return runs


def _key_ranges(runs, batch: int, documents) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
    """The varlen entries of this rank's rows, in the order of q [B, S_local] flattened (row by row, each row's runs in
    order): query lengths, key lengths, and each (row, run)'s key range (row, start, stop) in sequence positions.
    Without documents one entry per (row, run): the keys up to the run's end; with them one per document crossing
    the run: that document's keys up to the run's end (consecutive ranges, so one range per (row, run))."""
    q_lengths, k_lengths, ranges = [], [], []
    for b in range(batch):
        for l0, l1, g0 in runs:
            g1 = g0 + (l1 - l0)
            if documents is None:
                q_lengths.append(g1 - g0)
                k_lengths.append(g1)
                ranges.append((b, 0, g1))
                continue
            first = None
            for d0, n in zip(documents.starts(b), documents.lengths[b]):
                d1 = d0 + n
                if d1 <= g0 or d0 >= g1:
                    continue
                first = d0 if first is None else first
                q_lengths.append(min(d1, g1) - max(d0, g0))
                k_lengths.append(min(d1, g1) - d0)
            ranges.append((b, first, g1))
    return q_lengths, k_lengths, ranges


def _plan(layout, runs, batch: int, seq_len: int, documents, device):
    """(Segments, (shard, row, sequence row) index tensors of every key the call reads, in packing order): cached on
    the documents (built once per batch) or per shape and layout, so a layer copies nothing to the device."""
    cache = _SEGMENTS if documents is None else documents.cache
    key = (layout.spec, runs, batch, seq_len, str(device))
    if key not in cache:
        q_lengths, k_lengths, ranges = _key_ranges(runs, batch, documents)
        to_sequence = _to_sequence(layout, seq_len, device)
        shard_len = seq_len // layout.world_size
        at = torch.cat([to_sequence[start:stop] for _, start, stop in ranges])
        rows = torch.cat([torch.full((stop - start,), b, dtype=torch.long) for b, start, stop in ranges]).to(device)
        if documents is None and len(_SEGMENTS) > 64:
            _SEGMENTS.clear()
        cache[key] = (Segments.build(q_lengths, k_lengths, device), (at // shard_len, rows, at % shard_len))
    return cache[key]


_TO_SEQUENCE: dict = {}


def _to_sequence(layout, seq_len: int, device):
    """Where each sequence position lies among the ranks' shards laid one after another (the gathered K/V's rows), on
    the device, cached per layout (no copy to the device per layer)."""
    key = (layout.spec, seq_len, str(device))
    if key not in _TO_SEQUENCE:
        if len(_TO_SEQUENCE) > 16:
            _TO_SEQUENCE.clear()
        order = torch.cat([layout.indices(seq_len, r) for r in range(layout.world_size)])
        _TO_SEQUENCE[key] = torch.argsort(order).to(device)
    return _TO_SEQUENCE[key]


class _GatherKV(torch.autograd.Function):
    """All-gather this rank's k, v [B, S_local, Hkv, D] and pack the keys the call reads (`_plan`'s index: gathered
    shard, batch row, row within the shard, per key), k and v [Tk, Hkv, D] each; only those keys are copied.
    Backward: their gradients added in fp32 into the gathered shards' places (a key read by two entries gets both),
    then reduce-scattered back to their owners."""

    @staticmethod
    def forward(ctx, k, v, group, where):
        world = dist.get_world_size(group)
        B, Sl, H, D = k.shape
        local = torch.stack((k, v), dim=2).contiguous()  # [B, Sl, 2, H, D]: one collective for both
        buf = torch.empty((world * B, Sl, 2, H, D), dtype=k.dtype, device=k.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name, where it is
        gather(buf, local, group=group)
        shard, row, at = where
        both = buf.view(world, B, Sl, 2, H, D)[shard, row, at]  # [Tk, 2, H, D]
        ctx.group, ctx.world, ctx.dtype, ctx.shape = group, world, k.dtype, (world, B, Sl, 2, H, D)
        ctx.save_for_backward(shard, row, at)
        return both[:, 0].contiguous(), both[:, 1].contiguous()

    @staticmethod
    def backward(ctx, dk, dv):
        shard, row, at = ctx.saved_tensors
        world, B, Sl, _, H, D = ctx.shape
        parts = torch.zeros(ctx.shape, dtype=torch.float32, device=shard.device)
        for i, g in enumerate((dk, dv)):
            if g is not None:
                parts.index_put_((shard, row, at, torch.full_like(at, i)), g.float(), accumulate=True)
        mine = torch.empty((B, Sl, 2, H, D), dtype=torch.float32, device=parts.device)
        dist.reduce_scatter_tensor(mine, parts.view(world * B, Sl, 2, H, D), group=ctx.group)
        return mine[:, :, 0].to(ctx.dtype), mine[:, :, 1].to(ctx.dtype), None, None


def gathered_dense_attention(q, k, v, runs, layout, group, scale: float, documents=None, backend=None):
    """Causal dense attention of this rank's rows (q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D], shards of
    `layout`, whose rows are `runs`: `query_runs`) against the whole group's keys, within `documents`
    (`mtrain.ops.varlen.Documents` of the whole sequence, or None). backend: `varlen_attention`'s.
    Returns out [B, S_local, Hq, D]."""
    world = dist.get_world_size(group)
    B, Sl = q.shape[:2]
    seq_len = Sl * world
    seg, where = _plan(layout, runs, B, seq_len, documents, q.device)
    k_packed, v_packed = _GatherKV.apply(k, v, group, where)
    out = varlen_attention(q.reshape(B * Sl, *q.shape[2:]), k_packed, v_packed, seg, scale, backend)
    return out.view(q.shape)
