"""FlashAttention-4 (CuTe DSL) as an optional block engine for vertical-slash attention: the index's key blocks
run in FA4's block-sparse kernels, the vertical columns in our Triton column path, the two merged by LSE."""

from __future__ import annotations

import dataclasses
import math

import torch

from mtrain.ops import partial
from mtrain.ops.partial_autograd import NOT_PLANS, join_tensors, split_tensors
from mtrain.ops.index import SparseIndex, group_counts, kernel_column_chunk
from mtrain.ops.lists import doc_ranges, left_pack

# The FA4 release this engine was written and checked against (pyproject extra `fa4`). The engine calls FA4's
# lower-level `_flash_attn_fwd` / `_flash_attn_bwd` (the public `flash_attn_func` cannot run its backward on
# another out / lse than its own forward's), so the pin is exact. 4.0.0b11 fixed silently wrong SM90
# block-sparse gradients at head dim 64 (Dao-AILab/flash-attention#2623).
FA4_VERSION = "4.0.0b36"
# The only index block size the engine takes: FA4's SM90 backward runs 128-token key tiles and needs the
# sparse key block to equal its tile (`normalize_block_sparse_config_bwd`); its forward would take 64.
BLOCK_SIZE = 128
# Keys of an index's cache the Triton backward fallback does not read.
_OWN_KEYS = ("fa4", "flex", *NOT_PLANS)

# Jitted callables built on first use (CuTe mask_mods, Triton kernels): FA4 keys its compile cache on the mask_mods.
_JIT: dict = {}


def load_fa4():
    """FA4's `flash_attn.cute.interface` module; ImportError naming the install when it is missing."""
    try:
        from flash_attn.cute import interface
    except ImportError as exc:
        raise ImportError(
            "impl='fa4' needs FlashAttention-4 (the CuTe DSL kernels, module flash_attn.cute), which is not "
            f"importable here: install it on the GPU machine with pip install 'mtrain[fa4]' (flash-attn-4=="
            f"{FA4_VERSION}; for CUDA 13 torch also nvidia-cutlass-dsl[cu13]), or use impl='triton'"
        ) from exc
    return interface


