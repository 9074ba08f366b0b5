"""The record each sparse-kind call leaves (`LayerRecord`), and what every mtrain attention kind does first with a
call (HF's inputs, a KV-cache call, the mask function).

What the attention reads and writes besides its inputs (settings, the CP group and layout, the packed documents, the
dense/sparse policy's per-layer state, the records) lives in the runtime the model owns
(`mtrain.models.runtime.AttentionRuntime`), found on the module HF calls the attention with (`runtime_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain.errors import MtrainError


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
    """The layer's cap multiplier this call ran with (the runtime's policy.cap_scale; 1 = the recipe's caps)."""
    widened: bool = False
    """True when this call's choice doubled the layer's caps for its next estimate (`mtrain.models.policy.widen`)."""
    escalated_recall: float | None = None
    """The recall this call's layer estimates at where `escalate` raised it (the runtime's policy.layer_recall), else None."""
    index_bytes: int = 0
    """Bytes of this call's index lists on this rank (`mtrain.ops.index.list_bytes`: its rows under CP), 0 where no
    index was estimated."""

    def as_floats(self, read: dict | None = None) -> dict:
        """The record as plain numbers. read: its tensor figures already read back (what `records_as_floats` passes
        for a step's records); None reads them here, in one copy."""
        if read is None:
            return records_as_floats([self])[0]
        out = {"layer": self.layer, "path": self.path, "held": self.held, "dense_ms": self.dense_ms,
               "sparse_ms": self.sparse_ms, "cap_scale": self.cap_scale, "widened": self.widened,
               "escalated_recall": self.escalated_recall, "index_bytes": self.index_bytes}
        for name in TENSOR_FIGURES:
            value = getattr(self, name)
            out[name] = read[name] if name in read else None if value is None else float(value)
        return out


TENSOR_FIGURES = ("density", "est_recall", "true_recall", "output_error")
"""The `LayerRecord` fields that may hold device tensors (read back when the step is logged)."""


def records_as_floats(records) -> list[dict]:
    """`LayerRecord.as_floats` of every record, their tensor figures read back in one copy per device (a step's
    records hold a few hundred: one read each would make the host wait for the device as many times)."""
    slots, parts = [], {}
    for i, record in enumerate(records):
        for name in TENSOR_FIGURES:
            value = getattr(record, name)
            if isinstance(value, torch.Tensor):
                part = parts.setdefault(value.device, [])
                slots.append((i, name, value.device, len(part)))
                part.append(value.detach().float().mean().reshape(1))
    host = {device: torch.cat(part).tolist() for device, part in parts.items()}
    read = [{} for _ in records]
    for i, name, device, j in slots:
        read[i][name] = host[device][j]
    return [record.as_floats(values) for record, values in zip(records, read)]


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
    from mtrain.models.runtime import runtime_of

    rt = runtime_of(module)
    if rt.topology.group is not None or rt.inputs.doc_ids is not None:
        raise MtrainError("a KV cache runs on one device over one document: clear the context-parallel group and "
                          "the documents of the model's runtime (runtime.topology.group, runtime.set_documents(None)) "
                          "before generating")
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
