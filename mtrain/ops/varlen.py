"""Dense causal attention over packed documents in one call (varlen), through the fastest kernel installed:
FlashAttention-4's varlen kernel, flash-attn 2's, SDPA (cuDNN) once per document, or our Triton partial kernels.

`Documents` holds a packed batch's boundaries, read from the host once per batch (the trainer builds it from the
CPU batch), so no attention layer syncs the device to learn where documents start. `Segments` is the general form
one varlen call takes: entry i pairs queries [cu_q[i], cu_q[i+1]) with keys [cu_k[i], cu_k[i+1]), causal from the
bottom right (the last query sees the last key), as FlashAttention's varlen kernels define it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mtrain.ops.backends import fa4_runs, has_flash_attn, host_to_device, sdpa_attention

# Backends of `varlen_attention`, fastest first where each runs (BENCHMARKS.md, "Dense attention with documents").
VARLEN_BACKENDS = ("fa4", "flash_attn", "sdpa", "triton")


@dataclasses.dataclass(frozen=True, eq=False)
class Segments:
    """The entries of one varlen call. q_lengths / k_lengths: host tuples (entry i has q_lengths[i] queries and
    k_lengths[i] >= q_lengths[i] keys); cu_q / cu_k: their int32 prefix sums on the attention's device."""

    q_lengths: tuple[int, ...]
    k_lengths: tuple[int, ...]
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    @classmethod
    def build(cls, q_lengths, k_lengths=None, device=None) -> "Segments":
        q_lengths = tuple(int(n) for n in q_lengths)
        k_lengths = q_lengths if k_lengths is None else tuple(int(n) for n in k_lengths)
        if len(q_lengths) != len(k_lengths) or any(a < 1 or b < a for a, b in zip(q_lengths, k_lengths)):
            raise ValueError(f"varlen segments need as many key lengths as query lengths, each >= its query length "
                             f"(>= 1); got {q_lengths} / {k_lengths}")

        def prefix(lengths):  # built on the host, copied without waiting for the device
            return host_to_device(torch.tensor((0, *torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32),
                                  device)

        return cls(q_lengths, k_lengths, prefix(q_lengths), prefix(k_lengths))

    @property
    def max_q(self) -> int:
        return max(self.q_lengths)

    @property
    def max_k(self) -> int:
        return max(self.k_lengths)

    @property
    def total_q(self) -> int:
        return sum(self.q_lengths)

    @property
    def total_k(self) -> int:
        return sum(self.k_lengths)

    def pairs(self) -> int:
        """Query-key pairs the entries attend (causal from the bottom right)."""
        return sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in zip(self.q_lengths, self.k_lengths))

    def to(self, device) -> "Segments":
        return dataclasses.replace(self, cu_q=self.cu_q.to(device), cu_k=self.cu_k.to(device))


def _boundaries(doc_ids: torch.Tensor) -> list[tuple[int, ...]]:
    """Per batch row, the lengths of its documents (runs of equal ids) read on the host; ValueError if an id comes
    back after another (a document must be one run of the row)."""
    rows = []
    host = doc_ids.detach().cpu()
    for b in range(host.shape[0]):
        ids, lengths = torch.unique_consecutive(host[b], return_counts=True)
        if ids.numel() != torch.unique(ids).numel():
            raise ValueError(f"doc_ids row {b} has a document id in more than one run: each document of a packed row "
                             "must be one contiguous run of its id (number documents as they come, e.g. "
                             "cumsum(position_ids == 0))")
        rows.append(tuple(lengths.tolist()))
    return rows


@dataclasses.dataclass(frozen=True, eq=False)
class Documents:
    """A packed batch's document boundaries. doc_ids: [B, S] integer ids (a document = one run of its id in a row),
    on the attention's device; lengths: per row, its documents' lengths (host); segments: the rows' documents
    flattened into one varlen call (row b's documents after row b - 1's)."""

    doc_ids: torch.Tensor
    lengths: tuple[tuple[int, ...], ...]
    segments: Segments
    cache: dict = dataclasses.field(default_factory=dict, repr=False)
    """What users of these documents derive from them once per batch (e.g. the CP ranks' varlen segments)."""

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor, device=None) -> "Documents":
        """Read the boundaries from `doc_ids` [B, S] (one host read: build this once per batch, from the CPU copy
        where there is one) and keep the ids and prefix sums on `device` (default: the ids' own)."""
        if doc_ids.dim() != 2 or doc_ids.is_floating_point() or doc_ids.dtype == torch.bool:
            raise ValueError(f"doc_ids must be an integer tensor [B, S]; got {doc_ids.dtype} {tuple(doc_ids.shape)}")
        device = doc_ids.device if device is None else torch.device(device)
        lengths = tuple(_boundaries(doc_ids))
        flat = [n for row in lengths for n in row]
        return cls(doc_ids.to(device=device, dtype=torch.int64), lengths, Segments.build(flat, device=device))

    @property
    def max_len(self) -> int:
        return self.segments.max_q

    def segments_of(self, lengths, device=None) -> Segments:
        """The varlen segments of `lengths` (some of these documents, in order) on `device`, built once per batch:
        the per-document path's dense call over the documents it sends dense is the same in every layer that
        chooses alike and again in each recomputed forward, and building its prefix sums copies them to the device
        (a copy from pageable host memory, which waits for the device's queue to drain)."""
        device = self.segments.cu_q.device if device is None else torch.device(device)
        key = ("segments", tuple(int(n) for n in lengths), device)
        if key not in self.cache:
            self.cache[key] = Segments.build(key[1], device=device)
        return self.cache[key]

    def starts(self, row: int) -> list[int]:
        """Start offsets of row `row`'s documents."""
        out, at = [], 0
        for n in self.lengths[row]:
            out.append(at)
            at += n
        return out


