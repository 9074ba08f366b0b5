"""The vertical-slash sparse index: per (batch, query head, query block) the key blocks to run densely and
the extra vertical key columns, plus the transposed views the deterministic backward needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def compact(flags: torch.Tensor, values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the True positions of `flags` [..., N] to the left, keeping their order.

    Returns (ids [..., M] int32, padded with -1, M = max count (at least 1); counts [...] int32).
    `ids` holds the positions (0..N-1), or `values[..., pos]` when `values` (same shape as flags,
    or broadcastable) is given. Vectorized and proportional to the number of True entries: one
    nonzero() over the flags, then one indexed write (no loop over rows, no writes for False entries).
    """
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


def transpose_blocks(
    block_ids: torch.Tensor, block_counts: torch.Tensor, n_kblocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (b, h, key block j) the sorted query blocks whose list contains j.

    block_ids [B, H, nQB, MAXB] (-1 padded), block_counts [B, H, nQB] ->
    (q_ids [B, H, nKB, MAXT] int32, -1 padded; counts [B, H, nKB] int32).
    """
    B, H, nqb, maxb = block_ids.shape
    dev = block_ids.device
    valid = (torch.arange(maxb, device=dev) < block_counts[..., None].long()) & (block_ids >= 0)
    kb = torch.where(valid, block_ids.long(), n_kblocks)  # invalid entries land in a dump row
    flags = torch.zeros(B, H, n_kblocks + 1, nqb, dtype=torch.bool, device=dev)  # built transposed
    b_idx = torch.arange(B, device=dev)[:, None, None, None]
    h_idx = torch.arange(H, device=dev)[None, :, None, None]
    q_idx = torch.arange(nqb, device=dev)[None, None, :, None]
    flags[b_idx, h_idx, kb, q_idx] = True
    return compact(flags[:, :, :n_kblocks])


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


def column_plan(col_ids: torch.Tensor, col_counts: torch.Tensor, seq_k: int, chunk: int) -> ColumnPlan:
    """Build the `ColumnPlan` of per-query-block column lists (see `ColumnPlan`); chunk <= 64."""
    if not 1 <= chunk <= 64:
        raise ValueError(f"column chunk must be in 1..64 (one int64 bit mask per entry); got {chunk}")
    B, H, nqb, maxc = col_ids.shape
    dev = col_ids.device
    slot = torch.arange(maxc, device=dev)
    valid = (slot < col_counts[..., None].long()) & (col_ids >= 0) & (col_ids < seq_k)
    # Work on the listed entries only (the padded lists can be ~20x larger than their content).
    b, h, i, n = torch.nonzero(valid, as_tuple=True)
    cols = col_ids[b, h, i, n].long()
    used = torch.zeros(B, H, seq_k, dtype=torch.bool, device=dev)
    used[b, h, cols] = True  # tokens that are a column of some query block
    universe, _ = compact(used)
    rank = used.cumsum(-1) - 1  # universe slot of every used token
    n_chunks = -(-universe.shape[-1] // chunk)
    u = rank[b, h, cols]
    bits = torch.zeros(B, H, n_chunks, nqb, dtype=torch.int64, device=dev)
    # Each (query block, column) pair is unique, so adding bits is an exact, order-free OR.
    bits.index_put_((b, h, u // chunk, i), torch.ones_like(u) << (u % chunk), accumulate=True)
    q_ids, counts = compact(bits != 0)
    packed_bits = torch.gather(bits, -1, q_ids.long().clamp(min=0))
    packed_bits = torch.where(q_ids >= 0, packed_bits, 0)
    return ColumnPlan(universe, q_ids, packed_bits.contiguous(), counts, chunk)


@dataclass
class SparseIndex:
    """Which (query, key) pairs vertical-slash attention computes, in GLOBAL coordinates.

    block_ids [B, Hq, nQB, MAXB] int32: per query block of `block_size` tokens, the key blocks
        computed densely (causal inside), sorted ascending, -1 padded; block_counts [B, Hq, nQB].
    col_ids [B, Hq, nQB, MAXC] int32: extra vertical key tokens not inside any listed block, sorted,
        -1 padded; col_counts [B, Hq, nQB].
    seq_len, block_size: ints; nQB = ceil(seq_len / block_size).
    Built by `from_lines` or `estimate_vertical_slash` (vectorized tensor ops, no loop over blocks),
    or directly from these tensors. `transposed()` gives the per-key-block view the deterministic
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

    @classmethod
    def from_lines(
        cls, vertical: torch.Tensor, slash: torch.Tensor, seq_len: int, block_size: int = 64
    ) -> "SparseIndex":
        """Build the index from vertical key positions and slash offsets.

        vertical: LongTensor [B, Hq, Nv] of key positions; slash: [B, Hq, Ns] of offsets q - k >= 0;
        -1 (or anything out of range) is padding; Nv or Ns may be 0. Every query block keeps its
        diagonal block and the first key block (sinks); each slash offset d adds the (at most two)
        key blocks its diagonal crosses in each query block; verticals inside a computed block are
        dropped from the column lists, the rest become extra columns for every later query block.
        """
        if vertical.dim() != 3 or slash.dim() != 3 or vertical.shape[:2] != slash.shape[:2]:
            raise ValueError(
                f"vertical must be [B, Hq, Nv] and slash [B, Hq, Ns]; got {tuple(vertical.shape)}, {tuple(slash.shape)}"
            )
        if block_size < 1 or seq_len < 1:
            raise ValueError(f"block_size and seq_len must be positive; got {block_size}, {seq_len}")
        B, H, _ = vertical.shape
        dev = vertical.device
        n = -(-seq_len // block_size)
        qb = torch.arange(n, device=dev)
        flags = torch.zeros(B, H, n, n + 1, dtype=torch.bool, device=dev)  # last column = dump slot
        flags[:, :, qb, qb] = True
        flags[:, :, :, 0] = True
        if slash.shape[-1] > 0:
            d = slash.long()[:, :, None, :]  # [B,H,1,Ns]
            ok = (d >= 0) & (d < seq_len)
            row_lo = (qb * block_size)[None, None, :, None]
            row_hi = torch.clamp((qb + 1) * block_size, max=seq_len)[None, None, :, None] - 1
            key_lo, key_hi = row_lo - d, row_hi - d
            ok = ok & (key_hi >= 0)
            lo_blk = torch.where(ok, key_lo.clamp(min=0) // block_size, n)
            hi_blk = torch.where(ok, key_hi.clamp(min=0) // block_size, n)
            flags.scatter_(-1, lo_blk.expand(B, H, n, -1), True)
            flags.scatter_(-1, hi_blk.expand(B, H, n, -1), True)
        flags = flags[..., :n]
        block_ids, block_counts = compact(flags)

        if vertical.shape[-1] > 0:
            v, _ = torch.sort(torch.where((vertical >= 0) & (vertical < seq_len), vertical.long(), seq_len), dim=-1)
            dup = torch.zeros_like(v, dtype=torch.bool)
            dup[..., 1:] = v[..., 1:] == v[..., :-1]
            v_ok = (v < seq_len) & ~dup  # [B,H,Nv]
            v_blk = torch.where(v_ok, v // block_size, 0)
            covered = torch.gather(flags, -1, v_blk[:, :, None, :].expand(B, H, n, -1))
            active = v_ok[:, :, None, :] & (v_blk[:, :, None, :] < qb[None, None, :, None]) & ~covered
            col_ids, col_counts = compact(active, v[:, :, None, :].expand(B, H, n, -1).clamp(max=seq_len - 1))
        else:
            col_ids = torch.full((B, H, n, 1), -1, dtype=torch.int32, device=dev)
            col_counts = torch.zeros(B, H, n, dtype=torch.int32, device=dev)
        return cls(block_ids, block_counts, col_ids, col_counts, seq_len, block_size)

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
        cslot = torch.arange(self.col_ids.shape[-1], device=dev)
        cok = (cslot < self.col_counts[..., None].long()) & (self.col_ids >= 0)
        col = self.col_ids.double()
        q_hi = q_lo + q_len - 1
        seen = torch.clamp(q_hi - torch.maximum(col, q_lo) + 1, min=0)  # rows r in the block with r >= col
        return total + torch.where(cok, seen, 0.0).sum(dim=(-1, -2))

    def density(self) -> float:
        """Fraction of all causal (query, key) pairs that the kernels compute."""
        causal = self.seq_len * (self.seq_len + 1) / 2
        return float(self.pair_counts().mean() / causal)

    def block_density(self) -> float:
        """Fraction of causal key blocks listed (the work measure of a block kernel)."""
        n = self.n_blocks
        return float(self.block_counts.double().mean() / ((n + 1) / 2))

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_ids [B, Hq, nKB, MAXT], counts): per key block, the query blocks that compute it (cached)."""
        if "t" not in self._cache:
            self._cache["t"] = transpose_blocks(self.block_ids, self.block_counts, self.n_blocks)
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

