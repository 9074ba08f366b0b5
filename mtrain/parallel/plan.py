"""What each ring step of one rank computes: a global SparseIndex remapped to local block lists, with the
sink block and vertical columns taken off the ring into one local pass; built once, used by fwd and bwd."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from mtrain.ops.index import compact
from mtrain.parallel.dense_rects import Rect, dense_rects
from mtrain.parallel.layout import Layout

@dataclass
class StepBlocks:
    """Local key-block lists of one ring step: ids [B, Hq, nQB_local, M] int32 sorted, -1 padded; counts."""

    ids: torch.Tensor
    counts: torch.Tensor

    def as_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids, self.counts


@dataclass
class OffRingColumns:
    """Sink block + vertical columns, attended locally against K/V gathered once from their owners.

    positions [U] global positions (padding = seq_len, causally invisible), owner/local [U] where each
    lives (-1 for padding), ids [B, Hq, nQB_local, C] int32 indices into positions, sorted, -1 padded.
    """

    positions: torch.Tensor
    owner: torch.Tensor
    local: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor


@dataclass
class RingPlan:
    """Everything one rank needs to run a ring: positions of every rank's shard, the local block size,
    per-origin block lists (None = dense), origins with nothing to compute, the off-ring pass, and for
    dense steps that are unions of full/causal rectangles, those rectangles (run by fused SDPA kernels)."""

    seq_len: int
    rank: int
    block_size: int
    positions: list[torch.Tensor]
    steps: dict[int, StepBlocks | None]
    skip: set[int]
    columns: OffRingColumns | None
    rects: dict[int, list[Rect] | None] = field(default_factory=dict)
    doc_ids: torch.Tensor | None = None
    """Global document ids [B, seq_len] (packed samples) or None; see `with_documents`."""

    @property
    def q_pos(self) -> torch.Tensor:
        return self.positions[self.rank]

    def docs(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Document ids [B, n] of the tokens at global `positions` (padding positions >= seq_len read the
        last token's id: they are causally invisible anyway), or None without document masking."""
        if self.doc_ids is None:
            return None
        return self.doc_ids[:, positions.clamp(max=self.seq_len - 1)]

    def with_documents(self, doc_ids: torch.Tensor) -> "RingPlan":
        """A copy (cached plans stay untouched) whose steps keep only same-document pairs. The dense
        rectangles are dropped: a fused SDPA rectangle cannot mask documents, so those steps run the
        partial kernels, which take the ids (and on the GPU skip the blocks of other documents)."""
        return dataclasses.replace(self, rects={}, doc_ids=doc_ids)


@functools.lru_cache(maxsize=16)
def _positions_cached(spec: tuple, seq_len: int, device: str) -> tuple[torch.Tensor, ...]:
    layout = Layout.create(*spec)
    return tuple(layout.indices(seq_len, r).to(device) for r in range(layout.world_size))


