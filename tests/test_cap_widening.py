"""Cap widening under sparse_policy auto (attention.widen_caps, `mtrain.models.policy.widen`): a layer that the
estimate's recall or the quality check sends dense where the cost model said sparse, and whose caps bind, estimates
again with doubled caps on its next training call instead of being held dense. Real estimates on the worker's local
pattern (2048 tokens, block 64), whose estimated recall grows with the caps: with the 16-line caps below it is more
than RECALL_SLACK short of 0.5 at 16, 32 and 64 lines and reaches it at 128."""

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtrain.errors import MtrainError
from mtrain.models.attention import mtrain_attention
from mtrain.models.policy import MAX_CAP_SCALE, RECALL_SLACK, scaled_settings
from mtrain.models.registry import attention_runtime, register_kind
from mtrain.attention_settings import PolicySettings
from mtrain.models.runtime import AttentionRuntime, AttentionSettings, PolicyState, Records
from mtrain.ops import cost
from mtrain.parallel import SparseSettings
from mtrain.train.metrics import attention_stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "workers"))
from attention_choice import BS, SEQ, inputs  # noqa: E402  (the local pattern)

SHORT = SparseSettings(recall=0.5, block_size=BS, max_vertical=16, max_slash=16, min_vertical=0, min_slash=0)
"""Caps that bind on the local pattern: its estimate is short of recall 0.5 until the caps are 8x wider."""
TINY = dataclasses.replace(SHORT, max_vertical=4, max_slash=4)
"""Caps still short at MAX_CAP_SCALE x."""
COVERING = dataclasses.replace(SHORT, recall=0.4, max_vertical=SEQ, max_slash=SEQ)
"""Caps that cover the whole sequence: doubling them lists nothing more."""


RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
"""The attention runtime of the layer `call` runs (`mtrain.models.runtime`): fresh for every test."""


@pytest.fixture(autouse=True)
def fresh_context(monkeypatch):
    """A fresh attention runtime (one device, no holds, widening on, hold 4 steps) and the kernels' costs only (the
    online estimate's own cost changes with every estimator version)."""
    global RT
    monkeypatch.setattr(cost, "CPU", dataclasses.replace(cost.CPU, estimate=(0.0, 0.0)))
    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
    RT.settings.set_policy(dense_hold_steps=4)
    yield


@pytest.fixture
def estimates(monkeypatch):
    """The keywords of every estimate the layer runs (through mtrain.ops.graphed: eager off CUDA) and its index."""
    import mtrain.ops

    seen = []
    real = mtrain.ops.estimate_vertical_slash

    def spy(*args, **kwargs):
        index = real(*args, **kwargs)
        seen.append((kwargs, index))
        return index

    monkeypatch.setattr("mtrain.ops.graphed.estimate_vertical_slash", spy)
    return seen


def call(settings, step, *, layer=5, max_error=False, qkv=None):
    """One training call of layer `layer` at optimizer step `step`; returns (output, its LayerRecord)."""
    q, k, v = qkv or inputs("local")
    RT.inputs.step = step
    module = SimpleNamespace(training=True, layer_idx=layer, mtrain_runtime=RT)
    out, _ = mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              settings=settings, policy="auto", max_error=max_error)
    return out, RT.records.layers[-1]


