"""Block-sparse indexes whose key blocks a selection rule picks from q/k (MoBA chunk gating, XAttention
antidiagonal scores): helpers that turn per-query-block choices into the kernels' sorted block lists."""

from __future__ import annotations

import torch

from mtrain.ops.index import SparseIndex


def pack_lists(ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted block lists from candidate ids [..., N] (distinct where valid) and their validity flags:
    (ids int32 [..., M] ascending, -1 padded, M = the longest list (at least 1); counts int32 [...])."""
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(valid, ids.long(), big), dim=-1).values
    counts = valid.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    ordered = ordered[..., :width]
    return torch.where(ordered < big, ordered, -1).to(torch.int32), counts


def row_pairs(block_ids: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, seq_len: int,
              block_size: int) -> torch.Tensor:
    """Float64 [B, H, R]: causal (query, key) pairs that the lists of query blocks `rows` [R] compute (a key
    block before the row counts in full, the row's own block as a triangle; a short last block is handled)."""
    bs = block_size
    slot = torch.arange(block_ids.shape[-1], device=block_ids.device)
    ok = (slot < counts[..., None].long()) & (block_ids >= 0)
    q_lo = (rows.double() * bs)[None, None, :, None]
    q_len = (q_lo + bs).clamp(max=seq_len) - q_lo
    k_lo = block_ids.double().clamp(min=0) * bs
    k_len = (k_lo + bs).clamp(max=seq_len) - k_lo
    pairs = torch.where(k_lo < q_lo, q_len * k_len, torch.where(k_lo == q_lo, q_len * (q_len + 1) / 2, 0.0))
    return torch.where(ok, pairs, 0.0).sum(-1)


def index_from_lists(block_ids: torch.Tensor, counts: torch.Tensor, seq_len: int, block_size: int) -> SparseIndex:
    """A SparseIndex of block lists [B, H, nQB, M] (every query block, ascending, -1 padded) without columns."""
    B, H, n, _ = block_ids.shape
    dev = block_ids.device
    empty = torch.full((B, H, n, 1), -1, dtype=torch.int32, device=dev)
    return SparseIndex(block_ids.contiguous(), counts.contiguous(), empty,
                       torch.zeros(B, H, n, dtype=torch.int32, device=dev), seq_len, block_size)


def whole_block_rows(q_pos: torch.Tensor, seq_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R] ascending: the query blocks the positions `q_pos` [S_local] fall in; slot [S_local]: each token's
    row). Raises ValueError unless `q_pos` holds every token of each of those blocks (a selection rule that pools
    a query block needs all of its rows)."""
    blocks = q_pos.long() // block_size
    rows, slot = torch.unique(blocks, return_inverse=True)
    sizes = (rows * block_size + block_size).clamp(max=seq_len) - rows * block_size
    if not torch.equal(torch.bincount(slot, minlength=rows.numel()), sizes):
        raise ValueError(f"the query positions do not hold whole blocks of {block_size} tokens; use a layout that "
                         "keeps blocks whole (zigzag, or block-stripe with granularity a multiple of the block size)")
    return rows, slot
