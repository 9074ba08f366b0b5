"""The hf eval backend against plain transformers: chunked prefill changes neither greedy text nor log-likelihood.

A prompt over the backend's limit is refused, never cut.
"""

from __future__ import annotations

import pytest
import torch
from test_eval_helpers import tiny_checkpoint

from mtrain.eval.backends.base import PromptTooLongError, context_limit
from mtrain.eval.backends.hf import HFBackend


@pytest.fixture(scope="module")
def backend():
    # chunks of 64 tokens: a 200-token prompt takes the multi-chunk path through the KV cache
    return HFBackend(tiny_checkpoint(max_positions=512), prefill_chunk=64)


def _prompt(n: int) -> list[int]:
    return [0] + [(7 * i + 3) % 500 + 2 for i in range(n - 1)]


def test_loglikelihood_matches_one_full_forward(backend):
    ids = _prompt(200)
    nll, count = backend.loglikelihood(ids)
    with torch.no_grad():  # reference: one unchunked forward, log-softmax, gather the next tokens
        logits = backend.model(torch.tensor([ids])).logits[0].double()
    reference = -torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
    assert count == 199
    assert nll == pytest.approx(reference, rel=1e-5)  # fp32 model, fp32 vs fp64 softmax over 200 tokens


def test_greedy_generation_matches_transformers_generate(backend):
    ids = _prompt(150)
    text = backend.generate(ids, 12, stop=())
    with torch.no_grad():
        out = backend.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=backend.model.generation_config.eos_token_id)
    expected = backend.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert text == expected and text


def test_stop_string_cuts_the_generation(backend):
    ids = _prompt(150)
    full = backend.generate(ids, 12, stop=())
    stop = full[3:5]  # a stop string that occurs: text is cut before its first occurrence
    cut = backend.generate(ids, 12, stop=(stop,))
    assert cut == full[: full.find(stop)]


def test_prompt_over_the_limit_is_refused_not_truncated(backend):
    assert backend.max_length == 512 == context_limit(tiny_checkpoint(max_positions=512))
    with pytest.raises(PromptTooLongError, match="exceeds the hf backend limit of 512"):
        backend.generate(_prompt(505), 8, stop=())
    with pytest.raises(PromptTooLongError):
        backend.loglikelihood(_prompt(513))


def test_context_limit_follows_rope_scaling(tmp_path):
    import json

    cfg = {"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 32768}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert context_limit(str(tmp_path)) == 131072  # Qwen2.5 + YaRN x4
    cfg = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                               "original_max_position_embeddings": 8192}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert context_limit(str(tmp_path)) == 131072  # Llama 3.1 already states its extended length


def test_vllm_backend_without_vllm_is_a_clear_error():
    from mtrain.errors import MtrainError
    from mtrain.eval import make_backend
    from mtrain.eval.backends.vllm import vllm_available

    if vllm_available():
        pytest.skip("vLLM can run here (in process or through MTRAIN_VLLM_PYTHON's worker)")
    with pytest.raises(MtrainError, match=r"needs vLLM.*--backend hf"):
        make_backend("vllm", tiny_checkpoint())


def _full_forward_nll(model, ids) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return -torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).sum().item()


def test_mtrain_attention_through_the_kv_cache_matches_sdpa(backend):
    # mtrain's dense kind, prefilled in 64-token chunks: later chunks and decoding attend over the cache
    # (queries at the end of the keys); the SDPA model's single full forward is the reference.
    ours = HFBackend(tiny_checkpoint(max_positions=512), prefill_chunk=64, attn_implementation="mtrain-dense")
    assert ours.model.config._attn_implementation == "mtrain-dense"
    ids = _prompt(200)
    nll, _ = ours.loglikelihood(ids)
    assert nll == pytest.approx(_full_forward_nll(backend.model, ids), rel=1e-5)
    assert ours.generate(_prompt(150), 12, stop=()) == backend.generate(_prompt(150), 12, stop=())


def test_sparse_prefill_keeping_every_pair_matches_sdpa(backend):
    # The sparse kind on a one-chunk prefill with budgets that keep every (query, key) pair is dense
    # attention; with a tight budget it is not (the sparse path really ran).
    # every layer sparse, named (the default policy, the recipe's, may run a layer dense)
    every = {"sparse_policy": "always", "max_output_error": None}
    keep_all = {"recall": 1.0, "max_vertical": 512, "max_slash": 512, "min_vertical": 512, "min_slash": 512,
                "block_size": 16, **every}
    ours = HFBackend(tiny_checkpoint(max_positions=512), prefill_chunk=512, attn_implementation="mtrain-mtraining",
                     sparse=keep_all)
    ids = _prompt(300)
    reference = _full_forward_nll(backend.model, ids)
    assert ours.loglikelihood(ids)[0] == pytest.approx(reference, rel=1e-5)
    assert ours.describe()["sparse"] == keep_all
    tight = HFBackend(tiny_checkpoint(max_positions=512), prefill_chunk=512, attn_implementation="mtrain-mtraining",
                      sparse={"recall": 0.3, "max_vertical": 1, "max_slash": 1, "min_vertical": 0, "min_slash": 0,
                              "block_size": 16, **every})
    # well past the tolerance the equal case meets (a random tiny model barely depends on attention)
    assert abs(tight.loglikelihood(ids)[0] - reference) > 2e-5 * abs(reference)
    # the dense kind keeps computing dense after a sparse kind was registered
    dense = HFBackend(tiny_checkpoint(max_positions=512), prefill_chunk=512, attn_implementation="mtrain-dense")
    tight = HFBackend(tiny_checkpoint(max_positions=512), prefill_chunk=512, attn_implementation="mtrain-mtraining",
                      sparse={"recall": 0.3, "max_vertical": 1, "max_slash": 1, "min_vertical": 0, "min_slash": 0,
                              "block_size": 16})
    assert dense.loglikelihood(ids)[0] == pytest.approx(reference, rel=1e-5)


def test_sparse_calls_leave_no_records_behind():
    # mtrain attention records every call for the trainer's log, which clears them each step; an evaluation's
    # samples would otherwise pile them up (on a GPU each held a replayed index's whole buffer: out of memory)
    from mtrain.models.runtime import runtime_of

    ours = HFBackend(tiny_checkpoint(max_positions=512), prefill_chunk=512, attn_implementation="mtrain-mtraining",
                     sparse={"block_size": 16, "sparse_policy": "always"})
    ids = _prompt(300)
    rt = runtime_of(ours.model)
    ours.loglikelihood(ids)
    assert rt.records.layers == [] and rt.records.densities == []
    ours.generate(ids, 2, [])
    assert rt.records.layers == [] and rt.records.densities == []


def test_bad_backend_attention_settings_are_clear_errors():
    from mtrain.errors import MtrainError

    with pytest.raises(MtrainError, match="no mtrain implementation"):
        HFBackend(tiny_checkpoint(max_positions=512), attn_implementation="mtrain-bogus")
    with pytest.raises(MtrainError, match="valid settings: recall"):
        HFBackend(tiny_checkpoint(max_positions=512), attn_implementation="mtrain-mtraining", sparse={"recal": 0.9})
    with pytest.raises(MtrainError, match="backend.sparse needs"):
        HFBackend(tiny_checkpoint(max_positions=512), sparse={"recall": 0.9})
