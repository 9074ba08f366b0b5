"""The mtraining kinds (dense, mtraining, zigzag-dense, zigzag-sparse) as HF attention functions: one device
(`_local_attention`: dense, or the vertical-slash estimate and the sparse engine) and a context-parallel group
(`_ring`). A plugin of `mtrain.models.registry`: `KINDS`, `settings_of` and `register` are what the registry reads.
Every call reads the runtime of the model it runs in (`mtrain.models.runtime.runtime_of(module)`) and nothing else:
its settings and switches (passed down to every reader of the stack it calls: `rt.switches`), CP topology, step
inputs, per-layer policy state and records."""

from __future__ import annotations

import contextlib
import logging

import torch

from mtrain.attention_settings import ENGINES
from mtrain.errors import MtrainError
from mtrain.models.context import LayerRecord, hf_inputs, no_mask
from mtrain.models import decision
from mtrain.models.policy import SPARSE_POLICIES, layer_settings, scored_rows
from mtrain.models.runtime import AttentionSettings, runtime_of

log = logging.getLogger(__name__)

# attention.kind -> (sparse?, layout name, or None for the recipe's parallel.layout)
KINDS = {
    "dense": (False, None),
    "mtraining": (True, "block-stripe"),
    "zigzag-dense": (False, "zigzag"),
    "zigzag-sparse": (True, "zigzag"),
}

# ENGINES (imported from mtrain.attention_settings, with the policy's settings): the sparse block engines a recipe
# may name (attention.engine), `vertical_slash_attention`'s impl on one device; "auto": the engine measured fastest
# for the device and block size (see vertical_slash_attention).


_ENGINES_SAID: set = set()


def say_engine(engine: str, q, block_size: int) -> str:
    """The engine a sparse layer runs for attention.engine `engine` (`resolve_impl`), logged once per choice."""
    from mtrain.ops.attention import resolve_impl

    device = q.device
    chosen = resolve_impl(engine, device, block_size, q.dtype)
    key = (engine, chosen, block_size, device.type)
    if key not in _ENGINES_SAID:
        _ENGINES_SAID.add(key)
        log.info("sparse attention engine: %s (attention.engine=%s, block %d, %s)", chosen, engine, block_size,
                 device.type)
    return chosen


def _deterministic_backward(engine: str) -> bool:
    """Whether a sparse layer's backward must be bitwise repeatable. Our Triton kernels always run their
    deterministic backward (as fast as the atomic one at head dim 64, faster at 128: BENCHMARKS.md); FlashAttention-4
    has none on Hopper, so the fa4 engine runs FA4's own atomic backward (the faster one there: BENCHMARKS.md,
    "Must-show status (issue #13)") unless the run asked for deterministic algorithms (train.deterministic)."""
    return engine != "fa4" or torch.are_deterministic_algorithms_enabled()


def prepare_spec(q, k, engine: str, doc_ids):
    """`estimate_graphed`'s prepare= for a layer: (engine, KV heads, head dim) where the engine's plans can be built
    with the index (our Triton kernels or fa4, no documents: with documents the engines derive them per call)."""
    return (engine, k.shape[2], q.shape[-1]) if engine in ("triton", "fa4") and doc_ids is None else None


def _graphed(q, prepare, switches) -> bool:
    """Whether this layer's estimate runs from a CUDA graph that also builds the engine's plans (prepare: the layer's
    `prepare_spec`; switches: the runtime's, attention.graph_estimate; what the cost model then charges the estimate:
    CostTable.graphed)."""
    return switches.graph_estimate and q.is_cuda and prepare is not None


def _decide(rt, q, k, v, scaling, s, *, policy, training, layer_idx, key, memo_key, engine, max_error, prepare,
            graphed, doc_ids=None, floor=True, paid_if_sparse=False):
    """("sparse", index) or ("dense", None) for one device's call over q [B, S, Hq, D] under SparseSettings `s`: the
    layer's decision (`mtrain.models.decision.decide`, the ring's too) with the whole sequence at hand
    (`decision.OneDevice`), its state under `key` (the layer index, or on packed documents the layer's documents of
    one length class: `document_key`), its replayed choice under `memo_key`, its records under `layer_idx`.
    doc_ids: the documents masked within this one estimate and index (per_document off), else None. floor False:
    the call is a packed document that cleared the per-document break-even (`_shortest_sparse`, or
    attention.min_sparse_document), so the floor is not priced again; paid_if_sparse: `Site.paid_if_sparse`."""
    site = decision.OneDevice(rt, q, k, v, scaling, s, doc_ids, engine=engine, prepare=prepare, graphed=graphed,
                              floor=floor, paid_if_sparse=paid_if_sparse)
    return decision.decide(rt, q, s, site, policy=policy, training=training, key=key, memo_key=memo_key,
                           layer=layer_idx, max_error=max_error)


