"""Ring steps through FlashAttention-4 (`attention.engine` fa4 / auto): a sparse step's local key-block lists run in
FA4's block-sparse kernels and the step's off-ring columns in our Triton column path, merged by LSE in the column
kernel's epilogue, as the one-device fa4 engine (`mtrain.ops.fa4`) does; the backward runs from the ring's merged
out / lse (FA4's block-sparse backward, then the columns' deterministic backward adding into its gradients).

A step's lists hold local key blocks of one shard. Where every global block is one local block of one rank
(`RingPlan.block_size` equals the index's), a listed key block lies wholly before the query block in the sequence,
except the query block's own block on the local step (origin = this rank), the only one that needs the causal test
inside the block. So FA4 runs every listed block as a full block and that one as a mask block with the causal
mask_mod; local offsets inside a block equal global ones, so the test in local coordinates is the global one.
"""

from __future__ import annotations

import dataclasses

import torch

from mtrain.ops import partial
from mtrain.ops.fa4 import BLOCK_SIZE, load_fa4, mask_mods, sparse_tensors, transposed, transposed_bounded
from mtrain.ops.lists import left_pack
from mtrain.parallel.plan import RingPlan

ENGINES = ("auto", "triton", "fa4")


def resolve_engine(engine: str, plan: RingPlan, q: torch.Tensor) -> str:
    """The block kernels a ring's sparse steps run for `engine`: "fa4" where FA4 runs (CUDA, fp16/bf16, the plan's
    blocks are the index's 128-token blocks, no document masking, flash_attn.cute importable, deterministic
    algorithms not asked for: FA4's backward is atomic), else "triton". "fa4"
    asked for where it cannot run falls back to "triton" too (the ring's result is the same): a ring cannot refuse
    one step of a call its other ranks are running."""
    if engine not in ENGINES:
        raise ValueError(f"ring engine must be one of {ENGINES}; got {engine!r}")
    if engine == "triton":
        return "triton"
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and plan.block_size == BLOCK_SIZE
            and plan.doc_ids is None and all(s is not None for s in plan.steps.values())):
        return "triton"
    if torch.are_deterministic_algorithms_enabled():  # FA4's block-sparse backward adds dQ with atomics
        return "triton"
    from mtrain.ops.attention import fa4_usable

    return "fa4" if fa4_usable(q.device.type, q.device.index) else "triton"


@dataclasses.dataclass
class StepLists:
    """FA4's block-sparse lists of one ring step (see `mtrain.ops.fa4.Fa4Lists`), and the column path's no-block
    lists; built once per plan, step and shapes (kept in the step's kernel cache)."""

    fwd: object
    bwd: object
    no_blocks: tuple[torch.Tensor, torch.Tensor]
    col_plans: dict


