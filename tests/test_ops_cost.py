"""The attention cost model (mtrain.ops.cost): reproduces the H200 measurements it was fitted to, is monotone in
the work, and chooses dense at high density and sparse at low density."""

import dataclasses
import math

import pytest
import torch

from mtrain.errors import MtrainError
from mtrain.ops import SparseIndex, cost
from mtrain.ops.index import blocks_for_causal_dense


def causal_blocks(seq_len, block_size, heads, batch=1):
    n = -(-seq_len // block_size)
    return batch * heads * n * (n + 1) // 2


# Measured on the H200 by mtrain/bench/cost.py (2026-11-23), rows independent of the fitted formula: (S, Hq, D,
# ms fwd+bwd, ms fwd). The fits claim <= 10% on dense.
DENSE_H200 = [(32768, 9, 64, 10.17, 3.01), (131072, 9, 64, 158.69, 43.97), (131072, 16, 128, 462.25, 125.33),
              (65536, 16, 128, 112.32, 29.90)]
# (S, Hq, D, block size, blocks, columns, kernels ms fwd+bwd, index ms): claimed <= 15% (kernels), the index
# (~2 ms, launch-bound) within 1 ms.
SPARSE_H200 = [(131072, 16, 128, 64, 1682720, 0, 49.88, 2.74), (131072, 9, 64, 64, 5251554, 0, 82.95, 1.78),
               (131072, 16, 128, 128, 420784, 15968000, 62.41, 2.28), (32768, 16, 128, 64, 583968, 0, 17.01, 2.62)]


@pytest.mark.parametrize("S, Hq, D, train_ms, eval_ms", DENSE_H200)
def test_dense_prediction_reproduces_h200_measurements(S, Hq, D, train_ms, eval_ms):
    assert cost.dense_ms(S, Hq, D, backward=True, table=cost.H200) == pytest.approx(train_ms, rel=0.10)
    assert cost.dense_ms(S, Hq, D, backward=False, table=cost.H200) == pytest.approx(eval_ms, rel=0.10)


@pytest.mark.parametrize("S, Hq, D, bs, blocks, cols, kernel_ms, index_ms", SPARSE_H200)
def test_sparse_prediction_reproduces_h200_measurements(S, Hq, D, bs, blocks, cols, kernel_ms, index_ms):
    kernels = cost.sparse_ms(blocks, cols, S, Hq, D, bs, table=cost.H200, with_index=False)
    total = cost.sparse_ms(blocks, cols, S, Hq, D, bs, table=cost.H200)
    assert kernels == pytest.approx(kernel_ms, rel=0.15)
    assert total - kernels == pytest.approx(index_ms, abs=1.0)


@pytest.mark.parametrize("table", [cost.H200, cost.CPU], ids=["h200", "cpu"])
@pytest.mark.parametrize("backward", [True, False])
def test_monotone_in_the_work(table, backward):
    kw = dict(table=table, backward=backward)
    lengths = [4096, 16384, 65536, 131072]
    dense = [cost.dense_ms(S, 8, 64, **kw) for S in lengths]
    assert all(a < b for a, b in zip(dense, dense[1:]))
    assert cost.dense_ms(32768, 8, 64, **kw) < cost.dense_ms(32768, 16, 64, **kw)
    assert cost.dense_ms(32768, 8, 64, **kw) < cost.dense_ms(32768, 8, 64, batch=2, **kw)
    S, total = 65536, causal_blocks(65536, 64, 8)
    sparse = [cost.sparse_ms(f * total, 0, S, 8, 64, 64, **kw) for f in (0.01, 0.05, 0.2, 0.5, 1.0)]
    assert all(a < b for a, b in zip(sparse, sparse[1:]))
    with_cols = [cost.sparse_ms(0.05 * total, c, S, 8, 64, 64, **kw) for c in (0, 1e6, 1e7)]
    assert all(a < b for a, b in zip(with_cols, with_cols[1:]))
    # a column entry covers 1/block_size of a block entry's pairs and costs less than a block entry
    assert cost.sparse_ms(0, 1e6, S, 8, 64, 64, **kw) < cost.sparse_ms(1e6, 0, S, 8, 64, 64, **kw)


@pytest.mark.parametrize("device, S, D, bs", [("cuda", 32768, 64, 64), ("cuda", 131072, 128, 128),
                                               ("cpu", 8192, 32, 64), ("cpu", 4096, 64, 64)])
def test_dense_at_high_density_sparse_at_low_density(device, S, D, bs):
    H = 8
    full = causal_blocks(S, bs, H)
    dense_like = cost.predict(full, 0, seq_len=S, heads=H, head_dim=D, block_size=bs, device=device)
    assert dense_like.path == "dense" and dense_like.sparse_ms > dense_like.dense_ms
    half = cost.predict(0.6 * full, 0, seq_len=S, heads=H, head_dim=D, block_size=bs, device=device)
    assert half.path == "dense"
    low = cost.predict(0.01 * full, 0, seq_len=S, heads=H, head_dim=D, block_size=bs, device=device)
    assert low.path == "sparse" and low.sparse_ms < low.dense_ms
    # measured on an H200 (SmolLM2-135M, 32K tokens, head dim 64): the kernels beat cuDNN only below ~30% density
    if device == "cuda" and S == 32768:
        assert cost.predict(0.45 * full, 0, seq_len=S, heads=9, head_dim=64, block_size=64).path == "dense"


def test_short_sequences_stay_dense_on_the_gpu():
    """At 4K the sparse fixed costs (index ~4 ms) exceed all of dense attention (~0.6 ms)."""
    S, H = 4096, 9
    assert cost.predict(0.01 * causal_blocks(S, 64, H), 0, seq_len=S, heads=H, head_dim=64, block_size=64).path == "dense"


def test_context_parallel_splits_the_kernels_not_the_index():
    args = dict(seq_len=131072, heads=16, head_dim=128, block_size=128)
    one = cost.predict(1e5, 0, **args)
    two = cost.predict(1e5, 0, **args, world=2)
    index = cost.sparse_ms(1e5, 0, 131072, 16, 128, 128) - cost.sparse_ms(1e5, 0, 131072, 16, 128, 128, with_index=False)
    assert two.dense_ms == pytest.approx(one.dense_ms / 2)
    assert two.sparse_ms == pytest.approx((one.sparse_ms - index) / 2 + index)


def test_documents_make_dense_cheaper():
    whole = cost.dense_ms(65536, 8, 64)
    four_docs = cost.dense_ms(65536, 8, 64, doc_lengths=[16384] * 4)
    assert four_docs < whole / 3  # a quarter of the pairs, plus three more calls' fixed cost


def test_choose_margin_and_bad_input():
    assert cost.choose(10.0, 8.0) == "sparse"
    assert cost.choose(10.0, 9.0) == "dense"  # within the model's error: not worth the risk
    assert cost.choose(10.0, 9.0, margin=1.0) == "sparse"
    with pytest.raises(ValueError, match="finite"):
        cost.choose(math.nan, 1.0)


def test_unmeasured_shapes_take_the_nearest_measured_rates():
    ms0 = cost.H200.dense[64]["train"][0]
    assert cost.dense_ms(32768, 8, 80) - ms0 == pytest.approx((cost.dense_ms(32768, 8, 64) - ms0) * 80 / 64)
    assert cost.table_for("cpu") is cost.CPU and cost.table_for(torch.device("cpu")) is cost.CPU
    assert cost.table_for("cuda") is cost.H200


def test_an_engine_uses_its_own_rates_at_its_block_sizes():
    """CostTable.engines: an engine's measured rates replace the Triton ones only at the block sizes it was
    measured at; other engines and block sizes keep the Triton figures."""
    twice = {key: {mode: tuple(2 * c for c in coeffs) for mode, coeffs in modes.items()}
             for key, modes in cost.H200.sparse.items() if key[1] == 128}
    table = dataclasses.replace(cost.H200, engines={"fa4": twice})
    args = (200_000, 3_000, 65536, 9, 64)
    base = cost.sparse_ms(*args, 128, table=table, with_index=False)
    assert cost.sparse_ms(*args, 128, table=table, engine="fa4", with_index=False) == pytest.approx(2 * base)
    assert cost.sparse_ms(*args, 128, table=table, engine="triton", with_index=False) == base
    assert cost.sparse_ms(*args, 64, table=table, engine="fa4") == cost.sparse_ms(*args, 64, table=table)


def test_index_work_counts_the_listed_entries():
    S, bs, H = 1024, 64, 3
    dense_index = blocks_for_causal_dense(S, bs, 2, H)
    assert cost.index_work(dense_index) == (causal_blocks(S, bs, H, batch=2), 0)
    vertical = torch.tensor([[[5, 300, 700]] * H])
    slash = torch.tensor([[[0, 130]] * H])
    index = SparseIndex.from_lines(vertical, slash, S, bs)
    blocks, cols = cost.index_work(index)
    # by hand from the index's own lists, entry by entry
    assert blocks == sum(int(index.block_counts[0, h, i]) for h in range(H) for i in range(S // bs))
    assert cols == int((index.col_ids >= 0).sum())
    assert cols > 0 and blocks < causal_blocks(S, bs, H)


def test_worth_estimating_weighs_the_estimate_against_dense(monkeypatch):
    """The estimate is paid before any choice: where it alone costs more than dense, do not estimate."""
    smollm_32k = dict(seq_len=32768, heads=9, head_dim=64, block_size=64)
    # the estimator scores 1088 rows: 5.8 ms measured at 32K (eager), dense 10 ms: worth trying
    assert cost.worth_estimating(**smollm_32k, rows=1088).path == "sparse"
    smollm_8k = dict(smollm_32k, seq_len=8192)  # 3.5 ms against dense ~0.8 ms
    assert cost.worth_estimating(**smollm_8k, rows=1088).path == "dense"
    slow = dataclasses.replace(cost.H200, estimate=(16.0, 0.0))  # an estimate costlier than dense at 32K
    monkeypatch.setattr(cost, "H200", slow)
    assert cost.worth_estimating(**smollm_32k, rows=1088).path == "dense"
    monkeypatch.undo()
    assert cost.worth_estimating(seq_len=131072, heads=16, head_dim=128, block_size=128, rows=1088).path == "sparse"
    short = cost.worth_estimating(seq_len=4096, heads=9, head_dim=64, block_size=64, rows=64)
    assert short.path == "dense" and short.sparse_ms > short.dense_ms  # the fixed costs alone exceed dense
    # the floor is the estimate plus sparse attention with nothing listed
    floor = cost.worth_estimating(**smollm_32k, rows=1088).sparse_ms
    assert floor == pytest.approx(cost.estimate_ms(32768, 9, 1088) + cost.sparse_ms(0, 0, 32768, 9, 64, 64))
    # measured on the H200 (bench_cost.py, 2026-11-25): eager 5.77 ms; from the CUDA graph, plans included, 2.43 ms
    assert cost.estimate_ms(32768, 9, 1088) == pytest.approx(5.77, rel=0.25)
    assert cost.estimate_ms(32768, 9, 1088, graphed=True) == pytest.approx(2.43, rel=0.25)


def test_cost_table_override_from_measured_rows(tmp_path, monkeypatch):
    """mtrain bench cost --fit ... --write-table writes figures that MTRAIN_COST_TABLE puts in place of the built-in
    ones they cover (the rest stay); a broken file is refused in one line naming the variable."""
    import json
    from mtrain.bench import cost as bench_cost

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(kind="estimate", S=S, Hq=9, Hkv=3, D=64, bs=64, rows=1088,
                                            scorer="triton", ms_estimate=0.5 + 3.0 * 9 * 1088 * S / 1e9)) + "\n"
                            for S in (8192, 32768, 131072)))
    table = tmp_path / "table.json"
    bench_cost.fit(str(rows), str(table))
    monkeypatch.setenv("MTRAIN_COST_TABLE", str(table))
    t = cost.table_for("cuda")
    assert t.estimate == pytest.approx((0.5, 3.0), rel=1e-3)
    assert t.dense == cost.H200.dense and t.index == cost.H200.index
    assert cost.estimate_ms(32768, 9, 1088, table=t) == pytest.approx(0.5 + 3.0 * 9 * 1088 * 32768 / 1e9, rel=1e-3)
    table.write_text('{"estimate": [1.0]}')
    with pytest.raises(MtrainError, match="MTRAIN_COST_TABLE=.*estimate needs 2 numbers"):
        cost.table_for("cuda")
    # entries that load but would break a prediction later: refused at load, naming the file and the entry
    for doc, words in (('{"dense": {"64": {"train": [1.0]}}}', "dense.64 needs the modes train and eval"),
                       ('{"dense": {"64": {"train": [1.0], "eval": [1.0, 2.0]}}}', "dense.64.train needs 2 finite"),
                       ('{"sparse": {"64,64": {"train": [1, 2, 3, "x"], "eval": [1, 2, 3, 4]}}}',
                        "sparse.64,64.train needs 4 finite")):
        table.write_text(doc)
        with pytest.raises(MtrainError, match=f"MTRAIN_COST_TABLE={table}.*{words}"):
            cost.table_for("cuda")


