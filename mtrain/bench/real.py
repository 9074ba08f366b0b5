"""Sparse attention on a REAL model's attention: `mtrain bench real --model DIR --seq-len N` (the same as
`mtrain bench attention --model DIR --seq-len N`).

One run: load a pretrained HF Llama/Qwen2 checkpoint (or a .gguf file, converted on the fly) with YaRN set
for the sequence length, run real prose through it once and capture the post-RoPE q/k/v of every layer;
then per layer and for the whole model: the estimated pattern's density, estimated and TRUE recall (the
exact attention mass of the rows that the index keeps), forward+backward time of dense attention (cuDNN
on the GPU) and of mtrain's attention as training calls it (estimate, per-layer sparse/dense choice,
kernels), with the forced-sparse breakdown (index, forward, backward); and the whole-model perplexity of
the same tokens, in labelled rows: dense; at the TRAINING choice (each layer forced onto the path that the timed
training-mode call took: the cost model priced forward + backward); at the INFERENCE choice (the model in eval mode
under no_grad, where the cost model prices a forward only, so layers may go dense that training runs sparse); and
with every layer sparse. Each row lists the layers that ran sparse in it. On the GPU, dense and mtrain's attention
as trained (every step, and the steady state of a layer held dense between estimates) are timed with their calls
queued back to back, as training queues them; the forced-sparse breakdown times each call alone. Works on the CPU
at small lengths (slow; for smoke tests).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mtrain.atomic import write_json_atomic
from mtrain.bench.model import as_trained as model_layer
from mtrain.bench.model import (BENCH_NAME, capture_qkv, fwd_bwd, load_model,  # noqa: F401 (re-exported)
                                perplexity, register_bench_attention, resolve_model, yarn_factor)
from mtrain.bench.timing import timed
from mtrain.errors import MtrainError


PPL_LABELS = {
    "dense": "dense",
    "training_choice": "training choice (each layer on the path the timed training-mode call took, its choice priced "
                       "forward + backward)",
    "inference_choice": "inference choice (eval mode, no_grad: each layer's choice priced forward only)",
    "all_sparse": "every layer sparse",
}
"""The perplexity rows `run` reports (summary["perplexity"]), by key."""


# ----------------------------------------------------------------------------- per layer
@dataclass
class LayerResult:
    layer: int
    density: float
    est_recall: float | None
    true_recall: float
    min_head_recall: float
    path: str
    """what mtrain's attention chose for this layer (sparse / dense)"""
    dense_ms: float
    mtrain_ms: float
    """fwd+bwd of mtrain's attention as training calls it (estimate + choice + kernels)"""
    index_ms: float
    fwd_ms: float
    bwd_ms: float
    """forced-sparse breakdown"""
    steady_ms: float = float("nan")
    """mean fwd+bwd of mtrain's attention over dense_hold + 1 training steps in a row (the step counter moving):
    what a layer costs per step once a layer whose estimate does not pay holds dense between estimates"""
    held: bool = False
    """whether the layer's choice held it dense for the following steps (attention.dense_hold_steps)"""
    long_run_ms: float = float("nan")
    """steady_ms once the holds have grown to their longest (HOLD_BACKOFF_MAX x dense_hold steps): the measured
    estimating step and held steps, weighted as a long training run repeats them (= steady_ms when not held)"""
    extra: dict = field(default_factory=dict)


def _settings_kwargs(settings) -> dict:
    import dataclasses

    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


