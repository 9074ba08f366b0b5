"""FlexAttention engine (mtrain.ops.flex): the BlockMask built from our index is token-exact (vertical
columns not rounded up to blocks), with documents too; forward + lse against a float64 reference on CPU."""

import pytest
import torch

from mtrain.ops import SparseIndex, reference, vertical_slash_attention
from mtrain.ops.flex import flex_block_mask
from test_ops_sparse_attention import make_inputs, random_lines


def flex_dense_mask(bm, B, H, S):
    """The token mask a BlockMask computes: full blocks whole, partial blocks through mask_mod."""
    bs = bm.BLOCK_SIZE[0]
    n = -(-S // bs)
    pos = torch.arange(S)
    b, h, qi, ki = torch.meshgrid(torch.arange(B), torch.arange(H), pos, pos, indexing="ij")
    mod = bm.mask_mod(b, h, qi, ki)
    out = torch.zeros(B, H, S, S, dtype=torch.bool)
    kinds = ((bm.kv_num_blocks, bm.kv_indices, False), (bm.full_kv_num_blocks, bm.full_kv_indices, True))
    for nums, ids, is_full in kinds:
        for bb in range(B):
            for hh in range(H):
                for i in range(n):
                    for t in range(int(nums[bb, hh, i])):
                        j = int(ids[bb, hh, i, t])
                        rq, rk = slice(i * bs, (i + 1) * bs), slice(j * bs, (j + 1) * bs)
                        out[bb, hh, rq, rk] |= True if is_full else mod[bb, hh, rq, rk]
    return out


@pytest.mark.parametrize("S,bs,docs", [(72, 16, False), (80, 16, True)])
def test_block_mask_is_token_exact(S, bs, docs):
    gen = torch.Generator().manual_seed(S)
    vertical, slash = random_lines(2, 3, S, 6, 2, gen)
    index = SparseIndex.from_lines(vertical, slash, S, bs)
    assert index.col_counts.sum() > 0
    want = index.to_mask()
    doc = None
    if docs:
        doc = torch.cumsum(torch.rand(2, S, generator=gen) < 0.05, -1)
        want &= doc[:, None, :, None] == doc[:, None, None, :]
    bm = flex_block_mask(index, doc)
    assert torch.equal(flex_dense_mask(bm, 2, 3, S), want)  # what the fused kernels compute
    pos = torch.arange(S)
    b, h, qi, ki = torch.meshgrid(torch.arange(2), torch.arange(3), pos, pos, indexing="ij")
    assert torch.equal(bm.mask_mod(b, h, qi, ki), want)  # what Flex's eager path computes


def test_index_with_per_block_columns_is_refused():
    index = SparseIndex.from_lines(torch.tensor([[[20, 21]]]), torch.tensor([[[0]]]), 64, 16)
    assert index.col_counts[0, 0].tolist() == [0, 0, 2, 2]
    index.col_counts[0, 0, 3] = 1  # block 3 keeps column 20 but not 21: not one column set per head
    with pytest.raises(ValueError, match="cannot be expressed exactly"):
        flex_block_mask(index)


def test_bad_document_ids_are_refused():
    index = SparseIndex.from_lines(torch.tensor([[[20]]]), torch.tensor([[[0]]]), 64, 16)
    with pytest.raises(ValueError, match="doc_ids must be"):
        flex_block_mask(index, torch.zeros(1, 63, dtype=torch.long))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_matches_float64_reference():
    """Eager Flex on CPU (forward only: torch has no Flex backward on CPU), GQA 2, ragged S, documents."""
    q, k, v, _, gen = make_inputs(1, 72, 4, 2, 16, torch.float64, seed=2)
    vertical, slash = random_lines(1, 4, 72, 5, 3, gen)
    index = SparseIndex.from_lines(vertical, slash, 72, 16)
    doc = torch.tensor([[0] * 30 + [1] * 42])
    for d in (None, doc):
        out, lse = vertical_slash_attention(q, k, v, index, return_lse=True, impl="flex", doc_ids=d)
        mask = index.to_mask()
        if d is not None:
            mask &= d[:, None, :, None] == d[:, None, None, :]
        r_out, r_lse = reference.attention(q, k, v, mask)
        assert out.shape == q.shape and lse.shape == (1, 4, 72)
        assert torch.allclose(out, r_out, atol=1e-10, rtol=0)
        assert torch.allclose(lse.double(), r_lse, atol=1e-6, rtol=0)
