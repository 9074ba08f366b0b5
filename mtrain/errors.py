"""User-facing errors: the CLI prints these as one line and exits nonzero (traceback with --debug)."""

import errno


class MtrainError(Exception):
    """A problem the user can fix (bad config, missing file, wrong shape). The message says what and how."""


class ConfigError(MtrainError, ValueError):
    """A recipe or override that does not validate; the message names the key."""


class DamagedCheckpointError(MtrainError):
    """A training checkpoint that cannot be read back (truncated, corrupt, or holding code instead of data)."""


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


def os_error_line(exc: OSError, doing: str = "") -> str:
    """One line for an OS error: what failed, on which path, and what to do about it."""
    path = exc.filename if exc.filename is not None else "?"
    if exc.filename2 is not None:
        path = f"{path} -> {exc.filename2}"
    reason = exc.strerror or str(exc)
    hint = _OS_HINTS.get(exc.errno, "check the path and the disk")
    what = f" while {doing}" if doing else ""
    return f"{path}: {reason}{what}; {hint}"
