"""Cost model of one attention call: predicted milliseconds of dense causal attention and of vertical-slash
sparse attention (index building + kernels) from measured coefficients, and `choose` between the two.

Every coefficient was measured with `mtrain bench cost` and fitted with `mtrain bench cost --fit` (the dense engines'
with `mtrain bench documents --fit`) and is a result row of benchmarks/results.jsonl; after a kernel or index change,
rerun both, append the fitted figures as rows (`cost.h200.*`, `cost.cpu.*`) and rewrite the asset the tables are read
from (`python scripts/measured_asset.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

from mtrain import measured
from mtrain.ops.switches import Switches, or_defaults

# A layer runs sparse only when sparse is predicted at most this fraction of dense: the fits below are off by up
# to about this much on small sparse calls, and a wrong "sparse" costs more than a wrong "dense" (a dense layer is
# exact and at worst as slow as dense). How well the fits predict index shapes they never saw, and how often the
# choice was the faster path (`mtrain bench cost --validate`): BENCHMARKS.md, "Cost model of the per-layer
# sparse/dense choice". The estimate is not in that check: it is paid before the choice (see `worth_estimating`).
SPARSE_MARGIN = 0.85

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
    estimate = (ms0, ms per 1e9 of B * Hq * scored rows * S): the online estimate (`estimate_vertical_slash`:
        scoring the sampled query rows against all keys, selecting lines), paid before any choice is possible.
    graphed = (ms0, ms per 1e9 of B * Hq * scored rows * S): the estimate as model layers run it on CUDA without
        documents: replayed from a CUDA graph that also builds the index and everything the engine derives from it
        (`mtrain.ops.graphed.estimate_graphed` with prepare=); the index term is then already paid. (0, 0): not
        measured; `estimate` + `index` are used instead.
    engines[name] = a `sparse` dict of another block engine (`vertical_slash_attention`'s impl, e.g. "fa4"), for
        the block sizes it runs; an engine or block size it lacks uses `sparse` (our Triton kernels).
    dense_engines[name] = a `dense` dict of another dense kernel (`mtrain.ops.dense.dense_backend`'s name, e.g.
        "fa4"), which runs a packed row's documents in one varlen call (`mtrain.ops.varlen`): its fixed cost is paid
        once per call, not per document. A dense kernel the table lacks uses `dense` (cuDNN, one call per document).
    document_break_even[(head_dim, block_size, engine)] = the shortest packed document (tokens) on which one
        device's per-document sparse path (`mtrain.models.attention._per_document`: the document's own estimate,
        index and kernels, queued among the layer's other calls) was measured faster than leaving it in the dense
        varlen call, forward + backward, on a real model (`mtrain bench real --documents long --min-document ...`).
        Where present it replaces, in training, the break-even the floor predicts (`worth_estimating`), whose fixed
        costs, measured with the GPU idle, overprice an estimate queued behind other work; only for the shape,
        block size and engine measured.
    A head dim or block size that was not measured takes the nearest measured one (its rate per unit).
    """

    name: str
    source: str
    dense: dict
    sparse: dict
    index: tuple
    estimate: tuple = (0.0, 0.0)
    graphed: tuple = (0.0, 0.0)
    engines: dict = dataclasses.field(default_factory=dict)
    dense_engines: dict = dataclasses.field(default_factory=dict)
    document_break_even: dict = dataclasses.field(default_factory=dict)


# The coefficients are result rows of benchmarks/results.jsonl (`cost.h200.*`, `cost.cpu.*`: each with its date,
# machine, versions and command), read from mtrain/assets/measured.json (`python scripts/measured_asset.py` writes it
# from the rows). A row's id names where its figure goes: cost.h200.dense.d64.train.ms0 is dense[64]["train"][0];
# sparse.d64_bs128 is sparse[(64, 128)]; engines.fa4.d64_bs128 and dense_engines.fa4.d64 the same for an engine;
# document_break_even.d64_bs128.fa4 is document_break_even[(64, 128, "fa4")]. The coefficients' names, in order:
COEFFICIENTS = {"dense": ("ms0", "per_unit"), "sparse": ("ms0", "per_row", "per_block", "per_column"),
                "index": ("ms0", "per_row", "per_1e6_blocks", "per_1e6_columns"), "estimate": ("ms0", "per_1e9"),
                "graphed": ("ms0", "per_1e9")}
