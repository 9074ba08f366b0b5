"""The ring's running sums on one process: PartialAccumulator's LSE merge (taken-over first part, in-place fp32
merges, final merge into the output dtype) against attention over the union of key sets; GradSum's sums."""

from __future__ import annotations

import math

import pytest
import torch

from mtrain.ops import merge_partial
from mtrain.parallel.merge import GradSum, PartialAccumulator

B, S, H, D = 2, 48, 3, 16


def _attend(q, k, v, scale):
    """(out [B, S, H, D], lse [B, H, S]) of plain softmax attention over all of k (float64)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v), lse


def _parts(n_parts: int, seed: int):
    """Queries and n_parts disjoint key sets; the union's attention is the reference."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    ks = [torch.randn(B, 8 + 4 * n, H, D, generator=g, dtype=torch.float64) for n in range(n_parts)]
    vs = [torch.randn(B, 8 + 4 * n, H, D, generator=g, dtype=torch.float64) for n in range(n_parts)]
    scale = 1.0 / math.sqrt(D)
    parts = [_attend(q, k, v, scale) for k, v in zip(ks, vs)]
    return parts, _attend(q, torch.cat(ks, 1), torch.cat(vs, 1), scale)


@pytest.mark.parametrize("n_parts", [1, 2, 3, 4])
def test_merge_in_fp32_equals_attention_over_the_union(n_parts):
    parts, (ref_out, ref_lse) = _parts(n_parts, seed=n_parts)
    acc = PartialAccumulator(torch.empty(B, S, H, D))
    first_out = parts[0][0].float()
    for n, (out, lse) in enumerate(parts):
        acc.add(out.float() if n else first_out, lse.float(), final=n == n_parts - 1)
    out, lse = acc.result(torch.float32)
    assert (out.double() - ref_out).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5
    if n_parts == 1:
        assert out is first_out, "a single part covering every row must be taken over, not copied"


@pytest.mark.parametrize("n_parts", [2, 3])
def test_final_merge_in_bf16_rounds_once_like_fp32_then_cast(n_parts):
    parts, _ = _parts(n_parts, seed=10 + n_parts)
    acc = PartialAccumulator(torch.empty(B, S, H, D, dtype=torch.bfloat16))
    for n, (out, lse) in enumerate(parts):
        acc.add(out.bfloat16(), lse.float(), final=n == n_parts - 1)
    got, got_lse = acc.result(torch.bfloat16)
    # the same merges done with merge_partial in fp32, cast at the end
    want, want_lse = parts[0][0].bfloat16().float(), parts[0][1].float()
    for out, lse in parts[1:]:
        want, want_lse = merge_partial(want, want_lse, out.bfloat16(), lse.float())
    assert got.dtype == torch.bfloat16
    # one bf16 rounding of values that agree to fp32 precision: at most one bf16 ulp apart
    ulp = want.abs().clamp(min=1e-30) * 2.0**-7
    assert bool(((got.float() - want).abs() <= ulp).all())
    assert (got_lse - want_lse).abs().max() < 1e-6


def test_merge_rows_and_empty_rows():
    """Parts for row ranges (a dense rectangle's rows), rows one side saw no key in, rows no key reached."""
    parts, _ = _parts(2, seed=5)
    (oa, la), (ob, lb) = [(o.float(), lse.float()) for o, lse in parts]
    la[:, :, 12:15] = float("-inf")  # rows 12..14 saw no key of part a
    oa[:, 12:15] = 0.0
    acc = PartialAccumulator(torch.empty(B, S, H, D))
    acc.add(oa[:, 10:], la[:, :, 10:], rows=slice(10, S))  # does not cover every row: an empty start
    acc.add(ob[:, :20], lb[:, :, :20], rows=slice(0, 20), final=True)
    out, lse = acc.result(torch.float32)
    want_mid, want_mid_lse = merge_partial(oa[:, 10:20], la[:, :, 10:20], ob[:, 10:20], lb[:, :, 10:20])
    assert (out[:, 10:20] - want_mid).abs().max() < 1e-6
    assert (lse[:, :, 10:20] - want_mid_lse).abs().max() < 1e-6
    assert (out[:, 12:15] - ob[:, 12:15]).abs().max() < 1e-6  # only part b's keys there
    assert torch.equal(out[:, :10], ob[:, :10]) and torch.equal(lse[:, :, :10], lb[:, :, :10])
    assert torch.equal(out[:, 20:], oa[:, 20:]) and torch.equal(lse[:, :, 20:], la[:, :, 20:])
    # a row with no key on either side stays empty: out 0, lse -inf, no NaN
    acc = PartialAccumulator(torch.empty(1, 2, 1, 4))
    acc.add(torch.zeros(1, 2, 1, 4), torch.full((1, 1, 2), float("-inf")))
    acc.add(torch.zeros(1, 2, 1, 4), torch.full((1, 1, 2), float("-inf")), final=True)
    out, lse = acc.result(torch.float32)
    assert torch.equal(out, torch.zeros(1, 2, 1, 4)) and bool(torch.isinf(lse).all())


def test_grad_sum_takes_over_the_first_full_part_and_adds_in_fp32():
    g = torch.Generator().manual_seed(0)
    like = torch.empty(B, S, H, D, dtype=torch.bfloat16)
    full32 = torch.randn(B, S, H, D, generator=g)
    part16 = torch.randn(B, 20, H, D, generator=g).bfloat16()
    want = full32.clone()
    want[:, 5:25] += part16.float()
    total = GradSum(like)
    total.add(full32)
    assert total.value() is full32  # an fp32 kernel output is summed into, not copied
    total.add(part16, rows=slice(5, 25))
    assert torch.equal(total.value(), want)
    # a 16-bit first part over some rows starts from zeros; the sum stays fp32
    rows_only = GradSum(like)
    rows_only.add(part16, rows=slice(0, 20))
    assert rows_only.value().dtype == torch.float32
    assert torch.equal(rows_only.value()[:, :20], part16.float()) and not rows_only.value()[:, 20:].any()
    assert not GradSum(like).value().any()
