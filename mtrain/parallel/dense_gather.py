"""Dense layers of a context-parallel group as one varlen call per rank (`parallel.dense_schedule: gather`): every
rank fetches the keys its rows read from the ranks that hold them (one all-to-all per layer, only those keys) and
runs its query rows against them with the dense kernel of one device (`mtrain.ops.varlen`: FlashAttention-4's
varlen kernel where it runs), documents or not: no ring steps, no LSE merge. Without documents a rank reads every
key up to its last row (as the all-gather scheme Llama 3 trained with); with them only its documents' keys, so a
pack whose documents each lie within one rank's rows moves no keys at all and the call is one device's.

It needs a layout whose shard is a few runs of consecutive positions (contiguous: one, zigzag: two, balanced for
causal work); a run [g0, g1) and a document [d0, d1) crossing it give one varlen entry, queries [max(d0, g0),
min(d1, g1)) against keys [d0, min(d1, g1)), causal from the bottom right. The plan (`_Plan`) is the same arithmetic
on every rank, from the layout and the documents alone (no exchange of sizes): the pieces of each entry's key range
by owning rank, what each rank sends to each other one, and where each key of the call lies among this rank's own
keys and the received ones. The keys of the call are then one gather from those, in entry order (none when the
rank's own keys already are that order). dK/dV are added up in fp32, the received keys' parts sent back to their
owners in a second all-to-all. Memory: the shard's K/V plus the keys received (at most the group's).
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
_PLANS: dict = {}


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
    order): query lengths, key lengths, and each entry's key range (row, start, stop) in sequence positions. Without
    documents one entry per (row, run): the keys up to the run's end; with them one per document crossing the run:
    that document's keys up to the run's end."""
    q_lengths, k_lengths, ranges = [], [], []
    for b in range(batch):
        for l0, l1, g0 in runs:
            g1 = g0 + (l1 - l0)
            if documents is None:
                q_lengths.append(g1 - g0)
                k_lengths.append(g1)
                ranges.append((b, 0, g1))
                continue
            for d0, n in zip(documents.starts(b), documents.lengths[b]):
                d1 = d0 + n
                if d1 <= g0 or d0 >= g1:
                    continue
                q_lengths.append(min(d1, g1) - max(d0, g0))
                k_lengths.append(min(d1, g1) - d0)
                ranges.append((b, d0, min(d1, g1)))
    return q_lengths, k_lengths, ranges


def _pieces(ranges, all_runs, shard_len: int) -> list[tuple[int, int, int]]:
    """Key ranges (row, start, stop) in sequence positions split by the rank holding them, in sequence order:
    (owner, flat start, flat stop), flat = row * shard_len + position within the owner's shard."""
    out = []
    for b, a, c in ranges:
        parts = []
        for owner, runs in enumerate(all_runs):
            for l0, l1, g0 in runs:
                lo, hi = max(a, g0), min(c, g0 + (l1 - l0))
                if lo < hi:
                    parts.append((lo, owner, b * shard_len + l0 + lo - g0, b * shard_len + l0 + hi - g0))
        out += [p[1:] for p in sorted(parts)]
    return out


def _merge(intervals) -> list[tuple[int, int]]:
    """The union of [lo, hi) intervals, as sorted disjoint ones."""
    merged: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _aranges(intervals) -> torch.Tensor:
    """The positions of [lo, hi) intervals, one after another."""
    if not intervals:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(lo, hi) for lo, hi in intervals])


# at most this many copied pieces make the call's keys by slice copies (else one indexed gather)
MAX_PIECES = 32


