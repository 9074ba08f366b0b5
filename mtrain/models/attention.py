"""mtrain's attention kinds as HF attention implementations (transformers' AttentionInterface).

`register_attention(recipe)` registers the recipe's kind under the name `mtrain-<kind>` together with a
mask function that returns None (no S x S mask is ever built); the trainer loads the model with
`attn_implementation=` that name. Per-batch facts the attention needs (the CP group, layout, and the
document spans of the packed sample) live in one `AttentionContext` that the trainer sets per micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import torch

from mtrain.errors import MtrainError
from mtrain.models.baselines import BASELINE_KINDS

log = logging.getLogger(__name__)

SPARSE_POLICIES = ("auto", "always", "never")
"""How a sparse kind picks its path per layer: the cost model (`mtrain.ops.cost`), sparse everywhere, or dense."""

# attention.kind -> (sparse?, layout name, or None for the recipe's parallel.layout)
KINDS = {
    "dense": (False, None),
    "mtraining": (True, "block-stripe"),
    "zigzag-dense": (False, "zigzag"),
    "zigzag-sparse": (True, "zigzag"),
    # baselines (mtrain.models.baselines; own settings, not the vertical-slash estimate)
    "moba": (False, None),
    "xattention": (False, None),
    "ulysses": (False, None),
}


@dataclass
class AttentionContext:
    """What the registered attention functions read; set by the trainer before each forward."""

    kind: str = "dense"
    sparse: bool = False
    settings: object = None
    """mtrain.parallel.SparseSettings for sparse kinds."""
    sparse_policy: str = "always"
    """One of SPARSE_POLICIES: per layer, "auto" runs dense where the cost model predicts sparse would not pay."""
    engine: str = "auto"
    """One of ENGINES: which kernels run a one-device sparse layer (`vertical_slash_attention`'s impl)."""
    group: object = None
    """The CP process group (None when cp_size == 1)."""
    layout: object = None
    """mtrain.parallel.Layout of the CP group."""
    inner_group: object = None
    outer_group: object = None
    """Hierarchical ring groups (inner = one node, outer = across nodes), or None for a flat ring."""
    local_world_size: object = None
    """Ranks per node of a hierarchical ring (None: flat)."""
    schedule: str = "ring"
    """parallel.schedule: how sparse layers of a CP group share K/V ("ring" or "gather", `ring_attention`'s)."""
    doc_ids: object = None
    """LongTensor [B, S] of document ids over the WHOLE (global) sequence, or None for one document per row."""
    densities: list = field(default_factory=list)
    """Fraction of causal pairs in the estimated pattern, per sparse-kind call (whichever path ran), for
    logging; reset by the trainer each step. `layers` says which path each call took."""
    layers: list = field(default_factory=list)
    """One `LayerRecord` per sparse-kind call (reset by the trainer each step)."""
    sample_recall: bool = False
    """Set by the trainer on the steps that log a sampled true recall: sparse layers then measure it."""
    recall_rows: int = 64
    """Query rows (spread over the sequence) the sampled true recall averages over."""

    imbalances: list = field(default_factory=list)
    """(worker, step, per-rank work / mean work) imbalance of the first layer's sparse index under the layout, per
    measured forward (logging)."""
    step: int = 0
    """The optimizer step the trainer is on (for dense_hold)."""
    dense_hold: int = 0
    """Under sparse_policy auto, in training: a layer that the choice sent dense runs dense without estimating
    for this many further steps (0 = estimate every call). Set from attention.dense_hold_steps."""
    dense_until: dict = field(default_factory=dict)
    """layer index -> the first step at which that layer estimates again (see dense_hold)."""
    hold_streak: dict = field(default_factory=dict)
    """layer index -> how many estimates in a row did not pay for themselves (each doubles the next hold, up to
    HOLD_BACKOFF_MAX x dense_hold)."""
    recomputing: bool = False
    """True while non-reentrant gradient checkpointing recomputes a layer's forward for its backward (set through
    `checkpoint_contexts`): the sparse kinds then replay what that layer's first forward chose (`memo`) instead of
    estimating again, so the recomputation runs the same path on the same index and logs nothing twice."""
    memo: dict = field(default_factory=dict)
    """layer index -> (path, lines) of the layer's last forward in training: "sparse" or "dense", and the lines
    its index was built from (`index._cache["lines"]`; small next to the lists, which are rebuilt from them)."""
    choice_stats: dict = field(default_factory=dict)
    """(layer index, q shape) -> (host tensor, event or None): the work counts and mean estimated recall of that
    layer's last estimate, copied to the host without waiting (see LAGGED_CHOICE)."""
    sample_imbalance: bool = True
    """Whether layer 0 measures the imbalance in this forward (the trainer sets it on the steps it logs): each CP rank
    counts its own rows' work on the CPU and one small all-gather combines them."""


CONTEXT = AttentionContext()

# Sparse block engines a recipe may name (attention.engine): `vertical_slash_attention`'s impl on one device.
# "auto": the engine measured fastest for the device and block size (see vertical_slash_attention).
ENGINES = ("auto", "triton", "flex", "fa4")


@dataclass
class LayerRecord:
    """What one sparse-kind attention call decided and measured. Tensors stay on the device (no host sync in
    the forward); `as_floats` reads them when the step is logged."""

    layer: object
    """module.layer_idx, or None when the module has none."""
    path: str
    """"sparse" or "dense": what ran."""
    density: object
    """Fraction of causal pairs in the estimated pattern, a 0-dim tensor on the device (None: not estimated, see
    `_skip_estimate`)."""
    dense_ms: float = float("nan")
    sparse_ms: float = float("nan")
    """The cost model's predictions (NaN when the policy is not "auto"; without an estimate, sparse_ms is the
    floor: estimate + fixed costs)."""
    est_recall: object = None
    """Tensor [B, Hq]: the estimator's own recall figure (index._cache["est_recall"]), when it provides one."""
    true_recall: object = None
    """Tensor [B, Hq]: exact attention mass kept, averaged over sampled rows (sample_recall steps, sparse only)."""

    held: bool = False
    """True when the layer ran dense without estimating because an earlier step's choice holds (dense_hold)."""

    def as_floats(self) -> dict:
        density = None if self.density is None else float(self.density)
        out = {"layer": self.layer, "path": self.path, "density": density, "held": self.held, "dense_ms": self.dense_ms,
               "sparse_ms": self.sparse_ms}
        for name in ("est_recall", "true_recall"):
            value = getattr(self, name)
            out[name] = None if value is None else float(value.float().mean())
        return out


# Under "auto", a layer whose estimate (mean over heads) falls short of the recall target by more than this runs
# dense, whatever the cost model says: its caps bind, so the pattern it may list cannot hold the mass. On
# SmolLM2-135M at 128K (H200, 2026-11-24) the layer means of the estimate were within 0.02 of the true recall;
# at target 0.99 this rule sends 2 of 30 layers dense (estimates 0.84 and 0.94). The per-head minimum at slack
# 0.02, tried first, sent 20 layers dense (true layer recalls 0.93-0.99) and the model ran at 1.01x dense;
# replayed on that run's per-layer times, this rule gives 1.83x, mean recall 0.98, worst layer 0.954.
RECALL_SLACK = 0.04


# Under "auto" on one device, a layer's choice reads the work counts and estimated recall of that layer's previous
# estimate (same shapes; one step old in training), copied to the host without waiting, instead of its own: reading
# its own makes the host wait for the GPU to finish the estimate before it can queue the attention kernels, and at
# 32K on SmolLM2 (H200, fa4 engine) the host's work after that wait (the kernels' launches) cost ~2.5 ms per layer
# against 2.6 ms of estimate and ~4 ms of kernels. A layer's first estimate (per shape) is read directly. The
# pattern, and so the choice, moves slowly in training (the premise of dense_hold as well). False: read each
# estimate itself.
LAGGED_CHOICE = True


def _choice_stats(index, q, target, layer_idx) -> list:
    """[listed block entries, listed column entries(, mean est_recall)] that `_choose_path` decides from: this
    estimate's, or with LAGGED_CHOICE and a layer index the previous estimate's of this layer and shape (this one's
    copy starts now, without waiting, for the next call)."""
    est = index._cache.get("est_recall")
    wanted = 3 if target is not None and est is not None else 2
    read = index._cache.get("host_read")  # a CP rank's RowIndex read these with its lists' widths: no second read
    if read is not None and len(read) >= wanted:
        return read[:wanted]
    parts = [index.work_tensor()]  # the whole index's work (a CP rank's RowIndex knows it from the lines)
    if target is not None and est is not None:
        parts.append(est.double().mean().view(1))
    now = torch.cat(parts)
    if not LAGGED_CHOICE or layer_idx is None:
        return now.tolist()  # one device-to-host read
    key = (layer_idx, tuple(q.shape), len(parts))
    before = CONTEXT.choice_stats.get(key)
    if now.is_cuda:
        host = torch.empty(now.shape, dtype=now.dtype, pin_memory=True)
        host.copy_(now, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host, event = now.clone(), None
    CONTEXT.choice_stats[key] = (host, event)
    host, event = before if before is not None else (host, event)
    if event is not None:
        event.synchronize()  # the previous estimate's copy finished long ago: no wait in practice
    return host.tolist()


def _choose_path(index, q, *, policy: str, training: bool, world: int = 1, doc_ids=None, target=None, rows=0,
                 engine: str = "auto", graphed: bool = False, layer_idx=None):
    """("sparse" | "dense", Prediction or None) for one call with the estimated `index` under `policy`.

    Decided from the index's integer work counts and its est_recall (identical on every rank of a CP group,
    whose index is the same global one), so every rank takes the same path. Under "auto" the layer runs dense
    when the cost model predicts sparse does not pay, or when `target` (the recall asked for) is given and the
    estimate's mean over heads falls short of it by more than RECALL_SLACK. The index build is already paid; what the
    dense path saves is everything the kernels derive from it (built lazily on the first kernel call) and the
    kernels. rows: the query rows the estimate scored (the Prediction then carries its predicted cost). engine: the
    block engine that would run the sparse path (its measured rates, where the cost table has them). graphed: the
    estimate ran from a CUDA graph that also built the engine's plans (`cost.predict`). layer_idx: given on one
    device, the counts come from this layer's previous estimate (LAGGED_CHOICE).
    """
    if policy == "always":
        return "sparse", None
    if policy == "never":
        return "dense", None
    from mtrain.ops import cost

    read = _choice_stats(index, q, target, layer_idx)
    blocks, columns = int(read[0]), int(read[1])
    B, _, Hq, D = q.shape
    # one device with packed documents: the dense path runs one call per document
    doc_lengths = None if doc_ids is None else _document_lengths(doc_ids)
    prediction = cost.predict(blocks, columns, seq_len=index.seq_len, heads=Hq, head_dim=D,
                              block_size=index.block_size, batch=B, backward=training, device=q.device,
                              world=world, doc_lengths=doc_lengths, estimate_rows=rows, engine=engine,
                              graphed=graphed)
    if len(read) == 3 and read[2] < target - RECALL_SLACK:
        prediction = dataclasses.replace(prediction, path="dense")
    return prediction.path, prediction


def _skip_estimate(q, s, layer_idx, *, policy: str, training: bool, world: int = 1, doc_ids=None,
                   engine: str = "auto", graphed: bool = False) -> bool:
    """Under "auto": True when sparse cannot pay even with no work listed (the estimate and the fixed costs
    alone exceed dense; `mtrain.ops.cost.worth_estimating`). The call then runs dense without estimating and
    records the floor. Decided from shapes and settings every rank shares."""
    if policy != "auto":
        return False
    if training and layer_idx is not None and CONTEXT.step < CONTEXT.dense_until.get(layer_idx, -1):
        CONTEXT.layers.append(LayerRecord(layer_idx, "dense", None, held=True))  # held dense: see dense_hold
        return True
    from mtrain.ops import cost

    B, S_local, Hq, D = q.shape
    S = S_local * world
    doc_lengths = None if doc_ids is None or world > 1 else _document_lengths(doc_ids)
    floor = cost.worth_estimating(seq_len=S, heads=Hq, head_dim=D, block_size=s.block_size,
                                  rows=_scored_rows(s, S), batch=B, backward=training,
                                  device=q.device, world=world, doc_lengths=doc_lengths, engine=engine,
                                  graphed=graphed)
    if floor.path == "sparse":
        return False
    CONTEXT.layers.append(LayerRecord(layer_idx, "dense", None, floor.dense_ms, floor.sparse_ms))
    return True


def _scored_rows(s, seq_len: int) -> int:
    """Query rows the estimate scores under SparseSettings `s` (the last rows and the sampled blocks)."""
    from mtrain.ops.estimate import scored_row_count

    return scored_row_count(seq_len, s.last_q, s.sample_blocks, s.block_size, s.sample_rows)


# The longest hold, as a multiple of dense_hold: a layer whose estimate keeps not paying is looked at again after
# dense_hold, 2x, 4x, then every 8x dense_hold steps (16, 32, 64, 128 steps at the default), so the estimates it
# pays for nothing fall towards none while a layer whose pattern becomes sparse in training is still found.
HOLD_BACKOFF_MAX = 8


def _hold(layer_idx, prediction, policy: str, training: bool) -> None:
    """After auto decided a training call, skip this layer's estimate (running dense) when estimating did not pay
    for itself: the layer went dense, or it went sparse but the estimate plus the sparse path is predicted no
    cheaper than dense (`Prediction.estimate_paid`). The estimate is paid before the choice, so such a layer
    would pay it every step for nothing or for a loss (a layer's attention pattern, and so its density, moves
    slowly during training). The hold is CONTEXT.dense_hold steps, doubled for each further estimate in a row
    that did not pay (up to HOLD_BACKOFF_MAX x); an estimate that pays resets it."""
    if policy != "auto" or not training or CONTEXT.dense_hold <= 0 or layer_idx is None or prediction is None:
        return
    if prediction.estimate_paid:
        CONTEXT.hold_streak.pop(layer_idx, None)
        return
    streak = CONTEXT.hold_streak.get(layer_idx, 0)
    CONTEXT.hold_streak[layer_idx] = streak + 1
    CONTEXT.dense_until[layer_idx] = CONTEXT.step + 1 + CONTEXT.dense_hold * min(2 ** streak, HOLD_BACKOFF_MAX)


def policy_state() -> dict:
    """What sparse_policy "auto" carries from one training step to the next, as plain JSON data: each layer's dense
    hold and its back-off streak, and the lagged choice's last statistics (LAGGED_CHOICE). Saved with every
    checkpoint and given back to `load_policy_state`, so that a resumed run takes the paths the uninterrupted one
    would have taken. (Per-step fields, `memo` and the logging lists, start afresh each step.)"""
    stats = []
    for (layer, shape, parts), (host, event) in sorted(CONTEXT.choice_stats.items(), key=repr):
        if event is not None:
            event.synchronize()
        stats.append([layer, list(shape), parts, host.tolist()])
    return {"dense_until": sorted(CONTEXT.dense_until.items()), "hold_streak": sorted(CONTEXT.hold_streak.items()),
            "choice_stats": stats}


def load_policy_state(state: dict) -> None:
    """Restore what `policy_state` returned (after `register_kind`, which clears the holds)."""
    CONTEXT.dense_until = {layer: step for layer, step in state["dense_until"]}
    CONTEXT.hold_streak = {layer: streak for layer, streak in state["hold_streak"]}
    CONTEXT.choice_stats = {(layer, tuple(shape), parts): (torch.tensor(values, dtype=torch.float64), None)
                            for layer, shape, parts, values in state["choice_stats"]}


def record_layer(layer_idx, path, index, prediction, q=None, k=None, scaling=None, doc_ids=None,
                 true_recall=None) -> None:
    """Append this call's LayerRecord; on sample_recall steps measure the true recall of a sparse call on
    CONTEXT.recall_rows rows spread evenly over the sequence (ending at the last row). q/k: the whole
    sequence (None under CP, where no rank holds it: the ring measures it across the group and passes
    `true_recall` instead)."""
    record = LayerRecord(layer_idx, path, index.density_tensor(), est_recall=index._cache.get("est_recall"),
                         true_recall=true_recall)
    if prediction is not None:
        record.dense_ms, record.sparse_ms = prediction.dense_ms, prediction.sparse_ms
    if CONTEXT.sample_recall and path == "sparse" and q is not None:
        from mtrain.ops.recall import sampled_rows, true_recall

        rows = sampled_rows(q.shape[1], CONTEXT.recall_rows, q.device)
        with torch.no_grad():
            record.true_recall = true_recall(q.detach(), k.detach(), index, softmax_scale=scaling, doc_ids=doc_ids,
                                             rows=rows)
    CONTEXT.densities.append(record.density)
    CONTEXT.layers.append(record)


@contextlib.contextmanager
def _recomputing():
    CONTEXT.recomputing = True
    try:
        yield
    finally:
        CONTEXT.recomputing = False


def checkpoint_contexts():
    """`context_fn` of torch.utils.checkpoint (non-reentrant) for models with mtrain attention: nothing around the
    first forward; around the recomputation for the backward, `CONTEXT.recomputing`. A recomputed layer then
    rebuilds the index its first forward chose from the remembered lines (cheap) rather than estimating again:
    one estimate per layer and step instead of two, and the same path in both passes whatever the first one
    changed (a dense hold it set would otherwise send the recomputation dense, which checkpointing refuses)."""
    return contextlib.nullcontext(), _recomputing()


def _replay(layer_idx):
    """(path, lines) that this layer's first forward chose, while gradient checkpointing recomputes it; else None."""
    if CONTEXT.recomputing and layer_idx is not None:
        return CONTEXT.memo.get(layer_idx)
    return None


def _remember(layer_idx, path: str, index, training: bool) -> None:
    """Keep this training forward's choice for the layer's recomputation (see `checkpoint_contexts`)."""
    if not training or layer_idx is None or not torch.is_grad_enabled():
        return
    lines = None if index is None else index._cache.get("lines")
    if path == "sparse" and lines is None:
        CONTEXT.memo.pop(layer_idx, None)  # nothing to rebuild from: the recomputation estimates again
    else:
        CONTEXT.memo[layer_idx] = (path, lines)


def no_mask(*args, **kwargs):
    """Mask function for mtrain kinds: attention masking is done inside the kernels."""
    return None


_ENGINES_SAID: set = set()


def say_engine(engine: str, q, block_size: int) -> str:
    """The engine a sparse layer runs for attention.engine `engine` (`resolve_impl`), logged once per choice."""
    from mtrain.ops.attention import resolve_impl

    device = q.device
    chosen = resolve_impl(engine, device, block_size, q.dtype)
    key = (engine, chosen, block_size, device.type)
    if key not in _ENGINES_SAID:
        _ENGINES_SAID.add(key)
        log.info("sparse attention engine: %s (attention.engine=%s, block %d, %s)", chosen, engine, block_size,
                 device.type)
    return chosen


def _deterministic_backward(engine: str) -> bool:
    """Whether a sparse layer's backward must be bitwise repeatable. Our Triton kernels always run their
    deterministic backward (as fast as the atomic one at head dim 64, faster at 128: BENCHMARKS.md); FlashAttention-4
    has none on Hopper, so the fa4 engine runs FA4's own atomic backward (7.4 + 30.2 ms against 37.9 with ours at 128K,
    16 q / 2 KV x 128, 5% of pairs) unless the run asked for deterministic algorithms (train.deterministic)."""
    return engine != "fa4" or torch.are_deterministic_algorithms_enabled()


def prepare_spec(q, k, engine: str, doc_ids):
    """`estimate_graphed`'s prepare= for a layer: (engine, KV heads, head dim) where the engine's plans can be built
    with the index (our Triton kernels or fa4, no documents: with documents the engines derive them per call)."""
    return (engine, k.shape[2], q.shape[-1]) if engine in ("triton", "fa4") and doc_ids is None else None


def _graphed(q, prepare) -> bool:
    """Whether this layer's estimate runs from a CUDA graph that also builds the engine's plans (prepare: the layer's
    `prepare_spec`; what the cost model then charges the estimate: CostTable.graphed)."""
    from mtrain.ops import graphed

    return graphed.GRAPH_ESTIMATE and q.is_cuda and prepare is not None


def _local_attention(q, k, v, scaling, s=None, doc_ids=None, *, policy="always", training=True, layer_idx=None,
                     engine="auto"):
    """One rank holds the whole sequence: dense causal, or online vertical-slash sparse attention with
    SparseSettings `s` on block engine `engine` (ENGINES), run sparse or dense per `policy` (see `_choose_path`)."""
    from mtrain.ops import dense_attention, vertical_slash_attention
    from mtrain.ops.graphed import estimate_graphed
    from mtrain.ops.index import SparseIndex

    if s is not None:  # the concrete engine (auto resolved): what runs, what the cost model prices, what is logged
        engine = say_engine(engine, q, s.block_size)
    prepare = prepare_spec(q, k, engine, doc_ids)
    graphed = _graphed(q, prepare)

    def sparse(index):
        return vertical_slash_attention(q, k, v, index, softmax_scale=scaling, doc_ids=doc_ids, impl=engine,
                                        deterministic=_deterministic_backward(engine))

    replay = _replay(layer_idx) if s is not None else None
    if replay is not None:  # gradient checkpointing recomputes this layer: its first forward's path and index
        path, lines = replay
        if path == "sparse":
            index = SparseIndex.from_lines(*lines, q.shape[1], s.block_size)
            return sparse(index)
    elif s is not None and policy != "never" and not _skip_estimate(q, s, layer_idx, policy=policy,
                                                                      training=training, doc_ids=doc_ids,
                                                                      engine=engine,
                                                                      graphed=graphed):
        # every SparseSettings field is an estimate_vertical_slash keyword of the same name
        fields = {**dataclasses.asdict(s), "last_q": min(s.last_q, q.shape[1])}
        # on CUDA replayed from a graph once the shapes have been seen twice (its ~280 launches are the cost at 32K),
        # with what the engine derives from the index (another ~100 launches) built in the same graph
        index = estimate_graphed(q.detach(), k.detach(), **fields, softmax_scale=scaling, doc_ids=doc_ids,
                                 prepare=prepare)
        path, prediction = _choose_path(index, q, policy=policy, training=training, doc_ids=doc_ids,
                                        target=s.recall, rows=_scored_rows(s, q.shape[1]), engine=engine,
                                        graphed=graphed, layer_idx=layer_idx)
        _hold(layer_idx, prediction, policy, training)
        record_layer(layer_idx, path, index, prediction, q, k, scaling, doc_ids)
        _remember(layer_idx, path, index, training)
        if path == "sparse":
            return sparse(index)
    elif s is not None:
        _remember(layer_idx, "dense", None, training)
    if doc_ids is None:
        return dense_attention(q, k, v, causal=True, softmax_scale=scaling)
    return _dense_per_document(q, k, v, scaling, doc_ids)


def _document_lengths(doc_ids) -> list[int]:
    """Lengths of the runs of equal document ids of every row of doc_ids [B, S] (one host read)."""
    change = torch.ones_like(doc_ids, dtype=torch.bool)
    change[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = torch.nonzero(change.flatten()).flatten().tolist()
    return [b - a for a, b in zip(starts, starts[1:] + [doc_ids.numel()])]


def _dense_per_document(q, k, v, scaling, doc_ids):
    """Dense attention on packed rows, one causal call per document (the fastest dense kernel, no mask)."""
    from mtrain.ops import dense_attention

    rows = []
    for b in range(q.shape[0]):
        _, lengths = torch.unique_consecutive(doc_ids[b], return_counts=True)
        pieces, start = [], 0
        for n in lengths.tolist():
            sl = slice(start, start + n)
            pieces.append(dense_attention(q[b : b + 1, sl], k[b : b + 1, sl], v[b : b + 1, sl], causal=True,
                                          softmax_scale=scaling))
            start += n
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def _start_gather(q, k, v, world: int, settings):
    """Under parallel.schedule gather, the group's K/V all-gather started before a sparse layer's estimate (a
    layer the choice then sends dense drops it), else None."""
    if CONTEXT.schedule != "gather" or world == 1:
        return None
    from mtrain.parallel.ring_gather import KVGather, spare_bound

    return KVGather(k, v, CONTEXT.group, spare=spare_bound(settings, q.shape[0] * q.shape[2], q.shape[1] * world))


def _ring(q, k, v, scaling, settings=None, layer_idx=None, *, policy="always", training=True, engine="auto"):
    """This rank's shard of a context-parallel group: dense ring, or sparse with SparseSettings `settings`, run
    sparse or dense per `policy` (the same path on every rank: see `_choose_path`); the sparse steps' block kernels
    per `engine` (`ring_attention`'s: flex has no ring steps and runs ours)."""
    import torch.distributed as dist

    from mtrain.parallel import ring_attention
    from mtrain.parallel.estimate import estimate_rank_index
    from mtrain.parallel.plan import rank_blocks, shard_key_blocks

    from mtrain.ops.index import rows_from_lines

    index = None
    world = dist.get_world_size(CONTEXT.group)
    replay = _replay(layer_idx) if settings is not None else None
    gather = None
    if replay is not None:  # gradient checkpointing recomputes this layer: its first forward's path and rows
        path, lines = replay
        if path == "sparse":
            gather = _start_gather(q, k, v, world, settings)
            vertical, slash, rows = lines
            index = rows_from_lines(vertical, slash, q.shape[1] * world, settings.block_size, rows, check=False,
                                    bound_widths=True)
    elif settings is not None and policy != "never" and not _skip_estimate(q, settings, layer_idx, policy=policy,
                                                                           training=training, world=world):
        # Estimated across the group (no rank does it for the others; the lines are identical on every rank);
        # each rank builds only its own rows of the index, whose whole work and density come from the lines.
        gather = _start_gather(q, k, v, world, settings)  # the gathered schedule's K/V travel while the estimate runs
        rank = dist.get_rank(CONTEXT.group)
        seq_len = q.shape[1] * world
        positions = CONTEXT.layout.indices(seq_len, rank).to(q.device)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        rows = rank_blocks(CONTEXT.layout, seq_len, rank, settings.block_size, q.device)
        index = estimate_rank_index(q.detach(), k.detach(), positions, positions, seq_len, settings, scale,
                                    CONTEXT.group, doc_ids=CONTEXT.doc_ids, rows=rows,
                                    key_blocks=shard_key_blocks(CONTEXT.layout, seq_len, rank, settings.block_size,
                                                                q.device))
        path, prediction = _choose_path(index, q, policy=policy, training=training, world=world,
                                        target=settings.recall, rows=_scored_rows(settings, seq_len))
        _hold(layer_idx, prediction, policy, training)  # the prediction, hence the hold, is the same on every rank
        recall = None
        if CONTEXT.sample_recall and path == "sparse":  # the same decision on every rank: a collective
            from mtrain.ops.recall import gathered_true_recall

            with torch.no_grad():
                recall = gathered_true_recall(q.detach(), k.detach(), positions, index._cache["lines"], seq_len,
                                              settings.block_size, CONTEXT.group, softmax_scale=scale,
                                              doc_ids=CONTEXT.doc_ids, n_rows=CONTEXT.recall_rows)
        record_layer(layer_idx, path, index, prediction, true_recall=recall)
        _remember(layer_idx, path, index, training)
        if layer_idx == 0 and CONTEXT.sample_imbalance:  # one layer of the logged steps watches the balance
            from mtrain.parallel.imbalance import gathered_imbalance

            measured = gathered_imbalance(index, CONTEXT.layout, rank, CONTEXT.group,
                                          local_world_size=CONTEXT.local_world_size)
            CONTEXT.imbalances.append((measured["worker"], measured["step"], measured["ranks"]))
        if path == "dense":
            index = None
    elif settings is not None:
        _remember(layer_idx, "dense", None, training)
    return ring_attention(q, k, v, group=CONTEXT.group, layout=CONTEXT.layout, index=index, softmax_scale=scaling,
                          inner_group=CONTEXT.inner_group, outer_group=CONTEXT.outer_group, doc_ids=CONTEXT.doc_ids,
                          engine=engine if engine in ("auto", "triton", "fa4") else "triton",
                          schedule=CONTEXT.schedule, kv_gather=gather)


def hf_inputs(module, query, key, value, scaling, dropout):
    """What every mtrain kind does first with HF's [B, H, S, D] inputs: refuse dropout in training, move to
    [B, S, H, D], and answer a KV-cache call (queries continuing cached keys) densely. Returns (q, k, v, out of
    the cached call or None)."""
    if dropout and module.training:
        raise MtrainError("mtrain attention kinds do not implement attention dropout; set attention_dropout=0")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if k.shape[1] == q.shape[1]:
        return q, k, v, None
    if CONTEXT.group is not None or CONTEXT.doc_ids is not None:
        raise MtrainError("a KV cache runs on one device over one document: clear the context-parallel "
                          "group and doc_ids (mtrain.models.attention.CONTEXT) before generating")
    return q, k, v, _cached_attention(q, k, v, scaling)


def _cached_attention(q, k, v, scaling):
    """Queries that continue a KV cache (generation, chunked prefill): the q_len newest positions of the
    k_len keys, causal from the bottom right. Dense: a decoding step or a later prefill chunk costs
    O(q_len x k_len) either way, and the sparse estimate needs the whole prompt at once."""
    from mtrain.ops import dense_attention, partial_attention

    past = k.shape[1] - q.shape[1]
    if q.shape[1] == 1:  # one new token sees every cached key: plain non-causal attention
        return dense_attention(q, k, v, causal=False, softmax_scale=scaling)
    q_pos = torch.arange(past, k.shape[1], device=q.device)
    k_pos = torch.arange(k.shape[1], device=q.device)
    out, _ = partial_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, softmax_scale=scaling, causal=True)
    return out


def mtrain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, settings=False,
                     policy=None, engine=None, **kwargs):
    """HF attention function: query [B, Hq, S_local, D], key/value [B, Hkv, S_local, D] after RoPE
    (with a KV cache, key/value hold the cached positions too: then see `_cached_attention`).
    settings: SparseSettings (sparse), None (dense); left out = the last registered kind's (CONTEXT).
    policy: one of SPARSE_POLICIES for sparse settings; None = CONTEXT.sparse_policy. Under "auto" the cost
    model is that of a training call (forward + backward) when the module is in training mode, else forward only.
    engine: one of ENGINES for the sparse path on one device; None = CONTEXT.engine (a CP ring runs its own
    partial-step kernels).

    Returns (out [B, S_local, Hq, D], None).
    """
    if settings is False:
        settings = CONTEXT.settings if CONTEXT.sparse else None
    policy = policy or CONTEXT.sparse_policy
    engine = engine or CONTEXT.engine
    training = bool(getattr(module, "training", True))
    layer_idx = getattr(module, "layer_idx", None)
    q, k, v, cached = hf_inputs(module, query, key, value, scaling, dropout)
    if cached is not None:
        return cached, None
    if CONTEXT.group is None:
        out = _local_attention(q, k, v, scaling, settings, CONTEXT.doc_ids, policy=policy, training=training,
                               layer_idx=layer_idx, engine=engine)
    else:
        out = _ring(q, k, v, scaling, settings, layer_idx, policy=policy, training=training, engine=engine)
    return out, None


def register_attention(recipe) -> str:
    """Register the recipe's attention kind with transformers; return the `attn_implementation` name."""
    from mtrain.parallel import SparseSettings

    # Every recipe key under `attention:` that is also a SparseSettings field reaches the estimator.
    shared = {f.name for f in dataclasses.fields(SparseSettings)}
    a = recipe.attention
    if a.kind in BASELINE_KINDS:  # they take the recipe's baseline keys and ignore the rest
        shared = {f.name for f in dataclasses.fields(a)} - {"kind", "sparse_policy", "dense_hold_steps", "engine"}
    settings = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name in shared}
    return register_kind(a.kind, sparse_policy=a.sparse_policy, dense_hold=a.dense_hold_steps, engine=a.engine,
                         **settings)


