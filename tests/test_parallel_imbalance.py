"""The imbalance measure on hand-computable indices, its invariants, and the balance claim at small scale."""

from __future__ import annotations

import importlib

import pytest
import torch

from mtrain.ops import SparseIndex
from mtrain.ops.index import blocks_for_causal_dense
from mtrain.parallel import LAYOUT_NAMES, Layout, imbalance


def _sink_and_diagonal(n_blocks: int, block: int, vertical=()) -> SparseIndex:
    # no slashes: every row keeps just its diagonal block and the sink block (plus optional verticals)
    v = torch.tensor([list(vertical)], dtype=torch.long).view(1, 1, -1)
    return SparseIndex.from_lines(v, torch.empty(1, 1, 0, dtype=torch.long), n_blocks * block, block)


def test_dense_contiguous_by_hand():
    # 16 blocks, 4 ranks of 4 blocks: step 0 is a causal 4x4 triangle (10 blocks), an earlier shard is 16
    index = blocks_for_causal_dense(256, 16, 1, 1)
    result = imbalance(index, Layout.create("contiguous", world_size=4), vertical_on_ring=True)
    r = torch.arange(4).view(-1, 1)
    s = torch.arange(4).view(1, -1)
    expected = torch.where(s == 0, 10.0, torch.where(s <= r, 16.0, 0.0)).double()
    assert torch.equal(result["work"], expected)
    assert result["worker"] == pytest.approx(58 / 34)
    assert result["step"] == pytest.approx(58 / 34)
    assert result["total"] == pytest.approx(136)


@pytest.mark.parametrize("name", ["zigzag", "stripe"])
def test_dense_balanced_layouts(name):
    index = blocks_for_causal_dense(256, 16, 1, 1)
    result = imbalance(index, Layout.create(name, world_size=4), vertical_on_ring=True)
    assert result["worker"] == pytest.approx(1.0)
    assert result["step"] == pytest.approx(1.0)
    assert result["total"] == pytest.approx(136)


def test_sink_on_and_off_the_ring_by_hand():
    # block-stripe with G = block: row i lives on rank i % 4; rows list {0, i}
    index = _sink_and_diagonal(16, 16)
    layout = Layout.create("block-stripe", world_size=4, granularity=16)
    on = imbalance(index, layout, vertical_on_ring=True)
    # on the ring: diagonals at step 0 (4 per rank; row 0's diagonal is the sink itself), the sink of
    # rank r's rows lands at step r (rank 0: rows 4, 8, 12 at step 0)
    expected = torch.tensor([[7, 0, 0, 0], [4, 4, 0, 0], [4, 0, 4, 0], [4, 0, 0, 4]], dtype=torch.float64)
    assert torch.equal(on["work"], expected)
    assert on["step"] == pytest.approx(19 / 7.75)
    assert on["worker"] == pytest.approx(8 / 7.75)
    off = imbalance(index, layout)
    # off the ring: only diagonals remain on it (rank 0's row 0 diagonal is the sink); each rank attends
    # its 4 rows' sinks locally
    assert torch.equal(off["work"][:, 0], torch.tensor([3.0, 4, 4, 4], dtype=torch.float64))
    assert torch.equal(off["work"][:, 1:], torch.zeros(4, 3, dtype=torch.float64))
    assert torch.equal(off["local"], torch.full((4,), 4.0, dtype=torch.float64))
    assert off["step"] == pytest.approx(8 / 7.75)
    assert off["total"] == pytest.approx(on["total"])


