"""The fidelity study's table (scripts/gpu_train_real.sh): several `mtrain eval --out` folders of one suite and seed
side by side, each score with its standard error and sample count, and each evaluation's paired difference from a
reference evaluation (the same prompts, so the differences' standard error), plus the training runs' final loss.

    python -m mtrain.eval.study --eval dense=runs/smollm2-32k-eval/dense \\
        --eval mtraining=runs/smollm2-32k-eval/mtraining --reference dense \\
        --run dense=runs/smollm2-32k-dense --run mtraining=runs/smollm2-32k-mtraining --out study.md

Scores are x100 (NIAH: answer found; RULER: the mean of its tasks' RULER metrics); perplexity is PG-19's held-out
text, token-weighted; "±" is one standard error. Each evaluation ends with an "all" row: its prompts of every length
pooled (`mtrain.eval.scoring.pooled_scores`), whose errors are the ones a 2-point difference is read against. Final
loss: the mean over the last --last-steps logged steps.
"""

from __future__ import annotations

import argparse
import os
import sys

from mtrain.atomic import write_text_atomic
from mtrain.errors import MtrainError
from mtrain.eval.scoring import load_predictions, paired_difference, pooled_scores, score_records


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{flag} takes NAME=PATH; got {value!r}")
        out[name] = path
    return out


def final_loss(run_dir: str, last: int) -> tuple[float, int]:
    """(mean loss over the last `last` logged steps of RUN/metrics.jsonl, steps averaged)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path}: no such file (a training run folder holds metrics.jsonl)")
    from mtrain.train.metrics import read_metrics

    losses = [r["loss"] for r in read_metrics(path) if isinstance(r, dict) and "loss" in r]  # a torn last line skipped
    if not losses:
        raise SystemExit(f"{path}: no step logged a loss")
    tail = losses[-last:]
    return sum(tail) / len(tail), len(tail)


def _cell(score, err, n) -> str:
    if score is None:
        return "–"
    return f"{score:.1f} ±{err:.1f} (n={n})" if err is not None else f"{score:.1f} (n={n})"


def _diff(cell) -> str:
    if cell is None:
        return "–"
    err = f" ±{cell['stderr']:.1f}" if cell.get("stderr") is not None else ""
    return f"{cell['diff']:+.1f}{err} (n={cell['n']})"


def table(evals: dict[str, str], reference: str | None, runs: dict[str, str], last: int) -> str:
    predictions = {name: load_predictions(path) for name, path in evals.items()}  # read once: scored, then pooled
    results = {name: score_records(records) for name, records in predictions.items()}
    lengths = sorted({int(L) for r in results.values() for kind in ("niah", "ruler") for L in (r.get(kind) or {})}
                     | {int(L) for r in results.values() for L in r["tasks"].get("pg19", {})})
    lines = []
    if runs:
        losses = {name: final_loss(path, last) for name, path in runs.items()}
        ref_loss = losses.get(reference, (None, 0))[0]
        lines += ["| training run | final loss | vs " + (reference or "–") + " |", "|---|---|---|"]
        for name, (loss, steps) in losses.items():
            rel = f"{100 * (loss / ref_loss - 1):+.2f}%" if ref_loss and name != reference else "–"
            lines.append(f"| {name} | {loss:.4f} (last {steps} steps) | {rel} |")
        lines.append("")
    header = ["evaluation", "length", "NIAH", "RULER avg", "PG-19 ppl"]
    if reference:
        header += [f"NIAH − {reference}", f"RULER − {reference}", f"PG-19 vs {reference}"]
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    diffs = {name: paired_difference(path, evals[reference]) for name, path in evals.items()
             if reference and name != reference}
    for name, res in results.items():
        for L in lengths:
            key = str(L)
            niah = res["tasks"].get("niah", {}).get(key)
            ruler = (res.get("ruler") or {}).get(key)
            ppl = res["tasks"].get("pg19", {}).get(key)
            row = [name, f"{L // 1024}K" if L % 1024 == 0 else str(L),
                   _cell(niah["score"], niah.get("stderr"), niah["n"]) if niah else "–",
                   _cell(ruler["average"], ruler.get("stderr"), ruler.get("n")) if ruler else "–",
                   f"{ppl['score']:.3f} (n={ppl['n']})" if ppl else "–"]
            if reference:
                d = diffs.get(name)
                ref_ppl = results[reference]["tasks"].get("pg19", {}).get(key)
                row += [_diff((d or {}).get("niah", {}).get(key)) if d else "–",
                        _diff((d or {}).get("ruler", {}).get(key)) if d else "–",
                        f"{100 * (ppl['score'] / ref_ppl['score'] - 1):+.2f}%" if d and ppl and ref_ppl else "–"]
            lines.append("| " + " | ".join(row) + " |")
        # every length pooled: the same prompts' scores together, which resolve what one length's cannot
        pool = pooled_scores(predictions[name])
        niah, ruler = pool.get("niah"), pool.get("ruler")
        if len(lengths) > 1 and (niah or ruler):
            row = [name, "all",
                   _cell(niah["score"], niah.get("stderr"), niah["n"]) if niah else "–",
                   _cell(ruler["average"], ruler.get("stderr"), ruler.get("n")) if ruler else "–", "–"]
            if reference:
                d = (diffs.get(name) or {}).get("pooled", {})  # none for the reference: its cells read "–"
                row += [_diff(d.get("niah")), _diff(d.get("ruler")), "–"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtrain.eval.study", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval", action="append", default=[], metavar="NAME=DIR", required=True,
                        help="an `mtrain eval --out` folder (repeatable)")
    parser.add_argument("--reference", help="NAME of the evaluation (and run) the others are compared with")
    parser.add_argument("--run", action="append", default=[], metavar="NAME=DIR", help="a training run folder")
    parser.add_argument("--last-steps", type=int, default=10, help="steps averaged for the final loss (10)")
    parser.add_argument("--out", help="write the table here too (atomically)")
    args = parser.parse_args(argv)
    evals, runs = _pairs(args.eval, "--eval"), _pairs(args.run, "--run")
    if args.reference and args.reference not in evals:
        parser.error(f"--reference {args.reference!r} names no --eval (have: {', '.join(evals)})")
    for name, path in evals.items():
        if not os.path.isdir(os.path.join(path, "predictions")):
            parser.error(f"--eval {name}={path}: no predictions/ folder there (an `mtrain eval --out` folder)")
    try:
        text = table(evals, args.reference, runs, args.last_steps)
    except MtrainError as exc:  # e.g. two evaluations of different prompts, which cannot be paired
        print(f"python -m mtrain.eval.study: error: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    if args.out:
        write_text_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
