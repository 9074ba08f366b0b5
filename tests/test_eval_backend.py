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
    import importlib.util

    from mtrain.errors import MtrainError
    from mtrain.eval import make_backend

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(MtrainError, match=r"needs vLLM.*--backend hf"):
        make_backend("vllm", tiny_checkpoint())
