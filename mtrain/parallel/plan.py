"""What each ring step of one rank computes: a sparse index (the global SparseIndex, or the rank's own rows as a
RowIndex) remapped to local block lists, with the sink block and vertical columns taken off the ring (gathered
once from their owners, attended with one chosen step); built once per index (cached with it), used by forward
and backward together with the kernels' derived data."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from mtrain.errors import MtrainError
from mtrain.ops.columns import RingColumns, ring_columns
from mtrain.ops.index import BOUNDED, COLUMN_BASE, RowIndex, group_counts, rows_from_lines
from mtrain.parallel.dense_rects import Rect, dense_rects
from mtrain.parallel.layout import Layout


@dataclass
class StepBlocks:
    """Local key-block lists of one ring step: ids [B, Hq, nQB_local, M] int32 sorted, -1 padded; counts.

    columns: for the local step, the off-ring columns as key tokens appended after the shard's own
    (ids = S_local + slot into `OffRingColumns.positions`, -1 padded; counts), else None; k_pos: the global
    positions of the step's keys (the shard's, then the columns')."""

    ids: torch.Tensor
    counts: torch.Tensor
    k_pos: torch.Tensor
    columns: tuple[torch.Tensor, torch.Tensor] | None = None

    def as_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids, self.counts


@dataclass
class OffRingColumns:
    """Sink block + vertical columns, attended by one ring step (`RingPlan.column_origin`) against K/V gathered
    once from their owners.

    positions [U] global positions (padding = seq_len, causally invisible), owner/local [U] where each
    lives (-1 for padding), ids [B, Hq, nQB_local, C] int32 indices into positions, sorted, -1 padded; or, for an
    index built without column lists, ids and counts None and `form` the same columns list-free
    (`mtrain.ops.columns.RingColumns`, slots from 0).
    The gather is an all-gather of per_rank rows from every rank (the most any rank owns; shorter lists padded):
    send_local [per_rank] the local rows this rank sends (its slots ascending, padding row 0), src [U] where each
    slot lies in the gathered [W * per_rank] rows, by_rank [W, per_rank] the slots each rank sends (padding = U),
    which also orders the column gradients for their reduce-scatter back to the owners (index tensors: the
    gather and the gradient scatter need no host sync).
    """

    positions: torch.Tensor
    owner: torch.Tensor
    local: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    per_rank: int
    send_local: torch.Tensor
    src: torch.Tensor
    by_rank: torch.Tensor
    form: RingColumns | None = None

    def step_columns(self, base: int):
        """The columns of a step whose slots start at key `base`: (ids, counts) lists or the list-free form."""
        if self.form is not None:
            return self.form.shifted(base)
        return torch.where(self.ids >= 0, self.ids + base, -1).to(torch.int32), self.counts


