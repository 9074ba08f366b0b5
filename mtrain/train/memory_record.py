"""Where GPU memory went in a step (`train.memory_record`, or MTRAIN_MEMORY_RECORD=1): the CUDA caching allocator
records its history (torch.cuda.memory._record_memory_history) during the first step; at the end of that step, or
when it runs out of memory, the allocations live at the step's peak are replayed from the snapshot's trace and
written, grouped by the code that made them, largest first, to RUN/memory/rankN.txt (atomically). A GPU-only tool:
it does nothing without CUDA."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from pathlib import Path

import torch

from mtrain.atomic import write_text_atomic

log = logging.getLogger(__name__)

ENV = "MTRAIN_MEMORY_RECORD"
MAX_ENTRIES = 200_000
"""Allocator events kept (a ring buffer); a step of a 36-layer model at 256K tokens makes some tens of thousands."""
FREE = ("free_requested", "free_completed")


def wanted(config_flag: bool) -> bool:
    return bool(config_flag) or os.environ.get(ENV, "") not in ("", "0")


def _site(frames: list, depth: int = 3) -> str:
    """The allocation's call site: the innermost frames outside torch's own files (`depth` of them), innermost
    first; the innermost frame when every frame is torch's."""
    def outside(f) -> bool:
        name = f.get("filename", "")
        return "/torch/" not in name and not name.startswith("<") and "/site-packages/torch" not in name

    own = [f for f in frames if outside(f)][:depth] or frames[:1]
    return " < ".join(f"{_short(f.get('filename', '?'))}:{f.get('line', '?')} {f.get('name', '?')}" for f in own)


def _short(path: str) -> str:
    for marker in ("/mtrain/", "/transformers/", "/deepspeed/", "/accelerate/", "/torch/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return os.path.basename(path)


def peak_blocks(snapshot: dict, device: int = 0) -> tuple[int, list[dict], dict]:
    """(bytes live at the peak, the blocks live then [{size, frames}], facts) of one device, from a
    `torch.cuda.memory._snapshot()`: the blocks allocated at the snapshot, walked back through the device's trace
    (undo each allocation, restore each free) to the moment the most bytes were allocated within the trace."""
    live = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        addr = seg.get("address", 0)
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                live[addr] = (block["size"], block.get("frames", []))
            addr += block["size"]
    traces = snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    total = sum(size for size, _ in live.values())
    best, best_at = total, len(trace)
    frees = set()  # the event that ends each block's life: its last free event (completed, else requested)
    for i in range(len(trace) - 1, -1, -1):  # state before event i
        ev = trace[i]
        action, addr = ev.get("action"), ev.get("addr")
        if action == "alloc" and addr in live:
            total -= live.pop(addr)[0]
        elif action in FREE and addr not in live:
            live[addr] = (ev.get("size", 0), ev.get("frames", []))
            total += ev.get("size", 0)
            frees.add(i)
        if total > best:
            best, best_at = total, i
    # replay forward to the peak (the state before event best_at), with the same free events
    for i, ev in enumerate(trace[:best_at]):
        action, addr = ev.get("action"), ev.get("addr")
        if action == "alloc":
            live[addr] = (ev.get("size", 0), ev.get("frames", []))
        elif i in frees:
            live.pop(addr, None)
    oom = [ev for ev in trace if ev.get("action") == "oom"]
    facts = {"events": len(trace), "peak_event": best_at, "oom": bool(oom),
             "oom_request": oom[-1].get("size") if oom else None}
    return sum(s for s, _ in live.values()), [{"size": s, "frames": f} for s, f in live.values()], facts


def summarise(snapshot: dict, device: int = 0, top: int = 30) -> str:
    """Text: the bytes live at the peak grouped by allocation site, largest first."""
    peak, blocks, facts = peak_blocks(snapshot, device)
    sites = defaultdict(lambda: [0, 0])
    for b in blocks:
        entry = sites[_site(b["frames"])]
        entry[0] += b["size"]
        entry[1] += 1
    gib = float(1 << 30)
    lines = [f"peak within the recorded trace: {peak / gib:.2f} GiB in {len(blocks)} blocks "
             f"(event {facts['peak_event']} of {facts['events']}"
             + (f"; out of memory asking for {facts['oom_request'] / gib:.2f} GiB" if facts["oom"] else "") + ")",
             f"{'GiB':>8} {'blocks':>7}  site (innermost first)"]
    for site, (size, count) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / gib:8.3f} {count:7d}  {site}")
    rest = sorted(sites.values(), key=lambda v: -v[0])[top:]
    if rest:
        lines.append(f"{sum(v[0] for v in rest) / gib:8.3f} {sum(v[1] for v in rest):7d}  ({len(rest)} other sites)")
    return "\n".join(lines) + "\n"


class MemoryRecord:
    """Start recording now; `finish(reason)` writes the summary and stops. Does nothing without CUDA."""

    def __init__(self, out_dir: Path, rank: int):
        self.path = Path(out_dir) / "memory" / f"rank{rank}.txt"
        self.active = False
        if not torch.cuda.is_available():
            return
        try:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
        except TypeError:  # an older signature
            torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=MAX_ENTRIES)
        self.active = True

    def finish(self, reason: str) -> None:
        if not self.active:
            return
        self.active = False
        try:
            snapshot = torch.cuda.memory._snapshot()
            text = f"# {reason}; torch.cuda.max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB\n"
            text += summarise(snapshot, torch.cuda.current_device())
            write_text_atomic(self.path, text)
            log.info("memory record (%s) written to %s", reason, self.path)
        except Exception as exc:  # a diagnostic must not hide the run's own error
            log.warning("memory record (%s) not written: %s", reason, exc)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
