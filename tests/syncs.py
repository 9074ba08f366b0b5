"""Counting host synchronisations on the CPU: the ops whose result a GPU's host would have to wait for (a value read
back, a data-dependent size), by the mtrain line that called them, through a dispatch mode. tolist() does not
dispatch on the CPU: `count_tolist` counts it."""

import collections
import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result the host must wait for on a GPU (a data-dependent size or a value read back).
SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
           "aten.unique_dim.default", "aten._unique2.default", "aten.unique_consecutive.default",
           "aten.bincount.default", "aten.repeat_interleave.Tensor"}


def site() -> str:
    """The innermost mtrain frame of the current stack, as path:line function."""
    for frame in reversed(traceback.extract_stack()):
        if "/mtrain/" in frame.filename:
            return f"{frame.filename.split('/mtrain/')[-1]}:{frame.lineno} {frame.name}"
    return "?"


class CountSyncs(TorchDispatchMode):
    """Counts the syncing ops by the mtrain line that called them (`sites`)."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        hit = name in SYNCING
        if name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"):
            hit = any(t is not None and t.dtype == torch.bool for t in args[1])
        if hit:
            self.sites[f"{name} {site()}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_tolist():
    """Yields a list that collects the mtrain call site of every Tensor.tolist() made inside."""
    reads, tolist = [], torch.Tensor.tolist

    def counted(self, *a, **kw):
        reads.append(site())
        return tolist(self, *a, **kw)

    torch.Tensor.tolist = counted
    try:
        yield reads
    finally:
        torch.Tensor.tolist = tolist
