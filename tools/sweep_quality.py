"""Estimator settings x kinds of text -> the perplexity cost of every layer sparse, on a real model.

For each length, kind of text (`mtrain.data.texts`) and setting: whole-model perplexity with every layer sparse
(policy "always": what the training choice runs at its worst) against dense on the same tokens, the mean
density of the estimated patterns, and the true recall (the exact attention mass the index keeps, on
--recall-rows rows spread evenly over the sequence) as the mean over layers and heads, the worst layer and the
worst head, and its tail: the share of (head, sampled row) pairs whose own recall is below 0.9, and the 1st
percentile of the rows' recall. Prints one markdown table (and writes every cell to --json).

  python -m tools.sweep_quality --model models/smollm2-135m --seq-len 4096 8192 \\
      --texts prose docs code dialogue --set default --set last_q=256 --set recall=0.995

A setting is `default` (SparseSettings as shipped) or comma-separated SparseSettings fields,
e.g. `last_q=256,recall=0.995`.

Each sparse layer also records what a choice could read about its error (`layer_measures`: the estimate's mean row
mass, the relative attention-output error of the scored rows and of --recall-rows evenly spaced rows), and the end
prints how each measure, summed over the layers or at the worst one, follows the perplexity rise (`predictions`).
--max-error E adds a pass per cell with the quality check alone (the layers whose scored-row output error exceeds E
dense: attention.max_output_error without the cost model), --dense L,L a pass with the listed layers dense, and
--one-layer each layer sparse alone (slow: one pass per layer).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time

import torch


from mtrain.data.texts import TEXT_KINDS


def parse_setting(text: str) -> dict:
    """'default' -> {}; 'last_q=256,recall=0.995' -> {'last_q': 256, 'recall': 0.995} (values read as YAML)."""
    import yaml

    from mtrain.parallel import SparseSettings

    if text == "default":
        return {}
    fields = set(SparseSettings.__dataclass_fields__)
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--set {text}: '{item}' is not FIELD=VALUE of a SparseSettings field ({', '.join(fields)})")
        out[key] = yaml.safe_load(value)
    SparseSettings(**out)  # refuses bad values now, not an hour in
    return out


def row_recalls(q, k, index, scale: float, n_rows: int) -> torch.Tensor:
    """Each (head, sampled row)'s own true recall, fp32 [Hq, R] (batch 1): the share of the row's exact causal
    attention mass inside `index`, on `n_rows` rows spread evenly over the sequence (`sampled_rows`). The mean of
    it is `true_recall`; its tail shows rows that lose much of their mass while the mean stays near the target."""
    from mtrain.ops.recall import index_row_mask, sampled_rows

    S, Hq, D = q.shape[1], q.shape[2], q.shape[3]
    Hkv = k.shape[2]
    rows = sampled_rows(S, n_rows, q.device)
    kp = torch.arange(S, device=q.device)
    qr = q[0, rows].float().reshape(rows.numel(), Hkv, Hq // Hkv, D)
    scale = scale if scale is not None else D ** -0.5
    s = torch.einsum("qhgd,khd->hgqk", qr, k[0].float()).reshape(Hq, rows.numel(), S) * scale
    s = s.masked_fill(kp[None, None, :] > rows[None, :, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.where(index_row_mask(index, rows, kp)[0], p, 0.0).sum(-1)


def layer_measures(q, k, v, index, settings, scale, recall_rows: int) -> dict:
    """What a layer's choice could read about its sparse error, for one sparse call: the estimate's mean mass of the
    scored rows (est_recall), the relative output error of the scored rows (`output_error` on `estimate_rows`: what
    the policy's quality check reads) and of `recall_rows` rows spread evenly over the sequence (`sampled_rows`,
    rows the estimate did not select its pattern on), and the layer's density."""
    import dataclasses

    from mtrain.ops.estimate import estimate_rows
    from mtrain.ops.recall import output_error, sampled_rows

    S = q.shape[1]
    fields = {**dataclasses.asdict(settings), "last_q": min(settings.last_q, S)}
    est = index._cache.get("est_recall")
    return {"est_recall": float(est.double().mean()) if est is not None else float("nan"),
            "err_scored": float(output_error(q, k, v, index, estimate_rows(S, q.device, **fields), scale)[0]),
            "err_sampled": float(output_error(q, k, v, index, sampled_rows(S, recall_rows, q.device), scale)[0]),
            "density": float(index.density())}


