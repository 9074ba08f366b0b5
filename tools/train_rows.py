"""Result rows (benchmarks/results.jsonl) from a pair of training runs on the same data: MTraining and its dense twin.

For each pair, read both runs' metrics.jsonl and append one row per figure under MEASURE.{label}.{figure}:
tokens/s of each (the median over the steps after --warmup), the speed-up (MTraining over dense), the mean per-step
loss difference (%, step by step on the same samples), the largest single-step difference, each run's peak GPU memory,
MTraining's mean attention density over the logged steps and mean sampled true recall.

  python -m tools.train_rows --measure train_docs.smollm2 --label 128k.long \\
      --mtraining runs/smollm2-docs-long-128k-mtraining/metrics.jsonl \\
      --dense runs/smollm2-docs-long-128k-dense/metrics.jsonl \\
      --gpu "1x H200" --versions "torch 2.11.0+cu130, flash-attn-4 4.0.0b36" --commit e0c6fd8 \\
      --command "LENGTHS=131072 scripts/gpu_train_docs.sh run" --note "SmolLM2-135M, long mix"
"""

from __future__ import annotations

import argparse
import datetime
import statistics

from mtrain.bench.results import append_rows

RESULTS = "benchmarks/results.jsonl"


def read_steps(path: str) -> list[dict]:
    """The logged steps of a metrics.jsonl (lines with a loss; a torn last line skipped, `read_metrics`)."""
    from mtrain.train.metrics import read_metrics

    return [row for row in read_metrics(path) if "loss" in row and "step" in row]


def figures(sparse: list[dict], dense: list[dict], warmup: int) -> dict:
    """figure name -> (value, unit, peer, digits, signed) for a pair of runs' logged steps."""
    def speed(rows):
        return statistics.median(r["tokens_per_s"] for r in rows if r["step"] > warmup)

    pairs = [(a["loss"], b["loss"]) for a, b in zip(sparse, dense) if a["step"] == b["step"]]
    diffs = [(a - b) / b * 100 for a, b in pairs]
    out = {"dense_tokens_s": (speed(dense), "tokens/s", None, 0, False),
           "mtrain_tokens_s": (speed(sparse), "tokens/s", None, 0, False),
           "speedup": (speed(sparse) / speed(dense), "x", "the dense kind", 2, False),
           "loss_diff": (statistics.mean(diffs), "%", "the dense kind", 2, True),
           "loss_diff_max": (max(diffs, key=abs), "%", "the dense kind", 2, True)}
    for name, rows in (("mtrain", sparse), ("dense", dense)):
        peaks = [r["peak_mem_gb"] for r in rows if "peak_mem_gb" in r]
        if peaks:
            out[f"{name}_peak_gib"] = (max(peaks), "GiB", None, 1, False)
    density = [r["attention_density"] for r in sparse if "attention_density" in r]
    recall = [r["attention_true_recall"] for r in sparse if r.get("attention_true_recall") is not None]
    if density:
        out["density"] = (statistics.mean(density), "ratio", None, 3, False)
    if recall:
        out["true_recall"] = (statistics.mean(recall), "recall", None, 3, False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", required=True, help="measure prefix, e.g. train_docs.smollm2")
    ap.add_argument("--label", required=True, help="the pair's label under it, e.g. 128k.long")
    ap.add_argument("--mtraining", required=True, help="the MTraining run's metrics.jsonl")
    ap.add_argument("--dense", required=True, help="the dense run's metrics.jsonl")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the tokens/s medians (default 2)")
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--versions", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    rows = []
    for name, (value, unit, peer, digits, signed) in figures(read_steps(args.mtraining), read_steps(args.dense),
                                                             args.warmup).items():
        row = {"date": args.date, "commit": args.commit or None, "gpu": args.gpu, "versions": args.versions,
               "command": args.command, "measure": f"{args.measure}.{args.label}.{name}", "value": round(value, 6),
               "unit": unit, "peer": peer, "note": args.note, "digits": digits}
        if signed:
            row["signed"] = True
        rows.append(row)
        print(f"{row['measure']}: {value:.4g} {unit}")
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
