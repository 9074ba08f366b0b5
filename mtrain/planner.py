"""Cost model of one training step on a cluster (`mtrain bench plan`): per-rank FLOPs, memory, bytes per link and
the expected step time of a model shape at a sequence length and CP size, flat or hierarchical ring, and whether
it fits. Attention times come from `mtrain.ops.cost` (kernel figures measured on an H200, scaled by a GPU's
relative speed); linear layers from an achieved matmul rate; links from their bandwidths.

Every number is a model, not a measurement: `check()` (`mtrain bench plan --check`) sets it against the runs
measured in BENCHMARKS.md and docs/benchmarks-history.md and states the error, apart for the runs its figures were
fitted on (MEASURED) and the runs they were not (OUT_OF_SAMPLE)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from mtrain.errors import MtrainError
from mtrain.measured import ASSET as MEASURED_ASSET
from mtrain.measured import figure as measured_figure
from mtrain.measured import load as load_measured

GB = 1e9
GiB = float(1 << 30)


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer the cost model needs."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params + embed

    @classmethod
    def from_config(cls, cfg: dict, name: str = "config") -> "ModelShape":
        """From a HF config.json dict (Qwen2 / Llama keys)."""
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(name, int(cfg["num_hidden_layers"]), hidden, heads,
                       int(cfg.get("num_key_value_heads", heads)), int(cfg.get("head_dim") or hidden // heads),
                       int(cfg["intermediate_size"]), int(cfg["vocab_size"]), bool(cfg.get("tie_word_embeddings", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise MtrainError(f"model config {name}: not a decoder config with hidden_size, num_hidden_layers, "
                              f"num_attention_heads, intermediate_size, vocab_size ({exc})") from None


# Shapes of the models the recipes name (from their HF config.json files), so the planner runs offline.
SHAPES = {
    "qwen2.5-0.5b": ModelShape("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, True),
    "qwen2.5-3b": ModelShape("qwen2.5-3b", 36, 2048, 16, 2, 128, 11008, 151936, True),
    "llama3.1-8b": ModelShape("llama3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, False),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True),
}
_HUB_IDS = {"qwen/qwen2.5-0.5b": "qwen2.5-0.5b", "qwen/qwen2.5-3b": "qwen2.5-3b",
            "meta-llama/llama-3.1-8b": "llama3.1-8b", "meta-llama/meta-llama-3.1-8b": "llama3.1-8b"}


def load_shape(spec: str) -> ModelShape:
    """A shape by name (SHAPES), from a config.json file or a model folder holding one, or a known hub id."""
    key = spec.strip().lower()
    if key in SHAPES:
        return SHAPES[key]
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        try:
            with open(path) as f:
                return ModelShape.from_config(json.load(f), name=os.path.basename(os.path.dirname(path)) or path)
        except json.JSONDecodeError as exc:
            raise MtrainError(f"{path}: not a JSON config ({exc})") from None
    if key.rstrip("/") in _HUB_IDS:
        return SHAPES[_HUB_IDS[key.rstrip("/")]]
    raise MtrainError(f"model {spec!r}: not a config.json, a model folder or a known shape; use one of "
                      f"{', '.join(SHAPES)} or a path to a HF config.json")


@dataclass(frozen=True)
class Gpu:
    """A GPU kind: memory, achieved bf16 matmul rate, attention speed relative to the H200 figures of
    mtrain.ops.cost, NVLink and network bandwidth per GPU (GB/s, one direction), host-to-device (PCIe) GB/s."""

    name: str
    memory_gb: float
    matmul_tflops: float
    attention_speed: float
    nvlink_gbs: float
    network_gbs: float
    pcie_gbs: float = 25.0


# matmul_tflops: fitted on the H200 training steps of BENCHMARKS.md (`mtrain bench plan --check`); the others
# scaled by peak bf16 throughput (A100 312 / H100 989 / H200 989 TFLOP/s) and their usual links.
GPUS = {
    "h200": Gpu("h200", 141.0, 390.0, 1.0, 450.0, 50.0, 50.0),
    "h100": Gpu("h100", 80.0, 370.0, 0.95, 450.0, 50.0, 50.0),
    "a100-40gb": Gpu("a100-40gb", 40.0, 125.0, 0.33, 300.0, 25.0, 25.0),
    "a100-80gb": Gpu("a100-80gb", 80.0, 125.0, 0.33, 300.0, 25.0, 25.0),
    # this workplace's CPU box (fp32, attention from mtrain.ops.cost.CPU; gloo over loopback): for --check
    "cpu": Gpu("cpu", 24.0, 0.05, 1.0, 2.0, 2.0, 2.0),
}


@dataclass(frozen=True)
class PlanSpec:
    """What to plan: model, sequence, parallelism, attention and the cluster."""

    shape: ModelShape
    seq_len: int
    cp: int
    gpus: int
    node_size: int = 8
    ring: str = "hierarchical"  # or "flat"
    gpu: Gpu = GPUS["h200"]
    attention: str = "sparse"  # or "dense"
    density: float = 0.05
    """Fraction of causal pairs the sparse index computes (the paper: ~95% sparse at 128K+)."""
    verticals: int = 1024
    """Vertical columns per head (a share of the density; they also set the off-ring side traffic)."""
    block_size: int = 64
    scored_rows: int = 64 + 16 * 64
    max_vertical: int = 16384
    max_slash: int = 16384
    """attention.max_slash: slash lines per head (token diagonals; the ring plan's block lists hold one entry per
    block offset)."""
    grad_accum: int = 1
    checkpointing: bool = True
    offload: bool = True
    loss_chunk: int = 4096
    mlp_chunk: int = 0
    """model.mlp_chunk: tokens per checkpointed MLP chunk (0 = the whole shard at once)."""
    offload_activations: bool = False
    """train.offload_activations: the activation checkpoints (and what the graph saves outside the layers) wait in
    pinned host memory."""
    ring_plans_held: bool = False
    """Every layer's sparse ring plan held by the autograd graph from its forward to its backward: the ring Functions
    before their plans went through save_for_backward (mtrain.parallel.saved_state; issue #28's 1M out-of-memory)."""
    host_memory_gb: float = 1024.0
    """Host memory per node (optimizer offload)."""
    latency_us: float = 10.0
    estimate_cost: tuple | None = None
    """(ms0, ms per 1e9 head-row-keys) of the online estimate, in place of the cost table's (the measured runs
    of MEASURED that predate an estimator change keep the figures of the estimator they ran)."""
    """Per-hop latency of a collective (a tree: 2 log2(W) hops)."""
    cpu_adam_params_per_s: float = 2e9
    """CPU Adam throughput of one node (parameters per second), under optimizer offload."""

    def check(self) -> list[str]:
        """Problems that make the spec invalid (raised) as one-line messages."""
        errors = []
        if self.seq_len < 1 or self.cp < 1 or self.gpus < 1 or self.node_size < 1:
            errors.append("seq_len, cp, gpus and node_size must be >= 1")
        elif self.gpus % self.cp:
            errors.append(f"cp {self.cp} must divide the {self.gpus} GPUs (the rest is data parallelism)")
        elif self.seq_len % (self.cp * self.block_size):
            errors.append(f"seq_len {self.seq_len} must be a multiple of cp x block size = {self.cp * self.block_size} "
                          "(block-stripe layout)")
        if self.ring not in ("flat", "hierarchical"):
            errors.append(f"ring must be flat or hierarchical; got {self.ring!r}")
        if self.attention not in ("dense", "sparse"):
            errors.append(f"attention must be dense or sparse; got {self.attention!r}")
        if not 0 < self.density <= 1:
            errors.append(f"density must be in (0, 1]; got {self.density}")
        if self.gpus > self.node_size and self.gpus % self.node_size:
            errors.append(f"{self.gpus} GPUs do not fill nodes of {self.node_size}")
        if self.ring == "hierarchical" and self.cp > self.node_size and self.cp % self.node_size:
            errors.append(f"a hierarchical ring needs a CP size that is a multiple of the node size {self.node_size}; "
                          f"got {self.cp}")
        return errors


def _tree(world: int) -> float:
    return 2 * math.log2(world) if world > 1 else 0.0


@dataclass
class Plan:
    """Per-rank figures of one micro-step (one sequence forward + backward) and of one optimizer step."""

    spec: PlanSpec
    flops: dict = field(default_factory=dict)
    memory_gb: dict = field(default_factory=dict)
    host_gb: dict = field(default_factory=dict)
    link_bytes: dict = field(default_factory=dict)
    times_s: dict = field(default_factory=dict)
    fits: bool = True
    notes: list = field(default_factory=list)

    @property
    def micro_s(self) -> float:
        return sum(v for k, v in self.times_s.items() if not k.startswith("optimizer step:"))

    @property
    def step_s(self) -> float:
        return self.spec.grad_accum * self.micro_s + sum(
            v for k, v in self.times_s.items() if k.startswith("optimizer step:"))

    @property
    def bound(self) -> str:
        parts = {k: v * (1 if k.startswith("optimizer step:") else self.spec.grad_accum)
                 for k, v in self.times_s.items()}
        top = max(parts, key=parts.get)
        return f"{top} ({parts[top] / max(self.step_s, 1e-12):.0%} of the step)"


def attention_layer_ms(spec: PlanSpec, world: int | None = None) -> dict:
    """Milliseconds of one layer's attention on one rank in a training micro-step (forward + backward, and the
    forward again under activation checkpointing): kernels, the online estimate and the rank's index rows."""
    from mtrain.ops import cost

    s = spec.shape
    w = spec.cp if world is None else world
    S, bs = spec.seq_len, spec.block_size
    speed = spec.gpu.attention_speed
    table = cost.H200 if spec.gpu.name != "cpu" else cost.CPU
    if spec.estimate_cost is not None:
        table = dataclasses.replace(table, estimate=tuple(spec.estimate_cost))
    recompute = 1 if spec.checkpointing else 0
    if spec.attention == "dense":
        train = cost.dense_ms(S, s.q_heads, s.head_dim, backward=True, table=table) / w
        fwd = cost.dense_ms(S, s.q_heads, s.head_dim, backward=False, table=table) / w
        return {"kernels": (train + recompute * fwd) / speed, "estimate": 0.0, "index": 0.0}
    n_blocks = S // bs
    col_entries = s.q_heads * spec.verticals * n_blocks / 2  # a vertical is a column of the rows after it
    pairs = spec.density * S * (S + 1) / 2 * s.q_heads
    blocks = max(pairs - col_entries * bs, 0.0) / bs ** 2
    args = dict(seq_len=S, heads=s.q_heads, head_dim=s.head_dim, block_size=bs, table=table, world=w)
    # cost.sparse_ms divides all kernel work by the world; on a ring only the listed work shrinks: each of the W
    # steps pays the call's fixed part and touches every local row (softmax state, output), so those stay whole
    fixed = (cost.sparse_ms(0, 0, backward=True, with_index=False, **{**args, "world": 1}),
             cost.sparse_ms(0, 0, backward=False, with_index=False, **{**args, "world": 1}))
    train = cost.sparse_ms(blocks, col_entries, backward=True, with_index=False, **args) + fixed[0] * (1 - 1 / w)
    fwd = cost.sparse_ms(blocks, col_entries, backward=False, with_index=False, **args) + fixed[1] * (1 - 1 / w)
    whole_index = (cost.sparse_ms(blocks, col_entries, backward=False, with_index=True, **args)
                   - cost.sparse_ms(blocks, col_entries, backward=False, with_index=False, **args))
    i0 = table.index[0]
    index = i0 + (whole_index - i0) / w  # each rank builds only its own rows (the fixed part stays)
    estimate = cost.estimate_ms(S, s.q_heads, spec.scored_rows, table=table, world=w)
    calls = 1 + recompute  # checkpointing recomputes the forward: the estimate and index run again
    return {"kernels": (train + recompute * fwd) / speed, "estimate": calls * estimate / speed,
            "index": calls * index / speed, "index_whole_ms": calls * whole_index / speed}


def ring_plan_bytes(spec: PlanSpec) -> float:
    """Bytes of one layer's sparse ring plan on one rank (mtrain.parallel.plan.build_sparse_plan from a RowIndex with
    bounded widths): the off-ring columns' lists [B, Hq, local query blocks, sink + verticals] int32 three times (the
    plan's, the column step's shifted copy, the kernels' document-filtered copy) and the per-origin block lists
    (cp x [B, Hq, local query blocks, slash offsets + 2] int32)."""
    s = spec.shape
    rows = spec.seq_len / spec.cp / spec.block_size
    columns = min(spec.block_size, spec.seq_len) + spec.verticals
    offsets = spec.max_slash / spec.block_size + 2
    return 4 * s.q_heads * rows * (3 * columns + spec.cp * offsets)


def memory_terms(spec: PlanSpec) -> dict:
    """GiB per GPU of each term of one micro-step's memory, finer than `plan`'s sum (which is fitted and checked
    against measured peaks): what stays from the forward to the backward, and the largest transient of each pass
    (one layer's, under activation checkpointing). Bytes: bf16 activations, a rank's T = seq_len / cp tokens."""
    s = spec.shape
    T = spec.seq_len / spec.cp
    h, inter, dq = s.hidden, s.intermediate, s.q_heads * s.head_dim
    dkv = s.kv_heads * s.head_dim
    chunk = min(T, spec.mlp_chunk) if spec.mlp_chunk else T
    plan_layer = ring_plan_bytes(spec) if spec.attention == "sparse" and spec.cp > 1 else 0.0
    rows = T / spec.block_size
    gib = GiB
    held = {
        "weights (bf16)": 2 * s.params,
        "activation checkpoints (layer inputs)": 0 if spec.offload_activations else s.layers * T * h * 2,
        "final norm saved + LM-head input (fp32 in, bf16 out)": 0 if spec.offload_activations else T * h * (4 + 2 + 2),
        "ring plans held by the graph (all layers)": s.layers * plan_layer if spec.ring_plans_held else 0.0,
    }
    forward = {
        "MLP gate, up, act(gate) (one chunk)": 3 * chunk * inter * 2,
        "MLP chunks' outputs + their concatenation": 2 * T * h * 2 if spec.mlp_chunk else 0.0,
        "attention q, k, v, out (+ lse fp32)": T * (2 * dq + 2 * dkv) * 2 + T * s.q_heads * 4,
        # the column lists' build holds ~4 int32 copies at once (the clamped ids, their slots, the two shifted forms)
        "index rows + plan build (int32 column lists)": 4 * 4 * s.q_heads * rows * (spec.block_size + spec.verticals)
        + plan_layer,
    }
    backward = {
        "one layer recomputed + its gradients (fitted, MLP share per chunk)":
            T * (2 * (6 * h + 6 * inter) + 4 * dq) - (T - chunk) * 12 * inter,
        "the layer's recomputed ring plan": plan_layer,
        "loss chunk (bf16 logits, fp32 logits, log-softmax, its gradient)": spec.loss_chunk * s.vocab * (2 + 4 + 4 + 4),
    }
    held_total = sum(held.values())
    out = {k: v / gib for k, v in held.items()}
    out.update({f"forward: {k}": v / gib for k, v in forward.items()})
    out.update({f"backward: {k}": v / gib for k, v in backward.items()})
    out["peak in the forward (held + forward)"] = (held_total + sum(forward.values())) / gib
    out["peak in the backward (held + max(layer, loss chunk) + plan)"] = (
        held_total + max(backward["one layer recomputed + its gradients (fitted, MLP share per chunk)"]
                         + plan_layer, backward["loss chunk (bf16 logits, fp32 logits, log-softmax, its gradient)"])) / gib
    return out


def _flops(spec: PlanSpec) -> dict:
    """FLOPs per rank per micro-step: the linear layers (LM head included), attention as it runs (dense, or the
    sparse density's share) and attention as it would run dense."""
    s, w, S = spec.shape, spec.cp, spec.seq_len
    tokens = S / w  # per rank
    recompute = 1 if spec.checkpointing else 0
    linear = 2 * s.layers * s.layer_params * tokens * (3 + recompute) + 2 * s.hidden * s.vocab * tokens * 3
    attn_dense = 2 * s.q_heads * s.head_dim * S * S / w * s.layers * (3.5 + recompute)  # fwd 2, bwd 5 of 4*S^2/2*D
    frac = 1.0 if spec.attention == "dense" else spec.density
    return {"linear (incl. LM head)": linear, "attention": attn_dense * frac, "attention if dense": attn_dense}


def _memory(spec: PlanSpec, out: Plan, kv_shard: float, columns: int, per_rank: float) -> None:
    """Fill `out`'s memory per GPU (GB, with its total) and host memory per node, and mark it as not fitting (with
    a note) when either is over what the GPU or the node holds. kv_shard: bytes of a rank's K/V shard; columns,
    per_rank: the distinct vertical columns at worst and those one rank owns."""
    s, g = spec.shape, spec.gpu
    w, S = spec.cp, spec.seq_len
    world = spec.gpus
    nodes = max(1, world // spec.node_size)
    tokens = S / w  # per rank
    n = s.params
    w_bytes = 2 * n
    opt = 12 * n / world  # fp32 master + Adam m, v partitioned by ZeRO over all ranks
    bucket = min(2 * n, 0.5 * GB)  # DeepSpeed's reduce bucket
    grads = bucket if spec.offload else 2 * n / world + bucket  # offload: the gradient partition lives on the host
    ckpt = s.layers * tokens * s.hidden * 2 if spec.checkpointing else 0
    # one layer's working set per token in its backward (fitted: 3B shape on one H200, 128K-384K, within 3%); the
    # MLP's share (12 bytes per intermediate unit and token) follows model.mlp_chunk's chunk
    per_token_layer = 2 * (6 * s.hidden + 6 * s.intermediate) + 4 * s.q_heads * s.head_dim
    mlp_tokens = min(tokens, spec.mlp_chunk) if spec.mlp_chunk else tokens
    layer = (tokens * per_token_layer - (tokens - mlp_tokens) * 12 * s.intermediate) * (
        1 if spec.checkpointing else s.layers)
    logits = spec.loss_chunk * s.vocab * (2 + 4)  # a chunk's bf16 logits and fp32 gradient (not with a layer's)
    col_row = 2 * s.kv_heads * s.head_dim
    kv_buffers = 2 * kv_shard + 2 * kv_shard * 2 + (columns * col_row * (2 + 4) + w * per_rank * col_row * 2)
    rows_per_rank = S // spec.block_size / w
    list_width = spec.density * S / spec.block_size + 2  # listed blocks of a mean row, sink and diagonal
    index = s.q_heads * rows_per_rank * (list_width + spec.verticals) * 4 * 2 if spec.attention == "sparse" else 0
    host_ckpt = ckpt if spec.offload_activations else 0.0
    out.memory_gb = {"weights (bf16)": w_bytes / GB, "gradients (ZeRO-2 part + bucket)": grads / GB,
                     "optimizer (ZeRO-2)": 0.0 if spec.offload else opt / GB,
                     "activation checkpoints": (ckpt - host_ckpt) / GB,
                     "working set (a layer or the loss chunk)": max(layer, logits) / GB,
                     "ring KV buffers + columns": kv_buffers / GB, "index rows (one layer)": index / GB}
    if spec.ring_plans_held and spec.attention == "sparse" and w > 1:
        out.memory_gb["ring plans held (every layer)"] = s.layers * ring_plan_bytes(spec) / GB
    total = sum(out.memory_gb.values())
    out.memory_gb["total"] = total
    host = (12 * n + 4 * n / world * min(world, spec.node_size)) / nodes if spec.offload else 0.0
    host += host_ckpt * min(world, spec.node_size)
    out.host_gb = {"optimizer offload per node": host / GB, "host memory per node": spec.host_memory_gb}
    if host_ckpt:
        out.host_gb["of which activation checkpoints"] = host_ckpt * min(world, spec.node_size) / GB
    if total > g.memory_gb:
        out.fits = False
        out.notes.append(f"does not fit: {total:.1f} GB per GPU > {g.memory_gb:.0f} GB")
    if host / GB > spec.host_memory_gb:
        out.fits = False
        out.notes.append(f"optimizer offload needs {host / GB:.0f} GB per node > {spec.host_memory_gb:.0f} GB")


def _link_bytes(spec: PlanSpec, traffic, kv_shard: float) -> dict:
    """Bytes per link: the ring's K/V over NVLink and over the network and the side traffic (columns, estimate)
    per micro-step, all layers; the gradient sync and the offload's PCIe traffic per optimizer step. traffic: one
    layer's (`mtrain.parallel.traffic.layer_traffic`); kv_shard: bytes of a rank's K/V shard."""
    s, w = spec.shape, spec.cp
    world = spec.gpus
    n = s.params
    cp_nodes = max(1, math.ceil(w / spec.node_size))
    recompute = 1 if spec.checkpointing else 0
    calls = 1 + recompute  # the recomputed forward repeats the forward's traffic
    ring_fwd = (w - 1) * kv_shard
    ring_per_layer = traffic.ring_kv + recompute * ring_fwd
    side_per_layer = traffic.columns_after + calls * traffic.estimate
    hier = spec.ring == "hierarchical" and cp_nodes > 1
    if w == 1:
        nvlink, network = 0.0, 0.0
    elif cp_nodes == 1:
        nvlink, network = ring_per_layer, 0.0
    elif hier:  # the outer ring sends one shard per inner ring across nodes; the inner steps stay in the node
        outer = (cp_nodes - 1) / (w - 1)
        nvlink, network = ring_per_layer * (1 - outer), ring_per_layer * outer
    else:  # a flat ring crosses a node boundary at every step for the node's edge ranks: the slowest link sets it
        nvlink, network = 0.0, ring_per_layer
    side_link = "network" if cp_nodes > 1 else "nvlink"
    grad_sync = 2 * 2 * n * (world - 1) / world  # ZeRO-2: reduce-scatter of bf16 gradients + all-gather of weights
    return {"ring KV, NVLink (per micro-step)": nvlink * s.layers,
            "ring KV, network (per micro-step)": network * s.layers,
            f"side traffic, {side_link} (per micro-step)": side_per_layer * s.layers,
            "  same, before #17 (column all-reduce, all candidates)":
                (traffic.columns_before + calls * traffic.estimate_before) * s.layers,
            "gradient sync (per optimizer step)": grad_sync,
            "offload PCIe (per optimizer step)": 6 * n / world if spec.offload else 0.0}


def _times(spec: PlanSpec, linear: float, traffic, kv_shard: float) -> dict:
    """Seconds per micro-step of each part (linear layers, attention kernels, the sparse estimate and index and, on
    a ring, the transfers and collectives the compute does not hide), then those of the optimizer step (gradient
    sync, CPU Adam with offload). linear: the micro-step's linear FLOPs; traffic and kv_shard as `_link_bytes`."""
    s, g = spec.shape, spec.gpu
    w = spec.cp
    world = spec.gpus
    nodes = max(1, world // spec.node_size)
    cp_nodes = max(1, math.ceil(w / spec.node_size))
    local = min(w, spec.node_size)
    n = s.params
    recompute = 1 if spec.checkpointing else 0
    calls = 1 + recompute  # the recomputed forward repeats the forward's traffic
    hier = spec.ring == "hierarchical" and cp_nodes > 1
    grad_sync = 2 * 2 * n * (world - 1) / world  # ZeRO-2: reduce-scatter of bf16 gradients + all-gather of weights
    at = attention_layer_ms(spec)
    linear_s = linear / (g.matmul_tflops * 1e12)
    kernel_s = at["kernels"] * s.layers / 1e3
    times = {"linear layers (matmul)": linear_s, "attention kernels": kernel_s,
             "sparse estimate + index": (at["estimate"] + at["index"]) * s.layers / 1e3}
    if w > 1:
        step_compute = at["kernels"] / 1e3 / (2 + recompute) / w  # one ring step of one pass (fwd ~ 1/3 of the work)
        shard_s = kv_shard / (g.network_gbs * GB if (cp_nodes > 1 and not hier) else g.nvlink_gbs * GB)
        exposed = max(0.0, shard_s - step_compute) * (w - 1) * (1 + recompute) + max(0.0, 3 * shard_s - 2 * step_compute) * (w - 1)
        if hier:  # the outer shard must arrive within one inner ring
            outer_s = kv_shard / (g.network_gbs * GB)
            exposed += max(0.0, outer_s - local * step_compute) * (cp_nodes - 1) * (2 + recompute)
        times["ring transfers (exposed)"] = exposed * s.layers
        bw = (g.network_gbs if cp_nodes > 1 else g.nvlink_gbs) * GB
        lat = spec.latency_us * 1e-6 * _tree(w)
        est_collectives = 8 if spec.attention == "sparse" else 0
        # the estimate's collectives are synchronous; the column gather/reduce overlap the ring steps
        col_s = traffic.columns_after / bw
        ring_s = at["kernels"] / 1e3
        times["estimate collectives"] = calls * (est_collectives * lat + traffic.estimate / bw) * s.layers
        times["column gather (exposed)"] = max(0.0, col_s - ring_s * (w - 1) / w) * s.layers
    sync_bw = (g.network_gbs if nodes > 1 else g.nvlink_gbs) * GB
    times["optimizer step: gradient sync"] = grad_sync / sync_bw
    if spec.offload:
        per_node = n / world * min(world, spec.node_size)
        times["optimizer step: CPU Adam + PCIe"] = per_node / spec.cpu_adam_params_per_s + 6 * n / world / (g.pcie_gbs * GB)
    return times


def plan(spec: PlanSpec) -> Plan:
    """The cost model (see the module docstring); raises MtrainError on an invalid spec."""
    from mtrain.parallel.traffic import expected_per_rank, layer_traffic

    errors = spec.check()
    if errors:
        raise MtrainError("; ".join(errors))
    s = spec.shape
    out = Plan(spec)
    w, S = spec.cp, spec.seq_len
    dp = spec.gpus // w
    tokens = S / w  # per rank
    out.flops = _flops(spec)  # per rank per micro-step
    kv_shard = tokens * s.kv_heads * s.head_dim * 2 * 2
    columns = 0
    if spec.attention == "sparse" and w > 1:
        columns = min(S, spec.block_size + s.q_heads * spec.verticals)  # distinct columns at worst (all heads)
    per_rank = expected_per_rank(columns, w, min(spec.block_size, S)) if columns else 0
    _memory(spec, out, kv_shard, columns, per_rank)  # per GPU (GB)
    # bytes per link, per micro-step (all layers)
    traffic = layer_traffic(world=w, seq_len=S, q_heads=s.q_heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                            columns=columns, per_rank=per_rank, block_size=spec.block_size,
                            scored_rows=spec.scored_rows, vertical_cap=spec.max_vertical,
                            sparse=spec.attention == "sparse")
    out.link_bytes = _link_bytes(spec, traffic, kv_shard)
    out.times_s = _times(spec, out.flops["linear (incl. LM head)"], traffic, kv_shard)  # per micro-step
    if dp > 1:
        out.notes.append(f"data parallel x{dp}: {dp} sequences per micro-step across the cluster")
    return out


def format_plan(p: Plan) -> str:
    s = p.spec
    sh = s.shape
    lines = [f"plan: {sh.name} ({sh.params / 1e9:.2f} B params, {sh.layers} layers, {sh.q_heads}/{sh.kv_heads} heads x "
             f"{sh.head_dim}), {s.seq_len:,} tokens, CP={s.cp} over {s.gpus} x {s.gpu.name} "
             f"({max(1, s.gpus // s.node_size)} node(s) of {min(s.node_size, s.gpus)}), {s.ring} ring, "
             f"{s.attention} attention" + (f" (density {s.density:.3f}, {s.verticals} verticals/head)"
                                         if s.attention == "sparse" else "")
             + f", grad_accum {s.grad_accum}, ZeRO-2{' + optimizer offload' if s.offload else ''}"]
    lines.append("per rank, per micro-step (one sequence fwd+bwd" + (", checkpointed" if s.checkpointing else "") + "):")
    lines.append("  FLOPs: " + ", ".join(f"{k} {v / 1e12:,.1f} TFLOP" for k, v in p.flops.items()))
    lines.append("  memory per GPU (GB):")
    for k, v in p.memory_gb.items():
        lines.append(f"    {k:<40} {v:10.2f}")
    if s.offload:
        lines.append(f"  host memory per node: {p.host_gb['optimizer offload per node']:.0f} GB of "
                     f"{p.host_gb['host memory per node']:.0f} GB")
    lines.append("  bytes sent per rank (GB):")
    for k, v in p.link_bytes.items():
        lines.append(f"    {k:<55} {v / GB:10.3f}")
    lines.append("  time (s):")
    for k, v in p.times_s.items():
        lines.append(f"    {k:<40} {v:10.3f}")
    tokens_s = s.seq_len * (s.gpus // s.cp) * s.grad_accum / p.step_s
    lines.append(f"expected: micro-step {p.micro_s:.2f} s, optimizer step {p.step_s:.1f} s "
                 f"({tokens_s:,.0f} tokens/s for the cluster); bound by {p.bound}")
    lines.append(("FITS" if p.fits else "DOES NOT FIT") + (": " + "; ".join(p.notes) if p.notes else ""))
    return "\n".join(lines)


# Runs measured in BENCHMARKS.md and docs/benchmarks-history.md: (label, spec overrides, what was measured, value).
# "step" = seconds per training step (1 sequence, no accumulation), "attn" = ms of one attention call (fwd+bwd,
# no checkpointing, index given: kernels + ring), "mem" = peak GPU GB. The measured values are result rows of
# benchmarks/results.jsonl (`planner.measured.*`, two `train.qwen25_3b.*`: each with its date, machine, versions and
# command), read from mtrain/assets/measured.json (`python scripts/measured_asset.py` writes it from the rows); the
# specs below describe the runs.
_HEADS_16 = ModelShape("attention 16/16 x 128", 1, 2048, 16, 16, 128, 1, 1)
_HEADS_16_2 = ModelShape("attention 16/2 x 128", 1, 2048, 16, 2, 128, 1, 1)
# CPU gloo, 2 ranks, fp32, 8K tokens, 4/2 heads x 32 (tools/bench_ring_cpu.py, 2026-11-24, median of 3, twice)
_CPU_HEADS = ModelShape("attention 4/2 x 32", 1, 128, 4, 2, 32, 1, 1)
# Runs the model was NOT fitted on (out of sample): SmolLM2-135M on 4 H100s of one node, CP=4, ZeRO-2 without
# offload, activation checkpointing, 64-token blocks (docs/benchmarks-history.md, "End to end on 4 GPUs", 2026-11-27;
# density as measured). Step = tokens per sequence / the median tokens/s; peak memory converted from GiB to GB.
_E2E4 = dict(shape="smollm2-135m", gpus=4, cp=4, node_size=4, ring="flat", gpu=GPUS["h100"], offload=False,
             loss_chunk=8192, scored_rows=64 + 16 * 64)


def measured_runs(figures: dict, path=MEASURED_ASSET) -> tuple[list, list]:
    """(MEASURED, OUT_OF_SAMPLE) with the measured values of `figures` (`mtrain.measured.load(path)`'s
    {measure: value}); MeasuredAssetError naming the file and a figure it lacks."""

    def got(measure: str):
        return measured_figure(figures, measure, path)

    # The training-step runs (2026-11-22) predate the estimator rewrite of 2026-11-24, which cut the estimate's cost
    # about 4x: they are checked with the estimate figures the model was validated with before it.
    old_estimate = (got("planner.measured.estimate_2026_11_24.ms0"),
                    got("planner.measured.estimate_2026_11_24.per_1e9"))
    small = dict(shape="qwen2.5-0.5b", offload=False, loss_chunk=8192, gpus=1, cp=1, scored_rows=64,
                 estimate_cost=old_estimate)
    big = dict(shape="qwen2.5-3b", gpus=1, cp=1, verticals=32, loss_chunk=8192, scored_rows=64,
               estimate_cost=old_estimate)
    run = "planner.measured.in_sample."
    measured = [
        ("1 GPU 0.5B dense 64K", dict(small, seq_len=65536, attention="dense"), "step",
         got(run + "qwen25_05b.dense_64k.step_s")),
        ("1 GPU 0.5B dense 128K", dict(small, seq_len=131072, attention="dense"), "step",
         got(run + "qwen25_05b.dense_128k.step_s")),
        ("1 GPU 0.5B sparse 64K (3.0%)", dict(small, seq_len=65536, density=0.030, verticals=32), "step",
         got(run + "qwen25_05b.sparse_64k.step_s")),
        ("1 GPU 0.5B sparse 128K (1.5%)", dict(small, seq_len=131072, density=0.015, verticals=32), "step",
         got(run + "qwen25_05b.sparse_128k.step_s")),
        ("1 GPU 0.5B dense 128K peak", dict(small, seq_len=131072, attention="dense"), "mem",
         got(run + "qwen25_05b.dense_128k.peak_gb")),
        ("1 GPU 3B offload 128K (3.2%)", dict(big, seq_len=131072, density=0.032), "step",
         got(run + "qwen25_3b_offload.sparse_128k.step_s")),
        ("1 GPU 3B offload 256K (1.6%)", dict(big, seq_len=262144, density=0.016), "step",
         got(run + "qwen25_3b_offload.sparse_256k.step_s")),
        ("1 GPU 3B offload 384K (1.1%)", dict(big, seq_len=393216, density=0.011), "step",
         got("train.qwen25_3b.longest_one_gpu.step_s")),
        ("1 GPU 3B offload 128K peak", dict(big, seq_len=131072, density=0.032), "mem",
         got(run + "qwen25_3b_offload.sparse_128k.peak_gb")),
        ("1 GPU 3B offload 256K peak", dict(big, seq_len=262144, density=0.016), "mem",
         got(run + "qwen25_3b_offload.sparse_256k.peak_gb")),
        ("1 GPU 3B offload 384K peak", dict(big, seq_len=393216, density=0.011), "mem",
         got("train.qwen25_3b.longest_one_gpu.peak_gb")),
        ("2 GPU CP=2 0.5B sparse 128K (1.6%)", dict(small, seq_len=131072, gpus=2, cp=2, density=0.016, verticals=32),
         "step", 131072 / got(run + "qwen25_05b_cp2.sparse_128k.tokens_per_s")),
        ("CPU gloo 2 ranks ring attention dense 4K/rank", dict(shape=_CPU_HEADS, seq_len=8192, gpus=2, cp=2,
                                                              attention="dense", gpu=GPUS["cpu"]), "attn",
         got(run + "cpu_gloo_ring.dense_4k_per_rank.attn_ms")),
        ("CPU gloo 2 ranks ring attention sparse 4K/rank (25%)", dict(shape=_CPU_HEADS, seq_len=8192, gpus=2, cp=2,
                                                                     density=0.251, verticals=64, gpu=GPUS["cpu"]),
         "attn", got(run + "cpu_gloo_ring.sparse_4k_per_rank.attn_ms")),
    ]
    for cp in (2, 4):
        for tok in (65536, 131072):
            dens = 0.083 * 131072 / (tok * cp)  # the bench's fixed per-row budget: 8.3% of blocks at 128K
            ring = f"{run}ring_cp{cp}.{{}}_{tok >> 10}k_per_gpu.attn_ms"
            measured.append((f"{cp} GPU ring attention dense {tok >> 10}K/GPU",
                             dict(shape=_HEADS_16, seq_len=tok * cp, gpus=cp, cp=cp, attention="dense"), "attn",
                             got(ring.format("dense"))))
            measured.append((f"{cp} GPU ring attention sparse {tok >> 10}K/GPU ({dens:.1%})",
                             dict(shape=_HEADS_16_2, seq_len=tok * cp, gpus=cp, cp=cp, density=dens, verticals=200),
                             "attn", got(ring.format("sparse"))))
    out_of_sample = []
    for length, kind, dens in ((256, "sparse", 0.094), (256, "dense", 0.05), (512, "sparse", 0.054),
                               (512, "dense", 0.05)):
        name = "mtraining" if kind == "sparse" else "dense ring"
        e2e = f"planner.measured.out_of_sample.smollm2_cp4_h100.{name.replace(' ', '_')}_{length}k."
        label = f"4 H100 CP=4 SmolLM2-135M {name} {length}K"
        spec = dict(_E2E4, seq_len=length << 10, attention=kind, density=dens)
        out_of_sample.append((label, spec, "step", (length << 10) / got(e2e + "tokens_per_s")))
        out_of_sample.append((label + " peak", spec, "mem", got(e2e + "peak_gib") * GiB / GB))
    return measured, out_of_sample


MEASURED, OUT_OF_SAMPLE = measured_runs(load_measured())


def spec_from(overrides: dict, **extra) -> PlanSpec:
    kw = {**overrides, **extra}
    shape = kw.pop("shape")
    return PlanSpec(shape=load_shape(shape) if isinstance(shape, str) else shape, **kw)


def predicted(spec: PlanSpec, metric: str) -> float:
    """The model's figure for a measured metric ("step" s, "attn" ms, "mem" GB)."""
    if metric == "attn":  # one attention call, no checkpointing, index given (no estimate / index build)
        one = dataclasses.replace(spec, checkpointing=False)
        at = attention_layer_ms(one)
        kv_shard = spec.seq_len / spec.cp * spec.shape.kv_heads * spec.shape.head_dim * 2 * 2
        step = at["kernels"] / 3 / spec.cp / 1e3
        shard_s = kv_shard / (spec.gpu.nvlink_gbs * GB)
        exposed = max(0.0, shard_s - step) * (spec.cp - 1) + max(0.0, 3 * shard_s - 2 * step) * (spec.cp - 1)
        return at["kernels"] + exposed * 1e3
    p = plan(spec)
    return p.step_s if metric == "step" else p.memory_gb["total"]


def check() -> list[dict]:
    """Every measured run against the model: rows of label, metric, measured, predicted, error and sample ("in":
    MEASURED, the runs its fitted figures come from; "out": OUT_OF_SAMPLE, runs it was not fitted on)."""
    rows = []
    for sample, runs in (("in", MEASURED), ("out", OUT_OF_SAMPLE)):
        for label, overrides, metric, value in runs:
            got = predicted(spec_from(overrides), metric)
            rows.append({"run": label, "metric": metric, "measured": value, "predicted": got,
                         "error": (got - value) / value, "sample": sample})
    return rows
