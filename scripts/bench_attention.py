"""Benchmark of vertical-slash sparse attention against dense SDPA (cuDNN, flash) and FlexAttention on the
same block mask: checks correctness at a small size first, then times every variant in one run (GPU)."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mtrain.ops import SparseIndex, estimate_vertical_slash, partial, reference  # noqa: E402
from mtrain.ops import _triton_attention  # noqa: E402
from mtrain.ops.index import transpose_blocks_csr  # noqa: E402
from mtrain.ops.reference import block_mask_from_lists  # noqa: E402


# ----------------------------------------------------------------------------- inputs
def rope(x: torch.Tensor, theta: float = 1e6) -> torch.Tensor:
    """Rotary embedding (half-split convention, as in Qwen2/Llama) of x [B, S, H, D] at positions 0..S-1."""
    B, S, H, D = x.shape
    inv = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    ang = torch.arange(S, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def make_inputs(S, Hq=16, Hkv=2, D=128, seed=0, device="cuda", dtype=torch.bfloat16):
    """RoPE'd queries/keys with vertical-slash structure (logits of 15-30 over a small noise floor, like
    trained heads): a shared per-kv-head direction in the fast-rotating RoPE dims (a local window with
    ripples), 4 attention sinks, 32 outlier keys per kv head (verticals), and 3 periodic offsets per
    query head planted as q_t += 0.8 k_{t-d} (slashes; periods 256..2048, shifted per head)."""
    g = torch.Generator(device=device).manual_seed(seed)
    G = Hq // Hkv

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32)

    def unit(*shape):
        x = randn(*shape)
        return x / x.norm(dim=-1, keepdim=True) * math.sqrt(shape[-1])

    fast = 16  # RoPE pairs 0..15 turn at least once every ~200 tokens
    u = torch.zeros(1, 1, Hkv, D, device=device)
    u[..., :fast] = randn(1, 1, Hkv, fast)
    u[..., D // 2 : D // 2 + fast] = randn(1, 1, Hkv, fast)
    u = u / u.norm(dim=-1, keepdim=True) * math.sqrt(D)
    k = rope(u.expand(1, S, Hkv, D).contiguous()) + 0.5 * randn(1, S, Hkv, D)
    q = rope(u.repeat_interleave(G, 2).expand(1, S, Hq, D).contiguous()) + 0.5 * randn(1, S, Hq, D)
    w = unit(1, 1, Hkv, D)
    k[:, :4] += 3 * w
    q += 0.5 * w.repeat_interleave(G, 2)
    w2 = unit(1, 1, Hkv, D)
    for h in range(Hkv):
        idx = torch.randint(4, S, (32,), generator=g, device=device)
        k[:, idx, h] += 3 * w2[:, :, h]
    q += 0.4 * w2.repeat_interleave(G, 2)
    planted = k.clone()
    for h in range(Hq):
        period = [256, 512, 1024, 2048][h % 4]
        for m in range(1, 4):
            d = period * m + 17 * (h // 4)
            if d < S:
                q[:, d:, h] += 0.8 * planted[:, : S - d, h // G]
    v = randn(1, S, Hkv, D)
    return (1.6 * q).to(dtype), k.to(dtype), v.to(dtype)


# ----------------------------------------------------------------------------- timing
def timed(fn, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() over `iters` runs, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # CPU smoke runs of this script: wall clock
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


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


# ----------------------------------------------------------------------------- FlexAttention
def flex_block_mask(index: SparseIndex):
    """The index as a Flex BlockMask: listed blocks plus the blocks holding its vertical columns (rounded
    up to whole blocks); the diagonal block is partial (causal mask_mod), all others full."""
    from torch.nn.attention.flex_attention import BlockMask

    n, bs = index.n_blocks, index.block_size
    flags = block_mask_from_lists(index.block_ids.long(), index.block_counts, n)
    cols = index.col_ids.long()
    ok = (torch.arange(cols.shape[-1], device=cols.device) < index.col_counts[..., None]) & (cols >= 0)
    cflags = torch.zeros(*flags.shape[:-1], n + 1, dtype=torch.bool, device=cols.device)
    cflags.scatter_(-1, torch.where(ok, cols // bs, n), True)
    flags = flags | cflags[..., :n]
    eye = torch.eye(n, dtype=torch.bool, device=flags.device)
    full = flags & ~eye & torch.ones(n, n, dtype=torch.bool, device=flags.device).tril()
    part = flags & eye

    def pack(f):
        order = torch.argsort((~f).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return f.sum(-1, dtype=torch.int32), order

    kv_num, kv_idx = pack(part)
    full_num, full_idx = pack(full)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=bs, mask_mod=causal)


# ----------------------------------------------------------------------------- checks
def correctness(device, bs, log, dtypes):
    """Ours (bf16 and fp32), Flex, against a float32/float64 reference with the materialized mask."""
    S, Hq, Hkv, D = 4096 + 40, 16, 2, 128  # ragged on purpose
    res = {}
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
            res_d.update({f"dq_{tag}": rel(dq, qr.grad), f"dk_{tag}": rel(dk, kr.grad), f"dv_{tag}": rel(dv, vr.grad)})
        assert torch.isfinite(out).all() and torch.isfinite(dq).all()
        res[str(dtype).replace("torch.", "")] = res_d
        log(f"check {dtype} S={S} bs={bs} density={index.density():.3f}: " +
            " ".join(f"{a}={b:.2e}" for a, b in res_d.items()))
        del qr, kr, vr, mask
        torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--recalls", type=float, nargs="+", default=[0.90, 0.95])
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench"), help="folder for the log and json")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--time-budget", type=float, default=480.0, help="skip the remaining variants after this many s")
    ap.add_argument("--check-dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--sweep", action="store_true", help="try launch configs of our kernels at the first size")
    ap.add_argument("--densities-only", action="store_true", help="print index densities (CPU ok) and stop")
    ap.add_argument("--index-build", nargs=2, type=int, metavar=("NV", "NS"),
                    help="time and peak memory of SparseIndex.from_lines + the transposed index for one head with NV "
                         "verticals and NS slashes: offset builder (ragged transpose) vs the previous flag-matrix "
                         "builder (padded transpose); CPU ok; then stop")
    ap.add_argument("--index-build-one", nargs=5, metavar=("BUILDER", "S", "NV", "NS", "BS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
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
        results["checks"][args.block_sizes[0]] = correctness(device, args.block_sizes[0], log, args.check_dtypes)
    except Exception as e:  # keep the timings even if a check cannot run; the failure is in the log
        log(f"check failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")

    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)

    Hq, Hkv, D = 16, 2, 128
    rows = []
    for si, S in enumerate(args.seqs):
        q, k, v = make_inputs(S, Hq, Hkv, D, seed=0, device=device)
        dout = torch.randn_like(q)
        pos = torch.arange(S, device=device)
        it = iters_for(S)
        dense = {}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                f_fwd, gqa = sdpa_fn(backend, q, k, v, False, dout)
                t_f = timed(f_fwd, it)
                f_all, _ = sdpa_fn(backend, q, k, v, True, dout)
                t_a = timed(f_all, it)
                dense[name] = (t_f, t_a)
                log(f"S={S} dense {name} (gqa={gqa}): fwd {t_f:.2f} ms fwd+bwd {t_a:.2f} ms "
                    f"({causal_flops(S, Hq, D, True) / t_a / 1e9:.0f} TFLOP/s)")
                rows.append(dict(S=S, variant=f"sdpa-{name}", fwd=t_f, total=t_a))
            except RuntimeError as e:
                log(f"S={S} dense {name}: unavailable ({str(e).splitlines()[0][:120]})")
            torch.cuda.empty_cache()
        best_dense = min((t[1] for t in dense.values()), default=float("nan"))

        for bs in args.block_sizes:
            if args.sweep and si == 0:
                sweep(q, k, v, dout, pos, bs, log)
            for recall in args.recalls:
                if time.time() - t_start > args.time_budget:
                    log(f"S={S} bs={bs} recall={recall}: skipped (time budget)")
                    continue

                def est():
                    idx = estimate_vertical_slash(q, k, recall=recall, block_size=bs)
                    _triton_attention.prepare_backward(idx, Hkv, D)
                    return idx

                t_idx = timed(est, it)
                index = est()
                if recall == args.recalls[0]:
                    index_breakdown(q, k, recall, bs, Hkv, D, log)
                t_est_only = timed(lambda: estimate_vertical_slash(q, k, recall=recall, block_size=bs), it)
                dens, bdens = index.density(), index.block_density()
                cols = float(index.col_counts.float().mean())
                fwd = lambda: partial.attention_forward(q, k, v, q_pos=pos, k_pos=pos, blocks=index.blocks,  # noqa
                                                        columns=index.columns, block_size=bs, plans=index._cache)
                t_fwd = timed(fwd, it)
                out, lse = fwd()
                t_bwd = timed(lambda: partial.attention_backward(
                    dout, q, k, v, out, lse, q_pos=pos, k_pos=pos, blocks=index.blocks, columns=index.columns,
                    block_size=bs, plans=index._cache), it)
                t_bwd_at = timed(lambda: partial.attention_backward(
                    dout, q, k, v, out, lse, q_pos=pos, k_pos=pos, blocks=index.blocks, columns=index.columns,
                    block_size=bs, plans=index._cache, deterministic=False), it)
                total = t_idx + t_fwd + t_bwd
                row = dict(S=S, bs=bs, recall=recall, density=dens, block_density=bdens, cols_per_row=cols,
                           index=t_idx, estimate=t_est_only, fwd=t_fwd, bwd=t_bwd, bwd_atomic=t_bwd_at, total=total,
                           speedup_vs_dense=best_dense / total)
                log(f"S={S} bs={bs} recall={recall}: density {dens:.4f} (blocks {bdens:.4f}, {cols:.0f} cols/row) "
                    f"index {t_idx:.2f} (estimate {t_est_only:.2f}) fwd {t_fwd:.2f} bwd {t_bwd:.2f} "
                    f"(atomic {t_bwd_at:.2f}) total {total:.2f} ms; x{best_dense / total:.2f} vs best dense")
                if flex is not None:
                    try:
                        t0 = time.time()
                        bm = flex_block_mask(index)
                        t_bm = timed(lambda: flex_block_mask(index), 3, warmup=0)
                        qh, kh, vh = (t.transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
                        doh = dout.transpose(1, 2).contiguous()
                        # Flex's default tiles are 128; a 64-token mask needs 64-token tiles in every kernel.
                        ko = {n: bs for n in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")}
                        ko = ko if bs < 128 else None
                        f_out, f_lse = flex(qh, kh, vh, block_mask=bm, enable_gqa=True, return_lse=True,
                                            kernel_options=ko)
                        row["flex_vs_ours_out"] = rel(out, f_out.transpose(1, 2))
                        row["flex_vs_ours_lse"] = rel(lse, f_lse)
                        t_ff = timed(lambda: flex(qh, kh, vh, block_mask=bm, enable_gqa=True, kernel_options=ko), it)

                        def flex_all():
                            o = flex(qh, kh, vh, block_mask=bm, enable_gqa=True, kernel_options=ko)
                            torch.autograd.grad(o, (qh, kh, vh), doh)

                        t_fa = timed(flex_all, it)
                        flex_density = float(bm.kv_num_blocks.float().mean() + bm.full_kv_num_blocks.float().mean())
                        flex_density /= (index.n_blocks + 1) / 2
                        row.update(flex_fwd=t_ff, flex_total=t_fa, flex_mask=t_bm, flex_block_density=flex_density,
                                   ours_vs_flex=(t_fa + t_est_only + t_bm) / total,
                                   ours_kernels_vs_flex=t_fa / (t_fwd + t_bwd))
                        log(f"   flex: mask {t_bm:.2f} fwd {t_ff:.2f} fwd+bwd {t_fa:.2f} ms (block density "
                            f"{flex_density:.4f}, compile+first {time.time() - t0:.0f}s); out rel diff vs ours "
                            f"{row['flex_vs_ours_out']:.2e}; ours kernels x{row['ours_kernels_vs_flex']:.2f}, "
                            f"ours total vs flex(+estimate+mask) x{row['ours_vs_flex']:.2f}")
                        del qh, kh, vh, f_out, f_lse
                    except Exception as e:  # report and keep benchmarking the other variants
                        log(f"   flex failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                row["dense_best"] = best_dense
                rows.append(row)
                del index, out, lse
                torch.cuda.empty_cache()
        del q, k, v, dout
        torch.cuda.empty_cache()

    results["runs"] = rows
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    log("\n| S | variant | density (pairs / blocks) | index ms | fwd ms | bwd ms | total ms | vs best dense | "
        "Flex fwd+bwd ms | ours vs Flex |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "variant" in r:
            log(f"| {r['S']} | {r['variant']} | 1 | - | {r['fwd']:.1f} | {r['total'] - r['fwd']:.1f} | "
                f"{r['total']:.1f} | - | - | - |")
        else:
            fl = f"{r['flex_total']:.1f}" if "flex_total" in r else "-"
            vs = f"x{r['ours_kernels_vs_flex']:.2f} kernels / x{r['ours_vs_flex']:.2f} all" if "flex_total" in r else "-"
            log(f"| {r['S']} | ours bs={r['bs']} p={r['recall']} | {r['density']:.3f} / {r['block_density']:.3f} | "
                f"{r['index']:.1f} | {r['fwd']:.1f} | {r['bwd']:.1f} (atomic {r['bwd_atomic']:.1f}) | "
                f"{r['total']:.1f} | x{r['speedup_vs_dense']:.1f} | {fl} | {vs} |")
    return 0


def index_build_one(builder: str, S: str, nv: str, ns: str, bs: str) -> int:
    """Child process of --index-build: one builder at one size; prints a JSON line (own process, so that
    ru_maxrss measures this build alone: peak resident memory above the inputs' baseline)."""
    import resource

    S, nv, ns, bs = int(S), int(nv), int(ns), int(bs)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    g = torch.Generator().manual_seed(0)
    vertical = torch.randint(0, S, (1, 1, nv), generator=g)
    # Half the slashes local (offsets < 4096, many share blocks), half anywhere: like estimated indices.
    slash = torch.cat([torch.randint(0, 4096, (1, 1, ns // 2), generator=g),
                       torch.randint(0, S, (1, 1, ns - ns // 2), generator=g)], -1)
    if builder == "flags":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from test_ops_index import flag_matrix_from_lines, flag_matrix_transpose

        def build():
            return SparseIndex(*flag_matrix_from_lines(vertical, slash, S, bs), S, bs)

        def transpose(index):
            return flag_matrix_transpose(index.block_ids, index.block_counts, index.n_blocks)
    else:
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
    """--index-build: the table of index building cost per size, flag-matrix builder vs offset builder."""
    import subprocess

    print(f"# index build, one head, {nv} verticals, {ns} slashes, CPU threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}")
    print("| S | block | builder | from_lines ms | transposed ms | peak MB above inputs | listed blocks | columns |")
    print("|---|---|---|---|---|---|---|---|")
    for S in seqs:
        for bs in block_sizes:
            for builder in ("flags", "offsets"):
                run = subprocess.run([sys.executable, os.path.abspath(__file__), "--index-build-one", builder, str(S),
                                      str(nv), str(ns), str(bs)], capture_output=True, text=True)
                if run.returncode:
                    print(f"| {S} | {bs} | {builder} | failed: {run.stderr.strip().splitlines()[-1][:120]} |")
                    continue
                r = json.loads(run.stdout.strip().splitlines()[-1])
                print(f"| {S} | {bs} | {builder} | {r['build_ms']:.1f} | {r['transpose_ms']:.1f} | "
                      f"{r['peak_mb']:.0f} | {r['listed']} | {r['cols']} |", flush=True)
    return 0


def index_breakdown(q, k, recall, bs, Hkv, D, log):
    """Time the pieces of index building once each (estimation, lines -> index, backward plans)."""
    from mtrain.ops.estimate import _select, last_query_probs, slash_scores

    B, S, Hq, _ = q.shape
    G = Hq // Hkv
    probs = last_query_probs(q, k, 64)
    t_probs = timed(lambda: last_query_probs(q, k, 64), 3)
    vert, sl = probs.sum(-2), slash_scores(probs)
    t_sel = timed(lambda: (_select(probs.sum(-2), recall, 4096, 16), _select(slash_scores(probs), recall, 4096, 16)), 3)
    v_idx = _select(vert, recall, 4096, 16).reshape(B, Hq, -1)
    s_idx = _select(sl, recall, 4096, 16).reshape(B, Hq, -1)
    t_lines = timed(lambda: SparseIndex.from_lines(v_idx, s_idx, S, bs), 3)
    index = SparseIndex.from_lines(v_idx, s_idx, S, bs)
    t_t = timed(lambda: transpose_blocks_csr(index.block_ids, index.block_counts, index.n_blocks), 3)
    t_prep = timed(lambda: _triton_attention.prepare_backward(
        SparseIndex(index.block_ids, index.block_counts, index.col_ids, index.col_counts, S, bs), Hkv, D), 3)
    log(f"   index breakdown S={S} bs={bs}: probs {t_probs:.2f} select {t_sel:.2f} from_lines {t_lines:.2f} "
        f"transpose {t_t:.2f} all backward plans {t_prep:.2f} ms (Nv {v_idx.shape[-1]}, Ns {s_idx.shape[-1]})")


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
    sys.exit(main())
