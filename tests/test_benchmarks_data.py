"""Benchmarks as data: the result rows of benchmarks/results.jsonl validate, BENCHMARKS.md is what they generate, and
every figure README.md quotes with a unit is a figure some row holds.

Reads files only (no torch), so it takes well under a second.
"""

from __future__ import annotations

import json
import re
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from mtrain.bench.results import (ResultRowError, append_rows, current, decimals, figure, read_rows, render_markdown,
                                  rounded)
from test_docs_links import CODE_SPAN, split_fenced

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results.jsonl"
MAX_LINES = 300

sys.path.insert(0, str(ROOT / "scripts"))
import benchmarks_md  # noqa: E402  (scripts/ is not a package)


def test_every_row_validates():
    rows = read_rows(ROWS)
    assert len(rows) >= 100
    assert all(r["unit"] != "x" or r["peer"] for r in rows), "a ratio names its peer"


def test_benchmarks_md_is_generated_from_the_rows_and_short():
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert text == benchmarks_md.generate(), "BENCHMARKS.md differs from the rows: run `make benchmarks`"
    assert text.count("\n") <= MAX_LINES, f"BENCHMARKS.md has {text.count(chr(10))} lines (at most {MAX_LINES})"


# A figure: a number glued to × or %, or followed by a unit word. Numbers joined by " / ", "–", " vs ", " against " or
# " → " share the unit of the last one that has one ("37.0 vs 455 ms", "0.65–0.70×", "+0.13 / −0.09 / +0.21%").
NUM = r"[+−-]?\d(?:[\d,]*\d)?(?:\.\d+)?"
UNIT = r"(?:×|%|\s(?:ms|s|tokens/s|MiB|GiB|GB)(?![\w/]))"
SEP = r"(?:\s/\s|–|\s(?:vs|against|→)\s)"
CHAIN = re.compile(rf"(?<![\w.×/])({NUM})({UNIT})?((?:{SEP}{NUM}(?:{UNIT})?)*)")
# not measured figures: targets, thresholds, rates per unit of work, capacities ("target ≥ 3×", "within 1%",
# "5.9 ms per 1% of pairs", "out of 80 GB")
NOT_A_FIGURE = re.compile(r"(?:≥|≤|<|>|~|\btargets?|\bwithin|\bper|\bup to|\bout of)\s*$")
UNITS = {"×": "x"}


def quoted_figures(text: str):
    """(line, text as printed, number, unit) of each figure the prose and tables of a Markdown text quote."""
    prose, _ = split_fenced(text)
    for n, line in prose:
        line = CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)
        line = re.sub(r"\]\([^)]*\)", "]", line)  # link targets
        for m in CHAIN.finditer(line):
            parts = [(m.group(1), m.group(2))] + re.findall(rf"{SEP}({NUM})({UNIT})?", m.group(3))
            if not parts[-1][1] or NOT_A_FIGURE.search(line[:m.start()]):
                continue
            unit = None
            for num, u in reversed(parts):
                unit = u.strip() if u else unit
                yield n, num + ("" if unit in ("×", "%") else " ") + unit, num, UNITS.get(unit, unit)


def holds(row: dict, num: str, unit: str) -> bool:
    """Whether `row` holds the figure `num` (as printed) in `unit`: equal once rounded as printed; a figure printed
    without a sign ("60–86% low") may be the row's magnitude."""
    if row["unit"] != unit:
        return False
    want = Decimal(num.replace(",", "").replace("−", "-"))
    got = rounded(row["value"], decimals(num))
    return got == want if num[0] in "+−-" else abs(got) == abs(want)


def test_every_readme_figure_is_a_result_row():
    rows = current(read_rows(ROWS))
    figures = list(quoted_figures((ROOT / "README.md").read_text(encoding="utf-8")))
    assert len(figures) > 50, "the figure pattern no longer finds README's figures"
    missing = [f"README.md:{n}: {shown}" for n, shown, num, unit in figures
               if not any(holds(r, num, unit) for r in rows)]
    assert not missing, ("README quotes figures no current row of benchmarks/results.jsonl holds (add the row with "
                         "its command, or correct the figure):\n" + "\n".join(missing))