def _trim(ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Transposed lists cut to their longest (one host read, with the plan): about the number of slash offsets,
    where the untrimmed width is every query block of the shard. (A bounded plan sizes them from its bound instead:
    a key block is listed once per block offset at most, query block i listing key block j when i - j is one of the
    head's offsets, and a row's list holds every offset it can use, so a step's list width bounds the transposed
    lists too: `transposed_bounded`.)"""
    width = max(1, int(counts.max())) if counts.numel() else 1
    return ids[..., :width].contiguous()


def step_block_lists(plan: RingPlan, origin: int, n_keys: int) -> tuple[tuple, tuple]:
    """FA4's block-sparse lists of one ring step over `n_keys` key rows, as plain tensors: ((mask_cnt, mask_idx,
    full_cnt, full_idx) per query block, (the same) per key block for the backward), int32. Every index tensor is at
    most as wide as the blocks it lists from (FA4 refuses wider ones): a short shard (few key blocks per step, e.g. a
    small sequence over 8 ranks) can have lists wider than its blocks, though a row never lists a block twice."""
    step = plan.steps[origin]
    bs = plan.block_size
    ids, counts = step.ids.long(), step.counts.long()
    b, h, nq, width = ids.shape
    nk = -(-n_keys // bs)  # the shard's blocks, then the gathered columns' on the column step
    dev = ids.device
    live = torch.arange(width, device=dev) < counts[..., None]
    if origin == plan.rank:
        diag = live & (ids == torch.arange(nq, device=dev)[:, None])
        full = live & ~diag
        mask_cnt = diag.any(-1).to(torch.int32)
    else:
        full = live
        mask_cnt = torch.zeros(b, h, nq, dtype=torch.int32, device=dev)
    full_idx, full_cnt = left_pack(ids, full, max(1, min(width, nk)))
    mask_idx = torch.arange(nq, device=dev, dtype=torch.int32).view(1, 1, nq, 1).expand(b, h, nq, 1).contiguous()
    if plan.bounded:  # sized from the bound: no [B, H, nk, nq] flags, no host read
        full_q_idx, full_q_cnt = transposed_bounded(full_idx, full_cnt, nk, min(width, nq))
    else:
        full_q_idx, full_q_cnt = transposed(full_idx, full_cnt, nk)
        full_q_idx = _trim(full_q_idx, full_q_cnt)
    blocks = torch.arange(nk, device=dev)
    mask_q_cnt = torch.zeros(b, h, nk, dtype=torch.int32, device=dev)
    mask_q_cnt[..., :nq] = mask_cnt
    mask_q_idx = torch.where(blocks < nq, blocks, 0).to(torch.int32).view(1, 1, nk, 1).expand(b, h, nk, 1).contiguous()
    return (mask_cnt, mask_idx, full_cnt, full_idx), (mask_q_cnt, mask_q_idx, full_q_cnt, full_q_idx)


def step_lists(plan: RingPlan, origin: int, q: torch.Tensor, k: torch.Tensor) -> StepLists:
    cache = plan.kernel_cache(origin, q, k)
    if "fa4" in cache:
        return cache["fa4"]
    fwd, bwd = step_block_lists(plan, origin, k.shape[1])
    b, h, nq = fwd[0].shape
    dev = fwd[0].device
    no_blocks = (torch.full((b, h, nq, 1), -1, dtype=torch.int32, device=dev),
                 torch.zeros(b, h, nq, dtype=torch.int32, device=dev))
    from mtrain.ops._triton_attention import NO_BLOCKS
    from mtrain.ops.index import BOUNDED, COLUMN_BASE

    lists = StepLists(sparse_tensors(*fwd, plan.block_size), sparse_tensors(*bwd, plan.block_size),
                      no_blocks, {NO_BLOCKS: True, BOUNDED: plan.bounded, COLUMN_BASE: plan.column_base(origin)})
    cache["fa4"] = lists
    return lists


def _column_kwargs(plan: RingPlan, lists: StepLists, k_pos, columns, scale: float) -> dict:
    return dict(q_pos=plan.q_pos, k_pos=k_pos, blocks=lists.no_blocks, columns=columns, block_size=plan.block_size,
                softmax_scale=scale, causal=True, impl="triton")


def forward(q, k, v, plan: RingPlan, origin: int, k_pos, columns, scale: float):
    """(out, lse) of the local queries against the step's keys k/v (the shard's, then the gathered columns' on the
    column step): FA4 on the listed blocks, the columns merged into its result in the column kernel."""
    fa4 = load_fa4()
    lists = step_lists(plan, origin, q, k)
    causal_mod, _ = mask_mods()
    out, lse = fa4._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=False, mask_mod=causal_mod,
                                   block_sparse_tensors=lists.fwd, return_lse=True)[:2]
    lse = lse.float().contiguous()
    if columns is not None:
        out, lse = partial.attention_forward(q, k, v, plans=lists.col_plans, merge_into=(out.contiguous(), lse),
                                             **_column_kwargs(plan, lists, k_pos, columns, scale))
    return out, lse


def backward(dout, q, k, v, out, lse, plan: RingPlan, origin: int, k_pos, columns, scale: float):
    """(dq, dk, dv) of the step from the ring's merged out / lse: FA4's block-sparse backward (atomic dQ), then the
    columns' deterministic backward accumulating into its gradients."""
    fa4 = load_fa4()
    lists = step_lists(plan, origin, q, k)
    causal_mod, _ = mask_mods()
    dq, dk, dv = fa4._flash_attn_bwd(q, k, v, out, dout, lse, scale, False, mask_mod=causal_mod,
                                     block_sparse_tensors=lists.bwd, deterministic=False)[:3]
    if columns is not None:
        dq, dk, dv = partial.attention_backward(dout, q, k, v, out, lse, deterministic=True, plans=lists.col_plans,
                                                grad_init=(dq, dk, dv),
                                                **_column_kwargs(plan, lists, k_pos, columns, scale))
    return dq, dk, dv
