"""Ring attention on one host's GPUs (torchrun --nproc_per_node 2 -m mtrain.bench.ring): dense and sparse ring
against CP=1 at equal tokens per GPU, PyTorch's context_parallel in the same run, and a per-phase breakdown.
`--cpu` runs the same code on gloo + the Triton interpreter at tiny sizes (a smoke test of the script)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import traceback
import warnings

if "--cpu" in sys.argv:  # the Triton kernels read this when mtrain.ops' Triton module is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtrain.bench import timing  # noqa: E402
from mtrain.bench.synthetic import window_slash_lines  # noqa: E402
from mtrain.data.texts import TEXT_KINDS  # noqa: E402
from mtrain.ops import SparseIndex  # noqa: E402
from mtrain.ops.columns import list_free_bytes  # noqa: E402
from mtrain.ops.index import list_bytes, used_list_bytes  # noqa: E402
from mtrain.ops.switches import DEFAULTS, Switches  # noqa: E402
from mtrain.ops.attention import resolve_impl, vertical_slash_attention  # noqa: E402
from mtrain.ops.estimate import estimate_vertical_slash  # noqa: E402
from mtrain.parallel import Layout, SparseSettings, estimate_ring_index, ring_attention  # noqa: E402
from mtrain.parallel.comm import RingComm  # noqa: E402
from mtrain.parallel.estimate import estimate_index, estimate_lines, estimate_rank_index  # noqa: E402
from mtrain.parallel import estimate as estimate_module  # noqa: E402
from mtrain.parallel import graphed, ring_gather  # noqa: E402
from mtrain.parallel.graphed import estimate_rank_index_graphed  # noqa: E402
from mtrain.parallel.merge import GradSum, PartialAccumulator  # noqa: E402
from mtrain.parallel.plan import (  # noqa: E402
    build_sparse_plan, dense_plan, rank_blocks, shard_key_blocks, sparse_plan,
)
from mtrain.parallel.steps import (  # noqa: E402
    ColumnGather, finish_column_grads, start_column_grad_reduce, step_backward, step_forward,
)

DTYPE = torch.bfloat16  # fp32 under --cpu: the Triton interpreter's bf16 tl.dot is wrong


def _switches(args, **changes) -> Switches:
    """The switches the script's calls run with (`mtrain.ops.switches`, passed to each call): the recipe keys'
    defaults, the torch merge under --torch-merge, and `changes` (field=value) for one variant."""
    return dataclasses.replace(DEFAULTS, fused_merge=DEFAULTS.fused_merge and not args.torch_merge, **changes)


def _tokens(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        out.append(int(part[:-1]) * 1024 if part.endswith("K") else int(part))
    return out


_sync = timing.sync
# median ms per call, every rank in step before each call (a barrier, then the GPU idle)
timed = functools.partial(timing.timed, before=lambda: dist.barrier())  # looked up per call (--emulate-cp)


def count_host_syncs(fn, sites: list | None = None) -> int | None:
    """Host syncs (device-to-host waits) one call of fn makes, from CUDA's sync debug mode; None on the CPU.
    sites: a list that receives "file:line" of the Python line behind each sync."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    _sync()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync()
    hits = [w for w in seen if "synchroniz" in str(w.message)]
    if sites is not None:
        sites.extend(f"{'/'.join(w.filename.split('/')[-2:])}:{w.lineno}" for w in hits)
    return len(hits)


def lines(seq_len: int, heads: int, seed: int, window: int, far: int, verticals: int):
    """A fixed per-head budget (window + far slashes + verticals + sinks): the work per query row does not
    depend on the length, so tokens/s at CP=1 and CP=2 compare like for like."""
    return window_slash_lines(seq_len, heads, window=window, far=far, verticals=verticals, seed=seed)


def make_index(seq_len, args, device):
    vertical, slash = lines(seq_len, args.heads, 0, args.window, args.far_slashes, args.verticals)
    return SparseIndex.from_lines(vertical.to(device), slash.to(device), seq_len, args.block_size)


