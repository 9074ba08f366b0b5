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


@dataclasses.dataclass
class VerticalColumns:
    """The columns of a vertical-slash index, list-free (see the module's docstring). All int32 or uint8 tensors on
    one device:

    verts [B, H, Nv]: each head's distinct vertical key tokens, ascending, -1 padded at the end.
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

    def __iter__(self):
        """(ids, counts) as a `columns=` pair: ids [B, H, nQB, Nv] is a view of verts with a zero stride over the
        query blocks (every row sees every vertical; the kernels skip the covered ones and those past counts). Only
        the Triton kernels read it that way: a reader of plain lists must take `to_lists()`."""
        B, H, nv = self.verts.shape
        yield self.verts.unsqueeze(2).expand(B, H, self.n_blocks, max(nv, 0))
        yield self.counts

    def nbytes(self) -> int:
        """Bytes held (the three tensors)."""
        return sum(t.numel() * t.element_size() for t in (self.verts, self.counts, self.covered))

    def active(self) -> torch.Tensor:
        """Bool [B, H, nQB, Nv]: vertical slot t is a column of query block i (reference and tests; it is the
        [nQB x Nv] tensor this form avoids, so keep to small shapes)."""
        n = self.n_blocks
        rows = torch.arange(n, device=self.verts.device)
        slot = torch.arange(self.verts.shape[-1], device=self.verts.device)
        vb = (self.verts.long() // self.block_size)[:, :, None, :]  # [B, H, 1, Nv]
        usable = (slot[None, None, None, :] < self.counts[..., None].long()) & (vb > 0)
        off = (rows[:, None] - vb).clamp(min=0, max=n - 1)  # [B, H, nQB, Nv]
        B, H = self.verts.shape[:2]
        flags = [self.covered[:, :, r].long()[:, :, None, :].expand(B, H, n, n) for r in (0, 1)]
        hit = torch.where((rows == n - 1)[:, None], torch.gather(flags[1], 3, off), torch.gather(flags[0], 3, off)) != 0
        return usable & ~hit

    def to_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(col_ids [B, H, nQB, MAXC] int32 -1 padded, col_counts [B, H, nQB] int32): the lists `SparseIndex`
        holds for the same lines (one host read for the width)."""
        slots, counts = compact(self.active())
        ids = torch.gather(self.verts.long()[:, :, None, :].expand(*slots.shape[:3], self.verts.shape[-1]), -1,
                           slots.long().clamp(min=0))
        return torch.where(slots >= 0, ids, -1).to(torch.int32), counts

    def column_plan(self, chunk: int) -> ColumnPlan:
        """The column backward's work, list-free: universe = verts in chunks of `chunk`, and per chunk its first
        query block (q_ids [B, H, n_chunks, 1]: the block after the chunk's first vertical's) and how many query
        blocks follow it (counts). The kernel (`_col_dkdv_kernel` with VCOLS) walks those blocks and takes each one's
        columns of the chunk from the coverage flags; bits is unused. B x H x n_chunks ints, no host read."""
        if not 1 <= chunk <= 64:
            raise ValueError(f"column chunk must be in 1..64 (the column kernels' chunk); got {chunk}")
        B, H, nv = self.verts.shape
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
    if vertical.dim() != 3 or slash.dim() != 3 or vertical.shape[:2] != slash.shape[:2]:
        raise ValueError(f"vertical must be [B, H, Nv] and slash [B, H, Ns]; got {tuple(vertical.shape)}, "
                         f"{tuple(slash.shape)}")
    if block_size < 1 or seq_len < 1:
        raise ValueError(f"block_size and seq_len must be positive; got {block_size}, {seq_len}")
    B, H, _ = vertical.shape
    dev = vertical.device
    n = -(-seq_len // block_size)
    if vertical.shape[-1] == 0:  # one padding slot: the kernels and plans keep a width of at least 1
        vertical = torch.full((B, H, 1), -1, dtype=torch.long, device=dev)
    v, _ = torch.sort(sorted_verticals(vertical, seq_len, block_size)[0], dim=-1)  # distinct, padding (seq_len) last
    v_blk = v // block_size  # padding: n
    counts = torch.searchsorted(v_blk.contiguous(), torch.arange(n, device=dev).expand(B, H, n).contiguous())
    offs, offs_last = block_offsets(slash, seq_len, block_size, trim=False)
    covered = torch.zeros(B, H, 2, n + 1, dtype=torch.uint8, device=dev)  # last column: padding's dump
    for row, o in enumerate((offs, offs if offs_last is None else offs_last)):
        covered[:, :, row].scatter_(-1, torch.where((o >= 0) & (o < n) & (o < NO_OFFSET), o, n), 1)
    return VerticalColumns(torch.where(v < seq_len, v, -1).to(torch.int32).contiguous(),
                           counts.to(torch.int32).contiguous(), covered[..., :n].contiguous(), seq_len, block_size)


def list_free_bytes(index) -> int | None:
    """Bytes of an index with its columns in this form: its block lists and counts, the `VerticalColumns` of the
    lines it was built from, and the column backward's plan at the kernels' chunk. A `RowIndex` (a context-parallel
    rank's rows) counts its own rows' block lists and per-row counts, with the whole head's verticals and flags. None
    when the index keeps neither the form nor its lines (`index._cache["lines"]`, which the estimators set)."""
    from mtrain.ops.index import kernel_column_chunk

    cols = index._cache.get("vcols")  # attached by `with_list_free_columns`, else built here from the lines
    if cols is None:
        lines = index._cache.get("lines")
        if lines is None:
            return None
        cols = vertical_columns(lines[0], lines[1], int(index.seq_len), int(index.block_size))
    plan = cols.column_plan(kernel_column_chunk(int(index.block_size)))
    rows = getattr(index, "rows", None)
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
