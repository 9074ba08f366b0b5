"""The quality check of sparse_policy auto (attention.max_output_error): `mtrain.ops.recall.output_error` against a
float64 reference written from the index's lists, and the policy sending a layer dense above the limit, sparse below."""

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtrain.errors import MtrainError
from mtrain.models.attention import mtrain_attention
from mtrain.attention_settings import PolicySettings
from mtrain.models.runtime import AttentionRuntime, AttentionSettings
from mtrain.ops import cost, dense_attention, estimate_vertical_slash, vertical_slash_attention
from mtrain.ops.estimate import estimate_rows
from mtrain.ops.recall import block_output_error, output_error
from mtrain.parallel import SparseSettings

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "workers"))
from attention_choice import BS, inputs  # noqa: E402  (a local pattern where sparse pays)
from test_ops_interpreter import needs_interpreter  # noqa: E402

LOCAL = SparseSettings(recall=0.4, block_size=BS, max_vertical=4, max_slash=4, min_vertical=0, min_slash=0)


def reference_error(q, k, v, index, rows, scale=None, doc_ids=None):
    """(per head [Hq], whole) relative output error of batch row 0, in float64: the keys each query block computes
    read from the index's block and column lists one by one (no mask helper), each row's exact softmax over all its
    causal keys (of its document) against the softmax renormalised over the kept keys; rows side by side, one head
    at a time."""
    _, S, Hq, D = q.shape
    G = Hq // k.shape[2]
    bs = index.block_size
    scale = D ** -0.5 if scale is None else scale
    q64, k64, v64 = (t[0].double() for t in (q, k, v))
    rows = rows.long()
    pos = torch.arange(S)
    causal = pos[None, :] <= rows[:, None]  # [R, S]: the keys each row may see
    if doc_ids is not None:
        causal &= doc_ids[0][None, :] == doc_ids[0, rows][:, None]
    err, ref = torch.zeros(Hq, dtype=torch.float64), torch.zeros(Hq, dtype=torch.float64)
    for h in range(Hq):
        keep = torch.zeros(index.block_counts.shape[-1], S, dtype=torch.bool)  # [nQB, S]: the keys a block lists
        for qb in range(keep.shape[0]):
            for j in range(int(index.block_counts[0, h, qb])):
                b = int(index.block_ids[0, h, qb, j])
                keep[qb, b * bs:(b + 1) * bs] = True
            keep[qb, index.col_ids[0, h, qb, : int(index.col_counts[0, h, qb])].long()] = True
        logits = (q64[rows, h] @ k64[:, h // G].T) * scale
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
        o = p @ v64[:, h // G]
        ps = torch.where(keep[rows // bs] & causal, p, 0.0)
        o_sparse = (ps / ps.sum(-1, keepdim=True)) @ v64[:, h // G]
        err[h] = (o_sparse - o).square().sum()
        ref[h] = o.square().sum()
    return (err / ref).sqrt(), (err.sum() / ref.sum()).sqrt()


@pytest.mark.parametrize("dtype,documents", [(torch.float32, False), (torch.float32, True), (torch.float64, False)])
def test_output_error_matches_a_float64_reference(dtype, documents):
    """Within 1e-4 relative for fp32 inputs (the fp32 softmax and products over <= 320 keys), 1e-10 for fp64; on a
    lossy index (recall 0.6, small caps) so the error is far from 0, with and without document masking."""
    g = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D, bs = 1, 320, 4, 2, 16, 32
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=dtype) for h in (Hq, Hkv, Hkv))
    docs = (torch.arange(S) >= 150).long()[None] if documents else None
    index = estimate_vertical_slash(q.float(), k.float(), recall=0.6, block_size=bs, last_q=32, max_vertical=8,
                                    max_slash=64, min_vertical=0, min_slash=0, sample_blocks=4, doc_ids=docs)
    rows = torch.tensor([0, 5, 31, 32, 100, 149, 150, 151, 200, 287, 319])
    per_head = output_error(q, k, v, index, rows, doc_ids=docs, per_head=True)[0]
    whole = output_error(q, k, v, index, rows, doc_ids=docs)[0]
    want_head, want = reference_error(q, k, v, index, rows, doc_ids=docs)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert float(want) > 0.05  # the index drops real mass: not a trivially zero error
    torch.testing.assert_close(per_head.double(), want_head, rtol=tol, atol=0.0)
    torch.testing.assert_close(whole.double(), want, rtol=tol, atol=0.0)
    # the rows the estimate scored (what the policy reads), in any order, give the same figure
    scored = estimate_rows(S, recall=0.6, block_size=bs, last_q=32, sample_blocks=4)
    _, want_scored = reference_error(q, k, v, index, scored, doc_ids=docs)
    got = output_error(q, k, v, index, scored.flip(0), doc_ids=docs)[0]
    torch.testing.assert_close(got.double(), want_scored, rtol=tol, atol=0.0)


def lossy_case(documents):
    g = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D, bs = 1, 320, 4, 2, 16, 32
    q, k, v = (torch.randn(B, S, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    docs = (torch.arange(S) >= 150).long()[None] if documents else None
    index = estimate_vertical_slash(q, k, recall=0.6, block_size=bs, last_q=32, max_vertical=8, max_slash=64,
                                    min_vertical=0, min_slash=0, sample_blocks=4, doc_ids=docs)
    return q, k, v, docs, index


@pytest.mark.parametrize("documents", [False, True])
def test_block_output_error_matches_the_float64_reference(documents):
    """The check's kernel form (the rows' query blocks through the partial-attention forward, on the index's lists
    and densely) gives the float64 reference's figure within 1e-4 relative in fp32 (torch path here; the Triton
    path under the interpreter in the next test), on rows inside and across query blocks."""
    q, k, v, docs, index = lossy_case(documents)
    rows = torch.tensor([0, 5, 31, 32, 100, 149, 150, 151, 200, 287, 319])
    want_head, want = reference_error(q, k, v, index, rows, doc_ids=docs)
    assert float(want) > 0.05
    got_head = block_output_error(q, k, v, index, rows.flip(0), doc_ids=docs, per_head=True)[0]
    got = block_output_error(q, k, v, index, rows, doc_ids=docs)[0]
    torch.testing.assert_close(got_head.double(), want_head, rtol=1e-4, atol=0.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0.0)


@needs_interpreter  # run by tests/test_ops_interpreter.py in its Triton-interpreter process (QUICK_ELSEWHERE)
def test_block_output_error_through_the_triton_kernels_in_the_interpreter():
    """What the GPU runs: the Triton partial-attention kernels (TRITON_INTERPRET=1), against the float64 reference,
    within 1e-4 relative (fp32 inputs), with and without document masking."""
    for documents in (False, True):
        q, k, v, docs, index = lossy_case(documents)
        rows = torch.tensor([0, 5, 31, 32, 100, 149, 150, 151, 200, 287, 319])
        got = block_output_error(q, k, v, index, rows, doc_ids=docs, per_head=True, impl="triton")[0]
        want_head, _ = reference_error(q, k, v, index, rows, doc_ids=docs)
        torch.testing.assert_close(got.double(), want_head, rtol=1e-4, atol=0.0)


@needs_interpreter  # in the quick suite's interpreter process, with the test above
def test_block_output_error_plans_its_dense_lists_on_the_host():
    """The check's dense call takes its block lists from the host plan made once per row set: a repeated call runs
    no op a GPU's host would wait for, apart from the checks of the rows themselves (a CPU tensor: host arithmetic
    on a GPU too). The old code built the lists on the device in every call: a count read back and two nonzero()."""
    from syncs import CountSyncs

    q, k, v, _, index = lossy_case(False)
    rows = torch.tensor([0, 5, 31, 32, 100, 149, 150, 151, 200, 287, 319])
    first = block_output_error(q, k, v, index, rows, impl="triton")
    mode = CountSyncs()
    with mode:
        again = block_output_error(q, k, v, index, rows, impl="triton")
    on_device = {site: n for site, n in mode.sites.items() if "_rows_key" not in site}
    assert not on_device, on_device
    assert torch.equal(first, again)


def test_output_error_is_zero_for_the_dense_pattern():
    q, k, v = inputs("local")
    index = estimate_vertical_slash(q, k, recall=1.0, block_size=BS, max_vertical=q.shape[1], max_slash=q.shape[1])
    assert index.density() == pytest.approx(1.0)
    assert float(output_error(q, k, v, index, torch.arange(0, q.shape[1], 97))[0]) < 1e-5


RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
"""The attention runtime of the layer `call` runs (`mtrain.models.runtime`): fresh for every test."""


@pytest.fixture(autouse=True)
def fresh_context(monkeypatch):
    """A fresh attention runtime (one device), and the cost model without the estimate's own cost (its figure moves
    with every estimator version: the layers here pay for sparse by their kernels alone)."""
    global RT
    monkeypatch.setattr(cost, "CPU", dataclasses.replace(cost.CPU, estimate=(0.0, 0.0)))
    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
    yield


def call(q, k, v, settings, policy="auto", max_error=False, layer=0):
    module = SimpleNamespace(training=True, layer_idx=layer, mtrain_runtime=RT)
    out, _ = mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              settings=settings, policy=policy, max_error=max_error)
    return out


@pytest.mark.parametrize("layer", [None, 0])  # with a layer index the choice reads the lagged statistics' path
def test_auto_runs_dense_above_the_output_error_limit_and_sparse_below(layer):
    """A layer where sparse pays (the cost model says sparse): with no limit it runs sparse and measures nothing; with
    a limit just above its output error on the scored rows (the float64 reference's figure) it stays sparse; just
    below, it runs dense and returns dense attention's output."""
    q, k, v = inputs("local")
    index = estimate_vertical_slash(q, k, **dataclasses.asdict(LOCAL))
    _, error = reference_error(q, k, v, index, estimate_rows(q.shape[1], **dataclasses.asdict(LOCAL)))
    error = float(error)
    assert error > 0.05

    sparse_out = vertical_slash_attention(q, k, v, index)
    out = call(q, k, v, LOCAL, max_error=None, layer=layer)
    (record,) = RT.records.layers
    assert record.path == "sparse" and record.output_error is None and torch.equal(out, sparse_out)

    for limit, path in ((error * 1.01, "sparse"), (error * 0.99, "dense")):
        RT.records.layers.clear()
        RT.policy.choice_stats.clear()  # each limit's call decides from its own estimate
        out = call(q, k, v, LOCAL, max_error=limit, layer=layer)
        (record,) = RT.records.layers
        assert record.path == path, (limit, error)
        assert float(record.output_error[0]) == pytest.approx(error, rel=1e-4)
        want = sparse_out if path == "sparse" else dense_attention(q, k, v, causal=True)
        assert torch.equal(out, want)
        assert record.sparse_ms < record.dense_ms  # the cost model alone would have run it sparse
        if layer is not None:  # logged per layer
            from mtrain.train.metrics import attention_stats

            assert attention_stats([record])["attn_output_error/L00"] == pytest.approx(error, rel=1e-4)


def test_the_limit_applies_under_auto_only_and_comes_from_the_registration():
    from mtrain.models.registry import attention_runtime, register_kind

    q, k, v = inputs("local")
    call(q, k, v, LOCAL, policy="always", max_error=1e-6)  # "always" stays sparse, measuring nothing
    assert RT.records.layers[-1].path == "sparse" and RT.records.layers[-1].output_error is None
    rt = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", max_output_error=1e-6, **dataclasses.asdict(LOCAL))
    assert rt.settings.policy.max_output_error == 1e-6
    module = SimpleNamespace(training=True, layer_idx=None, mtrain_runtime=rt)
    mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)  # the runtime's limit
    assert rt.records.layers[-1].path == "dense" and rt.records.layers[-1].output_error is not None
    with pytest.raises(MtrainError, match=r"attention\.max_output_error: must be a number > 0"):
        register_kind("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", max_output_error=0.0)


def test_a_layer_that_passed_the_check_is_measured_again_after_the_hold_and_resumes_so():
    """In training with dense_hold 4: a layer that passes the check (limit above its error) runs sparse and is not
    measured on the next 4 steps, then again on the 5th; a checkpoint's policy state carries that cadence (a resumed
    run skips the same steps). A layer over the limit is sent dense and held (measured again when the hold ends)."""
    q, k, v = inputs("local")
    index = estimate_vertical_slash(q, k, **dataclasses.asdict(LOCAL))
    error = float(reference_error(q, k, v, index, estimate_rows(q.shape[1], **dataclasses.asdict(LOCAL)))[1])
    RT.settings.set_policy(dense_hold_steps=4)
    measured = []
    for step in range(7):
        RT.inputs.step = step
        RT.records.layers.clear()
        call(q, k, v, LOCAL, max_error=error * 1.01, layer=0)
        (record,) = RT.records.layers
        assert record.path == "sparse"
        measured.append(record.output_error is not None)
        if step == 2:
            saved = RT.state_dict()
    assert measured == [True, False, False, False, False, True, False]
    assert dict(saved["checked_until"]) == {0: 5}
    RT.policy.checked_until = {}
    RT.load_state_dict(saved)
    RT.inputs.step = 3
    RT.records.layers.clear()
    call(q, k, v, LOCAL, max_error=error * 1.01, layer=0)
    assert RT.records.layers[0].output_error is None  # the resumed run skips step 3's check, as the first one did

    # over the limit: dense now, held dense for the hold (no estimate, no check), measured when it ends (LOCAL's
    # 4-line caps keep its estimate short of 0.4: with attention.widen_caps the layer would estimate again with wider
    # caps instead, tests/test_cap_widening.py)
    RT.policy.checked_until, RT.policy.dense_until, RT.policy.choice_stats = {}, {}, {}
    RT.settings.set_policy(widen_caps=False)
    paths = []
    for step in range(10, 16):
        RT.inputs.step = step
        RT.records.layers.clear()
        call(q, k, v, LOCAL, max_error=error * 0.99, layer=1)
        (record,) = RT.records.layers
        paths.append((record.path, record.output_error is not None))
    assert paths[0] == ("dense", True) and all(p == ("dense", False) for p in paths[1:5]), paths
    assert paths[5] == ("dense", True), paths


WIDE = dataclasses.replace(LOCAL, max_vertical=64, max_slash=64)  # caps with room: a higher recall lists more


def test_a_layer_over_the_limit_escalates_its_recall_and_keeps_it():
    """attention.escalate_recall: a layer whose output error at its recall exceeds the limit estimates again at the
    escalated recall in the same call, and keeps it (RT.policy.layer_recall, the policy state, the logged record).
    Under auto, with a limit between the two indexes' errors, it runs sparse on the escalated index (without
    escalation the check sends it dense); under always it stays sparse. Both outputs equal the sparse kernels on the
    index estimated directly at the escalated recall, and the recorded error is that index's own."""
    from mtrain.models.policy import quality_error
    from mtrain.train.metrics import attention_stats

    q, k, v = inputs("local")
    high = dataclasses.replace(WIDE, recall=0.46)  # an escalation its estimate reaches (within RECALL_SLACK)
    base_index = estimate_vertical_slash(q, k, **dataclasses.asdict(WIDE))
    high_index = estimate_vertical_slash(q, k, **dataclasses.asdict(high))
    low_err = float(quality_error(q, k, v, base_index, WIDE).amax())
    high_err = float(quality_error(q, k, v, high_index, high).amax())
    assert high_err < low_err and high_index.density() > base_index.density()
    limit = (low_err + high_err) / 2
    want = vertical_slash_attention(q, k, v, high_index)

    RT.records.layers.clear()
    call(q, k, v, WIDE, max_error=limit, layer=0)  # no escalation configured: the check sends it dense
    assert RT.records.layers[-1].path == "dense" and RT.policy.layer_recall == {}

    for policy, layer in (("auto", 1), ("always", 2)):
        RT.settings.set_policy(max_output_error=limit, escalate_recall=0.46)
        RT.records.layers, RT.policy.choice_stats = [], {}
        out = call(q, k, v, WIDE, policy=policy, max_error=limit, layer=layer)
        (record,) = RT.records.layers
        assert record.path == "sparse" and record.escalated_recall == 0.46, policy
        assert RT.policy.layer_recall[layer] == 0.46
        assert float(record.output_error.amax()) == pytest.approx(high_err, rel=1e-5)
        assert torch.equal(out, want), policy
        assert attention_stats([record])[f"attn_layer_recall/L{layer:02d}"] == 0.46
    saved = RT.state_dict()
    assert dict(saved["layer_recall"]) == {1: 0.46, 2: 0.46}
    RT.policy.layer_recall = {}
    RT.load_state_dict(saved)
    assert RT.policy.layer_recall == {1: 0.46, 2: 0.46}
    # the next call of an escalated layer estimates at its recall from the start (no check needed to get there)
    RT.records.layers.clear()
    out = call(q, k, v, WIDE, policy="always", max_error=None, layer=2)
    assert torch.equal(out, want) and RT.records.layers[-1].escalated_recall == 0.46


def test_escalation_is_validated_at_registration():
    from mtrain.models.registry import register_kind

    with pytest.raises(MtrainError, match=r"attention\.escalate_recall needs attention\.max_output_error"):
        register_kind("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", escalate_recall=0.999)
    with pytest.raises(MtrainError, match=r"attention\.escalate_recall: must be a number above attention\.recall \(0\.99\)"):
        register_kind("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", max_output_error=0.02, escalate_recall=0.9, recall=0.99)
