"""Document masking (packed samples) in mtrain.ops: partial attention, vertical-slash and dense attention and
the estimator against a float64 reference whose mask adds the rule "same document" to the loop-built mask."""

import pytest
import torch

from mtrain.ops import SparseIndex, dense_attention, estimate_vertical_slash, partial, reference
from mtrain.ops import merge_partial, vertical_slash_attention
from mtrain.ops.estimate import last_query_probs
from test_ops_interpreter import needs_interpreter
from test_ops_partial import block_stripe_positions, loop_mask, random_lists, ref_grads

IMPLS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def packed_doc_ids(lengths, base=0):
    """Document ids of a packed sample: ids need not be sorted or contiguous (equal id = same document)."""
    ids = [base + 7 * ((n * 5) % 11) for n in range(len(lengths))]
    return torch.cat([torch.full((n,), d, dtype=torch.long) for n, d in zip(lengths, ids)])


def doc_rule(q_doc, k_doc):
    """[B, 1, Sq, Sk] same-document pairs, by explicit comparison of the ids."""
    return (q_doc[:, :, None] == k_doc[:, None, :])[:, None]


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_step_with_documents_matches_reference(impl):
    """A ring step: query shard of rank 1 against KV of rank 0 (non-contiguous global positions),
    GQA 2, documents starting mid-block, a one-token document, random blocks and columns."""
    gen = torch.Generator().manual_seed(11)
    B, Hkv, group, D, bs, S, W = 2, 1, 2, 16, 8, 64, 2
    Hq = Hkv * group
    docs = torch.stack([packed_doc_ids([5, 1, 20, 13, 25]), packed_doc_ids([30, 34], base=3)])  # [B, S]
    q_pos = block_stripe_positions(S, W, bs, 1)
    k_pos = block_stripe_positions(S, W, bs, 0)
    Sq, Sk = len(q_pos), len(k_pos)
    q = torch.randn(B, Sq, Hq, D, generator=gen)
    k = torch.randn(B, Sk, Hkv, D, generator=gen)
    v = torch.randn(B, Sk, Hkv, D, generator=gen)
    dout = torch.randn(B, Sq, Hq, D, generator=gen)
    blocks, columns = random_lists(B, Hq, Sq // bs, Sk // bs, bs, Sk, 0.6, 3, gen)
    q_doc, k_doc = docs[:, q_pos], docs[:, k_pos]
    kw = dict(q_pos=q_pos, k_pos=k_pos, blocks=blocks, columns=columns, block_size=bs, softmax_scale=0.4,
              impl=impl, q_doc=q_doc, k_doc=k_doc)
    out, lse = partial.attention_forward(q, k, v, **kw)
    mask = loop_mask(q_pos, k_pos, B, Hq, blocks, columns, bs) & doc_rule(q_doc, k_doc)
    r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, k, v, mask, dout, 0.4)
    assert torch.isinf(r_lse).any() and not torch.isinf(r_lse).all()  # some rows see no key of their document
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    fin = ~torch.isinf(r_lse)
    assert torch.allclose(out.double(), r_out, atol=1e-5, rtol=0)
    assert torch.allclose(lse.double()[fin], r_lse[fin], atol=1e-5, rtol=0)
    dq, dk, dv = partial.attention_backward(dout, q, k, v, out, lse, **kw)
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=0), (got.double() - want).abs().max()


