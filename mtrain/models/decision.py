"""A sparse layer call's decision, one sequence of the policy's steps (`mtrain.models.policy`) wherever the call
runs: `decide` replays the first forward's choice while gradient checkpointing recomputes the layer, else skips an
estimate that cannot pay, estimates, measures the quality check (estimating again at the escalated recall where it
fails), chooses the path, widens the caps or holds the layer dense, sets the check's cadence, records the call and
remembers the choice. Where the call runs is a `Site`, which holds the few operations that differ: one device
(`OneDevice`, the whole sequence) or a rank of a context-parallel group (`RankOfGroup`, its shard: the estimate,
the check's figure and the sampled true recall are measured across the group, so every rank reads the same figures,
makes the same choice and joins the same collectives in the same order)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from mtrain.models.policy import (check_due, check_rows, check_wanted, choose_path, escalate, passed_check,
                                  quality_error, record_layer, remember_choice, replay_choice, scored_rows,
                                  skip_estimate, widen_or_hold)


class Site(Protocol):
    """Where a layer's call runs, as `decide` reads it."""

    seq_len: int
    """The whole sequence's tokens (a CP rank holds seq_len / group size of them)."""
    costs: dict
    """What `skip_estimate` and `choose_path` price the call with besides the shapes: world, doc_ids, engine,
    graphed (each as those functions take it)."""
    lagged: bool
    """Whether the choice reads the layer's previous estimate (attention.lagged_choice: `choose_path`'s layer_idx)."""
    floor: bool
    """Whether `skip_estimate` prices the call's floor (False: the caller priced it, e.g. a packed document at least
    the per-document break-even long: only the dense holds apply)."""
    paid_if_sparse: bool
    """Whether a sparse choice counts as having paid for its estimate (`hold`'s paid), whatever the prediction's fixed
    costs say: a packed document past a break-even measured on packed documents with its estimate
    (`cost.document_break_even`). False: the prediction says (`Prediction.estimate_paid`)."""

    def estimate(self, s):
        """The index estimated under SparseSettings `s` (a SparseIndex, or this rank's rows of one: a RowIndex)."""

    def output_error(self, index, s):
        """The quality check's figure of `index` estimated under `s`: fp32 [B]."""

    def of_lines(self, lines):
        """The index of the lines a remembered sparse choice kept (`remember_choice`)."""

    def record(self, path: str, index) -> dict:
        """`record_layer`'s keywords for this call besides the decision's: what measures the sampled true recall."""


def decide(rt, q, s, site: Site, *, policy: str, training: bool, key, memo_key, layer, max_error):
    """("sparse", index) or ("dense", None) for one call of a sparse layer over q [B, S_local, Hq, D] (this device's
    or this rank's) under SparseSettings `s` (the layer's: `layer_settings`) and `policy`, at `site`. key: the
    policy's state key (the layer index, or on one device with packed documents the layer's documents of one length
    class); memo_key: the key of the choice gradient checkpointing replays; layer: the records' layer; max_error:
    the quality check's limit (attention.max_output_error) or None."""
    replay = replay_choice(rt, memo_key)
    if replay is not None:  # gradient checkpointing recomputes this layer: its first forward's path and index
        path, lines = replay
        return ("sparse", site.of_lines(lines)) if path == "sparse" else ("dense", None)
    if policy == "never" or skip_estimate(rt, q, s, key, policy=policy, training=training, layer=layer,
                                          floor=site.floor, **site.costs):
        remember_choice(rt, memo_key, "dense", None, training)
        return "dense", None
    index, s, checked = _checked_estimate(rt, s, site, key, policy=policy, training=training, max_error=max_error)
    path, prediction = choose_path(rt, index, q, policy=policy, training=training, target=s.recall,
                                   rows=scored_rows(s, site.seq_len), layer_idx=key if site.lagged else None,
                                   max_error=max_error, **site.costs)
    # wider caps next call where they bind, else the dense hold
    cap_scale, widened = widen_or_hold(rt, key, index, s, site.seq_len, prediction, policy, training,
                                       paid=(path == "sparse") if site.paid_if_sparse else None)
    if checked:
        passed_check(rt, key, path, training)
    record_layer(rt, key, path, index, prediction, cap_scale=cap_scale, widened=widened, layer=layer,
                 **site.record(path, index))
    remember_choice(rt, memo_key, path, index, training)
    return path, (index if path == "sparse" else None)


def _checked_estimate(rt, s, site: Site, key, *, policy: str, training: bool, max_error):
    """(index, the SparseSettings it was estimated with, whether the quality check measured it): the estimate under
    `s`, and where the check is wanted and due (`check_wanted`, `check_due`) its figure in
    `index._cache["output_error"]`; over the limit, where `escalate` raises the layer's recall, the estimate again at
    the escalated recall, with its own figure."""
    index = site.estimate(s)
    checked = check_wanted(rt, max_error, policy) and check_due(rt, key, training)
    if checked:
        index._cache["output_error"] = site.output_error(index, s)
        if escalate(rt, key, index, max_error):
            s = dataclasses.replace(s, recall=rt.policy.layer_recall[key])
            index = site.estimate(s)
            index._cache["output_error"] = site.output_error(index, s)
    return index, s, checked