def measure_layer(layer: int, q, k, v, settings, scale: float, iters: int, recall_rows: int | None,
                  policy: str = "auto", hold: int = 16, engine: str = "auto", max_error=None, *,
                  rt) -> LayerResult:
    """All measures of one layer's captured q/k/v (see the module docstring); engine: the sparse path's block
    engine (`vertical_slash_attention`'s impl); max_error: the policy's quality check (attention.max_output_error);
    rt: the model's attention runtime (`mtrain.models.runtime`), whose policy state the calls use."""
    import functools

    from mtrain.ops import dense_attention, estimate_vertical_slash, vertical_slash_attention
    from mtrain.ops.columns import list_free_bytes, with_list_free_columns
    from mtrain.ops.index import list_bytes, used_list_bytes

    sparse_kw = dict(_settings_kwargs(settings), softmax_scale=scale)
    sparse_kw["last_q"] = min(settings.last_q, q.shape[1])

    def estimate():
        with torch.no_grad():
            return estimate_vertical_slash(q, k, **sparse_kw)

    index = estimate()
    dout = torch.randn_like(q)
    dense = functools.partial(dense_attention, causal=True, softmax_scale=scale)
    dense_ms = timed(fwd_bwd(dense, q, k, v, dout), iters, warmup=3, back_to_back=True)

    # mtrain's attention function exactly as a model layer calls it (HF layout in, [B, S, H, D] out)
    as_trained = model_layer(layer, scale, rt, settings=settings, policy=policy, engine=engine, max_error=max_error)

    marks = len(rt.records.densities), len(rt.records.layers)
    saved = (rt.settings.policy, rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until,
             rt.inputs.step)
    try:
        rt.settings.set_policy(dense_hold_steps=0)
        rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until = {}, {}, {}
        # the caps this layer's training settles on (attention.widen_caps), kept in rt.policy.cap_scale for the
        # perplexity pass at this length, which then runs the layer as it was timed
        rt.policy.cap_scale.pop(layer, None)
        _settle_caps(rt, fwd_bwd(as_trained, q, k, v, dout), marks[1])
        mtrain_ms = timed(fwd_bwd(as_trained, q, k, v, dout), iters, warmup=3, back_to_back=True)  # graph captured first
        path = _last_path(rt, marks[1], policy)
        last = rt.records.layers[-1] if len(rt.records.layers) > marks[1] else None
        output_err = None if last is None or last.output_error is None else float(last.output_error.float().max())
        # steady state in training: hold + 1 steps in a row, one estimate then `hold` held-dense steps when the
        # estimate did not pay (else every step estimates); later holds double (HOLD_BACKOFF_MAX), so this is
        # the costliest stretch of a held layer. Queued back to back, as training steps are.
        rt.settings.set_policy(dense_hold_steps=hold)
        step_fn = fwd_bwd(as_trained, q, k, v, dout)

        def steps(first: int, count: int):
            def run():
                for step in range(first, first + count):
                    rt.inputs.step = step
                    step_fn()
            return run

        steady_ms = timed(steps(0, hold + 1), 1, warmup=0, back_to_back=True) / (hold + 1)
        held = bool(rt.policy.dense_until)
        long_run_ms = steady_ms
        if held and hold > 0:  # the held steps again (still inside the hold), apart from the estimating one
            from mtrain.models.policy import HOLD_BACKOFF_MAX

            held_ms = timed(steps(1, hold), 1, warmup=0, back_to_back=True) / hold
            estimating_ms = steady_ms * (hold + 1) - held_ms * hold
            period = hold * HOLD_BACKOFF_MAX
            long_run_ms = (estimating_ms + period * held_ms) / (period + 1)
    finally:
        (rt.settings.policy, rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until,
         rt.inputs.step) = saved
    del rt.records.densities[marks[0]:], rt.records.layers[marks[1]:]

    # forced-sparse breakdown: all in (fresh index each time), then kernels on a prebuilt index; the backward
    # training runs (deterministic), and the fused atomic one beside it
    def all_in(qq, kk, vv):
        return vertical_slash_attention(qq, kk, vv, estimate(), softmax_scale=scale, impl=engine)

    total_ms = timed(fwd_bwd(all_in, q, k, v, dout), iters)
    fwd_ms = timed(lambda: vertical_slash_attention(q, k, v, index, softmax_scale=scale, impl=engine), iters)
    bwd = {}
    for deterministic in (True, False):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = vertical_slash_attention(qq, kk, vv, index, softmax_scale=scale, deterministic=deterministic,
                                       impl=engine)
        bwd[deterministic] = timed(lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True), iters)

    # the same kernels with the columns read list-free (mtrain.ops.columns), fwd + both backwards, beside the lists'
    # (a fresh copy of the index: what the kernels derive is rebuilt in the warm-up call)
    kernels_ms = {}
    vc_index = with_list_free_columns(index)
    for form, idx in (("lists", index), ("list_free", vc_index)):
        if idx is None:  # an index without its lines has no list-free form
            continue
        for deterministic in (True, False):
            kernels_ms[f"{form}_{'deterministic' if deterministic else 'atomic'}_ms"] = timed(fwd_bwd(
                lambda qq, kk, vv, idx=idx, det=deterministic: vertical_slash_attention(
                    qq, kk, vv, idx, softmax_scale=scale, deterministic=det, impl=engine), q, k, v, dout), iters)

    # the index as model layers build it on CUDA: replayed from a CUDA graph with the engine's plans (graphed.py)
    graph_ms = float("nan")
    if q.is_cuda:
        from mtrain.models.attention import prepare_spec, say_engine
        from mtrain.ops.graphed import estimate_graphed

        prepare = prepare_spec(q, k, say_engine(engine, q, settings.block_size), None)
        with torch.no_grad():
            graph_ms = timed(lambda: estimate_graphed(q, k, **sparse_kw, prepare=prepare), iters, warmup=2)
    est = index._cache.get("est_recall")
    per_head = _true_recall(q, k, index, scale, recall_rows)
    lines = index._cache.get("lines")  # (verticals, slashes) per head, -1 padded to the caps
    verticals = int((lines[0] >= 0).sum(-1).max()) if lines is not None else -1
    counts = index.col_counts.float()
    return LayerResult(
        layer=layer, density=index.density(), est_recall=None if est is None else float(est.float().mean()),
        true_recall=float(per_head.mean()), min_head_recall=float(per_head.min()), path=path,
        dense_ms=dense_ms, mtrain_ms=mtrain_ms, index_ms=max(0.0, total_ms - fwd_ms - bwd[True]), fwd_ms=fwd_ms,
        bwd_ms=bwd[True], steady_ms=steady_ms, held=held, long_run_ms=long_run_ms,
        extra={"bwd_deterministic_ms": bwd[True], "bwd_atomic_ms": bwd[False], "index_graph_ms": graph_ms,
               # verticals the estimate chose (most in one head) against the width of the column lists (on CUDA
               # the vertical cap: the memory the lists take and the graph copies)
               "verticals_max": verticals, "output_error": output_err, "column_list_width": int(index.col_ids.shape[-1]),
               # the layer's lists as held, and as wide as the longest list this pattern uses
               "index_bytes": list_bytes(index), "index_bytes_used_widths": used_list_bytes(index),
               # the same index with list-free columns (mtrain.ops.columns): blocks, verticals, flags, backward plan
               "index_bytes_list_free": list_free_bytes(index if vc_index is None else vc_index),
               # fwd + bwd on the prebuilt index, lists against list-free columns (lists_/list_free_ + backward)
               "kernels_ms": kernels_ms,
               "columns_per_row_max": int(counts.max()), "columns_per_row_mean": float(counts.mean())},
    )