def test_rank_holding_only_the_sink_block():
    """128 tokens, block 64, CP = 2 (block-stripe): rank 0 holds only the sink block, so nothing of its rows is
    left on the ring; its measure is zeros, not an integer tensor (the CP = 2 short-shard crash of rank_work)."""
    from mtrain.ops.index import rows_from_lines
    from mtrain.parallel.imbalance import rank_work

    index = _sink_and_diagonal(2, 64)
    layout = Layout.create("block-stripe", world_size=2, granularity=64)
    whole = imbalance(index, layout)
    # rank 0's row 0 lists only the sink (attended off the ring); rank 1's row 1 keeps its diagonal at step 0
    assert torch.equal(whole["work"], torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=torch.float64))
    assert torch.equal(whole["local"], torch.tensor([1.0, 1.0], dtype=torch.float64))
    for rank in range(2):  # each rank holds only its own row, as under CP
        mine = rank_work(rows_from_lines(torch.empty(1, 1, 0, dtype=torch.long), torch.empty(1, 1, 0, dtype=torch.long),
                                         128, 64, torch.tensor([rank])), layout, rank)
        assert mine.dtype == torch.float64
        assert torch.equal(mine, torch.cat([whole["work"][rank], whole["local"][rank:rank + 1]]))


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_rank_work_is_its_row_of_the_whole_measure(name, monkeypatch):
    """Each rank's `rank_work` (counted per key block, a few list rows at a time, from the global index or from its
    own rows only) equals its row of `imbalance` computed from every entry: random verticals and slashes, CP = 4,
    flat and hierarchical (2 x 2) step orders, with the row budget so small that every list row is its own chunk."""
    from mtrain.ops.index import rows_from_lines
    measure = importlib.import_module("mtrain.parallel.imbalance")  # the package exports the function of that name

    g = torch.Generator().manual_seed(1)
    seq_len, block = 512, 16
    vertical, slash = torch.randint(0, seq_len, (1, 2, 9), generator=g), torch.randint(0, seq_len, (1, 2, 7), generator=g)
    index = SparseIndex.from_lines(vertical, slash, seq_len, block)
    for local in (None, 2):
        layout = Layout.create(name, world_size=4, granularity=16, local_world_size=local)
        whole = imbalance(index, layout, local_world_size=local)
        for budget in (measure._ROW_BUDGET, 1):
            monkeypatch.setattr(measure, "_ROW_BUDGET", budget)
            for rank in range(4):
                expected = torch.cat([whole["work"][rank], whole["local"][rank:rank + 1]])
                got = measure.rank_work(index, layout, rank, local_world_size=local)
                assert got.dtype == torch.float64
                assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12), (local, budget, rank)
                held = layout.indices(seq_len, rank) // block  # the query blocks this rank holds tokens of
                rows = rows_from_lines(vertical, slash, seq_len, block, torch.unique(held))
                assert torch.allclose(measure.rank_work(rows, layout, rank, local_world_size=local), expected,
                                      rtol=1e-12, atol=1e-12), (local, budget, rank)


def test_vertical_column_lands_on_its_owner_step():
    # token 85 lies in block 5 (rank 1); rows 6..15 attend it as an extra column (1/16 block each)
    index = _sink_and_diagonal(16, 16, vertical=[85])
    layout = Layout.create("block-stripe", world_size=4, granularity=16)
    on = imbalance(index, layout, vertical_on_ring=True)
    base = imbalance(_sink_and_diagonal(16, 16), layout, vertical_on_ring=True)
    extra = on["work"] - base["work"]
    rows = torch.arange(6, 16)
    expected = torch.zeros(4, 4, dtype=torch.float64)
    for row in rows.tolist():
        expected[row % 4, (row % 4 - 1) % 4] += 1 / 16
    assert torch.allclose(extra, expected)
    off = imbalance(index, layout)
    assert off["total"] == pytest.approx(on["total"])
    assert float(off["local"].sum() - imbalance(_sink_and_diagonal(16, 16), layout)["local"].sum()) == pytest.approx(10 / 16)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_total_work_is_layout_independent(name):
    g = torch.Generator().manual_seed(0)
    index = SparseIndex.from_lines(torch.randint(0, 512, (2, 2, 8), generator=g),
                                   torch.randint(0, 512, (2, 2, 6), generator=g), 512, 16)
    expected = float(index.block_counts.sum())
    expected += sum(  # each column costs the rows of its query block, in units of 16 x 16
        float(((index.col_ids[..., i, :] >= 0).sum() * 16)) for i in range(index.block_ids.shape[2])
    ) / 256
    for on_ring in (True, False):
        result = imbalance(index, Layout.create(name, world_size=4, granularity=16), vertical_on_ring=on_ring)
        assert result["total"] == pytest.approx(expected)
        assert result["work"].shape == (4, 4)