def test_graphed_estimate_carries_the_index_term(monkeypatch):
    """CostTable.graphed (the estimate replayed from a CUDA graph that also builds the index and the engine's plans):
    where measured, a graphed prediction charges the estimate those figures and the sparse path no index term; where
    not measured (0, 0), graphed changes nothing."""
    args = dict(seq_len=32768, heads=9, head_dim=64, block_size=128, engine="fa4")
    work = (300_000, 20_000)
    unmeasured = dataclasses.replace(cost.H200, graphed=(0.0, 0.0))
    monkeypatch.setattr(cost, "H200", unmeasured)
    assert cost.predict(*work, **args, estimate_rows=2112, graphed=True) == cost.predict(*work, **args,
                                                                                         estimate_rows=2112)
    assert (cost.worth_estimating(**args, rows=2112, graphed=True)
            == cost.worth_estimating(**args, rows=2112))
    measured = dataclasses.replace(cost.H200, graphed=(1.0, 2.0))
    monkeypatch.setattr(cost, "H200", measured)
    p = cost.predict(*work, **args, estimate_rows=2112, graphed=True)
    assert p.estimate_ms == pytest.approx(1.0 + 2.0 * 9 * 2112 * 32768 / 1e9)
    kernels = cost.sparse_ms(*work, 32768, 9, 64, 128, engine="fa4", with_index=False, table=measured)
    assert p.sparse_ms == pytest.approx(kernels)
    eager = cost.predict(*work, **args, estimate_rows=2112)
    assert eager.sparse_ms > p.sparse_ms and eager.estimate_ms == pytest.approx(
        cost.estimate_ms(32768, 9, 2112, table=measured))
    floor = cost.worth_estimating(**args, rows=2112, graphed=True).sparse_ms
    assert floor == pytest.approx(p.estimate_ms + cost.sparse_ms(0, 0, 32768, 9, 64, 128, engine="fa4",
                                                                  with_index=False, table=measured))


