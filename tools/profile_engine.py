"""Where a block engine's forward and backward spend their GPU time on an estimated index: the kernels of one
forward + backward by total time, for the index as estimated, for the same index with its column lists cut to
their longest row (the estimate pads them to the vertical cap), and for its blocks alone.

    python -m tools.profile_engine --seq 131072 --heads 16 2 128 --recall 0.96 --engine fa4

Inputs: the planted (`mtrain.bench.synthetic.make_inputs`) vertical-slash q/k/v (bf16); block 128 for fa4.
"""

from __future__ import annotations

import argparse
import sys

import torch


from mtrain.bench.attention import blocks_only
from mtrain.bench.synthetic import make_inputs

from mtrain.bench.timing import timed
from mtrain.ops import SparseIndex, estimate_vertical_slash, vertical_slash_attention


def trimmed(index: SparseIndex) -> SparseIndex:
    """The same pairs with the column lists cut to the longest row's count (one host read)."""
    width = max(1, int(index.col_counts.max()))
    return SparseIndex(index.block_ids, index.block_counts, index.col_ids[..., :width].contiguous(), index.col_counts,
                       index.seq_len, index.block_size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--heads", type=int, nargs=3, default=[16, 2, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--recall", type=float, default=0.96)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--engine", default="fa4", choices=("fa4", "triton"))
    ap.add_argument("--deterministic", action="store_true", help="the deterministic backward (default: the engine's "
                                                                 "atomic / FA4 backward, as training runs fa4)")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    Hq, Hkv, D = args.heads
    q, k, v = make_inputs(args.seq, Hq=Hq, Hkv=Hkv, D=D)
    dout = torch.randn_like(q)
    index = estimate_vertical_slash(q, k, recall=args.recall, block_size=args.block_size)
    print(f"S={args.seq} {Hq}/{Hkv} x {D}, block {args.block_size}: density {index.density():.4f}, column lists "
          f"{tuple(index.col_ids.shape)} (longest row {int(index.col_counts.max())}, mean "
          f"{float(index.col_counts.float().mean()):.1f})", flush=True)
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

    def step(idx):
        out = vertical_slash_attention(qg, kg, vg, idx, impl=args.engine, deterministic=args.deterministic)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    from torch.profiler import ProfilerActivity, profile

    for name, idx in (("as estimated", index), ("column lists trimmed", trimmed(index)),
                      ("blocks alone", blocks_only(index))):
        ms = timed(lambda idx=idx: step(idx), 5, warmup=3, back_to_back=True)
        print(f"\n=== {name}: forward + backward {ms:.2f} ms (5 calls back to back)", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step(idx)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
