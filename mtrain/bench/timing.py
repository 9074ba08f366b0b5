"""Timing for every benchmark under `mtrain bench`: one `timed()` (CUDA events on a GPU, the wall clock on a CPU) and
`wall_host_stream()` (what a call costs the host, the GPU from idle, and the GPU queued behind other work).

Torch is imported inside the functions, so `mtrain --help` does not load it.
"""

from __future__ import annotations

import statistics
import time


def cuda_in_use() -> bool:
    """True when CUDA is available and initialised in this process (a CPU run on a GPU machine times by the clock)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def sync() -> None:
    """Wait for the GPU when one is in use; nothing on a CPU."""
    import torch

    if cuda_in_use():
        torch.cuda.synchronize()


def timed(fn, iters: int, warmup: int = 1, *, back_to_back: bool = False, before=None) -> float:
    """Median milliseconds of fn() over `iters` calls after `warmup` untimed calls.

    GPU: each call between two CUDA events, the GPU idle before it (its host launch time counts). back_to_back (GPU
    only): instead the mean of `iters` calls queued one after another, as a training loop runs them with the host
    ahead of the GPU. CPU: each call by the wall clock. before: called ahead of every timed call, outside the
    timing (e.g. a barrier that keeps the ranks of a ring in step)."""
    import torch

    for _ in range(warmup):
        fn()
    cuda = cuda_in_use()
    if cuda and back_to_back:
        if before is not None:
            before()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / iters
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def wall_host_stream(fn, reps: int) -> dict:
    """Medians (ms) over `reps` calls of fn() on CUDA, after one untimed call: "wall" = call to finished GPU work
    from an idle GPU (host launch time included); "host" = until the call returns; "stream" = GPU stream time of
    the call queued behind other GPU work (host-side gaps and synchronisations show up here, launch overhead does
    not)."""
    import torch

    fn()
    torch.cuda.synchronize()
    wall, host, stream = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # GPU work queued ahead of the call: the host runs ahead
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        stream.append(start.elapsed_time(end) / 1e3)
    return {k: 1e3 * statistics.median(v) for k, v in (("wall", wall), ("host", host), ("stream", stream))}
