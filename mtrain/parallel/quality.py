"""The quality check (`attention.max_output_error`) in a context-parallel group: the relative error of the attention
output of the rows the estimate scored, under the estimated lines against dense attention, as one device measures it
(`mtrain.ops.recall.block_output_error`), with each rank holding only its shard of the keys.

Every rank gets the scored rows' query blocks (each row lives on one rank: one all-reduce of exact values), runs them
through the partial-attention kernel against its own keys twice (on the lines' lists for those blocks, mapped to its
local key blocks and positions, and densely), and the partial results of all ranks are gathered and merged by their
log-sum-exp in rank order: every rank computes the same figure from the same numbers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError


def _local_lists(ids: torch.Tensor, counts: torch.Tensor, owner: torch.Tensor, local: torch.Tensor, rank: int):
    """A global list (ids [..., W] -1 padded, counts) restricted to what `rank` owns, in its local ids (owner / local
    indexed by the global id), ascending and front-packed: (ids int32, counts int32)."""
    width = ids.shape[-1]
    g = ids.long().clamp(min=0)
    valid = (torch.arange(width, device=ids.device) < counts[..., None].long()) & (ids >= 0)
    mine = valid & (owner[g] == rank)
    big = torch.iinfo(torch.int32).max
    packed = torch.sort(torch.where(mine, local[g], big), dim=-1).values  # the owned local ids first, ascending
    return torch.where(packed < big, packed, -1).to(torch.int32), mine.sum(-1, dtype=torch.int32)


def gathered_output_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, lines,
                          seq_len: int, block_size: int, layout, rank: int, group, *, rows: torch.Tensor,
                          softmax_scale: float | None = None, doc_ids: torch.Tensor | None = None,
                          impl: str = "auto") -> torch.Tensor:
    """`block_output_error` of the index built from `lines` = (vertical, slash) on the rows `rows` (a CPU tensor of
    global positions: the estimate's scored rows), in a CP group: fp32 [B], the same on every rank.

    q: [B, S_local, Hq, D], k / v: [B, S_local, Hkv, D], this rank's shard at global `positions` under `layout`
    (every global block of `block_size` tokens must be one local block of one rank: block-stripe with a granularity
    that is a multiple of the block size, zigzag and contiguous layouts with block-aligned chunks). doc_ids: global
    document ids [B, seq_len] or None. Collective over `group`: every rank must call it."""
    from mtrain.ops.index import rows_from_lines
    from mtrain.ops.partial import attention_forward, merge_partial
    from mtrain.ops.recall import relative_error, scored_blocks
    from mtrain.parallel.estimate import scored_queries
    from mtrain.parallel.plan import block_owners, position_owners

    dev = q.device
    blocks_owned = block_owners(layout, seq_len, block_size, dev)
    if blocks_owned is None:
        raise MtrainError(f"the quality check under context parallelism needs whole {block_size}-token blocks on each "
                          "rank (parallel.granularity a multiple of attention.block_size)")
    positions = positions.to(dev)
    pos, at, blocks = scored_blocks(rows, block_size, seq_len, dev)
    qs = scored_queries(q, positions, pos, seq_len, group)  # the scored blocks' queries on every rank

    index = rows_from_lines(lines[0], lines[1], seq_len, block_size, blocks, totals=False, check=False)
    block_lists = _local_lists(index.block_ids, index.block_counts, *blocks_owned, rank)
    column_lists = _local_lists(index.col_ids, index.col_counts, *position_owners(layout, seq_len, dev), rank)
    docs = {} if doc_ids is None else dict(q_doc=doc_ids[:, pos].to(dev), k_doc=doc_ids.to(dev)[:, positions])
    common = dict(q_pos=pos, k_pos=positions, block_size=block_size, softmax_scale=softmax_scale, impl=impl,
                  **docs)
    parts = [attention_forward(qs, k, v, blocks=block_lists, columns=column_lists, **common),
             attention_forward(qs, k, v, **common)]
    merged = []
    for out, lse in parts:  # every rank's partial result, merged by log-sum-exp in rank order
        outs = [torch.empty_like(out, dtype=torch.float32) for _ in range(dist.get_world_size(group))]
        lses = [torch.empty_like(lse) for _ in outs]
        dist.all_gather(outs, out.float().contiguous(), group=group)
        dist.all_gather(lses, lse.contiguous(), group=group)
        acc, acc_lse = outs[0], lses[0]
        for o, l in zip(outs[1:], lses[1:]):
            acc, acc_lse = merge_partial(acc, acc_lse, o, l)
        merged.append(acc)
    return relative_error(merged[0][:, at], merged[1][:, at]).float()
