"""Index blocks larger than the kernel tiles (sub-tiled Triton kernels, Triton interpreter) against a
float64 reference: ragged lengths, split work items, atomics, shuffled global positions, document ids."""

import pytest
import torch

from mtrain.ops import SparseIndex, partial
from test_ops_interpreter import needs_interpreter
from test_ops_partial import loop_mask, random_lists, ref_grads
from test_ops_sparse_attention import assert_close, make_inputs, random_lines, run_kernel, run_reference

pytestmark = needs_interpreter


@pytest.fixture
def subtiles(monkeypatch):
    """Set the kernel sub-tiles (query rows, keys) of every kernel; 32-token blocks then run sub-tiled."""
    from mtrain.ops import _triton_attention

    def set_tiles(qt, kt):
        monkeypatch.setattr(_triton_attention, "SUBTILE", {name: (qt, kt) for name in _triton_attention.SUBTILE})
        monkeypatch.setattr(_triton_attention, "SUBTILE_SMALL_HEADS", {})  # the tests' head dims are small
        return _triton_attention._subtiles(32, "fwd")

    return set_tiles


def test_subtile_choice():
    """Blocks above the wanted tile split into the largest power-of-two divisor; others run as one tile."""
    from mtrain.ops._triton_attention import _subtile

    assert [_subtile(bs, 64) for bs in (16, 48, 64, 96, 100, 128, 192, 256)] == [16, 64, 64, 32, 128, 64, 64, 64]
    assert [_subtile(bs, 128) for bs in (64, 128, 192, 256)] == [64, 128, 64, 128]

    from mtrain.ops._triton_attention import _subtiles

    # head dims <= 64 run the forward of a 128-token block as one 128-row query tile (SUBTILE_SMALL_HEADS)
    assert _subtiles(128, "fwd", 64) == {"QT": 128, "KT": 64, "NQS": 1, "NKS": 2}
    assert _subtiles(128, "fwd", 128) == {"QT": 64, "KT": 64, "NQS": 2, "NKS": 2}
    assert _subtiles(128, "dq", 64) == _subtiles(128, "dq", 128)
    # fp32 on CUDA (tf32x3 dots) caps both sides: the 64 x 128 dK/dV tile of a 128-block runs as 32 x 32 sub-tiles
    assert _subtiles(128, "dkdv", 128, cap=32) == {"QT": 32, "KT": 32, "NQS": 4, "NKS": 4}
    assert _subtiles(32, "fwd", 128, cap=32) == _subtiles(32, "fwd", 128)


def test_fp32_dot_settings():
    """fp32 inputs: tf32x3 dots everywhere; on CUDA the scorer runs 32 rows and one stage; 16-bit inputs unchanged."""
    from mtrain.ops._triton_attention import FP32_TILE, _tile_cap
    from mtrain.ops._triton_estimate import dot_precision, scorer_config

    assert dot_precision(torch.float32) == "tf32x3" and dot_precision(torch.bfloat16) == "tf32"
    assert scorer_config(128, 128, torch.float32) == dict(rows=32, warps=4, stages=1, split=True, keys=None)
    assert scorer_config(128, 128, torch.bfloat16) == scorer_config(128, 128)
    assert _tile_cap(torch.zeros(1)) is None  # the CPU (interpreter) keeps the CUDA 16-bit tiles
    assert FP32_TILE == 32


@pytest.mark.parametrize("qt,kt", [(16, 32), (32, 16)])
def test_subtiled_blocks_match_reference(subtiles, monkeypatch, qt, kt):
    from mtrain.ops import _triton_attention

    sub = subtiles(qt, kt)
    assert sub["NQS"] * sub["NKS"] > 1  # sub-tiling really runs
    monkeypatch.setattr(_triton_attention, "ITEM_LIMIT", 2)  # split items + reduce over sub-tile rows too
    q, k, v, dout, gen = make_inputs(1, 88, 4, 2, 16, torch.float32, seed=qt + kt)  # 88: a short last block
    vertical, slash = random_lines(1, 4, 88, 6, 2, gen)
    index = SparseIndex.from_lines(vertical, slash, 88, 32)
    want = run_reference(q, k, v, dout, index.to_mask())
    assert_close(run_kernel(q, k, v, dout, index, "triton"), want, atol_out=1e-5, atol_grad=1e-4)
    if (qt, kt) == (16, 32):
        assert_close(run_kernel(q, k, v, dout, index, "triton", deterministic=False), want, 1e-5, 1e-4)


def test_subtiled_partial_with_shuffled_positions_and_documents(subtiles):
    """Global positions in any order (the causal skip must stay exact) and document ids; both backwards."""
    subtiles(16, 16)
    gen = torch.Generator().manual_seed(4)
    B, Hq, Hkv, D, bs = 1, 2, 1, 16, 32
    q_pos = torch.randperm(64, generator=gen)
    k_pos = torch.randperm(64, generator=gen)
    q = torch.randn(B, 64, Hq, D, generator=gen)
    k = torch.randn(B, 64, Hkv, D, generator=gen)
    v = torch.randn(B, 64, Hkv, D, generator=gen)
    dout = torch.randn(B, 64, Hq, D, generator=gen)
    blocks, columns = random_lists(B, Hq, 2, 2, bs, 64, 0.7, 3, gen)
    q_doc, k_doc = q_pos[None] // 40, k_pos[None] // 40
    kw = dict(q_pos=q_pos, k_pos=k_pos, blocks=blocks, columns=columns, block_size=bs, softmax_scale=0.4,
              impl="triton", q_doc=q_doc, k_doc=k_doc)
    out, lse = partial.attention_forward(q, k, v, **kw)
    mask = loop_mask(q_pos, k_pos, B, Hq, blocks, columns, bs) & (q_doc[0][:, None] == k_doc[0][None, :])
    r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, k, v, mask, dout, 0.4)
    fin = ~torch.isinf(r_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert torch.allclose(out.double(), r_out, atol=1e-5, rtol=0)
    assert torch.allclose(lse.double()[fin], r_lse[fin], atol=1e-5, rtol=0)
    for deterministic in (True, False):  # and the fused backward
        grads = partial.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **kw)
        for got, want in zip(grads, (r_dq, r_dk, r_dv)):
            assert torch.allclose(got.double(), want, atol=1e-4, rtol=0), deterministic