def test_a_recall_short_layer_with_binding_caps_estimates_again_with_doubled_caps(estimates):
    """Scale 1 -> 2 -> 4 -> 8 over successive training calls, each estimate with the caps doubled (its index lists
    as many verticals as the wider cap allows) and no dense hold; at 8x the estimate reaches the recall and the layer
    runs sparse. Each choice reads its own estimate (the lagged statistics of the narrower caps are dropped)."""
    records = []
    for step in range(4):
        _, record = call(SHORT, step)
        records.append(record)
    assert [kw["max_vertical"] for kw, _ in estimates] == [16, 32, 64, 128]
    assert [kw["max_slash"] for kw, _ in estimates] == [16, 32, 64, 128]
    assert [index._cache["lines"][0].shape[-1] for _, index in estimates] == [16, 32, 64, 128]
    recalls = [float(r.est_recall.mean()) for r in records]
    assert all(x < SHORT.recall - RECALL_SLACK for x in recalls[:3]) and recalls[3] >= SHORT.recall - RECALL_SLACK
    assert [(r.path, r.held, r.cap_scale, r.widened) for r in records] == [
        ("dense", False, 1, True), ("dense", False, 2, True), ("dense", False, 4, True), ("sparse", False, 8, False)]
    assert all(r.sparse_ms < r.dense_ms for r in records)  # the cost model said sparse every time
    assert RT.policy.cap_scale == {5: 8} and 5 not in RT.policy.dense_until and 5 not in RT.policy.hold_streak
    stats = attention_stats(records[:2])
    assert stats["attn_cap_scale/L05"] == 1.5 and stats["attention_widened_layers"] == 1
    assert stats["attention_widened_calls"] == 2
    assert attention_stats(records[3:])["attention_widened_calls"] == 0
    # another layer keeps the recipe's caps (its own settings, its own graph key on a GPU)
    call(SHORT, 4, layer=2)
    assert estimates[-1][0]["max_vertical"] == 16 and RT.policy.cap_scale == {5: 8, 2: 2}


def test_the_quality_check_widens_caps_that_keep_the_estimate_short(estimates):
    """Target 0.42: the estimate is within RECALL_SLACK of it at 16, 32 and 64 lines but short (its caps bind), and
    the quality check sends the layer dense: the caps double and each next call is checked again; at 128 lines (the
    bound) the failing check holds the layer dense."""
    near = dataclasses.replace(SHORT, recall=0.42)
    records = [call(near, step, max_error=1e-6)[1] for step in range(4)]
    recalls = [float(r.est_recall.mean()) for r in records]
    assert all(near.recall - RECALL_SLACK <= x < near.recall for x in recalls[:3]), recalls
    assert all(r.output_error is not None and float(r.output_error.max()) > 1e-6 for r in records)
    assert [(r.path, r.held, r.cap_scale, r.widened) for r in records] == [
        ("dense", False, 1, True), ("dense", False, 2, True), ("dense", False, 4, True), ("dense", False, 8, False)]
    assert [kw["max_vertical"] for kw, _ in estimates] == [16, 32, 64, 128]
    assert RT.policy.cap_scale == {5: 8} and RT.policy.dense_until[5] == 3 + 1 + RT.settings.policy.dense_hold


def test_the_quality_check_holds_a_layer_whose_estimate_met_its_recall(estimates):
    """Target 0.38, met at 16 lines: the estimate lists the fewest lines reaching it, below its caps, so wider caps
    would list the same lines; the layer the check sends dense is held as without widening."""
    met = dataclasses.replace(SHORT, recall=0.38)
    _, record = call(met, 0, max_error=1e-6)
    assert float(record.est_recall.mean()) >= met.recall and float(record.output_error.max()) > 1e-6
    assert (record.path, record.widened, RT.policy.cap_scale) == ("dense", False, {})
    assert RT.policy.dense_until[5] == 0 + 1 + RT.settings.policy.dense_hold