def check_fa4_inputs(q: torch.Tensor, index: SparseIndex) -> None:
    """ValueError unless q and index suit the FA4 engine (128-token blocks, fp16/bf16, CUDA)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"impl='fa4' takes float16 or bfloat16 q/k/v, not {q.dtype}; use impl='triton'")
    if index.block_size != BLOCK_SIZE:
        raise ValueError(
            f"impl='fa4' needs an index with block_size={BLOCK_SIZE} (FA4's SM90 backward runs {BLOCK_SIZE}-token "
            f"key tiles and the sparse key block must equal them); this index has block_size={index.block_size}: "
            f"build it with block_size={BLOCK_SIZE} (estimate_vertical_slash(..., block_size={BLOCK_SIZE})) or use "
            "impl='triton'"
        )
    if q.device.type != "cuda":
        raise ValueError(
            f"impl='fa4' runs on CUDA tensors only (FlashAttention-4 is a GPU kernel library); q is on {q.device}: "
            "use impl='triton' (TRITON_INTERPRET=1 on the CPU) or impl='torch'"
        )


@dataclasses.dataclass
class Fa4Lists:
    """The index's key blocks in FA4's block-sparse format (all int32, entries past a count are 0).

    Forward, per (b, query head h, query block i): full_* = listed key blocks strictly below the diagonal that
    every query of block i keeps whole (no mask_mod), mask_* = listed blocks where the mask_mod decides pair by
    pair (the diagonal block: causal; with documents also blocks that cross a document boundary).
    counts [B, Hq, nQB], ids [B, Hq, nQB, W], ascending. Backward (the same pairs, transposed), per key block j:
    full_q_* / mask_q_* = the query blocks that list j as full / mask block, [B, Hq, nKB] and [B, Hq, nKB, W'].
    """

    full_cnt: torch.Tensor
    full_idx: torch.Tensor
    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor
    full_q_cnt: torch.Tensor
    full_q_idx: torch.Tensor
    mask_q_cnt: torch.Tensor
    mask_q_idx: torch.Tensor
    block_size: int


def transposed_bounded(ids: torch.Tensor, counts: torch.Tensor, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`transposed` into a width known to hold every transposed list (e.g. a bounded ring plan's, see
    `mtrain.parallel.fa4_steps`): one stable sort of the listed entries by key block instead of [B, H, n, nQB] flags,
    so time and memory follow the lists' entries; no host read. (ids int32 [B, H, n, width], 0-padded; counts)."""
    B, H, nq, w = ids.shape
    dev = ids.device
    width = max(1, int(width))
    live = torch.arange(w, device=dev) < counts[..., None]
    lists = B * H * n
    bh = torch.arange(B * H, device=dev).view(B, H, 1, 1) * n
    key = torch.where(live, bh + ids.long(), lists).flatten()  # entries in (b, h, query block) order
    key, order = torch.sort(key, stable=True)  # query blocks stay ascending within each key block
    q_blk = torch.arange(nq, device=dev).view(1, 1, nq, 1).expand(B, H, nq, w).flatten()[order]
    per_key = group_counts(key, lists + 1)
    slot = torch.arange(key.numel(), device=dev) - (torch.cumsum(per_key, 0) - per_key)[key]
    out = torch.zeros((lists + 1) * (width + 1), dtype=torch.int32, device=dev)  # last row / column: dumps
    out.index_put_((key * (width + 1) + slot.clamp(max=width),), q_blk.to(torch.int32))
    out = out.view(lists + 1, width + 1)[:lists, :width].reshape(B, H, n, width).contiguous()
    return out, per_key[:lists].view(B, H, n).to(torch.int32)


def transposed(ids: torch.Tensor, counts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block the query blocks listing it, ascending: (ids int32 [B, H, n, n], 0-padded; counts int32).
    Width n without reading the counts back: the sink block is listed by every query block, so the longest
    transposed list is about n anyway."""
    B, H, nq, width = ids.shape
    live = torch.arange(width, device=ids.device) < counts[..., None]
    flags = torch.zeros(B, H, n, nq + 1, dtype=torch.bool, device=ids.device)  # [b, h, key block, query block]
    rows = torch.arange(nq, device=ids.device)[:, None].expand(nq, width)
    at = ((torch.arange(B, device=ids.device)[:, None, None, None] * H + torch.arange(H, device=ids.device)[:, None, None])
          * n + ids.long()) * (nq + 1) + torch.where(live, rows, nq)
    flags.view(-1).index_fill_(0, at.flatten(), True)  # (a Python scalar set through [] would copy it to the device)
    flags = flags[..., :nq]
    return left_pack(torch.arange(nq, device=ids.device).expand_as(flags), flags, nq)


def _lists_without_documents(index: SparseIndex) -> Fa4Lists:
    """`fa4_block_lists` without documents, from what the index already holds: each row's list is its full
    blocks followed by its diagonal block (ascending, the diagonal last), so the full lists are the rows' lists
    less their last entry and the mask lists the diagonal alone; per key block j the transposed index
    (`SparseIndex.transposed_csr`, which the GPU builder makes with the index) lists j itself first, then the
    later query blocks listing j, so the full transposed lists are those entries past the first. A few gathers,
    no [B, H, n, n] flag tensor, no packing."""
    B, H, n, width = index.block_ids.shape
    dev = index.block_ids.device
    width = max(1, min(width, n))
    counts = index.block_counts[..., :n]
    slot = torch.arange(width, device=dev)
    full_cnt = (counts - 1).clamp(min=0).to(torch.int32)
    full_idx = torch.where(slot < full_cnt[..., None], index.block_ids[..., :width], 0).to(torch.int32).contiguous()
    diag = torch.arange(n, device=dev, dtype=torch.int32)
    mask_idx = diag.view(1, 1, n, 1).expand(B, H, n, 1).contiguous()
    ones = torch.ones(B, H, n, dtype=torch.int32, device=dev)
    q_ids, starts, t_counts = index.transposed_csr()
    full_q_cnt = (t_counts.to(torch.int32) - 1).clamp(min=0)
    col = torch.arange(n, device=dev)
    where = (starts[..., None] + 1 + col).clamp(max=max(q_ids.numel() - 1, 0))
    got = q_ids[where] if q_ids.numel() else torch.zeros_like(where)
    full_q_idx = torch.where(col < full_q_cnt[..., None], got, 0).to(torch.int32).contiguous()
    return Fa4Lists(full_cnt, full_idx, ones, mask_idx, full_q_cnt, full_q_idx, ones, mask_idx, index.block_size)


def fa4_block_lists(index: SparseIndex, doc_ids: torch.Tensor | None = None) -> Fa4Lists:
    """`Fa4Lists` of the index's listed key blocks (not its columns), exact with the causal mask_mod.

    Without documents: blocks below the diagonal are full, the diagonal block is a mask block, blocks above
    it are dropped (no causal pair). With doc_ids [B, S] (integers, equal = same document): a listed block is
    dropped when its document-id range cannot meet the query block's, full when both blocks lie in one and the
    same document and it is below the diagonal, else a mask block (the mask_mod adds the same-document test).
    Plain tensor code (CPU or GPU) without host synchronisation: the forward lists keep the index's width, the
    transposed lists have width nQB (the sink block is listed by every query block anyway). Without documents
    the lists come from the index's own lists and transposed index (`_lists_without_documents`, the same lists);
    `fa4_block_lists_general` is the general path.
    """
    if doc_ids is None:
        return _lists_without_documents(index)
    return fa4_block_lists_general(index, doc_ids)


def fa4_block_lists_general(index: SparseIndex, doc_ids: torch.Tensor | None = None) -> Fa4Lists:
    """`fa4_block_lists` by masking and packing the index's lists (documents or not)."""
    B, H, n, width = index.block_ids.shape
    bs, S = index.block_size, index.seq_len
    dev = index.block_ids.device
    width = max(1, min(width, n))
    rows = torch.arange(n, device=dev)[:, None]
    ids = index.block_ids.long()
    ok = (torch.arange(ids.shape[-1], device=dev) < index.block_counts[..., None].long()) & (ids >= 0) & (ids < n)
    below, diag = ok & (ids < rows), ok & (ids == rows)
    if doc_ids is None:
        full, mask = below, diag
    else:
        if tuple(doc_ids.shape) != (B, S) or doc_ids.is_floating_point() or doc_ids.is_complex():
            raise ValueError(
                f"doc_ids must be an integer tensor [B={B}, S={S}]; got {doc_ids.dtype} {tuple(doc_ids.shape)}")
        lo, hi = doc_ranges(doc_ids.to(device=dev, dtype=torch.int64), bs, n)
        b = torch.arange(B, device=dev)[:, None, None, None]
        j = ids.clamp(0, n - 1)
        q_lo, q_hi = lo[:, None, :, None], hi[:, None, :, None]
        meets = (lo[b, j] <= q_hi) & (hi[b, j] >= q_lo)
        one_doc = (q_lo == q_hi) & (lo[b, j] == q_lo) & (hi[b, j] == q_lo)
        full = below & one_doc
        mask = (below | diag) & meets & ~full
    full_idx, full_cnt = left_pack(ids, full, width)
    mask_idx, mask_cnt = left_pack(ids, mask, width)
    full_q_idx, full_q_cnt = transposed(full_idx, full_cnt, n)
    mask_q_idx, mask_q_cnt = transposed(mask_idx, mask_cnt, n)
    return Fa4Lists(full_cnt, full_idx, mask_cnt, mask_idx, full_q_cnt, full_q_idx, mask_q_cnt, mask_q_idx, bs)


def _no_blocks(index: SparseIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """Block lists that list nothing (the `blocks=` of the column-only Triton calls; None would mean dense)."""
    B, H, n, _ = index.block_ids.shape
    dev = index.block_ids.device
    return (torch.full((B, H, n, 1), -1, dtype=torch.int32, device=dev),
            torch.zeros(B, H, n, dtype=torch.int32, device=dev))


@dataclasses.dataclass
class _Plan:
    """What the engine derives once per index (kept in index._cache["fa4"] when there are no documents)."""

    lists: Fa4Lists
    has_cols: bool
    no_blocks: tuple[torch.Tensor, torch.Tensor]
    col_plans: dict  # the Triton column path's derived data for (no blocks, the index's columns)


def _plan(index: SparseIndex, doc_ids, num_kv_heads: int, head_dim: int) -> _Plan:
    if doc_ids is None and "fa4" in index._cache:
        return index._cache["fa4"]
    if not index._cache.get("diagonal_listed"):  # from_lines (and so the estimate) guarantees it; else a host read
        ids, counts = index.block_ids.long(), index.block_counts.long()
        last = torch.gather(ids, -1, (counts - 1).clamp(min=0)[..., None])[..., 0]
        if bool(((counts < 1) | (last != torch.arange(index.n_blocks, device=ids.device))).any()):
            raise ValueError(
                "impl='fa4' needs every query block's list to end with its diagonal block (SparseIndex.from_lines and "
                "estimate_vertical_slash always list it): a row without keys would reach FA4's backward with lse=-inf")
    # Whether to run the column path. A CUDA index with more than one column slot per row (the estimate's: its lists
    # are as wide as its vertical cap) runs it without reading the counts, as a CUDA graph capturing the plan must
    # (graphed.prepare_engine): the column kernels skip rows without columns (lse -inf, the merge keeps FA4's), and
    # the host does not wait for the estimate here. A narrower index (no verticals: one slot of padding) is read.
    width = index.col_ids.shape[-1]
    unread = index.col_ids.is_cuda and (width > 1 or torch.cuda.is_current_stream_capturing())
    has_cols = width > 0 and (unread or bool(index.col_counts.any()))
    plan = _Plan(fa4_block_lists(index, doc_ids), has_cols, _no_blocks(index), {})
    if doc_ids is None:
        if plan.has_cols and index.block_ids.is_cuda:
            from mtrain.ops import _triton_attention

            # The column-only backward's transposed lists (empty), column plan (the index's own, when its builder
            # made one) and work items, built once per index.
            col_index = SparseIndex(*plan.no_blocks, index.col_ids, index.col_counts, index.seq_len,
                                    index.block_size)
            counts = plan.no_blocks[1]
            col_index._cache["t"] = (counts.new_zeros(0), counts.new_zeros(counts.shape, dtype=torch.int64), counts)
            col_index._cache[_triton_attention.NO_BLOCKS] = True
            chunk = ("c", kernel_column_chunk(index.block_size))
            if chunk in index._cache:
                col_index._cache[chunk] = index._cache[chunk]
            _triton_attention.prepare_backward(col_index, num_kv_heads, head_dim)
            plan.col_plans = col_index._cache
        index._cache["fa4"] = plan
    return plan


def prepare_fa4(index: SparseIndex, num_kv_heads: int, head_dim: int) -> None:
    """Build, and cache in `index._cache`, all the engine derives from an index without documents (FA4's lists,
    the column path's backward plans), so that it can be timed with the index."""
    _plan(index, None, num_kv_heads, head_dim)


def mask_mods():
    """(causal, causal_same_document) as CuTe DSL mask_mods, built once (FA4 keys its compile cache on them).
    The document one reads aux_tensors[0], the doc ids [B, padded S] int32."""
    if "causal" not in _JIT:
        import cutlass
        import cutlass.cute as cute
        from flash_attn.cute.utils import scalar_to_ssa

        @cute.jit
        def causal(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            return kv_idx <= q_idx

        @cute.jit
        def causal_same_document(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            docs = aux_tensors[0]
            q_doc = scalar_to_ssa(docs[batch[0], q_idx[0]], cutlass.Int32)
            kv_doc = scalar_to_ssa(docs[batch[0], kv_idx[0]], cutlass.Int32)
            return (kv_idx <= q_idx) & (q_doc == kv_doc)

        _JIT.update(causal=causal, docs=causal_same_document)
    return _JIT["causal"], _JIT["docs"]


def sparse_tensors(cnt, idx, fcnt, fidx, bs):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    return BlockSparseTensorsTorch(mask_block_cnt=cnt, mask_block_idx=idx, full_block_cnt=fcnt, full_block_idx=fidx,
                                   block_size=(bs, bs))


def _doc_aux(doc_ids, bs: int, n: int):
    """aux_tensors of the document mask_mod: doc ids [B, n * bs] int32, padded so that no tile reads past them."""
    if doc_ids is None:
        return None
    doc = doc_ids.to(torch.int32)
    return [torch.nn.functional.pad(doc, (0, n * bs - doc.shape[1]), value=-1).contiguous()]


class _Fa4Attention(torch.autograd.Function):
    """Forward: FA4 block-sparse (blocks) + Triton (columns), merged by LSE. Backward from the merged out / lse:
    deterministic=False: FA4's block-sparse backward + the Triton column backward, summed; deterministic=True:
    our deterministic Triton backward over blocks and columns at once (FA4 4.0.0b36 has no deterministic
    block-sparse backward on SM90). Index-derived tensors go through save_for_backward (see
    `mtrain.ops.partial_autograd`)."""

    @staticmethod
    def forward(ctx, q, k, v, index, scale, doc_ids, deterministic):
        fa4 = load_fa4()
        B, S, Hq, D = q.shape
        n, bs = index.n_blocks, index.block_size
        plan = _plan(index, doc_ids, k.shape[2], D)
        lists = plan.lists
        causal_mod, doc_mod = mask_mods()
        mask_mod = causal_mod if doc_ids is None else doc_mod
        aux = _doc_aux(doc_ids, bs, n)
        fwd_sparse = sparse_tensors(lists.mask_cnt, lists.mask_idx, lists.full_cnt, lists.full_idx, bs)
        out, lse = fa4._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=False, mask_mod=mask_mod,
                                       aux_tensors=aux, block_sparse_tensors=fwd_sparse, return_lse=True)[:2]
        pos = torch.arange(S, device=q.device)
        col_plans = plan.col_plans if doc_ids is None else {}
        col_kw = dict(q_pos=pos, k_pos=pos, blocks=plan.no_blocks, columns=index.kernel_columns, block_size=bs,
                      softmax_scale=scale, causal=True, impl="triton", q_doc=doc_ids, k_doc=doc_ids)
        if plan.has_cols:  # the columns merged by LSE into FA4's out / lse in the column kernel's epilogue
            out, lse = partial.attention_forward(q, k, v, plans=col_plans, merge_into=(out.contiguous(),
                                                                                       lse.float().contiguous()),
                                                 **col_kw)
        triton_plans = None
        if deterministic:
            triton_plans = {key: val for key, val in index._cache.items() if key not in _OWN_KEYS}
            if doc_ids is not None:
                triton_plans = {}
        tensors = []
        ctx.layout = split_tensors((lists, aux, col_kw, col_plans, index.blocks, triton_plans), tensors)
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.args = (scale, deterministic, plan.has_cols, bs)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        lists, aux, col_kw, col_plans, blocks, triton_plans = join_tensors(ctx.layout, tensors)
        scale, deterministic, has_cols, bs = ctx.args
        dout = dout.contiguous()
        if deterministic:
            kw = dict(col_kw, blocks=blocks)
            dq, dk, dv = partial.attention_backward(dout, q, k, v, out, lse, deterministic=True, plans=triton_plans,
                                                    **kw)
        else:
            fa4 = load_fa4()
            causal_mod, doc_mod = mask_mods()
            bwd_sparse = sparse_tensors(lists.mask_q_cnt, lists.mask_q_idx, lists.full_q_cnt,
                                        lists.full_q_idx, bs)
            dq, dk, dv = fa4._flash_attn_bwd(q, k, v, out, dout, lse, scale, False,
                                             mask_mod=causal_mod if aux is None else doc_mod, aux_tensors=aux,
                                             block_sparse_tensors=bwd_sparse, deterministic=False)[:3]
            if has_cols:  # the columns' deterministic backward (its atomic one zero-fills and adds a whole fp32 dQ),
                # FA4's gradients added inside it: dQ in its dQ pass (stored in q's dtype), dK / dV before the columns'
                dq, dk, dv = partial.attention_backward(dout, q, k, v, out, lse, deterministic=True, plans=col_plans,
                                                        grad_init=(dq, dk, dv), **col_kw)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def fa4_vertical_slash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    softmax_scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical-slash attention on exactly the pairs of `index` (and documents), blocks through FlashAttention-4.

    q [B, S, Hq, D], k/v [B, S, Hkv, D] (GQA), CUDA, fp16/bf16, `index.block_size` == 128 (ValueError
    otherwise, naming the fix). The listed key blocks below the diagonal run as FA4 full blocks, the diagonal
    block as a mask block with a causal mask_mod; the vertical columns run in our Triton column path
    (`partial.attention_forward` with no blocks); the two are merged by LSE in fp32. Documents are supported:
    doc_ids [B, S] reach FA4's mask_mod as an aux tensor (same-document test in mask blocks; blocks inside one
    document stay full) and the column path filters by document as usual.
    Backward from the merged out and lse (exact: each disjoint pair set's softmax backward uses the global
    O / LSE): deterministic=False runs FA4's block-sparse backward (fp32 atomics for dQ) plus our column
    backward and sums dq/dk/dv; deterministic=True (default) runs our deterministic Triton backward over blocks
    and columns, since FA4 4.0.0b36 has no deterministic block-sparse backward on SM90. Its times against ours
    and cuDNN: BENCHMARKS.md, "Must-show status (issue #13)".
    Returns (out [B, S, Hq, D] in q.dtype, differentiable; lse [B, Hq, S] fp32, no gradient).
    ImportError (naming the install) when flash_attn.cute is missing.
    """
    check_fa4_inputs(q, index)
    load_fa4()
    if doc_ids is not None:
        doc_ids = doc_ids.to(q.device)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _Fa4Attention.apply(q, k, v, index, scale, doc_ids, deterministic)
