"""The dense/sparse policy of the sparse kinds, per layer and call: the choice (`choose_path`, on the cost model
`mtrain.ops.cost` and the estimate's recall), skipping an estimate that cannot pay (`skip_estimate`), the dense holds
(`hold`), the quality check's cadence (`check_due` / `passed_check`), the widening of the caps of a layer whose caps
bind (`layer_settings`, `widen`, `widen_or_hold`), the replay of a layer's choice under gradient checkpointing
(`replay_choice`, `remember_choice`; the recomputation flag is set by `AttentionRuntime.checkpoint_contexts`) and the
record of each call (`record_layer`).

Every function that reads or writes state takes the model's runtime first (`rt`, a
`mtrain.models.runtime.AttentionRuntime`): its settings and switches (`rt.switches`), its step inputs, its per-layer
policy state (`rt.policy`, which the trainer saves with each checkpoint through `rt.state_dict()`) and its records;
nothing here is shared between models."""

from __future__ import annotations

import dataclasses

import torch

from mtrain.attention_settings import SPARSE_POLICIES
from mtrain.models.context import LayerRecord, own
from mtrain.ops.lists import MAX_LIST_ENTRIES
from mtrain.ops.switches import Switches

# SPARSE_POLICIES (imported from mtrain.attention_settings, with the policy's settings): how a sparse kind picks its
# path per layer: the cost model (`mtrain.ops.cost`), sparse everywhere, or dense.


# Under "auto", a layer whose estimate (mean over heads) falls short of the recall target by more than this runs
# dense (or, with attention.widen_caps, estimates again with wider caps: `widen`), whatever the cost model says: its
# caps bind, so the pattern it may list cannot hold the mass. The layer mean, not the per-head minimum: on the real
# model the layer means of the estimate track the true recall closely, while a per-head rule sent most layers dense
# for little recall (BENCHMARKS.md, the real model's one-GPU runs of 2026-11-24 in docs/benchmarks-history.md).
RECALL_SLACK = 0.04


# Under "auto" on one device, a layer's choice reads the work counts and estimated recall of that layer's previous
# estimate (same shapes; one step old in training), copied to the host without waiting, instead of its own: reading
# its own makes the host wait for the GPU to finish the estimate before it can queue the attention kernels, and at
# short lengths the host's work after that wait (the kernels' launches) costs about as much as the estimate itself.
# A layer's first estimate (per shape) is read directly. The pattern, and so the choice, moves slowly in training (the
# premise of dense_hold as well). Under attention.lagged_choice (the runtime's `Switches.lagged_choice`, on by
# default); off: each layer reads its own estimate.

# The lagged statistics kept per layer: one per (shape, parts) the layer was called with, the least recently used
# going first beyond this many (a training run needs one or two: with and without the quality check's error).
CHOICE_STATS_PER_LAYER = 4


