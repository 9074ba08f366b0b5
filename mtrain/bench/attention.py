"""Benchmark of vertical-slash sparse attention against dense SDPA (cuDNN, flash), FlashAttention-4 dense causal,
and FlexAttention and FlashAttention-4 as block engines on the same index: checks correctness at a small size first,
then times every variant in one run (GPU). FA4 rows appear when flash_attn.cute imports (mtrain[fa4])."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

from mtrain.bench import real as bench_real
from mtrain.bench import timing
from mtrain.bench.synthetic import make_inputs
from mtrain.ops import SparseIndex, estimate_vertical_slash, partial, reference
from mtrain.ops import _triton_attention
from mtrain.ops import flex as flex_engine
from mtrain.ops.index import transpose_blocks_csr


# ----------------------------------------------------------------------------- inputs
# ----------------------------------------------------------------------------- timing
# two untimed calls before the timed ones: the first call of a kernel compiles it
timed = functools.partial(timing.timed, warmup=2)


def iters_for(S):
    return 5 if S >= 100_000 else 10


def causal_flops(S, Hq, D, bwd: bool) -> float:
    fwd = 4.0 * S * S / 2 * D * Hq
    return fwd * (3.5 if bwd else 1.0)  # backward = 2.5x forward (FlashAttention convention)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ----------------------------------------------------------------------------- dense baselines
def sdpa_fn(backend, q, k, v, bwd, dout):
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    qh, kh, vh = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    G = qh.shape[1] // kh.shape[1]
    try:
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(qh[:, :, :128], kh[:, :, :128], vh[:, :, :128], is_causal=True,
                                           enable_gqa=True)
        gqa = True
    except RuntimeError:
        # This backend has no GQA: expand K/V (same FLOPs; only memory grows).
        kh, vh = kh.repeat_interleave(G, dim=1), vh.repeat_interleave(G, dim=1)
        gqa = False
    qh.requires_grad_(bwd)
    kh.requires_grad_(bwd)
    vh.requires_grad_(bwd)
    doh = dout.transpose(1, 2).contiguous()

    def run():
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
        if bwd:
            torch.autograd.grad(out, (qh, kh, vh), doh)
        return out

    return run, gqa


# ----------------------------------------------------------------------------- checks
def correctness(device, block_sizes, log, dtypes, S=4096 + 40):
    """Ours (fp32 and bf16, every block size: 128-token blocks run sub-tiled) against a float64 reference
    with the materialized mask: out, lse, dq/dk/dv of the deterministic and atomic backward."""
    Hq, Hkv, D = 16, 2, 128  # S ragged on purpose
    res = {}
    for bs in block_sizes:
        for dtype in (getattr(torch, name) for name in dtypes):
            q, k, v = make_inputs(S, Hq, Hkv, D, seed=1, device=device, dtype=dtype)
            dout = torch.randn_like(q)
            index = estimate_vertical_slash(q, k, recall=0.95, block_size=bs)
            pos = torch.arange(S, device=device)
            out, lse = partial.attention_forward(q, k, v, q_pos=pos, k_pos=pos, blocks=index.blocks,
                                                 columns=index.columns, block_size=bs)
            mask = index.to_mask()
            qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
            r_out, r_lse = reference.attention(qr, kr, vr, mask)
            r_out.backward(dout.double())
            res_d = {"out": rel(out, r_out), "lse": rel(lse, r_lse)}
            for det in (True, False):
                dq, dk, dv = partial.attention_backward(dout, q, k, v, out, lse, q_pos=pos, k_pos=pos,
                                                        blocks=index.blocks, columns=index.columns, block_size=bs,
                                                        deterministic=det, plans=index._cache)
                tag = "det" if det else "atomic"
                res_d.update({f"dq_{tag}": rel(dq, qr.grad), f"dk_{tag}": rel(dk, kr.grad),
                              f"dv_{tag}": rel(dv, vr.grad)})
            assert torch.isfinite(out).all() and torch.isfinite(dq).all()
            res[f"{bs}-{str(dtype).replace('torch.', '')}"] = res_d
            log(f"check {dtype} S={S} bs={bs} density={index.density():.3f}: " +
                " ".join(f"{a}={b:.2e}" for a, b in res_d.items()))
            del qr, kr, vr, mask
            torch.cuda.empty_cache()
    return res


def time_ours(q, k, v, dout, pos, recall, bs, it):
    """Ours: index (estimate + everything the deterministic backward derives), forward, backward (ms)."""
    Hkv, D = k.shape[2], k.shape[3]

    def est():
        idx = estimate_vertical_slash(q, k, recall=recall, block_size=bs)
        _triton_attention.prepare_backward(idx, Hkv, D)
        return idx

    t_idx = timed(est, it)
    index = est()
    kw = dict(q_pos=pos, k_pos=pos, blocks=index.blocks, columns=index.columns, block_size=bs, plans=index._cache)
    t_fwd = timed(lambda: partial.attention_forward(q, k, v, **kw), it)
    out, lse = partial.attention_forward(q, k, v, **kw)
    t_bwd = timed(lambda: partial.attention_backward(dout, q, k, v, out, lse, **kw), it)
    grads = partial.attention_backward(dout, q, k, v, out, lse, **kw)
    return index, dict(index=t_idx, fwd=t_fwd, bwd=t_bwd, total=t_idx + t_fwd + t_bwd), (out, lse, *grads)


def time_fused_backward(q, k, v, dout, pos, index, bs, it, ours, ours_res, log):
    """The fused atomic backward (deterministic=False: dQ added with atomics from the dK/dV passes) on the
    same index, in the same run, beside the deterministic default, with its relative difference to it."""
    kw = dict(q_pos=pos, k_pos=pos, blocks=index.blocks, columns=index.columns, block_size=bs, plans=index._cache)
    out, lse = ours_res[:2]
    t_bwd = timed(lambda: partial.attention_backward(dout, q, k, v, out, lse, deterministic=False, **kw), it)
    grads = partial.attention_backward(dout, q, k, v, out, lse, deterministic=False, **kw)
    diffs = {n: rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, ours_res[2:])}
    log(f"   fused atomic backward: {t_bwd:.2f} ms (deterministic {ours['bwd']:.2f}: x{t_bwd / ours['bwd']:.3f}); "
        "rel diff " + " ".join(f"{a}={b:.1e}" for a, b in diffs.items()))
    return dict(bwd=t_bwd, diffs=diffs)


def time_flex(q, k, v, dout, recall, bs, it, kernel_options=None):
    """The Flex engine driven by our index (exact token mask): index (estimate + BlockMask), forward,
    backward through Flex's own kernels (ms); the first call compiles."""
    # Timing the backward alone replays one graph (retain_graph), which donated buffers forbid.
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False

    def est():
        idx = estimate_vertical_slash(q, k, recall=recall, block_size=bs)
        idx._cache["flex"] = flex_engine.flex_block_mask(idx)
        return idx

    index = est()
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    t0 = time.time()
    out, lse = flex_engine.flex_vertical_slash(qg, kg, vg, index, kernel_options=kernel_options)
    torch.autograd.grad(out, (qg, kg, vg), dout)
    torch.cuda.synchronize()
    t_compile = time.time() - t0
    t_idx = timed(est, it)
    t_fwd = timed(lambda: flex_engine.flex_vertical_slash(qg, kg, vg, index, kernel_options=kernel_options), it)
    out, lse = flex_engine.flex_vertical_slash(qg, kg, vg, index, kernel_options=kernel_options)
    t_bwd = timed(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True), it)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    bm = index._cache["flex"]
    blocks = float(bm.kv_num_blocks.float().mean() + bm.full_kv_num_blocks.float().mean()) / ((index.n_blocks + 1) / 2)
    return dict(index=t_idx, fwd=t_fwd, bwd=t_bwd, total=t_idx + t_fwd + t_bwd, compile_s=t_compile,
                flex_block_density=blocks), (out.detach(), lse, *grads)


