"""Dense attention over packed documents (mtrain.ops.varlen): every backend the machine runs against a float64
reference with a materialized mask; the GPU backends skip where absent."""

import pytest
import torch

from mtrain.ops import dense_attention
from mtrain.ops.backends import has_flash_attn
from mtrain.ops.varlen import (VARLEN_BACKENDS, Documents, Segments, document_attention, varlen_attention,
                               varlen_backend)


def reference(q, k, v, q_pos, k_pos, q_doc, k_doc, scale):
    """float64 attention with the mask written out: key j visible to query i iff same document and k_pos <= q_pos."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = (q_doc[:, None] == k_doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def runnable(backend, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if backend in ("fa4", "flash_attn"):
        if device != "cuda":
            pytest.skip(f"{backend} runs on CUDA only")
        probe = torch.zeros(1, 1, 64, device="cuda", dtype=torch.bfloat16)
        if backend == "fa4" and varlen_backend(probe) != "fa4":
            pytest.skip("FlashAttention-4 is not installed or does not run on this GPU")
        if backend == "flash_attn" and not has_flash_attn():
            pytest.skip("flash-attn 2 is not installed")


DEVICES = ["cpu", "cuda"]
# (dtype, atol): fp32 on the CPU; bf16 where the GPU kernels run (bf16 rounding of the output, within 2x of a
# same-precision PyTorch run against float64: flash-attn's rule, written out as a fixed tolerance at these sizes)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", VARLEN_BACKENDS)
def test_documents_match_reference(backend, device):
    runnable(backend, device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    lengths = [[70, 5, 53], [1, 127]]  # a one-token document; rows of different splits
    B, S, Hq, Hkv, D = 2, 128, 4, 2, 64
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    docs = Documents.from_doc_ids(doc_ids, device)
    q, k, v = (torch.randn(B, S, h, D, device=device, dtype=dtype, requires_grad=True) for h in (Hq, Hkv, Hkv))
    out = document_attention(q, k, v, docs, softmax_scale=0.125, backend=backend)
    grad = torch.randn_like(out)
    out.backward(grad)
    pos = torch.cat([torch.arange(n) for row in lengths for n in row]).to(device)
    flat_doc = (doc_ids + torch.arange(B)[:, None] * 10).reshape(-1).to(device)
    qd, kd, vd = (t.detach().reshape(B * S, *t.shape[2:]).double().requires_grad_() for t in (q, k, v))
    want = reference(qd, kd, vd, pos, pos, flat_doc, flat_doc, 0.125)
    want.backward(grad.reshape(B * S, Hq, D).double())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.reshape(B * S, Hq, D).double(), want, atol=tol, rtol=0)
    for got, ref in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(got.grad.reshape(ref.shape).double(), ref.grad, atol=4 * tol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", VARLEN_BACKENDS)
def test_more_keys_than_queries_is_causal_from_the_bottom_right(backend, device):
    """The ring's gathered dense step: a shard's rows of a document see the document's keys up to themselves."""
    runnable(backend, device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(1)
    seg = Segments.build([16, 40, 8], [80, 40, 64], device)
    Hq, Hkv, D = 6, 3, 64
    q = torch.randn(seg.total_q, Hq, D, device=device, dtype=dtype)
    k, v = (torch.randn(seg.total_k, Hkv, D, device=device, dtype=dtype) for _ in range(2))
    out = varlen_attention(q, k, v, seg, backend=backend)
    entry_q = torch.repeat_interleave(torch.arange(3), torch.tensor(seg.q_lengths)).to(device)
    entry_k = torch.repeat_interleave(torch.arange(3), torch.tensor(seg.k_lengths)).to(device)
    q_pos = torch.cat([torch.arange(lk - lq, lk) for lq, lk in zip(seg.q_lengths, seg.k_lengths)]).to(device)
    k_pos = torch.cat([torch.arange(lk) for lk in seg.k_lengths]).to(device)
    want = reference(q, k, v, q_pos, k_pos, entry_q, entry_k, D ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=0)


def test_dense_attention_with_documents_equals_its_doc_ids_form():
    """dense_attention(documents=) and (doc_ids=) give the varlen result; with return_lse the partial kernels run,
    which agree with it."""
    torch.manual_seed(2)
    doc_ids = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14])
    q, k, v = (torch.randn(1, 64, h, 32, dtype=torch.float64) for h in (4, 2, 2))
    docs = Documents.from_doc_ids(doc_ids)
    a = dense_attention(q, k, v, documents=docs)
    b = dense_attention(q, k, v, doc_ids=doc_ids)
    c, lse = dense_attention(q, k, v, doc_ids=doc_ids, return_lse=True)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    torch.testing.assert_close(a, c, atol=1e-10, rtol=0)
    assert lse.shape == (1, 4, 64)


def test_documents_boundaries():
    doc_ids = torch.tensor([[3, 3, 3, 7, 7, 9], [0, 1, 1, 1, 1, 1]])
    docs = Documents.from_doc_ids(doc_ids)
    assert docs.lengths == ((3, 2, 1), (1, 5))
    assert docs.segments.cu_q.tolist() == [0, 3, 5, 6, 7, 12]
    assert docs.segments.cu_q.dtype == torch.int32 and docs.max_len == 5
    assert docs.starts(0) == [0, 3, 5] and docs.segments.pairs() == 6 + 3 + 1 + 1 + 15


@pytest.mark.parametrize("bad, words", [
    (torch.tensor([[0, 0, 1, 1, 0]]), "more than one run"),
    (torch.zeros(1, 4), "integer tensor"),
    (torch.zeros(4, dtype=torch.long), "integer tensor"),
])
def test_documents_refuse_bad_ids(bad, words):
    with pytest.raises(ValueError, match=words):
        Documents.from_doc_ids(bad)


def test_varlen_refuses_mismatched_shapes():
    seg = Segments.build([4, 4])
    q, k = torch.randn(8, 2, 16), torch.randn(7, 1, 16)
    with pytest.raises(ValueError, match="hold 8 queries and 8 keys"):
        varlen_attention(q, k, k, seg)
    with pytest.raises(ValueError, match="one of"):
        varlen_attention(q, q[:, :1], q[:, :1], seg, backend="nope")
    with pytest.raises(ValueError, match=">= its query length"):
        Segments.build([4, 5], [4, 3])