def _settle_caps(rt, step, mark: int) -> None:
    """Run the layer's training call until cap widening (`mtrain.models.policy.widen`) stops widening it, as the
    first steps of a run do, so that the timed calls all run at the caps training settles on (at most
    log2(MAX_CAP_SCALE) + 1 calls; none beyond the first where the layer is not widened)."""
    from mtrain.models.policy import MAX_CAP_SCALE

    for _ in range(MAX_CAP_SCALE.bit_length()):
        before = len(rt.records.layers)
        step()
        if not any(record.widened for record in rt.records.layers[max(before, mark):]):
            return


def _last_path(rt, mark: int, policy: str) -> str:
    """The path of the last mtrain attention call since rt.records.layers had `mark` records (policy "never" records
    nothing: dense)."""
    if len(rt.records.layers) > mark:
        return rt.records.layers[-1].path
    return "dense" if policy == "never" else "sparse"


def training_choice(layer: int, q, k, v, settings, scale: float, policy: str = "auto", engine: str = "auto",
                    max_error=None, *, rt) -> str:
    """The path ("sparse" / "dense") mtrain's attention takes for this layer's captured q/k/v [1, S, H, D] when a
    training step calls it (module in training mode: the cost model prices forward + backward), from one untimed
    call; for the layers `measure_layer` does not time. Leaves the policy state as it found it, but for the caps the
    layer settles on under cap widening (rt.policy.cap_scale, which the perplexity pass then runs it at)."""
    from mtrain.models.attention import mtrain_attention

    class _Layer:
        layer_idx = layer
        training = True
        mtrain_runtime = rt

    marks = len(rt.records.densities), len(rt.records.layers)
    saved = rt.settings.policy, rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until
    try:
        rt.settings.set_policy(dense_hold_steps=0)
        rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until = {}, {}, {}
        rt.policy.cap_scale.pop(layer, None)

        def call():
            with torch.no_grad():
                mtrain_attention(_Layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                 scaling=scale, settings=settings, policy=policy, engine=engine, max_error=max_error)

        _settle_caps(rt, call, marks[1])  # the caps training settles on stay in rt.policy.cap_scale, as measure_layer's
        return _last_path(rt, marks[1], policy)
    finally:
        rt.settings.policy, rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until = saved
        del rt.records.densities[marks[0]:], rt.records.layers[marks[1]:]


