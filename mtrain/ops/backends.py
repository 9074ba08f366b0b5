"""Which dense attention kernels are installed and run here (FlashAttention-4, flash-attn 2), and PyTorch SDPA with
cuDNN first: what `mtrain.ops.dense` and `mtrain.ops.varlen` both dispatch on."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` (on the host) on `device` without making the host wait: a copy to a CUDA device from pageable memory
    first waits for the device's queue to drain, so it goes through pinned memory, asynchronously (the caching
    host allocator keeps the pinned copy alive until the transfer is done). Elsewhere a plain `.to(device)`."""
    device = torch.device(device) if device is not None else t.device
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def importable(module: str) -> bool:
    """Whether `module` (dotted) is installed, without importing it (a missing parent package is no error)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package is missing
        return False


def has_flash_attn() -> bool:
    """Whether flash-attn 2's `flash_attn_func` can be imported: flash-attn-4 alone (the `fa4` extra) also
    provides a `flash_attn` package (only `flash_attn.cute`), which does not count."""
    return importable("flash_attn.flash_attn_interface")


def fa4_runs(q: torch.Tensor) -> bool:
    """Whether FlashAttention-4 (`flash_attn.cute`) runs this q: installed, a Hopper or Blackwell GPU, fp16/bf16, a
    head dimension it takes (a multiple of 8, at most 128; 256 on Hopper)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or not importable("flash_attn.cute.interface"):
        return False
    major = torch.cuda.get_device_capability(q.device)[0]
    D = q.shape[-1]
    return major in (9, 10, 11) and D % 8 == 0 and D <= (256 if major == 9 else 128)


def sdpa_attention(q, k, v, causal, scale):
    """SDPA on q [B, S, Hq, D], k, v [B, Sk, Hkv, D] (GQA), cuDNN first; causal from the top left."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    # cuDNN first: the fastest causal fwd+bwd of SDPA's backends at long context on Hopper (BENCHMARKS.md).
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=Hq != Hkv)
    return out.transpose(1, 2)
