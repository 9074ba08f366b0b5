"""The vertical-slash sparse index: per (batch, query head, query block) the key blocks to run densely and
the extra vertical key columns, plus the transposed views the deterministic backward needs."""

from __future__ import annotations

import dataclasses
import math

from dataclasses import dataclass, field

import torch


# plans[BOUNDED] = True in the kernels' cache (`mtrain.ops.partial`'s `plans`): the lists come from a bounded ring
# plan (`mtrain.parallel.plan.RingPlan.bounded`), and what the kernels derive from them is sized from their widths
# instead of read-back counts (no host synchronisation): the document filter keeps each list's width, the
# transposed lists sort every slot, and a head's column universe fits in its column lists' width (its columns are
# the sink block's and its verticals', every row drawing from them).
BOUNDED = "bounded"

# Flag of a kernels' `plans` dict: every column of the call's lists lies at or after this key position (the ring's
# gathered columns sit in slots after the keys of the shards), so the column plan and the columns' dK/dV fold work
# on the keys from there on instead of the whole key range.
COLUMN_BASE = "column_base"


def compact(flags: torch.Tensor, values: torch.Tensor | None = None,
            width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the True positions of `flags` [..., N] to the left, keeping their order.

    Returns (ids [..., M] int32, padded with -1, M = max count (at least 1); counts [...] int32).
    `ids` holds the positions (0..N-1), or `values[..., pos]` when `values` (same shape as flags,
    or broadcastable) is given. Vectorized and proportional to the number of True entries: one
    nonzero() over the flags, then one indexed write (no loop over rows, no writes for False entries).
    width: a bound the caller knows on every row's count: M = width, and no host synchronisation (one
    cumulative sum and one scatter over all N entries instead of the nonzero()).
    """
    if width is not None:
        return _compact_to(flags, values, width)
    n = flags.shape[-1]
    lead = flags.shape[:-1]
    counts = flags.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    flat = flags.reshape(-1, n)
    row, col = torch.nonzero(flat, as_tuple=True)  # row-major, so each row's entries are in order
    starts = torch.cumsum(counts.reshape(-1), 0, dtype=torch.int64) - counts.reshape(-1)
    pos = torch.arange(row.numel(), device=flags.device) - starts[row]
    if values is None:
        vals = col.to(torch.int32)
    else:
        # Index the broadcast view directly: no [..., N] copy of the values.
        vals = values.expand(flags.shape)[(*torch.unravel_index(row, lead), col)].to(torch.int32)
    out = torch.full((flat.shape[0], width), -1, dtype=torch.int32, device=flags.device)
    out[row, pos] = vals
    return out.view(*lead, width), counts


def _compact_to(flags: torch.Tensor, values: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`compact` into a given width (entries past it are dropped: the caller's bound must hold)."""
    width = max(int(width), 1)
    counts = flags.sum(-1, dtype=torch.int32)
    slot = torch.where(flags, flags.cumsum(-1) - 1, width).clamp_(max=width)  # the rest land in a dump column
    if values is None:
        vals = torch.arange(flags.shape[-1], device=flags.device).expand(flags.shape)
    else:
        vals = values.expand(flags.shape)
    out = torch.full((*flags.shape[:-1], width + 1), -1, dtype=torch.int32, device=flags.device)
    out.scatter_(-1, slot, torch.where(flags, vals, -1).to(torch.int32))
    return out[..., :width].contiguous(), counts.clamp_(max=width)


