"""`mtrain bench documents`: dense causal attention over packed documents, fwd + bwd, on one GPU. Rows: FlashAttention-4's
varlen kernel called directly (the peer), mtrain's dense path with documents (`dense_attention(documents=)`, the
path training runs), SDPA once per document (cuDNN), flash-attn 2's varlen kernel where installed, and our Triton
partial kernels with document ids; then the gathered dense ring's rank (`mtrain.parallel.dense_gather`) of a CP=N
group under the zigzag layout, timed alone on the GPU (`mtrain.bench.emulate`: transfers as local fills, so a
bound), against CP=1's FA4 varlen at the same tokens per GPU, each mix as it is and `shifted` (every document
edge moved by half the first document: the short mix's documents then cross the chunks' edges). Every variant is checked against a float64 reference
(small case) and against FA4 at the timed shape before it is timed.

Mixes (`document_lengths`): "long", four documents in the proportions of a 128K pack of real long documents (53K /
41K / 25K / 12K: books and repositories), repeated every 128K tokens; "short", sixteen equal documents per 128K
(per S below 128K).
"""

from __future__ import annotations

import argparse
import json
import os
import time

LONG_SHARES = (53, 41, 25, 12)  # K tokens of the four documents of a real 128K pack (reference docs, docstrings,...)
UNIT = 131072
MIXES = ("long", "short")


