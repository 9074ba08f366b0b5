"""Estimator settings x kinds of text -> the perplexity cost of every layer sparse, on a real model.

For each length, kind of text (`mtrain.data.texts`) and setting: whole-model perplexity with every layer sparse
(policy "always": what the training choice runs at its worst) against dense on the same tokens, the mean
density of the estimated patterns, and the true recall (the exact attention mass the index keeps, on
--recall-rows rows spread evenly over the sequence) as the mean over layers and heads, the worst layer and the
worst head, and its tail: the share of (head, sampled row) pairs whose own recall is below 0.9, and the 1st
percentile of the rows' recall. Prints one markdown table (and writes every cell to --json).

  python -m mtrain.bench.dev.sweep_quality --model models/smollm2-135m --seq-len 4096 8192 \\
      --texts prose docs code dialogue --set default --set last_q=256 --set recall=0.995

A setting is `default` (SparseSettings as shipped) or comma-separated SparseSettings fields,
e.g. `last_q=256,recall=0.995`.
"""

from __future__ import annotations

import argparse
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


def sparse_pass(net, ids, settings, recall_rows: int, low: float = 0.9) -> dict:
    """Perplexity of `net` over `ids` with every layer sparse under `settings`, with each layer's density and true
    recall on `recall_rows` sampled rows (read from the records mtrain's attention leaves), and the share of
    (head, sampled row) pairs whose own recall is below `low`."""
    from mtrain.bench import real as bench_real
    from mtrain.models import attention
    from mtrain.models.attention import mtrain_attention
    from mtrain.models.context import CONTEXT

    marks = len(CONTEXT.densities), len(CONTEXT.layers)
    saved = CONTEXT.sample_recall, CONTEXT.recall_rows
    plain_record = attention.record_layer
    per_row = []

    def record(layer_idx, path, index, prediction, q=None, k=None, scaling=None, *args, **kwargs):
        plain_record(layer_idx, path, index, prediction, q, k, scaling, *args, **kwargs)
        if path == "sparse" and q is not None:
            with torch.no_grad():
                per_row.append(row_recalls(q.detach(), k.detach(), index, scaling, recall_rows))

    CONTEXT.choice_stats.clear()
    CONTEXT.sample_recall, CONTEXT.recall_rows = True, recall_rows
    attention.record_layer = record  # module global, looked up at each call
    bench_real.register_bench_attention(functools.partial(mtrain_attention, settings=settings, policy="always"))
    try:
        ppl = bench_real.perplexity(net, ids)
        records = CONTEXT.layers[marks[1]:]
        if not records or any(r.path != "sparse" for r in records) or len(per_row) != len(records):
            raise RuntimeError("not every layer ran sparse")
        density = [float(r.density) for r in records]
        recall = [r.true_recall.float().mean(-1).squeeze(0) for r in records]  # [Hq] per layer (batch 1)
        layer_recall = [float(r.mean()) for r in recall]
        head_min = min(float(r.min()) for r in recall)
        rows = torch.stack(per_row)  # [layers, Hq, R]
    finally:
        attention.record_layer = plain_record
        bench_real.register_bench_attention(None)
        CONTEXT.sample_recall, CONTEXT.recall_rows = saved
        del CONTEXT.densities[marks[0]:], CONTEXT.layers[marks[1]:]
    return {"ppl": ppl, "density": sum(density) / len(density), "true_recall_mean": sum(layer_recall) / len(layer_recall),
            "true_recall_worst_layer": min(layer_recall), "true_recall_worst_head": head_min,
            "rows_below": float((rows < low).float().mean()), "rows_below_at": low,
            "row_recall_p01": float(torch.quantile(rows.flatten(), 0.01)), "layers": len(records)}


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
    args = ap.parse_args()
    if args.table:
        cells = []
        for name in args.table:
            with open(name) as fh:
                cells += json.load(fh)["cells"]
        print(table(cells))
        return 0
    if not args.model:
        ap.error("--model is required (except with --table)")
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from mtrain.bench import real as bench_real
    from mtrain.data.texts import text_tokens
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
            cell = sparse_pass(net, ids, SparseSettings(**overrides[name]), args.recall_rows)
            cell.update(seq_len=seq_len, text=text, setting=name, ppl_dense=ppl_dense, rise=cell["ppl"] / ppl_dense - 1,
                        seconds=time.perf_counter() - t0, dense_seconds=dense_s, yarn_factor=factor)
            cells.append(cell)
            print(row(cell), flush=True)
            if args.json:
                with open(args.json + ".tmp", "w") as fh:
                    json.dump({"torch": torch.__version__, "device": device.type, "cells": cells}, fh, indent=1)
                os.replace(args.json + ".tmp", args.json)
        del net
    print("\n" + table(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
