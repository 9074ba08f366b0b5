"""Benchmark results as data: one JSON object per line in `benchmarks/results.jsonl`, one row per measured figure.

A row says when (`date`, YYYY-MM-DD), at which `commit` (null where the run did not record one), on what (`gpu`: "1x
H200", "4x H100", "CPU 2 cores"; `versions`), how (`command`), what (`measure`: a stable dotted id such as
`dense_docs.ratio_vs_fa4.128k.16x2x128.long`), the figure (`value`, a number, in `unit`: "x" for a ratio, "%",
"ms", "tokens/s", ...), against what a ratio is (`peer`, null for a plain figure) and a short `note`. Two optional
keys say how the figure prints: `digits` (decimals) and `signed` (a + before a positive value, for a change).

A benchmark appends its rows (`append_rows`); `current` keeps the newest row of each measure; `render_markdown` writes
BENCHMARKS.md from the current rows and the hand-written section texts of `benchmarks/sections.yaml`
(`python scripts/benchmarks_md.py`, or `make benchmarks`).
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Iterable, Mapping
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from mtrain.atomic import write_text_atomic
from mtrain.errors import MtrainError

REQUIRED = ("date", "commit", "gpu", "versions", "command", "measure", "value", "unit", "peer", "note")
OPTIONAL = ("digits", "signed")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMIT = re.compile(r"[0-9a-f]{7,40}")
MEASURE = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)+")
# units printed glued to the number; the others follow it after a space, and these print no unit at all
GLUED = {"x": "×", "%": "%"}
BARE = ("ratio", "recall", "loss", "score", "count")
MINUS = "−"


class ResultRowError(MtrainError, ValueError):
    """A result row that does not validate; the message names the file and line."""


def check_row(row, where: str = "row") -> dict:
    """`row` if it is a valid result row, else ResultRowError naming `where` (file:line) and the key."""
    if not isinstance(row, dict):
        raise ResultRowError(f"{where}: a row is a JSON object, got {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    unknown = [k for k in row if k not in REQUIRED + OPTIONAL]
    if missing or unknown:
        raise ResultRowError(f"{where}: " + "; ".join(
            ([f"missing keys {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])))

    def bad(key: str, want: str):
        raise ResultRowError(f"{where}: '{key}' must be {want}, got {row[key]!r}")

    for key in ("gpu", "versions", "command", "unit", "note"):
        if not isinstance(row[key], str) or (key != "note" and not row[key].strip()):
            bad(key, "a non-empty string" if key != "note" else "a string")
    if not isinstance(row["date"], str) or not DATE.fullmatch(row["date"]):
        bad("date", "a date YYYY-MM-DD")
    if row["commit"] is not None and not (isinstance(row["commit"], str) and COMMIT.fullmatch(row["commit"])):
        bad("commit", "null or 7 to 40 hex digits")
    if not isinstance(row["measure"], str) or not MEASURE.fullmatch(row["measure"]):
        bad("measure", "a dotted id of lower-case words (a.b.c)")
    if isinstance(row["value"], bool) or not isinstance(row["value"], (int, float)) or row["value"] != row["value"]:
        bad("value", "a number")
    if row["peer"] is not None and not (isinstance(row["peer"], str) and row["peer"].strip()):
        bad("peer", "null or a non-empty string")
    if "digits" in row and (isinstance(row["digits"], bool) or not isinstance(row["digits"], int)
                            or not 0 <= row["digits"] <= 6):
        bad("digits", "an integer 0 to 6")
    if "signed" in row and not isinstance(row["signed"], bool):
        bad("signed", "true or false")
    return row


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Every row of a results file, each validated; blank lines are skipped. ResultRowError names file:line."""
    path = Path(path)
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ResultRowError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from None
        rows.append(check_row(row, f"{path}:{n}"))
    return rows


def dumps(row: Mapping) -> str:
    """One row as its line in a results file (keys in the documented order)."""
    return json.dumps({k: row[k] for k in REQUIRED + OPTIONAL if k in row}, ensure_ascii=False)


def append_rows(path: str | os.PathLike, rows: Iterable[Mapping]) -> Path:
    """Append `rows` (validated first, all or none) to a results file: the old lines and the new ones are written to
    a temporary file that replaces it in one rename, so a reader never sees half a row."""
    path = Path(path)
    new = [check_row(dict(r), f"{path}: new row {i}") for i, r in enumerate(rows, 1)]
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    return write_text_atomic(path, old + "".join(dumps(r) + "\n" for r in new))


def current(rows: Iterable[Mapping]) -> list[dict]:
    """The newest row of each measure (by date; on the same date the later line wins), in the order each measure
    first appears."""
    newest: dict[str, Mapping] = {}
    for row in rows:
        old = newest.get(row["measure"])
        if old is None or row["date"] >= old["date"]:
            newest[row["measure"]] = row
    return [dict(r) for r in newest.values()]


def decimals(text: str) -> int:
    return len(text.split(".", 1)[1]) if "." in text else 0


def rounded(value: float, digits: int) -> Decimal:
    """`value` rounded half-up to `digits` decimals, as it is printed (2.495 -> 2.50)."""
    return Decimal(repr(value)).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)