COEFFICIENTS.update(dense_engines=COEFFICIENTS["dense"], engines=COEFFICIENTS["sparse"])
_MODES = ("train", "eval")


def _key(text: str, where: str, block: bool):
    """"d64" -> 64 (block=False), "d64_bs128" -> (64, 128) (block=True)."""
    head, _, bs = text.partition("_bs")
    if not (head.startswith("d") and head[1:].isdigit() and (bs.isdigit() if block else not bs)):
        raise ValueError(f"{where}: expected {'d<head dim>_bs<block size>' if block else 'd<head dim>'}, got {text!r}")
    return (int(head[1:]), int(bs)) if block else int(head[1:])


def table_from(figures: dict, prefix: str, name: str, source: str, path=measured.ASSET) -> CostTable:
    """The CostTable whose coefficients are the measured figures under `prefix` (`mtrain.measured.load(path)`'s
    {measure: value}); MeasuredAssetError naming the file and a figure that does not fit the layout above or a set
    of coefficients that is incomplete."""
    try:
        return _table_from(figures, prefix, name, source)
    except ValueError as exc:
        raise measured.asset_error(str(exc), path) from None


def _table_from(figures: dict, prefix: str, name: str, source: str) -> CostTable:
    groups: dict[tuple, dict] = {}  # (field, engine or None, key or None, mode or None) -> {coefficient: value}
    ids: dict[tuple, str] = {}  # the same -> its measure id without the coefficient
    break_even = {}
    for rest, value in measured.under(figures, prefix).items():
        where = prefix + rest
        field, *parts = rest.split(".")
        if field == "document_break_even" and len(parts) == 2:
            if value != int(value):
                raise ValueError(f"{where}: a length in tokens, got {value!r}")
            break_even[(*_key(parts[0], where, block=True), parts[1])] = int(value)
            continue
        depth = {"index": 1, "estimate": 1, "graphed": 1, "dense": 3, "sparse": 3, "engines": 4,
                 "dense_engines": 4}.get(field)
        if depth != len(parts) or parts[-1] not in COEFFICIENTS[field] or (depth > 1 and parts[-2] not in _MODES):
            raise ValueError(f"{where}: not a cost-table coefficient")
        at = (field, None, None, None)
        if depth > 1:
            key = _key(parts[-3], where, block=field in ("sparse", "engines"))
            at = (field, parts[0] if depth == 4 else None, key, parts[-2])
        groups.setdefault(at, {})[parts[-1]] = float(value)
        ids[at] = where.rsplit(".", 1)[0]

    def coeffs(at) -> tuple:
        names, got = COEFFICIENTS[at[0]], groups.get(at, {})
        if set(got) != set(names):
            raise ValueError(f"{ids.get(at, prefix + at[0])}: needs {', '.join(names)}, has {', '.join(got) or 'none'}")
        return tuple(got[n] for n in names)

    def rates(field: str, engine=None) -> dict:
        keys = sorted({at[2] for at in groups if at[:2] == (field, engine)},
                      key=lambda k: k if isinstance(k, tuple) else (k,))
        if not keys and engine is None:
            raise ValueError(f"{prefix}{field}: no coefficients")
        return {k: {mode: coeffs((field, engine, k, mode)) for mode in _MODES} for k in keys}

    flat = {f: coeffs((f, None, None, None)) for f in ("index", "estimate", "graphed")
            if f == "index" or (f, None, None, None) in groups}
    engines = {f: {e: rates(f, e) for e in sorted({at[1] for at in groups if at[0] == f})}
               for f in ("engines", "dense_engines")}
    return CostTable(name=name, source=source, dense=rates("dense"), sparse=rates("sparse"), **flat, **engines,
                     document_break_even=break_even)