@functools.lru_cache(maxsize=16)
def _owners_cached(spec: tuple, seq_len: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    owner, local = Layout.create(*spec).owners(seq_len)
    return owner.to(device), local.to(device)


def _all_positions(layout: Layout, seq_len: int, device: torch.device) -> list[torch.Tensor]:
    """Every rank's positions on `device`; cached, since every layer of a step asks for the same ones."""
    return list(_positions_cached(layout.spec, seq_len, str(device)))


def dense_plan(layout: Layout, seq_len: int, rank: int, device: torch.device) -> RingPlan:
    """Dense causal: every visiting shard in full, except shards wholly in this rank's future (cached:
    the plan depends only on the layout, length, rank and device)."""
    return _dense_plan_cached(layout.spec, seq_len, rank, str(device))


@functools.lru_cache(maxsize=16)
def _dense_plan_cached(spec: tuple, seq_len: int, rank: int, device: str) -> RingPlan:
    layout = Layout.create(*spec)
    positions = _all_positions(layout, seq_len, device)
    mine = positions[rank]
    skip = {r for r, pos in enumerate(positions) if int(pos.min()) > int(mine.max())}
    block = math.gcd(seq_len // layout.world_size, 64)
    cpu = [p.cpu() for p in positions]
    rects = {r: dense_rects(cpu[rank], cpu[r], same_shard=r == rank) for r in range(layout.world_size) if r not in skip}
    return RingPlan(seq_len, rank, block, positions, {r: None for r in range(layout.world_size)}, skip, None, rects)


def _pack(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the valid (>= 0) ids of each list to the front, keeping their order; (ids int32, counts).
    The lists built here are already ascending (layouts keep a rank's positions ascending within each
    of its runs, and the global lists are sorted), so no sort is needed."""
    return compact(ids >= 0, ids)


def _key_block_table(positions: torch.Tensor, local_block: int, block_size: int, n_global: int) -> torch.Tensor:
    """For one rank's shard: [n_global, m] local key-block ids that lie inside each global block, -1 padded."""
    global_of_local = positions.view(-1, local_block)[:, 0] // block_size
    per_global = torch.bincount(global_of_local, minlength=n_global)
    width = max(int(per_global.max()), 1)
    order = torch.argsort(global_of_local, stable=True)
    start = torch.cumsum(per_global, 0) - per_global
    slot = torch.arange(order.numel(), device=positions.device) - start[global_of_local[order]]
    table = torch.full((n_global, width), -1, dtype=torch.long, device=positions.device)
    table[global_of_local[order], slot] = order
    return table


def sparse_plan(index, layout: Layout, rank: int, device: torch.device) -> RingPlan:
    """Remap a global SparseIndex (block lists + vertical columns) onto rank `rank`'s ring steps.

    Slash/diagonal blocks travel the ring; global block 0 (the sinks) and vertical columns go to the
    off-ring pass so no single worker carries them at one ring step.
    """
    seq_len, block_size = int(index.seq_len), int(index.block_size)
    layout.check(seq_len)
    local_block = layout.local_block_size(seq_len, block_size)
    positions = _all_positions(layout, seq_len, device)
    n_global = -(-seq_len // block_size)

    my_global_blocks = positions[rank].view(-1, local_block)[:, 0] // block_size
    rows = index.block_ids.to(device).long()[:, :, my_global_blocks, :]  # [B, H, nLQB, MAXB] global ids
    had_sink = (rows == 0).any(dim=-1)
    rows = torch.where(rows == 0, -1, rows)

    steps: dict[int, StepBlocks | None] = {}
    skip: set[int] = set()
    valid = (rows >= 0).unsqueeze(-1)
    for origin in range(layout.world_size):
        table = _key_block_table(positions[origin], local_block, block_size, n_global)
        mapped = torch.where(valid, table[rows.clamp(min=0)], -1).flatten(-2)
        ids, counts = _pack(mapped)
        if int(counts.max()) == 0:
            skip.add(origin)
        steps[origin] = StepBlocks(ids, counts)

    columns = _off_ring_columns(index, layout, had_sink, my_global_blocks, local_block, seq_len, device)
    return RingPlan(seq_len, rank, local_block, positions, steps, skip, columns)


def _off_ring_columns(index, layout, had_sink, my_global_blocks, local_block, seq_len, device) -> OffRingColumns | None:
    block_size = int(index.block_size)
    col_ids = index.col_ids.to(device).long()
    any_sink = bool((index.block_ids == 0).any())
    n_sink = min(block_size, seq_len) if any_sink else 0
    # the union over the whole (global, identical on every rank) index, so all ranks agree on it; flags
    # over the sequence (slot seq_len takes the -1 padding) instead of sorting every listed column
    used = torch.zeros(seq_len + 1, dtype=torch.bool, device=device)
    used[:n_sink] = True
    used[torch.where(col_ids >= 0, col_ids, seq_len).flatten()] = True
    union = torch.nonzero(used[:seq_len]).flatten()
    if union.numel() == 0:  # decided from the global index, so every rank skips the gather alike
        return None
    pad = (-union.numel()) % local_block
    positions = torch.cat([union, torch.full((pad,), seq_len, dtype=torch.long, device=device)])
    owner_all, local_all = _owners_cached(layout.spec, seq_len, str(device))
    owner = torch.full_like(positions, -1)
    local = torch.full_like(positions, -1)
    owner[: union.numel()] = owner_all[union]
    local[: union.numel()] = local_all[union]

    my_cols = col_ids[:, :, my_global_blocks, :]
    col_slots = torch.where(my_cols >= 0, torch.searchsorted(union, my_cols.clamp(min=0)), -1)
    b, h, n = had_sink.shape
    # sink tokens are the first entries of the sorted union (they are positions 0..block_size-1)
    sink_slots = torch.arange(n_sink, device=device).expand(b, h, n, n_sink)
    sink_slots = torch.where(had_sink.unsqueeze(-1), sink_slots, -1)
    ids, counts = _pack(torch.cat([sink_slots, col_slots], dim=-1))
    return OffRingColumns(positions, owner, local, ids, counts)
