"""The online estimate replayed from a CUDA graph: `estimate_vertical_slash` launches ~280 small kernels per call,
and at 32K their host launches cost about what their GPU work does. Its shapes depend only on the input shapes
and settings and it makes no host synchronisation, so one capture per (shapes, settings) serves every layer and
step of a training run: the inputs are copied into the graph's buffers, the graph is replayed, and the outputs
are cloned into a fresh `SparseIndex` (each layer keeps its index for the backward). With `prepare=(engine,
num_kv_heads, head_dim)` the graph also holds what that block engine derives from the index (the backward's
transposed lists, column plan and work items; FA4's lists): built eagerly they cost ~100 more launches per layer."""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict

import torch

from mtrain.ops.partial_autograd import join_tensors, split_tensors
from mtrain.ops.estimate import estimate_rows, estimate_vertical_slash
from mtrain.ops.index import SparseIndex
from mtrain.ops.switches import Switches, or_defaults

log = logging.getLogger(__name__)

# Captured graphs kept at once (they share one memory pool per device, `capture`; each keeps its input buffers and
# the packed copy of its index); the least recently used goes first and its key runs eagerly from then on. A
# training run needs one per estimate setting and shape it meets every step: on packed documents one per document
# length that runs sparse, times the recalls its layers estimate at (escalated layers: attention.escalate_recall)
# and their cap scales (six at 256K on the long mix); an eval over many lengths would otherwise keep one per length.
MAX_GRAPHS = 8


class _Graph:
    """One captured estimate: its input buffers (k, and of q only the rows the estimate scores) and the packed copy
    of the index its replays write."""

    def __init__(self, q, k, doc_ids, kwargs, prepare=None):
        self.rows = estimate_rows(k.shape[1], q.device, **kwargs)
        self.q = q.detach()[:, self.rows]  # at 128K x 16 heads x 128, 2112 rows instead of 512 MB
        self.k = k.detach().clone()
        self.doc_ids = None if doc_ids is None else doc_ids.clone()
        kwargs = dict(kwargs, scored_q=True)

        def run():
            index = _estimate(self.q, self.k, self.doc_ids, kwargs, prepare)
            # every output tensor copied, inside the graph, into one flat buffer: a replay's copy is then one clone
            # and a view per tensor (a deep copy of the ~60 tensors costs host time on every layer)
            return index, _Packed(index)

        self.graph, (index, self.packed) = capture(run)
        # The index the capture returned is not kept: a replay rewrites it before packing it, so its memory is one
        # more temporary of the shared pool (other graphs' captures may reuse it), not a second copy held per graph.
        del index

    def __call__(self, q, k, doc_ids) -> SparseIndex:
        torch.index_select(q, 1, self.rows, out=self.q)
        self.k.copy_(k)
        if doc_ids is not None:
            self.doc_ids.copy_(doc_ids)
        self.graph.replay()
        return self.packed.unpack()


# Byte alignment of each tensor in a packed index's flat buffer (a view of any dtype may start there).
_ALIGN = 16


class _Packed:
    """A SparseIndex and everything in its cache (tensors inside tuples, dicts and dataclasses) copied into one flat
    byte buffer (`PackedTree` of its lists and cache: the index itself is rebuilt through its constructor, which
    checks shapes); `unpack` rebuilds an index from a copy of the buffer. Device work only (capturable)."""

    def __init__(self, index: SparseIndex):
        self.tree = PackedTree((index.block_ids, index.block_counts, index.col_ids, index.col_counts, index.seq_len,
                                index.block_size, dict(index._cache)))

    def unpack(self) -> SparseIndex:
        """A new index whose tensors are views into one fresh copy of the buffer (nothing shared with it)."""
        *lists, cache = self.tree.unpack()
        out = SparseIndex(*lists)
        out._cache.update(cache)
        return out


