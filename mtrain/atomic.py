"""Atomic file writes: the content goes to a temporary file beside the target, then one rename puts it in place, so
a reader (or a run resumed after a kill) sees the old file or the new one, never a half-written one."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yields a temporary path beside `path` (its folder made if missing) for the caller to write; on a clean exit it
    is renamed onto `path`, on an error it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (`atomic_path`); returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj, **dump_kw) -> Path:
    """Write `obj` as JSON (json.dump keywords in `dump_kw`, a newline after it) to `path` atomically."""
    return write_text_atomic(path, json.dumps(obj, **dump_kw) + "\n")
