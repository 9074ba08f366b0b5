"""`ring_attention`: the public entry point that picks the plan (dense, or sparse on a finished index) and the
ring schedule (flat, or hierarchical inner/outer) for local shards of one context-parallel group; and
`estimate_ring_index`, the index it takes estimated online across the group."""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError
from mtrain.ops.switches import Switches, or_defaults
from mtrain.ops.varlen import Documents
from mtrain.parallel.comm import hierarchical_groups, ring_node_size
from mtrain.parallel.dense_gather import gather_runs, gathered_dense_attention
from mtrain.parallel import ring_flat, ring_gather, ring_hierarchical
from mtrain.parallel.estimate import SparseSettings, estimate_rank_index
from mtrain.parallel.fa4_steps import ENGINES, resolve_engine
from mtrain.parallel.graphed import estimate_rank_index_graphed
from mtrain.parallel.layout import Layout
from mtrain.parallel.plan import (dense_plan, gathered_sparse_plan, rank_blocks, rank_positions,
                                  shard_key_blocks, sparse_plan)
from mtrain.parallel.ring_flat import ring_flat_attention
from mtrain.parallel.ring_hierarchical import ring_hierarchical_attention
from mtrain.parallel.ring_gather import SCHEDULES, KVGather, ring_gather_attention


def _check_shapes(q, k, v, layout: Layout, world: int) -> int:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise MtrainError(
            f"ring_attention wants q [B, S_local, Hq, D] and k, v [B, S_local, Hkv, D]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise MtrainError(
            f"ring_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} must share B, S_local and D, and "
            "Hq must be a multiple of Hkv"
        )
    if layout.world_size != world:
        raise MtrainError(f"layout is for {layout.world_size} ranks but the CP group has {world}")
    seq_len = q.shape[1] * world
    layout.check(seq_len)
    return seq_len


