"""The per-layer sparse/dense choice of the sparse attention kinds (attention.sparse_policy) and its logging."""

import dataclasses
import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtrain.errors import MtrainError
from mtrain.models.attention import mtrain_attention
from mtrain.models.registry import attention_runtime, register_kind
from mtrain.attention_settings import PolicySettings
from mtrain.models.runtime import AttentionRuntime, AttentionSettings
from mtrain.ops import cost, estimate_vertical_slash, vertical_slash_attention
from mtrain.parallel import SparseSettings
from mtrain.train.metrics import attention_stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "workers"))
from attention_choice import BS, inputs  # noqa: E402  (the worker's two patterns: local and flat)

LOCAL = SparseSettings(recall=0.4, block_size=BS, max_vertical=4, max_slash=4, min_vertical=0, min_slash=0)
FLAT = SparseSettings(recall=1.0, block_size=BS)


@pytest.fixture(autouse=True)
def kernels_only_cpu_costs(monkeypatch):
    """These tests check the choice between the kernels: leave out the online estimate's own cost, which
    changes with every estimator version (test_skips_the_estimate_where_sparse_cannot_pay covers it)."""
    monkeypatch.setattr(cost, "CPU", dataclasses.replace(cost.CPU, estimate=(0.0, 0.0)))


RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
"""The attention runtime of the layer `call` runs (`mtrain.models.runtime`): fresh for every test."""


@pytest.fixture(autouse=True)
def single_device():
    """Every test starts from a fresh attention runtime (one device, no holds, no memo)."""
    global RT
    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
    yield


def call(q, k, v, settings, policy, training=True, layer=0):
    module = SimpleNamespace(training=training, layer_idx=layer, mtrain_runtime=RT)
    out, _ = mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              settings=settings, policy=policy)
    return out


def dense_kind(q, k, v):
    return call(q, k, v, None, None)


def test_auto_runs_dense_where_the_caps_keep_the_estimate_short_of_its_recall():
    """The same local pattern asked for recall 0.5 with 4-line caps: the estimate reaches ~0.39, more than
    RECALL_SLACK short, so auto runs the layer dense though sparse would pay; always still runs it sparse."""
    from mtrain.models.policy import RECALL_SLACK

    q, k, v = inputs("local")
    short = dataclasses.replace(LOCAL, recall=0.5)
    out = call(q, k, v, short, "auto")
    (record,) = RT.records.layers
    assert float(record.est_recall.mean()) < 0.5 - RECALL_SLACK
    assert record.path == "dense" and record.sparse_ms < record.dense_ms  # it would have paid
    assert torch.equal(out, dense_kind(q, k, v))
    RT.records.layers.clear()
    call(q, k, v, short, "always")
    assert RT.records.layers[0].path == "sparse"


@pytest.mark.parametrize("documents", [False, True])
def test_auto_runs_dense_where_sparse_would_not_pay_and_equals_the_dense_kind(documents):
    q, k, v = inputs("flat")
    if documents:
        RT.inputs.doc_ids = (torch.arange(q.shape[1]) >= 700).long()[None]
    out = call(q, k, v, FLAT, "auto")
    # with documents each one is estimated on its own (`_per_document`): one record per document
    assert len(RT.records.layers) == (2 if documents else 1)
    for record in RT.records.layers:
        assert record.path == "dense" and record.density > 0.8
        assert record.sparse_ms > record.dense_ms
    assert torch.equal(out, dense_kind(q, k, v))
    assert RT.records.densities == [record.density for record in RT.records.layers]


def test_auto_runs_sparse_where_it_pays():
    q, k, v = inputs("local")
    out = call(q, k, v, LOCAL, "auto")
    (record,) = RT.records.layers
    assert record.path == "sparse" and record.density < 0.3 and record.sparse_ms < record.dense_ms
    index = estimate_vertical_slash(q, k, recall=LOCAL.recall, block_size=BS, max_vertical=4, max_slash=4,
                                    min_vertical=0, min_slash=0)
    assert torch.equal(out, vertical_slash_attention(q, k, v, index))
    assert (out - dense_kind(q, k, v)).abs().max() > 1e-2  # really sparse: it drops attention mass


