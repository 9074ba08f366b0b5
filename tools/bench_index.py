"""Index building on the GPU: SparseIndex.from_lines + transposed lists + column plan, and the deterministic
backward's work plans on top (`prepare_backward`: everything the sparse kernels read from an index), reference
builder vs the Triton builder, checked equal and for host syncs, plus the estimator's own cost. One table per run.

    python -m tools.bench_index                       # 32K/64K/128K, SmolLM2 and Qwen2.5-3B heads
    python -m tools.bench_index --seqs 4096 --reps 2  # quick (CPU: add TRITON_INTERPRET=1, tiny sizes)

Columns: "wall" = call to finished GPU work, from an idle GPU (host launch time included); "host" = time
until the call returns (the new builder does not wait for the GPU); "stream" = GPU stream time of the
call queued behind other GPU work (what a training step pays when the host runs ahead: host-side gaps
and synchronisations show up here, launch overhead does not). Medians of --reps runs.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch


from mtrain.bench.timing import wall_host_stream as timed
from mtrain.ops import SparseIndex, estimate_vertical_slash
from mtrain.ops.index import column_plan, kernel_column_chunk, pad_groups, transpose_blocks_csr

# name: (query heads, kv heads, head dim, block size)
MODELS = {"smollm2-135m": (9, 3, 64, 64), "qwen2.5-3b": (16, 2, 128, 128)}
# (verticals, slashes) per head: the ends of the ranges the estimator selects on real attention.
LINES = [(100, 50), (2000, 500)]


def make_lines(S: int, heads: int, nv: int, ns: int, device, seed: int = 0):
    """Verticals: 4 sinks + uniform key positions; slashes: half within 2048 tokens of the diagonal (they
    share blocks, like a local window), half anywhere. Distinct per head, -1 padded to equal width."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.cat([torch.arange(4).expand(1, heads, 4), torch.randint(4, S, (1, heads, nv - 4), generator=g)], -1)
    slash = torch.cat([torch.randint(0, 2048, (1, heads, ns // 2), generator=g),
                       torch.randint(0, S, (1, heads, ns - ns // 2), generator=g)], -1)
    slash[..., -1] = -1  # padding, as the estimator leaves it
    return vertical.to(device), slash.to(device)


def make_qk(S: int, hq: int, hkv: int, d: int, device, seed: int = 0):
    """bf16 q [1, S, Hq, D], k [1, S, Hkv, D]: RoPE-style rotations give logits that depend on q - k alone (a
    local window and ripples: slashes), plus a shared direction that makes 4 sinks and 32 outlier keys per
    KV head (verticals), over weak random attention."""
    g = torch.Generator(device=device).manual_seed(seed)
    pos = torch.arange(S, device=device, dtype=torch.float32)
    theta = 1e4 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    ang = pos[:, None] * theta[None, :]  # [S, D/2]
    w = math.sqrt(8.0 * math.sqrt(d) / (d // 2))  # logit 8 at q - k = 0
    rot = w * torch.stack([ang.cos(), ang.sin()], -1).flatten(-2)  # [S, D]
    q = rot[None, :, None, :] + 0.3 * torch.randn(1, S, hq, d, device=device, generator=g)
    k = rot[None, :, None, :] + 0.3 * torch.randn(1, S, hkv, d, device=device, generator=g)
    u = torch.nn.functional.normalize(torch.randn(hkv, d, device=device, generator=g), dim=-1)
    q += 1.5 * u.repeat_interleave(hq // hkv, 0)
    outliers = torch.cat([torch.arange(4, device=device), torch.randint(4, S, (32,), device=device, generator=g)])
    k[0, outliers] += (10.0 * math.sqrt(d) / 1.5) * u  # logit ~10 against every query
    return q.bfloat16(), k.bfloat16()


def build_old(vertical, slash, S, bs):
    index = SparseIndex.from_lines(vertical, slash, S, bs, impl="torch")
    transposed = transpose_blocks_csr(index.block_ids, index.block_counts, index.n_blocks)
    plan = column_plan(index.col_ids, index.col_counts, S, kernel_column_chunk(bs))
    return index, transposed, plan


def build_new(vertical, slash, S, bs):
    index = SparseIndex.from_lines(vertical, slash, S, bs, impl="triton")
    return index, index.transposed_csr(), index.column_plan(kernel_column_chunk(bs))


def same(old, new) -> str:
    """'ok' when the new builder's lists equal the reference's (up to the reference's widths, padding beyond),
    else what differs."""
    (o, o_t, o_p), (n, n_t, n_p) = old, new

    def padded(a, b, pad):
        w = a.shape[-1]
        return b.shape[:-1] == a.shape[:-1] and torch.equal(a, b[..., :w]) and bool((b[..., w:] == pad).all())

    k = o_p.q_ids.shape[2]
    checks = {
        "block lists": torch.equal(o.block_counts, n.block_counts) and padded(o.block_ids, n.block_ids, -1),
        "columns": torch.equal(o.col_counts, n.col_counts) and padded(o.col_ids, n.col_ids, -1),
        "transposed": torch.equal(o_t[2], n_t[2]) and torch.equal(pad_groups(*o_t), pad_groups(*n_t)),
        "column plan": padded(o_p.universe, n_p.universe, -1) and torch.equal(o_p.counts, n_p.counts[:, :, :k])
        and padded(o_p.q_ids, n_p.q_ids[:, :, :k], -1) and padded(o_p.bits, n_p.bits[:, :, :k], 0)
        and bool((n_p.counts[:, :, k:] == 0).all()),
    }
    bad = [name for name, ok in checks.items() if not ok]
    return "ok" if not bad else "DIFFERS: " + ", ".join(bad)


def kernels_agree(vertical, slash, S: int, hq: int, hkv: int, d: int, bs: int, device) -> str:
    """Forward + deterministic backward through the Triton kernels (bf16) with the reference index and with the
    new one (wider padding, its own transposed lists and column plan): 'identical' when out and all grads
    are bitwise equal."""
    from mtrain.ops import vertical_slash_attention

    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(1, S, h, d, device=device, generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    results = []
    for impl in ("torch", "triton"):
        index = SparseIndex.from_lines(vertical, slash, S, bs, impl=impl)
        assert int(index.col_counts.sum()) > 0  # the column backward is exercised
        qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
        out = vertical_slash_attention(qi, ki, vi, index, impl="triton", deterministic=True)
        out.backward(torch.ones_like(out))
        results.append((out, qi.grad, ki.grad, vi.grad))
    names = ("out", "dq", "dk", "dv")
    rel = {n: float((a.float() - b.float()).norm() / b.float().norm()) for n, a, b in zip(names, *results)
           if not torch.equal(a, b)}
    if not rel:
        return "identical"
    # The work split (`_split_work`) counts only targets with work, so the new plan's extra empty column chunks
    # change nothing: any difference, even in the last bit, is a fault.
    return "DIFFER: " + ", ".join(f"{n} rel {r:.1e}" for n, r in rel.items())


def column_add_times(S: int, hq: int, hkv: int, d: int, nv: int, reps: int, device) -> tuple[float, float]:
    """Stream ms of adding the columns' dK/dV into dK/dV rows: `column_add` (one kernel, no host sync) vs the
    indexed adds it replaced (per GQA step g, rows += cols; lists prebuilt, so only the adds are timed)."""
    from mtrain.ops._triton_attention import column_add

    group = hq // hkv
    g = torch.Generator(device=device).manual_seed(3)
    # Heads draw their columns independently: the heads of a group share some, so the order of the adds counts.
    universe = torch.stack([torch.randperm(S, device=device, generator=g)[:nv].sort().values for _ in range(hq)])
    universe = universe[None].int()
    dk, dv = (torch.randn(1, S, hkv, d, device=device, generator=g) for _ in range(2))
    dkc, dvc = (torch.randn(1, hq, nv, d, device=device, generator=g) for _ in range(2))
    h = torch.arange(hq, device=device)[:, None].expand(hq, nv).flatten()
    rows = universe.flatten().long() * hkv + h // group
    src = h * nv + torch.arange(nv, device=device).repeat(hq)
    steps = [(rows[h % group == s], src[h % group == s]) for s in range(group)]

    def indexed():
        fk, fv, sk, sv = dk.view(-1, d), dv.view(-1, d), dkc.view(-1, d), dvc.view(-1, d)
        for r, c in steps:
            fk[r] += sk[c]
            fv[r] += sv[c]

    want_k, want_v = dk.clone(), dv.clone()
    indexed()
    got_k, got_v = dk.clone(), dv.clone()
    dk.copy_(want_k), dv.copy_(want_v)
    column_add(dk, dv, dkc, dvc, universe, group)
    if not (torch.equal(dk, got_k) and torch.equal(dv, got_v)):
        raise SystemExit("column add: the kernel differs from the indexed adds")
    return (timed(lambda: column_add(dk, dv, dkc, dvc, universe, group), reps)["stream"],
            timed(indexed, reps)["stream"])


def nbytes(built) -> float:
    index, transposed, plan = built
    ts = [index.block_ids, index.block_counts, index.col_ids, index.col_counts, *transposed,
          plan.universe, plan.q_ids, plan.bits, plan.counts]
    return sum(t.numel() * t.element_size() for t in ts) / 2**20


def syncs_of(fn) -> str:
    """'none' when fn() runs under torch.cuda.set_sync_debug_mode('error'), else the first sync's message."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as err:
        return str(err).splitlines()[0][:60]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cap-bound", action="store_true", default=True,
                    help="also a row at the estimator's caps (4096 verticals, 4096 slashes) at the longest length")
    ap.add_argument("--no-cap-bound", dest="cap_bound", action="store_false")
    ap.add_argument("--skip-estimate", action="store_true")
    ap.add_argument("--kernel-check-seq", type=int, default=32768,
                    help="length of the bf16 forward+backward run with both indices (0: skip)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_index.py times GPU index building: no CUDA device here", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    from mtrain.ops import _triton_attention

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; batch 1; medians of {args.reps}")
    rows, failures = [], 0
    for model in args.models:
        hq, hkv, d, bs = MODELS[model]
        for S in args.seqs:
            cases = list(LINES) + ([(4096, 4096)] if args.cap_bound and S == max(args.seqs) else [])
            for nv, ns in cases:
                vertical, slash = make_lines(S, hq, nv, ns, dev, seed=S + nv)
                old, new = build_old(vertical, slash, S, bs), build_new(vertical, slash, S, bs)
                check = same(old, new)
                failures += check != "ok"
                t_old = timed(lambda: build_old(vertical, slash, S, bs), args.reps)
                t_new = timed(lambda: build_new(vertical, slash, S, bs), args.reps)

                def with_plans():
                    index = build_new(vertical, slash, S, bs)[0]
                    _triton_attention.prepare_backward(index, hkv, d)

                t_plans = timed(with_plans, args.reps)
                rows.append((model, S, bs, hq, nv, ns, t_old, t_new, t_plans, syncs_of(with_plans), nbytes(old),
                             nbytes(new), check))
                print(f"  {model} S={S} Nv={nv} Ns={ns}: old {t_old['wall']:.2f} new {t_new['wall']:.2f} ms "
                      f"(stream {t_new['stream']:.2f}; + plans {t_plans['stream']:.2f}) {check}", flush=True)
    if args.kernel_check_seq:
        print()
        for model in args.models:
            hq, hkv, d, bs = MODELS[model]
            S = args.kernel_check_seq
            vertical, slash = make_lines(S, hq, 2000, 500, dev, seed=7)
            check = kernels_agree(vertical, slash, S, hq, hkv, d, bs, dev)
            failures += check.startswith("DIFFER")
            print(f"kernels (bf16 fwd + deterministic bwd), {model} S={S} Nv=2000 Ns=500, reference index vs new: "
                  f"{check}", flush=True)
            t_add, t_indexed = column_add_times(S, hq, hkv, d, 2000, args.reps, dev)
            print(f"column dK/dV add, {model} S={S}, 2000 columns per head: kernel {t_add:.3f} ms vs indexed adds "
                  f"{t_indexed:.3f} ms (stream; bitwise equal)", flush=True)
    print()
    print("| model | S | block | Hq | Nv / Ns | old wall ms | old stream ms | new wall ms | new host ms | "
          "new stream ms | speedup (stream) | new + work plans: wall / host / stream ms | host syncs (new + plans) | "
          "MB old / new | lists equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, S, bs, hq, nv, ns, t_old, t_new, t_plans, syncs, mb_old, mb_new, check in rows:
        print(f"| {model} | {S // 1024}K | {bs} | {hq} | {nv} / {ns} | {t_old['wall']:.2f} | {t_old['stream']:.2f} | "
              f"{t_new['wall']:.2f} | {t_new['host']:.2f} | {t_new['stream']:.2f} | "
              f"{t_old['stream'] / t_new['stream']:.1f}x | {t_plans['wall']:.2f} / {t_plans['host']:.2f} / "
              f"{t_plans['stream']:.2f} | {syncs} | "
              f"{mb_old:.0f} / {mb_new:.0f} | {check} |")

    if not args.skip_estimate:
        print()
        print("Estimation: estimate_vertical_slash in all (scores, selection, SparseIndex.from_lines and whatever the "
              "estimator adds), and lines -> index alone on the lines it chose:")
        print("| model | S | estimate in all, wall / stream ms | lines -> index (new), wall / stream ms | "
              "rest of the estimate, stream ms | Nv / Ns chosen (max per head) |")
        print("|---|---|---|---|---|---|")
        real_from_lines = SparseIndex.from_lines.__func__
        for model in args.models:
            hq, hkv, d, bs = MODELS[model]
            for S in args.seqs:
                q, k = make_qk(S, hq, hkv, d, dev)
                seen = {}

                def capture(cls, vertical, slash, *a, **kw):
                    seen["lines"] = (vertical, slash)
                    return real_from_lines(cls, vertical, slash, *a, **kw)

                SparseIndex.from_lines = classmethod(capture)
                try:
                    t_est = timed(lambda: estimate_vertical_slash(q, k, recall=0.95, block_size=bs), args.reps)
                finally:
                    SparseIndex.from_lines = classmethod(real_from_lines)
                vertical, slash = seen["lines"]
                t_lines = timed(lambda: build_new(vertical, slash, S, bs), args.reps)
                nv, ns = int((vertical >= 0).sum(-1).max()), int((slash >= 0).sum(-1).max())
                print(f"| {model} | {S // 1024}K | {t_est['wall']:.2f} / {t_est['stream']:.2f} | "
                      f"{t_lines['wall']:.2f} / {t_lines['stream']:.2f} | {t_est['stream'] - t_lines['stream']:.2f} | "
                      f"{nv} / {ns} |", flush=True)
                del q, k
    failures += sum(r[9] != "none" for r in rows)
    if failures:
        print(f"{failures} failure(s): the new index differs from the reference (lists or kernel results), or "
              f"building it with its work plans synchronised with the host", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
