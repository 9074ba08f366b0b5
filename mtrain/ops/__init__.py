"""Attention kernels for mtrain: vertical-slash sparse attention (index, estimator, Triton kernels),
dense attention, the ring-facing partial entry points and the pure-PyTorch reference; the MoBA and XAttention
baselines' block selections on the same kernels. No transformers here."""

from mtrain.ops import partial, reference
from mtrain.ops.attention import vertical_slash_attention
from mtrain.ops.dense import dense_attention, dense_backend
from mtrain.ops.estimate import estimate_vertical_slash
from mtrain.ops.index import SparseIndex
from mtrain.ops.moba import moba_attention
from mtrain.ops.partial import merge_partial
from mtrain.ops.partial_autograd import partial_attention
from mtrain.ops.recall import index_row_mask, true_recall
from mtrain.ops.xattention import xattention_attention

__all__ = [
    "SparseIndex",
    "dense_attention",
    "dense_backend",
    "estimate_vertical_slash",
    "index_row_mask",
    "merge_partial",
    "moba_attention",
    "partial",
    "partial_attention",
    "reference",
    "true_recall",
    "vertical_slash_attention",
    "xattention_attention",
]