@pytest.mark.parametrize("case", ["recall", "error"])
def test_caps_that_cover_the_sequence_hold_dense_as_before(estimates, case):
    """Caps that already cover the sequence: the layer runs dense and is held for dense_hold steps exactly as with
    widening off (same paths, outputs, holds and estimates); the scale stays 1."""
    # recall: slashes asked for less mass than the target leave the estimate short though no cap binds
    settings, max_error = ((dataclasses.replace(COVERING, recall=0.6, slash_recall=0.3), False) if case == "recall"
                           else (COVERING, 1e-6))

    def run(widen):
        RT.policy, RT.records = PolicyState(), Records()
        RT.settings.set_policy(widen_caps=widen)
        estimates.clear()
        outs = [call(settings, step, max_error=max_error)[0] for step in range(3)]
        records = [(r.path, r.held, r.cap_scale, r.widened) for r in RT.records.layers]
        return outs, records, dict(RT.policy.dense_until), dict(RT.policy.hold_streak), len(estimates)

    on, off = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(on[0], off[0]))
    assert on[1:] == off[1:]
    first = RT.records.layers[0]  # sent dense by the recall or the check, where the cost model said sparse
    assert first.sparse_ms < first.dense_ms
    if case == "recall":
        assert float(first.est_recall.mean()) < settings.recall - RECALL_SLACK
    else:
        assert float(first.output_error.max()) > max_error
    assert on[1] == [("dense", False, 1, False), ("dense", True, 1, False), ("dense", True, 1, False)]
    assert on[2] == {5: 0 + 1 + RT.settings.policy.dense_hold} and on[4] == 1 and RT.policy.cap_scale == {}


def test_caps_that_do_not_bind_change_nothing(estimates):
    """A layer whose estimate meets its recall (sparse) and one the cost model sends dense (flat attention, the
    recipe's default caps, which cover this sequence) take the same paths, holds and outputs with widening on and
    off."""
    flat = inputs("flat")

    def run(widen):
        RT.policy, RT.records = PolicyState(), Records()
        RT.settings.set_policy(widen_caps=widen)
        outs = []
        for step in range(3):
            outs.append(call(dataclasses.replace(SHORT, recall=0.35), step, layer=1)[0])
            outs.append(call(SparseSettings(recall=1.0, block_size=BS), step, layer=3, qkv=flat)[0])
        return outs, [(r.layer, r.path, r.held) for r in RT.records.layers], dict(RT.policy.dense_until)

    on, off = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(on[0], off[0])) and on[1:] == off[1:]
    assert ("sparse" in [p for _, p, _ in on[1]]) and on[2] == {3: 1 + RT.settings.policy.dense_hold}
    assert RT.policy.cap_scale == {}


def test_at_the_bound_the_layer_is_held_dense(estimates):
    """Caps still short at MAX_CAP_SCALE x: after the last doubling the layer is held dense as without widening,
    keeps its widest caps, and estimates with them when the hold ends."""
    paths = []
    for step in range(6):
        _, record = call(TINY, step)
        paths.append((record.path, record.held, record.cap_scale, record.widened))
    assert paths[:4] == [("dense", False, 1, True), ("dense", False, 2, True), ("dense", False, 4, True),
                         ("dense", False, 8, False)]
    assert paths[4:] == [("dense", True, 8, False)] * 2
    assert RT.policy.cap_scale == {5: MAX_CAP_SCALE} and RT.policy.dense_until[5] == 3 + 1 + RT.settings.policy.dense_hold
    assert [kw["max_vertical"] for kw, _ in estimates] == [4, 8, 16, 32]
    call(TINY, RT.policy.dense_until[5])
    assert estimates[-1][0]["max_vertical"] == 4 * MAX_CAP_SCALE


def test_widening_is_training_only_and_scales_cap_fraction(estimates):
    """Eval calls never widen (they estimate with the layer's scale); cap_fraction doubles with the caps, up to 1."""
    q, k, v = inputs("local")
    module = SimpleNamespace(training=False, layer_idx=5, mtrain_runtime=RT)
    mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, settings=SHORT,
                     policy="auto")
    assert RT.policy.cap_scale == {} and not RT.records.layers[-1].widened
    fraction = dataclasses.replace(SHORT, max_vertical=SEQ, max_slash=SEQ, cap_fraction=0.004)  # 9 verticals
    for step in range(3):
        call(fraction, step)
    assert [kw["cap_fraction"] for kw, _ in estimates[1:]] == [0.004, 0.008, 0.016]
    assert [kw["max_vertical"] for kw, _ in estimates[1:]] == [SEQ, 2 * SEQ, 4 * SEQ]
    assert [index._cache["lines"][0].shape[-1] for _, index in estimates[1:]] == [9, 17, 33]
    assert scaled_settings(dataclasses.replace(SHORT, cap_fraction=0.3), 4).cap_fraction == 1.0