# One NVIDIA H200, bf16 (`cost.h200.*`): dense = SDPA cuDNN, one call per document, and sparse = our Triton kernels,
# fitted by `python -m mtrain.bench.cost` and its `--fit` on 2026-11-23 (index the same), the eager estimate and its
# CUDA-graph replay on 2026-11-25; engines["fa4"]: FlashAttention-4 for the listed blocks + our column kernels
# (impl="fa4", FA4's own backward as training runs it), block 128, `--engine fa4 --only sparse`, 2026-11-25;
# dense_engines["fa4"]: FA4's varlen dense over a packed row's documents, `mtrain bench documents --fit`, 2026-12-01;
# document_break_even: SmolLM2-135M (9/3 x 64), block 128, fa4, the long mix at 64K / 128K / 256K, eager and graphed
# estimates: documents of 24.9K and 26.8K tokens ran 1.3x slower sparse than dense, 40.6K and longer 0.4-0.74x of
# dense (rows doc_sweep.smollm2.*): 32K, between them (the floor put it at 41.7K). The shapes the fits cover and their
# worst relative errors: docs/benchmarks-history.md, "Provenance of the shipped cost tables".
H200 = table_from(measured.load(), "cost.h200.", name="cuda (H200)",
                  source="mtrain/bench/cost.py on one H200, 2026-11-23")

# The CPU path (`cost.cpu.*`: fp32; dense = PyTorch SDPA, sparse = mtrain.ops.partial's PyTorch path over the listed
# blocks, index = from_lines), fitted by `python -m mtrain.bench.cost --cpu` on this project's 2-core CPU machine under
# load, 2026-11-23: an order of magnitude only; its robust content is the ratio of sparse to dense per computed pair,
# so on a CPU sparse pays only at low density and never for short sequences. Other head dims use these rates; its
# estimate was measured with 64 scored rows, 1K-8K, and is scaled by the rows scored.
CPU = table_from(measured.load(), "cost.cpu.", name="cpu",
                 source="mtrain/bench/cost.py --cpu on the 2-core CPU machine (loaded), 2026-11-23")


def table_for(device, *, switches: Switches | None = None) -> CostTable:
    """The cost table of a device (a torch.device or its type string): CUDA -> H200, anything else -> CPU.
    Other GPUs use the H200 figures: the choice depends on the ratio of sparse to dense, which moves less
    between GPUs than either time. A JSON file of figures measured on this machine (`mtrain bench cost --fit ROWS
    --write-table FILE`) replaces the built-in ones it covers: the recipe's attention.cost_table
    (`switches.cost_table`; None = the defaults, no file), else the file the environment variable MTRAIN_COST_TABLE
    names."""
    kind = device if isinstance(device, str) else device.type
    path, source = or_defaults(switches).cost_table, "attention.cost_table"
    if not path:
        path, source = os.environ.get("MTRAIN_COST_TABLE"), "MTRAIN_COST_TABLE"
    if path:
        mtime = os.path.getmtime(path) if os.path.exists(path) else None
        return _with_override(kind == "cuda", path, mtime, source)
    return H200 if kind == "cuda" else CPU


_FIELDS = ("dense", "sparse", "index", "estimate", "graphed")


