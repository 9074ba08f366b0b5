"""Ring-facing partial attention (mtrain.ops.partial) against a float64 reference whose mask is built by
explicit loops: block-striped shards, LSE merging across shards, empty rows, torch and Triton paths."""

import pytest
import torch

from mtrain.ops import merge_partial, partial, reference
from test_ops_interpreter import needs_interpreter

IMPLS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def loop_mask(q_pos, k_pos, B, H, blocks, columns, bs, causal=True):
    """Independent (slow, loop-based) statement of the partial-attention mask contract."""
    Sq, Sk = len(q_pos), len(k_pos)
    m = torch.zeros(B, H, Sq, Sk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for qi in range(Sq):
                i = qi // bs
                keys = set()
                if blocks is None:
                    keys = set(range(Sk))
                else:
                    ids, cnt = blocks
                    for n in range(int(cnt[b, h, i])):
                        j = int(ids[b, h, i, n])
                        keys |= set(range(j * bs, min(Sk, (j + 1) * bs)))
                if columns is not None:
                    ids, cnt = columns
                    keys |= {int(ids[b, h, i, n]) for n in range(int(cnt[b, h, i]))}
                for kj in keys:
                    if not causal or int(k_pos[kj]) <= int(q_pos[qi]):
                        m[b, h, qi, kj] = True
    return m


def random_lists(B, H, nqb, nkb, bs, Sk, p_block, n_cols, gen):
    """Random sorted block lists and columns outside the listed blocks (the SparseIndex invariants)."""
    take = torch.rand(B, H, nqb, nkb, generator=gen) < p_block
    maxb = max(1, int(take.sum(-1).max()))
    ids = torch.full((B, H, nqb, maxb), -1, dtype=torch.int32)
    cnt = take.sum(-1).int()
    cols = torch.full((B, H, nqb, max(1, n_cols)), -1, dtype=torch.int32)
    ccnt = torch.zeros(B, H, nqb, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for i in range(nqb):
                js = torch.nonzero(take[b, h, i]).flatten()
                ids[b, h, i, : len(js)] = js.int()
                free = [t for t in range(Sk) if not take[b, h, i, t // bs]]
                if free and n_cols:
                    pick = torch.randperm(len(free), generator=gen)[:n_cols]
                    chosen = sorted(free[int(x)] for x in pick)
                    cols[b, h, i, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
                    ccnt[b, h, i] = len(chosen)
    return (ids, cnt), (cols, ccnt)


def block_stripe_positions(S, world, stripe, rank):
    """Global positions held by `rank` under block-striping with stripes of `stripe` tokens."""
    pos = torch.arange(S).view(-1, stripe)
    return pos[rank::world].flatten()


def ref_grads(q, k, v, mask, dout, scale):
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, lse = reference.attention(q64, k64, v64, mask, softmax_scale=scale)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("group", [1, 2])
def test_block_striped_step_matches_reference(impl, group):
    gen = torch.Generator().manual_seed(1)
    B, Hkv, D, bs, S, W = 1, 2, 16, 16, 128, 2
    Hq = Hkv * group
    q_pos = block_stripe_positions(S, W, bs, 1)  # a query shard from rank 1
    k_pos = block_stripe_positions(S, W, bs, 0)  # KV that travelled from rank 0
    Sq, Sk = len(q_pos), len(k_pos)
    q = torch.randn(B, Sq, Hq, D, generator=gen)
    k = torch.randn(B, Sk, Hkv, D, generator=gen)
    v = torch.randn(B, Sk, Hkv, D, generator=gen)
    dout = torch.randn(B, Sq, Hq, D, generator=gen)
    blocks, columns = random_lists(B, Hq, Sq // bs, Sk // bs, bs, Sk, 0.5, 3, gen)
    scale = 0.3
    out, lse = partial.attention_forward(q, k, v, q_pos=q_pos, k_pos=k_pos, blocks=blocks, columns=columns,
                                         block_size=bs, softmax_scale=scale, impl=impl)
    mask = loop_mask(q_pos, k_pos, B, Hq, blocks, columns, bs)
    r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, k, v, mask, dout, scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    assert torch.allclose(out.double(), r_out, atol=1e-5, rtol=0)
    fin = ~torch.isinf(r_lse)
    assert torch.allclose(lse.double()[fin], r_lse[fin], atol=1e-5, rtol=0)
    dq, dk, dv = partial.attention_backward(dout, q, k, v, out, lse, q_pos=q_pos, k_pos=k_pos, blocks=blocks,
                                            columns=columns, block_size=bs, softmax_scale=scale, impl=impl)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=0), _rel(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_two_shards_merge_to_full_attention(impl):
    """Ring rule: per-shard forward merged by LSE, and per-shard backward with the merged out/lse,
    reproduce full causal attention over the union of the shards."""
    gen = torch.Generator().manual_seed(2)
    B, Hq, Hkv, D, bs, S = 1, 4, 2, 16, 8, 48
    q = torch.randn(B, S, Hq, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    v = torch.randn(B, S, Hkv, D, generator=gen)
    dout = torch.randn(B, S, Hq, D, generator=gen)
    pos = torch.arange(S)
    shards = [block_stripe_positions(S, 2, bs, r) for r in range(2)]
    q_pos = pos
    parts = []
    for kp in shards:
        parts.append(partial.attention_forward(q, k[:, kp], v[:, kp], q_pos=q_pos, k_pos=kp, block_size=bs,
                                               impl=impl))
    out, lse = merge_partial(parts[0][0], parts[0][1], parts[1][0], parts[1][1])
    r_out, r_lse, r_dq, r_dk, r_dv = ref_grads(q, k, v, torch.ones(S, S, dtype=torch.bool).tril(), dout, None)
    assert torch.allclose(out.double(), r_out, atol=1e-5)
    assert torch.allclose(lse.double(), r_lse, atol=1e-5)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for kp in shards:
        g = partial.attention_backward(dout, q, k[:, kp], v[:, kp], out, lse, q_pos=q_pos, k_pos=kp, block_size=bs,
                                       impl=impl)
        dq += g[0]
        dk[:, kp] += g[1]
        dv[:, kp] += g[2]
    for got, want in ((dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert torch.allclose(got.double(), want, atol=1e-4), _rel(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_keys_and_columns_only(impl):
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, bs, S = 1, 2, 1, 16, 4, 16
    q = torch.randn(B, S, Hq, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    v = torch.randn(B, S, Hkv, D, generator=gen)
    pos = torch.arange(S)
    nqb = S // bs
    empty = (torch.full((B, Hq, nqb, 1), -1, dtype=torch.int32), torch.zeros(B, Hq, nqb, dtype=torch.int32))
    out, lse = partial.attention_forward(q, k, v, q_pos=pos, k_pos=pos, blocks=empty, block_size=bs, impl=impl)
    assert torch.all(torch.isneginf(lse)) and torch.all(out == 0)
    dq, dk, dv = partial.attention_backward(torch.randn_like(q), q, k, v, out, lse, q_pos=pos, k_pos=pos,
                                            blocks=empty, block_size=bs, impl=impl)
    assert torch.all(dq == 0) and torch.all(dk == 0) and torch.all(dv == 0)
    # Columns only (the ring's off-ring vertical pass): keys 1 and 9 for every query block.
    cols = torch.tensor([1, 9], dtype=torch.int32).expand(B, Hq, nqb, 2).contiguous()
    columns = (cols, torch.full((B, Hq, nqb), 2, dtype=torch.int32))
    out, lse = partial.attention_forward(q, k, v, q_pos=pos, k_pos=pos, blocks=empty, columns=columns,
                                         block_size=bs, impl=impl)
    mask = loop_mask(pos, pos, B, Hq, empty, columns, bs)
    r_out, r_lse = reference.attention(q.double(), k.double(), v.double(), mask)
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    assert torch.isneginf(lse[:, :, 0]).all()  # row 0 sees neither key 1 nor key 9
    assert torch.allclose(out.double(), r_out, atol=1e-5)


@needs_interpreter
def test_column_only_backward_skips_the_block_pass():
    """plans[NO_BLOCKS] (the fa4 engine's column path) gives the gradients of the full column-only backward, against
    the float64 reference over the columns' pairs."""
    from mtrain.ops._triton_attention import NO_BLOCKS

    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, bs, S = 1, 4, 2, 16, 16, 64
    q, k, v = (torch.randn(B, S, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
    pos = torch.arange(S)
    nqb = S // bs
    empty = (torch.full((B, Hq, nqb, 1), -1, dtype=torch.int32), torch.zeros(B, Hq, nqb, dtype=torch.int32))
    cols = torch.tensor([0, 5, 20, 33, 50], dtype=torch.int32).expand(B, Hq, nqb, 5).contiguous()
    columns = (cols, torch.full((B, Hq, nqb), 5, dtype=torch.int32))
    kw = dict(q_pos=pos, k_pos=pos, blocks=empty, columns=columns, block_size=bs, impl="triton")
    out, lse = partial.attention_forward(q, k, v, **kw)
    dout = torch.randn_like(q)
    rows = torch.isfinite(lse).transpose(1, 2)[..., None]  # rows that see a column
    dout = torch.where(rows, dout, 0.0)
    got = partial.attention_backward(dout, q, k, v, out, lse, plans={NO_BLOCKS: True}, **kw)
    full = partial.attention_backward(dout, q, k, v, out, lse, plans={}, **kw)
    mask = loop_mask(pos, pos, B, Hq, empty, columns, bs)
    qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
    r_out, _ = reference.attention(qr, kr, vr, mask)
    torch.where(rows, r_out, 0.0).backward(dout.double())
    for a, b, want in zip(got, full, (qr.grad, kr.grad, vr.grad)):
        assert torch.equal(a, b)
        assert torch.allclose(a.double(), want, atol=1e-5)
    # another pass's gradients accumulated in place (the fa4 engine adds into FA4's), in their dtypes
    init = (torch.randn_like(q).to(torch.bfloat16), torch.randn_like(k).to(torch.bfloat16), torch.randn_like(v))
    before = tuple(t.clone() for t in init)
    summed = partial.attention_backward(dout, q, k, v, out, lse, plans={NO_BLOCKS: True}, grad_init=init, **kw)
    for a, b, i, i0 in zip(summed, got, init, before):
        assert a is i or a.data_ptr() == i.data_ptr()  # in place
        assert a.dtype == i0.dtype
        if i0.dtype == torch.bfloat16:  # fp32 sum, rounded once (to within one bf16 step)
            torch.testing.assert_close(a, (b + i0.float()).to(torch.bfloat16), atol=0, rtol=2 ** -7)
        else:
            torch.testing.assert_close(a, b + i0, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_adds_grad_init(impl):
    """grad_init is added to the gradients of a step with blocks and columns (Triton: dq inside the dQ pass)."""
    gen = torch.Generator().manual_seed(8)
    B, Hq, Hkv, D, bs, S = 1, 2, 1, 16, 16, 48
    q, k, v = (torch.randn(B, S, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
    pos = torch.arange(S)
    blocks, columns = random_lists(B, Hq, S // bs, S // bs, bs, S, 0.5, 2, gen)
    kw = dict(q_pos=pos, k_pos=pos, blocks=blocks, columns=columns, block_size=bs, impl=impl)
    out, lse = partial.attention_forward(q, k, v, **kw)
    dout = torch.where(torch.isfinite(lse).transpose(1, 2)[..., None], torch.randn_like(q), 0.0)
    plain = partial.attention_backward(dout, q, k, v, out, lse, **kw)
    init = (torch.randn_like(q), torch.randn_like(k), torch.randn_like(v))
    before = tuple(t.clone() for t in init)
    summed = partial.attention_backward(dout, q, k, v, out, lse, grad_init=init, **kw)
    for a, b, i, i0 in zip(summed, plain, init, before):
        assert a.data_ptr() == i.data_ptr()  # accumulated in place
        torch.testing.assert_close(a, b + i0, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="grad_init must hold"):
        partial.attention_backward(dout, q, k, v, out, lse, grad_init=init[::-1], **kw)
    strided = (torch.randn(B, S, Hq, 2 * D)[..., ::2], init[1], init[2])
    with pytest.raises(ValueError, match="contiguous last dim"):
        partial.attention_backward(dout, q, k, v, out, lse, grad_init=strided, **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_forward_merges_into_another_result(impl):
    """merge_into: a step over the columns merged in place into a step over the blocks of the same rows (the fa4
    engine's forward) gives attention over both, against float64; rows only one side sees keep that side's."""
    gen = torch.Generator().manual_seed(9)
    B, Hq, Hkv, D, bs, S = 1, 2, 1, 16, 16, 48
    q, k, v = (torch.randn(B, S, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
    pos = torch.arange(S)
    nqb = S // bs
    blocks, columns = random_lists(B, Hq, nqb, nqb, bs, S, 0.4, 3, gen)
    none = (torch.full((B, Hq, nqb, 1), -1, dtype=torch.int32), torch.zeros(B, Hq, nqb, dtype=torch.int32))
    kw = dict(q_pos=pos, k_pos=pos, block_size=bs, impl=impl)
    out_a, lse_a = partial.attention_forward(q, k, v, blocks=blocks, **kw)
    target = (out_a.clone(), lse_a.clone())
    got_out, got_lse = partial.attention_forward(q, k, v, blocks=none, columns=columns, merge_into=target, **kw)
    assert got_out.data_ptr() == target[0].data_ptr() and got_lse.data_ptr() == target[1].data_ptr()
    mask = loop_mask(pos, pos, B, Hq, blocks, columns, bs)
    want_out, want_lse = reference.attention(q.double(), k.double(), v.double(), mask)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(want_lse))
    seen = torch.isfinite(want_lse)
    assert torch.allclose(got_lse[seen].double(), want_lse[seen], atol=1e-5)
    assert torch.allclose(got_out.double(), want_out, atol=1e-5)
    with pytest.raises(ValueError, match="merge_into must be"):
        partial.attention_forward(q, k, v, blocks=none, columns=columns, merge_into=(out_a.half(), lse_a), **kw)


def test_merge_partial_handles_empty_sides():
    gen = torch.Generator().manual_seed(4)
    out = torch.randn(1, 3, 2, 4, generator=gen)
    lse = torch.randn(1, 2, 3, generator=gen)
    none = torch.full_like(lse, float("-inf"))
    m_out, m_lse = merge_partial(out, lse, torch.zeros_like(out), none)
    assert torch.allclose(m_out, out) and torch.allclose(m_lse, lse)
    m_out, m_lse = merge_partial(torch.zeros_like(out), none, torch.zeros_like(out), none)
    assert torch.all(m_out == 0) and torch.all(torch.isneginf(m_lse))
    big = lse + 1e4  # would overflow exp() without the max shift
    m_out, m_lse = merge_partial(out, big, out, big)
    assert torch.allclose(m_lse, big + torch.log(torch.tensor(2.0)), rtol=0, atol=1e-3)
    assert torch.allclose(m_out, out)


def test_bad_shapes_are_refused_with_a_clear_message():
    q = torch.randn(1, 8, 2, 16)
    k = torch.randn(1, 8, 2, 16)
    pos = torch.arange(8)
    with pytest.raises(ValueError, match="q_pos"):
        partial.attention_forward(q, k, k, q_pos=pos[:4], k_pos=pos, block_size=4, impl="torch")
    with pytest.raises(ValueError, match="impl='torch'"):
        partial.attention_forward(q.double(), k.double(), k.double(), q_pos=pos, k_pos=pos, block_size=4,
                                  impl="triton")
    with pytest.raises(ValueError, match="blocks"):
        partial.attention_forward(q, k, k, q_pos=pos, k_pos=pos, block_size=4, impl="torch",
                                  blocks=(torch.zeros(1, 2, 3, 1, dtype=torch.int32), torch.zeros(1, 2, 3)))


@needs_interpreter
def test_lists_past_the_kernels_32_bit_offsets_are_refused_at_launch(monkeypatch):
    """A block or column list tensor with more entries than the kernels address with 32-bit offsets
    (`mtrain.ops.lists.MAX_LIST_ENTRIES`, lowered here) is refused with an error that names the lists and the fix,
    where the kernels would read out of bounds; at the limit it runs."""
    from mtrain.errors import MtrainError
    from mtrain.ops import lists

    q, k, v = (torch.randn(1, 64, 1, 16) for _ in range(3))
    pos = torch.arange(64)
    blocks = (torch.arange(4, dtype=torch.int32).view(1, 1, 4, 1), torch.ones(1, 1, 4, dtype=torch.int32))
    cols = (torch.full((1, 1, 4, 8), -1, dtype=torch.int32), torch.zeros(1, 1, 4, dtype=torch.int32))
    kw = dict(q_pos=pos, k_pos=pos, blocks=blocks, columns=cols, block_size=16, softmax_scale=0.25, causal=True,
              impl="triton")
    monkeypatch.setattr(lists, "MAX_LIST_ENTRIES", 32)
    out, _ = partial.attention_forward(q, k, v, **kw)
    assert torch.isfinite(out).all()
    monkeypatch.setattr(lists, "MAX_LIST_ENTRIES", 31)
    with pytest.raises(MtrainError, match=r"column lists of shape \(1, 1, 4, 8\) hold 32 entries.*max_vertical"):
        partial.attention_forward(q, k, v, **kw)
    monkeypatch.setattr(lists, "MAX_LIST_ENTRIES", 3)
    with pytest.raises(MtrainError, match="block lists"):
        partial.attention_forward(q, k, v, **{**kw, "columns": None})
