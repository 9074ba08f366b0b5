"""The vertical columns without per-query-block lists: each head's verticals, sorted, with its set of block offsets.

A `SparseIndex` lists, per (batch, head, query block), the vertical key tokens the block reads outside its listed key
blocks: `col_ids [B, H, nQB, MAXC]`. Those lists are as wide as the vertical cap (16,384 slots at the recipes'
caps), and the same verticals repeat in every later query block: at 128K tokens, 128-token blocks and 9 heads,
585 MiB per layer. But which verticals a query block reads follows from two small per-head sets (see
`SparseIndex.from_lines`): query block i lists the sink block 0 and the key blocks i - o for every block offset o
of the head's slashes (0, the diagonal, included), and a vertical v in key block b = v // block_size is a column
of row i exactly when b < i, b > 0 and i - b is not one of those offsets.

`VerticalColumns` keeps just that: the verticals sorted ascending [B, H, Nv], per query block how many of them
lie in earlier key blocks [B, H, nQB], and the head's block offsets as flags [B, H, 2, nQB] (row 1 for a short
last query block, whose slashes may cross one block fewer). The Triton kernels read column ids from the verticals
(a list view with a zero stride over query blocks, so no [B, H, nQB, Nv] tensor exists) and skip the verticals
that a listed block already covers, one flag read each. The column backward's plan is built from the same three
tensors, one int per chunk of verticals. Memory is about B x H x (Nv + 3 nQB) ints instead of B x H x nQB x MAXC:
at 128K, 128-token blocks, 9 heads and 16,384 verticals per head, under 1 MiB against 585 MiB of lists.

Built here from the lines (`vertical_columns`) without a host read; `to_lists` gives the lists a `SparseIndex`
holds (the reference the tests compare with); the Triton path of `mtrain.ops.partial` takes a `VerticalColumns`
as its `columns=` argument, and the torch path takes its lists.
"""

from __future__ import annotations

import dataclasses

import torch

from mtrain.ops.index import NO_OFFSET, ColumnPlan, block_offsets, compact, sorted_verticals


class _ListFree:
    """What both list-free forms share: their entries per head (`_entries`: key ids, -1 padded) and per query block
    how many leading entries it may read (`counts`), read as a `columns=` pair, as lists, and counted in bytes."""

    counts: torch.Tensor

    def _entries(self) -> torch.Tensor:
        raise NotImplementedError

    def active(self) -> torch.Tensor:
        raise NotImplementedError

    def __iter__(self):
        """(ids, counts) as a `columns=` pair: ids [B, H, nQB, N] is a view of the entries with a zero stride over the
        query blocks (every row sees every entry; the kernels skip the covered ones and those past counts). Only the
        Triton kernels read it that way: a reader of plain lists must take `to_lists()`."""
        ids = self._entries()
        B, H, n = ids.shape
        yield ids.unsqueeze(2).expand(B, H, self.counts.shape[-1], n)
        yield self.counts

    def nbytes(self) -> int:
        """Bytes held (every tensor of the form)."""
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return sum(t.numel() * t.element_size() for t in fields if isinstance(t, torch.Tensor))

    def to_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(col_ids [B, H, nQB, W] int32 -1 padded, col_counts [B, H, nQB] int32): the same columns as lists, the
        entries `active()` marks in their order (one host read for the width)."""
        ids = self._entries()
        slots, counts = compact(self.active())
        got = torch.gather(ids.long()[:, :, None, :].expand(*slots.shape[:3], ids.shape[-1]), -1,
                           slots.long().clamp(min=0))
        return torch.where(slots >= 0, got, -1).to(torch.int32), counts


def _check_chunk(chunk: int) -> None:
    if not 1 <= chunk <= 64:
        raise ValueError(f"column chunk must be in 1..64 (the column kernels' chunk); got {chunk}")


def _offset_hit(covered: torch.Tensor, gi: torch.Tensor, blk: torch.Tensor) -> torch.Tensor:
    """Bool [B, H, R, N]: key block blk [B, H, 1, N] lies at one of the head's block offsets from query block gi [R]
    (`covered` [B, H, 2, nQB]; its row 1 for the last query block)."""
    n = covered.shape[-1]
    off = (gi[:, None] - blk).clamp(min=0, max=n - 1)  # [B, H, R, N]
    B, H, R, _ = off.shape
    rows = [torch.gather(covered[:, :, r].long()[:, :, None, :].expand(B, H, R, n), 3, off) for r in (0, 1)]
    return torch.where((gi == n - 1)[:, None], rows[1], rows[0]) != 0


def _verticals_past_sink(vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int,
                         union: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, Nv] long: each head's distinct verticals past the sink block 0 (never a column of a query block that
    lists block 0) and, with `union` (ascending positions), only those in it; ascending, seq_len padded at the end.
    Checks the lines' shapes (as `SparseIndex.from_lines` takes them) and keeps a width of at least 1."""
    if vertical.dim() != 3 or slash.dim() != 3 or vertical.shape[:2] != slash.shape[:2]:
        raise ValueError(f"vertical must be [B, H, Nv] and slash [B, H, Ns]; got {tuple(vertical.shape)}, "
                         f"{tuple(slash.shape)}")
    if block_size < 1 or seq_len < 1:
        raise ValueError(f"block_size and seq_len must be positive; got {block_size}, {seq_len}")
    if vertical.shape[-1] == 0:  # one padding slot: the kernels and plans keep a width of at least 1
        vertical = torch.full((*vertical.shape[:2], 1), -1, dtype=torch.long, device=vertical.device)
    v = sorted_verticals(vertical, seq_len, block_size)[0]  # distinct, duplicates and padding seq_len
    keep = (v >= block_size) & (v < seq_len)
    if union is not None:
        if union.numel():
            keep &= union[torch.searchsorted(union, v.contiguous()).clamp(max=union.numel() - 1)] == v
        else:
            keep = torch.zeros_like(keep)
    return torch.sort(torch.where(keep, v, seq_len), dim=-1).values


