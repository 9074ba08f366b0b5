"""Under non-reentrant activation checkpointing, a sparse ring layer must not hold its index-derived ring plan
(the per-step block lists, the off-ring columns' lists and what the kernels derive from them) from its forward to
its backward: a model holds one layer's at a time. The one-device sparse Function does this (its lists go through
save_for_backward, mtrain/ops/partial_autograd.py); the ring Functions (mtrain/parallel/ring_flat.py,
ring_hierarchical.py, ring_gather.py) keep `ctx.plan` as a ctx attribute, which the autograd graph holds until the
backward: at 256K tokens per GPU on the Qwen2.5-3B shape with 4,096-line caps that is ~2-3 GiB per layer (the
columns' [B, Hq, 4096 blocks, ~4160] int32 lists, twice, and the kernels' filtered copy), ~70-110 GiB over 36 layers
(issue #28's out-of-memory in the 1M forward; mtrain/planner.py, "ring plans held (ctx)")."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mtrain.attention_settings import PolicySettings
from mtrain.models.runtime import AttentionRuntime, AttentionSettings
from mtrain.ops.index import SparseIndex
from mtrain.parallel import Layout, ring_attention

S, BS = 256, 16


def _plan_tensors(index) -> list:
    plans = [v for k, v in index._cache.items() if isinstance(k, tuple) and k and k[0] == "ring_plan"]
    assert len(plans) == 1
    plan = plans[0]
    found = [step.ids for step in plan.steps.values() if step is not None]
    if plan.columns is not None:
        found.append(plan.columns.ids)
    return found


@pytest.mark.parametrize("documents", [False, True])
def test_checkpointed_ring_layer_frees_its_plan_between_forward_and_backward(single_process_group, documents):
    torch.manual_seed(0)
    q = torch.randn(1, S, 4, 16)
    k, v = torch.randn(1, S, 2, 16), torch.randn(1, S, 2, 16)
    vertical = torch.tensor([[[3, 40, 100]] * 4])
    slash = torch.tensor([[[0, 17, 64]] * 4])
    layout = Layout.create("block-stripe", world_size=1, granularity=BS)
    docs = (torch.arange(S) >= 97).long()[None] if documents else None
    results = []
    for checkpointed in (False, True):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        held = []

        def layer(a, b, c):
            index = SparseIndex.from_lines(vertical, slash, S, BS)
            out = ring_attention(a, b, c, group=None, layout=layout, index=index, doc_ids=docs)
            held.extend(weakref.ref(t) for t in _plan_tensors(index))
            return out

        if checkpointed:
            out = checkpoint(layer, qq, kk, vv, use_reentrant=False, context_fn=AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse())).checkpoint_contexts)
        else:
            out = layer(qq, kk, vv)
        gc.collect()
        assert held, "no plan tensors found"
        alive = [r() is not None for r in held]
        # checkpointed: dropped after the forward (rebuilt for the backward); not: the graph keeps them
        assert not any(alive) if checkpointed else all(alive), alive
        out.square().sum().backward()
        results.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=0, atol=0)