def sparse_pass(net, ids, settings, recall_rows: int, low: float = 0.9, paths: dict | None = None) -> dict:
    """Perplexity of `net` over `ids` with every layer sparse under `settings` (or layer i on `paths[i]`, "sparse" /
    "dense"), with each sparse layer's density and true recall on `recall_rows` sampled rows (read from the records
    mtrain's attention leaves), its `layer_measures`, and the share of (head, sampled row) pairs whose own recall is
    below `low`."""
    from mtrain.bench import real as bench_real
    from mtrain.models import attention
    from mtrain.models.attention import mtrain_attention
    from mtrain.models.runtime import runtime_of

    rt = runtime_of(net)  # the model's attention runtime: its records, recall sampling and policy state
    marks = len(rt.records.densities), len(rt.records.layers)
    saved = rt.inputs.sample_recall, rt.inputs.recall_rows
    plain_record = attention.record_layer
    per_row, measures, values = [], [], {}
    inner = (functools.partial(mtrain_attention, settings=settings, policy="always") if paths is None
             else bench_real.forced_paths_attention(paths, settings))

    def attend(module, query, key, value, *args, **kwargs):  # keeps V for the output error
        values[module.layer_idx] = value.transpose(1, 2)
        return inner(module, query, key, value, *args, **kwargs)

    def record(rt, layer_idx, path, index, prediction, q=None, k=None, scaling=None, *args, **kwargs):
        plain_record(rt, layer_idx, path, index, prediction, q, k, scaling, *args, **kwargs)
        if path == "sparse" and q is not None:
            with torch.no_grad():
                per_row.append(row_recalls(q.detach(), k.detach(), index, scaling, recall_rows))
                measures.append({"layer": layer_idx, **layer_measures(q, k, values[layer_idx], index, settings,
                                                                      scaling, recall_rows)})

    rt.policy.choice_stats.clear()
    rt.inputs.sample_recall, rt.inputs.recall_rows = True, recall_rows
    attention.record_layer = record  # module global, looked up at each call
    bench_real.register_bench_attention(attend)
    try:
        ppl = bench_real.perplexity(net, ids)
        records = rt.records.layers[marks[1]:]
        want = None if paths is None else sum(p == "sparse" for p in paths.values())
        if (not records or any(r.path != "sparse" for r in records) or len(per_row) != len(records)
                or (want is not None and len(records) != want)):
            raise RuntimeError("the layers did not run on the paths asked for")
        density = [float(r.density) for r in records]
        recall = [r.true_recall.float().mean(-1).squeeze(0) for r in records]  # [Hq] per layer (batch 1)
        layer_recall = [float(r.mean()) for r in recall]
        for m, r in zip(measures, layer_recall):
            m["true_recall"] = r
        head_min = min(float(r.min()) for r in recall)
        rows = torch.stack(per_row)  # [layers, Hq, R]
    finally:
        attention.record_layer = plain_record
        bench_real.register_bench_attention(None)
        rt.inputs.sample_recall, rt.inputs.recall_rows = saved
        del rt.records.densities[marks[0]:], rt.records.layers[marks[1]:]
    mean = lambda key: sum(m[key] for m in measures) / len(measures)  # noqa: E731
    return {"ppl": ppl, "density": sum(density) / len(density), "true_recall_mean": sum(layer_recall) / len(layer_recall),
            "true_recall_worst_layer": min(layer_recall), "true_recall_worst_head": head_min,
            "rows_below": float((rows < low).float().mean()), "rows_below_at": low,
            "row_recall_p01": float(torch.quantile(rows.flatten(), 0.01)), "layers": len(records),
            "est_recall_mean": mean("est_recall"), "err_scored_mean": mean("err_scored"),
            "err_sampled_mean": mean("err_sampled"), "per_layer": measures}


