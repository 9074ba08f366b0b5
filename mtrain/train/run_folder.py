"""The run folder's guards: one trainer per output_dir (a lock), checkpoints that prove they are whole
(files.json: size and sha256 of every file, checked before a resume) and a `latest` marker that cannot leave
OUTPUT_DIR/checkpoints. Resume walks from the marker's checkpoint to older intact ones.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
from pathlib import Path

from mtrain.errors import DamagedCheckpointError, MtrainError

log = logging.getLogger(__name__)

LOCK = ".mtrain.lock"
FILES = "files.json"
LATEST = "latest"
CHECKPOINT_NAME = re.compile(r"step-\d{7,}")


class RunLock:
    """An exclusive, non-blocking lock on OUTPUT_DIR/.mtrain.lock for the life of this process.

    The kernel drops it when the process dies (kill -9 included), so a stale lock never blocks a rerun.
    """

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK
        self._fh = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a+")
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._fh.close()
            self._fh = None
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise MtrainError(
                    f"{self.path.parent} is in use by another `mtrain train` (it holds {self.path}); wait for it "
                    "to finish or choose another train.output_dir"
                ) from None
            raise
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(f"{os.getpid()}\n")
        self._fh.flush()
        return self

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != FILES)


def write_file_list(folder: Path) -> None:
    """Record the size and sha256 of every file in a finished checkpoint folder (before it is renamed in)."""
    listing = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _files(folder)}
    tmp = folder / (FILES + ".tmp")
    tmp.write_text(json.dumps(listing, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, folder / FILES)


def verify_file_list(folder: Path) -> None:
    """Raise DamagedCheckpointError naming the first file that is missing, truncated or changed.

    Checkpoints written before files.json existed are not checked here (loading them still is).
    """
    listing_path = folder / FILES
    if not listing_path.exists():
        return
    try:
        listing = json.loads(listing_path.read_text())
    except (OSError, ValueError) as exc:
        raise DamagedCheckpointError(f"{listing_path}: unreadable ({exc})") from None
    for name, want in sorted(listing.items()):
        path = folder / name
        if not path.is_file():
            raise DamagedCheckpointError(f"{path}: missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise DamagedCheckpointError(f"{path}: truncated or changed ({size} bytes, {FILES} says {want['bytes']})")
        if _sha256(path) != want["sha256"]:
            raise DamagedCheckpointError(f"{path}: corrupt (sha256 does not match {FILES})")


def checkpoint_candidates(root: Path) -> list[Path]:
    """Checkpoints to try for a resume, newest first: the one `latest` names, then older ones.

    The marker must name a checkpoint folder directly inside `root` (no path, no `..`, no link out).
    """
    marker = root / LATEST
    if not marker.exists():
        return []
    name = marker.read_text().strip()
    if not CHECKPOINT_NAME.fullmatch(name):
        raise MtrainError(
            f"{marker} names {name!r}, which is not a checkpoint folder of this run (step-NNNNNNN); "
            f"fix or delete the marker"
        )
    chosen = root / name
    if chosen.is_symlink() or chosen.resolve().parent != root.resolve():
        raise MtrainError(f"{marker} leads to {chosen.resolve()}, outside {root}; delete the marker and that link")
    if not chosen.is_dir():
        raise MtrainError(f"checkpoint marker {marker} points at missing folder {chosen}; delete the marker to start over")
    older = sorted((p for p in root.iterdir() if CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir()
                    and not p.is_symlink() and p.name < name), reverse=True)
    return [chosen, *older]
