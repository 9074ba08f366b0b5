"""Scoring: a pure function of the prediction files, then the reports (results.json, CSV, RULER table, plots).

`score_records` needs no model; `score_run(out_dir)` reads OUT/predictions and writes every report.
"""

from __future__ import annotations

import csv
import glob
import math
import os
from collections import defaultdict

from mtrain.errors import MtrainError
from mtrain.atomic import atomic_path, write_json_atomic, write_text_atomic
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
                                        "stderr": standard_error(per_sample, scale), "n": len(recs)}
            if name == "niah":
                cells: dict[float, list[float]] = defaultdict(list)
                for r, s in zip(recs, per_sample):
                    cells[r["meta"]["depth"]].append(s)
                niah[str(length)] = {str(d): scale * sum(v) / len(v) for d, v in sorted(cells.items())}
    results: dict = {"tasks": tasks}
    ruler = {n: tasks[n] for n in RULER_TASKS if n in tasks}
    if ruler:
        lengths = sorted({int(L) for t in ruler.values() for L in t})
        results["ruler"] = {str(L): _task_average(ruler, str(L), "score", "average") for L in lengths}
    if niah:
        results["niah"] = niah
    return results


def _clean(family: str, prediction: str) -> str:
    # RULER scores its own post-processed prediction; the others score the raw text
    return ruler_postprocess(prediction) if family in ("ruler", "niah") else prediction


def _task_average(tasks: dict[str, dict], length: str, key: str, name: str) -> dict:
    """The mean of `key` over the tasks' cells at `length` (as `name`), with its standard error (the tasks' samples are
    drawn independently: the mean's variance is the sum of theirs over T^2; None where a task has none), the number
    of tasks and of samples."""
    cells = [t[length] for t in tasks.values() if length in t]
    errors = [c.get("stderr") for c in cells]
    stderr = math.sqrt(sum(e * e for e in errors)) / len(cells) if None not in errors else None
    return {name: sum(c[key] for c in cells) / len(cells), "stderr": stderr, "tasks": len(cells),
            "n": sum(c["n"] for c in cells)}


def standard_error(per_sample: list[float], scale: float = 1.0) -> float | None:
    """Standard error of the mean of `per_sample` (sample standard deviation over sqrt(n)), times `scale`; None
    with fewer than 2 samples, where it is not defined."""
    n = len(per_sample)
    if n < 2:
        return None
    mean = sum(per_sample) / n
    return scale * math.sqrt(sum((x - mean) ** 2 for x in per_sample) / (n - 1) / n)


def _per_sample(records_by_task: dict[str, list[dict]]) -> dict[tuple[str, int], dict[int, float]]:
    """{(task, length): {sample index: score in [0, 1]}} of the generation tasks (as `score_records` scores them)."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    for name, records in records_by_task.items():
        task = get_task(name)
        if task.kind == "loglik":
            continue
        scorer, _ = METRICS[task.metric]
        for r in _unique(records):
            out.setdefault((name, r["length"]), {})[r["index"]] = scorer(_clean(task.family, r["prediction"]),
                                                                           r["references"])
    return out


def _per_prompt(records_by_task: dict[str, list[dict]]) -> dict[tuple[str, int], dict[str, float]]:
    """`_per_sample`'s scores keyed by each sample's prompt (its `prompt_sha256`; records written before it was
    recorded: by index, "#i")."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for name, records in records_by_task.items():
        for r in _unique(records):
            scores = _per_sample({name: [r]})
            for key, by_index in scores.items():
                out.setdefault(key, {})[r.get("prompt_sha256") or f"#{r['index']}"] = by_index[r["index"]]
    return out


