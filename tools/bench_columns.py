"""Launch settings of the column path (the fa4 engine's vertical columns through mtrain's Triton kernels on a
column-only index): each candidate's kernels timed on an estimated index, its results checked against the
current settings'.

    python -m tools.bench_columns --seq 131072 --heads 16 2 128 --recall 0.96

Three kernels are swept: the column forward merged into a block result ("colfwd": query rows x column chunk,
warps, stages), the column dQ pass with another pass's gradients added ("coldq": the same), and the column
dK/dV pass ("col": query rows per step, warps, stages; 64-column chunks). Times are GPU time per call from the
profiler (mean over --iters calls), so one kernel's setting does not blur another's. Inputs: the
planted (`mtrain.bench.synthetic.make_inputs`) vertical-slash q/k/v (bf16), block 128, the estimate's index and the fa4 engine's column-only plans.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch


from mtrain.bench.synthetic import make_inputs
from mtrain.bench.check import rel

from mtrain.ops import _triton_attention as ta
from mtrain.ops import estimate_vertical_slash, partial
from mtrain.ops.fa4 import prepare_fa4

# (query rows, column chunk, warps, stages); the first entry of each list is compared against the current setting.
FWD = [(128, 32, 4, 2), (128, 32, 4, 1), (128, 32, 4, 3), (128, 16, 4, 2), (128, 32, 2, 2), (64, 32, 4, 1),
       (128, 64, 4, 1), (128, 32, 8, 3)]
DQ = [(64, 64, 4, 1), (64, 32, 4, 1), (128, 32, 4, 1), (128, 64, 4, 1), (64, 64, 2, 1), (32, 64, 4, 1),
      (64, 32, 2, 1), (32, 32, 4, 1)]
# (query rows per step, warps, stages)
COL = [(32, 4, 3), (32, 4, 4), (32, 2, 3), (16, 4, 3), (16, 2, 3), (32, 8, 3), (16, 2, 2), (32, 2, 4)]
KERNELS = ("_fwd_kernel", "_dq_kernel", "_col_dkdv_kernel", "_reduce_kernel", "_column_add_kernel", "_delta_kernel")


def set_launch(kernel: str, rows: int, cols: int, warps: int, stages: int) -> None:
    ta.SUBTILE[kernel] = (rows, cols)
    ta.CUDA_LAUNCH[kernel] = (warps, stages)
    ta.CUDA_LAUNCH_WIDE[kernel] = (warps, stages)  # as given, also for 128-row tiles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--heads", type=int, nargs=3, default=[16, 2, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--recall", type=float, default=0.96)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    Hq, Hkv, D = args.heads
    S, bs = args.seq, 128
    q, k, v = make_inputs(S, Hq=Hq, Hkv=Hkv, D=D)
    index = estimate_vertical_slash(q, k, recall=args.recall, block_size=bs)
    prepare_fa4(index, Hkv, D)
    plan = index._cache["fa4"]
    col_plans = plan.col_plans
    scale = 1.0 / math.sqrt(D)
    pos = torch.arange(S, device=q.device)
    kw = dict(q_pos=pos, k_pos=pos, blocks=plan.no_blocks, columns=index.columns, block_size=bs,
              softmax_scale=scale, causal=True, impl="triton")
    g = torch.Generator(device=q.device).manual_seed(1)
    base_out = torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)
    base_lse = torch.randn(1, Hq, S, generator=g, device=q.device) + 8.0
    dout = torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)
    inits = tuple(torch.randn(t.shape, generator=g, device=q.device).to(t.dtype) for t in (q, k, v))
    counts = index.col_counts.float()
    print(f"S={S} {Hq}/{Hkv} x {D}, block {bs}: density {index.density():.4f}, columns per query block mean "
          f"{counts.mean():.1f}, longest {int(counts.max())}", flush=True)

    def run():
        out, lse = partial.attention_forward(q, k, v, plans=col_plans, merge_into=(base_out.clone(),
                                                                                   base_lse.clone()), **kw)
        grads = partial.attention_backward(dout, q, k, v, out, lse, plans=col_plans,
                                           grad_init=tuple(t.clone() for t in inits), **kw)
        return out, lse, grads

    def profile() -> dict:
        run()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity

        with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                run()
            torch.cuda.synchronize()
        got = {name: 0.0 for name in KERNELS}
        for ev in prof.key_averages():
            if ev.key in got:
                got[ev.key] = ev.device_time_total / 1e3 / args.iters
        return got

    ref_out, ref_lse, ref_grads = run()
    print("setting                      | colfwd ms | coldq ms | col dK/dV ms | reduce+add+delta ms | "
          "err out / dq / dk / dv vs current")
    n = max(len(FWD), len(DQ), len(COL))
    for i in range(n):
        for name, rows in (("colfwd", FWD), ("coldq", DQ)):
            r, c, w, s = rows[min(i, len(rows) - 1)]
            set_launch(name, r, c, w, s)
        r, w, s = COL[min(i, len(COL) - 1)]
        set_launch("col", r, 64, w, s)
        tag = (f"f{FWD[min(i, len(FWD) - 1)]} q{DQ[min(i, len(DQ) - 1)]} c{COL[min(i, len(COL) - 1)]}"
               .replace(" ", ""))
        try:
            out, lse, grads = run()
            errs = [rel(out, ref_out)] + [rel(a, b) for a, b in zip(grads, ref_grads)]
            t = profile()
        except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported, the sweep goes on
            print(f"{tag}: failed {exc!r:.200}", flush=True)
            continue
        glue = t["_reduce_kernel"] + t["_column_add_kernel"] + t["_delta_kernel"]
        print(f"{tag:28s} | {t['_fwd_kernel']:9.3f} | {t['_dq_kernel']:8.3f} | {t['_col_dkdv_kernel']:12.3f} | "
              f"{glue:19.3f} | " + " / ".join(f"{e:.1e}" for e in errs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