def forced_paths_attention(paths: dict, settings, engine: str = "auto"):
    """An HF attention function (for `register_bench_attention`) that runs layer i on `paths[i]` ("sparse": estimate
    and sparse kernels, as policy "always"; "dense": dense, as policy "never") whatever the cost model would choose
    in this mode: the training choice's paths in an eval-mode perplexity pass."""
    from mtrain.models.attention import mtrain_attention

    policies = {"sparse": "always", "dense": "never"}

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        return mtrain_attention(module, query, key, value, attention_mask, scaling=scaling, settings=settings,
                                policy=policies[paths[module.layer_idx]], engine=engine, **kwargs)

    return attend


def perplexity_as_run(model, ids: torch.Tensor, fn) -> tuple[float, list[int]]:
    """(perplexity, the layers that ran sparse) of `model` over `ids` with the bench's attention name pointed at
    `fn` (None: dense); what ran is read from the records mtrain's attention leaves (rt.records.layers). Each pass is
    one forward: the lagged choice's statistics are cleared first, so every layer choosing reads its own estimate."""
    from mtrain.models.runtime import runtime_of

    rt = runtime_of(model)
    marks = len(rt.records.densities), len(rt.records.layers)
    rt.policy.choice_stats.clear()
    register_bench_attention(fn)
    try:
        value = perplexity(model, ids)
        ran = {r.layer: r.path for r in rt.records.layers[marks[1]:]}
    finally:
        register_bench_attention(None)
        del rt.records.densities[marks[0]:], rt.records.layers[marks[1]:]
    return value, sorted(layer for layer, path in ran.items() if path == "sparse")


def _true_recall(q, k, index, scale, rows: int | None) -> torch.Tensor:
    """Per-head true recall [Hq] over all rows (or `rows` rows spread evenly over the sequence)."""
    from mtrain.ops.recall import true_recall

    S = q.shape[1]
    sel = None
    if rows is not None and rows < S:
        sel = torch.linspace(0, S - 1, rows, device=q.device).round().long().unique()
    return true_recall(q, k, index, softmax_scale=scale, rows=sel)[0]


