"""MoBA block-sparse attention (mixture of block attention): keys are split into chunks, each query block is
routed to its top-k earlier chunks by a gate on mean-pooled queries and keys, plus its own chunk (causal)."""

from __future__ import annotations

import torch

from mtrain.ops.block_select import index_from_lists, pack_lists, whole_block_rows
from mtrain.ops.index import SparseIndex


def check_moba(chunk_size: int, topk: int, block_size: int) -> None:
    """ValueError (one line) unless chunks are whole kernel blocks and top-k is >= 0."""
    if block_size < 1 or chunk_size < 1 or chunk_size % block_size:
        raise ValueError(f"moba chunk_size ({chunk_size}) must be a positive multiple of block_size ({block_size})")
    if topk < 0:
        raise ValueError(f"moba topk must be >= 0 (earlier chunks kept per query block), got {topk}")


def chunk_key_sums(k: torch.Tensor, k_pos: torch.Tensor, seq_len: int, chunk_size: int) -> torch.Tensor:
    """Sum of the keys k [B, S_k, Hkv, D] (global positions k_pos [S_k]) per chunk of `chunk_size` positions:
    [B, nC, Hkv, D] in fp32 (fp64 for fp64 keys). Summed over ranks, the sums of the whole sequence."""
    n_chunks = -(-seq_len // chunk_size)
    acc = torch.promote_types(k.dtype, torch.float32)
    sums = k.new_zeros(k.shape[0], n_chunks, *k.shape[2:], dtype=acc)
    return sums.index_add_(1, k_pos.to(k.device).long() // chunk_size, k.to(acc))


def chunk_lengths(seq_len: int, chunk_size: int, device) -> torch.Tensor:
    """Tokens in each chunk [nC] (the last one may be short)."""
    start = torch.arange(0, seq_len, chunk_size, device=device)
    return (start + chunk_size).clamp(max=seq_len) - start


def block_query_means(q: torch.Tensor, q_pos: torch.Tensor, seq_len: int, block_size: int):
    """(rows [R], mean query of each [B, R, Hq, D] fp32/fp64) of the whole query blocks q [B, S_q, Hq, D] at
    global positions q_pos holds (see `mtrain.ops.block_select.whole_block_rows`)."""
    rows, slot = whole_block_rows(q_pos.to(q.device), seq_len, block_size)
    acc = torch.promote_types(q.dtype, torch.float32)
    sums = q.new_zeros(q.shape[0], rows.numel(), *q.shape[2:], dtype=acc).index_add_(1, slot, q.to(acc))
    sizes = (rows * block_size + block_size).clamp(max=seq_len) - rows * block_size
    return rows, sums / sizes.to(acc)[None, :, None, None]


def moba_lists(q_mean: torch.Tensor, k_mean: torch.Tensor, rows: torch.Tensor, *, seq_len: int, block_size: int,
               chunk_size: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-block lists of the query blocks `rows` [R]: (ids int32 [B, Hq, R, M] ascending, -1 padded; counts).

    q_mean [B, R, Hq, D]: each row's mean query; k_mean [B, nC, Hkv, D]: each chunk's mean key (GQA: query head
    h gates with kv head h // (Hq / Hkv)). Gate score of chunk c for a row = q_mean . k_mean[c]; a row keeps the
    `topk` best chunks that end before its own chunk begins, and all blocks of its own chunk up to itself.
    """
    check_moba(chunk_size, topk, block_size)
    B, R, Hq, _ = q_mean.shape
    n_chunks, hkv = k_mean.shape[1], k_mean.shape[2]
    dev = q_mean.device
    keys = k_mean.to(q_mean.dtype).repeat_interleave(Hq // hkv, dim=2)
    scores = torch.einsum("brhd,bchd->bhrc", q_mean, keys)  # [B, Hq, R, nC]
    rows = rows.to(dev).long()
    own = rows * block_size // chunk_size  # [R]
    past = torch.arange(n_chunks, device=dev)[None, :] < own[:, None]  # [R, nC]
    scores = scores.masked_fill(~past, float("-inf"))
    per_block = chunk_size // block_size
    take = min(topk, n_chunks)
    if take > 0:
        best, chosen = torch.topk(scores, take, dim=-1)
        chunks = torch.cat([torch.where(best > float("-inf"), chosen, -1), own.expand(B, Hq, R)[..., None]], -1)
    else:
        chunks = own.expand(B, Hq, R)[..., None]
    blocks = chunks[..., None] * per_block + torch.arange(per_block, device=dev)  # [B, Hq, R, K+1, per_block]
    valid = (chunks >= 0)[..., None] & (blocks <= rows[:, None, None])
    return pack_lists(blocks.flatten(-2), valid.flatten(-2))


def moba_index(q: torch.Tensor, k: torch.Tensor, *, chunk_size: int, topk: int, block_size: int = 64) -> SparseIndex:
    """The MoBA index of the whole sequence on one device: q [B, S, Hq, D], k [B, S, Hkv, D] (no gradient)."""
    seq_len = q.shape[1]
    check_moba(chunk_size, topk, block_size)
    pos = torch.arange(seq_len, device=q.device)
    with torch.no_grad():
        rows, q_mean = block_query_means(q, pos, seq_len, block_size)
        sums = chunk_key_sums(k, pos, seq_len, chunk_size)
        k_mean = sums / chunk_lengths(seq_len, chunk_size, q.device).to(sums.dtype)[None, :, None, None]
        ids, counts = moba_lists(q_mean, k_mean, rows, seq_len=seq_len, block_size=block_size,
                                 chunk_size=chunk_size, topk=topk)
    return index_from_lists(ids, counts, seq_len, block_size)


def moba_attention(q, k, v, *, chunk_size: int, topk: int, block_size: int = 64, softmax_scale: float | None = None,
                   doc_ids: torch.Tensor | None = None, return_index: bool = False):
    """Causal MoBA attention on one device, differentiable in q, k and v (the gate is not).

    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]. Query block i (of `block_size` tokens) attends, causally, to the
    blocks of its own chunk (of `chunk_size` tokens) up to itself and to every block of the `topk` earlier
    chunks whose mean key scores highest against the block's mean query. Gating per query block (not per token)
    maps the choice onto the block-sparse kernels (`mtrain.ops.vertical_slash_attention` with the lists as its
    index); the choice of a block reads all of its queries, the attention itself is exactly causal.
    doc_ids [B, S]: packed documents, masked by the kernels on top of the chosen blocks (the gate ignores them).
    Returns out [B, S, Hq, D] (and the SparseIndex with return_index).
    """
    from mtrain.ops.attention import vertical_slash_attention

    index = moba_index(q.detach(), k.detach(), chunk_size=chunk_size, topk=topk, block_size=block_size)
    out = vertical_slash_attention(q, k, v, index, softmax_scale=softmax_scale, doc_ids=doc_ids)
    return (out, index) if return_index else out
