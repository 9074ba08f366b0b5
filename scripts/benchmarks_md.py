"""Write BENCHMARKS.md from the result rows (benchmarks/results.jsonl) and the section texts (benchmarks/sections.yaml).

    python scripts/benchmarks_md.py            # rewrite BENCHMARKS.md (`make benchmarks`)
    python scripts/benchmarks_md.py --check    # exit 1 if BENCHMARKS.md differs from what the rows give
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from mtrain.atomic import write_text_atomic
from mtrain.bench.results import read_rows, render_markdown

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results.jsonl"
SECTIONS = ROOT / "benchmarks" / "sections.yaml"
OUT = ROOT / "BENCHMARKS.md"


def generate(rows: Path = ROWS, sections: Path = SECTIONS) -> str:
    """The text BENCHMARKS.md should hold."""
    return render_markdown(read_rows(rows), yaml.safe_load(sections.read_text(encoding="utf-8")),
                           source=rows.relative_to(ROOT).as_posix() if rows.is_relative_to(ROOT) else str(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with BENCHMARKS.md instead of writing it")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'differs from the rows: run make benchmarks'}")
        return 0 if same else 1
    write_text_atomic(args.out, text)
    print(f"wrote {args.out} ({text.count(chr(10))} lines) from {len(read_rows(ROWS))} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