def _local_attention(rt, q, k, v, scaling, s=None, doc_ids=None, *, policy="always", training=True, layer_idx=None,
                     engine="auto", max_error=None, per_document=True):
    """One rank holds the whole sequence: dense causal, or online vertical-slash sparse attention with
    SparseSettings `s` on block engine `engine` (ENGINES), run sparse or dense per `policy` (see `choose_path`;
    under "auto" with `max_error`, also dense where the layer's output error on the scored rows exceeds it).
    Packed documents (doc_ids) run per document (`_per_document`): each long enough document sparse on its own,
    the rest in one dense varlen call; with per_document False, one estimate over the whole sequence with the
    documents masked in the kernels (what a CP group runs)."""
    from mtrain.ops import dense_attention, vertical_slash_attention

    documents = rt.current_documents(doc_ids)  # the batch's boundaries, read from the host once per batch
    if s is None:
        return dense_attention(q, k, v, causal=True, softmax_scale=scaling, documents=documents)
    # the concrete engine (auto resolved): what runs, what the cost model prices, what is logged
    engine = say_engine(engine, q, s.block_size)
    if documents is not None and per_document:
        return _per_document(rt, q, k, v, scaling, s, documents, policy=policy, training=training,
                             layer_idx=layer_idx, engine=engine, max_error=max_error)
    prepare = prepare_spec(q, k, engine, doc_ids)
    path, index = _decide(rt, q, k, v, scaling, s, policy=policy, training=training, layer_idx=layer_idx,
                          key=layer_idx, memo_key=layer_idx, engine=engine, max_error=max_error, prepare=prepare,
                          graphed=_graphed(q, prepare, rt.switches), doc_ids=doc_ids)
    if path == "sparse":
        return vertical_slash_attention(q, k, v, index, softmax_scale=scaling, doc_ids=doc_ids, impl=engine,
                                        deterministic=_deterministic_backward(engine))
    return dense_attention(q, k, v, causal=True, softmax_scale=scaling, documents=documents)


def document_key(layer_idx, length: int):
    """The policy's key for a layer's documents of `length` tokens: one per layer and power-of-two length class
    ("03@64K": layer 3, documents of 32K+1 .. 64K tokens), under which their holds, widened caps, escalated recall
    and quality-check cadence live (a document's pattern, and whether sparse pays on it, depends on its length
    much as a whole sequence's does); None without a layer index."""
    if layer_idx is None:
        return None
    size = 1 << max(int(length) - 1, 1).bit_length()
    label = f"{size >> 10}K" if size >= 1024 else str(size)
    return f"{layer_idx:02d}@{label}" if isinstance(layer_idx, int) else f"{layer_idx}@{label}"


_SHORTEST: dict = {}
"""`_shortest_sparse`'s lengths by (cost table, arguments): the bisection costs ~0.5 ms of host time, per layer call."""


def _measured_break_even(policy: str, head_dim: int, block_size: int, training: bool, device, engine: str,
                         switches=None) -> int | None:
    """Under "auto" in training, the break-even measured on packed documents for this head dim, block size and engine
    (`cost.document_break_even`), else None: the length `_shortest_sparse` then returns, and measured with each
    document's estimate, so a document past it that goes sparse paid for it (`decision.Site.paid_if_sparse`)."""
    from mtrain.ops import cost

    if policy != "auto":
        return None
    return cost.document_break_even(device, head_dim=head_dim, block_size=block_size, engine=engine,
                                    backward=training, switches=switches)