class _Plan:
    """What the gathered dense call of `rank` moves and reads (module docstring), for the group's layout, batch and
    documents: `segments` (the varlen entries); `exchange` (False when no rank of the group reads another's keys:
    every rank skips both all-to-alls); `send_counts` / `send_rows` (this rank's own flat rows each other rank reads,
    by rank; `send_unique` / `send_inverse` the same rows once each); `recv_counts` (the rows received from each
    rank); `pieces` ((source, start, stop, at): the call's keys as copies of own (source 0) or received (1) rows,
    placed at `at`, in order) or None when the call reads exactly the own rows in order; `index` (the same keys as
    one index into [own ++ received] rows, on the device: the forward's gather past MAX_PIECES pieces, the
    backward's sums where an own row is read twice; else None); `own_once` (no own row is read twice: its
    gradient is one copy, not a sum)."""

    def __init__(self, layout, runs, rank: int, batch: int, seq_len: int, documents, device):
        world = layout.world_size
        shard_len = seq_len // world
        all_runs = [query_runs(layout, seq_len, r) for r in range(world)]
        if any(r is None for r in all_runs):  # (gather_runs refused these layouts already)
            raise MtrainError(f"the gathered dense call needs shards of at most {MAX_RUNS} runs; {layout!r} has more")
        entries = [_key_ranges(all_runs[r], batch, documents) for r in range(world)]  # (runs is all_runs[rank])
        q_lengths, k_lengths, _ = entries[rank]
        self.segments = Segments.build(q_lengths, k_lengths, device)
        pieces_of = [_pieces(ranges, all_runs, shard_len) for _, _, ranges in entries]
        # what each rank reads from each other one, as merged flat intervals of the owner's shard
        reads = [[_merge([(lo, hi) for s, lo, hi in pieces_of[r] if s == owner]) if owner != r else []
                  for owner in range(world)] for r in range(world)]
        self.exchange = any(reads[r][s] for r in range(world) for s in range(world))
        self.send_counts = [sum(hi - lo for lo, hi in reads[j][rank]) for j in range(world)]
        self.send_rows = _aranges([iv for j in range(world) for iv in reads[j][rank]])
        self.send_unique, self.send_inverse = (t.to(device) for t in torch.unique(self.send_rows, return_inverse=True))
        self.send_rows = self.send_rows.to(device)
        self.recv_counts = [sum(hi - lo for lo, hi in reads[rank][s]) for s in range(world)]
        own = batch * shard_len
        mine = pieces_of[rank]
        own_spans = [(lo, hi) for s, lo, hi in mine if s == rank]
        self.own_once = sum(hi - lo for lo, hi in own_spans) == sum(hi - lo for lo, hi in _merge(own_spans))
        self.pieces = self.index = None
        if all(s == rank for s, _, _ in mine) and _merge(own_spans) == [(0, own)] and self.own_once \
                and sorted(mine) == mine:
            return  # the call reads the own rows, each once, in order
        base, offset = {}, 0  # where each received interval starts among the received rows
        for s in range(world):
            for lo, hi in reads[rank][s]:
                base[(s, lo)] = offset
                offset += hi - lo
        pieces, at = [], 0
        for s, lo, hi in mine:
            if s == rank:
                src, a = 0, lo
            else:
                start = max(iv_lo for iv_lo, _ in reads[rank][s] if iv_lo <= lo)
                src, a = 1, base[(s, start)] + lo - start
            n = hi - lo
            if pieces and pieces[-1][0] == src and pieces[-1][2] == a:  # continues the last piece (placed just before)
                pieces[-1] = (src, pieces[-1][1], a + n, pieces[-1][3])
            else:
                pieces.append((src, a, a + n, at))
            at += n
        self.pieces = pieces
        if len(pieces) > MAX_PIECES or not self.own_once:  # (the backward's sums need it; on the device once)
            index = _aranges([(lo + (own if src else 0), hi + (own if src else 0)) for src, lo, hi, _ in pieces])
            self.index = index.to(device)


def _plan(layout, runs, rank: int, batch: int, seq_len: int, documents, device) -> _Plan:
    """The rank's `_Plan`: cached on the documents (built once per batch) or per shape and layout, so a layer copies
    nothing to the device."""
    cache = _PLANS if documents is None else documents.cache
    key = ("dense_gather", layout.spec, runs, rank, batch, seq_len, str(device))
    if key not in cache:
        if documents is None and len(_PLANS) > 64:
            _PLANS.clear()
        cache[key] = _Plan(layout, runs, rank, batch, seq_len, documents, device)
    return cache[key]


