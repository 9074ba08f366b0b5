"""The estimator on a real pretrained model (SmolLM2-135M, models/smollm2-135m) over real prose: its true
recall and its own est_recall against an independent float64 reference, and whole-model perplexity with the
`mtraining` kind at its default settings on every layer within 1% of dense at 4K tokens (fp32, CPU)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mtrain.attention_settings import PolicySettings
from mtrain.ops import estimate_vertical_slash, true_recall
from mtrain.ops.estimate import scored_rows
from mtrain.parallel import SparseSettings

MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(),
                                reason=f"{MODEL} is missing: run `make real-model` to write it")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    return model, tok


def prose_ids(tok, n: int) -> torch.Tensor:
    """The first n tokens of CPython's reference documentation topics (real English prose, no download)."""
    from pydoc_data.topics import topics

    ids = tok("\n\n".join(topics[key] for key in sorted(topics)), return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n
    return ids


def capture_qk(model, ids, layers):
    """Post-RoPE (q [B, S, Hq, D], k [B, S, Hkv, D], scaling) of the given layers from one dense forward."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    got = {}

    def record(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if module.layer_idx in layers:
            got[module.layer_idx] = (query.transpose(1, 2).clone(), key.transpose(1, 2).clone(), scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("mtrain-test-capture", record)
    model.set_attn_implementation("mtrain-test-capture")
    with torch.no_grad():
        model(ids, use_cache=False)
    return [got[i] for i in layers]


def float64_row_recall(q, k, index, scale):
    """[B, Hq, S]: each row's float64 causal softmax mass on the pairs of index.to_mask()."""
    B, S, Hq, D = q.shape
    kk = k.double().repeat_interleave(Hq // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, dim=-1) * index.to_mask()).sum(-1)


@pytest.mark.slow
def test_true_and_estimated_recall_on_real_attention(model_and_tokenizer):
    model, tok = model_and_tokenizer
    S, layers = 1024, [0, 4, 13, 21]
    defaults = SparseSettings()
    densities = []
    for layer, (q, k, scale) in zip(layers, capture_qk(model, prose_ids(tok, S), layers)):
        index = estimate_vertical_slash(q, k, softmax_scale=scale)
        per_row = float64_row_recall(q, k, index, scale)
        true = true_recall(q, k, index, softmax_scale=scale)
        assert torch.allclose(true.double(), per_row.mean(-1), atol=1e-5), f"layer {layer}"  # fp32 vs float64
        rows = scored_rows(S, defaults.last_q, defaults.sample_blocks, defaults.block_size)
        est = index._cache["est_recall"]
        assert torch.allclose(est.double(), per_row[..., rows].mean(-1), atol=1e-5), f"layer {layer}"
        assert (est >= defaults.recall - 1e-5).all(), f"layer {layer}: the scored rows miss the target"
        # the scored rows stand for all rows: their figure is within 0.02 of the truth on average
        assert abs(float(est.mean()) - float(true.mean())) < 0.02, f"layer {layer}: est {est} true {true}"
        densities.append(index.density())
    # layer 0 is nearly dense at 1K tokens; the others are not: the recall comparisons above are not trivial
    assert sum(densities) / len(densities) < 0.7 and min(densities) < 0.5, f"densities {densities}"


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~5 min on 2 busy cores: a dense and a sparse 4K forward of 30 layers
def test_sparse_perplexity_within_one_percent_of_dense_at_4k(model_and_tokenizer):
    """The must-show of issue #12: every layer sparse (no dense fallback), default settings, fp32, 4K tokens."""
    from mtrain.models.registry import attention_runtime
    from mtrain.models.runtime import attach_runtime

    model, tok = model_and_tokenizer
    ids = prose_ids(tok, 4096)

    def ppl():
        with torch.no_grad():
            return math.exp(float(model(ids, labels=ids, use_cache=False).loss))

    rt = attention_runtime("dense")
    model.set_attn_implementation(rt.name)
    attach_runtime(model, rt)
    dense = ppl()
    rt = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), sparse_policy="always")
    model.set_attn_implementation(rt.name)
    attach_runtime(model, rt)
    sparse = ppl()
    densities = list(rt.records.densities)
    assert len(densities) == model.config.num_hidden_layers, "some layer did not run the sparse path"
    mean_density = sum(densities) / len(densities)
    assert sparse / dense - 1 < 0.01, f"sparse ppl {sparse:.4f} vs dense {dense:.4f} (density {mean_density:.3f})"
    assert mean_density < 0.6, f"mean density {mean_density:.3f}: the pass would be bought by running dense"
