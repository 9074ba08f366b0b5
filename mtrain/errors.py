"""User-facing errors: the CLI prints these as one line and exits nonzero (traceback with --debug)."""

import contextlib
import errno
import os
import re
import shutil


class MtrainError(Exception):
    """A problem the user can fix (bad config, missing file, wrong shape). The message says what and how."""


class ConfigError(MtrainError, ValueError):
    """A recipe or override that does not validate; the message names the key."""


class DamagedCheckpointError(MtrainError):
    """A training checkpoint that cannot be read back (truncated, corrupt, or holding code instead of data)."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is a GPU allocation failure: torch's OutOfMemoryError, or the plain RuntimeError that cuBLAS and
    DeepSpeed raise for one."""
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


_OS_HINTS = {
    errno.ENOSPC: "free space on that disk or point the output elsewhere",
    errno.EDQUOT: "free space within your quota or point the output elsewhere",
    errno.EROFS: "the file system is read-only: choose a writable folder",
    errno.EACCES: "you lack permission there: fix its permissions or choose another folder",
    errno.EPERM: "you lack permission there: fix its permissions or choose another folder",
    errno.ENOTDIR: "a file stands where a folder is needed: move it away or choose another path",
    errno.EISDIR: "a folder stands where a file is needed: choose another path",
    errno.EEXIST: "something already exists at that path: remove it or choose another path",
    errno.ENOENT: "check the path (relative paths are taken from the current directory)",
}


_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes this user may still write on the file system holding `path` (or its nearest existing folder)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def out_of_space(exc: OSError, path: str | os.PathLike) -> str | None:
    """How a write of `path` ran out of room ("" for ENOSPC, "Disk quota exceeded", "N of M bytes written"), or
    None when `exc` is another error. numpy reports a short write without an errno ("M requested and N written"):
    it counts when the disk holds less than the rest (check it before the half-written file is removed)."""
    if exc.errno == errno.ENOSPC:
        return ""
    if exc.errno == errno.EDQUOT:
        return exc.strerror or os.strerror(exc.errno)
    short = _SHORT_WRITE.search(str(exc)) if exc.errno is None else None
    if short is None:
        return None
    wanted, written = int(short[1]), int(short[2])
    free = free_bytes(path)
    if free is None or free >= wanted - written:
        return None
    return f"{written} of {wanted} bytes written"


@contextlib.contextmanager
def writing(path: str | os.PathLike, fix: str, doing: str = ""):
    """Run a write of `path`. A full disk (or quota) becomes one MtrainError naming the file, "no space left on
    device", the room left and `fix`; any other OS error is re-raised with `path` as its file name if it has none."""
    try:
        yield
    except OSError as exc:
        how = out_of_space(exc, path)
        if how is not None:
            free = free_bytes(path)
            detail = "; ".join(d for d in (how, f"{free / 2**20:.1f} MiB free there" if free is not None else "") if d)
            what = f" while {doing}" if doing else ""
            raise MtrainError(f"{path}: no space left on device{what} ({detail}); {fix}") from None
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise


def os_error_line(exc: OSError, doing: str = "") -> str:
    """One line for an OS error: what failed, on which path, and what to do about it."""
    path = exc.filename if exc.filename is not None else "?"
    if exc.filename2 is not None:
        path = f"{path} -> {exc.filename2}"
    reason = exc.strerror or str(exc)
    hint = _OS_HINTS.get(exc.errno, "check the path and the disk")
    what = f" while {doing}" if doing else ""
    return f"{path}: {reason}{what}; {hint}"