@pytest.mark.parametrize("impl", IMPLS)
def test_ring_of_dense_shards_with_documents(impl):
    """Per-shard dense steps (blocks=None) with document ids, merged by LSE: full causal attention inside
    each document, gradients included."""
    gen = torch.Generator().manual_seed(12)
    B, Hq, Hkv, D, bs, S = 1, 2, 1, 16, 8, 48
    # Increasing ids (as a packer numbers documents), so block ranges separate and blocks get skipped.
    docs = torch.repeat_interleave(torch.tensor([2, 4, 9, 11]), torch.tensor([3, 1, 17, 27]))[None]
    q = torch.randn(B, S, Hq, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    v = torch.randn(B, S, Hkv, D, generator=gen)
    dout = torch.randn(B, S, Hq, D, generator=gen)
    pos = torch.arange(S)
    shards = [block_stripe_positions(S, 2, bs, r) for r in range(2)]
    plans = [{} for _ in shards]
    parts = [partial.attention_forward(q, k[:, kp], v[:, kp], q_pos=pos, k_pos=kp, block_size=bs, impl=impl,
                                       q_doc=docs, k_doc=docs[:, kp], plans=p) for kp, p in zip(shards, plans)]
    if impl == "triton":  # key blocks of other documents are dropped from the lists, not just masked
        for p in plans:
            assert p["doc"]["lists"][1].sum() < p["dense"][1].sum() * Hq
    out, lse = merge_partial(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    mask = torch.ones(S, S, dtype=torch.bool).tril() & doc_rule(docs, docs)
    r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, k, v, mask, dout, None)
    assert torch.allclose(out.double(), r_out, atol=1e-5) and torch.allclose(lse.double(), r_lse, atol=1e-5)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for kp, p in zip(shards, plans):
        g = partial.attention_backward(dout, q, k[:, kp], v[:, kp], out, lse, q_pos=pos, k_pos=kp, block_size=bs,
                                       impl=impl, q_doc=docs, k_doc=docs[:, kp], plans=p)
        dq += g[0]
        dk[:, kp] += g[1]
        dv[:, kp] += g[2]
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert torch.allclose(got.double(), want, atol=1e-4), (got.double() - want).abs().max()


@pytest.mark.parametrize("impl", IMPLS)
def test_vertical_slash_and_dense_with_documents(impl):
    gen = torch.Generator().manual_seed(13)
    B, Hq, Hkv, D, bs, S = 1, 4, 2, 16, 16, 72  # ragged last block
    docs = packed_doc_ids([9, 1, 30, 32])[None]
    q = torch.randn(B, S, Hq, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    v = torch.randn(B, S, Hkv, D, generator=gen)
    dout = torch.randn(B, S, Hq, D, generator=gen)
    index = SparseIndex.from_lines(torch.randint(-1, S, (B, Hq, 5), generator=gen),
                                   torch.randint(-1, S, (B, Hq, 3), generator=gen), S, bs)
    mask = index.to_mask() & doc_rule(docs, docs)
    r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, k, v, mask, dout, None)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = vertical_slash_attention(qg, kg, vg, index, return_lse=True, impl=impl, doc_ids=docs)
    out.backward(dout)
    assert torch.allclose(out.detach().double(), r_out, atol=1e-5) and torch.allclose(lse.double(), r_lse, atol=1e-5)
    for got, want in ((qg.grad, r_dq), (kg.grad, r_dk), (vg.grad, r_dv)):
        assert torch.allclose(got.double(), want, atol=1e-4), (got.double() - want).abs().max()
    assert index._cache.get("doc") is None  # doc-filtered lists never enter the index's cache
    if impl == "torch":  # dense_attention picks its own backend (Triton on CUDA, PyTorch here)
        out_d, lse_d = dense_attention(q, k, v, doc_ids=docs, return_lse=True)
        r_out, r_lse = reference.attention(q.double(), k.double(), v.double(), doc_rule(docs, docs), causal=True)
        assert torch.allclose(out_d.double(), r_out, atol=1e-5) and torch.allclose(lse_d.double(), r_lse, atol=1e-5)


def test_one_document_is_bit_identical_to_no_documents():
    gen = torch.Generator().manual_seed(14)
    B, Hq, Hkv, D, bs, S = 1, 2, 1, 16, 8, 40
    q, k, v, dout = (torch.randn(B, S, h, D, generator=gen) for h in (Hq, Hkv, Hkv, Hq))
    pos = torch.arange(S)
    same = torch.full((B, S), 5)
    a = partial.attention_forward(q, k, v, q_pos=pos, k_pos=pos, block_size=bs, impl="torch")
    b = partial.attention_forward(q, k, v, q_pos=pos, k_pos=pos, block_size=bs, impl="torch", q_doc=same, k_doc=same)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ga = partial.attention_backward(dout, q, k, v, *a, q_pos=pos, k_pos=pos, block_size=bs, impl="torch")
    gb = partial.attention_backward(dout, q, k, v, *a, q_pos=pos, k_pos=pos, block_size=bs, impl="torch",
                                    q_doc=same, k_doc=same)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_estimator_scores_only_the_last_document():
    gen = torch.Generator().manual_seed(15)
    B, Hq, Hkv, D, S = 1, 2, 1, 16, 96
    q = torch.randn(B, S, Hq, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    docs = packed_doc_ids([40, 30, 26])[None]  # the last 16 queries all lie in the third document
    probs = last_query_probs(q, k, 16, doc_ids=docs)
    assert torch.all(probs[..., :70] == 0)
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-6)
    est = dict(recall=1.0, last_q=16, block_size=16, min_vertical=1, min_slash=1, max_slash=1, sample_blocks=0)
    index = estimate_vertical_slash(q, k, doc_ids=docs, **est)
    assert torch.all(index.col_ids[index.col_ids >= 0] >= 70)  # no vertical outside the scored document
    plain = estimate_vertical_slash(q, k, **est)
    assert (plain.col_ids[plain.col_ids >= 0] < 70).any()  # without ids, earlier documents win verticals
    same = estimate_vertical_slash(q, k, doc_ids=torch.zeros(B, S, dtype=torch.long), **est)
    assert torch.equal(plain.block_ids, same.block_ids) and torch.equal(plain.col_ids, same.col_ids)


def test_bad_document_ids_are_refused():
    q = torch.randn(1, 8, 2, 16)
    pos = torch.arange(8)
    with pytest.raises(ValueError, match="q_doc and k_doc"):
        partial.attention_forward(q, q, q, q_pos=pos, k_pos=pos, block_size=4, impl="torch", q_doc=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="q_doc must be"):
        partial.attention_forward(q, q, q, q_pos=pos, k_pos=pos, block_size=4, impl="torch",
                                  q_doc=torch.zeros(8, dtype=torch.long), k_doc=torch.zeros(1, 8, dtype=torch.long))
