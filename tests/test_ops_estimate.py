"""estimate_vertical_slash on planted patterns: recall reached on the scored rows (its own est_recall checked
against a float64 reference), diagonal and sinks always present, a purely vertical pattern buys no slashes,
budgets (caps and floors) respected, one shared budget per KV group; and dense_attention on the CPU."""

import math

import pytest
import torch

from mtrain.ops import dense_attention, dense_backend, estimate_vertical_slash, reference
from mtrain.ops.estimate import _select, scored_row_count, scored_rows, slash_scores


def planted(S=256, Hq=4, Hkv=2, D=32, offset=9, outlier=100, seed=0):
    """Queries that attend to key `outlier` (a vertical) and to the key `offset` tokens back (a slash)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, Hq, D, generator=gen) * 0.3
    k = torch.randn(1, S, Hkv, D, generator=gen)
    k[:, outlier, :, :] = 0.0
    k[:, outlier, :, 0] = 40.0  # logit ~14, as strong as the slash's
    q[:, :, :, 0] = 2.0
    g = Hq // Hkv
    for h in range(Hq):
        q[:, offset:, h, 1:] += 2.5 * k[:, :-offset, h // g, 1:]
    return q, k


def rows_recall(q, k, index, rows):
    """Mean per-row attention mass (float64, computed here) of the given rows inside the index mask."""
    B, S, Hq, D = q.shape
    _, lse = reference.attention(q.double(), k.double(), k.double(), causal=True)
    g = Hq // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(g, dim=2)) / math.sqrt(D)
    p = torch.exp(s - lse[..., None]).tril()
    mask = index.to_mask()
    return (p[..., rows, :] * mask[..., rows, :]).sum(dim=-1).mean(-1)


@pytest.mark.parametrize("recall,sample_blocks,sample_rows", [(0.9, 0, None), (0.95, 4, None), (0.95, 6, 5)])
def test_recall_reached_and_planted_lines_found(recall, sample_blocks, sample_rows):
    q, k = planted()
    index = estimate_vertical_slash(q, k, recall=recall, last_q=32, block_size=16, sample_blocks=sample_blocks,
                                    sample_rows=sample_rows)
    rows = scored_rows(q.shape[1], 32, sample_blocks, 16, sample_rows=sample_rows)
    assert rows.numel() == 32 + (sample_rows or 16) * sample_blocks == scored_row_count(q.shape[1], 32, sample_blocks,
                                                                                        16, sample_rows)
    want = rows_recall(q, k, index, rows)
    assert (want >= recall - 1e-5).all()
    assert torch.allclose(index._cache["est_recall"].double(), want, atol=1e-5)  # fp32 scores vs float64
    mask = index.to_mask()
    S = q.shape[1]
    rows = torch.arange(9, S)
    assert mask[:, :, rows, rows - 9].all()  # the planted slash
    assert mask[:, :, 100:, 100].all()  # the planted vertical
    assert index.density() < 0.8


def test_sampled_rows_per_block():
    """sample_rows scores the first rows of each sampled block; by default the whole block."""
    rows = scored_rows(8192, 64, 4, 128, sample_rows=64)
    assert rows.numel() == 64 + 4 * 64 == scored_row_count(8192, 64, 4, 128, 64)
    starts = rows[:-64].view(4, 64)[:, 0]
    assert (starts % 128 == 0).all() and torch.equal(rows[:-64].view(4, 64) - starts[:, None],
                                                     torch.arange(64).expand(4, -1))
    assert scored_rows(8192, 64, 4, 128).numel() == 64 + 4 * 128 == scored_row_count(8192, 64, 4, 128)
    assert torch.equal(scored_rows(8192, 64, 4, 32), scored_rows(8192, 64, 4, 32, sample_rows=500))
    with pytest.raises(ValueError, match="sample_rows must be >= 1"):
        estimate_vertical_slash(torch.randn(1, 64, 2, 16), torch.randn(1, 64, 1, 16), sample_rows=0)


def test_diagonal_and_sink_always_present_and_caps_hold():
    q, k = planted()
    index = estimate_vertical_slash(q, k, recall=0.99, last_q=16, max_vertical=2, max_slash=1, block_size=16,
                                    min_vertical=1, min_slash=1)
    n = index.n_blocks
    for i in range(n):
        ids = index.block_ids[..., i, :]
        assert ((ids == 0).any(-1) & (ids == i).any(-1)).all()
    assert (index.col_counts <= 2).all()
    # max_slash=1 token diagonal still buys one block offset (the cap is at least one): diagonal + sink + 1.
    assert (index.block_counts <= 3).all()


def test_one_block_sequence():
    """A sequence of one block has no slash offset besides the diagonal: the index is that block, the whole
    causal triangle (it used to stop in torch.topk asking for one of no candidates)."""
    q, k = planted(S=64, outlier=40)
    index = estimate_vertical_slash(q, k, recall=0.9, last_q=16, block_size=64)
    assert index.n_blocks == 1
    assert torch.equal(index.to_mask(), torch.ones(64, 64, dtype=torch.bool).tril().expand_as(index.to_mask()))
    assert index.density() == 1.0


def test_scored_rows_spread_over_the_sequence():
    rows = scored_rows(1000, 40, 3, 64)
    assert torch.equal(rows[-40:], torch.arange(960, 1000))
    starts = rows[:-40:64]
    assert starts.tolist() == [128, 448, 768]  # centres of three equal strata of the 15 full blocks before
    assert torch.equal(scored_rows(100, 64, 5, 64), torch.arange(36, 100))  # no full block before the last rows


def test_purely_vertical_pattern_buys_no_slashes():
    """Every row attends mostly to three key columns: the old token-level rule bought a slash per (row, column)."""
    gen = torch.Generator().manual_seed(3)
    S, D = 512, 32
    q = torch.randn(1, S, 2, D, generator=gen) * 0.1
    k = torch.randn(1, S, 1, D, generator=gen) * 0.1
    q[..., 0] = 3.0
    for col in (20, 40, 70):
        k[:, col, :, 0] = 15.0  # logit ~ 8 above the rest: the three columns hold ~95% of a late row's mass
    index = estimate_vertical_slash(q, k, recall=0.9, last_q=32, block_size=16, sample_blocks=8, min_slash=0,
                                    min_vertical=0)
    assert (index.block_counts <= 2).all()  # sink and diagonal only: no slash block offset
    cols = index.col_ids[index.col_ids >= 0].unique().tolist()
    assert set(cols) <= {20, 40, 70} and len(cols) >= 2  # (a column inside a kept block is no extra column)
    assert (index._cache["est_recall"] >= 0.9).all()


def test_cap_fraction_bounds_the_lines():
    q, k = planted()
    free = estimate_vertical_slash(q, k, recall=1.0, last_q=32, block_size=16, min_vertical=0, min_slash=0)
    capped = estimate_vertical_slash(q, k, recall=1.0, last_q=32, block_size=16, min_vertical=0, min_slash=0,
                                     cap_fraction=0.02)  # 6 columns, 1 block offset of 16
    assert (capped.col_counts <= 6).all() and (capped.block_counts <= 3).all()
    assert capped.density() < free.density()


def test_select_floors_caps_and_minimality():
    scores = torch.tensor([[5.0, 3.0, 1.0, 0.5, 0.5, 0.0]])
    assert _select(scores, 0.5, 6, 1).tolist() == [[0]]  # 5/10 reaches 0.5; padding is trimmed
    assert _select(scores, 0.8, 6, 1).tolist()[0][:2] == [0, 1]  # 8/10
    assert (_select(scores, 0.8, 6, 1) >= 0).sum() == 2
    assert (_select(scores, 0.5, 6, 3) >= 0).sum() == 3  # minimum budget
    assert _select(scores, 1.0, 2, 1).tolist() == [[0, 1]]  # cap
    assert (_select(scores, 1.0, 6, 6) >= 0).sum() == 5  # zero-mass entries are never kept


def test_share_kv_group_gives_one_list_per_group():
    q, k = planted(Hq=4, Hkv=2)
    index = estimate_vertical_slash(q, k, recall=0.9, last_q=32, block_size=16, share_kv_group=True)
    assert torch.equal(index.block_ids[:, 0], index.block_ids[:, 1])
    assert torch.equal(index.col_ids[:, 2], index.col_ids[:, 3])


def test_slash_scores_sum_diagonals():
    probs = torch.arange(12, dtype=torch.float32).view(1, 2, 6)  # rows at positions 4 and 5 of S = 6
    got = slash_scores(probs)[0]
    want = torch.zeros(6)
    for r, pos in enumerate((4, 5)):
        for j in range(pos + 1):
            want[pos - j] += probs[0, r, j]
    assert torch.equal(got, want)


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1)])
def test_dense_attention_cpu_matches_reference(Hq, Hkv):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 24, Hq, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, 24, Hkv, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, 24, Hkv, 16, generator=gen, requires_grad=True)
    assert dense_backend(q) == "sdpa" and dense_backend(q, return_lse=True) == "torch"
    out = dense_attention(q, k, v, causal=True)
    out2, lse = dense_attention(q, k, v, causal=True, return_lse=True)
    r_out, r_lse = reference.attention(q.double(), k.double(), v.double(), causal=True)
    assert torch.allclose(out.double(), r_out, atol=1e-5) and torch.allclose(out2.double(), r_out, atol=1e-5)
    assert torch.allclose(lse.double(), r_lse, atol=1e-5)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(k.grad).all()


CP_SETTINGS = {  # every estimator setting the CP twin must reproduce
    "defaults": {},
    "shared": {"share_kv_group": True, "recall": 0.9},
    "capped": {"cap_fraction": 0.05, "recall": 1.0},  # the caps bind
    "last-only": {"sample_blocks": 0, "last_q": 24, "slash_recall": 0.8},
    "docs": {"recall": 0.95, "sample_blocks": 5},
    "short-samples": {"recall": 0.95, "sample_blocks": 6, "sample_rows": 8},  # part of each sampled block
}


def _cp_worker(rank, world, init_file, out_file):
    """Every layout x setting: the CP estimate from this rank's shard vs the single device's on the whole."""
    import json

    import torch.distributed as dist

    from mtrain.parallel import LAYOUT_NAMES, Layout, SparseSettings
    from mtrain.parallel.estimate import estimate_index

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    q, k = planted(S=320, Hq=4, Hkv=2, seed=5)
    docs = torch.zeros(1, 320, dtype=torch.long)
    docs[:, 90:], docs[:, 211:] = 1, 2
    results = {}
    for layout_name in LAYOUT_NAMES:
        layout = Layout.create(layout_name, world_size=world, granularity=16)
        pos = layout.indices(320, rank)
        for name, extra in CP_SETTINGS.items():
            kw = dict(block_size=16, **extra)
            doc_ids = docs if name == "docs" else None
            want = estimate_vertical_slash(q, k, doc_ids=doc_ids, **kw)
            got = estimate_index(layout.shard(q, rank), layout.shard(k, rank), pos, pos, 320, SparseSettings(**kw),
                                 1.0 / math.sqrt(32), None, doc_ids=doc_ids)
            same = all(torch.equal(getattr(got, f), getattr(want, f))
                       for f in ("block_ids", "block_counts", "col_ids", "col_counts"))
            err = float((got._cache["est_recall"] - want._cache["est_recall"]).abs().max())
            results[f"{layout_name}/{name}"] = [same, err, want.density()]
    with open(f"{out_file}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_cp_estimator_gives_the_single_device_lines_for_every_setting(tmp_path):
    """2 gloo ranks on the CPU; identical index and est_recall within 1e-5 (sums in another order)."""
    import json

    from ranks import run_ranks

    run_ranks(_cp_worker, 2, (2, str(tmp_path / "init"), str(tmp_path / "out")))
    for rank in range(2):
        for case, (same, err, density) in json.loads((tmp_path / f"out.{rank}").read_text()).items():
            assert same, f"rank {rank} {case}: the CP index differs from the single-device one"
            assert err < 1e-5, f"rank {rank} {case}: est_recall differs by {err:.2e}"
            assert density < 0.95, f"{case}: density {density:.2f}, the case tests nothing"


def test_graphed_estimate_clone_and_comparison():
    """estimate_graphed off CUDA is the eager estimate; the clone a replay returns owns its tensors (a later
    replay overwrites the graph's outputs, not an index a layer keeps for its backward); same_index tells a
    changed list or recall apart."""
    from mtrain.ops.graphed import _clone, estimate_graphed, same_index

    q, k = planted(512, 4, 2, 32, seed=3)
    kw = dict(recall=0.95, block_size=64, sample_blocks=2)
    eager = estimate_vertical_slash(q, k, **kw)
    got = estimate_graphed(q, k, **kw)
    assert same_index(got, eager)
    copy = _clone(eager)
    assert same_index(copy, eager)
    assert copy.block_ids.data_ptr() != eager.block_ids.data_ptr()
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(copy._cache["lines"], eager._cache["lines"]))
    copy.block_ids[0, 0, -1, 0] += 1
    assert not same_index(copy, eager)
    other = _clone(eager)
    other._cache["est_recall"] = other._cache["est_recall"] * 0.5
    assert not same_index(other, eager)


def test_graph_cache_does_not_churn_when_more_keys_are_in_use_than_it_keeps():
    """A training step on packed documents meets one estimate key per document length and recall: three lengths,
    escalated layers at a second recall (six keys). With room for six no step after the first captures; with room for
    four, the dropped keys run eagerly instead of being captured again in every step (the old cache deleted them: two
    to four captures a step, each an eager check and a freed pool), and every kept graph keeps serving."""
    from mtrain.ops.graphed import GraphCache

    def steps(size, n=5):
        cache, counts = GraphCache(), []
        for _ in range(n):
            got = {"capture": 0, "eager": 0, "replay": 0}
            for layer in range(30):
                recall = 0.995 if layer in (7, 18, 20) else 0.99
                for length in (107479, 81264, 49807):
                    key = (length, recall)
                    if cache.graph(key) is not None:
                        got["replay"] += 1
                    elif cache.capture_due(key):
                        got["capture"] += 1
                        cache.keep(key, object(), size)
                    else:
                        got["eager"] += 1
            counts.append(got)
        return counts

    roomy = steps(6)
    assert roomy[0]["capture"] == 6 and all(c == {"capture": 0, "eager": 0, "replay": 90} for c in roomy[1:]), roomy
    tight = steps(4)
    assert all(c["capture"] == 0 for c in tight[1:]), tight
    assert all(c["replay"] + c["eager"] == 90 and c["replay"] >= 4 * 3 for c in tight[1:]), tight
    assert tight[1] == tight[-1], tight  # a steady state


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graphs)")
def test_graphed_estimates_share_one_pool_and_replay_in_any_order():
    """Three estimate settings (lengths, one with documents, one with the triton engine's plans) captured into the
    shared pool, then replayed in an order unlike their capture's, each on new inputs: every replay equals the eager
    estimate of its own inputs. A graph that read memory it does not write in its replay, where another graph's
    temporaries or outputs now lie, would differ. The three graphs use one pool."""
    from mtrain.ops.graphed import _GRAPHS, estimate_graphed, same_index, shared_pool

    _GRAPHS.entries.clear()
    kw = dict(recall=0.95, block_size=64, sample_blocks=4)
    cases = {"short": (1024, None, None), "documents": (2048, 700, None), "plans": (1536, None, ("triton", 2, 64))}

    def call(name, seed):
        S, cut, prepare = cases[name]
        q, k = planted(S, 4, 2, 64, offset=5 + seed % 7, outlier=50 + 13 * seed, seed=seed)
        q, k = q.cuda().bfloat16(), k.cuda().bfloat16()
        docs = None
        if cut is not None:
            docs = torch.zeros(1, S, dtype=torch.long, device="cuda")
            docs[:, cut + seed:] = 1
        got = estimate_graphed(q, k, doc_ids=docs, prepare=prepare, **kw)
        want = estimate_vertical_slash(q, k, doc_ids=docs, **kw)
        return same_index(got, want)

    for name in cases:  # the first call compiles, the second captures
        assert call(name, 1) and call(name, 2), name
    graphs = [entry for entry in _GRAPHS.entries.values() if not isinstance(entry, str)]
    assert len(graphs) == 3, _GRAPHS.entries
    assert all(g.graph.pool() == shared_pool() for g in graphs)
    for seed, name in enumerate(["plans", "short", "documents", "short", "plans", "documents", "plans"], start=3):
        assert call(name, seed), f"replay {seed} ({name}) differs from the eager estimate"
    _GRAPHS.entries.clear()


def test_graphed_clone_copies_engine_plans():
    """What prepare_engine adds to an index's cache (here FA4's lists, buildable on the CPU) is copied by the clone
    a replay returns (the packed copy a graph keeps): equal values, the same types and shapes, no storage shared with
    the original; plain values (counts, flags) kept as they are."""
    from mtrain.ops.fa4 import Fa4Lists
    from mtrain.ops.graphed import _clone, prepare_engine

    q, k = planted(1024, 4, 2, 32, seed=5)
    index = estimate_vertical_slash(q, k, recall=0.95, block_size=128, sample_blocks=2)
    prepare_engine(index, ("fa4", 2, 32))
    plan = index._cache["fa4"]
    copy = _clone(index)
    got = copy._cache["fa4"]
    assert type(got) is type(plan) and isinstance(got.lists, Fa4Lists) and got.has_cols == plan.has_cols
    for name in ("full_cnt", "full_idx", "mask_cnt", "mask_idx", "full_q_cnt", "full_q_idx", "mask_q_cnt",
                 "mask_q_idx"):
        a, b = getattr(plan.lists, name), getattr(got.lists, name)
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    assert got.col_plans.keys() == plan.col_plans.keys() and copy._cache["diagonal_listed"] is True
    assert copy.seq_len == index.seq_len and copy.block_size == index.block_size
    t_a, t_b = index._cache["t"], copy._cache["t"]
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(t_a, t_b))
    with pytest.raises(ValueError, match="engine must be"):
        prepare_engine(index, ("flex", 2, 32))


def test_scored_rows_of_q_alone_give_the_same_index():
    """scored_q: q holding only the rows the estimate scores (`estimate_rows`, what the CUDA graph copies in) gives
    the index and est_recall of the whole q; a q of another row count is refused."""
    from mtrain.ops.estimate import estimate_rows
    from mtrain.ops.graphed import same_index

    q, k = planted(1000, 4, 2, 32, seed=7)
    kw = dict(recall=0.95, block_size=64, sample_blocks=3, last_q=40, softmax_scale=0.2)
    rows = estimate_rows(1000, **kw)
    assert torch.equal(rows, scored_rows(1000, 40, 3, 64))
    assert torch.equal(estimate_rows(4096), scored_rows(4096, 64, 32, 64))  # the estimator's own defaults
    whole = estimate_vertical_slash(q, k, **kw)
    assert same_index(estimate_vertical_slash(q[:, rows], k, scored_q=True, **kw), whole)
    with pytest.raises(ValueError, match="scored rows"):
        estimate_vertical_slash(q[:, rows[1:]], k, scored_q=True, **kw)