def document_lengths(mix: str, seq_len: int) -> list[int]:
    """Document lengths summing to seq_len for a mix (module docstring); every unit of min(seq_len, 128K) tokens holds
    the same documents."""
    if mix not in MIXES:
        raise ValueError(f"document mix must be one of {', '.join(MIXES)}; got {mix!r}")
    unit = min(seq_len, UNIT)
    if seq_len % unit:
        raise ValueError(f"seq_len {seq_len} must be a multiple of {unit}")
    if mix == "short":
        if unit % 16:
            raise ValueError(f"the short mix splits {unit} tokens into 16 documents: use a multiple of 16")
        one = [unit // 16] * 16
    else:
        total = sum(LONG_SHARES)
        one = [unit * s // total for s in LONG_SHARES[:-1]]
        one.append(unit - sum(one))
    return one * (seq_len // unit)


def doc_ids_of(lengths, device):
    import torch

    return torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))[None]


def causal_pairs(lengths) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def _check_small(device, log) -> list[dict]:
    """Every varlen backend the GPU runs against a float64 reference on 4K tokens of mixed documents (bf16)."""
    import torch

    from mtrain.ops.backends import has_flash_attn
    from mtrain.ops.varlen import VARLEN_BACKENDS, Documents, document_attention, varlen_backend

    torch.manual_seed(0)
    lengths = [1500, 37, 1, 2000, 558]
    S, Hq, Hkv, D = sum(lengths), 8, 2, 128
    docs = Documents.from_doc_ids(doc_ids_of(lengths, "cpu"), device)
    q, k, v, dout = (torch.randn(1, S, h, D, device=device) for h in (Hq, Hkv, Hkv, Hq))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    want = document_attention(*ref, docs, backend="sdpa")  # float64: SDPA's math kernel per document
    want.backward(dout.double())
    rows = []
    for backend in VARLEN_BACKENDS:
        if backend == "fa4" and varlen_backend(q.bfloat16()) != "fa4":
            continue
        if backend == "flash_attn" and not has_flash_attn():
            continue
        got = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        out = document_attention(*got, docs, backend=backend)
        out.backward(dout.bfloat16())
        errs = {name: float((a.double() - b).abs().max()) for name, a, b in
                (("out", out.detach(), want.detach()), ("dq", got[0].grad, ref[0].grad),
                 ("dk", got[1].grad, ref[1].grad), ("dv", got[2].grad, ref[2].grad))}
        ok = errs["out"] < 2e-2 and max(errs["dq"], errs["dk"], errs["dv"]) < 8e-2
        rows.append({"backend": backend, **errs, "ok": ok})
        log(f"check {backend:10s} out {errs['out']:.1e} dq {errs['dq']:.1e} dk {errs['dk']:.1e} "
            f"dv {errs['dv']:.1e} {'ok' if ok else 'FAIL'}")
    # the gathered dense ring's rank 0 (documents crossing the shards' edges; the others' keys zero), as timed below:
    # relative Frobenius errors within the GPU gate's bf16 tolerances
    from mtrain.bench.check import TOL, dense_gather_case, rel

    for world in (2, 4):
        got, want = dense_gather_case(*(t.bfloat16() for t in (q, k, v)), docs.doc_ids, dout.bfloat16(), world)
        errs = {name: rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
        ok = errs["out"] < TOL[torch.bfloat16][0] and max(errs["dq"], errs["dk"], errs["dv"]) < TOL[torch.bfloat16][1]
        rows.append({"backend": f"ring-gather-cp{world}", **errs, "ok": ok})
        log(f"check ring CP={world} (relative) out {errs['out']:.1e} dq {errs['dq']:.1e} dk {errs['dk']:.1e} "
            f"dv {errs['dv']:.1e} {'ok' if ok else 'FAIL'}")
    return rows


def _time_one_device(S, heads, mix, iters, log) -> list[dict]:
    import torch

    from mtrain.bench.timing import timed
    from mtrain.ops.backends import fa4_runs, has_flash_attn, sdpa_attention
    from mtrain.ops.varlen import Documents, document_attention

    Hq, Hkv, D = heads
    lengths = document_lengths(mix, S)
    docs = Documents.from_doc_ids(doc_ids_of(lengths, "cpu"), "cuda")
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                     for i, h in enumerate((Hq, Hkv, Hkv, Hq)))
    seg = docs.segments
    variants = {}
    if fa4_runs(q):
        from flash_attn.cute import flash_attn_varlen_func

        variants["fa4-varlen"] = lambda: flash_attn_varlen_func(
            q[0], k[0], v[0], cu_seqlens_q=seg.cu_q, cu_seqlens_k=seg.cu_k, max_seqlen_q=seg.max_q,
            max_seqlen_k=seg.max_k, causal=True)[0][None]
    variants["mtrain"] = lambda: document_attention(q, k, v, docs)

    def per_document():
        pieces, at = [], 0
        for n in lengths:
            pieces.append(sdpa_attention(q[:, at:at + n], k[:, at:at + n], v[:, at:at + n], True, D ** -0.5))
            at += n
        return torch.cat(pieces, dim=1)

    variants["cudnn-per-doc"] = per_document
    if has_flash_attn():
        variants["fa2-varlen"] = lambda: document_attention(q, k, v, docs, backend="flash_attn")
    variants["triton"] = lambda: document_attention(q, k, v, docs, backend="triton")
    ref = None
    rows = []
    for name, fn in variants.items():
        out = fn()
        ref = out.detach() if ref is None else ref
        err = float((out.detach().float() - ref.float()).abs().max())

        def step():
            q.grad = k.grad = v.grad = None
            fn().backward(dout)

        ms = timed(step, iters, warmup=2)
        rows.append({"S": S, "heads": f"{Hq}/{Hkv}x{D}", "mix": mix, "docs": len(lengths), "variant": name, "ms": ms,
                     "max_diff_vs_first": err})
    peer = rows[0]["ms"]
    for row in rows:
        row["speed_vs_peer"] = peer / row["ms"]
        log(f"{S:>7} {row['heads']:>10} {mix:5s} {row['variant']:14s} {row['ms']:9.2f} ms  x{row['speed_vs_peer']:.3f} "
            f"of {rows[0]['variant']}  (diff {row['max_diff_vs_first']:.1e})")
    return rows


def shifted(lengths: list[int]) -> list[int]:
    """The same documents moved by half the first one (its second half last): every edge between documents moves, so
    a pack whose documents each lay inside one rank's zigzag chunk then has one crossing every chunk's edge."""
    half = lengths[0] // 2
    return [lengths[0] - half, *lengths[1:], half] if half else list(lengths)


def _time_ring_rank(cp, tokens_per_gpu, heads, mix, iters, log, shift=False) -> dict:
    """The gathered dense ring's rank 0 of a zigzag CP group, emulated on one GPU, against CP=1's FA4 varlen on the
    same mix (per-GPU rate: causal pairs per ms). shift: the mix's documents `shifted`."""
    import torch

    from mtrain.bench.emulate import emulated_group
    from mtrain.bench.timing import timed
    from mtrain.ops.varlen import Documents, document_attention
    from mtrain.parallel.dense_gather import gathered_dense_attention, query_runs
    from mtrain.parallel.layout import Layout

    Hq, Hkv, D = heads
    S = tokens_per_gpu * cp
    lengths = document_lengths(mix, S)
    label = f"{mix}-shifted" if shift else mix
    if shift:
        lengths = shifted(lengths)
    docs = Documents.from_doc_ids(doc_ids_of(lengths, "cpu"), "cuda")
    layout = Layout.create("zigzag", world_size=cp)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, tokens_per_gpu, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                     for i, h in enumerate((Hq, Hkv, Hkv, Hq)))
    runs = query_runs(layout, S, 0)
    pos = layout.indices(S, 0)
    ids = docs.doc_ids[0].cpu()
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]])
    rank_pairs = int((pos - starts[ids[pos]] + 1).sum())  # each of the rank's rows sees its document's keys to itself

    with emulated_group(cp, 0) as grp:
        def step():
            q.grad = k.grad = v.grad = None
            gathered_dense_attention(q, k, v, runs, layout, grp, D ** -0.5, docs).backward(dout)

        ms = timed(step, iters, warmup=2)
    one_lengths = document_lengths(mix, tokens_per_gpu)
    one_docs = Documents.from_doc_ids(doc_ids_of(one_lengths, "cpu"), "cuda")

    def one_step():
        q.grad = k.grad = v.grad = None
        document_attention(q, k, v, one_docs).backward(dout)

    one_ms = timed(one_step, iters, warmup=2)
    rate = (rank_pairs / ms) / (causal_pairs(one_lengths) / one_ms)
    log(f"ring rank CP={cp} {tokens_per_gpu // 1024}K/GPU {Hq}/{Hkv}x{D} {label:13s}: rank 0 {ms:8.2f} ms "
        f"({rank_pairs / 1e9:.2f} G pairs) vs CP=1 {one_ms:8.2f} ms ({causal_pairs(one_lengths) / 1e9:.2f} G): "
        f"per-GPU rate {rate:.3f} of CP=1 (BOUND: transfers left out)")
    return {"cp": cp, "tokens_per_gpu": tokens_per_gpu, "heads": f"{Hq}/{Hkv}x{D}", "mix": label, "rank_ms": ms,
            "rank_pairs": rank_pairs, "cp1_ms": one_ms, "cp1_pairs": causal_pairs(one_lengths), "rate_vs_cp1": rate}


