"""FlexAttention as an optional block engine for vertical-slash attention: our SparseIndex as an exact Flex
BlockMask (listed blocks full, diagonal and vertical-column blocks partial), differentiable through Flex."""

from __future__ import annotations

import math

import torch

from mtrain.ops.index import SparseIndex
from mtrain.ops.lists import doc_ranges, left_pack

# Compiled flex_attention per kind of kernel choice (see `_flex_fn`).
_COMPILED: dict = {}


def _mask_mod(listed: torch.Tensor, is_col: torch.Tensor, bs: int, doc: torch.Tensor | None):
    """The exact token mask as a Flex mask_mod: causal, and the key's block is listed for the query's
    block or the key is a vertical column of the head (and, with documents, the same document). Flex
    calls it only inside partial blocks on CUDA, but its eager path (CPU) evaluates it everywhere, so it
    states the whole mask, not just the partial blocks' part."""
    if doc is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (listed[b, h, q_idx // bs, kv_idx // bs] | is_col[b, h, kv_idx])
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            inside = listed[b, h, q_idx // bs, kv_idx // bs] | is_col[b, h, kv_idx]
            return (q_idx >= kv_idx) & inside & (doc[b, q_idx] == doc[b, kv_idx])
    return mask_mod


def flex_block_mask(index: SparseIndex, doc_ids: torch.Tensor | None = None):
    """The exact Flex `BlockMask` of `index` (and of document ids [B, S], if given).

    Without documents: listed key blocks below the diagonal are full blocks (no mask_mod); the diagonal
    block is partial with the causal test; each key block holding vertical columns of a query block is
    partial with a mask_mod that keeps only the head's column tokens (a per-head [B, Hq, S] lookup), so
    the mask is token-exact, not rounded up to blocks. That lookup is exact when a head's columns are the
    same tokens for every query block that does not list their block, which `SparseIndex.from_lines`
    (and so `estimate_vertical_slash`) guarantees; other indices are refused with a ValueError. Every
    row's list must end with its diagonal block (from_lines always lists it). The mask_mod states the
    whole mask (it also reads a [B, Hq, nQB, nKB] bool table of the listed blocks), because Flex's eager
    path (CPU) applies it everywhere, not only inside partial blocks.
    With documents: blocks whose doc-id ranges cannot meet are dropped; listed blocks lying in one and the
    same document stay full, the rest are partial (the mask_mod adds the same-document test).
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, H, n, _ = index.block_ids.shape
    bs, S = index.block_size, index.seq_len
    dev = index.block_ids.device
    if doc_ids is not None and (tuple(doc_ids.shape) != (B, S) or doc_ids.is_floating_point()):
        raise ValueError(
            f"doc_ids must be an integer tensor [B={B}, S={S}]; got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    rows = torch.arange(n, device=dev)
    ids = index.block_ids.long()
    ok = (torch.arange(ids.shape[-1], device=dev) < index.block_counts[..., None].long()) & (ids >= 0)
    cnt = index.block_counts.long()
    last = torch.gather(ids, -1, (cnt - 1).clamp(min=0)[..., None])[..., 0]
    # Columns: per head, the union of its column tokens; per row, the distinct key blocks they lie in.
    cols = index.col_ids.long()
    cok = (torch.arange(cols.shape[-1], device=dev) < index.col_counts[..., None].long()) & (cols >= 0)
    is_col = torch.zeros(B, H, S + 1, dtype=torch.bool, device=dev)
    is_col.scatter_(-1, torch.where(cok, cols, S).flatten(2), True)
    is_col = is_col[..., :S].contiguous()
    cblk = torch.where(cok, cols // bs, -1)
    first = cok.clone()
    first[..., 1:] &= cblk[..., 1:] != cblk[..., :-1]  # col_ids are sorted: one entry per block
    per_block = torch.nn.functional.pad(is_col, (0, n * bs - S)).view(B, H, n, bs).sum(-1)  # columns per block
    covered = torch.where(first, torch.gather(per_block, -1, cblk.clamp(min=0).flatten(2)).view_as(cblk), 0).sum(-1)
    bad_diag = (cnt < 1) | (last != rows)
    bad_cols = covered != index.col_counts.long()
    if bool((bad_diag | bad_cols).any()):
        raise ValueError(
            "this SparseIndex cannot be expressed exactly as a Flex BlockMask: every query block's list must end "
            "with its diagonal block, and a head's vertical columns must be the same tokens for every query block "
            "that does not list their block (indices from SparseIndex.from_lines / estimate_vertical_slash are)"
        )
    diag = ok & (ids == rows[:, None])
    below = ok & (ids < rows[:, None])
    doc = None
    if doc_ids is None:
        full_ids, full_cnt = left_pack(ids, below, n)
        part_ids, part_cnt = left_pack(torch.cat([cblk, ids], -1), torch.cat([first, diag], -1), n)
    else:
        doc = doc_ids.to(device=dev, dtype=torch.int64)
        lo, hi = doc_ranges(doc, bs, n)
        bidx = torch.arange(B, device=dev)[:, None, None, None]
        q_lo, q_hi = lo[:, None, :, None], hi[:, None, :, None]

        def meets(j):
            return (lo[bidx, j.clamp(min=0)] <= q_hi) & (hi[bidx, j.clamp(min=0)] >= q_lo)

        one_doc = (lo == hi)[:, None, :, None] & (lo[bidx, ids.clamp(min=0)] == q_lo) & (
            hi[bidx, ids.clamp(min=0)] == q_lo)
        full = below & one_doc
        full_ids, full_cnt = left_pack(ids, full, n)
        part_keep = torch.cat([first & meets(cblk), ok & ~full & (ids <= rows[:, None]) & meets(ids)], -1)
        part_ids, part_cnt = left_pack(torch.cat([cblk, ids], -1), part_keep, n)
    listed = torch.zeros(B, H, n, n + 1, dtype=torch.bool, device=dev)
    listed.scatter_(-1, torch.where(ok, ids, n), True)
    mask_mod = _mask_mod(listed[..., :n].contiguous(), is_col, bs, doc)
    return BlockMask.from_kv_blocks(part_cnt, part_ids, full_cnt, full_ids, BLOCK_SIZE=bs, mask_mod=mask_mod,
                                    seq_lengths=(S, S))


def _flex_fn(device: torch.device, autotune: bool):
    """flex_attention: compiled on CUDA (Flex's fused Triton kernels; with `autotune` under inductor's
    max_autotune, which is what offers backward configurations with tiles of 64 or less), eager on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    key = ("autotune" if autotune else "default",)
    if key not in _COMPILED:
        options = {"max_autotune": True} if autotune else None
        _COMPILED[key] = torch.compile(flex_attention, dynamic=False, options=options)
    return _COMPILED[key]


def kernel_options_for(block_size: int) -> tuple[dict | None, bool]:
    """(kernel_options, autotune) that let Flex run index blocks of `block_size` on CUDA. Flex's default
    tiles suit 128-token blocks (on Hopper with a 128 head dim: forward 128 x 64/128, backward 64 x 128).
    For smaller blocks the forward takes smaller tiles through kernel_options, but the backward keeps
    only configurations whose own tiles divide the block size *before* it reads kernel_options (torch
    2.11-2.13), and the default one (64 x 128) does not: so smaller blocks compile under inductor's
    max_autotune, whose extra backward configurations include 32- and 64-token tiles (and which picks
    the fastest of them by measurement). That compile is slow: minutes at 128K (BENCHMARKS.md)."""
    if block_size >= 128:
        return None, False
    t = max(16, min(64, 1 << (block_size.bit_length() - 1)))
    return {"BLOCK_M": t, "BLOCK_N": t}, True


def flex_vertical_slash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    softmax_scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
    kernel_options: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical-slash attention through FlexAttention on exactly the pairs of `index` (and documents).

    q [B, S, Hq, D], k/v [B, S, Hkv, D]; returns (out [B, S, Hq, D] in q.dtype, differentiable through
    Flex's own backward; lse [B, Hq, S] float32 natural log, no gradient). The BlockMask is cached in the
    index (without documents). On CPU Flex runs eagerly and only without gradients (torch refuses Flex's
    backward on CPU); on CUDA it is compiled (the first call per shape compiles, tens of seconds).
    kernel_options: None = `kernel_options_for(index.block_size)`.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if doc_ids is None:
        if "flex" not in index._cache:
            index._cache["flex"] = flex_block_mask(index)
        bm = index._cache["flex"]
    else:
        bm = flex_block_mask(index, doc_ids)
    opts, autotune = kernel_options_for(index.block_size)
    opts = kernel_options if kernel_options is not None else opts
    if q.device.type != "cuda":
        opts = None  # the eager path takes no kernel options
    fn = _flex_fn(q.device, autotune)
    kw = dict(block_mask=bm, scale=scale, enable_gqa=k.shape[2] != q.shape[2], kernel_options=opts)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch before AuxRequest: the older return_lse flag
        out, lse = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), return_lse=True, **kw)
    else:
        out, aux = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), return_aux=AuxRequest(lse=True), **kw)
        lse = aux.lse
    return out.transpose(1, 2), lse.detach().float()