def inputs(seq_len, hq, hkv, dim, device, seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = [(1, seq_len, hq, dim), (1, seq_len, hkv, dim), (1, seq_len, hkv, dim), (1, seq_len, hq, dim)]
    return [torch.randn(s, generator=g, device=device, dtype=DTYPE) for s in shapes]


def sdpa_cudnn(q, k, v):
    """[B, S, H, D] in and out; SDPA's cuDNN backend, causal (any backend on the CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)


def fwd_bwd(fn, tensors, dout):
    leaves = [t.detach().requires_grad_(True) for t in tensors]

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dout)

    return run, leaves


def dense_flops(seq_len, heads, dim):
    return 7.0 * seq_len * seq_len * heads * dim  # causal fwd (2 S^2 H D) + bwd (2.5x fwd)


def check(rank, world, args, device, report, zero_peers: bool = False):
    """Ring vs single-GPU reference at a small length: max abs error of out and dq (and dk). zero_peers (an emulated
    rank, `--emulate-cp`): the given-index cases alone, against one device whose keys and values of every other rank
    are zero (what the rank sees there); dk is not compared (the others' rows' share of it never comes back)."""
    seq_len = args.check_len
    if zero_peers:
        cases = [("sparse", args.heads, args.kv_heads, "block-stripe", True)]
        if _hierarchical(args, world):  # the inner / outer rings over emulated nodes of --node-size ranks
            cases.append(("sparse-h", args.heads, args.kv_heads, "block-stripe", True))
        if "gather" in args.schedules:
            cases.append(("sparse-g", args.heads, args.kv_heads, "block-stripe", True))
        runs = [(c[0], c[3], functools.partial(_check_case, rank, world, args, device, seq_len, *c, zero_peers=True))
                for c in cases]
        # the estimated index (bounded widths) under the engine against our kernels
        runs += [(f"estimated{'-g' if schedule == 'gather' else ''} vs triton", "block-stripe",
                  functools.partial(_engine_case, rank, world, args, device, seq_len, schedule))
                 for schedule in args.schedules]
    else:
        cases = [("dense", args.heads, args.heads, "zigzag", False),
                 ("sparse", args.heads, args.kv_heads, "block-stripe", True),
                 ("estimated", args.heads, args.kv_heads, "block-stripe", "estimate")]
        if _hierarchical(args, world):
            cases.append(("sparse-h", args.heads, args.kv_heads, "block-stripe", True))
        # the estimated index with its columns list-free (as at the recipes' caps: `_list_free_limit`)
        cases.append(("estimated-lf", args.heads, args.kv_heads, "block-stripe", "estimate"))
        if "gather" in args.schedules:  # the gathered schedule on the same indexes
            cases += [("sparse-g", args.heads, args.kv_heads, "block-stripe", True),
                      ("estimated-g", args.heads, args.kv_heads, "block-stripe", "estimate"),
                      ("estimated-lf-g", args.heads, args.kv_heads, "block-stripe", "estimate")]
        runs = [(c[0], c[3], functools.partial(_check_one, rank, world, args, device, seq_len, *c)) for c in cases]
    for name, layout_name, run in runs:
        try:
            report.append(run())
        except Exception as exc:  # the other checks and the timings still run
            report.append({"check": name, "layout": layout_name, "error": f"{type(exc).__name__}: {exc}"})
            if rank == 0 or zero_peers:
                traceback.print_exc()


def _settings(args) -> SparseSettings:
    """The online estimate's settings: budgets as the given index's, so that the difference is the estimation
    itself (random inputs spread attention evenly; uncapped top-p would pick nearly every line)."""
    return SparseSettings(block_size=args.block_size, max_vertical=args.verticals,
                          max_slash=args.window + args.far_slashes)


def _estimated_ring(q, k, v, *, layout: Layout, settings: SparseSettings, schedule: str = "ring",
                    softmax_scale=None, switches=None, **ring):
    """`ring_attention` on the index estimated across the group first (`estimate_ring_index`), as an estimated layer
    runs: under the gathered schedule the group's K/V all-gather starts before the estimate (in flight while it
    runs; spare rows for the index's columns reserved from the settings). `ring`: ring_attention's other keywords."""
    gather = None
    if schedule == "gather" and dist.get_world_size() > 1:
        lists, n_local = q.shape[0] * q.shape[2], q.shape[1]
        spare = ring_gather.spare_bound(settings, lists, n_local * dist.get_world_size(), n_local)
        gather = ring_gather.KVGather(k, v, None, spare=spare)
    index = estimate_ring_index(q, k, layout=layout, settings=settings, softmax_scale=softmax_scale,
                                schedule=schedule, switches=switches)
    return ring_attention(q, k, v, layout=layout, index=index, softmax_scale=softmax_scale, schedule=schedule,
                          kv_gather=gather, switches=switches, **ring)


def _ring_call(q, k, v, layout: Layout, index, settings: SparseSettings | None, **kwargs):
    """`ring_attention` on `index`, or with `settings` on the index estimated first (`_estimated_ring`)."""
    if settings is not None:
        return _estimated_ring(q, k, v, layout=layout, settings=settings, **kwargs)
    return ring_attention(q, k, v, layout=layout, index=index, **kwargs)


def _estimate_one_device(q, k, settings: SparseSettings):
    # every SparseSettings field is an estimate_vertical_slash keyword of the same name
    return estimate_vertical_slash(q, k, **dataclasses.asdict(settings))


def line_differences(one_lines, ring_lines) -> dict:
    """How the ring's lines differ from one device's: (vertical [B, H, nv], slash [B, H, ns], ...) as the estimates
    cache them (`index._cache["lines"]`: key positions and token diagonals, -1 padded, any order), compared as sets
    per (batch, head). Counts of the verticals and slashes only one side chose, and the heads where any differ: a
    near-tie at the recall cutoff swaps one or two lines in a head, a fault in the estimate many."""
    counts = dict.fromkeys(("verticals_only_one_device", "verticals_only_ring", "slashes_only_one_device",
                            "slashes_only_ring", "heads_differing"), 0)
    (v1, s1), (v2, s2) = one_lines[:2], ring_lines[:2]
    for b in range(v1.shape[0]):
        for h in range(v1.shape[1]):
            differ = False
            for kind, mine, theirs in (("verticals", v1[b, h], v2[b, h]), ("slashes", s1[b, h], s2[b, h])):
                x, y = mine[mine >= 0], theirs[theirs >= 0]
                only_one, only_ring = int((~torch.isin(x, y)).sum()), int((~torch.isin(y, x)).sum())
                counts[f"{kind}_only_one_device"] += only_one
                counts[f"{kind}_only_ring"] += only_ring
                differ = differ or bool(only_one or only_ring)
            counts["heads_differing"] += differ
    return counts


def _list_free_limit(args, seq_len: int, world: int, heads: int) -> int:
    """A `Switches.static_width_bytes` (parallel.static_width_mib) under which a rank's estimated index at the
    script's budgets holds no column lists while its block lists fit: the list-free columns of the recipes' caps,
    with one host read under the ring schedule and static widths under the gathered one
    (`mtrain.parallel.estimate.rank_list_widths`)."""
    from mtrain.ops.estimate import line_caps

    s = _settings(args)
    _, cap_s = line_caps(seq_len, s.block_size, s.max_vertical, s.max_slash, s.cap_fraction)
    return estimate_module.lists_bytes(1, heads, seq_len // s.block_size // world, cap_s, 0)


def _check_one(rank, world, args, device, seq_len, name, hq, hkv, layout_name, sparse):
    if "-lf" not in name:
        return _check_case(rank, world, args, device, seq_len, name, hq, hkv, layout_name, sparse)
    return _check_case(rank, world, args, device, seq_len, name, hq, hkv, layout_name, sparse,
                       switches=_switches(args, static_width_bytes=_list_free_limit(args, seq_len, world, hq)))


def _check_case(rank, world, args, device, seq_len, name, hq, hkv, layout_name, sparse, zero_peers: bool = False,
                switches: Switches | None = None):
    switches = switches or _switches(args)
    q, k, v, dout = inputs(seq_len, hq, hkv, args.dim, device)
    hier = name.endswith("-h")
    layout = _layout(layout_name, world, args, hier)
    if zero_peers:  # the reference sees what an emulated rank sees: zeros for every other rank's keys and values
        held = torch.zeros(seq_len, dtype=torch.bool, device=device)
        held[layout.indices(seq_len, rank).to(device)] = True
        k, v = (torch.where(held[None, :, None, None], t, 0).contiguous() for t in (k, v))
    settings = _settings(args)
    index = None
    if sparse == "estimate":  # the one device's estimate of the whole sequence, the reference's index
        index = _estimate_one_device(q, k, settings)
    elif sparse:
        index = make_index(seq_len, args, device)
    impl = args.engine if args.engine != "auto" else resolve_impl("auto", device, args.block_size, q.dtype)
    run_ref, ref_leaves = fwd_bwd(
        (lambda a, b, c: vertical_slash_attention(a, b, c, index, impl=impl)) if sparse else sdpa_cudnn, (q, k, v),
        dout)
    ref_out = (vertical_slash_attention(q, k, v, index, impl=impl) if sparse else sdpa_cudnn(q, k, v)).float()
    run_ref()
    schedule = "gather" if name.endswith("-g") else "ring"
    row = {"check": name, "layout": layout_name, "seq_len": seq_len}
    shard = [layout.shard(t, rank) for t in (q, k, v, dout)]
    leaves = [t.detach().requires_grad_(True) for t in shard[:3]]
    if sparse == "estimate":
        pos = layout.indices(seq_len, rank).to(device)
        mine = estimate_rank_index(shard[0], shard[1], pos, pos, seq_len, settings, 1.0 / math.sqrt(args.dim), None,
                                   rows=rank_blocks(layout, seq_len, rank, args.block_size, device),
                                   key_blocks=shard_key_blocks(layout, seq_len, rank, args.block_size, device),
                                   schedule=schedule, switches=switches)
        row["list_free"] = mine.col_ids is None  # the ring's columns read list-free (`-lf` cases)
        row["static_widths"] = bool(mine._cache.get("static_widths"))
        want = index.block_ids[:, :, mine.rows]
        width = max(want.shape[-1], mine.block_ids.shape[-1])
        pad = lambda t: F.pad(t, (0, width - t.shape[-1]), value=-1)  # noqa: E731
        row["same_lines"] = bool(torch.equal(pad(want), pad(mine.block_ids))
                                 and torch.equal(index.block_counts[:, :, mine.rows], mine.block_counts)
                                 and torch.equal(index.col_counts[:, :, mine.rows], mine.col_counts))
        index = mine
        out = ring_attention(*leaves, group=None, layout=layout, index=index, engine=args.engine, schedule=schedule,
                             switches=switches)
    else:
        out = ring_attention(*leaves, group=None, layout=layout, index=index, engine=args.engine, schedule=schedule,
                             switches=switches, **_groups(args, hier))
    out.backward(shard[3])
    row["max_err_out"] = float((out.detach().float() - layout.shard(ref_out.detach(), rank)).abs().max())
    row["max_err_dq"] = float((leaves[0].grad.float() - layout.shard(ref_leaves[0].grad.float(), rank)).abs().max())
    row["max_err_dk"] = None if zero_peers else float(
        (leaves[1].grad.float() - layout.shard(ref_leaves[1].grad.float(), rank)).abs().max())
    return row


def _engine_case(rank, world, args, device, seq_len, schedule: str) -> dict:
    """The ring on this rank's online-estimated index under `--engine` against the same call under our Triton
    kernels (`mtrain.parallel.fa4_steps.resolve_engine`): max abs differences of out, dq, dk. Under an emulated group
    (`--emulate-cp`) the one check of the estimated path's plans (bounded widths) that needs no other rank's data."""
    q, k, v, dout = inputs(seq_len, args.heads, args.kv_heads, args.dim, device)
    layout = _layout("block-stripe", world, args, False)
    shard = [layout.shard(t, rank) for t in (q, k, v, dout)]
    runs = []
    for engine in (args.engine, "triton"):
        leaves = [t.detach().requires_grad_(True) for t in shard[:3]]
        out = _estimated_ring(*leaves, layout=layout, settings=_settings(args), engine=engine, schedule=schedule,
                              switches=_switches(args))
        out.backward(shard[3])
        runs.append([out.detach().float()] + [t.grad.float() for t in leaves[:2]])
    row = {"check": f"estimated{'-g' if schedule == 'gather' else ''} vs triton", "layout": "block-stripe",
           "seq_len": seq_len}
    for key, a, b in zip(("max_err_out", "max_err_dq", "max_err_dk"), *runs):
        row[key] = float((a - b).abs().max())
    return row


def _hierarchical(args, world: int) -> bool:
    return bool(args.node_size) and 1 < args.node_size < world


def _layout(name: str, world: int, args, hierarchical: bool) -> Layout:
    """The ring's layout; for the hierarchical ring the node-aware block-stripe (balanced steps)."""
    if hierarchical:
        return Layout.create(name, world_size=world, granularity=args.block_size, local_world_size=args.node_size)
    return Layout.create(name, world_size=world, granularity=args.block_size)


def _groups(args, hierarchical: bool) -> dict:
    """inner/outer groups of a hierarchical ring over nodes of --node-size ranks (collective, cached)."""
    if not hierarchical:
        return {}
    from mtrain.parallel.comm import hierarchical_groups

    inner, outer = hierarchical_groups(None, args.node_size)
    return {"inner_group": inner, "outer_group": outer}


def bench_tokens(tokens, rank, world, args, device, report):
    seq = tokens * world
    row = {"tokens_per_gpu": tokens, "cp": world, "list_free_columns": args.list_free_columns}

    def attempt(key, fn):
        try:
            row[key] = fn()
        except Exception as exc:  # one failing variant must not hide the others' numbers
            row[key] = None
            row[key + "_error"] = f"{type(exc).__name__}: {exc}"
            if rank == 0:
                traceback.print_exc()
        torch.cuda.empty_cache()

    h, hkv, d = args.heads, args.kv_heads, args.dim

    # dense, 16/16 heads x 128: the shape of BENCHMARKS.md "Ring attention on 2 GPUs" (PyTorch's context_parallel too)
    def cp1_dense():
        q, k, v, dout = inputs(tokens, h, h, d, device)
        run, _ = fwd_bwd(sdpa_cudnn, (q, k, v), dout)
        return timed(run, args.iters, args.warmup)

    def ring_dense():
        q, k, v, dout = inputs(seq, h, h, d, device)
        layout = Layout.create("zigzag", world_size=world)
        shard = [layout.shard(t, rank) for t in (q, k, v, dout)]
        del q, k, v, dout
        run, _ = fwd_bwd(lambda a, b, c: ring_attention(a, b, c, group=None, layout=layout,
                                                       switches=_switches(args)), shard[:3], shard[3])
        return timed(run, args.iters, args.warmup)

    def torch_cp():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda", (world,))
        q, k, v, dout = inputs(seq, h, h, d, device)
        qh, kh, vh, doh = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
        del q, k, v, dout
        buffers = [qh, kh, vh, doh]
        # buffers are resharded in place, which tensors that require grad refuse: ask for grad inside
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(buffers)):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for t in (qh, kh, vh):
                t.requires_grad_(True)

            def run():
                for t in (qh, kh, vh):
                    t.grad = None
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).backward(doh)

            return timed(run, args.iters, args.warmup)

    if not args.skip_dense:
        attempt("cp1_dense_ms", cp1_dense)
        attempt("ring_dense_ms", ring_dense)
    if args.skip_dense:
        row["torch_cp_dense_ms"], row["torch_cp_dense_ms_error"] = None, "skipped (--skip-dense)"
    elif device.type == "cuda":
        attempt("torch_cp_dense_ms", torch_cp)
    else:
        row["torch_cp_dense_ms"], row["torch_cp_dense_ms_error"] = None, "CUDA only (skipped under --cpu)"
    for key in ("cp1_dense", "ring_dense", "torch_cp_dense"):
        if row.get(key + "_ms"):
            n = tokens if key == "cp1_dense" else seq
            row[key + "_tflops_per_gpu"] = dense_flops(n, h, d) / (1 if key == "cp1_dense" else world) / (row[key + "_ms"] * 1e9)

    # sparse, Qwen2.5-3B heads (16 q / 2 kv), fixed per-row budget
    impl = args.engine if args.engine != "auto" else resolve_impl("auto", device, args.block_size, DTYPE)
    row["engine"] = impl

    def cp1_sparse():
        q, k, v, dout = inputs(tokens, h, hkv, d, device)
        index = make_index(tokens, args, device)
        row["density_cp1"] = index.block_density()
        run, _ = fwd_bwd(lambda a, b, c: vertical_slash_attention(a, b, c, index, impl=impl), (q, k, v), dout)
        return timed(run, args.iters, args.warmup)

    def cp1_sparse_estimated():
        """One GPU's online estimate + attention per call: the baseline of the ring's estimated variant."""
        q, k, v, dout = inputs(tokens, h, hkv, d, device)
        settings = _settings(args)
        row["estimate_cp1_ms"] = timed(lambda: _estimate_one_device(q, k, settings), args.iters, args.warmup)
        run, _ = fwd_bwd(lambda a, b, c: vertical_slash_attention(a, b, c, _estimate_one_device(a, b, settings),
                                                                  impl=impl), (q, k, v), dout)
        ms = timed(run, args.iters, args.warmup)
        if args.profile and device.type == "cuda":
            _profile(run, rank, f"cp1_sparse_estimated {tokens} tokens")
        return ms

    def ring_sparse(estimate: bool, schedule: str = "ring", graph: bool = False, backward: str | None = None):
        def go():
            # eager estimate unless this variant replays it from a CUDA graph; --list-free-columns: the estimated rank
            # index without column lists, as at the recipes' caps
            width = (_list_free_limit(args, seq, world, h) if args.list_free_columns
                     else DEFAULTS.static_width_bytes)
            return timed_variant(_switches(args, graph_ring_estimate=graph, static_width_bytes=width,
                                           gather_backward=backward or DEFAULTS.gather_backward))

        def timed_variant(switches):
            q, k, v, dout = inputs(seq, h, hkv, d, device)
            layout = Layout.create("block-stripe", world_size=world, granularity=args.block_size)
            index = None if estimate else make_index(seq, args, device)
            if index is not None:
                row["density_ring"] = index.block_density()
            settings = _settings(args) if estimate else None
            shard = [layout.shard(t, rank) for t in (q, k, v, dout)]
            del q, k, v, dout
            if estimate and schedule == "ring" and not graph:  # the estimate's own figures, once (eager and graphed)
                pos = layout.indices(seq, rank).to(device)
                scale = 1.0 / math.sqrt(d)
                est = dict(rows=rank_blocks(layout, seq, rank, args.block_size, device),
                           key_blocks=shard_key_blocks(layout, seq, rank, args.block_size, device))
                row["estimate_ring_ms"] = timed(lambda: estimate_rank_index_graphed(
                    shard[0], shard[1], pos, seq, settings, scale, None, layout_key=(layout.spec, rank),
                    switches=switches, **est), args.iters, args.warmup)  # eager
                if args.graph_estimate:
                    graphed_switches = dataclasses.replace(switches, graph_ring_estimate=True)
                    row["estimate_ring_graphed_ms"] = timed(lambda: estimate_rank_index_graphed(
                        shard[0], shard[1], pos, seq, settings, scale, None, layout_key=(layout.spec, rank),
                        switches=graphed_switches, **est), args.iters, max(args.warmup, 2))  # warms, then captures
                row["estimate_ring_lines_ms"] = timed(lambda: estimate_lines(
                    shard[0], shard[1], pos, pos, seq, settings, scale, None, key_blocks=est["key_blocks"]),
                    args.iters, args.warmup)
                mine = estimate_rank_index(shard[0], shard[1], pos, pos, seq, settings, scale, None,
                                           switches=switches, **est)
                origin = (rank + 1) % world
                row["plan_estimated_ms"] = timed(lambda: build_sparse_plan(mine, layout, rank, device, origin),
                                                 args.iters, args.warmup)
                row["density_ring_estimated"] = mine.density()
                row["index_bytes_per_layer"] = list_bytes(mine)
                row["index_bytes_used_widths"] = used_list_bytes(mine)
                row["index_bytes_cap_wide_cols"] = _cap_wide_column_bytes(mine, settings)
                row["index_bytes_list_free"] = list_free_bytes(mine)
                if args.torch_scorer:
                    row["estimate_ring_torch_ms"] = timed(lambda: estimate_rank_index(
                        shard[0], shard[1], pos, pos, seq, settings, scale, None, scorer="torch", switches=switches,
                        **est),
                        args.iters, args.warmup)
            run, _ = fwd_bwd(lambda a, b, c: _ring_call(a, b, c, layout, index, settings, engine=args.engine,
                                                       schedule=schedule, switches=switches),
                             shard[:3], shard[3])
            ms = timed(run, args.iters, args.warmup)
            if estimate and args.profile and device.type == "cuda":
                _profile(run, rank, f"ring_sparse_estimated ({schedule}{', graphed' if graph else ''}) CP={world} "
                                    f"{tokens} tokens/GPU")
            return ms
        return go

    attempt("cp1_sparse_ms", cp1_sparse)
    attempt("cp1_sparse_estimated_ms", cp1_sparse_estimated)
    if "ring" in args.schedules:
        attempt("ring_sparse_ms", ring_sparse(False))
        attempt("ring_sparse_estimated_ms", ring_sparse(True))
    if "gather" in args.schedules:
        attempt("ring_sparse_gather_ms", ring_sparse(False, "gather"))
        attempt("ring_sparse_estimated_gather_ms", ring_sparse(True, "gather"))
    if args.graph_estimate:  # the same estimated variants with the estimate replayed from a CUDA graph
        if "ring" in args.schedules:
            attempt("ring_sparse_estimated_graphed_ms", ring_sparse(True, graph=True))
        if "gather" in args.schedules:
            attempt("ring_sparse_estimated_gather_graphed_ms", ring_sparse(True, "gather", graph=True))
            if impl == "fa4":  # the gathered step's other backward under the fa4 engine (parallel.gather_backward)
                row["gather_backward"] = ring_gather.gathered_backward(impl, world, switches=_switches(args))
                other = "triton" if row["gather_backward"] == "fa4" else "fa4"
                attempt(f"ring_sparse_estimated_gather_graphed_{'tritonbwd' if other == 'triton' else 'fa4bwd'}_ms",
                        ring_sparse(True, "gather", graph=True, backward=other))

    def ring_sparse_hierarchical():
        q, k, v, dout = inputs(seq, h, hkv, d, device)
        layout = _layout("block-stripe", world, args, True)
        index = make_index(seq, args, device)
        shard = [layout.shard(t, rank) for t in (q, k, v, dout)]
        del q, k, v, dout
        groups = _groups(args, True)
        run, _ = fwd_bwd(lambda a, b, c: ring_attention(a, b, c, group=None, layout=layout, index=index,
                                                       engine=args.engine, switches=_switches(args), **groups),
                         shard[:3], shard[3])
        return timed(run, args.iters, args.warmup)

    if _hierarchical(args, world):
        attempt("ring_sparse_hierarchical_ms", ring_sparse_hierarchical)

    def sync_counts():
        """Host syncs of one fwd+bwd call after warm-up (plan and kernel data cached with the index)."""
        counts = {}
        cases = [("dense", h, "zigzag", False, "ring"), ("sparse", hkv, "block-stripe", True, "ring"),
                 ("estimated", hkv, "block-stripe", "estimate", "ring")]
        if "gather" in args.schedules:
            cases.append(("estimated_gather", hkv, "block-stripe", "estimate", "gather"))
        for label, hk, layout_name, sparse, schedule in cases:
            q, k, v, dout = inputs(tokens, h, hk, d, device)
            layout = Layout.create(layout_name, world_size=world, granularity=args.block_size)
            index = make_index(seq, args, device) if sparse is True else None
            settings = _settings(args) if sparse == "estimate" else None
            run, _ = fwd_bwd(lambda a, b, c: _ring_call(a, b, c, layout, index, settings, engine=args.engine,
                                                       schedule=schedule, switches=_switches(args)),
                             (q, k, v), dout)
            run()
            sites = []
            counts[f"{label}_ring_host_syncs"] = count_host_syncs(run, sites)
            if sites:  # where they come from (the Python line that made each)
                counts[f"{label}_ring_host_sync_sites"] = sorted(set(sites))
        return counts

    attempt("host_syncs", sync_counts)
    if not args.skip_phases:
        attempt("phases", lambda: phases(tokens, rank, world, args, device))
    report.append(row)


