"""Recipe configuration: typed dataclasses loaded from one YAML per recipe, validated at load.

Unknown keys, wrong types and missing paths fail with a message that names the key (and the closest
valid key); `--set section.key=value` overrides apply before validation; `save()` writes the resolved config.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from mtrain.attention_settings import (DEFAULT_ESCALATE_RECALL, BaselineSettings, PolicySettings, SparseSettings,
                                       default_escalation, settings_from_keys)
from mtrain.errors import ConfigError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
ATTENTION_KINDS = ("dense", "mtraining", "zigzag-dense", "zigzag-sparse", "moba", "xattention", "ulysses", "sdpa",
                   "eager")


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """HF checkpoint folder to continue training from (config.json + weights). Exclusive with `config`."""
    config: Optional[str] = None
    """A config.json to initialise a model from scratch (random weights), e.g. the tiny default's."""
    tokenizer: Optional[str] = None
    """Tokenizer folder; defaults to `path`. Saved next to every exported checkpoint."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and activation dtype (bf16 on GPUs; fp32 on CPUs)."""
    rope_theta: Optional[float] = None
    """Override the RoPE base (ProLong uses 128M at 512K); None keeps the checkpoint's."""
    rope_scaling: Optional[dict] = None
    """e.g. {rope_type: yarn, factor: 16, original_max_position_embeddings: 32768}; written into config.json."""
    max_position_embeddings: Optional[int] = None
    """Override; with YaRN it defaults to original_max_position_embeddings x factor."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward (activation checkpointing)."""
    mlp_chunk: Optional[int] = None
    """Tokens per chunk of each decoder layer's MLP (`mtrain.models.memory.chunk_mlp`): the MLP runs the sequence in
    chunks, each checkpointed, so no pass holds the [S, intermediate_size] tensors of the whole sequence (at 256K
    tokens on Qwen2.5-3B: 5.4 GiB each, four of them in a layer's backward) but one chunk's; it costs the MLP's
    forward once more per step. 0 or null = off. Same outputs and gradients (Qwen2 and Llama)."""


@dataclass
class DataConfig:
    path: str = ""
    """Packed dataset folder written by `mtrain pack` (MDS shards + manifest)."""
    seq_len: int = 1024
    """Tokens per training sequence; must equal the packed dataset's seq_len."""
    document_masking: bool = True
    """Attention never crosses packed documents; position_ids restart at document starts."""
    shuffle: bool = True
    """Shuffle sample order each epoch (seeded by train.seed)."""



