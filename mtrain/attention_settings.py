"""The attention settings, one definition each: the vertical-slash estimate's (`SparseSettings`), the dense/sparse
policy's (`PolicySettings`) and the baseline kinds' (`BaselineSettings`), each with its defaults and its validation
(in `__post_init__`, one line naming the recipe key under `attention:` and how to fix it; a `ConfigError`).

Every entry point builds these objects and nothing else checks their fields: the recipe
(`mtrain.config.AttentionConfig`, whose flat `attention:` keys take their defaults from here and which builds them
with `settings()`), the registration (`mtrain.models.registry.attention_runtime(kind, sparse=, policy=, baseline=)`,
whose keywords replace fields of these objects), the runtime (`mtrain.models.runtime.AttentionSettings` holds them) and
`mtrain eval` (`--sparse KEY=VALUE`, `--attention-from`, a suite's `backend.sparse`: `settings_from_keys`). So the
defaults are the same everywhere: a sparse kind runs `sparse_policy` auto with the quality check and a dense hold of
16 steps unless told otherwise (a test or benchmark that wants every layer sparse with no check names it:
`PolicySettings.every_layer_sparse()`).

Immutable (frozen dataclasses: change one with `dataclasses.replace`, which validates again). Torch-free, so the
recipe loader reads it without importing the attention stack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mtrain.errors import ConfigError

SPARSE_POLICIES = ("auto", "always", "never")
"""attention.sparse_policy: per layer, auto = dense where the cost model predicts sparse would not pay."""
ENGINES = ("auto", "triton", "flex", "fa4")
"""attention.engine: the block kernels of a one-device sparse layer (`mtrain.ops.attention.resolve_impl`)."""
DEFAULT_ESCALATE_RECALL = 0.995
"""attention.escalate_recall's default (dropped where there is nothing to escalate to: `default_escalation`)."""


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SparseSettings:
    """Settings of the online vertical-slash estimate and its index (`mtrain.ops.estimate` on one device,
    `mtrain.parallel.estimate` across a CP group, with the same selection rule, so one GPU and a CP group agree).
    The fields that are recipe keys have the same name under `attention:`."""

    recall: float = 0.99
    """Target mean per-row attention mass of the scored rows that the kept blocks, verticals and slashes reach
    together (0.99: SmolLM2-135M at 4K lost 0.2% perplexity, 0.98 lost 1.2%)."""
    last_q: int = 64
    """How many of the last queries of the global sequence score the keys."""
    max_vertical: int = 16384
    """Cap on vertical columns per head (key positions every query attends to)."""
    max_slash: int = 16384
    """Cap on slash lines per head in token diagonals; slashes are chosen per block offset a * block_size,
    which counts as block_size of them."""
    block_size: int = 64
    """Key/query block size of the index handed to the kernels."""
    min_vertical: int = 16
    """Floor on the verticals kept, so one dominant key does not leave a one-entry list (not a recipe key)."""
    min_slash: int = 16
    """Floor on the slashes kept, in token diagonals (ceil(min_slash / block_size) block offsets; not a recipe key)."""
    share_kv_group: bool = False
    """Select once per KV group on the scores summed over its query heads (one budget per group; not a recipe key)."""
    slash_recall: float | None = None
    """Target the slashes complete the coverage to (after the kept blocks and verticals); None = `recall` (not a
    recipe key)."""
    sample_blocks: int = 32
    """Query blocks spread evenly over the sequence whose first sample_rows rows are scored besides the last_q rows."""
    sample_rows: int | None = None
    """Rows scored per sampled query block (at most block_size); None = the whole block."""
    cap_fraction: float | None = None
    """Also cap verticals at this fraction of the sequence's tokens and slashes at this fraction of its blocks."""

    def __post_init__(self) -> None:
        if not _number(self.recall) or not 0.0 < self.recall <= 1.0:
            raise ConfigError(f"attention.recall: must be in (0, 1], got {self.recall!r}")
        if self.slash_recall is not None and (not _number(self.slash_recall) or not 0.0 < self.slash_recall <= 1.0):
            raise ConfigError(f"SparseSettings.slash_recall: must be in (0, 1] or None, got {self.slash_recall!r}")
        for name in ("last_q", "max_vertical", "max_slash", "block_size"):
            value = getattr(self, name)
            if not _integer(value) or value < 1:
                raise ConfigError(f"attention.{name}: must be positive, got {value!r}")
        if self.cap_fraction is not None and (not _number(self.cap_fraction) or not 0.0 < self.cap_fraction <= 1.0):
            raise ConfigError(f"attention.cap_fraction: must be in (0, 1] or null, got {self.cap_fraction!r}")
        if self.sample_rows is not None and (not _integer(self.sample_rows) or self.sample_rows < 1):
            raise ConfigError(f"attention.sample_rows: must be a positive integer or null (= the whole block), "
                              f"got {self.sample_rows!r}")
        for name in ("min_vertical", "min_slash", "sample_blocks"):
            value = getattr(self, name)
            if not _integer(value) or value < 0:
                key = "attention.sample_blocks" if name == "sample_blocks" else f"SparseSettings.{name}"
                raise ConfigError(f"{key}: must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class PolicySettings:
    """How a sparse kind chooses, per layer, between its sparse and dense paths (`mtrain.models.policy`) and what it
    runs them with; each field is the recipe key of the same name under `attention:` (its docstring in
    `mtrain.config.AttentionConfig`). The dense kinds and the baselines read none of it."""

    sparse_policy: str = "auto"
    """One of SPARSE_POLICIES."""
    engine: str = "auto"
    """One of ENGINES."""
    max_output_error: float | None = 0.025
    """The quality check's limit on the relative output error of the scored rows; None = no check."""
    escalate_recall: float | None = DEFAULT_ESCALATE_RECALL
    """With max_output_error: the recall a layer that fails the check estimates at from then on; None = none. The
    default is dropped without a check (here) or at a recall at or above it (`for_recall`)."""
    dense_hold_steps: int = 16
    """In training, under auto: steps a layer the choice sent dense runs dense without estimating (0 = none)."""
    widen_caps: bool = True
    """In training, under auto: double the caps of a layer whose caps bind instead of holding it dense."""
    widen_max_list_mib: int = 0
    """With widen_caps: widen only while the rank's index lists at the doubled caps take at most this many MiB."""
    per_document: bool = True
    """One device with packed documents: each long enough document estimated and run on its own."""
    min_sparse_document: int | None = None
    """With per_document, under auto or always: the shortest document (tokens) that is estimated and may run sparse;
    shorter ones run dense without an estimate. None = the cost model's break-even for the layer's shape under auto,
    two blocks under always."""

    def __post_init__(self) -> None:
        if self.sparse_policy not in SPARSE_POLICIES:
            raise ConfigError(f"attention.sparse_policy: {self.sparse_policy!r} is not one of "
                              f"{', '.join(SPARSE_POLICIES)}")
        if self.engine not in ENGINES:
            raise ConfigError(f"attention.engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        mx = self.max_output_error
        if mx is not None and (not _number(mx) or not 0 < mx < float("inf")):
            raise ConfigError(f"attention.max_output_error: must be a number > 0 (the relative output error above "
                              f"which a layer runs dense) or null (no quality check), got {mx!r}")
        if not _integer(self.dense_hold_steps) or self.dense_hold_steps < 0:
            raise ConfigError(f"attention.dense_hold_steps: must be an integer >= 0 (0 = estimate every step), "
                              f"got {self.dense_hold_steps!r}")
        for name in ("widen_caps", "per_document"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"attention.{name}: expected true or false, got {getattr(self, name)!r}")
        msd = self.min_sparse_document
        if msd is not None and (not _integer(msd) or msd < 1):
            raise ConfigError(f"attention.min_sparse_document: must be a positive number of tokens (documents shorter "
                              f"than it run dense) or null (the cost model's break-even), got {msd!r}")
        if not _integer(self.widen_max_list_mib) or self.widen_max_list_mib < 0:
            raise ConfigError(f"attention.widen_max_list_mib: must be an integer >= 0 (MiB of a rank's index lists at "
                              f"the widened caps; 0 = no limit), got {self.widen_max_list_mib!r}")
        er = default_escalation(self.escalate_recall, None, mx)
        object.__setattr__(self, "escalate_recall", er)
        if er is not None:
            if not _number(er) or not 0 < er <= 1:
                raise ConfigError(f"attention.escalate_recall: must be a number above attention.recall and at most 1 "
                                  f"(the recall a layer the quality check fails estimates at), got {er!r}")
            if mx is None:
                raise ConfigError("attention.escalate_recall needs attention.max_output_error (the check that decides "
                                  "which layers escalate): set both, e.g. max_output_error: 0.025, "
                                  "escalate_recall: 0.995")

    @property
    def dense_hold(self) -> int:
        """dense_hold_steps (the name the policy reads)."""
        return self.dense_hold_steps

    @property
    def widen_max_list_bytes(self) -> int:
        """widen_max_list_mib in bytes (0 = no limit)."""
        return self.widen_max_list_mib * 2**20

    def for_recall(self, recall: float) -> PolicySettings:
        """These settings for an estimate at `recall`: the default escalation dropped where `recall` is at or above
        it; ConfigError for an escalate_recall of one's own that is not above `recall`."""
        er = default_escalation(self.escalate_recall, recall, self.max_output_error)
        if er is not None and not recall < er:
            raise ConfigError(f"attention.escalate_recall: must be a number above attention.recall ({recall}) and at "
                              f"most 1 (the recall a layer the quality check fails estimates at), got {er!r}")
        return self if er == self.escalate_recall else dataclasses.replace(self, escalate_recall=er)

    @classmethod
    def every_layer_sparse(cls, **fields) -> PolicySettings:
        """sparse_policy always, with no quality check, escalation or hold: every layer of a sparse kind runs its
        estimated index (what a test or a benchmark of the sparse path names); `fields` replace any of them."""
        chosen = dict(sparse_policy="always", max_output_error=None, escalate_recall=None, dense_hold_steps=0)
        return cls(**{**chosen, **fields})


TRAINING_ONLY = ("dense_hold_steps", "widen_caps", "widen_max_list_mib")
"""The PolicySettings fields that only training reads (the dense hold and cap widening act between steps): an
evaluation takes every other policy field (`mtrain eval --sparse`, `--attention-from`), not these."""


def inference_keys(group: type) -> tuple[str, ...]:
    """The keys of one settings class that an evaluation takes: its fields less TRAINING_ONLY."""
    return tuple(name for name in keys_of(group) if name not in TRAINING_ONLY)


def default_escalation(escalate_recall, recall, max_output_error):
    """escalate_recall, or None where it is the default (DEFAULT_ESCALATE_RECALL) and there is nothing to escalate
    to: no quality check (`max_output_error` None), or a `recall` (None: not known yet) at or above it. An
    escalate_recall named with the check and a lower recall is kept as given."""
    er = escalate_recall
    if er == DEFAULT_ESCALATE_RECALL and type(er) is float and (
            max_output_error is None or (_number(recall) and recall >= er)):
        return None
    return er


@dataclass(frozen=True)
class BaselineSettings:
    """The recipe's `attention:` keys the baseline kinds read (moba, xattention; ulysses reads none)."""

    block_size: int = 64
    """Kernel block size (tokens): the query-block granularity of the moba gate and the xattention scores."""
    moba_chunk_size: int = 4096
    """moba: key chunk (tokens), a multiple of block_size."""
    moba_topk: int = 12
    """moba: earlier chunks each query block keeps, besides its own chunk."""
    xattn_stride: int = 8
    """xattention: antidiagonal stride (tokens), a divisor of block_size."""
    xattn_threshold: float = 0.9
    """xattention: fraction of a query block's normalised score mass its kept key blocks reach."""

    def __post_init__(self) -> None:
        if not _integer(self.block_size) or self.block_size < 1:
            raise ConfigError(f"attention.block_size: must be positive, got {self.block_size!r}")
        for key in ("moba_chunk_size", "moba_topk", "xattn_stride"):
            floor = 0 if key == "moba_topk" else 1
            if not _integer(getattr(self, key)) or getattr(self, key) < floor:
                raise ConfigError(f"attention.{key}: must be {'>= 0' if floor == 0 else 'positive'}, "
                                  f"got {getattr(self, key)!r}")
        if not _number(self.xattn_threshold) or not 0.0 < self.xattn_threshold <= 1.0:
            raise ConfigError(f"attention.xattn_threshold: must be in (0, 1], got {self.xattn_threshold!r}")

    def check_for(self, kind: str) -> BaselineSettings:
        """These settings, checked against the kind that reads them: moba's chunks whole blocks, xattention's stride a
        divisor of the block size. Returns self."""
        bs = self.block_size
        if kind == "moba" and self.moba_chunk_size % bs:
            raise ConfigError(f"attention.moba_chunk_size: {self.moba_chunk_size} is not a multiple of "
                              f"attention.block_size ({bs}); use e.g. {max(1, self.moba_chunk_size // bs) * bs}")
        if kind == "xattention" and bs % self.xattn_stride:
            fit = max(d for d in range(1, self.xattn_stride + 1) if bs % d == 0)
            raise ConfigError(f"attention.xattn_stride: {self.xattn_stride} does not divide attention.block_size "
                              f"({bs}); use a divisor of it, e.g. {fit}")
        return self


GROUPS = {"sparse": SparseSettings, "policy": PolicySettings, "baseline": BaselineSettings}
"""The settings objects by their keyword (`attention_runtime`'s, `AttentionConfig.settings()`'s)."""


def keys_of(group: type) -> tuple[str, ...]:
    """The field names of one settings class: the keys that reach it."""
    return tuple(f.name for f in dataclasses.fields(group))


def settings_from_keys(kind: str | None = None, keys: dict | None = None, *, sparse: SparseSettings | None = None,
                       policy: PolicySettings | None = None,
                       baseline: BaselineSettings | None = None) -> dict:
    """{"sparse", "policy", "baseline"}: the given objects (their defaults where None) with the flat `keys` (recipe
    key -> value, e.g. `--sparse` items or registration keywords) replacing their fields. A key reaches every group
    that has it (block_size: the sparse and the baseline settings). Each object validates itself; the policy is then
    checked against the sparse recall (`PolicySettings.for_recall`), the baseline against `kind` (`check_for`).
    ConfigError naming an unknown key and the valid ones."""
    given = {"sparse": sparse or SparseSettings(), "policy": policy or PolicySettings(),
             "baseline": baseline or BaselineSettings()}
    keys = dict(keys or {})
    valid = [name for group in GROUPS.values() for name in keys_of(group)]
    unknown = [key for key in keys if key not in valid]
    if unknown:
        raise ConfigError(f"bad attention setting {unknown[0]!r}; valid settings: "
                          f"{', '.join(dict.fromkeys(valid))}")
    out = {}
    for name, group in GROUPS.items():
        mine = {key: value for key, value in keys.items() if key in keys_of(group)}
        out[name] = dataclasses.replace(given[name], **mine) if mine else given[name]
    out["policy"] = out["policy"].for_recall(out["sparse"].recall)
    if kind is not None:
        out["baseline"].check_for(kind)
    return out


def flat_keys(settings: dict) -> dict:
    """The flat keys (field -> value) of a `settings_from_keys` result, sparse first (block_size: the sparse one's)."""
    out: dict = {}
    for name in ("baseline", "policy", "sparse"):
        out.update(dataclasses.asdict(settings[name]))
    return out