def write_override(path: str, figures: dict, source: str) -> None:
    """Write fitted figures (a dict of CostTable fields: dense {D: {mode: coeffs}}, sparse {(D, bs): {...}},
    index, estimate) as a JSON override file, atomically."""
    doc = {"source": source}
    for name, value in figures.items():
        if name not in _FIELDS:
            raise ValueError(f"unknown cost-table field {name!r}; expected one of {', '.join(_FIELDS)}")
        if name == "sparse":
            value = {f"{d},{bs}": modes for (d, bs), modes in value.items()}
        elif name == "dense":
            value = {str(d): modes for d, modes in value.items()}
        doc[name] = value
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def _modes(value, count: int, where: str) -> dict:
    """{"train": (count numbers), "eval": (count numbers)} of an override's entry; ValueError naming `where`."""
    if not isinstance(value, dict) or set(value) != {"train", "eval"}:
        raise ValueError(f"{where} needs the modes train and eval, got {value!r}")
    out = {}
    for mode, coeffs in value.items():
        if not isinstance(coeffs, list) or len(coeffs) != count or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in coeffs):
            raise ValueError(f"{where}.{mode} needs {count} finite numbers, got {coeffs!r}")
        out[mode] = tuple(float(c) for c in coeffs)
    return out


def _override_changes(base: CostTable, path: str) -> dict:
    """The CostTable fields the override file at `path` sets, over `base`; OSError or ValueError (naming the entry)
    where it is not one."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    changes = {}
    for name in _FIELDS:
        if name not in doc:
            continue
        value = doc[name]
        if name == "sparse":
            value = {**base.sparse, **{tuple(int(x) for x in key.split(",")): _modes(v, 4, f"sparse.{key}")
                                       for key, v in value.items()}}
        elif name == "dense":
            value = {**base.dense, **{int(key): _modes(v, 2, f"dense.{key}") for key, v in value.items()}}
        else:
            value = tuple(float(x) for x in value)
            if len(value) != len(getattr(base, name)):
                raise ValueError(f"{name} needs {len(getattr(base, name))} numbers, got {len(value)}")
        changes[name] = value
    unknown = set(doc) - set(_FIELDS) - {"source"}
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    changes["source"] = doc.get("source", path)
    return changes


def read_override(path: str) -> str | None:
    """What is wrong with the cost-table override file at `path` (one line), or None where it is one (the recipe's
    load checks attention.cost_table with it)."""
    try:
        _override_changes(CPU, path)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=8)
def _with_override(cuda: bool, path: str, mtime, source: str = "MTRAIN_COST_TABLE") -> CostTable:
    from mtrain.errors import MtrainError

    base = H200 if cuda else CPU
    try:
        changes = _override_changes(base, path)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        fix = "unset the variable" if source == "MTRAIN_COST_TABLE" else f"set {source}: null"
        raise MtrainError(f"{source}={path}: not a cost-table override ({exc}); write one with "
                          f"mtrain bench cost --fit ROWS --write-table FILE, or {fix}") from exc
    origin = changes.pop("source")
    return dataclasses.replace(base, name=f"{base.name} + {os.path.basename(path)}",
                               source=f"{base.source}; overridden by {origin}", **changes)


def _nearest(keys, want):
    """The measured key closest to `want` on a log scale (keys: ints or tuples of ints)."""
    def dist(key):
        key, w = (key, want) if isinstance(key, tuple) else ((key,), (want,))
        return sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(key, w))

    return min(keys, key=dist)


def _mode(backward: bool) -> str:
    return "train" if backward else "eval"


def dense_ms(seq_len: int, heads: int, head_dim: int, *, batch: int = 1, backward: bool = True,
             table: CostTable = H200, doc_lengths=None, engine: str = "sdpa") -> float:
    """Predicted ms of dense causal attention over `batch` rows of `seq_len` tokens, `heads` query heads.

    doc_lengths: packed rows: an iterable of all documents' lengths (over the whole batch); then `batch` and
    `seq_len` only count the calls' fixed cost. engine: the dense kernel that runs (`mtrain.ops.dense.dense_backend`):
    one in CostTable.dense_engines runs every document in one varlen call at its own rates; another runs one call per
    document at the `dense` rates.
    """
    rates = table.dense_engines.get(engine) or table.dense
    ms0, per_unit = rates[_nearest(rates, head_dim)][_mode(backward)]
    if doc_lengths is None:
        pairs, calls = batch * seq_len * seq_len / 2, 1
    else:
        lengths = list(doc_lengths)
        pairs, calls = sum(n * n / 2 for n in lengths), max(1, len(lengths))
    if engine in table.dense_engines:
        calls = 1
    return calls * ms0 + per_unit * heads * pairs * head_dim / 1e12


def sparse_ms(blocks: float, columns: float, seq_len: int, heads: int, head_dim: int, block_size: int, *,
              batch: int = 1, backward: bool = True, table: CostTable = H200, world: int = 1,
              with_index: bool = True, engine: str = "auto") -> float:
    """Predicted ms of vertical-slash sparse attention given the index's work: `blocks` listed (query block,
    key block) entries and `columns` listed (query block, vertical column) entries, summed over batch and
    heads. world > 1: one rank of a context-parallel group, whose kernels do 1/world of the work while every
    rank builds the whole index. with_index: add the index-building time. engine: the block engine's own rates
    where the table has them for this block size (CostTable.engines), else our Triton kernels'."""
    rates = table.sparse
    own = table.engines.get(engine, {})
    if any(bs == block_size for _, bs in own):
        rates = own
    key = _nearest(rates, (head_dim, block_size))
    ms0, per_row, per_block, per_col = rates[key][_mode(backward)]
    rows = batch * heads * seq_len / 1e6
    kernels = (ms0 + per_row * rows + per_block * blocks * block_size ** 2 * head_dim / 1e12
               + per_col * columns * block_size * head_dim / 1e12)
    total = kernels / world
    if with_index:
        i0, i_row, i_block, i_col = table.index
        total += i0 + i_row * rows + i_block * blocks / 1e6 + i_col * columns / 1e6
    return total


