"""The distributed estimate through the Triton scorer (run by the interpreter on gloo): every rank scores the sampled
rows against its own key blocks, the rows' softmax normaliser is combined over ranks, and the lines equal one device's
for every block-aligned layout, with documents and shared KV-group budgets; layouts that split blocks fall back to
the torch scorer (the ranks are forked from a server started with TRITON_INTERPRET=1, tests/ranks.py). Also the ring's fa4 engine falling
back to our kernels where FA4 cannot run. (The fused merge kernel: tests/test_ops_merge_kernel.py.)"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

S, HQ, HKV, D, BLOCK = 256, 4, 2, 16, 16
CASES = {
    "defaults": ({}, False),
    "shared": ({"share_kv_group": True, "recall": 0.9}, False),
    "docs": ({"recall": 0.95, "sample_blocks": 5}, True),
}


def _planted():
    """Queries that attend to key 100 (a vertical) and to the key 9 tokens back (a slash)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, S, HQ, D, generator=gen) * 0.3
    k = torch.randn(1, S, HKV, D, generator=gen)
    k[:, 100], k[:, 100, :, 0] = 0.0, 40.0
    q[:, :, :, 0] = 2.0
    for h in range(HQ):
        q[:, 9:, h, 1:] += 2.5 * k[:, :-9, h // (HQ // HKV), 1:]
    return q, k


def _docs() -> torch.Tensor:
    docs = torch.zeros(1, S, dtype=torch.long)
    docs[:, 90:], docs[:, 200:] = 1, 2
    return docs


def _worker(rank, world, layouts, init_file, out_file):
    import torch.distributed as dist

    from mtrain.errors import MtrainError
    from mtrain.ops.estimate import estimate_vertical_slash
    from mtrain.parallel import Layout, SparseSettings
    from mtrain.parallel.estimate import (estimate_index, estimate_rank_index, estimate_rank_lines,
                                          rank_index_from_lines)
    from mtrain.parallel.plan import rank_blocks, shard_key_blocks

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    q, k = _planted()
    results = {}
    for layout_name in layouts:
        layout = Layout.create(layout_name, world_size=world, granularity=BLOCK)
        pos = layout.indices(S, rank)
        blocks = shard_key_blocks(layout, S, rank, BLOCK, torch.device("cpu"))
        for name, (extra, with_docs) in CASES.items():
            kw = {"block_size": BLOCK, "sample_blocks": 4, **extra}
            doc_ids = _docs() if with_docs else None
            want = estimate_vertical_slash(q, k, doc_ids=doc_ids, **kw)
            args = (layout.shard(q, rank), layout.shard(k, rank), pos, pos, S, SparseSettings(**kw), 1 / math.sqrt(D),
                    None)
            if blocks is None:  # blocks split across ranks: the Triton scorer refuses, auto takes the torch one
                try:
                    estimate_index(*args, doc_ids=doc_ids, scorer="triton")
                    refused = False
                except MtrainError:
                    refused = True
                got = estimate_index(*args, doc_ids=doc_ids, scorer="auto")
            else:
                refused = None
                got = estimate_index(*args, doc_ids=doc_ids, scorer="triton", key_blocks=blocks)
            same = all(torch.equal(getattr(got, f), getattr(want, f))
                       for f in ("block_ids", "block_counts", "col_ids", "col_counts"))
            err = float((got._cache["est_recall"] - want._cache["est_recall"]).abs().max())
            row = {"same": same, "recall_err": err, "density": want.density(), "refused": refused}
            if blocks is not None and name == "defaults":  # the per-rank rows the ring uses
                mine = estimate_rank_index(*args, scorer="triton", key_blocks=blocks,
                                           rows=rank_blocks(layout, S, rank, BLOCK, torch.device("cpu")))
                row["rows_same"] = bool(torch.equal(mine.block_counts, want.block_counts[:, :, mine.rows])
                                        and torch.equal(mine.col_counts, want.col_counts[:, :, mine.rows]))
                # the two halves a CUDA graph splits it into at large caps (mtrain.parallel.graphed): the same index
                lines = estimate_rank_lines(*args, key_blocks=blocks)
                halves = rank_index_from_lines(lines, pos, pos, S, SparseSettings(**kw), None, rows=mine.rows)
                row["rows_same"] &= all(torch.equal(getattr(halves, f), getattr(mine, f)) for f in
                                        ("block_ids", "block_counts", "col_ids", "col_counts", "rows")) and \
                    torch.equal(halves._cache["est_recall"], mine._cache["est_recall"])
            results[f"{layout_name}/{name}"] = row
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _run(tmp_path, world, layouts):
    from ranks import run_ranks

    # the ranks fork from a server that runs Triton's interpreter, whatever this session imported
    run_ranks(_worker, world, (world, layouts, str(tmp_path / "init"), str(tmp_path / "out")), interpret=True)
    for rank in range(world):
        results = json.loads((tmp_path / f"out.{rank}").read_text())
        assert len(results) == len(layouts) * len(CASES)
        for case, r in results.items():
            assert r["same"], f"CP={world} rank {rank} {case}: the Triton CP lines differ from one device's"
            assert r["recall_err"] < 1e-5, f"CP={world} rank {rank} {case}: est_recall off by {r['recall_err']:.2e}"
            assert r["density"] < 0.9, f"{case}: density {r['density']:.2f}, the case tests nothing"
            assert r["refused"] in (None, True), f"{case}: scorer='triton' accepted a shard of split blocks"
            assert r.get("rows_same", True), f"CP={world} rank {rank} {case}: rank rows differ"


@pytest.mark.slow  # ~20 s on 2 cores: 15 estimates of 2 ranks in the interpreter (the scorer alone: quick, in
# tests/test_ops_interpreter.py; the distributed estimate's lines against one device's: tests/test_parallel_ring.py)
def test_triton_cp_estimate_gives_one_devices_lines_cp2(tmp_path):
    _run(tmp_path, 2, ("block-stripe", "zigzag", "contiguous", "stripe"))


@pytest.mark.slow
def test_triton_cp_estimate_gives_one_devices_lines_cp4(tmp_path):
    _run(tmp_path, 4, ("block-stripe", "zigzag"))


def test_ring_fa4_engine_falls_back_where_fa4_cannot_run(single_process_group):
    """On the CPU (no FA4, fp32) engine='fa4' and 'auto' run our kernels: the same output as engine='triton'."""
    from mtrain.ops import SparseIndex
    from mtrain.parallel import Layout, ring_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 128, 4, 16, generator=g), torch.randn(1, 128, 2, 16, generator=g), \
        torch.randn(1, 128, 2, 16, generator=g)
    index = SparseIndex.from_lines(torch.tensor([[[5, 70]] * 4]), torch.tensor([[[0, 40]] * 4]), 128, 16)
    layout = Layout.create("block-stripe", world_size=1, granularity=16)
    outs = {e: ring_attention(q, k, v, layout=layout, index=index, engine=e) for e in ("triton", "fa4", "auto")}
    assert torch.equal(outs["fa4"], outs["triton"]) and torch.equal(outs["auto"], outs["triton"])
    with pytest.raises(ValueError, match="ring engine must be one of"):
        ring_attention(q, k, v, layout=layout, index=index, engine="flash")