class _FetchKV(torch.autograd.Function):
    """The keys of the call, k and v [Tk, Hkv, D] each, from this rank's k, v [B, S_local, Hkv, D] and the rows the
    other ranks send (`_Plan`). Backward: each key's gradient to the own or received row it came from (added up in
    fp32 where a row is read twice), the received rows' parts sent back to their owners and added, in fp32, to the
    own rows they came from."""

    @staticmethod
    def forward(ctx, k, v, group, plan):
        B, Sl, H, D = k.shape
        own = (k.reshape(B * Sl, H, D), v.reshape(B * Sl, H, D))
        received = (own[0][:0], own[1][:0])
        if plan.exchange:
            buf = k.new_empty((sum(plan.recv_counts), 2, H, D))
            dist.all_to_all_single(buf, torch.stack([t[plan.send_rows] for t in own], dim=1),
                                   output_split_sizes=plan.recv_counts, input_split_sizes=plan.send_counts,
                                   group=group)
            received = (buf[:, 0], buf[:, 1])
        if plan.pieces is None:
            keys = own
        elif len(plan.pieces) > MAX_PIECES:
            keys = tuple(torch.cat((o, r))[plan.index] for o, r in zip(own, received))
        else:
            keys = tuple(o.new_empty((plan.segments.total_k, H, D)) for o in own)
            for src, lo, hi, at in plan.pieces:
                for key, whole in zip(keys, received if src else own):
                    key[at:at + hi - lo] = whole[lo:hi]
        ctx.group, ctx.plan, ctx.shape, ctx.dtype = group, plan, (B, Sl, H, D), k.dtype
        return keys

    @staticmethod
    def backward(ctx, dk, dv):
        plan, (B, Sl, H, D) = ctx.plan, ctx.shape
        own_n, recv_n = B * Sl, sum(plan.recv_counts)
        grads = [torch.zeros((plan.segments.total_k, H, D), dtype=ctx.dtype, device=plan.send_rows.device)
                 if g is None else g for g in (dk, dv)]
        if plan.pieces is None:  # nothing received; others read these rows (else the call had no _FetchKV)
            own = [g.float() for g in grads]
            received = [g.new_zeros((0, H, D), dtype=torch.float32) for g in grads]
        elif plan.index is not None:
            pools = [g.new_zeros((own_n + recv_n, H, D), dtype=torch.float32) for g in grads]
            for pool, g in zip(pools, grads):
                pool.index_add_(0, plan.index, g.float())
            own, received = [p[:own_n] for p in pools], [p[own_n:] for p in pools]
        else:  # each own row read once: its gradient is a copy; received rows (maybe read twice) add up in fp32
            own = [g.new_zeros((own_n, H, D)) for g in grads]
            received = [g.new_zeros((recv_n, H, D), dtype=torch.float32) for g in grads]
            for src, lo, hi, at in plan.pieces:
                for o, r, g in zip(own, received, grads):
                    if src:
                        r[lo:hi] += g[at:at + hi - lo]
                    else:
                        o[lo:hi] = g[at:at + hi - lo]
        if plan.exchange:
            back = grads[0].new_empty((sum(plan.send_counts), 2, H, D), dtype=torch.float32)
            dist.all_to_all_single(back, torch.stack(received, dim=1), output_split_sizes=plan.send_counts,
                                   input_split_sizes=plan.recv_counts, group=ctx.group)
            for i, o in enumerate(own):
                rows = o[plan.send_unique].float()
                rows.index_add_(0, plan.send_inverse, back[:, i])
                o[plan.send_unique] = rows.to(o.dtype)
        return own[0].to(ctx.dtype).view(B, Sl, H, D), own[1].to(ctx.dtype).view(B, Sl, H, D), None, None


def gathered_dense_attention(q, k, v, runs, layout, group, scale: float, documents=None, backend=None):
    """Causal dense attention of this rank's rows (q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D], shards of
    `layout`, whose rows are `runs`: `query_runs`) against the whole group's keys, within `documents`
    (`mtrain.ops.varlen.Documents` of the whole sequence, or None). backend: `varlen_attention`'s.
    Returns out [B, S_local, Hq, D]."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    B, Sl = q.shape[:2]
    seq_len = Sl * world
    plan = _plan(layout, runs, rank, B, seq_len, documents, q.device)
    flat_q = q.reshape(B * Sl, *q.shape[2:])
    if plan.pieces is None and not plan.exchange:  # every key this rank reads is its own, in order: one device's call
        k_call, v_call = k.reshape(B * Sl, *k.shape[2:]), v.reshape(B * Sl, *v.shape[2:])
    else:
        k_call, v_call = _FetchKV.apply(k, v, group, plan)
    out = varlen_attention(flat_q, k_call, v_call, plan.segments, scale, backend)
    return out.view(q.shape)
