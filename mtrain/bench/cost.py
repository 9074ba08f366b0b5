"""Measurements behind the attention cost model (`mtrain.ops.cost`): dense attention (the `dense_attention`
path: SDPA cuDNN on the GPU) and our sparse kernels at controlled block/column counts, plus index building.

Prints one JSON line per measurement (and writes them to --out): shape, work counts, milliseconds. The
coefficients in `mtrain/ops/cost.py` are least-squares fits of these rows. GPU: bf16; `--cpu`: the CPU
path (fp32, small shapes, PyTorch partial path).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mtrain.bench.synthetic import band_lines
from mtrain.bench.timing import timed
from mtrain.errors import MtrainError
from mtrain.ops import SparseIndex, dense_attention, estimate_vertical_slash, vertical_slash_attention


def qkv(S, Hq, Hkv, D, device, dtype, grad):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, S, Hq, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, S, Hkv, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, S, Hkv, D, device=device, dtype=dtype, generator=g)
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v


def build_index(vert, slash, S, bs, Hkv, D, device, engine="auto"):
    index = SparseIndex.from_lines(vert, slash, S, bs)
    if device == "cuda":
        from mtrain.ops import _triton_attention

        _triton_attention.prepare_backward(index, Hkv, D)
        if engine == "fa4":
            from mtrain.ops.fa4 import prepare_fa4

            prepare_fa4(index, Hkv, D)
    return index


def work(index):
    return int(index.block_counts.long().sum()), int(index.col_counts.long().sum())


def bench_dense(S, Hq, Hkv, D, device, dtype, it):
    q, k, v = qkv(S, Hq, Hkv, D, device, dtype, True)
    dout = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            dense_attention(q, k, v, causal=True)

    def fwd_bwd():
        out = dense_attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    return dict(kind="dense", S=S, Hq=Hq, Hkv=Hkv, D=D, ms_fwd=timed(fwd, it), ms_fwd_bwd=timed(fwd_bwd, it))


def bench_sparse(S, Hq, Hkv, D, bs, frac, n_vert, device, dtype, it, engine="triton"):
    """One sparse row; engine: vertical_slash_attention's impl, with the backward a training layer runs for it
    (fa4: FA4's own, see mtrain.models.attention._deterministic_backward)."""
    q, k, v = qkv(S, Hq, Hkv, D, device, dtype, True)
    dout = torch.randn_like(q)
    vert, slash = band_lines(S, Hq, bs, frac, n_vert, device)
    index = build_index(vert, slash, S, bs, Hkv, D, device, engine)
    blocks, cols = work(index)
    kw = dict(impl=engine, deterministic=engine != "fa4")

    def fwd():
        with torch.no_grad():
            vertical_slash_attention(q, k, v, index, **kw)

    def fwd_bwd():
        out = vertical_slash_attention(q, k, v, index, **kw)
        torch.autograd.grad(out, (q, k, v), dout)

    row = dict(kind="sparse", S=S, Hq=Hq, Hkv=Hkv, D=D, bs=bs, n_vert=n_vert, blocks=blocks, cols=cols,
               block_frac=blocks / (Hq * (S // bs) * (S // bs + 1) / 2), density=index.density(), engine=engine,
               ms_fwd=timed(fwd, it), ms_fwd_bwd=timed(fwd_bwd, it),
               ms_index=timed(lambda: build_index(vert, slash, S, bs, Hkv, D, device, engine), it))
    return row


def bench_estimate(S, Hq, Hkv, D, bs, device, dtype, it, scorer="auto"):
    from mtrain.ops.estimate import estimate_rows

    q, k, _ = qkv(S, Hq, Hkv, D, device, dtype, False)
    index = estimate_vertical_slash(q, k, block_size=bs, scorer=scorer)
    return dict(kind="estimate", S=S, Hq=Hq, Hkv=Hkv, D=D, bs=bs, rows=estimate_rows(S, block_size=bs).numel(),
                scorer=scorer,
                density=index.density(),
                ms_estimate=timed(lambda: estimate_vertical_slash(q, k, block_size=bs, scorer=scorer), it))


def bench_graphed(S, Hq, Hkv, D, bs, device, dtype, it, engine="triton"):
    """The estimate as model layers run it on CUDA: replayed from a CUDA graph that also builds the index and the
    engine's plans (`estimate_graphed` with prepare=), the copy of its outputs included."""
    from mtrain.ops.estimate import estimate_rows
    from mtrain.ops.graphed import estimate_graphed

    q, k, _ = qkv(S, Hq, Hkv, D, device, dtype, False)

    def run():
        return estimate_graphed(q, k, block_size=bs, prepare=(engine, Hkv, D))

    for _ in range(3):  # compile, capture (and check against the eager estimate), replay
        index = run()
    return dict(kind="graphed", S=S, Hq=Hq, Hkv=Hkv, D=D, bs=bs, engine=engine,
                rows=estimate_rows(S, block_size=bs).numel(), density=index.density(), ms_estimate=timed(run, it))


def gpu_plan(engine="triton"):
    heads = {64: (9, 3), 128: (16, 2)}
    if engine == "fa4":  # the engine's sparse rows only, at the block size it runs (128)
        for D, (Hq, Hkv) in heads.items():
            for S in (32768, 131072):
                for frac in (0.01, 0.05, 0.15, 0.3):
                    yield ("sparse", S, Hq, Hkv, D, 128, frac, 0)
                yield ("sparse", S, Hq, Hkv, D, 128, 0.05, 2048)
        return
    for D, (Hq, Hkv) in heads.items():
        for S in (4096, 16384, 32768, 65536, 131072):
            yield ("dense", S, Hq, Hkv, D)
    for D, (Hq, Hkv) in heads.items():
        for S in (32768, 131072):
            for bs in (64, 128):
                for frac in (0.01, 0.05, 0.15, 0.3):
                    yield ("sparse", S, Hq, Hkv, D, bs, frac, 0)
                yield ("sparse", S, Hq, Hkv, D, bs, 0.05, 2048)
    for D, (Hq, Hkv) in heads.items():
        for S in (8192, 32768, 65536, 131072):
            yield ("estimate", S, Hq, Hkv, D, 64, "triton")
        yield ("estimate", 32768, Hq, Hkv, D, 64, "torch")  # the materialising scorer, for comparison
    for D, (Hq, Hkv) in heads.items():  # the graphed estimate with each engine's plans at its block size
        for S in (8192, 32768, 65536, 131072):
            yield ("graphed", S, Hq, Hkv, D, 64, "triton")
            yield ("graphed", S, Hq, Hkv, D, 128, "fa4")
    for S in (8192, 65536):  # the length term of the sparse fixed cost
        yield ("sparse", S, 9, 3, 64, 64, 0.05, 0)
        yield ("sparse", S, 9, 3, 64, 64, 0.3, 0)


def cpu_plan():
    # the tiny default's heads (4/2 x 32) and SmolLM2-135M's (9/3 x 64), as the CPU runs them
    for (Hq, Hkv, D), lengths in {(4, 2, 32): (2048, 4096, 8192), (9, 3, 64): (2048, 4096)}.items():
        for S in lengths:
            yield ("dense", S, Hq, Hkv, D)
            for frac in (0.1, 0.3, 0.6):
                yield ("sparse", S, Hq, Hkv, D, 64, frac, 0)
            yield ("sparse", S, Hq, Hkv, D, 64, 0.1, 256)


def validate(device, dtype, it, out) -> None:
    """Check the choice on index shapes the fits never saw: random slashes and verticals (a 1K local window
    plus n_s random offsets and n_v random columns), 32K-128K. Per case: predicted and measured ms of both
    paths (sparse = index + forward + backward), the path chosen, and its regret (measured time of the chosen
    path / the faster one)."""
    from mtrain.ops import cost

    rows = []
    for (Hq, Hkv, D), lengths in {(9, 3, 64): (32768, 65536, 131072), (16, 2, 128): (32768, 131072)}.items():
        for S in lengths:
            dense = bench_dense(S, Hq, Hkv, D, device, dtype, it)
            for n_s, n_v in ((16, 64), (64, 256), (256, 256), (1024, 1024), (4096, 2048)):
                g = torch.Generator(device=device).manual_seed(n_s + n_v)
                slash = torch.cat([torch.arange(1024, device=device).expand(1, Hq, -1),
                                   torch.randint(1024, S, (1, Hq, n_s), device=device, generator=g)], -1)
                vert = torch.randint(0, S, (1, Hq, n_v), device=device, generator=g)
                q, k, v = qkv(S, Hq, Hkv, D, device, dtype, True)
                dout = torch.randn_like(q)
                index = build_index(vert, slash, S, 64, Hkv, D, device)
                blocks, cols = work(index)

                def fwd_bwd():
                    out = vertical_slash_attention(q, k, v, index)
                    torch.autograd.grad(out, (q, k, v), dout)

                sparse = timed(fwd_bwd, it) + timed(lambda: build_index(vert, slash, S, 64, Hkv, D, device), it)
                pred = cost.predict(blocks, cols, seq_len=S, heads=Hq, head_dim=D, block_size=64, device=device)
                measured = {"dense": dense["ms_fwd_bwd"], "sparse": sparse}
                row = dict(kind="validate", S=S, Hq=Hq, D=D, n_s=n_s, n_v=n_v, density=index.density(),
                           pred_dense=pred.dense_ms, pred_sparse=pred.sparse_ms, ms_dense=measured["dense"],
                           ms_sparse=sparse, chosen=pred.path, regret=measured[pred.path] / min(measured.values()))
                rows.append(row)
                line = json.dumps({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()})
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
                del q, k, v, dout, index
                torch.cuda.empty_cache()
    print("\n| S | heads x D | density | pred dense | pred sparse | dense ms | sparse ms | chosen | regret |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['S']} | {r['Hq']} x {r['D']} | {r['density']:.3f} | {r['pred_dense']:.1f} | {r['pred_sparse']:.1f} | "
              f"{r['ms_dense']:.1f} | {r['ms_sparse']:.1f} | {r['chosen']} | {r['regret']:.2f} |")


def _fit(X, y):
    """Least squares on relative error with non-negative coefficients (a negative term is dropped and the
    rest refitted): returns (coefficients, worst relative error)."""
    import numpy as np

    X, y = np.asarray(X, float), np.asarray(y, float)
    keep = np.ones(X.shape[1], bool)
    while True:
        c = np.zeros(X.shape[1])
        c[keep], *_ = np.linalg.lstsq(X[:, keep] / y[:, None], np.ones_like(y), rcond=None)
        if (c >= 0).all():
            return c, float(np.abs(X @ c / y - 1).max())
        keep &= c > 0


def fit(path: str, table_json: str | None = None) -> dict:
    """Print the cost-table coefficients (`mtrain.ops.cost.CostTable` fields) fitted to the rows of `path`, for
    the kinds it holds; with table_json, also write them there as a table override (MTRAIN_COST_TABLE)."""
    rows = [json.loads(line) for line in open(path)]
    modes = {"train": "ms_fwd_bwd", "eval": "ms_fwd"}
    dense, sparse, out = {}, {}, {}
    for D in sorted({r["D"] for r in rows}):
        d = [r for r in rows if r["kind"] == "dense" and r["D"] == D]
        for mode, key in modes.items() if d else ():
            c, err = _fit([[1, r["Hq"] * r["S"] ** 2 / 2 * D / 1e12] for r in d], [r[key] for r in d])
            dense.setdefault(D, {})[mode] = tuple(round(float(x), 4) for x in c)
            print(f"# dense D={D} {mode}: worst relative error {err:.2f}")
        for bs in sorted({r["bs"] for r in rows if r["kind"] == "sparse" and r["D"] == D}):
            s = [r for r in rows if r["kind"] == "sparse" and r["D"] == D and r["bs"] == bs]
            X = [[1, r["Hq"] * r["S"] / 1e6, r["blocks"] * bs * bs * D / 1e12, r["cols"] * bs * D / 1e12] for r in s]
            for mode, key in modes.items():
                c, err = _fit(X, [r[key] for r in s])
                sparse.setdefault((D, bs), {})[mode] = tuple(round(float(x), 4) for x in c)
                print(f"# sparse D={D} bs={bs} {mode}: worst relative error {err:.2f}")
    if dense:
        out["dense"] = dense
        print(f"dense={dense}")
    if sparse:
        out["sparse"] = sparse
        print(f"sparse={sparse}")
    s = [r for r in rows if r["kind"] == "sparse"]
    if s:
        c, err = _fit([[1, r["Hq"] * r["S"] / 1e6, r["blocks"] / 1e6, r["cols"] / 1e6] for r in s],
                      [r["ms_index"] for r in s])
        print(f"# index: worst relative error {err:.2f}")
        out["index"] = tuple(round(float(x), 4) for x in c)
        print(f"index={out['index']}")
    for kind in ("estimate", "graphed"):
        e = [r for r in rows if r["kind"] == kind and "rows" in r and r.get("scorer", "auto") != "torch"]
        if e:
            ce, err = _fit([[1, r["Hq"] * r["rows"] * r["S"] / 1e9] for r in e], [r["ms_estimate"] for r in e])
            out[kind] = tuple(round(float(x), 4) for x in ce)
            print(f"# {kind}: worst relative error {err:.2f}")
            print(f"{kind}={out[kind]}")
    if table_json:
        from mtrain.ops.cost import write_override

        write_override(table_json, out, source=f"mtrain bench cost --fit {path}")
        print(f"# wrote {table_json}: MTRAIN_COST_TABLE={table_json} makes the cost model use these figures")
    return out


UNITS = {"ms0": "ms", "per_unit": "ms/dense unit", "per_row": "ms/row unit", "per_block": "ms/block unit",
         "per_column": "ms/column unit", "per_1e6_blocks": "ms/1e6 block entries",
         "per_1e6_columns": "ms/1e6 column entries", "per_1e9": "ms/1e9 head-row-keys"}
"""The unit of each cost-table coefficient's result row (`mtrain.ops.cost`'s coefficient names)."""


def fitted_rows(fitted: dict, table: str, *, engine: str = "triton", gpu: str, versions: str, command: str,
                date: str | None = None, commit: str | None = None) -> list[dict]:
    """`fit`'s coefficients as result rows (benchmarks/results.jsonl's format) under cost.TABLE., in the layout
    `mtrain.ops.cost.table_from` reads (`python scripts/measured_asset.py` then makes them the built-in table's):
    dense.d64.train.ms0, sparse.d64_bs64.eval.per_row, index.ms0, estimate.per_1e9, ...; with `engine` other than
    triton the sparse coefficients go under engines.ENGINE. (they time that engine's kernels)."""
    import datetime

    from mtrain.ops.cost import COEFFICIENTS

    if not table or not table.replace("_", "").isalnum() or table != table.lower():
        raise MtrainError(f"--table {table!r}: a lower-case name of letters, digits and _ (e.g. h200)")
    rows, base = [], dict(date=date or datetime.date.today().isoformat(), commit=commit, gpu=gpu, versions=versions,
                          command=command, peer=None)

    def add(field: str, where: str, coeffs) -> None:
        for name, value in zip(COEFFICIENTS[field], coeffs):
            rows.append(dict(base, measure=f"cost.{table}.{where}.{name}", value=float(value), unit=UNITS[name],
                             note=f"fitted by mtrain bench cost --fit: {field} {where.split('.', 1)[-1]}"))

    for D, modes in fitted.get("dense", {}).items():
        for mode, coeffs in modes.items():
            add("dense", f"dense.d{D}.{mode}", coeffs)
    sparse = "sparse" if engine == "triton" else f"engines.{engine}"
    for (D, bs), modes in fitted.get("sparse", {}).items():
        for mode, coeffs in modes.items():
            add("sparse", f"{sparse}.d{D}_bs{bs}.{mode}", coeffs)
    for field in ("index", "estimate", "graphed"):
        if field in fitted:
            add(field, field, fitted[field])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="measure the CPU path (fp32) instead of the GPU")
    ap.add_argument("--out", default=None, help="also write the JSON lines here")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--fit", metavar="JSONL", help="fit the cost-table coefficients to measured rows and stop")
    ap.add_argument("--validate", action="store_true", help="time both paths on random-line indices and report "
                    "the cost model's choice and its regret (GPU)")
    ap.add_argument("--write-table", metavar="JSON", help="with --fit: also write the fitted figures as a cost-table "
                    "override file (read through MTRAIN_COST_TABLE)")
    ap.add_argument("--only", nargs="+", choices=("dense", "sparse", "estimate", "graphed"),
                    help="measure only these kinds (e.g. --only estimate after an estimator change)")
    ap.add_argument("--engine", default="triton", choices=("triton", "fa4"),
                    help="block engine of the sparse rows (fa4: its sparse rows at block 128 only; fit them into "
                    "mtrain.ops.cost's CostTable.engines)")
    ap.add_argument("--rows", metavar="JSONL", help="with --fit: also append the fitted coefficients as result rows "
                    "(cost.TABLE.*) to this file, e.g. benchmarks/results.jsonl; then python scripts/measured_asset.py "
                    "makes them the built-in table")
    ap.add_argument("--table", default="h200", help="with --rows: the table's name in the rows' ids (cost.TABLE.*)")
    ap.add_argument("--gpu", help="with --rows: the machine the rows were measured on, e.g. '1x H200' (required)")
    ap.add_argument("--versions", help="with --rows: the measured stack, e.g. 'torch 2.11, triton 3.6' (required)")
    ap.add_argument("--commit", help="with --rows: the commit that measured them")
    args = ap.parse_args(argv)
    if args.rows and not (args.fit and args.gpu and args.versions):
        raise MtrainError("--rows needs --fit JSONL, --gpu and --versions (what the rows say they measured)")
    if args.fit:
        fitted = fit(args.fit, args.write_table)
        if args.rows:
            from mtrain.bench.results import append_rows

            command = f"python -m mtrain.bench.cost --out {args.fit}, then --fit {args.fit}"
            rows = fitted_rows(fitted, args.table, engine=args.engine, gpu=args.gpu, versions=args.versions,
                               command=command, commit=args.commit)
            append_rows(args.rows, rows)
            print(f"# appended {len(rows)} rows to {args.rows}: python scripts/measured_asset.py makes them the "
                  f"built-in cost.{args.table} table")
        return 0
    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    rows = []
    out = open(args.out, "w") if args.out else None
    if args.validate:
        validate(device, dtype, args.iters, out)
        return 0
    for spec in cpu_plan() if args.cpu else gpu_plan(args.engine):
        if args.only and spec[0] not in args.only:
            continue
        t0 = time.perf_counter()
        if spec[0] == "dense":
            row = bench_dense(*spec[1:], device, dtype, args.iters)
        elif spec[0] == "sparse":
            row = bench_sparse(*spec[1:], device, dtype, args.iters, args.engine)
        elif spec[0] == "graphed":
            row = bench_graphed(*spec[1:6], device, dtype, args.iters, *spec[6:])
        else:
            row = bench_estimate(*spec[1:6], device, dtype, args.iters, *spec[6:])
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        line = json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
        if device == "cuda":
            torch.cuda.empty_cache()
    print("\n| kind | S | heads | D | bs | block frac | fwd ms | fwd+bwd ms | index ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['S']} | {r['Hq']}/{r['Hkv']} | {r['D']} | {r.get('bs', '')} | "
              f"{r.get('block_frac', 1.0):.3f} | {r.get('ms_fwd', float('nan')):.2f} | "
              f"{r.get('ms_fwd_bwd', float('nan')):.2f} | {r.get('ms_index', r.get('ms_estimate', float('nan'))):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
