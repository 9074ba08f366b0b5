"""Context parallelism for mtrain: sequence layouts, balanced sparse ring attention (flat and hierarchical)
and the imbalance measure of a sparse index under a layout."""

from mtrain.parallel.estimate import SparseSettings
from mtrain.parallel.imbalance import imbalance
from mtrain.parallel.layout import LAYOUT_NAMES, Layout, LayoutError
from mtrain.parallel.ring import ring_attention

__all__ = ["LAYOUT_NAMES", "Layout", "LayoutError", "SparseSettings", "imbalance", "ring_attention"]
