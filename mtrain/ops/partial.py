"""Partial attention of a query shard against one key/value shard, with global positions: the kernel
entry points ring attention calls once per ring step (merge results with `merge_partial`)."""

from __future__ import annotations

import math
import os

import torch

from mtrain.ops.reference import _check_qkv, partial_mask

# Rows of the torch path's score matrix processed at once, so CPU memory stays bounded.
_TORCH_CHUNK_ELEMS = 1 << 24


def _use_triton(impl: str, device: torch.device) -> bool:
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
    B, Sq, Sk, Hq, _ = _check_qkv(q, k, v)
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


def _torch_forward(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, q_doc=None, k_doc=None):
    B, Sq, Sk, Hq, Hkv = _check_qkv(q, k, v)
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


def _torch_backward(dout, q, k, v, out, lse, q_pos, k_pos, blocks, columns, block_size, scale, causal, q_doc=None,
                    k_doc=None):
    B, Sq, Sk, Hq, Hkv = _check_qkv(q, k, v)
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
        such a pair twice.
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
    Returns out [B, Sq, Hq, D] in q.dtype and lse [B, Hq, Sq] float32 (natural log); rows that see
    no key get out = 0 and lse = -inf. Not differentiable itself: use `attention_backward`.
    """
    _check_args(q, k, v, q_pos, k_pos, blocks, columns, block_size, q_doc, k_doc)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if _use_triton(impl, q.device):
        from mtrain.ops import _triton_attention

        return _triton_attention.forward(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, plans,
                                         q_doc=q_doc, k_doc=k_doc)
    return _torch_forward(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, q_doc, k_doc)


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
    """
    _check_args(q, k, v, q_pos, k_pos, blocks, columns, block_size, q_doc, k_doc)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if _use_triton(impl, q.device):
        from mtrain.ops import _triton_attention

        return _triton_attention.backward(
            dout, q, k, v, out, lse, q_pos, k_pos, blocks, columns, block_size, scale, causal,
            deterministic=deterministic, plans=plans, q_doc=q_doc, k_doc=k_doc,
        )
    return _torch_backward(dout, q, k, v, out, lse, q_pos, k_pos, blocks, columns, block_size, scale, causal,
                           q_doc, k_doc)


def merge_partial(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets, in float32.

    out_*: [B, S, H, D], lse_*: [B, H, S]. Returns (out fp32 [B, S, H, D], lse fp32 [B, H, S]) with
    lse = log(exp(lse_a) + exp(lse_b)) and out the matching weighted sum. Safe when either or both
    sides are -inf (a row that saw no key): the weights come from the larger lse, so nothing overflows.
    """
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    total = wa + wb
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, float("-inf")))
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    wa = (wa * inv).transpose(1, 2)[..., None]
    wb = (wb * inv).transpose(1, 2)[..., None]
    return out_a.float() * wa + out_b.float() * wb, lse
