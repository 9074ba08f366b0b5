"""The estimator's Triton scorer (`mtrain.ops._triton_estimate.score_rows`) under several launch settings, on the
rows the estimate scores (`estimate_rows`): GPU time per call and the largest difference from the first setting,
for every shape asked. One process, one shape at a time; the inputs are the planted (`mtrain.bench.synthetic.make_inputs`) q/k.

    python -m tools.bench_scorer --shapes 131072x16x2x128 32768x9x3x64 --block-size 128 \\
        --variants r64-w8-nosplit r64-w8 r128-w8 r128-w8-s3

A variant names its settings joined by '-': rN rows per program, wN warps, sN pipeline stages, kN keys per program,
nosplit (every key tile masked; the default runs the keys all rows see without masks). What a variant leaves out takes
`scorer_config`'s default.
"""

from __future__ import annotations

import argparse
import sys

import torch


from mtrain.bench.attention import timed
from mtrain.bench.synthetic import make_inputs

from mtrain.ops._triton_estimate import score_rows
from mtrain.ops.estimate import estimate_rows


def parse_variant(name: str) -> dict:
    cfg = {}
    for part in name.split("-"):
        if part == "nosplit":
            cfg["split"] = False
        elif part[:1] in "rwsk" and part[1:].isdigit():
            cfg[{"r": "rows", "w": "warps", "s": "stages", "k": "keys"}[part[0]]] = int(part[1:])
        else:
            raise SystemExit(f"variant {name!r}: unknown part {part!r} (rN, wN, sN, kN or nosplit)")
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["131072x16x2x128", "131072x9x3x64", "32768x9x3x64"],
                    metavar="SxHQxHKVxD")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--variants", nargs="+",
                    default=["r128-w4", "r128-w4-s2", "r128-w4-s3", "r128-w4-nosplit", "r128-w8", "r64-w4", "r64-w8",
                             "r256-w8", "r128-w4-k8192", "r128-w4-k2048"])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_scorer times GPU kernels: no CUDA device here")
    variants = [(v, parse_variant(v)) for v in args.variants]
    for shape in args.shapes:
        S, Hq, Hkv, D = (int(x) for x in shape.split("x"))
        q, k, _ = make_inputs(S, Hq=Hq, Hkv=Hkv, D=D)
        rows = estimate_rows(S, device=q.device, block_size=args.block_size)
        q_rows = q[:, rows].contiguous()
        del q
        keys = int(torch.minimum(rows + 1, torch.tensor(S)).sum()) * Hq
        flop = 4.0 * keys * D  # two passes, q.k only
        print(f"\n=== S={S} Hq={Hq} Hkv={Hkv} D={D} block {args.block_size}: {rows.numel()} rows, "
              f"{keys / 1e9:.2f} G visible (row, key) pairs over heads", flush=True)
        print("| variant | ms | TFLOP/s (q.k, both passes) | max diff lse / pooled / vert vs the first |")
        print("|---|---|---|---|")
        first = None
        for name, cfg in variants:
            try:
                out = score_rows(q_rows, k, rows, args.block_size, D ** -0.5, config=cfg)
                ms = timed(lambda cfg=cfg: score_rows(q_rows, k, rows, args.block_size, D ** -0.5, config=cfg),
                           args.iters, warmup=1)
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is a row of the table
                print(f"| {name} | failed: {exc!r:.150} | | |", flush=True)
                continue
            if first is None:
                first = out
            diff = " / ".join(f"{float((a - b).abs().max()):.1e}" for a, b in zip(out, first))
            print(f"| {name} | {ms:.3f} | {flop / ms / 1e9:.0f} | {diff} |", flush=True)
            del out
        del q_rows, k, first
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