@dataclass
class AttentionConfig:
    kind: str = "dense"
    """One of: dense, mtraining, zigzag-dense, zigzag-sparse, moba, xattention, ulysses, sdpa, eager (moba and
    xattention: block-sparse baselines chosen from q/k every call, on the recipe's parallel.layout under CP;
    ulysses: dense, head-parallel all-to-all under CP)."""
    block_size: int = SparseSettings.block_size
    """Sparse kernel block size (tokens)."""
    recall: float = SparseSettings.recall
    """Target mean per-row attention mass the online vertical-slash estimate keeps on its scored rows."""
    last_q: int = SparseSettings.last_q
    """Queries (at the end of the sequence) used to estimate the sparse pattern."""
    max_vertical: int = SparseSettings.max_vertical
    """Budget cap on vertical (key column) lines per head (16384: on SmolLM2-135M at 64K-128K the former
    4096-line caps bound in early layers and held their recall to 0.53-0.68; a layer that needs more than
    pays runs dense under sparse_policy auto, or with `widen_caps` estimates again with wider caps)."""
    max_slash: int = SparseSettings.max_slash
    """Budget cap on slash lines per head, in token diagonals (slashes are chosen per block offset, which
    counts as block_size diagonals)."""
    sample_blocks: int = SparseSettings.sample_blocks
    """Query blocks spread evenly over the sequence that the estimate scores besides the last_q queries (32: with 16,
    SmolLM2-135M with every layer sparse read +1.7% perplexity at 32K, with 32 +0.2%; BENCHMARKS.md, issue #29)."""
    sample_rows: Optional[int] = SparseSettings.sample_rows
    """Rows the estimate scores per sampled query block (its first ones, at most block_size); None = the whole
    block. Fewer rows make the estimate cheaper (its cost is linear in the scored rows) and its pattern coarser."""
    cap_fraction: Optional[float] = SparseSettings.cap_fraction
    """Also cap verticals at this fraction of the sequence's tokens and slashes at this fraction of its
    blocks (caps that grow with the sequence); None = only max_vertical / max_slash."""
    sparse_policy: Literal["auto", "always", "never"] = PolicySettings.sparse_policy
    """Sparse kinds, per layer: auto = run dense where the cost model (mtrain.ops.cost) predicts sparse would
    not pay; always = sparse on every layer; never = dense on every layer (the pattern is not estimated)."""
    engine: Literal["auto", "triton", "flex", "fa4"] = PolicySettings.engine
    """Sparse kinds on one device: the block kernels of the sparse path. auto = the engine measured fastest for
    the GPU and block size (fa4 at block_size 128 where FlashAttention-4 is installed on a Hopper-or-newer GPU,
    else our Triton kernels; `mtrain.ops.attention.resolve_impl`); triton = ours;
    flex = FlexAttention driven by the index; fa4 = FlashAttention-4's block-sparse kernels (the `fa4` extra,
    Hopper or newer GPUs) for the listed blocks plus our column kernels. Under context parallelism the engine picks
    the kernels of every sparse ring step: fa4 (FA4's block-sparse kernels, where it runs: 128-token blocks, no
    document masking; else ours), triton, or auto (fa4 where it runs); flex has no ring steps and is refused there."""
    max_output_error: Optional[float] = PolicySettings.max_output_error
    """Under sparse_policy auto, the quality check: a layer runs dense where the relative error of the attention
    output of the rows the estimate scored, with only the pairs inside the estimated index against dense attention
    (`mtrain.models.policy.quality_error`; under context parallelism measured across the group,
    `mtrain.parallel.quality.gathered_output_error`), exceeds this number, whatever the cost model says. It costs two
    partial-attention calls over those rows' query blocks, once per `dense_hold_steps` for a layer that passed. Default
    0.025: with it and `escalate_recall` 0.995, every layer sparse on SmolLM2-135M held perplexity within 1% of dense
    on four kinds of text at 4K and 8K (CPU), where the estimate alone missed by up to 2.4%. null = no check (faster,
    lossier: a setting to name). BENCHMARKS.md ("The quality check", issue #29) has the CPU measurements: the output
    error follows a layer's perplexity cost where the estimate's row mass does not."""
    escalate_recall: Optional[float] = DEFAULT_ESCALATE_RECALL
    """With max_output_error: a layer whose output error on the scored rows exceeds it first estimates again at this
    recall (above `recall`, at most 1) and keeps it for the rest of the run (saved with checkpoints, logged as
    attn_layer_recall/LNN); the check then reads the new index, and only a layer still over the limit goes dense under
    auto. Under sparse_policy always the check runs for this alone and the layer stays sparse. Spends the higher
    recall's pairs only on the layers whose error needs them, where raising `recall` spends them on every layer.
    Default 0.995 (see max_output_error); null = no escalation."""
    dense_hold_steps: int = PolicySettings.dense_hold_steps
    """Under sparse_policy auto, in training: a layer the choice sent dense runs dense without estimating its
    pattern for this many further steps, then estimates again (the estimate is paid before the choice; a
    layer's density moves slowly). 0 = estimate every step."""
    per_document: bool = PolicySettings.per_document
    """Sparse kinds on one device with packed documents (data.document_masking): true = each document at least as
    long as the cost model's break-even is estimated and run sparse as a sequence of its own, the rest in one dense
    varlen call (`mtrain.models.attention._per_document`); false = one estimate over the whole sequence with the
    documents masked in the kernels, as a context-parallel group runs (which ignores this key)."""
    min_sparse_document: Optional[int] = PolicySettings.min_sparse_document
    """With per_document, under sparse_policy auto or always: documents shorter than this many tokens run dense
    without an estimate (one at least two blocks and this long is estimated; under auto the choice then prices it).
    null = under auto the cost model's break-even for the layer's shape (`mtrain.models.attention._shortest_sparse`),
    under always two blocks. A measured
    threshold for a model and GPU comes from `mtrain bench real --documents long --min-document N [N ...]`."""
    widen_caps: bool = PolicySettings.widen_caps
    """Under sparse_policy auto, in training: a layer that the estimate's recall (more than 0.04 short of `recall`) or
    the quality check (`max_output_error`) sends dense where the cost model said sparse, and whose caps bind (its
    estimate is short of `recall`, and doubled they would be larger for the sequence), runs dense this call and estimates again on its next call with its
    max_vertical / max_slash (and cap_fraction, at most 1) doubled, instead of being held dense for
    `dense_hold_steps`; doubled again each time, up to 8x (`mtrain.models.policy.widen`, MAX_CAP_SCALE). At 8x, or
    where the caps already cover the sequence, the layer is held dense as before. Each layer's scale is saved with
    checkpoints and logged (attn_cap_scale/LNN, attention_widened_layers). false = hold such a layer dense."""
    widen_max_list_mib: int = PolicySettings.widen_max_list_mib
    """With widen_caps: widen a layer only while its index lists at the doubled caps would take at most this many MiB
    on one rank (int32 block and column lists as wide as the caps allow, over the rank's query blocks: what the index,
    the ring plan and the kernels' plans build and pass over every call); above it the layer is held dense as at 8x.
    0 (default) = no limit. At 512K tokens with CP=4, 64-token blocks and 9 heads, column lists at 16,384-line caps
    would take ~1.2 GiB per rank and double with each widening; a CP rank at such caps holds its columns list-free
    (block lists and each head's verticals: ~15 MiB there), and the limit counts what it holds."""
    moba_chunk_size: int = BaselineSettings.moba_chunk_size
    """kind moba: key chunk (tokens), a multiple of block_size; each query block gates the chunks by mean key."""
    moba_topk: int = BaselineSettings.moba_topk
    """kind moba: earlier chunks each query block keeps (best gate scores), besides its own chunk (always kept)."""
    xattn_stride: int = BaselineSettings.xattn_stride
    """kind xattention: antidiagonal stride (tokens) of the block scores, a divisor of block_size."""
    xattn_threshold: float = BaselineSettings.xattn_threshold
    """kind xattention: each query block keeps the fewest key blocks (diagonal and first block always) whose
    normalised antidiagonal scores reach this fraction, in (0, 1]."""
    graph_estimate: bool = True
    """Sparse kinds on one CUDA device: replay the online estimate (and the plans the engine derives from the index)
    from a CUDA graph once a shape has been seen twice (`mtrain.ops.graphed`): its ~280 small launches per call cost
    about what its GPU work does at 32K. false = the eager estimate every call (the same index)."""
    lagged_choice: bool = True
    """Under sparse_policy auto on one device: a layer decides from the work counts and estimated recall of its
    previous estimate of the same shape (one step old in training), copied to the host without waiting, instead of
    waiting for its own (`mtrain.models.policy`); a layer's first estimate is read directly. false = every layer
    decides from its own estimate (a host wait per layer; the choice can differ by one call)."""
    cost_table: Optional[str] = None
    """A JSON file of cost-model figures measured on this machine (`mtrain bench cost --fit ROWS --write-table FILE`)
    that replace the built-in ones they cover in the sparse / dense choice (`mtrain.ops.cost.table_for`). null = the
    built-in figures, or the file the environment variable MTRAIN_COST_TABLE names (this key wins over it)."""

    def __post_init__(self) -> None:
        # The default escalation needs the check and a recall below it: a recipe that turns the check off, or asks
        # for a recall at or above 0.995 on every layer, has nothing to escalate to (an escalate_recall it names
        # itself is checked as given). The rule is the settings' (`mtrain.attention_settings.default_escalation`).
        self.escalate_recall = default_escalation(self.escalate_recall, self.recall, self.max_output_error)

    def settings(self) -> dict:
        """These keys as the checked settings objects of `mtrain.attention_settings`: {"sparse": SparseSettings,
        "policy": PolicySettings, "baseline": BaselineSettings} (`settings_from_keys`; each validates its own keys,
        ConfigError naming the key). What `mtrain.models.registry.attention_runtime` takes (`recipe_runtime`)."""
        keys = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in SETTINGS_KEYS}
        return settings_from_keys(self.kind, keys)


