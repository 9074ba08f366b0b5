"""Dense ring steps as a few full or plainly causal rectangles (contiguous, zigzag shards), run by SDPA's
fused cuDNN kernel with its LSE on the GPU; other layouts' dense steps go through mtrain.ops.partial."""

from __future__ import annotations

from dataclasses import dataclass

import warnings

import torch

from mtrain.ops import partial

# most runs a shard may have before the rectangles stop paying off (zigzag has 2)
_MAX_RUNS = 4


@dataclass(frozen=True)
class Rect:
    """Local query rows [q0, q1) against local key rows [k0, k1) of the visiting shard; causal = top-left
    causal on a square (the same positions on both sides), else every pair is visible."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _runs(pos: torch.Tensor) -> list[tuple[int, int]]:
    """Local [start, stop) ranges holding consecutive ascending positions."""
    breaks = (torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1).tolist()
    edges = [0] + breaks + [pos.numel()]
    return list(zip(edges[:-1], edges[1:]))


def dense_rects(q_pos: torch.Tensor, k_pos: torch.Tensor, same_shard: bool) -> list[Rect] | None:
    """The rectangles of the causal mask of q_pos against k_pos, or None when it is no such union."""
    ascending = bool((q_pos[1:] > q_pos[:-1]).all())
    if same_shard and ascending:
        return [Rect(0, q_pos.numel(), 0, k_pos.numel(), True)]  # ascending positions: causal = local causal
    q_runs, k_runs = _runs(q_pos), _runs(k_pos)
    if len(q_runs) > _MAX_RUNS or len(k_runs) > _MAX_RUNS:
        return None
    rects: list[Rect] = []
    for k0, k1 in k_runs:
        k_lo, k_hi = int(k_pos[k0]), int(k_pos[k1 - 1])
        for q0, q1 in q_runs:
            q_lo, q_hi = int(q_pos[q0]), int(q_pos[q1 - 1])
            if k_lo > q_hi:
                continue  # all keys in this query run's future
            if k_hi <= q_lo:
                causal = False
            elif (k_lo, k_hi) == (q_lo, q_hi):
                causal = True
            else:
                return None  # partly overlapping runs: not a plain rectangle
            last = rects[-1] if rects else None
            if last and not causal and not last.causal and (last.k0, last.k1) == (k0, k1) and last.q1 == q0:
                rects[-1] = Rect(last.q0, q1, k0, k1, False)  # adjacent query runs seeing the same keys
            else:
                rects.append(Rect(q0, q1, k0, k1, causal))
    # adjacent key runs seen in full by the same query rows become one rectangle
    merged: list[Rect] = []
    for rect in sorted(rects, key=lambda r: (r.q0, r.q1, r.k0)):
        last = merged[-1] if merged else None
        if last and not rect.causal and not last.causal and (last.q0, last.q1) == (rect.q0, rect.q1) and last.k1 == rect.k0:
            merged[-1] = Rect(last.q0, last.q1, last.k0, rect.k1, False)
        else:
            merged.append(rect)
    return merged


def _fused_ok(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, Hq, S, D], repeating KV heads after the transfer (only Hkv heads travel)."""
    if x.shape[2] != heads:
        x = x.repeat_interleave(heads // x.shape[2], dim=2)
    return x.transpose(1, 2)


_CUDNN = {"usable": True}


def _fused_forward(q, k, v, causal: bool, scale: float):
    """(out, lse, aux): aux holds what the kernel's backward needs from its forward (sequence offsets, RNG
    state, the stats' shape), as PyTorch's own autograd keeps it."""
    b, sq, hq, _ = q.shape
    qh, kh, vh = q.transpose(1, 2), _heads_first(k, hq), _heads_first(v, hq)
    if _CUDNN["usable"]:
        try:
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, causal, False, scale=scale)
            aux = {"kernel": "cudnn", "stats_shape": res[1].shape, "rest": res[2:8]}
            return res[0].transpose(1, 2), res[1].reshape(b, hq, sq).float(), aux
        except RuntimeError as exc:
            # this build/GPU has no cuDNN attention: SDPA's flash kernel instead
            _CUDNN["usable"] = False
            warnings.warn(f"cuDNN attention unavailable ({exc}); dense ring steps use SDPA's flash kernel")
    res = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)
    aux = {"kernel": "flash", "stats_shape": res[1].shape, "rest": res[2:8]}
    return res[0].transpose(1, 2), res[1].reshape(b, hq, sq).float(), aux


def _fused_backward(dout, q, k, v, out, lse, causal: bool, scale: float, aux: dict):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qh, kh, vh = q.transpose(1, 2), _heads_first(k, hq), _heads_first(v, hq)
    doh, oh = dout.transpose(1, 2), out.transpose(1, 2)
    # the merged LSE in the layout the forward kernel returned its stats in
    stats = lse.contiguous().reshape(aux["stats_shape"])
    cum_q, cum_k, max_q, max_k, seed, offset = aux["rest"]
    if aux["kernel"] == "cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            doh, qh, kh, vh, oh, stats, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, stats, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    group = hq // hkv
    if group > 1:  # the GQA group's query heads summed in fp32, straight from the 16-bit kernel output
        dk = dk.view(b, hkv, group, sk, d).sum(2, dtype=torch.float32)
        dv = dv.view(b, hkv, group, sk, d).sum(2, dtype=torch.float32)
    # 16-bit parts stay 16-bit: the ring adds them into its fp32 sums (no widened copy of each)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _local_positions(n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device)


def rect_forward(q, k, v, rect: Rect, scale: float):
    """(out, lse, aux) of one rectangle: fused SDPA on the GPU (aux: what its backward needs), else
    mtrain.ops.partial with the rectangle's own rule (local positions, causal flag; aux None), so the CPU
    tests check the decomposition itself."""
    qs, ks, vs = q[:, rect.q0:rect.q1], k[:, rect.k0:rect.k1], v[:, rect.k0:rect.k1]
    if _fused_ok(q):
        return _fused_forward(qs, ks, vs, rect.causal, scale)
    out, lse = partial.attention_forward(
        qs, ks, vs, q_pos=_local_positions(qs.shape[1], q.device), k_pos=_local_positions(ks.shape[1], q.device),
        softmax_scale=scale, causal=rect.causal,
    )
    return out, lse, None


def rect_backward(dout, q, k, v, out, lse, rect: Rect, scale: float, aux: dict | None):
    """(dq, dk, dv) of one rectangle, given the final merged out and lse of its rows and the aux its forward
    returned: the fused kernel's 16-bit results (GQA sums in fp32), else fp32 (fp64 for fp64 inputs)."""
    rows, keys = slice(rect.q0, rect.q1), slice(rect.k0, rect.k1)
    args = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows])
    if aux is not None:
        return _fused_backward(*args, rect.causal, scale, aux)
    return partial.attention_backward(
        *args, q_pos=_local_positions(rect.q1 - rect.q0, q.device),
        k_pos=_local_positions(rect.k1 - rect.k0, q.device), softmax_scale=scale, causal=rect.causal,
    )
