"""The data-parallel x context-parallel mesh: which ranks share a sequence, and their process groups.

Ranks [d*cp, (d+1)*cp) form context-parallel group d and all read DP shard d of the data. With several
nodes (a node size below cp: parallel.node_size, else LOCAL_WORLD_SIZE, under parallel.hierarchy auto or
hierarchical; `mtrain.parallel.comm.ring_node_size`) each CP group is split into inner (one node) and outer (across
nodes) rings. Group creation is collective, so every rank creates every group in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtrain.errors import MtrainError


@dataclass
class Mesh:
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    cp_group: object = None
    inner_group: object = None
    outer_group: object = None


def build_mesh(world: int, rank: int, cp_size: int, local_world_size: int | None = None) -> Mesh:
    if cp_size < 1 or world % cp_size:
        raise MtrainError(f"parallel.cp_size={cp_size} must divide the number of processes ({world}); "
                          f"valid values: {', '.join(str(c) for c in range(1, world + 1) if world % c == 0)}")
    mesh = Mesh(dp_size=world // cp_size, dp_rank=rank // cp_size, cp_size=cp_size, cp_rank=rank % cp_size)
    if cp_size == 1:
        return mesh
    import torch.distributed as dist

    for d in range(mesh.dp_size):
        ranks = list(range(d * cp_size, (d + 1) * cp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mesh.cp_group = group
    local = local_world_size or cp_size
    if 1 < local < cp_size and cp_size % local == 0:
        nodes = cp_size // local
        for d in range(mesh.dp_size):
            base = d * cp_size
            for n in range(nodes):
                ranks = [base + n * local + i for i in range(local)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mesh.inner_group = group
            for i in range(local):
                ranks = [base + n * local + i for n in range(nodes)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    mesh.outer_group = group
    return mesh
