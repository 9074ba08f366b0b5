"""vertical_slash_attention (Triton kernels in the interpreter, and the torch path) against a float64
reference with a materialized mask: out, lse and dq/dk/dv, GQA 1/2/8, ragged lengths, empty sets."""

import pytest
import torch

from mtrain.ops import SparseIndex, dense_attention, reference, vertical_slash_attention
from mtrain.ops.index import blocks_for_causal_dense
from test_ops_interpreter import needs_interpreter


def make_inputs(B, S, Hq, Hkv, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, Hq, D, generator=gen).to(dtype)
    k = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    dout = torch.randn(B, S, Hq, D, generator=gen).to(dtype)
    return q, k, v, dout, gen


def random_lines(B, H, S, nv, ns, gen):
    vertical = torch.randint(-1, S, (B, H, nv), generator=gen)
    slash = torch.randint(-1, S, (B, H, ns), generator=gen)
    return vertical, slash


def run_kernel(q, k, v, dout, index, impl, deterministic=True):
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = vertical_slash_attention(qg, kg, vg, index, return_lse=True, impl=impl, deterministic=deterministic)
    out.backward(dout)
    return out.detach(), lse, qg.grad, kg.grad, vg.grad


def run_reference(q, k, v, dout, mask):
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, lse = reference.attention(qr, kr, vr, mask)
    out.backward(dout.double())
    return out.detach(), lse, qr.grad, kr.grad, vr.grad


def assert_close(got, want, atol_out, atol_grad):
    out, lse, dq, dk, dv = got
    r_out, r_lse, r_dq, r_dk, r_dv = want
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), r_out, atol=atol_out, rtol=0), (out.double() - r_out).abs().max()
    assert torch.allclose(lse.double(), r_lse, atol=atol_out, rtol=0)
    for name, g, r in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        err = (g.double() - r).abs().max()
        assert torch.allclose(g.double(), r, atol=atol_grad, rtol=0), f"{name} max error {err}"


@needs_interpreter
@pytest.mark.parametrize(
    "Hq,Hkv,S,bs",
    [(2, 2, 64, 16), (4, 2, 72, 16), (8, 1, 80, 32)],  # GQA 1, 2, 8; 72 and 80 are ragged
)
def test_triton_fp32_matches_float64_reference(Hq, Hkv, S, bs):
    q, k, v, dout, gen = make_inputs(1, S, Hq, Hkv, 16, torch.float32, seed=S + Hq)
    vertical, slash = random_lines(1, Hq, S, 5, 3, gen)
    index = SparseIndex.from_lines(vertical, slash, S, bs)
    assert index.col_counts.sum() > 0 and index.density() < 1.0  # both kernel paths are exercised
    got = run_kernel(q, k, v, dout, index, "triton")
    want = run_reference(q, k, v, dout, index.to_mask())
    assert_close(got, want, atol_out=1e-5, atol_grad=1e-4)


@needs_interpreter
def test_triton_fp16_within_stated_tolerance():
    """fp16 inputs, fp32 accumulation: out within 2e-3 and grads within 1e-2 of float64 (inputs ~ N(0, 1))."""
    q, k, v, dout, gen = make_inputs(1, 48, 4, 2, 16, torch.float16, seed=7)
    vertical, slash = random_lines(1, 4, 48, 4, 3, gen)
    index = SparseIndex.from_lines(vertical, slash, 48, 16)
    got = run_kernel(q, k, v, dout, index, "triton")
    assert got[0].dtype == torch.float16 and got[2].dtype == torch.float16
    want = run_reference(q, k, v, dout, index.to_mask())
    assert_close(got, want, atol_out=2e-3, atol_grad=1e-2)


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_interpreter), "torch"])
def test_empty_vertical_or_slash_sets(impl):
    q, k, v, dout, gen = make_inputs(1, 48, 2, 1, 16, torch.float32, seed=11)
    none = torch.full((1, 2, 3), -1)
    for vertical, slash in (
        (torch.empty(1, 2, 0, dtype=torch.long), torch.tensor([[[5], [20]]])),  # no verticals
        (torch.tensor([[[3, 30], [17, -1]]]), none),  # no slashes (all padding)
        (none, torch.empty(1, 2, 0, dtype=torch.long)),  # neither: diagonal + sink blocks only
    ):
        index = SparseIndex.from_lines(vertical, slash, 48, 16)
        got = run_kernel(q, k, v, dout, index, impl)
        want = run_reference(q, k, v, dout, index.to_mask())
        assert_close(got, want, atol_out=1e-5, atol_grad=1e-4)


