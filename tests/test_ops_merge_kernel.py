"""The fused LSE merge kernel (`mtrain.ops._triton_merge.merge`, what the ring merges its steps with on the GPU)
against the torch merge, in Triton's interpreter (run by tests/test_ops_interpreter.py in a fresh process)."""

import pytest
import torch

from test_ops_interpreter import needs_interpreter

pytestmark = needs_interpreter


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_fused_merge_equals_the_torch_merge(out_dtype):
    from mtrain.ops._triton_merge import merge
    from mtrain.ops.partial import merge_partial

    g = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 100, 3, 16
    out_a, out_b = (torch.randn(b, s, h, d, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(b, h, s, generator=g) * 3 for _ in range(2))
    lse_a[0, 0, :5] = float("-inf")  # rows one side never saw
    lse_b[0, 0, 3:8] = float("-inf")  # rows 3, 4: neither side
    want_out, want_lse = merge_partial(out_a, lse_a, out_b, lse_b)
    out = torch.empty(b, s, h, d, dtype=out_dtype)
    lse = torch.empty(b, h, s)
    merge(out_a.to(out_dtype), lse_a, out_b.to(out_dtype), lse_b, out, lse)
    tol = 1e-5 if out_dtype == torch.float32 else 5e-3
    assert torch.isneginf(lse[0, 0, 3:5]).all() and (out[0, 3:5, 0] == 0).all()  # rows neither side saw
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    assert (lse[fin] - want_lse[fin]).abs().max() < 1e-5
    assert (out.float() - want_out.nan_to_num()).abs().max() < tol


@pytest.mark.parametrize("world", [2, 4, 8])
def test_sum_of_rank_parts_in_one_pass_equals_the_sum_in_rank_order(world):
    """`sum_parts` (the owners' dK/dV sum of the gathered schedule on the GPU): into fp32, bit for bit the torch
    path's widening copy of rank 0's part and adds in rank order (the same fp32 additions in the same order); into
    the parts' dtype, that sum rounded once (within one unit in the last place: the interpreter rounds toward zero
    where the GPU rounds to nearest, which the GPU gate's "sum-parts" case checks bit for bit); and an fp64 sum."""
    from mtrain.ops._triton_merge import sum_parts
    from mtrain.parallel.merge import RankParts

    g = torch.Generator().manual_seed(world)
    shape = (1, 300, 2, 16)
    for dtype in (torch.bfloat16, torch.float16):
        parts = [(torch.randn(shape, generator=g) * 10 ** (o % 3)).to(dtype) for o in range(world)]
        want = parts[0].float()
        for p in parts[1:]:
            want = want + p.float()
        ulp = 2.0 ** (torch.frexp(want).exponent.float() - (8 if dtype == torch.bfloat16 else 11))
        for rank in sorted({0, world // 2, world - 1}):
            held = RankParts.receiving(parts[rank].clone(), world, rank)
            for o in range(world):
                if o != rank:
                    held.part(o).copy_(parts[o])
            wide = torch.empty(shape)
            sum_parts(held.own, held.inbox, rank, wide)
            assert torch.equal(wide, want)
            out = torch.empty(shape, dtype=dtype)
            sum_parts(held.own, held.inbox, rank, out)
            assert bool(((out.float() - want).abs() <= ulp).all())
            assert torch.equal(held.sum(dtype), want.to(dtype))  # the torch path (CPU)
            exact = sum(p.double() for p in parts)
            assert (wide.double() - exact).abs().max() <= exact.abs().max() * 2 ** -20
    with pytest.raises(ValueError, match="sum_parts"):
        sum_parts(parts[0], torch.empty(world - 1, 299, 2, 16, dtype=dtype), 0, torch.empty(shape, dtype=dtype))
