"""The context-parallel estimate replayed from a CUDA graph, opt-in: `parallel.graph_ring_estimate: true` (the recipe
key; `Switches.graph_ring_estimate`, passed down from the model's runtime).
`mtrain.parallel.estimate.estimate_rank_index` makes no host synchronisation where the rank's lists are sized from
the lines' shapes (`rank_list_widths` "static"), but it issues several hundred small kernels and five collectives per
layer from Python, and on the GPU the host, not the GPU, sets the estimated ring's pace. Its shapes depend only on
the input shapes, the settings and the layout, so one capture per key serves every layer and step, as the one-device
estimate's graph does (`mtrain.ops.graphed`): q and k are copied into the graph's buffers, the graph (the Triton
scorer, the collectives, the rank's index rows) is replayed, and the index is copied out. Where the index reads its
lists' widths back (caps whose cap-wide lists would pass `parallel.static_width_mib`, as the recipes' 16,384-line
caps do, under the ring schedule), the graph holds the lines alone and the index is built from them eagerly after
each replay; under the gathered schedule such an index holds its columns list-free with static widths
(`rank_list_widths`), and the graph holds it too.

Every rank of the group must make the same calls in the same order (they do: the same layers with the same shapes).
The first call with a key runs eagerly; the second captures on every rank, replays once and compares with an eager
run, and the ranks agree through one all-reduce whether every rank's replay matched (else, or where a capture failed,
the key stays eager on every rank, with a warning). Off by default until measured on the GPU: capturing NCCL
collectives needs every rank to capture the same ones, and a rank whose capture fails midway would leave the
communicator out of step with the others."""

from __future__ import annotations

import atexit
import logging
import warnings

import torch
import torch.distributed as dist

from mtrain.ops.graphed import GraphCache, PackedTree, capture, same_tree
from mtrain.ops.switches import Switches, or_defaults

log = logging.getLogger(__name__)

MAX_GRAPHS = 8  # as one device's (`mtrain.ops.graphed.MAX_GRAPHS`): a key whose graph was dropped runs eagerly
# key -> "warm", "eager" (capture failed or did not match on some rank) or a _RankGraph
_GRAPHS = GraphCache()


def release_graphs() -> None:
    """Drop every captured context-parallel estimate (after the GPU finished their replays). A graph that captured
    NCCL collectives keeps the communicator in use, and tearing the process group down while one is alive can hang
    in the communicator's destruction (reported against PyTorch: pytorch/pytorch issue 115388): call this before
    `torch.distributed.destroy_process_group()`. Also run at interpreter exit."""
    if any(not isinstance(entry, str) for entry in _GRAPHS.entries.values()) and torch.cuda.is_available():
        torch.cuda.synchronize()
    _GRAPHS.entries.clear()


atexit.register(release_graphs)


class _RankGraph:
    """One captured call of the estimate: its q / k (and document ids) buffers and what its replays write, packed
    into one buffer (tensors in `keep`, such as the rank's cached row list that plans test by identity, stay the
    caller's). `lines_only`: the graph holds `estimate_rank_lines` and the caller builds the index from its lines
    eagerly (`rank_index_from_lines`), where that build reads the lists' widths back (large caps)."""

    def __init__(self, call, q, k, doc_ids, keep, held, lines_only: bool):
        self.held = held  # tensors the graph reads in place (positions, row and key-block lists): alive with it
        self.lines_only = lines_only
        self.q, self.k = q.detach().clone(), k.detach().clone()
        self.doc_ids = None if doc_ids is None else doc_ids.clone()

        def run():
            out = call(self.q, self.k, self.doc_ids)
            return out, PackedTree(out, keep=keep)

        self.graph, (out, self.packed) = capture(run)
        del out  # rewritten by every replay before it is packed: a temporary of the shared pool (`graphed._Graph`)

    def __call__(self, q, k, doc_ids):
        self.q.copy_(q)
        self.k.copy_(k)
        if doc_ids is not None:
            self.doc_ids.copy_(doc_ids)
        self.graph.replay()
        return self.packed.unpack()


