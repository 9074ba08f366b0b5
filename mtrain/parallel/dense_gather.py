"""Dense layers of a context-parallel group as one varlen call per query run (`parallel.dense_schedule: gather`):
every rank all-gathers the group's K/V once per layer (small under GQA), puts them in sequence order, and runs its
query rows against them with the dense kernel of one device (`mtrain.ops.varlen`: FlashAttention-4's varlen kernel
where it runs), documents or not. This is the all-gather scheme Llama 3 trained with: no ring steps, no LSE merge.

It needs a layout whose shard is a few runs of consecutive positions (contiguous: one, zigzag: two, balanced for
causal work); a run [g0, g1) and a document [d0, d1) crossing it give one varlen entry, queries [max(d0, g0),
min(d1, g1)) against keys [d0, min(d1, g1)), causal from the bottom right. One run's entries read consecutive key
ranges, so its keys are one slice of the gathered sequence. dK/dV go back to their owners in one reduce-scatter,
summed in fp32. Memory: the group's K/V of the layer on every rank (cp_size x the shard's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError
from mtrain.ops.varlen import Segments, varlen_attention

DENSE_SCHEDULES = ("auto", "ring", "gather")
# the most runs of consecutive positions a shard may have for the gathered dense call (one varlen call per run)
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


def _run_segments(runs, batch: int, seq_len: int, documents, device):
    """Per run: (Segments, key start per batch row). Without documents one entry per row (all keys up to the run's
    end); with them one per (row, document crossing the run). Cached on the documents (built once per batch) or per
    shape, so a layer copies nothing to the device."""
    cache = _SEGMENTS if documents is None else documents.cache
    key = (runs, batch, seq_len, str(device))
    if key in cache:
        return cache[key]
    out = []
    for l0, l1, g0 in runs:
        g1 = g0 + (l1 - l0)
        q_lengths, k_lengths, k_starts = [], [], []
        for b in range(batch):
            if documents is None:
                q_lengths.append(g1 - g0)
                k_lengths.append(g1)
                k_starts.append(0)
                continue
            first = None
            for d0, n in zip(documents.starts(b), documents.lengths[b]):
                d1 = d0 + n
                if d1 <= g0 or d0 >= g1:
                    continue
                first = d0 if first is None else first
                q_lengths.append(min(d1, g1) - max(d0, g0))
                k_lengths.append(min(d1, g1) - d0)
            k_starts.append(first)
        out.append((Segments.build(q_lengths, k_lengths, device), tuple(k_starts)))
    if documents is None and len(_SEGMENTS) > 64:
        _SEGMENTS.clear()
    cache[key] = out
    return out


_ORDERS: dict = {}


def _orders(layout, seq_len: int, device):
    """(order, to_sequence): the sequence positions of the ranks' shards one after another, and its inverse
    permutation; on the device, cached per layout (no copy to the device per layer)."""
    key = (layout.spec, seq_len, str(device))
    if key not in _ORDERS:
        if len(_ORDERS) > 16:
            _ORDERS.clear()
        order = torch.cat([layout.indices(seq_len, r) for r in range(layout.world_size)])
        _ORDERS[key] = (order.to(device), torch.argsort(order).to(device))
    return _ORDERS[key]


class _GatherKV(torch.autograd.Function):
    """All-gather this rank's k, v [B, S_local, Hkv, D] into the whole sequence's and hand out the key ranges of each
    run: per run, k and v [sum over rows of the row's range, Hkv, D] (a row's range [start_b, stop)). Backward: the
    runs' gradients summed in fp32 into the whole sequence's, then reduce-scattered back to their owners."""

    @staticmethod
    def forward(ctx, k, v, group, order, to_sequence, ranges):
        world = dist.get_world_size(group)
        local = torch.stack((k, v)).contiguous()  # [2, B, Sl, Hkv, D]
        _, B, Sl, H, D = local.shape
        buf = torch.empty((world * 2, B, Sl, H, D), dtype=local.dtype, device=local.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name, where it is
        gather(buf, local, group=group)
        whole = buf.view(world, 2, B, Sl, H, D).permute(1, 2, 0, 3, 4, 5).reshape(2, B, world * Sl, H, D)
        whole = whole.index_select(2, to_sequence)
        ctx.group, ctx.world, ctx.dtype, ctx.ranges, ctx.shape = group, world, k.dtype, ranges, whole.shape
        ctx.save_for_backward(order)
        out = []
        for starts, stop in ranges:
            rows = [whole[:, b, start:stop] for b, start in enumerate(starts)]
            both = rows[0] if B == 1 else torch.cat(rows, dim=1)
            out += [both[0], both[1]]
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        (order,) = ctx.saved_tensors
        whole = torch.zeros(ctx.shape, dtype=torch.float32, device=order.device)
        for r, (starts, stop) in enumerate(ctx.ranges):
            for i, g in enumerate(grads[2 * r: 2 * r + 2]):
                if g is None:
                    continue
                at = 0
                for b, start in enumerate(starts):
                    whole[i, b, start:stop] += g[at:at + stop - start].float()
                    at += stop - start
        _, B, S, H, D = whole.shape
        Sl = S // ctx.world
        parts = whole.index_select(2, order).view(2, B, ctx.world, Sl, H, D).permute(2, 0, 1, 3, 4, 5)
        parts = parts.reshape(ctx.world * 2, B, Sl, H, D)
        mine = torch.empty((2, B, Sl, H, D), dtype=parts.dtype, device=parts.device)
        dist.reduce_scatter_tensor(mine, parts, group=ctx.group)
        return mine[0].to(ctx.dtype), mine[1].to(ctx.dtype), None, None, None, None


def gathered_dense_attention(q, k, v, runs, layout, group, scale: float, documents=None, backend=None):
    """Causal dense attention of this rank's rows (q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D], shards of
    `layout`, whose rows are `runs`: `query_runs`) against the whole group's keys, within `documents`
    (`mtrain.ops.varlen.Documents` of the whole sequence, or None). backend: `varlen_attention`'s.
    Returns out [B, S_local, Hq, D]."""
    world = dist.get_world_size(group)
    B, Sl = q.shape[:2]
    seq_len = Sl * world
    order, to_sequence = _orders(layout, seq_len, q.device)
    segments = _run_segments(runs, B, seq_len, documents, q.device)
    ranges = tuple((k_starts, g0 + (l1 - l0)) for (l0, l1, g0), (_, k_starts) in zip(runs, segments))
    kv = _GatherKV.apply(k, v, group, order, to_sequence, ranges)
    pieces = []
    for r, ((l0, l1, _), (seg, _)) in enumerate(zip(runs, segments)):
        qr = q[:, l0:l1].reshape(B * (l1 - l0), *q.shape[2:])
        pieces.append(varlen_attention(qr, kv[2 * r], kv[2 * r + 1], seg, scale, backend)
                      .view(B, l1 - l0, *q.shape[2:]))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
