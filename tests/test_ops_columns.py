"""The list-free vertical columns (`mtrain.ops.columns.VerticalColumns`) against the column lists a `SparseIndex`
builds from the same lines: the same columns for every query block, the same column plan for the backward, and
the same attention and gradients through the Triton kernels (float64 reference over the index's own mask)."""

import pytest
import torch

from mtrain.ops import SparseIndex, partial
from mtrain.ops.columns import VerticalColumns, vertical_columns
from mtrain.ops.index import list_bytes
from test_ops_interpreter import needs_interpreter
from test_ops_partial import loop_mask, ref_grads


def random_lines(gen, B, H, S, nv, ns):
    """Verticals and slashes with the cases the index builder handles: out-of-range padding on both sides,
    duplicates, verticals in the sink block and in the last (possibly short) block."""
    vert = torch.randint(-2, S + 2, (B, H, nv), generator=gen)
    if nv >= 2:
        vert[..., 1] = vert[..., 0]  # a duplicate
    slash = torch.randint(-1, S + 1, (B, H, ns), generator=gen)
    return vert, slash


def trimmed(ids, counts):
    """Lists cut to their entries (padding beyond counts set to -1, width = the longest list)."""
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    ids = torch.where(torch.arange(ids.shape[-1]) < counts[..., None].long(), ids.long(), -1)
    if ids.shape[-1] < width:
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[-1]), value=-1)
    return ids[..., :width]


def test_lists_equal_the_index_builders_on_random_lines():
    gen = torch.Generator().manual_seed(5)
    for trial in range(240):
        B, H = 1 + trial % 2, 1 + trial % 3
        bs = (4, 8, 16)[trial % 3]
        S = int(torch.randint(bs, 12 * bs, (1,), generator=gen))  # often a short last block
        nv, ns = int(torch.randint(0, 14, (1,), generator=gen)), int(torch.randint(0, 6, (1,), generator=gen))
        vert, slash = random_lines(gen, B, H, S, nv, ns)
        index = SparseIndex.from_lines(vert, slash, S, bs, impl="torch")
        cols = vertical_columns(vert, slash, S, bs)
        assert not bool(((cols.verts >= 0) & (cols.verts < bs)).any()), trial  # the sink block's are never columns
        ids, counts = cols.to_lists()
        assert torch.equal(counts, index.col_counts), trial
        assert torch.equal(trimmed(ids, counts), trimmed(index.col_ids, index.col_counts)), trial