class PackedTree:
    """Any object tree (dataclasses, dicts, tuples, lists; a `mtrain.ops.index.RowIndex` and what its cache holds)
    with its tensors copied into one flat byte buffer, as `_Packed` does for a SparseIndex; tensors in `keep` (by
    identity: inputs that outlive every call, such as cached row lists whose identity callers test) stay referenced
    instead. Device work only (capturable); `unpack` rebuilds the tree from a fresh copy of the buffer. The tensors
    go into the buffer in one concatenation (a kernel or two, where a copy per tensor made ~40 copy kernels per
    replay of an index with FA4's lists)."""

    def __init__(self, obj, keep=()):
        tensors: list = []
        self.layout = split_tensors(obj, tensors)
        kept = {id(t) for t in keep}
        self.kept = {i: t for i, t in enumerate(tensors) if id(t) in kept}
        self.places, size, pieces = [], 0, []
        device = next((t.device for t in tensors), torch.device("cpu"))
        pad = torch.empty(_ALIGN, dtype=torch.uint8, device=device)  # filler between tensors (never read)
        for i, t in enumerate(tensors):
            nbytes = 0 if i in self.kept else t.numel() * t.element_size()
            self.places.append((size, nbytes, t.dtype, tuple(t.shape)))
            if nbytes:
                pieces.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
                gap = -nbytes % _ALIGN
                if gap:
                    pieces.append(pad[:gap])
                size += nbytes + gap
        self.flat = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        if pieces:
            torch.cat(pieces, out=self.flat[:size])

    def unpack(self):
        flat = self.flat.clone()
        views = [self.kept[i] if i in self.kept else flat[at:at + nbytes].view(dtype).view(shape)
                 for i, (at, nbytes, dtype, shape) in enumerate(self.places)]
        return join_tensors(self.layout, views)


def same_tree(a, b) -> bool:
    """Whether two object trees hold equal tensors in the same places: integer and bool tensors exactly, floating
    ones to fp32 rounding (rtol 1e-5, atol 1e-6), and the same non-tensor leaves."""
    ta, tb = [], []
    la, lb = split_tensors(a, ta), split_tensors(b, tb)
    if la != lb or len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        same = torch.allclose(x, y, rtol=1e-5, atol=1e-6) if x.is_floating_point() else torch.equal(x, y)
        if not same:
            return False
    return True


# One memory pool per device that every captured estimate allocates from (`capture`).
_POOLS: dict = {}


def shared_pool(device=None):
    """The memory pool handle that every graph `capture` makes on `device` (default: the current one) shares."""
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    if index not in _POOLS:
        _POOLS[index] = torch.cuda.graph_pool_handle()
    return _POOLS[index]


