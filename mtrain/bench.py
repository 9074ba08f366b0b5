"""`mtrain bench`: benchmarks as sub-subcommands; `imbalance` measures how evenly a sparse index's work
falls on workers and ring steps per layout (CPU, seconds). Other benchmarks join as further sub-subcommands."""

from __future__ import annotations

import argparse
import json
import sys

from mtrain.errors import MtrainError

_SIZES = {"K": 1 << 10, "M": 1 << 20}


def _tokens(text: str) -> int:
    text = text.strip().upper()
    try:
        return int(text[:-1]) * _SIZES[text[-1]] if text[-1] in _SIZES else int(text)
    except ValueError as exc:
        raise MtrainError(f"cannot read {text!r} as a token count; write e.g. 131072, 128K or 1M") from exc


def _int_list(text: str) -> list[int]:
    return [_tokens(x) for x in text.split(",") if x.strip()]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks (imbalance of sparse work across ring workers)",
        description="Benchmarks. `mtrain bench imbalance` needs only the CPU; GPU timing benchmarks live in "
        "scripts/bench_*.py.",
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    _register_imbalance(benches)


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
    import torch

    from mtrain.ops import SparseIndex

    try:
        fields = torch.load(path, map_location="cpu")
        return SparseIndex(**{k: fields[k] for k in ("block_ids", "block_counts", "col_ids", "col_counts",
                                                     "seq_len", "block_size")})
    except (OSError, KeyError, TypeError) as exc:
        raise MtrainError(f"--index {path}: cannot load a SparseIndex from it ({exc})") from exc


def run_imbalance(args) -> int:
    from mtrain.parallel import Layout, imbalance

    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for name in layouts:
        Layout.create(name, world_size=1)  # rejects unknown names with the list of known ones
    if args.index:
        indices = [(None, _load_index(args.index))]
    else:
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