def test_policy_state_keeps_the_cap_scales_and_old_states_load():
    """The runtime's state_dict carries each layer's scale through JSON; a fresh runtime starts a run at the recipe's
    caps; a state saved before widening (no "cap_scale") loads as every layer at 1."""
    global RT
    RT = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", dense_hold_steps=4, block_size=BS)
    for step in range(2):
        call(SHORT, step)
    assert RT.policy.cap_scale == {5: 4}
    saved = json.loads(json.dumps(RT.state_dict()))
    assert saved["cap_scale"] == [[5, 4]]
    RT = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", dense_hold_steps=4, block_size=BS)
    assert RT.policy.cap_scale == {}
    RT.load_state_dict(saved)
    assert RT.policy.cap_scale == {5: 4} and json.loads(json.dumps(RT.state_dict())) == saved
    old = {key: value for key, value in saved.items() if key != "cap_scale"}
    RT.load_state_dict(old)
    assert RT.policy.cap_scale == {}


def test_widen_caps_is_validated_and_reaches_the_context():
    assert attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", widen_caps=False).settings.policy.widen_caps is False
    assert attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto").settings.policy.widen_caps is True
    with pytest.raises(MtrainError, match="attention.widen_caps: expected true or false"):
        register_kind("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", widen_caps="yes")


def short_caps(scale):
    """(vertical, slash) line caps of SHORT widened `scale` times, over the pattern's sequence."""
    from mtrain.ops.estimate import line_caps

    x = scaled_settings(SHORT, scale)
    return line_caps(SEQ, BS, x.max_vertical, x.max_slash, x.cap_fraction)


def widening_paths(first, steps: int = 2) -> list:
    """(path, cap scale, widened) of the first call's record and of the SHORT layer's next `steps` training calls."""
    paths = [(first.path, first.cap_scale, first.widened)]
    for step in range(1, steps + 1):
        _, record = call(SHORT, step)
        paths.append((record.path, record.cap_scale, record.widened))
    return paths


