"""The attention runtime a model patched with mtrain attention owns: everything its attention calls read and write.

One `AttentionRuntime` per model, attached to the model and to every one of its modules (`attach_runtime`); the
registered attention functions (`mtrain.models.attention.mtrain_attention`, `mtrain.models.baselines`) find it on the
module HF calls them with (`runtime_of(module)`) and read nothing else, so two models in one process keep their own
settings, policy state and records. It holds, in five typed parts:

- `settings` (`AttentionSettings`): the kind and what the recipe's `attention:` section says of it (the
  `mtrain.attention_settings` objects: `SparseSettings`, `PolicySettings`, `BaselineSettings`), and the run's `Switches`
  (`mtrain.ops.switches`), which each attention call passes down to every reader of the stack it calls (an autograd
  function whose backward reads one keeps its forward's: the backward runs outside the call);
- `topology` (`Topology`): the context-parallel group, its layout, the hierarchical ring's groups and node size, and
  the ring schedules (set by the trainer at set-up; all None/defaults on one device);
- `inputs` (`StepInputs`): what the trainer sets per step or micro-batch: the packed documents (`set_documents`), the
  optimizer step, whether the step samples recall or imbalance, and the recomputation flag of gradient checkpointing;
- `policy` (`PolicyState`): the dense/sparse policy's state per layer (holds, check cadence, cap scale, escalated
  recall, lagged choice statistics, the recomputation memo), saved with checkpoints (`state_dict` /
  `load_state_dict`: the JSON the trainer writes in its trainer_state files);
- `records` (`Records`): what each call leaves for logging (densities, imbalances, `LayerRecord`s), taken by the
  trainer at each step with `drain()`.

`mtrain.models.registry.attention_runtime(kind, sparse=, policy=, baseline=)` builds one (and registers the kind's attention function
with transformers); `mtrain.models.load_model(..., runtime=...)` attaches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch

from mtrain.attention_settings import BaselineSettings, PolicySettings, SparseSettings
from mtrain.errors import MtrainError
from mtrain.ops.switches import Switches, or_defaults

ATTR = "mtrain_runtime"
"""The attribute under which a model and each of its modules hold their runtime."""


@dataclass
class AttentionSettings:
    """What one model's attention runs with: the kind, the recipe's `attention:` settings of it as the checked objects
    of `mtrain.attention_settings` (`SparseSettings`, `PolicySettings`, `BaselineSettings`, which validate themselves
    and hold the one set of defaults, the recipe's), and the switches. A benchmark or a test that changes a policy
    field on a runtime it owns calls `set_policy`, which validates it as a recipe's would be."""

    kind: str = "dense"
    sparse: SparseSettings | None = None
    """The estimate's settings of the vertical-slash kinds; None for a dense kind."""
    baseline: BaselineSettings | None = None
    """The baseline kinds' settings; None otherwise."""
    policy: PolicySettings = field(default_factory=PolicySettings)
    """How a sparse kind chooses between its sparse and dense paths per layer (`mtrain.models.policy`): the
    sparse_policy, engine, quality check, escalation, dense hold, cap widening and per-document fields of the
    recipe's `attention:`."""
    switches: Switches | None = field(default_factory=Switches)
    """The `mtrain.ops.switches.Switches` this model's attention runs with (the trainer's: the recipe's), passed down
    by each call to the readers of the stack; immutable (replace it with `dataclasses.replace`). None: the defaults."""

    @classmethod
    def of(cls, kind: str = "dense", *, sparse: SparseSettings | None = None, policy: PolicySettings | None = None,
           baseline: BaselineSettings | None = None) -> AttentionSettings:
        """The settings of `kind` from the checked objects (`policy` None: PolicySettings(), the recipe's defaults;
        a test or benchmark that wants every layer sparse with no check names `PolicySettings.every_layer_sparse()`)."""
        p = PolicySettings() if policy is None else policy
        if sparse is not None:
            p = p.for_recall(sparse.recall)
        return cls(kind=kind, sparse=sparse, baseline=baseline, policy=p)

    def set_policy(self, **fields) -> PolicySettings:
        """Replace these PolicySettings fields (validated by PolicySettings, ConfigError naming a bad one); returns
        the policy they replace, for a caller that restores it."""
        before = self.policy
        self.policy = dataclasses.replace(before, **fields)
        return before

    @property
    def name(self) -> str:
        """The `attn_implementation` name the kind is registered under with transformers."""
        return f"mtrain-{self.kind}"


@dataclass
class Topology:
    """Where the model's sequence lives: its context-parallel group and layout (None on one device)."""

    group: object = None
    """The CP process group (None when cp_size == 1)."""
    layout: object = None
    """mtrain.parallel.Layout of the CP group."""
    inner_group: object = None
    outer_group: object = None
    """Hierarchical ring groups (inner = one node, outer = across nodes), or None for a flat ring."""
    local_world_size: int | None = None
    """Ranks per node of a hierarchical ring (None: flat)."""
    schedule: str = "ring"
    """parallel.schedule: how sparse layers of a CP group share K/V ("ring" or "gather", `ring_attention`'s)."""
    dense_schedule: str = "auto"
    """parallel.dense_schedule: how dense layers of a CP group run ("auto", "ring" or "gather", `ring_attention`'s)."""


@dataclass
class StepInputs:
    """What the trainer (or a benchmark) sets per step or micro-batch."""

    doc_ids: object = None
    """LongTensor [B, S] of document ids over the WHOLE (global) sequence, or None for one document per row."""
    documents: object = None
    """`mtrain.ops.varlen.Documents` of doc_ids (their boundaries, read from the host once per batch:
    `AttentionRuntime.set_documents`), or None; dense attention with documents runs one varlen call from it."""
    step: int = 0
    """The optimizer step the trainer is on (for dense_hold)."""
    sample_recall: bool = False
    """Set by the trainer on the steps that log a sampled true recall: sparse layers then measure it."""
    recall_rows: int = 64
    """Query rows (spread over the sequence) the sampled true recall averages over."""
    sample_imbalance: bool = True
    """Whether the next layer that runs sparse measures the imbalance (the trainer sets it on the steps it logs; that
    layer clears it, so one layer a step measures, whichever layers `auto` holds dense): each CP rank counts its own
    rows' work where its lists are (`mtrain.parallel.imbalance.rank_work`) and one small all-gather combines them."""
    recomputing: bool = False
    """True while non-reentrant gradient checkpointing recomputes a layer's forward for its backward (set through
    `AttentionRuntime.checkpoint_contexts`): the sparse kinds then replay what that layer's first forward chose
    (`PolicyState.memo`) instead of estimating again, so the recomputation runs the same path on the same index and
    logs nothing twice."""


def _items(state: dict) -> list:
    """A per-layer dict as JSON pairs: layer indices first, then the per-document keys ("03@64K": `document_key`)."""
    return sorted(state.items(), key=lambda item: (isinstance(item[0], str), item[0]))


@dataclass
class PolicyState:
    """The dense/sparse policy's state per layer (`mtrain.models.policy`), keyed by the layer index or, on packed
    documents, by the layer's documents of one length class (`mtrain.models.attention.document_key`)."""

    dense_until: dict = field(default_factory=dict)
    """key -> the first step at which that layer estimates again (see AttentionSettings.dense_hold)."""
    hold_streak: dict = field(default_factory=dict)
    """key -> how many estimates in a row did not pay for themselves (each doubles the next hold, up to
    HOLD_BACKOFF_MAX x dense_hold)."""
    checked_until: dict = field(default_factory=dict)
    """key -> the first step at which the quality check (max_output_error) measures that layer again: a layer that
    passed it is looked at again after dense_hold steps, as a held-dense layer is (see `check_due`)."""
    cap_scale: dict = field(default_factory=dict)
    """key -> how many times wider than the recipe's max_vertical / max_slash (and cap_fraction, at most 1) that
    layer's caps are (1 when absent; doubled by `widen` up to MAX_CAP_SCALE)."""
    layer_recall: dict = field(default_factory=dict)
    """key -> the recall that layer estimates at where `escalate` raised it (absent: the settings' recall)."""
    choice_stats: dict = field(default_factory=dict)
    """(key, q shape, parts) -> (host tensor, event or None): the work counts and mean estimated recall of that
    layer's last estimate, copied to the host without waiting (see policy._choice_stats)."""
    memo: dict = field(default_factory=dict)
    """key -> (path, lines) of the layer's last forward in training: "sparse" or "dense", and the lines its index
    was built from (`index._cache["lines"]`; small next to the lists, which are rebuilt from them). Not saved."""

    def state_dict(self) -> dict:
        """What sparse_policy "auto" carries from one training step to the next, as plain JSON data: each layer's
        dense hold and its back-off streak, its quality check's cadence, its cap scale, its escalated recall and the
        lagged choice's last statistics. Saved with every checkpoint (the trainer_state files' "attention") and given
        back to `load_state_dict`, so that a resumed run takes the paths the uninterrupted one would have taken.
        (`memo` and the records start afresh each step.)"""
        stats = []
        for (layer, shape, parts), (host, event) in sorted(self.choice_stats.items(), key=repr):
            if event is not None:
                event.synchronize()
            stats.append([layer, list(shape), parts, host.tolist()])
        return {"dense_until": _items(self.dense_until), "hold_streak": _items(self.hold_streak),
                "checked_until": _items(self.checked_until), "cap_scale": _items(self.cap_scale),
                "layer_recall": _items(self.layer_recall), "choice_stats": stats}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (the same JSON every mtrain checkpoint holds)."""
        self.dense_until = {layer: step for layer, step in state["dense_until"]}
        self.hold_streak = {layer: streak for layer, streak in state["hold_streak"]}
        # checkpoints written before the check's cadence have no "checked_until": every layer is then checked at once
        self.checked_until = {layer: step for layer, step in state.get("checked_until", [])}
        # checkpoints written before cap widening have no "cap_scale": every layer then has the recipe's caps
        self.cap_scale = {layer: scale for layer, scale in state.get("cap_scale", [])}
        # ... and none before recall escalation: every layer then estimates at the recipe's recall
        self.layer_recall = {layer: recall for layer, recall in state.get("layer_recall", [])}
        self.choice_stats = {(layer, tuple(shape), parts): (torch.tensor(values, dtype=torch.float64), None)
                             for layer, shape, parts, values in state["choice_stats"]}
        self.memo = {}


@dataclass
class Records:
    """What the attention calls since the last `AttentionRuntime.drain` left for logging."""

    densities: list = field(default_factory=list)
    """Fraction of causal pairs in the estimated pattern, per sparse-kind call (whichever path ran)."""
    imbalances: list = field(default_factory=list)
    """(worker, step, per-rank work / mean work) imbalance of the first sparse layer's index under the layout, per
    measured forward."""
    layers: list = field(default_factory=list)
    """One `mtrain.models.context.LayerRecord` per sparse-kind call: which path it took and what it measured."""


@dataclass
class AttentionRuntime:
    """Everything one model's attention reads and writes (see the module docstring)."""

    settings: AttentionSettings = field(default_factory=AttentionSettings)
    topology: Topology = field(default_factory=Topology)
    inputs: StepInputs = field(default_factory=StepInputs)
    policy: PolicyState = field(default_factory=PolicyState)
    records: Records = field(default_factory=Records)

    @property
    def name(self) -> str:
        """The `attn_implementation` to load the model with (`mtrain-<kind>`)."""
        return self.settings.name

    @property
    def switches(self) -> Switches:
        """The switches this model's attention runs with (`settings.switches`; the defaults where that is None)."""
        return or_defaults(self.settings.switches)

    def set_documents(self, doc_ids, device=None) -> None:
        """Set this batch's documents: doc_ids [B, S] (the CPU copy where there is one: its boundaries are read
        there, once per batch) on `device`, or None for one document per row."""
        from mtrain.ops.varlen import Documents

        self.inputs.documents = None if doc_ids is None else Documents.from_doc_ids(doc_ids, device)
        self.inputs.doc_ids = None if doc_ids is None else self.inputs.documents.doc_ids

    def current_documents(self, doc_ids):
        """The `Documents` of doc_ids: the batch's (`set_documents`) when they are of these ids, else read from them
        here (a host read per call: callers in a training step set the batch's once); None for None."""
        if doc_ids is None:
            return None
        docs = self.inputs.documents
        if docs is not None and docs.doc_ids is doc_ids:
            return docs
        from mtrain.ops.varlen import Documents

        return Documents.from_doc_ids(doc_ids)

    def drain(self) -> Records:
        """The records left since the last drain, and a fresh empty set for the calls to come. The trainer drains
        at every step; a caller that runs the model outside training (an evaluation's samples) drains after each
        sample, or the lists grow with every call."""
        records, self.records = self.records, Records()
        return records

    def state_dict(self) -> dict:
        """The policy state as JSON (`PolicyState.state_dict`), what checkpoints hold."""
        return self.policy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s JSON (from any mtrain checkpoint)."""
        self.policy.load_state_dict(state)

    @contextlib.contextmanager
    def _recomputing(self):
        self.inputs.recomputing = True
        try:
            yield
        finally:
            self.inputs.recomputing = False

    def checkpoint_contexts(self):
        """`context_fn` of torch.utils.checkpoint (non-reentrant) for this model: nothing around the first forward;
        around the recomputation for the backward, `inputs.recomputing`. A recomputed layer then rebuilds the index
        its first forward chose from the remembered lines (cheap) rather than estimating again: one estimate per
        layer and step instead of two, and the same path in both passes whatever the first one changed (a dense
        hold it set would otherwise send the recomputation dense, which checkpointing refuses)."""
        return contextlib.nullcontext(), self._recomputing()

    def fresh(self) -> AttentionRuntime:
        """A new runtime with a copy of these settings and this topology, and nothing else (no state, no records)."""
        return AttentionRuntime(dataclasses.replace(self.settings), dataclasses.replace(self.topology))


def attach_runtime(model, runtime: AttentionRuntime):
    """Give `model` and every module in it `runtime` (the attention functions find it on the module HF calls them
    with); returns the model. A model has one runtime: attaching another replaces it everywhere."""
    if not isinstance(runtime, AttentionRuntime):
        raise MtrainError(f"attach_runtime needs an AttentionRuntime, got {type(runtime).__name__}")
    for module in model.modules():
        module.__dict__[ATTR] = runtime
    return model


def runtime_of(obj) -> AttentionRuntime:
    """The runtime attached to a model or module (`attach_runtime`); a model wrapped after attaching (a loss wrapper,
    DDP) answers with its inner model's. MtrainError naming the fix where there is none."""
    found = getattr(obj, ATTR, None)
    if found is None and isinstance(obj, torch.nn.Module):
        found = next((m.__dict__[ATTR] for m in obj.modules() if ATTR in m.__dict__), None)
    if found is None:
        raise MtrainError(f"{type(obj).__name__} has no mtrain attention runtime: an mtrain attention kind reads its "
                          "settings and state from the model it runs in. Load the model with "
                          "mtrain.models.load_model(..., runtime=...), or after loading it with "
                          "attn_implementation=runtime.name call mtrain.models.runtime.attach_runtime(model, runtime), "
                          "runtime = mtrain.models.registry.attention_runtime(kind, ...)")
    return found
