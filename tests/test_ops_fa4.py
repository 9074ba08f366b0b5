"""FlashAttention-4 block engine (mtrain.ops.fa4), the parts that run without a GPU: the index in FA4's
block-sparse format (forward lists and transposed backward lists) rebuilds exactly the index's token mask (with
documents too); the block + column split the engine computes, merged by LSE and differentiated from the merged
out / lse, equals attention over the whole index; and the engine's refusals name their fix. The kernels
themselves are checked on the GPU by mtrain/bench/check.py."""

import importlib.util
import os

import pytest
import torch

from mtrain.ops import SparseIndex, partial, reference, vertical_slash_attention
from mtrain.ops.backends import importable
from mtrain.ops.fa4 import BLOCK_SIZE, fa4_block_lists, fa4_block_lists_general, load_fa4
from test_ops_sparse_attention import make_inputs, random_lines

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
HAS_FA4 = importable("flash_attn.cute")


def rebuild(cnt, idx, kind, S, bs, doc, transposed):
    """Token mask [B, H, S, S] of one FA4 list: 'full' blocks whole (inside S), 'mask' blocks through the causal
    (and same-document) mask_mod. transposed: the lists are per key block and name query blocks."""
    B, H, n = cnt.shape
    pos = torch.arange(S)
    out = torch.zeros(B, H, S, S, dtype=torch.bool)
    for b in range(B):
        mod = pos[None, :] <= pos[:, None]
        if doc is not None:
            mod = mod & (doc[b][:, None] == doc[b][None, :])
        for h in range(H):
            for row in range(n):
                for t in range(int(cnt[b, h, row])):
                    i, j = (int(idx[b, h, row, t]), row) if transposed else (row, int(idx[b, h, row, t]))
                    rq, rk = slice(i * bs, (i + 1) * bs), slice(j * bs, (j + 1) * bs)
                    out[b, h, rq, rk] |= True if kind == "full" else mod[rq, rk]
    return out


def column_mask(index):
    pos = torch.arange(index.seq_len)
    B, H = index.block_ids.shape[:2]
    return reference.partial_mask(pos, pos, batch=B, heads=H, blocks=None, columns=index.columns,
                                  block_size=index.block_size, causal=True) & ~reference.partial_mask(
        pos, pos, batch=B, heads=H, blocks=index.blocks, columns=None, block_size=index.block_size, causal=True)


def random_docs(B, S, gen, rate):
    return torch.cumsum(torch.rand(B, S, generator=gen) < rate, -1)


CASES = [  # (S, block size, verticals, slashes, documents): ragged S, sparse to dense
    (700, 128, 4, 1, False),
    (1000, 128, 10, 6, False),
    (1000, 128, 30, 40, False),
    (901, 128, 8, 4, True),
    (640, 128, 2, 30, True),
    (333, 64, 6, 3, True),  # the conversion itself takes any block size
]


