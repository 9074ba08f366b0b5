"""Multi-rank ring attention on CPU/gloo (one spawned group per world size runs every layout x dense/sparse x
flat/hierarchical case) against single-device attention on the whole sequence: out 1e-5, grads 1e-4."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from mtrain.ops import SparseIndex
from mtrain.parallel import LAYOUT_NAMES, Layout, SparseSettings, estimate_ring_index, ring_attention
from mtrain.parallel.comm import hierarchical_groups

SEQ_LEN = 256
BLOCK = 16
HQ, HKV, DIM = 4, 2, 16
OUT_TOL, GRAD_TOL = 1e-5, 1e-4


def reference_attention(q, k, v, mask, scale):
    """Plain masked softmax attention in float64 on the whole sequence (mask [B, Hq, S, S] or None = causal)."""
    s = q.shape[1]
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    if mask is None:
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(q.shape[0], q.shape[2], s, s)
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)


def make_index(batch: int, seed: int) -> SparseIndex:
    """A vertical-slash index with a local window, far slashes and scattered verticals, per head."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.randint(0, SEQ_LEN, (batch, HQ, 6), generator=g)
    vertical[..., 0] = -1  # padding is allowed
    window = torch.arange(5).expand(batch, HQ, 5)
    far = torch.randint(20, SEQ_LEN, (batch, HQ, 3), generator=g)
    return SparseIndex.from_lines(vertical, torch.cat([window, far], -1), SEQ_LEN, BLOCK)


def make_docs() -> torch.Tensor:
    """Document ids [2, SEQ_LEN] of two packed samples with different spans: starts mid-block and
    mid-shard, a one-token document in each (mid-sequence; the very last token), ids not 0..n-1."""
    docs = torch.zeros(2, SEQ_LEN, dtype=torch.long)
    for row, (starts, first_id, step) in enumerate((([0, 37, 38, 100, 171, 230], 0, 1),
                                                    ([0, 23, 90, 91, 150, 255], 5, 3))):
        for n, start in enumerate(starts):
            docs[row, start:] = first_id + n * step
    return docs


