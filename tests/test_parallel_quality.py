"""The quality check under context parallelism (`mtrain.parallel.quality.gathered_output_error`): on gloo with 2 and
4 ranks, every rank's figure equals one device's `block_output_error` on the same lines and rows (fp32, 1e-5
relative: the partial results merged across ranks round differently from one pass), with and without document
masking, on block-stripe, zigzag and contiguous layouts; and it is far from zero (the lines drop real mass)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks

SEQ, BLOCK, HQ, HKV, DIM = 512, 16, 4, 2, 16


def _case(documents: bool):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, SEQ, HQ, DIM, generator=g)
    k, v = (torch.randn(1, SEQ, HKV, DIM, generator=g) for _ in range(2))
    vertical = torch.sort(torch.randint(0, SEQ, (1, HQ, 6), generator=g), -1).values
    slash = torch.cat([torch.arange(0, 2 * BLOCK, BLOCK).expand(1, HQ, 2),
                       torch.randint(3, SEQ // BLOCK, (1, HQ, 2), generator=g) * BLOCK], -1)
    docs = (torch.arange(SEQ) >= 200).long()[None] + (torch.arange(SEQ) >= 430).long()[None] if documents else None
    rows = torch.cat([torch.arange(40, 56), torch.arange(200, 216), torch.arange(SEQ - 24, SEQ)])  # 3 query blocks
    return q, k, v, vertical, slash, docs, rows


def _worker(rank, world, layout_name, documents, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from mtrain.parallel import Layout
    from mtrain.parallel.quality import gathered_output_error

    q, k, v, vertical, slash, docs, rows = _case(documents)
    layout = Layout.create(layout_name, world_size=world, granularity=BLOCK)
    shard = [layout.shard(t, rank) for t in (q, k, v)]
    positions = layout.indices(SEQ, rank)
    got = gathered_output_error(*shard, positions, (vertical, slash), SEQ, BLOCK, layout, rank, None, rows=rows,
                                doc_ids=docs)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(got.tolist(), f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world,layout_name,documents", [(2, "block-stripe", False), (4, "block-stripe", True),
                                                         (4, "zigzag", False), (2, "contiguous", True)])
def test_gathered_output_error_equals_one_device(tmp_path, world, layout_name, documents):
    from mtrain.ops import SparseIndex
    from mtrain.ops.recall import block_output_error, output_error

    q, k, v, vertical, slash, docs, rows = _case(documents)
    index = SparseIndex.from_lines(vertical, slash, SEQ, BLOCK)
    want = block_output_error(q, k, v, index, rows, doc_ids=docs)
    exact = output_error(q.double(), k.double(), v.double(), index, rows, doc_ids=docs)  # the float64 reference
    assert float(exact[0]) > 0.05
    torch.testing.assert_close(want.double(), exact, rtol=1e-4, atol=0.0)
    run_ranks(_worker, world, (world, layout_name, documents, str(tmp_path / "init"), str(tmp_path)))
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.json") as f:
            got = torch.tensor(json.load(f), dtype=torch.float32)
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=0.0)


def _layer_worker(rank, world, init_file, out_dir):
    """mtraining layer calls under CP (gloo) with the quality check, on the local pattern where sparse pays (the
    choice tests' inputs, the cost model without the estimate's own cost): each call's path and logged error, and
    the error one device measures on the same lines."""
    import dataclasses
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
    from attention_choice import BS, SEQ as N, inputs

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from mtrain.models.attention import mtrain_attention
    from mtrain.attention_settings import PolicySettings
    from mtrain.models.runtime import AttentionRuntime, AttentionSettings
    from mtrain.ops import SparseIndex, cost
    from mtrain.ops.estimate import row_plan
    from mtrain.ops.recall import block_output_error
    from mtrain.parallel import Layout, SparseSettings
    from mtrain.parallel.estimate import estimate_lines

    cost.CPU = dataclasses.replace(cost.CPU, estimate=(0.0, 0.0))
    q, k, v = inputs("local")
    settings = SparseSettings(recall=0.4, block_size=BS, max_vertical=4, max_slash=4, min_vertical=0, min_slash=0)
    layout = Layout.create("block-stripe", world_size=world, granularity=BS)
    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))  # the layer's attention runtime: the group, its holds and records
    RT.topology.group, RT.topology.layout, RT.inputs.doc_ids, RT.topology.schedule = dist.group.WORLD, layout, None, "ring"
    RT.topology.local_world_size, RT.topology.inner_group, RT.topology.outer_group = None, None, None
    RT.settings.set_policy(dense_hold_steps=0)
    positions = layout.indices(N, rank)
    shard = [t[:, positions] for t in (q, k, v)]
    vertical, slash = estimate_lines(*shard[:2], positions, positions, N, settings, q.shape[-1] ** -0.5, None)
    rows = row_plan(N, settings.last_q, settings.sample_blocks, BS, torch.device("cpu"), None)[0]
    one_device = float(block_output_error(q, k, v, SparseIndex.from_lines(vertical, slash, N, BS), rows)[0])
    record = {"one_device": one_device}
    for name, limit in (("none", None), ("above", one_device * 1.01), ("below", one_device * 0.99)):
        RT.records.layers.clear()
        module = SimpleNamespace(training=True, layer_idx=None, mtrain_runtime=RT)
        mtrain_attention(module, *(t.transpose(1, 2) for t in shard), None, settings=settings, policy="auto",
                         max_error=limit)
        (layer,) = RT.records.layers
        record[name] = {"path": layer.path,
                        "error": None if layer.output_error is None else float(layer.output_error[0])}
    # attention.escalate_recall across the group: caps with room, a limit between one device's errors at recall 0.4
    # and at 0.46 (an escalation the estimate reaches): the layer escalates on every rank and runs sparse
    wide = dataclasses.replace(settings, max_vertical=64, max_slash=64)
    errors = {}
    for recall in (0.4, 0.46):
        s = dataclasses.replace(wide, recall=recall)
        lines = estimate_lines(*shard[:2], positions, positions, N, s, q.shape[-1] ** -0.5, None)
        errors[recall] = float(block_output_error(q, k, v, SparseIndex.from_lines(*lines, N, BS), rows)[0])
    RT.records.layers.clear()
    RT.settings.set_policy(max_output_error=(errors[0.4] + errors[0.46]) / 2, escalate_recall=0.46)
    RT.policy.layer_recall, RT.policy.choice_stats = {}, {}
    mtrain_attention(SimpleNamespace(training=True, layer_idx=0, mtrain_runtime=RT), *(t.transpose(1, 2) for t in shard), None,
                     settings=wide, policy="auto", max_error=(errors[0.4] + errors[0.46]) / 2)
    (layer,) = RT.records.layers
    record["escalated"] = {"path": layer.path, "recall": layer.escalated_recall, "error": float(layer.output_error[0]),
                           "one_device": errors}
    with open(os.path.join(out_dir, f"layer{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_check_in_a_cp_layer_measures_one_devices_figure_and_decides_by_it():
    """Through `mtrain_attention` on 2 gloo ranks under sparse_policy auto, on a pattern where sparse pays: no limit,
    sparse and no figure; a limit just above the layer's error, sparse; just below, dense on every rank; the logged
    figure is one device's on the same lines (1e-5). With attention.escalate_recall and a limit between one device's
    errors at the base and the escalated recall, every rank escalates and runs sparse on the escalated index."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_layer_worker, 2, (2, os.path.join(tmp, "init"), tmp))
        records = []
        for rank in range(2):
            with open(os.path.join(tmp, f"layer{rank}.json")) as f:
                records.append(json.load(f))
    for record in records:
        assert record["one_device"] > 0.01
        assert record["none"] == {"path": "sparse", "error": None}
        for name, path in (("above", "sparse"), ("below", "dense")):
            assert record[name]["path"] == path, record
            assert record[name]["error"] == pytest.approx(record["one_device"], rel=1e-5)
        escalated = record["escalated"]
        low, high = escalated["one_device"]["0.4"], escalated["one_device"]["0.46"]
        assert high < low
        assert escalated["path"] == "sparse" and escalated["recall"] == 0.46, escalated
        assert escalated["error"] == pytest.approx(high, rel=1e-5)  # the escalated index's figure
    assert records[0] == records[1]
