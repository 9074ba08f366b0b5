"""Bytes one CP rank sends per attention layer and training step, computed from shapes: the ring's KV (and dK/dV)
shards, the off-ring sink + vertical columns (before: an all-reduce of a zero-filled buffer; now: an all-gather of
each owner's rows and a reduce-scatter of their gradients) and the online estimate's collectives. Ring
collectives are counted as NCCL's ring algorithms send them: all-reduce 2(W-1)/W x N, all-gather and
reduce-scatter (W-1) x the per-rank part."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mtrain.errors import MtrainError
from mtrain.parallel.estimate import first_round


@dataclass(frozen=True)
class LayerTraffic:
    """Bytes one rank sends for one layer (forward + backward of a training step)."""

    ring_kv: int
    """KV shards around the ring: forward W - 1 hops; backward W - 2 hops of KV and W - 1 of fp32 dK/dV."""
    columns_before: int
    """Sink + vertical columns as an all-reduce of [2, B, U, Hkv, D] (forward, 16-bit) and of its fp32 gradients."""
    columns_after: int
    """The same as an all-gather of each owner's rows (padded to `per_rank`) and a reduce-scatter of the gradients."""
    estimate: int
    """The online estimate's collectives (scored queries, softmax max/sum, block masses, vertical candidates), with
    the vertical candidates' first round only (`mtrain.parallel.estimate.first_round`: the whole exchange in groups of
    up to `ONE_ROUND_WORLD` ranks; beyond, a second round, sent where the first cannot be proven exact, costs
    `estimate_before`'s candidates again)."""
    estimate_before: int
    """The same with every rank sending its best max_vertical candidates per head (the exchange before)."""
    columns: int
    """U: sink tokens + distinct vertical columns gathered."""
    per_rank: int
    """P: rows the rank owning the most columns sends (the all-gather pads every rank to it)."""

    @property
    def side_before(self) -> int:
        return self.columns_before + self.estimate_before

    @property
    def side_after(self) -> int:
        return self.columns_after + self.estimate

    def as_dict(self) -> dict:
        return {**asdict(self), "side_before": self.side_before, "side_after": self.side_after}


def _all_reduce(n_bytes: float, world: int) -> float:
    return 2 * (world - 1) / world * n_bytes


def expected_per_rank(columns: int, world: int, sink: int) -> int:
    """Rows the busiest owner sends when `columns` (sink included) lie at random positions: the sink block's
    tokens all sit on one rank, the verticals spread evenly (plus a one-sigma binomial margin)."""
    share = max(columns - sink, 0) / world
    return sink + math.ceil(share + math.sqrt(share))


def layer_traffic(*, world: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int, columns: int,
                  per_rank: int | None = None, batch: int = 1, bytes_per_elem: int = 2, block_size: int = 64,
                  scored_rows: int = 64 + 16 * 64, vertical_cap: int = 16384, share_kv_group: bool = False,
                  sparse: bool = True) -> LayerTraffic:
    """Bytes one rank of a `world`-rank ring sends for one attention layer of a training step (fwd + bwd).

    columns: U, the sink tokens plus the distinct vertical columns of the layer's index (all heads);
    per_rank: the most of them one rank owns (default `expected_per_rank`). scored_rows / vertical_cap /
    share_kv_group: the estimator's settings (last_q + sample_blocks x sample rows; max_vertical).
    sparse=False: a dense ring (no columns, no estimate)."""
    for name, value in (("world", world), ("seq_len", seq_len), ("q_heads", q_heads), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("batch", batch), ("bytes_per_elem", bytes_per_elem),
                        ("block_size", block_size)):
        if value < 1:
            raise MtrainError(f"traffic: {name} must be >= 1; got {value}")
    if columns < 0 or seq_len % world:
        raise MtrainError(f"traffic: need columns >= 0 and seq_len divisible by world; got {columns}, {seq_len} / {world}")
    s_local = seq_len // world
    kv_shard = batch * s_local * kv_heads * head_dim * 2  # K and V elements
    ring_kv = (world - 1) * kv_shard * bytes_per_elem + max(world - 2, 0) * kv_shard * bytes_per_elem \
        + (world - 1) * kv_shard * 4
    if not sparse or world == 1:
        return LayerTraffic(int(ring_kv), 0, 0, 0, 0, 0, 0)
    sink = min(block_size, seq_len)
    per_rank = expected_per_rank(columns, world, sink) if per_rank is None else per_rank
    row = batch * 2 * kv_heads * head_dim  # one column's K and V
    before = _all_reduce(columns * row * bytes_per_elem, world) + _all_reduce(columns * row * 4, world)
    after = (world - 1) * per_rank * row * bytes_per_elem + (world - 1) * per_rank * row * 4
    n_blocks = -(-seq_len // block_size)
    heads_sel = kv_heads if share_kv_group else q_heads
    full = min(vertical_cap, s_local)
    first = first_round(full, vertical_cap, world)
    rest = (_all_reduce(batch * scored_rows * q_heads * head_dim * bytes_per_elem, world)  # scored queries
            + 2 * _all_reduce(batch * q_heads * scored_rows * 4, world)  # softmax max and sum
            + 2 * _all_reduce(batch * q_heads * n_blocks * 4, world)  # slash masses, before and after verticals
            + 2 * _all_reduce(batch * q_heads * 4, world))  # kept-block mass, est_recall

    def candidates(n: int) -> float:  # vertical candidates: mass fp32 + position int64 (+ the last mass sent)
        return (world - 1) * batch * heads_sel * (n * (4 + 8) + (4 if n < full else 0))

    return LayerTraffic(int(ring_kv), int(before), int(after), int(rest + candidates(first)),
                        int(rest + candidates(full)), int(columns), int(per_rank))


def plan_traffic(plan, *, q_heads: int, kv_heads: int, head_dim: int, batch: int = 1, bytes_per_elem: int = 2,
                 **estimate_settings) -> LayerTraffic:
    """`layer_traffic` of a real sparse `RingPlan`: U and the busiest owner's rows read from its column tables."""
    world = len(plan.positions)
    cols = plan.columns
    columns = 0 if cols is None else int((cols.owner >= 0).sum())
    per_rank = 0 if cols is None else cols.per_rank
    return layer_traffic(world=world, seq_len=plan.seq_len, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                         columns=columns, per_rank=per_rank, batch=batch, bytes_per_elem=bytes_per_elem,
                         **estimate_settings)
