"""Ulysses context parallelism (dense): an all-to-all turns each rank's S/P tokens of all heads into all S
tokens of H/P heads, dense causal attention runs locally, and a second all-to-all returns the output."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError


def head_split_problem(q_heads: int, kv_heads: int, cp_size: int) -> str | None:
    """None when Ulysses can split the heads over `cp_size` ranks, else the one-line reason and fix.

    Rule: query heads divide evenly (Hq % P == 0), and key/value heads either divide evenly (Hkv % P == 0) or
    are replicated, each to P / Hkv ranks (P % Hkv == 0), so every rank holds the KV heads its query heads read.
    """
    if cp_size <= 1 or (q_heads % cp_size == 0 and (kv_heads % cp_size == 0 or cp_size % kv_heads == 0)):
        return None
    fits = [p for p in range(2, q_heads + 1) if q_heads % p == 0 and (kv_heads % p == 0 or p % kv_heads == 0)]
    return (f"attention.kind ulysses cannot split {q_heads} query heads and {kv_heads} key/value heads over "
            f"parallel.cp_size={cp_size} (needs num_attention_heads % cp_size == 0 and num_key_value_heads % cp_size "
            f"== 0 or cp_size % num_key_value_heads == 0); set parallel.cp_size to one of "
            f"{', '.join(map(str, fits)) or '1'}, or use a ring kind (zigzag-dense)")


def check_heads(q_heads: int, kv_heads: int, cp_size: int) -> None:
    problem = head_split_problem(q_heads, kv_heads, cp_size)
    if problem is not None:
        raise MtrainError(problem)


def _kv_heads_per_rank(kv_heads: int, world: int) -> torch.Tensor:
    """When P % Hkv == 0: the one KV head each rank p's query heads read, for every p in order (LongTensor [P];
    each KV head goes to P / Hkv consecutive ranks)."""
    return torch.arange(world) // (world // kv_heads)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [P, ...]: part p goes to rank p; returns [P, ...] with part r received from rank r."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S_local, P * h, D] (this rank's tokens, all heads) -> [B, P * S_local, h, D] (every rank's tokens in
    rank order, this rank's h heads)."""
    world = dist.get_world_size(group)
    b, s, heads, d = x.shape
    parts = x.view(b, s, world, heads // world, d).permute(2, 0, 1, 3, 4)
    return _all_to_all(parts, group).permute(1, 0, 2, 3, 4).reshape(b, world * s, heads // world, d)


def _heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: [B, P * S_local, h, D] -> [B, S_local, P * h, D]."""
    world = dist.get_world_size(group)
    b, n, h, d = y.shape
    parts = y.view(b, world, n // world, h, d).permute(1, 0, 2, 3, 4)
    return _all_to_all(parts, group).permute(1, 2, 0, 3, 4).reshape(b, n // world, world * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def ulysses_attention(q, k, v, *, group=None, layout, softmax_scale: float | None = None,
                      doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Dense causal attention over a sequence sharded across a CP group, by head-parallel all-to-alls; differentiable.

    q: [B, S_local, Hq, D], k, v: [B, S_local, Hkv, D]: this rank's shard under `layout` (any layout; positions
    `layout.indices(S, rank)`). Heads: Hq % P == 0, and Hkv % P == 0 or P % Hkv == 0 (KV heads are then
    replicated to the P / Hkv ranks whose query heads read them; their gradients are summed back), checked here
    with a one-line error (`head_split_problem`). doc_ids [B, S]: global document ids (the same on every rank).
    Each rank holds all S tokens of Hq / P heads during attention: activation memory per rank is that of one
    device over H / P heads. Returns out [B, S_local, Hq, D].
    """
    from mtrain.ops import dense_attention

    world = dist.get_world_size(group)
    hq, hkv = q.shape[2], k.shape[2]
    check_heads(hq, hkv, world)
    if layout.world_size != world:
        raise MtrainError(f"layout is for {layout.world_size} ranks but the CP group has {world}")
    seq_len = q.shape[1] * world
    layout.check(seq_len)
    if world == 1:
        return dense_attention(q, k, v, causal=True, softmax_scale=softmax_scale, doc_ids=doc_ids)
    if hkv % world:  # replicate each KV head to the ranks whose query heads read it
        kv_heads = _kv_heads_per_rank(hkv, world).to(q.device)
        k, v = k.index_select(2, kv_heads), v.index_select(2, kv_heads)
    # positions of the gathered sequence: every rank's shard in rank order
    order = torch.cat([layout.indices(seq_len, r) for r in range(world)]).to(q.device)
    to_global = torch.argsort(order)
    qh, kh, vh = (_SeqToHeads.apply(t, group).index_select(1, to_global) for t in (q, k, v))
    out = dense_attention(qh, kh, vh, causal=True, softmax_scale=softmax_scale,
                          doc_ids=None if doc_ids is None else doc_ids.to(q.device))
    return _HeadsToSeq.apply(out.index_select(1, order), group)