@dataclasses.dataclass
class VerticalColumns(_ListFree):
    """The columns of a vertical-slash index, list-free (see the module's docstring). All int32 or uint8 tensors on
    one device:

    verts [B, H, Nv]: each head's distinct vertical key tokens past the sink block 0 (those in it are never columns),
        ascending, -1 padded at the end.
    counts [B, H, nQB]: how many leading entries of verts lie in key blocks before query block i (the ones row i
        may read; those a listed block covers are skipped by the flags).
    covered [B, H, 2, nQB] uint8: covered[b, h, 0, o] = 1 when o is one of the head's block offsets (the key block
        i - o is listed for every full query block i); row 1 the same for the last query block (it differs when that
        block is short).
    seq_len, block_size: of the index.
    """

    verts: torch.Tensor
    counts: torch.Tensor
    covered: torch.Tensor
    seq_len: int
    block_size: int

    def __post_init__(self) -> None:
        if not all(isinstance(t, torch.Tensor) for t in (self.verts, self.counts, self.covered)):
            return  # a placeholder copy (`mtrain.ops.partial_autograd.split_tensors` swaps tensors for slots)
        n = -(-self.seq_len // self.block_size)
        if self.verts.dim() != 3 or self.counts.shape != (*self.verts.shape[:2], n) \
                or self.covered.shape != (*self.verts.shape[:2], 2, n):
            raise ValueError(f"VerticalColumns wants verts [B, H, Nv], counts [B, H, {n}] and covered [B, H, 2, {n}] "
                             f"(seq_len {self.seq_len}, block_size {self.block_size}); got {tuple(self.verts.shape)}, "
                             f"{tuple(self.counts.shape)}, {tuple(self.covered.shape)}")

    @property
    def n_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    def _entries(self) -> torch.Tensor:
        return self.verts

    def active(self) -> torch.Tensor:
        """Bool [B, H, nQB, Nv]: vertical slot t is a column of query block i (reference and tests; it is the
        [nQB x Nv] tensor this form avoids, so keep to small shapes)."""
        rows = torch.arange(self.n_blocks, device=self.verts.device)
        slot = torch.arange(self.verts.shape[-1], device=self.verts.device)
        vb = (self.verts.long() // self.block_size)[:, :, None, :]  # [B, H, 1, Nv]
        usable = (slot[None, None, None, :] < self.counts[..., None].long()) & (vb > 0)
        return usable & ~_offset_hit(self.covered, rows, vb)

    def column_plan(self, chunk: int) -> ColumnPlan:
        """The column backward's work, list-free: universe = verts in chunks of `chunk`, and per chunk its first
        query block (q_ids [B, H, n_chunks, 1]: the block after the chunk's first vertical's) and how many query
        blocks follow it (counts). The kernel (`_col_dkdv_kernel` with VCOLS) walks those blocks and takes each one's
        columns of the chunk from the coverage flags; bits is unused. B x H x n_chunks ints, no host read."""
        _check_chunk(chunk)
        n = self.n_blocks
        first_v = self.verts[:, :, ::chunk].long()  # each chunk's smallest vertical (ascending, -1 padding last)
        first_q = torch.where(first_v >= 0, first_v // self.block_size + 1, n).clamp(max=n)
        counts = (n - first_q).to(torch.int32)
        bits = torch.zeros(1, dtype=torch.int64, device=self.verts.device)
        return ColumnPlan(self.verts, first_q.to(torch.int32).unsqueeze(-1).contiguous(), bits, counts, chunk,
                          list_free=True)


def vertical_columns(vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int) -> VerticalColumns:
    """The list-free columns of the index `SparseIndex.from_lines(vertical, slash, seq_len, block_size)` would
    build (same arguments: vertical [B, H, Nv] key positions, slash [B, H, Ns] offsets, out of range = padding).
    Sorts and flags only: no host read, no [nQB x Nv] tensor."""
    v = _verticals_past_sink(vertical, slash, seq_len, block_size)
    B, H, _ = v.shape
    n = -(-seq_len // block_size)
    v_blk = v // block_size  # padding: n
    counts = torch.searchsorted(v_blk.contiguous(), torch.arange(n, device=v.device).expand(B, H, n).contiguous())
    return VerticalColumns(torch.where(v < seq_len, v, -1).to(torch.int32).contiguous(),
                           counts.to(torch.int32).contiguous(), offset_flags(slash, seq_len, block_size), seq_len,
                           block_size)


def offset_flags(slash: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[B, H, 2, nQB] uint8: 1 at each of the head's block offsets (`mtrain.ops.index.block_offsets`; row 1 those of
    a short last query block, else row 0 again). No host read."""
    B, H, _ = slash.shape
    n = -(-seq_len // block_size)
    offs, offs_last = block_offsets(slash, seq_len, block_size, trim=False)
    covered = torch.zeros(B, H, 2, n + 1, dtype=torch.uint8, device=slash.device)  # last column: padding's dump
    for row, o in enumerate((offs, offs if offs_last is None else offs_last)):
        covered[:, :, row].scatter_(-1, torch.where((o >= 0) & (o < n) & (o < NO_OFFSET), o, n), 1)
    return covered[..., :n].contiguous()


@dataclasses.dataclass
class RingColumns(_ListFree):
    """One context-parallel rank's off-ring columns (`mtrain.parallel.plan.OffRingColumns`), list-free: the ring's
    counterpart of `VerticalColumns`. On the ring the sink block is not a listed block: its tokens are columns of
    every query block, gathered with the verticals into slots after the step's keys. So each head keeps

    ids [B, H, Nc] int32: the step's keys (base + slot) of the sink block's tokens, then of the head's verticals past
        block 0 that are a column somewhere (ascending positions; -1 padded at the end);
    blocks [B, H, Nc] int32: their global key blocks (0 for the sink's; padding: nG);
    counts [B, H, R] int32: per local query block, how many leading entries lie in global key blocks before it
        (the sink's included: they are columns of every query block, causally masked on its own block);
    covered [B, H, 2, nG] uint8: the head's block offsets as flags (`offset_flags`);
    row_blocks [R] int64: the global query block of each local query block, ascending;
    seq_len, block_size: of the whole sequence; base: the first column key of the step (its shard's keys before).

    A vertical in global key block b > 0 is a column of local query block r exactly when b < row_blocks[r] and
    row_blocks[r] - b is not an offset; the Triton kernels (VCOLS 2) take b and the query block from the keys' and
    queries' global positions. About B x H x (2 Nc + R + 2 nG) ints against the lists' B x H x R x (sink + cap).
    """

    ids: torch.Tensor
    blocks: torch.Tensor
    counts: torch.Tensor
    covered: torch.Tensor
    row_blocks: torch.Tensor
    seq_len: int
    block_size: int
    base: int = 0

    def __post_init__(self) -> None:
        if not all(isinstance(t, torch.Tensor) for t in (self.ids, self.blocks, self.counts, self.covered,
                                                           self.row_blocks)):
            return  # a placeholder copy (`mtrain.ops.partial_autograd.split_tensors` swaps tensors for slots)
        n = -(-self.seq_len // self.block_size)
        bh = tuple(self.ids.shape[:2])
        if self.ids.dim() != 3 or self.blocks.shape != self.ids.shape or self.row_blocks.dim() != 1 \
                or self.counts.shape != (*bh, self.row_blocks.numel()) or self.covered.shape != (*bh, 2, n):
            raise ValueError(f"RingColumns wants ids and blocks [B, H, Nc], counts [B, H, R] for R row_blocks and "
                             f"covered [B, H, 2, {n}]; got {tuple(self.ids.shape)}, {tuple(self.blocks.shape)}, "
                             f"{tuple(self.counts.shape)}, {tuple(self.row_blocks.shape)}, {tuple(self.covered.shape)}")

    def _entries(self) -> torch.Tensor:
        return self.ids

    def shifted(self, base: int) -> "RingColumns":
        """The same columns for a step whose column slots start at key `base`."""
        return dataclasses.replace(self, ids=torch.where(self.ids >= 0, self.ids + (base - self.base), -1).to(
            torch.int32), base=base)

    def active(self) -> torch.Tensor:
        """Bool [B, H, R, Nc]: entry t is a column of local query block r (reference and tests: small shapes). Its
        lists (`to_lists`) are in the order the list-built plan holds them: the sink's tokens, then the verticals."""
        gi = self.row_blocks.long()
        blk = self.blocks.long()[:, :, None, :]  # [B, H, 1, Nc]
        slot = torch.arange(self.ids.shape[-1], device=self.ids.device)
        usable = (slot < self.counts[..., None].long()) & (self.ids[:, :, None, :] >= 0)
        return usable & ((blk == 0) | ((blk < gi[:, None]) & ~_offset_hit(self.covered, gi, blk)))

    def column_plan(self, chunk: int) -> ColumnPlan:
        """The column backward's work (as `VerticalColumns.column_plan`): per chunk of entries its first local
        query block (0 for a chunk holding sink tokens, else the first whose global block is past the chunk's first
        entry's) and how many local query blocks follow it. No host read."""
        _check_chunk(chunk)
        R = self.row_blocks.numel()
        first_b = self.blocks[:, :, ::chunk].long()  # ascending entries: each chunk's smallest block
        after = torch.searchsorted(self.row_blocks.long().contiguous(), first_b.contiguous(), right=True)
        first_q = torch.where(first_b == 0, 0, after).clamp(max=R)
        bits = torch.zeros(1, dtype=torch.int64, device=self.ids.device)
        return ColumnPlan(self.ids, first_q.to(torch.int32).unsqueeze(-1).contiguous(), bits,
                          (R - first_q).to(torch.int32), chunk, list_free=True)


def ring_columns(vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int, union: torch.Tensor,
                 row_blocks: torch.Tensor, n_sink: int, sink_columns: bool = True) -> RingColumns:
    """The `RingColumns` of the lines (vertical [B, H, Nv] key positions, slash [B, H, Ns] offsets, as
    `SparseIndex.from_lines` takes them) for the local query blocks `row_blocks`, whose off-ring slots hold the sink
    block's first n_sink tokens and then `union` (the ascending positions of every column of the whole index,
    `mtrain.ops.index.RowIndex.column_union`; it may end in seq_len padding). A vertical that is a column of no
    query block is not in the union and is dropped: it would never be read. sink_columns False: the sink's tokens
    are no columns (the gathered schedule lists the sink block itself; their slots stay, unread). Sorts and searches
    only: no host read."""
    union = union.to(device=vertical.device, dtype=torch.long).contiguous()
    v = _verticals_past_sink(vertical, slash, seq_len, block_size, union)
    B, H, _ = v.shape
    dev = v.device
    n = -(-seq_len // block_size)
    real = v < seq_len
    slot = n_sink + torch.searchsorted(union, v.contiguous())
    blk = torch.where(real, v // block_size, n)
    row_blocks = row_blocks.to(device=dev, dtype=torch.long).contiguous()
    n_cols = n_sink if sink_columns else 0  # the sink's tokens among the columns (their slots stay either way)
    counts = n_cols + torch.searchsorted(blk.contiguous(), row_blocks.expand(B, H, -1).contiguous())
    sink = torch.arange(n_cols, device=dev).expand(B, H, n_cols)
    ids = torch.cat([sink, torch.where(real, slot, -1)], -1).to(torch.int32).contiguous()
    blocks = torch.cat([torch.zeros_like(sink), blk], -1).to(torch.int32).contiguous()
    return RingColumns(ids, blocks, counts.to(torch.int32).contiguous(), offset_flags(slash, seq_len, block_size),
                       row_blocks, seq_len, block_size)


def list_free_bytes(index) -> int | None:
    """Bytes of an index with its columns in this form: its block lists and counts, the list-free columns of the
    lines it was built from and the column backward's plan at the kernels' chunk. A `SparseIndex` counts its
    `VerticalColumns`; a `RowIndex` (a context-parallel rank's rows) the `RingColumns` the ring reads for those rows
    (its per-row column counts included). None when the index keeps neither the form nor its lines
    (`index._cache["lines"]`, which the estimators set)."""
    from mtrain.ops.index import kernel_column_chunk

    chunk = kernel_column_chunk(int(index.block_size))
    rows = getattr(index, "rows", None)
    lines = index._cache.get("lines")
    if rows is not None and lines is not None and index.column_union is not None:
        seq_len, bs = int(index.seq_len), int(index.block_size)
        form = ring_columns(lines[0], lines[1], seq_len, bs, index.column_union, rows, min(bs, seq_len))
        plan = form.column_plan(chunk)
        held = (index.block_ids, index.block_counts, index.col_counts, plan.q_ids, plan.counts)
        return form.nbytes() + sum(t.numel() * t.element_size() for t in held)
    cols = index._cache.get("vcols")  # attached by `with_list_free_columns`, else built here from the lines
    if cols is None:
        if lines is None:
            return None
        cols = vertical_columns(lines[0], lines[1], int(index.seq_len), int(index.block_size))
    plan = cols.column_plan(chunk)
    per_row = cols.counts.numel() if rows is None else cols.counts.shape[0] * cols.counts.shape[1] * rows.numel()
    held = (index.block_ids, index.block_counts, cols.verts, cols.covered, plan.q_ids, plan.counts)
    return per_row * cols.counts.element_size() + sum(t.numel() * t.element_size() for t in held)


def with_list_free_columns(index):
    """A copy of a `SparseIndex` (the same list tensors) whose kernels read its columns list-free: the
    `VerticalColumns` of the lines it was built from, attached as `_cache["vcols"]` (`SparseIndex.kernel_columns`);
    what the kernels derive is rebuilt for it. None when the index keeps no lines (`_cache["lines"]`)."""
    from mtrain.ops.index import SparseIndex

    lines = index._cache.get("lines")
    if lines is None:
        return None
    out = SparseIndex(index.block_ids, index.block_counts, index.col_ids, index.col_counts, index.seq_len,
                      index.block_size)
    for key in ("diagonal_listed", "lines", "est_recall"):
        if key in index._cache:
            out._cache[key] = index._cache[key]
    out._cache["vcols"] = vertical_columns(lines[0], lines[1], int(index.seq_len), int(index.block_size))
    return out
