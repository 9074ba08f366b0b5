"""What the one-device estimate's CUDA graphs keep allocated (`mtrain.ops.graphed`), on a GPU: per estimate key (a
document length and recall, as a 256K step of the long mix meets them), the bytes of an eager index, of a replayed
one (its packed buffer), what the graph holds between replays (its input buffers and the packed copy), what it no
longer holds (the unpacked index its capture returned, about the packed copy's size: a temporary of the shared
pool now), and `torch.cuda.memory_allocated`'s rise over the key's first calls (the eager call, the capture with
its eager check). Inputs are synthetic (a local band and a few strong key columns per head), so list widths,
and with them bytes, differ from a real model's.

    python -m tools.graph_memory [--lengths 107479 81264 49807] [--recalls 0.99 0.995]
"""

from __future__ import annotations

import argparse

import torch


def _bytes(obj) -> int:
    from mtrain.ops.partial_autograd import split_tensors

    tensors: list = []
    split_tensors(obj, tensors)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _index_bytes(index) -> int:
    return _bytes((index.block_ids, index.block_counts, index.col_ids, index.col_counts, dict(index._cache)))


def _inputs(S: int, seed: int, hq: int = 9, hkv: int = 3, d: int = 64):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(1, S, hkv, d, device="cuda", generator=gen)
    q = 0.3 * torch.randn(1, S, hq, d, device="cuda", generator=gen)
    q[..., 1:] += 1.5 * k.repeat_interleave(hq // hkv, dim=2)[..., 1:]  # a diagonal band (a slash at offset 0)
    cols = torch.randint(0, S, (8,), device="cuda", generator=gen)
    k[:, cols, :, 0] = 12.0  # strong key columns (verticals)
    q[..., 0] = 1.0
    return q.bfloat16(), k.bfloat16()


def main(argv=None) -> None:
    from mtrain.ops import estimate_vertical_slash
    from mtrain.ops.graphed import _GRAPHS, estimate_graphed, prepare_engine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[107479, 81264, 49807])
    p.add_argument("--recalls", type=float, nargs="+", default=[0.99, 0.995])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools.graph_memory measures CUDA graphs: run it on a GPU machine")
    prepare = ("fa4", 3, 64)
    mib = 2 ** 20
    print(f"{'length':>7s} {'recall':>6s} {'eager idx MiB':>13s} {'replayed MiB':>12s} {'graph holds MiB':>15s} "
          f"{'dropped MiB':>13s} {'alloc rise MiB':>14s}")
    total = 0
    for S in args.lengths:
        for recall in args.recalls:
            kw = dict(recall=recall, block_size=128, sample_blocks=32)
            q, k = _inputs(S, seed=S)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            for _ in range(2):  # the first call compiles (eager), the second captures
                out = estimate_graphed(q, k, prepare=prepare, **kw)
                del out
            torch.cuda.synchronize()
            rise = torch.cuda.memory_allocated() - before
            key = next(reversed(_GRAPHS.entries), None)
            graph = "never seen" if key is None else _GRAPHS.entries[key]
            if isinstance(graph, str):
                print(f"{S:7d} {recall:6.3f} not captured ({graph})")
                continue
            eager = estimate_vertical_slash(q, k, **kw)
            prepare_engine(eager, prepare)
            replayed = estimate_graphed(q, k, prepare=prepare, **kw)
            held_out = graph.packed.flat.nbytes  # the index the capture returned held the same tensors
            held = held_out + graph.q.nbytes + graph.k.nbytes
            total += rise
            print(f"{S:7d} {recall:6.3f} {_index_bytes(eager) / mib:13.1f} {_index_bytes(replayed) / mib:12.1f} "
                  f"{held / mib:15.1f} {held_out / mib:13.1f} {rise / mib:14.1f}")
            del eager, replayed
    print(f"memory_allocated rise over every key: {total / mib:.0f} MiB; reserved now "
          f"{torch.cuda.memory_reserved() / mib:.0f} MiB")


if __name__ == "__main__":
    main()
