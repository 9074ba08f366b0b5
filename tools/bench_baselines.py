"""The paper's comparison at the kernel level, one GPU, one run: dense (SDPA cuDNN), MTraining (online
vertical-slash), MoBA and XAttention, each all in (its block selection, forward, backward through the same
block-sparse kernels), on the benchmark's planted long-context inputs.

First a correctness check per method on a short sequence: each method's output and gradients against a float64
reference that applies the method's own index as a mask (`mtrain.ops.reference`); exits non-zero on a failure.

    python -m tools.bench_baselines --seqs 65536 131072 [--heads 16 2 128] [--out DIR]

Settings are the recipe defaults (attention.recall 0.99; moba 4096-token chunks, top 12; xattention stride 8,
threshold 0.9) unless given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


from mtrain.bench.attention import sdpa_fn, timed
from mtrain.bench.synthetic import make_inputs

from mtrain.ops import estimate_vertical_slash, vertical_slash_attention
from mtrain.ops.moba import moba_index
from mtrain.ops.xattention import xattention_index


def selectors(args, short: bool = False):
    """name -> function (q, k) -> SparseIndex. short: settings that leave a short sequence sparse (the check)."""
    bs = args.block_size
    recall, chunk, topk, thresh = (0.8, 2 * bs, 2, 0.5) if short else (args.recall, args.moba_chunk, args.moba_topk,
                                                                       args.xattn_threshold)
    return {
        "mtraining": lambda q, k: estimate_vertical_slash(q, k, recall=recall, block_size=bs),
        "moba": lambda q, k: moba_index(q, k, chunk_size=chunk, topk=topk, block_size=bs),
        "xattention": lambda q, k: xattention_index(q, k, stride=args.xattn_stride, threshold=thresh, block_size=bs),
    }


def check(args, device) -> bool:
    """Each method at S = 1024 + 40 (fp32; settings that keep it sparse there) against the float64 masked
    reference: out and grads within 1e-4 relative."""
    from mtrain.ops import reference

    torch.manual_seed(0)
    S, (Hq, Hkv, D) = 1064, args.heads
    q, k, v = (torch.randn(1, S, h, D, device=device) for h in (Hq, Hkv, Hkv))
    dout = torch.randn_like(q)
    ok = True
    for name, select in selectors(args, short=True).items():
        index = select(q, k)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = vertical_slash_attention(qq, kk, vv, index)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout)
        rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
        ref, _ = reference.vertical_slash_attention(rq, rk, rv, index.to(device))
        want = torch.autograd.grad(ref, (rq, rk, rv), dout.double())
        errs = [float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-12))
                for a, b in zip((out, *grads), (ref, *want))]
        good = max(errs) < 1e-4
        ok &= good
        print(f"check {name:10s} density {index.density():.3f}: out {errs[0]:.1e} dq {errs[1]:.1e} dk {errs[2]:.1e} "
              f"dv {errs[3]:.1e} -> {'ok' if good else 'FAIL'}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--heads", type=int, nargs=3, default=[16, 2, 128], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--recall", type=float, default=0.99)
    ap.add_argument("--moba-chunk", type=int, default=4096)
    ap.add_argument("--moba-topk", type=int, default=12)
    ap.add_argument("--xattn-stride", type=int, default=8)
    ap.add_argument("--xattn-threshold", type=float, default=0.9)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench-baselines"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = check(args, device)
    if device != "cuda":
        print("no GPU: correctness only")
        return 0 if ok else 1
    from torch.nn.attention import SDPBackend

    Hq, Hkv, D = args.heads
    rows = []
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__}; heads {Hq}/{Hkv} x {D}, block {args.block_size}")
    print("| S | method | pairs | selection ms | fwd ms | bwd ms | total ms | vs cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for S in args.seqs:
        q, k, v = make_inputs(S, Hq, Hkv, D, device=device)
        dout = torch.randn_like(q)
        f_fwd, _ = sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, False, dout)
        f_all, _ = sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, True, dout)
        t_f, t_a = timed(f_fwd, args.iters), timed(f_all, args.iters)
        rows.append(dict(S=S, method="dense (cuDNN)", pairs=1.0, select=0.0, fwd=t_f, bwd=t_a - t_f, total=t_a))
        print(f"| {S} | dense (cuDNN) | 100% | – | {t_f:.1f} | {t_a - t_f:.1f} | {t_a:.1f} | 1.0× |", flush=True)
        for name, select in selectors(args).items():
            t_sel = timed(lambda: select(q, k), args.iters)
            index = select(q, k)
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            t_fwd = timed(lambda: vertical_slash_attention(q, k, v, index), args.iters)
            out = vertical_slash_attention(qq, kk, vv, index)
            t_bwd = timed(lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True), args.iters)
            total = t_sel + t_fwd + t_bwd
            dens = index.density()
            rows.append(dict(S=S, method=name, pairs=dens, select=t_sel, fwd=t_fwd, bwd=t_bwd, total=total))
            print(f"| {S} | {name} | {100 * dens:.1f}% | {t_sel:.1f} | {t_fwd:.1f} | {t_bwd:.1f} | {total:.1f} | "
                  f"{t_a / total:.1f}× |", flush=True)
            del index, out, qq, kk, vv
            torch.cuda.empty_cache()
        del q, k, v, dout
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_baselines.json"), "w") as f:
        json.dump(dict(args=vars(args), device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
