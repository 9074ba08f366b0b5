"""The real-model benchmark (`mtrain bench real`) end to end on the CPU at a short length: one layer
of the converted SmolLM2, its per-layer record and the whole-model summary the GPU runs report, written atomically."""

import json
import math

import pytest

from real_model import require_real_model


@pytest.mark.slow
def test_bench_real_reports_what_the_gpu_table_needs(tmp_path):
    from mtrain.bench import real as bench_real
    from mtrain.parallel import SparseSettings

    lines = []
    summary = bench_real.run(str(require_real_model()), 256, settings=SparseSettings(block_size=64, last_q=32),
                             layers=[1], iters=1, hold=2, recall_rows=32, out_dir=str(tmp_path), log=lines.append)
    (layer,) = summary["layers"]
    assert layer["layer"] == 1 and layer["path"] in ("sparse", "dense")
    for name in ("dense_ms", "mtrain_ms", "steady_ms", "long_run_ms", "fwd_ms", "bwd_ms"):
        assert math.isfinite(layer[name]) and layer[name] > 0, name
    assert 0.0 < layer["true_recall"] <= 1.0 + 1e-6
    # as run: a dense layer keeps all of its attention
    want = 1.0 if layer["path"] == "dense" else layer["true_recall"]
    assert summary["as_run_true_recall"] == pytest.approx(want)
    assert summary["as_run_min_layer_true_recall"] == pytest.approx(want)
    assert summary["long_run_speedup"] == pytest.approx(summary["dense_ms"] / summary["long_run_ms"])
    over = summary["percent_over_dense"]
    assert set(over) == {"every_step", "steady", "long_run"}
    assert (1 in over["steady"]) == (layer["steady_ms"] > layer["dense_ms"])
    assert math.isfinite(summary["ppl_dense"]) and math.isfinite(summary["ppl_training_choice"])
    assert set(summary["perplexity"]) == {"dense", "training_choice", "inference_choice", "all_sparse"}
    assert summary["perplexity"]["training_choice"]["sparse_layers"] == [
        i for i, path in enumerate(summary["training_paths"]) if path == "sparse"]
    assert summary["training_paths"][1] == layer["path"]
    # the index's lists as held, and as wide as the lists used: never more, and both reported per layer
    assert 0 < layer["extra"]["index_bytes_used_widths"] <= layer["extra"]["index_bytes"]
    assert summary["index_mib_per_layer_max"] == layer["extra"]["index_bytes"] / 2**20
    # and with list-free columns (the estimator keeps the lines): positive, reported in the summary
    assert layer["extra"]["index_bytes_list_free"] > 0
    assert summary["index_mib_list_free_max"] == layer["extra"]["index_bytes_list_free"] / 2**20
    # both column forms timed through the same kernels, both backwards
    forms = summary["column_forms_ms"]
    assert set(forms) == {f"{f}_{b}_ms" for f in ("lists", "list_free") for b in ("deterministic", "atomic")}
    assert all(math.isfinite(ms) and ms > 0 for ms in forms.values())
    # how much of the vertical cap the estimate used: a row never lists more columns than its head has verticals,
    # nor than its list is wide
    extra = layer["extra"]
    assert extra["verticals_max"] >= 16 and extra["column_list_width"] == summary["column_list_width"]
    assert 0 <= extra["columns_per_row_mean"] <= extra["columns_per_row_max"] <= extra["verticals_max"]
    assert extra["columns_per_row_max"] <= extra["column_list_width"]
    saved = json.loads((tmp_path / "real_256.json").read_text())
    assert saved["seq_len"] == 256 and saved["layers"][0]["layer"] == 1
    assert not list(tmp_path.glob("*.tmp"))
    assert any(line.startswith("whole model (1 layers)") for line in lines)


def _model_dir(tmp_path):
    """The converted SmolLM2 when `make real-model` built it, else the tiny embedded model (random weights, seed 0)
    saved with its tokenizer."""
    from real_model import REAL_MODEL

    if (REAL_MODEL / "config.json").is_file():
        return REAL_MODEL
    from mtrain.tiny import build_tiny_model, load_tokenizer

    out = tmp_path / "tiny"
    build_tiny_model(seed=0).save_pretrained(out)
    load_tokenizer().save_pretrained(out)
    return out