def test_always_runs_sparse_even_where_dense_is_cheaper():
    q, k, v = (t[:, :512] for t in inputs("local"))
    call(q, k, v, LOCAL, "auto")
    assert RT.records.layers[-1].path == "dense"  # 512 tokens: the sparse fixed costs do not pay
    out = call(q, k, v, LOCAL, "always")
    assert RT.records.layers[-1].path == "sparse"
    index = estimate_vertical_slash(q, k, recall=LOCAL.recall, block_size=BS, max_vertical=4, max_slash=4,
                                    min_vertical=0, min_slash=0)
    assert torch.equal(out, vertical_slash_attention(q, k, v, index))
    assert not torch.allclose(out, dense_kind(q, k, v), atol=1e-3)


def test_never_runs_dense_without_estimating():
    q, k, v = inputs("local")
    out = call(q, k, v, LOCAL, "never")
    assert RT.records.layers == [] and RT.records.densities == []
    assert torch.equal(out, dense_kind(q, k, v))


def test_eval_uses_the_forward_only_costs():
    q, k, v = inputs("local")
    call(q, k, v, LOCAL, "auto", training=True)
    call(q, k, v, LOCAL, "auto", training=False)
    train, infer = RT.records.layers
    assert infer.dense_ms < train.dense_ms and infer.sparse_ms < train.sparse_ms


def test_a_dense_choice_holds_for_dense_hold_steps_in_training(monkeypatch):
    """With attention.dense_hold_steps 2 a layer that auto sent dense at step 0 runs dense without estimating at
    steps 0 (again: recomputation, micro-batches) to 2 and estimates again at step 3; eval calls never hold;
    a sparse choice sets no hold."""
    import mtrain.ops

    q, k, v = inputs("flat")
    estimates = []
    real = mtrain.ops.estimate_vertical_slash
    # the model layer estimates through mtrain.ops.graphed (a CUDA graph on GPUs, eager here)
    monkeypatch.setattr("mtrain.ops.graphed.estimate_vertical_slash",
                        lambda *a, **kw: estimates.append(1) or real(*a, **kw))
    monkeypatch.setattr(RT.settings, "policy", dataclasses.replace(RT.settings.policy, dense_hold_steps=2))
    monkeypatch.setattr(RT.policy, "dense_until", {})
    monkeypatch.setattr(RT.policy, "hold_streak", {})
    want = dense_kind(q, k, v)
    paths = []
    for step in range(5):
        monkeypatch.setattr(RT.inputs, "step", step)
        RT.records.layers.clear()
        out = call(q, k, v, FLAT, "auto", layer=3)
        (record,) = RT.records.layers
        paths.append((record.path, record.held))
        assert torch.equal(out, want)
    assert paths == [("dense", False), ("dense", True), ("dense", True), ("dense", False), ("dense", True)]
    assert len(estimates) == 2
    assert attention_stats(RT.records.layers)["attention_held_layers"] == 1.0
    assert RT.policy.dense_until[3] == 3 + 1 + 2 * 2  # the second estimate in a row that did not pay: twice the hold
    for step, want_until in ((8, 8 + 1 + 2 * 4), (17, 17 + 1 + 2 * 8), (34, 34 + 1 + 2 * 8)):  # doubling, capped
        monkeypatch.setattr(RT.inputs, "step", step)
        call(q, k, v, FLAT, "auto", layer=3)
        assert not RT.records.layers[-1].held and RT.policy.dense_until[3] == want_until
    assert len(estimates) == 5
    call(q, k, v, FLAT, "auto", layer=3, training=False)  # eval: estimated whatever the hold
    assert len(estimates) == 6 and not RT.records.layers[-1].held
    RT.policy.dense_until.clear()
    call(*inputs("local"), LOCAL, "auto", layer=4)  # sparse pays: no hold
    r = RT.records.layers[-1]
    assert r.path == "sparse" and 4 not in RT.policy.dense_until, (r.sparse_ms, r.dense_ms, r.est_recall)


