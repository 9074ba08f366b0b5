"""`mtrain bench imbalance`: how evenly a sparse index's work falls on workers and ring steps per layout (CPU,
seconds). The index is synthetic (`mtrain.bench.synthetic.synthetic_index`) unless --index gives one captured
from a model."""

from __future__ import annotations

import argparse
import json
import sys

from mtrain.bench.units import format_tokens, token_counts
from mtrain.errors import MtrainError

HELP = "worker- and step-level imbalance per layout, CP size and length"
DESCRIPTION = ("Worker-level (max/mean of work per worker) and step-level (sum over ring steps of the "
               "busiest worker / of the mean worker) imbalance of a vertical-slash index under each layout, with the "
               "sink and vertical columns attended off the ring (what ring_attention does) and on it (a plain ring). "
               "The index is synthetic (local window + far slashes sized to --density + sinks + verticals) unless "
               "--index gives one captured from a model.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp", type=token_counts, default=[8, 16, 32, 64, 128], help="CP sizes, comma separated")
    p.add_argument("--lengths", type=token_counts, default=[128 << 10, 256 << 10, 512 << 10, 1 << 20],
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


def run(args) -> int:
    from mtrain.bench.synthetic import synthetic_index
    from mtrain.parallel import Layout, imbalance

    if not 0.0 < args.density <= 1.0:
        raise MtrainError(f"--density {args.density}: the fraction of causal blocks computed must be in (0, 1], "
                          "e.g. 0.05")
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
            index = synthetic_index(seq_len, block_size=args.block_size, window=args.window, density=args.density,
                                    verticals=args.verticals, heads=args.heads, seed=args.seed)
        seq_len = int(index.seq_len)
        density = index.block_density()
        for cp in args.cp:
            for name in layouts:
                nodes = args.local_world_size if args.local_world_size and args.local_world_size < cp else None
                layout = Layout.create(name, world_size=cp, granularity=args.granularity, local_world_size=nodes)
                if seq_len % layout.length_multiple():
                    print(f"{format_tokens(seq_len):>8} {cp:>4} {name:<13} skipped: length not a multiple of "
                          f"{layout.length_multiple()}")
                    continue
                off = imbalance(index, layout, local_world_size=nodes)
                on = imbalance(index, layout, vertical_on_ring=True, local_world_size=nodes)
                row = {"tokens": seq_len, "cp": cp, "layout": name, "local_world_size": nodes,
                       "kernel_block": layout.local_block_size(seq_len, int(index.block_size)),
                       "block_density": density, "worker_off_ring": off["worker"], "step_off_ring": off["step"],
                       "worker_on_ring": on["worker"], "step_on_ring": on["step"]}
                rows.append(row)
                print(f"{format_tokens(seq_len):>8} {cp:>4} {name:<13} {row['kernel_block']:>6} {density:>7.3f} "
                      f"{off['worker']:>7.3f} {off['step']:>7.3f} {on['worker']:>7.3f} {on['step']:>7.3f}")
                sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtrain bench imbalance", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
