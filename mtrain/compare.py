"""`mtrain compare RUN_DIR...`: a side-by-side table of runs and a loss-vs-tokens plot.

Reads each run's `metrics.jsonl` and resolved `config.yaml`, so it works offline and on runs that
logged to wandb in any mode.
"""

from __future__ import annotations

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
    }


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


def plot(summaries: list[dict], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summaries:
        ax.plot([r["tokens"] for r in s["rows"]], [r["loss"] for r in s["rows"]], label=s["run"])
    ax.set_xlabel("tokens")
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
        "compare", help="compare runs: a table and a loss-vs-tokens plot",
        description="Print steps, tokens, final and best loss, tokens/s and the config keys that differ for "
        "each run folder, and write a loss-vs-tokens PNG.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="train.output_dir folders")
    p.add_argument("--plot", default="compare-loss.png", help="PNG to write (default: %(default)s)")
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.plot.lower().endswith(".png") or Path(args.plot).is_dir():
        raise MtrainError(f"--plot {args.plot}: name a .png file to write")
    summaries = [summarize(r) for r in args.runs]
    print(format_table(summaries))
    print(f"\nwrote {plot(summaries, args.plot)}")
    return 0
