"""The predictions file format: OUT/predictions/<task>.jsonl, one flushed JSON record per sample, append-only.

The runner writes these files and the scorer reads them; both import this module (neither imports the other
for it). A record holds at least `task`, `length` and `index`; a torn last line (a run killed mid-write) is
not a record: readers skip it and the runner cuts it before appending.
"""

from __future__ import annotations

import json
import os

from mtrain.errors import MtrainError

PREDICTIONS = "predictions"


def predictions_path(out_dir: str, task: str) -> str:
    return os.path.join(out_dir, PREDICTIONS, task.replace("/", "__") + ".jsonl")


def read_records(path: str) -> list[dict]:
    """Complete records of a predictions file; a torn last line (killed mid-write) is ignored."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                continue
            try:
                record = json.loads(line)
                record["task"], record["length"], record["index"]
            except (ValueError, KeyError, TypeError) as exc:
                raise MtrainError(
                    f"{path}:{number}: damaged prediction record ({type(exc).__name__}: {exc}); delete that line "
                    "(its sample is rerun on resume) or the file"
                ) from None
            records.append(record)
    return records


def drop_torn_tail(path: str) -> None:
    """Cut a partial last line so the next append starts on a fresh line."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)


def append_records(path: str, records: list[dict]) -> None:
    """Append records, one JSON line each, flushed and synced before returning (a kill loses no written line)."""
    with open(path, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
