"""Online vertical-slash pattern estimation (DESIGN §3.1): score sampled query rows (the last queries plus
query blocks spread over the sequence) against all keys, count what the always-kept blocks cover, pick
verticals, then block-level slashes on the mass still uncovered, and build the SparseIndex."""

from __future__ import annotations

import functools
import math

import torch

from mtrain.ops.index import SparseIndex


def scored_rows(seq_len: int, last_q: int, sample_blocks: int, block_size: int, device=None) -> torch.Tensor:
    """Sorted query positions the estimator scores: the last `last_q` rows, plus `sample_blocks` query blocks
    of `block_size` rows spread evenly over the full blocks before them (LongTensor [n])."""
    n_last = min(last_q, seq_len)
    first = seq_len - n_last
    avail = first // block_size  # full query blocks entirely before the last rows
    m = min(sample_blocks, avail)
    parts = []
    if m > 0:
        blocks = ((torch.arange(m, device=device) * 2 + 1) * avail) // (2 * m)  # centres of m equal strata
        parts.append((blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten())
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


def fewest(scores: torch.Tensor, ids: torch.Tensor, need: torch.Tensor, cap: int, minimum: int) -> torch.Tensor:
    """The fewest highest-scoring `ids` whose scores sum to `need` [...], kept within [minimum, cap] and only
    with positive scores: [..., width] -1 padded (padding trimmed). `scores` need only hold the candidates."""
    width = max(1, min(cap, scores.shape[-1]))
    top, where = torch.topk(scores, width, dim=-1)
    chosen = torch.gather(ids, -1, where)
    count = _count_to_reach(top, need, width)
    count = count.clamp(min=min(minimum, width), max=width)
    keep = (torch.arange(width, device=scores.device) < count) & (top > 0)
    width = max(1, int(keep.sum(-1).max()))
    return torch.where(keep, chosen, -1)[..., :width]


def _count_to_reach(values: torch.Tensor, need: torch.Tensor, width: int) -> torch.Tensor:
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


# Elements of the largest temporary the q/k recomputations make at once (fp32: 256 MB).
_CHUNK = 1 << 26


def _heads_k(k: torch.Tensor, pos: torch.Tensor, Hq: int) -> torch.Tensor:
    """Keys at positions pos [B, Hq, ..., C] (any >= 0) of each query head's KV head: [B, Hq, ..., C, D]."""
    B, _, Hkv, _ = k.shape
    b = torch.arange(B, device=k.device).view(B, *([1] * (pos.dim() - 1)))
    h = (torch.arange(Hq, device=k.device) // (Hq // Hkv)).view(1, Hq, *([1] * (pos.dim() - 2)))
    return k[b, pos, h]


def _visible(rpos: torch.Tensor, cpos: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
    """Pairs (row at rpos [..., P], column at cpos [..., C], -1 = padding) a causal row sees: [..., P, C]."""
    r, c = rpos[..., :, None], cpos[..., None, :]
    vis = (r >= 0) & (c >= 0) & (c <= r)
    if docs is not None:  # docs [B, S]; rpos / cpos lead with B
        dr = torch.gather(docs, 1, rpos.clamp(min=0).reshape(docs.shape[0], -1)).view(rpos.shape)
        dc = torch.gather(docs, 1, cpos.clamp(min=0).reshape(docs.shape[0], -1)).view(cpos.shape)
        vis = vis & (dr[..., :, None] == dc[..., None, :])
    return vis


def uncovered_blocks_qk(rest, q_rows, k, rows, lse, vertical, block_size: int, scale: float, docs=None):
    """`uncovered_blocks` from q and k instead of stored probabilities: q_rows [B, n, Hq, D] (the scored rows),
    k [B, S, Hkv, D], lse [B, Hq, n] each row's softmax normaliser, vertical [B, Hq, Nv] (-1 padded)."""
    B, n, Hq, _ = q_rows.shape
    kv = _heads_k(k, vertical.clamp(min=0), Hq).float()  # [B, Hq, Nv, D]
    qh = q_rows.transpose(1, 2).float()  # [B, Hq, n, D]
    v_blk = torch.where(vertical >= 0, vertical, 0) // block_size  # [B, Hq, Nv]
    shape = rest.shape
    out = rest.reshape(B, Hq, n, shape[-1]).clone()
    step = max(1, _CHUNK // max(1, B * Hq * vertical.shape[-1]))  # rows per chunk: bounded temporaries
    for r0 in range(0, n, step):
        r = rows[r0:r0 + step]
        logits = torch.matmul(qh[:, :, r0:r0 + step], kv.transpose(-1, -2)).mul_(scale)  # [B, Hq, rows, Nv]
        vis = _visible(r.expand(B, Hq, -1), vertical, docs)
        vis &= (v_blk[..., None, :] != 0) & (v_blk[..., None, :] != (r // block_size)[:, None])
        vals = torch.where(vis, logits.sub_(lse[:, :, r0:r0 + step, None]).exp_(), 0.0)
        out[:, :, r0:r0 + step].scatter_add_(-1, v_blk[..., None, :].expand(B, Hq, r.numel(), -1), -vals)
    return out.view(shape)


def row_groups(rows: torch.Tensor, block_size: int):
    """Scored rows (sorted, on the host) by query block: (blocks [U], table [U, P] of indices into rows, -1
    padded, P = the most rows of one block)."""
    blk = rows // block_size
    blocks, which, counts = torch.unique_consecutive(blk, return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts
    table = torch.full((blocks.numel(), int(counts.max())), -1, dtype=torch.long)
    table[which, torch.arange(rows.numel()) - start[which]] = torch.arange(rows.numel())
    return blocks, table


@functools.lru_cache(maxsize=64)
def _row_plan(seq_len: int, last_q: int, sample_blocks: int, block_size: int, device: torch.device):
    """(rows, blocks, table) of `scored_rows` / `row_groups` on `device`, made once per shape: a host-to-device
    copy in every call would wait for the GPU's queue (a host synchronisation per layer)."""
    rows = scored_rows(seq_len, last_q, sample_blocks, block_size)
    blocks, table = row_groups(rows, block_size)
    return rows.to(device), blocks.to(device), table.to(device)


def covered_mass_qk(index: SparseIndex, plan, pooled, q_rows, k, lse, scale: float, docs=None):
    """`covered_mass` from q and k: pooled [B, Hq, n, nKB] as `score_rows` gives it, q_rows [B, n, Hq, D], lse
    [B, Hq, n]. The column part groups the rows by query block (the rows of one block share its columns)."""
    dev = pooled.device
    B, n, Hq, _ = q_rows.shape
    rows, blocks, table = plan
    in_blocks = _in_blocks(index, rows // index.block_size, pooled).sum(-1)
    if index.col_ids.shape[-1] == 0:
        return in_blocks
    cols = index.col_ids[:, :, blocks].long()  # [B, Hq, U, C]
    cok = (torch.arange(cols.shape[-1], device=dev) < index.col_counts[:, :, blocks, None].long()) & (cols >= 0)
    cols = torch.where(cok, cols, -1)
    U, P = table.shape
    rpos_all = torch.where(table >= 0, rows[table.clamp(min=0)], -1)
    in_cols = torch.zeros_like(in_blocks)
    step = max(1, _CHUNK // max(1, B * Hq * P * cols.shape[-1]))  # query blocks per chunk
    for u0 in range(0, U, step):
        c, t = cols[:, :, u0:u0 + step], table[u0:u0 + step].clamp(min=0)
        kc = _heads_k(k, c.clamp(min=0), Hq).float()  # [B, Hq, u, C, D]
        qg = q_rows.transpose(1, 2)[:, :, t].float()  # [B, Hq, u, P, D]
        logits = torch.matmul(qg, kc.transpose(-1, -2)).mul_(scale)  # [B, Hq, u, P, C]
        vis = _visible(rpos_all[u0:u0 + step].expand(B, Hq, -1, -1), c, docs)
        in_cols += torch.where(vis, logits.sub_(lse[:, :, t][..., None]).exp_(), 0.0).sum((-1, -2, -3))
    return in_blocks + in_cols


def block_slash_mass(pooled: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mass per block offset a (key block = row block - a) summed over rows: [..., n, nKB] -> [..., nKB]."""
    nkb = pooled.shape[-1]
    a = torch.arange(nkb, device=pooled.device)
    key_blk = (rows // block_size)[:, None] - a[None, :]  # [n, nKB]
    got = torch.gather(pooled, -1, key_blk.clamp(min=0).expand(*pooled.shape[:-2], -1, -1))
    return torch.where(key_blk >= 0, got, 0.0).sum(-2)


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
    count = _count_to_reach(torch.gather(value, -1, order), need, value.shape[-1])
    in_prefix = torch.arange(value.shape[-1], device=value.device) < count
    is_column = order < width
    n_v = (in_prefix & is_column).sum(-1, keepdim=True).clamp(min=min(min_v, width), max=width)
    keep = (torch.arange(width, device=top.device) < n_v) & (top > 0)
    return torch.where(keep, ids, -1), torch.where(keep, top, 0.0).sum(-1)


def estimate_vertical_slash(
    q: torch.Tensor,
    k: torch.Tensor,
    recall: float = 0.99,
    last_q: int = 64,
    max_vertical: int = 16384,
    max_slash: int = 16384,
    block_size: int = 64,
    *,
    min_vertical: int = 16,
    min_slash: int = 16,
    share_kv_group: bool = False,
    softmax_scale: float | None = None,
    slash_recall: float | None = None,
    sample_blocks: int = 16,
    cap_fraction: float | None = None,
    doc_ids: torch.Tensor | None = None,
    scorer: str = "auto",
) -> SparseIndex:
    """Estimate the vertical-slash pattern of causal attention and return its `SparseIndex`.

    q: [B, S, Hq, D]; k: [B, S, Hkv, D] (after RoPE). Scored rows (`scored_rows`): the last `last_q` queries
    and `sample_blocks` query blocks spread over the sequence, each a causal softmax over all its keys (so
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
    The returned index carries `index._cache["est_recall"]` (fp32 [B, Hq]): the exact mean mass of the scored
    rows inside the final index (blocks after expansion, sink and diagonal included, and columns).
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
    if scorer not in ("auto", "torch", "triton"):
        raise ValueError(f"scorer must be 'auto', 'torch' or 'triton'; got {scorer!r}")
    pow2 = block_size >= 16 and block_size & (block_size - 1) == 0
    if scorer == "auto":
        scorer = "triton" if q.is_cuda and pow2 else "torch"
    with torch.no_grad():
        docs = None if doc_ids is None else doc_ids.to(q.device)
        plan = _row_plan(S, last_q, sample_blocks, block_size, q.device)
        rows = plan[0]
        n = rows.numel()
        n_blocks = -(-S // block_size)
        k_pos = torch.arange(S, device=q.device)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
        if scorer == "triton":
            from mtrain.ops._triton_estimate import score_rows

            lse, pooled, vert = score_rows(q, k, rows, block_size, scale, docs)
            pooled, vert = pooled.view(B, Hkv, G, n, n_blocks), vert.view(B, Hkv, G, S)
            mandatory, rest = kept_split(pooled, rows, block_size)
            probs = None
        else:
            logits = row_probs(q[:, rows], k, rows, softmax_scale, docs)  # [B, Hkv, G, n, S]
            row_max = logits.amax(-1)
            row_sum = torch.exp(logits - row_max[..., None]).sum(-1)
            probs, pooled, mandatory, vert, rest = residual_parts(logits, rows, k_pos, row_max, row_sum, block_size,
                                                                  n_blocks)
            del logits
        slash0 = block_slash_mass(rest, rows, block_size)
        total = float(rows.numel())
        if share_kv_group:
            mandatory, vert, slash0 = (t.sum(2, keepdim=True) for t in (mandatory, vert, slash0))
            total *= G
        cap_v, cap_s = line_caps(S, block_size, max_vertical, max_slash, cap_fraction)
        v_need = recall * total - mandatory
        v_idx, v_mass = choose_verticals(vert, k_pos.expand(vert.shape), slash0, v_need, cap_v, min_vertical,
                                         block_size)
        # the slash stage sees only what the kept blocks and the chosen verticals leave uncovered
        if probs is None:
            v_heads = v_idx.expand(B, Hkv, G, -1).reshape(B, Hq, -1)
            uncovered = uncovered_blocks_qk(rest, q[:, rows], k, rows, lse, v_heads, block_size, scale, docs)
        else:
            uncovered = uncovered_blocks(probs, rest, rows, k_pos, v_idx, S, block_size)
        slash1 = block_slash_mass(uncovered, rows, block_size)
        if share_kv_group:
            slash1 = slash1.sum(2, keepdim=True)
        s_target = recall if slash_recall is None else slash_recall
        s_need = s_target * total - mandatory - v_mass
        offsets = torch.arange(n_blocks, device=q.device)
        s_idx = fewest(slash1[..., 1:], offsets[1:].expand(*slash1.shape[:-1], -1), s_need, cap_s,
                       -(-min_slash // block_size))
        s_tok = torch.where(s_idx >= 0, s_idx * block_size, -1)
        v_idx = v_idx.expand(B, Hkv, G, -1).reshape(B, Hq, -1)
        s_tok = s_tok.expand(B, Hkv, G, -1).reshape(B, Hq, -1)
        index = SparseIndex.from_lines(v_idx, s_tok, S, block_size)
        if probs is None:
            covered = covered_mass_qk(index, plan, pooled.view(B, Hq, n, -1), q[:, rows], k, lse, scale, docs)
        else:
            covered = covered_mass(index, rows, probs.view(B, Hq, n, S), pooled.view(B, Hq, n, -1), k_pos)
        index._cache["est_recall"] = covered / n
        return index
