"""mtrain's attention kinds as HF attention implementations (transformers' AttentionInterface).

`register_attention(recipe)` registers the recipe's kind under the name `mtrain-<kind>` together with a
mask function that returns None (no S x S mask is ever built); the trainer loads the model with
`attn_implementation=` that name. Per-batch facts the attention needs (the CP group, layout, and the
document spans of the packed sample) live in one `AttentionContext` that the trainer sets per micro-batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from mtrain.errors import MtrainError

# attention.kind -> (sparse?, layout name, or None for the recipe's parallel.layout)
KINDS = {
    "dense": (False, None),
    "mtraining": (True, "block-stripe"),
    "zigzag-dense": (False, "zigzag"),
    "zigzag-sparse": (True, "zigzag"),
}


@dataclass
class AttentionContext:
    """What the registered attention functions read; set by the trainer before each forward."""

    kind: str = "dense"
    sparse: bool = False
    settings: object = None
    """mtrain.parallel.SparseSettings for sparse kinds."""
    group: object = None
    """The CP process group (None when cp_size == 1)."""
    layout: object = None
    """mtrain.parallel.Layout of the CP group."""
    inner_group: object = None
    outer_group: object = None
    """Hierarchical ring groups (inner = one node, outer = across nodes), or None for a flat ring."""
    local_world_size: object = None
    """Ranks per node of a hierarchical ring (None: flat)."""
    doc_ids: object = None
    """LongTensor [B, S] of document ids over the WHOLE (global) sequence, or None for one document per row."""
    densities: list = field(default_factory=list)
    """Computed fraction of causal pairs per sparse call (for logging), reset by the trainer each step."""
    imbalances: list = field(default_factory=list)
    """(worker, step) imbalance of the first layer's sparse index under the layout, per forward (logging)."""


CONTEXT = AttentionContext()


def _no_mask(*args, **kwargs):
    """Mask function for mtrain kinds: attention masking is done inside the kernels."""
    return None


def _local_attention(q, k, v, scaling, s=None, doc_ids=None):
    """One rank holds the whole sequence: dense causal, or online vertical-slash sparse attention with
    SparseSettings `s`."""
    from mtrain.ops import dense_attention, estimate_vertical_slash, vertical_slash_attention

    if s is None:
        if doc_ids is None:
            return dense_attention(q, k, v, causal=True, softmax_scale=scaling)
        return _dense_per_document(q, k, v, scaling, doc_ids)
    index = estimate_vertical_slash(q.detach(), k.detach(), recall=s.recall, last_q=min(s.last_q, q.shape[1]),
                                    max_vertical=s.max_vertical, max_slash=s.max_slash, block_size=s.block_size,
                                    min_vertical=s.min_vertical, min_slash=s.min_slash,
                                    share_kv_group=s.share_kv_group, slash_recall=s.slash_recall,
                                    softmax_scale=scaling, doc_ids=doc_ids)
    CONTEXT.densities.append(float(index.density()))
    return vertical_slash_attention(q, k, v, index, softmax_scale=scaling, doc_ids=doc_ids)


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


def _ring(q, k, v, scaling, settings=None, layer_idx=None):
    """This rank's shard of a context-parallel group: dense ring, or sparse with SparseSettings `settings`."""
    import torch.distributed as dist

    from mtrain.parallel import ring_attention
    from mtrain.parallel.estimate import estimate_index

    index = None
    if settings is not None:
        # Estimated across the group (no rank does it for the others); identical on every rank.
        world, rank = dist.get_world_size(CONTEXT.group), dist.get_rank(CONTEXT.group)
        seq_len = q.shape[1] * world
        positions = CONTEXT.layout.indices(seq_len, rank).to(q.device)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        index = estimate_index(q.detach(), k.detach(), positions, positions, seq_len, settings, scale,
                               CONTEXT.group, doc_ids=CONTEXT.doc_ids)
        CONTEXT.densities.append(float(index.density()))
        if layer_idx == 0:  # one layer per forward is enough to watch the balance
            from mtrain.parallel import imbalance

            measured = imbalance(index, CONTEXT.layout, local_world_size=CONTEXT.local_world_size)
            CONTEXT.imbalances.append((float(measured["worker"]), float(measured["step"])))
    return ring_attention(q, k, v, group=CONTEXT.group, layout=CONTEXT.layout, index=index, softmax_scale=scaling,
                          inner_group=CONTEXT.inner_group, outer_group=CONTEXT.outer_group, doc_ids=CONTEXT.doc_ids)


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
                     **kwargs):
    """HF attention function: query [B, Hq, S_local, D], key/value [B, Hkv, S_local, D] after RoPE
    (with a KV cache, key/value hold the cached positions too: then see `_cached_attention`).
    settings: SparseSettings (sparse), None (dense); left out = the last registered kind's (CONTEXT).

    Returns (out [B, S_local, Hq, D], None).
    """
    if settings is False:
        settings = CONTEXT.settings if CONTEXT.sparse else None
    if dropout and module.training:
        raise MtrainError("mtrain attention kinds do not implement attention dropout; set attention_dropout=0")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:
        if CONTEXT.group is not None or CONTEXT.doc_ids is not None:
            raise MtrainError("a KV cache runs on one device over one document: clear the context-parallel "
                              "group and doc_ids (mtrain.models.attention.CONTEXT) before generating")
        return _cached_attention(q, k, v, scaling), None
    if CONTEXT.group is None:
        out = _local_attention(q, k, v, scaling, settings, CONTEXT.doc_ids)
    else:
        out = _ring(q, k, v, scaling, settings, getattr(module, "layer_idx", None))
    return out, None


def register_attention(recipe) -> str:
    """Register the recipe's attention kind with transformers; return the `attn_implementation` name."""
    import dataclasses

    from mtrain.parallel import SparseSettings

    # Every recipe key under `attention:` that is also a SparseSettings field reaches the estimator.
    shared = {f.name for f in dataclasses.fields(SparseSettings)}
    a = recipe.attention
    settings = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name in shared}
    return register_kind(a.kind, **settings)


def register_kind(kind: str, **sparse_settings) -> str:
    """Register attention kind `kind` (see KINDS) as `mtrain-<kind>`; sparse kinds take
    `mtrain.parallel.SparseSettings` fields as keywords. Returns the `attn_implementation` name. Each
    name carries its own settings; registering a name again replaces them for every model using it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from mtrain.parallel import SparseSettings

    if kind not in KINDS:
        raise MtrainError(f"attention kind '{kind}' has no mtrain implementation; use one of {', '.join(KINDS)}")
    sparse, _ = KINDS[kind]
    CONTEXT.kind, CONTEXT.sparse = kind, sparse
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
    AttentionInterface.register(name, functools.partial(mtrain_attention, settings=CONTEXT.settings))
    AttentionMaskInterface.register(name, _no_mask)
    return name


def layout_name(recipe) -> str:
    """The sequence layout an attention kind runs on (zigzag kinds force zigzag)."""
    forced = KINDS.get(recipe.attention.kind, (False, None))[1]
    return forced or recipe.parallel.layout
