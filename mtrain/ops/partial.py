"""Partial attention of a query shard against one key/value shard, with global positions: the kernel
entry points ring attention calls once per ring step (merge results with `merge_partial`)."""

from __future__ import annotations

import math
import os
import warnings

import torch

from mtrain.ops.reference import check_qkv, partial_mask

# Rows of the torch path's score matrix processed at once, so CPU memory stays bounded.
_TORCH_CHUNK_ELEMS = 1 << 24
# Score (and mask) elements per chunk of query blocks on the block-list path: 16 MB tiles stay in the
# allocator's heap instead of fresh mmaps (larger tiles were slower per step on the CPU).
_SPARSE_CHUNK_ELEMS = 1 << 22


def use_triton(impl: str, device: torch.device) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f'impl must be "auto", "triton" or "torch"; got {impl!r}')
    if impl == "auto":
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return impl == "triton"


def _check_docs(q_doc, k_doc, B: int, Sq: int, Sk: int) -> None:
    if (q_doc is None) != (k_doc is None):
        raise ValueError("document masking needs both q_doc and k_doc (or neither)")
    if q_doc is None:
        return
    for name, t, n in (("q_doc", q_doc, Sq), ("k_doc", k_doc, Sk)):
        if t.shape != (B, n) or t.is_floating_point() or t.is_complex():
            raise ValueError(
                f"{name} must be an integer tensor [B={B}, {n}] of document ids; got {t.dtype} {tuple(t.shape)}"
            )


