"""`mtrain bench`: benchmarks as sub-subcommands; `imbalance` measures how evenly a sparse index's work
falls on workers and ring steps per layout (CPU, seconds); `plan` prints the cost model of a training step on a
cluster (`mtrain.planner`). Other benchmarks join as further sub-subcommands."""

from __future__ import annotations

import argparse
import json
import sys

from mtrain.errors import MtrainError

_SIZES = {"K": 1 << 10, "M": 1 << 20}


def _tokens(text: str) -> int:
    """An argparse type: a token count (131072, 128K, 1M). argparse reports a bad one as a usage error naming the
    option (an MtrainError raised here would escape parse_args as a traceback)."""
    text = text.strip().upper()
    try:
        return int(text[:-1]) * _SIZES[text[-1]] if text[-1:] in _SIZES else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a token count; write e.g. 131072, 128K or 1M") from None


def _int_list(text: str) -> list[int]:
    return [_tokens(x) for x in text.split(",") if x.strip()]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks (imbalance of sparse work across ring workers, a cluster plan of a training step)",
        description="Benchmarks. `mtrain bench imbalance` and `mtrain bench plan` need only the CPU; GPU timing "
        "benchmarks live in scripts/bench_*.py.",
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    _register_imbalance(benches)
    _register_plan(benches)


def _register_imbalance(benches) -> None:
    p = benches.add_parser(
        "imbalance",
        help="worker- and step-level imbalance per layout, CP size and length",
        description="Worker-level (max/mean of work per worker) and step-level (sum over ring steps of the "
        "busiest worker / of the mean worker) imbalance of a vertical-slash index under each layout, with the "
        "sink and vertical columns attended off the ring (what ring_attention does) and on it (a plain ring). "
        "The index is synthetic (local window + far slashes sized to --density + sinks + verticals) unless "
        "--index gives one captured from a model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--cp", type=_int_list, default=[8, 16, 32, 64, 128], help="CP sizes, comma separated")
    p.add_argument("--lengths", type=_int_list, default=[128 << 10, 256 << 10, 512 << 10, 1 << 20],
                   help="sequence lengths, comma separated (128K, 1M, ... accepted)")
    # the names of mtrain.parallel.LAYOUT_NAMES, spelled out so `mtrain --help` does not import torch
    p.add_argument("--layouts", default="contiguous,zigzag,stripe,block-stripe", help="layouts, comma separated")
    p.add_argument("--block-size", type=int, default=64, help="kernel block size of the index")
    p.add_argument("--granularity", type=int, default=64, help="block-stripe stripe width G")
    p.add_argument("--window", type=int, default=1024, help="local window (slash offsets 0..window-1)")
    p.add_argument("--density", type=float, default=0.05,
                   help="target fraction of causal blocks computed; sets the number of far slashes per length")
    p.add_argument("--verticals", type=int, default=200, help="vertical columns per head")
    p.add_argument("--heads", type=int, default=1, help="query heads, each with its own random pattern")
    p.add_argument("--local-world-size", type=int, default=None,
                   help="order ring steps as the hierarchical ring (nodes of this many ranks) does, with the "
                   "layouts built node-aware (local_world_size) as that ring wants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--index", default=None,
                   help="a torch.save'd dict of SparseIndex fields (block_ids, block_counts, col_ids, col_counts, "
                   "seq_len, block_size) captured from a model; replaces the synthetic index and --lengths")
    p.add_argument("--json", default=None, help="also write every row as JSON to this file")
    p.set_defaults(func=run_imbalance)