def bench_model(rank, world, args, device, report) -> None:
    """The ring on a real model's attention (`--model`): every rank runs one dense forward over stdlib text
    (`--text`, prose by default) of tokens-per-gpu x CP tokens (YaRN from the model's trained length) and keeps each
    layer's post-RoPE q/k/v; per layer, the ring's online estimate (this rank's rows) is checked against one
    device's estimate of the whole sequence (the same lists), its true recall is measured on sampled rows across the
    group, and the estimated sparse ring's fwd+bwd is timed; the dense ring is timed on one layer (its time does not
    depend on the data). Whole model = the sum over layers (attention only)."""
    from transformers import AutoTokenizer

    from mtrain.bench.model import capture_qkv, load_model, resolve_model
    from mtrain.data.texts import text_tokens
    from mtrain.ops.recall import gathered_true_recall

    tokens = args.tokens_per_gpu[0]
    seq = tokens * world
    if rank == 0:
        path = resolve_model(args.model)  # a .gguf is converted once, by rank 0
    dist.barrier()
    path = resolve_model(args.model)
    model, factor = load_model(path, seq, "auto", device, DTYPE)
    ids = torch.tensor([text_tokens(AutoTokenizer.from_pretrained(str(path)), seq, args.text)], device=device)
    layers = capture_qkv(model, ids)
    if args.layers:
        layers = layers[:args.layers]
    cfg = model.config
    del model, ids
    scale = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) ** -0.5
    layout = Layout.create("block-stripe", world_size=world, granularity=args.block_size)
    settings = SparseSettings(block_size=args.block_size, recall=args.recall)
    pos = layout.indices(seq, rank).to(device)
    est = dict(rows=rank_blocks(layout, seq, rank, args.block_size, device),
               key_blocks=shard_key_blocks(layout, seq, rank, args.block_size, device))
    per_layer = []
    dense_ms = None
    for n in range(len(layers)):
        q, k, v = layers[n]
        layers[n] = None
        one = _estimate_one_device(q, k, settings)  # the reference: one device's estimate of the whole sequence
        shard = [layout.shard(t, rank).contiguous() for t in (q, k, v)]
        del q, k, v
        mine = estimate_rank_index(shard[0], shard[1], pos, pos, seq, settings, scale, None,
                                   switches=_switches(args), **est)
        want = one.block_ids[:, :, mine.rows]
        lists = mine.col_ids is not None  # else the ring reads its columns list-free from the lines
        width = max(want.shape[-1], mine.block_ids.shape[-1], one.col_ids.shape[-1],
                    mine.col_ids.shape[-1] if lists else 1)
        pad = lambda t: F.pad(t, (0, width - t.shape[-1]), value=-1)  # noqa: E731
        same = bool(torch.equal(pad(want), pad(mine.block_ids))
                    and (not lists or torch.equal(pad(one.col_ids[:, :, mine.rows]), pad(mine.col_ids)))
                    and torch.equal(one.block_counts[:, :, mine.rows], mine.block_counts)
                    and torch.equal(one.col_counts[:, :, mine.rows], mine.col_counts))
        same_all = torch.tensor(float(same), device=device)
        dist.all_reduce(same_all, op=dist.ReduceOp.MIN)
        differences = line_differences(one._cache["lines"], mine._cache["lines"])  # the lines: global, as every rank's
        with torch.no_grad():
            recall = gathered_true_recall(shard[0], shard[1], pos, mine._cache["lines"], seq, args.block_size, None,
                                          softmax_scale=scale, n_rows=args.recall_rows)
        dout = torch.randn_like(shard[0])
        ms, gather_ms = _time_model_ring(shard, dout, layout, settings, scale, args)
        # the estimate alone (this rank's lines and rows of the index), as the ring schedule runs it, eager
        estimate_ms = timed(lambda: estimate_rank_index(shard[0], shard[1], pos, pos, seq, settings, scale, None,
                                                        switches=_switches(args), **est), args.iters, args.warmup)
        graph_ms = graph_gather_ms = None
        if args.graph_estimate and device.type == "cuda":
            graph_ms, graph_gather_ms = _time_model_ring(shard, dout, layout, settings, scale, args, graph=True)
        lists_ms = lists_gather_ms = None
        if args.compare_columns:  # the same calls with the rank index's column lists
            lists_ms, lists_gather_ms = _time_model_ring(shard, dout, layout, settings, scale, args,
                                                         list_free_columns=False)
        if dense_ms is None and not args.skip_dense:
            # zigzag, the dense ring's best layout; its time does not depend on the values, so this layer's
            # block-stripe shards stand in for zigzag ones
            dense_layout = Layout.create("zigzag", world_size=world)
            drun, _ = fwd_bwd(lambda a, b, c: ring_attention(a, b, c, group=None, layout=dense_layout,
                                                            softmax_scale=scale, switches=_switches(args)),
                              shard, dout)
            dense_ms = timed(drun, max(1, args.iters // 2), 1)
        row = {"layer": n, "ring_sparse_estimated_ms": ms, "gather_sparse_estimated_ms": gather_ms,
               "estimate_ring_ms": estimate_ms,
               "same_lines_as_one_device": bool(same_all.item()), "line_differences": differences,
               "true_recall_mean": float(recall.mean()), "true_recall_min": float(recall.min()),
               "density": mine.density(), "est_recall": float(mine._cache["est_recall"].mean()),
               "index_bytes": list_bytes(mine), "index_bytes_used_widths": used_list_bytes(mine),
               "index_bytes_cap_wide_cols": _cap_wide_column_bytes(mine, settings),
               # the same rows with list-free columns (mtrain.ops.columns.RingColumns, as the ring reads them where
               # list_free_columns: the cap-wide lists would pass STATIC_WIDTH_BYTES)
               "index_bytes_list_free": list_free_bytes(mine), "list_free_columns": mine.col_ids is None,
               "ring_sparse_lists_ms": lists_ms, "gather_sparse_lists_ms": lists_gather_ms,
               "ring_sparse_graphed_ms": graph_ms, "gather_sparse_graphed_ms": graph_gather_ms,
               "rank_bytes": [_rank_bytes(mine._cache["lines"], seq, cp, settings) for cp in args.bytes_cp]}
        per_layer.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del shard, dout, mine, one
    total = None if "ring" not in args.schedules else sum(r["ring_sparse_estimated_ms"] for r in per_layer)
    gather_total = None if "gather" not in args.schedules else sum(r["gather_sparse_estimated_ms"] for r in per_layer)
    summary = {"model": str(args.model), "text": args.text, "tokens": seq, "cp": world, "yarn": factor,
               "layers": len(per_layer),
               "block_size": args.block_size, "engine": args.engine, "recall_target": args.recall,
               "sparse_ring_model_ms": total, "sparse_gather_model_ms": gather_total, "dense_ring_layer_ms": dense_ms,
               "dense_ring_model_ms": None if dense_ms is None else dense_ms * len(per_layer),
               "same_lines_all_layers": all(r["same_lines_as_one_device"] for r in per_layer),
               "layers_with_other_lines": {r["layer"]: r["line_differences"] for r in per_layer
                                           if r["line_differences"]["heads_differing"]},
               "true_recall_mean": statistics.mean(r["true_recall_mean"] for r in per_layer),
               "true_recall_worst_layer": min(r["true_recall_mean"] for r in per_layer),
               "density_mean": statistics.mean(r["density"] for r in per_layer),
               "index_mib_per_layer_max": max(r["index_bytes"] for r in per_layer) / 2**20,
               "index_mib_used_widths_max": max(r["index_bytes_used_widths"] for r in per_layer) / 2**20,
               "index_mib_cap_wide_cols": per_layer[0]["index_bytes_cap_wide_cols"] / 2**20,
               "index_mib_list_free_max": max(r["index_bytes_list_free"] or 0 for r in per_layer) / 2**20,
               "layers_list_free_columns": sum(r["list_free_columns"] for r in per_layer),
               "estimate_ring_model_ms": sum(r["estimate_ring_ms"] for r in per_layer),
               "per_layer": per_layer}
    for key, on in (("lists", args.compare_columns), ("graphed", args.graph_estimate and device.type == "cuda")):
        for schedule in ("ring", "gather"):
            if on and schedule in args.schedules:
                summary[f"sparse_{schedule}_{key}_model_ms"] = sum(r[f"{schedule}_sparse_{key}_ms"] for r in per_layer)
    summary["rank_mib_max"] = [  # per CP size of --bytes-cp: the most over layers, of each form
        {"cp": cp, **{form: max(r["rank_bytes"][i][form] for r in per_layer) / 2**20
                      for form in ("lists", "list_free", "cap_wide")}} for i, cp in enumerate(args.bytes_cp)]
    report.append(summary)
    if rank == 0:
        dense_total = summary["dense_ring_model_ms"]
        runs = [(name, ms) for name, ms in (("ring", total), ("gathered", gather_total)) if ms is not None]
        timing = ", ".join(f"{name} {ms:.0f} ms" + ("" if dense_total is None else f" ({dense_total / ms:.2f}x faster "
                                                    "than the dense ring)") for name, ms in runs)
        dense = "" if dense_total is None else f"; dense ring {dense_total:.0f} ms"
        print(f"MODEL {args.model}: {seq} tokens of {args.text}, CP={world}, YaRN x{factor:g}, "
              f"block {args.block_size}, "
              f"{len(per_layer)} layers: sparse ring (online estimate) fwd+bwd: {timing}{dense}; "
              f"lines equal one device's on every layer and rank: {summary['same_lines_all_layers']}; true recall "
              f"mean {summary['true_recall_mean']:.4f}, worst layer {summary['true_recall_worst_layer']:.4f}; "
              f"density {summary['density_mean']:.4f}; index {summary['index_mib_per_layer_max']:.1f} MiB per layer "
              f"at most ({summary['index_mib_used_widths_max']:.1f} MiB as wide as the lists used; column lists as "
              f"wide as the {settings.max_vertical} cap: {summary['index_mib_cap_wide_cols']:.0f} MiB; with list-free "
              f"columns, as the ring reads them at large caps: {summary['index_mib_list_free_max']:.1f} MiB)",
              flush=True)
        print(f"  columns read list-free on {summary['layers_list_free_columns']} of {len(per_layer)} layers; the "
              f"estimate alone {summary['estimate_ring_model_ms']:.0f} ms over the layers (eager)", flush=True)
        for key, label in (("lists", "with the column lists instead"),
                           ("graphed", "with the estimate replayed from a CUDA graph")):
            parts = [f"{name} {summary[f'sparse_{schedule}_{key}_model_ms']:.0f} ms (eager, list-free / this "
                     f"{ms / summary[f'sparse_{schedule}_{key}_model_ms']:.3f})"
                     for schedule, (name, ms) in zip(("ring", "gather"), (("ring", total), ("gathered", gather_total)))
                     if ms is not None and f"sparse_{schedule}_{key}_model_ms" in summary]
            if parts:
                print(f"  {label}: " + ", ".join(parts), flush=True)
        for b in summary["rank_mib_max"]:
            print(f"  index per layer, rank 0 of CP={b['cp']} (most over layers): column lists as held "
                  f"{b['lists']:.1f} MiB, list-free {b['list_free']:.1f} MiB, cap-wide lists {b['cap_wide']:.1f} MiB",
                  flush=True)
        for layer, diff in summary["layers_with_other_lines"].items():  # where, and how many lines, the ring differs
            print(f"  layer {layer}: lines differ from one device's in {diff['heads_differing']} heads: verticals "
                  f"{diff['verticals_only_one_device']} only one device's, {diff['verticals_only_ring']} only the "
                  f"ring's; slashes {diff['slashes_only_one_device']} / {diff['slashes_only_ring']}", flush=True)


def _time_model_ring(shard, dout, layout, settings, scale, args, graph: bool = False, **changes):
    """(ring ms or None, gathered ms or None) per the schedules asked for: the estimated sparse ring's fwd+bwd on a
    layer's shards, median; graph: the context-parallel estimate replayed from a CUDA graph (`mtrain.parallel.graphed`;
    one more warm-up call: the first warms, the second captures); changes: other switches of these calls."""
    switches = _switches(args, graph_ring_estimate=graph, **changes)
    times = []
    for schedule in ("ring", "gather"):
        if schedule not in args.schedules:
            times.append(None)
            continue
        run, _ = fwd_bwd(lambda a, b, c: _estimated_ring(a, b, c, layout=layout, settings=settings,
                                                        softmax_scale=scale, engine=args.engine, schedule=schedule,
                                                        switches=switches),
                         shard, dout)
        times.append(timed(run, args.iters, max(args.warmup, 2) if graph else args.warmup))
    return tuple(times)


def _rank_bytes(lines, seq: int, cp: int, settings) -> dict:
    """Index bytes of rank 0 of a `cp`-rank block-stripe ring over `seq` tokens, from the lines every rank agrees on:
    with the column lists as the ring held them before the list-free form (widths from the one host read), list-free
    (`mtrain.ops.columns.list_free_bytes`), and with column lists as wide as the vertical cap."""
    from mtrain.ops.index import rows_from_lines
    from mtrain.parallel.estimate import rank_rows

    vertical, slash = lines[0], lines[1]
    bs = settings.block_size
    layout = Layout.create("block-stripe", world_size=cp, granularity=bs)
    rows = rank_rows(layout.indices(seq, 0).to(vertical.device), bs)
    out = {"cp": cp, "rows": rows.numel()}
    for name, columns in (("lists", True), ("list_free", False)):
        index = rows_from_lines(vertical, slash, seq, bs, rows, check=False, bound_widths=True, columns=columns)
        index._cache["lines"] = (vertical, slash, rows)
        out[name] = list_bytes(index) if columns else list_free_bytes(index)
        if not columns:
            out["cap_wide"] = list_bytes(index) + _cap_wide_column_bytes(index, settings)
        del index
    return out


def _cap_wide_column_bytes(index, settings) -> int:
    """What column lists as wide as the vertical cap would take: int32 per slot over the index's (batch, head, query
    block) lists, this rank's rows."""
    b, h, n = index.col_counts.shape
    return b * h * n * settings.max_vertical * 4


def _profile(run, rank: int, label: str) -> None:
    """One call under torch.profiler on every rank; rank 0 prints its ops by GPU time and by host time."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        run()
        _sync()
    if rank == 0:
        table = prof.key_averages()
        print(f"\n== profile: {label}, rank 0 ==")
        print(table.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))
        print(table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        # the same ops split by their inputs' shapes: which call of an op (e.g. which cumulative sum) costs
        by_shape = prof.key_averages(group_by_input_shape=True)
        print(by_shape.table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=40,
                             max_shapes_column_width=60))


def phases(tokens, rank, world, args, device):
    """Each part of one fwd+bwd ring call timed on its own (ms, median): the plan, the column gather, every
    step's forward and backward kernels, the merges and gradient sums, the transfers; the sum of the
    compute parts against the whole call shows what overlap (or idle time) there is."""
    seq = tokens * world
    h, hkv, d = args.heads, args.kv_heads, args.dim
    scale = 1.0 / math.sqrt(d)
    comm = RingComm(None)
    it, wu = args.iters, args.warmup
    parts = {}
    for label, hk, layout_name in (("dense", h, "zigzag"), ("sparse", hkv, "block-stripe")):
        q, k, v, dout = inputs(tokens, h, hk, d, device)
        layout = Layout.create(layout_name, world_size=world, granularity=args.block_size)
        index = make_index(seq, args, device) if label == "sparse" else None
        plan = sparse_plan(index, layout, rank, device) if index is not None else dense_plan(layout, seq, rank, device)
        t = {}
        if index is not None:
            t["plan_build"] = timed(lambda: build_sparse_plan(index, layout, rank, device, rank), it, wu)
            t["plan_cached"] = timed(lambda: sparse_plan(index, layout, rank, device), it, wu)
            pos = layout.indices(seq, rank).to(device)
            settings = SparseSettings(block_size=args.block_size, max_vertical=args.verticals,
                                      max_slash=args.window + args.far_slashes)
            t["estimate_index"] = timed(lambda: estimate_index(q, k, pos, pos, seq, settings, scale, None), it, wu)
            t["estimate_rank_index"] = timed(lambda: estimate_rank_index(q, k, pos, pos, seq, settings, scale, None,
                                                                         switches=_switches(args)), it, wu)
            t["column_gather"] = timed(lambda: ColumnGather(k, v, plan, None).wait(), it, wu)
        columns_kv = ColumnGather(k, v, plan, None).wait() if plan.columns is not None else None
        # a visiting shard's K/V (another rank's data, as the ring would hand it over)
        remote = comm.shift([k, v]).wait()
        order = [(rank - s) % world for s in range(world)]
        def visits():
            """(step, origin, its K/V, the gathered columns where it carries them) of every step that runs."""
            for s, origin in enumerate(order):
                if origin not in plan.skip:
                    yield s, origin, ((k, v) if s == 0 else remote), (columns_kv if origin == rank else None)

        outs = {}
        for s, origin, kv, cols in visits():
            aux: dict = {}

            def fwd():
                acc = PartialAccumulator(q, switches=_switches(args))
                step_forward(acc, q, kv[0], kv[1], plan, origin, scale, aux, cols)
                return acc

            t[f"step{s}_fwd"] = timed(fwd, it, wu)
            outs[s] = fwd()
        # the merge of the steps' outputs as the ring does it (the first taken over, the last merged final)
        first, rest = min(outs), sorted(outs)[1:]

        def merge():  # merges into the first step's output in place, as the ring does (values stay finite)
            acc = PartialAccumulator(q, switches=_switches(args))
            acc.add(outs[first].out, outs[first].lse)
            for n, s in enumerate(rest):
                acc.add(outs[s].out, outs[s].lse, final=n == len(rest) - 1)
            return acc.result(q.dtype)

        if rest:
            t["merge"] = timed(merge, it, wu)
        out, lse = merge() if rest else outs[first].result(q.dtype)
        for s, origin, kv, cols in visits():
            aux: dict = {}
            acc = PartialAccumulator(q, switches=_switches(args))
            step_forward(acc, q, kv[0], kv[1], plan, origin, scale, aux, cols)

            def bwd():
                sums = GradSum(q), GradSum(k), GradSum(k)
                dcols = step_backward(*sums, dout, q, kv[0], kv[1], out, lse, plan, origin, scale, aux, cols)
                return sums, dcols

            t[f"step{s}_bwd"] = timed(bwd, it, wu)
            sums, dcols = bwd()
            if dcols is not None:
                t["column_grads"] = timed(
                    lambda: finish_column_grads(start_column_grad_reduce(dcols, plan, None), plan, sums[1].value(),
                                                sums[2].value()), it, wu)
        dq_part = sums[0].value()
        dq_sum = dq_part.clone()
        t["dq_add_and_cast"] = timed(lambda: dq_sum.add_(dq_part).to(q.dtype), it, wu)
        t["kv_transfer"] = timed(lambda: comm.shift([k, v]).wait(), it, wu)
        dk32 = torch.zeros(k.shape, dtype=torch.float32, device=device)
        t["dkv_transfer_fp32"] = timed(lambda: comm.shift([dk32, dk32]).wait(), it, wu)
        compute = sum(val for key, val in t.items() if key.startswith("step") or key in ("merge", "column_grads",
                                                                                          "dq_add_and_cast"))
        t["sum_of_compute_parts"] = compute
        for key, val in t.items():
            parts[f"{label}_{key}_ms"] = val
    return parts


def print_table(report):
    print("\n== correctness (ring vs single device, max abs error) ==")
    for r in report:
        if "check" in r and "error" in r:
            print(f"{r['check']:<20} {r['layout']:<13} failed: {r['error'][:100]}")
        elif "check" in r:
            lines = f"  same lines as one device: {r['same_lines']}" if "same_lines" in r else ""
            if r.get("list_free"):
                lines += "  columns list-free" + (" (static widths)" if r.get("static_widths") else "")
            dk = "-" if r["max_err_dk"] is None else f"{r['max_err_dk']:.3e}"
            print(f"{r['check']:<20} {r['layout']:<13} out {r['max_err_out']:.3e}  dq {r['max_err_dq']:.3e}  "
                  f"dk {dk}{lines}")
    print("\n== fwd+bwd per GPU ==")
    print(f"{'tok/GPU':>8} {'variant':<44} {'ms':>9} {'TFLOP/s/GPU':>12} {'vs CP=1':>8}")
    for r in report:
        if "tokens_per_gpu" not in r:
            continue
        t = r["tokens_per_gpu"]
        t_label = f"{t // 1024}K" if t >= 1024 else str(t)
        for key, base in (("cp1_dense", None), ("ring_dense", "cp1_dense"), ("torch_cp_dense", "cp1_dense"),
                          ("cp1_sparse", None), ("ring_sparse", "cp1_sparse"), ("ring_sparse_hierarchical", "cp1_sparse"),
                          ("ring_sparse_gather", "cp1_sparse"), ("cp1_sparse_estimated", None),
                          ("ring_sparse_estimated", "cp1_sparse_estimated"),
                          ("ring_sparse_estimated_gather", "cp1_sparse_estimated"),
                          ("ring_sparse_estimated_graphed", "cp1_sparse_estimated"),
                          ("ring_sparse_estimated_gather_graphed", "cp1_sparse_estimated"),
                          ("ring_sparse_estimated_gather_graphed_tritonbwd", "cp1_sparse_estimated"),
                          ("ring_sparse_estimated_gather_graphed_fa4bwd", "cp1_sparse_estimated")):
            ms = r.get(key + "_ms")
            if ms is None and key + "_ms_error" not in r:
                continue  # not asked for (--node-size, --schedules, --skip-dense)
            if ms is None:
                print(f"{t_label:>8} {key:<44} failed: {r.get(key + '_ms_error', '')[:80]}")
                continue
            tf = r.get(key + "_tflops_per_gpu")
            # per-GPU throughput against CP=1 at equal tokens per GPU: dense work per token grows with the
            # length, so compare TFLOP/s; the sparse budget per query row is fixed, so compare tokens/s
            ratio = None
            if base and r.get(base + "_ms"):
                ratio = tf / r[base + "_tflops_per_gpu"] if tf else r[base + "_ms"] / ms
            print(f"{t_label:>8} {key:<44} {ms:>9.2f} {tf if tf else float('nan'):>12.1f} "
                  f"{(f'{ratio:.3f}' if ratio else '-'):>8}")
        for sched, key in (("ring", "ring_sparse_estimated_ms"), ("gather", "ring_sparse_estimated_gather_ms"),
                           ("ring, estimate from a CUDA graph", "ring_sparse_estimated_graphed_ms"),
                           ("gather, estimate from a CUDA graph", "ring_sparse_estimated_gather_graphed_ms")):
            if r.get(key) and r.get("cp1_sparse_estimated_ms"):
                what = ("BOUND (rank alone, transfers as local fills: --emulate-cp)" if r.get("emulated")
                        else "HEADLINE")
                bwd = f", gathered backward {r['gather_backward']}" if sched.startswith("gather") and \
                    r.get("gather_backward") else ""
                print(f"{'':>9}{what} sparse CP={r['cp']} with online estimate ({sched} schedule) vs CP=1 with its "
                      f"own: {r['cp1_sparse_estimated_ms'] / r[key]:.3f} (engine {r.get('engine')}{bwd})")
        if r.get("estimate_ring_ms") and r.get("estimate_cp1_ms"):
            torch_part = (f", torch scorer {r['estimate_ring_torch_ms']:.2f} ms" if r.get("estimate_ring_torch_ms")
                          else "")
            print(f"{'':>9}estimate: ring {r['estimate_ring_ms']:.2f} ms (lines alone {r.get('estimate_ring_lines_ms', 0):.2f}"
                  f", plan from it {r.get('plan_estimated_ms', 0):.2f}) vs one GPU's {r['estimate_cp1_ms']:.2f} ms "
                  f"({r['estimate_ring_ms'] / r['estimate_cp1_ms']:.2f}x){torch_part}")
            if r.get("estimate_ring_graphed_ms"):
                print(f"{'':>9}estimate from a CUDA graph: ring {r['estimate_ring_graphed_ms']:.2f} ms "
                      f"({r['estimate_ring_graphed_ms'] / r['estimate_cp1_ms']:.2f}x one GPU's)")
        if r.get("index_bytes_per_layer"):
            print(f"{'':>9}index bytes per layer (this rank's rows): {r['index_bytes_per_layer'] / 2**20:.1f} MiB "
                  f"({r['index_bytes_used_widths'] / 2**20:.1f} MiB as wide as the lists used); "
                  f"cap-wide column lists would take {r['index_bytes_cap_wide_cols'] / 2**20:.1f} MiB; list-free "
                  f"columns (the ring's form at large caps) {(r.get('index_bytes_list_free') or 0) / 2**20:.1f} MiB; "
                  f"density "
                  f"{r.get('density_ring_estimated', float('nan')):.4f}")
        if r.get("density_cp1") and r.get("density_ring") and r.get("cp1_sparse_ms") and r.get("ring_sparse_ms"):
            # block kernels per 1% of the causal pairs of one GPU's tokens (the ring's pairs per GPU: density x CP)
            per1 = r["cp1_sparse_ms"] / (100 * r["density_cp1"])
            per1_ring = r["ring_sparse_ms"] / (100 * r["density_ring"] * r["cp"])
            print(f"{'':>9}ms per 1% of a GPU's causal pairs (given index, all in): CP=1 {per1:.2f}, ring "
                  f"{per1_ring:.2f} ({per1_ring / per1:.3f}x)")
        if r.get("ring_dense_ms") and r.get("torch_cp_dense_ms"):
            print(f"{'':>9}ring dense / torch context_parallel TFLOP/s: {r['torch_cp_dense_ms'] / r['ring_dense_ms']:.3f}")
        if r.get("phases"):
            print(f"{'':>9}(phases: ms, each part timed alone; step0 = own shard + gathered columns, stepN = the shard "
                  "of rank r-N; backward runs them in reverse)")
        for key in ("host_syncs", "phases"):
            if r.get(key):
                items = [f"{k.removesuffix('_ms')} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in r[key].items()]
                print(f"{'':>9}{key}: " + ", ".join(items))
            elif key + "_error" in r:
                print(f"{'':>9}{key} failed: {r[key + '_error'][:100]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-gpu", type=_tokens, default=_tokens("64K,128K"))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--far-slashes", type=int, default=48)
    parser.add_argument("--verticals", type=int, default=200)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--check-len", type=_tokens, default=[16384], help="tokens of the correctness check")
    parser.add_argument("--cpu", action="store_true",
                        help="gloo + Triton interpreter + fp32 on the CPU: a smoke test of this script at tiny sizes")
    parser.add_argument("--node-size", type=int, default=0,
                        help="also check and time the hierarchical ring over emulated nodes of this many ranks "
                             "(node-aware block-stripe layout), e.g. 2 on 4 GPUs for 2 x 2")
    parser.add_argument("--engine", default="auto", choices=("auto", "triton", "fa4"),
                        help="block kernels of the sparse variants (one GPU's impl and the ring steps'); auto: fa4 "
                             "where it runs (128-token blocks, FA4 installed), else triton")
    parser.add_argument("--torch-scorer", action="store_true",
                        help="also time the ring's estimate with the torch scorer (the [rows x S_local] path)")
    parser.add_argument("--skip-dense", action="store_true", help="time no dense variant")
    parser.add_argument("--skip-phases", action="store_true", help="no per-phase breakdown")
    parser.add_argument("--profile", action="store_true",
                        help="profile one call of the estimated sparse ring and print rank 0's top ops")
    parser.add_argument("--model", default=None,
                        help="HF checkpoint folder or .gguf: time the ring on this model's captured q/k/v at "
                             "tokens-per-gpu x CP tokens of stdlib text (--text; the first --tokens-per-gpu value) "
                             "instead of the synthetic variants (see bench_model)")
    parser.add_argument("--text", default="prose", choices=TEXT_KINDS,
                        help="--model: the kind of text the model reads (mtrain.data.texts; prose, the standard "
                             "library's documentation, holds ~400K tokens: code for longer sequences)")
    parser.add_argument("--recall", type=float, default=0.99, help="--model: the online estimate's recall target")
    parser.add_argument("--recall-rows", type=int, default=64, help="--model: sampled rows of the true recall")
    parser.add_argument("--layers", type=int, default=0, help="--model: only the first N layers (0: all)")
    parser.add_argument("--compare-columns", action="store_true",
                        help="--model: also time each layer's ring with the rank index's column lists "
                             "(parallel.list_free_columns off) beside the list-free columns")
    parser.add_argument("--bytes-cp", type=int, nargs="*", default=[],
                        help="--model: also count, per layer, the index bytes of rank 0 of a block-stripe ring of "
                             "each of these CP sizes over the same sequence (from the same lines, no ring run): "
                             "the column lists as the ring held them, list-free, and cap-wide")
    parser.add_argument("--list-free-columns", action="store_true",
                        help="the ring variants' estimated rank index without column lists at the script's budgets "
                             "(the columns read list-free, as at the recipes' caps, where the lists would be wide)")
    parser.add_argument("--check-only", action="store_true", help="the correctness check alone (no timing)")
    parser.add_argument("--torch-merge", action="store_true",
                        help="merge the ring's partial results with the torch merge instead of the fused Triton one")
    parser.add_argument("--schedules", type=lambda s: s.split(","), default=["ring", "gather"],
                        help="comma list of ring_attention schedules to check and time: ring, gather")
    parser.add_argument("--graph-estimate", action="store_true",
                        help="also time the estimated variants and the estimate itself with the context-parallel "
                             "estimate replayed from a CUDA graph (mtrain.parallel.graphed, as "
                             "parallel.graph_ring_estimate does in training), beside the eager ones")
    parser.add_argument("--emulate-cp", type=int, default=0, metavar="N",
                        help="one process, one device, no torchrun: time rank --emulate-rank of a CP=N group alone, "
                             "every transfer replaced by a local fill (mtrain.bench.emulate: the rank's compute at "
                             "CP=N, a bound on what the real ring reaches; checked against one device with the other "
                             "ranks' keys zero; no dense ring; the estimate sees this rank's keys only; with "
                             "--node-size the hierarchical ring over emulated nodes too)")
    parser.add_argument("--emulate-rank", type=int, default=0, help="--emulate-cp: which rank of the group")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.check_len = args.check_len[0]
    bad = [name for name in args.schedules if name not in ring_gather.SCHEDULES]
    if bad or not args.schedules:
        parser.error(f"--schedules {','.join(args.schedules)}: each must be one of {', '.join(ring_gather.SCHEDULES)}, "
                     "comma separated (e.g. ring,gather)")
    if args.node_size < 0:
        parser.error(f"--node-size {args.node_size}: give the ranks per node (>= 2), or 0 for no hierarchical ring")
    if args.emulate_cp:
        check_node_size(parser, args.node_size, args.emulate_cp)
        return _main_emulated(args)

    global DTYPE
    if args.cpu:
        DTYPE = torch.float32
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cpu")
        torch.set_num_threads(1)
        name = "CPU (gloo, Triton interpreter)"
    else:
        dist.init_process_group("nccl")
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    check_node_size(parser, args.node_size, world)
    report: list[dict] = []
    if rank == 0:
        print(f"torch {torch.__version__}, {name} x {world}, heads {args.heads}/{args.kv_heads} x {args.dim}, "
              f"{DTYPE}", flush=True)
    if args.model:
        bench_model(rank, world, args, device, report)
        if rank == 0:
            _write_json(args.json, report)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    if not args.skip_check:
        try:
            check(rank, world, args, device, report)
        except Exception:
            if rank == 0:
                traceback.print_exc()
    if args.check_only:
        args.tokens_per_gpu = []
    for tokens in args.tokens_per_gpu:
        bench_tokens(tokens, rank, world, args, device, report)
        if rank == 0:
            print(json.dumps(report[-1]), flush=True)
    if rank == 0:
        print_table(report)
        _write_json(args.json, report)
    dist.barrier()
    graphed.release_graphs()  # before the process group goes: a graph holding NCCL work can hang its teardown
    dist.destroy_process_group()
    return 0


def check_node_size(parser, node_size: int, world: int) -> None:
    """--node-size must split the group into several nodes of at least 2 ranks (0: no hierarchical ring)."""
    if node_size and not (1 < node_size < world and world % node_size == 0):
        parser.error(f"--node-size {node_size}: the hierarchical ring needs nodes of 2 or more ranks that split the "
                     f"group of {world} into several (a divisor of {world} between 2 and {world // 2}), or 0 for none")


def _write_json(path: str | None, report: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def _main_emulated(args) -> int:
    """`--emulate-cp N`: the synthetic variants of one rank of a CP=N group, alone in this process (see
    mtrain.bench.emulate), against CP=1 measured in the same run."""
    from mtrain.bench.emulate import emulated_group

    global DTYPE
    if args.model or args.check_only:
        raise SystemExit("--emulate-cp times the synthetic variants only: drop --model and --check-only")
    if args.emulate_cp < 2:
        raise SystemExit(f"--emulate-cp needs a group of at least 2 ranks; got {args.emulate_cp}")
    if not 0 <= args.emulate_rank < args.emulate_cp:
        raise SystemExit(f"--emulate-rank must be in 0..{args.emulate_cp - 1} for --emulate-cp {args.emulate_cp}; "
                         f"got {args.emulate_rank}")
    args.skip_dense = True  # the dense ring's figures are known: its work does not depend on the data
    if args.cpu:
        DTYPE = torch.float32
        device = torch.device("cpu")
        torch.set_num_threads(1)
        name = "CPU (Triton interpreter)"
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
    world, rank = args.emulate_cp, args.emulate_rank
    print(f"torch {torch.__version__}, {name}, EMULATED rank {rank} of CP={world} (transfers replaced by local fills), "
          f"heads {args.heads}/{args.kv_heads} x {args.dim}, {DTYPE}", flush=True)
    report: list[dict] = []
    with emulated_group(world, rank):
        if not args.skip_check:  # the given-index cases against one device with the other ranks' keys zero
            try:
                check(rank, world, args, device, report, zero_peers=True)
            except Exception:
                traceback.print_exc()
        for tokens in args.tokens_per_gpu:
            bench_tokens(tokens, rank, world, args, device, report)
            report[-1]["emulated"] = True
            print(json.dumps(report[-1]), flush=True)
        graphed.release_graphs()
    print_table(report)
    _write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