def varlen_backend(q: torch.Tensor) -> str:
    """The backend `varlen_attention` runs for q (one of VARLEN_BACKENDS): FlashAttention-4's varlen kernel where it
    runs, flash-attn 2's where installed (fp16/bf16 on CUDA), else SDPA once per entry (cuDNN first on the GPU; the
    CPU's own kernels)."""
    if fa4_runs(q):
        return "fa4"
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and has_flash_attn():
        return "flash_attn"
    return "sdpa"


def _check(q, k, v, seg: Segments) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen attention wants q [Tq, Hq, D] and k, v [Tk, Hkv, D] with Hq a multiple of Hkv; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != seg.total_q or k.shape[0] != seg.total_k:
        raise ValueError(f"varlen segments hold {seg.total_q} queries and {seg.total_k} keys; the tensors hold "
                         f"{q.shape[0]} and {k.shape[0]}")


def _fa4(q, k, v, seg: Segments, scale):
    from flash_attn.cute import flash_attn_varlen_func

    out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=seg.cu_q, cu_seqlens_k=seg.cu_k, max_seqlen_q=seg.max_q,
                                    max_seqlen_k=seg.max_k, softmax_scale=scale, causal=True)
    return out


def _flash_attn(q, k, v, seg: Segments, scale):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, softmax_scale=scale,
                                  causal=True)


def _sdpa_entries(q, k, v, seg: Segments, scale):
    """SDPA once per entry: a square entry through `sdpa_attention` (cuDNN first), one with more keys than queries with a
    bottom-right causal bias (SDPA's flash / efficient / math kernels; its K/V heads repeated for GQA)."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    pieces, q0, k0 = [], 0, 0
    group = q.shape[1] // k.shape[1]
    for lq, lk in zip(seg.q_lengths, seg.k_lengths):
        qi, ki, vi = q[None, q0:q0 + lq], k[None, k0:k0 + lk], v[None, k0:k0 + lk]
        if lq == lk:
            pieces.append(sdpa_attention(qi, ki, vi, True, scale)[0])
        else:
            ki, vi = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (ki, vi))
            out = F.scaled_dot_product_attention(qi.transpose(1, 2), ki, vi, attn_mask=causal_lower_right(lq, lk),
                                                 scale=scale)
            pieces.append(out.transpose(1, 2)[0])
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]


def _triton(q, k, v, seg: Segments, scale):
    """Our partial kernels over the whole packed call: entry ids as document ids, positions within each entry (the
    queries at the end of their entry's keys)."""
    from mtrain.ops.partial_autograd import partial_attention

    dev = q.device
    lq, lk = torch.tensor(seg.q_lengths), torch.tensor(seg.k_lengths)
    entry_q = torch.repeat_interleave(torch.arange(len(lq)), lq)
    entry_k = torch.repeat_interleave(torch.arange(len(lk)), lk)
    starts_q = torch.cumsum(lq, 0) - lq
    starts_k = torch.cumsum(lk, 0) - lk
    q_pos = torch.arange(seg.total_q) - starts_q[entry_q] + (lk - lq)[entry_q]
    k_pos = torch.arange(seg.total_k) - starts_k[entry_k]
    out, _ = partial_attention(q[None], k[None], v[None], q_pos=q_pos.to(dev), k_pos=k_pos.to(dev),
                               softmax_scale=scale, causal=True, block_size=64, q_doc=entry_q[None].to(dev),
                               k_doc=entry_k[None].to(dev))
    return out[0]


_RUN = {"fa4": _fa4, "flash_attn": _flash_attn, "sdpa": _sdpa_entries, "triton": _triton}


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                     softmax_scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Causal attention of packed entries in one call, differentiable in q, k, v.

    q: [Tq, Hq, D], k, v: [Tk, Hkv, D] (Hq % Hkv == 0): the entries of `segments` back to back; entry i's queries
    see its keys causally from the bottom right (query j of lq sees keys 0 .. lk - lq + j). softmax_scale defaults
    to 1/sqrt(D). backend: one of VARLEN_BACKENDS, None = `varlen_backend(q)`. Returns out [Tq, Hq, D] in q.dtype.
    """
    _check(q, k, v, segments)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = backend or varlen_backend(q)
    if backend not in _RUN:
        raise ValueError(f"varlen backend must be one of {VARLEN_BACKENDS}; got {backend!r}")
    return _RUN[backend](q, k, v, segments, scale)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents,
                       softmax_scale: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Dense causal attention within the documents of packed rows: q [B, S, Hq, D], k, v [B, S, Hkv, D], documents
    of the same [B, S]; a query sees the keys of its own document up to itself. One varlen call for the whole batch
    (`varlen_attention`; backend as there). Returns out [B, S, Hq, D]."""
    B, S = q.shape[:2]
    if k.shape[:2] != (B, S) or tuple(documents.doc_ids.shape) != (B, S):
        raise ValueError(f"document attention needs q, k, v and the documents over the same [B, S]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, documents {tuple(documents.doc_ids.shape)}")
    seg = documents.segments
    if seg.cu_q.device != q.device:
        seg = seg.to(q.device)
    flat = [t.reshape(B * S, *t.shape[2:]) for t in (q, k, v)]
    return varlen_attention(*flat, seg, softmax_scale, backend).view(B, S, *q.shape[2:])