class OneDevice:
    """A call that holds the whole sequence: its estimate (on CUDA replayed from a graph once the shapes have been
    seen twice: `mtrain.ops.graphed.estimate_graphed`, with the engine's plans where `prepare` says), the check's
    figure (`quality_error`), a SparseIndex of remembered lines, and the true recall measured by `record_layer` from
    q / k. doc_ids: the documents masked within the one estimate, else None; engine / graphed: what the cost model
    prices (the concrete engine; whether the estimate runs from a graph that builds the engine's plans); floor,
    paid_if_sparse: `Site`'s."""

    lagged = True

    def __init__(self, rt, q, k, v, scaling, s, doc_ids=None, *, engine: str, prepare, graphed: bool,
                 floor: bool = True, paid_if_sparse: bool = False):
        self.floor, self.paid_if_sparse = floor, paid_if_sparse
        self.rt, self.q, self.k, self.v, self.scaling, self.doc_ids = rt, q, k, v, scaling, doc_ids
        self.block_size, self.prepare, self.seq_len = s.block_size, prepare, q.shape[1]
        self.costs = {"doc_ids": doc_ids, "engine": engine, "graphed": graphed}

    def estimate(self, s):
        from mtrain.ops.graphed import estimate_graphed

        # every SparseSettings field is an estimate_vertical_slash keyword of the same name
        fields = {**dataclasses.asdict(s), "last_q": min(s.last_q, self.seq_len)}
        # on CUDA replayed from a graph once the shapes have been seen twice (its ~280 launches are the cost at 32K),
        # with what the engine derives from the index (another ~100 launches) built in the same graph
        return estimate_graphed(self.q.detach(), self.k.detach(), **fields, softmax_scale=self.scaling,
                                doc_ids=self.doc_ids, prepare=self.prepare, switches=self.rt.switches)

    def output_error(self, index, s):
        return quality_error(self.q, self.k, self.v, index, s, self.scaling, self.doc_ids)

    def of_lines(self, lines):
        from mtrain.ops.index import SparseIndex

        return SparseIndex.from_lines(*lines, self.seq_len, self.block_size)

    def record(self, path: str, index) -> dict:
        return {"q": self.q, "k": self.k, "scaling": self.scaling, "doc_ids": self.doc_ids}


class RankOfGroup:
    """This rank's shard of a context-parallel group (`rt.topology`): the estimate across the group, each rank
    building its own rows of the index (`mtrain.parallel.ring.estimate_ring_index`), the check's figure across the
    group (`mtrain.parallel.quality.gathered_output_error`), this rank's rows of an index of remembered lines, and
    the sampled true recall across the group (a collective, on every rank alike since every rank takes the same
    path). Under parallel.schedule gather, the group's K/V all-gather starts before the first index is built
    (`gather`, in flight while the estimate runs; None otherwise). s: the layer's SparseSettings."""

    lagged = False
    floor, paid_if_sparse = True, False

    def __init__(self, rt, q, k, v, scale: float, world: int, s):
        import torch.distributed as dist

        self.rt, self.q, self.k, self.v, self.scale, self.world, self.settings = rt, q, k, v, scale, world, s
        self.rank, self.seq_len = dist.get_rank(rt.topology.group), q.shape[1] * world
        self.costs = {"world": world}
        self.gather, self._started = None, False

    def _start_gather(self) -> None:
        """The gathered schedule's K/V all-gather, started once (a layer the choice then sends dense drops it)."""
        topo = self.rt.topology
        if self._started or topo.schedule != "gather" or self.world == 1:
            return
        from mtrain.parallel.ring_gather import KVGather, spare_bound

        self._started = True
        spare = spare_bound(self.settings, self.q.shape[0] * self.q.shape[2], self.seq_len)
        self.gather = KVGather(self.k, self.v, topo.group, spare=spare)

    def estimate(self, s):
        from mtrain.parallel.ring import estimate_ring_index

        self._start_gather()  # the gathered schedule's K/V travel during the estimate
        topo = self.rt.topology
        return estimate_ring_index(self.q.detach(), self.k.detach(), group=topo.group, layout=topo.layout,
                                   settings=s, softmax_scale=self.scale, doc_ids=self.rt.inputs.doc_ids,
                                   schedule=topo.schedule, switches=self.rt.switches)

    def _positions(self):
        from mtrain.parallel.plan import rank_positions

        return rank_positions(self.rt.topology.layout, self.seq_len, self.rank, self.q.device)  # cached

    def output_error(self, index, s):
        from mtrain.parallel.quality import gathered_output_error

        vertical, slash, _ = index._cache["lines"]
        topo = self.rt.topology
        with torch.no_grad():
            return gathered_output_error(self.q.detach(), self.k.detach(), self.v.detach(), self._positions(),
                                         (vertical, slash), self.seq_len, s.block_size, topo.layout, self.rank,
                                         topo.group, rows=check_rows(s, self.seq_len), softmax_scale=self.scale,
                                         doc_ids=self.rt.inputs.doc_ids)

    def of_lines(self, lines):
        from mtrain.parallel.estimate import rank_index_of_lines

        self._start_gather()
        vertical, slash, rows = lines
        return rank_index_of_lines(vertical, slash, self.seq_len, self.settings.block_size, rows,
                                   schedule=self.rt.topology.schedule, switches=self.rt.switches)

    def record(self, path: str, index) -> dict:
        inputs = self.rt.inputs
        if not (inputs.sample_recall and path == "sparse"):
            return {}
        from mtrain.ops.recall import gathered_true_recall

        with torch.no_grad():
            recall = gathered_true_recall(self.q.detach(), self.k.detach(), self._positions(), index._cache["lines"],
                                          self.seq_len, self.settings.block_size, self.rt.topology.group,
                                          softmax_scale=self.scale, doc_ids=inputs.doc_ids, n_rows=inputs.recall_rows)
        return {"true_recall": recall}
