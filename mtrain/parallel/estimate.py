"""Online vertical-slash estimation across a CP group: every rank scores the sampled query rows (the global last
queries and strided query blocks) against its own keys (on the GPU through the Triton scorer, the rows' softmax
normaliser combined over ranks in rank order); gathers of small per-head tensors give every rank the lines one
device would pick, and no rank works for all. `estimate_rank_index` then builds only the
rank's own rows of the index (`mtrain.ops.index.RowIndex`), so index time and memory per rank fall as 1/CP."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.attention_settings import SparseSettings
from mtrain.errors import MtrainError
from mtrain.ops.switches import Switches, or_defaults


def _estimate(q, k, q_pos, k_pos, seq_len: int, settings: SparseSettings, scale: float, group,
              doc_ids: torch.Tensor | None = None):
    """(vertical [B, Hq, Nv], slash [B, Hq, Ns], the scored rows' probabilities on this rank's keys
    [B, Hq, n, S_local], the scored rows' positions [n]): the single-device rule of
    `mtrain.ops.estimate_vertical_slash`, with each reduction over keys summed across the group."""
    from mtrain.ops.estimate import (block_slash_mass, fewest, line_caps, residual_parts,
                                     row_probs, scored_rows, uncovered_blocks)

    b, _, hq, _ = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    bs = settings.block_size
    n_blocks = -(-seq_len // bs)
    dev = q.device
    with torch.no_grad():
        rows = scored_rows(seq_len, settings.last_q, settings.sample_blocks, bs, dev, settings.sample_rows)
        n = rows.numel()
        scored_q = scored_queries(q, q_pos, rows, seq_len, group)
        docs = None if doc_ids is None else doc_ids.to(dev)
        logits = row_probs(scored_q, k, rows, scale, docs, k_pos)  # [B, Hkv, G, n, S_local]
        row_max = logits.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        row_sum = torch.exp(logits - row_max[..., None]).sum(dim=-1)
        dist.all_reduce(row_sum, group=group)  # the softmax over the whole global key range
        probs, pooled, mandatory, vert, rest = residual_parts(logits, rows, k_pos, row_max, row_sum, bs, n_blocks)
        del logits
        slash0 = block_slash_mass(rest, rows, bs)
        dist.all_reduce(mandatory, group=group)
        dist.all_reduce(slash0, group=group)
        total = float(n)
        if settings.share_kv_group:
            mandatory, vert, slash0 = (t.sum(2, keepdim=True) for t in (mandatory, vert, slash0))
            total *= g
        cap_v, cap_s = line_caps(seq_len, bs, settings.max_vertical, settings.max_slash, settings.cap_fraction)

        # verticals: each rank's best local keys are candidates; the global top set is among them
        vertical, v_mass = _global_verticals(vert, k_pos, slash0, settings.recall * total - mandatory, cap_v,
                                             settings.min_vertical, bs, group)

        # slashes on the mass the kept blocks and the chosen verticals leave uncovered, summed over ranks
        slash1 = block_slash_mass(uncovered_blocks(probs, rest, rows, k_pos, vertical, seq_len, bs), rows, bs)
        dist.all_reduce(slash1, group=group)
        if settings.share_kv_group:
            slash1 = slash1.sum(2, keepdim=True)
        target = settings.recall if settings.slash_recall is None else settings.slash_recall
        offsets = torch.arange(n_blocks, device=dev)
        blocks = fewest(slash1[..., 1:], offsets[1:].expand(*slash1.shape[:-1], -1),
                        target * total - mandatory - v_mass, cap_s, -(-settings.min_slash // bs))
        slash = torch.where(blocks >= 0, blocks * bs, -1)
        vertical = vertical.expand(b, hkv, g, -1).reshape(b, hq, -1)
        slash = slash.expand(b, hkv, g, -1).reshape(b, hq, -1)
    return vertical, slash, probs.reshape(b, hq, n, -1), pooled.reshape(b, hq, n, -1), rows


def _rank_sum(t: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group's ranks of a small tensor, in rank order (an all-gather, then one sum): the same
    bits on every rank and in every run, whatever the collective's algorithm."""
    return _rank_gather(t, group).sum(0)


def _rank_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[W, *t.shape]: every rank's t, in rank order (flat buffers: gloo wants the output as [W * n])."""
    world = dist.get_world_size(group)
    parts = t.new_empty(world * t.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name, where it exists
    gather(parts, t.contiguous().view(-1), group=group)
    return parts.view(world, *t.shape)


def scored_queries(q, q_pos, rows, seq_len: int, group):
    """[B, n, Hq, D]: the scored rows' queries, wherever the layout put them, on every rank (one small all-reduce
    of exact values: every row is non-zero on one rank only)."""
    local = torch.full((seq_len,), -1, dtype=torch.long, device=q.device)
    local[q_pos] = torch.arange(q_pos.numel(), device=q.device)  # where each position lies in this shard
    at = local[rows]  # [n]: the scored rows' local index, -1 where another rank holds them (gathers only: no sync)
    scored_q = torch.where((at >= 0)[None, :, None, None], q[:, at.clamp(min=0)], 0).to(q.dtype)
    dist.all_reduce(scored_q, group=group)
    return scored_q


def _estimate_triton(q, k, q_pos, k_pos, seq_len: int, settings: SparseSettings, scale: float, group,
                     doc_ids, key_blocks: torch.Tensor):
    """`_estimate`'s lines through the Triton scorer (`mtrain.ops._triton_estimate.score_rows` over this rank's key
    blocks `key_blocks`, the global softmax normaliser from every rank's max / sum combined in rank order), with
    no [rows x S_local] tensor: (vertical [B, Hq, Nv], slash [B, Hq, Ns], est_recall [B, Hq] = the scored rows' mean
    mass inside the index). The per-head sums cross ranks as rank-ordered gathers (`_rank_sum`)."""
    from mtrain.ops._triton_estimate import combine_stats, group_column_mass, score_rows
    from mtrain.ops.estimate import fewest, line_caps, offset_mass, row_plan

    b, _, hq, _ = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    bs = settings.block_size
    n_blocks = -(-seq_len // bs)
    dev = q.device
    with torch.no_grad():
        rows, row_blocks, table = row_plan(seq_len, settings.last_q, settings.sample_blocks, bs, dev,
                                           settings.sample_rows)
        n = rows.numel()
        scored_q = scored_queries(q, q_pos, rows, seq_len, group)
        docs = None if doc_ids is None else doc_ids.to(dev)

        def combine(m, l):
            both = _rank_gather(torch.stack([m, l]), group)  # one collective for the max and the sum
            return combine_stats(both[:, 0], both[:, 1])

        lse, pooled, vert = score_rows(scored_q, k, rows, bs, scale, docs, key_blocks=key_blocks, combine=combine)
        n_local = key_blocks.numel()
        pooled = pooled.view(b, hkv, g, n, n_local)
        vert = vert.view(b, hkv, g, -1)
        kb = key_blocks.to(device=dev, dtype=torch.long)
        kept = (kb[None, :] == 0) | (kb[None, :] == (rows // bs)[:, None])  # [n, nKB_local]: sink and own blocks
        mandatory = torch.where(kept, pooled, 0.0).sum(-1).sum(-1)  # [B, Hkv, G], this rank's part
        rest = torch.where(kept, 0.0, pooled)
        # per query block of the scored rows, then per block offset a (key block = row block - a) over local blocks
        per_block = torch.where(table >= 0, 1.0, 0.0)[..., None] * rest[..., table.clamp(min=0), :]
        per_block = per_block.sum(-2)  # [B, Hkv, G, U, nKB_local]
        slot_of = torch.full((n_blocks,), -1, dtype=torch.long, device=dev)
        slot_of[kb] = torch.arange(n_local, device=dev)
        key_blk = row_blocks[:, None] - torch.arange(n_blocks, device=dev)[None, :]  # [U, nKB]
        at = torch.where(key_blk >= 0, slot_of[key_blk.clamp(min=0)], -1)
        got = torch.gather(per_block, -1, at.clamp(min=0).expand(b, hkv, g, -1, -1))
        slash_heads = torch.where(at >= 0, got, 0.0).sum(-2)  # [B, Hkv, G, nKB], this rank's part
        # both sums over the ranks in one collective
        summed = _rank_sum(torch.cat([mandatory[..., None], slash_heads], -1), group)
        mandatory, slash_heads = summed[..., 0], summed[..., 1:]
        slash0 = slash_heads
        total = float(n)
        mandatory_heads = mandatory
        vert_cand = vert
        if settings.share_kv_group:
            mandatory, vert_cand, slash0 = (t.sum(2, keepdim=True) for t in (mandatory, vert, slash_heads))
            total *= g
        cap_v, cap_s = line_caps(seq_len, bs, settings.max_vertical, settings.max_slash, settings.cap_fraction)
        vertical, v_mass = _global_verticals(vert_cand, k_pos, slash0, settings.recall * total - mandatory, cap_v,
                                             settings.min_vertical, bs, group)

        # the chosen verticals this rank holds: their mass per block offset (outside the kept blocks) from q and k
        v_heads = vertical.expand(b, hkv, g, -1).reshape(b, hq, -1)
        v_slot = torch.where(v_heads >= 0, slot_of[v_heads.clamp(min=0) // bs], -1)
        v_mine = torch.sort(torch.where(v_slot >= 0, v_heads, -1), dim=-1).values  # ascending, -1 first
        v_loc = torch.where(v_mine >= 0, slot_of[v_mine.clamp(min=0) // bs] * bs + v_mine.clamp(min=0) % bs, -1)
        colsum = group_column_mass(scored_q, k, lse, rows, table, v_mine[:, :, None], scale, bs, docs,
                                   skip_kept=True, cols_local=v_loc[:, :, None])
        # the chosen verticals' mass this rank holds (for the recall figure) summed with `held` in one collective
        vert_flat = vert.reshape(b, hq, -1)
        in_cols = torch.where(v_loc >= 0, torch.gather(vert_flat, -1, v_loc.clamp(min=0)), 0.0).sum(-1)
        summed = _rank_sum(torch.cat([offset_mass(colsum, v_mine, row_blocks, bs, n_blocks),
                                      in_cols[..., None].to(colsum.dtype)], -1), group)
        held, in_cols = summed[..., :-1].reshape(b, hkv, g, -1), summed[..., -1]
        slash1_heads = (slash_heads - held).clamp_(min=0.0)
        slash1 = slash1_heads.sum(2, keepdim=True) if settings.share_kv_group else slash1_heads
        target = settings.recall if settings.slash_recall is None else settings.slash_recall
        offsets = torch.arange(n_blocks, device=dev)
        blocks = fewest(slash1[..., 1:], offsets[1:].expand(*slash1.shape[:-1], -1),  # trim=False: no host read
                        target * total - mandatory - v_mass, cap_s, -(-settings.min_slash // bs), trim=False)
        slash = torch.where(blocks >= 0, blocks * bs, -1)

        # the scored rows' mass inside the index: kept blocks + chosen verticals (summed where they are held) +
        # chosen offsets' uncovered mass (as `mtrain.ops.estimate.kept_mass`)
        s_heads = blocks.expand(b, hkv, g, -1)
        in_slash = torch.where(s_heads >= 0, torch.gather(slash1_heads, -1, s_heads.clamp(min=0)), 0.0).sum(-1)
        covered = mandatory_heads.reshape(b, hq) + in_cols + in_slash.reshape(b, hq)
        slash = slash.expand(b, hkv, g, -1).reshape(b, hq, -1)
    return v_heads, slash, covered / n


def use_triton_scorer(scorer: str, q: torch.Tensor, block_size: int, key_blocks) -> bool:
    """Whether `scorer` ("auto", "torch", "triton") scores with the Triton kernels for these inputs."""
    if scorer not in ("auto", "torch", "triton"):
        raise MtrainError(f"scorer must be 'auto', 'torch' or 'triton'; got {scorer!r}")
    if scorer == "torch":
        return False
    pow2 = block_size >= 16 and block_size & (block_size - 1) == 0
    usable = pow2 and key_blocks is not None
    if scorer == "triton" and not usable:
        raise MtrainError(
            "scorer='triton' needs a power-of-two block size >= 16 and a shard made of whole, ascending key blocks "
            f"(block-stripe, zigzag or contiguous layouts with block-aligned chunks); block_size={block_size}")
    return usable and (scorer == "triton" or q.is_cuda)


def shard_key_blocks(k_pos: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """The global block of each of a shard's key blocks when the shard (positions k_pos, in storage order) is made
    of whole blocks in ascending order, else None. Reads the check back to the host: callers that know the layout
    pass `mtrain.parallel.plan.shard_key_blocks` instead."""
    if k_pos.numel() % block_size:
        return None
    kp = k_pos.view(-1, block_size)
    first = kp[:, 0]
    whole = bool(((kp - first[:, None]) == torch.arange(block_size, device=k_pos.device)).all()
                 and (first % block_size == 0).all() and (first[1:] > first[:-1]).all())
    return first // block_size if whole else None


# First round of the vertical candidates: each rank sends its best max(FIRST_ROUND_MIN, FIRST_ROUND x cap / W)
# columns per head instead of its best cap (at CP=128 and a 4096 cap, its whole score vector: ~100 MiB per
# layer for 16 heads). A second round sends the full lists only where the first cannot be proven exact.
FIRST_ROUND = 4
FIRST_ROUND_MIN = 64
# Groups of at most this many ranks (a node) send their best cap at once: one round always, so no host read decides
# on a second and a CUDA graph can hold the exchange (at the recipes' caps, CP=8 and 16 heads: ~34 MiB gathered per
# layer, where the first round's check read the host on every layer).
ONE_ROUND_WORLD = 8


def first_round(full: int, cap_v: int, world: int, min_v: int = 0) -> int:
    """Vertical candidates a rank sends per head in the first round of the exchange, of its `full` (its best cap):
    all of them in groups of at most ONE_ROUND_WORLD ranks (one round), else FIRST_ROUND x cap / W (at least
    FIRST_ROUND_MIN and min_v)."""
    if world <= ONE_ROUND_WORLD:
        return full
    return min(full, max(FIRST_ROUND_MIN, min_v, FIRST_ROUND * -(-cap_v // world)))


def _gather_last(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, -1)


def _gather_candidates(mass: torch.Tensor, positions: torch.Tensor, group):
    """`_gather_last` of a rank's candidate masses and their key positions in one collective (both as float64:
    positions below 2**53 and fp32 masses travel exactly)."""
    both = _gather_last(torch.stack([mass.double(), positions.double()]), group)
    return both[0].to(mass.dtype), both[1].long()


def _cutoff(cand_mass, slash_mass, need, cap_v: int, min_v: int, block_size: int, full_width: int):
    """Per head, the priority above which every column must be among the candidates for `choose_verticals` on
    them to pick what it picks on all columns: the last item of its prefix and its last chosen column (-inf where
    that cannot hold: it chose every candidate column while the full lists hold more)."""
    from mtrain.ops.estimate import count_to_reach

    width = max(1, min(cap_v, cand_mass.shape[-1]))
    top = torch.topk(cand_mass, width, dim=-1).values
    value = torch.cat([top, slash_mass[..., 1:]], -1)
    priority = torch.cat([top, slash_mass[..., 1:] / block_size], -1)
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    ranked = torch.gather(value, -1, order)
    count = count_to_reach(ranked, need, value.shape[-1])  # [..., 1]
    reached = ranked.cumsum(-1)[..., -1:] >= need[..., None] * (1 - 1e-6)
    p_sorted = torch.gather(priority, -1, order)
    inf = torch.full_like(count, float("inf"), dtype=top.dtype)
    # where the need is reached, the prefix ends at its last item; where it is not, the prefix is everything and
    # every column is chosen up to the width, so only the chosen set's last column matters
    p_last = torch.where((count > 0) & reached, torch.gather(p_sorted, -1, (count - 1).clamp(min=0)), inf)
    n_v = ((torch.arange(value.shape[-1], device=top.device) < count) & (order < width)).sum(-1, keepdim=True)
    n_v = n_v.clamp(min=min(min_v, width), max=width)
    last_col = torch.where(n_v > 0, torch.gather(top, -1, (n_v - 1).clamp(min=0)), inf)
    cut = torch.minimum(p_last, last_col)
    if width < min(cap_v, full_width):  # the full lists could choose more columns than the candidates hold
        cut = torch.where(n_v >= width, -inf, cut)
    return cut[..., 0]


def _global_verticals(vert, k_pos, slash0, need, cap_v: int, min_v: int, block_size: int, group):
    """`choose_verticals` over every rank's columns (vert [..., S_local] mass per local key at k_pos), exchanging
    only candidates: a first round of each rank's best few per head is exact when, on every head, each rank's last
    sent mass lies below the selection's cutoff (`_cutoff`) or the cap is filled by sent columns above all of them;
    else a second round sends each rank's best cap.
    Every rank decides from the same gathered numbers, so all take the same branch."""
    from mtrain.ops.estimate import choose_verticals

    world = dist.get_world_size(group)
    full = min(cap_v, vert.shape[-1])
    first = first_round(full, cap_v, world, min_v)
    if first < full:
        mass, where = torch.topk(vert, first, dim=-1)
        masses, positions = _gather_candidates(mass, k_pos[where], group)
        unsent = _gather_last(mass[..., -1:], group).amax(-1)  # no unsent column weighs more than its rank's last
        cut = _cutoff(masses, slash0, need, cap_v, min_v, block_size, full * world)
        # or the cap binds above every unsent column: the choice is then the top cap columns, all of them sent
        capped = (masses > unsent[..., None]).sum(-1) >= min(cap_v, full * world)
        if bool(((unsent < cut) | capped).all()):
            return choose_verticals(masses, positions, slash0, need, cap_v, min_v, block_size)
    mass, where = torch.topk(vert, full, dim=-1)
    return choose_verticals(*_gather_candidates(mass, k_pos[where], group), slash0, need, cap_v, min_v, block_size)


def _lines_and_recall(q, k, q_pos, k_pos, seq_len, settings, scale, group, doc_ids, scorer, key_blocks):
    """(vertical, slash, est_recall, torch_parts) by the chosen scorer: the Triton scorer gives est_recall [B, Hq]
    itself (torch_parts None); the torch one gives est_recall None and torch_parts = (probs, pooled, scored rows),
    from which the caller measures the recall inside the index it builds."""
    if key_blocks is None and scorer != "torch":
        key_blocks = shard_key_blocks(k_pos, settings.block_size)
    if use_triton_scorer(scorer, q, settings.block_size, key_blocks):
        vertical, slash, recall = _estimate_triton(q, k, q_pos, k_pos, seq_len, settings, scale, group, doc_ids,
                                                   key_blocks)
        return vertical, slash, recall, None
    vertical, slash, probs, pooled, rows = _estimate(q, k, q_pos, k_pos, seq_len, settings, scale, group, doc_ids)
    return vertical, slash, None, (probs, pooled, rows)


def estimate_lines(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
    settings: SparseSettings, scale: float, group, doc_ids: torch.Tensor | None = None, *,
    scorer: str = "auto", key_blocks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(vertical [B, Hq, Nv], slash [B, Hq, Ns]), -1 padded, identical on every rank of `group`.

    q [B, S_local, Hq, D], k [B, S_local, Hkv, D] local shards; q_pos/k_pos their global positions. The lines
    are those `mtrain.ops.estimate_vertical_slash` picks from the whole sequence (slashes are block-level
    offsets a * block_size); every rank scores the sampled rows against its own keys, and small all-reduces
    and one all-gather of vertical candidates give every rank the same lines.
    doc_ids: global document ids [B, seq_len] (the same on every rank) or None: the scored rows then see only
    keys of their own document, as `estimate_vertical_slash(..., doc_ids=)` does.
    scorer: "triton" scores through the Triton scorer on this rank's key blocks (no [rows x S_local] tensor; GPU, or
    TRITON_INTERPRET=1), "torch" materialises the rows' probabilities, "auto" (default) is "triton" on a GPU where the
    shard is made of whole key blocks (key_blocks: their global ids, `mtrain.parallel.plan.shard_key_blocks`; else
    derived from k_pos with one host read).
    """
    vertical, slash, _, _ = _lines_and_recall(q, k, q_pos, k_pos, seq_len, settings, scale, group, doc_ids, scorer,
                                              key_blocks)
    return vertical, slash


def estimate_index(q, k, q_pos, k_pos, seq_len: int, settings: SparseSettings, scale: float, group, *,
                   doc_ids: torch.Tensor | None = None, scorer: str = "auto", key_blocks: torch.Tensor | None = None):
    """The global SparseIndex of the estimated lines (identical on every rank of `group`), carrying
    `_cache["est_recall"]` (fp32 [B, Hq]: the scored rows' mass inside the index, summed over ranks). scorer,
    key_blocks: as `estimate_lines`."""
    from mtrain.ops import SparseIndex
    from mtrain.ops.estimate import covered_mass

    vertical, slash, recall, parts = _lines_and_recall(q, k, q_pos, k_pos, seq_len, settings, scale, group, doc_ids,
                                                       scorer, key_blocks)
    index = SparseIndex.from_lines(vertical, slash, seq_len, settings.block_size)
    if recall is not None:
        index._cache["est_recall"] = recall
        return index
    probs, pooled, rows = parts
    with torch.no_grad():
        covered = covered_mass(index, rows, probs, pooled, k_pos.to(probs.device))
        dist.all_reduce(covered, group=group)
    index._cache["est_recall"] = covered / rows.numel()
    return index


def rank_rows(q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """The global query blocks (ascending, distinct) that the positions `q_pos` of one rank's shard fall in."""
    return torch.unique(q_pos // block_size)


def _covered_rows(lists, rows, probs, pooled, k_pos) -> torch.Tensor:
    """`mtrain.ops.estimate.covered_mass` from a RowIndex holding (at least) the scored rows' query blocks."""
    from mtrain.ops.estimate import covered_mass

    slot = torch.searchsorted(lists.rows, rows // lists.block_size)
    return covered_mass(lists, rows, probs, pooled, k_pos, slot=slot)


# Lists as wide as the lines allow (every slash and vertical slot, `rows_from_lines(bound_widths="static")`) are
# used without reading the chosen widths back when a rank's lists then take at most `Switches.static_width_bytes`
# (parallel.static_width_mib; 64 MiB): the host read drains the GPU's queue, and the host's index and plan work then
# runs with the GPU idle.


def lists_bytes(b: int, h: int, n_rows: int, n_slash: int, n_vertical: int) -> int:
    """Bytes of int32 block and column lists over `n_rows` query blocks of `h` heads (batch `b`) as wide as `n_slash`
    slash block offsets (two key blocks each: a slash line crosses at most two) plus the sink and diagonal blocks, and
    `n_vertical` columns, allow."""
    return b * h * n_rows * (2 * n_slash + 2 + n_vertical) * 4


def static_list_bytes(vertical: torch.Tensor, slash: torch.Tensor, n_rows: int) -> int:
    """Bytes of a rank's block and column lists (int32) over `n_rows` query blocks at the widths the lines allow."""
    b, h = vertical.shape[:2]
    return lists_bytes(b, h, n_rows, slash.shape[-1], vertical.shape[-1])


# Where a rank's lists as wide as the lines allow would pass the static width limit (the recipes' caps), its rows
# hold no column lists (parallel.list_free_columns, on by default): the ring reads the columns list-free
# (`mtrain.ops.columns.RingColumns`: each head's sorted verticals and block offsets), so a layer's index takes
# B x H x (rows x block offsets + verticals) ints instead of B x H x rows x the vertical cap (~1 GiB per layer at
# 128K tokens per GPU, 16 heads and 16,384-vertical caps); their widths then come from one host read, or under the
# gathered schedule are static (`rank_list_widths`). Off: lists as before, widths from the read.


def columns_list_free(b: int, h: int, n_rows: int, n_slash: int, n_vertical: int, *,
                      switches: Switches | None = None) -> bool:
    """Whether a rank's rows of lines this wide hold their columns list-free: where lists as wide as they allow
    (`lists_bytes`) would pass `switches.static_width_bytes`, under `parallel.list_free_columns` (`switches`; None =
    the defaults)."""
    switches = or_defaults(switches)
    return switches.list_free_columns and lists_bytes(b, h, n_rows, n_slash, n_vertical) > \
        switches.static_width_bytes


def rank_list_widths(vertical: torch.Tensor, slash: torch.Tensor, n_rows: int, *, schedule: str = "ring",
                     switches: Switches | None = None) -> bool | str:
    """`rows_from_lines`' bound_widths for a rank's rows of these lines: "static" (no host read) where those lists
    take at most `switches.static_width_bytes` (parallel.static_width_mib; None = the defaults), else True (one host
    read). Under the
    gathered schedule (`schedule` "gather") the rows hold no column lists where they would be wide
    (`parallel.list_free_columns`), so "static" too where the block lists alone fit: the column union is then as
    wide as the verticals' slots, for which the gathered K/V buffers already keep room
    (`mtrain.parallel.ring_gather.spare_bound`); the ring schedule keeps the read, which sizes the columns' all-gather.
    Recomputation (gradient checkpointing) asks the same, so a layer's replay builds the lists
    its first forward did."""
    switches = or_defaults(switches)
    if static_list_bytes(vertical, slash, n_rows) <= switches.static_width_bytes:
        return "static"
    if switches.list_free_columns and schedule == "gather" and static_list_bytes(vertical[..., :0], slash, n_rows) \
            <= switches.static_width_bytes:  # (list-free: the lists with their columns did not fit)
        return "static"
    return True


def rank_index_of_lines(vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int,
                        rows: torch.Tensor, *, read_also: tuple = (), schedule: str = "ring",
                        switches: Switches | None = None):
    """This rank's RowIndex of the lines for its query blocks `rows`, as `estimate_rank_index` builds it and gradient
    checkpointing's recomputation rebuilds it (the same widths and form, from the shapes alone): widths from
    `rank_list_widths`, and no column lists where lists as wide as the lines allow would pass
    `switches.static_width_bytes` (`parallel.list_free_columns`: the ring reads the columns list-free from the lines,
    kept as `_cache["lines"]`); `switches`: the run's (None = the defaults), which a recomputation must pass as its
    first forward did."""
    from mtrain.ops.index import rows_from_lines

    widths = rank_list_widths(vertical, slash, rows.numel(), schedule=schedule, switches=switches)
    list_free = columns_list_free(*vertical.shape[:2], rows.numel(), slash.shape[-1], vertical.shape[-1],
                                  switches=switches)
    index = rows_from_lines(vertical, slash, seq_len, block_size, rows, check=False, bound_widths=widths,
                            read_also=read_also, columns=not list_free)
    index._cache["lines"] = (vertical, slash, rows)  # what gradient checkpointing's recomputation rebuilds from
    return index


def estimate_rank_index(q, k, q_pos, k_pos, seq_len: int, settings: SparseSettings, scale: float, group, *,
                        doc_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None, scorer: str = "auto",
                        key_blocks: torch.Tensor | None = None, schedule: str = "ring",
                        switches: Switches | None = None):
    """This rank's rows of the index `estimate_index` gives (a `mtrain.ops.index.RowIndex` over the query blocks
    of q_pos, entry for entry the same lists), with the whole index's work, density and column union from the
    lines, and `_cache["est_recall"]` as `estimate_index` sets it. No rank builds the other ranks' rows: index
    time and memory per rank fall as 1/CP (the lines and O(nQB) per head are what every rank still holds).
    rows: `rank_rows(q_pos, block_size)` made once by the caller (`mtrain.parallel.plan.rank_blocks` caches them
    per layout), else computed here. scorer, key_blocks: as `estimate_lines`. The lists' widths are bounds, so the
    ring plan built from the index reads nothing back: where lists as wide as the lines allow take at most
    `switches.static_width_bytes` (small caps), those widths, with no host read at all (`rows_from_lines(bound_widths=
    "static")`); else no column lists (`parallel.list_free_columns`) and bounds from one host read
    (`bound_widths=True`), or, for the gathered schedule (`schedule` "gather"), static widths again
    (`rank_list_widths`). switches: the run's (`mtrain.ops.switches`; None = the defaults)."""
    lines = _lines_and_recall(q, k, q_pos, k_pos, seq_len, settings, scale, group, doc_ids, scorer, key_blocks)
    return rank_index_from_lines(lines, q_pos, k_pos, seq_len, settings, group, rows=rows, schedule=schedule,
                                 switches=switches)


def estimate_rank_lines(q, k, q_pos, k_pos, seq_len: int, settings: SparseSettings, scale: float, group, *,
                        doc_ids: torch.Tensor | None = None, key_blocks: torch.Tensor | None = None):
    """The first half of `estimate_rank_index` with the Triton scorer: (vertical, slash, est_recall, None), the
    lines every rank agrees on. No host read where the vertical exchange takes one round (CP groups of at most
    ONE_ROUND_WORLD ranks, or shards short against the cap), at any cap: a CUDA graph can hold it where it cannot hold
    the index the lines make (`rank_index_from_lines` reads the lists' widths back at large caps)."""
    return _lines_and_recall(q, k, q_pos, k_pos, seq_len, settings, scale, group, doc_ids, "triton", key_blocks)


def rank_index_from_lines(lines, q_pos, k_pos, seq_len: int, settings: SparseSettings, group, *,
                          rows: torch.Tensor | None = None, schedule: str = "ring",
                          switches: Switches | None = None):
    """The second half of `estimate_rank_index`: this rank's RowIndex from `lines` = (vertical, slash, est_recall,
    torch_parts) as `_lines_and_recall` gives them (est_recall None and torch_parts set by the torch scorer, whose
    recall is measured here inside the index)."""
    from mtrain.ops.index import rows_from_lines

    vertical, slash, recall, parts = lines
    bs = settings.block_size
    rows = rank_rows(q_pos, bs) if rows is None else rows
    also = () if recall is None else (recall.double().mean(),)  # what a layer's dense/sparse choice reads
    index = rank_index_of_lines(vertical, slash, seq_len, bs, rows, read_also=also, schedule=schedule,
                                switches=switches)
    if recall is not None:
        index._cache["est_recall"] = recall
        return index
    probs, pooled, scored = parts
    with torch.no_grad():
        # the scored rows' lists (a few query blocks, whichever rank holds them) for the recall figure
        lists = rows_from_lines(vertical, slash, seq_len, bs, torch.unique(scored // bs), totals=False, check=False)
        covered = _covered_rows(lists, scored, probs, pooled, k_pos.to(probs.device))
        dist.all_reduce(covered, group=group)
    index._cache["est_recall"] = covered / scored.numel()
    return index