# The `attention:` keys that are fields of the settings objects (the others: kind and the switches).
SETTINGS_KEYS = frozenset(f.name for group in (SparseSettings, PolicySettings, BaselineSettings)
                          for f in dataclasses.fields(group)) & {f.name for f in dataclasses.fields(AttentionConfig)}


@dataclass
class ParallelConfig:
    cp_size: int = 1
    """Context-parallel group size: ranks that share one sequence. DP size = world / cp_size."""
    layout: str = "block-stripe"
    """Sequence layout over a CP group: contiguous, zigzag, stripe, block-stripe."""
    granularity: int = 64
    """Stripe width (tokens) for block-stripe."""
    schedule: Literal["ring", "gather"] = "ring"
    """How a sparse layer's ranks share K/V: ring (the flat ring, or the hierarchical one across nodes: each rank
    holds two shards at a time) or gather (every rank all-gathers the group's K/V and runs its rows in one call,
    without the ring's per-step merge: cp_size x the shard's K/V per layer in memory; for one node's GPUs).
    Dense layers follow dense_schedule."""
    dense_schedule: Literal["auto", "ring", "gather"] = "auto"
    """How dense layers (the dense kinds, and sparse kinds' layers run dense) share K/V: gather (every rank all-gathers
    the group's K/V and runs its rows in one varlen call, with FlashAttention-4's varlen kernel where it runs: needs the
    contiguous or zigzag layout), ring (the ring's steps, any layout), or auto
    (gather where the layout allows, else the ring)."""
    graph_ring_estimate: bool = False
    """On CUDA, replay each rank's context-parallel estimate (the Triton scorer, its collectives and the rank's index
    rows) from a CUDA graph once a shape has been seen twice (`mtrain.parallel.graphed`); the ranks agree on every
    capture. false (default) = eager. The 256K figure of README (4.60x the dense ring) ran with it and
    schedule gather."""
    list_free_columns: bool = True
    """A CP rank whose block and column lists as wide as the lines allow would pass static_width_mib holds no column
    lists: the ring reads the columns from each head's sorted verticals (`mtrain.ops.columns.RingColumns`; ~1 GiB
    less per layer at 128K tokens per GPU, 16 heads, 16,384-line caps). false = the lists. Same results."""
    static_width_mib: int = 64
    """A CP rank's index lists that take at most this many MiB at the widths the lines allow are built at those
    widths, with no host read (and can be held in the estimate's CUDA graph); larger ones read their widths back
    once per layer (`mtrain.parallel.estimate.rank_list_widths`). Same results."""
    fused_merge: bool = True
    """On the GPU, the ring's LSE merge of full-row parts and the owners' dK/dV sum run as one Triton pass each
    (`mtrain.parallel.merge`); false = torch (the same arithmetic; `mtrain bench check --engines merge` compares)."""
    gather_backward: Literal["auto", "fa4", "triton"] = "auto"
    """schedule gather, fa4 engine: the gathered step's backward. fa4 = FlashAttention-4's block-sparse backward plus
    our column backward; triton = our deterministic backward from FA4's out / lse; auto = fa4 in groups of up to 4
    ranks, triton in larger ones (each the faster there: `mtrain.parallel.ring_gather`)."""
    gather_sink: Literal["replicas", "columns"] = "replicas"
    """schedule gather under FA4's backward: how the plan holds the sink block. replicas = copies read by a few
    query blocks each; columns = its tokens as columns of every query block, as on the ring."""
    hierarchy: Literal["auto", "flat", "hierarchical"] = "auto"
    """The ring over a CP group that spans nodes: hierarchical = an inner ring within each node and an outer one
    across nodes (`mtrain.parallel.ring_hierarchical`); flat = one ring over the group; auto = hierarchical where
    the node size (node_size) splits the group into several nodes, else flat. The trainer logs which one runs."""
    node_size: Optional[int] = None
    """Ranks per node of the hierarchical ring; null = LOCAL_WORLD_SIZE as the launcher (torchrun, accelerate) sets
    it (the GPUs per node), flat where it is unset."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    schedule: Literal["cosine", "rewarm", "constant"] = "cosine"
    """cosine: warmup then cosine to min_lr_ratio; rewarm: from the checkpoint's LR, rewarm then decay."""
    warmup_steps: int = 0
    """Linear warmup steps (overrides warmup_ratio when > 0)."""
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.1
    """Floor of the decay as a fraction of lr."""