def fa4_available() -> bool:
    try:
        from mtrain.ops.fa4 import load_fa4

        load_fa4()
        return True
    except ImportError:
        return False


def fa4_dense_fn(q, k, v, bwd, dout):
    """FlashAttention-4's dense causal attention (its public flash_attn_func, GQA native), fwd or fwd+bwd."""
    from flash_attn.cute import flash_attn_func

    qg, kg, vg = (t.detach().requires_grad_(bwd) for t in (q, k, v))

    def run():
        out = flash_attn_func(qg, kg, vg, causal=True)[0]
        if bwd:
            torch.autograd.grad(out, (qg, kg, vg), dout)
        return out

    return run


def blocks_only(index: SparseIndex) -> SparseIndex:
    """The same listed blocks without the vertical columns."""
    return SparseIndex(index.block_ids, index.block_counts, index.col_ids[..., :1].clone().fill_(-1),
                       torch.zeros_like(index.col_counts), index.seq_len, index.block_size)


def time_fa4(q, k, v, dout, recall, bs, it):
    """FlashAttention-4 as the block engine on our index (mtrain.ops.fa4): index (estimate + FA4's lists + the
    column path's plans), forward (FA4 blocks + Triton columns, merged), backward with FA4's block-sparse backward
    (deterministic=False) and with our deterministic one behind FA4's forward (fwd_det/bwd_det; its index adds
    our backward plans); and FA4 on the blocks alone (the same index without its columns)."""
    from mtrain.ops import fa4 as fa4_engine

    Hkv, D = k.shape[2], k.shape[3]

    def est():
        idx = estimate_vertical_slash(q, k, recall=recall, block_size=bs)
        fa4_engine.prepare_fa4(idx, Hkv, D)
        return idx

    index = est()
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd(idx, det):
        out, lse = fa4_engine.fa4_vertical_slash(qg, kg, vg, idx, deterministic=det)
        t_f = timed(lambda: fa4_engine.fa4_vertical_slash(qg, kg, vg, idx, deterministic=det), it)
        t_b = timed(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True), it)
        return t_f, t_b, (out.detach(), lse, *torch.autograd.grad(out, (qg, kg, vg), dout))

    t0 = time.time()
    fwd_bwd(index, False)  # compiles FA4's forward and backward for this shape
    torch.cuda.synchronize()
    t_compile = time.time() - t0
    t_idx = timed(est, it)
    t_fwd, t_bwd, res = fwd_bwd(index, False)
    _triton_attention.prepare_backward(index, Hkv, D)
    _, t_bwd_det, res_det = fwd_bwd(index, True)
    no_cols = blocks_only(index)
    fa4_engine.prepare_fa4(no_cols, Hkv, D)
    b_fwd, b_bwd, _ = fwd_bwd(no_cols, False)
    det_diffs = {n: rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), res_det[2:], res[2:])}
    return index, dict(index=t_idx, fwd=t_fwd, bwd=t_bwd, total=t_idx + t_fwd + t_bwd, bwd_det=t_bwd_det,
                       blocks_fwd=b_fwd, blocks_bwd=b_bwd, blocks_density=no_cols.density(), compile_s=t_compile,
                       det_vs_atomic=det_diffs), res


