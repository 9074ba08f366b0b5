"""The estimated sparse ring's per-layer path reads nothing back to the host but the one read of the lines' widths
(issue #27), and none under the gathered schedule where the columns are list-free and the block lists small: every
host synchronisation a GPU would make (item / int / bool of a tensor, nonzero, boolean indexing, bincount, unique,
repeat_interleave without a size) is counted on the CPU through a dispatch mode, over one whole fwd+bwd of
`estimate_ring_index` and `ring_attention` on its index on 2 gloo ranks with the Triton scorer and steps (in the
interpreter), the gathered schedule's K/V all-gather started before the estimate, as an estimated layer runs."""

import json

import pytest
import torch

from syncs import CountSyncs, count_tolist


def _worker(rank, world, init_file, out_file):
    import os

    import torch.distributed as dist

    from mtrain.parallel import Layout, SparseSettings, estimate_ring_index, ring_attention
    from mtrain.parallel.ring_gather import KVGather, spare_bound

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    seq, bs = 1024, 64  # 8 query blocks a rank; the lines keep 86% of the blocks and ~350 columns (at 512: all)
    layout = Layout.create("block-stripe", world_size=world, granularity=bs)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, h, 16, generator=gen) for h in (2, 1, 1))
    shards = [layout.shard(t, rank).detach().requires_grad_() for t in (q, k, v)]
    settings = SparseSettings(block_size=bs, max_vertical=32, max_slash=512, last_q=32, sample_blocks=2)
    from mtrain.ops.switches import DEFAULTS, Switches

    def call(schedule, static_bytes):
        switches = Switches(static_width_bytes=static_bytes)
        gather = None
        if schedule == "gather":  # in flight while the estimate runs
            gather = KVGather(*shards[1:], None, spare=spare_bound(settings, 2, seq, seq // world))
        index = estimate_ring_index(*shards[:2], layout=layout, settings=settings, scorer="triton",
                                    schedule=schedule, switches=switches)
        out = ring_attention(*shards, layout=layout, index=index, engine="auto", schedule=schedule, kv_gather=gather,
                             switches=switches)
        out.square().sum().backward()

    results = {}
    # small caps: the rank's lists as wide as the lines allow (no host read); then lists sized from one host read;
    # then the gathered schedule where the column lists would pass the limit but the block lists fit (2 heads x 8
    # rows x 18 block slots x 4 bytes = 1,152 bytes; with the 32 column slots 3,200): list-free columns, no read
    cases = (("static", DEFAULTS.static_width_bytes, "ring"), ("read", 0, "ring"), ("read-gather", 0, "gather"),
             ("list-free-gather", 2000, "gather"))
    warm = set()
    for case, static_bytes, schedule in cases:
        if schedule not in warm:  # a schedule's first call: its cached layout tables (Triton compiles nothing here)
            call(schedule, static_bytes)
            warm.add(schedule)
        mode = CountSyncs()
        with count_tolist() as reads, mode:
            call(schedule, static_bytes)
        results[case] = {"syncs": dict(mode.sites), "tolist": list(reads)}
    assert os.environ.get("TRITON_INTERPRET") == "1"
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.slow  # ~30 s on 2 cores: 6 fwd+bwd of the estimated sparse ring, its kernels in the interpreter
def test_estimated_sparse_ring_reads_back_at_most_once_per_call(tmp_path):
    """No syncing op in the estimated sparse ring's per-layer path; no host read at all where the lines' caps are
    small (`parallel.static_width_mib`), or under the gathered schedule where the block lists alone are (list-free
    columns), else exactly one (the lists' widths, read by rows_from_lines' `_bounded_widths`)."""
    from ranks import run_ranks

    # the ranks run the scorer and steps' Triton kernels: forked from the interpreter's server
    run_ranks(_worker, 2, (2, str(tmp_path / "init"), str(tmp_path / "out")), interpret=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        for case in ("static", "read", "read-gather", "list-free-gather"):
            syncs, reads = got[case]["syncs"], got[case]["tolist"]
            assert syncs == {}, f"rank {rank} {case}: host synchronisations in the per-layer path: {syncs}"
        for case in ("static", "list-free-gather"):
            assert got[case]["tolist"] == [], (case, got[case]["tolist"])
        for case in ("read", "read-gather"):
            read = got[case]["tolist"]
            assert len(read) == 1 and "_bounded_widths" in read[0], (case, read)
