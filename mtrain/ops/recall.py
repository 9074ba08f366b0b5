"""True recall of a sparse index: the exact softmax mass of causal attention that the index keeps, per head,
averaged over query rows (all of them, or a sample), computed in row chunks so memory stays bounded."""

from __future__ import annotations

import functools
import math

import torch

from mtrain.ops.backends import host_to_device
from mtrain.ops.index import SparseIndex

# Elements of one chunk's [B, Hq, rows, keys] score tensor (fp32: 128 MiB).
_CHUNK_ELEMS = 1 << 25


def index_row_mask(index: SparseIndex, rows: torch.Tensor, k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [B, Hq, R, Sk]: which keys at positions k_pos (default all, 0..S-1) the index computes for the
    query rows at global positions rows [R]: the key's block is listed for the row's query block, or the key is
    one of that block's extra columns; and key <= row (causal). Document masking is not applied here.
    `index` may be a `RowIndex` (some query blocks' lists, e.g. a CP rank's): it must hold the rows' blocks."""
    dev = index.block_ids.device
    rows = rows.to(dev).long()
    k_pos = torch.arange(index.seq_len, device=dev) if k_pos is None else k_pos.to(dev).long()
    bs, nkb = index.block_size, index.n_blocks
    qb = rows // bs
    held = getattr(index, "rows", None)  # a RowIndex lists only its query blocks `rows`, in ascending order
    slot = qb if held is None else torch.searchsorted(held.to(dev).long(), qb)
    ids = index.block_ids[:, :, slot].long()  # [B, H, R, MAXB]
    ok = (torch.arange(ids.shape[-1], device=dev) < index.block_counts[:, :, slot, None].long()) & (ids >= 0)
    bflags = torch.zeros(*ids.shape[:3], nkb + 1, dtype=torch.bool, device=dev)
    bflags.scatter_(-1, torch.where(ok, ids, nkb), True)
    mask = bflags[..., k_pos // bs]
    cols = index.col_ids[:, :, slot].long()
    cok = (torch.arange(cols.shape[-1], device=dev) < index.col_counts[:, :, slot, None].long()) & (cols >= 0)
    cflags = torch.zeros(*cols.shape[:3], index.seq_len + 1, dtype=torch.bool, device=dev)
    cflags.scatter_(-1, torch.where(cok, cols, index.seq_len), True)
    mask |= cflags[..., k_pos]
    return mask & (k_pos[None, :] <= rows[:, None])


def true_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    softmax_scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean per-row share of the exact causal attention mass that falls inside `index`: fp32 [B, Hq].

    q: [B, S, Hq, D], k: [B, S, Hkv, D] (after RoPE; K is never repeated for GQA). Each query row's softmax
    runs over all its causal keys (same-document keys only when doc_ids [B, S] is given); its recall is the
    part of that mass on the (query, key) pairs the index computes (listed blocks + columns). rows: LongTensor
    of query positions to average over (a cheap sampled estimate); None = every row. Work runs in chunks of
    rows against the keys up to the chunk's last row, in fp32 (fp64 for fp64 inputs), so memory is bounded by
    one [B, Hq, rows, keys] chunk of about 2^25 elements.
    """
    B, S, Hq, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[1] != S or Hq % k.shape[2] != 0:
        raise ValueError(f"k must be [B={B}, S={S}, Hkv, D] with Hq % Hkv == 0; got {tuple(k.shape)}")
    if index.seq_len != S or index.block_ids.shape[:2] != (B, Hq):
        raise ValueError(f"index is for [B, Hq] = {tuple(index.block_ids.shape[:2])} and {index.seq_len} tokens; "
                         f"q is [B={B}, S={S}, Hq={Hq}]: estimate the index from these q/k")
    if doc_ids is not None and (doc_ids.shape != (B, S) or doc_ids.is_floating_point()):
        raise ValueError(f"doc_ids must be an integer tensor [B={B}, S={S}]; got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    Hkv = k.shape[2]
    G = Hq // Hkv
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    dev = q.device
    # the rows on the host (a read only where the caller's are on the device): their checks and each chunk's key
    # count are host arithmetic, not a wait for the device per chunk
    host = list(range(S)) if rows is None else sorted(torch.as_tensor(rows).detach().long().reshape(-1).tolist())
    if not host or host[0] < 0 or host[-1] >= S:
        raise ValueError(f"rows must be a non-empty set of query positions in [0, {S}); got {len(host)} rows")
    rows = host_to_device(torch.tensor(host, dtype=torch.long), dev)
    kf = k.to(dt)
    total = torch.zeros(B, Hq, dtype=dt, device=dev)
    step = max(1, _CHUNK_ELEMS // max(1, B * Hq * S))
    for r0 in range(0, rows.numel(), step):
        r = rows[r0 : r0 + step]
        n_keys = host[min(r0 + step, len(host)) - 1] + 1  # keys after the chunk's last row are never visible
        kp = torch.arange(n_keys, device=dev)
        qr = q[:, r].to(dt).reshape(B, r.numel(), Hkv, G, D)
        s = torch.einsum("bqhgd,bkhd->bhgqk", qr, kf[:, :n_keys]).reshape(B, Hq, r.numel(), n_keys) * scale
        visible = (kp[None, :] <= r[:, None])[None, None]
        if doc_ids is not None:
            docs = doc_ids.to(dev)
            visible = visible & (docs[:, r, None] == docs[:, None, :n_keys])[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        inside = index_row_mask(index, r, kp)
        total += torch.where(inside, p, 0.0).sum(-1).sum(-1)
    return (total / len(host)).float()


def output_error(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    rows: torch.Tensor,
    softmax_scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
    per_head: bool = False,
) -> torch.Tensor:
    """Relative error of the attention OUTPUT of the query rows at positions `rows` when only the pairs inside
    `index` are computed: sqrt(sum ||o_sparse - o||^2 / sum ||o||^2) over the rows and heads, [B] (per_head:
    over the rows only, [B, Hq]; fp32, fp64 for fp64 inputs). o is the exact causal attention output of a row (softmax over all its keys, same
    document only with doc_ids [B, S]); o_sparse is what the sparse kernels return for it: the softmax renormalised
    over the row's keys inside the index (listed blocks + columns), times V. Unlike the mass a row keeps
    (`true_recall`), this weighs the dropped keys by how far their values lie from the row's output.

    q: [B, S, Hq, D], k / v: [B, S, Hkv, D] (after RoPE, K/V never repeated for GQA). Rows run in chunks against the
    keys up to the chunk's last row, in fp32 (fp64 for fp64 inputs): memory ~ one [B, Hq, rows, keys] chunk of
    about 2^25 elements. The reference of `block_output_error`, which the policy's quality check runs on a layer's
    scored rows."""
    B, S, Hq, D = q.shape
    if k.shape != v.shape or k.dim() != 4 or k.shape[:2] != (B, S) or Hq % k.shape[2] != 0:
        raise ValueError(f"k and v must be [B={B}, S={S}, Hkv, D] with Hq % Hkv == 0; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if index.seq_len != S or index.block_ids.shape[:2] != (B, Hq):
        raise ValueError(f"index is for [B, Hq] = {tuple(index.block_ids.shape[:2])} and {index.seq_len} tokens; "
                         f"q is [B={B}, S={S}, Hq={Hq}]")
    Hkv = k.shape[2]
    G = Hq // Hkv
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    dev = q.device
    rows, _ = torch.sort(torch.as_tensor(rows, device=dev).long().flatten())
    if rows.numel() == 0 or rows.min() < 0 or rows.max() >= S:
        raise ValueError(f"rows must be a non-empty set of query positions in [0, {S}); got {rows.numel()} rows")
    err = torch.zeros(B, Hq, dtype=dt, device=dev)
    ref = torch.zeros(B, Hq, dtype=dt, device=dev)
    step = max(1, _CHUNK_ELEMS // max(1, B * Hq * S))
    for r0 in range(0, rows.numel(), step):
        r = rows[r0 : r0 + step]
        n, n_keys = r.numel(), int(r[-1]) + 1
        kp = torch.arange(n_keys, device=dev)
        qr = q[:, r].to(dt).reshape(B, n, Hkv, G, D)
        s = torch.einsum("bqhgd,bkhd->bhgqk", qr, k[:, :n_keys].to(dt)).reshape(B, Hq, n, n_keys) * scale
        visible = (kp[None, :] <= r[:, None])[None, None]
        if doc_ids is not None:
            docs = doc_ids.to(dev)
            visible = visible & (docs[:, r, None] == docs[:, None, :n_keys])[:, None]
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        kept = torch.where(index_row_mask(index, r, kp) & visible, p, 0.0)
        both = torch.stack([p, kept]).view(2, B, Hkv, G, n, n_keys)
        out = torch.einsum("xbhgqk,bkhd->xbhgqd", both, v[:, :n_keys].to(dt)).reshape(2, B, Hq, n, D)
        mass = kept.sum(-1, keepdim=True)
        sparse = torch.where(mass > 0, out[1] / mass.clamp(min=torch.finfo(dt).tiny), 0.0)
        err += (sparse - out[0]).square().sum(-1).sum(-1)
        ref += out[0].square().sum(-1).sum(-1)
    if not per_head:
        err, ref = err.sum(-1), ref.sum(-1)
    return (err / ref.clamp(min=torch.finfo(dt).tiny)).sqrt()



def scored_blocks(rows: torch.Tensor, block_size: int, seq_len: int, device) -> tuple:
    """(positions of the whole query blocks holding `rows` (a CPU tensor of positions), where each row lies among
    them, the blocks), on `device`: planned on the host once per row set (cached) and copied once."""
    return _row_blocks(_rows_key(rows, seq_len), block_size, seq_len, torch.device(device))[:3]


def _rows_key(rows: torch.Tensor, seq_len: int) -> bytes:
    """`rows` (positions, on the host) checked, sorted and made unique, as the bytes `_row_blocks` is cached by."""
    rows = torch.as_tensor(rows, device="cpu").long().flatten().unique()  # sorted
    if rows.numel() == 0 or rows[0] < 0 or rows[-1] >= seq_len:
        raise ValueError(f"rows must be a non-empty set of query positions in [0, {seq_len}); got {rows.numel()} rows")
    return rows.numpy().tobytes()


@functools.lru_cache(maxsize=16)
def _row_blocks(rows_key: bytes, block_size: int, seq_len: int, device: torch.device):
    """(positions of the whole query blocks holding `rows`, where each row lies among them, the blocks, and the
    dense call's block lists over keys 0..seq_len-1 for those positions: `_triton_attention.dense_plan`): made on the
    host once per row set and copied to `device` once (a copy per call would wait for the GPU's queue, and the
    lists built on the device read three values back)."""
    from mtrain.ops._triton_attention import dense_plan

    rows = torch.frombuffer(bytearray(rows_key), dtype=torch.long)
    blocks = torch.unique(rows // block_size)
    pos = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    pos = pos[pos < seq_len]
    at = torch.searchsorted(pos, rows)
    plan = dense_plan(pos, torch.arange(seq_len), block_size, causal=True)
    on = functools.partial(torch.Tensor.to, device=device)
    return on(pos), on(at), on(blocks), (on(plan[0]), on(plan[1]), tuple(on(t) for t in plan[2]))


def block_output_error(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    rows: torch.Tensor,
    softmax_scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
    per_head: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """`output_error`'s measure from the block kernels, at the cost of two small attention calls: the whole query
    blocks that hold `rows` (a CPU tensor of positions) run once through the partial-attention kernel on the index's
    lists for those blocks (`mtrain.ops.partial.attention_forward`, what the sparse path computes) and once densely
    (every causal key), in the inputs' dtype with fp32 accumulation; the error is then taken on `rows`. No
    [rows x keys] tensor and no host read: what the policy's quality check runs in every training step. bf16 inputs
    round both outputs to bf16 (a relative floor of ~0.002 under the errors the check compares, ~0.01-0.06)."""
    from mtrain.ops.partial import attention_forward

    B, S, Hq, D = q.shape
    if index.seq_len != S or index.block_ids.shape[:2] != (B, Hq):
        raise ValueError(f"index is for [B, Hq] = {tuple(index.block_ids.shape[:2])} and {index.seq_len} tokens; "
                         f"q is [B={B}, S={S}, Hq={Hq}]")
    bs = index.block_size
    pos, at, blocks, plan = _row_blocks(_rows_key(rows, S), bs, S, torch.device(q.device))
    k_pos = torch.arange(S, device=q.device)
    qs = q[:, pos]
    docs = {} if doc_ids is None else dict(q_doc=doc_ids[:, pos].to(q.device), k_doc=doc_ids.to(q.device))
    common = dict(q_pos=pos, k_pos=k_pos, block_size=bs, softmax_scale=softmax_scale, impl=impl, **docs)
    lists = dict(blocks=(index.block_ids[:, :, blocks].contiguous(), index.block_counts[:, :, blocks].contiguous()),
                 columns=(index.col_ids[:, :, blocks].contiguous(), index.col_counts[:, :, blocks].contiguous()))
    sparse, _ = attention_forward(qs, k, v, **common, **lists)
    dense, _ = attention_forward(qs, k, v, **common, plans={"dense": plan})  # lists planned on the host
    return relative_error(sparse[:, at], dense[:, at], per_head)


def relative_error(sparse: torch.Tensor, dense: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """sqrt(sum ||sparse - dense||^2 / sum ||dense||^2) of attention outputs [B, n, Hq, D], over the rows and heads:
    [B] (per_head: over the rows, [B, Hq]); fp32 (fp64 for fp64 inputs)."""
    dt = torch.float64 if dense.dtype == torch.float64 else torch.float32
    o_s, o_d = sparse.to(dt), dense.to(dt)
    err = (o_s - o_d).square().sum(-1).sum(1)  # [B, Hq]
    ref = o_d.square().sum(-1).sum(1)
    if not per_head:
        err, ref = err.sum(-1), ref.sum(-1)
    return (err / ref.clamp(min=torch.finfo(dt).tiny)).sqrt()


def sampled_rows(seq_len: int, n_rows: int, device=None) -> torch.Tensor:
    """`n_rows` query positions spread evenly over a sequence of `seq_len`, the last one its last row (the
    rows a training step's sampled true recall averages over)."""
    n = max(1, min(n_rows, seq_len))
    stride = seq_len // n
    return torch.arange(n, device=device) * stride + (seq_len - 1 - (n - 1) * stride)


def gathered_true_recall(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, lines, seq_len: int,
                         block_size: int, group, *, softmax_scale: float | None = None,
                         doc_ids: torch.Tensor | None = None, n_rows: int = 64) -> torch.Tensor:
    """`true_recall` of the index built from `lines` = (vertical, slash) on `n_rows` sampled rows, in a
    context-parallel group where each rank holds only its shard: fp32 [B, Hq], the same on every rank.

    q: [B, S_local, Hq, D], k: [B, S_local, Hkv, D], positions: the global positions of this rank's tokens.
    The sampled rows' queries are summed into every rank (each row lives on one rank); every rank scores
    them against its own keys, the index's lists of the sampled rows' query blocks are rebuilt from the lines
    on every rank, and the softmax is merged across ranks (max, then the total and the in-index sums of exp).
    Collective over `group`: every rank must call it. Keys are scored in chunks (memory ~ 2^25 elements).
    """
    import torch.distributed as dist

    from mtrain.ops.index import rows_from_lines

    B, S_loc, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    dev = q.device
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    positions = positions.to(dev).long()
    rows = sampled_rows(seq_len, n_rows, dev)
    n = rows.numel()
    where = torch.full((seq_len,), -1, dtype=torch.long, device=dev)
    where[positions] = torch.arange(S_loc, device=dev)
    local = where[rows]
    mine = local >= 0
    qr = torch.zeros(B, n, Hq, D, dtype=torch.float32, device=dev)
    qr[:, mine] = q[:, local[mine]].float()
    dist.all_reduce(qr, group=group)
    qr = qr.reshape(B, n, Hkv, G, D)
    vertical, slash = lines[0], lines[1]
    index = rows_from_lines(vertical, slash, seq_len, block_size, torch.unique(rows // block_size), totals=False,
                            check=False)
    docs = None if doc_ids is None else doc_ids.to(dev)
    step = max(1, _CHUNK_ELEMS // max(1, B * Hq * n))

    def scores(c0: int):
        kp = positions[c0 : c0 + step]
        s = torch.einsum("bqhgd,bkhd->bhgqk", qr, k[:, c0 : c0 + step].float()).reshape(B, Hq, n, kp.numel()) * scale
        visible = (kp[None, :] <= rows[:, None])[None, None]
        if docs is not None:
            visible = visible & (docs[:, rows, None] == docs[:, kp][:, None, :])[:, None]
        return s.masked_fill(~visible, float("-inf")), kp

    inside = index_row_mask(index, rows, positions)  # [B, Hq, n, S_local] bool, built once
    peak = torch.full((B, Hq, n), float("-inf"), device=dev)
    for c0 in range(0, S_loc, step):
        peak = torch.maximum(peak, scores(c0)[0].amax(-1))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)  # every row sees itself: finite on some rank
    sums = torch.zeros(2, B, Hq, n, dtype=torch.float64, device=dev)
    for c0 in range(0, S_loc, step):
        s, _ = scores(c0)
        p = torch.exp(s - peak[..., None])
        sums[0] += p.sum(-1).double()
        sums[1] += torch.where(inside[..., c0 : c0 + step], p, 0.0).sum(-1).double()
    dist.all_reduce(sums, group=group)
    return (sums[1] / sums[0]).mean(-1).float()
