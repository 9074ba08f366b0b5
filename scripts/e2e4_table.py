"""The issue #28 tables from run folders' metrics.jsonl (written by scripts/gpu_e2e4.sh, readable anywhere).

One table per length for an mtraining run and its dense twin (same data, seed and steps): steps and tokens both
ran, tokens/s (median over the steps after the warm-up) and mtraining's speed-up against dense with the issue's
target, per-step loss difference over the steps both ran (largest and mean, relative to dense), peak memory per
GPU (largest rank, and every rank), mean attention density and sampled true recall, worker / ring-step imbalance
and each rank's share of the work. Then the longest-context table: one row per length tried.

    python scripts/e2e4_table.py --pair 256K runs/e2e4-256k-mtraining runs/e2e4-256k-dense --target 3 \
        --pair 512K runs/e2e4-512k-mtraining runs/e2e4-512k-dense --target 5 --longest runs/e2e4-qwen-*
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read_rows(run: str | Path) -> list[dict]:
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a torn last line from a killed run
    return rows


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _fmt(v, spec: str = ".3g") -> str:
    return format(v, spec) if _num(v) else "-"


def _median(rows: list[dict], key: str, warmup: int):
    values = [r[key] for r in rows if r.get("step", 0) > warmup and _num(r.get(key))]
    if not values:  # too few steps: all of them
        values = [r[key] for r in rows if _num(r.get(key))]
    return statistics.median(values) if values else None


def _mean(rows: list[dict], key: str):
    values = [r[key] for r in rows if _num(r.get(key))]
    return sum(values) / len(values) if values else None


def _per_rank(rows: list[dict], prefix: str) -> list[float]:
    """The largest value of each rank's `PREFIX<rank>` key over the steps, in rank order."""
    ranks: dict[int, float] = {}
    for r in rows:
        for key, v in r.items():
            if key.startswith(prefix) and _num(v):
                rank = int(key[len(prefix):])
                ranks[rank] = max(ranks.get(rank, v), v)
    return [ranks[k] for k in sorted(ranks)]


def run_figures(rows: list[dict], warmup: int) -> dict:
    recall_min = [r["attention_true_recall_min"] for r in rows if _num(r.get("attention_true_recall_min"))]
    return {
        "steps": rows[-1]["step"] if rows else 0,
        "tokens": rows[-1].get("tokens") if rows else None,
        "tokens_per_s": _median(rows, "tokens_per_s", warmup),
        "peak_mem_gb": max((r["peak_mem_gb"] for r in rows if _num(r.get("peak_mem_gb"))), default=None),
        "peak_mem_ranks": _per_rank(rows, "peak_mem_gb/rank"),
        "density": _mean(rows, "attention_density"),
        "work": _mean(rows, "attention_work"),
        "sparse_layers": _mean(rows, "attention_sparse_layers"),
        "true_recall": _mean(rows, "attention_true_recall"),
        "true_recall_min": min(recall_min) if recall_min else None,
        "imbalance_worker": _mean(rows, "imbalance_worker"),
        "imbalance_step": _mean(rows, "imbalance_step"),
        "imbalance_ranks": _per_rank(rows, "imbalance_rank/r"),
    }