@dataclass
class LoggingConfig:
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; metrics.jsonl is written in every mode."""
    project: str = "mtrain"
    run_name: Optional[str] = None
    """Defaults to the output folder's name."""
    log_every: int = 1
    recall_every: int = 0
    """Every N optimizer steps, sparse layers measure their true recall on sampled query rows (logged per
    layer as attn_true_recall/LNN); 0 = never. Under CP the ranks measure it together (each scores the sampled
    rows against its own keys; `mtrain.ops.recall.gathered_true_recall`)."""


@dataclass
class TrainConfig:
    output_dir: str = "runs/default"
    """Run folder: metrics.jsonl, config.yaml, checkpoints/, final/ (the exported HF checkpoint)."""
    max_steps: int = 100
    """Optimizer steps."""
    save_every: int = 0
    """Checkpoint every N optimizer steps (0: only at the end and on SIGTERM)."""
    seed: int = 0
    deterministic: bool = False
    """Deterministic algorithms and seeded everything: reruns and resumes give bit-identical losses on CPU."""
    micro_batch_size: int = 1
    """Sequences per rank per forward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    deepspeed: Optional[str] = None
    """DeepSpeed JSON config (ZeRO-2, optionally with CPU offload); None trains without DeepSpeed."""
    export: bool = True
    """Write a plain HF checkpoint (safetensors + config + tokenizer) to OUTPUT_DIR/final at the end."""
    max_bad_steps: int = 10
    """Stop after this many skipped updates (non-finite loss or gradients; under DeepSpeed, updates its overflow check skipped)."""
    loss_chunk: int = 4096
    """Tokens per chunk of the LM head + cross-entropy (no [S, vocab] logits are ever materialised)."""
    offload_activations: bool = False
    """Keep what autograd saves for the backward in pinned host memory from the forward until the backward reads it
    (`mtrain.models.memory.OffloadActivations`: torch's save_on_cpu without the parameters and small tensors). With
    model.gradient_checkpointing that is each decoder layer's input, the one tensor a checkpointed layer keeps (36 x
    1 GiB at 256K tokens per GPU on Qwen2.5-3B). Costs a copy each way over PCIe per layer and step and as much
    pinned host memory per process."""
    memory_record: bool = False
    """On a GPU, record the allocator's history during the first step (`torch.cuda.memory._record_memory_history`)
    and write RUN/memory/rankN.txt (the allocation sites live at the step's peak, largest first), at the end of that
    step or when it runs out of memory. Also on with the environment variable MTRAIN_MEMORY_RECORD=1. Slows that
    step down; off the GPU it does nothing."""
    profile_step: int = 0
    """Profile this step (1-based; 0 = none) with torch.profiler on every rank and write RUN/profile/rankN.txt: the
    step's wall time, each layer's attention calls (host and device ms) and the operators and kernels taking the most
    time (`mtrain.train.step_profile`). Also set by the environment variable MTRAIN_PROFILE_STEP=N. The profiled step
    runs slower than the others: its tokens/s is not a speed figure."""


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        def plain(value):
            if isinstance(value, tuple):
                return list(value)
            return value

        return {
            f.name: {k: plain(v) for k, v in dataclasses.asdict(getattr(self, f.name)).items()}
            for f in dataclasses.fields(self)
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write the resolved config as YAML, atomically. Local paths are written absolute, so that the saved
        config means the same files from any directory (`mtrain export` of a checkpoint reads it)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = self.to_dict()
        for section, key in LOCAL_PATH_KEYS:
            value = raw[section][key]
            if isinstance(value, str) and Path(value).exists():  # a hub id stays as it is
                raw[section][key] = os.path.abspath(value)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
        os.replace(tmp, path)


# (section, key) of the recipe fields that name local files or folders
LOCAL_PATH_KEYS = (("model", "path"), ("model", "config"), ("model", "tokenizer"), ("data", "path"),
                   ("train", "output_dir"), ("train", "deepspeed"), ("attention", "cost_table"))


def _suggest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check `value` against the field's type annotation; convert where the conversion is lossless."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}{_suggest(str(value), map(str, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 2e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if annotation is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {annotation!r}")


def _build_section(cls, section: str, raw: Any):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"unknown key '{section}.{key}'{_suggest(key, names)}; valid keys of '{section}': {', '.join(sorted(names))}")
        kwargs[key] = _coerce(f"{section}.{key}", value, hints[key])
    return cls(**kwargs)


def parse_override_value(text: str) -> Any:
    """`--set a.b=VALUE`: VALUE is read as YAML, so 1 -> int, true -> bool, [1,2] -> list, x -> str."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` strings to a raw recipe dict (before validation)."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) < 2:
            raise ConfigError(f"override '{item}' must name a section and a key, like train.max_steps=10")
        section, key = parts[0], ".".join(parts[1:])
        value = parse_override_value(text)
        target = raw.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"override '{item}': section '{section}' is not a mapping")
        if "." in key:  # nested dict field, e.g. model.rope_scaling.factor=16
            head, rest = key.split(".", 1)
            nested = dict(target.get(head) or {})
            nested[rest] = value
            target[head] = nested
        else:
            target[key] = value
    return raw