def test_widening_stops_where_the_wider_lists_would_exceed_the_limit(estimates, monkeypatch):
    """attention.widen_max_list_mib: with the limit between the lists' bytes at 4x and at 8x the caps (by
    `list_bytes` over the index's query blocks: per block and head two entries per slash offset, the sink and the
    diagonal, one per vertical, int32), the layer widens to 4x and is then held dense as at MAX_CAP_SCALE; with no
    limit the same calls widen to 8x."""
    from mtrain.models import policy
    from mtrain.models.policy import list_bytes

    _, first = call(SHORT, 0)
    index = estimates[0][1]
    b, h, rows = index.block_ids.shape[:3]
    cap_v, cap_s = short_caps(8)
    assert list_bytes(index, cap_v, cap_s) == b * h * rows * (2 * cap_s + 2 + cap_v) * 4
    # the limit is whole MiB: each byte of these small lists counts as a MiB
    monkeypatch.setattr(policy, "list_bytes", lambda *args, **kw: list_bytes(*args, **kw) * 2**20)
    RT.settings.set_policy(widen_max_list_mib=(list_bytes(index, *short_caps(4)) + list_bytes(index, *short_caps(8))) // 2)
    assert widening_paths(first) == [("dense", 1, True), ("dense", 2, True), ("dense", 4, False)]
    assert RT.policy.cap_scale == {5: 4} and RT.policy.dense_until[5] == 2 + 1 + RT.settings.policy.dense_hold
    RT.settings.set_policy(widen_max_list_mib=0)  # no limit: the next estimate widens on to 8x and reaches the recall
    RT.policy.dense_until.clear()
    _, record = call(SHORT, 3)
    assert (record.path, record.widened) == ("dense", True) and RT.policy.cap_scale == {5: 8}


def test_widen_max_list_mib_is_validated_and_reaches_the_context():
    settings = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", widen_max_list_mib=512).settings
    assert settings.policy.widen_max_list_bytes == 512 * 2**20
    assert attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto").settings.policy.widen_max_list_bytes == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(MtrainError, match="attention.widen_max_list_mib: must be an integer >= 0"):
            register_kind("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="auto", widen_max_list_mib=bad)


def test_the_scales_fit_the_graph_caches():
    """Every scale a layer can reach (1, 2, 4, ... MAX_CAP_SCALE) is one estimate setting per shape: no more of them
    than the estimate's graph caches keep."""
    from mtrain.ops import graphed
    from mtrain.parallel import graphed as ring_graphed

    scales = 1 + MAX_CAP_SCALE.bit_length() - 1
    assert scales <= min(graphed.MAX_GRAPHS, ring_graphed.MAX_GRAPHS)


@pytest.mark.slow
def test_cp2_ranks_widen_alike(tmp_path):
    """Under context parallelism (2 ranks, gloo) the layer's estimate across the group is short at 16, 32 and 64
    lines: every rank doubles its caps on the same calls (the decision reads the est_recall every rank shares) and
    runs its next estimate with them, none holds it dense, and at 128 lines every rank runs it sparse."""
    from ranks import run_script

    out = tmp_path / "rows.jsonl"
    proc = run_script(2, "tests/workers/cap_widening.py", str(out))  # as torchrun --standalone --nproc_per_node=2
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        assert row["ranks"][0] == row["ranks"][1], row
        assert not row["held"], row
    assert [(r["ranks"][0][:3], r["scale_after"]) for r in rows] == [
        (["dense", 1, True], 2), (["dense", 2, True], 4), (["dense", 4, True], 8), (["sparse", 8, False], 8)]


def test_the_real_model_benchmark_settles_a_layers_caps_before_it_decides():
    """`mtrain.bench.real.training_choice` runs a recall-short layer until widening stops (scales 2, 4, 8), so the
    path it reports is the one training settles on, and it leaves the settled scale in RT.policy.cap_scale for the
    perplexity pass at that length; a layer that does not bind is decided in one call at the recipe's caps."""
    from mtrain.bench.real import training_choice

    q, k, v = inputs("local")  # [1, S, H, D], as the benchmark captures them
    scale = q.shape[-1] ** -0.5
    assert training_choice(5, q, k, v, SHORT, scale, rt=RT) == "sparse"
    assert RT.policy.cap_scale[5] == 8  # short at 1x, 2x and 4x (this module's docstring), sparse at 8x
    assert not RT.policy.dense_until and not RT.records.layers  # holds and records left as they were found
    assert training_choice(7, q, k, v, TINY, scale, rt=RT) == "dense"  # still short at 8x: dense, as training holds it
    assert RT.policy.cap_scale[7] == 8
    assert training_choice(6, q, k, v, COVERING, scale, rt=RT) == "sparse" and RT.policy.cap_scale.get(6, 1) == 1


def test_widening_stops_before_lists_the_kernels_cannot_address(estimates, monkeypatch):
    """The kernels address list entries with 32-bit offsets (`mtrain.ops.lists.MAX_LIST_ENTRIES`; at 256K tokens on
    one GPU, 9 heads at 8x the default vertical cap reach 2**31 column entries and read out of bounds): with the limit
    between the column lists' entries at 4x and at 8x the caps, the layer widens to 4x and is then held dense, as
    under widen_max_list_mib (the kernels' own refusal: tests/test_ops_partial.py)."""
    from mtrain.models import policy

    _, first = call(SHORT, 0)
    index = estimates[0][1]
    b, h, rows = index.block_ids.shape[:3]
    assert policy.column_list_entries(index, *short_caps(8)) == b * h * rows * short_caps(8)[0]
    limit = sum(policy.column_list_entries(index, *short_caps(scale)) for scale in (4, 8)) // 2
    monkeypatch.setattr(policy, "MAX_LIST_ENTRIES", limit)
    assert widening_paths(first) == [("dense", 1, True), ("dense", 2, True), ("dense", 4, False)]
