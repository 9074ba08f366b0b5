"""Online vertical-slash pattern estimation (README, "Sparse attention: the pattern, and where it runs"): score
sampled query rows (the last queries plus query blocks spread over the sequence) against all keys, count what the
always-kept blocks cover, pick verticals, then block-level slashes on the mass still uncovered, and build the
SparseIndex."""

from __future__ import annotations

import functools
import inspect
import math

import torch

from mtrain.ops.index import SparseIndex


def sample_height(block_size: int, sample_rows: int | None) -> int:
    """Rows scored per sampled query block: sample_rows (at most block_size), or the whole block when None. (64-row
    samples of 128-token blocks, the 64-token default's rows, were no faster on SmolLM2 with the fa4 engine and cost
    perplexity; BENCHMARKS.md.)"""
    return block_size if sample_rows is None else min(block_size, sample_rows)


def scored_row_count(seq_len: int, last_q: int, sample_blocks: int, block_size: int,
                     sample_rows: int | None = None) -> int:
    """An upper bound on the rows `scored_rows` returns (what the cost model charges the estimate)."""
    return min(seq_len, last_q + sample_blocks * sample_height(block_size, sample_rows))


def scored_rows(seq_len: int, last_q: int, sample_blocks: int, block_size: int, device=None,
                sample_rows: int | None = None) -> torch.Tensor:
    """Sorted query positions the estimator scores: the last `last_q` rows, plus the first `sample_height`
    rows of `sample_blocks` query blocks spread evenly over the full blocks before them (LongTensor [n])."""
    n_last = min(last_q, seq_len)
    first = seq_len - n_last
    avail = first // block_size  # full query blocks entirely before the last rows
    m = min(sample_blocks, avail)
    parts = []
    if m > 0:
        blocks = ((torch.arange(m, device=device) * 2 + 1) * avail) // (2 * m)  # centres of m equal strata
        height = sample_height(block_size, sample_rows)
        parts.append((blocks[:, None] * block_size + torch.arange(height, device=device)).flatten())
    parts.append(torch.arange(first, seq_len, device=device))
    return torch.cat(parts)


def row_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    softmax_scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled q.k logits of the query rows at positions `rows` (q is [B, n, Hq, D], those rows only) against
    the keys k [B, Sk, Hkv, D] at positions k_pos (default 0..Sk-1), causal (and same-document when doc_ids
    [B, S] of the whole sequence is given), hidden pairs -inf: fp32 [B, Hkv, G, n, Sk]."""
    B, n, Hq, D = q.shape
    Hkv = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    k_pos = torch.arange(k.shape[1], device=q.device) if k_pos is None else k_pos
    s = torch.einsum("bqhgd,bkhd->bhgqk", q.float().reshape(B, n, Hkv, Hq // Hkv, D), k.float()) * scale
    hidden = k_pos[None, :] > rows[:, None]  # [n, Sk]
    if doc_ids is not None:
        hidden = (hidden | (doc_ids[:, rows, None] != doc_ids[:, None, k_pos]))[:, None, None]
    return s.masked_fill_(hidden, float("-inf"))


def last_query_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    last_q: int,
    softmax_scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax of the last `last_q` queries over all keys: fp32 [B, Hkv, G, last_q, S] (query head
    h = hkv * G + g reads kv head hkv; only keys of the row's own document when doc_ids [B, S] is given)."""
    S = q.shape[1]
    rows = torch.arange(S - min(last_q, S), S, device=q.device)
    return torch.softmax(row_probs(q[:, rows], k, rows, softmax_scale, doc_ids), dim=-1)


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
    ids = torch.arange(S, device=scores.device).expand(scores.shape)
    return fewest(scores, ids, recall * scores.sum(-1), cap, minimum)


def fewest(scores: torch.Tensor, ids: torch.Tensor, need: torch.Tensor, cap: int, minimum: int,
           trim: bool = True) -> torch.Tensor:
    """The fewest highest-scoring `ids` whose scores sum to `need` [...], kept within [minimum, cap] and only
    with positive scores: [..., width] -1 padded. `scores` need only hold the candidates. trim: cut the
    padding to the longest selection (reads a count back to the host); else width = min(cap, candidates)."""
    if scores.shape[-1] == 0:  # no candidates (a one-block sequence has no slash offset but 0): one -1 pad
        return torch.full((*scores.shape[:-1], 1), -1, dtype=ids.dtype, device=scores.device)
    width = max(1, min(cap, scores.shape[-1]))
    top, where = torch.topk(scores, width, dim=-1)
    chosen = torch.gather(ids, -1, where)
    count = count_to_reach(top, need, width)
    count = count.clamp(min=min(minimum, width), max=width)
    keep = (torch.arange(width, device=scores.device) < count) & (top > 0)
    if trim:
        width = max(1, int(keep.sum(-1).max()))
    return torch.where(keep, chosen, -1)[..., :width]