def test_a_sparse_choice_whose_estimate_does_not_pay_holds_too(monkeypatch):
    """Sparse is chosen (the kernels beat dense) but the estimate plus the sparse path is predicted above the
    margin of dense: the call runs sparse (the estimate is paid) and the layer then holds dense; with a free
    estimate the same call sets no hold."""
    q, k, v = inputs("local")
    monkeypatch.setattr(RT.settings, "policy", dataclasses.replace(RT.settings.policy, dense_hold_steps=4))
    monkeypatch.setattr(RT.policy, "dense_until", {})
    monkeypatch.setattr(RT.policy, "hold_streak", {})
    monkeypatch.setattr(RT.inputs, "step", 0)
    call(q, k, v, LOCAL, "auto", layer=6)
    free = RT.records.layers[-1]
    assert free.path == "sparse" and 6 not in RT.policy.dense_until
    rows = min(q.shape[1], LOCAL.last_q + LOCAL.sample_blocks * LOCAL.block_size)
    fixed = cost.worth_estimating(seq_len=q.shape[1], heads=q.shape[2], head_dim=q.shape[3], block_size=BS,
                                  rows=rows, device="cpu").sparse_ms
    # an estimate that leaves the floor under the margin but not the floor plus the listed work
    est = cost.SPARSE_MARGIN * free.dense_ms - (free.sparse_ms + fixed) / 2
    assert est > 0
    monkeypatch.setattr(cost, "CPU", dataclasses.replace(cost.CPU, estimate=(est, 0.0)))
    out = call(q, k, v, LOCAL, "auto", layer=6)
    record = RT.records.layers[-1]
    assert record.path == "sparse" and RT.policy.dense_until[6] == 5
    index = estimate_vertical_slash(q, k, recall=LOCAL.recall, block_size=BS, max_vertical=4, max_slash=4,
                                    min_vertical=0, min_slash=0)
    assert torch.equal(out, vertical_slash_attention(q, k, v, index))
    monkeypatch.setattr(RT.inputs, "step", 1)
    call(q, k, v, LOCAL, "auto", layer=6)
    assert RT.records.layers[-1].path == "dense" and RT.records.layers[-1].held


@pytest.mark.slow
def test_policy_state_saved_under_auto_resumes_the_same_holds_and_choices():
    """What the trainer saves with a checkpoint under sparse_policy auto (`runtime.state_dict()`, written as JSON) and gives
    back on resume (`load_state_dict`, in a fresh runtime) is the same dense holds, back-off streaks
    and lagged choice statistics, and the resumed calls take the uninterrupted ones' paths; resumed without the holds
    or without the statistics, they do not (a held layer estimates again; a lagged choice decides on its own counts)."""
    import json

    local, flat = inputs("local"), inputs("flat")
    # per step: (layer 3: the flat pattern, always dense), (layer 1: local, local, then flat)
    plan = [[(3, flat, FLAT), (1, local, LOCAL)]] * 2 + [[(3, flat, FLAT), (1, flat, LOCAL)]] * 3

    def fresh_run():  # a new process: a fresh runtime of the kind, made as the trainer makes it
        global RT
        RT = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", dense_hold_steps=2, block_size=BS)

    def run(steps):
        paths = []
        for step in steps:
            RT.inputs.step = step
            for layer, qkv, settings in plan[step]:
                RT.records.layers.clear()
                call(*qkv, settings, "auto", layer=layer)
                (record,) = RT.records.layers
                paths.append((step, layer, record.path, record.held))
        return paths

    fresh_run()
    run([0, 1])
    saved = json.loads(json.dumps(RT.state_dict()))  # the checkpoint after step 1
    holds = (dict(RT.policy.dense_until), dict(RT.policy.hold_streak))
    assert holds[0] and RT.policy.choice_stats
    ref = run([2, 3, 4])
    assert any(held for *_, held in ref) and any(path == "sparse" for _, _, path, _ in ref), ref

    fresh_run()
    RT.load_state_dict(saved)
    assert (RT.policy.dense_until, RT.policy.hold_streak) == holds
    assert json.loads(json.dumps(RT.state_dict())) == saved
    assert run([2, 3, 4]) == ref

    for lost in ({"dense_until": [], "hold_streak": []}, {"choice_stats": []}):  # resumed without the holds, the stats
        fresh_run()
        RT.load_state_dict({**saved, **lost})
        assert run([2, 3, 4]) != ref, lost