def paired_difference(out_a: str, out_b: str) -> dict:
    """Scores of evaluation `out_a` minus those of `out_b` (two `mtrain eval --out` folders of one suite and seed),
    paired by prompt (`prompt_sha256`) on the samples both hold, with the standard error of
    the paired differences: the right error for two models on the same prompts, smaller than the two means' errors
    combined when the models agree on most samples. Returns {"tasks": {task: {length: {"diff", "stderr", "n"}}},
    "ruler": {length: {"diff", "stderr", "tasks", "n"}}, "niah": {length: ...}, "pooled": the same over all lengths
    (as `pooled_scores`)} in the scores' scale (x100). MtrainError when, for a task and length, neither holds all the
    other's prompts (another suite, seed or tokenizer)."""
    recs_a, recs_b = load_predictions(out_a), load_predictions(out_b)
    a, b = _per_prompt(recs_a), _per_prompt(recs_b)
    tasks: dict[str, dict] = {}
    pooled: dict[str, list[float]] = defaultdict(list)  # every length's differences of a task, for "pooled"
    for key in sorted(set(a) & set(b)):
        name, length = key
        common = sorted(set(a[key]) & set(b[key]))
        if not (set(a[key]) <= set(b[key]) or set(b[key]) <= set(a[key])):  # one may lack samples, not hold others
            raise MtrainError(f"{out_a} and {out_b} scored different prompts ({name} at length {length}: "
                              f"{len(set(a[key]) - set(b[key]))} of {len(a[key])} prompts not in the other): paired "
                              "differences need the same prompts; evaluate both with the same suite, seed and tokenizer")
        if not common:
            continue
        _, scale = METRICS[get_task(name).metric]
        diffs = [a[key][i] - b[key][i] for i in common]
        pooled[name] += diffs
        tasks.setdefault(name, {})[str(length)] = {"diff": scale * sum(diffs) / len(diffs),
                                                   "stderr": standard_error(diffs, scale), "n": len(diffs)}
    results: dict = {"tasks": tasks}
    ruler = {n: tasks[n] for n in RULER_TASKS if n in tasks}
    lengths = sorted({int(L) for t in ruler.values() for L in t})
    if lengths:
        results["ruler"] = {str(L): _task_average(ruler, str(L), "diff", "diff") for L in lengths}
    if "niah" in tasks:
        results["niah"] = tasks["niah"]
    results["pooled"] = _pooled(pooled, "diff", "diff")
    return results


def pooled_scores(records_by_task: dict[str, list[dict]]) -> dict:
    """Every generation task's samples of all lengths pooled into one cell: {"tasks": {task: {"score", "stderr",
    "n"}}, "niah": that cell of NIAH, "ruler": {"average", "stderr", "tasks", "n"}} (x100; a key is absent where its
    tasks are). Pooling over lengths is what resolves small differences: a NIAH cell of 10 prompts moves by 10 points
    per prompt, the 40 prompts of four lengths by 2.5."""
    values: dict[str, list[float]] = defaultdict(list)
    for (name, _), samples in sorted(_per_sample(records_by_task).items()):
        values[name] += [samples[i] for i in sorted(samples)]
    return _pooled(values, "score", "average")


def _pooled(values: dict[str, list[float]], key: str, average: str) -> dict:
    """Cells {key, "stderr", "n"} of per-sample values in [0, 1] (or differences of them), scaled as each task's
    metric is; the RULER tasks' average as `average` (`_task_average`)."""
    tasks = {}
    for name, vals in values.items():
        if vals:
            _, scale = METRICS[get_task(name).metric]
            tasks[name] = {"all": {key: scale * sum(vals) / len(vals), "stderr": standard_error(vals, scale),
                                   "n": len(vals)}}
    out: dict = {"tasks": {name: cell["all"] for name, cell in tasks.items()}}
    ruler = {n: tasks[n] for n in RULER_TASKS if n in tasks}
    if ruler:
        out["ruler"] = _task_average(ruler, "all", key, average)
    if "niah" in tasks:
        out["niah"] = tasks["niah"]["all"]
    return out


def _fmt_err(value) -> str:
    return "" if value is None else f"{value:.4f}"


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
    write_json_atomic(os.path.join(out_dir, "results.json"), results, indent=2, sort_keys=True)
    with atomic_path(os.path.join(out_dir, "results.csv")) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "length", "metric", "score", "stderr", "n"])
        for name, by_length in results["tasks"].items():
            for length, cell in by_length.items():
                writer.writerow([name, length, cell["metric"], f"{cell['score']:.4f}", _fmt_err(cell.get("stderr")),
                                 cell["n"]])
        for length, cell in results.get("ruler", {}).items():
            writer.writerow(["ruler/average", length, f"mean of {cell['tasks']} tasks", f"{cell['average']:.4f}",
                             _fmt_err(cell.get("stderr")), cell.get("n", "")])
    if "ruler" in results:
        write_text_atomic(os.path.join(out_dir, "ruler_table.md"), ruler_table(results))
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
