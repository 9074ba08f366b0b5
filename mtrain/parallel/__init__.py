"""Context parallelism for mtrain: sequence layouts, balanced sparse ring attention (flat and hierarchical) on an
index estimated online across the group, and the imbalance measure of a sparse index under a layout."""

from mtrain.parallel.estimate import SparseSettings
from mtrain.parallel.imbalance import imbalance
from mtrain.parallel.layout import LAYOUT_NAMES, Layout, LayoutError
from mtrain.parallel.ring import estimate_ring_index, ring_attention

__all__ = ["LAYOUT_NAMES", "Layout", "LayoutError", "SparseSettings", "estimate_ring_index", "imbalance",
           "ring_attention"]
