"""Our Triton sparse kernels under launch-time variants, side by side in one process: each variant sets module
attributes of `mtrain.ops._triton_attention` (e.g. CUDA_LAUNCH, SUBTILE), and every variant is checked
against the first one (same index, same inputs) before it is timed, next to cuDNN dense causal attention.

    python -m tools.bench_kernel_variants --seqs 32768 --heads 9 3 64 --block-sizes 64 --variants base tma

Variants are named in VARIANTS below. Prints per (S, heads, block size, variant): density, forward / backward ms
(deterministic backward), ms per 1% of causal pairs, the ratio to dense, and the largest relative difference to
the first variant's out / dq / dk / dv.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch


from mtrain.bench.attention import timed
from mtrain.bench.synthetic import band_lines, make_inputs

from mtrain.ops import _triton_attention as ta
from mtrain.ops import dense_attention, estimate_vertical_slash, partial

# name -> {module attribute: value}; values replace the attribute for that variant only.
# A variant that sets SUBTILE or CUDA_LAUNCH_WIDE also clears the head-dim-64 overrides (SUBTILE_SMALL_HEADS,
# CUDA_LAUNCH_WIDE_SMALL_HEADS) unless it sets them, so it times exactly what it names.
VARIANTS = {
    "base": {},
    "fwd-64x64": {"SUBTILE": dict(ta.SUBTILE)},
    "fwd-w8": {"CUDA_LAUNCH": {**ta.CUDA_LAUNCH, "fwd": (8, 3)}},
    "fwd-s4": {"CUDA_LAUNCH": {**ta.CUDA_LAUNCH, "fwd": (4, 4)}},
    "fwd-128x64": {"SUBTILE": {**ta.SUBTILE, "fwd": (128, 64)}},
    "fwd-64x128": {"SUBTILE": {**ta.SUBTILE, "fwd": (64, 128)}},
    # wider sub-tiles with their own launch choices (CUDA_LAUNCH_WIDE), for 128-token blocks
    "fwd-128x64-w4": {"SUBTILE": {**ta.SUBTILE, "fwd": (128, 64)}, "CUDA_LAUNCH_WIDE": {"fwd": (4, 3)}},
    "fwd-128x128-w4": {"SUBTILE": {**ta.SUBTILE, "fwd": (128, 128)}, "CUDA_LAUNCH_WIDE": {"fwd": (4, 2)}},
    "fwd-128x128-w8": {"SUBTILE": {**ta.SUBTILE, "fwd": (128, 128)}, "CUDA_LAUNCH_WIDE": {"fwd": (8, 2)}},
    "fwd-64x128-w4": {"SUBTILE": {**ta.SUBTILE, "fwd": (64, 128)}, "CUDA_LAUNCH_WIDE": {"fwd": (4, 3)}},
    "dq-128x64-w4": {"SUBTILE": {**ta.SUBTILE, "dq": (128, 64)}, "CUDA_LAUNCH_WIDE": {"dq": (4, 2)}},
    "dq-128x64-w8": {"SUBTILE": {**ta.SUBTILE, "dq": (128, 64)}, "CUDA_LAUNCH_WIDE": {"dq": (8, 2)}},
    "dq-64x128-w4": {"SUBTILE": {**ta.SUBTILE, "dq": (64, 128)}, "CUDA_LAUNCH_WIDE": {"dq": (4, 2)}},
    "dkdv-64x128-w4": {"CUDA_LAUNCH_WIDE": {"dkdv": (4, 3)}},
    "dkdv-128x128-w8": {"SUBTILE": {**ta.SUBTILE, "dkdv": (128, 128)}, "CUDA_LAUNCH_WIDE": {"dkdv": (8, 2)}},
    # work items of the dK/dV passes: MIN_ITEMS = 0 cuts only lists above 2x the mean (the rule before it)
    "items-mean-only": {"MIN_ITEMS": 0},
    "items-8-per-sm": {"MIN_ITEMS": 8 * 132},
}


def run_variant(name, q, k, v, dout, index):
    changes = dict(VARIANTS[name])
    if "SUBTILE" in changes or "CUDA_LAUNCH_WIDE" in changes:
        changes.setdefault("SUBTILE_SMALL_HEADS", {})
        changes.setdefault("CUDA_LAUNCH_WIDE_SMALL_HEADS", {})
    saved = {attr: copy.deepcopy(getattr(ta, attr)) for attr in changes}
    try:
        for attr, value in changes.items():
            setattr(ta, attr, copy.deepcopy(value))
        for key in [key for key in index._cache if isinstance(key, tuple) and key[0] in ("kv_items", "col_items")]:
            del index._cache[key]  # the backward's work items, rebuilt under this variant's settings
        S = q.shape[1]
        pos = torch.arange(S, device=q.device)
        kw = dict(q_pos=pos, k_pos=pos, blocks=index.blocks, columns=index.columns, block_size=index.block_size,
                  plans=index._cache)
        out, lse = partial.attention_forward(q, k, v, **kw)
        grads = partial.attention_backward(dout, q, k, v, out, lse, **kw)
        it = 5 if S >= 100_000 else 10
        t_f = timed(lambda: partial.attention_forward(q, k, v, **kw), it)
        t_b = timed(lambda: partial.attention_backward(dout, q, k, v, out, lse, **kw), it)
        return (out, *grads), t_f, t_b
    finally:
        for attr, value in saved.items():
            setattr(ta, attr, value)


def band_index(S, Hq, bs, frac, n_vert, device):
    """The band index that `mtrain bench cost` times (`mtrain.bench.synthetic.band_lines`)."""
    from mtrain.ops.index import SparseIndex

    return SparseIndex.from_lines(*band_lines(S, Hq, bs, frac, n_vert, device), S, bs)


def profile(name, q, k, v, dout, index):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        run_variant(name, q, k, v, dout, index)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_variant(name, q, k, v, dout, index)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768])
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[64])
    ap.add_argument("--recall", type=float, default=0.95)
    ap.add_argument("--variants", nargs="+", default=["base"], choices=sorted(VARIANTS))
    ap.add_argument("--density", type=float, help="instead of the estimate on planted inputs: a local band of "
                    "block-aligned slashes plus --verticals spread columns per head, about this fraction of blocks")
    ap.add_argument("--verticals", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of the first variant's fwd + bwd")
    args = ap.parse_args()
    Hq, Hkv, D = args.heads
    rows = []
    for S in args.seqs:
        q, k, v = make_inputs(S, Hq=Hq, Hkv=Hkv, D=D)
        dout = torch.randn_like(q)
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))

        def dense_step():
            o = dense_attention(qd, kd, vd, causal=True)
            torch.autograd.grad(o, (qd, kd, vd), dout)

        t_dense = timed(dense_step, 5 if S >= 100_000 else 10)
        with torch.no_grad():
            t_dense_fwd = timed(lambda: dense_attention(q, k, v, causal=True), 5 if S >= 100_000 else 10)
        print(f"S={S} heads={Hq}/{Hkv}x{D}: dense (cuDNN) fwd {t_dense_fwd:.2f} ms, fwd+bwd {t_dense:.2f} ms", flush=True)
        for bs in args.block_sizes:
            if args.density is None:
                index = estimate_vertical_slash(q, k, recall=args.recall, block_size=bs)
            else:
                index = band_index(S, Hq, bs, args.density, args.verticals, q.device)
            ta.prepare_backward(index, Hkv, D)
            dens = index.density()
            ref = None
            for name in args.variants:
                res, t_f, t_b = run_variant(name, q, k, v, dout, index)
                if ref is None:
                    ref = res
                    if args.profile:
                        profile(name, q, k, v, dout, index)
                diff = max(float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))
                           for a, b in zip(res, ref))
                per = (t_f + t_b) / (100 * dens)
                rows.append((S, f"{Hq}/{Hkv}x{D}", bs, name, dens, t_f, t_b, per, t_dense / (t_f + t_b), diff))
                print(f"S={S} heads={Hq}/{Hkv}x{D} bs={bs} {name:12s} density {dens:.3f} fwd {t_f:7.2f} bwd "
                      f"{t_b:7.2f} ms, {per:.3f} ms per 1%, {t_dense / (t_f + t_b):.2f}x dense ({t_dense:.1f} ms), "
                      f"max rel diff to {args.variants[0]} {diff:.1e}", flush=True)
        del q, k, v, dout, qd, kd, vd
        torch.cuda.empty_cache()
    print("\n| S | heads | block | variant | density | fwd ms | bwd ms | ms per 1% | x dense | rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.3f} | "
              f"{r[8]:.2f} | {r[9]:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
