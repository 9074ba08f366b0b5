"""XAttention block-sparse attention: each (query block, key block) is scored by strided antidiagonal sums of
its logits, and each query block keeps the fewest key blocks whose normalised scores reach a threshold."""

from __future__ import annotations

import torch

from mtrain.ops.block_select import index_from_lists, pack_lists, whole_block_rows
from mtrain.ops.index import SparseIndex

# Elements of the strided-logit tile scored at once (rows are processed in chunks of about this size).
_SCORE_ELEMS = 1 << 24


def check_xattention(stride: int, threshold: float, block_size: int) -> None:
    """ValueError (one line) unless the stride divides the block size and 0 < threshold <= 1."""
    if stride < 1 or block_size < 1 or block_size % stride:
        raise ValueError(f"xattention stride ({stride}) must be a positive divisor of block_size ({block_size})")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"xattention threshold must be in (0, 1], got {threshold}")


def antidiagonal_scores(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, *, stride: int, block_size: int,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R], scores [B, Hq, R, nKB]): the normalised block scores of the whole query blocks q [B, S_q, Hq, D]
    (global positions q_pos, any order) holds, against the whole sequence's keys k [B, S, Hkv, D].

    Tokens are grouped by `stride` (group m = positions m*stride .. m*stride + stride - 1). The strided logit of
    query group m and key group n is the mean of the `stride` logits on the antidiagonal through the pair
    (query m*stride + stride - 1 - t, key n*stride + t): reversed query groups dotted with key groups, flattened
    to stride*D features. Each query group takes a softmax over the strictly earlier key groups (n < m: the score
    never reads a key of its own group or later); a block's score is the probability mass its key groups
    receive, averaged over the query block's groups (a row's scores sum to 1 where it has any earlier group).
    """
    seq_len = k.shape[1]
    B, _, Hq, D = q.shape
    hkv = k.shape[2]
    g = Hq // hkv
    n = -(-seq_len // block_size)
    per_block = block_size // stride
    n_groups = -(-seq_len // stride)  # groups holding a real token
    dev = q.device
    acc = torch.promote_types(q.dtype, torch.float32)
    rows, slot = whole_block_rows(q_pos.to(dev), seq_len, block_size)
    R = rows.numel()
    # queries by block, padded with zeros past the sequence end; keys likewise
    qb = q.new_zeros(B, R * block_size, Hq, D, dtype=acc)
    qb[:, slot * block_size + q_pos.to(dev).long() % block_size] = q.to(acc)
    kp = k.new_zeros(B, n * block_size, hkv, D, dtype=acc)
    kp[:, :seq_len] = k.to(acc)
    q_r = qb.view(B, R * per_block, stride, hkv, g, D).flip(2)  # each query group reversed
    q_r = q_r.permute(0, 3, 4, 1, 2, 5).reshape(B, hkv, g, R * per_block, stride * D)
    k_r = kp.view(B, n * per_block, stride, hkv, D).permute(0, 3, 1, 2, 4).reshape(B, hkv, 1, n * per_block, stride * D)
    m_all = (rows[:, None] * per_block + torch.arange(per_block, device=dev)).flatten()  # [R * per_block]
    keys = torch.arange(n * per_block, device=dev)
    scores = torch.zeros(B, Hq, R, n, dtype=acc, device=dev)
    rows_per_step = max(1, _SCORE_ELEMS // max(1, B * Hq * per_block * n * per_block))
    for r0 in range(0, R, rows_per_step):
        sl = slice(r0 * per_block, min(R, r0 + rows_per_step) * per_block)
        logits = torch.matmul(q_r[:, :, :, sl], k_r.transpose(-1, -2)) * (scale / stride)  # [B, Hkv, g, m, nG]
        m = m_all[sl]
        keep = (keys[None, :] < m[:, None]) & (keys[None, :] < n_groups) & (m[:, None] < n_groups)  # no padding
        logits = logits.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a group with no earlier key group scores nothing
        probs = probs.reshape(B, Hq, -1, per_block, n, per_block).sum((3, 5))
        scores[:, :, r0:r0 + probs.shape[2]] = probs
    total = scores.sum(-1, keepdim=True)
    return rows, torch.where(total > 0, scores / total.clamp(min=torch.finfo(acc).tiny), 0.0)


def xattention_lists(scores: torch.Tensor, rows: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-block lists of the query blocks `rows` [R] from their normalised scores [B, Hq, R, nKB]: (ids int32
    [B, Hq, R, M] ascending, -1 padded; counts). A row keeps its diagonal block and the first (sink) block, then
    the best-scoring earlier blocks until the kept blocks' scores (the forced ones included) reach `threshold`
    of the row's total."""
    n = scores.shape[-1]
    dev = scores.device
    rows = rows.to(dev).long()
    blocks = torch.arange(n, device=dev)
    causal = blocks[None, :] <= rows[:, None]  # [R, nKB]
    forced = (blocks[None, :] == rows[:, None]) | (blocks[None, :] == 0)
    value = torch.where(causal, scores, 0.0)
    priority = torch.where(forced, 2.0, torch.where(causal, value, -1.0))  # scores are <= 1
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    ranked = torch.gather(value, -1, order)
    before = ranked.cumsum(-1) - ranked  # mass kept before each candidate
    need = threshold * value.sum(-1, keepdim=True)
    keep = (before < need) | torch.gather(forced.expand_as(value), -1, order)
    keep &= torch.gather(causal.expand_as(value), -1, order)
    return pack_lists(order, keep)


def xattention_index(q: torch.Tensor, k: torch.Tensor, *, stride: int, threshold: float, block_size: int = 64,
                     softmax_scale: float | None = None) -> SparseIndex:
    """The XAttention index of the whole sequence on one device: q [B, S, Hq, D], k [B, S, Hkv, D]."""
    check_xattention(stride, threshold, block_size)
    seq_len = q.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    with torch.no_grad():
        rows, scores = antidiagonal_scores(q, torch.arange(seq_len, device=q.device), k, stride=stride,
                                           block_size=block_size, scale=scale)
        ids, counts = xattention_lists(scores, rows, threshold)
    return index_from_lists(ids, counts, seq_len, block_size)


def xattention_attention(q, k, v, *, stride: int, threshold: float, block_size: int = 64,
                         softmax_scale: float | None = None, doc_ids: torch.Tensor | None = None,
                         return_index: bool = False):
    """Causal XAttention on one device, differentiable in q, k and v (the selection is not).

    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D]. Each query block (of `block_size` tokens) attends causally to the key
    blocks `xattention_lists` keeps from the strided antidiagonal scores (`antidiagonal_scores`), through the
    block-sparse kernels (`mtrain.ops.vertical_slash_attention` with the lists as its index).
    doc_ids [B, S]: packed documents, masked by the kernels on top of the chosen blocks (the scores ignore them).
    Returns out [B, S, Hq, D] (and the SparseIndex with return_index).
    """
    from mtrain.ops.attention import vertical_slash_attention

    index = xattention_index(q.detach(), k.detach(), stride=stride, threshold=threshold, block_size=block_size,
                             softmax_scale=softmax_scale)
    out = vertical_slash_attention(q, k, v, index, softmax_scale=softmax_scale, doc_ids=doc_ids)
    return (out, index) if return_index else out