class _ForcedPaths:
    """An HF attention function written here, apart from mtrain's attention functions: layer i runs the sparse
    kernels on its own estimate where paths[i] == "sparse", else dense; `work` records what each layer's estimate
    listed (blocks, columns, mean estimated recall), whichever path it then ran."""

    def __init__(self, settings):
        self.settings, self.paths, self.work = settings, {}, {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        import dataclasses

        import torch

        from mtrain.ops import dense_attention, estimate_vertical_slash, vertical_slash_attention

        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        fields = {**dataclasses.asdict(self.settings), "last_q": min(self.settings.last_q, q.shape[1])}
        with torch.no_grad():
            index = estimate_vertical_slash(q.detach(), k.detach(), **fields, softmax_scale=scaling)
        blocks, columns = index.work_tensor().tolist()
        est = index._cache.get("est_recall")
        self.work[module.layer_idx] = (int(blocks), int(columns), None if est is None else float(est.double().mean()))
        if self.paths.get(module.layer_idx) == "sparse":
            return vertical_slash_attention(q, k, v, index, softmax_scale=scaling), None
        return dense_attention(q, k, v, causal=True, softmax_scale=scaling), None


@pytest.mark.slow
def test_bench_real_perplexity_follows_the_training_choice(tmp_path, monkeypatch):
    """A cost table under which training (forward + backward priced) runs some layers sparse while inference (forward
    only) runs every layer dense: the benchmark's training-choice perplexity is the model's perplexity with exactly
    the training choice's per-layer paths, computed here with an attention function of the test's own; the
    inference-choice row is dense and differs from it; the every-layer-sparse row is a third, labelled row."""
    import math

    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.masking_utils import AttentionMaskInterface

    from mtrain.bench import real as bench_real
    from mtrain.data.prose import prose_tokens
    from mtrain.models.policy import RECALL_SLACK
    from mtrain.ops.cost import SPARSE_MARGIN
    from mtrain.parallel import SparseSettings

    from real_model import REAL_MODEL

    if not (REAL_MODEL / "config.json").is_file():  # `make test` builds it; `make test-quick` does not
        pytest.skip("needs the real model (make real-model): on the tiny model's random weights the sparse and dense "
                    "paths give the same perplexity at 256 tokens, so the choices cannot be told apart")
    seq_len, block = 256, 64
    settings = SparseSettings(block_size=block, last_q=32)
    model_dir = _model_dir(tmp_path)
    forced = _ForcedPaths(settings)
    AttentionInterface.register("test-forced-paths", forced)
    AttentionMaskInterface.register("test-forced-paths", lambda *args, **kwargs: None)
    net = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                               attn_implementation="test-forced-paths").eval()
    net.config.use_cache = False
    ids = torch.tensor([prose_tokens(AutoTokenizer.from_pretrained(str(model_dir)), seq_len)])

    def ppl(paths):
        forced.paths = dict(enumerate(paths))
        with torch.no_grad():
            logits = net(input_ids=ids).logits[0, :-1].float()
        return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))

    n_layers = net.config.num_hidden_layers
    ppl_dense = ppl(["dense"] * n_layers)  # also records each layer's estimate on the dense model's q/k
    # training prices sparse by its listed columns: the layers listing at most `cut` columns pay; inference never
    columns = sorted({forced.work[i][1] for i in range(n_layers)})
    cut = columns[0] + 0.5 if len(columns) == 1 else (columns[len(columns) // 2 - 1] + columns[len(columns) // 2]) / 2
    head_dim = getattr(net.config, "head_dim", None) or net.config.hidden_size // net.config.num_attention_heads
    per_column = SPARSE_MARGIN * 1e12 / (cut * block * head_dim)  # sparse = margin x dense (1 ms) at `cut` columns
    table = tmp_path / "cost.json"
    table.write_text(json.dumps({
        "source": "test: training sparse by listed columns, inference dense",
        "dense": {str(head_dim): {"train": [1.0, 0.0], "eval": [1.0, 0.0]}},
        "sparse": {f"{head_dim},{block}": {"train": [0.0, 0.0, 0.0, per_column], "eval": [1000.0, 0.0, 0.0, 0.0]}},
        "index": [0.0, 0.0, 0.0, 0.0], "estimate": [0.0, 0.0]}))
    monkeypatch.setenv("MTRAIN_COST_TABLE", str(table))
    expected = ["sparse" if columns_ <= cut and (est is None or est >= settings.recall - RECALL_SLACK) else "dense"
                for _, columns_, est in (forced.work[i] for i in range(n_layers))]
    assert "sparse" in expected  # the two choices differ somewhere
    timed = [expected.index("sparse")] + ([expected.index("dense")] if "dense" in expected else [])

    lines = []
    summary = bench_real.run(str(model_dir), seq_len, settings=settings, layers=sorted(timed), iters=1, hold=2,
                             recall_rows=32, log=lines.append)
    # the training choice as the timed pass took it, and for the untimed layers as a training call takes it
    assert summary["training_paths"] == expected
    assert {r["layer"]: r["path"] for r in summary["layers"]} == {i: expected[i] for i in timed}
    rows = summary["perplexity"]
    sparse_layers = [i for i, path in enumerate(expected) if path == "sparse"]
    assert rows["training_choice"]["sparse_layers"] == sparse_layers
    assert rows["inference_choice"]["sparse_layers"] == []
    assert rows["all_sparse"]["sparse_layers"] == list(range(n_layers))
    # the reported training-choice perplexity is the perplexity at exactly those paths, computed independently
    ours = ppl(expected)
    assert summary["ppl_training_choice"] == pytest.approx(ours, rel=1e-5)
    assert rows["training_choice"]["ppl"] == summary["ppl_training_choice"]
    assert summary["ppl_dense"] == pytest.approx(ppl_dense, rel=1e-5)
    assert summary["ppl_inference_choice"] == pytest.approx(ppl_dense, rel=1e-5)  # inference ran every layer dense
    # where the paths differ, so does the perplexity
    assert abs(summary["ppl_training_choice"] / summary["ppl_inference_choice"] - 1) > 1e-4
    if "dense" in expected:
        assert summary["ppl_all_sparse"] == pytest.approx(ppl(["sparse"] * n_layers), rel=1e-5)
        assert abs(summary["ppl_training_choice"] / summary["ppl_all_sparse"] - 1) > 1e-4
    rise = summary["ppl_training_choice"] / summary["ppl_dense"] - 1
    assert summary["ppl_training_choice_rise"] == pytest.approx(rise)
    # the output says which choice each perplexity is
    said = [line for line in lines if line.startswith("perplexity, ")]
    assert len(said) == len(rows) == 4
    assert all(line.startswith(f"perplexity, {rows[name]['label']}: ") for line, name in zip(said, rows))
    assert any("training choice" in line and f"{len(sparse_layers)} of {n_layers} layers sparse" in line
               for line in said)


@pytest.mark.slow  # the real model's perplexity passes at 256 tokens (~50 s on 2 cores)
def test_bench_real_escalates_a_layer_over_the_limit(tmp_path):
    """--escalate-recall with --max-output-error: a layer whose error exceeds the limit (here any: 1e-9) estimates at
    the escalated recall from then on, and the summary names it (policy always: at 256 tokens auto skips the estimate);
    without the check the flag is refused up front."""
    from mtrain.bench import real as bench_real
    from mtrain.parallel import SparseSettings

    settings = SparseSettings(block_size=64, last_q=32, recall=0.9)
    with pytest.raises(SystemExit, match="needs --max-output-error"):
        bench_real.run("no-such-model", 256, settings=settings, escalate_recall=0.99)
    summary = bench_real.run(str(require_real_model()), 256, settings=settings, layers=[1], iters=1, hold=2,
                             recall_rows=32, out_dir=str(tmp_path), log=lambda _: None, max_error=1e-9, policy="always",
                             escalate_recall=0.99)
    # the timed layer, and those of the perplexity passes (which run every layer under the same check)
    assert summary["escalate_recall"] == 0.99 and 1 in summary["escalated_layers"]


def test_packed_mixes_hold_the_sequence_in_their_documents():
    """`mtrain bench real --documents`: the long mix is four documents of 41 / 31 / 19 / 9% of the sequence, the
    short one sixteen equal documents; every token comes from the start of a real text (books, code)."""
    from transformers import AutoTokenizer

    from mtrain.bench.real_documents import packed_mix
    from mtrain.errors import MtrainError
    from mtrain.tiny import TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    ids, lengths, names = packed_mix(tokenizer, 4096, "long")
    assert len(ids) == sum(lengths) == 4096 and lengths == [1679, 1269, 778, 370]
    assert len(set(names)) == 4 and "python-reference" in names
    ids, lengths, names = packed_mix(tokenizer, 4096, "short")
    assert len(ids) == 4096 and lengths == [256] * 16
    with pytest.raises(MtrainError, match="mix must be one of long, short"):
        packed_mix(tokenizer, 4096, "medium")


@pytest.mark.slow
def test_bench_real_on_packed_documents_reports_against_the_varlen_peer(tmp_path):
    """One layer of the real model over the long mix at 1024 tokens (CPU): the peer, the dense kind and the sparse
    kind as trained, per layer and for the whole model, the perplexities with the documents masked, written to
    real_docs_<S>_<mix>.json."""
    from mtrain.bench import real_documents
    from mtrain.parallel import SparseSettings

    summary = real_documents.run(str(require_real_model()), 1024, "long", policy="always", layers=[1], iters=1,
                                 hold=1, out_dir=str(tmp_path), log=lambda _: None,
                                 settings=SparseSettings(block_size=64, last_q=32, recall=0.9))
    (layer,) = summary["layers"]
    assert summary["document_lengths"] == [419, 317, 194, 94]
    # policy always: every document of at least two blocks is estimated and runs sparse
    assert layer["estimated"] == layer["sparse"] == 3 and all(0 < d <= 1 for d in layer["density"])
    assert all(0 < r <= 1 + 1e-6 for r in layer["true_recall"])
    for key in ("peer_ms", "dense_ms", "mtrain_ms", "steady_ms"):
        assert math.isfinite(summary[key]) and summary[key] > 0
    assert summary["speedup_vs_peer"] == pytest.approx(summary["peer_ms"] / summary["mtrain_ms"])
    assert math.isfinite(summary["ppl_dense"]) and abs(summary["ppl_rise"]) < 0.05
    assert json.loads((tmp_path / "real_docs_1024_long.json").read_text())["mix"] == "long"


@pytest.mark.slow
def test_bench_real_sweeps_the_shortest_sparse_document(tmp_path):
    """`--min-document`: the same captured q/k/v timed at each attention.min_sparse_document; a document
    shorter than the threshold is not estimated (419 / 317 / 194 / 94 tokens: 200 estimates two, 400 one), and every
    point has its own whole-model figures and perplexity."""
    from mtrain.bench import real_documents
    from mtrain.parallel import SparseSettings

    summary = real_documents.run(str(require_real_model()), 1024, "long", policy="always", layers=[1], iters=1,
                                 hold=1, out_dir=str(tmp_path), log=lambda _: None, min_documents=[200, 400],
                                 eager_estimate=True, settings=SparseSettings(block_size=64, last_q=32, recall=0.9))
    (layer,) = summary["layers"]
    assert [p["min_sparse_document"] for p in layer["sweep"]] == [200, 400]
    assert [p["estimated"] for p in layer["sweep"]] == [p["sparse"] for p in layer["sweep"]] == [2, 1]
    assert layer["estimated"] == 2 and summary["graph_estimate"] is False
    for point in summary["sweep"]:
        assert point["speedup_vs_peer"] == pytest.approx(summary["peer_ms"] / point["mtrain_ms"])
        assert math.isfinite(point["ppl_rise"]) and abs(point["ppl_rise"]) < 0.05
    assert summary["sweep"][0]["ppl_as_trained"] == summary["ppl_as_trained"]