def _graphed(table: CostTable, graphed: bool) -> bool:
    """Whether the graphed-estimate figures apply: asked for, and measured for this table."""
    return graphed and any(table.graphed)


def estimate_ms(seq_len: int, heads: int, rows: int, *, batch: int = 1, table: CostTable = H200,
                world: int = 1, graphed: bool = False) -> float:
    """Predicted ms of the online estimate scoring `rows` query rows against `seq_len` keys (world > 1: each
    rank scores against its 1/world of the keys). graphed: the estimate replayed from a CUDA graph with the index
    and the engine's plans built in it (CostTable.graphed, where measured)."""
    ms0, per_unit = table.graphed if _graphed(table, graphed) else table.estimate
    return ms0 + per_unit * batch * heads * min(rows, seq_len) * seq_len / 1e9 / world


def worth_estimating(*, seq_len: int, heads: int, head_dim: int, block_size: int, rows: int, batch: int = 1,
                     backward: bool = True, device="cuda", world: int = 1, doc_lengths=None,
                     margin: float = SPARSE_MARGIN, engine: str = "auto", graphed: bool = False,
                     dense_engine: str = "sdpa", switches: Switches | None = None) -> Prediction:
    """Whether sparse attention can pay at all, before estimating: its floor (the estimate + the index's and
    kernels' fixed costs with no listed work) against dense. Prediction.path "dense" = it cannot: run dense
    and skip the estimate; sparse_ms holds the floor. graphed, dense_engine, switches: as in `predict`."""
    table = table_for(device, switches=switches)
    dense = dense_ms(seq_len, heads, head_dim, batch=batch, backward=backward, table=table,
                     doc_lengths=doc_lengths, engine=dense_engine) / world
    g = _graphed(table, graphed)
    floor = (estimate_ms(seq_len, heads, rows, batch=batch, table=table, world=world, graphed=g)
             + sparse_ms(0, 0, seq_len, heads, head_dim, block_size, batch=batch, backward=backward, table=table,
                         world=world, engine=engine, with_index=not g))
    return Prediction(dense, floor, choose(dense, floor, margin))