@dataclass
class RingPlan:
    """Everything one rank needs to run a ring: positions of every rank's shard, the local block size,
    per-origin block lists (None = dense), origins with nothing to compute, the off-ring pass, and for
    dense steps that are unions of full/causal rectangles, those rectangles (run by fused SDPA kernels)."""

    seq_len: int
    rank: int
    block_size: int
    positions: list[torch.Tensor]
    steps: dict[int, StepBlocks | None]
    skip: set[int]
    columns: OffRingColumns | None
    rects: dict[int, list[Rect] | None] = field(default_factory=dict)
    doc_ids: torch.Tensor | None = None
    """Global document ids [B, seq_len] (packed samples) or None; see `with_documents`."""
    kernel_caches: dict[tuple, dict] = field(default_factory=dict, repr=False)
    column_origin: int | None = None
    """The origin whose step attends the gathered columns (appended to its keys); None: no columns."""
    engine: str = "triton"
    """The block kernels of the sparse steps: "triton" (`mtrain.ops.partial`) or "fa4" (`mtrain.parallel.fa4_steps`);
    set per call by `ring_attention` on a copy that shares the caches."""
    bounded: bool = False
    """Built from a RowIndex with bounded widths (`rows_from_lines(bound_widths=True)`): list widths are bounds
    known on the host, nothing was read back to build the plan, every origin's step runs (`skip` is empty), and
    the kernels' derived lists are sized from the same bounds (each step's lists hold at most one entry per
    block offset; each head's columns are the sink block's and its verticals)."""
    gather_slots: tuple | None = None
    """A plan for the gathered schedule (`mtrain.parallel.ring_gather`): one step, keyed by this rank, over the group's
    K/V in the ring's step order (this rank's shard first) followed by the column slots; (col_src [U]: the gathered
    row each column slot copies, col_dst [U]: where its gradient goes back, a padding slot onto itself, n_local,
    sink copies: None, or (the gathered rows of the sink block's tokens [block_size], R) for R copies of them held in
    the blocks after the column slots, whose gradients fold back into those rows)."""

    @property
    def q_pos(self) -> torch.Tensor:
        return self.positions[self.rank]

    def docs(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Document ids [B, n] of the tokens at global `positions` (padding positions >= seq_len read the
        last token's id: they are causally invisible anyway), or None without document masking."""
        if self.doc_ids is None:
            return None
        return self.doc_ids[:, positions.clamp(max=self.seq_len - 1)]

    def with_documents(self, doc_ids: torch.Tensor) -> "RingPlan":
        """A copy (cached plans stay untouched) whose steps keep only same-document pairs. The dense
        rectangles are dropped: a fused SDPA rectangle cannot mask documents, so those steps run the
        partial kernels, which take the ids (and on the GPU skip the blocks of other documents). Each step
        gets an empty kernel cache: what the kernels derive then depends on these ids."""
        return dataclasses.replace(self, rects={}, doc_ids=doc_ids, kernel_caches={})

    def kernel_cache(self, origin: int, q: torch.Tensor, k: torch.Tensor) -> dict:
        """The `plans` dict of `mtrain.ops.partial` for the step of `origin` (the transposed lists, work items
        and column plan the kernels derive from its lists), filled on first use and shared by forward,
        backward and every later call with this plan and these shapes (B, Hq, Hkv, D: a cached dense plan
        serves any batch)."""
        key = (origin, q.shape[0], q.shape[2], k.shape[2], q.shape[3])
        if key not in self.kernel_caches:
            self.kernel_caches[key] = {BOUNDED: True} if self.bounded and self.steps.get(origin) is not None else {}
            base = self.column_base(origin)
            if base:
                self.kernel_caches[key][COLUMN_BASE] = base
        return self.kernel_caches[key]

    def column_base(self, origin: int) -> int:
        """The first key of the step's gathered columns (appended after its keys: the shard's on the ring's column
        step, the group's W shards on the gathered one), 0 for a step without columns: every column id of the step's
        lists is at least this (`mtrain.ops.index.COLUMN_BASE`)."""
        step = self.steps.get(origin)
        if step is None or step.columns is None:
            return 0
        n_local = self.positions[self.rank].numel()
        return n_local * len(self.positions) if self.gather_slots is not None else n_local


@functools.lru_cache(maxsize=16)
def _positions_cached(spec: tuple, seq_len: int, device: str) -> tuple[torch.Tensor, ...]:
    layout = Layout.create(*spec)
    local = layout.check(seq_len)
    perm = layout.permutation(seq_len).to(device)  # once: `indices` per rank would rebuild it W times
    return tuple(perm[layout.slot(r) * local:(layout.slot(r) + 1) * local].clone() for r in range(layout.world_size))


@functools.lru_cache(maxsize=16)
def _owners_cached(spec: tuple, seq_len: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    owner, local = Layout.create(*spec).owners(seq_len)
    return owner.to(device), local.to(device)


def rank_positions(layout: Layout, seq_len: int, rank: int, device: torch.device) -> torch.Tensor:
    """The global positions of rank `rank`'s shard, on `device`; cached per layout (no host-to-device copy per
    layer: such a copy waits for the device)."""
    return _positions_cached(layout.spec, seq_len, str(device))[rank]


def rank_blocks(layout: Layout, seq_len: int, rank: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The global query blocks rank `rank` holds (ascending, distinct), on `device`; cached per layout, so the
    estimator's per-rank index needs no host read or copy per layer to know its rows."""
    return _rank_blocks_cached(layout.spec, seq_len, rank, block_size, str(device))


@functools.lru_cache(maxsize=64)
def _rank_blocks_cached(spec: tuple, seq_len: int, rank: int, block_size: int, device: str) -> torch.Tensor:
    return torch.unique(_positions_cached(spec, seq_len, "cpu")[rank] // block_size).to(device)


def shard_key_blocks(layout: Layout, seq_len: int, rank: int, block_size: int,
                     device: torch.device) -> torch.Tensor | None:
    """The global block id of each stored key block of rank `rank`'s shard when the shard is whole blocks in
    ascending order (what the distributed Triton scorer walks), else None; cached per layout (no host read per
    layer)."""
    return _shard_key_blocks_cached(layout.spec, seq_len, rank, block_size, str(device))


@functools.lru_cache(maxsize=64)
def _shard_key_blocks_cached(spec: tuple, seq_len: int, rank: int, block_size: int, device: str):
    from mtrain.parallel.estimate import shard_key_blocks as from_positions

    blocks = from_positions(_positions_cached(spec, seq_len, "cpu")[rank], block_size)
    return None if blocks is None else blocks.to(device)


def _all_positions(layout: Layout, seq_len: int, device: torch.device) -> list[torch.Tensor]:
    """Every rank's positions on `device`; cached, since every layer of a step asks for the same ones."""
    return list(_positions_cached(layout.spec, seq_len, str(device)))


def dense_plan(layout: Layout, seq_len: int, rank: int, device: torch.device) -> RingPlan:
    """Dense causal: every visiting shard in full, except shards wholly in this rank's future (cached:
    the plan depends only on the layout, length, rank and device)."""
    return _dense_plan_cached(layout.spec, seq_len, rank, str(device))


@functools.lru_cache(maxsize=16)
def _dense_plan_cached(spec: tuple, seq_len: int, rank: int, device: str) -> RingPlan:
    layout = Layout.create(*spec)
    positions = _all_positions(layout, seq_len, device)
    mine = positions[rank]
    skip = {r for r, pos in enumerate(positions) if int(pos.min()) > int(mine.max())}
    block = math.gcd(seq_len // layout.world_size, 64)
    cpu = [p.cpu() for p in positions]
    rects = {r: dense_rects(cpu[rank], cpu[r], same_shard=r == rank) for r in range(layout.world_size) if r not in skip}
    return RingPlan(seq_len, rank, block, positions, {r: None for r in range(layout.world_size)}, skip, None, rects)


def _pack(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the valid (>= 0) ids of each list to the front, keeping their order; (ids int32, counts).
    The lists built here are already ascending (layouts keep a rank's positions ascending within each
    of its runs, and the global lists are sorted), so a stable sort on validity packs them; the width is
    kept (no host sync to learn the longest list: the kernels read `counts` entries)."""
    valid = ids >= 0
    order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
    return torch.gather(ids, -1, order).to(torch.int32), valid.sum(-1, dtype=torch.int32)


def _key_block_table(positions: torch.Tensor, local_block: int, block_size: int, n_global: int) -> torch.Tensor:
    """For one rank's shard: [n_global, m] local key-block ids that lie inside each global block, -1 padded."""
    global_of_local = positions.view(-1, local_block)[:, 0] // block_size
    per_global = torch.bincount(global_of_local, minlength=n_global)
    width = max(int(per_global.max()), 1)
    order = torch.argsort(global_of_local, stable=True)
    start = torch.cumsum(per_global, 0) - per_global
    slot = torch.arange(order.numel(), device=positions.device) - start[global_of_local[order]]
    table = torch.full((n_global, width), -1, dtype=torch.long, device=positions.device)
    table[global_of_local[order], slot] = order
    return table


def sparse_plan(index, layout: Layout, rank: int, device: torch.device, column_origin: int | None = None) -> RingPlan:
    """Remap a sparse index onto rank `rank`'s ring steps: a global SparseIndex (block lists + vertical columns),
    or a RowIndex holding this rank's rows (`mtrain.parallel.estimate.estimate_rank_index`).

    Slash/diagonal blocks travel the ring; global block 0 (the sinks) and vertical columns go off the ring:
    gathered once and appended to the keys of the step of `column_origin` (default: the local step), so no single
    worker carries them at one ring step and they cost no kernel launch of their own. A schedule picks the
    origin of a step that runs after the gather had time to arrive (`mtrain.parallel.ring`). Cached with the
    index (which is frozen), so repeated calls with one index, and the kernels' derived data in the plan, are
    built once.
    """
    column_origin = rank if column_origin is None else column_origin
    if not 0 <= column_origin < layout.world_size:
        raise MtrainError(f"column_origin {column_origin} is not a rank of the {layout.world_size}-rank ring")
    key = ("ring_plan", layout.spec, rank, str(device), column_origin)
    cache = index._cache
    if key not in cache:
        cache[key] = build_sparse_plan(index, layout, rank, device, column_origin)
    return cache[key]


def _rank_lists(index, my_global_blocks: torch.Tensor, rank: int, device, list_free_ok: bool = False):
    """(block lists int64, column lists int32) [B, H, nLQB, *] in global ids of the rank's local query blocks. The
    column lists stay int32 (and are the index's own tensor where the rows match): at 256K tokens per GPU with
    4,096-line caps an int64 copy of them is 2 GiB. A RowIndex without column lists gives None for them where the
    caller reads the columns list-free (`list_free_ok`), else lists built here from its lines."""
    if isinstance(index, RowIndex) and index.col_ids is None and not list_free_ok:
        vertical, slash, _ = index._cache["lines"]
        rows = torch.unique(my_global_blocks)  # (a local block smaller than the index's: blocks repeat)
        part = rows_from_lines(vertical, slash, int(index.seq_len), int(index.block_size), rows.to(vertical.device),
                               totals=False, check=False)
        at = torch.searchsorted(rows, my_global_blocks)
        return part.block_ids.to(device).long()[:, :, at], part.col_ids.to(device, torch.int32)[:, :, at]

    def cols(select):
        return None if index.col_ids is None else select(index.col_ids.to(device, torch.int32))

    if not isinstance(index, RowIndex):
        return (index.block_ids.to(device).long()[:, :, my_global_blocks, :],
                cols(lambda c: c[:, :, my_global_blocks, :]))
    held = index.rows.to(device)
    if held is my_global_blocks:  # the rows the rank's cached block list names: nothing to look up or check
        return index.block_ids.to(device).long(), cols(lambda c: c)
    slot = torch.searchsorted(held, my_global_blocks).clamp(max=held.numel() - 1)
    if not torch.equal(held[slot], my_global_blocks):
        raise MtrainError(f"the RowIndex does not hold the query blocks of rank {rank}'s shard; build it from "
                          "that rank's positions (mtrain.parallel.estimate.rank_rows)")
    return index.block_ids.to(device).long()[:, :, slot, :], cols(lambda c: c[:, :, slot, :])


def build_sparse_plan(index, layout: Layout, rank: int, device: torch.device, column_origin: int) -> RingPlan:
    seq_len, block_size = int(index.seq_len), int(index.block_size)
    layout.check(seq_len)
    local_block = layout.local_block_size(seq_len, block_size)
    positions = _all_positions(layout, seq_len, device)

    bounded = isinstance(index, RowIndex) and bool(index._cache.get("bounded_widths"))
    if local_block == block_size:  # the cached tensor `estimate_rank_index` was given as rows
        my_global_blocks = rank_blocks(layout, seq_len, rank, block_size, device)
    else:
        my_global_blocks = positions[rank].view(-1, local_block)[:, 0] // block_size
    list_free = local_block == block_size  # the list-free columns need the index's blocks on the ring
    rows, my_cols = _rank_lists(index, my_global_blocks, rank, device, list_free)  # [B, H, nLQB, *] global ids
    had_sink = (rows == 0).any(dim=-1)
    rows = torch.where(rows == 0, -1, rows)

    owners = _block_owners(layout.spec, seq_len, local_block, block_size, str(device))
    bounded = bounded and owners is not None  # (other layouts remap through tables, trimmed with host reads)
    columns = _off_ring_columns(index, layout, rank, had_sink, my_cols, local_block, seq_len, device, bounded,
                                my_global_blocks)
    steps: dict[int, StepBlocks | None] = {}
    if owners is not None:  # every global block is one local block of one rank: split the lists once
        per_origin, longest = _split_by_origin(rows, *owners, layout.world_size, bounded)
    else:
        per_origin, longest = _remap_per_origin(rows, layout, seq_len, local_block, block_size, device)
    for origin in range(layout.world_size):
        ids, counts = per_origin[origin]
        k_pos = positions[origin]
        step_columns = None
        if origin == column_origin and columns is not None:
            # the gathered columns follow the shard's own keys: slot u is key S_local + u of this step
            step_columns = columns.step_columns(k_pos.numel())
            k_pos = torch.cat([k_pos, columns.positions])
        steps[origin] = StepBlocks(ids, counts, k_pos, step_columns)
    # the step carrying the columns always runs
    skip = set() if longest is None else {o for o, n in enumerate(longest) if n == 0 and steps[o].columns is None}
    return RingPlan(seq_len, rank, local_block, positions, steps, skip, columns,
                    column_origin=column_origin if columns is not None else None, bounded=bounded)


SINK_FORMS = ("listed", "replicas", "columns")

# Under a backward that runs each key block's query blocks in turn (FA4's), the sink block, which every query block
# reads, would be one long tail: the gathered plan then lists copies of it instead, each read by at most this many
# query blocks (and at most a list's width, so the bounded transposed lists hold them).
SINK_SHARE = 32


def gathered_sparse_plan(index, layout: Layout, rank: int, device: torch.device,
                         sink: str = "listed") -> RingPlan | None:
    """The plan of the gathered schedule for rank `rank` straight from a sparse index (cached with it): each listed
    global key block g becomes gathered block ((rank - owner[g]) % W) * nLB + local[g], one sort per list puts them in
    order; the columns are the ring's off-ring columns in slots after the W shards. The sink block (`SINK_FORMS`):
    "listed", a listed block as on one device (the columns are the verticals alone); "replicas", the same but each
    query block past it lists one of R copies of it held in slots after the columns (`SINK_SHARE` query blocks a
    copy; `RingPlan.gather_slots` says where they come from), for FA4's backward; "columns", as on the ring, its tokens
    are columns of every query block. None where a global block is not one local block of one rank (then
    `mtrain.parallel.ring_gather.gathered_plan` merges the ring plan's steps)."""
    if sink not in SINK_FORMS:
        raise ValueError(f"gathered plan: sink must be one of {SINK_FORMS}; got {sink!r}")
    key = ("gathered_plan", layout.spec, rank, str(device), sink)
    cache = index._cache
    if key not in cache:
        if sink == "replicas":  # the listed plan's lists with the sink block swapped for its copies
            listed = gathered_sparse_plan(index, layout, rank, device)
            cache[key] = None if listed is None else _with_sink_copies(listed, layout, device)
        else:
            cache[key] = _build_gathered_plan(index, layout, rank, device, sink == "columns")
    return cache[key]


def sink_copies(n_query_blocks: int, list_width: int) -> int:
    """How many copies of the sink block a gathered plan with `sink="replicas"` holds for this many local query blocks
    and lists this wide (each copy read by at most min(SINK_SHARE, list_width) of them)."""
    return -(-n_query_blocks // max(1, min(SINK_SHARE, list_width)))


def _build_gathered_plan(index, layout: Layout, rank: int, device: torch.device,
                         sink_columns: bool) -> RingPlan | None:
    seq_len, block_size = int(index.seq_len), int(index.block_size)
    layout.check(seq_len)
    local_block = layout.local_block_size(seq_len, block_size)
    owners = _block_owners(layout.spec, seq_len, local_block, block_size, str(device))
    if owners is None:
        return None
    world = layout.world_size
    positions = _all_positions(layout, seq_len, device)
    bounded = isinstance(index, RowIndex) and bool(index._cache.get("bounded_widths"))
    my_global_blocks = rank_blocks(layout, seq_len, rank, block_size, device)
    rows, my_cols = _rank_lists(index, my_global_blocks, rank, device, list_free_ok=True)
    had_sink = None  # listed: its keys are among the gathered ones, so the block kernels run it as one device does
    if sink_columns:
        had_sink = (rows == 0).any(dim=-1)
        rows = torch.where(rows == 0, -1, rows)
    columns = _off_ring_columns(index, layout, rank, had_sink, my_cols, local_block, seq_len, device, bounded,
                                my_global_blocks)
    owner, local = owners
    n_local = positions[rank].numel()
    nlb = n_local // local_block
    at = rows.clamp(min=0)
    past = world * nlb  # sorts after every gathered block
    ids = torch.sort(torch.where(rows >= 0, ((rank - owner[at]) % world) * nlb + local[at], past), dim=-1).values
    counts = (rows >= 0).sum(-1, dtype=torch.int32)
    if not bounded:  # trimmed to the longest list (one host read), as the ring's plan is
        ids = ids[..., :max(1, int(counts.max()))]
    ids = torch.where(ids < past, ids, -1).to(torch.int32).contiguous()
    k_pos = torch.cat([positions[(rank - step) % world] for step in range(world)])
    step_columns, slots = gathered_columns(columns, rank, world, n_local)
    if columns is not None:
        k_pos = torch.cat([k_pos, columns.positions])
    return RingPlan(seq_len, rank, local_block, positions, {rank: StepBlocks(ids, counts, k_pos, step_columns)},
                    set(), columns, column_origin=rank if columns is not None else None, bounded=bounded,
                    gather_slots=slots)


def _with_sink_copies(plan: RingPlan, layout: Layout, device: torch.device) -> RingPlan:
    """The gathered plan with its sink block listed (`sink="listed"`) turned into `sink="replicas"`: query block i past
    the sink lists copy i % R instead, the copies in the blocks after the column slots (the step's keys then end in
    R x the sink's positions), and `gather_slots` names the gathered rows they copy. A sequence of one block has no
    query block past the sink: the plan as it is."""
    seq_len, bs, rank = plan.seq_len, plan.block_size, plan.rank
    if seq_len < 2 * bs:
        return plan
    step = plan.steps[rank]
    world = len(plan.positions)
    n_local = plan.positions[rank].numel()
    owner, local = _block_owners(layout.spec, seq_len, bs, bs, str(device))
    sink_at = ((rank - owner[0]) % world) * (n_local // bs) + local[0]  # global block 0 among the gathered ones
    nq = step.ids.shape[2]
    n_copies = sink_copies(nq, step.ids.shape[-1])
    copy_of = step.k_pos.numel() // bs + torch.arange(nq, device=device) % n_copies  # (shards, slots: whole blocks)
    ids = step.ids.long()
    past_sink = (rank_blocks(layout, seq_len, rank, bs, device) != 0).view(1, 1, -1, 1)  # not its own diagonal
    past = 2**30  # sorts after every block
    ids = torch.where(ids < 0, past, torch.where((ids == sink_at) & past_sink, copy_of.view(1, 1, -1, 1), ids))
    ids = torch.sort(ids, dim=-1).values
    ids = torch.where(ids < past, ids, -1).to(torch.int32).contiguous()
    src = ((rank - owner[0]) % world) * n_local + local[0] * bs + torch.arange(bs, device=device)
    k_pos = torch.cat([step.k_pos, torch.arange(bs, device=device).repeat(n_copies)])
    return dataclasses.replace(plan, steps={rank: dataclasses.replace(step, ids=ids, k_pos=k_pos)}, kernel_caches={},
                               gather_slots=(*plan.gather_slots[:3], (src, n_copies)))


def gathered_columns(columns: OffRingColumns | None, rank: int, world: int, n_local: int):
    """The off-ring columns of rank `rank`'s gathered step: (its column lists (ids into the slots after the W
    shards, counts) or None, `RingPlan.gather_slots`). Rank o's shard is at step (rank - o) % W of the gathered rows:
    arithmetic on the device, no host-to-device copy (which would wait)."""
    if columns is None:
        return None, (None, None, n_local, None)
    real = columns.owner >= 0
    col_src = torch.where(real, ((rank - columns.owner.clamp(min=0)) % world) * n_local + columns.local.clamp(min=0), 0)
    # where each slot's gradient goes back: its gathered row; a padding slot onto itself (distinct targets)
    col_dst = torch.where(real, col_src, world * n_local + torch.arange(real.numel(), device=real.device))
    return columns.step_columns(world * n_local), (col_src, col_dst, n_local, None)


def _remap_per_origin(rows, layout: Layout, seq_len: int, local_block: int, block_size: int, device):
    """Per origin (ids, counts) of the rank's lists [B, H, nLQB, M] (global key blocks) in the origin's local
    blocks, through each origin's `_key_block_table` (any layout); and the longest list per origin (one host
    sync). Work and memory: W x the rank's list entries x the table width."""
    valid = (rows >= 0).unsqueeze(-1)
    tables = _key_block_tables(layout.spec, seq_len, local_block, block_size, str(device))
    lists = [_pack(torch.where(valid, table[rows.clamp(min=0)], -1).flatten(-2)) for table in tables]
    return lists, torch.stack([counts.max() for _, counts in lists]).tolist()


def _split_by_origin(rows: torch.Tensor, owner: torch.Tensor, local: torch.Tensor, world: int, bounded: bool = False):
    """`_remap_per_origin` where global key block j is local block local[j] of rank owner[j] alone: every
    listed entry goes to one origin, so one stable sort by (origin, list) splits the lists (ascending within
    each, as the layouts keep a rank's blocks ascending; empty slots sort last, into a spare list that is
    dropped) in time and memory of the rank's list slots, not W x them. Widths are trimmed to the longest list of
    all origins (one host read, which also gives the per-origin longest lists); bounded: every origin's lists as
    wide as the rank's (no host read; longest is None)."""
    b, h, n, m = rows.shape
    lists = b * h * n
    spare = world * lists
    key = torch.where(rows >= 0, owner[rows.clamp(min=0)] * lists
                      + torch.arange(lists, device=rows.device).view(b, h, n, 1), spare).flatten()
    key, order = torch.sort(key, stable=True)
    loc = local[rows.clamp(min=0)].flatten()[order]
    counts = group_counts(key, spare + 1)
    pos = torch.arange(key.numel(), device=rows.device) - (torch.cumsum(counts, 0) - counts)[key]
    ids = torch.full((spare + 1, m), -1, dtype=torch.int32, device=rows.device)
    ids[key, pos.clamp(max=m - 1)] = loc.to(torch.int32)  # (only the spare list's can pass the width)
    ids = ids[:spare].view(world, b, h, n, m)
    counts = counts[:spare].view(world, b, h, n).to(torch.int32)
    longest = None
    if not bounded:
        longest = counts.view(world, lists).amax(1).tolist()
        ids = ids[..., :max(1, max(longest))].contiguous()
    return [(ids[o], counts[o]) for o in range(world)], longest


def block_owners(layout: Layout, seq_len: int, block_size: int, device: torch.device):
    """(owner [nG], local [nG]) of each global key block of `block_size` tokens: its rank and local block, where every
    global block is one local block of one rank under `layout`; else None. Cached per layout."""
    local_block = layout.local_block_size(seq_len, block_size)
    return _block_owners(layout.spec, seq_len, local_block, block_size, str(device))


def position_owners(layout: Layout, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner [S], local [S]): each global position's rank and its index in that rank's shard. Cached per layout."""
    return _owners_cached(layout.spec, seq_len, str(device))


@functools.lru_cache(maxsize=16)
def _block_owners(spec: tuple, seq_len: int, local_block: int, block_size: int, device: str):
    """(owner [nG], local [nG]): the rank and local block of each global key block when each global block is
    exactly one local block of one rank (block-stripe with granularity a multiple of the block size, zigzag and
    contiguous with block-aligned chunks), else None."""
    if local_block != block_size:
        return None
    layout = Layout.create(*spec)
    positions = _all_positions(layout, seq_len, torch.device(device))
    n_global = -(-seq_len // block_size)
    owner = torch.full((n_global,), -1, dtype=torch.long, device=device)
    local = torch.full((n_global,), -1, dtype=torch.long, device=device)
    for rank, pos in enumerate(positions):
        blocks = pos.view(-1, local_block)[:, 0] // block_size
        owner[blocks] = rank
        local[blocks] = torch.arange(blocks.numel(), device=device)
    return owner, local


@functools.lru_cache(maxsize=16)
def _key_block_tables(spec: tuple, seq_len: int, local_block: int, block_size: int, device: str) -> tuple:
    """Per origin rank, `_key_block_table` of its shard (cached: it depends only on the layout and length)."""
    positions = _all_positions(Layout.create(*spec), seq_len, torch.device(device))
    n_global = -(-seq_len // block_size)
    return tuple(_key_block_table(p, local_block, block_size, n_global) for p in positions)


def _column_union(index, seq_len: int, device) -> tuple[torch.Tensor, int]:
    """(ascending positions gathered off the ring: the sink block's tokens, then every vertical column of the
    whole index, the same on every rank; the number of sink tokens)."""
    block_size = int(index.block_size)
    if isinstance(index, RowIndex):  # from the lines: every query block lists the sink block
        n_sink = min(block_size, seq_len)
        return torch.cat([torch.arange(n_sink, device=device), index.column_union.to(device)]), n_sink
    col_ids = index.col_ids.to(device).long()
    n_sink = min(block_size, seq_len) if bool((index.block_ids == 0).any()) else 0
    # flags over the sequence (slot seq_len takes the -1 padding) instead of sorting every listed column
    used = torch.zeros(seq_len + 1, dtype=torch.bool, device=device)
    used[:n_sink] = True
    used[torch.where(col_ids >= 0, col_ids, seq_len).flatten()] = True
    return torch.nonzero(used[:seq_len]).flatten(), n_sink


def _gather_tables(owner: torch.Tensor, local: torch.Tensor, world: int, rank: int, bounded: bool = False):
    """(per_rank, send_local, src, by_rank) of `OffRingColumns` for slots owned as `owner` [U] says (-1: padding).
    per_rank: the most slots one rank owns (one host read), or with `bounded` every slot (no host read; the
    gather then carries padding rows)."""
    u = owner.numel()
    dev = owner.device
    real = owner >= 0
    group = torch.where(real, owner, world)
    counts = group_counts(group, world + 1)
    per_rank = max(1, u) if bounded else max(1, int(counts[:world].max()))
    order = torch.sort(group, stable=True).indices  # slots grouped by owner, ascending within each
    starts = torch.cumsum(counts, 0) - counts
    slot_rank = group[order]
    j = torch.arange(order.numel(), device=dev) - starts[slot_rank]  # padding slots: in a spare last row
    by_rank = torch.full((world + 1, per_rank), u, dtype=torch.long, device=dev)
    by_rank[slot_rank, j.clamp(max=per_rank - 1)] = order  # (only the spare row's can pass the width)
    by_rank = by_rank[:world]
    src = torch.zeros(u, dtype=torch.long, device=dev)
    src[order] = torch.where(slot_rank < world, slot_rank * per_rank + j, 0)
    mine = by_rank[rank]
    send_local = torch.where(mine < u, local[mine.clamp(max=u - 1)], 0)
    return per_rank, send_local, src, by_rank


def _off_ring_columns(index, layout, rank, had_sink, my_cols, local_block, seq_len, device,
                      bounded: bool = False, row_blocks: torch.Tensor | None = None) -> OffRingColumns | None:
    """The off-ring columns of the rank's rows: lists from `my_cols`, or (my_cols None: an index without column
    lists) list-free from the index's lines for the local query blocks `row_blocks`. had_sink [B, H, nLQB]: the
    lists that name the sink block, whose tokens become their first columns; None: the sink block stays a listed
    block (the gathered schedule) and only the verticals are columns."""
    union, n_sink = _column_union(index, seq_len, device)
    if union.numel() == (0 if had_sink is not None else n_sink):  # decided from the whole index: every rank alike
        return None
    pad = (-union.numel()) % local_block
    positions = torch.cat([union, torch.full((pad,), seq_len, dtype=torch.long, device=device)])
    owner_all, local_all = _owners_cached(layout.spec, seq_len, str(device))
    owner = torch.full_like(positions, -1)
    local = torch.full_like(positions, -1)
    real = union < seq_len  # a union built without a host read ends in seq_len padding
    owner[: union.numel()] = torch.where(real, owner_all[union.clamp(max=seq_len - 1)], -1)
    local[: union.numel()] = torch.where(real, local_all[union.clamp(max=seq_len - 1)], -1)

    if my_cols is None:  # list-free: each head's sorted verticals in slots, with its block offsets as flags
        vertical, slash, _ = index._cache["lines"]
        form = ring_columns(vertical.to(device), slash.to(device), seq_len, int(index.block_size),
                            index.column_union.to(device), row_blocks, n_sink, sink_columns=had_sink is not None)
        per_rank, send_local, src, by_rank = _gather_tables(owner, local, layout.world_size, rank, bounded)
        return OffRingColumns(positions, owner, local, None, None, per_rank, send_local, src, by_rank, form)
    # int32 throughout (positions < 2**31): these lists are the plan's largest tensors (1 GiB each in int32 at 256K
    # tokens per GPU with 4,096-line caps), and the sort-based packing with int64 indices held ~13 GiB at once there
    col_slots = torch.searchsorted(union.to(torch.int32), my_cols.clamp(min=0), out_int32=True)
    col_slots.masked_fill_(my_cols < 0, -1)
    if n_sink and had_sink is not None:
        b, h, n = had_sink.shape
        # sink tokens are the first entries of the sorted union (positions 0..block_size-1): a list that names the
        # sink block starts with them; the index's column lists are front-packed (valid entries, then -1), so
        # every list comes out front-packed with no sort
        sink_slots = torch.arange(n_sink, dtype=torch.int32, device=device).expand(b, h, n, n_sink)
        ids = torch.where(had_sink.unsqueeze(-1), torch.cat([sink_slots, col_slots], dim=-1),
                          torch.nn.functional.pad(col_slots, (0, n_sink), value=-1))
    else:
        ids = col_slots
    counts = (ids >= 0).sum(-1, dtype=torch.int32)
    per_rank, send_local, src, by_rank = _gather_tables(owner, local, layout.world_size, rank, bounded)
    return OffRingColumns(positions, owner, local, ids, counts, per_rank, send_local, src, by_rank)
