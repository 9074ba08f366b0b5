"""Ring attention forward + backward on CPU gloo ranks (PyTorch paths, fp32): the CPU row of `mtrain bench plan
--check`. Dense on zigzag, sparse on block-stripe with a given index (local window + far slashes + verticals).

    python -m tools.bench_ring_cpu --world 2 --tokens 8192 --heads 4 --kv-heads 2 --dim 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, args, init, out):
    from mtrain.bench.synthetic import window_slash_lines
    from mtrain.ops import SparseIndex
    from mtrain.parallel import Layout, ring_attention

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=args.world)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    S, bs = args.tokens, args.block_size
    q, dout = (torch.randn(1, S, args.heads, args.dim, generator=g) for _ in range(2))
    k, v = (torch.randn(1, S, args.kv_heads, args.dim, generator=g) for _ in range(2))
    # one pattern for every head: the window in block steps, far slashes anywhere below S
    vertical, slash = window_slash_lines(S, 1, window=args.window, far=args.far, verticals=args.verticals, seed=0,
                                         window_step=bs, far_high=S)
    index = SparseIndex.from_lines(vertical.expand(1, args.heads, -1), slash.expand(1, args.heads, -1), S, bs)
    rows = {}
    for mode, layout_name in (("dense", "zigzag"), ("sparse", "block-stripe")):
        layout = Layout.create(layout_name, world_size=args.world, granularity=bs)
        shards = [layout.shard(t, rank) for t in (q, k, v, dout)]
        times = []
        for it in range(args.iters + 1):
            inputs = [t.clone().requires_grad_(True) for t in shards[:3]]
            dist.barrier()
            t0 = time.perf_counter()
            result = ring_attention(*inputs, group=None, layout=layout, index=index if mode == "sparse" else None)
            result.backward(shards[3])
            dist.barrier()
            if it:  # the first call builds and caches the plan
                times.append((time.perf_counter() - t0) * 1e3)
        rows[mode] = statistics.median(times)
    rows["density"] = index.density()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--far", type=int, default=8)
    p.add_argument("--verticals", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.json"
        mp.spawn(_worker, args=(args, f"{tmp}/init", out), nprocs=args.world, join=True)
        rows = json.loads(Path(out).read_text())
    print(json.dumps({**vars(args), **rows}))


if __name__ == "__main__":
    main()