# ----------------------------------------------------------------------------- the whole run
def run(model: str, seq_len: int, *, settings=None, policy: str = "auto", yarn="auto", device=None, dtype=None,
        iters: int = 5, hold: int | None = None, engine: str = "auto",
        layers: list[int] | None = None, recall_rows: int | None = None, out_dir: str | None = None,
        text: str = "prose", log=print, max_error: float | None = None, escalate_recall: float | None = None) -> dict:
    """Benchmark one model at one length on text of kind `text` (`mtrain.data.texts.TEXT_KINDS`); returns (and
    writes to out_dir/real_<S>.json, or real_<S>_<text>.json for a kind other than prose) the results. max_error: the
    policy's quality check (attention.max_output_error) in the timed calls and both choices; escalate_recall: with it,
    attention.escalate_recall (a layer over the limit estimates at this recall from then on)."""
    from mtrain.config import AttentionConfig
    from mtrain.parallel import SparseSettings

    hold = AttentionConfig.dense_hold_steps if hold is None else hold

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    settings = settings or SparseSettings()
    from mtrain.attention_settings import PolicySettings

    try:  # the policy's own check (with this benchmark's sparse policy and hold, named by its flags)
        PolicySettings(sparse_policy=policy, engine=engine, max_output_error=max_error, escalate_recall=escalate_recall,
                       dense_hold_steps=hold).for_recall(settings.recall)
    except MtrainError as err:
        raise SystemExit(f"--escalate-recall {escalate_recall} needs --max-output-error and a recall above "
                         f"{settings.recall} and at most 1 ({err})") from None
    path = resolve_model(model)
    from transformers import AutoTokenizer

    from mtrain.data.texts import TEXT_LABELS, text_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    ids = torch.tensor([text_tokens(tokenizer, seq_len, text)], device=device)
    net, factor = load_model(path, seq_len, yarn, device, dtype)
    cfg = net.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scale = head_dim ** -0.5
    log(f"model {path.name}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q / "
        f"{cfg.num_key_value_heads} kv heads x {head_dim}; S={seq_len}, YaRN factor {factor:g}, {dtype}, "
        f"{device.type}; engine {engine}; text {text}: {TEXT_LABELS[text]}; settings {settings}"
        f"{'' if max_error is None else f'; max_output_error {max_error}'}"
        f"{'' if escalate_recall is None else f'; escalate_recall {escalate_recall}'}")

    from mtrain.models.runtime import runtime_of

    rt = runtime_of(net)  # the bench's layer calls share the model's runtime: its caps, escalations and records
    rt.policy.choice_stats.clear()  # a fresh run: no layer's choice reads an estimate from before it (lagged_choice)
    # every layer at the settings' recall; the escalation with the check it needs (the calls pass the limit too)
    rt.settings.set_policy(max_output_error=max_error, escalate_recall=escalate_recall)
    rt.policy.layer_recall = {}
    t0 = time.perf_counter()
    qkv = capture_qkv(net, ids)
    log(f"captured q/k/v of {len(qkv)} layers in {time.perf_counter() - t0:.1f} s")
    picked = layers if layers is not None else list(range(len(qkv)))
    results = []
    for i in picked:
        q, k, v = qkv[i]
        r = measure_layer(i, q, k, v, settings, scale, iters, recall_rows, policy, hold, engine, max_error, rt=rt)
        results.append(r)
        log(f"layer {i:3d}: density {r.density:.3f} est {r.est_recall if r.est_recall is None else round(r.est_recall, 3)} "
            f"true {r.true_recall:.3f} (min head {r.min_head_recall:.3f})"
            f"{'' if r.extra['output_error'] is None else ' output error %.4f' % r.extra['output_error']} "
            f"{r.path:6s} | dense {r.dense_ms:7.2f} ms "
            f"mtrain {r.mtrain_ms:7.2f} ms ({r.dense_ms / r.mtrain_ms:4.2f}x) steady {r.steady_ms:7.2f} ms "
            f"({r.dense_ms / r.steady_ms:4.2f}x{', held' if r.held else ''}) | sparse index {r.index_ms:6.2f} "
            f"(graph {r.extra['index_graph_ms']:5.2f}) "
            f"fwd {r.fwd_ms:6.2f} bwd {r.bwd_ms:6.2f} (deterministic {r.extra['bwd_deterministic_ms']:6.2f}, "
            f"atomic {r.extra['bwd_atomic_ms']:6.2f})")
    # the training choice of every layer: the timed (training-mode) call's path for the measured layers, one untimed
    # training-mode call for the others
    training_paths = {r.layer: r.path for r in results}
    for i, (q, k, v) in enumerate(qkv):
        if i not in training_paths:
            training_paths[i] = training_choice(i, q, k, v, settings, scale, policy, engine, max_error, rt=rt)
    training_paths = [training_paths[i] for i in range(len(qkv))]
    del qkv

    import functools

    from mtrain.models.attention import mtrain_attention

    # perplexity rows (PPL_LABELS): key -> attention function; each row records the layers that ran sparse in it
    rows = {
        "dense": None,
        # each layer on the path the training choice took (priced forward + backward), forced in the eval pass
        "training_choice": forced_paths_attention(dict(enumerate(training_paths)), settings, engine),
        # the model in eval mode under no_grad: the policy choosing again, priced as a forward only
        "inference_choice": functools.partial(mtrain_attention, settings=settings, policy=policy, engine=engine,
                                              max_error=max_error),
        "all_sparse": functools.partial(mtrain_attention, settings=settings, policy="always", engine=engine),
    }
    ppl, ran_sparse = {}, {}
    for name, fn in rows.items():
        ppl[name], ran_sparse[name] = perplexity_as_run(net, ids, fn)
    ppl_dense = ppl["dense"]
    want = [i for i, p in enumerate(training_paths) if p == "sparse"]
    if ran_sparse["training_choice"] != want:  # the forced paths are what ran
        raise MtrainError(f"the training-choice perplexity pass ran layers {ran_sparse['training_choice']} sparse, "
                          f"the training choice {want}")
    dense_total = sum(r.dense_ms for r in results)
    mtrain_total = sum(r.mtrain_ms for r in results)
    steady_total = sum(r.steady_ms for r in results)
    long_total = sum(r.long_run_ms for r in results)
    from mtrain.models.policy import HOLD_BACKOFF_MAX

    def slower(attr):  # layer -> % over dense, for the layers slower than dense
        return {r.layer: round(100 * (getattr(r, attr) / r.dense_ms - 1), 2) for r in results
                if getattr(r, attr) > r.dense_ms}
    summary = {
        "model": str(path), "seq_len": seq_len, "text": text, "yarn_factor": factor, "dtype": str(dtype), "device": device.type,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "torch": torch.__version__, "settings": _settings_kwargs(settings),
        "layers": [asdict(r) for r in results],
        "mean_density": statistics.mean(r.density for r in results),
        "mean_true_recall": statistics.mean(r.true_recall for r in results),
        "min_layer_true_recall": min(r.true_recall for r in results),
        # as run in the timed pass (the training choice): a layer that runs dense keeps all of its attention (recall 1)
        "as_run_true_recall": statistics.mean(1.0 if r.path == "dense" else r.true_recall for r in results),
        "as_run_min_layer_true_recall": min(1.0 if r.path == "dense" else r.true_recall for r in results),
        "dense_ms": dense_total, "mtrain_ms": mtrain_total, "speedup": dense_total / mtrain_total,
        "layers_slower_than_dense": [r.layer for r in results if r.mtrain_ms > r.dense_ms],
        "steady_ms": steady_total, "steady_speedup": dense_total / steady_total,
        "layers_slower_than_dense_steady": [r.layer for r in results if r.steady_ms > r.dense_ms],
        "long_run_ms": long_total, "long_run_speedup": dense_total / long_total,
        "percent_over_dense": {"every_step": slower("mtrain_ms"), "steady": slower("steady_ms"),
                               "long_run": slower("long_run_ms")},
        "held_layers": [r.layer for r in results if r.held], "dense_hold_steps": hold,
        "sparse_layers": sum(r.path == "sparse" for r in results),
        "policy": policy, "engine": engine, "max_output_error": max_error, "ppl_dense": ppl_dense,
        "escalate_recall": escalate_recall, "escalated_layers": sorted(rt.policy.layer_recall),
        # the perplexity rows (see the module docstring): which choice each is, and the layers that ran sparse in it
        "training_paths": training_paths,
        "training_paths_timed": [r.layer for r in results],
        **{f"ppl_{name}": ppl[name] for name in rows if name != "dense"},
        **{f"ppl_{name}_rise": ppl[name] / ppl_dense - 1 for name in rows if name != "dense"},
        "perplexity": {name: {"label": PPL_LABELS[name], "ppl": ppl[name], "rise": ppl[name] / ppl_dense - 1,
                              "sparse_layers": ran_sparse[name]} for name in rows},
        "recall_rows": recall_rows,
        "index_ms_range": [min(r.index_ms for r in results), max(r.index_ms for r in results)],
        "index_graph_ms_range": [min(r.extra["index_graph_ms"] for r in results),
                                 max(r.extra["index_graph_ms"] for r in results)],
        "kernels_ms": {name: sum(r.fwd_ms + r.extra[f"bwd_{name}_ms"] for r in results)
                       for name in ("deterministic", "atomic")},
        "verticals_max": max(r.extra["verticals_max"] for r in results),
        "column_list_width": max(r.extra["column_list_width"] for r in results),
        "columns_per_row_max": max(r.extra["columns_per_row_max"] for r in results),
        "index_mib_per_layer_max": max(r.extra["index_bytes"] for r in results) / 2**20,
        "index_mib_used_widths_max": max(r.extra["index_bytes_used_widths"] for r in results) / 2**20,
        "index_mib_list_free_max": max((r.extra.get("index_bytes_list_free") or 0) for r in results) / 2**20,
        # fwd + bwd of every layer sparse on its prebuilt index, lists against list-free columns
        "column_forms_ms": {key: sum(r.extra["kernels_ms"][key] for r in results)
                            for key in (results[0].extra["kernels_ms"] if results else {})
                            if all(key in r.extra["kernels_ms"] for r in results)},
    }
    log(f"whole model ({len(results)} layers): dense {dense_total:.1f} ms, mtrain {mtrain_total:.1f} ms "
        f"({summary['speedup']:.2f}x), steady state over {hold + 1} steps {steady_total:.1f} ms "
        f"({summary['steady_speedup']:.2f}x, held dense {summary['held_layers']}); {summary['sparse_layers']} "
        f"timed layers sparse (training choice); mean density "
        f"{summary['mean_density']:.3f}; true recall mean {summary['mean_true_recall']:.3f}, worst layer "
        f"{summary['min_layer_true_recall']:.3f} (at the training choice, dense layers whole: "
        f"{summary['as_run_true_recall']:.3f} / {summary['as_run_min_layer_true_recall']:.3f}); "
        f"layers slower than dense: "
        f"{summary['layers_slower_than_dense']} (steady state: {summary['layers_slower_than_dense_steady']}; % over "
        f"dense {summary['percent_over_dense']}); long run (holds of {hold * HOLD_BACKOFF_MAX} steps) {long_total:.1f} "
        f"ms ({summary['long_run_speedup']:.2f}x); "
        f"every layer sparse, kernels only: deterministic backward {summary['kernels_ms']['deterministic']:.1f} ms "
        f"({dense_total / summary['kernels_ms']['deterministic']:.2f}x), atomic backward "
        f"{summary['kernels_ms']['atomic']:.1f} ms ({dense_total / summary['kernels_ms']['atomic']:.2f}x); index per "
        f"layer {summary['index_ms_range'][0]:.2f}-{summary['index_ms_range'][1]:.2f} ms eager, "
        f"{summary['index_graph_ms_range'][0]:.2f}-{summary['index_graph_ms_range'][1]:.2f} ms from the CUDA graph; "
        f"verticals per head at most {summary['verticals_max']}, columns per query block at most "
        f"{summary['columns_per_row_max']} (lists {summary['column_list_width']} wide); index lists per layer at most "
        f"{summary['index_mib_per_layer_max']:.1f} MiB ({summary['index_mib_used_widths_max']:.1f} MiB as wide as "
        f"the lists used; {summary['index_mib_list_free_max']:.1f} MiB with list-free columns); kernels fwd + bwd, "
        f"lists vs list-free columns: "
        + ", ".join(f"{key[:-3]} {ms:.1f} ms" for key, ms in summary["column_forms_ms"].items()))
    for name, row in summary["perplexity"].items():
        log(f"perplexity, {row['label']}: {row['ppl']:.3f} ({100 * row['rise']:+.2f}% over dense); "
            f"{len(row['sparse_layers'])} of {len(training_paths)} layers sparse {_ranges(row['sparse_layers'])}")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        target = Path(out_dir) / (f"real_{seq_len}.json" if text == "prose" else f"real_{seq_len}_{text}.json")
        write_json_atomic(target, summary, indent=1)
    return summary


