"""One rank of a context-parallel group run alone, in one process on one device: what that rank computes at CP=N,
with every transfer replaced by a local fill, so a single GPU can time (and profile) a rank's share of the ring at
any CP size.

`emulated_group(world, rank)` stands in for `torch.distributed` as mtrain's ring code calls it (the module's
attributes, for the duration of the block): the group has `world` ranks and this process is `rank`; the other ranks
contribute nothing, so

- all_reduce leaves this rank's values (the others add the op's identity: 0 to a sum, nothing to a max or min);
- all_gather / all_gather_into_tensor put this rank's part in its slot and zeros in the others';
- reduce_scatter / reduce_scatter_tensor keep this rank's own chunk; all_to_all_single its own part (even or uneven
  splits), zeros elsewhere;
- point-to-point receives (batch_isend_irecv) are zero-filled, sends dropped; barrier does nothing.

What that measures: the rank's kernels, index, plans, merges and fills, every launch and host read, at the shapes
and list widths of a CP=N group (the plans are built for N ranks; a zero-filled shard costs the attention kernels
what real keys cost). What it does not: the transfers themselves (the fills stand in for their writes), their
overlap with compute, and the wait for the slowest rank. The online estimate sees only this rank's keys (the others'
scores are zero), so its lines are those of a sequence whose mass lies in this rank's shard: the same caps and
budgets, not one device's lines. A bench reads its results as a bound: a real ring at CP=N runs no faster than
its rank's compute alone.

Only mtrain's calls through `torch.distributed` (the package's attributes) are redirected; torch's own internals
keep the real process group, so a one-rank group initialised beforehand still serves barriers and NCCL-free code.
`new_group` makes emulated subgroups (the hierarchical ring's inner and outer rings), in which this process has its
place or none; `all_gather_object` hands every rank this one's object (the CP group is the whole world).
"""

from __future__ import annotations

import contextlib
import types

from mtrain.errors import MtrainError


class EmulatedGroup:
    """The stand-in process group: `world` ranks (global ranks `ranks`, default 0..world-1), this process being group
    rank `rank` (-1: not a member, for a group `new_group` made of others)."""

    def __init__(self, world: int, rank: int, ranks: list[int] | None = None):
        if world < 1 or not -1 <= rank < world or (ranks is None and rank < 0):
            raise MtrainError(f"emulated group: need world >= 1 and 0 <= rank < world; got world {world}, rank {rank}")
        self.world, self.rank = world, rank
        self.ranks = list(range(world)) if ranks is None else list(ranks)

    def __repr__(self) -> str:
        return f"EmulatedGroup(world={self.world}, rank={self.rank}, ranks={self.ranks})"


class _Done:
    """A finished collective (what async_op=True returns)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _P2POp:
    """dist.P2POp's fields, without its checks against a real group."""

    def __init__(self, op, tensor, peer=None, group=None, tag: int = 0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def _isend(*args, **kwargs):  # identities that batch_isend_irecv tells apart; never called themselves
    raise MtrainError("emulated group: isend runs only through batch_isend_irecv")


def _irecv(*args, **kwargs):
    raise MtrainError("emulated group: irecv runs only through batch_isend_irecv")


def _fill_others(chunks, own, rank: int) -> None:
    for r, chunk in enumerate(chunks):
        if r == rank:
            if chunk.data_ptr() != own.data_ptr():
                chunk.copy_(own.reshape(chunk.shape))
        else:
            chunk.zero_()


@contextlib.contextmanager
def emulated_group(world: int, rank: int = 0):
    """Within the block, mtrain's calls through `torch.distributed` see a `world`-rank group of which this process is
    rank `rank` (module docstring); yields the group, also `dist.group.WORLD` there."""
    import torch.distributed as dist

    grp = EmulatedGroup(world, rank)

    def done(async_op):
        return _Done() if async_op else None

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return done(async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        g = of(group)
        if len(tensor_list) != g.world:
            raise MtrainError(f"emulated all_gather: {len(tensor_list)} outputs for a group of {g.world}")
        _fill_others(tensor_list, tensor, g.rank)
        return done(async_op)

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        g = of(group)
        _fill_others(output_tensor.view(g.world, -1).unbind(0), input_tensor.reshape(-1), g.rank)
        return done(async_op)

    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        output.copy_(input_list[of(group).rank])
        return done(async_op)

    def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
        g = of(group)
        output.copy_(input.reshape(g.world, *output.shape)[g.rank])
        return done(async_op)

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        g = of(group)
        if output_split_sizes is None and input_split_sizes is None:
            _fill_others(output.chunk(g.world), input.chunk(g.world)[g.rank], g.rank)
            return done(async_op)
        outs = list(output.split(list(output_split_sizes))) if output_split_sizes is not None else \
            list(output.chunk(g.world))
        ins = list(input.split(list(input_split_sizes))) if input_split_sizes is not None else list(input.chunk(g.world))
        if len(outs) != g.world or len(ins) != g.world or outs[g.rank].shape != ins[g.rank].shape:
            raise MtrainError(f"emulated all_to_all_single: splits {output_split_sizes} / {input_split_sizes} do not "
                              f"fit a group of {g.world} (this rank's own part must be the same size both ways)")
        _fill_others(outs, ins[g.rank], g.rank)
        return done(async_op)

    def batch_isend_irecv(p2p_op_list):
        for op in p2p_op_list:
            if op.op is _irecv:
                op.tensor.zero_()
        return [_Done() for _ in p2p_op_list]

    def barrier(group=None, async_op=False, device_ids=None):
        return done(async_op)

    def new_group(ranks=None, *args, **kwargs):
        ranks = list(range(world)) if ranks is None else sorted(ranks)
        return EmulatedGroup(len(ranks), ranks.index(rank) if rank in ranks else -1, ranks)

    def all_gather_object(object_list, obj, group=None):
        for i in range(len(object_list)):  # every rank holds what this one does (one CP group: the world)
            object_list[i] = obj

    def of(group):
        return grp if group is None else group

    replacements = {
        "get_world_size": lambda group=None: of(group).world,
        "get_rank": lambda group=None: of(group).rank,
        "get_global_rank": lambda group, group_rank: of(group).ranks[group_rank],
        "get_process_group_ranks": lambda group: list(of(group).ranks),
        "all_gather_object": all_gather_object,
        "all_reduce": all_reduce,
        "all_gather": all_gather,
        "all_gather_into_tensor": all_gather_into_tensor,
        "reduce_scatter": reduce_scatter,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "all_to_all_single": all_to_all_single,
        "batch_isend_irecv": batch_isend_irecv,
        "P2POp": _P2POp,
        "isend": _isend,
        "irecv": _irecv,
        "barrier": barrier,
        "new_group": new_group,
        "group": types.SimpleNamespace(WORLD=grp),
    }
    if hasattr(dist, "all_gather_single"):
        replacements["all_gather_single"] = all_gather_into_tensor
    missing = object()
    saved = {name: getattr(dist, name, missing) for name in replacements}
    try:
        for name, value in replacements.items():
            setattr(dist, name, value)
        yield grp
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(dist, name)
            else:
                setattr(dist, name, value)
        from mtrain.parallel.comm import forget_hierarchies

        forget_hierarchies()  # the hierarchical ring's cached groups were stand-ins
