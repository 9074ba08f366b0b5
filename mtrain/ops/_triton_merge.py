"""The LSE merge of two partial attention results in one Triton pass: read the running out / lse and the new part,
write the merged out (in fp32 while more parts follow, in the output dtype for the last) and lse. The torch merge
(`mtrain.ops.partial.lse_weights` + a multiply and an add) makes three passes over [B, S, H, D] in fp32; at 128K
tokens x 16 heads x 128 that is ~1 GiB a pass, per ring step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(A, LA, P, LP, O, LO, S, H, D, sab, sas, sah, spb, sps, sph, sob, sos, soh,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per (row tile, batch x head): weights from the two lse (the larger as the reference, so nothing overflows;
    rows where both are -inf get weight 0 and lse -inf), then out = a * wa + p * wb in fp32, stored in O's dtype."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    s = t * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = s < S
    d = tl.arange(0, BLOCK_D)
    ok = s_ok[:, None] & (d < D)[None, :]
    la = tl.load(LA + bh.to(tl.int64) * S + s, mask=s_ok, other=float("-inf"))
    lp = tl.load(LP + bh.to(tl.int64) * S + s, mask=s_ok, other=float("-inf"))
    a = tl.load(A + b * sab + s[:, None].to(tl.int64) * sas + h * sah + d[None, :], mask=ok, other=0.0)
    p = tl.load(P + b * spb + s[:, None].to(tl.int64) * sps + h * sph + d[None, :], mask=ok, other=0.0)
    # Every load before any store: the merge runs in place (LO is LA, O may be A), and a row's lse is held by
    # several warps at once (a [BLOCK_S] vector over the program's threads), so without this barrier a warp that
    # stores the merged lse early can be read back by another warp as its `la` (on the GPU; the interpreter runs
    # a program's threads as one, which is why only the GPU showed it).
    tl.debug_barrier()
    m = tl.maximum(la, lp)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wp = tl.exp(lp - m_safe)
    total = wa + wp
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    lse = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(LO + bh.to(tl.int64) * S + s, lse, mask=s_ok)
    out = a.to(tl.float32) * (wa * inv)[:, None] + p.to(tl.float32) * (wp * inv)[:, None]
    tl.store(O + b * sob + s[:, None].to(tl.int64) * sos + h * soh + d[None, :], out.to(O.dtype.element_ty), mask=ok)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
          out: torch.Tensor, lse: torch.Tensor) -> None:
    """out, lse <- the merge of (out_a, lse_a) and (out_b, lse_b): outs [B, S, H, D] (last dim contiguous, any float
    dtype; `out` may be out_a itself), lses [B, H, S] fp32 contiguous (`lse` may be lse_a)."""
    B, S, H, D = out_a.shape
    for t in (out_a, out_b, out):
        if t.shape != out_a.shape or t.stride(-1) != 1:
            raise ValueError(f"merge: outs must be {tuple(out_a.shape)} with a contiguous last dim; got "
                             f"{tuple(t.shape)} stride {t.stride()}")
    for t in (lse_a, lse_b, lse):
        if t.shape != (B, H, S) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"merge: lses must be contiguous float32 {(B, H, S)}; got {t.dtype} {tuple(t.shape)}")
    block_s = 64
    _merge_kernel[(triton.cdiv(S, block_s), B * H)](
        out_a, lse_a, out_b, lse_b, out, lse, S, H, D,
        out_a.stride(0), out_a.stride(1), out_a.stride(2), out_b.stride(0), out_b.stride(1), out_b.stride(2),
        out.stride(0), out.stride(1), out.stride(2), BLOCK_S=block_s, BLOCK_D=max(16, triton.next_power_of_2(D)),
        num_warps=4)


@triton.jit
def _sum_parts_kernel(OWN, INBOX, OUT, N, own_at, W: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[i] = sum over o = 0..W-1 of part o's element i, in fp32 in that order and rounded once to OUT's dtype;
    part own_at is OWN, the others are INBOX's W - 1 rows in order around it."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for o in tl.static_range(W):
        if o == own_at:
            x = tl.load(OWN + offs, mask=ok, other=0.0)
        else:
            row = tl.where(o > own_at, o - 1, o).to(tl.int64)
            x = tl.load(INBOX + row * N + offs, mask=ok, other=0.0)
        acc += x.to(tl.float32)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)


def sum_parts(own: torch.Tensor, inbox: torch.Tensor, own_at: int, out: torch.Tensor) -> None:
    """out <- the sum of W parts in fp32, in part order, rounded once to out's dtype: part `own_at` is `own`, the
    others are inbox[0..W-2] in order around it (inbox [W - 1, *own.shape]); every tensor contiguous. One pass: reads
    each part once and writes the sum, where a widening copy and W - 1 fp32 adds make W + 1 passes over fp32."""
    world = inbox.shape[0] + 1
    if not (own.is_contiguous() and inbox.is_contiguous() and out.is_contiguous()) or inbox.shape[1:] != own.shape \
            or out.shape != own.shape or not 0 <= own_at < world:
        raise ValueError(f"sum_parts: own {tuple(own.shape)}, inbox {tuple(inbox.shape)} and out {tuple(out.shape)} "
                         f"must be contiguous, inbox one part per other rank, own_at in [0, {world}); got {own_at}")
    n = own.numel()
    block = 1024
    _sum_parts_kernel[(triton.cdiv(n, block),)](own, inbox, out, n, own_at, W=world, BLOCK=block, num_warps=4)
