"""Dense attention through the fastest backend available: FlashAttention-4 or flash-attn 2 where installed, else
PyTorch SDPA (cuDNN first) on the GPU, our Triton kernels when the LSE is needed, plain PyTorch on the CPU; packed
documents through one varlen call (`mtrain.ops.varlen`)."""

from __future__ import annotations

import math

import torch

from mtrain.ops.backends import fa4_runs, has_flash_attn, importable, sdpa_attention  # noqa: F401 (re-exported)
from mtrain.ops.reference import check_qkv


def dense_backend(q: torch.Tensor, return_lse: bool = False) -> str:
    """Name of the backend `dense_attention` uses for this tensor: fa4, flash_attn, sdpa, triton or torch. FA4 leads
    where it runs (causal 128K fwd+bwd on an H200: 389-396 ms against cuDNN's 446-464, BENCHMARKS.md)."""
    if q.device.type != "cuda":
        return "torch" if return_lse else "sdpa"
    if fa4_runs(q):
        return "fa4"
    if has_flash_attn() and q.dtype in (torch.float16, torch.bfloat16):
        return "flash_attn"
    return "triton" if return_lse else "sdpa"


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    doc_ids: torch.Tensor | None = None,
    documents=None,
):
    """Dense (optionally causal) attention, differentiable in q, k, v.

    q: [B, S, Hq, D]; k, v: [B, Sk, Hkv, D], Hq % Hkv == 0 (GQA). causal masks key j > query i
    (aligned at position 0). softmax_scale defaults to 1/sqrt(D). Returns out [B, S, Hq, D] in q.dtype
    and, with return_lse, lse [B, Hq, S] fp32 (natural log, no gradient). Backend: see `dense_backend`.
    documents: a `mtrain.ops.varlen.Documents` of the packed rows (needs Sk == S and causal): a query attends
    only to keys of its own document, in one varlen call (FA4's varlen kernel, flash-attn 2's, or SDPA per document;
    `mtrain.ops.varlen.varlen_backend`). doc_ids: integer tensor [B, S] of document ids, the same masking; without
    return_lse its boundaries are read on the host here (build `Documents` once per batch instead); with return_lse
    these calls run our partial kernels (Triton on CUDA, which skip key blocks of other documents; PyTorch on the
    CPU), never an S x S mask.
    """
    check_qkv(q, k, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if (doc_ids is not None or documents is not None) and not return_lse:
        from mtrain.ops.varlen import Documents, document_attention

        if not causal:
            raise ValueError("dense attention with documents is causal within each document; pass causal=True")
        if k.shape[1] != q.shape[1]:
            raise ValueError(f"documents need as many keys as queries; got Sq={q.shape[1]}, Sk={k.shape[1]}")
        documents = documents if documents is not None else Documents.from_doc_ids(doc_ids, q.device)
        return document_attention(q, k, v, documents, scale)
    if documents is not None:
        doc_ids = documents.doc_ids
    if doc_ids is not None:
        from mtrain.ops.partial_autograd import partial_attention

        if k.shape[1] != q.shape[1]:
            raise ValueError(f"doc_ids needs as many keys as queries; got Sq={q.shape[1]}, Sk={k.shape[1]}")
        pos = torch.arange(q.shape[1], device=q.device)
        out, lse = partial_attention(q, k, v, q_pos=pos, k_pos=pos, softmax_scale=scale, causal=causal,
                                     block_size=64, q_doc=doc_ids, k_doc=doc_ids)
        return (out, lse) if return_lse else out
    backend = dense_backend(q, return_lse)
    if backend == "fa4":
        from flash_attn.cute import flash_attn_func as fa4_func

        return fa4_func(q, k, v, softmax_scale=scale, causal=causal)[0]
    if backend == "flash_attn":
        from flash_attn import flash_attn_func

        if return_lse:
            out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
            return out, lse.detach().float()
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    if backend == "sdpa":
        return sdpa_attention(q, k, v, causal, scale)
    if backend == "triton":
        from mtrain.ops.partial_autograd import partial_attention

        q_pos = torch.arange(q.shape[1], device=q.device)
        k_pos = torch.arange(k.shape[1], device=q.device)
        return partial_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, softmax_scale=scale, causal=causal,
                                 block_size=64, impl="triton")
    from mtrain.ops.reference import attention

    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = attention(q.to(cdt), k.to(cdt), v.to(cdt), softmax_scale=scale, causal=causal)
    return out.to(q.dtype), lse.detach().float()
