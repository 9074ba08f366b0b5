"""Where the pattern estimator spends its time on a GPU: per stage (the `record_function` labels inside
`estimate_vertical_slash`), per kernel, the host-side enqueue time against the GPU time, and every host
synchronisation (with the line that caused it).

    python -m tools.profile_estimate --seqs 32768 131072 [--heads 9 3 64] [--block-size 128] [--engine fa4]

It also times the estimate as model layers run it: replayed from a CUDA graph (`estimate_graphed`), alone and with
the engine's plans built in the same graph (`prepare=`), copies of the outputs included.

A run whose enqueue time is close to its GPU time is launch-bound: fewer, larger kernels help; a run whose
GPU time dominates needs faster kernels. Inputs: the benchmark's planted vertical-slash q/k (`mtrain.bench.synthetic.make_inputs`).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
import warnings

import torch


from mtrain.bench.synthetic import make_inputs

from mtrain.ops import estimate_vertical_slash
from mtrain.ops.graphed import estimate_graphed, prepare_engine


def gpu_ms(fn, iters=5):
    fn()
    torch.cuda.synchronize()
    times, enq = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        enq.append((time.perf_counter() - t0) * 1e3)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2], sorted(enq)[len(enq) // 2]


def syncs(fn):
    """Host synchronisations fn() makes: {(file:line of the mtrain frame, op): count}."""
    found = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        for w in caught:
            if "synchroniz" not in str(w.message):
                continue
            found[(f"{os.path.basename(w.filename)}:{w.lineno}", str(w.message)[:60])] += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--recall", type=float, default=0.99)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--rows", type=int, default=30, help="rows of the kernel table")
    ap.add_argument("--engine", choices=("triton", "fa4"), default="triton",
                    help="whose plans are built after the estimate (fa4: FA4's lists and the column path's plans)")
    args = ap.parse_args()
    Hq, Hkv, D = args.heads
    for S in args.seqs:
        q, k, _ = make_inputs(S, Hq=Hq, Hkv=Hkv, D=D)

        def est():
            return estimate_vertical_slash(q, k, recall=args.recall, block_size=args.block_size)

        prep = (args.engine, Hkv, D)

        def est_build():
            idx = est()
            with torch.profiler.record_function("est:7 prepare"):
                prepare_engine(idx, prep)
            return idx

        def graphed(prepare):
            return lambda: estimate_graphed(q, k, recall=args.recall, block_size=args.block_size, prepare=prepare)

        idx = est()
        g, e = gpu_ms(est)
        g2, e2 = gpu_ms(est_build)
        print(f"\n=== S={S} Hq={Hq} Hkv={Hkv} D={D} bs={args.block_size}: density {idx.density():.3f}, "
              f"verticals {int((idx.col_counts > 0).sum())} rows with columns; estimate GPU {g:.2f} ms "
              f"(enqueue {e:.2f} ms on the host); with the {args.engine} plans GPU {g2:.2f} ms (enqueue {e2:.2f})",
              flush=True)
        for prepare in (None, prep):
            fn = graphed(prepare)
            for _ in range(3):  # warm, capture + check, replay
                fn()
            gg, ee = gpu_ms(fn)
            print(f"CUDA graph replay{'' if prepare is None else ' with the ' + args.engine + ' plans'}: "
                  f"GPU {gg:.2f} ms (enqueue {ee:.2f} ms)", flush=True)
        found = syncs(est_build)
        print(f"host synchronisations per call: {sum(found.values())}")
        for (where, msg), c in found.most_common():
            print(f"  {c:3d}x {where}  {msg}")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            est_build()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        stages = [e for e in ka if e.key.startswith("est:")]
        print("stages (record_function): name | host ms | GPU ms")
        for ev in sorted(stages, key=lambda e: e.key):
            print(f"  {ev.key:28s} {ev.cpu_time_total / 1e3:8.2f} {ev.device_time_total / 1e3:8.2f}")
        n_launch = sum(ev.count for ev in ka if ev.device_type == torch.autograd.DeviceType.CUDA)
        print(f"GPU kernels launched: {n_launch}")
        print(ka.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=50))
        del q, k
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
