"""One rank of a simulated CP ring on one device: what index building costs that rank before and after per-rank
rows (issue #17). The same lines (what the estimator hands every rank) are built two ways, each in its own
process so peak memory is that build's alone:

  global: `SparseIndex.from_lines` of the whole index, then `sparse_plan` keeps the rank's rows (what every rank
          did before), plus the logging it paid per layer: `density()` of the whole lists and `imbalance()`;
  rank:   `rows_from_lines` of the rank's own query blocks, then `sparse_plan`, plus `density()` from the lines
          and the rank's row of the imbalance (`rank_work`).

It also prints the rank's side-traffic bytes per layer from its real plan (`plan_traffic`), before (all-reduce)
and after (all-gather + reduce-scatter). The lines are synthetic: per head `--verticals` random columns and a
local window of `--window` tokens plus `--far` random far slashes (the estimator's caps bound real ones).

    python -m tools.bench_rank_index --seq 524288 1048576 --cp 32 128 --heads 16 --verticals 1024
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from mtrain.bench.synthetic import window_slash_lines


def lines(seq: int, heads: int, verticals: int, window: int, far: int, seed: int = 0):
    """The synthetic lines (`mtrain.bench.synthetic.window_slash_lines`), the window in 64-token steps."""
    return window_slash_lines(seq, heads, window=window, far=far, verticals=verticals, seed=seed + seq, window_step=64)


def _peak_mb(device: str = "cpu") -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(args) -> dict:
    """One build (args.mode) for one rank, in this process: times (min of --repeat) and the peak RSS above the
    inputs."""
    from mtrain.ops import SparseIndex
    from mtrain.ops.index import rows_from_lines
    from mtrain.parallel import Layout, imbalance
    from mtrain.parallel.estimate import rank_rows
    from mtrain.parallel.imbalance import rank_work
    from mtrain.parallel.plan import sparse_plan
    from mtrain.parallel.ring_flat import column_origin
    from mtrain.parallel.traffic import plan_traffic

    torch.set_num_threads(args.threads)
    seq, cp, rank, bs = args.one_seq, args.one_cp, args.rank, args.block_size
    dev = args.device
    vertical, slash = (t.to(dev) for t in lines(seq, args.heads, args.verticals, args.window, args.far))
    layout = Layout.create("block-stripe", world_size=cp, granularity=bs)
    positions = layout.indices(seq, rank).to(dev)
    cpu = torch.device(dev)
    base = _peak_mb(dev)
    best = {}
    for _ in range(args.repeat):
        _sync(dev)
        t0 = time.perf_counter()
        if args.mode == "global":
            index = SparseIndex.from_lines(vertical, slash, seq, bs)
        else:
            index = rows_from_lines(vertical, slash, seq, bs, rank_rows(positions, bs))
        _sync(dev)
        t1 = time.perf_counter()
        plan = sparse_plan(index, layout, rank, cpu, column_origin(rank, cp))
        _sync(dev)
        t2 = time.perf_counter()
        density = index.density()
        t3 = time.perf_counter()
        if args.mode == "global":
            imbalance(index, layout)
        else:
            rank_work(index, layout, rank)
        t4 = time.perf_counter()
        for key, value in (("build_s", t1 - t0), ("plan_s", t2 - t1), ("density_s", t3 - t2), ("imbalance_s", t4 - t3)):
            best[key] = min(best.get(key, float("inf")), value)
        del index
    traffic = plan_traffic(plan, q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=bs,
                           vertical_cap=args.vertical_cap)
    return {"seq": seq, "cp": cp, "rank": rank, "mode": args.mode, **best, "density": density,
            "peak_mb": _peak_mb(dev) - base, "traffic": traffic.as_dict(), "threads": args.threads, "device": dev}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[524288, 1048576])
    p.add_argument("--cp", type=int, nargs="+", default=[32, 128])
    p.add_argument("--rank", type=int, default=1, help="the simulated rank")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--verticals", type=int, default=1024)
    p.add_argument("--window", type=int, default=1024, help="local window in tokens (slashes every 64)")
    p.add_argument("--far", type=int, default=48, help="far slashes per head")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vertical-cap", type=int, default=4096, help="the estimator's max_vertical (its candidates)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=["global", "rank"])
    p.add_argument("--device", default="cpu", help="cpu, or cuda (global = the GPU index builder; peak = CUDA "
                   "memory allocated above the inputs)")
    p.add_argument("--json", default=None)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # one measurement (child process)
    p.add_argument("--one-seq", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--one-cp", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(measure(args)))
        return
    rows = []
    for seq in args.seq:
        for cp in args.cp:
            for mode in args.modes:
                cmd = [sys.executable, "-m", "tools.bench_rank_index", "--mode", mode, "--one-seq", str(seq), "--one-cp", str(cp)]
                for flag in ("rank", "heads", "kv_heads", "head_dim", "verticals", "window", "far", "block_size",
                             "vertical_cap", "repeat", "threads", "device"):
                    cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
                if out.returncode:
                    print(f"{seq} CP={cp} {mode}: failed: {out.stderr.strip().splitlines()[-1:]}")
                    continue
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                t = row["traffic"]
                print(f"{seq:>8} CP={cp:<4} {mode:<6} build {row['build_s'] * 1e3:9.1f} ms  plan {row['plan_s'] * 1e3:8.1f} ms"
                      f"  density {row['density_s'] * 1e3:8.1f} ms  imbalance {row['imbalance_s'] * 1e3:8.1f} ms"
                      f"  peak {row['peak_mb']:8.0f} MB  columns U={t['columns']} P={t['per_rank']}"
                      f"  col bytes before {t['columns_before'] / 2**20:7.2f} MiB after {t['columns_after'] / 2**20:7.2f} MiB"
                      f"  estimate {t['estimate'] / 2**20:7.2f} MiB  ring KV {t['ring_kv'] / 2**20:8.1f} MiB", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
