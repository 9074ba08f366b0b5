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