def _shortest_sparse(policy: str, heads: int, head_dim: int, block_size: int, s, training: bool, device,
                     engine: str, dense_engine: str, switches=None) -> int:
    """The shortest document a sparse layer estimates: two blocks under "always" (a shorter one has no block to
    skip); under "auto" the shortest whole number of blocks (from two up) at which the cost model's floor (the
    estimate and the fixed costs, `cost.worth_estimating`) is under the document's dense cost, found by bisection
    (the floor grows more slowly with the length than dense does); beyond 2**24 tokens, never. The estimate is
    priced eager: documents' lengths change from batch to batch, so a CUDA graph of one length is rarely replayed.
    In training, where the cost table holds a break-even measured on packed documents for this head dim, block size
    and engine (`cost.document_break_even`), that one, in whole blocks: the floor's fixed costs, measured with the GPU
    idle, overprice a document's estimate queued among the layer's other calls.
    s: the SparseSettings, whose scored rows depend on the length; switches: the runtime's (its cost table; None =
    the defaults)."""
    from mtrain.ops import cost

    shortest = 2 * block_size
    if policy != "auto":
        return shortest
    measured = _measured_break_even(policy, head_dim, block_size, training, device, engine, switches)
    if measured is not None:
        return max(shortest, -(-measured // block_size) * block_size)
    # the same for every layer and step of a run: computed once per arguments and cost table (a table a test or a
    # recipe's attention.cost_table replaces is another object, so its lengths are computed afresh)
    table = cost.table_for(device, switches=switches)
    key = (id(table), heads, head_dim, block_size, s, training, torch.device(device).type, engine, dense_engine)
    known = _SHORTEST.get(key)
    if known is not None and known[0] is table:
        return known[1]

    def pays(blocks: int) -> bool:
        length = blocks * block_size
        return cost.worth_estimating(seq_len=length, heads=heads, head_dim=head_dim, block_size=block_size,
                                     rows=scored_rows(s, length), backward=training, device=device,
                                     engine=engine, dense_engine=dense_engine, switches=switches).path == "sparse"

    low, high = 2, (1 << 24) // block_size  # pays(high) or nothing does; bisect on the first block count that pays
    reachable = pays(high)
    while reachable and low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if pays(middle) else (middle + 1, high)
    _SHORTEST[key] = (table, low * block_size if reachable else 1 << 24)
    return _SHORTEST[key][1]


def _per_document(rt, q, k, v, scaling, s, documents, *, policy, training, layer_idx, engine, max_error):
    """Sparse attention within packed documents on one device: every document at least `_shortest_sparse` long is
    a causal sequence of its own (its own estimate from its own rows, index and choice, no block across a boundary,
    nothing the documents mask computed); the documents the choice sends dense and the short ones (where dense is
    cheap) run in one varlen call. Policy state per layer and length class (`document_key`); one record per
    estimated document, under the layer's index."""
    from mtrain.ops import vertical_slash_attention
    from mtrain.ops.dense import dense_backend
    from mtrain.ops.varlen import varlen_attention

    B, S, Hq, D = q.shape
    measured = False  # the length is a break-even measured with each document's estimate (`_measured_break_even`)
    if policy == "never":
        shortest = S + 1
    elif rt.settings.policy.min_sparse_document is not None:  # attention.min_sparse_document
        shortest = max(2 * s.block_size, rt.settings.policy.min_sparse_document)
    else:
        shortest = _shortest_sparse(policy, Hq, D, s.block_size, s, training, q.device, engine, dense_backend(q),
                                    rt.switches)
        measured = _measured_break_even(policy, D, s.block_size, training, q.device, engine,
                                        rt.switches) is not None
    pieces, dense, slot = {}, [], 0
    # Each row's documents as views from one split (the documents' lengths cover the row): the backward then joins
    # their gradients in one concatenation per tensor, where a slice per document made a zero-filled gradient of the
    # whole q / k / v for each document and added them up.
    rows_of = [_documents_of(t, documents) for t in (q, k, v)]
    for b in range(B):
        for i, n in enumerate(documents.lengths[b]):
            if n < shortest:
                dense.append((b, i, n))
                continue
            key = document_key(layer_idx, n)
            qd, kd, vd = (row[b][i].unsqueeze(0) for row in rows_of)
            # priced with an eager estimate (see `_shortest_sparse`), though a length seen twice replays a graph
            path, index = _decide(rt, qd, kd, vd, scaling, layer_settings(rt, s, key), policy=policy,
                                  training=training, layer_idx=layer_idx, key=key,
                                  memo_key=None if key is None else (key, slot), engine=engine,
                                  max_error=max_error, prepare=prepare_spec(qd, kd, engine, None), graphed=False,
                                  floor=False, paid_if_sparse=measured)
            slot += 1
            if path == "sparse":
                pieces[b, i] = vertical_slash_attention(qd, kd, vd, index, softmax_scale=scaling, impl=engine,
                                                        deterministic=_deterministic_backward(engine))[0]
            else:
                dense.append((b, i, n))
    if slot == 0 and policy != "never":  # no document long enough to estimate: the layer ran dense as a whole
        rt.records.layers.append(LayerRecord(layer_idx, "dense", None))
    if len(dense) == sum(len(row) for row in documents.lengths):  # every document dense: the batch's one call
        from mtrain.ops import dense_attention

        return dense_attention(q, k, v, causal=True, softmax_scale=scaling, documents=documents)
    if dense:
        cat = [torch.cat([row[b][i] for b, i, _ in dense]) for row in rows_of]
        out = varlen_attention(*cat, documents.segments_of([n for _, _, n in dense], q.device), scaling)
        for (b, i, n), piece in zip(dense, out.split([n for _, _, n in dense])):
            pieces[b, i] = piece
    rows = [torch.cat([pieces[b, i] for i in range(len(documents.lengths[b]))]) for b in range(B)]
    return rows[0].unsqueeze(0) if B == 1 else torch.stack(rows)


def _documents_of(t: torch.Tensor, documents) -> list[tuple[torch.Tensor, ...]]:
    """Per row of t [B, S, ...], its documents' [n, ...] views (`documents.lengths`, which cover the row), from one
    split: the gradient flows back through one concatenation per row (and, for B > 1, one stack) instead of a
    zero-filled whole-tensor gradient per document."""
    rows = [t.squeeze(0)] if t.shape[0] == 1 else t.unbind(0)
    return [row.split(list(documents.lengths[b]), dim=0) for b, row in enumerate(rows)]


def _ring(rt, q, k, v, scaling, settings=None, layer_idx=None, *, policy="always", training=True, engine="auto",
          max_error=None):
    """This rank's shard of a context-parallel group: dense ring, or sparse with SparseSettings `settings`, run
    sparse or dense per `policy`. The layer decides as on one device (`mtrain.models.decision.decide`), at this rank
    (`decision.RankOfGroup`: its figures, and so its path, are the same on every rank); `ring_attention` then runs on
    the finished index, the sparse steps' block kernels per `engine` (`ring_attention`'s: flex has no ring steps and
    runs ours). `max_error`: the quality check under "auto", measured across the group
    (`mtrain.parallel.quality.gathered_output_error`)."""
    import torch.distributed as dist

    from mtrain.parallel import ring_attention

    index, gather, topo = None, None, rt.topology
    if settings is not None:
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        site = decision.RankOfGroup(rt, q, k, v, scale, dist.get_world_size(topo.group), settings)
        path, index = decision.decide(rt, q, settings, site, policy=policy, training=training, key=layer_idx,
                                      memo_key=layer_idx, layer=layer_idx, max_error=max_error)
        if path == "sparse" and rt.inputs.sample_imbalance:
            _sample_imbalance(rt, index, site.rank)
        gather = site.gather  # the gathered schedule's K/V, started before the index was built
    return ring_attention(q, k, v, group=topo.group, layout=topo.layout, index=index, softmax_scale=scaling,
                          inner_group=topo.inner_group, outer_group=topo.outer_group, doc_ids=rt.inputs.doc_ids,
                          engine=engine if engine in ("auto", "triton", "fa4") else "triton",
                          schedule=topo.schedule, kv_gather=gather, dense_schedule=topo.dense_schedule,
                          documents=rt.current_documents(rt.inputs.doc_ids), switches=rt.switches)


def _sample_imbalance(rt, index, rank: int) -> None:
    """The first sparse layer of a logged step watches the balance: this rank's work counted against the group's (a
    collective: every rank of the group takes the same path, so all of them join it); once a step."""
    from mtrain.parallel.imbalance import gathered_imbalance

    topo = rt.topology
    rt.inputs.sample_imbalance = False
    measured = gathered_imbalance(index, topo.layout, rank, topo.group, local_world_size=topo.local_world_size)
    rt.records.imbalances.append((measured["worker"], measured["step"], measured["ranks"]))


def mtrain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, settings=False,
                     policy=None, engine=None, max_error=False, per_document=None, **kwargs):
    """HF attention function of the mtraining kinds: query [B, Hq, S_local, D], key/value [B, Hkv, S_local, D] after
    RoPE (with a KV cache, key/value hold the cached positions too: then see `_cached_attention`). Everything it reads
    and writes besides its inputs is the runtime of the model `module` belongs to (`runtime_of(module)`,
    `mtrain.models.runtime`): its settings, topology, step inputs, policy state and records; the runtime's switches
    (`rt.switches`) are passed down to every reader the call reaches. The keywords override the runtime's settings
    for this call:
    settings: SparseSettings (sparse), None (dense); left out = the runtime's (settings.sparse).
    policy: one of SPARSE_POLICIES for sparse settings; None = the runtime's sparse_policy. Under "auto" the cost
    model is that of a training call (forward + backward) when the module is in training mode, else forward only.
    engine: one of ENGINES for the sparse path on one device; None = the runtime's (a CP ring runs its own
    partial-step kernels).
    max_error: under "auto", a layer whose output error on the scored rows exceeds it runs dense (the quality check,
    `mtrain.models.policy.quality_error`; in a CP group `mtrain.parallel.quality.gathered_output_error`); None = no
    check; left out = the runtime's max_output_error.
    per_document: one device with packed documents: each long enough document sparse on its own
    (`_per_document`); False = one estimate over the whole sequence, documents masked; None = the runtime's.

    Returns (out [B, S_local, Hq, D], None).
    """
    rt = runtime_of(module)
    return _attention(rt, module, query, key, value, scaling, dropout, settings=settings, policy=policy,
                      engine=engine, max_error=max_error, per_document=per_document), None


def _attention(rt, module, query, key, value, scaling, dropout, *, settings, policy, engine, max_error,
               per_document):
    """`mtrain_attention`'s work: the call's out [B, S_local, Hq, D]."""
    own = rt.settings
    settings = own.sparse if settings is False else settings
    policy = policy or own.policy.sparse_policy
    engine = engine or own.policy.engine
    max_error = own.policy.max_output_error if max_error is False else max_error
    per_document = own.policy.per_document if per_document is None else per_document
    training = bool(getattr(module, "training", True))
    layer_idx = getattr(module, "layer_idx", None)
    settings = layer_settings(rt, settings, layer_idx)  # the layer's caps, widened where `widen` widened them
    q, k, v, cached = hf_inputs(module, query, key, value, scaling, dropout)
    if cached is not None:
        return cached
    with profile_range(layer_idx):
        if rt.topology.group is None:
            return _local_attention(rt, q, k, v, scaling, settings, rt.inputs.doc_ids, policy=policy,
                                    training=training, layer_idx=layer_idx, engine=engine, max_error=max_error,
                                    per_document=per_document)
        return _ring(rt, q, k, v, scaling, settings, layer_idx, policy=policy, training=training, engine=engine,
                     max_error=max_error)


PROFILE_LABEL = "mtrain.attention"
"""Prefix of the torch.profiler ranges around each attention call (`profile_range`; read by
`mtrain.train.step_profile`)."""


def profile_range(layer_idx):
    """A record_function range `mtrain.attention LNN` around one attention call while a torch profiler records
    (`train.profile_step`); a no-op context otherwise."""
    if not getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return contextlib.nullcontext()
    layer = "L??" if layer_idx is None else f"L{int(layer_idx):02d}"
    return torch.profiler.record_function(f"{PROFILE_LABEL} {layer}")


def settings_of(kind: str, *, sparse, policy, baseline=None) -> AttentionSettings:
    """The plugin's settings (`mtrain.models.registry.attention_runtime` calls it for the kinds of KINDS, with the
    checked `mtrain.attention_settings` objects): the sparse kinds keep `sparse` (the estimate's) and `policy` (how
    a layer chooses its path and runs it: `mtrain.models.policy`, `mtrain_attention`); the dense kinds the policy
    alone (which they do not read)."""
    return AttentionSettings.of(kind, sparse=sparse if KINDS[kind][0] else None, policy=policy)


def register(kind: str) -> str:
    """The plugin's registration with transformers (`mtrain.models.registry.attention_runtime` calls it): `kind` as
    `mtrain-<kind>`, whose function (`mtrain_attention`) carries no settings (they travel in the runtime of the model
    it runs in), with a mask function that builds no mask. Registering again changes nothing. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"mtrain-{kind}"
    AttentionInterface.register(name, mtrain_attention)
    AttentionMaskInterface.register(name, no_mask)
    return name
