"""Differentiable vertical-slash sparse attention on one device: the engine dispatch (`resolve_impl`) and, for our
kernels, the partial-attention autograd function (`mtrain.ops.partial_autograd`: Triton on GPU / interpreter,
PyTorch otherwise) with query and key positions 0..S-1."""

from __future__ import annotations

import functools

import torch

from mtrain.ops import partial
from mtrain.ops.index import SparseIndex
from mtrain.ops.partial_autograd import partial_attention


# Index block sizes for which impl="auto" on CUDA runs FlexAttention instead of our Triton kernels, i.e.
# where Flex driven by our index was measured faster (index + forward + backward). None: our kernels beat Flex on
# the identical 128-token-block mask, and Flex's backward does not lower for 64-token blocks with its default
# configurations, while ours run them (mtrain/bench/attention.py; BENCHMARKS.md, one-GPU attention on synthetic
# inputs).
AUTO_FLEX_BLOCK_SIZES: frozenset[int] = frozenset()
# Index block sizes for which impl="auto" runs the fa4 engine (FlashAttention-4 for the listed blocks) where FA4 is
# installed, on a GPU of compute capability >= 9, with 16-bit inputs: faster than our kernels alone at 128-token
# blocks, on synthetic inputs and on SmolLM2's whole model (BENCHMARKS.md, one-GPU attention).
# FA4's SM90 backward runs only 128-token key blocks.
AUTO_FA4_BLOCK_SIZES: frozenset[int] = frozenset({128})


@functools.lru_cache(maxsize=8)
def fa4_usable(device_type: str, device_index) -> bool:
    """Whether the fa4 engine can run here: a CUDA GPU of compute capability >= 9 with flash_attn.cute importable."""
    from mtrain.ops.backends import importable

    return device_type == "cuda" and torch.cuda.get_device_capability(device_index)[0] >= 9 and importable(
        "flash_attn.cute")


def resolve_impl(impl: str, device, block_size: int, dtype=None) -> str:
    """The engine `vertical_slash_attention` runs for `impl` on `device` (a torch.device) at this block size and
    input dtype: "auto" becomes "fa4" on CUDA at AUTO_FA4_BLOCK_SIZES where FA4 can run (`fa4_usable`; fp16/bf16
    inputs, or dtype None), "flex" at AUTO_FLEX_BLOCK_SIZES, else "triton" on CUDA and under TRITON_INTERPRET=1,
    else "torch"; other impls are returned as they are."""
    if impl != "auto":
        return impl
    if device.type == "cuda":
        if (block_size in AUTO_FA4_BLOCK_SIZES and dtype in (None, torch.float16, torch.bfloat16)
                and fa4_usable(device.type, device.index)):
            return "fa4"
        return "flex" if block_size in AUTO_FLEX_BLOCK_SIZES else "triton"
    return "triton" if partial.use_triton("auto", device) else "torch"


def vertical_slash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    impl: str = "auto",
    deterministic: bool = True,
    doc_ids: torch.Tensor | None = None,
):
    """Causal vertical-slash sparse attention, differentiable in q, k and v.

    q: [B, S, Hq, D]; k, v: [B, S, Hkv, D] with Hq % Hkv == 0 (GQA: query head h reads kv head
    h // (Hq // Hkv); K/V are not repeated in memory). index: a `SparseIndex` for these B, Hq, S.
    Computes softmax(scale * q k^T) v over exactly the pairs of `index.to_mask()` (causal: key
    position <= query position), accumulating in fp32 (on a GPU our Triton kernels form fp32 inputs' products as
    three tf32 products, tf32x3: within ~1e-6 of float64 on the gate's cases). S need not be a multiple of the
    block size: the last block is partial and masked. softmax_scale defaults to 1/sqrt(D).
    impl: "auto", "triton", "flex", "fa4" or "torch". "triton": our kernels (GPU, or TRITON_INTERPRET=1 on
    the CPU). "flex": FlexAttention driven by this index (`mtrain.ops.flex`: an exact BlockMask from
    `BlockMask.from_kv_blocks`, Flex's own fused forward and backward; CUDA, or forward-only on the CPU;
    `deterministic` does not apply). "fa4": FlashAttention-4 as the block engine (`mtrain.ops.fa4`; optional
    extra `mtrain[fa4]`, CUDA, fp16/bf16, index block_size 128 only, ValueError otherwise): listed blocks in
    FA4's block-sparse kernels, vertical columns in our Triton column path, merged by LSE; its backward is
    FA4's (atomic) with deterministic=False and ours (deterministic) with deterministic=True.
    "torch": the PyTorch path. "auto" (`resolve_impl`): on CUDA the engine measured fastest for the index's
    block size (fa4 at AUTO_FA4_BLOCK_SIZES where FA4 is installed on a Hopper-or-newer GPU and the inputs
    are 16-bit, flex at AUTO_FLEX_BLOCK_SIZES, else triton; see there and BENCHMARKS.md), under
    TRITON_INTERPRET=1 Triton, else PyTorch.
    deterministic: True (default) = backward without atomics (dQ per query block, dK/dV per key block
    through the transposed index, looping over the GQA group's heads, vertical columns per column
    chunk); False = the fused backward: the same dK/dV passes also add each tile's dQ share with fp32
    atomics, so no dQ pass recomputes the scores (dQ varies in the last bits between runs; as fast at
    head dim 64, slower at 128: BENCHMARKS.md). The torch path is deterministic either way.
    doc_ids: optional integer tensor [B, S] of document ids (packed samples; equal id = same
    document): a query then attends only to keys of its own document, on top of the index.
    Returns out [B, S, Hq, D] in q.dtype, and with return_lse also lse [B, Hq, S] fp32 (no gradient).
    """
    B, S, Hq, _ = q.shape
    if index.seq_len != S or tuple(index.block_ids.shape[:2]) != (B, Hq):
        raise ValueError(
            f"index is for B={index.block_ids.shape[0]}, Hq={index.block_ids.shape[1]}, S={index.seq_len} but q is "
            f"[B={B}, S={S}, Hq={Hq}, D]; build the index from these q/k (estimate_vertical_slash) or with from_lines"
        )
    if index.block_ids.device != q.device:
        index = index.to(q.device)
    if impl not in ("auto", "triton", "flex", "fa4", "torch"):
        raise ValueError(f'impl must be "auto", "triton", "flex", "fa4" or "torch"; got {impl!r}')
    impl = resolve_impl(impl, q.device, index.block_size, q.dtype)
    if impl == "fa4":
        from mtrain.ops.fa4 import fa4_vertical_slash

        out, lse = fa4_vertical_slash(q, k, v, index, softmax_scale, doc_ids, deterministic)
        return (out, lse) if return_lse else out
    if impl == "flex":
        from mtrain.ops.flex import flex_vertical_slash

        out, lse = flex_vertical_slash(q, k, v, index, softmax_scale, doc_ids)
        return (out, lse) if return_lse else out
    pos = torch.arange(S, device=q.device)
    # With document ids everything the kernels derive comes from the doc-filtered lists: a per-call
    # dict (shared by this call's forward and backward) keeps it out of the index's cache.
    plans = index._cache if doc_ids is None else {}
    out, lse = partial_attention(
        q, k, v, q_pos=pos, k_pos=pos, blocks=index.blocks, columns=index.kernel_columns, block_size=index.block_size,
        softmax_scale=softmax_scale, causal=True, impl=impl, deterministic=deterministic, plans=plans,
        q_doc=doc_ids, k_doc=doc_ids,
    )
    return (out, lse) if return_lse else out
