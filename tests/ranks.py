"""Gloo ranks for the multi-rank CPU tests, forked from a server that imported torch and mtrain once.

Spawned, each rank imports torch, mtrain's ring and what the first backward pulls in (torch.fx's symbolic shapes,
sympy) itself: ~4 s of CPU a rank, paid again by every test that starts ranks. `run_ranks` forks them instead from
a fork server (multiprocessing's `forkserver`) that preloaded those modules and has run no torch op (no OpenMP pool
to inherit); each rank still sets its own threads and process group.

Two servers, each started on first use and kept for the session: one for compiled Triton (what the ranks of most
tests run: torch kernels, no Triton at all), one started with TRITON_INTERPRET=1 for ranks that run our Triton
kernels in the interpreter (triton.jit reads the variable when a kernel module is imported, so a rank cannot switch
after the server imported them). The servers are this module's own, not multiprocessing's global one.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

# What the servers import before forking: a rank starts with torch, the ring and the estimate loaded (none of these
# imports Triton).
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch.fx.experimental.symbolic_shapes",
           "mtrain.parallel", "mtrain.parallel.estimate", "mtrain.parallel.plan", "mtrain.ops.partial_autograd",
           "mtrain.ops.estimate", "mtrain.ops.recall"]

# The interpreter's server imports Triton and our kernels too (interpreted: it runs with TRITON_INTERPRET=1).
PRELOAD_INTERPRET = PRELOAD + ["triton", "mtrain.ops._triton_attention", "mtrain.ops._triton_estimate",
                               "mtrain.ops._triton_index", "mtrain.ops._triton_merge"]

_SERVERS: dict[bool, object] = {}


def _server(interpret: bool):
    from multiprocessing import forkserver

    if interpret not in _SERVERS:
        server = forkserver.ForkServer()
        server.set_forkserver_preload(PRELOAD_INTERPRET if interpret else PRELOAD)
        saved = os.environ.pop("TRITON_INTERPRET", None)
        if interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            server.ensure_running()  # the server process takes this environment, and its ranks with it
        finally:
            os.environ.pop("TRITON_INTERPRET", None)
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved
        _SERVERS[interpret] = server
    return _SERVERS[interpret]


@contextmanager
def _through(server):
    """multiprocessing's forkserver Popen connects through the module function: point it at `server` meanwhile."""
    from multiprocessing import forkserver

    saved = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = saved


def _entry(rank, fn, env, args):
    os.environ.update(env)
    fn(rank, *args)


def run_ranks(fn, world: int, args: tuple = (), *, interpret: bool = False, env: dict | None = None) -> None:
    """Run `fn(rank, *args)` on `world` processes forked from the server, and wait for them (as `mp.spawn(fn,
    args, nprocs=world, join=True)`; a rank's exception fails the call). `fn` must be importable by name (a
    module-level function of a test module or helper). `env` is set in each rank before `fn` runs: the
    parent's later environment does not reach a forked rank. `interpret`: the ranks run Triton's interpreter."""
    import torch.multiprocessing as mp

    server = _server(interpret)
    with _through(server):
        mp.start_processes(_entry, args=(fn, dict(env or {}), tuple(args)), nprocs=world, join=True,
                           start_method="forkserver")
