"""Sparse attention within packed documents on one device (`mtrain.models.attention._per_document`): each long
enough document estimated and run as a causal sequence of its own, the rest in one dense varlen call."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from mtrain.models.attention import document_key, mtrain_attention
from mtrain.attention_settings import PolicySettings
from mtrain.models.runtime import AttentionRuntime, AttentionSettings
from mtrain.ops import cost
from mtrain.parallel import SparseSettings

BS, HQ, HKV, D = 64, 4, 2, 16
# three long documents (two of one length class) around two short ones (under two blocks: always dense)
LENGTHS = (300, 70, 520, 40, 400)
LOCAL = SparseSettings(recall=0.6, block_size=BS, max_vertical=3, max_slash=3, min_vertical=0, min_slash=0)


RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
"""The attention runtime of the layer `call` runs (`mtrain.models.runtime`): fresh for every test."""


@pytest.fixture(autouse=True)
def fresh_context():
    global RT
    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
    yield


def inputs(lengths=LENGTHS, seed=0, dtype=torch.float32):
    """Per document: rotary-like features (attention peaks near the diagonal) plus noise, from each document's own
    start, so every document has a local pattern the estimate keeps only part of."""
    g = torch.Generator().manual_seed(seed)
    S = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])
    freq = 0.5 ** torch.arange(D // 2)
    feat = torch.cat([(pos[:, None] * freq).cos(), (pos[:, None] * freq).sin()], -1)[None, :, None, :]
    q = 2.0 * feat.expand(1, S, HQ, D) + 0.3 * torch.randn(1, S, HQ, D, generator=g)
    k = feat.expand(1, S, HKV, D) + 0.3 * torch.randn(1, S, HKV, D, generator=g)
    v = torch.randn(1, S, HKV, D, generator=g)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    return [t.to(dtype) for t in (q, k, v)], ids


def call(q, k, v, settings, policy="always", training=True, layer=0):
    module = SimpleNamespace(training=training, layer_idx=layer, mtrain_runtime=RT)
    out, _ = mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              settings=settings, policy=policy, max_error=None)
    return out


def reference(q, k, v, lengths):
    """float64 attention with the written-out mask: causal within each document."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    S = ids.numel()
    allowed = (ids[:, None] == ids[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    rep = HQ // HKV
    qd, kd, vd = q.double()[0], k.double()[0].repeat_interleave(rep, 1), v.double()[0].repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * D ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd)[None]


def test_each_document_runs_as_its_own_sequence():
    """A packed call's rows of each document equal the same call on that document alone (the same estimate from the
    same rows, nothing read across a boundary); the documents under two blocks equal dense attention."""
    (q, k, v), ids = inputs()
    RT.set_documents(ids)
    packed = call(q, k, v, LOCAL)
    records = list(RT.records.layers)
    assert [r.path for r in records] == ["sparse"] * 3  # the three long documents, each estimated
    assert [r.layer for r in records] == [0, 0, 0]  # recorded under the layer: one letter per layer in the logs
    assert [document_key(0, n) for n in (300, 520, 400)] == ["00@512", "00@1K", "00@512"]  # the policy's keys
    RT.set_documents(None)
    start = 0
    for n in LENGTHS:
        alone = call(*(t[:, start:start + n] for t in (q, k, v)), LOCAL if n >= 2 * BS else None)
        torch.testing.assert_close(packed[:, start:start + n], alone, rtol=0, atol=1e-6)
        start += n
    # sparse: the long documents differ from dense attention within documents (the pattern drops pairs) ...
    dense = reference(q, k, v, LENGTHS)
    assert (packed[:, :300].double() - dense[:, :300]).abs().max() > 1e-3
    # ... the short ones do not
    torch.testing.assert_close(packed[:, 300:370].double(), dense[:, 300:370], rtol=0, atol=1e-5)


def test_full_recall_equals_dense_within_documents_forward_and_backward():
    """At recall 1 with caps that hold every line the pattern is the whole causal triangle of each document: the
    per-document path equals float64 attention within documents (fwd 1e-5, grads 1e-4, fp32)."""
    flat = SparseSettings(recall=1.0, block_size=BS, max_vertical=1024, max_slash=1024)
    (q, k, v), ids = inputs(seed=1)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    RT.set_documents(ids)
    out = call(q, k, v, flat)
    assert {r.path for r in RT.records.layers} == {"sparse"}
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, LENGTHS)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    grad = torch.randn_like(ref)
    out.backward(grad.float())
    ref.backward(grad)
    for got, want in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=0, atol=1e-4)