@pytest.mark.parametrize("S,bs,nv,ns,docs", CASES)
def test_fa4_lists_rebuild_the_index_mask(S, bs, nv, ns, docs):
    gen = torch.Generator().manual_seed(S + nv)
    B, H = 2, 3  # index heads are query heads: GQA groups share K/V, not lists
    vertical, slash = random_lines(B, H, S, nv, ns, gen)
    slash[..., 0] = 0
    index = SparseIndex.from_lines(vertical, slash, S, bs)
    doc = random_docs(B, S, gen, 0.004) if docs else None
    want = index.to_mask()
    if doc is not None:
        want &= doc[:, None, :, None] == doc[:, None, None, :]
    lists = fa4_block_lists(index, doc)
    blocks = want & ~column_mask(index)  # what FA4 computes; the columns go to the Triton path
    assert 0 < blocks.sum() < want.sum() if index.col_counts.sum() else blocks.sum() == want.sum()
    for transposed, (fc, fi, mc, mi) in ((False, (lists.full_cnt, lists.full_idx, lists.mask_cnt, lists.mask_idx)),
                                         (True, (lists.full_q_cnt, lists.full_q_idx, lists.mask_q_cnt,
                                                 lists.mask_q_idx))):
        full = rebuild(fc, fi, "full", S, bs, doc, transposed)
        masked = rebuild(mc, mi, "mask", S, bs, doc, transposed)
        assert torch.equal(full | masked, blocks)
        assert not (full & masked).any()  # each key block once per query block: no pair counted twice
        for cnt, idx in ((fc, fi), (mc, mi)):
            assert cnt.dtype == idx.dtype == torch.int32 and idx.is_contiguous()
            assert idx.shape[-1] <= -(-S // bs)  # FA4's compact index: at most the number of blocks
            slot = torch.arange(idx.shape[-1])
            live = slot < cnt[..., None]
            assert (idx[~live] == 0).all() and (idx[live] >= 0).all()
            assert (idx[..., 1:] > idx[..., :-1])[live[..., 1:]].all()  # ascending, distinct
    if doc is None:  # without documents every block below the diagonal is full, only the diagonal masked
        assert (lists.mask_cnt == 1).all()
        assert torch.equal(lists.mask_idx[..., 0], torch.arange(index.n_blocks).expand(B, H, -1).int())
        # the lists read off the index's own lists and transposed index equal the general masking path's
        general = fa4_block_lists_general(index, None)
        for name in ("full", "mask", "full_q", "mask_q"):
            cnt, idx = getattr(lists, f"{name}_cnt"), getattr(lists, f"{name}_idx")
            g_cnt, g_idx = getattr(general, f"{name}_cnt"), getattr(general, f"{name}_idx")
            assert torch.equal(cnt, g_cnt)
            w = min(idx.shape[-1], g_idx.shape[-1])
            assert torch.equal(idx[..., :w], g_idx[..., :w]) and not idx[..., w:].any() and not g_idx[..., w:].any()


def test_fa4_lists_refuse_bad_document_ids():
    index = SparseIndex.from_lines(torch.tensor([[[20]]]), torch.tensor([[[0]]]), 300, BLOCK_SIZE)
    with pytest.raises(ValueError, match="doc_ids must be an integer tensor"):
        fa4_block_lists(index, torch.zeros(1, 299, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_ids must be an integer tensor"):
        fa4_block_lists(index, torch.zeros(1, 300))


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not IN_INTERPRETER, reason="Triton on the CPU needs TRITON_INTERPRET=1 at process start"))])
@pytest.mark.parametrize("docs", [False, True])
def test_block_and_column_split_is_exact(impl, docs):
    """The engine's algebra with our kernels standing in for FA4's block part: blocks only + columns only (the
    column path's `blocks` lists nothing; None would mean dense), merged by LSE, equals the whole index; each
    part's backward fed the MERGED out / lse, summed, equals the whole backward."""
    S, Hq, Hkv, D, bs = 333, 4, 2, 16, BLOCK_SIZE
    q, k, v, dout, gen = make_inputs(1, S, Hq, Hkv, D, torch.float32, seed=5)
    # the local diagonal + sinks as blocks, and per head a few far columns in blocks 1 and 2
    vertical = torch.tensor([5, 140, 150 + 20, 200, 270])[None, None] + torch.arange(Hq)[None, :, None]
    index = SparseIndex.from_lines(vertical, torch.zeros(1, Hq, 1, dtype=torch.long), S, bs)
    assert index.col_counts.sum() > 0
    doc = random_docs(1, S, gen, 0.01) if docs else None
    pos = torch.arange(S)
    none = (torch.full((1, Hq, index.n_blocks, 1), -1, dtype=torch.int32),
            torch.zeros(1, Hq, index.n_blocks, dtype=torch.int32))
    kw = dict(q_pos=pos, k_pos=pos, block_size=bs, impl=impl, q_doc=doc, k_doc=doc)
    out_b, lse_b = partial.attention_forward(q, k, v, blocks=index.blocks, columns=None, **kw)
    out_c, lse_c = partial.attention_forward(q, k, v, blocks=none, columns=index.columns, **kw)
    out, lse = partial.merge_partial(out_b, lse_b, out_c, lse_c)
    want_out, want_lse = partial.attention_forward(q, k, v, blocks=index.blocks, columns=index.columns, **kw)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=1e-5)
    grads_b = partial.attention_backward(dout, q, k, v, out, lse, blocks=index.blocks, columns=None, **kw)
    grads_c = partial.attention_backward(dout, q, k, v, out, lse, blocks=none, columns=index.columns, **kw)
    want = partial.attention_backward(dout, q, k, v, want_out, want_lse, blocks=index.blocks,
                                      columns=index.columns, **kw)
    for a, b, w in zip(grads_b, grads_c, want):
        torch.testing.assert_close(a + b, w, atol=1e-4, rtol=1e-4)
    assert grads_c[1].abs().sum() > 0  # the columns carry gradient of their own


def test_fa4_refuses_other_block_sizes():
    q, k, v, _, gen = make_inputs(1, 256, 4, 2, 64, torch.bfloat16, seed=1)
    index = SparseIndex.from_lines(*random_lines(1, 4, 256, 3, 2, gen), 256, 64)
    with pytest.raises(ValueError, match="block_size=128"):
        vertical_slash_attention(q, k, v, index, impl="fa4")


