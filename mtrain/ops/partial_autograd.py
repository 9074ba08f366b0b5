"""The partial-attention autograd function: `partial_attention`, a differentiable `partial.attention_forward`
(backward through `partial.attention_backward`), and the packing helpers that hand an index's tensors to a
backward through save_for_backward (`split_tensors` / `join_tensors`, `NOT_PLANS`). The one-device dispatcher
(`mtrain.ops.attention`), the dense path (`mtrain.ops.dense`) and the fa4 engine (`mtrain.ops.fa4`) import it."""

from __future__ import annotations

import dataclasses
import math

import torch

from mtrain.ops import partial


# Entries of an index's cache that are not derived lists (the estimator's own recall figure, the lines it was built
# from, the list-free columns, which reach the backward as its `columns`, the quality check's output error and what it
# overruled): they stay with the caller and are not handed to the backward (a gradient-checkpointed layer rebuilds its
# index from the lines, without them, and must save the same tensors).
NOT_PLANS = ("est_recall", "lines", "diagonal_listed", "vcols", "output_error", "overruled")


def split_tensors(obj, tensors: list):
    """`obj` (nested dicts, tuples, lists and dataclasses) with every tensor moved to `tensors` and replaced by its
    slot there (an `_Slot`); `join_tensors` puts them back."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {key: split_tensors(val, tensors) for key, val in obj.items()}
    if isinstance(obj, (tuple, list)):
        return _rebuild(obj, [split_tensors(val, tensors) for val in obj])
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: split_tensors(getattr(obj, f.name), tensors)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def join_tensors(obj, tensors):
    if isinstance(obj, _Slot):
        return tensors[obj.at]
    if isinstance(obj, dict):
        return {key: join_tensors(val, tensors) for key, val in obj.items()}
    if isinstance(obj, (tuple, list)):
        return _rebuild(obj, [join_tensors(val, tensors) for val in obj])
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: join_tensors(getattr(obj, f.name), tensors)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _rebuild(obj, items: list):
    """A tuple or list of obj's type holding `items`: a named tuple (FA4's BlockSparseTensorsTorch, say) takes its
    fields as arguments, the others an iterable."""
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return type(obj)(*items)
    return type(obj)(items)


@dataclasses.dataclass(frozen=True)
class _Slot:
    at: int


class _PartialAttention(torch.autograd.Function):
    """out, lse = partial attention; backward through `partial.attention_backward` (lse not differentiable).

    Every tensor the backward reads (the lists and what the kernels derived from them in `plans`) goes through
    save_for_backward, none through ctx attributes: under non-reentrant gradient checkpointing the saved tensors
    of a layer are dropped after its forward and recomputed for its backward, so a model holds one layer's index
    at a time (ctx attributes would keep every layer's lists until the backward: on SmolLM2 at 32K that was
    ~18 GB). The backward's own plans go into a fresh dict, dropped with it."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, impl, deterministic, plans,
                q_doc, k_doc):
        out, lse = partial.attention_forward(
            q, k, v, q_pos=q_pos, k_pos=k_pos, blocks=blocks, columns=columns, block_size=block_size,
            softmax_scale=scale, causal=causal, impl=impl, plans=plans, q_doc=q_doc, k_doc=k_doc,
        )
        kept = None if plans is None else {key: val for key, val in plans.items() if key not in NOT_PLANS}
        tensors = []
        ctx.layout = split_tensors((q_pos, k_pos, blocks, columns, kept, q_doc, k_doc), tensors)
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.args = (block_size, scale, causal, impl, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        q_pos, k_pos, blocks, columns, plans, q_doc, k_doc = join_tensors(ctx.layout, tensors)
        block_size, scale, causal, impl, deterministic = ctx.args
        dq, dk, dv = partial.attention_backward(
            dout, q, k, v, out, lse, q_pos=q_pos, k_pos=k_pos, blocks=blocks, columns=columns,
            block_size=block_size, softmax_scale=scale, causal=causal, impl=impl,
            deterministic=deterministic, plans=plans, q_doc=q_doc, k_doc=k_doc,
        )
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 12


def partial_attention(q, k, v, *, q_pos, k_pos, blocks=None, columns=None, block_size=64, softmax_scale=None,
                      causal=True, impl="auto", deterministic=True, plans=None, q_doc=None, k_doc=None):
    """Differentiable `partial.attention_forward` (same arguments, document ids q_doc [B, Sq] / k_doc
    [B, Sk] included); returns (out, lse), lse without grad."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _PartialAttention.apply(q, k, v, q_pos, k_pos, blocks, columns, block_size, scale, causal, impl,
                                   deterministic, plans, q_doc, k_doc)