def _check_args(q, k, v, q_pos, k_pos, blocks, columns, block_size, q_doc=None, k_doc=None):
    B, Sq, Sk, Hq, _ = check_qkv(q, k, v)
    _check_docs(q_doc, k_doc, B, Sq, Sk)
    if block_size < 1:
        raise ValueError(f"block_size must be positive; got {block_size}")
    if q_pos.shape != (Sq,) or k_pos.shape != (Sk,):
        raise ValueError(
            f"q_pos must be [Sq={Sq}] and k_pos [Sk={Sk}] global positions; got {tuple(q_pos.shape)}, {tuple(k_pos.shape)}"
        )
    nqb = -(-Sq // block_size)
    for name, arg in (("blocks", blocks), ("columns", columns)):
        if arg is None:
            continue
        ids, counts = arg
        if ids.dim() != 4 or tuple(ids.shape[:3]) != (B, Hq, nqb) or tuple(counts.shape) != (B, Hq, nqb):
            raise ValueError(
                f"{name} must be (ids [B={B}, Hq={Hq}, ceil(Sq/block_size)={nqb}, MAX], counts [{B}, {Hq}, {nqb}]); "
                f"got ids {tuple(ids.shape)}, counts {tuple(counts.shape)}"
            )


def _lists(columns):
    """The torch path reads plain column lists: a `VerticalColumns` or `RingColumns` gives its own (`to_lists`)."""
    from mtrain.ops.columns import RingColumns, VerticalColumns

    return columns.to_lists() if isinstance(columns, (VerticalColumns, RingColumns)) else columns


def _row_chunks(Sq: int, B: int, Hq: int, Sk: int, block_size: int):
    rows = max(block_size, (_TORCH_CHUNK_ELEMS // max(1, B * Hq * Sk)) // block_size * block_size)
    for start in range(0, Sq, rows):
        yield start, min(Sq, start + rows)


def _slice_lists(arg, start: int, stop: int, block_size: int):
    if arg is None:
        return None
    ids, counts = arg
    return ids[:, :, start // block_size : -(-stop // block_size)], counts[:, :, start // block_size : -(-stop // block_size)]


def _doc_rows(q_doc, start: int, stop: int):
    return None if q_doc is None else q_doc[:, start:stop]


def _torch_forward_all(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, q_doc=None, k_doc=None):
    B, Sq, Sk, Hq, Hkv = check_qkv(q, k, v)
    q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = Hq // Hkv
    kh = k.to(cdt).transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.to(cdt).transpose(1, 2).repeat_interleave(group, dim=1)
    out = torch.empty(B, Sq, Hq, q.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    for start, stop in _row_chunks(Sq, B, Hq, Sk, block_size):
        keep = partial_mask(
            q_pos[start:stop], k_pos, batch=B, heads=Hq, blocks=_slice_lists(blocks, start, stop, block_size),
            columns=_slice_lists(columns, start, stop, block_size), block_size=block_size, causal=causal,
            q_doc=_doc_rows(q_doc, start, stop), k_doc=k_doc,
        )
        s = torch.matmul(q[:, start:stop].to(cdt).transpose(1, 2), kh.transpose(-1, -2)) * scale
        s = s.masked_fill(~keep, float("-inf"))
        m = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m)[..., None])
        out[:, start:stop] = torch.matmul(p, vh).transpose(1, 2).to(q.dtype)
        lse[:, :, start:stop] = m.to(torch.float32)
    return out, lse


def _torch_backward_all(dout, q, k, v, out, lse, q_pos, k_pos, blocks, columns, block_size, scale, causal, q_doc=None,
                    k_doc=None):
    B, Sq, Sk, Hq, Hkv = check_qkv(q, k, v)
    q_pos, k_pos = q_pos.to(q.device), k_pos.to(q.device)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = Hq // Hkv
    D = q.shape[-1]
    kh = k.to(cdt).transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.to(cdt).transpose(1, 2).repeat_interleave(group, dim=1)
    dq = torch.empty(B, Sq, Hq, D, dtype=cdt, device=q.device)
    dk = torch.zeros(B, Hq, Sk, D, dtype=cdt, device=q.device)
    dv = torch.zeros(B, Hq, Sk, D, dtype=cdt, device=q.device)
    for start, stop in _row_chunks(Sq, B, Hq, Sk, block_size):
        keep = partial_mask(
            q_pos[start:stop], k_pos, batch=B, heads=Hq, blocks=_slice_lists(blocks, start, stop, block_size),
            columns=_slice_lists(columns, start, stop, block_size), block_size=block_size, causal=causal,
            q_doc=_doc_rows(q_doc, start, stop), k_doc=k_doc,
        )
        qc = q[:, start:stop].to(cdt).transpose(1, 2)
        doc = dout[:, start:stop].to(cdt).transpose(1, 2)
        delta = (doc * out[:, start:stop].to(cdt).transpose(1, 2)).sum(-1, keepdim=True)
        lc = lse[:, :, start:stop].to(cdt)[..., None]
        # Rows that saw no key anywhere (lse = -inf) get no gradient.
        lc = torch.where(torch.isinf(lc), torch.full_like(lc, float("inf")), lc)
        s = torch.matmul(qc, kh.transpose(-1, -2)) * scale
        p = torch.exp(s - lc).masked_fill(~keep, 0.0)
        dp = torch.matmul(doc, vh.transpose(-1, -2))
        ds = p * (dp - delta)
        dq[:, start:stop] = (torch.matmul(ds, kh) * scale).transpose(1, 2)
        dk += torch.matmul(ds.transpose(-1, -2), qc) * scale
        dv += torch.matmul(p.transpose(-1, -2), doc)
    dk = dk.view(B, Hkv, group, Sk, D).sum(2).transpose(1, 2)
    dv = dv.view(B, Hkv, group, Sk, D).sum(2).transpose(1, 2)
    return dq, dk.contiguous(), dv.contiguous()


def _flash_cpu(backward: bool = False):
    """PyTorch's fused CPU attention (the kernel behind F.scaled_dot_product_attention on the CPU), called
    directly because the merge needs its log-sum-exp and the ring backward must pass the rows' final out and
    lse. Looked up at call time: GPU runs never touch it."""
    ops = torch.ops.aten
    if backward:
        return ops._scaled_dot_product_flash_attention_for_cpu_backward
    return ops._scaled_dot_product_flash_attention_for_cpu


def _padded_blocks(t: torch.Tensor, dim: int, n: int, block_size: int, fill=0):
    """Pad `t` along `dim` to n * block_size with `fill` and split that dim into [n, block_size]."""
    short = n * block_size - t.shape[dim]
    if short:
        pad_shape = list(t.shape)
        pad_shape[dim] = short
        t = torch.cat([t, torch.full(pad_shape, fill, dtype=t.dtype, device=t.device)], dim)
    return t.unflatten(dim, (n, block_size))


class _Codes:
    """The causal and document tests of a pair as one range test: key token j is kept by query row i iff
    lo[i] <= code[j] <= hi[i] (code = document * span + position). Padding keys get code -1 and padding
    query rows an empty range. Block-level bounds of the codes let whole listed blocks be dropped."""

    def __init__(self, q_pos, k_pos, q_doc, k_doc, causal: bool, B: int, nqb: int, nkb: int, bs: int):
        low = torch.minimum(q_pos.min(), k_pos.min())
        qp, kp = q_pos - low, k_pos - low
        span = int(torch.maximum(qp.max(), kp.max())) + 1
        if q_doc is None:
            kbase = torch.zeros(1, kp.numel(), dtype=torch.long, device=kp.device)
            qbase = torch.zeros(1, qp.numel(), dtype=torch.long, device=qp.device)
        else:
            first = torch.minimum(q_doc.min(), k_doc.min())
            kbase, qbase = (k_doc.long() - first) * span, (q_doc.long() - first) * span
        code = _padded_blocks((kbase + kp).expand(B, -1), 1, nkb, bs, fill=-1)  # [B, nkb, bs]
        self.key = code.flatten(1)  # [B, nkb * bs]
        self.lo = _padded_blocks(qbase.expand(B, -1), 1, nqb, bs, fill=1)  # [B, nqb, bs]
        self.hi = _padded_blocks((qbase + (qp if causal else span - 1)).expand(B, -1), 1, nqb, bs, fill=0)
        # per key block: smallest and largest code of its real tokens; per query block: the union of ranges
        self.block_min = torch.where(code >= 0, code, torch.iinfo(torch.long).max).amin(-1)  # [B, nkb]
        self.block_max = code.amax(-1)
        self.block_whole = (code >= 0).all(-1)  # no padding token (only the shard's last block can have some)
        self.q_lo, self.q_hi = self.lo.amin(-1), self.hi.amax(-1)  # [B, nqb]


def _pruned(arg, codes: _Codes, block: bool):
    """The lists without entries that no query of their block can keep (other documents, the future),
    kept ones moved to the front in order: (ids [B, Hq, nqb, MAX] long, counts [B, Hq, nqb])."""
    ids, counts = arg[0].long(), arg[1].long()
    B = ids.shape[0]
    slot = torch.arange(ids.shape[-1], device=ids.device)
    ok = (slot < counts[..., None]) & (ids >= 0)
    ids = ids.clamp_min(0)
    b = torch.arange(B, device=ids.device)[:, None, None, None]
    kmin, kmax = (codes.block_min, codes.block_max) if block else (codes.key, codes.key)
    ok &= (kmax[b, ids] >= codes.q_lo[:, None, :, None]) & (kmin[b, ids] <= codes.q_hi[:, None, :, None])
    order = torch.sort((~ok).to(torch.uint8), dim=-1, stable=True).indices
    return ids.gather(-1, order), ok.sum(-1)


def _chunk_lists(lists, qb0: int, qb1: int):
    """Query blocks [qb0, qb1) of each pruned list, cut to the longest count in the range."""
    out = []
    for ids, counts in lists:
        counts = counts[:, :, qb0:qb1]
        used = int(counts.max()) if counts.numel() else 0
        ids = ids[:, :, qb0:qb1, :used]
        out.append((ids, torch.arange(used, device=ids.device) < counts[..., None]))
    return out


# A dropped pair's additive mask: finite, so that a row which keeps no pair shows itself by its lse (about
# _DROP) instead of the NaN or 0 the fused kernel gives an all -inf row; exp(_DROP - anything real) is 0.
_DROP = -1e30


def _gather(k_blocks, k_t, chunk, group: int, cdt):
    """Keys (or values) of the chunk's listed blocks and columns: [B, Hq, n, L, D], blocks first.

    k_blocks: [B, Hkv, nkb, bs, D], a view of k_t [B, Hkv, nkb * bs, D]; whole blocks are copied at once.
    """
    (bid, _), (cid, _) = chunk
    B, Hq = bid.shape[:2]
    b_idx = torch.arange(B, device=bid.device)[:, None, None, None]
    h_idx = (torch.arange(Hq, device=bid.device) // group)[None, :, None, None]
    parts = []
    if bid.shape[-1]:
        parts.append(k_blocks[b_idx, h_idx, bid].flatten(3, 4))
    if cid.shape[-1]:
        parts.append(k_t[b_idx, h_idx, cid])
    return (torch.cat(parts, 3) if len(parts) > 1 else parts[0]).to(cdt)


def _mask(codes: _Codes, chunk, qb0: int, qb1: int, bs: int, cdt) -> torch.Tensor:
    """Additive mask [B, Hq, n, bs, L] of the gathered pairs: 0 kept, _DROP dropped.

    A listed block that every row of its query block keeps whole (below the diagonal, one document) is
    written as a block of zeros; only the others (diagonal, document edges, padding) are tested pair by pair.
    """
    (bid, bok), (cid, cok) = chunk
    B, Hq, n, nb = bid.shape
    nc = cid.shape[-1]
    lo, hi = codes.lo[:, qb0:qb1], codes.hi[:, qb0:qb1]  # [B, n, bs]
    bias = torch.empty(B, Hq, n, bs, nb * bs + nc, dtype=cdt, device=bid.device)
    b_idx = torch.arange(B, device=bid.device)[:, None, None, None]
    if nb:
        full = (bok & codes.block_whole[b_idx, bid] & (codes.block_min[b_idx, bid] >= lo.amax(-1)[:, None, :, None])
                & (codes.block_max[b_idx, bid] <= hi.amin(-1)[:, None, :, None]))
        blocks = bias[..., : nb * bs].unflatten(-1, (nb, bs))  # [B, Hq, n, bs, nb, bs]
        blocks.copy_(torch.where(full, 0.0, _DROP).to(cdt)[:, :, :, None, :, None].expand_as(blocks))
        b, h, i, j = (bok & ~full).nonzero(as_tuple=True)
        if b.numel():
            key = codes.key.view(B, -1, bs)[b, bid[b, h, i, j]]  # [K, bs] key codes of each such block
            keep = (key[:, None, :] >= lo[b, i][:, :, None]) & (key[:, None, :] <= hi[b, i][:, :, None])
            blocks[b, h, i, :, j, :] = torch.where(keep, 0.0, _DROP).to(cdt)
    if nc:
        key = torch.where(cok, codes.key[b_idx, cid], -1)[:, :, :, None, :]  # [B, Hq, n, 1, nc]
        keep = (key >= lo[:, None, :, :, None]) & (key <= hi[:, None, :, :, None])
        bias[..., nb * bs :] = torch.where(keep, 0.0, _DROP).to(cdt)
    return bias


def _add_rows(acc: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """acc[rows[i]] += src[i] for 2-D acc / src, deterministically: a 0/1 CSR matrix (entries sorted by
    destination, stably) times src, so each destination sums its sources in a fixed order. On the CPU this
    beats sorting + segment_reduce and index_add_, which expands the index to every element (and index_put_
    with accumulate uses atomics unless determinism is switched on)."""
    order = torch.argsort(rows, stable=True)
    crow = torch.zeros(acc.shape[0] + 1, dtype=torch.long, device=rows.device)
    crow[1:] = torch.cumsum(torch.bincount(rows, minlength=acc.shape[0]), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR tensor support is in beta": construction only
        pick = torch.sparse_csr_tensor(crow, order, torch.ones(rows.numel(), dtype=src.dtype, device=src.device),
                                       (acc.shape[0], rows.numel()))
    acc += pick @ src


def _sparse_setup(q, k, q_pos, k_pos, blocks, columns, block_size, causal, q_doc, k_doc):
    """What forward and backward share: shapes, the pair codes, the pruned lists, query blocks per chunk."""
    B, Sq, Sk, Hq, Hkv = check_qkv(q, k, k)
    nqb, nkb = -(-Sq // block_size), -(-Sk // block_size)
    codes = _Codes(q_pos.to(q.device), k_pos.to(q.device), None if q_doc is None else q_doc.to(q.device),
                   None if k_doc is None else k_doc.to(q.device), causal, B, nqb, nkb, block_size)
    empty = torch.zeros(B, Hq, nqb, 0, dtype=torch.long, device=q.device)
    lists = [_pruned(blocks, codes, True) if blocks is not None else (empty, empty.sum(-1)),
             _pruned(columns, codes, False) if columns is not None else (empty, empty.sum(-1))]
    width = max(1, int(lists[0][1].max()) * block_size + int(lists[1][1].max()))
    # query blocks per chunk: the score tiles of a chunk stay within _SPARSE_CHUNK_ELEMS
    step = max(1, _SPARSE_CHUNK_ELEMS // (B * Hq * block_size * width))
    return B, Sq, Sk, Hq, Hkv, nqb, nkb, codes, lists, step


def _heads(t):
    """[B, Hq, n, rows, X] -> [B * Hq, n, rows, X]: query blocks become the fused kernel's heads."""
    return t.flatten(0, 1)


def _torch_forward(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, q_doc=None, k_doc=None):
    """Torch path. With block lists each query block gathers only its listed key blocks and columns (minus
    those that no query of the block can keep) and runs PyTorch's fused CPU attention on them, so the cost
    follows the kept pairs; without lists (dense) the whole key shard is scored in row chunks."""
    if blocks is None:
        return _torch_forward_all(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, q_doc, k_doc)
    bs = block_size
    B, Sq, Sk, Hq, Hkv, nqb, nkb, codes, lists, step = _sparse_setup(q, k, q_pos, k_pos, blocks, columns, bs, causal,
                                                                     q_doc, k_doc)
    D = q.shape[-1]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qb = _padded_blocks(q.transpose(1, 2), 2, nqb, bs)  # [B, Hq, nqb, bs, D]
    k_t, v_t = (_padded_blocks(t.transpose(1, 2), 2, nkb, bs).flatten(2, 3) for t in (k, v))  # [B, Hkv, nkb*bs, D]
    k_blocks, v_blocks = k_t.unflatten(2, (nkb, bs)), v_t.unflatten(2, (nkb, bs))
    out = torch.zeros(B, Hq, nqb, bs, D, dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, nqb, bs), float("-inf"), dtype=torch.float32, device=q.device)
    for qb0 in range(0, nqb, step):
        qb1 = min(nqb, qb0 + step)
        chunk = _chunk_lists(lists, qb0, qb1)
        if not (chunk[0][0].shape[-1] or chunk[1][0].shape[-1]):
            continue
        kg = _gather(k_blocks, k_t, chunk, Hq // Hkv, cdt)
        vg = _gather(v_blocks, v_t, chunk, Hq // Hkv, cdt)
        o, m = _flash_cpu()(_heads(qb[:, :, qb0:qb1].to(cdt)), _heads(kg), _heads(vg), 0.0, False,
                          attn_mask=_heads(_mask(codes, chunk, qb0, qb1, bs, cdt)), scale=scale)
        m = m.view(lse[:, :, qb0:qb1].shape)
        seen = m > _DROP / 2  # a row that keeps no pair: out 0 and lse -inf, as the contract says
        out[:, :, qb0:qb1] = o.view(out[:, :, qb0:qb1].shape).masked_fill(~seen[..., None], 0).to(q.dtype)
        lse[:, :, qb0:qb1] = torch.where(seen, m.float(), float("-inf"))
    return out.flatten(2, 3)[:, :, :Sq].transpose(1, 2).contiguous(), lse.flatten(2, 3)[:, :, :Sq].contiguous()


def _torch_backward(dout, q, k, v, out, lse, q_pos, k_pos, blocks, columns, block_size, scale, causal, q_doc=None,
                    k_doc=None):
    """Torch path of the backward, over the same gathered pairs as `_torch_forward`, by PyTorch's fused CPU
    attention backward fed the rows' final out and lse; key gradients are added back block by block
    (deterministically, see `_add_rows`) into their kv head's rows."""
    if blocks is None:
        return _torch_backward_all(dout, q, k, v, out, lse, q_pos, k_pos, blocks, columns, block_size, scale, causal,
                                   q_doc, k_doc)
    bs = block_size
    B, Sq, Sk, Hq, Hkv, nqb, nkb, codes, lists, step = _sparse_setup(q, k, q_pos, k_pos, blocks, columns, bs, causal,
                                                                     q_doc, k_doc)
    D, group = q.shape[-1], Hq // Hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qb = _padded_blocks(q.transpose(1, 2), 2, nqb, bs)
    dob = _padded_blocks(dout.transpose(1, 2), 2, nqb, bs)
    ob = _padded_blocks(out.transpose(1, 2), 2, nqb, bs)
    # rows that saw no key anywhere (lse = -inf) get no gradient: exp(s - inf) = 0
    lb = _padded_blocks(lse.to(cdt), 2, nqb, bs, fill=float("inf"))
    lb = torch.where(torch.isinf(lb), float("inf"), lb)
    k_t, v_t = (_padded_blocks(t.transpose(1, 2), 2, nkb, bs).flatten(2, 3) for t in (k, v))
    k_blocks, v_blocks = k_t.unflatten(2, (nkb, bs)), v_t.unflatten(2, (nkb, bs))
    dq = torch.zeros(B, Hq, nqb, bs, D, dtype=cdt, device=q.device)
    dk = torch.zeros(B, Hkv, nkb * bs, D, dtype=cdt, device=q.device)
    dv = torch.zeros_like(dk)
    head_row = (torch.arange(B, device=q.device)[:, None] * Hkv
                + torch.arange(Hq, device=q.device)[None, :] // group)[:, :, None, None]  # [B, Hq, 1, 1]
    for qb0 in range(0, nqb, step):
        qb1 = min(nqb, qb0 + step)
        chunk = _chunk_lists(lists, qb0, qb1)
        nb, nc = chunk[0][0].shape[-1], chunk[1][0].shape[-1]
        if not (nb or nc):
            continue
        kg = _gather(k_blocks, k_t, chunk, group, cdt)
        vg = _gather(v_blocks, v_t, chunk, group, cdt)
        g_q, g_k, g_v = _flash_cpu(backward=True)(
            _heads(dob[:, :, qb0:qb1].to(cdt)), _heads(qb[:, :, qb0:qb1].to(cdt)), _heads(kg), _heads(vg),
            _heads(ob[:, :, qb0:qb1].to(cdt)), _heads(lb[:, :, qb0:qb1]), 0.0, False,
            attn_mask=_heads(_mask(codes, chunk, qb0, qb1, bs, cdt)), scale=scale)
        dq[:, :, qb0:qb1] = g_q.view(dq[:, :, qb0:qb1].shape)
        g_k, g_v = g_k.view(kg.shape), g_v.view(kg.shape)
        # dropped and padding entries point at real rows but carry exactly zero gradient
        if nb:
            rows = (head_row * nkb + chunk[0][0]).reshape(-1)
            for grad, acc in ((g_k, dk), (g_v, dv)):
                _add_rows(acc.view(-1, bs * D), rows, grad[:, :, :, : nb * bs].reshape(-1, bs * D))
        if nc:
            rows = (head_row * (nkb * bs) + chunk[1][0]).reshape(-1)
            for grad, acc in ((g_k, dk), (g_v, dv)):
                _add_rows(acc.view(-1, D), rows, grad[:, :, :, nb * bs :].reshape(-1, D))
    dq = dq.flatten(2, 3)[:, :, :Sq].transpose(1, 2).contiguous()
    return dq, dk[:, :, :Sk].transpose(1, 2).contiguous(), dv[:, :, :Sk].transpose(1, 2).contiguous()


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    blocks=None,
    columns=None,
    block_size: int = 64,
    softmax_scale: float | None = None,
    causal: bool = True,
    impl: str = "auto",
    plans: dict | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    merge_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query shard against one key/value shard; returns (out, lse) for an LSE merge.

    q: [B, Sq, Hq, D] query shard; k, v: [B, Sk, Hkv, D] key/value shard (Hq % Hkv == 0, GQA: query
    head h reads kv head h // (Hq // Hkv); K/V are never repeated in memory on the Triton path).
    q_pos: LongTensor [Sq], k_pos: [Sk], GLOBAL token positions; with `causal` a pair is kept only
    when k_pos <= q_pos (positions may be any order, e.g. a block-striped shard).
    Blocks are `block_size` consecutive LOCAL tokens of each shard (the last may be short).
    blocks: None = every key block of this shard (dense); or (block_ids [B, Hq, ceil(Sq/bs), MAXB]
        int32 local key-block ids, sorted ascending, -1 padded; counts [B, Hq, ceil(Sq/bs)] int32).
    columns: None, or (col_ids [B, Hq, ceil(Sq/bs), MAXC] local key token indices, -1 padded;
        counts): extra key tokens for every query of the block. They must be distinct and must not
        lie inside a listed key block (SparseIndex guarantees both); the Triton path would count
        such a pair twice. Or a `mtrain.ops.columns.VerticalColumns` (one device's index, keys from 0): the
        same columns without per-block lists, for `blocks` from the same lines; or a
        `mtrain.ops.columns.RingColumns` (a context-parallel rank's off-ring columns, from the step's
        `mtrain.ops.index.COLUMN_BASE` in `plans`).
    softmax_scale: default 1/sqrt(D). impl: "auto" (Triton on CUDA tensors and under
        TRITON_INTERPRET=1, else torch), "triton" or "torch". The Triton path takes fp16, bf16 and
        fp32 with a power-of-two head dim >= 16 and accumulates in fp32; float64 needs impl="torch".
    plans: optional dict the Triton path fills with derived index data (the lists for blocks=None,
        the transposed index) and reuses on later calls; pass the same dict only while positions,
        lists and document ids stay the same (e.g. forward and backward of one step), never across
        different shards.
    q_doc: integer tensor [B, Sq] and k_doc [B, Sk] of document ids (any integers; equal id = same
        document), both or neither: a pair is then kept only when q_doc == k_doc as well (packed
        samples). The Triton path drops listed key blocks and columns whose doc-id range cannot meet
        the query block's before launching (with increasing ids, as a packer numbers documents, that
        is every block of other documents) and tests the ids pair by pair in the remaining tiles.
    merge_into: (out [B, Sq, Hq, D] in q.dtype, lse [B, Hq, Sq] float32), both contiguous: the same rows' result
        over other keys. This step's result is merged into them in place (by LSE, in fp32; the Triton path in its
        own epilogue, with no separate pass) and they are returned.
    Returns out [B, Sq, Hq, D] in q.dtype and lse [B, Hq, Sq] float32 (natural log); rows that see
    no key get out = 0 and lse = -inf. Not differentiable itself: use `attention_backward`.
    """
    _check_args(q, k, v, q_pos, k_pos, blocks, columns, block_size, q_doc, k_doc)
    if merge_into is not None:
        o, l = merge_into
        B, Sq, Hq, _ = q.shape
        if (o.shape != q.shape or o.dtype != q.dtype or not o.is_contiguous() or l.shape != (B, Hq, Sq)
                or l.dtype != torch.float32 or not l.is_contiguous()):
            raise ValueError(f"merge_into must be (out {tuple(q.shape)} {q.dtype}, lse {(B, Hq, Sq)} float32), both "
                             f"contiguous; got ({tuple(o.shape)} {o.dtype}, {tuple(l.shape)} {l.dtype})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if use_triton(impl, q.device):
        from mtrain.ops import _triton_attention

        return _triton_attention.forward(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, plans,
                                         q_doc=q_doc, k_doc=k_doc, merge_into=merge_into)
    out, lse = _torch_forward(q, k, v, q_pos, k_pos, blocks, _lists(columns), block_size, scale, causal, q_doc,
                              k_doc)
    if merge_into is None:
        return out, lse
    merged, merged_lse = merge_partial(merge_into[0], merge_into[1], out, lse)
    merge_into[0].copy_(merged)
    merge_into[1].copy_(merged_lse)
    return merge_into


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    blocks=None,
    columns=None,
    block_size: int = 64,
    softmax_scale: float | None = None,
    causal: bool = True,
    impl: str = "auto",
    deterministic: bool = True,
    plans: dict | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    grad_init: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one partial attention step, given the FINAL (merged) out and lse of the rows.

    The standard ring rule: with delta = rowsum(dout * out) and P = exp(scale * q k^T - lse) over
    this shard's kept pairs, dV = P^T dout, dS = P * (dout V^T - delta), dQ = scale * dS K,
    dK = scale * dS^T Q (summed over each GQA group's query heads). Arguments as in
    `attention_forward`; dout and out [B, Sq, Hq, D], lse [B, Hq, Sq] (rows with lse = -inf get no
    gradient). Returns (dq [B, Sq, Hq, D], dk, dv [B, Sk, Hkv, D]) in float32 (float64 for float64
    inputs, torch path) so the ring can accumulate them. `deterministic=True` uses no atomics
    (Triton: a dQ kernel per query block; a dK/dV kernel per key block over the transposed index,
    long lists cut into work items whose partial sums are added in a fixed order; vertical columns
    per column chunk): bitwise repeatable. `deterministic=False` adds dK/dV with fp32 atomics from the
    dQ kernel (no transposed index; slower under GQA, see BENCHMARKS.md). `plans`: as in
    `attention_forward` (also holds the transposed index; `SparseIndex` keeps one per index).
    q_doc, k_doc: document ids as in `attention_forward` (pass the same ones as the forward).
    grad_init: (dq, dk, dv) of another pass over other pairs of the same rows (shapes of q, k, v, last dim
    contiguous), with `deterministic` only: the step's gradients are accumulated into these tensors in place (fp32
    arithmetic, stored in their dtypes) and they are returned. The Triton path adds dq inside its dQ pass, and on
    a column-only index (`plans[NO_BLOCKS]`) adds the columns' dK/dV straight into grad_init's dk/dv: no fp32
    copy of any of the three and no separate add.
    """
    _check_args(q, k, v, q_pos, k_pos, blocks, columns, block_size, q_doc, k_doc)
    if grad_init is not None and tuple(t.shape for t in grad_init) != (q.shape, k.shape, v.shape):
        raise ValueError(f"grad_init must hold gradients shaped like q, k, v {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}; got {[tuple(t.shape) for t in grad_init]}")
    if grad_init is not None and not deterministic:
        raise ValueError("grad_init needs deterministic=True (the fused backward adds dQ with atomics)")
    if grad_init is not None and any(t.stride(-1) != 1 for t in grad_init):
        raise ValueError("grad_init's tensors are accumulated into in place and need a contiguous last dim; pass "
                         "t.contiguous() (and use the returned tensors)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if use_triton(impl, q.device):
        from mtrain.ops import _triton_attention

        return _triton_attention.backward(
            dout, q, k, v, out, lse, q_pos, k_pos, blocks, columns, block_size, scale, causal,
            deterministic=deterministic, plans=plans, q_doc=q_doc, k_doc=k_doc, grad_init=grad_init,
        )
    grads = _torch_backward(dout, q, k, v, out, lse, q_pos, k_pos, blocks, _lists(columns), block_size, scale, causal,
                            q_doc, k_doc)
    if grad_init is None:
        return grads
    return tuple(i.copy_(g + i.to(g.dtype)) for g, i in zip(grads, grad_init))


def lse_weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """(weight_a, weight_b [B, S, H, 1], lse [B, H, S]) of merging two partial results over disjoint key sets:
    lse = log(exp(a) + exp(b)). Safe when either or both sides are -inf (a row that saw no key): the
    weights come from the larger lse, so nothing overflows."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    total = wa + wb
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, float("-inf")))
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    return (wa * inv).transpose(1, 2)[..., None], (wb * inv).transpose(1, 2)[..., None], lse


def merge_partial(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets, in float32.

    out_*: [B, S, H, D], lse_*: [B, H, S]. Returns (out fp32 [B, S, H, D], lse fp32 [B, H, S]) with
    lse = log(exp(lse_a) + exp(lse_b)) and out the matching weighted sum (see `lse_weights`).
    """
    wa, wb, lse = lse_weights(lse_a.float(), lse_b.float())
    return out_a.float() * wa + out_b.float() * wb, lse