def synthetic_index(seq_len: int, args):
    """A vertical-slash index like the ones estimated on long-context models: a local window, far slashes
    (as many as make `args.density` of the causal blocks), the sink block and scattered verticals."""
    import torch

    from mtrain.ops import SparseIndex

    g = torch.Generator().manual_seed(args.seed + seq_len)
    n_blocks = seq_len // args.block_size
    window_blocks = -(-args.window // args.block_size) + 1
    # a far slash crosses about two key blocks in the rows it reaches: with offsets uniform in
    # [window, S/2) that is 3/4 of the rows; the mean causal row holds n_blocks / 2 blocks
    far = max(0, int((args.density * n_blocks / 2 - window_blocks - 1) / (2 * 0.75)))
    heads = []
    verticals = []
    for _ in range(args.heads):
        far_offsets = torch.randint(args.window, seq_len // 2, (far,), generator=g)
        heads.append(torch.cat([torch.arange(args.window), far_offsets]))
        verticals.append(torch.randint(0, seq_len, (args.verticals,), generator=g))
    return SparseIndex.from_lines(torch.stack(verticals)[None], torch.stack(heads)[None], seq_len, args.block_size)


def _load_index(path: str):
    from mtrain.ops import SparseIndex
    from mtrain.safe_load import load_tensors

    fields = load_tensors(path)  # tensors only: an index file runs no code
    try:
        return SparseIndex(**{k: fields[k] for k in ("block_ids", "block_counts", "col_ids", "col_counts",
                                                     "seq_len", "block_size")})
    except (KeyError, TypeError) as exc:
        raise MtrainError(f"--index {path}: not a SparseIndex's fields (a dict of block_ids, block_counts, col_ids, "
                          f"col_counts, seq_len, block_size; {type(exc).__name__}: {exc})") from None


def run_imbalance(args) -> int:
    from mtrain.parallel import Layout, imbalance

    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for name in layouts:
        Layout.create(name, world_size=1)  # rejects unknown names with the list of known ones
    if args.index:
        indices = [(None, _load_index(args.index))]
    else:
        short = [n for n in args.lengths if n <= 2 * args.window or n < args.block_size]
        if short:  # the synthetic index draws its far slashes from [window, length / 2)
            raise MtrainError(f"--lengths {','.join(map(str, short))}: the synthetic index needs lengths above "
                              f"2 x --window ({args.window}) and at least --block-size ({args.block_size}); give "
                              f"longer lengths (e.g. 8K) or a smaller --window")
        indices = [(n, None) for n in args.lengths]
    header = (f"{'tokens':>8} {'CP':>4} {'layout':<13} {'kblock':>6} {'density':>7} "
              f"{'worker':>7} {'step':>7} {'worker':>7} {'step':>7}")
    print("work counted per block (64x64 pairs = 1); columns 6-7: sink + verticals off the ring (ring_attention),"
          " 8-9: on the ring; kblock = the kernel's block size on each rank")
    if args.local_world_size:
        print(f"hierarchical ring order, nodes of {args.local_world_size} ranks, node-aware layouts")
    print(f"{'':>47}{'---- off ring ----':>16} {'---- on ring ----':>16}")
    print(header)
    rows = []
    for seq_len, index in indices:
        if index is None:
            index = synthetic_index(seq_len, args)
        seq_len = int(index.seq_len)
        density = index.block_density()
        for cp in args.cp:
            for name in layouts:
                nodes = args.local_world_size if args.local_world_size and args.local_world_size < cp else None
                layout = Layout.create(name, world_size=cp, granularity=args.granularity, local_world_size=nodes)
                if seq_len % layout.length_multiple():
                    print(f"{_fmt_tokens(seq_len):>8} {cp:>4} {name:<13} skipped: length not a multiple of "
                          f"{layout.length_multiple()}")
                    continue
                off = imbalance(index, layout, local_world_size=nodes)
                on = imbalance(index, layout, vertical_on_ring=True, local_world_size=nodes)
                row = {"tokens": seq_len, "cp": cp, "layout": name, "local_world_size": nodes,
                       "kernel_block": layout.local_block_size(seq_len, int(index.block_size)),
                       "block_density": density, "worker_off_ring": off["worker"], "step_off_ring": off["step"],
                       "worker_on_ring": on["worker"], "step_on_ring": on["step"]}
                rows.append(row)
                print(f"{_fmt_tokens(seq_len):>8} {cp:>4} {name:<13} {row['kernel_block']:>6} {density:>7.3f} "
                      f"{off['worker']:>7.3f} {off['step']:>7.3f} {on['worker']:>7.3f} {on['step']:>7.3f}")
                sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _fmt_tokens(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % (1 << 10) == 0 else str(n)


def _register_plan(benches) -> None:
    p = benches.add_parser(
        "plan",
        help="cost model of a training step: per-rank FLOPs, memory, link bytes, step time; does it fit",
        description="Cost model of one training step for a model shape, sequence length and CP size on a cluster "
        "(flat or hierarchical ring, node size, link bandwidths): per-rank FLOPs, memory per GPU (weights, ZeRO-2 "
        "optimizer, activations, ring KV buffers, index rows), bytes per link, the expected step time, what bounds "
        "it, and whether it fits. Attention times from mtrain.ops.cost (H200 kernel figures, scaled by the GPU's "
        "speed). Settings come from RECIPE when given; flags override them. --check prints the model against the "
        "runs measured in BENCHMARKS.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("recipe", nargs="?", default=None, help="a recipe YAML (model, seq_len, cp_size, attention, ...)")
    p.add_argument("--model", default=None, help="shape name (qwen2.5-3b, ...), a HF config.json or a model folder "
                   "(default: the recipe's model, else qwen2.5-3b)")
    p.add_argument("--seq-len", type=_tokens, default=None, help="tokens per sequence (512K, 1M accepted)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel size")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the cluster (default: the CP size)")
    p.add_argument("--node-size", type=int, default=8, help="GPUs per node")
    p.add_argument("--ring", choices=("flat", "hierarchical"), default="hierarchical")
    p.add_argument("--gpu", default="h200", help="GPU kind: h200, h100, a100-40gb, a100-80gb")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="override the GPU kind's memory")
    p.add_argument("--nvlink-gbs", type=float, default=None, help="intra-node GB/s per GPU, one direction")
    p.add_argument("--network-gbs", type=float, default=None, help="inter-node GB/s per GPU, one direction")
    p.add_argument("--host-memory-gb", type=float, default=1024.0, help="host memory per node")
    p.add_argument("--attention", choices=("dense", "sparse"), default=None,
                   help="default: sparse for the mtraining / zigzag-sparse kinds, else dense")
    p.add_argument("--density", type=float, default=0.05, help="fraction of causal pairs the sparse index keeps")
    p.add_argument("--verticals", type=int, default=1024, help="vertical columns per head")
    p.add_argument("--grad-accum", type=int, default=None)
    p.add_argument("--offload", choices=("yes", "no"), default=None,
                   help="ZeRO-2 optimizer offload to the host (default: the recipe's DeepSpeed config, else yes)")
    p.add_argument("--check", action="store_true", help="print the model against the measured runs and exit")
    p.add_argument("--json", default=None, help="also write the plan (or the check rows) as JSON to this file")
    p.set_defaults(func=run_plan)


def _plan_spec(args):
    import dataclasses

    from mtrain import planner

    recipe = None
    if args.recipe:
        from mtrain.config import parse_recipe

        recipe = parse_recipe(args.recipe)
    model = args.model or (recipe and (recipe.model.config or recipe.model.path)) or "qwen2.5-3b"
    if args.gpu not in planner.GPUS:
        raise MtrainError(f"--gpu {args.gpu!r}: unknown; choose one of {', '.join(planner.GPUS)}")
    gpu = planner.GPUS[args.gpu]
    changes = {k: v for k, v in (("memory_gb", args.gpu_memory_gb), ("nvlink_gbs", args.nvlink_gbs),
                                 ("network_gbs", args.network_gbs)) if v is not None}
    for name, value in changes.items():
        if value <= 0:
            raise MtrainError(f"--{name.replace('_', '-')} must be > 0; got {value}")
    gpu = dataclasses.replace(gpu, **changes)
    kw = {}
    if recipe is not None:
        a = recipe.attention
        from mtrain.ops.estimate import sample_height
        kw = dict(seq_len=recipe.data.seq_len, cp=recipe.parallel.cp_size, block_size=a.block_size,
                  scored_rows=a.last_q + a.sample_blocks * sample_height(a.block_size, a.sample_rows),
                  max_vertical=a.max_vertical,
                  grad_accum=recipe.train.grad_accum * recipe.train.micro_batch_size,
                  checkpointing=recipe.model.gradient_checkpointing, loss_chunk=recipe.train.loss_chunk,
                  attention="sparse" if a.kind in ("mtraining", "zigzag-sparse") else "dense",
                  offload="offload" in str(recipe.train.deepspeed or ""))
    for key, value in (("seq_len", args.seq_len), ("cp", args.cp), ("grad_accum", args.grad_accum),
                       ("attention", args.attention)):
        if value is not None:
            kw[key] = value
    if args.offload is not None:
        kw["offload"] = args.offload == "yes"
    kw.setdefault("seq_len", 512 << 10)
    kw.setdefault("cp", 8)
    gpus = args.gpus if args.gpus is not None else kw["cp"]
    return planner.PlanSpec(shape=planner.load_shape(model), gpus=gpus, node_size=args.node_size, ring=args.ring,
                            gpu=gpu, density=args.density, verticals=args.verticals,
                            host_memory_gb=args.host_memory_gb, **kw)


def run_plan(args) -> int:
    from mtrain import planner

    if args.check:
        rows = planner.check()
        print(f"{'measured run (BENCHMARKS.md)':<54} {'metric':<7} {'measured':>9} {'model':>9} {'error':>7} sample")
        for r in rows:
            unit = {"step": "s", "attn": "ms", "mem": "GB"}[r["metric"]]
            print(f"{r['run']:<54} {r['metric'] + ' ' + unit:<7} {r['measured']:9.2f} {r['predicted']:9.2f} "
                  f"{r['error']:+7.1%} {r['sample']}")
        for sample in ("in", "out"):
            for metric in ("step", "attn", "mem"):
                for device in ("GPU", "CPU"):
                    errs = [abs(r["error"]) for r in rows if r["metric"] == metric and r["sample"] == sample
                            and r["run"].startswith("CPU") == (device == "CPU")]
                    if errs:
                        where = "in sample" if sample == "in" else "out of sample"
                        print(f"{device} {metric}, {where}: mean |error| {sum(errs) / len(errs):.1%}, "
                              f"worst {max(errs):.1%} over {len(errs)} runs")
        payload = rows
    else:
        result = planner.plan(_plan_spec(args))
        print(planner.format_plan(result))
        payload = {"memory_gb": result.memory_gb, "link_bytes": result.link_bytes, "times_s": result.times_s,
                   "flops": result.flops, "micro_step_s": result.micro_s, "step_s": result.step_s,
                   "bound": result.bound, "fits": result.fits, "notes": result.notes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0
