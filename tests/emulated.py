"""The reference for one rank of a context-parallel group run alone (`mtrain.bench.emulate.emulated_group`): every
other rank's keys and values arrive as zeros there, and its dK/dV share never comes back, so the rank computes the
attention of the whole sequence with those keys and values zero, and dK/dV of its own keys from its own rows. Also
the small case the emulated-rank tests share (`sample_case`)."""

from __future__ import annotations

import torch

from mtrain.ops import SparseIndex, reference

SEQ, BLOCK, HQ, HKV, DIM = 512, 16, 2, 1, 16


def sample_index() -> SparseIndex:
    """A fixed vertical-slash index over SEQ tokens in BLOCK-token blocks, HQ heads."""
    vertical = torch.tensor([[[3, 40, 41, 130, 200, 333, 334, 470], [17, 100, 260, 261, 262, 400, 401, 505]]])
    slash = torch.tensor([[[0, 1, 35, 96, 250], [0, 16, 50, 64, 300]]])
    return SparseIndex.from_lines(vertical, slash, SEQ, BLOCK)


def sample_case(seed: int):
    """(q, dout [1, SEQ, HQ, DIM], k, v [1, SEQ, HKV, DIM] float64, `sample_index()`)."""
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, SEQ, HQ, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, SEQ, HKV, DIM, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout, sample_index()


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