def test_figure_pattern():
    text = ("12.3× faster: 37.0 vs 455 ms; 73,185 vs 15,896 tokens/s; +0.13 / −0.09 / +0.21% at 8K; "
            "0.86–0.92 of CP=1; target ≥ 3×; within 1%; 5.9 ms per 1% of pairs; 16/2 × 128; `0.5 ms`")
    assert [(shown, unit) for _, shown, _, unit in quoted_figures(text)] == [
        ("12.3×", "x"), ("455 ms", "ms"), ("37.0 ms", "ms"), ("15,896 tokens/s", "tokens/s"),
        ("73,185 tokens/s", "tokens/s"), ("+0.21%", "%"), ("−0.09%", "%"), ("+0.13%", "%"), ("5.9 ms", "ms")]
    row = {"value": 2.495, "unit": "x"}
    assert holds(row, "2.50", "x") and holds(row, "2.495", "x") and not holds(row, "2.49", "x")
    assert holds({"value": -72, "unit": "%"}, "72", "%") and not holds({"value": -72, "unit": "%"}, "+72", "%")


GOOD = {"date": "2026-12-01", "commit": "24e0b82", "gpu": "1x H200", "versions": "torch 2.11.0+cu130",
        "command": "python -m mtrain.bench.check", "measure": "gate.seconds", "value": 172, "unit": "s", "peer": None,
        "note": "24 cases"}


def test_read_rows_names_file_and_line_of_a_malformed_row(tmp_path):
    path = tmp_path / "results.jsonl"
    bad = {k: v for k, v in GOOD.items() if k != "command"}
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ResultRowError, match=rf"{re.escape(str(path))}:3: missing keys \['command'\]"):
        read_rows(path)
    for line, why in (("{not json", "not JSON"), (json.dumps({**GOOD, "value": "172"}), "'value' must be a number"),
                      (json.dumps({**GOOD, "date": "1 Dec"}), "'date' must be a date"),
                      (json.dumps({**GOOD, "measure": "Gate seconds"}), "'measure' must be a dotted id"),
                      (json.dumps({**GOOD, "extra": 1}), "unknown keys \\['extra'\\]")):
        path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
        with pytest.raises(ResultRowError, match=rf"results.jsonl:2: {why}"):
            read_rows(path)


def test_append_rows_and_current(tmp_path):
    path = tmp_path / "results.jsonl"
    append_rows(path, [GOOD])
    append_rows(path, [{**GOOD, "date": "2026-12-03", "value": 150}, {**GOOD, "measure": "gate.cases", "value": 24,
                                                                       "unit": "count"}])
    rows = read_rows(path)
    assert len(rows) == 3 and path.read_text().count("\n") == 3
    assert [(r["measure"], r["value"]) for r in current(rows)] == [("gate.seconds", 150), ("gate.cases", 24)]
    with pytest.raises(ResultRowError, match="new row 1: 'value' must be a number"):
        append_rows(path, [{**GOOD, "value": None}])
    assert len(read_rows(path)) == 3  # nothing appended
    assert figure({**GOOD, "value": -0.3, "unit": "%", "digits": 2, "signed": True}) == "−0.30%"
    assert figure({**GOOD, "value": 73185, "unit": "tokens/s"}) == "73,185 tokens/s"


def test_render_refuses_a_row_no_section_takes():
    sections = {"title": "t", "preface": "p", "sections": [{"title": "Gate", "prefixes": ["gate."], "intro": "i"}]}
    assert "| `gate.seconds` | 172 s |" in render_markdown([GOOD], sections)
    with pytest.raises(Exception, match="no section"):
        render_markdown([GOOD, {**GOOD, "measure": "other.figure"}], sections)


def test_retired_measures_leave_the_reference_and_are_named_once():
    sections = {"title": "t", "preface": "p", "retired": {"old.": "superseded by gate"},
                "sections": [{"title": "Gate", "prefixes": ["gate."], "intro": "i"}]}
    text = render_markdown([GOOD, {**GOOD, "measure": "old.figure", "value": 999}], sections)
    assert "| `gate.seconds` | 172 s |" in text and "999" not in text
    assert "Retired (still in the rows): `old.*` (superseded by gate)." in text
