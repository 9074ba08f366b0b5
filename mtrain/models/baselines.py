"""The baseline attention kinds as HF attention functions: moba and xattention (block-sparse, chosen from q/k
every call; one device or the sparse ring under CP) and ulysses (dense, head-parallel all-to-all under CP).
A plugin of `mtrain.models.registry` (`KINDS`, `register`), registered through its `register_kind`; they read the
same `CONTEXT` (`mtrain.models.context`) as the other kinds."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from mtrain.errors import MtrainError

BASELINE_KINDS = ("moba", "xattention", "ulysses")

# attention.kind -> (sparse?, layout name, or None for the recipe's parallel.layout): the registry's facts of these
# kinds (own settings, not the vertical-slash estimate, so not "sparse" in that sense)
KINDS = {kind: (False, None) for kind in BASELINE_KINDS}


@dataclass(frozen=True)
class BaselineSettings:
    """The recipe's `attention:` keys the baseline kinds read (see mtrain.config.AttentionConfig)."""

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
        from mtrain.ops.moba import check_moba
        from mtrain.ops.xattention import check_xattention

        try:
            check_moba(self.moba_chunk_size, self.moba_topk, self.block_size)
            check_xattention(self.xattn_stride, self.xattn_threshold, self.block_size)
        except ValueError as err:
            raise MtrainError(f"bad baseline attention setting: {err}") from None


def _index(kind: str, q, k, s: BaselineSettings, scaling):
    """The kind's index: the whole sequence's SparseIndex on one device, this rank's RowIndex under CP."""
    from mtrain.models.context import CONTEXT

    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    q, k = q.detach(), k.detach()
    if CONTEXT.group is None:
        from mtrain.ops.moba import moba_index
        from mtrain.ops.xattention import xattention_index

        if kind == "moba":
            return moba_index(q, k, chunk_size=s.moba_chunk_size, topk=s.moba_topk, block_size=s.block_size)
        return xattention_index(q, k, stride=s.xattn_stride, threshold=s.xattn_threshold, block_size=s.block_size,
                                softmax_scale=scale)
    import torch.distributed as dist

    from mtrain.parallel.selection import moba_rank_index, xattention_rank_index

    rank = dist.get_rank(CONTEXT.group)
    if kind == "moba":
        return moba_rank_index(q, k, CONTEXT.layout, rank, CONTEXT.group, chunk_size=s.moba_chunk_size,
                               topk=s.moba_topk, block_size=s.block_size)
    return xattention_rank_index(q, k, CONTEXT.layout, rank, CONTEXT.group, stride=s.xattn_stride,
                                 threshold=s.xattn_threshold, block_size=s.block_size, scale=scale)


def baseline_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, kind: str,
                       settings: BaselineSettings, **kwargs):
    """HF attention function of the baseline kinds (shapes as `mtrain.models.attention.mtrain_attention`):
    query [B, Hq, S_local, D], key/value [B, Hkv, S_local, D] after RoPE -> (out [B, S_local, Hq, D], None).
    A KV cache (generation) runs dense, as for every mtrain kind."""
    from mtrain.models.context import CONTEXT, current_documents, hf_inputs
    from mtrain.models.policy import record_layer

    q, k, v, cached = hf_inputs(module, query, key, value, scaling, dropout)
    if cached is not None:
        return cached, None
    if kind == "ulysses":
        if CONTEXT.group is None:
            from mtrain.ops import dense_attention

            return dense_attention(q, k, v, causal=True, softmax_scale=scaling,
                                   documents=current_documents(CONTEXT.doc_ids)), None
        from mtrain.parallel.ulysses import ulysses_attention

        return ulysses_attention(q, k, v, group=CONTEXT.group, layout=CONTEXT.layout, softmax_scale=scaling,
                                 doc_ids=CONTEXT.doc_ids), None
    index = _index(kind, q, k, settings, scaling)
    record_layer(getattr(module, "layer_idx", None), "sparse", index, None)
    if CONTEXT.group is None:
        from mtrain.ops import vertical_slash_attention

        return vertical_slash_attention(q, k, v, index, softmax_scale=scaling, doc_ids=CONTEXT.doc_ids), None
    from mtrain.parallel import ring_attention

    return ring_attention(q, k, v, group=CONTEXT.group, layout=CONTEXT.layout, index=index, softmax_scale=scaling,
                          inner_group=CONTEXT.inner_group, outer_group=CONTEXT.outer_group,
                          doc_ids=CONTEXT.doc_ids), None


def register_baseline(kind: str, **settings) -> str:
    """Register baseline kind `kind` (BASELINE_KINDS) as `mtrain-<kind>` with BaselineSettings fields as keywords
    (others are ignored: the recipe's vertical-slash keys do not apply). Returns the `attn_implementation` name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from mtrain.models.context import CONTEXT, no_mask

    if kind not in BASELINE_KINDS:
        raise MtrainError(f"'{kind}' is not a baseline attention kind ({', '.join(BASELINE_KINDS)})")
    fields = {f.name for f in dataclasses.fields(BaselineSettings)}
    chosen = BaselineSettings(**{key: value for key, value in settings.items() if key in fields})
    CONTEXT.kind, CONTEXT.sparse, CONTEXT.settings = kind, False, None
    name = f"mtrain-{kind}"
    AttentionInterface.register(name, functools.partial(baseline_attention, kind=kind, settings=chosen))
    AttentionMaskInterface.register(name, no_mask)
    return name


def register(kind: str, *, sparse_policy: str = "always", dense_hold: int = 0, engine: str = "auto", **settings) -> str:
    """The plugin's registration (`mtrain.models.registry.register_kind` calls it for the kinds of KINDS):
    `register_baseline`; the sparse kinds' policy, hold and engine do not apply."""
    return register_baseline(kind, **settings)