def test_fa4_refuses_cpu_and_fp32():
    q, k, v, _, gen = make_inputs(1, 256, 4, 2, 64, torch.bfloat16, seed=1)
    index = SparseIndex.from_lines(*random_lines(1, 4, 256, 3, 2, gen), 256, BLOCK_SIZE)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        vertical_slash_attention(q, k, v, index, impl="fa4")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        vertical_slash_attention(q.float(), k.float(), v.float(), index, impl="fa4")


@pytest.mark.skipif(bool(HAS_FA4), reason="flash_attn.cute is installed here")
def test_missing_fa4_names_the_install():
    with pytest.raises(ImportError, match=r"mtrain\[fa4\].*flash-attn-4==4\.0\.0b36"):
        load_fa4()


def test_unknown_impl_lists_fa4():
    q, k, v, _, gen = make_inputs(1, 64, 2, 2, 16, torch.float32, seed=1)
    index = SparseIndex.from_lines(*random_lines(1, 2, 64, 2, 2, gen), 64, 16)
    with pytest.raises(ValueError, match='"fa4"'):
        vertical_slash_attention(q, k, v, index, impl="fa3")


def test_flash_attn_4_alone_is_not_flash_attn_2(tmp_path, monkeypatch):
    """flash-attn-4 installs a `flash_attn` package holding only `cute`: dense attention must not take it for
    flash-attn 2 (whose flash_attn_func it would then fail to import)."""
    import sys

    from mtrain.ops.backends import has_flash_attn

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("a real flash_attn is installed here")
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert not has_flash_attn()
        (tmp_path / "flash_attn" / "flash_attn_interface.py").write_text("def flash_attn_func(*a, **k): pass\n")
        sys.modules.pop("flash_attn", None)
        importlib.invalidate_caches()
        assert has_flash_attn()
    finally:  # the stand-in package must not outlive the test
        sys.modules.pop("flash_attn", None)
        sys.modules.pop("flash_attn.flash_attn_interface", None)


def test_auto_picks_fa4_where_it_was_measured_faster(monkeypatch):
    """impl="auto" on CUDA: the fa4 engine at AUTO_FA4_BLOCK_SIZES (128) for 16-bit inputs where FA4 can run, our
    Triton kernels otherwise (other block sizes, fp32, FA4 missing or a pre-Hopper GPU); other impls as asked."""
    from mtrain.ops import attention

    cuda = torch.device("cuda")
    monkeypatch.setattr(attention, "fa4_usable", lambda device_type, device_index: True)
    assert attention.resolve_impl("auto", cuda, 128, torch.bfloat16) == "fa4"
    assert attention.resolve_impl("auto", cuda, 128) == "fa4"
    assert attention.resolve_impl("auto", cuda, 128, torch.float32) == "triton"
    assert attention.resolve_impl("auto", cuda, 64, torch.bfloat16) == "triton"
    assert attention.resolve_impl("triton", cuda, 128, torch.bfloat16) == "triton"
    monkeypatch.setattr(attention, "fa4_usable", lambda device_type, device_index: False)
    assert attention.resolve_impl("auto", cuda, 128, torch.bfloat16) == "triton"
    monkeypatch.undo()
    assert attention.fa4_usable("cpu", None) is False  # no GPU: never fa4, whatever is installed


@pytest.mark.parametrize("seed", range(3))
def test_bounded_transposed_lists_equal_the_flag_built_ones(seed):
    """`transposed_bounded` (one sort of the listed entries, width given) lists, per key block, the same ascending
    query blocks and counts as `transposed` (built from [B, H, n, nQB] flags), wherever the width holds them; padding
    ignored past the counts (FA4 reads only counts entries)."""
    from mtrain.ops.fa4 import transposed, transposed_bounded

    g = torch.Generator().manual_seed(seed)
    B, H, nq, n, w = 2, 3, 9, 13, 5
    counts = torch.randint(0, w + 1, (B, H, nq), generator=g, dtype=torch.int32)
    # each row's list: distinct ascending key blocks (as the plans' lists are), -1 past its count
    ids = torch.sort(torch.rand(B, H, nq, n, generator=g).argsort(-1)[..., :w], -1).values.to(torch.int32)
    ids = torch.where(torch.arange(w) < counts[..., None], ids, -1)
    want_idx, want_cnt = transposed(ids, counts, n)
    width = int(want_cnt.max())
    got_idx, got_cnt = transposed_bounded(ids, counts, n, width)
    assert torch.equal(got_cnt, want_cnt) and got_idx.shape == (B, H, n, width)
    live = torch.arange(width) < want_cnt[..., None]
    assert torch.equal(torch.where(live, got_idx, 0), torch.where(live, want_idx[..., :width], 0))
    assert bool((want_cnt > 0).any()) and int(want_cnt.max()) > 1  # the case is not trivial