def check_model_section(m: ModelConfig, deepspeed: str | None = None) -> None:
    """The model section's checks (exactly one of path / config, the paths exist, tokenizer and model files): all
    that a tool which only builds the model (`mtrain export`) needs of a recipe. deepspeed: train.deepspeed,
    whose path is checked with them."""
    if (m.path is None) == (m.config is None):
        raise ConfigError("model: set exactly one of 'model.path' (a checkpoint to continue) or 'model.config' (a config.json to start from)")
    for key, value in (("model.path", m.path), ("model.config", m.config), ("model.tokenizer", m.tokenizer), ("train.deepspeed", deepspeed)):
        if value is None or Path(value).exists():
            continue
        if key in ("model.path", "model.tokenizer") and HUB_ID.fullmatch(value):
            check_hub_id(key, value)
            continue
        raise ConfigError(f"{key}: path '{value}' does not exist (relative paths are taken from the current directory)")
    if m.path is None and m.tokenizer is None:
        raise ConfigError("model.tokenizer: required when the model starts from 'model.config'")
    _check_model_files(m)


def check_mlp_chunk(value) -> None:
    """model.mlp_chunk must be null, 0 (off) or a positive number of tokens."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"model.mlp_chunk: must be a whole number of tokens >= 0 (0 or null = the MLP runs the "
                          f"whole sequence at once), got {value!r}; e.g. model.mlp_chunk: 32768")


def _check(recipe: RecipeConfig) -> None:
    """Cross-field checks that need more than the types."""
    m, d, a, p, t, o = recipe.model, recipe.data, recipe.attention, recipe.parallel, recipe.train, recipe.optim
    check_model_section(m, t.deepspeed)
    if t.deepspeed is not None and not Path(t.deepspeed).is_file():
        raise ConfigError(f"train.deepspeed: '{t.deepspeed}' is not a file; name a DeepSpeed JSON config")
    if not d.path:
        raise ConfigError("data.path: required (a folder written by `mtrain pack`)")
    if not Path(d.path).exists():
        raise ConfigError(f"data.path: '{d.path}' does not exist; write it with `mtrain pack ... --out {d.path}`")
    if not (Path(d.path) / "index.json").is_file():
        raise ConfigError(f"data.path: '{d.path}' holds no index.json, so it is not a finished `mtrain pack` output; "
                          "point it at a packed folder (or rerun the pack that writes it to finish it)")
    _check_output_dir(t.output_dir)
    _check_ranges(recipe)
    if a.kind not in ATTENTION_KINDS:
        raise ConfigError(f"attention.kind: '{a.kind}' is not one of {', '.join(ATTENTION_KINDS)}{_suggest(a.kind, ATTENTION_KINDS)}")
    positive = {
        "data.seq_len": d.seq_len, "train.max_steps": t.max_steps, "train.micro_batch_size": t.micro_batch_size,
        "train.grad_accum": t.grad_accum, "parallel.cp_size": p.cp_size,
        "parallel.granularity": p.granularity, "train.loss_chunk": t.loss_chunk,
        "logging.log_every": recipe.logging.log_every,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")
    check_mlp_chunk(m.mlp_chunk)
    if t.save_every < 0:
        raise ConfigError(f"train.save_every: must be >= 0 (0 = only at the end), got {t.save_every}")
    a.settings()  # the attention keys, each checked once by the settings object that holds it
    if p.cp_size > 1 and a.engine not in ("auto", "triton", "fa4"):
        raise ConfigError(f"attention.engine: '{a.engine}' runs on one device only; with parallel.cp_size "
                          f"{p.cp_size} the ring's steps run fa4 or triton: set attention.engine: auto")
    if recipe.logging.recall_every < 0:
        raise ConfigError(f"logging.recall_every: must be >= 0 (0 = never), got {recipe.logging.recall_every}")
    if not 0.0 <= o.min_lr_ratio <= 1.0 or not 0.0 <= o.warmup_ratio < 1.0:
        raise ConfigError("optim: need 0 <= min_lr_ratio <= 1 and 0 <= warmup_ratio < 1")
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        kind = rs.get("rope_type", rs.get("type"))
        if kind is None:
            raise ConfigError("model.rope_scaling: needs 'rope_type' (e.g. yarn)")
        if kind in ("yarn", "linear", "dynamic") and not isinstance(rs.get("factor"), (int, float)):
            raise ConfigError(f"model.rope_scaling.factor: required for rope_type '{kind}'")
        if kind == "yarn" and not isinstance(rs.get("original_max_position_embeddings"), int):
            raise ConfigError("model.rope_scaling.original_max_position_embeddings: required for yarn (the pre-extension context length)")
    _check_baselines(recipe)
    _check_switches(recipe)
    if p.layout not in ("contiguous", "zigzag", "stripe", "block-stripe"):
        raise ConfigError(f"parallel.layout: '{p.layout}' is not one of contiguous, zigzag, stripe, block-stripe{_suggest(p.layout, ('contiguous', 'zigzag', 'stripe', 'block-stripe'))}")
    if p.dense_schedule == "gather" and p.cp_size > 1 and p.layout in ("stripe", "block-stripe"):
        raise ConfigError(f"parallel.dense_schedule: gather needs shards of a few runs of consecutive positions, and "
                          f"a {p.layout} shard has one run per stripe; use parallel.layout zigzag (or contiguous), or "
                          "dense_schedule auto (the ring for this layout)")


def _check_switches(recipe: RecipeConfig) -> None:
    """The keys of the switches read deep in the attention stack (`mtrain.ops.switches`): the static widths' size,
    the hierarchical ring's node size against the CP group, the cost table's file."""
    a, p = recipe.attention, recipe.parallel
    if p.static_width_mib < 0:
        raise ConfigError(f"parallel.static_width_mib: must be an integer >= 0 (MiB of a rank's index lists built at "
                          f"static widths), got {p.static_width_mib}; the default is 64")
    if p.hierarchy == "hierarchical" and p.cp_size == 1:
        raise ConfigError("parallel.hierarchy: hierarchical needs a CP group (parallel.cp_size > 1) to split into "
                          "nodes; use hierarchy auto")
    if p.node_size is not None:
        if p.node_size < 1:
            raise ConfigError(f"parallel.node_size: must be a positive number of ranks per node or null (= the "
                              f"launcher's LOCAL_WORLD_SIZE), got {p.node_size}")
        if p.hierarchy != "flat" and p.node_size < p.cp_size and p.cp_size % p.node_size:
            raise ConfigError(f"parallel.node_size: {p.node_size} ranks per node do not split parallel.cp_size "
                              f"{p.cp_size} into whole nodes; use a divisor of it, or parallel.hierarchy: flat")
        if p.hierarchy == "hierarchical" and p.node_size >= p.cp_size:
            raise ConfigError(f"parallel.hierarchy: hierarchical needs nodes smaller than the CP group, and "
                              f"parallel.node_size {p.node_size} holds all {p.cp_size} ranks; use hierarchy auto or "
                              "flat, or a smaller node_size")
    if a.cost_table is not None:
        if not Path(a.cost_table).is_file():
            raise ConfigError(f"attention.cost_table: '{a.cost_table}' is not a file; write one with `mtrain bench "
                              "cost --fit ROWS --write-table FILE`, or set null for the built-in figures")
        from mtrain.ops.cost import read_override

        problem = read_override(a.cost_table)
        if problem is not None:
            raise ConfigError(f"attention.cost_table: '{a.cost_table}' is not a cost-table override ({problem}); "
                              "write one with `mtrain bench cost --fit ROWS --write-table FILE`")


def _check_baselines(recipe: RecipeConfig) -> None:
    """The baseline kinds' blocks against the CP layout, and ulysses' head split against the model's config.json (when
    it is local)."""
    a, p = recipe.attention, recipe.parallel
    # the keys' own values and their fit to the kind: BaselineSettings (`AttentionConfig.settings`, in _check)
    if a.kind in ("moba", "xattention") and p.cp_size > 1 and p.layout in ("contiguous", "zigzag", "stripe", "block-stripe"):
        from mtrain.parallel.layout import Layout, LayoutError
        from mtrain.parallel.selection import whole_blocks_problem

        try:
            problem = whole_blocks_problem(Layout.create(p.layout, p.cp_size, p.granularity), recipe.data.seq_len,
                                           a.block_size, a.kind)
        except LayoutError:
            problem = None  # a length the layout cannot split is refused by the trainer with its own message
        if problem is not None:
            raise ConfigError(problem)
    if a.kind == "ulysses" and p.cp_size > 1:
        heads = _model_heads(recipe.model)
        if heads is not None:
            from mtrain.parallel.ulysses import head_split_problem

            problem = head_split_problem(*heads, p.cp_size)
            if problem is not None:
                raise ConfigError(problem)


def _model_heads(m: ModelConfig) -> tuple[int, int] | None:
    """(num_attention_heads, num_key_value_heads) from the model's local config.json, or None when not local."""
    path = Path(m.config) if m.config is not None else Path(m.path) / "config.json" if m.path else None
    if path is None or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    hq = cfg.get("num_attention_heads")
    if not isinstance(hq, int):
        return None
    hkv = cfg.get("num_key_value_heads") or hq
    return hq, hkv