def _choice_stats(rt, index, q, target, layer_idx) -> list:
    """[listed block entries, listed column entries(, mean est_recall)(, output error)] that `choose_path` decides
    from (the recall when `target` is given and the index has one; the output error when the quality check put one in
    `index._cache["output_error"]`): this estimate's, or with lagged_choice and a layer index the previous estimate's
    of this layer and shape (this one's copy starts now, without waiting, for the next call)."""
    est = index._cache.get("est_recall")
    error = index._cache.get("output_error")
    wanted = 2 + (target is not None and est is not None) + (error is not None)
    read = index._cache.get("host_read")  # a CP rank's RowIndex read these with its lists' widths: no second read
    if read is not None and len(read) >= wanted and error is None:
        return read[:wanted]
    parts = [index.work_tensor()]  # the whole index's work (a CP rank's RowIndex knows it from the lines)
    if target is not None and est is not None:
        parts.append(est.double().mean().view(1))
    if error is not None:
        parts.append(error.double().amax().view(1).to(parts[0].device))  # the worst sequence of the batch
    now = torch.cat(parts)
    if not rt.switches.lagged_choice or layer_idx is None:
        return now.tolist()  # one device-to-host read
    key = (layer_idx, tuple(q.shape), len(parts))
    before = rt.policy.choice_stats.get(key)
    if now.is_cuda:
        host = torch.empty(now.shape, dtype=now.dtype, pin_memory=True)
        host.copy_(now, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host, event = now.clone(), None
    rt.policy.choice_stats.pop(key, None)
    rt.policy.choice_stats[key] = (host, event)  # now the layer's most recent
    mine = [k for k in rt.policy.choice_stats if k[0] == layer_idx]
    for old in mine[:-CHOICE_STATS_PER_LAYER]:  # an evaluation meets a new shape with every prompt: keep a few
        del rt.policy.choice_stats[old]
    host, event = before if before is not None else (host, event)
    if event is not None:
        event.synchronize()  # the previous estimate's copy finished long ago: no wait in practice
    return host.tolist()


def quality_error(q, k, v, index, s, scaling=None, doc_ids=None) -> torch.Tensor:
    """The quality check's measure of a layer (sparse_policy auto with attention.max_output_error): the relative error
    of the attention output of the rows the estimate scored (`mtrain.ops.estimate.estimate_rows` under SparseSettings
    `s`) when only the pairs inside `index` are computed, against dense attention on the same rows: fp32 [B]. Their
    query blocks run through the partial-attention kernel twice, on the index's lists and densely
    (`mtrain.ops.recall.block_output_error`): two small kernel calls, no host read."""
    from mtrain.ops.recall import block_output_error

    with torch.no_grad():
        return block_output_error(q.detach(), k.detach(), v.detach(), index, check_rows(s, q.shape[1]),
                                  softmax_scale=scaling, doc_ids=doc_ids).float()


def check_rows(s, seq_len: int) -> torch.Tensor:
    """The rows the quality check measures: those the estimate scored under SparseSettings `s` in a `seq_len`-token
    sequence, as a CPU tensor (`mtrain.ops.estimate.row_plan`, cached per shape)."""
    from mtrain.ops.estimate import row_plan

    return row_plan(seq_len, min(s.last_q, seq_len), s.sample_blocks, s.block_size, torch.device("cpu"),
                    s.sample_rows)[0]


def choose_path(rt, index, q, *, policy: str, training: bool, world: int = 1, doc_ids=None, target=None, rows=0,
                 engine: str = "auto", graphed: bool = False, layer_idx=None, max_error=None):
    """("sparse" | "dense", Prediction or None) for one call with the estimated `index` under `policy`.

    Decided from the index's integer work counts and its est_recall (identical on every rank of a CP group,
    whose index is the same global one), so every rank takes the same path. Under "auto" the layer runs dense
    when the cost model predicts sparse does not pay, or when `target` (the recall asked for) is given and the
    estimate's mean over heads falls short of it by more than RECALL_SLACK, or when `max_error` is given and the
    layer's output error (`quality_error`, which the caller put in `index._cache["output_error"]`) exceeds it (the
    quality check: attention.max_output_error); where one of these two overrules a sparse cost-model choice,
    `index._cache["overruled"]` says which and with what mean estimated recall (("recall" or "error", the recall read
    or None): what `widen` reads). The index build is already paid; what the
    dense path saves is everything the kernels derive from it (built lazily on the first kernel call) and the
    kernels. rows: the query rows the estimate scored (the Prediction then carries its predicted cost). engine: the
    block engine that would run the sparse path (its measured rates, where the cost table has them). graphed: the
    estimate ran from a CUDA graph that also built the engine's plans (`cost.predict`). layer_idx: given on one
    device, the counts come from this layer's previous estimate (attention.lagged_choice).
    """
    if policy == "always":
        return "sparse", None
    if policy == "never":
        return "dense", None
    from mtrain.ops import cost
    from mtrain.ops.dense import dense_backend

    read = _choice_stats(rt, index, q, target, layer_idx)
    blocks, columns = int(read[0]), int(read[1])
    B, _, Hq, D = q.shape
    # one device with packed documents: the dense path runs them in one varlen call (or one call per document)
    doc_lengths = None if doc_ids is None else document_lengths(rt, doc_ids)
    prediction = cost.predict(blocks, columns, seq_len=index.seq_len, heads=Hq, head_dim=D,
                              block_size=index.block_size, batch=B, backward=training, device=q.device,
                              world=world, doc_lengths=doc_lengths, estimate_rows=rows, engine=engine,
                              graphed=graphed, dense_engine=dense_backend(q), switches=rt.switches)
    by_cost = prediction.path
    has_recall = target is not None and index._cache.get("est_recall") is not None
    reasons = []
    if has_recall and read[2] < target - RECALL_SLACK:
        reasons.append("recall")
    error = read[2 + has_recall] if index._cache.get("output_error") is not None else None
    if max_error is not None and error is not None and error > max_error:
        reasons.append("error")
    if reasons:
        prediction = dataclasses.replace(prediction, path="dense")
        if by_cost == "sparse":
            index._cache["overruled"] = (reasons[0], read[2] if has_recall else None)
    return prediction.path, prediction


def skip_estimate(rt, q, s, layer_idx, *, policy: str, training: bool, world: int = 1, doc_ids=None,
                   engine: str = "auto", graphed: bool = False, layer=False, floor: bool = True) -> bool:
    """Under "auto": True when sparse cannot pay even with no work listed (the estimate and the fixed costs
    alone exceed dense; `mtrain.ops.cost.worth_estimating`). The call then runs dense without estimating and
    records the floor. Decided from shapes and settings every rank shares. layer_idx: the key of the policy's
    state (the layer index, or a layer's documents of one length class); layer: the record's layer (default:
    layer_idx). floor False: the caller priced the call already (a packed document at least
    `mtrain.models.attention._shortest_sparse` long): only the dense holds apply."""
    layer = layer_idx if layer is False else layer
    if policy != "auto":
        return False
    if training and layer_idx is not None and rt.inputs.step < rt.policy.dense_until.get(layer_idx, -1):
        rt.records.layers.append(LayerRecord(layer, "dense", None, held=True,  # held dense: see dense_hold
                                             cap_scale=rt.policy.cap_scale.get(layer_idx, 1)))
        return True
    if not floor:
        return False
    from mtrain.ops import cost
    from mtrain.ops.dense import dense_backend

    B, S_local, Hq, D = q.shape
    S = S_local * world
    doc_lengths = None if doc_ids is None or world > 1 else document_lengths(rt, doc_ids)
    floor = cost.worth_estimating(seq_len=S, heads=Hq, head_dim=D, block_size=s.block_size,
                                  rows=scored_rows(s, S), batch=B, backward=training,
                                  device=q.device, world=world, doc_lengths=doc_lengths, engine=engine,
                                  graphed=graphed, dense_engine=dense_backend(q), switches=rt.switches)
    if floor.path == "sparse":
        return False
    rt.records.layers.append(LayerRecord(layer, "dense", None, floor.dense_ms, floor.sparse_ms,
                                         cap_scale=rt.policy.cap_scale.get(layer_idx, 1)))
    return True


def scored_rows(s, seq_len: int) -> int:
    """Query rows the estimate scores under SparseSettings `s` (the last rows and the sampled blocks)."""
    from mtrain.ops.estimate import scored_row_count

    return scored_row_count(seq_len, s.last_q, s.sample_blocks, s.block_size, s.sample_rows)


# The longest hold, as a multiple of dense_hold: a layer whose estimate keeps not paying is looked at again after
# dense_hold, 2x, 4x, then every 8x dense_hold steps (16, 32, 64, 128 steps at the default), so the estimates it
# pays for nothing fall towards none while a layer whose pattern becomes sparse in training is still found.
HOLD_BACKOFF_MAX = 8


def hold(rt, layer_idx, prediction, policy: str, training: bool, paid: bool | None = None) -> None:
    """After auto decided a training call, skip this layer's estimate (running dense) when estimating did not pay
    for itself: the layer went dense, or it went sparse but the estimate plus the sparse path is predicted no
    cheaper than dense (`Prediction.estimate_paid`). The estimate is paid before the choice, so such a layer
    would pay it every step for nothing or for a loss (a layer's attention pattern, and so its density, moves
    slowly during training). The hold is rt.settings.policy.dense_hold steps, doubled for each further estimate in a row
    that did not pay (up to HOLD_BACKOFF_MAX x); an estimate that pays resets it. paid: whether it paid where the
    caller knows better than the prediction (`mtrain.models.decision.Site.paid_if_sparse`); None = the prediction's
    `estimate_paid`."""
    if policy != "auto" or not training or rt.settings.policy.dense_hold <= 0 or layer_idx is None or prediction is None:
        return
    if prediction.estimate_paid if paid is None else paid:
        rt.policy.hold_streak.pop(layer_idx, None)
        return
    streak = rt.policy.hold_streak.get(layer_idx, 0)
    rt.policy.hold_streak[layer_idx] = streak + 1
    backoff = min(2 ** streak, HOLD_BACKOFF_MAX)
    rt.policy.dense_until[layer_idx] = rt.inputs.step + 1 + rt.settings.policy.dense_hold * backoff


# The widest a layer's caps grow (`widen`), as a multiple of the recipe's max_vertical / max_slash: the scales 1, 2, 4
# and 8 give at most four settings per shape, as many estimates as the graph caches keep captured at once
# (MAX_GRAPHS in mtrain/ops/graphed.py and mtrain/parallel/graphed.py).
MAX_CAP_SCALE = 8


def scaled_settings(s, scale: int):
    """SparseSettings `s` with caps `scale` x wider: max_vertical, max_slash and cap_fraction (at most 1.0); `s`
    itself at scale 1."""
    if scale == 1:
        return s
    fraction = None if s.cap_fraction is None else min(1.0, s.cap_fraction * scale)
    return dataclasses.replace(s, max_vertical=s.max_vertical * scale, max_slash=s.max_slash * scale,
                               cap_fraction=fraction)


def layer_settings(rt, s, layer_idx):
    """The SparseSettings a layer estimates with: `s` with the layer's caps widened by its rt.policy.cap_scale and its
    recall raised to its rt.policy.layer_recall (`escalate`) (the same object where the layer has neither). A layer at another scale has other settings, hence its own key in the
    estimate's graph caches."""
    if s is None or layer_idx is None:
        return s
    s = scaled_settings(s, rt.policy.cap_scale.get(layer_idx, 1))
    recall = rt.policy.layer_recall.get(layer_idx)
    return s if recall is None or recall == s.recall else dataclasses.replace(s, recall=recall)


def list_bytes(index, cap_v: int, cap_s: int, *, switches: Switches | None = None) -> int:
    """Bytes of the int32 block and column lists over the query blocks `index` holds (every block of a one-device
    SparseIndex, a CP rank's own in a RowIndex) when they are as wide as caps of `cap_v` verticals and `cap_s` slash
    block offsets allow: per query block and head, two block entries per slash offset (a slash line crosses at most
    two key blocks), the sink and diagonal blocks, and one column entry per vertical
    (`mtrain.parallel.estimate.lists_bytes`, what a rank's index sizes its lists by). A CP rank whose lists at those
    caps would pass `static_width_mib` holds no column lists (`list_free_columns`): its block lists, and each head's
    verticals with their key blocks (`mtrain.ops.columns.RingColumns`), instead. switches: the run's (those two keys;
    None = the defaults)."""
    from mtrain.parallel import estimate

    b, h, rows, list_free = _lists_at(index, cap_v, cap_s, switches)
    if list_free:
        return estimate.lists_bytes(b, h, rows, cap_s, 0) + b * h * cap_v * 4 * 2
    return estimate.lists_bytes(b, h, rows, cap_s, cap_v)


def column_list_entries(index, cap_v: int, cap_s: int, *, switches: Switches | None = None) -> int:
    """Entries of the column lists over the query blocks `index` holds at caps of `cap_v` verticals and `cap_s` slash
    block offsets (0 where a rank's index holds them list-free at those caps under `switches`, as `list_bytes`
    counts): batch x heads x query blocks x cap_v."""
    b, h, rows, list_free = _lists_at(index, cap_v, cap_s, switches)
    return 0 if list_free else b * h * rows * cap_v


def _lists_at(index, cap_v: int, cap_s: int, switches: Switches | None) -> tuple[int, int, int, bool]:
    """(batch, heads, query blocks) of `index`'s lists, and whether it would hold its columns list-free at these caps
    (a CP rank's RowIndex past `static_width_mib`, `mtrain.parallel.estimate.columns_list_free`)."""
    from mtrain.ops.index import RowIndex
    from mtrain.parallel import estimate

    b, h, rows = index.block_ids.shape[:3]
    return b, h, rows, isinstance(index, RowIndex) and estimate.columns_list_free(b, h, rows, cap_s, cap_v,
                                                                                  switches=switches)


def widen(rt, layer_idx, index, s, seq_len: int, policy: str, training: bool) -> bool:
    """After auto decided a training call: where the estimate's recall or the quality check sent the layer dense
    though the cost model said sparse (`index._cache["overruled"]`, set by `choose_path`) and its caps bind, double
    the layer's rt.policy.cap_scale for its next estimate and return True: the caller then sets no dense hold, and the
    next call estimates again with the wider caps. The caps bind when the estimate fell short of its recall target
    (the fewest lines reaching it are listed, so an estimate that reached it stopped below its caps and wider caps
    would list the same lines: a layer the check sends dense with its recall met is held as before) and doubling
    them gives larger caps for this sequence (`mtrain.ops.estimate.line_caps`: they do not yet cover it). Returns
    False (the caller holds the layer as before) under attention.widen_caps false, at MAX_CAP_SCALE, where the caps
    do not bind, where the lists at the doubled caps would exceed rt.settings.policy.widen_max_list_bytes (`list_bytes`) or the
    entries our kernels can address (`mtrain.ops.lists.MAX_LIST_ENTRIES`), or for any other choice. `s`: the
    settings the layer estimated with (`layer_settings`); `seq_len`: the whole sequence (every rank of a CP group passes the same). Decided from the est_recall / output error the choice read,
    which every rank of a CP group shares, so every rank widens alike. The layer's lagged choice statistics
    (lagged_choice) are dropped: its next choice reads the estimate at the new caps, not the last one at the old."""
    overruled = index._cache.get("overruled")
    if policy != "auto" or not training or not rt.settings.policy.widen_caps or layer_idx is None or overruled is None:
        return False
    _, recall = overruled
    scale = rt.policy.cap_scale.get(layer_idx, 1)
    if scale * 2 > MAX_CAP_SCALE or (recall is not None and recall >= s.recall):
        return False
    from mtrain.ops.estimate import line_caps

    wide = scaled_settings(s, 2)
    caps = [line_caps(seq_len, x.block_size, x.max_vertical, x.max_slash, x.cap_fraction) for x in (s, wide)]
    if caps[1] == caps[0]:  # the caps already cover the sequence: wider caps list nothing more
        return False
    limit = rt.settings.policy.widen_max_list_bytes
    # lists this wide cost more to build than a dense layer saves
    if limit and list_bytes(index, *caps[1], switches=rt.switches) > limit:
        return False
    if column_list_entries(index, *caps[1], switches=rt.switches) > MAX_LIST_ENTRIES:  # beyond 32-bit offsets
        return False
    rt.policy.cap_scale[layer_idx] = scale * 2
    for key in [key for key in rt.policy.choice_stats if key[0] == layer_idx]:
        del rt.policy.choice_stats[key]
    return True


def escalate(rt, layer_idx, index, max_error) -> bool:
    """After the quality check measured a layer (`index._cache["output_error"]`): where the error exceeds `max_error`,
    rt.settings.policy.escalate_recall is set and the layer does not already estimate at it, make that the layer's recall from
    now on (rt.policy.layer_recall, read by `layer_settings`) and return True: the caller estimates again with the
    layer's settings and checks the new index before its choice. The layer's lagged choice statistics are dropped (its
    choice reads the new estimate). The error is the same on every rank of a CP group, so every rank escalates alike."""
    er = rt.settings.policy.escalate_recall
    error = index._cache.get("output_error")
    if er is None or layer_idx is None or max_error is None or error is None:
        return False
    # the worst sequence of the batch, as `choose_path` reads it; one host read, on the calls that measure the check
    if rt.policy.layer_recall.get(layer_idx) == er or not float(error.double().amax()) > max_error:
        return False
    rt.policy.layer_recall[layer_idx] = er
    for key in [key for key in rt.policy.choice_stats if key[0] == layer_idx]:
        del rt.policy.choice_stats[key]
    return True


def check_wanted(rt, max_error, policy: str) -> bool:
    """Whether a call measures the quality check at all (its cadence aside: `check_due`): under "auto" with a limit,
    and under "always" where the check also decides recall escalation (rt.settings.policy.escalate_recall)."""
    escalating = rt.settings.policy.escalate_recall is not None
    return max_error is not None and (policy == "auto" or (policy == "always" and escalating))


def widen_or_hold(rt, layer_idx, index, s, seq_len: int, prediction, policy: str, training: bool,
                  paid: bool | None = None) -> tuple[int, bool]:
    """After auto decided a training call: `widen` the layer's caps where they bind, else `hold` it as before (paid:
    `hold`'s). Returns (the cap scale this call estimated with, whether it widened), what `record_layer` records."""
    cap_scale = rt.policy.cap_scale.get(layer_idx, 1)
    widened = widen(rt, layer_idx, index, s, seq_len, policy, training)
    if not widened:
        hold(rt, layer_idx, prediction, policy, training, paid)
    return cap_scale, widened


def check_due(rt, layer_idx, training: bool) -> bool:
    """Whether this call measures the quality check's output error (`quality_error`): always outside training, with
    no layer index or with no hold (dense_hold 0: every call); in training, unless the layer passed the check less
    than dense_hold steps ago (`passed_check`). The check costs two partial-attention calls over the scored rows'
    query blocks; a layer's pattern, and so its error, moves slowly in training (the premise of the holds), so a layer
    that passed is measured once per hold period, the cadence at which a held-dense layer estimates again."""
    if not training or layer_idx is None or rt.settings.policy.dense_hold <= 0:
        return True
    return rt.inputs.step >= rt.policy.checked_until.get(layer_idx, -1)


def passed_check(rt, layer_idx, path: str, training: bool) -> None:
    """After a training call measured the check and ran sparse: skip the check on this layer for dense_hold steps.
    A layer the check sent dense is held dense by `hold` instead (and is measured again when its hold ends)."""
    if not training or layer_idx is None or rt.settings.policy.dense_hold <= 0 or path != "sparse":
        return
    rt.policy.checked_until[layer_idx] = rt.inputs.step + 1 + rt.settings.policy.dense_hold


def record_layer(rt, layer_idx, path, index, prediction, q=None, k=None, scaling=None, doc_ids=None,
                 true_recall=None, cap_scale: int = 1, widened: bool = False, layer=False) -> None:
    """Append this call's LayerRecord; on sample_recall steps measure the true recall of a sparse call on
    rt.inputs.recall_rows rows spread evenly over the sequence (ending at the last row). q/k: the whole
    sequence (None under CP, where no rank holds it: the ring measures it across the group and passes
    `true_recall` instead). cap_scale: the layer's cap multiplier this call estimated with; widened: whether this
    call's choice doubled it (`widen`). layer_idx: the key of the policy's state; layer: the record's layer
    (default: layer_idx)."""
    from mtrain.ops.index import list_bytes

    # own copies of the index's small tensors: a graph-replayed index's are views into its one buffer (`own`)
    record = LayerRecord(layer_idx if layer is False else layer, path, index.density_tensor(), est_recall=own(index._cache.get("est_recall")),
                         true_recall=true_recall, output_error=index._cache.get("output_error"),
                         cap_scale=cap_scale, widened=widened, index_bytes=list_bytes(index),
                         escalated_recall=rt.policy.layer_recall.get(layer_idx) if layer_idx is not None else None)
    if prediction is not None:
        record.dense_ms, record.sparse_ms = prediction.dense_ms, prediction.sparse_ms
    if rt.inputs.sample_recall and path == "sparse" and q is not None:
        from mtrain.ops.recall import sampled_rows, true_recall

        rows = sampled_rows(q.shape[1], rt.inputs.recall_rows)  # on the host: true_recall reads none back
        with torch.no_grad():
            record.true_recall = true_recall(q.detach(), k.detach(), index, softmax_scale=scaling, doc_ids=doc_ids,
                                             rows=rows)
    rt.records.densities.append(record.density)
    rt.records.layers.append(record)


def replay_choice(rt, layer_idx):
    """(path, lines) that this layer's first forward chose, while gradient checkpointing recomputes it; else None."""
    if rt.inputs.recomputing and layer_idx is not None:
        return rt.policy.memo.get(layer_idx)
    return None


def remember_choice(rt, layer_idx, path: str, index, training: bool) -> None:
    """Keep this training forward's choice for the layer's recomputation (see `AttentionRuntime.checkpoint_contexts`)."""
    if not training or layer_idx is None or not torch.is_grad_enabled():
        return
    lines = None if index is None else own(index._cache.get("lines"))  # not views that keep the lists alive
    if path == "sparse" and lines is None:
        rt.policy.memo.pop(layer_idx, None)  # nothing to rebuild from: the recomputation estimates again
    else:
        rt.policy.memo[layer_idx] = (path, lines)


def document_lengths(rt, doc_ids) -> list[int]:
    """Lengths of the runs of equal document ids of every row of doc_ids [B, S]: the batch's
    (`AttentionRuntime.set_documents`, read once per batch) when doc_ids are its ids, else one host read here."""
    docs = rt.inputs.documents
    if docs is not None and docs.doc_ids is doc_ids:
        return [n for row in docs.lengths for n in row]
    change = torch.ones_like(doc_ids, dtype=torch.bool)
    change[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = torch.nonzero(change.flatten()).flatten().tolist()
    return [b - a for a, b in zip(starts, starts[1:] + [doc_ids.numel()])]
