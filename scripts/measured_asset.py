"""Write mtrain/assets/measured.json, the measured figures the code computes with, from the result rows.

    python scripts/measured_asset.py            # rewrite the asset (`make benchmarks`)
    python scripts/measured_asset.py --check    # exit 1 if the asset differs from what the rows give

The planner's measured runs (mtrain.planner.MEASURED / OUT_OF_SAMPLE) and the cost model's fitted coefficients
(mtrain.ops.cost.H200 / CPU) are rows of benchmarks/results.jsonl like every other figure. The package cannot read
that file once installed, so this copies the current row of each measure they use (value, unit and where it came
from) into an asset that ships with it (`mtrain.measured` reads it). tests/test_measured_asset.py fails when a row
changed and the asset was not rewritten.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtrain.atomic import write_text_atomic
from mtrain.bench.results import current, read_rows

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results.jsonl"
OUT = ROOT / "mtrain" / "assets" / "measured.json"
# the measures under these prefixes are the asset's (benchmarks/sections.yaml's `constants`: not printed in
# BENCHMARKS.md) ...
PREFIXES = ("planner.measured.", "cost.h200.", "cost.cpu.")
# ... and these rows, which BENCHMARKS.md prints, hold figures of the planner's measured runs too
MEASURES = ("train.qwen25_3b.longest_one_gpu.step_s", "train.qwen25_3b.longest_one_gpu.peak_gb")
KEEP = ("value", "unit", "date", "commit", "gpu", "command")


def generate(rows: Path = ROWS) -> str:
    """The text the asset should hold: the current row of every measure under PREFIXES or in MEASURES."""
    chosen = [r for r in current(read_rows(rows)) if r["measure"].startswith(PREFIXES) or r["measure"] in MEASURES]
    missing = set(MEASURES) - {r["measure"] for r in chosen}
    if missing:
        raise SystemExit(f"{rows}: no row for {sorted(missing)}")
    doc = {"about": "The measured figures mtrain.planner and mtrain.ops.cost compute with: the current rows of "
                    "benchmarks/results.jsonl, written by `python scripts/measured_asset.py`. Edit the rows, not this "
                    "file.",
           "figures": {r["measure"]: {k: r[k] for k in KEEP} for r in chosen}}
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the asset instead of writing it")
    parser.add_argument("--rows", type=Path, default=ROWS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = generate(args.rows)
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'differs from the rows: run python scripts/measured_asset.py'}")
        return 0 if same else 1
    write_text_atomic(args.out, text)
    print(f"wrote {args.out} ({len(json.loads(text)['figures'])} figures) from {args.rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