def estimate_rank_index_graphed(q, k, positions, seq_len: int, settings, scale: float, group, *, doc_ids=None,
                                rows, key_blocks=None, layout_key=None, schedule: str = "ring",
                                switches: Switches | None = None):
    """`mtrain.parallel.estimate.estimate_rank_index(q, k, positions, positions, ...)` for this rank's shard, replayed
    from a CUDA graph where parallel.graph_ring_estimate is on (`switches`; None = the defaults) and the tensors are
    on CUDA (see the module's docstring); else the eager call. The other switches reach the index build (its widths
    and list-free columns) and are part of the graph's key. rows / key_blocks: the rank's cached query-block rows
    and key blocks (`mtrain.parallel.plan`); layout_key: what identifies the layout and rank (part of the graph's
    key). Where the index of these lines reads the lists' widths back (`rank_list_widths`: large caps), the graph
    holds the lines alone and the index is built from them eagerly after each replay."""
    from mtrain.parallel.estimate import (estimate_rank_index, estimate_rank_lines, rank_index_from_lines,
                                          rank_list_widths, use_triton_scorer)

    def call(qq, kk, dd):
        return estimate_rank_index(qq, kk, positions, positions, seq_len, settings, scale, group, doc_ids=dd,
                                   rows=rows, key_blocks=key_blocks, schedule=schedule, switches=switches)

    def lines(qq, kk, dd):
        return estimate_rank_lines(qq, kk, positions, positions, seq_len, settings, scale, group, doc_ids=dd,
                                   key_blocks=key_blocks)

    def index_of(found):
        return rank_index_from_lines(found, positions, positions, seq_len, settings, group, rows=rows,
                                     schedule=schedule, switches=switches)

    switches = or_defaults(switches)
    if not (switches.graph_ring_estimate and q.is_cuda) or torch.cuda.is_current_stream_capturing():
        return call(q, k, doc_ids)
    if key_blocks is None or not use_triton_scorer("auto", q, settings.block_size, key_blocks):
        return call(q, k, doc_ids)  # the torch scorer reads back (torch.unique): never captured
    # the graph reads positions, rows and key_blocks where they are (the callers' cached tensors): the key holds
    # their identities, and the graph holds them alive, so a replay never reads memory they no longer own
    held = (positions, rows, key_blocks)
    key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, None if doc_ids is None else tuple(doc_ids.shape),
           seq_len, settings, float(scale), layout_key, schedule, dist.get_world_size(group), tuple(map(id, held)),
           switches)
    graph = _GRAPHS.graph(key)
    if graph is not None:
        return index_of(graph(q, k, doc_ids)) if graph.lines_only else graph(q, k, doc_ids)
    if not _GRAPHS.capture_due(key):
        return call(q, k, doc_ids)
    eager_lines = lines(q, k, doc_ids)
    lines_only = rank_list_widths(eager_lines[0], eager_lines[1], rows.numel(), schedule=schedule,
                                  switches=switches) != "static"
    eager = index_of(eager_lines)
    graph, problem = None, None
    try:
        if lines_only:
            graph = _RankGraph(lines, q, k, doc_ids, keep=(), held=held, lines_only=True)
            same = same_tree(graph(q, k, doc_ids), eager_lines)
        else:
            graph = _RankGraph(call, q, k, doc_ids, keep=(rows, positions), held=held, lines_only=False)
            same = same_tree(graph(q, k, doc_ids), eager)
        if not same:
            problem = "its replay differs from the eager estimate"
    except Exception as exc:  # an op that cannot be captured (a host read where the lists need one, say)
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
    agree = torch.tensor([0 if problem else 1], device=q.device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)  # every rank takes the same branch (once per key)
    if not int(agree.item()):
        _GRAPHS.refuse(key)
        warnings.warn("the context-parallel estimate could not be replayed from a CUDA graph on every rank "
                      f"({problem or 'another rank failed'}); it runs eagerly")
        return eager
    _GRAPHS.keep(key, graph, MAX_GRAPHS)
    log.info("context-parallel estimate captured as a CUDA graph for q %s (%s)", tuple(q.shape),
             "its lines; the index eagerly" if lines_only else "lines and index")
    return eager
