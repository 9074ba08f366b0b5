"""Point-to-point ring shifts (async `batch_isend_irecv`: the next step's data moves while the current one
computes) and the process-group helpers shared by every ring schedule."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtrain.errors import MtrainError
from mtrain.ops.switches import Switches, or_defaults

# Separate tags keep the KV stream and the gradient stream apart when both are in flight between the
# same pair of ranks (gloo matches on tag; NCCL matches in issue order, which is the same on both ends).
TAG_KV = 11
TAG_GRAD = 12


@dataclass
class PendingShift:
    """Tensors being received; `wait()` returns them once the transfer is done."""

    received: list[torch.Tensor]
    works: list = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)  # kept alive until the sends complete

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works = []
        self.sent = []
        return self.received


class RingComm:
    """Shifts over the ranks of `group`: by default a ring in group-rank order (rank i sends to i+1 and
    receives from i-1); `shift` also takes explicit group ranks for other orders."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def shift(self, tensors: list[torch.Tensor], tag: int = TAG_KV, send_to: int | None = None,
              recv_from: int | None = None) -> PendingShift:
        """Start sending `tensors` to group rank `send_to` (default: next) and receiving same-shaped ones
        from `recv_from` (default: previous). Sending to oneself hands the tensors back without a copy."""
        send_to = (self.rank + 1) % self.size if send_to is None else send_to
        recv_from = (self.rank - 1) % self.size if recv_from is None else recv_from
        if send_to == self.rank and recv_from == self.rank:
            return PendingShift(received=list(tensors))
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        to_peer = dist.get_global_rank(self.group, send_to)
        from_peer = dist.get_global_rank(self.group, recv_from)
        ops = [dist.P2POp(dist.isend, t, peer=to_peer, group=self.group, tag=tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, peer=from_peer, group=self.group, tag=tag) for t in received]
        return PendingShift(received=received, works=dist.batch_isend_irecv(ops), sent=sent)


_HIERARCHY_CACHE: dict[tuple[tuple[int, ...], int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def forget_hierarchies() -> None:
    """Drop the cached inner / outer groups of `hierarchical_groups` (after their process groups are gone, e.g. the
    stand-in ones of `mtrain.bench.emulate`)."""
    _HIERARCHY_CACHE.clear()


def local_world_size_from_env() -> int | None:
    """LOCAL_WORLD_SIZE as set by torchrun / accelerate (GPUs per node), or None when unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def ring_node_size(world: int, *, switches: Switches | None = None) -> int | None:
    """Ranks per node of the hierarchical ring over a CP group of `world` ranks, or None for the flat ring, as
    parallel.hierarchy and parallel.node_size say (`switches`; None = the defaults): flat -> None; auto -> the node
    size (node_size, else the launcher's LOCAL_WORLD_SIZE) where it splits the group into several whole nodes, else
    None; hierarchical -> that node size, refused where it does not split the group."""
    switches = or_defaults(switches)
    if switches.hierarchy == "flat":
        return None
    local = switches.node_size or local_world_size_from_env()
    if local is not None and 1 < local < world and world % local == 0:
        return local
    if switches.hierarchy == "hierarchical":
        source = "parallel.node_size" if switches.node_size else "LOCAL_WORLD_SIZE (the launcher's GPUs per node)"
        raise MtrainError(f"parallel.hierarchy: hierarchical needs nodes that split the CP group of {world} ranks "
                          f"into several, and the node size is {local} ({source}); set parallel.node_size to the "
                          "ranks per node, or parallel.hierarchy: auto")
    return None


def hierarchical_groups(
    group: dist.ProcessGroup | None, local_world_size: int
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(inner, outer) groups for a hierarchical ring over the CP `group`: inner = consecutive runs of
    `local_world_size` group ranks (one node each); outer = a second communicator over all the group's
    ranks, for the inter-node ring, so its transfers run beside the inner ring's instead of behind them.

    Creating groups is collective over the whole world, so every rank must call this at the same time
    (ring_attention does so on its first call); results are cached per CP group.
    """
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if local_world_size < 1 or size % local_world_size:
        raise MtrainError(
            f"hierarchical ring: CP group of {size} ranks cannot be split into nodes of "
            f"{local_world_size} (parallel.node_size, else LOCAL_WORLD_SIZE); use a CP size that is a multiple of the "
            "GPUs per node"
        )
    my_ranks = tuple(dist.get_process_group_ranks(group))
    key = (my_ranks, local_world_size)
    if key in _HIERARCHY_CACHE:
        return _HIERARCHY_CACHE[key]
    # every rank learns every CP group, so all ranks create the same groups in the same order
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, my_ranks)
    for ranks in sorted(set(everyone)):
        nodes = len(ranks) // local_world_size
        inner_sets = [ranks[n * local_world_size:(n + 1) * local_world_size] for n in range(nodes)]
        made_inner = [dist.new_group(list(r)) for r in inner_sets]
        made_outer = dist.new_group(list(ranks))
        if ranks == my_ranks:
            me = dist.get_rank()
            inner = next(g for g, r in zip(made_inner, inner_sets) if me in r)
            _HIERARCHY_CACHE[key] = (inner, made_outer)
    return _HIERARCHY_CACHE[key]