def _ranges(layers: list[int]) -> str:
    """[0-3, 5, 7-9] for [0, 1, 2, 3, 5, 7, 8, 9]."""
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return "[" + ", ".join(parts) + "]"


# ----------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """The real-model options (`mtrain bench real`; `mtrain bench attention --model`)."""
    from mtrain.data.texts import TEXT_KINDS

    real = parser.add_argument_group("real attention (mtrain.bench.real): a pretrained model's captured q/k/v")
    real.add_argument("--model", required=required, help="HF checkpoint folder or .gguf file: benchmark on this model's attention "
                                      "over real prose instead of synthetic inputs")
    real.add_argument("--seq-len", type=int, nargs="+", help="sequence lengths for --model (one run each)")
    real.add_argument("--text", default="prose", choices=TEXT_KINDS,
                      help="kind of text the model reads (mtrain.data.texts; shipped with Python or a package; "
                           "default prose)")
    real.add_argument("--yarn", default="auto", help="YaRN factor for --model: auto (seq_len / trained length), "
                                                     "none, or a number")
    real.add_argument("--layers", type=int, nargs="*", help="layers to measure (default: all)")
    real.add_argument("--iters", type=int, default=5, help="timed iterations per variant")
    real.add_argument("--hold", type=int, help="attention.dense_hold_steps of the steady-state timing (default: the "
                                               "config default)")
    real.add_argument("--recall-rows", type=int, help="true recall from this many rows spread over the sequence "
                                                      "(default: every row)")
    real.add_argument("--engine", default="auto", choices=("auto", "triton", "flex", "fa4"),
                      help="--model: block engine of the sparse path (vertical_slash_attention's impl)")
    real.add_argument("--policy", default="auto", choices=("auto", "always", "never"),
                      help="attention.sparse_policy of the mtrain timings and of the training- and "
                           "inference-choice perplexities (default auto)")
    real.add_argument("--max-output-error", type=float, default=None, metavar="E",
                      help="attention.max_output_error: under --policy auto, a layer whose output error on the "
                           "estimate's scored rows exceeds E runs dense (the quality check; default: none)")
    real.add_argument("--escalate-recall", type=float, default=None, metavar="R",
                      help="attention.escalate_recall (with --max-output-error): a layer over the limit estimates "
                           "again at recall R and keeps it (default: none)")
    real.add_argument("--documents", choices=("long", "short"),
                      help="pack real documents into the sequence and mask across them (mtrain.bench.real_documents): "
                           "long = four documents of 41/31/19/9%% of it, short = sixteen equal ones; timed against "
                           "FlashAttention-4's varlen kernel (default: one text, no documents)")
    real.add_argument("--causal-too", action="store_true",
                      help="with --documents: also time the same q/k/v as one causal sequence (against dense)")
    real.add_argument("--min-document", nargs="+", type=_min_document, metavar="N|auto",
                      help="with --documents: time mtrain's path at each attention.min_sparse_document (tokens; auto = "
                           "the cost model's break-even), from the same captured q/k/v (default: auto)")
    real.add_argument("--eager-estimate", action="store_true",
                      help="with --documents: attention.graph_estimate off (every document's estimate eager, as "
                           "training on packs whose document lengths change from batch to batch runs it)")
    real.add_argument("--sparse", action="append", default=[], metavar="KEY=VALUE",
                      help="sparse attention setting (SparseSettings field), e.g. --sparse recall=0.95 (repeatable)")