FIT_SEQS = (8192, 32768, 131072)


def fit_dense(heads_list, iters, log) -> dict:
    """The cost model's dense figures for the path training runs (`dense_attention(documents=)`, FA4's varlen kernel
    where it runs): ms of forward ("eval") and forward + backward ("train") on one document, the long mix and the short
    mix at 8K / 32K / 128K, least-squares fitted per head dim to ms0 + per_unit * unit, unit = Hq * causal pairs * D /
    1e12 (`mtrain.ops.cost.CostTable.dense`), weighted by 1 / ms. Returns {D: {mode: (ms0, per_unit)}} and logs the fit's worst error."""
    import torch

    from mtrain.bench.timing import timed
    from mtrain.ops.varlen import Documents, document_attention

    out = {}
    for Hq, Hkv, D in heads_list:
        points = {"train": [], "eval": []}
        for S in FIT_SEQS:
            for lengths in ([S], document_lengths("long", S), document_lengths("short", S)):
                docs = Documents.from_doc_ids(doc_ids_of(lengths, "cpu"), "cuda")
                q, k, v, dout = (torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                                 for i, h in enumerate((Hq, Hkv, Hkv, Hq)))
                unit = Hq * causal_pairs(lengths) * D / 1e12

                def train():
                    q.grad = k.grad = v.grad = None
                    document_attention(q, k, v, docs).backward(dout)

                with torch.no_grad():
                    points["eval"].append((unit, timed(lambda: document_attention(q, k, v, docs), iters, warmup=2)))
                points["train"].append((unit, timed(train, iters, warmup=2)))
        out[D] = {}
        for mode, pts in points.items():
            A = torch.tensor([[1.0, u] for u, _ in pts], dtype=torch.float64)
            y = torch.tensor([ms for _, ms in pts], dtype=torch.float64)
            # least squares of the relative error: the small calls' fixed cost counts as much as the large calls' rate
            ms0, per_unit = torch.linalg.lstsq(A / y[:, None], torch.ones_like(y)[:, None]).solution.flatten().tolist()
            ms0 = max(ms0, 0.0)
            worst = max(abs(ms0 + per_unit * u - ms) / ms for u, ms in pts)
            out[D][mode] = (round(ms0, 4), round(per_unit, 4))
            log(f"fit D={D} {mode}: ms0 {ms0:.4f} per unit {per_unit:.4f} (worst relative error {worst:.1%} over "
                f"{len(pts)} points: " + ", ".join(f"{ms:.2f}" for _, ms in pts) + " ms)")
    log(f"dense_engines fa4 (rows cost.h200.dense_engines.fa4.d<D>.<mode>.ms0 / .per_unit of benchmarks/results.jsonl, "
        f"then python scripts/measured_asset.py): {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtrain bench documents", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="*", default=[32768, 131072],
                    help="one-device sequence lengths (none: only the ring rank)")
    ap.add_argument("--heads", nargs="+", default=["16/2/128", "9/3/64"], help="HQ/HKV/D head shapes")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    ap.add_argument("--ring-cp", type=int, nargs="*", default=[2, 4, 8], help="CP sizes of the emulated ring rank")
    ap.add_argument("--ring-tokens", type=int, default=131072, help="tokens per GPU of the emulated ring rank")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--fit", action="store_true", help="also time the dense path at 8K-128K and fit the cost model's "
                    "dense figures (mtrain.ops.cost)")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench"), help="folder for the log and json")
    args = ap.parse_args(argv)
    heads = []
    for text in args.heads:
        parts = text.split("/")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) % int(parts[1]):
            ap.error(f"--heads {text!r}: want HQ/HKV/D, positive integers with HKV dividing HQ, e.g. 16/2/128")
        heads.append(tuple(int(p) for p in parts))
    for S in args.seqs:
        try:
            for mix in args.mixes:
                document_lengths(mix, S)
        except ValueError as err:
            ap.error(f"--seqs {S}: {err}")
    if any(cp < 2 for cp in args.ring_cp):
        ap.error("--ring-cp: CP sizes must be >= 2")
    import torch

    if not torch.cuda.is_available():
        print("mtrain bench documents times GPU kernels: no CUDA device here (the CPU tests check the same paths: "
              "tests/test_ops_varlen.py, tests/test_parallel_ring.py)")
        return 0
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "documents.log")

    def log(msg):
        print(msg, flush=True)
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    log(f"# mtrain bench documents {time.strftime('%Y-%m-%d %H:%M')} {torch.cuda.get_device_name()} torch "
        f"{torch.__version__}")
    result = {"check": _check_small("cuda", log), "one_device": [], "ring": []}
    for S in args.seqs:
        for h in heads:
            for mix in args.mixes:
                result["one_device"] += _time_one_device(S, h, mix, args.iters, log)
    for cp in args.ring_cp:
        for h in heads:
            for mix in args.mixes:
                for shift in (False, True):
                    result["ring"].append(_time_ring_rank(cp, args.ring_tokens, h, mix, args.iters, log, shift))
    if args.fit:
        result["fit"] = {str(d): modes for d, modes in fit_dense(heads, args.iters, log).items()}
    with open(os.path.join(args.out, "documents.json"), "w") as f:
        json.dump(result, f, indent=1)
    failed = [r["backend"] for r in result["check"] if not r["ok"]]
    if failed:
        log(f"FAILED checks: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
