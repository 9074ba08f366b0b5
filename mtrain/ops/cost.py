"""Cost model of one attention call: predicted milliseconds of dense causal attention and of vertical-slash
sparse attention (index building + kernels) from measured coefficients, and `choose` between the two.

Every figure below was measured with `scripts/bench_cost.py` and fitted with `scripts/bench_cost.py --fit`;
rerun both after a kernel or index change and paste the printed tables here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A layer runs sparse only when sparse is predicted at most this fraction of dense: the fits below are off by
# up to ~15% (35% on the smallest sparse calls), and a wrong "sparse" costs more than a wrong "dense" (a dense
# layer is exact and at worst as slow as dense).
SPARSE_MARGIN = 0.85
# Checked on index shapes the fits never saw (`scripts/bench_cost.py --validate`, H200, 2026-11-23: random
# slashes + verticals, 32K-128K, heads 9 x 64 and 16 x 128, densities 3-100%): predictions within 7% of the
# measured index + forward + backward; 23 of 25 choices optimal, the other two picked dense where sparse was
# 6% and 11% faster (near break-even, inside the margin); no case ran slower than dense.


@dataclass(frozen=True)
class CostTable:
    """Coefficients of the predicted milliseconds, per mode ("train" = forward + backward, "eval" = forward).

    dense[D][mode] = (ms0, ms per dense unit), dense unit = B * Hq * sum over documents of len^2 / 2 * D / 1e12
        (the causal query-key pairs times the head dim, in 1e12).
    sparse[(D, block_size)][mode] = (ms0, ms per row unit, ms per block unit, ms per column unit):
        row unit = B * Hq * S / 1e6 (per-row fixed work: launches, softmax state, output),
        block unit = listed (query block, key block) entries * block_size^2 * D / 1e12,
        column unit = listed (query block, vertical column) entries * block_size * D / 1e12.
    index = (ms0, ms per row unit, ms per 1e6 block entries, ms per 1e6 column entries): building the
        SparseIndex from the lines and everything the backward derives from it (transposed lists, column plan).
    A head dim or block size that was not measured takes the nearest measured one (its rate per unit).
    """

    name: str
    source: str
    dense: dict
    sparse: dict
    index: tuple


# One NVIDIA H200, torch 2.11, triton 3.6, bf16; measured 2026-11-23 by `python scripts/bench_cost.py`
# (heads 9q/3kv x 64 = SmolLM2-135M and 16q/2kv x 128 = Qwen2.5-3B; dense through `dense_attention` = SDPA
# cuDNN, 4K-128K; sparse = our Triton kernels, deterministic backward, local band + 2048 verticals, 1-28% of
# causal blocks, 8K-128K). Worst relative error of the fits: dense 2-10%, sparse kernels 2-15% (35% on a
# 2.6 ms call), index 26%. Examples: dense fwd+bwd 10.0 ms at 32K x 64 (9 heads), 454 ms at 128K x 128 (16
# heads, 533 TFLOP/s); sparse 128K x 128 at 5% of blocks 49 ms (bs 64); index 3.5-5 ms, +0.55 ms per 1e6
# column entries.
H200 = CostTable(
    name="cuda (H200)",
    source="scripts/bench_cost.py on one H200, 2026-11-23",
    dense={64: {"train": (0.4789, 31.1267), "eval": (0.3822, 8.05)},
           128: {"train": (0.7172, 23.9996), "eval": (0.1605, 6.5063)}},
    sparse={(64, 64): {"train": (1.1516, 1.2205, 54.4929, 93.0403), "eval": (0.1755, 0.3057, 18.8462, 29.9299)},
            (64, 128): {"train": (1.4788, 1.3479, 57.8477, 105.9521), "eval": (0.2436, 0.1483, 18.7776, 29.4297)},
            (128, 64): {"train": (0.7455, 2.5521, 48.6712, 74.9097), "eval": (0.2052, 0.2622, 11.7576, 17.8773)},
            (128, 128): {"train": (1.6772, 2.2439, 40.7202, 79.0168), "eval": (0.2411, 0.2298, 11.986, 17.7466)}},
    index=(3.9474, 0.0, 0.0597, 0.5463),
)

# The CPU path (fp32; dense = PyTorch SDPA, sparse = mtrain.ops.partial's PyTorch path over the listed blocks,
# index = from_lines), measured 2026-11-23 on this workplace's CPU machine (2 cores shared with other jobs,
# torch 2.13) by `python scripts/bench_cost.py --cpu` twice, heads 4/2 x 32, 1K-8K, fitted together
# (`--fit` on both files). The machine was loaded: single timings varied 2-3x, so the fit is an order of
# magnitude (worst relative error ~65% dense, ~95% sparse); its robust content is the ratio: the PyTorch
# sparse path costs ~2.1x dense per computed pair (a SmolLM2-shaped 9/3 x 64 run gave ~3x), so on a CPU
# sparse pays only below ~40% density and never for short sequences. Other head dims use these rates.
CPU = CostTable(
    name="cpu",
    source="scripts/bench_cost.py --cpu on the 2-core CPU machine (loaded), 2026-11-23",
    dense={32: {"train": (0.0, 267886.0248), "eval": (0.0, 71155.7291)}},
    sparse={(32, 64): {"train": (0.6148, 0.0, 573988.8701, 915806.3729), "eval": (0.0, 0.0, 228095.5965, 299461.9548)}},
    index=(0.368, 0.2239, 13.2548, 42.9433),
)


def table_for(device) -> CostTable:
    """The cost table of a device (a torch.device or its type string): CUDA -> H200, anything else -> CPU.
    Other GPUs use the H200 figures: the choice depends on the ratio of sparse to dense, which moves less
    between GPUs than either time."""
    kind = device if isinstance(device, str) else device.type
    return H200 if kind == "cuda" else CPU


def _nearest(keys, want):
    """The measured key closest to `want` on a log scale (keys: ints or tuples of ints)."""
    def dist(key):
        key, w = (key, want) if isinstance(key, tuple) else ((key,), (want,))
        return sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(key, w))

    return min(keys, key=dist)


def _mode(backward: bool) -> str:
    return "train" if backward else "eval"


def dense_ms(seq_len: int, heads: int, head_dim: int, *, batch: int = 1, backward: bool = True,
             table: CostTable = H200, doc_lengths=None) -> float:
    """Predicted ms of dense causal attention over `batch` rows of `seq_len` tokens, `heads` query heads.

    doc_lengths: packed rows run one dense call per document: an iterable of all documents' lengths (over the
    whole batch); then `batch` and `seq_len` only count the calls' fixed cost.
    """
    ms0, per_unit = table.dense[_nearest(table.dense, head_dim)][_mode(backward)]
    if doc_lengths is None:
        pairs, calls = batch * seq_len * seq_len / 2, 1
    else:
        lengths = list(doc_lengths)
        pairs, calls = sum(n * n / 2 for n in lengths), max(1, len(lengths))
    return calls * ms0 + per_unit * heads * pairs * head_dim / 1e12


def sparse_ms(blocks: float, columns: float, seq_len: int, heads: int, head_dim: int, block_size: int, *,
              batch: int = 1, backward: bool = True, table: CostTable = H200, world: int = 1,
              with_index: bool = True) -> float:
    """Predicted ms of vertical-slash sparse attention given the index's work: `blocks` listed (query block,
    key block) entries and `columns` listed (query block, vertical column) entries, summed over batch and
    heads. world > 1: one rank of a context-parallel group, whose kernels do 1/world of the work while every
    rank builds the whole index. with_index: add the index-building time."""
    key = _nearest(table.sparse, (head_dim, block_size))
    ms0, per_row, per_block, per_col = table.sparse[key][_mode(backward)]
    rows = batch * heads * seq_len / 1e6
    kernels = (ms0 + per_row * rows + per_block * blocks * block_size ** 2 * head_dim / 1e12
               + per_col * columns * block_size * head_dim / 1e12)
    total = kernels / world
    if with_index:
        i0, i_row, i_block, i_col = table.index
        total += i0 + i_row * rows + i_block * blocks / 1e6 + i_col * columns / 1e6
    return total


def index_work(index) -> tuple[int, int]:
    """(listed block entries, listed column entries) of a `SparseIndex`, summed over batch and heads (one
    device-to-host read of two integers)."""
    import torch

    counts = torch.stack([index.block_counts.long().sum(), index.col_counts.long().sum()]).tolist()
    return int(counts[0]), int(counts[1])


@dataclass(frozen=True)
class Prediction:
    """The predicted ms of both paths of one attention call and the path `choose` picked."""

    dense_ms: float
    sparse_ms: float
    path: str


def choose(dense: float, sparse: float, margin: float = SPARSE_MARGIN) -> str:
    """"sparse" when the sparse prediction is at most `margin` x the dense one, else "dense"."""
    if not (math.isfinite(dense) and math.isfinite(sparse)) or dense < 0 or sparse < 0:
        raise ValueError(f"predicted times must be finite and >= 0; got dense {dense} ms, sparse {sparse} ms")
    return "sparse" if sparse <= margin * dense else "dense"


def predict(blocks: float, columns: float, *, seq_len: int, heads: int, head_dim: int, block_size: int,
            batch: int = 1, backward: bool = True, device="cuda", world: int = 1, doc_lengths=None,
            margin: float = SPARSE_MARGIN) -> Prediction:
    """Both paths' predicted ms for one rank and the cheaper path (see `choose`).

    world: context-parallel group size (dense and sparse kernels split over the ranks; the index is whole on
    every rank; the ring's KV traffic, the same for both paths, is left out). doc_lengths: the documents'
    lengths when the dense path runs one call per document (single device with packed documents).
    """
    table = table_for(device)
    dense = dense_ms(seq_len, heads, head_dim, batch=batch, backward=backward, table=table,
                     doc_lengths=doc_lengths) / world
    sparse = sparse_ms(blocks, columns, seq_len, heads, head_dim, block_size, batch=batch, backward=backward,
                       table=table, world=world)
    return Prediction(dense, sparse, choose(dense, sparse, margin))