def document_break_even(device, *, head_dim: int, block_size: int, engine: str, backward: bool = True,
                        switches: Switches | None = None) -> int | None:
    """The measured shortest packed document on which per-document sparse attention pays in training
    (CostTable.document_break_even), or None where this head dim, block size and engine were not measured or the call
    is forward only (the floor, `worth_estimating`, decides then)."""
    if not backward:
        return None
    return table_for(device, switches=switches).document_break_even.get((head_dim, block_size, engine))


def index_work(index) -> tuple[int, int]:
    """(listed block entries, listed column entries) of a `SparseIndex`, summed over batch and heads (one
    device-to-host read of two integers; `index.work_tensor()` is the same on the device)."""
    blocks, columns = index.work_tensor().tolist()
    return int(blocks), int(columns)


@dataclass(frozen=True)
class Prediction:
    """The predicted ms of both paths of one attention call and the path `choose` picked."""

    dense_ms: float
    sparse_ms: float
    path: str
    estimate_ms: float = 0.0
    """The online estimate's predicted ms (paid before the choice; 0 when not predicted)."""

    @property
    def estimate_paid(self) -> bool:
        """Whether estimating paid for itself: sparse was chosen and the estimate plus the sparse path is still
        within the margin of dense. A layer where it did not would be better off not estimating at all."""
        return self.path == "sparse" and choose(self.dense_ms, self.estimate_ms + self.sparse_ms) == "sparse"


def choose(dense: float, sparse: float, margin: float = SPARSE_MARGIN) -> str:
    """"sparse" when the sparse prediction is at most `margin` x the dense one, else "dense"."""
    if not (math.isfinite(dense) and math.isfinite(sparse)) or dense < 0 or sparse < 0:
        raise ValueError(f"predicted times must be finite and >= 0; got dense {dense} ms, sparse {sparse} ms")
    return "sparse" if sparse <= margin * dense else "dense"


def predict(blocks: float, columns: float, *, seq_len: int, heads: int, head_dim: int, block_size: int,
            batch: int = 1, backward: bool = True, device="cuda", world: int = 1, doc_lengths=None,
            margin: float = SPARSE_MARGIN, estimate_rows: int = 0, engine: str = "auto",
            graphed: bool = False, dense_engine: str = "sdpa", switches: Switches | None = None) -> Prediction:
    """Both paths' predicted ms for one rank and the cheaper path (see `choose`).

    world: context-parallel group size (dense and sparse kernels split over the ranks; the index is whole on
    every rank; the ring's KV traffic, the same for both paths, is left out). doc_lengths: the documents'
    lengths when the dense path runs one call per document (single device with packed documents).
    estimate_rows: the query rows the estimate scored (> 0: Prediction.estimate_ms holds its predicted cost).
    engine: the block engine of the sparse path (see `sparse_ms`). graphed: the estimate ran from a CUDA graph that
    also built the index and the engine's plans (CostTable.graphed, where measured): the sparse path then no longer
    pays the index term, and the estimate's predicted cost includes it. dense_engine: the dense kernel the dense
    path runs (`dense_ms`'s engine). switches: the run's (`mtrain.ops.switches`), whose attention.cost_table the
    figures come from (`table_for`); None = the defaults.
    """
    table = table_for(device, switches=switches)
    dense = dense_ms(seq_len, heads, head_dim, batch=batch, backward=backward, table=table,
                     doc_lengths=doc_lengths, engine=dense_engine) / world
    g = _graphed(table, graphed)
    sparse = sparse_ms(blocks, columns, seq_len, heads, head_dim, block_size, batch=batch, backward=backward,
                       table=table, world=world, engine=engine, with_index=not g)
    est = (estimate_ms(seq_len, heads, estimate_rows, batch=batch, table=table, world=world, graphed=g)
           if estimate_rows else 0.0)
    return Prediction(dense, sparse, choose(dense, sparse, margin), est)
