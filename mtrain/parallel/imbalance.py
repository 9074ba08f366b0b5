"""How evenly a sparse index's work falls on the workers and ring steps of a layout: work[r, s] of rank r at
ring step s, counted per block from the index lists (nothing S x S), so CP = 128 at 1M tokens takes seconds."""

from __future__ import annotations

import torch

from mtrain.parallel.layout import Layout
from mtrain.parallel.ring_hierarchical import node_grid, origin_rank

# entries folded per index_add when a block spans several ranks (token stripe), to bound memory
_CHUNK = 1 << 16
# list entries masked at a time by rank_work (bounds its temporaries on a widened layer's lists)
_ROW_BUDGET = 1 << 24


def _tokens_per_block_and_rank(layout: Layout, seq_len: int, block_size: int) -> torch.Tensor:
    """C [nBlocks, W] float64: how many tokens of global block i rank r holds."""
    owner, _ = layout.owners(seq_len)
    blocks = torch.arange(seq_len) // block_size
    n = -(-seq_len // block_size)
    counts = torch.zeros(n * layout.world_size, dtype=torch.float64)
    counts.index_add_(0, blocks * layout.world_size + owner, torch.ones(seq_len, dtype=torch.float64))
    return counts.view(n, layout.world_size)


def _valid_entries(ids: torch.Tensor, counts: torch.Tensor, row_ids: torch.Tensor | None = None):
    """(query block, listed id) of every valid entry of a [B, H, nQB, M] list, pooled over B and H; row_ids [nQB]:
    the global query block of each list (default 0..nQB-1)."""
    slot = torch.arange(ids.shape[-1])
    valid = (slot < counts[..., None].long()) & (ids >= 0)
    row_ids = torch.arange(ids.shape[2]) if row_ids is None else row_ids.cpu().long()
    rows = row_ids.view(1, 1, -1, 1).expand_as(ids)
    return rows[valid], ids[valid].long()


def _key_rank_sums(q_rows: torch.Tensor, k_blocks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """K [nBlocks, W]: K[i, r'] = tokens of rank r' summed over the key blocks listed for query block i."""
    n_blocks, world = tokens.shape
    one_rank = (tokens > 0).sum(dim=1) == 1
    if bool(one_rank.all()):  # every block on one rank (block-aligned layouts): a weighted bincount
        rank_of = tokens.argmax(dim=1)
        flat = torch.bincount(q_rows * world + rank_of[k_blocks], weights=tokens.sum(dim=1)[k_blocks],
                              minlength=n_blocks * world)
        # float64 even when nothing is listed (a rank holding only the sink block): bincount of an empty input
        # returns int64 whatever its weights, which the float64 products below refuse
        return flat.to(torch.float64).view(n_blocks, world)
    if bool((tokens == tokens[0]).all()):  # every block split alike (token stripe with W | block size)
        return torch.bincount(q_rows, minlength=n_blocks).double()[:, None] * tokens[0][None, :]
    out = torch.zeros(n_blocks, world, dtype=torch.float64)
    for start in range(0, q_rows.numel(), _CHUNK):  # blocks spread over ranks unevenly
        out.index_add_(0, q_rows[start:start + _CHUNK], tokens[k_blocks[start:start + _CHUNK]])
    return out


def _by_step(pair_work: torch.Tensor, local_world_size: int | None) -> torch.Tensor:
    """[W, W] (query rank r, key rank r') -> [W, W] (rank r, ring step t): the flat ring visits r' = r - t;
    the hierarchical one (nodes of L ranks) the rank `origin_rank` gives for step t = o * L + i."""
    world, dev = pair_work.shape[0], pair_work.device
    r = torch.arange(world, device=dev).view(-1, 1)
    if not local_world_size:
        return pair_work[r, (r - torch.arange(world, device=dev).view(1, -1)) % world]
    origins = torch.tensor([
        [origin_rank(node_grid(rank, world, local_world_size, rank % local_world_size), t // local_world_size,
                     t % local_world_size) for t in range(world)]
        for rank in range(world)
    ], device=dev)
    return pair_work[r, origins]


def imbalance(index, layout: Layout, *, vertical_on_ring: bool = False, local_world_size: int | None = None) -> dict:
    """Worker- and step-level imbalance of `index` (a global SparseIndex) under `layout`.

    Returns {"worker": max_r sum_s / mean_r sum_s, "step": sum_s max_r / sum_s mean_r, "work": [W, W]
    float64 work[r, s] of rank r at ring step s, "local": [W] work of the off-ring pass per rank,
    "total": all work}, in block equivalents (block_size^2 pairs; diagonal blocks count in full, as a
    block kernel runs them). With vertical_on_ring=False (what ring_attention does) the sink block and
    the vertical columns are attended once per rank off the ring: their work is "local", a phase of its
    own in the step measure. With True they stay with the shard that owns them, as in a plain ring.
    local_world_size: order the steps as the hierarchical ring with nodes of that many ranks does (None:
    the flat ring). Its steps are balanced when `layout` was built with the same local_world_size.
    """
    seq_len, block_size = int(index.seq_len), int(index.block_size)
    world = layout.world_size
    layout.check(seq_len)
    tokens = _tokens_per_block_and_rank(layout, seq_len, block_size)  # [nB, W]
    n_blocks = tokens.shape[0]
    area = float(block_size * block_size)

    q_rows, k_blocks = _valid_entries(index.block_ids.cpu(), index.block_counts.cpu())
    c_rows, c_tokens = _valid_entries(index.col_ids.cpu(), index.col_counts.cpu())
    owner, _ = layout.owners(seq_len)
    local = torch.zeros(world, dtype=torch.float64)
    if not vertical_on_ring:
        sink = k_blocks == 0
        # per query block: sink tokens + columns it attends off the ring
        extra = torch.zeros(n_blocks, dtype=torch.float64)
        extra.index_add_(0, q_rows[sink], tokens[0].sum().expand(int(sink.sum())).clone())
        extra.index_add_(0, c_rows, torch.ones(c_rows.numel(), dtype=torch.float64))
        local = tokens.t() @ extra / area
        q_rows, k_blocks = q_rows[~sink], k_blocks[~sink]

    key_sums = _key_rank_sums(q_rows, k_blocks, tokens)
    if vertical_on_ring:
        col_keys = torch.zeros(n_blocks * world, dtype=torch.float64)
        col_keys.index_add_(0, c_rows * world + owner[c_tokens], torch.ones(c_rows.numel(), dtype=torch.float64))
        key_sums += col_keys.view(n_blocks, world)
    if local_world_size is not None and (local_world_size < 1 or world % local_world_size):
        raise ValueError(f"local_world_size {local_world_size} must divide the CP size {world}")
    work = _by_step(tokens.t() @ key_sums / area, local_world_size)

    per_worker = work.sum(dim=1) + local
    step_time = work.max(dim=0).values.sum() + local.max()
    step_mean = work.mean(dim=0).sum() + local.mean()
    return {
        "worker": float(per_worker.max() / per_worker.mean()),
        "step": float(step_time / step_mean),
        "work": work,
        "local": local,
        "total": float(per_worker.sum()),
    }


def _row_chunks(ids: torch.Tensor, counts: torch.Tensor, row_ids: torch.Tensor):
    """(ids [r, M], valid [r, M], global query block [r]) over the rows of a [B, H, nQB, M] list, a few rows at a
    time so the masks stay within _ROW_BUDGET entries whatever the lists' width (a widened layer's lists take GBs)."""
    width = max(int(ids.shape[-1]), 1)
    flat_ids, flat_counts = ids.reshape(-1, ids.shape[-1]), counts.reshape(-1)
    rows = row_ids.view(1, -1).expand(ids.shape[0] * ids.shape[1], -1).reshape(-1)
    step = max(_ROW_BUDGET // width, 1)
    slot = torch.arange(ids.shape[-1], device=ids.device)
    for start in range(0, flat_ids.shape[0], step):
        part = flat_ids[start:start + step]
        valid = (slot < flat_counts[start:start + step, None].long()) & (part >= 0)
        yield part, valid, rows[start:start + step]


def rank_work(index, layout: Layout, rank: int, *, local_world_size: int | None = None) -> torch.Tensor:
    """Rank `rank`'s row of `imbalance`'s measure from its own rows of the index (a `mtrain.ops.index.RowIndex`
    holding at least them, or a global SparseIndex): float64 [W + 1], its work at each ring step in step order,
    then its off-ring (sink + vertical) work. Nothing of the other ranks' rows is needed.

    Counted where the lists live (the GPU in training) by per-key-block weights: no entry list is extracted, nothing
    of the lists' size is copied to the host and no host synchronisation is made (a widened layer's lists at 512K
    take GBs, and copying them made one step of the 4-GPU run ~20 s longer). The result stays on that device."""
    seq_len, block_size = int(index.seq_len), int(index.block_size)
    world = layout.world_size
    dev = index.block_ids.device
    tokens = _tokens_per_block_and_rank(layout, seq_len, block_size).to(dev)  # [nB, W]
    mine = tokens[:, rank]
    row_ids = getattr(index, "rows", None)
    row_ids = (torch.arange(index.block_ids.shape[2]) if row_ids is None else row_ids).to(dev).long()
    area = float(block_size * block_size)
    # key_weight[j] = sum of mine[i] over the (i, j) entries of the block lists: the work against key block j is
    # key_weight[j] * tokens[j]; j = 0 (the sink) is attended off the ring, once per listing row
    key_weight = torch.zeros(tokens.shape[0], dtype=torch.float64, device=dev)
    for ids, valid, rows in _row_chunks(index.block_ids, index.block_counts, row_ids):
        weight = torch.where(valid, mine[rows][:, None], 0.0)
        key_weight.index_add_(0, ids.clamp(min=0).long().flatten(), weight.flatten())
    # one token each, off the ring: a row's column count (its lists are front-packed, or held list-free)
    column_weight = (index.col_counts.double() * mine[row_ids]).sum()
    by_origin = tokens[1:].t() @ key_weight[1:] / area  # [W]: work against each origin's shard
    local = (key_weight[0] * tokens[0].sum() + column_weight) / area
    pair = torch.zeros(world, world, dtype=torch.float64, device=dev)
    pair[rank] = by_origin
    by_step = _by_step(pair, local_world_size)[rank]
    return torch.cat([by_step, local.view(1)])


def gathered_imbalance(index, layout: Layout, rank: int, group, *, local_world_size: int | None = None) -> dict:
    """`imbalance`'s worker and step figures for a CP group in which each rank holds only its own rows of the
    index: every rank measures its row (`rank_work`) and one all-gather of W + 1 numbers per rank gives all of
    them the whole measure. Collective: every rank of `group` must call it. Returns {"worker", "step", "ranks"}:
    ranks = each rank's work over the mean work (its own share of the imbalance; max(ranks) == worker)."""
    import torch.distributed as dist

    mine = rank_work(index, layout, rank, local_world_size=local_world_size)  # on the index's device, as NCCL needs
    rows = [torch.empty_like(mine) for _ in range(layout.world_size)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows)
    work, local = table[:, :-1], table[:, -1]
    per_worker = work.sum(dim=1) + local
    step_time = work.max(dim=0).values.sum() + local.max()
    step_mean = work.mean(dim=0).sum() + local.mean()
    return {"worker": float(per_worker.max() / per_worker.mean()), "step": float(step_time / step_mean),
            "ranks": (per_worker / per_worker.mean()).tolist()}
