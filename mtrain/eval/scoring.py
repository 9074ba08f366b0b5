"""Scoring: a pure function of the prediction files, then the reports (results.json, CSV, RULER table, plots).

`score_records` needs no model; `score_run(out_dir)` reads OUT/predictions and writes every report.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
from collections import defaultdict

from mtrain.eval.metrics import METRICS, ruler_postprocess
from mtrain.eval.registry import get_task
from mtrain.eval.predictions import PREDICTIONS, read_records

RULER_TASKS = (
    "ruler/niah_single_1", "ruler/niah_single_2", "ruler/niah_single_3",
    "ruler/niah_multikey_1", "ruler/niah_multikey_2", "ruler/niah_multikey_3",
    "ruler/niah_multivalue", "ruler/niah_multiquery", "ruler/vt", "ruler/cwe", "ruler/fwe",
    "ruler/qa_1", "ruler/qa_2",
)


def _unique(records: list[dict]) -> list[dict]:
    """One record per (length, index): the first written wins (a rerun never rewrites one)."""
    seen, out = set(), []
    for r in records:
        key = (r["length"], r["index"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def score_records(records_by_task: dict[str, list[dict]]) -> dict:
    """Scores from prediction records: per task and length, the RULER average, the NIAH grid, PG-19 perplexity.

    Generation tasks: mean per-sample metric x100 (`metrics.aggregate`); loglik tasks: exp(sum NLL / sum tokens).
    """
    tasks: dict[str, dict] = {}
    niah: dict[str, dict[str, float]] = {}
    for name in sorted(records_by_task):
        task = get_task(name)
        by_length: dict[int, list[dict]] = defaultdict(list)
        for r in _unique(records_by_task[name]):
            by_length[r["length"]].append(r)
        tasks[name] = {}
        for length in sorted(by_length):
            recs = by_length[length]
            if task.kind == "loglik":
                nll, count = sum(r["nll"] for r in recs), sum(r["tokens"] for r in recs)
                tasks[name][str(length)] = {"metric": "perplexity", "score": math.exp(nll / count), "n": len(recs),
                                            "tokens": count}
                continue
            scorer, scale = METRICS[task.metric]
            per_sample = [scorer(_clean(task.family, r["prediction"]), r["references"]) for r in recs]
            tasks[name][str(length)] = {"metric": task.metric, "score": scale * sum(per_sample) / len(recs),
                                        "n": len(recs)}
            if name == "niah":
                cells: dict[float, list[float]] = defaultdict(list)
                for r, s in zip(recs, per_sample):
                    cells[r["meta"]["depth"]].append(s)
                niah[str(length)] = {str(d): scale * sum(v) / len(v) for d, v in sorted(cells.items())}
    results: dict = {"tasks": tasks}
    ruler = {n: tasks[n] for n in RULER_TASKS if n in tasks}
    if ruler:
        lengths = sorted({int(L) for t in ruler.values() for L in t})
        results["ruler"] = {
            str(L): {"average": sum(t[str(L)]["score"] for t in ruler.values() if str(L) in t)
                     / sum(1 for t in ruler.values() if str(L) in t),
                     "tasks": sum(1 for t in ruler.values() if str(L) in t)}
            for L in lengths
        }
    if niah:
        results["niah"] = niah
    return results


def _clean(family: str, prediction: str) -> str:
    # RULER scores its own post-processed prediction; the others score the raw text
    return ruler_postprocess(prediction) if family in ("ruler", "niah") else prediction


def load_predictions(out_dir: str) -> dict[str, list[dict]]:
    out = {}
    for path in sorted(glob.glob(os.path.join(out_dir, PREDICTIONS, "*.jsonl"))):
        records = read_records(path)
        if records:
            out[records[0]["task"]] = records
    return out


def score_run(out_dir: str) -> dict:
    """Score OUT/predictions and write results.json, results.csv, ruler_table.md and the plots; returns results."""
    results = score_records(load_predictions(out_dir))
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "length", "metric", "score", "n"])
        for name, by_length in results["tasks"].items():
            for length, cell in by_length.items():
                writer.writerow([name, length, cell["metric"], f"{cell['score']:.4f}", cell["n"]])
        for length, cell in results.get("ruler", {}).items():
            writer.writerow(["ruler/average", length, f"mean of {cell['tasks']} tasks", f"{cell['average']:.4f}", ""])
    if "ruler" in results:
        with open(os.path.join(out_dir, "ruler_table.md"), "w") as f:
            f.write(ruler_table(results))
    from mtrain.eval import plots

    if "niah" in results:
        plots.niah_heatmap(results["niah"], os.path.join(out_dir, "niah_heatmap.png"))
    if "pg19" in results["tasks"]:
        plots.perplexity_curve(results["tasks"]["pg19"], os.path.join(out_dir, "pg19_perplexity.png"))
    return results


def ruler_table(results: dict) -> str:
    """Markdown table: one row per RULER task present, one column per length, the average last."""
    lengths = list(results["ruler"])
    lines = ["| task | " + " | ".join(lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for name in RULER_TASKS:
        if name in results["tasks"]:
            cells = results["tasks"][name]
            lines.append(f"| {name.split('/', 1)[1]} | " + " | ".join(
                f"{cells[L]['score']:.1f}" if L in cells else "" for L in lengths) + " |")
    lines.append("| **average** | " + " | ".join(
        f"**{results['ruler'][L]['average']:.1f}** ({results['ruler'][L]['tasks']} tasks)" for L in lengths) + " |")
    return "\n".join(lines) + "\n"