def tile_sweep(q, k, v, dout, pos, bs, log):
    """Time our kernels at one block size under a few sub-tile shapes (query rows, keys) per kernel."""
    index = estimate_vertical_slash(q, k, recall=0.90, block_size=bs)
    kw = dict(q_pos=pos, k_pos=pos, blocks=index.blocks, columns=index.columns, block_size=bs, plans=index._cache)
    out, lse = partial.attention_forward(q, k, v, **kw)
    partial.attention_backward(dout, q, k, v, out, lse, **kw)
    base = dict(_triton_attention.SUBTILE)
    # Flex's Hopper defaults for a 128 head dim are forward 128 x 64 or 128 x 128, dQ 128 x 64, dK/dV 64 x 128.
    choices = {"fwd": [(64, 64), (128, 64), (128, 128)], "dq": [(64, 64), (128, 64)],
               "dkdv": [(64, 64), (64, 128), (128, 64)]}
    for kernel, opts in choices.items():
        best = None
        for c in opts:
            if max(c) > bs:
                continue
            _triton_attention.SUBTILE[kernel] = c
            try:
                if kernel == "fwd":
                    t = timed(lambda: partial.attention_forward(q, k, v, **kw), 5)
                else:
                    t = timed(lambda: partial.attention_backward(dout, q, k, v, out, lse, **kw), 5)
            except Exception as e:  # a shape that does not fit (shared memory) is skipped
                log(f"tile sweep bs={bs} {kernel} {c}: failed {type(e).__name__}")
                continue
            log(f"tile sweep bs={bs} {kernel} (rows, keys)={c}: {t:.2f} ms")
            if best is None or t < best[0]:
                best = (t, c)
        _triton_attention.SUBTILE[kernel] = best[1] if best else base[kernel]
        log(f"tile sweep bs={bs} {kernel}: keep {_triton_attention.SUBTILE[kernel]}")


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtrain bench attention", description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--heads", type=int, nargs=3, default=[16, 2, 128], metavar=("HQ", "HKV", "D"),
                    help="query heads, KV heads and head dim of the synthetic inputs (default: Qwen2.5-3B's)")
    ap.add_argument("--recalls", type=float, nargs="+", default=[0.90, 0.95])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench"), help="folder for the log and json")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-fa4", action="store_true", help="skip the FlashAttention-4 rows (dense and block engine)")
    ap.add_argument("--fa4-recalls", type=float, nargs="*", help="recalls the FA4 engine is timed at (default: the "
                                                                 "first); 128-token blocks only")
    ap.add_argument("--time-budget", type=float, default=480.0, help="skip the remaining variants after this many s")
    ap.add_argument("--check-dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--check-seq", type=int, default=4096 + 40, help="sequence length of the correctness check")
    ap.add_argument("--sweep", action="store_true", help="try launch configs of our kernels at the first size")
    ap.add_argument("--tile-sweep", action="store_true",
                    help="try sub-tile shapes of our kernels for blocks > 64 at the first size (keeps the fastest)")
    ap.add_argument("--dense", nargs="*", default=["cudnn", "flash", "fa4"],
                    help="dense backends to time: SDPA's cudnn and flash, FlashAttention-4's fa4")
    ap.add_argument("--fused-backward", action="store_true",
                    help="also time the fused atomic backward (deterministic=False) on the same index")
    ap.add_argument("--flex-recalls", type=float, nargs="*", help="recalls Flex is timed at (default: the first)")
    ap.add_argument("--profile-index", action="store_true", help="torch.profiler table of index building")
    ap.add_argument("--no-flex64", action="store_true", help="skip Flex at blocks < 128 (needs max_autotune)")
    ap.add_argument("--densities-only", action="store_true", help="print index densities (CPU ok) and stop")
    ap.add_argument("--index-build", nargs=2, type=int, metavar=("NV", "NS"),
                    help="time and peak memory of SparseIndex.from_lines + the transposed index for one head with NV "
                         "verticals and NS slashes (the offset builder, ragged transpose); CPU ok; then stop")
    ap.add_argument("--index-build-one", nargs=4, metavar=("S", "NV", "NS", "BS"), help=argparse.SUPPRESS)
    bench_real.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.model:
        return bench_real.run_cli(args)
    if args.index_build_one:
        return index_build_one(*args.index_build_one)
    if args.index_build:
        return index_build(args.seqs, args.block_sizes, *args.index_build)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "bench_attention.log"), "a")

    t_start = time.time()

    def log(msg):
        msg = f"[{time.time() - t_start:5.0f}s] {msg}"
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    if args.densities_only:
        for S in args.seqs:
            q, k, _ = make_inputs(S, device=device, dtype=torch.float32)
            for bs in args.block_sizes:
                for r in args.recalls:
                    t0 = time.time()
                    idx = estimate_vertical_slash(q, k, recall=r, block_size=bs)
                    log(f"S={S} bs={bs} recall={r}: block density {idx.block_density():.4f} pair density "
                        f"{idx.density():.4f} cols/row {idx.col_counts.float().mean():.1f} ({time.time() - t0:.1f}s)")
        return 0

    import triton
    from torch.nn.attention import SDPBackend

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    log(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {gpu} torch {torch.__version__} "
        f"triton {triton.__version__}")
    results = {"device": gpu, "torch": torch.__version__, "triton": triton.__version__,
               "checks": {}, "runs": []}
    try:
        results["checks"] = correctness(device, args.block_sizes, log, args.check_dtypes, args.check_seq)
    except Exception as e:  # keep the timings even if a check cannot run; the failure is in the log
        log(f"check failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")

    Hq, Hkv, D = args.heads
    rows = []
    for si, S in enumerate(args.seqs):
        q, k, v = make_inputs(S, Hq, Hkv, D, seed=0, device=device)
        dout = torch.randn_like(q)
        pos = torch.arange(S, device=device)
        it = iters_for(S)
        dense = {}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            if name not in args.dense:
                continue
            try:
                f_fwd, gqa = sdpa_fn(backend, q, k, v, False, dout)
                t_f = timed(f_fwd, it)
                f_all, _ = sdpa_fn(backend, q, k, v, True, dout)
                t_a = timed(f_all, it)
                dense[name] = (t_f, t_a)
                log(f"S={S} dense {name} (gqa={gqa}): fwd {t_f:.2f} ms fwd+bwd {t_a:.2f} ms "
                    f"({causal_flops(S, Hq, D, True) / t_a / 1e9:.0f} TFLOP/s)")
                rows.append(dict(S=S, variant=f"sdpa-{name}", fwd=t_f, bwd=t_a - t_f, total=t_a))
            except RuntimeError as e:
                log(f"S={S} dense {name}: unavailable ({str(e).splitlines()[0][:120]})")
            torch.cuda.empty_cache()
        use_fa4 = not args.no_fa4 and device == "cuda" and fa4_available()
        if use_fa4 and "fa4" in args.dense:
            try:
                t_f = timed(fa4_dense_fn(q, k, v, False, dout), it)
                t_a = timed(fa4_dense_fn(q, k, v, True, dout), it)
                dense["fa4"] = (t_f, t_a)
                log(f"S={S} dense fa4 (FlashAttention-4 causal): fwd {t_f:.2f} ms fwd+bwd {t_a:.2f} ms "
                    f"({causal_flops(S, Hq, D, True) / t_a / 1e9:.0f} TFLOP/s)")
                rows.append(dict(S=S, variant="fa4-dense", fwd=t_f, bwd=t_a - t_f, total=t_a))
            except Exception as e:  # report and keep benchmarking the other variants
                log(f"S={S} dense fa4 failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            torch.cuda.empty_cache()
        elif not args.no_fa4 and "fa4" in args.dense:
            log(f"S={S} fa4: skipped (flash_attn.cute not importable or no GPU)")
        best_dense = min((t[1] for t in dense.values()), default=float("nan"))

        for bs in args.block_sizes:
            if args.sweep and si == 0:
                sweep(q, k, v, dout, pos, bs, log)
            if args.tile_sweep and si == 0 and bs > 64:
                tile_sweep(q, k, v, dout, pos, bs, log)
            for recall in args.recalls:
                if time.time() - t_start > args.time_budget:
                    log(f"S={S} bs={bs} recall={recall}: skipped (time budget)")
                    continue
                index, ours, ours_res = time_ours(q, k, v, dout, pos, recall, bs, it)
                if recall == args.recalls[0] and si == 0:
                    index_breakdown(q, k, recall, bs, Hkv, D, log)
                    if args.profile_index:
                        profile_index(q, k, recall, bs, Hkv, D, log)
                dens, bdens = index.density(), index.block_density()
                cols = float(index.col_counts.float().mean())
                row = dict(S=S, bs=bs, recall=recall, engine="ours", density=dens, block_density=bdens,
                           cols_per_row=cols, **ours, speedup_vs_dense=best_dense / ours["total"])
                rows.append(row)
                if args.fused_backward:
                    row["fused_backward"] = time_fused_backward(q, k, v, dout, pos, index, bs, it, ours, ours_res, log)
                log(f"S={S} bs={bs} p={recall} ours: pairs {dens:.4f} (blocks {bdens:.4f}, {cols:.0f} cols/row) "
                    f"index {ours['index']:.2f} fwd {ours['fwd']:.2f} bwd {ours['bwd']:.2f} total {ours['total']:.2f} "
                    f"ms; x{best_dense / ours['total']:.2f} vs best dense; kernels per 1% pairs "
                    f"{(ours['fwd'] + ours['bwd']) / (100 * dens):.2f} ms")
                fa4_recalls = args.fa4_recalls or args.recalls[:1]
                if use_fa4 and bs == 128 and recall in fa4_recalls and time.time() - t_start <= args.time_budget:
                    try:
                        _, f4, f4_res = time_fa4(q, k, v, dout, recall, bs, it)
                        diffs = {n: rel(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), f4_res, ours_res)}
                        per = (f4["fwd"] + f4["bwd"]) / (100 * dens)
                        rows.append(dict(S=S, bs=bs, recall=recall, engine="fa4", density=dens, block_density=bdens,
                                         **f4, per_pct=per, speedup_vs_dense=best_dense / f4["total"], vs_ours=diffs))
                        rows.append(dict(S=S, bs=bs, recall=recall, engine="fa4-det-bwd", density=dens,
                                         block_density=bdens, index=f4["index"], fwd=f4["fwd"], bwd=f4["bwd_det"],
                                         total=f4["index"] + f4["fwd"] + f4["bwd_det"],
                                         per_pct=(f4["fwd"] + f4["bwd_det"]) / (100 * dens),
                                         speedup_vs_dense=best_dense / (f4["index"] + f4["fwd"] + f4["bwd_det"])))
                        bd = f4["blocks_density"]
                        rows.append(dict(S=S, bs=bs, recall=recall, engine="fa4-blocks-only", density=bd,
                                         block_density=bdens, index=float("nan"), fwd=f4["blocks_fwd"],
                                         bwd=f4["blocks_bwd"], total=f4["blocks_fwd"] + f4["blocks_bwd"],
                                         per_pct=(f4["blocks_fwd"] + f4["blocks_bwd"]) / (100 * bd),
                                         speedup_vs_dense=float("nan")))
                        log(f"S={S} bs={bs} p={recall} fa4 engine: index {f4['index']:.2f} fwd {f4['fwd']:.2f} bwd "
                            f"{f4['bwd']:.2f} (our deterministic bwd behind it {f4['bwd_det']:.2f}) total "
                            f"{f4['total']:.2f} ms (compile {f4['compile_s']:.0f}s); x{best_dense / f4['total']:.2f} vs "
                            f"best dense; kernels per 1% pairs {per:.2f} ms (ours {(ours['fwd'] + ours['bwd']) / (100 * dens):.2f}); "
                            f"FA4 on the blocks alone ({bd:.4f} of pairs) fwd {f4['blocks_fwd']:.2f} bwd "
                            f"{f4['blocks_bwd']:.2f} ms = {(f4['blocks_fwd'] + f4['blocks_bwd']) / (100 * bd):.2f} ms "
                            f"per 1%; rel diff vs ours " + " ".join(f"{a}={b:.1e}" for a, b in diffs.items()) +
                            "; det vs atomic bwd " + " ".join(f"{a}={b:.1e}" for a, b in f4["det_vs_atomic"].items()))
                        del f4_res
                    except Exception as e:  # report and keep benchmarking the other variants
                        log(f"S={S} bs={bs} p={recall} fa4 failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                    torch.cuda.empty_cache()
                flex_recalls = args.flex_recalls or args.recalls[:1]
                if args.no_flex or (bs < 128 and args.no_flex64) or recall not in flex_recalls:
                    continue
                if time.time() - t_start > args.time_budget:
                    log(f"S={S} bs={bs} recall={recall} flex: skipped (time budget)")
                    continue
                try:
                    fl, fl_res = time_flex(q, k, v, dout, recall, bs, it)
                    diffs = {n: rel(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), fl_res, ours_res)}
                    frow = dict(S=S, bs=bs, recall=recall, engine="flex", density=dens, **fl,
                                speedup_vs_dense=best_dense / fl["total"], vs_ours=diffs)
                    rows.append(frow)
                    log(f"S={S} bs={bs} p={recall} flex: index {fl['index']:.2f} fwd {fl['fwd']:.2f} bwd "
                        f"{fl['bwd']:.2f} total {fl['total']:.2f} ms (blocks {fl['flex_block_density']:.4f}, compile "
                        f"{fl['compile_s']:.0f}s); x{best_dense / fl['total']:.2f} vs best dense; ours x"
                        f"{fl['total'] / ours['total']:.2f} faster all-in, "
                        f"x{(fl['fwd'] + fl['bwd']) / (ours['fwd'] + ours['bwd']):.2f} "
                        f"kernels; rel diff flex vs ours " + " ".join(f"{a}={b:.1e}" for a, b in diffs.items()))
                    del fl_res
                except Exception as e:  # report and keep benchmarking the other variants
                    log(f"S={S} bs={bs} p={recall} flex failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                del index, ours_res
                torch.cuda.empty_cache()
        del q, k, v, dout
        torch.cuda.empty_cache()

    results["runs"] = rows
    results["subtile"] = dict(_triton_attention.SUBTILE)
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    log("\n| S | variant | pairs / blocks | index ms | fwd ms | bwd ms | total ms | kernels ms per 1% pairs | "
        "vs best dense |")
    log("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "variant" in r:
            log(f"| {r['S']} | {r['variant']} | 1 | - | {r['fwd']:.1f} | {r['bwd']:.1f} | {r['total']:.1f} | "
                f"{r['total'] / 100:.2f} | - |")
        else:
            dens = f"{r['density']:.3f} / {r.get('block_density', r.get('flex_block_density', 0)):.3f}"
            per = r.get("per_pct", (r["fwd"] + r["bwd"]) / (100 * r["density"]))
            log(f"| {r['S']} | {r['engine']} bs={r['bs']} p={r['recall']} | {dens} | {r['index']:.1f} | "
                f"{r['fwd']:.1f} | {r['bwd']:.1f} | {r['total']:.1f} | {per:.2f} | x{r['speedup_vs_dense']:.1f} |")
    return 0


def index_build_one(S: str, nv: str, ns: str, bs: str) -> int:
    """Child process of --index-build: one size; prints a JSON line (own process, so that
    ru_maxrss measures this build alone: peak resident memory above the inputs' baseline)."""
    import resource

    S, nv, ns, bs = int(S), int(nv), int(ns), int(bs)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    g = torch.Generator().manual_seed(0)
    vertical = torch.randint(0, S, (1, 1, nv), generator=g)
    # Half the slashes local (offsets < 4096, many share blocks), half anywhere: like estimated indices.
    slash = torch.cat([torch.randint(0, 4096, (1, 1, ns // 2), generator=g),
                       torch.randint(0, S, (1, 1, ns - ns // 2), generator=g)], -1)
    def build():
        return SparseIndex.from_lines(vertical, slash, S, bs)

    def transpose(index):
        return transpose_blocks_csr(index.block_ids, index.block_counts, index.n_blocks)

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_build, t_t = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        index = build()
        t1 = time.perf_counter()
        transpose(index)
        t_build.append(t1 - t0)
        t_t.append(time.perf_counter() - t1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The minimum of 5: the CPU machines are shared, and interference only ever adds time.
    print(json.dumps({"build_ms": 1e3 * min(t_build), "transpose_ms": 1e3 * min(t_t),
                      "peak_mb": (peak - base) / 1024, "listed": int(index.block_counts.sum()),
                      "cols": int(index.col_counts.sum())}))
    return 0


def index_build(seqs, block_sizes, nv: int, ns: int) -> int:
    """--index-build: the table of index building cost per size (SparseIndex.from_lines, the offset builder)."""
    import subprocess

    print(f"# index build, one head, {nv} verticals, {ns} slashes, CPU threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}")
    print("| S | block | builder | from_lines ms | transposed ms | peak MB above inputs | listed blocks | columns |")
    print("|---|---|---|---|---|---|---|---|")
    for S in seqs:
        for bs in block_sizes:
            for builder in ("offsets",):
                run = subprocess.run([sys.executable, "-m", "mtrain.bench.attention", "--index-build-one", str(S),
                                      str(nv), str(ns), str(bs)], capture_output=True, text=True)
                if run.returncode:
                    print(f"| {S} | {bs} | {builder} | failed: {run.stderr.strip().splitlines()[-1][:120]} |")
                    continue
                r = json.loads(run.stdout.strip().splitlines()[-1])
                print(f"| {S} | {bs} | {builder} | {r['build_ms']:.1f} | {r['transpose_ms']:.1f} | "
                      f"{r['peak_mb']:.0f} | {r['listed']} | {r['cols']} |", flush=True)
    return 0


def index_breakdown(q, k, recall, bs, Hkv, D, log):
    """Time the pieces of index building once each: the Triton scorer alone, the whole estimate with either
    scorer, and what the kernels derive from the index (transposed lists, backward plans)."""
    from mtrain.ops._triton_estimate import score_rows
    from mtrain.ops.estimate import scored_rows

    S = q.shape[1]
    rows = scored_rows(S, 64, 16, bs).to(q.device)
    t_score = timed(lambda: score_rows(q[:, rows], k, rows, bs, D ** -0.5), 3)
    t_est = {sc: timed(lambda sc=sc: estimate_vertical_slash(q, k, recall=recall, block_size=bs, scorer=sc), 3)
             for sc in ("triton", "torch")}
    index = estimate_vertical_slash(q, k, recall=recall, block_size=bs)
    from mtrain.ops import graphed

    t_graph = timed(lambda: graphed.estimate_graphed(q, k, recall=recall, block_size=bs), 3)  # warm-up captures
    same = graphed.same_index(graphed.estimate_graphed(q, k, recall=recall, block_size=bs), index)
    docs = (torch.arange(S, device=q.device) >= S // 3).long()[None]  # two packed documents
    t_docs = timed(lambda: estimate_vertical_slash(q, k, recall=recall, block_size=bs, doc_ids=docs), 3)
    t_graph_docs = timed(lambda: graphed.estimate_graphed(q, k, recall=recall, block_size=bs, doc_ids=docs), 3)
    same_docs = graphed.same_index(graphed.estimate_graphed(q, k, recall=recall, block_size=bs, doc_ids=docs),
                                   estimate_vertical_slash(q, k, recall=recall, block_size=bs, doc_ids=docs))
    log(f"   estimate with two documents: eager {t_docs:.2f}, replayed from a CUDA graph {t_graph_docs:.2f} ms (same "
        f"index as eager: {same_docs})")
    t_t = timed(lambda: transpose_blocks_csr(index.block_ids, index.block_counts, index.n_blocks), 3)
    t_prep = timed(lambda: _triton_attention.prepare_backward(
        SparseIndex(index.block_ids, index.block_counts, index.col_ids, index.col_counts, S, bs), Hkv, D), 3)
    log(f"   index breakdown S={S} bs={bs}: scorer kernel ({rows.numel()} rows) {t_score:.2f}, estimate "
        f"(triton scorer) {t_est['triton']:.2f}, estimate replayed from a CUDA graph {t_graph:.2f} (same index as "
        f"eager: {same}), estimate (torch scorer) {t_est['torch']:.2f}, transpose {t_t:.2f}, "
        f"all backward plans {t_prep:.2f} ms (density {index.density():.3f})")


def profile_index(q, k, recall, bs, Hkv, D, log):
    """Where index building spends its time: the top GPU kernels and the wall time around them."""
    from torch.profiler import ProfilerActivity, profile

    def est():
        idx = estimate_vertical_slash(q, k, recall=recall, block_size=bs)
        _triton_attention.prepare_backward(idx, Hkv, D)

    est()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        est()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    log(f"   index profile S={q.shape[1]} bs={bs}:\n{table}")


def sweep(q, k, v, dout, pos, bs, log):
    """Time our kernels under a few (num_warps, num_stages) choices; keep the fastest per kernel."""
    index = estimate_vertical_slash(q, k, recall=0.95, block_size=bs)
    index.transposed_csr()
    args = dict(q_pos=pos, k_pos=pos, blocks=index.blocks, columns=index.columns, block_size=bs, plans=index._cache)
    out, lse = partial.attention_forward(q, k, v, **args)
    choices = [(4, 2), (4, 3), (8, 2), (8, 3)]
    for kernel in ("fwd", "dq", "dkdv", "col"):
        best = None
        for c in choices:
            _triton_attention.CUDA_LAUNCH[kernel] = c
            try:
                if kernel == "fwd":
                    t = timed(lambda: partial.attention_forward(q, k, v, **args), 5)
                else:
                    t = timed(lambda: partial.attention_backward(dout, q, k, v, out, lse, **args), 5)
            except Exception as e:  # a config that does not fit (shared memory) is skipped
                log(f"sweep bs={bs} {kernel} {c}: failed {type(e).__name__}")
                continue
            log(f"sweep bs={bs} {kernel} warps,stages={c}: {t:.2f} ms")
            if best is None or t < best[0]:
                best = (t, c)
        _triton_attention.CUDA_LAUNCH[kernel] = best[1]
        log(f"sweep bs={bs} {kernel}: keep {best[1]}")


if __name__ == "__main__":
    raise SystemExit(main())
