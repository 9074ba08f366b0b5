"""Where one training step's time went (`train.profile_step`, or MTRAIN_PROFILE_STEP=N): torch.profiler records step N
on every rank (host and, on a GPU, device activity) and RUN/profile/rankR.txt is written (atomically) at the end of
that step: the step's wall time, the device and host time of each layer's attention call (the `mtrain.attention LNN`
ranges `mtrain.models.attention.profile_range` puts around every call, recomputed forwards included; the path each
layer took is the step's `attention_paths` in metrics.jsonl), and the operators and kernels that took the most device
time and the most host time, the operators run inside the attention calls, and the host's waits for the device
(stream synchronisations, driver allocations) with their callers. A diagnostic: the profiled step runs slower than the
others (the profiler's own cost), so its tokens/s is not a speed figure."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from mtrain.atomic import write_text_atomic
from mtrain.models.attention import PROFILE_LABEL as LABEL

log = logging.getLogger(__name__)

ENV = "MTRAIN_PROFILE_STEP"
TOP = 40


def wanted(config_step: int) -> int:
    """The step to profile (1-based; 0 = none): MTRAIN_PROFILE_STEP if set, else the recipe's train.profile_step."""
    env = os.environ.get(ENV, "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            log.warning("%s=%r is not a step number: no step is profiled", ENV, env)
            return 0
    return max(0, int(config_step or 0))


def _attr(evt, names: tuple[str, ...]) -> float:
    """The first of `names` that a key_averages entry has (torch names device times device_* or, older, cuda_*)."""
    for name in names:
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _device_time(evt) -> float:
    """Microseconds of device time of a key_averages entry, its children's included."""
    return _attr(evt, ("device_time_total", "cuda_time_total"))


def _self_device_time(evt) -> float:
    """Microseconds of device time of a key_averages entry itself."""
    return _attr(evt, ("self_device_time_total", "self_cuda_time_total"))


def inside_attention(events) -> dict[str, list[float]]:
    """Per operator name, [calls, self device us, self host us] of the operators run inside an attention call's range
    (`mtrain.models.attention.profile_range`: the forward and the recomputed forward, its estimate, index building,
    copies and kernels; the backward runs outside the ranges). `events`: `prof.events()`."""
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.name.startswith(LABEL):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(LABEL):
            parent = parent.cpu_parent
        if parent is None:
            continue
        got = totals.setdefault(e.name, [0, 0.0, 0.0])
        got[0] += 1
        got[1] += _self_device_time(e)
        got[2] += float(e.self_cpu_time_total)
    return totals


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc", "cudaFree")
CHAIN = 3  # callers named per wait


def _is_wait(name: str, names: tuple[str, ...]) -> bool:
    return name.startswith(names) or name == "cudaMemcpy"  # (cudaMemcpy without Async waits for the device)


def host_waits(events, names: tuple[str, ...] = WAITS, chain: int = CHAIN) -> dict[tuple[str, str, str], list[float]]:
    """Where the host waited for the device or the allocator went to the driver: per (runtime call, "attention" or
    "outside" the attention calls' ranges, its callers innermost first: up to `chain` operator or range names, e.g.
    "aten::_local_scalar_dense < aten::item < est:1 score"), [calls, host us]. A runtime call matches `names` by
    prefix (CUDA versions add suffixes). Each such call inside an attention range stalls the host until the device
    drains, and the device then idles while the host launches what comes next. `events`: `prof.events()`."""
    totals: dict[tuple[str, str, str], list[float]] = {}
    for e in events:
        if not _is_wait(e.name, names):
            continue
        callers, where, parent = [], "outside", e.cpu_parent
        while parent is not None:
            if parent.name.startswith(LABEL):
                where = "attention"
                break
            if len(callers) < chain:
                callers.append(parent.name)
            parent = parent.cpu_parent
        got = totals.setdefault((e.name, where, " < ".join(callers) or "-"), [0, 0.0])
        got[0] += 1
        got[1] += float(e.cpu_time_total)
    return totals


def _waits_table(totals: dict[tuple[str, str, str], list[float]], top: int) -> list[str]:
    """`host_waits`'s figures as text lines, the most frequent first, with the sums per runtime call and place."""
    if not totals:
        return ["", "host waits and driver allocations (" + ", ".join(WAITS) + "): none recorded"]
    lines = ["", "host waits and driver allocations: runtime call | where | callers (innermost first) | calls | host ms"]
    for (name, where, callers), (calls, host) in sorted(totals.items(), key=lambda kv: kv[1][0], reverse=True)[:top]:
        lines.append(f"{name[:28]:28s} {where:9s} {callers[:110]:110s} {int(calls):6d} {host / 1e3:9.2f}")
    sums: dict[tuple[str, str], list[float]] = {}
    for (name, where, _), (calls, host) in totals.items():
        got = sums.setdefault((name, where), [0, 0.0])
        got[0] += calls
        got[1] += host
    for (name, where), (calls, host) in sorted(sums.items()):
        lines.append(f"{name[:28]:28s} {where:9s} {'every caller':110s} {int(calls):6d} {host / 1e3:9.2f}")
    return lines


def _inside_table(totals: dict[str, list[float]], device: bool, top: int) -> list[str]:
    """`inside_attention`'s figures as text lines: the entries with the most self device time (host time without a
    device), with the sums over every entry."""
    if not totals:
        return []
    rank = 1 if device else 2
    lines = ["", f"inside the attention calls (forward, recomputed forward), by self {'device' if device else 'host'} "
             f"time: name | calls | self device ms | self host ms"]
    for name, (calls, dev, host) in sorted(totals.items(), key=lambda kv: kv[1][rank], reverse=True)[:top]:
        lines.append(f"{name[:90]:90s} {int(calls):6d} {dev / 1e3:10.2f} {host / 1e3:10.2f}")
    calls, dev, host = (sum(v[i] for v in totals.values()) for i in range(3))
    lines.append(f"{'every entry inside':90s} {int(calls):6d} {dev / 1e3:10.2f} {host / 1e3:10.2f}")
    return lines


def summarise(averages, wall_s: float, top: int = TOP, events=None) -> str:
    """The profile's text: per attention label (by layer) host and device ms; then the entries with the
    most self device time and the most host time; with `events` (`prof.events()`), the operators inside the
    attention calls (`inside_attention`) and where the host waited for the device (`host_waits`). `averages`: `prof.key_averages()`."""
    rows = list(averages)
    lines = [f"# step wall time {wall_s * 1e3:.1f} ms"]
    total_device = sum(_self_device_time(e) for e in rows) / 1e3
    lines.append(f"# device time of every kernel, summed: {total_device:.1f} ms")
    att = [e for e in rows if e.key.startswith(LABEL)]
    host_all = dev_all = 0.0
    if att:
        lines.append("")
        lines.append("attention calls (forward and recomputed forward; the backward's kernels are in the tables below)")
        lines.append(f"{'label':34s} {'calls':>5s} {'host ms':>10s} {'device ms':>10s}")
        for e in sorted(att, key=lambda e: e.key):
            host, dev = e.cpu_time_total / 1e3, _device_time(e) / 1e3
            lines.append(f"{e.key:34s} {e.count:5d} {host:10.1f} {dev:10.1f}")
            host_all += host
            dev_all += dev
        lines.append(f"{'every layer':34s} {sum(e.count for e in att):5d} {host_all:10.1f} {dev_all:10.1f}")
    tables = [("most self host time", lambda e: float(e.self_cpu_time_total))]
    if total_device > 0:  # a device was recorded (on a GPU)
        tables.insert(0, ("most self device time", _self_device_time))
    for title, key in tables:
        lines.append("")
        lines.append(f"{title}: name | calls | self device ms | self host ms")
        for e in sorted((e for e in rows if not e.key.startswith(LABEL)), key=key, reverse=True)[:top]:
            lines.append(f"{e.key[:90]:90s} {e.count:6d} {_self_device_time(e) / 1e3:10.2f} "
                         f"{e.self_cpu_time_total / 1e3:10.2f}")
    if events is not None:
        lines += _inside_table(inside_attention(events), total_device > 0, top)
        lines += _waits_table(host_waits(events), top)
    return "\n".join(lines) + "\n"


class StepProfile:
    """`start()` before the step, `finish()` after it (writes RUN/profile/rankR.txt). Host activity always, the
    device's where CUDA is available."""

    def __init__(self, out_dir: Path, rank: int, step: int):
        self.path = Path(out_dir) / "profile" / f"rank{rank}.txt"
        self.step = step
        self.prof = None
        self.t0 = 0.0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def finish(self, reason: str = "") -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            prof.__exit__(None, None, None)
            text = f"# step {self.step}{'; ' + reason if reason else ''}\n" + summarise(
                prof.key_averages(), wall, events=prof.events())
            write_text_atomic(self.path, text)
            log.info("step %d profile written to %s", self.step, self.path)
        except Exception as exc:  # a diagnostic must not hide the run's own error
            log.warning("step %d profile not written: %s", self.step, exc)
