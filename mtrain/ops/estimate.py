"""Online vertical-slash pattern estimation (DESIGN §3.1): score the last queries against all keys, keep
the fewest verticals and slashes reaching a target attention recall, and build the SparseIndex."""

from __future__ import annotations

import math

import torch

from mtrain.ops.index import SparseIndex


def last_query_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    last_q: int,
    softmax_scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax of the last `last_q` queries over all keys: fp32 [B, Hkv, G, last_q, S].

    Query head h = hkv * G + g reads kv head hkv (K is never repeated). Row r sits at position
    S - last_q + r and sees keys 0..S - last_q + r (only those of its own document when doc_ids
    [B, S] is given).
    """
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    n = min(last_q, S)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    ql = q[:, S - n :].float().reshape(B, n, Hkv, G, D)
    s = torch.einsum("bqhgd,bkhd->bhgqk", ql, k.float()) * scale
    rows = torch.arange(S - n, S, device=q.device)
    if doc_ids is None:
        # Only the last n keys can lie after a row: mask that [n, n] corner in place, not all S columns.
        corner = torch.arange(S - n, S, device=q.device)[None, :] > rows[:, None]
        s[..., S - n :].masked_fill_(corner, float("-inf"))
        return torch.softmax(s, dim=-1)
    hidden = torch.arange(S, device=q.device)[None, :] > rows[:, None]  # [n, S]
    other_doc = doc_ids[:, S - n :, None] != doc_ids[:, None, :]  # [B, n, S]
    hidden = (hidden | other_doc)[:, None, None]
    return torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1)


def slash_scores(probs: torch.Tensor) -> torch.Tensor:
    """Token-level slash mass: [..., n, S] probabilities of the last n rows -> [..., S] mass per offset d.

    Row r (position S - n + r) puts probs[r, S - n + r - d] on diagonal d; a gather (not a scatter)
    keeps the sum deterministic on the GPU.
    """
    n, S = probs.shape[-2:]
    dev = probs.device
    d = torch.arange(S, device=dev)[None, :]
    pos = torch.arange(S - n, S, device=dev)[:, None]
    key = pos - d  # [n, S]
    shifted = torch.gather(probs, -1, key.clamp(min=0).expand(*probs.shape[:-2], n, S))
    return torch.where(key >= 0, shifted, 0.0).sum(-2)


def _select(scores: torch.Tensor, recall: float, cap: int, minimum: int) -> torch.Tensor:
    """Fewest top-scoring entries whose mass reaches `recall` of the total, within [minimum, cap].

    scores [..., S] (non-negative) -> LongTensor [..., min(cap, S)] of indices, -1 padded.
    """
    S = scores.shape[-1]
    cap = max(1, min(cap, S))
    top, idx = torch.topk(scores, cap, dim=-1)
    need = recall * scores.sum(-1, keepdim=True)
    reached = top.cumsum(-1) >= need * (1 - 1e-6)
    # Count of entries needed = index of the first entry where the cumulative mass reaches the target.
    count = torch.where(reached.any(-1, keepdim=True), reached.float().argmax(-1, keepdim=True) + 1,
                        torch.full_like(need, cap, dtype=torch.long))
    count = count.clamp(min=min(minimum, cap), max=cap)
    keep = (torch.arange(cap, device=scores.device) < count) & (top > 0)
    width = max(1, int(keep.sum(-1).max()))  # trim the padding so index building stays proportional
    return torch.where(keep, idx, -1)[..., :width]


def estimate_vertical_slash(
    q: torch.Tensor,
    k: torch.Tensor,
    recall: float = 0.95,
    last_q: int = 64,
    max_vertical: int = 4096,
    max_slash: int = 4096,
    block_size: int = 64,
    *,
    min_vertical: int = 16,
    min_slash: int = 16,
    share_kv_group: bool = False,
    softmax_scale: float | None = None,
    slash_recall: float | None = None,
    doc_ids: torch.Tensor | None = None,
) -> SparseIndex:
    """Estimate the vertical-slash pattern of causal attention and return its `SparseIndex`.

    q: [B, S, Hq, D]; k: [B, S, Hkv, D] (after RoPE). The last `last_q` queries are scored against
    all keys (scaled, causal, softmax over the full key range), then per query head:
    - vertical score of key j = sum of the rows' probabilities at column j;
    - slash score of offset d = sum of the probabilities on diagonal q - k = d, at TOKEN level (as
      the reference code does, not pooled per block): each kept offset later expands into the at most
      two key blocks its diagonal crosses in every query block, so neighbouring offsets share blocks
      and the block density is what the kernels pay;
    - keep the fewest top verticals whose mass reaches `recall` of the rows' total mass (likewise the
      slashes, with `slash_recall`, default `recall`), at least `min_vertical` / `min_slash` of them
      (a floor that keeps a short list when one entry dominates), at most `max_vertical` / `max_slash`.
    The index always holds the diagonal block and the first key block (sinks), whatever the scores.
    share_kv_group: sum the scores over the query heads of each KV group and select once per group
    (one budget per group: cheaper index, identical lists for the group's heads).
    doc_ids: optional integer tensor [B, S] of document ids (packed samples): the last queries then
    score only keys of their own document, so keys the attention will mask never win a vertical or
    slash slot. Verticals and slashes still apply to every query block (the kernels mask them per
    document); the pattern is therefore that of the last document(s).
    """
    if not 0.0 < recall <= 1.0:
        raise ValueError(f"recall must be in (0, 1]; got {recall}")
    B, S, Hq, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[1] != S or Hq % k.shape[2] != 0:
        raise ValueError(f"k must be [B={B}, S={S}, Hkv, D] with Hq % Hkv == 0; got {tuple(k.shape)}")
    Hkv = k.shape[2]
    G = Hq // Hkv
    if doc_ids is not None and (doc_ids.shape != (B, S) or doc_ids.is_floating_point()):
        raise ValueError(
            f"doc_ids must be an integer tensor [B={B}, S={S}]; got {doc_ids.dtype} {tuple(doc_ids.shape)}"
        )
    with torch.no_grad():
        docs = None if doc_ids is None else doc_ids.to(q.device)
        probs = last_query_probs(q, k, last_q, softmax_scale, docs)  # [B, Hkv, G, n, S]
        vert = probs.sum(-2)
        slash = slash_scores(probs)
        if share_kv_group:
            vert = vert.sum(2, keepdim=True)
            slash = slash.sum(2, keepdim=True)
        v_idx = _select(vert, recall, max_vertical, min_vertical)
        s_idx = _select(slash, recall if slash_recall is None else slash_recall, max_slash, min_slash)
        v_idx = v_idx.expand(B, Hkv, G, -1).reshape(B, Hq, -1)
        s_idx = s_idx.expand(B, Hkv, G, -1).reshape(B, Hq, -1)
        return SparseIndex.from_lines(v_idx, s_idx, S, block_size)