def test_dense_hold_steps_is_validated():
    with pytest.raises(MtrainError, match=r"attention\.dense_hold_steps: must be an integer >= 0"):
        register_kind("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", dense_hold_steps=-1)


def test_skips_the_estimate_where_sparse_cannot_pay(monkeypatch):
    q, k, v = inputs("local")
    slow = dataclasses.replace(cost.CPU, estimate=(1e6, 0.0))  # an estimate slower than any dense call here
    monkeypatch.setattr(cost, "CPU", slow)
    calls = []
    monkeypatch.setattr("mtrain.ops.graphed.estimate_vertical_slash", lambda *a, **kw: calls.append(1))
    out = call(q, k, v, LOCAL, "auto", layer=5)
    (record,) = RT.records.layers
    assert calls == [] and RT.records.densities == []  # never estimated
    assert record.path == "dense" and record.density is None and record.layer == 5
    assert record.sparse_ms >= 1e6 > record.dense_ms
    assert torch.equal(out, dense_kind(q, k, v))
    stats = attention_stats(RT.records.layers)
    assert stats["attention_paths"] == "d" and "attn_density/L05" not in stats and stats["attention_work"] == 1.0


def test_sampled_true_recall_matches_a_float64_reference():
    q, k, v = inputs("local")
    RT.inputs.sample_recall, RT.inputs.recall_rows = True, 16
    call(q, k, v, LOCAL, "always", layer=7)
    (record,) = RT.records.layers
    S = q.shape[1]
    rows = torch.arange(16) * (S // 16) + (S // 16 - 1)
    assert rows[-1] == S - 1
    # independent reference: the index's exact pair mask, float64 softmax of every sampled row over its causal keys
    index = estimate_vertical_slash(q, k, recall=LOCAL.recall, block_size=BS, max_vertical=4, max_slash=4,
                                    min_vertical=0, min_slash=0)
    mask = index.to_mask()[:, :, rows]  # [B, Hq, R, S]
    G = q.shape[2] // k.shape[2]
    kk = k.double().repeat_interleave(G, dim=2)
    logits = torch.einsum("brhd,bshd->bhrs", q[:, rows].double(), kk) / q.shape[-1] ** 0.5
    logits = logits.masked_fill(torch.arange(S)[None, :] > rows[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    expected = (probs * mask).sum(-1).mean(-1)  # [B, Hq]
    assert record.true_recall.shape == expected.shape
    torch.testing.assert_close(record.true_recall.double(), expected, atol=1e-5, rtol=0)
    assert float(expected.min()) < 0.999  # the sparse pattern really drops mass here
    stats = attention_stats(RT.records.layers)
    assert stats["attn_true_recall/L07"] == pytest.approx(float(expected.mean()), abs=1e-5)
    assert stats["attention_true_recall_min"] == stats["attention_true_recall"]
    # the index's size on this rank: its block and column lists as held (one call: the largest of the step)
    held = sum(t.numel() * t.element_size() for t in (index.block_ids, index.block_counts, index.col_ids,
                                                       index.col_counts))
    assert record.index_bytes == held > 0 and stats["attention_index_mib"] == held / 2**20


def test_dense_layers_measure_no_true_recall():
    q, k, v = inputs("flat")
    RT.inputs.sample_recall = True
    call(q, k, v, FLAT, "auto")
    assert RT.records.layers[0].path == "dense" and RT.records.layers[0].true_recall is None


def test_attention_stats_per_layer():
    from mtrain.models.context import LayerRecord

    records = [LayerRecord(0, "sparse", 0.2, 10.0, 5.0, est_recall=torch.tensor([[0.9, 0.8]])),
               LayerRecord(1, "dense", 0.7, 10.0, 12.0),
               LayerRecord(0, "sparse", 0.4, 10.0, 6.0, est_recall=torch.tensor([[0.7, 0.6]])),  # 2nd micro-batch
               LayerRecord(1, "dense", 0.9, 10.0, 14.0)]
    stats = attention_stats(records)
    assert stats["attention_paths"] == "sd"
    assert stats["attn_sparse/L00"] == 1.0 and stats["attn_sparse/L01"] == 0.0
    assert stats["attn_density/L00"] == pytest.approx(0.3) and stats["attn_density/L01"] == pytest.approx(0.8)
    assert stats["attn_est_recall/L00"] == pytest.approx(0.75) and "attn_est_recall/L01" not in stats
    assert stats["attention_sparse_layers"] == 0.5
    assert stats["attention_work"] == pytest.approx((0.2 + 1 + 0.4 + 1) / 4)
    assert stats["attention_pred_ms"] == pytest.approx(5 + 10 + 6 + 10)
    assert stats["attention_pred_dense_ms"] == pytest.approx(40)
    assert "attention_true_recall" not in stats and "attention_index_mib" not in stats  # no index sizes recorded
    json.dumps(stats)  # metrics.jsonl takes it as is
    assert attention_stats([]) == {}


def test_attention_stats_read_a_steps_records_back_at_once():
    """A step's records hold their figures as device tensors; logging reads them all back in one copy (per device),
    not one read per figure (a step of 30 layers and four documents holds a few hundred), with the same values."""
    from syncs import CountSyncs, count_tolist

    from mtrain.models.context import LayerRecord

    records = [LayerRecord(i % 3, "sparse", torch.tensor(0.1 * (i + 1)), 10.0, 5.0,
                           est_recall=torch.tensor([[0.9, 0.7]]), true_recall=torch.tensor([[0.8, 0.6]]),
                           output_error=torch.tensor([0.01 * i])) for i in range(6)]
    records.append(LayerRecord(3, "dense", None, 10.0, 12.0))
    mode = CountSyncs()
    with count_tolist() as reads, mode:
        stats = attention_stats(records)
    assert not mode.sites, dict(mode.sites)
    assert len(reads) == 1 and "models/context.py" in reads[0], reads
    assert stats["attn_density/L00"] == pytest.approx((0.1 + 0.4) / 2)
    assert stats["attn_est_recall/L01"] == pytest.approx(0.8)
    assert stats["attn_true_recall/L02"] == pytest.approx(0.7)
    assert stats["attn_output_error/L02"] == pytest.approx((0.02 + 0.05) / 2)
    assert stats["attention_paths"] == "sssd"


def test_model_forward_records_every_layer():
    from transformers import AutoModelForCausalLM

    from mtrain.tiny import tiny_config

    ids = torch.randint(0, 500, (1, 256), generator=torch.Generator().manual_seed(0))
    layers = tiny_config().num_hidden_layers
    from mtrain.models.runtime import attach_runtime

    for policy in ("auto", "always"):
        rt = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy=policy, block_size=32, recall=0.9)
        model = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=rt.name).eval()
        attach_runtime(model, rt)
        with torch.no_grad():
            model(ids)
        stats = attention_stats(rt.records.layers)
        assert len(stats["attention_paths"]) == layers
        if policy == "auto":  # 256 tokens: dense everywhere, with the predictions logged
            assert stats["attention_paths"] == "d" * layers and "attention_pred_ms" in stats
        else:
            assert stats["attention_paths"] == "s" * layers
            assert all(0 < stats[f"attn_density/L{i:02d}"] < 1 for i in range(layers))


def _hold_state(monkeypatch, hold=4):
    monkeypatch.setattr(RT.settings, "policy", dataclasses.replace(RT.settings.policy, dense_hold_steps=hold))
    monkeypatch.setattr(RT.policy, "dense_until", {})
    monkeypatch.setattr(RT.policy, "hold_streak", {})
    monkeypatch.setattr(RT.policy, "memo", {})
    monkeypatch.setattr(RT.inputs, "step", 0)


def test_checkpointing_replays_the_first_forwards_choice(monkeypatch):
    """Under non-reentrant gradient checkpointing with `checkpoint_contexts`, the recomputation for the backward
    rebuilds the index the first forward chose instead of estimating again. The case: auto runs the layer sparse
    and, as the estimate did not pay, sets a dense hold in that same forward; estimating again in the
    recomputation would run it held dense and checkpointing would refuse the backward. Checked: one estimate and
    one record, and grads equal to the same call without checkpointing."""
    import mtrain.ops
    from torch.utils.checkpoint import checkpoint

    q, k, v = inputs("local")
    _hold_state(monkeypatch)
    call(q, k, v, LOCAL, "auto", layer=6)
    free = RT.records.layers[-1]
    rows = min(q.shape[1], LOCAL.last_q + LOCAL.sample_blocks * LOCAL.block_size)
    fixed = cost.worth_estimating(seq_len=q.shape[1], heads=q.shape[2], head_dim=q.shape[3], block_size=BS,
                                  rows=rows, device="cpu").sparse_ms
    # an estimate that sparse still pays for, but not with the estimate on top (as in the test above)
    monkeypatch.setattr(cost, "CPU", dataclasses.replace(
        cost.CPU, estimate=(cost.SPARSE_MARGIN * free.dense_ms - (free.sparse_ms + fixed) / 2, 0.0)))
    estimates = []
    real = mtrain.ops.estimate_vertical_slash
    # the model layer estimates through mtrain.ops.graphed (a CUDA graph on GPUs, eager here)
    monkeypatch.setattr("mtrain.ops.graphed.estimate_vertical_slash",
                        lambda *a, **kw: estimates.append(1) or real(*a, **kw))
    dout = torch.randn_like(q)

    def grads(checkpointed: bool):
        _hold_state(monkeypatch)
        RT.records.layers.clear()
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        fn = functools.partial(call, settings=LOCAL, policy="auto", layer=6)
        if checkpointed:
            out = checkpoint(fn, qq, kk, vv, use_reentrant=False, context_fn=RT.checkpoint_contexts)
        else:
            out = fn(qq, kk, vv)
        assert [r.path for r in RT.records.layers] == ["sparse"] and RT.policy.dense_until[6] == 5  # sparse, then held
        out.backward(dout)
        assert len(RT.records.layers) == 1 and not RT.inputs.recomputing
        return out.detach(), qq.grad, kk.grad, vv.grad

    want = grads(False)
    assert len(estimates) == 1
    got = grads(True)
    assert len(estimates) == 2  # the recomputation did not estimate
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_checkpointing_frees_the_index_between_forward_and_backward():
    """Everything the sparse backward reads goes through save_for_backward, so under non-reentrant checkpointing
    a layer's lists are dropped after its forward (and rebuilt for its backward) instead of being held by the
    autograd graph until then; without checkpointing the graph keeps them."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    q, k, v = inputs("local")
    index = estimate_vertical_slash(q, k, recall=LOCAL.recall, block_size=BS, max_vertical=4, max_slash=4,
                                    min_vertical=0, min_slash=0)
    lines = index._cache["lines"]
    grads = []
    for checkpointed in (False, True):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        built = []

        def layer(a, b, c):
            idx = type(index).from_lines(*lines, q.shape[1], BS)
            built.append(weakref.ref(idx.col_ids))
            return vertical_slash_attention(a, b, c, idx)

        if checkpointed:
            out = checkpoint(layer, qq, kk, vv, use_reentrant=False, context_fn=RT.checkpoint_contexts)
        else:
            out = layer(qq, kk, vv)
        gc.collect()
        assert (built[0]() is None) == checkpointed
        out.sum().backward()
        assert len(built) == 1 + checkpointed  # the recomputation built the lists again
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_register_rejects_an_unknown_policy():
    with pytest.raises(MtrainError, match="attention.sparse_policy: 'sometimes' is not one of auto, always, never"):
        register_kind("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="sometimes")
    with pytest.raises(MtrainError, match="attention.engine: 'cudnn' is not one of auto, triton, flex, fa4"):
        register_kind("mtraining", policy=PolicySettings.every_layer_sparse(), engine="cudnn")


@pytest.mark.parametrize("given, registered, strict", [(None, "flex", False), ("triton", "flex", False),
                                                       (None, "fa4", False), (None, "fa4", True)])
def test_the_engine_reaches_the_sparse_kernels(monkeypatch, given, registered, strict):
    """The registered engine (attention.engine) is the impl of every sparse call of the kind; a call's own
    engine argument wins. The backward is the deterministic one except on fa4 (FA4 has none on Hopper) when the
    run did not ask for deterministic algorithms. The spy records the arguments and runs the real attention."""
    import mtrain.ops

    seen = []
    real = mtrain.ops.vertical_slash_attention

    def spy(*args, impl="auto", deterministic=True, **kwargs):
        seen.append((impl, deterministic))
        return real(*args, impl="torch", **kwargs)  # the CPU path whatever was asked: the test checks the routing

    if strict:
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)

    monkeypatch.setattr(mtrain.ops, "vertical_slash_attention", spy)
    rt = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), engine=registered, **dataclasses.asdict(LOCAL))
    q, k, v = inputs("local")
    module = SimpleNamespace(training=True, layer_idx=0, mtrain_runtime=rt)
    mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, settings=LOCAL,
                     policy="always", engine=given)
    engine = given or registered
    assert seen == [(engine, engine != "fa4" or strict)]


def test_cp2_ranks_agree_on_the_choice(tmp_path):
    out = tmp_path / "rows.jsonl"
    from ranks import run_script

    proc = run_script(2, "tests/workers/attention_choice.py", str(out))  # as torchrun --standalone --nproc_per_node=2
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["pattern"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["local"]["paths"] == ["sparse", "sparse"]
    assert rows["flat"]["paths"] == ["dense", "dense"]
    assert all(r["same_as_forced"] for r in rows.values())
    assert rows["flat"]["err_vs_single_dense"] < 1e-5  # the dense ring equals one-device dense (fp32)
    assert rows["local"]["err_vs_single_dense"] > 1e-2  # and the sparse ring really is sparse


def test_trainer_logs_the_choice_per_layer(tmp_path):
    """A training run writes every layer's path and density to metrics.jsonl, and the sampled true recall on
    logging.recall_every steps."""
    from mtrain.config import load_recipe
    from mtrain.data import pack
    from mtrain.data.synthetic import CorpusSpec, generate, write_jsonl
    from mtrain.tiny import MODEL_CONFIG, TOKENIZER_DIR, tiny_config
    from mtrain.train.metrics import read_metrics
    from mtrain.train.trainer import Trainer

    write_jsonl(tmp_path / "docs.jsonl", generate(CorpusSpec(num_docs=40, max_sentences=40, seed=5)))
    pack([f"{tmp_path / 'docs.jsonl'}:jsonl"], str(TOKENIZER_DIR), 256, tmp_path / "packed", progress=False, workers=1)
    rows = {}
    for policy in ("always", "auto"):
        recipe = load_recipe(None, [
            f"model.config={MODEL_CONFIG}", f"model.tokenizer={TOKENIZER_DIR}", f"data.path={tmp_path / 'packed'}",
            "data.seq_len=256", "attention.kind=mtraining", "attention.block_size=32", "attention.recall=0.6",
            f"attention.sparse_policy={policy}", "logging.wandb=disabled", "logging.recall_every=2",
            f"train.output_dir={tmp_path / policy}", "train.max_steps=2", "train.export=false",
            # one 256-token sequence per row (this model's documents of tens of tokens are too short to be sparse),
            # caps that leave out part of its 8 blocks
            "data.document_masking=false", "attention.max_vertical=4", "attention.max_slash=32"])
        Trainer(recipe).run()
        rows[policy] = read_metrics(tmp_path / policy / "metrics.jsonl")
    first, second = rows["always"]
    layers = tiny_config().num_hidden_layers
    assert first["attention_paths"] == second["attention_paths"] == "s" * layers
    assert all(0 < first[f"attn_density/L{i:02d}"] < 1 for i in range(layers))
    assert "attention_true_recall" not in first  # step 1 is not a recall step
    assert all(0 < second[f"attn_true_recall/L{i:02d}"] <= 1 for i in range(layers))
    assert 0 < second["attention_true_recall_min"] <= second["attention_true_recall"] <= 1
    assert second["attention_work"] == pytest.approx(second["attention_density"])
    # auto on a CPU at 256 tokens: dense everywhere (the sparse fixed costs do not pay), so no recall to sample
    for row in rows["auto"]:
        assert row["attention_paths"] == "d" * layers and row["attention_work"] == 1.0
        assert row["attention_pred_ms"] == pytest.approx(row["attention_pred_dense_ms"])
        assert "attention_true_recall" not in row


def test_auto_engine_is_resolved_and_logged_once(caplog):
    """attention.engine auto: the layer runs the engine `resolve_impl` names for the device and block size (our
    PyTorch path on a CPU without the Triton interpreter) and says so once in the log."""
    import logging
    import os

    from mtrain.models import attention as attn
    from mtrain.ops.attention import resolve_impl

    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu, BS) == ("triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch")
    assert resolve_impl("fa4", cpu, BS) == "fa4"
    attn._ENGINES_SAID.clear()
    q, k, v = inputs("local")
    with caplog.at_level(logging.INFO, logger="mtrain.models.attention"):
        call(q, k, v, LOCAL, "always")
        call(q, k, v, LOCAL, "always")
    said = [r.getMessage() for r in caplog.records if "sparse attention engine" in r.getMessage()]
    assert said == [f"sparse attention engine: {resolve_impl('auto', cpu, BS)} (attention.engine=auto, block {BS}, cpu)"]


def test_auto_decides_from_the_layers_previous_estimate():
    """attention.lagged_choice: a layer's first call decides from its own estimate; later calls of the same layer and
    shape from the estimate before theirs (read without waiting for the GPU), so a pattern that changes moves the
    choice one call later; another layer, or lagged_choice off, decides from its own estimate."""
    import dataclasses

    local, flat = inputs("local"), inputs("flat")
    call(*local, LOCAL, "auto", training=False)
    call(*flat, LOCAL, "auto", training=False)  # the flat pattern, decided on the local one's counts
    call(*flat, LOCAL, "auto", training=False)  # now on the flat one's own
    call(*flat, LOCAL, "auto", training=False, layer=1)  # a layer's first call: its own counts
    paths = [r.path for r in RT.records.layers]
    assert paths == ["sparse", "sparse", "dense", "dense"]
    RT.records.layers.clear()
    RT.settings.switches = dataclasses.replace(RT.switches, lagged_choice=False)  # the runtime's switch
    call(*local, LOCAL, "auto", training=False, layer=2)
    call(*flat, LOCAL, "auto", training=False, layer=2)
    assert [r.path for r in RT.records.layers] == ["sparse", "dense"]


def test_lagged_statistics_keep_a_few_shapes_per_layer():
    """An evaluation calls each layer with a new sequence length per prompt: the lagged statistics keep the layer's
    CHOICE_STATS_PER_LAYER most recent shapes, not one entry per prompt."""
    import mtrain.models.policy as policy

    q, k, v = inputs("local")
    lengths = [q.shape[1] - i * BS for i in range(policy.CHOICE_STATS_PER_LAYER + 3)]
    for S in lengths:
        call(q[:, :S], k[:, :S], v[:, :S], LOCAL, "auto", training=False, layer=3)
    kept = [key[1][1] for key in RT.policy.choice_stats if key[0] == 3]
    assert kept == lengths[-policy.CHOICE_STATS_PER_LAYER:]
