"""The reference for one rank of a context-parallel group run alone (`mtrain.bench.emulate.emulated_group`): every
other rank's keys and values arrive as zeros there, and its dK/dV share never comes back, so the rank computes the
attention of the whole sequence with those keys and values zero, and dK/dV of its own keys from its own rows."""

from __future__ import annotations

import torch

from mtrain.ops import reference


def zero_peer_reference(q, k, v, dout, mask, scale: float, mine: torch.Tensor):
    """(out, dq, dk, dv) in float64 of the rank's positions `mine` (its rows of out and dq, its keys of dk / dv),
    from the whole sequence with keys and values elsewhere zero and dout elsewhere zero (which changes only dK/dV:
    a row's out and dq are its own)."""
    held = torch.zeros(q.shape[1], dtype=torch.bool)
    held[mine] = True
    keep = held[None, :, None, None]
    full = [q.double().clone().requires_grad_(True)] + [torch.where(keep, t.double(), 0.0).requires_grad_(True)
                                                        for t in (k, v)]
    out, _ = reference.attention(*full, mask, scale)
    out.backward(torch.where(keep, dout.double(), 0.0))
    return out.detach()[:, mine], *(t.grad[:, mine] for t in full)
