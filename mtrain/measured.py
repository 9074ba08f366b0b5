"""The measured figures the code computes with: the planner's measured runs (`mtrain.planner.MEASURED`,
`OUT_OF_SAMPLE`) and the cost model's fitted coefficients (`mtrain.ops.cost.H200`, `CPU`).

They are result rows of `benchmarks/results.jsonl` like every other benchmark figure; `python scripts/measured_asset.py`
(`make benchmarks`) copies the current ones the code needs into `mtrain/assets/measured.json`, which ships with the
package and is read here at import. A row changed without regenerating the asset fails
tests/test_measured_asset.py. Torch-free.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

from mtrain.errors import MtrainError

ASSET = Path(__file__).resolve().parent / "assets" / "measured.json"
REGENERATE = "python scripts/measured_asset.py"


class MeasuredAssetError(MtrainError):
    """The measured-figures asset is missing, malformed or lacks a figure the code needs; the message names the file
    and how to regenerate it."""


def asset_error(why: str, path: str | os.PathLike = ASSET) -> MeasuredAssetError:
    """The error for an asset at `path` that does not hold what the code needs (`why`), saying how to regenerate it."""
    return MeasuredAssetError(f"{path}: {why}; regenerate it from benchmarks/results.jsonl with `{REGENERATE}` "
                              "(or reinstall mtrain)")


@functools.lru_cache(maxsize=4)
def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise asset_error("missing", path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise asset_error(f"unreadable ({exc})", path) from None
    except json.JSONDecodeError as exc:
        raise asset_error(f"not JSON ({exc.msg} at line {exc.lineno})", path) from None
    figures = doc.get("figures") if isinstance(doc, dict) else None
    if not isinstance(figures, dict) or not figures:
        raise asset_error("not a measured-figures asset (no 'figures' object)", path)
    out = {}
    for measure, entry in figures.items():
        value = entry.get("value") if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise asset_error(f"figure {measure!r} has no finite 'value' (got {entry!r})", path)
        out[measure] = value
    return out


def load(path: str | os.PathLike = ASSET) -> dict:
    """{measure id: value} of the asset at `path` (read once per path); MeasuredAssetError where it is missing or
    malformed. The caller gets its own copy."""
    return dict(_load(str(path)))


def figure(figures: dict, measure: str, path: str | os.PathLike = ASSET):
    """The value of `measure` in `figures` (from `load(path)`); MeasuredAssetError naming the file where it lacks it."""
    if measure not in figures:
        raise asset_error(f"no figure {measure!r}", path)
    return figures[measure]


def under(figures: dict, prefix: str) -> dict:
    """{the rest of the id: value} of the figures whose id starts with `prefix`."""
    return {m[len(prefix):]: v for m, v in figures.items() if m.startswith(prefix)}
