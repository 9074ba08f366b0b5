"""MoBA and XAttention block selection across a CP group: each rank chooses the key blocks of its own query
blocks, from what one device would see (MoBA: chunk key sums all-reduced; XAttention: the keys all-gathered),
and returns them as its rows of the global index (a `mtrain.ops.index.RowIndex`) for the sparse ring."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError
from mtrain.ops.block_select import row_pairs
from mtrain.ops.index import RowIndex
from mtrain.parallel.layout import Layout


def whole_blocks_problem(layout: Layout, seq_len: int, block_size: int, kind: str) -> str | None:
    """None when every rank of `layout` holds whole query blocks of `block_size` tokens at `seq_len` (what the
    moba and xattention selections need under CP), else the one-line reason and fix."""
    if layout.local_block_size(seq_len, block_size) == block_size:
        return None
    return (f"attention.kind {kind} under CP needs whole query blocks of attention.block_size={block_size} tokens "
            f"on every rank, which {layout!r} at {seq_len} tokens does not give; use parallel.layout zigzag (with "
            f"seq_len / (2 x cp_size) a multiple of {block_size}) or block-stripe with parallel.granularity a "
            f"multiple of {block_size}")


def _check_whole_blocks(layout: Layout, seq_len: int, block_size: int, kind: str) -> None:
    problem = whole_blocks_problem(layout, seq_len, block_size, kind)
    if problem is not None:
        raise MtrainError(problem)


def _row_index(ids, counts, rows, seq_len: int, block_size: int, group) -> RowIndex:
    """The rank's rows as a RowIndex without columns; its totals (the whole index's work) summed over the group."""
    B, H, R, _ = ids.shape
    dev = ids.device
    totals = torch.stack([counts.double().sum(-1), torch.zeros(B, H, dtype=torch.float64, device=dev),
                          row_pairs(ids, counts, rows, seq_len, block_size).sum(-1)], -1)
    dist.all_reduce(totals, group=group)
    empty = torch.full((B, H, R, 1), -1, dtype=torch.int32, device=dev)
    return RowIndex(rows, ids, counts, empty, torch.zeros(B, H, R, dtype=torch.int32, device=dev), seq_len,
                    block_size, column_union=torch.zeros(0, dtype=torch.long, device=dev), totals=totals)


def moba_rank_index(q, k, layout: Layout, rank: int, group, *, chunk_size: int, topk: int,
                    block_size: int) -> RowIndex:
    """This rank's rows of `mtrain.ops.moba.moba_index` of the whole sequence, from its shards q [B, S_local, Hq, D],
    k [B, S_local, Hkv, D]: the chunk key sums are all-reduced ([B, nC, Hkv, D], small), each rank gates its own
    (whole) query blocks. Every rank's rows are those one device picks (up to fp rounding of the sums)."""
    from mtrain.ops.moba import block_query_means, check_moba, chunk_key_sums, chunk_lengths, moba_lists

    seq_len = q.shape[1] * layout.world_size
    check_moba(chunk_size, topk, block_size)
    _check_whole_blocks(layout, seq_len, block_size, "moba")
    pos = layout.indices(seq_len, rank).to(q.device)
    with torch.no_grad():
        rows, q_mean = block_query_means(q, pos, seq_len, block_size)
        sums = chunk_key_sums(k, pos, seq_len, chunk_size)
        dist.all_reduce(sums, group=group)
        k_mean = sums / chunk_lengths(seq_len, chunk_size, q.device).to(sums.dtype)[None, :, None, None]
        ids, counts = moba_lists(q_mean, k_mean, rows, seq_len=seq_len, block_size=block_size,
                                 chunk_size=chunk_size, topk=topk)
        return _row_index(ids, counts, rows, seq_len, block_size, group)


def xattention_rank_index(q, k, layout: Layout, rank: int, group, *, stride: int, threshold: float,
                          block_size: int, scale: float) -> RowIndex:
    """This rank's rows of `mtrain.ops.xattention.xattention_index` of the whole sequence, from its shards: the
    keys are all-gathered once (no gradient; the strided scores of a row read every earlier key group), each rank
    scores and selects its own (whole) query blocks, so the scoring work per rank falls as 1/CP."""
    from mtrain.ops.xattention import antidiagonal_scores, check_xattention, xattention_lists

    seq_len = q.shape[1] * layout.world_size
    check_xattention(stride, threshold, block_size)
    _check_whole_blocks(layout, seq_len, block_size, "xattention")
    pos = layout.indices(seq_len, rank).to(q.device)
    with torch.no_grad():
        shards = [torch.empty_like(k) for _ in range(layout.world_size)]
        dist.all_gather(shards, k.contiguous(), group=group)
        k_all = layout.unshard(shards, dim=1)
        rows, scores = antidiagonal_scores(q, pos, k_all, stride=stride, block_size=block_size, scale=scale)
        ids, counts = xattention_lists(scores, rows, threshold)
        return _row_index(ids, counts, rows, seq_len, block_size, group)