# FA4's varlen dense over packed documents (`dense_attention(documents=)`), measured by `mtrain bench documents` on
# one H200 on 2026-12-01 in a run apart from the fit's: (S, Hq, D, mix, ms fwd+bwd). The fit claims <= 25%.
FA4_DOCS_H200 = [(131072, 16, 128, "long", 121.99), (131072, 16, 128, "short", 27.42), (131072, 9, 64, "long", 39.65),
                 (131072, 9, 64, "short", 8.95), (32768, 16, 128, "long", 8.12), (32768, 9, 64, "short", 1.27)]


@pytest.mark.parametrize("S, Hq, D, mix, train_ms", FA4_DOCS_H200)
def test_fa4_varlen_dense_prediction_reproduces_h200_measurements(S, Hq, D, mix, train_ms):
    from mtrain.bench.documents import document_lengths

    lengths = document_lengths(mix, S)
    got = cost.dense_ms(S, Hq, D, table=cost.H200, doc_lengths=lengths, engine="fa4")
    assert got == pytest.approx(train_ms, rel=0.25)


def test_cost_model_prices_the_dense_engine_that_runs():
    """A dense layer on FA4 is priced at FA4's rates (the choice of sparse weighs against the dense that runs); a
    CPU table without dense engines keeps its one call per document."""
    short = [2048] * 64
    assert cost.dense_ms(131072, 16, 128, doc_lengths=short, engine="fa4") < cost.dense_ms(131072, 16, 128,
                                                                                         doc_lengths=short)
    assert cost.dense_ms(4096, 4, 32, table=cost.CPU, doc_lengths=[1024] * 4, engine="fa4") == cost.dense_ms(
        4096, 4, 32, table=cost.CPU, doc_lengths=[1024] * 4)
    p = cost.predict(10_000, 0, seq_len=131072, heads=16, head_dim=128, block_size=128, doc_lengths=short,
                     dense_engine="fa4")
    assert p.dense_ms == pytest.approx(cost.dense_ms(131072, 16, 128, doc_lengths=short, engine="fa4"))