def test_block_stripe_balances_slashes_where_zigzag_does_not():
    # 64K tokens, CP = 8: a 512-token window, far slashes, sinks and verticals (as `mtrain bench imbalance`)
    seq_len, g = 1 << 16, torch.Generator().manual_seed(0)
    slash = torch.cat([torch.arange(512), torch.randint(512, seq_len // 2, (24,), generator=g)]).view(1, 1, -1)
    vertical = torch.randint(0, seq_len, (1, 1, 100), generator=g)
    index = SparseIndex.from_lines(vertical, slash, seq_len, 64)
    stripe = imbalance(index, Layout.create("block-stripe", world_size=8))
    zigzag = imbalance(index, Layout.create("zigzag", world_size=8))
    assert stripe["step"] <= 1.05
    assert zigzag["step"] >= 1.3
    # keeping the sink and verticals on the ring costs block-stripe its balance
    assert imbalance(index, Layout.create("block-stripe", world_size=8), vertical_on_ring=True)["step"] > stripe["step"]


def test_bench_imbalance_command(capsys, tmp_path):
    from mtrain.cli import main

    out_json = tmp_path / "rows.json"
    code = main(["bench", "imbalance", "--cp", "4,8", "--lengths", "32K", "--layouts", "zigzag,block-stripe",
                 "--json", str(out_json)])
    assert code == 0
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines() if line.strip().startswith("32K")]
    assert [(r[1], r[2]) for r in rows] == [("4", "zigzag"), ("4", "block-stripe"), ("8", "zigzag"), ("8", "block-stripe")]
    import json

    saved = json.loads(out_json.read_text())
    assert len(saved) == 4 and all(r["step_off_ring"] >= 1.0 for r in saved)
    # block-stripe keeps its balance with the sink and verticals off the ring
    assert saved[3]["layout"] == "block-stripe" and saved[3]["step_off_ring"] < saved[2]["step_off_ring"]


def test_bench_imbalance_rejects_unknown_layout(capsys):
    from mtrain.cli import main

    assert main(["bench", "imbalance", "--layouts", "diagonal", "--lengths", "8K"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_hierarchical_ring_balanced_only_with_the_node_aware_layout():
    seq_len, g = 1 << 15, torch.Generator().manual_seed(1)
    slash = torch.cat([torch.arange(256), torch.randint(256, seq_len // 2, (16,), generator=g)]).view(1, 1, -1)
    index = SparseIndex.from_lines(torch.randint(0, seq_len, (1, 1, 50), generator=g), slash, seq_len, 64)
    flat = imbalance(index, Layout.create("block-stripe", world_size=8))
    plain = imbalance(index, Layout.create("block-stripe", world_size=8), local_world_size=4)
    nodes = imbalance(index, Layout.create("block-stripe", world_size=8, local_world_size=4), local_world_size=4)
    assert nodes["step"] == pytest.approx(flat["step"])  # the same distances, visited in another order
    assert plain["step"] > flat["step"] + 0.05  # a node's ranks at different distances in one step
    assert plain["worker"] == pytest.approx(flat["worker"])
    # by hand, contiguous dense, 2 nodes of 2 (plain layout): rank 3 = node 1, local 1 sits at slot 3 and
    # visits slots 3, 1, 2, 0 -> ranks 3, 2 (its node's inner ring), then 1, 0 (from the other node)
    dense = blocks_for_causal_dense(256, 16, 1, 1)
    by_hand = imbalance(dense, Layout.create("contiguous", world_size=4), vertical_on_ring=True, local_world_size=2)
    assert by_hand["work"][3].tolist() == [10.0, 16.0, 16.0, 16.0]
    # rank 1 = node 0, local 1, slot 2: visits slots 2, 0, 1, 3 -> ranks 1, 0, 2, 3 (the last two in its future)
    assert by_hand["work"][1].tolist() == [10.0, 16.0, 0.0, 0.0]


def test_bench_imbalance_bad_length_is_a_usage_error(capsys):
    """`--lengths 12abc`: argparse's usage error naming the option (it was a traceback from inside parse_args)."""
    from mtrain.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["bench", "imbalance", "--lengths", "12abc"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "argument --lengths: cannot read '12ABC' as a token count" in err


def test_bench_imbalance_length_too_short_for_the_synthetic_index(capsys):
    """--lengths 1000 (below 2 x the default 1024-token window): one line naming the lengths and the fix (it was an
    internal error from torch.randint); a length the layout cannot split is a skipped row, not an error."""
    from mtrain.cli import main

    assert main(["bench", "imbalance", "--lengths", "1000,8K", "--cp", "3"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mtrain ")]
    assert len(lines) == 1 and "--lengths 1000:" in lines[0] and "smaller --window" in lines[0], err
    assert main(["bench", "imbalance", "--lengths", "3000", "--cp", "3", "--window", "1000",
                 "--layouts", "stripe,block-stripe"]) == 0
    out = capsys.readouterr().out
    assert "block-stripe  skipped: length not a multiple of 192" in out and " stripe " in out


def test_bench_imbalance_index_file(capsys, tmp_path):
    """--index: a saved index's fields give the table; a file that is not a torch file, or holds a pickled object
    (its code would run under torch.load's old default), is refused in one line naming it, running nothing."""
    from mtrain.cli import main
    from planted import Payload

    index = _sink_and_diagonal(8, 16)
    fields = {k: getattr(index, k) for k in ("block_ids", "block_counts", "col_ids", "col_counts")}
    torch.save({**fields, "seq_len": 128, "block_size": 16}, tmp_path / "index.pt")
    assert main(["bench", "imbalance", "--index", str(tmp_path / "index.pt"), "--cp", "2", "--layouts", "zigzag"]) == 0
    assert "zigzag" in capsys.readouterr().out

    (tmp_path / "notes.txt").write_text("not an index\n")
    marker = tmp_path / "PWNED"
    torch.save({**fields, "seq_len": 128, "block_size": Payload(marker)}, tmp_path / "planted.pt")
    for name, needle in (("notes.txt", "not a torch tensor file"), ("planted.pt", "holds a pickled object")):
        assert main(["bench", "imbalance", "--index", str(tmp_path / name), "--cp", "2"]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("mtrain ")]
        assert len(lines) == 1 and name in lines[0] and needle in lines[0], err
        assert "weights_only" not in err and "Traceback" not in err
    assert not marker.exists()