# files any HF tokenizer folder holds one of (tokenizer_config.json alone is not a tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def check_hub_id(key: str, value: str) -> None:
    """A missing local path shaped like a hub id: fine online; offline only when the hub cache holds it."""
    from mtrain.offline import hub_offline

    if not hub_offline():
        return  # online: transformers resolves it from the hub
    from huggingface_hub import try_to_load_from_cache

    wanted = "config.json" if key == "model.path" else "tokenizer_config.json"
    if isinstance(try_to_load_from_cache(value, wanted), str):
        return
    raise ConfigError(
        f"{key}: '{value}' is not a local path and not a hub model in the local cache; fix the path (relative "
        f"paths are taken from the current directory), or run `mtrain --online ...` to download hub model '{value}'"
    )


def _check_model_files(m: ModelConfig) -> None:
    """The local model and tokenizer files the recipe names hold what loading them needs."""
    if m.config is not None:
        if not Path(m.config).is_file():
            raise ConfigError(f"model.config: '{m.config}' is not a file; name a config.json (model.path takes a folder)")
        try:
            parsed = json.loads(Path(m.config).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"model.config: '{m.config}' is not readable JSON ({exc}); restore the file") from None
        if not isinstance(parsed, dict) or "model_type" not in parsed:
            raise ConfigError(f"model.config: '{m.config}' has no 'model_type'; name a HF config.json")
    if m.path is not None and Path(m.path).exists():
        if not (Path(m.path) / "config.json").is_file():
            raise ConfigError(f"model.path: '{m.path}' holds no config.json; name a HF checkpoint folder "
                              "(or use model.config for a config.json file)")
    tokenizer = m.tokenizer or m.path
    if tokenizer is not None and Path(tokenizer).exists():
        if not Path(tokenizer).is_dir() or not any((Path(tokenizer) / f).is_file() for f in TOKENIZER_FILES):
            source = "model.tokenizer" if m.tokenizer else "model.path (the tokenizer defaults to it)"
            raise ConfigError(
                f"{source}: '{tokenizer}' holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                "set model.tokenizer to the folder of the model's tokenizer"
            )