PREDICTORS = {
    "1 - est_recall": lambda m: 1 - m["est_recall"],
    "1 - true_recall": lambda m: 1 - m["true_recall"],
    "output error, scored rows": lambda m: m["err_scored"],
    "output error, sampled rows": lambda m: m["err_sampled"],
}
"""Per-layer measures whose sum or maximum over the sparse layers may predict the perplexity rise (`predictions`)."""


def _ranks(x: list[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for t in range(i, j + 1):
            out[order[t]] = (i + j) / 2
        i = j + 1
    return out


def _pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def predictions(points: list[tuple[list[dict], float]]) -> dict:
    """How well each PREDICTORS measure, summed over a pass's sparse layers and at its worst layer, follows the
    perplexity rise over `points` = [(per-layer measures of a pass, its rise)]:
    {(name, "sum" | "max"): (Pearson r, Spearman rho)}."""
    rises = [rise for _, rise in points]
    out = {}
    for name, f in PREDICTORS.items():
        for how, agg in (("sum", sum), ("max", max)):
            x = [agg(f(m) for m in measures) for measures, _ in points]
            out[name, how] = (_pearson(x, rises), _pearson(_ranks(x), _ranks(rises)))
    return out


def one_layer_sweep(net, ids, settings, recall_rows: int, ppl_dense: float, n_layers: int, log=print) -> list[dict]:
    """Each layer sparse alone (the others dense), in turn: its perplexity rise and `layer_measures`."""
    out = []
    for i in range(n_layers):
        cell = sparse_pass(net, ids, settings, recall_rows, paths={j: "sparse" if j == i else "dense"
                                                                   for j in range(n_layers)})
        m = cell["per_layer"][0]
        out.append({**m, "rise": cell["ppl"] / ppl_dense - 1})
        log(f"layer {i:2d} alone sparse: rise {100 * out[-1]['rise']:+.3f}% est_recall {m['est_recall']:.4f} "
            f"true_recall {m['true_recall']:.4f} err scored {m['err_scored']:.4f} sampled {m['err_sampled']:.4f}")
    return out


def quality_paths(per_layer: list[dict], n_layers: int, max_error: float, key: str = "err_scored") -> dict:
    """Layer -> path of the quality check alone (no cost model): dense where the layer's output error (`key` of its
    measures in an every-layer-sparse pass) exceeds max_error."""
    err = {m["layer"]: m[key] for m in per_layer}
    return {i: "dense" if err[i] > max_error else "sparse" for i in range(n_layers)}


@contextlib.contextmanager
def escalation(rt, limit: float, recall: float):
    """The quality check at `limit` with recall escalation to `recall` (`mtrain.models.policy.escalate`) for the passes
    inside, in attention runtime `rt` (the model's): every layer starts at the setting's recall. Yields a list that
    holds the layers it escalated on exit."""
    saved = rt.settings.set_policy(max_output_error=limit, escalate_recall=recall), rt.policy.layer_recall
    rt.policy.layer_recall = {}
    escalated: list[int] = []
    try:
        yield escalated
        escalated.extend(sorted(rt.policy.layer_recall))
    finally:
        rt.settings.policy, rt.policy.layer_recall = saved


HEADER = ("| S | text | setting | ppl dense | ppl sparse | rise | density | true recall mean | worst layer | "
          "worst head | rows < 0.9 | row p1 | s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(c: dict) -> str:
    """One markdown table row of a sweep cell."""
    return (f"| {c['seq_len'] // 1024}K | {c['text']} | {c['setting']} | {c['ppl_dense']:.3f} | {c['ppl']:.3f} | "
            f"{100 * c['rise']:+.2f}% | {c['density']:.3f} | {c['true_recall_mean']:.4f} | "
            f"{c['true_recall_worst_layer']:.4f} | {c['true_recall_worst_head']:.3f} | "
            f"{_pct(c.get('rows_below'))} | {_num(c.get('row_recall_p01'))} | {c['seconds']:.0f} |")


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.2f}%"


def _num(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def table(cells: list[dict]) -> str:
    """The markdown table of `cells`, by length, then text (TEXT_KINDS order), then the order they ran in."""
    order = {kind: i for i, kind in enumerate(TEXT_KINDS)}
    ranked = sorted(enumerate(cells), key=lambda ic: (ic[1]["seq_len"], order[ic[1]["text"]], ic[0]))
    return "\n".join([HEADER] + [row(c) for _, c in ranked])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint folder (or .gguf)")
    ap.add_argument("--seq-len", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--texts", nargs="+", default=list(TEXT_KINDS), choices=TEXT_KINDS)
    ap.add_argument("--set", dest="settings", action="append", default=None,
                    help="a setting: 'default' or FIELD=VALUE[,FIELD=VALUE...] (repeatable; default: 'default')")
    ap.add_argument("--recall-rows", type=int, default=256, help="rows the true recall is measured on (default 256)")
    ap.add_argument("--order", choices=("settings", "texts"), default="settings",
                    help="settings: each setting on every text before the next (default); texts: every setting on "
                         "one text before the next")
    ap.add_argument("--yarn", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", default=None, help="also write every cell to this file (rewritten after each cell)")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the one table of the cells in these --json files "
                    "(runs in several parts) and exit")
    ap.add_argument("--max-error", type=float, nargs="+", default=[], metavar="E",
                    help="after each every-layer-sparse cell, one pass per E with the quality check alone (no cost "
                         "model): dense the layers whose output error on the scored rows in that cell exceeds E")
    ap.add_argument("--dense", action="append", default=[], metavar="L,L,...",
                    help="after each every-layer-sparse cell, one pass with these layers dense and the rest sparse "
                         "(repeatable): e.g. the layers another measure would send dense")
    ap.add_argument("--escalate", action="append", default=[], metavar="E:R",
                    help="after each every-layer-sparse cell, one pass with recall escalation (repeatable): every layer "
                         "sparse, and a layer whose output error on the scored rows exceeds E estimates again at recall "
                         "R (attention.max_output_error E with attention.escalate_recall R, under policy always)")
    ap.add_argument("--one-layer", action="store_true",
                    help="also each layer sparse alone (the others dense), per cell: the per-layer rise and measures")
    ap.add_argument("--escalated-only", action="store_true",
                    help="run only the --escalate passes (not the every-layer-sparse pass without the check before "
                         "them): with --set default --escalate 0.025:0.995, the mtraining kind's defaults alone")
    args = ap.parse_args()
    if args.escalated_only and (not args.escalate or args.max_error or args.dense or args.one_layer):
        ap.error("--escalated-only needs --escalate and takes no --max-error, --dense or --one-layer (they read the "
                 "pass it skips)")
    if args.table:
        cells = []
        for name in args.table:
            with open(name) as fh:
                cells += json.load(fh)["cells"]
        print(table(cells))
        _say_predictions(cells)
        return 0
    if not args.model:
        ap.error("--model is required (except with --table)")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from mtrain.bench import real as bench_real
    from mtrain.data.texts import text_tokens
    from mtrain.models.runtime import runtime_of
    from mtrain.parallel import SparseSettings

    names = args.settings or ["default"]
    overrides = {name: parse_setting(name) for name in names}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = bench_real.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    print(f"# {path.name}, {device.type}, {dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"every layer sparse; true recall on {args.recall_rows} rows; defaults {SparseSettings()}", flush=True)
    cells = []
    print(HEADER, flush=True)
    for seq_len in args.seq_len:
        net, factor = bench_real.load_model(path, seq_len, args.yarn, device, dtype)
        dense = {}  # text -> (ids, dense perplexity, seconds), on first use

        def text_ids(text):
            if text not in dense:
                ids = torch.tensor([text_tokens(tokenizer, seq_len, text)], device=device)
                t0 = time.perf_counter()
                dense[text] = ids, bench_real.perplexity(net, ids), time.perf_counter() - t0
            return dense[text]

        # setting-major (each setting on every text before the next setting) or text-major
        order = ([(t, n) for n in names for t in args.texts] if args.order == "settings"
                 else [(t, n) for t in args.texts for n in names])
        for text, name in order:
            ids, ppl_dense, dense_s = text_ids(text)
            t0 = time.perf_counter()
            settings = SparseSettings(**overrides[name])
            found, chosen = [], []
            if not args.escalated_only:
                cell = sparse_pass(net, ids, settings, args.recall_rows)
                cell.update(seq_len=seq_len, text=text, setting=name, ppl_dense=ppl_dense,
                            rise=cell["ppl"] / ppl_dense - 1, seconds=time.perf_counter() - t0,
                            dense_seconds=dense_s, yarn_factor=factor)
                n_layers = cell["layers"]
                found = [cell]
                chosen = [(f"max_error={limit}", quality_paths(cell["per_layer"], n_layers, limit))
                          for limit in args.max_error]
            for listed in args.dense:
                layers = sorted(int(x) for x in listed.split(","))
                chosen.append((f"dense {layers}", {i: "dense" if i in layers else "sparse" for i in range(n_layers)}))
            for label, paths in chosen:
                t0 = time.perf_counter()
                if "sparse" not in paths.values():
                    print(f"# {seq_len} {text} {name} {label}: every layer dense", flush=True)
                    continue
                extra = sparse_pass(net, ids, settings, args.recall_rows, paths=paths)
                extra.update(seq_len=seq_len, text=text, setting=f"{name} {label}", ppl_dense=ppl_dense,
                             rise=extra["ppl"] / ppl_dense - 1, seconds=time.perf_counter() - t0,
                             dense_seconds=dense_s, yarn_factor=factor,
                             dense_layers=[i for i, p in paths.items() if p == "dense"])
                found.append(extra)
            for spec in args.escalate:
                t0 = time.perf_counter()
                limit, recall = (float(x) for x in spec.split(":"))
                with escalation(runtime_of(net), limit, recall) as escalated:
                    extra = sparse_pass(net, ids, settings, args.recall_rows)
                extra.update(seq_len=seq_len, text=text, setting=f"{name} escalate {limit}:{recall}",
                             ppl_dense=ppl_dense, rise=extra["ppl"] / ppl_dense - 1,
                             seconds=time.perf_counter() - t0, dense_seconds=dense_s, yarn_factor=factor,
                             escalated_layers=escalated)
                found.append(extra)
            if args.one_layer:
                cell["one_layer"] = one_layer_sweep(net, ids, settings, args.recall_rows, ppl_dense, n_layers)
            for c in found:
                cells.append(c)
                print(row(c), flush=True)
            if args.json:
                with open(args.json + ".tmp", "w") as fh:
                    json.dump({"torch": torch.__version__, "device": device.type, "cells": cells}, fh, indent=1)
                os.replace(args.json + ".tmp", args.json)
        del net
    print("\n" + table(cells))
    _say_predictions(cells)
    return 0


def _say_predictions(cells: list[dict]) -> None:
    """Print how each PREDICTORS measure follows the perplexity rise: over the cells (every layer sparse, and the
    quality-check passes: the measure summed over the sparse layers) and over each cell's one-layer sweep."""
    whole = [(c["per_layer"], c["rise"]) for c in cells if c.get("per_layer")]
    if len(whole) >= 3:
        print(f"\n# whole model, {len(whole)} passes: Pearson r / Spearman rho of the rise with the measure summed over "
              "the sparse layers / at the worst one")
        _print_predictions(predictions(whole))
    for c in cells:
        if c.get("one_layer"):
            points = [([m], m["rise"]) for m in c["one_layer"]]
            print(f"\n# {c['seq_len'] // 1024}K {c['text']} {c['setting']}, each of {len(points)} layers sparse alone: "
                  "Pearson r / Spearman rho of its rise with its measure")
            _print_predictions({name: v for (name, how), v in predictions(points).items() if how == "sum"})


def _print_predictions(found: dict) -> None:
    for name, (r, rho) in found.items():
        label = name if isinstance(name, str) else f"{name[0]} ({name[1]})"
        print(f"#   {label:34s} {r:+.3f} / {rho:+.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
