"""DeepSpeed's CPU ops (the shared-memory collectives, CPU Adam) are compiled on first use by torch's extension
builder, which holds a `lock` file in the op's build folder while it compiles. A build killed midway (Ctrl-C, a
timeout) leaves that file behind, and every later start that loads the op, `make setup`, `make train` and the
tests, then waits on it forever without a word. `clear_stale_locks` removes such a lock, one that neither it nor
anything else in its folder has changed for `STALE_S` seconds (a live build writes its objects as it goes), and says
which file it removed.

  python -m mtrain.train.extensions     # what `make setup` runs before it builds the ops
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

OPS = ("deepspeed_shm_comm", "cpu_adam")
"""The build folders of the DeepSpeed ops mtrain loads on a CPU."""
STALE_S = 600.0
"""A lock older than this, in a folder where nothing changed for as long, belongs to a build that died."""


def build_dir(name: str) -> str:
    """The folder torch's extension builder compiles op `name` in (as `torch.utils.cpp_extension` names it:
    TORCH_EXTENSIONS_DIR, else its default root and a folder per Python and accelerator), without creating it."""
    import sys

    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return os.path.join(root, name)


def clear_stale_locks(ops=OPS, stale_s: float = STALE_S, now: float | None = None) -> list[str]:
    """Remove the build lock of each op in `ops` whose folder has not changed for `stale_s` seconds; returns the
    removed paths (each also logged as a warning)."""
    now = time.time() if now is None else now
    removed = []
    for name in ops:
        folder = build_dir(name)
        lock = os.path.join(folder, "lock")
        try:
            newest = max(os.path.getmtime(os.path.join(folder, f)) for f in os.listdir(folder))
        except (FileNotFoundError, ValueError):  # no folder, or an empty one
            continue
        if not os.path.exists(lock) or now - newest < stale_s:
            continue
        try:
            os.remove(lock)
        except FileNotFoundError:  # another rank removed it first
            continue
        log.warning("removed %s: a build of %s stopped %.0f min ago left it, and every start would wait on it",
                    lock, name, (now - newest) / 60)
        removed.append(lock)
    return removed


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for path in clear_stale_locks():
        print(f"removed stale build lock {path}")
