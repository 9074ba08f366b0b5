"""The per-call context every mtrain attention kind reads, the record each sparse-kind call leaves, and what every
kind does first with a call (HF's inputs, a KV-cache call, the mask function).

Per-batch facts the attention needs (the CP group, layout, and the document spans of the packed sample) live in
one `AttentionContext`, `CONTEXT`, that the trainer sets per micro-batch; the dense/sparse policy
(`mtrain.models.policy`) keeps its per-layer state there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mtrain.errors import MtrainError


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
    max_output_error: object = None
    """Under sparse_policy auto: a layer whose output error on the scored rows exceeds this runs dense
    (`mtrain.models.policy.quality_error`; in a CP group `mtrain.parallel.quality.gathered_output_error`); None = no
    quality check. Set from attention.max_output_error."""
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
    dense_schedule: str = "auto"
    """parallel.dense_schedule: how dense layers of a CP group run ("auto", "ring" or "gather", `ring_attention`'s)."""
    doc_ids: object = None
    """LongTensor [B, S] of document ids over the WHOLE (global) sequence, or None for one document per row."""
    documents: object = None
    """`mtrain.ops.varlen.Documents` of doc_ids (their boundaries, read from the host once per batch: `set_documents`),
    or None; dense attention with documents runs one varlen call from it."""
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
    checked_until: dict = field(default_factory=dict)
    """layer index -> the first step at which the quality check (max_output_error) measures that layer again: a
    layer that passed it is looked at again after dense_hold steps, as a held-dense layer is (see `check_due`)."""
    recomputing: bool = False
    """True while non-reentrant gradient checkpointing recomputes a layer's forward for its backward (set through
    `checkpoint_contexts`): the sparse kinds then replay what that layer's first forward chose (`memo`) instead of
    estimating again, so the recomputation runs the same path on the same index and logs nothing twice."""
    memo: dict = field(default_factory=dict)
    """layer index -> (path, lines) of the layer's last forward in training: "sparse" or "dense", and the lines
    its index was built from (`index._cache["lines"]`; small next to the lists, which are rebuilt from them)."""
    widen_caps: bool = True
    """Under sparse_policy auto, in training: a layer the estimate's recall or the quality check sends dense (where the
    cost model said sparse) while its caps bind gets its caps doubled for its next estimate instead of a dense hold
    (`mtrain.models.policy.widen`). Set from attention.widen_caps."""
    widen_max_list_bytes: int = 0
    """`widen` doubles a layer's caps only while the rank's index lists at the doubled caps take at most this many
    bytes (`mtrain.models.policy.list_bytes`); 0 = no limit. Set from attention.widen_max_list_mib."""
    escalate_recall: object = None
    """With max_output_error: the recall a layer whose output error exceeds it estimates at from then on
    (`mtrain.models.policy.escalate`); None = no escalation. Set from attention.escalate_recall."""
    layer_recall: dict = field(default_factory=dict)
    """layer index -> the recall that layer estimates at where `escalate` raised it (absent: the settings' recall)."""
    cap_scale: dict = field(default_factory=dict)
    """layer index -> how many times wider than the recipe's max_vertical / max_slash (and cap_fraction, at most 1)
    that layer's caps are (1 when absent; doubled by `widen` up to MAX_CAP_SCALE)."""
    choice_stats: dict = field(default_factory=dict)
    """(layer index, q shape) -> (host tensor, event or None): the work counts and mean estimated recall of that
    layer's last estimate, copied to the host without waiting (see attention.lagged_choice)."""
    sample_imbalance: bool = True
    """Whether the next layer that runs sparse measures the imbalance (the trainer sets it on the steps it logs; that
    layer clears it, so one layer a step measures, whichever layers `auto` holds dense): each CP rank counts its own
    rows' work where its lists are (`mtrain.parallel.imbalance.rank_work`) and one small all-gather combines them."""


CONTEXT = AttentionContext()


def set_documents(doc_ids, device=None) -> None:
    """Set this batch's documents: doc_ids [B, S] (the CPU copy where there is one: its boundaries are read there,
    once per batch) on `device`, or None for one document per row."""
    from mtrain.ops.varlen import Documents

    CONTEXT.documents = None if doc_ids is None else Documents.from_doc_ids(doc_ids, device)
    CONTEXT.doc_ids = None if doc_ids is None else CONTEXT.documents.doc_ids


def current_documents(doc_ids):
    """The `Documents` of doc_ids: the batch's (`set_documents`) when they are of these ids, else read from them here
    (a host read per call: callers in a training step set the batch's once); None for None."""
    if doc_ids is None:
        return None
    docs = CONTEXT.documents
    if docs is not None and docs.doc_ids is doc_ids:
        return docs
    from mtrain.ops.varlen import Documents

    return Documents.from_doc_ids(doc_ids)


def clear_records() -> None:
    """Forget the per-call logging lists (densities, imbalances, layer records). The trainer does this at every
    step; a caller that runs the model outside training (an evaluation's samples) does it after each sample, or
    the lists grow with every call."""
    CONTEXT.densities, CONTEXT.imbalances, CONTEXT.layers = [], [], []


def own(value):
    """`value` with every tensor in it (a tensor, or a tuple / list of them) that is a view into a larger buffer
    copied into memory of its own (the others are returned as they are). An index replayed from a CUDA graph holds
    its lists and cache as views into one flat buffer (`mtrain.ops.graphed`): a small tensor kept from it past the
    layer (its lines for the recomputation, its recall for the log) would keep the whole buffer alive, every list
    and plan of every layer of the step."""
    if isinstance(value, torch.Tensor):
        shares = value.untyped_storage().nbytes() > value.numel() * value.element_size()
        return value.clone() if shares else value
    if isinstance(value, (tuple, list)):
        items = [own(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a named tuple too
    return value


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
    `mtrain.models.policy.skip_estimate`)."""
    dense_ms: float = float("nan")
    sparse_ms: float = float("nan")
    """The cost model's predictions (NaN when the policy is not "auto"; without an estimate, sparse_ms is the
    floor: estimate + fixed costs)."""
    est_recall: object = None
    """Tensor [B, Hq]: the estimator's own recall figure (index._cache["est_recall"]), when it provides one."""
    true_recall: object = None
    """Tensor [B, Hq]: exact attention mass kept, averaged over sampled rows (sample_recall steps, sparse only)."""

    output_error: object = None
    """Tensor [B]: the quality check's relative output error of the scored rows (`mtrain.models.policy.quality_error`;
    only under sparse_policy auto with attention.max_output_error set)."""

    held: bool = False
    """True when the layer ran dense without estimating because an earlier step's choice holds (dense_hold)."""

    cap_scale: int = 1
    """The layer's cap multiplier this call ran with (CONTEXT.cap_scale; 1 = the recipe's caps)."""
    widened: bool = False
    """True when this call's choice doubled the layer's caps for its next estimate (`mtrain.models.policy.widen`)."""
    escalated_recall: float | None = None
    """The recall this call's layer estimates at where `escalate` raised it (CONTEXT.layer_recall), else None."""
    index_bytes: int = 0
    """Bytes of this call's index lists on this rank (`mtrain.ops.index.list_bytes`: its rows under CP), 0 where no
    index was estimated."""

    def as_floats(self) -> dict:
        density = None if self.density is None else float(self.density)
        out = {"layer": self.layer, "path": self.path, "density": density, "held": self.held, "dense_ms": self.dense_ms,
               "sparse_ms": self.sparse_ms, "cap_scale": self.cap_scale, "widened": self.widened,
               "escalated_recall": self.escalated_recall, "index_bytes": self.index_bytes}
        for name in ("est_recall", "true_recall", "output_error"):
            value = getattr(self, name)
            out[name] = None if value is None else float(value.float().mean())
        return out


def no_mask(*args, **kwargs):
    """Mask function for mtrain kinds: attention masking is done inside the kernels."""
    return None


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
                          "group and doc_ids (mtrain.models.context.CONTEXT) before generating")
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