def test_the_backward_joins_the_documents_gradients_without_whole_tensor_fills():
    """The per-document path takes each document's q / k / v as views of one split, so the backward joins their
    gradients in one concatenation per tensor. A slice per document gave each document a zero-filled gradient of the
    whole tensor, then added them up. The backward runs no zero-fill or addition at the size of the whole q, k or v
    (torch.profiler with shapes, CPU), and the gradients equal those of a per-document reference call (each
    document's own sparse call, its short documents dense, at 1e-6 in fp32)."""
    from torch.profiler import ProfilerActivity, profile

    (q, k, v), ids = inputs(seed=2)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    RT.set_documents(ids)
    out = call(q, k, v, LOCAL)
    grad = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out.backward(grad)
    whole = {tuple(t.shape) for t in (q, k, v)}
    wide = [(e.name, e.input_shapes) for e in prof.events()
            if e.name in ("aten::zero_", "aten::fill_", "aten::add", "aten::add_", "aten::zeros", "aten::new_zeros")
            and any(tuple(shape) in whole for shape in e.input_shapes if shape)]
    assert not wide, wide[:6]
    RT.set_documents(None)
    start = 0
    for n in LENGTHS:
        pieces = [t.detach()[:, start:start + n].clone().requires_grad_() for t in (q, k, v)]
        alone = call(*pieces, LOCAL if n >= 2 * BS else None)
        alone.backward(grad[:, start:start + n])
        for got, piece in zip((q, k, v), pieces):
            torch.testing.assert_close(got.grad[:, start:start + n], piece.grad, rtol=0, atol=1e-6)
        start += n


def test_short_documents_and_never_run_one_dense_call():
    """Documents all under two blocks, or the policy "never": dense within documents, as the dense kind."""
    (q, k, v), ids = inputs(lengths=(100, 90, 120), seed=2)
    RT.set_documents(ids)
    short = call(q, k, v, LOCAL)
    assert [(r.layer, r.path, r.density) for r in RT.records.layers] == [(0, "dense", None)]
    RT.records.layers.clear()
    (q2, k2, v2), ids2 = inputs(seed=2)
    RT.set_documents(ids2)
    never = call(q2, k2, v2, LOCAL, policy="never")
    assert RT.records.layers == []
    torch.testing.assert_close(never.double(), reference(q2, k2, v2, LENGTHS), rtol=0, atol=1e-5)
    RT.set_documents(ids)
    torch.testing.assert_close(short.double(), reference(q, k, v, (100, 90, 120)), rtol=0, atol=1e-5)


def test_auto_sends_short_documents_dense_without_estimating(monkeypatch):
    """Under "auto" the cost model's floor decides from which length a document is estimated at all: with an
    estimate that costs far more than dense at these lengths, no document is estimated."""
    monkeypatch.setattr(cost, "CPU", dataclasses.replace(cost.CPU, estimate=(1e6, 0.0)))
    (q, k, v), ids = inputs()
    RT.set_documents(ids)
    out = call(q, k, v, LOCAL, policy="auto")
    assert [(r.layer, r.path, r.density) for r in RT.records.layers] == [(0, "dense", None)]
    torch.testing.assert_close(out.double(), reference(q, k, v, LENGTHS), rtol=0, atol=1e-5)


def test_recomputation_replays_each_documents_own_choice():
    """Gradient checkpointing's recomputation (RT.inputs.recomputing) rebuilds each document's index from the lines
    its first forward chose (two documents of one length class included): the same output, no new estimate."""
    (q, k, v), ids = inputs()
    RT.set_documents(ids)
    first = call(q, k, v, LOCAL)
    estimated = len(RT.records.layers)
    assert len(RT.policy.memo) == 3
    RT.inputs.recomputing = True
    try:
        again = call(q, k, v, LOCAL)
    finally:
        RT.inputs.recomputing = False
    assert len(RT.records.layers) == estimated
    assert torch.equal(first, again)