def count_to_reach(values: torch.Tensor, need: torch.Tensor, width: int) -> torch.Tensor:
    """[..., 1]: entries of `values` (in order) needed for their running sum to reach `need` [...] (with a
    float slack of 1e-6, so one GPU and a CP group agree); 0 when need <= 0; all when never reached."""
    need = need[..., None]
    reached = values.cumsum(-1) >= need * (1 - 1e-6)
    count = torch.where(reached.any(-1, keepdim=True), reached.float().argmax(-1, keepdim=True) + 1,
                        torch.full_like(need, width, dtype=torch.long))
    return torch.where(need <= 0, 0, count)


def line_caps(seq_len: int, block_size: int, max_vertical: int, max_slash: int,
              cap_fraction: float | None) -> tuple[int, int]:
    """(vertical cap in columns, slash cap in block offsets). max_slash counts token diagonals: a block
    offset counts as block_size of them. cap_fraction (of the sequence, or None) lowers both caps."""
    n_blocks = -(-seq_len // block_size)
    cap_v = min(max_vertical, seq_len)
    cap_s = min(max(1, max_slash // block_size), n_blocks)
    if cap_fraction is not None:
        cap_v = min(cap_v, max(1, math.ceil(cap_fraction * seq_len)))
        cap_s = min(cap_s, max(1, math.ceil(cap_fraction * n_blocks)))
    return cap_v, cap_s


def pool_blocks(x: torch.Tensor, k_pos: torch.Tensor, block_size: int, n_blocks: int) -> torch.Tensor:
    """Sum [..., Sk] over the key blocks of k_pos -> [..., n_blocks] (a reshape when k_pos is 0..Sk-1)."""
    sk = x.shape[-1]
    if sk == k_pos.numel() and int(k_pos[0]) == 0 and int(k_pos[-1]) == sk - 1:  # the whole sequence, in order
        pad = n_blocks * block_size - sk
        return torch.nn.functional.pad(x, (0, pad)).view(*x.shape[:-1], n_blocks, block_size).sum(-1)
    out = x.new_zeros(*x.shape[:-1], n_blocks)
    return out.index_add_(-1, k_pos // block_size, x)


def residual_parts(logits, rows, k_pos, row_max, row_sum, block_size: int, n_blocks: int):
    """From the masked logits [B, Hkv, G, n, Sk] of the scored rows (keys at k_pos) and each row's global
    softmax max and sum: (probs, probs per (row, key block) [B, Hkv, G, n, nKB], the mass on the always-kept
    blocks (sink block 0 and the row's own block) [B, Hkv, G], the rest per column [B, Hkv, G, Sk] and per
    (row, key block) [B, Hkv, G, n, nKB])."""
    probs = logits.sub_(row_max[..., None]).exp_().div_(row_sum[..., None])  # in place: no second copy
    pooled = pool_blocks(probs, k_pos, block_size, n_blocks)
    row_blk = rows // block_size
    mandatory, rest = kept_split(pooled, rows, block_size)
    # column mass outside the kept blocks: all rows, less the rows of the column's own block; block 0 is kept
    blocks, which = torch.unique(row_blk, return_inverse=True)  # the few query blocks the rows lie in
    member = (which[None, :] == torch.arange(blocks.numel(), device=probs.device)[:, None]).to(probs.dtype)
    own = torch.matmul(member, probs)  # [..., U, Sk]: each row block's rows summed (a matmul: fast everywhere)
    slot = torch.full((n_blocks,), -1, dtype=torch.long, device=probs.device)
    slot[blocks] = torch.arange(blocks.numel(), device=probs.device)
    k_slot = slot[k_pos // block_size]  # [Sk]: the key's block among the rows' blocks, or -1
    own = torch.gather(own, -2, k_slot.clamp(min=0).expand(*own.shape[:-2], 1, -1)).squeeze(-2)
    vert = probs.sum(-2) - torch.where(k_slot >= 0, own, 0.0)
    vert = torch.where(k_pos < block_size, 0.0, vert.clamp_(min=0.0))
    return probs, pooled, mandatory, vert, rest


def kept_split(pooled: torch.Tensor, rows: torch.Tensor, block_size: int):
    """(mass on the always-kept blocks, sink block 0 and each row's own block, summed over rows [...]; `pooled`
    [..., n, nKB] with those blocks zeroed)."""
    rest = pooled.clone()
    rest[..., 0] = 0.0
    rest.scatter_(-1, (rows // block_size).expand(*pooled.shape[:-2], -1)[..., None], 0.0)
    return (pooled - rest).sum(-1).sum(-1), rest


def uncovered_blocks(probs, rest, rows, k_pos, vertical, seq_len: int, block_size: int) -> torch.Tensor:
    """`rest` [..., n, nKB] less the mass of the chosen vertical columns (global positions [..., Nv], -1
    padded, broadcastable to probs' heads) outside the always-kept blocks, from this rank's keys k_pos."""
    local = torch.full((seq_len + 1,), -1, dtype=torch.long, device=probs.device)
    local[k_pos] = torch.arange(k_pos.numel(), device=probs.device)
    v = vertical.expand(*probs.shape[:-2], -1)
    slot = local[torch.where(v >= 0, v, seq_len)]  # -1: padding or a key another rank holds
    n = rows.numel()
    vals = torch.gather(probs, -1, slot.clamp(min=0)[..., None, :].expand(*v.shape[:-1], n, -1))
    v_blk = torch.where(v >= 0, v, 0) // block_size
    row_blk = (rows // block_size)[:, None]
    keep = (slot >= 0)[..., None, :] & (v_blk[..., None, :] != 0) & (v_blk[..., None, :] != row_blk)
    return rest.scatter_add(-1, v_blk[..., None, :].expand(*v.shape[:-1], n, -1), -torch.where(keep, vals, 0.0))


def _in_blocks(index, slot: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Mass of each scored row inside its query block's listed key blocks: [B, Hq, n]. slot [n]: the row of the
    index's lists each scored row reads; pooled [B, Hq, n, nKB]: the rows' mass per key block."""
    ids = index.block_ids[:, :, slot].long()
    ok = (torch.arange(ids.shape[-1], device=pooled.device) < index.block_counts[:, :, slot, None].long()) & (ids >= 0)
    return torch.where(ok, torch.gather(pooled, -1, ids.clamp(min=0)), 0.0).sum(-1)


def covered_mass(index, rows, probs, pooled, k_pos, slot=None) -> torch.Tensor:
    """Mass of the scored rows inside `index`, summed over rows, from this rank's keys: [B, Hq]. probs
    [B, Hq, n, Sk] and pooled [B, Hq, n, nKB] as `residual_parts` gives them (heads flattened). slot: the row
    of the index's lists each scored row reads (default its query block; a rank's RowIndex holds only some)."""
    dev = probs.device
    slot = rows // index.block_size if slot is None else slot
    local = torch.full((index.seq_len + 1,), -1, dtype=torch.long, device=dev)
    local[k_pos] = torch.arange(k_pos.numel(), device=dev)
    cols = index.col_ids[:, :, slot].long()
    cok = (torch.arange(cols.shape[-1], device=dev) < index.col_counts[:, :, slot, None].long()) & (cols >= 0)
    where = local[torch.where(cok, cols, index.seq_len)]
    in_cols = torch.where(where >= 0, torch.gather(probs, -1, where.clamp(min=0)), 0.0).sum(-1)
    return (_in_blocks(index, slot, pooled) + in_cols).sum(-1)


def row_groups(rows: torch.Tensor, block_size: int):
    """Scored rows (sorted, on the host) by query block: (blocks [U], table [U, P] of indices into rows, -1
    padded, P = the most rows of one block)."""
    blk = rows // block_size
    blocks, which, counts = torch.unique_consecutive(blk, return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts
    table = torch.full((blocks.numel(), int(counts.max())), -1, dtype=torch.long)
    table[which, torch.arange(rows.numel()) - start[which]] = torch.arange(rows.numel())
    return blocks, table


def estimate_rows(seq_len: int, device=None, **settings) -> torch.Tensor:
    """The query positions `estimate_vertical_slash(q, k, **settings)` scores in a `seq_len`-token sequence, in the
    order it scores them (its defaults where `settings` is silent; other keywords are ignored): LongTensor [n]."""
    given = {name: p.default for name, p in inspect.signature(estimate_vertical_slash).parameters.items()
             if p.default is not inspect.Parameter.empty}
    given.update(settings)
    return row_plan(seq_len, given["last_q"], given["sample_blocks"], given["block_size"],
                    torch.device(device or "cpu"), given["sample_rows"])[0]


@functools.lru_cache(maxsize=64)
def row_plan(seq_len: int, last_q: int, sample_blocks: int, block_size: int, device: torch.device,
             sample_rows: int | None = None):
    """(rows, blocks, table) of `scored_rows` / `row_groups` on `device`, made once per shape: a host-to-device
    copy in every call would wait for the GPU's queue (a host synchronisation per layer)."""
    rows = scored_rows(seq_len, last_q, sample_blocks, block_size, sample_rows=sample_rows)
    blocks, table = row_groups(rows, block_size)
    return rows.to(device), blocks.to(device), table.to(device)


def offset_mass(colsum: torch.Tensor, cols: torch.Tensor, blocks: torch.Tensor, block_size: int,
                n_blocks: int) -> torch.Tensor:
    """Column mass per block offset a = query block - key block: colsum [B, H, U, C] (per query block of the
    scored rows and column, `_triton_estimate.group_column_mass`), cols [B, H, C] the columns' key positions
    in ascending order (-1 padding first), blocks [U] the query blocks -> fp32 [B, H, n_blocks]. Segment sums
    of a float64 prefix sum over the sorted columns, so no scatter: the same sums on every run."""
    dev = colsum.device
    cs = torch.nn.functional.pad(colsum.double().cumsum(-1), (1, 0))  # [B, H, U, C + 1]
    edges = (torch.arange(n_blocks + 1, device=dev) * block_size).expand(*cols.shape[:-1], -1).contiguous()
    bound = torch.searchsorted(cols.contiguous(), edges)  # [B, H, nKB + 1]: columns before each block's start
    at = torch.gather(cs, -1, bound[:, :, None].expand(-1, -1, cs.shape[2], -1))
    per_block = at[..., 1:] - at[..., :-1]  # [B, H, U, nKB]: mass of the columns in key block kb
    kb = blocks[:, None] - torch.arange(n_blocks, device=dev)[None, :]  # [U, nKB]: key block at offset a
    got = torch.gather(per_block, -1, kb.clamp(min=0).expand(*per_block.shape[:2], -1, -1))
    return torch.where(kb >= 0, got, 0.0).sum(-2).float()


def block_slash_mass(pooled: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mass per block offset a (key block = row block - a) summed over rows: [..., n, nKB] -> [..., nKB]."""
    nkb = pooled.shape[-1]
    a = torch.arange(nkb, device=pooled.device)
    key_blk = (rows // block_size)[:, None] - a[None, :]  # [n, nKB]
    got = torch.gather(pooled, -1, key_blk.clamp(min=0).expand(*pooled.shape[:-2], -1, -1))
    return torch.where(key_blk >= 0, got, 0.0).sum(-2)


def kept_mass(mandatory, vert, v_idx, slash1, s_idx) -> torch.Tensor:
    """Mass of the scored rows inside the index the lines build, summed over rows, per query head, from what the
    estimate already holds (no second pass over q and k): the always-kept blocks, plus the chosen verticals'
    mass outside them, plus the chosen block offsets' mass that neither covers. Exact, because the index lists
    for query block i exactly blocks 0 and i, blocks i - a for the chosen offsets a (block-aligned slashes), and
    the verticals as columns where their key block is not listed; `slash1` is each offset's mass less the
    verticals inside it, so nothing is counted twice. Per head: mandatory [B, Hkv, G], vert [B, Hkv, G, S] (column
    mass outside the kept blocks), slash1 [B, Hkv, G, nKB]; v_idx / s_idx [B, Hkv, G or 1, N], -1 padded (the
    columns; the block offsets) -> [B, Hkv, G]."""
    def picked(values, ids):
        ids = ids.expand(*values.shape[:-1], -1)
        return torch.where(ids >= 0, torch.gather(values, -1, ids.clamp(min=0)), 0.0).sum(-1)

    return mandatory + picked(vert, v_idx) + picked(slash1, s_idx)


def choose_verticals(cand_mass, cand_ids, slash_mass, need, cap_v: int, min_v: int, block_size: int):
    """Cost-aware split of the budget: candidate columns (mass per column, [..., C]) and block offsets
    (slash_mass [..., nKB], offset 0 = the kept diagonal) are ranked together by mass per key a query block
    pays (a column costs 1 key, a block offset block_size), and the verticals are the columns inside the
    shortest prefix reaching `need`, within [min_v, cap_v]. Returns (vertical ids [..., <=C] -1 padded,
    their mass [...])."""
    width = max(1, min(cap_v, cand_mass.shape[-1]))
    top, where = torch.topk(cand_mass, width, dim=-1)
    ids = torch.gather(cand_ids, -1, where)
    slashes = slash_mass[..., 1:]
    value = torch.cat([top, slashes], -1)
    priority = torch.cat([top, slashes / block_size], -1)
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    count = count_to_reach(torch.gather(value, -1, order), need, value.shape[-1])
    in_prefix = torch.arange(value.shape[-1], device=value.device) < count
    is_column = order < width
    n_v = (in_prefix & is_column).sum(-1, keepdim=True).clamp(min=min(min_v, width), max=width)
    keep = (torch.arange(width, device=top.device) < n_v) & (top > 0)
    return torch.where(keep, ids, -1), torch.where(keep, top, 0.0).sum(-1)


def _checked_args(q, k, recall: float, sample_rows: int | None, doc_ids, scorer: str, scored_q: bool,
                  block_size: int) -> tuple[int, str]:
    """`estimate_vertical_slash`'s arguments checked (a ValueError names the first that is wrong): returns the
    sequence's length (k's with scored_q) and the scorer that runs ("auto" resolved: "triton" on a GPU at a
    power-of-two block_size >= 16, else "torch")."""
    if not 0.0 < recall <= 1.0:
        raise ValueError(f"recall must be in (0, 1]; got {recall}")
    if sample_rows is not None and sample_rows < 1:
        raise ValueError(f"sample_rows must be >= 1 or None; got {sample_rows}")
    B, S, Hq, _ = q.shape
    if scored_q:
        S = k.shape[1]
    if k.dim() != 4 or k.shape[0] != B or k.shape[1] != S or Hq % k.shape[2] != 0:
        raise ValueError(f"k must be [B={B}, S={S}, Hkv, D] with Hq % Hkv == 0; got {tuple(k.shape)}")
    if doc_ids is not None and (doc_ids.shape != (B, S) or doc_ids.is_floating_point()):
        raise ValueError(
            f"doc_ids must be an integer tensor [B={B}, S={S}]; got {doc_ids.dtype} {tuple(doc_ids.shape)}"
        )
    if scorer not in ("auto", "torch", "triton"):
        raise ValueError(f"scorer must be 'auto', 'torch' or 'triton'; got {scorer!r}")
    pow2 = block_size >= 16 and block_size & (block_size - 1) == 0
    if scorer == "auto":
        scorer = "triton" if q.is_cuda and pow2 else "torch"
    return S, scorer


def _score(scorer: str, q_rows, k, rows, k_pos, block_size: int, scale: float, softmax_scale: float | None, docs):
    """Step 1 of `estimate_vertical_slash`: the scored rows `q_rows` against all keys, split into the mass of the
    always-kept blocks and the rest. Returns (probs [B, Hkv, G, n, S], None with the triton scorer, which writes
    no probabilities; mandatory [B, Hkv, G]; vert [B, Hkv, G, S], the column mass outside the kept blocks; rest
    [B, Hkv, G, n, nKB], the block mass outside them; lse, each row's log-sum-exp from the triton scorer, else
    None)."""
    B, S, Hkv = k.shape[0], k.shape[1], k.shape[2]
    G, n, n_blocks = q_rows.shape[2] // Hkv, rows.numel(), -(-S // block_size)
    if scorer == "triton":
        from mtrain.ops._triton_estimate import score_rows

        with torch.profiler.record_function("est:1 score"):
            lse, pooled, vert = score_rows(q_rows, k, rows, block_size, scale, docs)
        pooled, vert = pooled.view(B, Hkv, G, n, n_blocks), vert.view(B, Hkv, G, S)
        mandatory, rest = kept_split(pooled, rows, block_size)
        return None, mandatory, vert, rest, lse
    logits = row_probs(q_rows, k, rows, softmax_scale, docs)  # [B, Hkv, G, n, S]
    row_max = logits.amax(-1)
    row_sum = torch.exp(logits - row_max[..., None]).sum(-1)
    probs, pooled, mandatory, vert, rest = residual_parts(logits, rows, k_pos, row_max, row_sum, block_size,
                                                          n_blocks)
    return probs, mandatory, vert, rest, None


def _uncovered_offsets(probs, rest, slash_heads, v_idx, q_rows, k, lse, plan, k_pos, scale: float, block_size: int,
                       docs) -> torch.Tensor:
    """Step 3's input in `estimate_vertical_slash`: the mass per block offset [B, Hkv, G, nKB] that the kept blocks
    and the chosen verticals v_idx leave uncovered. From the probabilities when the torch scorer kept them; with
    the triton scorer (probs None), the verticals' mass per offset is recomputed from q and k (`lse` the rows')
    and taken from each offset's mass `slash_heads`."""
    rows, row_blocks, table = plan
    B, S, Hkv = k.shape[0], k.shape[1], k.shape[2]
    Hq = q_rows.shape[2]
    if probs is None:  # the verticals' mass per block offset, from q and k, less what blocks hold
        from mtrain.ops._triton_estimate import group_column_mass

        v_sorted = torch.sort(v_idx, dim=-1).values.expand(B, Hkv, Hq // Hkv, -1).reshape(B, Hq, -1)
        colsum = group_column_mass(q_rows, k, lse, rows, table, v_sorted[:, :, None], scale, block_size,
                                   docs, skip_kept=True)
        held = offset_mass(colsum, v_sorted, row_blocks, block_size, -(-S // block_size)).view(B, Hkv, Hq // Hkv, -1)
        return (slash_heads - held).clamp_(min=0.0)
    uncovered = uncovered_blocks(probs, rest, rows, k_pos, v_idx, S, block_size)
    return block_slash_mass(uncovered, rows, block_size)


def _index_of(v_idx, s_tok, covered, seq_len: int, block_size: int, n: int) -> SparseIndex:
    """The `SparseIndex` of the chosen lines (v_idx, s_tok [B, Hkv, G or 1, N], -1 padded, expanded here to every
    query head), carrying the mean mass of the n scored rows inside it (`covered` [B, Hkv, G] over n) as
    `_cache["est_recall"]` and its `from_lines` arguments as `_cache["lines"]`."""
    B, Hkv, G = covered.shape
    v_idx = v_idx.expand(B, Hkv, G, -1).reshape(B, Hkv * G, -1)
    s_tok = s_tok.expand(B, Hkv, G, -1).reshape(B, Hkv * G, -1)
    with torch.profiler.record_function("est:5 index"):
        index = SparseIndex.from_lines(v_idx, s_tok, seq_len, block_size)
    index._cache["est_recall"] = covered.reshape(B, Hkv * G) / n
    index._cache["lines"] = (v_idx, s_tok)  # `SparseIndex.from_lines` arguments (gradient checkpointing)
    return index


def estimate_vertical_slash(
    q: torch.Tensor, k: torch.Tensor, recall: float = 0.99, last_q: int = 64, max_vertical: int = 16384,
    max_slash: int = 16384, block_size: int = 64, *, min_vertical: int = 16, min_slash: int = 16,
    share_kv_group: bool = False, softmax_scale: float | None = None, slash_recall: float | None = None,
    sample_blocks: int = 32, sample_rows: int | None = None, cap_fraction: float | None = None,
    doc_ids: torch.Tensor | None = None, scorer: str = "auto", scored_q: bool = False,
) -> SparseIndex:
    """Estimate the vertical-slash pattern of causal attention and return its `SparseIndex`.

    q: [B, S, Hq, D]; k: [B, S, Hkv, D] (after RoPE). Scored rows (`scored_rows`): the last `last_q` queries
    and the first `sample_rows` rows (default: all) of `sample_blocks` query blocks spread over the sequence,
    each a causal softmax over all its keys (so
    every row weighs 1 and the target means "mean per-row mass"). Per query head (per KV group with
    share_kv_group, on the scores summed over its heads):
    1. the sink block 0 and each row's own (diagonal) block are always kept: their mass counts first;
    2. columns and block-level slash offsets (a = q_block - k_block, what the kernels pay for) are ranked
       together by mass per key computed (`choose_verticals`) to pick the verticals reaching `recall`;
    3. slash offsets are then chosen on the mass the kept blocks and verticals leave uncovered, the fewest
       reaching `slash_recall` (default `recall`) of all scored mass: a purely vertical pattern buys none.
    Floors and caps: at least min_vertical columns and ceil(min_slash / block_size) offsets; at most
    max_vertical columns and max_slash // block_size offsets (max_slash counts token diagonals), both also
    at most cap_fraction of the sequence's columns / blocks when cap_fraction is set.
    doc_ids: optional integer tensor [B, S] of document ids (packed samples): scored rows then see only keys
    of their own document.
    scorer: how the rows are scored. "torch" materialises the [rows x S] probabilities; "triton" streams them
    through one Triton kernel (`_triton_estimate.score_rows`: two passes, only per-block and per-column sums
    written) and recomputes the few probabilities the later steps read from q and k; "auto" (default) is
    "triton" on a GPU at a power-of-two block_size >= 16, else "torch". Both give the same index up to float
    summation order.
    scored_q: q holds only the scored rows, [B, n, Hq, D] in the order `estimate_rows` gives them (the sequence is
    then k's); the same index as passing the whole q (what the CUDA graph of `graphed.estimate_graphed` copies in).
    The returned index carries `index._cache["est_recall"]` (fp32 [B, Hq]): the exact mean mass of the scored
    rows inside the final index (blocks after expansion, sink and diagonal included, and columns), summed from
    the per-block, per-column and per-offset masses the steps above computed (`kept_mass`).
    """
    S, scorer = _checked_args(q, k, recall, sample_rows, doc_ids, scorer, scored_q, block_size)
    _, _, Hq, D = q.shape
    G = Hq // k.shape[2]
    with torch.no_grad():
        docs = None if doc_ids is None else doc_ids.to(q.device)
        plan = row_plan(S, last_q, sample_blocks, block_size, q.device, sample_rows)
        rows = plan[0]
        n = rows.numel()
        if scored_q and q.shape[1] != n:
            raise ValueError(f"scored_q: q must hold the {n} scored rows of a {S}-token sequence (estimate_rows); "
                             f"got {q.shape[1]}")
        q_rows = q if scored_q else q[:, rows]
        n_blocks = -(-S // block_size)
        k_pos = torch.arange(S, device=q.device)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
        stage = torch.profiler.record_function  # labels for tools/profile_estimate.py (free when not profiling)
        probs, mandatory, vert, rest, lse = _score(scorer, q_rows, k, rows, k_pos, block_size, scale, softmax_scale,
                                                   docs)
        with stage("est:2 verticals"):
            slash_heads = block_slash_mass(rest, rows, block_size)  # [B, Hkv, G, nKB]
        slash0 = slash_heads
        total = float(rows.numel())
        mandatory_heads, vert_heads = mandatory, vert
        if share_kv_group:
            mandatory, vert, slash0 = (t.sum(2, keepdim=True) for t in (mandatory, vert, slash_heads))
            total *= G
        cap_v, cap_s = line_caps(S, block_size, max_vertical, max_slash, cap_fraction)
        v_need = recall * total - mandatory
        with stage("est:2 verticals"):
            v_idx, v_mass = choose_verticals(vert, k_pos.expand(vert.shape), slash0, v_need, cap_v, min_vertical,
                                             block_size)
        # the slash stage sees only what the kept blocks and the chosen verticals leave uncovered
        with stage("est:3 uncovered"):
            slash1 = _uncovered_offsets(probs, rest, slash_heads, v_idx, q_rows, k, lse, plan, k_pos, scale,
                                        block_size, docs)
        slash1_heads = slash1
        if share_kv_group:
            slash1 = slash1.sum(2, keepdim=True)
        s_target = recall if slash_recall is None else slash_recall
        s_need = s_target * total - mandatory - v_mass
        offsets = torch.arange(n_blocks, device=q.device)
        with stage("est:4 slashes"):
            s_idx = fewest(slash1[..., 1:], offsets[1:].expand(*slash1.shape[:-1], -1), s_need, cap_s,
                           -(-min_slash // block_size), trim=probs is not None)
        s_tok = torch.where(s_idx >= 0, s_idx * block_size, -1)
        with stage("est:6 covered"):
            covered = kept_mass(mandatory_heads, vert_heads, v_idx, slash1_heads, s_idx)
        return _index_of(v_idx, s_tok, covered, S, block_size, n)
