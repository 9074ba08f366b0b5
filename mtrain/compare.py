"""`mtrain compare RUN_DIR...`: a side-by-side table of runs, their eval scores, and a loss-vs-tokens plot.

Reads each run's `metrics.jsonl` and resolved `config.yaml` (and `RUN_DIR/eval/results.json` where `mtrain eval`
wrote one), so it works offline and on runs that logged to wandb in any mode. A run that continues another
compared run (its `model.path` is that run's `final/` or a checkpoint of it) is plotted on the token axis
continuing the other's: stage 2 after stage 1.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from mtrain.errors import MtrainError


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and prefix == "":
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def summarize(run_dir: str | Path) -> dict:
    """Steps, tokens, final/best loss and tokens/s of one run folder."""
    import yaml

    from mtrain.train.metrics import read_metrics

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MtrainError(f"{run_dir}: no such run folder; give train.output_dir folders")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise MtrainError(f"{run_dir} has no metrics.jsonl; is it a train.output_dir?")
    rows = read_metrics(path)
    if not rows:
        raise MtrainError(f"{path} holds no complete steps yet")
    for number, row in enumerate(rows, 1):
        bad = [k for k in ("step", "tokens", "loss", "tokens_per_s")
               if not isinstance(row, dict) or isinstance(row.get(k), bool) or not isinstance(row.get(k), (int, float))]
        if bad:
            raise MtrainError(f"{path}: record {number} lacks numeric {bad}; it was not written by `mtrain train`: "
                              "delete that line")
    config_file = run_dir / "config.yaml"
    try:
        config = (yaml.safe_load(config_file.read_text()) or {}) if config_file.exists() else {}
    except yaml.YAMLError as exc:
        raise MtrainError(f"{config_file}: not valid YAML ({' '.join(str(exc).split())}); restore it") from None
    if not isinstance(config, dict):
        raise MtrainError(f"{config_file}: not a recipe (a mapping of sections); restore it")
    speeds = [r["tokens_per_s"] for r in rows[1:]] or [rows[0]["tokens_per_s"]]  # step 1 includes warm-up
    return {
        "run": run_dir.name,
        "path": str(run_dir),
        "steps": rows[-1]["step"],
        "tokens": rows[-1]["tokens"],
        "final_loss": rows[-1]["loss"],
        "best_loss": min(r["loss"] for r in rows),
        "tokens_per_s": statistics.median(speeds),
        "rows": rows,
        "config": _flatten(config),
        "eval": _eval_results(run_dir),
    }


def _eval_results(run_dir: Path) -> dict | None:
    """The run's `eval/results.json` (what `make eval` writes), or None if it has none."""
    path = run_dir / "eval" / "results.json"
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())
    except ValueError:
        raise MtrainError(f"{path}: not valid JSON; rerun `mtrain eval ... --score-only --out {path.parent}`") from None
    return results if isinstance(results, dict) else None


def token_offsets(summaries: list[dict]) -> list[int]:
    """Tokens each run starts at on a shared axis: a run whose model.path lies inside another compared run's
    folder (its final/ export or a checkpoint) starts where that run ended, recursively; others at 0."""
    folders = [os.path.realpath(s["path"]) for s in summaries]

    def parent(i: int) -> int | None:
        model = summaries[i]["config"].get("model.path")
        if not isinstance(model, str):
            return None
        model = os.path.realpath(model)
        for j, folder in enumerate(folders):
            if j != i and (model == folder or model.startswith(folder + os.sep)):
                return j
        return None

    def offset(i: int, seen: frozenset) -> int:
        j = parent(i)
        if j is None or j in seen:
            return 0
        return offset(j, seen | {i}) + summaries[j]["tokens"]

    return [offset(i, frozenset()) for i in range(len(summaries))]


def differing_keys(summaries: list[dict]) -> list[str]:
    keys = sorted({k for s in summaries for k in s["config"]})
    return [k for k in keys if len({repr(s["config"].get(k)) for s in summaries}) > 1]


def format_table(summaries: list[dict]) -> str:
    diff = [k for k in differing_keys(summaries) if k != "train.output_dir"]
    headers = ["run", "steps", "tokens", "final loss", "best loss", "tokens/s"] + diff
    rows = []
    for s in summaries:
        rows.append([s["run"], str(s["steps"]), f"{s['tokens']:,}", f"{s['final_loss']:.4f}", f"{s['best_loss']:.4f}",
                     f"{s['tokens_per_s']:,.0f}"] + [str(s["config"].get(k, "-")) for k in diff])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_eval_table(summaries: list[dict]) -> str | None:
    """NIAH (mean over depths) and RULER average per length, one row per run that has eval results; None if
    no run has any. A dash marks a length a run was not evaluated at."""
    with_eval = [s for s in summaries if s["eval"]]
    if not with_eval:
        return None
    columns: list[tuple[str, str, str]] = []  # (header, kind, length)
    for kind, label in (("niah", "NIAH"), ("ruler", "RULER avg")):
        lengths = sorted({int(L) for s in with_eval for L in (s["eval"].get(kind) or {})})
        columns += [(f"{label} {_length_label(L)}", kind, str(L)) for L in lengths]
    if not columns:
        return None

    def cell(results: dict, kind: str, length: str) -> str:
        value = (results.get(kind) or {}).get(length)
        if value is None:
            return "-"
        if kind == "niah":
            return f"{sum(value.values()) / len(value):.1f}" if value else "-"
        return f"{value['average']:.1f}"

    headers = ["run"] + [c[0] for c in columns]
    rows = [[s["run"]] + [cell(s["eval"], kind, L) for _, kind, L in columns] for s in with_eval]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _length_label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def plot(summaries: list[dict], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, start in zip(summaries, token_offsets(summaries)):
        label = s["run"] if not start else f"{s['run']} (from {start:,} tokens)"
        ax.plot([start + r["tokens"] for r in s["rows"]], [r["loss"] for r in s["rows"]], label=label)
    ax.set_xlabel("tokens (a continued run starts where its parent run ended)")
    ax.set_ylabel("training loss")
    ax.set_title("loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare runs: a table, their eval scores and a loss-vs-tokens plot",
        description="Print steps, tokens, final and best loss, tokens/s and the config keys that differ for "
        "each run folder, the NIAH and RULER scores of runs with RUN_DIR/eval/results.json, and write a "
        "loss-vs-tokens PNG (a run continuing another compared run starts where that one ended).",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train.output_dir folders")
    p.add_argument("--plot", default="compare-loss.png", help="PNG to write (default: %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.plot.lower().endswith(".png") or Path(args.plot).is_dir():
        raise MtrainError(f"--plot {args.plot}: name a .png file to write")
    summaries = [summarize(r) for r in args.runs]
    print(format_table(summaries))
    scores = format_eval_table(summaries)
    if scores:
        print("\neval scores (RUN_DIR/eval/results.json): NIAH answer found %, mean over depths; RULER average\n"
              + scores)
    print(f"\nwrote {plot(summaries, args.plot)}")
    return 0
