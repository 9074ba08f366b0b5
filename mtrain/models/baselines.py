"""The baseline attention kinds as HF attention functions: moba and xattention (block-sparse, chosen from q/k
every call; one device or the sparse ring under CP) and ulysses (dense, head-parallel all-to-all under CP).
A plugin of `mtrain.models.registry` (`KINDS`, `settings_of`, `register`), registered through its `register_kind`;
like the other kinds they read the runtime of the model they run in (`mtrain.models.runtime.runtime_of(module)`):
its settings (`settings.baseline`), CP topology and documents, and they leave their records there."""

from __future__ import annotations

from mtrain.attention_settings import BaselineSettings
from mtrain.errors import MtrainError

BASELINE_KINDS = ("moba", "xattention", "ulysses")

# attention.kind -> (sparse?, layout name, or None for the recipe's parallel.layout): the registry's facts of these
# kinds (own settings, not the vertical-slash estimate, so not "sparse" in that sense)
KINDS = {kind: (False, None) for kind in BASELINE_KINDS}


def _index(rt, kind: str, q, k, s: BaselineSettings, scaling):
    """The kind's index: the whole sequence's SparseIndex on one device, this rank's RowIndex under CP."""
    topo = rt.topology
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    q, k = q.detach(), k.detach()
    if topo.group is None:
        from mtrain.ops.moba import moba_index
        from mtrain.ops.xattention import xattention_index

        if kind == "moba":
            return moba_index(q, k, chunk_size=s.moba_chunk_size, topk=s.moba_topk, block_size=s.block_size)
        return xattention_index(q, k, stride=s.xattn_stride, threshold=s.xattn_threshold, block_size=s.block_size,
                                softmax_scale=scale)
    import torch.distributed as dist

    from mtrain.parallel.selection import moba_rank_index, xattention_rank_index

    rank = dist.get_rank(topo.group)
    if kind == "moba":
        return moba_rank_index(q, k, topo.layout, rank, topo.group, chunk_size=s.moba_chunk_size,
                               topk=s.moba_topk, block_size=s.block_size)
    return xattention_rank_index(q, k, topo.layout, rank, topo.group, stride=s.xattn_stride,
                                 threshold=s.xattn_threshold, block_size=s.block_size, scale=scale)


def baseline_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function of the baseline kinds (shapes as `mtrain.models.attention.mtrain_attention`):
    query [B, Hq, S_local, D], key/value [B, Hkv, S_local, D] after RoPE -> (out [B, S_local, Hq, D], None). The kind
    and its settings are those of the runtime of the model `module` belongs to (`runtime_of`), whose switches the
    ring is given. A KV cache (generation) runs dense, as for every mtrain kind."""
    from mtrain.models.runtime import runtime_of

    rt = runtime_of(module)
    return _baseline(rt, module, query, key, value, scaling, dropout), None


def _baseline(rt, module, query, key, value, scaling, dropout):
    """`baseline_attention`'s work: the call's out [B, S_local, Hq, D]."""
    from mtrain.models.context import hf_inputs
    from mtrain.models.policy import record_layer

    kind, topo, doc_ids = rt.settings.kind, rt.topology, rt.inputs.doc_ids
    if kind not in BASELINE_KINDS or rt.settings.baseline is None:
        raise MtrainError(f"the model's attention runtime is of kind '{kind}', not a baseline kind: attach the "
                          "runtime registry.attention_runtime made for the kind the model was loaded with")
    q, k, v, cached = hf_inputs(module, query, key, value, scaling, dropout)
    if cached is not None:
        return cached
    if kind == "ulysses":
        if topo.group is None:
            from mtrain.ops import dense_attention

            return dense_attention(q, k, v, causal=True, softmax_scale=scaling,
                                   documents=rt.current_documents(doc_ids))
        from mtrain.parallel.ulysses import ulysses_attention

        return ulysses_attention(q, k, v, group=topo.group, layout=topo.layout, softmax_scale=scaling,
                                 doc_ids=doc_ids)
    index = _index(rt, kind, q, k, rt.settings.baseline, scaling)
    record_layer(rt, getattr(module, "layer_idx", None), "sparse", index, None)
    if topo.group is None:
        from mtrain.ops import vertical_slash_attention

        return vertical_slash_attention(q, k, v, index, softmax_scale=scaling, doc_ids=doc_ids)
    from mtrain.parallel import ring_attention

    return ring_attention(q, k, v, group=topo.group, layout=topo.layout, index=index, softmax_scale=scaling,
                          inner_group=topo.inner_group, outer_group=topo.outer_group, doc_ids=doc_ids,
                          switches=rt.switches)


def settings_of(kind: str, *, sparse=None, policy=None, baseline) -> object:
    """The plugin's settings (`mtrain.models.registry.attention_runtime` calls it for the kinds of KINDS, with the
    checked `mtrain.attention_settings` objects): baseline kind `kind` (BASELINE_KINDS) keeps `baseline` (checked
    against the kind: `BaselineSettings.check_for`); the vertical-slash estimate and the policy do not apply."""
    from mtrain.models.runtime import AttentionSettings

    if kind not in BASELINE_KINDS:
        raise MtrainError(f"'{kind}' is not a baseline attention kind ({', '.join(BASELINE_KINDS)})")
    return AttentionSettings.of(kind, baseline=baseline.check_for(kind))


def register(kind: str) -> str:
    """The plugin's registration with transformers (`mtrain.models.registry.attention_runtime` calls it): `kind` as
    `mtrain-<kind>`, whose function (`baseline_attention`) carries no settings (they travel in the model's runtime),
    with a mask function that builds no mask. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from mtrain.models.context import no_mask

    if kind not in BASELINE_KINDS:
        raise MtrainError(f"'{kind}' is not a baseline attention kind ({', '.join(BASELINE_KINDS)})")
    name = f"mtrain-{kind}"
    AttentionInterface.register(name, baseline_attention)
    AttentionMaskInterface.register(name, no_mask)
    return name