def register_kind(kind: str, *, sparse_policy: str = "always", dense_hold: int = 0, engine: str = "auto",
                  **sparse_settings) -> str:
    """Register attention kind `kind` (see KINDS) as `mtrain-<kind>`; sparse kinds take
    `mtrain.parallel.SparseSettings` fields as keywords, and `sparse_policy` (SPARSE_POLICIES; the recipe's
    attention.sparse_policy, default "auto", reaches it through `register_attention`; called directly a
    sparse kind runs sparse on every layer unless told otherwise) and `engine` (ENGINES: the block kernels of the
    sparse path on one device). Returns the `attn_implementation` name.
    Each name carries its own settings; registering a name again replaces them for every model using it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from mtrain.parallel import SparseSettings

    if kind not in KINDS:
        raise MtrainError(f"attention kind '{kind}' has no mtrain implementation; use one of {', '.join(KINDS)}")
    if kind in BASELINE_KINDS:
        from mtrain.models.baselines import register_baseline

        return register_baseline(kind, **sparse_settings)
    if sparse_policy not in SPARSE_POLICIES:
        raise MtrainError(f"sparse_policy '{sparse_policy}' is not one of {', '.join(SPARSE_POLICIES)}")
    if engine not in ENGINES:
        raise MtrainError(f"engine '{engine}' is not one of {', '.join(ENGINES)}")
    sparse, _ = KINDS[kind]
    if not isinstance(dense_hold, int) or dense_hold < 0:
        raise MtrainError(f"dense_hold must be an integer >= 0 (steps; 0 = estimate every step), got {dense_hold!r}")
    CONTEXT.kind, CONTEXT.sparse, CONTEXT.sparse_policy, CONTEXT.engine = kind, sparse, sparse_policy, engine
    CONTEXT.dense_hold, CONTEXT.dense_until, CONTEXT.hold_streak = dense_hold, {}, {}
    if sparse:
        try:
            CONTEXT.settings = SparseSettings(**sparse_settings)
        except TypeError as err:
            fields = ", ".join(SparseSettings.__dataclass_fields__)
            raise MtrainError(f"bad sparse attention setting ({err}); valid settings: {fields}") from None
    else:
        CONTEXT.settings = None
    name = f"mtrain-{kind}"
    # The function carries its own settings: models loaded under other mtrain names keep theirs.
    AttentionInterface.register(name, functools.partial(mtrain_attention, settings=CONTEXT.settings,
                                                        policy=sparse_policy, engine=engine))
    AttentionMaskInterface.register(name, no_mask)
    return name


def layout_name(recipe) -> str:
    """The sequence layout an attention kind runs on (zigzag kinds force zigzag)."""
    forced = KINDS.get(recipe.attention.kind, (False, None))[1]
    return forced or recipe.parallel.layout