def _min_document(text: str):
    """--min-document's values: a positive number of tokens, or auto (None: the cost model's break-even)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of tokens or auto")
    return value


def sparse_overrides(items: list[str]) -> dict:
    """The --sparse KEY=VALUE items as SparseSettings fields, validated as `mtrain eval --sparse` validates them (one
    line naming the bad item); the per-layer policy keys have flags of their own here."""
    from mtrain.errors import MtrainError
    from mtrain.eval.cli import POLICY_KEYS, attention_options

    settings = attention_options("mtraining", items, {}).get("sparse", {})
    policy = sorted(set(settings) & set(POLICY_KEYS))
    if policy:
        raise MtrainError(f"--sparse {policy[0]}=...: set the per-layer policy with this command's own flags "
                          "(--policy, --engine, --max-output-error, --escalate-recall, --min-document)")
    return settings


def run_cli(args) -> int:
    """Run the benchmark at every --seq-len, logging to OUT/bench_real.log."""
    from mtrain.parallel import SparseSettings

    if not args.seq_len:
        raise SystemExit("--model needs --seq-len N [N ...]")
    if (args.min_document or args.eager_estimate) and not args.documents:
        raise SystemExit("--min-document and --eager-estimate need --documents long|short")
    settings = SparseSettings(**sparse_overrides(args.sparse))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_real.log"), "a") as logf:
        def log(msg):
            print(msg, flush=True)
            logf.write(msg + "\n")
            logf.flush()

        for seq_len in args.seq_len:
            if getattr(args, "documents", None):
                from mtrain.bench import real_documents
                from mtrain.config import AttentionConfig

                real_documents.run(args.model, seq_len, args.documents, settings=settings, policy=args.policy,
                                   engine=args.engine, yarn=args.yarn, iters=args.iters,
                                   hold=AttentionConfig.dense_hold_steps if args.hold is None else args.hold,
                                   layers=args.layers, out_dir=args.out, log=log,
                                   max_error=getattr(args, "max_output_error", None), causal_too=args.causal_too,
                                   min_documents=args.min_document, eager_estimate=args.eager_estimate)
                continue
            run(args.model, seq_len, settings=settings, policy=args.policy, engine=args.engine,
                yarn=args.yarn, iters=args.iters, hold=args.hold, layers=args.layers,
                recall_rows=args.recall_rows, out_dir=args.out, text=args.text, log=log,
                max_error=getattr(args, "max_output_error", None),
                escalate_recall=getattr(args, "escalate_recall", None))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtrain bench real", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/bench"), help="folder for the log and json")
    add_arguments(parser, required=True)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