def number(row: Mapping) -> str:
    """The row's value as printed: its `digits`, thousands grouped, a true minus sign, + where `signed`."""
    value = row["value"]
    if "digits" in row:
        text = f"{rounded(value, row['digits']):,f}"
    elif float(value).is_integer():
        text = f"{int(value):,}"
    else:
        text = repr(float(value))
    if text.startswith("-"):
        text = MINUS + text[1:]
    elif row.get("signed"):
        text = "+" + text
    return text


def figure(row: Mapping) -> str:
    """Value and unit as a document prints them: 0.97×, +0.18%, 455.1 ms, 73,185 tokens/s."""
    unit = row["unit"]
    if unit in GLUED:
        return number(row) + GLUED[unit]
    if unit in BARE:
        return number(row)
    return f"{number(row)} {unit}"


def cell(row: Mapping) -> str:
    """A grid cell: the number, with × or % glued (the other units are in the column's header)."""
    return number(row) + GLUED.get(row["unit"], "")


def _source_key(row: Mapping) -> tuple:
    return row["date"], row["commit"] or "", row["gpu"], row["versions"], row["command"]


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(map(esc, line)) + " |" for line in body)]


def render_markdown(rows: Iterable[Mapping], sections: Mapping, source: str = "benchmarks/results.jsonl") -> str:
    """BENCHMARKS.md from the rows (their current figures) and `sections` (benchmarks/sections.yaml): a title, a
    `preface`, then each section's title, hand-written `intro`, its `grids` (a table whose cells are measures
    `cell.format(row=ROW, col=COL)`), a table of the section's other measures, and the runs they come from, each with
    its date, machine, versions, commit and command. A section takes the measures that start with one of its
    `prefixes`; a current row no section takes is an error (it would be missing from the reference). Measures under a
    prefix of `retired` (prefix -> why) stay in the rows but leave the reference, and so do those under a prefix of
    `constants` (prefix -> what: figures the code computes with, `mtrain/assets/measured.json`): one line at its end
    names both."""
    retired = sections.get("retired") or {}
    constants = sections.get("constants") or {}
    rows = [r for r in current(rows) if not r["measure"].startswith(tuple(retired) + tuple(constants))]
    by_measure = {r["measure"]: r for r in rows}
    taken: set[str] = set()
    out = [f"# {sections['title']}", "", sections["preface"].strip(), ""]
    out += ["Sections: " + " · ".join(f"[{s['title']}](#{_slug(s['title'])})" for s in sections["sections"]) + ".", ""]
    for sec in sections["sections"]:
        prefixes = tuple(sec["prefixes"])
        mine = [r for r in rows if r["measure"].startswith(prefixes) and r["measure"] not in taken]
        taken.update(r["measure"] for r in mine)
        sources: dict[tuple, int] = {}
        for r in mine:
            sources.setdefault(_source_key(r), len(sources) + 1)
        src = lambda r: f"[{sources[_source_key(r)]}]"  # noqa: E731
        out += [f"## {sec['title']}", "", sec["intro"].strip(), ""]  # the intro keeps its line breaks
        shown: set[str] = set()
        for grid in sec.get("grids", []):
            body, used = [], []
            for row_key, label in grid["rows"].items():
                line = [label]
                for col_key in grid["cols"]:
                    m = grid["cell"].format(row=row_key, col=col_key)
                    r = by_measure.get(m)
                    if r is not None and r["measure"].startswith(prefixes):
                        line.append(cell(r))
                        shown.add(m)
                        used.append(r)
                    else:
                        line.append("–")
                body.append(line)
            if not used:
                raise MtrainError(f"grid '{grid.get('caption', grid['cell'])}' of section '{sec['title']}' "
                                  "shows no measure")
            refs = " ".join(sorted({src(r) for r in used}, key=lambda s: int(s[1:-1])))
            out += [f"{' '.join(grid['caption'].split())} Runs {refs}."]
            out += _table([grid["corner"], *grid["cols"].values()], body) + [""]
        rest = [r for r in mine if r["measure"] not in shown]
        if rest:
            out += _table(["measure", "value", "peer", "date", "run", "note"],
                          [[f"`{r['measure']}`", figure(r), r["peer"] or "", r["date"], src(r), r["note"]]
                           for r in rest]) + [""]
        runs = []
        for (date, commit, gpu, versions, command), n in sources.items():
            at = f", commit {commit}" if commit else ""
            runs.append(f"**[{n}]** {date}, {gpu}, {versions}{at}: `{command}`")
        if runs:
            out += ["Runs: " + " · ".join(runs) + ".", ""]
    left = [r["measure"] for r in rows if r["measure"] not in taken]
    if left:
        raise MtrainError(f"measures no section of the reference takes (add a prefix to a section): {left}")
    left_out = []
    if retired:
        left_out.append("Retired (still in the rows): "
                        + "; ".join(f"`{p}*` ({why})" for p, why in retired.items()) + ".")
    if constants:
        left_out.append("Not printed, the figures the code computes with (`python scripts/measured_asset.py` copies "
                        "them into `mtrain/assets/measured.json`): "
                        + "; ".join(f"`{p}*` ({what})" for p, what in constants.items()) + ".")
    if left_out:
        out += [" ".join(left_out), ""]
    out.append(f"Generated by `python scripts/benchmarks_md.py` (`make benchmarks`) from `{source}`: edit the rows "
               "or the section texts, not this file. Older runs: [docs/benchmarks-history.md]"
               "(docs/benchmarks-history.md).")
    return "\n".join(out) + "\n"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading (the rule of tests/test_docs_links.py)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower().strip()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")
