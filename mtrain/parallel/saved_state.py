"""What a ring Function's backward reads besides q, k, v, out and lse (its plan: the per-step block lists, the
off-ring columns' lists, what the kernels derived from them; and `aux`, the fused dense kernels' per-call state)
goes through save_for_backward, never through ctx attributes: under non-reentrant activation checkpointing the
saved tensors of a layer are dropped after its forward and recomputed for its backward, so a model holds one
layer's plan at a time. As ctx attributes the autograd graph kept every layer's until its backward (issue #28: at
256K tokens per GPU on the Qwen2.5-3B shape with 4,096-line caps, ~2-3 GiB per layer, ~70-110 GiB over 36 layers,
the 1M forward's out-of-memory). The one-device sparse Function does the same (`mtrain.ops.partial_autograd`)."""

from __future__ import annotations

import weakref

from mtrain.ops.partial_autograd import join_tensors, split_tensors


def per_call(plan) -> bool:
    """Whether `plan` was built for this call (a sparse plan, cached with its index; a plan with documents, a copy
    with its own kernel caches), rather than shared by every call (the cached dense plan: its tensors live in the
    cache anyway, and its kernel caches grow in the backward, which would change what a recomputation saves)."""
    return plan.doc_ids is not None or any(step is not None for step in plan.steps.values())


def save_state(ctx, saved: list, *state) -> None:
    """ctx.save_for_backward(*saved, *the tensors of `state`); the per-call plans of `state` and everything else
    in it (dicts, tuples, dataclasses) are kept as slots (`split_tensors`). A shared plan stays as it is. A per-call
    plan is also remembered by a weak reference: while something else keeps it alive (its index, cached with it, in
    a caller that reuses the index), the backward uses it itself, so what the kernels derive in the backward stays
    in its caches for the next call, as before; under checkpointing nothing keeps it and the backward rebuilds it."""
    tensors: list = []
    kept = tuple(obj if _shared_plan(obj) else split_tensors(obj, tensors) for obj in state)
    ctx.state_layout, ctx.n_saved = kept, len(saved)
    ctx.state_refs = tuple(weakref.ref(obj) if _per_call_plan(obj) else None for obj in state)
    ctx.save_for_backward(*saved, *tensors)


def load_state(ctx) -> tuple[tuple, tuple]:
    """(the tensors given to `save_state` as `saved`, the state: a per-call plan still alive itself, else rebuilt
    from the saved tensors)."""
    tensors = ctx.saved_tensors
    saved, rest = tensors[: ctx.n_saved], tensors[ctx.n_saved :]
    live = tuple(None if ref is None else ref() for ref in ctx.state_refs)
    return saved, tuple(obj if obj is not None else join_tensors(layout, rest)
                        for obj, layout in zip(live, ctx.state_layout))


def _is_plan(obj) -> bool:
    return hasattr(obj, "steps") and hasattr(obj, "kernel_caches")


def _shared_plan(obj) -> bool:
    return _is_plan(obj) and not per_call(obj)


def _per_call_plan(obj) -> bool:
    return _is_plan(obj) and per_call(obj)