@needs_interpreter
def test_all_blocks_index_equals_dense_causal():
    q, k, v, dout, _ = make_inputs(2, 40, 4, 2, 16, torch.float32, seed=5)
    index = blocks_for_causal_dense(40, 16, 2, 4)
    assert index.density() == pytest.approx(1.0)
    got = run_kernel(q, k, v, dout, index, "triton")
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    want = run_reference(q, k, v, dout, causal)
    assert_close(got, want, atol_out=1e-5, atol_grad=1e-4)
    dense = dense_attention(q, k, v, causal=True)
    assert torch.allclose(dense.double(), want[0], atol=1e-5)


@needs_interpreter
def test_atomic_backward_matches_and_deterministic_backward_repeats_bitwise():
    """The fused backward (dQ added with atomics from the dK/dV passes) against float64; the deterministic
    one repeats bit for bit."""
    q, k, v, dout, gen = make_inputs(1, 64, 4, 2, 16, torch.float32, seed=3)
    vertical, slash = random_lines(1, 4, 64, 6, 2, gen)
    index = SparseIndex.from_lines(vertical, slash, 64, 16)
    want = run_reference(q, k, v, dout, index.to_mask())
    atomic = run_kernel(q, k, v, dout, index, "triton", deterministic=False)
    assert_close(atomic, want, atol_out=1e-5, atol_grad=1e-4)
    first = run_kernel(q, k, v, dout, index, "triton")
    second = run_kernel(q, k, v, dout, index, "triton")
    for a, b in zip(first[2:], second[2:]):
        assert torch.equal(a, b)


def test_index_for_other_shapes_is_refused():
    q, k, v, _, gen = make_inputs(1, 32, 2, 1, 16, torch.float32, seed=1)
    index = SparseIndex.from_lines(torch.tensor([[[1], [2]]]), torch.tensor([[[0], [0]]]), 48, 16)
    with pytest.raises(ValueError, match="index is for"):
        vertical_slash_attention(q, k, v, index, impl="torch")


@needs_interpreter
@pytest.mark.parametrize("item_limit, min_items", [(2, None), (None, 400)])
def test_split_work_items_match_reference(monkeypatch, item_limit, min_items):
    """Long transposed lists are cut into work items whose partial dK/dV are reduced in a fixed order (forced
    by ITEM_LIMIT, or by MIN_ITEMS: few targets cut short to fill a big GPU)."""
    from mtrain.ops import _triton_attention

    monkeypatch.setattr(_triton_attention, "ITEM_LIMIT", item_limit)
    monkeypatch.setattr(_triton_attention, "MIN_ITEMS", min_items)
    monkeypatch.setattr(_triton_attention, "MIN_ITEM_LENGTH", 1)  # this test's lists are a few blocks long
    q, k, v, dout, gen = make_inputs(1, 96, 4, 2, 16, torch.float32, seed=9)
    vertical, slash = random_lines(1, 4, 96, 8, 2, gen)
    index = SparseIndex.from_lines(vertical, slash, 96, 16)
    want = run_reference(q, k, v, dout, index.to_mask())
    _triton_attention.prepare_backward(index, 2, 16)  # the backward's work plans, cached where this test reads them
    got = run_kernel(q, k, v, dout, index, "triton")
    plans = index._cache
    kv_items = next(p for key, p in plans.items() if key[0] == "kv_items")
    col_items = next(p for key, p in plans.items() if key[0] == "col_items")
    assert kv_items["n_extra"] > 0 and col_items["n_extra"] > 0  # the split path really ran
    assert_close(got, want, atol_out=1e-5, atol_grad=1e-4)
    again = run_kernel(q, k, v, dout, index, "triton")
    for a, b in zip(got[2:], again[2:]):
        assert torch.equal(a, b)