def test_column_plan_covers_every_query_block_that_reads_a_chunk():
    """The backward's list-free plan: chunk c of a head's verticals is walked from its first query block on, so
    no query block before it may read any of the chunk's columns, and the walk ends at the last query block."""
    gen = torch.Generator().manual_seed(9)
    for trial in range(60):
        B, H, bs = 1 + trial % 2, 2, (4, 8)[trial % 2]
        S = int(torch.randint(4 * bs, 14 * bs, (1,), generator=gen))
        vert, slash = random_lines(gen, B, H, S, int(torch.randint(1, 40, (1,), generator=gen)), 3)
        cols = vertical_columns(vert, slash, S, bs)
        chunk = (4, 16, 64)[trial % 3]
        plan = cols.column_plan(chunk)
        active = cols.active()  # [B, H, nQB, Nv]
        n, nv = cols.n_blocks, cols.verts.shape[-1]
        assert plan.q_ids.shape == (B, H, -(-nv // chunk), 1) and torch.equal(plan.universe, cols.verts)
        for c in range(plan.q_ids.shape[2]):
            first = plan.q_ids[:, :, c, 0].long()  # [B, H]
            assert torch.equal(plan.counts[:, :, c].long(), n - first)
            before = torch.arange(n)[None, None, :] < first[..., None]  # [B, H, nQB]
            assert not (active[..., c * chunk:(c + 1) * chunk].any(-1) & before).any(), trial


def test_no_per_block_lists_and_far_fewer_bytes():
    """At 16K tokens, 64-token blocks, 512 verticals and 64 slashes per head: the form holds the verticals, one
    count per query block and two flag rows, not a list per query block; the lists of the same index are
    ~50x larger. The ids view the kernels read shares the verticals' memory."""
    gen = torch.Generator().manual_seed(1)
    S, bs, H = 16384, 64, 2
    vert = torch.randint(0, S, (1, H, 512), generator=gen)
    slash = torch.randint(0, S, (1, H, 64), generator=gen)
    cols = vertical_columns(vert, slash, S, bs)
    index = SparseIndex.from_lines(vert, slash, S, bs, impl="torch")
    assert cols.nbytes() <= H * (512 * 4 + 3 * (S // bs) * 4)
    assert list_bytes(index) > 50 * cols.nbytes(), (list_bytes(index), cols.nbytes())
    ids, counts = cols
    assert ids.shape == (1, H, S // bs, cols.verts.shape[-1]) and ids.stride(2) == 0
    assert ids.untyped_storage().data_ptr() == cols.verts.untyped_storage().data_ptr()


def test_bad_shapes_are_refused():
    cols = vertical_columns(torch.tensor([[[5, 9]]]), torch.tensor([[[0]]]), 32, 8)
    with pytest.raises(ValueError, match="counts"):
        VerticalColumns(cols.verts, cols.counts[..., :2], cols.covered, 32, 8)
    with pytest.raises(ValueError, match="vertical must be"):
        vertical_columns(torch.tensor([5, 9]), torch.tensor([[[0]]]), 32, 8)
    with pytest.raises(ValueError, match="chunk"):
        cols.column_plan(65)


@needs_interpreter
def test_columns_of_another_block_size_are_refused():
    gen = torch.Generator().manual_seed(2)
    q, k, v, _, index, cols = _attention_case(gen, 1, 2, 1, 64, 8, nv=6, ns=2)
    other = vertical_columns(torch.tensor([[[5, 40]] * 2]), torch.tensor([[[0]] * 2]), 128, 16)  # also 8 blocks
    pos = torch.arange(64)
    with pytest.raises(ValueError, match="128 tokens in blocks of 16 on cpu cannot serve 64 keys in blocks of 8"):
        partial.attention_forward(q, k, v, q_pos=pos, k_pos=pos, blocks=index.blocks, columns=other, block_size=8,
                                  impl="triton")


def _attention_case(gen, B, Hq, Hkv, S, bs, nv, ns, docs=None):
    D = 16
    q = torch.randn(B, S, Hq, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    v = torch.randn(B, S, Hkv, D, generator=gen)
    dout = torch.randn(B, S, Hq, D, generator=gen)
    vert, slash = random_lines(gen, B, Hq, S, nv, ns)
    index = SparseIndex.from_lines(vert, slash, S, bs, impl="torch")
    return q, k, v, dout, index, vertical_columns(vert, slash, S, bs)


CASES = [
    (64, 8, 2, 1, True, False),   # GQA 2, full blocks
    (61, 8, 2, 2, True, True),    # a short last block, documents
]


@pytest.mark.parametrize("impl,S,bs,Hq,Hkv,deterministic,with_docs",
                         [("torch", *c) for c in CASES]
                         + [pytest.param("triton", *c, marks=needs_interpreter) for c in CASES]
                         # the fused backward (atomics): Triton only
                         + [pytest.param("triton", 72, 16, 1, 1, False, False, marks=needs_interpreter)])
def test_attention_with_list_free_columns_matches_reference(impl, S, bs, Hq, Hkv, deterministic, with_docs):
    """Forward and backward with `columns=VerticalColumns` against the float64 reference over the mask the
    index's own lists define (the same pairs), and against the same call with the lists."""
    gen = torch.Generator().manual_seed(S + bs)
    B = 2 if with_docs else 1
    q, k, v, dout, index, cols = _attention_case(gen, B, Hq, Hkv, S, bs, nv=12, ns=3)
    pos = torch.arange(S)
    docs = None
    if with_docs:
        docs = torch.cat([torch.zeros(23, dtype=torch.long), torch.ones(S - 23, dtype=torch.long)]).expand(B, S)
    kw = dict(q_pos=pos, k_pos=pos, blocks=index.blocks, block_size=bs, softmax_scale=0.3, impl=impl,
              q_doc=docs, k_doc=docs)
    out, lse = partial.attention_forward(q, k, v, columns=cols, **kw)
    mask = loop_mask(pos, pos, B, Hq, index.blocks, index.columns, bs)
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, k, v, mask, dout, 0.3)
    assert torch.allclose(out.double(), r_out, atol=1e-5, rtol=0)
    assert torch.allclose(lse.double(), r_lse, atol=1e-5, rtol=0)
    dq, dk, dv = partial.attention_backward(dout, q, k, v, out, lse, columns=cols, deterministic=deterministic, **kw)
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=0), (got.double() - want).abs().max()
    # the same call with the index's lists: the same result within fp32 accumulation order
    l_out, l_lse = partial.attention_forward(q, k, v, columns=index.columns, **kw)
    assert torch.allclose(out, l_out, atol=1e-5, rtol=0)
    l_dq, l_dk, l_dv = partial.attention_backward(dout, q, k, v, l_out, l_lse, columns=index.columns,
                                                  deterministic=deterministic, **kw)
    for got, want in ((dq, l_dq), (dk, l_dk), (dv, l_dv)):
        assert torch.allclose(got, want, atol=1e-4, rtol=0)


@needs_interpreter
def test_vertical_slash_attention_reads_an_attached_list_free_form():
    """`with_list_free_columns` attaches the form to a copy of an index that keeps its lines; the one-device
    attention (Triton kernels) then reads its columns list-free and gives the lists' result and gradients."""
    from mtrain.ops import vertical_slash_attention
    from mtrain.ops.columns import with_list_free_columns

    gen = torch.Generator().manual_seed(3)
    q, k, v, dout, index, _ = _attention_case(gen, 1, 4, 2, 93, 16, nv=20, ns=4)
    vert, slash = random_lines(gen, 1, 4, 93, 20, 4)
    index = SparseIndex.from_lines(vert, slash, 93, 16, impl="torch")
    assert with_list_free_columns(index) is None  # no lines kept: nothing to attach
    index._cache["lines"] = (vert, slash)
    vc_index = with_list_free_columns(index)
    assert isinstance(vc_index.kernel_columns, VerticalColumns) and index.kernel_columns == index.columns
    grads = []
    for idx in (index, vc_index):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = vertical_slash_attention(qq, kk, vv, idx, impl="triton")
        out.backward(dout)
        grads.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for got, want in zip(*grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
