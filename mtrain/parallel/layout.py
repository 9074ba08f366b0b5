"""Sequence layouts for context parallelism: which global positions each CP rank holds, in local order;
they are the rank's `position_ids`, so RoPE is right without any per-layer shuffle."""

from __future__ import annotations

import abc
import math
from typing import Sequence

import torch

from mtrain.errors import MtrainError

LAYOUT_NAMES = ("contiguous", "zigzag", "stripe", "block-stripe")


class LayoutError(MtrainError, ValueError):
    """A sequence length (or world size) that a layout cannot split; the message says which lengths work."""


class Layout(abc.ABC):
    """Base class: subclasses define `length_multiple`, `permutation` and `local_block_size`.

    `permutation(seq_len)` concatenates the shards in slot order: slot j holds `permutation[j * S_local:
    (j + 1) * S_local]`. Rank r holds slot r, unless `local_world_size` L is given (a hierarchical ring with
    nodes of L consecutive ranks): then rank r = node * L + local holds slot local * (W / L) + node, so a
    node's shards lie W / L slots apart and every step of the hierarchical ring stays balanced.
    """

    name = ""

    def __init__(self, world_size: int, granularity: int = 64, local_world_size: int | None = None):
        if world_size < 1:
            raise LayoutError(f"world_size must be >= 1, got {world_size}")
        if granularity < 1:
            raise LayoutError(f"granularity must be >= 1, got {granularity}")
        if local_world_size is not None and (local_world_size < 1 or world_size % local_world_size):
            raise LayoutError(
                f"local_world_size {local_world_size} must divide world_size {world_size} (ranks per node)"
            )
        self.world_size = int(world_size)
        self.granularity = int(granularity)
        self.local_world_size = int(local_world_size) if local_world_size else None

    @staticmethod
    def create(name: str, world_size: int, granularity: int = 64, local_world_size: int | None = None) -> "Layout":
        """Build a layout by name: contiguous, zigzag, stripe (token) or block-stripe (stripes of `granularity`).
        local_world_size: ranks per node when the ring is hierarchical (see the class docstring)."""
        classes = {cls.name: cls for cls in (ContiguousLayout, ZigzagLayout, StripeLayout, BlockStripeLayout)}
        if name not in classes:
            raise LayoutError(f"unknown layout {name!r}; choose one of {', '.join(LAYOUT_NAMES)}")
        return classes[name](world_size, granularity, local_world_size)

    @property
    def spec(self) -> tuple:
        """(name, world_size, granularity, local_world_size): `Layout.create(*spec)` rebuilds this layout."""
        return self.name, self.world_size, self.granularity, self.local_world_size

    def __repr__(self) -> str:
        extra = f", granularity={self.granularity}" if isinstance(self, BlockStripeLayout) else ""
        if self.local_world_size:
            extra += f", local_world_size={self.local_world_size}"
        return f"Layout.create({self.name!r}, world_size={self.world_size}{extra})"

    def slot(self, rank):
        """Which slot of `permutation` rank `rank` holds (int or LongTensor)."""
        if not self.local_world_size:
            return rank
        nodes = self.world_size // self.local_world_size
        return (rank % self.local_world_size) * nodes + rank // self.local_world_size

    def rank_of_slot(self, slot):
        """Inverse of `slot` (int or LongTensor)."""
        if not self.local_world_size:
            return slot
        nodes = self.world_size // self.local_world_size
        return (slot % nodes) * self.local_world_size + slot // nodes

    # -- what subclasses define ------------------------------------------------------------------------
    @abc.abstractmethod
    def length_multiple(self) -> int:
        """Sequence lengths this layout splits are exactly the multiples of this number."""

    @abc.abstractmethod
    def permutation(self, seq_len: int) -> torch.Tensor:
        """Every slot's positions concatenated in slot order (LongTensor [S])."""

    @abc.abstractmethod
    def local_block_size(self, seq_len: int, block_size: int) -> int:
        """Largest size L dividing the local length such that every run of L local tokens lies inside one
        global block of `block_size` tokens: a global block-sparse index maps onto local blocks of L."""

    # -- shared ----------------------------------------------------------------------------------------
    def check(self, seq_len: int) -> int:
        """Validate `seq_len`; return the local length S / W."""
        multiple = self.length_multiple()
        if seq_len <= 0 or seq_len % multiple:
            raise LayoutError(
                f"sequence length {seq_len} cannot be split by {self!r}: it needs a multiple of {multiple} "
                f"({self._why()}); pad the sequence to {max(multiple, -(-seq_len // multiple) * multiple)}"
            )
        return seq_len // self.world_size

    def _why(self) -> str:
        return f"world_size {self.world_size}"

    def indices(self, seq_len: int, rank: int) -> torch.Tensor:
        """Global positions held by `rank`, in local order (LongTensor [S / W]); use them as position_ids."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world_size {self.world_size}")
        local = self.check(seq_len)
        slot = self.slot(rank)
        return self.permutation(seq_len)[slot * local:(slot + 1) * local]

    def owners(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank, local index) of every global position: two LongTensors [S]."""
        local = self.check(seq_len)
        perm = self.permutation(seq_len)
        where = torch.empty_like(perm)
        where[perm] = torch.arange(seq_len)
        return self.rank_of_slot(where // local), where % local

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """The part of `x` (global sequence along `dim`) that `rank` holds, in local order."""
        idx = self.indices(x.shape[dim], rank).to(x.device)
        return x.index_select(dim, idx)

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of `shard`: reassemble the global sequence from all ranks' shards (in rank order)."""
        if len(shards) != self.world_size:
            raise LayoutError(f"unshard needs {self.world_size} shards (one per rank), got {len(shards)}")
        stacked = torch.cat([shards[self.rank_of_slot(j)] for j in range(self.world_size)], dim=dim)
        seq_len = stacked.shape[dim]
        self.check(seq_len)
        perm = self.permutation(seq_len).to(stacked.device)
        out = torch.empty_like(stacked)
        out.index_copy_(dim, perm, stacked)
        return out


class ContiguousLayout(Layout):
    """Rank r holds tokens [r*S/W, (r+1)*S/W): simple, but causal work grows with r."""

    name = "contiguous"

    def length_multiple(self) -> int:
        return self.world_size

    def permutation(self, seq_len: int) -> torch.Tensor:
        self.check(seq_len)
        return torch.arange(seq_len)

    def local_block_size(self, seq_len: int, block_size: int) -> int:
        return math.gcd(self.check(seq_len), block_size)


class ZigzagLayout(Layout):
    """2W chunks; rank r holds chunks r and 2W-1-r, which balances dense causal work."""

    name = "zigzag"

    def length_multiple(self) -> int:
        return 2 * self.world_size

    def _why(self) -> str:
        return f"2 x world_size {self.world_size} chunks"

    def permutation(self, seq_len: int) -> torch.Tensor:
        self.check(seq_len)
        w = self.world_size
        chunks = torch.arange(seq_len).view(2 * w, seq_len // (2 * w))
        order = torch.stack([torch.arange(w), 2 * w - 1 - torch.arange(w)], dim=1).flatten()
        return chunks[order].flatten()

    def local_block_size(self, seq_len: int, block_size: int) -> int:
        self.check(seq_len)
        return math.gcd(seq_len // (2 * self.world_size), block_size)


class StripeLayout(Layout):
    """Token i goes to rank i mod W: balanced for dense causal, but a rank's tokens are never contiguous,
    so a block-sparse kernel sees tiny blocks (block_size / W tokens)."""

    name = "stripe"

    def length_multiple(self) -> int:
        return self.world_size

    def permutation(self, seq_len: int) -> torch.Tensor:
        self.check(seq_len)
        w = self.world_size
        return torch.arange(seq_len).view(seq_len // w, w).t().flatten()

    def local_block_size(self, seq_len: int, block_size: int) -> int:
        local = self.check(seq_len)
        if block_size % self.world_size:
            return 1
        return math.gcd(block_size // self.world_size, local)


class BlockStripeLayout(Layout):
    """Stripes of G tokens; rank r holds stripes r, r+W, r+2W, ...: every rank sits on the diagonal, so
    each gets an equal share of every slash line at every ring step."""

    name = "block-stripe"

    def length_multiple(self) -> int:
        return self.world_size * self.granularity

    def _why(self) -> str:
        return f"world_size {self.world_size} x granularity {self.granularity}"

    def permutation(self, seq_len: int) -> torch.Tensor:
        self.check(seq_len)
        w, g = self.world_size, self.granularity
        stripes = torch.arange(seq_len).view(seq_len // (w * g), w, g)
        return stripes.transpose(0, 1).flatten()

    def local_block_size(self, seq_len: int, block_size: int) -> int:
        return math.gcd(math.gcd(self.granularity, block_size), self.check(seq_len))