def _check_output_dir(output_dir: str) -> None:
    """train.output_dir must be a folder (or creatable as one): no file in its place or above it."""
    if not output_dir:
        raise ConfigError("train.output_dir: required (the run folder)")
    path = Path(output_dir)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise ConfigError(f"train.output_dir: '{part}' is a file, not a folder; move it away or choose "
                                  "another train.output_dir")
            break


def _check_ranges(recipe: RecipeConfig) -> None:
    """Every number finite and inside the range its meaning allows (a negative clip would negate gradients)."""
    for section in dataclasses.fields(recipe):
        for f in dataclasses.fields(getattr(recipe, section.name)):
            value = getattr(getattr(recipe, section.name), f.name)
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{section.name}.{f.name}: must be a finite number, got {value!r}")
    m, o, t = recipe.model, recipe.optim, recipe.train
    rules = (
        ("optim.lr", o.lr, o.lr > 0, "must be positive"),
        ("optim.grad_clip", o.grad_clip, o.grad_clip >= 0, "must be >= 0 (0 disables clipping)"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, "must be >= 0"),
        ("optim.eps", o.eps, o.eps > 0, "must be positive (e.g. 1e-8)"),
        ("optim.betas", list(o.betas), all(0 <= b < 1 for b in o.betas), "must both be in [0, 1), e.g. [0.9, 0.95]"),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, "must be >= 0"),
        ("train.seed", t.seed, t.seed >= 0, "must be >= 0"),
        ("train.max_bad_steps", t.max_bad_steps, t.max_bad_steps >= 0, "must be >= 0"),
        ("model.rope_theta", m.rope_theta, m.rope_theta is None or m.rope_theta > 0, "must be positive"),
        ("model.max_position_embeddings", m.max_position_embeddings,
         m.max_position_embeddings is None or m.max_position_embeddings > 0, "must be positive"),
    )
    for key, value, ok, rule in rules:
        if not ok:
            raise ConfigError(f"{key}: {rule}, got {value}")
    if m.rope_scaling is not None:
        for name in ("factor", "original_max_position_embeddings"):
            value = m.rope_scaling.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"model.rope_scaling.{name}: must be a positive finite number, got {value}")


