"""The running LSE merge of partial attention results over ring steps, shared by every ring schedule:
fp32 (fp64 for fp64 inputs) through `mtrain.ops.merge_partial`, which is -inf safe."""

from __future__ import annotations

import torch

from mtrain.ops import merge_partial


def accum_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulator dtype for outputs and gradients: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class PartialAccumulator:
    """Running (out, lse) over ring steps; starts with every row empty (out = 0, lse = -inf)."""

    def __init__(self, like_q: torch.Tensor):
        b, s, h, d = like_q.shape
        self.out = torch.zeros(b, s, h, d, dtype=accum_dtype(like_q), device=like_q.device)
        self.lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=like_q.device)

    def add(self, part_out: torch.Tensor, part_lse: torch.Tensor, rows: slice = slice(None)) -> None:
        """Merge a partial result for the query rows `rows` (all by default)."""
        out, lse = merge_partial(self.out[:, rows], self.lse[:, :, rows], part_out, part_lse)
        self.out[:, rows] = out
        self.lse[:, :, rows] = lse
