"""Online vertical-slash estimation across a CP group: every rank scores the global last queries against its
own keys; all-reduce / all-gather of small tensors give every rank the same lines, no rank works for all."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError


@dataclass(frozen=True)
class SparseSettings:
    """Settings of the online budget approximation (DESIGN §3.1), estimated per layer and query head with the
    same selection rule as `mtrain.ops.estimate_vertical_slash`, so one GPU and a CP group agree."""

    recall: float = 0.95
    """Target attention mass the vertical set must reach (and the slash set, unless slash_recall is set)."""
    last_q: int = 64
    """How many of the last queries of the global sequence score the keys."""
    max_vertical: int = 4096
    """Cap on vertical columns per head (key positions every query attends to)."""
    max_slash: int = 4096
    """Cap on slash lines per head (token-level offsets q - k)."""
    block_size: int = 64
    """Key/query block size of the index handed to the kernels."""
    min_vertical: int = 16
    """Floor on the verticals kept, so one dominant key does not leave a one-entry list."""
    min_slash: int = 16
    """Floor on the slashes kept."""
    share_kv_group: bool = False
    """Select once per KV group on the scores summed over its query heads (one budget per group)."""
    slash_recall: float | None = None
    """Recall target of the slash set; None = `recall`."""
    sample_blocks: int = 16
    """Query blocks (of block_size rows) spread evenly over the sequence that are scored besides the last_q rows."""
    cap_fraction: float | None = None
    """Also cap verticals at this fraction of the sequence's tokens and slashes at this fraction of its blocks."""

    def __post_init__(self) -> None:
        for name in ("recall", "slash_recall"):
            value = getattr(self, name)
            if value is not None and not 0.0 < value <= 1.0:
                raise MtrainError(f"sparse.{name} must be in (0, 1]; got {value}")
        for name in ("last_q", "max_vertical", "max_slash", "block_size"):
            if getattr(self, name) < 1:
                raise MtrainError(f"sparse.{name} must be >= 1; got {getattr(self, name)}")
        if self.cap_fraction is not None and not 0.0 < self.cap_fraction <= 1.0:
            raise MtrainError(f"sparse.cap_fraction must be in (0, 1] or None; got {self.cap_fraction}")
        for name in ("min_vertical", "min_slash", "sample_blocks"):
            if getattr(self, name) < 0:
                raise MtrainError(f"sparse.{name} must be >= 0; got {getattr(self, name)}")


def _top_p(scores, ids, total, recall: float, cap: int, minimum: int) -> torch.Tensor:
    """Fewest highest-scoring ids whose scores reach recall * total, kept within [minimum, cap] and only
    with positive scores; [..., width] -1 padded. `scores` need only hold the top candidates."""
    width = max(1, min(cap, scores.shape[-1]))
    top, where = torch.topk(scores, width, dim=-1)
    chosen = torch.gather(ids, -1, where)
    need = recall * total[..., None]
    reached = top.cumsum(-1) >= need * (1 - 1e-6)  # the same float slack as the single-device rule
    count = torch.where(reached.any(-1, keepdim=True), reached.float().argmax(-1, keepdim=True) + 1,
                        torch.full_like(need, width, dtype=torch.long))
    count = count.clamp(min=min(minimum, width), max=width)
    keep = (torch.arange(width, device=scores.device) < count) & (top > 0)
    return torch.where(keep, chosen, -1)