def test_the_dense_documents_segments_are_built_once_per_batch(monkeypatch):
    """The varlen call over the documents a layer sends dense takes its segments from the batch's `Documents`: built
    (prefix sums copied to the device, a wait for the device's queue on a GPU) once per batch and set of documents,
    not again in every layer and recomputed forward; a new batch builds its own. Outputs unchanged."""
    from mtrain.ops import varlen

    built = []
    real = varlen.Segments.build.__func__
    monkeypatch.setattr(varlen.Segments, "build", classmethod(lambda cls, *a, **kw: built.append(a[0]) or
                                                              real(cls, *a, **kw)))
    (q, k, v), ids = inputs()
    RT.set_documents(ids)
    assert len(built) == 1  # the batch's own segments (every document: the dense kind's one call)
    outs = [call(q, k, v, LOCAL, layer=layer) for layer in range(3)]
    RT.inputs.recomputing = True
    try:
        outs.append(call(q, k, v, LOCAL, layer=0))
    finally:
        RT.inputs.recomputing = False
    assert built[1:] == [(70, 40)]  # the two short documents, once for three layers and a recomputation
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][:, 300:370].double(), reference(q, k, v, LENGTHS)[:, 300:370], rtol=0,
                               atol=1e-5)
    RT.set_documents(ids.clone())  # the next batch: its own Documents, its own segments
    call(q, k, v, LOCAL)
    assert built[2:] == [list(LENGTHS), (70, 40)]


def test_policy_state_with_document_keys_round_trips_through_json():
    """Holds under per-document keys are saved with checkpoints beside the layer indices and load back."""
    RT.policy.dense_until = {3: 9, document_key(3, 40000): 12, document_key(11, 5000): 7}
    RT.policy.hold_streak = {document_key(3, 40000): 2, 1: 1}
    state = json.loads(json.dumps(RT.state_dict()))
    before = (dict(RT.policy.dense_until), dict(RT.policy.hold_streak))
    RT.load_state_dict(state)
    assert (RT.policy.dense_until, RT.policy.hold_streak) == before
    assert [key for key, _ in state["dense_until"]] == [3, "03@64K", "11@8K"]


def test_holds_live_per_layer_and_length_class(monkeypatch):
    """Under "auto" in training with dense holds, documents whose estimate did not pay hold their layer's length
    class dense (`document_key`), not the layer as a whole."""
    monkeypatch.setattr(cost, "CPU", dataclasses.replace(cost.CPU, estimate=(0.0, 0.0)))
    RT.settings.set_policy(dense_hold_steps=4)
    (q, k, v), ids = inputs()
    q, k = q * 0.01, k * 0.01  # flat attention: the recall target needs most of each document, dense is cheaper
    RT.set_documents(ids)
    call(q, k, v, SparseSettings(recall=1.0, block_size=BS), policy="auto")
    assert {r.path for r in RT.records.layers} == {"dense"}
    estimated = sum(r.density is not None for r in RT.records.layers)
    held = set(RT.policy.dense_until)
    assert "00@1K" in held and held <= {"00@512", "00@1K"}  # the classes of the documents estimated, not layer 0
    RT.records.layers.clear()
    RT.inputs.step += 1
    call(q, k, v, SparseSettings(recall=1.0, block_size=BS), policy="auto")
    # held without an estimate: the documents estimated before (those long enough to be, all in those classes)
    assert sum(r.held for r in RT.records.layers) == estimated >= 1
    assert not any(r.density is not None for r in RT.records.layers)


@pytest.mark.parametrize("training, head_dim", [(True, 128), (False, 64), (False, 128)])
def test_break_even_is_the_shortest_length_the_floor_pays_at(training, head_dim):
    """`_shortest_sparse` under "auto" where no break-even was measured (a head dim the table lacks, or forward
    only): the cost model's floor pays at the length it returns and not one block shorter (the bisection lands on
    the boundary); under "always" two blocks."""
    from mtrain.models.attention import _shortest_sparse
    from mtrain.models.policy import scored_rows

    s = SparseSettings(block_size=128)
    device = torch.device("cuda")  # the H200 table: priced, nothing runs

    def pays(length):
        return cost.worth_estimating(seq_len=length, heads=9, head_dim=head_dim, block_size=128,
                                     rows=scored_rows(s, length), backward=training, device=device, engine="fa4",
                                     dense_engine="fa4").path == "sparse"

    assert cost.document_break_even(device, head_dim=head_dim, block_size=128, engine="fa4", backward=training) is None
    shortest = _shortest_sparse("auto", 9, head_dim, 128, s, training, device, "fa4", "fa4")
    assert shortest % 128 == 0 and pays(shortest) and not pays(shortest - 128)
    assert 8192 < shortest < 131072  # between the lengths where estimating clearly cannot and clearly does pay
    assert _shortest_sparse("always", 9, head_dim, 128, s, training, device, "fa4", "fa4") == 256


