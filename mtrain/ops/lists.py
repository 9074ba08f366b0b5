"""List utilities the block engines share: packing the kept entries of padded lists to the left (`left_pack`) and
the document-id range of each block (`doc_ranges`)."""

from __future__ import annotations

import torch

from mtrain.errors import MtrainError

# Our Triton kernels address a list entry with 32-bit offsets (batch, head and query block times their strides), so a
# block or column list tensor holds fewer entries than this.
MAX_LIST_ENTRIES = 2**31 - 1


def left_pack(ids: torch.Tensor, keep: torch.Tensor, width: int, fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept entries of ids [..., M] packed to the left, in order, of a [..., width] int32 tensor padded with `fill`
    (0 for Flex and FA4, which never read past the count; -1 for our kernels' lists) and their counts [...] int32."""
    counts = keep.sum(-1, dtype=torch.int32)
    slot = torch.where(keep, keep.cumsum(-1) - 1, width)  # dropped entries land in a dump column
    out = torch.full((*ids.shape[:-1], width + 1), fill, dtype=torch.int32, device=ids.device)
    out.scatter_(-1, slot, torch.where(keep, ids, fill).to(torch.int32))
    return out[..., :width].contiguous(), counts


def doc_ranges(doc: torch.Tensor, bs: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest document id per block of bs tokens: [B, n] each (n: the blocks of doc's S by default)."""
    B, S = doc.shape
    n = -(-S // bs) if n is None else n
    pad = n * bs - S
    lo = torch.nn.functional.pad(doc, (0, pad), value=torch.iinfo(torch.int64).max).view(B, n, bs).amin(-1)
    hi = torch.nn.functional.pad(doc, (0, pad), value=torch.iinfo(torch.int64).min).view(B, n, bs).amax(-1)
    return lo, hi


def check_list_entries(t: torch.Tensor, what: str) -> None:
    """Refuse a list tensor our kernels cannot address (`MAX_LIST_ENTRIES`): with a clear error, where the kernels
    would read out of bounds (an illegal memory access, losing the process)."""
    if t.numel() > MAX_LIST_ENTRIES:
        raise MtrainError(
            f"{what} of shape {tuple(t.shape)} hold {t.numel():,} entries, more than the sparse kernels address with "
            f"32-bit offsets ({MAX_LIST_ENTRIES:,}): lower attention.max_vertical (the column lists are as wide as "
            "the vertical cap), bound the cap widening with attention.widen_max_list_mib, or split the sequence over "
            "more ranks (parallel.cp_size)")