def estimate_lines(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
    settings: SparseSettings, scale: float, group, doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(vertical [B, Hq, Nv], slash [B, Hq, Ns]), -1 padded, identical on every rank of `group`.

    q [B, S_local, Hq, D], k [B, S_local, Hkv, D] local shards; q_pos/k_pos their global positions.
    Vertical and slash scores are token level, as in `mtrain.ops.estimate_vertical_slash`.
    doc_ids: global document ids [B, seq_len] (the same on every rank) or None: the last queries then score
    only keys of their own document, as `estimate_vertical_slash(..., doc_ids=)` does.
    """
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    heads = hkv if settings.share_kv_group else hq  # the heads a budget is chosen for
    last = min(settings.last_q, seq_len)
    first = seq_len - last
    with torch.no_grad():
        # the last queries, wherever the layout put them, on every rank (one small all-reduce)
        mine = q_pos >= first
        last_q = q.new_zeros(b, last, hq, d)
        last_q[:, q_pos[mine] - first] = q[:, mine]
        dist.all_reduce(last_q, group=group)
        last_pos = torch.arange(first, seq_len, device=q.device)

        qg = last_q.float().view(b, last, hkv, hq // hkv, d)
        logits = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()).reshape(b, hq, last, -1) * scale
        visible = k_pos[None, :] <= last_pos[:, None]  # [last, S_local]
        if doc_ids is not None:  # [B, 1, last, S_local]: same document only
            docs = doc_ids.to(q.device)
            visible = (visible & (docs[:, last_pos, None] == docs[:, None, k_pos]))[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        row_max = logits.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        probs = torch.exp(logits - row_max[..., None])
        row_sum = probs.sum(dim=-1)
        dist.all_reduce(row_sum, group=group)
        probs = probs / row_sum[..., None]  # the softmax over the whole global key range

        # verticals: each rank's best local keys are candidates; the global top set is among them
        vert = probs.sum(dim=2).view(b, heads, -1, probs.shape[-1]).sum(dim=2)  # [B, heads, S_local]
        vert_total = vert.sum(dim=-1)
        dist.all_reduce(vert_total, group=group)
        n_cand = min(settings.max_vertical, vert.shape[-1])
        cand_score, cand_where = torch.topk(vert, n_cand, dim=-1)
        cand_pos = k_pos[cand_where]
        world = dist.get_world_size(group)
        scores_all = [torch.empty_like(cand_score) for _ in range(world)]
        pos_all = [torch.empty_like(cand_pos) for _ in range(world)]
        dist.all_gather(scores_all, cand_score, group=group)
        dist.all_gather(pos_all, cand_pos, group=group)
        vertical = _top_p(torch.cat(scores_all, -1), torch.cat(pos_all, -1), vert_total, settings.recall,
                          min(settings.max_vertical, seq_len), settings.min_vertical)

        # slashes: per-offset mass summed over ranks
        offset = (last_pos[:, None] - k_pos[None, :]).clamp(min=0)  # [last, S_local]
        slash_scores = torch.zeros(b, hq, seq_len, dtype=torch.float32, device=q.device)
        slash_scores.scatter_add_(
            -1, offset.flatten().expand(b, hq, -1), torch.where(visible, probs, 0.0).flatten(2)
        )
        slash_scores = slash_scores.view(b, heads, -1, seq_len).sum(dim=2)
        dist.all_reduce(slash_scores, group=group)
        offsets = torch.arange(seq_len, device=q.device).expand(b, heads, -1)
        slash_recall = settings.recall if settings.slash_recall is None else settings.slash_recall
        slash = _top_p(slash_scores, offsets, slash_scores.sum(-1), slash_recall, settings.max_slash,
                       settings.min_slash)
        if settings.share_kv_group:  # one list per KV group, repeated for its query heads
            vertical = vertical.repeat_interleave(hq // hkv, dim=1)
            slash = slash.repeat_interleave(hq // hkv, dim=1)
    return vertical, slash


def estimate_index(q, k, q_pos, k_pos, seq_len: int, settings: SparseSettings, scale: float, group, *,
                   doc_ids: torch.Tensor | None = None):
    """The global SparseIndex of the estimated lines (identical on every rank of `group`)."""
    from mtrain.ops import SparseIndex

    vertical, slash = estimate_lines(q, k, q_pos, k_pos, seq_len, settings, scale, group, doc_ids)
    return SparseIndex.from_lines(vertical, slash, seq_len, settings.block_size)
