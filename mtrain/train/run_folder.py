"""The run folder's guards: one trainer per output_dir (a lock), checkpoints that prove they are whole
(files.json: size and sha256 of every file, checked before a resume) and a `latest` marker that cannot leave
OUTPUT_DIR/checkpoints. Resume walks from the marker's checkpoint to older intact ones; an intact one written by
another number of processes or holding another model (meta.json records both) is refused at once, naming the
difference, and never called damaged.
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

from mtrain.atomic import write_json_atomic
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
    write_json_atomic(folder / FILES, listing, indent=1, sort_keys=True)


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


# ---- what a checkpoint was written by: a resume refuses another process count or another model outright (the
# checkpoint is intact; calling it damaged would invite moving it away)
META = "meta.json"
STATE_FILE = re.compile(r"trainer_state_rank(\d+)\.json")
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
"""Model config fields that fix the weights' names and shapes."""


def architecture(config) -> dict:
    """The ARCHITECTURE_KEYS a HF model config sets (recorded in every checkpoint's meta.json)."""
    return {k: getattr(config, k) for k in ARCHITECTURE_KEYS if getattr(config, k, None) is not None}


def read_meta(folder: Path) -> dict:
    """A checkpoint's meta.json ({} when absent or unreadable: loading the checkpoint then tells what is wrong)."""
    try:
        meta = json.loads((Path(folder) / META).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def checkpoint_writers(folder: Path) -> int | None:
    """How many processes wrote a checkpoint: meta.json's `processes`, else (checkpoints from before it was
    recorded) its trainer_state_rankN.json files, one per process, as files.json lists them or the folder holds
    them; None when neither tells."""
    folder = Path(folder)
    recorded = read_meta(folder).get("processes")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
        return recorded
    try:
        names = list(json.loads((folder / FILES).read_text()))
    except (OSError, ValueError, TypeError):
        names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    ranks = {int(m.group(1)) for m in map(STATE_FILE.fullmatch, names) if m}
    return len(ranks) or None


def _processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")


def check_resumable(folder: Path, processes: int, model_architecture: dict, model_key: str) -> None:
    """Refuse, with MtrainError (never DamagedCheckpointError), an intact checkpoint this launch cannot load: one
    written by another number of processes, or holding a model of another architecture than `model_key`'s."""
    new_run = "or start a new run (another train.output_dir)"
    writers = checkpoint_writers(folder)
    if writers is not None and writers != processes:
        raise MtrainError(f"checkpoint {folder} was written by {_processes(writers)}; this run has {processes}: "
                          f"resume with {_processes(writers)}, {new_run}")
    saved = read_meta(folder).get("model")
    if not isinstance(saved, dict):
        return  # written before meta.json recorded it: loading the weights tells (architecture_mismatch)
    differ = [k for k in ARCHITECTURE_KEYS if k in saved and k in model_architecture
              and saved[k] != model_architecture[k]]
    if differ:
        raise MtrainError(
            f"checkpoint {folder} holds a model with {', '.join(f'{k}={saved[k]}' for k in differ)}; this run's "
            f"{model_key} has {', '.join(f'{k}={model_architecture[k]}' for k in differ)}: resume with the model "
            f"the run was started with, {new_run}")


def architecture_mismatch(exc: BaseException) -> str | None:
    """The first difference torch names when a checkpoint's weights do not fit the model (missing or unexpected
    tensors, another shape), or None for any other error (a torn or corrupt file)."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or "Error(s) in loading state_dict" not in text:
        return None
    detail = " ".join(text.split(":", 1)[-1].split())
    return detail[:240] + ("..." if len(detail) > 240 else "")