def pair_table(label: str, sparse_run: str, dense_run: str, *, target: float | None, warmup: int,
               loss_tol: float = 0.01) -> str:
    sparse, dense = read_rows(sparse_run), read_rows(dense_run)
    if not sparse or not dense:
        missing = [run for run, rows in ((sparse_run, sparse), (dense_run, dense)) if not rows]
        return f"### {label}\n\nno metrics in {', '.join(missing)} (not run, or failed before its first step)\n"
    fs, fd = run_figures(sparse, warmup), run_figures(dense, warmup)
    by_step = {r["step"]: r["loss"] for r in dense}
    diffs = [(r["loss"] - by_step[r["step"]]) / by_step[r["step"]] for r in sparse
             if r["step"] in by_step and _num(r.get("loss")) and by_step[r["step"]]]
    worst = max(diffs, key=abs) if diffs else None
    speed = fs["tokens_per_s"] / fd["tokens_per_s"] if fs["tokens_per_s"] and fd["tokens_per_s"] else None
    lines = [f"### {label}", "",
             "| run | steps | tokens | tokens/s (median, steps > %d) | peak GB per GPU (max; per rank) | density | "
             "work | sparse layers | true recall (mean / min) | imbalance worker / step | per-rank work / mean |"
             % warmup, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in (("mtraining", fs), ("dense", fd)):
        ranks = ", ".join(_fmt(v, ".1f") for v in f["peak_mem_ranks"])
        lines.append(
            f"| {name} | {f['steps']} | {_fmt(f['tokens'], ',')} | {_fmt(f['tokens_per_s'], ',.0f')} | "
            f"{_fmt(f['peak_mem_gb'], '.1f')}{f' ({ranks})' if ranks else ''} | {_fmt(f['density'], '.3f')} | "
            f"{_fmt(f['work'], '.3f')} | {_fmt(f['sparse_layers'], '.2f')} | {_fmt(f['true_recall'], '.3f')} / "
            f"{_fmt(f['true_recall_min'], '.3f')} | {_fmt(f['imbalance_worker'], '.3f')} / "
            f"{_fmt(f['imbalance_step'], '.3f')} | {', '.join(_fmt(v, '.3f') for v in f['imbalance_ranks']) or '-'} |")
    verdict = ""
    if speed is not None and target is not None:
        verdict = f" (target >= {target:g}x: {'met' if speed >= target else f'missed by {target - speed:.2f}x'})"
    lines += ["", f"- speed-up, mtraining / dense tokens/s: **{_fmt(speed, '.2f')}x**{verdict}"]
    if diffs:
        mean = sum(abs(d) for d in diffs) / len(diffs)
        ok = "within" if abs(worst) <= loss_tol else "outside"
        lines.append(f"- per-step loss, mtraining vs dense over {len(diffs)} common steps: largest {worst:+.2%}, mean "
                     f"|diff| {mean:.2%} ({ok} {loss_tol:.0%})")
    if fs["steps"] != fd["steps"]:
        lines.append(f"- unequal steps: mtraining {fs['steps']}, dense {fd['steps']} (a run was stopped by its time box)")
    return "\n".join(lines) + "\n"


def longest_table(runs: list[str], warmup: int) -> str:
    cps = set()
    for run in runs:
        config = Path(run) / "config.yaml"
        if config.is_file():
            import yaml

            cps.add((yaml.safe_load(config.read_text()) or {}).get("parallel", {}).get("cp_size"))
    cp = "/".join(str(c) for c in sorted(c for c in cps if c)) or "4"
    lines = [f"### Longest context (CP={cp}, ZeRO-2 + optimizer offload)", "",
             "| run | tokens per sequence | status | steps | step s (last) | tokens/s | peak GB per GPU | density |",
             "|---|---|---|---|---|---|---|---|"]
    longest = None
    for run in runs:
        rows = read_rows(run)
        status_file = Path(run) / "status.txt"
        status = status_file.read_text().strip() if status_file.is_file() else ("ok" if rows else "no metrics")
        config = Path(run) / "config.yaml"
        seq = max_steps = None
        if config.is_file():
            import yaml

            loaded = yaml.safe_load(config.read_text()) or {}
            seq = loaded.get("data", {}).get("seq_len")
            max_steps = loaded.get("train", {}).get("max_steps")
        last = rows[-1] if rows else {}
        if status != "ok" and rows and max_steps and last.get("step", 0) >= max_steps:
            # every step ran; the box stopped the final checkpoint's save: the length trained
            status = f"{status} in the final save, after its {max_steps} steps"
        step_s = seq / last["tokens_per_s"] if seq and _num(last.get("tokens_per_s")) else None
        f = run_figures(rows, warmup) if rows else {}
        lines.append(f"| {Path(run).name} | {_fmt(seq, ',')} | {status} | {last.get('step', 0)} | {_fmt(step_s, '.1f')} | "
                     f"{_fmt(last.get('tokens_per_s'), ',.0f')} | {_fmt(f.get('peak_mem_gb'), '.1f')} | "
                     f"{_fmt(f.get('density'), '.3f')} |")
        if (status == "ok" or "after its" in status) and rows and seq and (longest is None or seq > longest):
            longest = seq
    lines += ["", f"- longest that trained: **{_fmt(longest, ',')} tokens** (target >= 1,048,576: "
              f"{'met' if longest and longest >= 1 << 20 else 'missed'})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", nargs=3, action="append", default=[], metavar=("LABEL", "MTRAINING_RUN", "DENSE_RUN"))
    ap.add_argument("--target", type=float, action="append", default=[],
                    help="speed-up target of each --pair, in order")
    ap.add_argument("--longest", nargs="*", default=[], help="run folders of the longest-context search")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the tokens/s median (default 2)")
    ap.add_argument("--out", help="also write the tables to this markdown file")
    args = ap.parse_args(argv)
    parts = [pair_table(label, s, d, target=args.target[i] if i < len(args.target) else None, warmup=args.warmup)
             for i, (label, s, d) in enumerate(args.pair)]
    if args.longest:
        parts.append(longest_table(args.longest, args.warmup))
    text = "\n".join(parts)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