def doc_mask(docs: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] same-document pairs."""
    return (docs[:, :, None] == docs[:, None, :])[:, None]


def _inputs(batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, SEQ_LEN, HQ, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(batch, SEQ_LEN, HKV, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(batch, SEQ_LEN, HKV, DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, SEQ_LEN, HQ, DIM, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _max_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


_REFERENCES: dict = {}  # per rank process: (mode, docs) -> the single-device reference (`_reference`)


def _reference(mode, docs, settings, index, doc_ids, q, k, v, dout, scale) -> dict:
    """The single-device float64 reference of one (mode, docs) input on the whole sequence: its index (the given one,
    or the one a single device estimates), out, dq/dk/dv, and the document-free and dense outputs. It does not depend on
    the world, layout or schedule (the inputs are seeded), so each rank computes it once for all the cases sharing it."""
    key = (mode, docs)
    if key in _REFERENCES:
        return _REFERENCES[key]
    ref_index = index
    if settings is not None:
        from mtrain.ops.estimate import estimate_vertical_slash

        ref_index = estimate_vertical_slash(
            q.float(), k.float(), recall=0.9, last_q=16, max_vertical=6, max_slash=6, block_size=BLOCK,
            min_vertical=2, min_slash=2, share_kv_group=settings.share_kv_group, softmax_scale=scale,
            doc_ids=doc_ids)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    mask = ref_index.to_mask() if ref_index is not None else None
    ref = {"index": ref_index}
    if doc_ids is not None:  # the same-document rule on top of causal + index
        causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
        doc_free = mask
        mask = (causal if mask is None else mask) & doc_mask(doc_ids)
        ref["doc_free"] = reference_attention(q, k, v, doc_free, scale)
    ref_out = reference_attention(*full, mask, scale)
    ref_out.backward(dout)
    ref["out"], ref["grads"] = ref_out.detach(), [t.grad for t in full]
    if ref_index is not None:
        ref["dense"] = reference_attention(q, k, v, None, scale)
    _REFERENCES[key] = ref
    return ref


def _run_case(rank, world, layout_name, mode, schedule, groups, results, local_world_size=None, docs=False,
              ring_schedule="ring", dense_schedule="ring"):
    """One ring run (fwd + bwd) against the float64 reference; docs: with document ids (`make_docs`);
    ring_schedule: `ring_attention`'s schedule ("gather": one call over the group's gathered K/V); dense_schedule:
    its dense_schedule ("gather": dense calls as one varlen call per run over the gathered K/V)."""
    batch, seed = 2, 7
    doc_ids = make_docs() if docs else None
    q, k, v, dout = _inputs(batch, seed)
    scale = 1.0 / math.sqrt(DIM)
    index = make_index(batch, seed) if mode == "sparse" else None
    settings = None
    ref_index = index
    if mode.startswith("estimate"):
        settings = SparseSettings(recall=0.9, last_q=16, max_vertical=6, max_slash=6, block_size=BLOCK,
                                  min_vertical=2, min_slash=2, share_kv_group=mode == "estimate-shared")
    layout = Layout.create(layout_name, world_size=world, granularity=BLOCK, local_world_size=local_world_size)

    # the ring, on this rank's fp32 shards
    kwargs = {}
    if groups is not None:  # a hierarchical schedule with these (inner, outer) groups
        kwargs = {"inner_group": groups[0], "outer_group": groups[1]}
    shards = [layout.shard(t.float(), rank).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    ring_index = index
    if settings is not None:  # the estimated modes: the index estimated across the group first
        ring_index = estimate_ring_index(shards[0], shards[1], layout=layout, settings=settings, doc_ids=doc_ids,
                                         schedule=ring_schedule)
    out = ring_attention(shards[0], shards[1], shards[2], group=None, layout=layout, index=ring_index,
                         doc_ids=doc_ids, schedule=ring_schedule, dense_schedule=dense_schedule, **kwargs)
    out.backward(shards[3])

    record = {}
    ref = _reference(mode, docs, settings, index, doc_ids, q, k, v, dout, scale)
    if settings is not None:
        # the index every rank estimated is the one a single device estimates from the whole sequence
        from mtrain.parallel.estimate import estimate_index

        pos = layout.indices(SEQ_LEN, rank)
        got = estimate_index(shards[0].detach(), shards[1].detach(), pos, pos, SEQ_LEN, settings, scale, None,
                             doc_ids=doc_ids)
        record["index_equal"] = all(
            torch.equal(getattr(got, f), getattr(ref["index"], f))
            for f in ("block_ids", "block_counts", "col_ids", "col_counts"))
        record["index_density"] = ref["index"].density()
    if doc_ids is not None:  # the documents must matter, or the document cases would prove nothing
        record["gap_to_doc_free"] = _max_err(out.detach(), layout.shard(ref["doc_free"], rank))
    record["out"] = _max_err(out.detach(), layout.shard(ref["out"], rank))
    if ref["index"] is not None:  # the sparse pattern must matter, or the sparse cases would prove nothing
        record["gap_to_dense"] = _max_err(out.detach(), layout.shard(ref["dense"], rank))
    for name, got, want in zip(("dq", "dk", "dv"), shards[:3], ref["grads"]):
        record[name] = _max_err(got.grad, layout.shard(want, rank))
    results[f"{world}/{layout_name}/{mode}{'-docs' if docs else ''}/{schedule}"] = record


def _run_bf16_case(rank, world, layout_name, mode, results, schedule="ring", dense_schedule="ring"):
    """bf16 ring vs float64 reference, against the same-precision single-device op (flash-attn's rule:
    within 2x the error of a same-precision run); schedule "gather": the gathered schedule (its column gradients
    fold into their rows in bf16 before the owners sum the parts)."""
    from mtrain.ops.partial_autograd import partial_attention

    q, k, v, dout = _inputs(1, 3)
    scale = 1.0 / math.sqrt(DIM)
    index = make_index(1, 3) if mode == "sparse" else None
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*full, index.to_mask() if index is not None else None, scale)
    ref.backward(dout)
    layout = Layout.create(layout_name, world_size=world, granularity=BLOCK)
    shards = [layout.shard(t.bfloat16(), rank).requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout))]
    out = ring_attention(shards[0], shards[1], shards[2], group=None, layout=layout, index=index, schedule=schedule,
                         dense_schedule=dense_schedule)
    out.backward(shards[3])
    one = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    pos = torch.arange(SEQ_LEN)
    if dense_schedule == "gather":  # the same varlen kernel on one device (on the CPU: SDPA, bf16 in its backward)
        from mtrain.ops.varlen import Segments, varlen_attention

        one_out = varlen_attention(*(t[0] for t in one), Segments.build([SEQ_LEN]), scale)[None]
    else:
        one_out, _ = partial_attention(*one, q_pos=pos, k_pos=pos, blocks=None if index is None else index.blocks,
                                       columns=None if index is None else index.columns, block_size=BLOCK,
                                       impl="torch")
    one_out.backward(dout.bfloat16())
    record = {}
    for name, ring_t, one_t, ref_t in (("out", out.detach(), one_out.detach(), ref.detach()),
                                       ("dq", shards[0].grad, one[0].grad, full[0].grad),
                                       ("dk", shards[1].grad, one[1].grad, full[1].grad),
                                       ("dv", shards[2].grad, one[2].grad, full[2].grad)):
        ref_shard = layout.shard(ref_t, rank)
        record[name] = [_max_err(ring_t, ref_shard), _max_err(layout.shard(one_t, rank), ref_shard)]
    label = "dense-gather" if dense_schedule == "gather" else "flat" if schedule == "ring" else schedule
    results[f"{world}/{layout_name}/{mode}-bf16/{label}"] = record


def _worker(rank, world, init_file, out_dir, hierarchies):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for local in hierarchies:
        groups = hierarchical_groups(None, local)
        for layout_name in LAYOUT_NAMES:
            for mode in ("dense", "sparse"):
                # with the node-aware layout the hierarchical ring's steps are balanced
                _run_case(rank, world, layout_name, mode, f"hierarchical{world // local}x{local}", groups, results,
                          local_world_size=local)
    for layout_name in LAYOUT_NAMES:
        for mode in ("dense", "sparse"):
            _run_case(rank, world, layout_name, mode, "flat", None, results)
        # the gathered schedule: sparse layers in one call over the group's K/V (dense ones run the ring)
        for mode in ("dense", "sparse"):
            _run_case(rank, world, layout_name, mode, "gather", None, results, ring_schedule="gather")
    if world in (2, 4):
        _run_case(rank, world, "block-stripe", "estimate", "gather", None, results, ring_schedule="gather")
        # dense calls as one varlen call per run over the gathered K/V (documents crossing the shards' edges)
        for layout_name in GATHER_DENSE_LAYOUTS:
            for docs in (False, True):
                _run_case(rank, world, layout_name, "dense", "dense-gather", None, results, docs=docs,
                          dense_schedule="gather")
    if world == 4:
        for layout_name, mode in (("block-stripe", "sparse"), ("zigzag", "estimate"), ("contiguous", "estimate")):
            _run_case(rank, world, layout_name, mode, "gather", None, results, docs=True, ring_schedule="gather")
        # document masking: every layout x dense / given index / estimated index x flat / hierarchical 2x2
        for schedule, doc_groups, local in (("flat", None, None), ("hierarchical2x2", hierarchical_groups(None, 2), 2)):
            for layout_name in LAYOUT_NAMES:
                for mode in DOC_MODES:
                    _run_case(rank, world, layout_name, mode, schedule, doc_groups, results, local_world_size=local,
                              docs=True)
        # outer group as the trainer's mesh builds it: the ranks with equal node-local index
        by_local = [dist.new_group([n * 2 + local for n in range(2)]) for local in range(2)]
        groups = (hierarchical_groups(None, 2)[0], by_local[rank % 2])
        _run_case(rank, world, "block-stripe", "sparse", "hierarchical2x2-local-outer", groups, results,
                  local_world_size=2)
        _run_case(rank, world, "block-stripe", "estimate", "flat", None, results)
        _run_case(rank, world, "zigzag", "estimate-shared", "flat", None, results)
        _run_bf16_case(rank, world, "zigzag", "dense", results)
        _run_bf16_case(rank, world, "zigzag", "dense", results, dense_schedule="gather")
        _run_bf16_case(rank, world, "block-stripe", "sparse", results)
        _run_bf16_case(rank, world, "block-stripe", "sparse", results, schedule="gather")
        # groups derived from LOCAL_WORLD_SIZE (2 nodes of 2) when none are passed in; a plain layout under
        # a hierarchical ring is unbalanced (it warns) but must stay exact
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _run_case(rank, world, "zigzag", "sparse", "derived", None, results)
        results["4/zigzag/sparse/derived"]["warned"] = any("not balanced" in str(w.message) for w in seen)
        del os.environ["LOCAL_WORLD_SIZE"]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


_WORLDS = {2: (), 4: (2,), 8: (4,)}  # world size -> node sizes of the hierarchical cases (2x2, 2x4)
DOC_MODES = ("dense", "sparse", "estimate")  # with document ids (world 4: every layout, flat and 2x2)
GATHER_DENSE_LAYOUTS = ("contiguous", "zigzag")  # the layouts whose shards are a few runs (dense_schedule gather)


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    # the ranks fork from the server of tests/ranks.py, which imported torch and mtrain's ring once
    from ranks import run_ranks

    results = {}
    for world, hierarchies in _WORLDS.items():
        out_dir = tmp_path_factory.mktemp(f"ring{world}")
        run_ranks(_worker, world, (world, str(out_dir / "init"), str(out_dir), hierarchies))
        for rank in range(world):
            with open(out_dir / f"rank{rank}.json") as f:
                for case, record in json.load(f).items():
                    results.setdefault(case, []).append(record)
    return results


def _cases():
    cases = []
    for world, hierarchies in _WORLDS.items():
        schedules = ["flat", "gather"] + [f"hierarchical{world // local}x{local}" for local in hierarchies]
        for schedule in schedules:
            for layout_name in LAYOUT_NAMES:
                for mode in ("dense", "sparse"):
                    cases.append(f"{world}/{layout_name}/{mode}/{schedule}")
    cases += [f"4/{layout_name}/{mode}-docs/{schedule}" for schedule in ("flat", "hierarchical2x2")
              for layout_name in LAYOUT_NAMES for mode in DOC_MODES]
    cases += [f"{world}/{layout_name}/dense{docs}/dense-gather" for world in (2, 4) for layout_name in
              GATHER_DENSE_LAYOUTS for docs in ("", "-docs")]
    cases += ["2/block-stripe/estimate/gather", "4/block-stripe/estimate/gather", "4/block-stripe/sparse-docs/gather",
              "4/zigzag/estimate-docs/gather", "4/contiguous/estimate-docs/gather"]
    return cases + ["4/block-stripe/sparse/hierarchical2x2-local-outer", "4/block-stripe/estimate/flat", "4/zigzag/estimate-shared/flat", "4/zigzag/sparse/derived"]


@pytest.mark.parametrize("case", ["4/zigzag/dense-bf16/flat", "4/zigzag/dense-bf16/dense-gather",
                                  "4/block-stripe/sparse-bf16/flat",
                                  "4/block-stripe/sparse-bf16/gather"])
def test_ring_bf16_within_twice_single_device_error(ring_results, case):
    for rank, record in enumerate(ring_results[case]):
        for name, (ring_err, one_err) in record.items():
            assert ring_err <= 2 * one_err, f"{case} rank {rank}: {name} error {ring_err:.2e} > 2 x {one_err:.2e}"


@pytest.mark.parametrize("case", _cases())
def test_ring_matches_single_device(ring_results, case):
    records = ring_results[case]
    world = int(case.split("/")[0])
    assert len(records) == world, f"{case}: {len(records)} of {world} ranks reported"
    for rank, record in enumerate(records):
        assert record["out"] < OUT_TOL, f"{case} rank {rank}: out differs by {record['out']:.2e}"
        for name in ("dq", "dk", "dv"):
            assert record[name] < GRAD_TOL, f"{case} rank {rank}: {name} differs by {record[name]:.2e}"
        if "warned" in record:
            assert record["warned"], f"{case} rank {rank}: no warning about the unbalanced plain layout"
        if "index_equal" in record:
            assert record["index_equal"], f"{case} rank {rank}: estimated index differs from the single-device one"
            assert record["index_density"] < 0.9, f"{case}: the estimate kept nearly everything; the test is too weak"
    if "gap_to_doc_free" in records[0]:
        assert max(r["gap_to_doc_free"] for r in records) > 1e-2, f"{case}: documents changed nothing"
    if "gap_to_dense" in records[0]:  # some rank's rows must differ from dense (the first rows may not)
        assert max(r["gap_to_dense"] for r in records) > 1e-2, f"{case}: sparse output equals dense attention"


def test_ring_attention_argument_errors(single_process_group):
    from mtrain.errors import MtrainError

    q = torch.randn(1, 64, 4, 16)
    kv = torch.randn(1, 64, 2, 16)
    layout = Layout.create("block-stripe", world_size=1, granularity=16)
    with pytest.raises(MtrainError, match="layout is for 2 ranks"):
        ring_attention(q, kv, kv, group=None, layout=Layout.create("zigzag", world_size=2))
    with pytest.raises(TypeError, match="sparse"):  # it takes a finished index (estimate_ring_index estimates one)
        ring_attention(q, kv, kv, group=None, layout=layout, sparse=SparseSettings())
    with pytest.raises(MtrainError, match="SparseIndex is for 256 tokens"):
        ring_attention(q, kv, kv, group=None, layout=layout, index=make_index(1, 0))
    with pytest.raises(MtrainError, match="multiple of Hkv"):
        ring_attention(q, torch.randn(1, 64, 3, 16), torch.randn(1, 64, 3, 16), group=None, layout=layout)
    with pytest.raises(MtrainError, match="both inner_group and outer_group"):
        ring_attention(q, kv, kv, group=None, layout=layout, inner_group=dist.group.WORLD)
    with pytest.raises(MtrainError, match="doc_ids must be an integer tensor"):
        ring_attention(q, kv, kv, group=None, layout=layout, doc_ids=torch.zeros(1, 32, dtype=torch.long))
    with pytest.raises(MtrainError, match="doc_ids must be an integer tensor"):
        ring_attention(q, kv, kv, group=None, layout=layout, doc_ids=torch.zeros(1, 64))
    with pytest.raises(MtrainError, match="doc_ids must be an integer tensor"):
        estimate_ring_index(q, kv, layout=layout, settings=SparseSettings(block_size=16), doc_ids=torch.zeros(1, 64))
    with pytest.raises(MtrainError, match=r"attention.recall: must be in \(0, 1\]"):
        SparseSettings(recall=1.5)
    # one rank: the ring is plain attention
    out = ring_attention(q, kv, kv, group=None, layout=layout)
    ref = reference_attention(q.double(), kv.double(), kv.double(), None, 0.25)
    assert _max_err(out, ref) < OUT_TOL
    # and with documents, plain attention within each document
    docs = (torch.arange(64) >= 29).long()[None]
    out = ring_attention(q, kv, kv, group=None, layout=layout, doc_ids=docs)
    mask = torch.ones(64, 64, dtype=torch.bool).tril() & doc_mask(docs)
    ref = reference_attention(q.double(), kv.double(), kv.double(), mask, 0.25)
    assert _max_err(out, ref) < OUT_TOL