def load_recipe(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RecipeConfig:
    """Load a recipe YAML (or only overrides when `path` is None), apply overrides, validate, return it.

    Relative paths inside the recipe are taken from the current directory (run from the repo root).
    """
    recipe = parse_recipe(path, overrides)
    _check(recipe)
    return recipe


def _read_recipe(path: Path, seen: tuple = ()) -> dict:
    """The raw sections of a recipe file. A recipe may start from another (`base: OTHER.yaml`, relative to its
    own folder): it then holds only what differs, key by key inside each section (a key's value, a mapping
    such as model.rope_scaling too, replaces the base's whole)."""
    if not path.is_file():
        raise ConfigError(f"recipe '{path}' does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe '{path}' is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe '{path}' must be a mapping of sections (model, data, train, ...)")
    if "base" not in raw:
        return raw
    base = raw.pop("base")
    if not isinstance(base, str):
        raise ConfigError(f"recipe '{path}': base: expected the path of another recipe, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in seen or base_path == path.resolve():
        raise ConfigError(f"recipe '{path}': base '{base}' leads back to itself")
    inherited = _read_recipe(base_path, seen + (path.resolve(),))
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in inherited.items()}
    for section, values in raw.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = values
    return merged


def parse_recipe(path: str | os.PathLike | None, overrides: list[str] | None = None) -> RecipeConfig:
    """`load_recipe` without the checks that need the run's files (data, model, tokenizer paths) and the
    cross-field checks: keys and types only. For tools that read a recipe's settings (`mtrain bench plan`)."""
    raw = _read_recipe(Path(path)) if path is not None else {}
    raw = apply_overrides(raw, overrides or [])
    sections = {f.name: f.type for f in dataclasses.fields(RecipeConfig)}
    hints = typing.get_type_hints(RecipeConfig)
    built = {}
    for name, value in raw.items():
        if name not in sections:
            raise ConfigError(f"unknown section '{name}'{_suggest(name, sections)}; sections: {', '.join(sections)}")
        built[name] = _build_section(hints[name], name, value)
    return RecipeConfig(**built)
