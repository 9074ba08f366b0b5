"""A real model's attention over PACKED documents: `mtrain bench real --model DIR --seq-len N --documents long|short`.

Training packs documents and masks attention across them (`data.document_masking`). This benchmark packs real
documents that need no download (`mtrain.data.longdocs`: books and code repositories of this Python) into one
sequence of N tokens, runs them through the model once with the mask (each document sees only itself) and
captures every layer's post-RoPE q/k/v; then per layer, forward + backward with the calls queued back to back as
training queues them:

- the peer: FlashAttention-4's varlen kernel over the documents, called directly (on a machine without FA4, the
  dense path's own backend, `mtrain.ops.varlen.varlen_backend`; the row says which);
- mtrain's dense kind (`dense_attention(documents=)`: the same kernel through mtrain);
- mtrain's sparse kind as a training step calls it (`_per_document`: every long enough document estimated and run
  sparse on its own, the others and those the choice sends dense in one varlen call), at every step and in the
  steady state of its dense holds;

and the whole model's perplexity over the same tokens with the documents masked: dense, and with every layer as
training runs it (the model in training mode under no_grad, so each document's choice is priced forward +
backward). Mixes: `long` = four documents of 41 / 31 / 19 / 9% of N (two books, a code repository, a third book:
lengths like ProLong's long books and repositories), `short` = sixteen documents of N / 16
(`mtrain.data.docmix`, which also writes such sequences for training). With `--causal-too`,
the same q/k/v as ONE causal sequence beside it (FA4 dense against mtrain without documents).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from mtrain.atomic import write_json_atomic
from mtrain.bench.model import as_trained as model_layer
from mtrain.bench.model import fwd_bwd
from mtrain.bench.timing import timed
from mtrain.data.docmix import packed_mix
from mtrain.models.context import records_as_floats


def _peer(documents, scale):
    """fn(q, k, v) of the dense peer: FA4's varlen kernel called directly where FA4 runs (no mtrain code between, so
    the dense kind's row measures mtrain's path against it), else the backend the dense path picks."""
    from mtrain.ops.varlen import varlen_attention, varlen_backend

    def fn(q, k, v):
        B, S = q.shape[:2]
        flat = [t.reshape(B * S, *t.shape[2:]) for t in (q, k, v)]
        backend = varlen_backend(q)
        if backend == "fa4":
            from flash_attn.cute import flash_attn_varlen_func

            seg = documents.segments
            out, _ = flash_attn_varlen_func(*flat, cu_seqlens_q=seg.cu_q, cu_seqlens_k=seg.cu_k,
                                            max_seqlen_q=seg.max_q, max_seqlen_k=seg.max_k, softmax_scale=scale,
                                            causal=True)
            return out.view(B, S, *out.shape[1:])
        return varlen_attention(*flat, documents.segments, scale, backend).view(q.shape)

    return fn


def measure_layer(layer: int, q, k, v, settings, scale: float, iters: int, policy: str, hold: int, engine: str,
                  max_error, documents, *, rt, thresholds=(None,)) -> dict:
    """One layer's timings and records over packed documents (`documents`: the batch's `Documents`, or None for
    the whole sequence causal); rt: the model's attention runtime (`mtrain.models.runtime`), whose documents and
    policy state the layer calls use. thresholds: attention.min_sparse_document values to time mtrain's path at
    (None = the cost model's break-even); the row's own mtrain figures are the first one's, all of them in "sweep"."""
    import functools

    from mtrain.ops import dense_attention
    from mtrain.ops.varlen import varlen_backend

    dout = torch.randn_like(q)
    if documents is not None:
        peer = _peer(documents, scale)
        peer_label = ("fa4 varlen, direct" if varlen_backend(q) == "fa4" else f"{varlen_backend(q)} varlen")
    else:
        peer = functools.partial(dense_attention, causal=True, softmax_scale=scale)
        peer_label = "dense (mtrain.ops.dense_attention)"
    peer_ms = timed(fwd_bwd(peer, q, k, v, dout), iters, warmup=3, back_to_back=True)
    dense = functools.partial(dense_attention, causal=True, softmax_scale=scale, documents=documents)
    dense_ms = timed(fwd_bwd(dense, q, k, v, dout), iters, warmup=3, back_to_back=True)

    as_trained = model_layer(layer, scale, rt, settings=settings, policy=policy, engine=engine, max_error=max_error)

    sweep = [_time_mtrain(as_trained, q, k, v, dout, iters, hold, rt, threshold) for threshold in thresholds]
    return {"layer": layer, "peer": peer_label, "peer_ms": peer_ms, "dense_ms": dense_ms,
            **{key: value for key, value in sweep[0].items() if key != "min_sparse_document"}, "sweep": sweep}


def _time_mtrain(as_trained, q, k, v, dout, iters: int, hold: int, rt, threshold) -> dict:
    """mtrain's path over one layer's q/k/v with attention.min_sparse_document = `threshold`: every call from fresh
    policy state (the first one untimed, its records and true recall kept), then the steady state of its dense holds
    (`hold` + 1 steps)."""
    mark = len(rt.records.layers)
    saved = (rt.settings.policy, rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until, rt.inputs.step)
    try:
        rt.settings.set_policy(dense_hold_steps=0, min_sparse_document=threshold)
        rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until = {}, {}, {}
        rt.inputs.sample_recall, rt.inputs.recall_rows = True, 256  # one untimed call measures the true recall
        fwd_bwd(as_trained, q, k, v, dout)()
        rt.inputs.sample_recall = False
        first = rt.records.layers[mark:]
        mtrain_ms = timed(fwd_bwd(as_trained, q, k, v, dout), iters, warmup=2, back_to_back=True)
        rt.settings.set_policy(dense_hold_steps=hold)
        step_fn = fwd_bwd(as_trained, q, k, v, dout)

        def steps():
            for step in range(hold + 1):
                rt.inputs.step = step
                step_fn()

        steady_ms = timed(steps, 1, warmup=0, back_to_back=True) / (hold + 1)
    finally:
        rt.settings.policy, rt.policy.dense_until, rt.policy.hold_streak, rt.policy.checked_until, rt.inputs.step = saved
        rt.inputs.sample_recall = False
    records = records_as_floats(first)  # one read for all the records
    del rt.records.layers[mark:], rt.records.densities[:]
    sparse = [r for r in records if r["path"] == "sparse"]
    return {"min_sparse_document": threshold, "mtrain_ms": mtrain_ms, "steady_ms": steady_ms,
            "estimated": len([r for r in records if r["density"] is not None]), "sparse": len(sparse),
            "density": [r["density"] for r in sparse], "true_recall": [r["true_recall"] for r in sparse]}


def _sweep_point(rows, j: int, threshold, peer_ms: float, ppl_dense: float, ppl: float) -> dict:
    """The whole model's figures at the sweep's j-th attention.min_sparse_document (`threshold`)."""
    mtrain_ms = sum(r["sweep"][j]["mtrain_ms"] for r in rows)
    steady_ms = sum(r["sweep"][j]["steady_ms"] for r in rows)
    return {"min_sparse_document": threshold, "mtrain_ms": mtrain_ms, "steady_ms": steady_ms,
            "speedup_vs_peer": peer_ms / mtrain_ms, "steady_speedup_vs_peer": peer_ms / steady_ms,
            "sparse": sum(r["sweep"][j]["sparse"] for r in rows), "ppl_as_trained": ppl, "ppl_rise": ppl / ppl_dense - 1}


def perplexity_trained(net, ids, fn) -> float:
    """Perplexity over `ids` with the bench's attention pointed at `fn`, the model in training mode under no_grad
    (each layer's choice priced as a training step prices it)."""
    from mtrain.bench.model import perplexity, register_bench_attention
    from mtrain.models.runtime import runtime_of

    rt = runtime_of(net)
    was = net.training
    net.train(fn is not None)
    rt.policy.choice_stats.clear()
    register_bench_attention(fn)
    try:
        return perplexity(net, ids)
    finally:
        register_bench_attention(None)
        net.train(was)
        rt.drain()


def run(model: str, seq_len: int, mix: str, *, settings, policy: str = "auto", yarn="auto", iters: int = 5,
        hold: int = 16, engine: str = "auto", layers=None, out_dir=None, log=print, max_error=None,
        causal_too: bool = False, min_documents=None, eager_estimate: bool = False) -> dict:
    """Benchmark one model at one length on packed documents of mix `mix`; writes out_dir/real_docs_<S>_<mix>.json.
    min_documents: attention.min_sparse_document values to sweep (None in it, or no list = the cost model's
    break-even); the summary's own mtrain figures are the first one's, every one's in summary["sweep"].
    eager_estimate: attention.graph_estimate off (each document's estimate eager, as in training on packs whose
    lengths change from batch to batch; on: a length seen twice replays a CUDA graph, as a fixed mix does)."""
    import functools

    from transformers import AutoTokenizer

    from mtrain.bench.model import capture_qkv, load_model, resolve_model
    from mtrain.models.attention import mtrain_attention
    from mtrain.models.runtime import runtime_of

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokens, lengths, names = packed_mix(tokenizer, seq_len, mix)
    ids = torch.tensor([tokens], device=device)
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    net, factor = load_model(path, seq_len, yarn, device, dtype)
    cfg = net.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scale = head_dim ** -0.5
    log(f"model {path.name}: S={seq_len}, YaRN {factor:g}, {dtype}; {mix} mix: {len(lengths)} documents "
        f"{lengths} ({', '.join(dict.fromkeys(names))}); policy {policy}, engine {engine}, settings {settings}")
    rt = runtime_of(net)  # the bench's layer calls share the model's runtime (its documents, caps and records)
    thresholds = list(min_documents) if min_documents else [None]
    if eager_estimate:
        import dataclasses

        from mtrain.ops.switches import or_defaults

        rt.settings.switches = dataclasses.replace(or_defaults(rt.settings.switches), graph_estimate=False)
    rt.policy.choice_stats.clear()
    rt.set_documents(doc_ids, device)
    try:
        qkv = capture_qkv(net, ids)  # one forward with the documents masked
        picked = layers if layers is not None else list(range(len(qkv)))
        rows = []
        for i in picked:
            row = measure_layer(i, *qkv[i], settings, scale, iters, policy, hold, engine, max_error,
                                rt.inputs.documents, rt=rt, thresholds=thresholds)
            rows.append(row)
            log(f"layer {i:3d}: {row['sparse']}/{row['estimated']} documents sparse, density "
                f"{[round(d, 3) for d in row['density']]} true recall "
                f"{[round(r, 3) for r in row['true_recall'] if r is not None]} | peer {row['peer_ms']:7.2f} ms, "
                f"dense {row['dense_ms']:7.2f}, mtrain {row['mtrain_ms']:7.2f} "
                f"({row['peer_ms'] / row['mtrain_ms']:.2f}x), steady {row['steady_ms']:7.2f} "
                f"({row['peer_ms'] / row['steady_ms']:.2f}x)")
        fn = functools.partial(mtrain_attention, settings=settings, policy=policy, engine=engine,
                               max_error=max_error)
        ppl_dense = perplexity_trained(net, ids, None)
        ppl_sweep = []
        for threshold in thresholds:
            rt.settings.set_policy(min_sparse_document=threshold)
            ppl_sweep.append(perplexity_trained(net, ids, fn))
        rt.settings.set_policy(min_sparse_document=None)
        ppl_trained = ppl_sweep[0]
    finally:
        rt.set_documents(None)
    summary = {"model": str(path), "seq_len": seq_len, "mix": mix, "document_lengths": lengths,
               "documents": names, "yarn_factor": factor, "dtype": str(dtype),
               "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "torch": torch.__version__,
               "policy": policy, "engine": engine, "dense_hold_steps": hold, "max_output_error": max_error,
               "graph_estimate": not eager_estimate,
               "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__}, "layers": rows,
               "peer": rows[0]["peer"] if rows else None}
    for key in ("peer_ms", "dense_ms", "mtrain_ms", "steady_ms"):
        summary[key] = sum(r[key] for r in rows)
    summary["speedup_vs_peer"] = summary["peer_ms"] / summary["mtrain_ms"]
    summary["steady_speedup_vs_peer"] = summary["peer_ms"] / summary["steady_ms"]
    summary["dense_vs_peer"] = summary["peer_ms"] / summary["dense_ms"]
    densities = [d for r in rows for d in r["density"]]
    summary["mean_sparse_density"] = statistics.mean(densities) if densities else None
    summary.update(ppl_dense=ppl_dense, ppl_as_trained=ppl_trained, ppl_rise=ppl_trained / ppl_dense - 1)
    summary["sweep"] = [_sweep_point(rows, j, threshold, summary["peer_ms"], ppl_dense, ppl_sweep[j])
                        for j, threshold in enumerate(thresholds)]
    if len(thresholds) > 1:
        log(f"attention.min_sparse_document sweep ({'eager' if eager_estimate else 'graphed'} estimates), "
            f"against the peer:")
        for point in summary["sweep"]:
            log(f"  {str(point['min_sparse_document'] or 'auto'):>8}: {point['sparse']:3d} document-layers sparse, "
                f"{point['speedup_vs_peer']:.2f}x, steady {point['steady_speedup_vs_peer']:.2f}x, perplexity "
                f"{100 * point['ppl_rise']:+.2f}%")
    log(f"whole model ({len(rows)} layers), {mix} mix at {seq_len}: peer ({summary['peer']}) "
        f"{summary['peer_ms']:.1f} ms, mtrain dense {summary['dense_ms']:.1f} ms ({summary['dense_vs_peer']:.2f}x), "
        f"mtrain sparse as trained {summary['mtrain_ms']:.1f} ms ({summary['speedup_vs_peer']:.2f}x), steady "
        f"{summary['steady_ms']:.1f} ms ({summary['steady_speedup_vs_peer']:.2f}x); perplexity dense "
        f"{ppl_dense:.3f}, as trained {ppl_trained:.3f} ({100 * summary['ppl_rise']:+.2f}%)")
    if causal_too:  # the same q/k/v as one causal sequence: FA4 dense against mtrain without documents
        causal = [measure_layer(i, *qkv[i], settings, scale, iters, policy, hold, engine, max_error, None, rt=rt)
                  for i in picked]
        summary["causal"] = {"layers": causal, **{key: sum(r[key] for r in causal)
                                                    for key in ("peer_ms", "mtrain_ms", "steady_ms")}}
        c = summary["causal"]
        log(f"the same pack as one causal sequence: dense {c['peer_ms']:.1f} ms, mtrain {c['mtrain_ms']:.1f} ms "
            f"({c['peer_ms'] / c['mtrain_ms']:.2f}x), steady {c['steady_ms']:.1f} ms "
            f"({c['peer_ms'] / c['steady_ms']:.2f}x)")
    del qkv
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        write_json_atomic(Path(out_dir) / f"real_docs_{seq_len}_{mix}.json", summary, indent=1)
    return summary