def group_counts(group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """`torch.bincount(group, minlength=n_groups)` (int64, group in [0, n_groups)) without the host read CUDA's
    bincount makes to size its result."""
    return torch.zeros(n_groups, dtype=torch.long, device=group.device).scatter_add_(0, group, torch.ones_like(group))


def group_entries(group: torch.Tensor, values: torch.Tensor, n_groups: int):
    """Ragged (CSR) lists: entry e goes to list group[e], keeping the order of e within a list.

    group (LongTensor [E], 0 <= group < n_groups), values [E] -> (flat int32 [E]: the lists one after
    another; starts int64 [n_groups]: where each list begins in flat; counts int32 [n_groups]). One
    stable sort of E entries: time and memory follow the number of entries, not n_groups x the
    longest list.
    """
    # int32 keys sort markedly faster on the CPU than int64.
    key = group.to(torch.int32) if n_groups < 2**31 else group
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(group, minlength=n_groups)
    starts = torch.cumsum(counts, 0) - counts
    return values[order].to(torch.int32), starts, counts.to(torch.int32)


def pad_groups(flat: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Ragged lists (list g is flat[starts[g] : starts[g] + counts[g]], any leading shape of starts/counts;
    lists may have gaps between them) -> padded [..., M] int32, -1 padded, M = the longest list (at
    least 1), as `compact` returns them."""
    lead = counts.shape
    counts, starts = counts.reshape(-1).long(), starts.reshape(-1)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=flat.device), counts)
    pos = torch.arange(group.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[group]
    out = torch.full((counts.numel(), width), -1, dtype=torch.int32, device=flat.device)
    out[group, pos] = flat[starts[group] + pos]
    return out.view(*lead, width)


def transpose_blocks_csr(
    block_ids: torch.Tensor, block_counts: torch.Tensor, n_kblocks: int, *, every_slot: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (b, h, key block j) the sorted query blocks whose list contains j, as ragged lists.

    block_ids [B, H, nQB, MAXB] (-1 padded), block_counts [B, H, nQB] -> (q_ids int32 [E], the lists
    one after another; starts int64 [B, H, nKB] into q_ids; counts int32 [B, H, nKB]). Works on the
    listed entries only: no [nKB, nQB] matrix (the sink block's list alone is nQB long, so a padded
    transposed index would be nKB x nQB).
    every_slot: sort every list slot (padding into a spare list after the others) instead of finding the
    listed entries first: E = B * H * nQB * MAXB, and no host synchronisation.
    """
    B, H, nqb, maxb = block_ids.shape
    dev = block_ids.device
    valid = (torch.arange(maxb, device=dev) < block_counts[..., None].long()) & (block_ids >= 0)
    if every_slot:
        n_groups = B * H * n_kblocks
        bh = torch.arange(B * H, device=dev).view(B, H, 1, 1)
        i = torch.arange(nqb, device=dev).view(1, 1, nqb, 1).expand_as(block_ids)
        group = torch.where(valid, bh * n_kblocks + block_ids.long(), n_groups).flatten()
        key = group.to(torch.int32) if n_groups < 2**31 else group
        order = torch.sort(key, stable=True).indices  # row-major slots: i ascending within each list
        counts = group_counts(group, n_groups + 1)
        starts = torch.cumsum(counts, 0) - counts
        q_ids = i.flatten()[order].to(torch.int32)
        return (q_ids, starts[:n_groups].view(B, H, n_kblocks),
                counts[:n_groups].to(torch.int32).view(B, H, n_kblocks))
    flat = torch.nonzero(valid.reshape(-1)).flatten()  # row-major: i ascending within each (b, h)
    j = block_ids.reshape(-1)[flat].long()
    row = flat // maxb  # (b * H + h) * nQB + i
    i = row % nqb
    q_ids, starts, counts = group_entries((row - i) // nqb * n_kblocks + j, i, B * H * n_kblocks)
    return q_ids, starts.view(B, H, n_kblocks), counts.view(B, H, n_kblocks)


def transpose_blocks(
    block_ids: torch.Tensor, block_counts: torch.Tensor, n_kblocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (b, h, key block j) the sorted query blocks whose list contains j, padded.

    block_ids [B, H, nQB, MAXB] (-1 padded), block_counts [B, H, nQB] ->
    (q_ids [B, H, nKB, MAXT] int32, -1 padded; counts [B, H, nKB] int32). The kernels use the ragged
    `transpose_blocks_csr` (this padded form is nKB x nQB when the sink block is listed everywhere).
    """
    q_ids, starts, counts = transpose_blocks_csr(block_ids, block_counts, n_kblocks)
    return pad_groups(q_ids, starts, counts), counts


@dataclass
class ColumnPlan:
    """The vertical columns regrouped for the deterministic dK/dV pass.

    universe [B, H, U] int32: the distinct column tokens of each (b, h), sorted, -1 padded.
    Columns are processed in chunks of `chunk` universe entries; for chunk c of (b, h),
    q_ids[b, h, c, :counts[b, h, c]] lists the query blocks that use any column of the chunk and
    bits[b, h, c, n] (int64) has bit t set when universe entry c*chunk+t is a column of that block.
    """

    universe: torch.Tensor
    q_ids: torch.Tensor
    bits: torch.Tensor
    counts: torch.Tensor
    chunk: int
    list_free: bool = False
    """A plan of `mtrain.ops.columns.VerticalColumns`: q_ids [B, H, n_chunks, 1] holds each chunk's first query block,
    counts how many follow, and bits is unused (the kernel reads the coverage flags)."""


def column_plan(col_ids: torch.Tensor, col_counts: torch.Tensor, seq_k: int, chunk: int,
                width: int | None = None, base: int = 0) -> ColumnPlan:
    """Build the `ColumnPlan` of per-query-block column lists (see `ColumnPlan`); chunk <= 64.
    width: a bound the caller knows on each head's distinct columns (the universe's width; e.g. the lists' width
    when every row of a head draws from the same columns): then no host synchronisation, and the plan's
    q_ids are as wide as the query blocks. base: every listed column is at or after this key position (the
    caller's promise, `COLUMN_BASE`); the plan is built over keys base..seq_k - 1 (its universe still holds key
    positions)."""
    if not 1 <= chunk <= 64:
        raise ValueError(f"column chunk must be in 1..64 (one int64 bit mask per entry); got {chunk}")
    if base:
        shifted = torch.where(col_ids >= base, col_ids - base, -1).to(col_ids.dtype)
        plan = column_plan(shifted, col_counts, seq_k - base, chunk, width)
        universe = torch.where(plan.universe >= 0, plan.universe + base, -1).to(plan.universe.dtype)
        return dataclasses.replace(plan, universe=universe)
    B, H, nqb, maxc = col_ids.shape
    dev = col_ids.device
    slot = torch.arange(maxc, device=dev)
    valid = (slot < col_counts[..., None].long()) & (col_ids >= 0) & (col_ids < seq_k)
    if width is not None:
        return _column_plan_bounded(col_ids, valid, seq_k, chunk, max(int(width), 1))
    # Work on the listed entries only (the padded lists can be ~20x larger than their content).
    b, h, i, n = torch.nonzero(valid, as_tuple=True)
    cols = col_ids[b, h, i, n].long()
    used = torch.zeros(B, H, seq_k, dtype=torch.bool, device=dev)
    used[b, h, cols] = True  # tokens that are a column of some query block
    universe, _ = compact(used)
    rank = used.cumsum(-1) - 1  # universe slot of every used token
    n_chunks = -(-universe.shape[-1] // chunk)
    u = torch.gather(rank, -1, torch.where(valid, col_ids.long(), 0).flatten(2)).view(B, H, nqb, maxc)
    bits = _chunk_bits(u, valid, chunk, n_chunks)
    q_ids, counts = compact(bits != 0)
    packed_bits = torch.gather(bits, -1, q_ids.long().clamp(min=0))
    packed_bits = torch.where(q_ids >= 0, packed_bits, 0)
    return ColumnPlan(universe, q_ids, packed_bits.contiguous(), counts, chunk)


def _chunk_bits(u: torch.Tensor, valid: torch.Tensor, chunk: int, n_chunks: int) -> torch.Tensor:
    """[B, H, n_chunks, nQB] int64: for each query block (a row of u [B, H, nQB, M], universe slots, ascending where
    `valid` (the lists are sorted, as `SparseIndex` asks), each at most once) and chunk of `chunk` slots, the bits
    1 << (slot % chunk) of its slots in the chunk. A prefix sum per row read at each chunk's end: the bits are
    distinct, so the difference of two prefix sums is their OR (exact in int64, wrapping at bit 63 included); the
    invalid entries add nothing and take their predecessor's slot, so the row stays ascending for the search.
    Deterministic, with no atomics (an accumulating index_put sorts every entry of every row together, several times
    slower on a GPU)."""
    us = torch.cummax(torch.where(valid, u, -1), dim=-1).values
    prefix = torch.nn.functional.pad(torch.cumsum(torch.where(valid, torch.ones_like(u) << (u.clamp(min=0) % chunk),
                                                              0), -1), (1, 0))
    bounds = torch.arange(n_chunks, device=u.device).expand(*u.shape[:-1], n_chunks).contiguous()
    ends = torch.searchsorted(torch.div(us, chunk, rounding_mode="floor").contiguous(), bounds, right=True)
    at_end = torch.gather(prefix, -1, ends)
    bits = at_end - torch.nn.functional.pad(at_end, (1, 0))[..., :-1]
    return bits.transpose(-1, -2).contiguous()


def _column_plan_bounded(col_ids, valid, seq_k: int, chunk: int, width: int) -> ColumnPlan:
    """`column_plan` over every list slot (invalid ones routed to spare rows) with a known universe width."""
    B, H, nqb, maxc = col_ids.shape
    dev = col_ids.device
    cols = torch.where(valid, col_ids.long(), seq_k)
    used = torch.zeros(B, H, seq_k + 1, dtype=torch.bool, device=dev)
    used.scatter_(-1, cols.flatten(2), True)
    used = used[..., :seq_k]
    universe, _ = compact(used, width=width)
    rank = used.cumsum(-1) - 1  # universe slot of every used token
    u = torch.gather(rank, -1, cols.clamp(max=seq_k - 1).flatten(2)).view_as(cols)
    bits = _chunk_bits(u, valid, chunk, -(-width // chunk))
    q_ids, counts = compact(bits != 0, width=nqb)
    packed_bits = torch.where(q_ids >= 0, torch.gather(bits, -1, q_ids.long().clamp(min=0)), 0)
    return ColumnPlan(universe, q_ids, packed_bits.contiguous(), counts, chunk)


def kernel_column_chunk(block_size: int) -> int:
    """The column chunk the deterministic column backward reads (`min(_tile(block_size), 64)` in
    `mtrain.ops._triton_attention`): the GPU builder makes that plan in its pass."""
    return min(max(16, 1 << (block_size - 1).bit_length()), 64)


def block_offsets(slash: torch.Tensor, seq_len: int, block_size: int, trim: bool = True):
    """(O [B, H, K], O_last or None): the per-head sets of BLOCK offsets of the slashes, holding 0 (the diagonal),
    ascending, NO_OFFSET padded; O_last is the set of a short last query block (None when the last block is full).

    A slash d = a*bs + r crosses, in every full query block i, key blocks i - a and (r > 0) i - a - 1; in a
    short last block of `tail` rows, i - a only when r < tail. So each query block's list is {0 (sink)} +
    {i - o : o in O, o <= i}: built from O alone, without any nQB x nQB flags."""
    B, H, _ = slash.shape
    n = -(-seq_len // block_size)
    tail = seq_len - (n - 1) * block_size  # length of the last query block
    d = slash.long()
    ok = (d >= 0) & (d < seq_len)
    a, r = d // block_size, d % block_size
    zero = torch.zeros(B, H, 1, dtype=torch.long, device=slash.device)
    offs = _offset_set(
        torch.cat([zero, torch.where(ok, a, NO_OFFSET), torch.where(ok & (r > 0), a + 1, NO_OFFSET)], -1), trim)
    if tail == block_size:
        return offs, None
    offs_last = _offset_set(torch.cat(
        [zero, torch.where(ok & (r < tail), a, NO_OFFSET), torch.where(ok & (r > 0), a + 1, NO_OFFSET)], -1), trim)
    return offs, offs_last


def sorted_verticals(vertical: torch.Tensor, seq_len: int, block_size: int):
    """(v [B, H, Nv] ascending, duplicates and padding set to seq_len; v_blk: their key blocks, nQB for those)."""
    n = -(-seq_len // block_size)
    v, _ = torch.sort(torch.where((vertical >= 0) & (vertical < seq_len), vertical.long(), seq_len), dim=-1)
    dup = torch.zeros_like(v, dtype=torch.bool)
    dup[..., 1:] = v[..., 1:] == v[..., :-1]
    v_ok = (v < seq_len) & ~dup
    return torch.where(v_ok, v, seq_len), torch.where(v_ok, v // block_size, n)


# Padding of the block-offset sets: larger than any real offset.
NO_OFFSET = 1 << 62
# Elements of the temporaries of one step of the vertical-coverage scatter in `from_lines`.
_SCATTER_ELEMS = 1 << 24


def _offset_set(offsets: torch.Tensor, trim: bool = True) -> torch.Tensor:
    """Sorted distinct offsets per (b, h): [B, H, K] (padding NO_OFFSET) -> [B, H, K'] ascending, NO_OFFSET padded
    (K' = the most any head has, read back to the host; trim=False keeps K' = K, no host read)."""
    o, _ = torch.sort(offsets, dim=-1)
    dup = torch.zeros_like(o, dtype=torch.bool)
    dup[..., 1:] = o[..., 1:] == o[..., :-1]
    o, _ = torch.sort(torch.where(dup, NO_OFFSET, o), dim=-1)
    if not trim:
        return o
    width = max(int((o < NO_OFFSET).sum(-1).max()), 1)
    return o[..., :width].contiguous()


def _rows_from_offsets(offs: torch.Tensor, rows: torch.Tensor):
    """Per query block i in `rows`: how many offsets o <= i (`pick`), whether the sink block 0 is extra
    (offset i absent), and the list length; offs [B, H, K] sorted, holding 0."""
    B, H, _ = offs.shape
    pick = torch.searchsorted(offs, rows.expand(B, H, -1).contiguous(), right=True)  # >= 1: offs holds 0
    sink = torch.gather(offs, -1, pick - 1) != rows
    return pick + sink, pick, sink


def _expand_rows(offs, rows, counts, pick, sink, width: int) -> torch.Tensor:
    """Block lists [B, H, len(rows), width], ascending: [0 if sink] + [i - offs[pick-1], ..., i - offs[0]]."""
    t = torch.arange(width, device=offs.device)
    src = pick[..., None] - 1 - t + sink[..., None].long()  # which offset lands in slot t
    o = torch.gather(offs[:, :, None, :].expand(-1, -1, rows.numel(), -1), -1,
                     src.clamp(min=0, max=offs.shape[-1] - 1))
    ids = torch.where(sink[..., None] & (t == 0), 0, rows[:, None] - o)
    return torch.where(t < counts[..., None], ids, -1).to(torch.int32)


def list_bytes(index) -> int:
    """Bytes of an index's block and column lists (ids and counts) as held: a `SparseIndex` or a `RowIndex` (one
    without column lists holds their counts only)."""
    return sum(t.numel() * t.element_size() for t in (index.block_ids, index.block_counts, index.col_ids,
                                                       index.col_counts) if t is not None)


def used_list_bytes(index) -> int:
    """Bytes the same lists would take as wide as their longest list (the widths the pattern uses, not the caps'):
    one host read of the two counts' maxima."""
    rows = math.prod(index.block_ids.shape[:-1])  # (batch, head, query block) lists
    widths = [int(index.block_counts.max()) if index.block_counts.numel() else 0,
              int(index.col_counts.max()) if index.col_counts.numel() else 0]
    ids = rows * (widths[0] * index.block_ids.element_size() + widths[1] * index.col_counts.element_size())
    return ids + index.block_counts.numel() * index.block_counts.element_size() + \
        index.col_counts.numel() * index.col_counts.element_size()


@dataclass
class SparseIndex:
    """Which (query, key) pairs vertical-slash attention computes, in GLOBAL coordinates.

    block_ids [B, Hq, nQB, MAXB] int32: per query block of `block_size` tokens, the key blocks
        computed densely (causal inside), sorted ascending, -1 padded; block_counts [B, Hq, nQB].
    col_ids [B, Hq, nQB, MAXC] int32: extra vertical key tokens not inside any listed block, sorted,
        -1 padded; col_counts [B, Hq, nQB].
    seq_len, block_size: ints; nQB = ceil(seq_len / block_size).
    Built by `from_lines` or `estimate_vertical_slash` (vectorized tensor ops, no loop over blocks),
    or directly from these tensors. `transposed_csr()` gives the per-key-block view the deterministic
    backward uses; derived data is cached with the index (`_cache`), so treat the tensors as frozen.
    """

    block_ids: torch.Tensor
    block_counts: torch.Tensor
    col_ids: torch.Tensor
    col_counts: torch.Tensor
    seq_len: int
    block_size: int = 64
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = -(-self.seq_len // self.block_size)
        if self.block_ids.dim() != 4 or self.block_ids.shape[2] != n:
            raise ValueError(
                f"block_ids must be [B, Hq, ceil(seq_len / block_size) = {n}, MAXB]; got {tuple(self.block_ids.shape)}"
            )
        if self.col_ids.dim() != 4 or self.col_ids.shape[:3] != self.block_ids.shape[:3]:
            raise ValueError(f"col_ids must be [B, Hq, {n}, MAXC]; got {tuple(self.col_ids.shape)}")

    @property
    def n_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_ids, block_counts), the `blocks=` argument of `mtrain.ops.partial`."""
        return self.block_ids, self.block_counts

    @property
    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(col_ids, col_counts), the `columns=` argument of `mtrain.ops.partial`."""
        return self.col_ids, self.col_counts

    @property
    def kernel_columns(self):
        """The `columns=` the block engines' column kernels take: the list-free form when one is attached
        (`mtrain.ops.columns.with_list_free_columns`), else the lists."""
        vcols = self._cache.get("vcols")
        return self.columns if vcols is None else vcols

    @classmethod
    def from_lines(
        cls, vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int = 64, *,
        impl: str = "auto",
    ) -> "SparseIndex":
        """Build the index from vertical key positions and slash offsets.

        vertical: LongTensor [B, Hq, Nv] of key positions; slash: [B, Hq, Ns] of offsets q - k >= 0;
        -1 (or anything out of range) is padding; Nv or Ns may be 0. Every query block keeps its
        diagonal block and the first key block (sinks); each slash offset d adds the (at most two)
        key blocks its diagonal crosses in each query block; verticals inside a computed block are
        dropped from the column lists, the rest become extra columns for every later query block.
        Time and memory follow the size of the lists: the slashes are reduced to a per-head set of
        block offsets i - j, which gives every row's list arithmetically (no nQB x nQB flags).

        impl: "torch" (the reference: vectorized tensor ops; list widths trimmed to the longest list,
        which reads counts back to the host), "triton" (`mtrain.ops._triton_index`: three kernels, no host
        synchronisation; the transposed lists and the kernels' column plan are built in the same pass and
        cached; list widths are bounds from Nv, Ns and seq_len, so more -1 padding, same lists), or "auto"
        (triton for CUDA tensors, torch otherwise). On CPU tensors "triton" needs TRITON_INTERPRET=1.
        """
        if vertical.dim() != 3 or slash.dim() != 3 or vertical.shape[:2] != slash.shape[:2]:
            raise ValueError(
                f"vertical must be [B, Hq, Nv] and slash [B, Hq, Ns]; got {tuple(vertical.shape)}, {tuple(slash.shape)}"
            )
        if block_size < 1 or seq_len < 1:
            raise ValueError(f"block_size and seq_len must be positive; got {block_size}, {seq_len}")
        if vertical.device != slash.device:
            raise ValueError(f"vertical and slash must be on one device; got {vertical.device} and {slash.device}")
        if impl not in ("auto", "torch", "triton"):
            raise ValueError(f"impl must be 'auto', 'torch' or 'triton'; got {impl!r}")
        if impl == "triton" or (impl == "auto" and vertical.is_cuda):
            index = cls._from_lines_triton(vertical, slash, seq_len, block_size)
        else:
            index = cls._from_lines_torch(vertical, slash, seq_len, block_size)
        index._cache["diagonal_listed"] = True  # every row's list ends with its diagonal block (engines rely on it)
        return index

    @classmethod
    def _from_lines_torch(cls, vertical, slash, seq_len: int, block_size: int) -> "SparseIndex":
        B, H, _ = vertical.shape
        dev = vertical.device
        n = -(-seq_len // block_size)
        offs, offs_last = block_offsets(slash, seq_len, block_size)
        rows = torch.arange(n, device=dev)
        counts, pick, sink = _rows_from_offsets(offs, rows)
        last = None
        if offs_last is not None:
            last = _rows_from_offsets(offs_last, rows[-1:])
            counts[..., -1:], pick[..., -1:], sink[..., -1:] = last
        width = max(int(counts.max()), 1)
        block_ids = _expand_rows(offs, rows, counts, pick, sink, width)
        if last is not None:
            block_ids[:, :, -1:] = _expand_rows(offs_last, rows[-1:], *last, width)
        block_counts = counts.to(torch.int32)

        if vertical.shape[-1] > 0:
            v, v_blk = sorted_verticals(vertical, seq_len, block_size)
            # A vertical is a column of every later query block whose list misses its key block: rows
            # v_blk + o (o in O) hold that block, and every row holds block 0.
            active = torch.zeros(B, H, n + 1, v.shape[-1], dtype=torch.bool, device=dev)  # last row = dump
            active[:, :, :n] = (v_blk[:, :, None, :] < rows[None, None, :, None]) & (v_blk > 0)[:, :, None, :]
            step = max(1, _SCATTER_ELEMS // max(1, B * H * v.shape[-1]))  # bounds the [B, H, step, Nv] temporaries
            for o0 in range(0, offs.shape[-1], step):
                o = offs[:, :, o0 : o0 + step, None]
                hit = v_blk[:, :, None, :] + o
                active.scatter_(2, torch.where((hit < n) & (o < NO_OFFSET), hit, n), False)
            active = active[:, :, :n]
            if last is not None:
                o_last = (n - 1) - v_blk  # the short last row tests its own offset set
                at = torch.searchsorted(offs_last, o_last).clamp(max=offs_last.shape[-1] - 1)
                covered = torch.gather(offs_last, -1, at) == o_last
                active[:, :, -1] = (v_blk < n - 1) & (v_blk > 0) & ~covered
            slots, col_counts = compact(active)  # which vertical, in sorted order
            col_ids = torch.where(slots >= 0, torch.gather(v, -1, slots.long().clamp(min=0).flatten(2)).view_as(slots),
                                  -1).to(torch.int32)
        else:
            col_ids = torch.full((B, H, n, 1), -1, dtype=torch.int32, device=dev)
            col_counts = torch.zeros(B, H, n, dtype=torch.int32, device=dev)
        return cls(block_ids, block_counts, col_ids, col_counts, seq_len, block_size)

    @classmethod
    def _from_lines_triton(cls, vertical, slash, seq_len: int, block_size: int) -> "SparseIndex":
        from mtrain.ops._triton_index import build_from_lines

        chunk = kernel_column_chunk(block_size)
        bi, bc, ci, cc, transposed, plan = build_from_lines(vertical, slash, seq_len, block_size, chunk)
        index = cls(bi, bc, ci, cc, seq_len, block_size)
        index._cache["t"] = transposed
        index._cache[("c", chunk)] = ColumnPlan(*plan, chunk)
        return index

    def to_mask(self) -> torch.Tensor:
        """Bool [B, Hq, S, S]: exactly the causal (query, key) pairs the kernels compute (tiny S only)."""
        from mtrain.ops.reference import partial_mask

        pos = torch.arange(self.seq_len, device=self.block_ids.device)
        B, H = self.block_ids.shape[:2]
        return partial_mask(
            pos, pos, batch=B, heads=H, blocks=self.blocks, columns=self.columns,
            block_size=self.block_size, causal=True,
        )

    def pair_counts(self) -> torch.Tensor:
        """Float64 [B, Hq]: number of causal (query, key) pairs computed, without building the mask."""
        bs, S = self.block_size, self.seq_len
        dev = self.block_ids.device
        n = self.n_blocks
        q_lo = torch.arange(n, device=dev, dtype=torch.float64) * bs
        q_len = (torch.clamp(q_lo + bs, max=S) - q_lo)[None, None, :, None]
        q_lo = q_lo[None, None, :, None]
        slot = torch.arange(self.block_ids.shape[-1], device=dev)
        ok = (slot < self.block_counts[..., None].long()) & (self.block_ids >= 0)
        k_lo = self.block_ids.double().clamp(min=0) * bs
        k_len = torch.clamp(k_lo + bs, max=S) - k_lo
        # Causal pairs of a query block against a strictly earlier key block: all; same block: triangle.
        full = q_len * k_len
        diag = q_len * (q_len + 1) / 2
        pairs = torch.where(k_lo < q_lo, full, torch.where(k_lo == q_lo, diag, torch.zeros_like(full)))
        total = torch.where(ok, pairs, 0.0).sum(dim=(-1, -2))
        # A listed column lies before its query block (the block's own keys are in its diagonal block), so every
        # row of the block sees it: the counts suffice, and the [B, Hq, nQB, C] column lists are never read.
        return total + (self.col_counts.double() * q_len[..., 0]).sum(-1)

    def density(self) -> float:
        """Fraction of all causal (query, key) pairs that the kernels compute."""
        return float(self.density_tensor())

    def density_tensor(self) -> torch.Tensor:
        """`density` as a 0-dim float64 tensor on the index's device (no host synchronisation)."""
        causal = self.seq_len * (self.seq_len + 1) / 2
        return self.pair_counts().mean() / causal

    def work_tensor(self) -> torch.Tensor:
        """Float64 [2] on the index's device: listed (query block, key block) and (query block, column) entries,
        summed over batch and heads (what `mtrain.ops.cost` prices; no host synchronisation)."""
        return torch.stack([self.block_counts.double().sum(), self.col_counts.double().sum()])

    def block_density(self) -> float:
        """Fraction of causal key blocks listed (the work measure of a block kernel)."""
        n = self.n_blocks
        return float(self.block_counts.double().mean() / ((n + 1) / 2))

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_ids [B, Hq, nKB, MAXT], counts): per key block, the query blocks that compute it, padded.
        MAXT is nQB whenever the sink block is listed everywhere: for inspection and small S."""
        q_ids, starts, counts = self.transposed_csr()
        return pad_groups(q_ids, starts, counts), counts

    def transposed_csr(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_ids int32 [E], starts int64 [B, Hq, nKB], counts int32 [B, Hq, nKB]): the transposed index as
        ragged lists, list (b, h, j) = q_ids[starts[b, h, j]:][:counts[b, h, j]] (what the deterministic
        backward reads; cached). From the GPU builder the lists of each head lie in their own segment, with
        unused entries between heads."""
        if "t" not in self._cache:
            self._cache["t"] = transpose_blocks_csr(self.block_ids, self.block_counts, self.n_blocks)
        return self._cache["t"]

    def column_plan(self, chunk: int) -> ColumnPlan:
        """The per-column regrouping used by the deterministic dK/dV pass (cached per chunk)."""
        key = ("c", chunk)
        if key not in self._cache:
            self._cache[key] = column_plan(self.col_ids, self.col_counts, self.seq_len, chunk)
        return self._cache[key]

    def to(self, device) -> "SparseIndex":
        return SparseIndex(
            self.block_ids.to(device), self.block_counts.to(device), self.col_ids.to(device),
            self.col_counts.to(device), self.seq_len, self.block_size,
        )


@dataclass
class RowIndex:
    """Some query blocks' lists of a vertical-slash index (one context-parallel rank's rows), with the facts of
    the whole index that such a rank needs, computed from the lines in O(lines + nQB) per head.

    rows LongTensor [R]: the global query blocks held, ascending, distinct. block_ids [B, Hq, R, MAXB],
    block_counts, col_ids [B, Hq, R, MAXC], col_counts: those rows of the `SparseIndex.from_lines` lists (same
    entries, same order; the widths fit these rows). column_union LongTensor [U]: ascending positions that are a
    column of some query block of the WHOLE index (any batch row or head; the sink block's tokens are never
    columns). totals float64 [B, Hq, 3]: the whole index's listed block entries, column entries and computed
    causal pairs. Every query block lists the sink block 0 (as `from_lines` builds it). col_ids is None where the
    index was built without column lists (`rows_from_lines(columns=False)`: the ring reads them list-free).
    """

    rows: torch.Tensor
    block_ids: torch.Tensor
    block_counts: torch.Tensor
    col_ids: torch.Tensor | None
    col_counts: torch.Tensor
    seq_len: int
    block_size: int
    column_union: torch.Tensor | None = None
    totals: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    def work_tensor(self) -> torch.Tensor:
        """`SparseIndex.work_tensor` of the whole index: float64 [2] (block entries, column entries)."""
        return self.totals[..., :2].sum((0, 1))

    def pair_counts(self) -> torch.Tensor:
        """`SparseIndex.pair_counts` of the whole index: float64 [B, Hq]."""
        return self.totals[..., 2]

    def density_tensor(self) -> torch.Tensor:
        """`SparseIndex.density_tensor` of the whole index (0-dim float64, no host synchronisation)."""
        return self.pair_counts().mean() / (self.seq_len * (self.seq_len + 1) / 2)

    def density(self) -> float:
        return float(self.density_tensor())


def _row_columns(v, v_blk, offs, offs_last, rows, n: int, width: int | None = None):
    """Column lists of query blocks `rows` [R]: (col_ids [B, H, R, MAXC] int32, counts). A vertical of key
    block j > 0 is a column of a later row i whose list misses block j, i.e. whose offset set lacks i - j.
    width: MAXC when the caller knows a bound (no host read), else the longest list."""
    B, H, nv = v.shape
    R = rows.numel()
    active = torch.empty(B, H, R, nv, dtype=torch.bool, device=v.device)
    step = max(1, _SCATTER_ELEMS // max(1, B * H * nv))  # rows per chunk: bounds the [B, H, step, Nv] temporaries
    for r0 in range(0, R, step):
        r = rows[r0:r0 + step]
        o = r[None, None, :, None] - v_blk[:, :, None, :]  # the offset that would cover the vertical
        at = torch.searchsorted(offs, o.flatten(2)).clamp(max=offs.shape[-1] - 1)
        covered = (torch.gather(offs, -1, at) == o.flatten(2)).view_as(o)
        if offs_last is not None:  # a short last block tests its own offset set
            at = torch.searchsorted(offs_last, o.flatten(2)).clamp(max=offs_last.shape[-1] - 1)
            covered_last = (torch.gather(offs_last, -1, at) == o.flatten(2)).view_as(o)
            covered = torch.where((r == n - 1)[:, None], covered_last, covered)
        active[:, :, r0:r0 + step] = (o > 0) & (v_blk > 0)[:, :, None, :] & ~covered
    slots, counts = compact(active, width=width)
    ids = torch.where(slots >= 0, torch.gather(v, -1, slots.long().clamp(min=0).flatten(2)).view_as(slots), -1)
    return ids.to(torch.int32), counts


def _row_column_counts(v_blk, offs, offs_last, rows, n: int) -> torch.Tensor:
    """The counts `_row_columns` gives, without the lists: per row i, the verticals of key blocks 0 < j < i less
    those whose offset i - j is one of the head's (a histogram of the verticals per key block, read at i - o for
    each offset o > 0). int32 [B, H, R]; work B x H x R x offsets, in chunks of rows."""
    B, H, _ = v_blk.shape
    dev = v_blk.device
    hist = torch.zeros(B, H, n + 1, dtype=torch.int32, device=dev)  # slot n: padding, duplicates and block 0
    hist.scatter_add_(-1, torch.where(v_blk > 0, v_blk, n).clamp(max=n), torch.ones_like(v_blk, dtype=torch.int32))
    hist = hist[..., :n].contiguous()
    before = torch.cumsum(hist, -1) - hist  # [B, H, n]: verticals in key blocks before i (block 0 holds none)

    def covered(o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        j = r[None, None, :, None] - o[:, :, None, :]  # [B, H, R, K]: the key block offset o covers in row i
        ok = (o < NO_OFFSET)[:, :, None, :] & (j > 0) & (o > 0)[:, :, None, :]
        got = torch.gather(hist, -1, j.clamp(min=0, max=n - 1).flatten(2)).view_as(j)
        return torch.where(ok, got, 0).sum(-1)

    out = torch.empty(B, H, rows.numel(), dtype=torch.int32, device=dev)
    step = max(1, _SCATTER_ELEMS // max(1, B * H * offs.shape[-1]))
    for r0 in range(0, rows.numel(), step):
        r = rows[r0:r0 + step]
        out[:, :, r0:r0 + step] = (before[:, :, r] - covered(offs, r)).to(torch.int32)
    if offs_last is not None:  # a short last block: its own offsets, if the rows hold it (no host read to know)
        last_row = torch.full((1,), n - 1, dtype=rows.dtype, device=dev)
        last = (before[:, :, n - 1:] - covered(offs_last, last_row)).to(torch.int32)
        out[..., -1:] = torch.where(rows[-1:] == n - 1, last, out[..., -1:])
    return out


def _line_totals(v, v_blk, offs, offs_last, seq_len: int, block_size: int):
    """(totals float64 [B, H, 3] as `RowIndex.totals`, used bool [seq_len]: the positions that are a column of
    some query block) of the whole index, without its lists: per row the list length from the offsets, per
    vertical the rows it is a column of by counting offsets."""
    B, H, _ = offs.shape
    dev = offs.device
    n = -(-seq_len // block_size)
    tail = seq_len - (n - 1) * block_size
    rows = torch.arange(n, device=dev)
    counts, _, _ = _rows_from_offsets(offs, rows)
    if offs_last is not None:
        counts[..., -1:] = _rows_from_offsets(offs_last, rows[-1:])[0]
    q_len = torch.full((n,), float(block_size), dtype=torch.float64, device=dev)
    q_len[-1:].fill_(tail)  # (a Python scalar set through [] would be copied to the device: a host sync)
    # every listed block before the diagonal is full (block_size keys); the diagonal block is a triangle
    pairs = (q_len * block_size * (counts.double() - 1) + q_len * (q_len + 1) / 2).sum(-1)
    blocks = counts.double().sum(-1)
    full_rows = n if offs_last is None else n - 1
    if v.shape[-1] == 0:
        zero = torch.zeros(B, H, dtype=torch.float64, device=dev)
        return torch.stack([blocks, zero, pairs], -1), torch.zeros(seq_len, dtype=torch.bool, device=dev)
    ok = v_blk > 0  # excludes padding (v_blk = n) only below; sink-block verticals are never columns
    later = (full_rows - 1 - v_blk).clamp(min=0)  # full rows after the vertical's block
    have = torch.searchsorted(offs, later, right=True) - 1  # offsets in [1, later] (offs holds 0 once)
    in_full = torch.where(ok & (v_blk < n), later - have, 0).double()
    in_last = torch.zeros_like(in_full)
    if offs_last is not None:
        o = (n - 1) - v_blk
        at = torch.searchsorted(offs_last, o).clamp(max=offs_last.shape[-1] - 1)
        in_last = (ok & (v_blk < n - 1) & (torch.gather(offs_last, -1, at) != o)).double()
    columns = (in_full + in_last).sum(-1)
    col_pairs = (in_full * block_size + in_last * tail).sum(-1)
    used = torch.zeros(seq_len + 1, dtype=torch.bool, device=dev)
    used.index_fill_(0, torch.where(in_full + in_last > 0, v, seq_len).flatten(), True)
    return torch.stack([blocks, columns, pairs + col_pairs], -1), used[:seq_len]


def _checked_rows(vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int, rows: torch.Tensor,
                  check: bool, bound_widths: bool | str) -> torch.Tensor:
    """`rows_from_lines`' arguments checked (a ValueError names what is wrong): returns `rows` as a LongTensor on
    the lines' device. With check=False the rows' order and range are taken on trust (no host read)."""
    if vertical.dim() != 3 or slash.dim() != 3 or vertical.shape[:2] != slash.shape[:2]:
        raise ValueError(
            f"vertical must be [B, Hq, Nv] and slash [B, Hq, Ns]; got {tuple(vertical.shape)}, {tuple(slash.shape)}"
        )
    if block_size < 1 or seq_len < 1:
        raise ValueError(f"block_size and seq_len must be positive; got {block_size}, {seq_len}")
    n = -(-seq_len // block_size)
    rows = rows.to(vertical.device).long()
    if rows.dim() != 1 or rows.numel() == 0 or (check and (not bool(((rows >= 0) & (rows < n)).all())
                                                           or not bool((rows[1:] > rows[:-1]).all()))):
        raise ValueError(f"rows must be a non-empty ascending list of distinct query blocks in [0, {n})")
    if bound_widths not in (False, True, "static"):
        raise ValueError(f"bound_widths must be False, True or 'static'; got {bound_widths!r}")
    return rows


def _bounded_widths(offs, offs_last, v, v_blk, used, work, seq_len: int, n: int, bound_widths: bool | str,
                    read_also: tuple):
    """The list widths of `rows_from_lines` under bound_widths, returned as (offs, offs_last, v, v_blk,
    block list width, column list width, sizes, host_read). "static": the widths the lines' shapes allow, known
    on the host (sizes ends with the column union's width; host_read None). True: one host read of the most
    offsets and verticals any head has and of the union's size (sizes, in that order), with read_also and the
    listed entries of `work` (host_read, None without work), and the lines trimmed to those bounds."""
    host_read = None
    if bound_widths == "static":  # the widths the lines' shapes allow: known on the host, nothing read back
        n_offs = offs.shape[-1]
        if offs_last is not None:
            n_offs = max(n_offs, offs_last.shape[-1])
        sizes = [n_offs, v.shape[-1], min(seq_len, max(1, v.numel()))]
        return offs, offs_last, v, v_blk, max(1, min(n_offs + 1, n)), max(1, v.shape[-1]), sizes, host_read
    # the one host read: the widths every later step sizes its lists from
    sizes = [(offs < NO_OFFSET).sum(-1).amax(), (v < seq_len).sum(-1).amax() if v.shape[-1] else offs.new_zeros(())]
    if offs_last is not None:
        sizes.append((offs_last < NO_OFFSET).sum(-1).amax())
    if used is not None:
        sizes.append(used.sum())
    read = [torch.stack([t.reshape(()).double() for t in sizes])]
    if work is not None:
        read += [work[..., :2].sum((0, 1))] + [t.reshape(-1).double() for t in read_also]
    read = torch.cat(read).tolist()
    sizes, host_read = [int(x) for x in read[:len(sizes)]], read[len(sizes):]
    n_offs, n_v = sizes[0], sizes[1]
    offs = offs[..., :max(n_offs, 1)].contiguous()
    if offs_last is not None:
        offs_last = offs_last[..., :max(sizes[2], 1)].contiguous()
        n_offs = max(n_offs, sizes[2])
    v, v_blk = v[..., :n_v].contiguous(), v_blk[..., :n_v].contiguous()
    return offs, offs_last, v, v_blk, max(1, min(n_offs + 1, n)), max(1, n_v), sizes, host_read


def _block_lists(offs, offs_last, rows, n: int, list_width: int | None):
    """(block ids [B, H, R, width] -1 padded, counts [B, H, R]) of the query blocks `rows` from the block offsets
    (offs_last: a short last block's own, used if the rows hold it, with no host read to know). width: list_width,
    else the rows' longest list (a host read)."""
    counts, pick, sink = _rows_from_offsets(offs, rows)
    last = None
    if offs_last is not None:  # a short last block: its own offsets, if the rows hold it (no host read to know)
        is_last = rows[-1:] == n - 1
        last = _rows_from_offsets(offs_last, rows[-1:])
        for mine, theirs in zip((counts, pick, sink), last):
            mine[..., -1:] = torch.where(is_last, theirs, mine[..., -1:])
    width = max(int(counts.max()), 1) if list_width is None else list_width
    block_ids = _expand_rows(offs, rows, counts, pick, sink, width)
    if last is not None:
        tail_ids = _expand_rows(offs_last, rows[-1:], counts[..., -1:], pick[..., -1:], sink[..., -1:], width)
        block_ids[:, :, -1:] = torch.where(is_last[:, None], tail_ids, block_ids[:, :, -1:])
    return block_ids, counts


def _column_lists(vertical, v, v_blk, offs, offs_last, rows, n: int, col_width: int | None, columns: bool):
    """(column ids [B, H, R, width] -1 padded, or None with columns=False; column counts [B, H, R]) of the query
    blocks `rows`: the verticals where their key block is not listed."""
    B, H, _ = vertical.shape
    if not columns:
        return None, _row_column_counts(v_blk, offs, offs_last, rows, n)
    if v.shape[-1] > 0:
        return _row_columns(v, v_blk, offs, offs_last, rows, n, col_width)
    col_ids = torch.full((B, H, rows.numel(), 1), -1, dtype=torch.int32, device=vertical.device)
    col_counts = torch.zeros(B, H, rows.numel(), dtype=torch.int32, device=vertical.device)
    return col_ids, col_counts


def _column_union(used, seq_len: int, bound_widths: bool | str, sizes) -> torch.Tensor | None:
    """The ascending positions that are a column of some query block, from `used` [seq_len] (None: not known, no
    union): as wide as sizes[-1] under bound_widths, padded at its end with seq_len when "static"."""
    if used is None:
        return None
    if bound_widths == "static":  # padded at the end with seq_len (causally invisible, after every position)
        ids = compact(used[None], width=sizes[-1])[0][0].long()
        return torch.where(ids >= 0, ids, seq_len)
    if bound_widths:
        return compact(used[None], width=max(sizes[-1], 1))[0][0, :sizes[-1]].long()
    return torch.nonzero(used).flatten()


def rows_from_lines(vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int,
                    rows: torch.Tensor, *, totals: bool = True, check: bool = True,
                    bound_widths: bool | str = False, read_also: tuple = (), columns: bool = True) -> RowIndex:
    """The lists of the query blocks `rows` of `SparseIndex.from_lines(vertical, slash, seq_len, block_size)`,
    without building the others: time and memory follow len(rows) (plus O(lines + nQB) per head for the
    totals and the column union of the whole index, skipped with totals=False).

    rows: LongTensor [R] of global query blocks, ascending and distinct (checked unless check=False: the check
    reads them back to the host). Vectorised tensor ops on any device; list widths are trimmed to these rows'
    longest (reads counts back to the host, several times).
    bound_widths: read back to the host once (the most block offsets and verticals any head has, and the size
    of the column union) and size every list from those bounds: block lists as wide as a head's offsets + 1
    (the sink), column lists as its verticals, so more -1 padding than the trimmed lists, the same entries
    (the RowIndex's `_cache["bounded_widths"]` is then True: a ring plan built from it reads nothing back either).
    read_also: with bound_widths and totals, small float tensors read in the same host read; the RowIndex's
    `_cache["host_read"]` is then [listed block entries, listed column entries (`work_tensor()`), *their values].
    bound_widths="static": no host read at all: every list as wide as the lines allow (block lists: the slash
    tensor's width + 1, column lists: the vertical tensor's), the column union as wide as the verticals' slots
    (at most seq_len) and padded at its end with seq_len; `_cache["static_widths"]` is then True and there is no
    `host_read` (read_also is ignored). For lines whose caps are small, so that these lists cost little memory.
    columns=False: no column lists (`col_ids` None; `col_counts` still exact): a context-parallel ring reads the
    columns list-free from the lines (`mtrain.ops.columns.RingColumns`), so lists as wide as the vertical cap are
    never built.
    """
    rows = _checked_rows(vertical, slash, seq_len, block_size, rows, check, bound_widths)
    n = -(-seq_len // block_size)
    offs, offs_last = block_offsets(slash, seq_len, block_size, trim=not bound_widths)
    v, v_blk = sorted_verticals(vertical, seq_len, block_size)
    work = used = None
    if totals:
        work, used = _line_totals(v, v_blk, offs, offs_last, seq_len, block_size)
    list_width = col_width = sizes = host_read = None
    if bound_widths:
        offs, offs_last, v, v_blk, list_width, col_width, sizes, host_read = _bounded_widths(
            offs, offs_last, v, v_blk, used, work, seq_len, n, bound_widths, read_also)
    block_ids, counts = _block_lists(offs, offs_last, rows, n, list_width)
    col_ids, col_counts = _column_lists(vertical, v, v_blk, offs, offs_last, rows, n, col_width, columns)
    union = _column_union(used, seq_len, bound_widths, sizes)
    index = RowIndex(rows, block_ids, counts.to(torch.int32), col_ids, col_counts, seq_len, block_size, union, work)
    if bound_widths:
        index._cache["bounded_widths"] = True
        if bound_widths == "static":
            index._cache["static_widths"] = True
        elif work is not None:
            index._cache["host_read"] = host_read
    return index


def blocks_for_causal_dense(seq_len: int, block_size: int, batch: int, heads: int, device=None) -> SparseIndex:
    """The index that lists every causal key block (equal to dense causal attention)."""
    n = -(-seq_len // block_size)
    ids = torch.arange(n, device=device, dtype=torch.int32)
    block_ids = torch.where(ids[None, :] <= ids[:, None], ids[None, :], -1)
    block_ids = block_ids.expand(batch, heads, n, n).contiguous()
    counts = (torch.arange(n, device=device, dtype=torch.int32) + 1).expand(batch, heads, n).contiguous()
    empty = torch.full((batch, heads, n, 1), -1, dtype=torch.int32, device=device)
    return SparseIndex(block_ids, counts, empty, torch.zeros(batch, heads, n, dtype=torch.int32, device=device),
                       seq_len, block_size)