def capture(run):
    """(the CUDA graph of `run()`, what `run()` returned in the capture): `run` goes once on a side stream first (lazy
    allocations, plans, kernels compiled), then is captured on the current stream; thread_local: CUDA calls of other
    threads (a data loader pinning memory) stay legal during the capture. Replays write the returned outputs; an
    output the caller drops is one more temporary of the pool (the estimate caches keep only the packed copy).

    Every capture on a device allocates from one shared pool (`shared_pool`): a graph's temporaries may lie where an
    earlier graph's temporaries or a later graph's outputs lie, so a replay overwrites what another graph's last
    replay wrote there. Callers copy a replay's outputs out before the next replay of any graph on the stream (both
    estimate caches clone them at once), which makes any replay order safe. Graphs captured in pools of their own
    would each keep their temporaries reserved: one pool per estimate setting a run meets (six at 256K on the long
    mix)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=shared_pool(), capture_error_mode="thread_local"):
        out = run()
    return graph, out


class GraphCache:
    """Captured graphs by key (shapes and settings): a key is "warm" once seen (its kernels compiled), "eager" where
    its capture failed or did not match, or where its graph was dropped, or holds its graph; `keep` keeps at most
    `size` graphs, the least recently used going first. A dropped key is not captured again: with more keys in use
    than `size`, capturing them in turn would drop another each time (a capture, an eager check and a pool freed, which
    waits for the device, per key and step) where eager estimates cost only themselves."""

    def __init__(self):
        self.entries: OrderedDict = OrderedDict()

    def graph(self, key):
        """The graph kept for `key` (now the most recently used), or None."""
        entry = self.entries.get(key)
        if entry is None or isinstance(entry, str):
            return None
        self.entries.move_to_end(key)
        return entry

    def capture_due(self, key) -> bool:
        """For a key without a graph: whether this call captures (its second); the first call marks it warm."""
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = "warm"
        return entry == "warm"

    def refuse(self, key) -> None:
        self.entries[key] = "eager"

    def keep(self, key, graph, size: int) -> None:
        self.entries[key] = graph
        graphs = [name for name, value in self.entries.items() if not isinstance(value, str)]
        for name in graphs[:-size]:
            self.entries[name] = "eager"


# key -> "warm", "eager" or a _Graph
_GRAPHS = GraphCache()


def prepare_engine(index: SparseIndex, prepare) -> None:
    """Build, into `index._cache`, what block engine `engine` derives from the index: prepare = (engine,
    num_kv_heads, head_dim) with engine "triton" (the deterministic backward's plans) or "fa4" (FA4's lists and the
    column path's plans; an index without documents), or None (nothing). Device work only: capturable."""
    if prepare is None:
        return
    engine, num_kv_heads, head_dim = prepare
    if engine == "fa4":
        from mtrain.ops.fa4 import prepare_fa4

        prepare_fa4(index, num_kv_heads, head_dim)
    elif engine == "triton":
        from mtrain.ops._triton_attention import prepare_backward

        prepare_backward(index, num_kv_heads, head_dim)
    else:
        raise ValueError(f"prepare: engine must be 'triton' or 'fa4'; got {engine!r}")


def _estimate(q, k, doc_ids, kwargs, prepare) -> SparseIndex:
    index = estimate_vertical_slash(q, k, doc_ids=doc_ids, **kwargs)
    prepare_engine(index, prepare)
    return index


def _clone(index: SparseIndex) -> SparseIndex:
    """A copy of the index and of everything in its cache that shares no memory with it (as a replay returns)."""
    return _Packed(index).unpack()


def same_index(a: SparseIndex, b: SparseIndex) -> bool:
    """Whether two indices list the same blocks and columns and estimate the same recall (to fp32 rounding)."""
    lists = all(torch.equal(x, y) for x, y in ((a.block_ids, b.block_ids), (a.block_counts, b.block_counts),
                                               (a.col_ids, b.col_ids), (a.col_counts, b.col_counts)))
    ra, rb = a._cache.get("est_recall"), b._cache.get("est_recall")
    return lists and (ra is None) == (rb is None) and (ra is None or torch.allclose(ra, rb, rtol=1e-5, atol=1e-6))


def estimate_graphed(q: torch.Tensor, k: torch.Tensor, *, doc_ids: torch.Tensor | None = None, prepare=None,
                     switches: Switches | None = None, **kwargs) -> SparseIndex:
    """`estimate_vertical_slash(q, k, doc_ids=doc_ids, **kwargs)`, replayed from a CUDA graph on CUDA; with
    `prepare=(engine, num_kv_heads, head_dim)` the graph also builds what that engine derives from the index
    (`prepare_engine`; eagerly the engine builds it on first use, so nothing is built for a layer that runs dense).

    The first call with given shapes and settings runs eagerly (it compiles the kernels); the second captures
    the graph, replays it once and compares the result with an eager run on the same inputs: the graph serves
    the later calls only if the two indices are equal (else, or if capture fails, that key stays eager, with a
    warning). Off CUDA, or with attention.graph_estimate off (`switches.graph_estimate`; None = the defaults), this
    is the eager estimate."""
    if not (or_defaults(switches).graph_estimate and q.is_cuda) or torch.cuda.is_current_stream_capturing():
        return estimate_vertical_slash(q, k, doc_ids=doc_ids, **kwargs)
    key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device, doc_ids is None,
           None if doc_ids is None else tuple(doc_ids.shape), tuple(sorted(kwargs.items())), prepare)
    graph = _GRAPHS.graph(key)
    if graph is not None:
        return graph(q, k, doc_ids)
    if not _GRAPHS.capture_due(key):
        return estimate_vertical_slash(q, k, doc_ids=doc_ids, **kwargs)
    eager = estimate_vertical_slash(q, k, doc_ids=doc_ids, **kwargs)
    try:
        graph = _Graph(q, k, doc_ids, kwargs, prepare)
        replayed = graph(q, k, doc_ids)
    except Exception as exc:  # an op that cannot be captured: this key runs eagerly from now on
        _GRAPHS.refuse(key)
        warnings.warn(f"the pattern estimate could not be captured as a CUDA graph ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:200]}); it runs eagerly")
        return eager
    if not same_index(replayed, eager):
        _GRAPHS.refuse(key)
        warnings.warn("the CUDA-graph replay of the pattern estimate differs from the eager estimate; it runs eagerly")
        return eager
    _GRAPHS.keep(key, graph, MAX_GRAPHS)
    log.info("pattern estimate captured as a CUDA graph for q %s (%d kept)", tuple(q.shape),
             sum(not isinstance(entry, str) for entry in _GRAPHS.entries.values()))
    return eager
