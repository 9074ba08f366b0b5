"""Document boundaries are read from the host once per batch (`AttentionRuntime.set_documents`), not per layer:
a tiny model's forward and backward with packed documents under the dense kind and the mtraining kind's dense
layers count the reads."""

import pytest
import torch

from mtrain.models.registry import attention_runtime
from mtrain.models.runtime import attach_runtime, runtime_of
from mtrain.ops import varlen


@pytest.fixture
def reads(monkeypatch):
    """A counter of `mtrain.ops.varlen._boundaries` calls (the only place boundaries are read on the host)."""
    count = [0]
    real = varlen._boundaries

    def counted(doc_ids):
        count[0] += 1
        return real(doc_ids)

    monkeypatch.setattr(varlen, "_boundaries", counted)
    return count


def _model(kind: str, **options):
    from transformers import AutoModelForCausalLM

    from mtrain.tiny import tiny_config

    rt = attention_runtime(kind, **options)
    torch.manual_seed(0)
    return attach_runtime(AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=3),
                                                           attn_implementation=rt.name), rt)


@pytest.mark.parametrize("kind, options", [("dense", {}), ("mtraining", {"sparse_policy": "never"})])
def test_boundaries_read_once_per_batch(reads, kind, options):
    model = _model(kind, **options)
    position_ids = torch.cat([torch.arange(n) for n in (40, 7, 81)])[None]
    doc_ids = torch.cumsum((position_ids == 0).long(), dim=-1)
    ids = torch.randint(0, model.config.vocab_size, (1, 128))
    runtime_of(model).set_documents(doc_ids)
    assert reads[0] == 1
    model(input_ids=ids, position_ids=position_ids, use_cache=False).logits.sum().backward()
    assert reads[0] == 1, f"{reads[0] - 1} further reads in a forward and backward of 3 layers"

    # the same ids without the batch's Documents are read by every layer: what the count above guards against
    runtime_of(model).inputs.documents = None
    model(input_ids=ids, position_ids=position_ids, use_cache=False)
    assert reads[0] == 1 + 3


def test_documents_mask_the_model():
    """The documents reach the layers: with them a token's logits depend only on its own document."""
    model = _model("dense")
    position_ids = torch.cat([torch.arange(n) for n in (50, 78)])[None]
    ids = torch.randint(0, model.config.vocab_size, (1, 128))
    runtime_of(model).set_documents(torch.cumsum((position_ids == 0).long(), dim=-1))
    whole = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    runtime_of(model).set_documents(None)
    alone = model(input_ids=ids[:, 50:], position_ids=position_ids[:, 50:], use_cache=False).logits
    torch.testing.assert_close(whole[:, 50:], alone, atol=1e-5, rtol=1e-5)