def column_origin(group, hierarchy) -> int:
    """The origin whose ring step attends the gathered sink + vertical columns under the schedule that runs
    (flat, or hierarchical with `hierarchy` = (inner, outer) groups): one whose step comes after the gather had
    time to arrive (see each schedule's `column_origin`)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if hierarchy is None:
        return ring_flat.column_origin(rank, world)
    inner = hierarchy[0]
    grid = ring_hierarchical.node_grid(rank, world, dist.get_world_size(inner), dist.get_rank(inner))
    return ring_hierarchical.column_origin(grid)


def _check_index(index, q, seq_len: int) -> None:
    if int(index.seq_len) != seq_len:
        raise MtrainError(f"SparseIndex is for {index.seq_len} tokens but the CP group holds {seq_len}")
    if tuple(index.block_ids.shape[:2]) != (q.shape[0], q.shape[2]):
        raise MtrainError(
            f"SparseIndex has [B, Hq] = {tuple(index.block_ids.shape[:2])}, the queries {(q.shape[0], q.shape[2])}"
        )


def _check_docs(doc_ids, q, seq_len: int) -> torch.Tensor:
    if doc_ids.dim() != 2 or tuple(doc_ids.shape) != (q.shape[0], seq_len) or doc_ids.is_floating_point() \
            or doc_ids.dtype == torch.bool:
        raise MtrainError(
            f"ring_attention: doc_ids must be an integer tensor [B={q.shape[0]}, S={seq_len}] of the whole "
            f"sequence's document ids (the same on every CP rank); got {doc_ids.dtype} {tuple(doc_ids.shape)}"
        )
    return doc_ids.to(device=q.device, dtype=torch.int64)


def _pick_groups(group, inner_group, outer_group, switches: Switches):
    """(inner, outer) for the hierarchical ring, or None for the flat one (parallel.hierarchy / node_size)."""
    if (inner_group is None) != (outer_group is None):
        raise MtrainError("pass both inner_group and outer_group for a hierarchical ring, or neither")
    if inner_group is not None:
        return inner_group, outer_group
    local = ring_node_size(dist.get_world_size(group), switches=switches)
    return None if local is None else hierarchical_groups(group, local)


def _warn_unbalanced(layout: Layout, inner_group) -> None:
    local = dist.get_world_size(inner_group)
    if layout.local_world_size != local and local < layout.world_size and not _WARNED:
        _WARNED.append(True)
        warnings.warn(
            f"hierarchical ring with nodes of {local} ranks over {layout!r}: correct, but its ring steps are "
            f"not balanced; build the layout with local_world_size={local} (and shard the data with it)",
            stacklevel=3,
        )


_WARNED: list = []


def _check_settings(engine: str, schedule: str) -> None:
    """The engine and the schedule are known ones."""
    if engine not in ENGINES:
        raise ValueError(f"ring engine must be one of {ENGINES}; got {engine!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"ring schedule must be one of {SCHEDULES}; got {schedule!r}")


def _start_gather(k, v, group, world: int, index, schedule: str, kv_gather):
    """The K/V all-gather of the "gather" schedule: the caller's kv_gather if it started one, else one started here
    for a sparse layer on several ranks. None under the ring, and for a dense layer (a gather already started is then
    dropped)."""
    gather = kv_gather if schedule == "gather" else None
    if gather is None and schedule == "gather" and index is not None and world > 1:
        gather = KVGather(k, v, group)
    if gather is not None and index is None:
        gather.drop()
        gather = None
    return gather


def estimate_ring_index(q: torch.Tensor, k: torch.Tensor, *, group=None, layout: Layout, settings: SparseSettings,
                        softmax_scale: float | None = None, doc_ids: torch.Tensor | None = None, scorer: str = "auto",
                        schedule: str = "ring", switches: Switches | None = None):
    """This rank's rows of the index `ring_attention` takes (a `mtrain.ops.index.RowIndex`), estimated online across
    the group with SparseSettings `settings`: no rank computes it for the others, and each builds only its own rows
    (`mtrain.parallel.estimate.estimate_rank_index`). Collective: every rank of the group calls it alike. q, k, group,
    layout, softmax_scale, doc_ids, schedule, switches: as `ring_attention` takes them (only same-document keys are
    scored; the index's lists are sized for the schedule). scorer "auto": replayed from a CUDA graph under parallel.graph_ring_estimate
    (`mtrain.parallel.graphed`), else eager; another scorer (`mtrain.parallel.estimate.estimate_lines`'s) eager."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = q.shape[1] * world
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if doc_ids is not None:
        doc_ids = _check_docs(doc_ids, q, seq_len)
    positions = rank_positions(layout, seq_len, rank, q.device)  # cached on the device: no copy per call
    rows = rank_blocks(layout, seq_len, rank, settings.block_size, q.device)
    key_blocks = shard_key_blocks(layout, seq_len, rank, settings.block_size, q.device)
    if scorer == "auto":
        return estimate_rank_index_graphed(q, k, positions, seq_len, settings, scale, group, doc_ids=doc_ids,
                                           rows=rows, key_blocks=key_blocks, layout_key=(layout.spec, rank),
                                           schedule=schedule, switches=switches)
    return estimate_rank_index(q, k, positions, positions, seq_len, settings, scale, group, doc_ids=doc_ids,
                               rows=rows, key_blocks=key_blocks, scorer=scorer, schedule=schedule, switches=switches)


def _plan(q, index, layout: Layout, seq_len: int, rank: int, group, hierarchy, gather, doc_ids, engine: str,
          switches: Switches):
    """The plan the call runs: from the index (checked against the group's sequence) when there is one, the gathered
    schedule's one step straight from it where the layout allows, else the ring's; without one the dense ring's.
    With doc_ids it keeps each query to its document's keys; a sparse plan runs on the engine `resolve_engine`
    picks (the gathered plan rebuilt for the sink form that engine needs: parallel.gather_backward / gather_sink)."""
    if index is not None:
        _check_index(index, q, seq_len)
        # the gathered schedule's one step straight from the index where the layout allows, else the ring's plan
        # (its steps merged into one by the schedule)
        plan = gathered_sparse_plan(index, layout, rank, q.device) if gather is not None else None
        if plan is None:
            plan = sparse_plan(index, layout, rank, q.device, column_origin(group, hierarchy))
    else:
        plan = dense_plan(layout, seq_len, rank, q.device)
    if doc_ids is not None:
        plan = plan.with_documents(doc_ids)
    if index is not None:
        chosen = resolve_engine(engine, plan, q)
        # not "listed" only under FA4's backward
        sink = ring_gather.gathered_sink_form(chosen, layout.world_size, switches=switches)
        if sink != "listed" and gather is not None and plan.gather_slots is not None:
            plan = gathered_sparse_plan(index, layout, rank, q.device, sink=sink)
        if chosen != plan.engine:
            plan = dataclasses.replace(plan, engine=chosen)  # shares the plan's caches
    return plan


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    layout: Layout,
    index=None,
    softmax_scale: float | None = None,
    inner_group=None,
    outer_group=None,
    doc_ids: torch.Tensor | None = None,
    engine: str = "auto",
    schedule: str = "ring",
    kv_gather=None,
    dense_schedule: str = "auto",
    documents=None,
    switches: Switches | None = None,
) -> torch.Tensor:
    """Causal attention over a sequence sharded across a context-parallel group; differentiable.

    q: [B, S_local, Hq, D], k, v: [B, S_local, Hkv, D]: this rank's shard, `layout.shard(x, cp_rank)`
    (positions `layout.indices(S, cp_rank)`, S = S_local * group size). Only the Hkv heads travel.
    group: the CP process group (None = the default world group).
    index: a finished index: a global `mtrain.ops.SparseIndex` (vertical-slash sparse), this rank's rows of one as a
    `mtrain.ops.index.RowIndex` (estimated online across the group by `estimate_ring_index`, which a caller runs
    first), or None = dense. The sink + vertical columns' K/V are all-gathered from their owners while the first
    ring steps run (their gradients reduce-scattered back the same way).
    inner_group/outer_group: a hierarchical ring (inner = one node's consecutive CP ranks; outer = a second
    communicator over the CP ranks, see `comm.hierarchical_groups`, or the ranks with equal node-local
    index, in which case the CP group carries the outer ring); when not given they are derived from the node
    size parallel.hierarchy / node_size choose (`comm.ring_node_size`: by default LOCAL_WORLD_SIZE where it splits
    the group into several nodes; collective on first use), else flat. Its
    steps are balanced when the layout is built with local_world_size = the inner group's size.
    doc_ids: integer tensor [B, S] of GLOBAL document ids of the whole sequence (packed samples; equal id =
    same document), identical on every rank of the group: a query then attends only to keys of its own
    document, in every ring step and the off-ring pass.
    engine: the block kernels of the sparse steps, as `attention.engine`: "fa4" (FlashAttention-4's block-sparse
    kernels, the columns in ours; `mtrain.parallel.fa4_steps`) where it runs, "triton" (ours), "auto" (fa4 where it
    runs, else triton); fa4 falls back to triton where it cannot run (CPU, fp32, 64-token blocks, documents).
    schedule: "ring" (the flat or hierarchical ring above), or "gather" for sparse layers: every rank all-gathers
    the group's K/V (started here unless the caller started it) and runs its rows against them in one sparse call,
    with no LSE merge (`mtrain.parallel.ring_gather`; W x the shard's K/V in memory); dense layers always run the
    ring.
    kv_gather: with schedule "gather", a `ring_gather.KVGather` of these k, v the caller started earlier (before its
    estimate, so that the K/V travel while it runs), used instead of starting one here (dropped if the layer runs
    dense).
    dense_schedule: how a dense call (no index) runs: "gather" (every rank all-gathers the group's K/V and
    runs its rows in one varlen call, `mtrain.parallel.dense_gather`; layouts whose shards are a few runs of
    consecutive positions: contiguous and zigzag), "ring" (the ring's steps), "auto" (gather where the layout allows, else the ring).
    documents: `mtrain.ops.varlen.Documents` of doc_ids (built once per batch), for the gathered dense call; read
    from doc_ids here when not given.
    switches: the run's `mtrain.ops.switches.Switches` (a model's runtime passes its own; None = the documented
    defaults): the hierarchy and node size, the merge, and the gathered step's backward and sink form. The backward
    reads the ones this call ran with.
    Returns out [B, S_local, Hq, D] in q.dtype; partial results are merged in fp32 through the LSE.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    switches = or_defaults(switches)
    hierarchy = _pick_groups(group, inner_group, outer_group, switches)
    seq_len = _check_shapes(q, k, v, layout, world)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _check_settings(engine, schedule)
    if doc_ids is not None:
        doc_ids = _check_docs(doc_ids, q, seq_len)
    if index is None and world > 1:
        runs = gather_runs(layout, seq_len, rank, dense_schedule)
        if runs is not None:
            if kv_gather is not None:
                kv_gather.drop()
            if doc_ids is not None and documents is None:
                documents = Documents.from_doc_ids(doc_ids)
            return gathered_dense_attention(q, k, v, runs, layout, group, scale, documents)
    gather = _start_gather(k, v, group, world, index, schedule, kv_gather)
    plan = _plan(q, index, layout, seq_len, rank, group, hierarchy, gather, doc_ids, engine, switches)
    if index is not None and gather is not None:
        out, _ = ring_gather_attention(q, k, v, plan, group, scale, gather, switches=switches)
    elif hierarchy is None:
        out, _ = ring_flat_attention(q, k, v, plan, group, scale, switches=switches)
    else:
        _warn_unbalanced(layout, hierarchy[0])
        out, _ = ring_hierarchical_attention(q, k, v, plan, group, hierarchy[0], hierarchy[1], scale,
                                             switches=switches)
    return out
