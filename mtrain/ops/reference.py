"""Pure-PyTorch attention with a materialized mask: the ground truth for tests and the tiny CPU path.
Everything here is plain tensor math (any float dtype, float64 included); nothing is fast."""

from __future__ import annotations

import math

import torch


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hkv, Dk = k.shape
    if k.shape != v.shape or Bk != B or Dk != D:
        raise ValueError(f"k and v must both be [B={B}, Sk, Hkv, D={D}]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA")
    return B, Sq, Sk, Hq, Hkv


def block_mask_from_lists(
    block_ids: torch.Tensor, block_counts: torch.Tensor, n_kblocks: int
) -> torch.Tensor:
    """Bool [B, Hq, nQB, nKB]: entry (b, h, i, j) is True when key block j is listed for query block i."""
    B, H, nqb, maxb = block_ids.shape
    slot = torch.arange(maxb, device=block_ids.device)
    valid = (slot < block_counts[..., None].long()) & (block_ids >= 0)
    target = torch.where(valid, block_ids.long(), n_kblocks)  # invalid entries land in a dump column
    flags = torch.zeros(B, H, nqb, n_kblocks + 1, dtype=torch.bool, device=block_ids.device)
    flags.scatter_(-1, target, True)
    return flags[..., :n_kblocks]


def column_mask_from_lists(col_ids: torch.Tensor, col_counts: torch.Tensor, seq_k: int) -> torch.Tensor:
    """Bool [B, Hq, nQB, Sk]: entry (b, h, i, t) is True when key token t is an extra column of query block i."""
    B, H, nqb, maxc = col_ids.shape
    flags = torch.zeros(B, H, nqb, seq_k + 1, dtype=torch.bool, device=col_ids.device)
    if maxc > 0:
        slot = torch.arange(maxc, device=col_ids.device)
        valid = (slot < col_counts[..., None].long()) & (col_ids >= 0) & (col_ids < seq_k)
        flags.scatter_(-1, torch.where(valid, col_ids.long(), seq_k), True)
    return flags[..., :seq_k]


def partial_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    batch: int,
    heads: int,
    blocks=None,
    columns=None,
    block_size: int = 64,
    causal: bool = True,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bool [B, Hq, Sq, Sk] of (query, key) pairs that `mtrain.ops.partial` computes.

    A pair is kept when its key block is listed for the query's block (every block when `blocks` is
    None) or its key token is one of the query block's extra columns, and, when `causal`,
    k_pos <= q_pos, and, when document ids q_doc [B, Sq] / k_doc [B, Sk] are given, q_doc == k_doc.
    Blocks are `block_size` consecutive local tokens of the query / key shard.
    """
    Sq, Sk = q_pos.numel(), k_pos.numel()
    dev = q_pos.device
    nkb = -(-Sk // block_size)
    q_blk = torch.arange(Sq, device=dev) // block_size
    k_blk = torch.arange(Sk, device=dev) // block_size
    if blocks is None:
        mask = torch.ones(batch, heads, Sq, Sk, dtype=torch.bool, device=dev)
    else:
        bflags = block_mask_from_lists(blocks[0].to(dev), blocks[1].to(dev), nkb)  # [B,H,nqb,nkb]
        mask = bflags[:, :, q_blk][:, :, :, k_blk]
    if columns is not None:
        cflags = column_mask_from_lists(columns[0].to(dev), columns[1].to(dev), Sk)  # [B,H,nqb,Sk]
        mask = mask | cflags[:, :, q_blk]
    if causal:
        mask = mask & (k_pos.to(dev)[None, :] <= q_pos.to(dev)[:, None])
    if q_doc is not None:
        mask = mask & (q_doc.to(dev)[:, None, :, None] == k_doc.to(dev)[:, None, None, :])
    return mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention computed in q's dtype (pass float64 for a reference).

    q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (GQA: query head h reads kv head h // (Hq // Hkv)).
    mask: bool [B or 1, Hq or 1, Sq, Sk], True = attend; `causal=True` adds the usual
    k <= q test on local indices. Returns (out [B, Sq, Hq, D], lse [B, Hq, Sq]); rows that see no
    key get out = 0 and lse = -inf.
    """
    B, Sq, Sk, Hq, Hkv = check_qkv(q, k, v)
    D = q.shape[-1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    group = Hq // Hkv
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        keep = torch.arange(Sk, device=q.device)[None, :] <= torch.arange(Sq, device=q.device)[:, None]
    if mask is not None:
        keep = keep & mask
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    p = p.masked_fill(~keep, 0.0)
    out = torch.matmul(p, vh).transpose(1, 2)
    return out, lse


def vertical_slash_attention(q, k, v, index, softmax_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `mtrain.ops.vertical_slash_attention`: dense math under `index.to_mask()`."""
    return attention(q, k, v, index.to_mask().to(q.device), softmax_scale=softmax_scale)