def test_break_even_measured_on_packed_documents_replaces_the_floor_in_training():
    """Where the cost table holds a break-even measured on packed documents (SmolLM2's 9/3 x 64 heads, block 128, fa4
    on the H200 table: 32K), `_shortest_sparse` returns it in training, in whole blocks; forward only, another engine
    or a table without it keeps the floor's; attention.min_sparse_document replaces both (`_per_document`)."""
    from mtrain.models.attention import _shortest_sparse

    s = SparseSettings(block_size=128)
    device = torch.device("cuda")
    assert cost.H200.document_break_even[(64, 128, "fa4")] == 32768
    assert _shortest_sparse("auto", 9, 64, 128, s, True, device, "fa4", "fa4") == 32768
    floor = _shortest_sparse("auto", 9, 64, 128, s, False, device, "fa4", "fa4")
    assert floor > 32768 and _shortest_sparse("auto", 9, 64, 128, s, True, device, "triton", "fa4") != 32768
    assert _shortest_sparse("auto", 9, 64, 128, s, True, "cpu", "fa4", "fa4") != 32768  # the CPU table has none


def test_min_sparse_document_picks_the_documents_auto_estimates():
    """attention.min_sparse_document under "auto": the documents at least that long are estimated, whatever the cost
    model's floor says of them (on the CPU table it says none of these pays: without the setting no document is
    estimated), and the shorter ones go to the dense varlen call unestimated; the output stays exact where every
    document runs dense, and within the estimate's error otherwise."""
    (q, k, v), ids = inputs()
    RT.set_documents(ids)
    RT.settings.set_policy(sparse_policy="auto")
    call(q, k, v, LOCAL, policy="auto")
    assert not any(r.density is not None for r in RT.records.layers)  # the floor: nothing estimated
    for threshold, estimated in ((350, 2), (450, 1), (600, 0)):  # documents of 300 / 520 / 400 tokens
        RT.records.layers.clear()
        RT.settings.set_policy(min_sparse_document=threshold)
        out = call(q, k, v, LOCAL, policy="auto")
        assert sum(r.density is not None for r in RT.records.layers) == estimated
        err = (out.double() - reference(q, k, v, LENGTHS)).norm() / reference(q, k, v, LENGTHS).norm()
        assert err < (1e-5 if estimated == 0 else 0.5)


def test_a_document_past_a_measured_break_even_that_runs_sparse_is_not_held_dense(monkeypatch):
    """Under "auto" in training with dense holds, where the cost table holds a break-even measured on packed
    documents for the layer's shape (`cost.document_break_even`, which included each document's estimate): a
    document past it that goes sparse is not held dense for its estimate's predicted cost. Where the length comes
    from elsewhere (attention.min_sparse_document here; the floor on the CPU's table) the prediction decides as
    before: the same sparse documents are held. The table makes the choice sparse and the estimate too dear to pay."""
    from mtrain.models.attention import say_engine

    (q, k, v), ids = inputs()
    engine = say_engine("auto", q, BS)
    dear_estimate = dict(estimate=(1e6, 0.0), index=(0.0, 0.0, 0.0, 0.0),
                         sparse={(D, BS): {"train": (0.0, 0.0, 0.0, 0.0), "eval": (0.0, 0.0, 0.0, 0.0)}})
    for break_even, held in (({(D, BS, engine): 256}, False), ({}, True)):
        table = dataclasses.replace(cost.CPU, document_break_even=break_even, **dear_estimate)
        monkeypatch.setattr(cost, "CPU", table)
        global RT
        RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
        RT.settings.set_policy(sparse_policy="auto", dense_hold_steps=4,
                               min_sparse_document=None if break_even else 256)
        RT.set_documents(ids)
        call(q, k, v, LOCAL, policy="auto")
        # documents of 300, 520 and 400 tokens: held, the 300's hold (length class 00@512) sends the 400 dense
        assert [(r.path, r.held) for r in RT.records.layers] == [("sparse", False)] * 2 + [
            ("dense", True) if held else ("sparse", False)]
        assert sorted(RT.policy.dense_until) == (["00@1K", "00@512"] if held else [])
