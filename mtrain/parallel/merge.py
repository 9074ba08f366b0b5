"""Running sums over ring steps, shared by every ring schedule: the LSE merge of partial attention outputs
(weights in fp32, outputs merged in fp32, fp64 for fp64) and the fp32 sums of gradient parts."""

from __future__ import annotations

import dataclasses

import torch

from mtrain.ops.partial import lse_weights
from mtrain.ops.switches import Switches, or_defaults


def accum_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulator dtype for outputs and gradients: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# The one-pass Triton merge of full-row parts on the GPU (`PartialAccumulator._fused`), under parallel.fused_merge
# (`Switches.fused_merge`, on by default; the ring passes the run's). Its first version stored the merged lse in place
# while other warps could still load the same rows, and gave wrong results on the GPU; the kernel now loads everything
# before it stores (a barrier between), and mtrain/bench/check.py's "merge" case (fused and torch against float64)
# passes. Off: torch.


def _covers(rows: slice, n: int) -> bool:
    return (rows.start or 0) == 0 and (rows.stop is None or rows.stop >= n) and rows.step in (None, 1)


class PartialAccumulator:
    """Running (out, lse) of the local queries over ring steps.

    The first part that covers every row is taken as it came (no zero start, no copy); later parts merge in
    the accumulation dtype, in place. A part passed with `final=True` (no later part touches its rows) is
    merged straight into the output dtype while the running result is still in it: the same single
    rounding as merging in fp32 and casting at the end, without the fp32 round trip. switches: the run's
    (`mtrain.ops.switches`; None = the defaults), whose parallel.fused_merge picks the merge on the GPU.
    """

    def __init__(self, like_q: torch.Tensor, *, switches: Switches | None = None):
        self.shape, self.device, self.dtype = like_q.shape, like_q.device, accum_dtype(like_q)
        self.fused = or_defaults(switches).fused_merge
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def _start_empty(self) -> None:
        b, s, h, _ = self.shape
        self.out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=self.device)

    def add(self, part_out: torch.Tensor, part_lse: torch.Tensor, rows: slice = slice(None),
            final: bool = False) -> None:
        """Merge a partial result (out [B, r, H, D], lse [B, H, r] fp32) for the query rows `rows` (all by default)."""
        if self.out is None:
            if _covers(rows, self.shape[1]):
                self.out, self.lse = part_out, part_lse.float()
                return
            self._start_empty()
        if self._fused(part_out, part_lse, rows, final):
            return
        wa, wb, lse = lse_weights(self.lse[:, :, rows], part_lse.float())
        if self.out.dtype != self.dtype and not final:
            self.out = self.out.to(self.dtype)  # more merges follow: keep the running result in fp32
        dst = self.out[:, rows]
        if dst.dtype == self.dtype:
            dst.mul_(wa).addcmul_(part_out, wb)
        else:  # computed in fp32 (the weights' dtype), rounded once on the store
            torch.addcmul(dst * wa, part_out, wb, out=dst)
        self.lse[:, :, rows] = lse

    def _fused(self, part_out, part_lse, rows: slice, final: bool) -> bool:
        """On the GPU, a part covering every row merges in one Triton pass (`mtrain.ops._triton_merge`): into the
        fp32 running result in place, or into a new tensor (fp32 while more parts follow, the part's dtype for the
        last). The same arithmetic as the torch merge: fp32 weights and products, one rounding on the store."""
        if not (self.fused and part_out.is_cuda and self.dtype == torch.float32
                and _covers(rows, self.shape[1]) and part_lse.dtype == torch.float32 and part_lse.is_contiguous()
                and self.lse.is_contiguous() and part_out.stride(-1) == 1 and self.out.stride(-1) == 1):
            return False
        from mtrain.ops._triton_merge import merge

        target = part_out.dtype if final else self.dtype
        dst = self.out if self.out.dtype == target else torch.empty(self.shape, dtype=target, device=self.device)
        merge(self.out, self.lse, part_out, part_lse, dst, self.lse)
        self.out = dst
        return True

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in `dtype`, lse fp32 [B, H, S]); rows no part reached have out 0 and lse -inf."""
        if self.out is None:
            self._start_empty()
        return self.out.to(dtype, memory_format=torch.contiguous_format), self.lse


class GradSum:
    """Sum of gradient parts of a [B, S, H, D] tensor in the accumulation dtype (fp32; fp64 for fp64).

    The first part that covers every row is taken over (a contiguous fp32 kernel output as it is, a 16-bit one
    cast once) instead of adding it to zeros; later parts are added in place. Exact: every part is added in
    fp32 (16-bit parts are widened on the fly)."""

    def __init__(self, like: torch.Tensor):
        self.shape, self.device, self.dtype = like.shape, like.device, accum_dtype(like)
        self.total: torch.Tensor | None = None

    def add(self, part: torch.Tensor, rows: slice = slice(None)) -> None:
        if self.total is None:
            if _covers(rows, self.shape[1]):
                self.total = part.to(self.dtype, memory_format=torch.contiguous_format)
                return
            self.total = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.total[:, rows].add_(part)

    def value(self) -> torch.Tensor:
        if self.total is None:
            self.total = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.total


@dataclasses.dataclass
class RankParts:
    """Every rank's part of one tensor for a sum over the group: this rank's (`own`) and the others', received into
    the rows of one buffer (`inbox` [world - 1, *own.shape], rank order with this rank left out), so that the sum
    reads them all in one pass."""

    own: torch.Tensor
    inbox: torch.Tensor
    rank: int

    @classmethod
    def receiving(cls, own: torch.Tensor, world: int, rank: int) -> "RankParts":
        return cls(own, own.new_empty((world - 1, *own.shape)), rank)

    def part(self, o: int) -> torch.Tensor:
        """Rank o's part (for another rank: its receive buffer)."""
        return self.own if o == self.rank else self.inbox[o - (o > self.rank)]

    def sum(self, dtype: torch.dtype, *, switches: Switches | None = None) -> torch.Tensor:
        """The parts summed in rank order in the accumulation dtype, rounded once to `dtype`: the same sum on every
        run. On the GPU under parallel.fused_merge (`switches`; None = the defaults) in one Triton pass
        (`mtrain.ops._triton_merge.sum_parts`), else a widening copy of rank 0's part and one add per other rank."""
        acc = accum_dtype(self.own)
        if or_defaults(switches).fused_merge and self.own.is_cuda and acc == torch.float32 and self.own.is_contiguous():
            from mtrain.ops._triton_merge import sum_parts

            out = torch.empty(self.own.shape, dtype=dtype, device=self.own.device)
            sum_parts(self.own, self.inbox, self.rank, out)
            return out
        total = self.part(0).to(acc, copy=True)
        for o in range(1, self.inbox.shape[0] + 1):
            total.add_(self.part(o))
        return total.to(dtype)
