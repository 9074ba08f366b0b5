"""The converted real model (SmolLM2-135M from its GGUF) in mtrain's attention kinds, on real prose (CPU, fp32)."""


import pytest
import torch

from mtrain.attention_settings import PolicySettings
from mtrain.models.registry import attention_runtime
from ranks import run_cli
from real_model import REAL_MODEL, load_real_model, prose_ids, require_real_model

SEQ = 512


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def reference():
    """SDPA logits of the real model on SEQ tokens of prose (transformers' own attention: the independent path)."""
    require_real_model()
    ids = list(prose_ids(SEQ))
    return ids, _logits(load_real_model("sdpa"), ids)


def test_converted_checkpoint_is_plain_hf():
    import json

    require_real_model()
    config = json.loads((REAL_MODEL / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config  # loads as a plain model: no gguf dependency at run time
    assert (REAL_MODEL / "model.safetensors").is_file() and (REAL_MODEL / "tokenizer.json").is_file()


def test_dense_kind_reproduces_sdpa_logits(reference):
    ids, want = reference
    got = _logits(load_real_model(attention_runtime("dense")), ids)
    assert _rel(got, want) < 1e-4
    # the model predicts real text far better than chance (a broken conversion would not)
    loss = torch.nn.functional.cross_entropy(got[:-1].float(), torch.tensor(ids[1:]))
    assert float(loss.exp()) < 100


def test_mtraining_at_recall_one_reproduces_dense(reference):
    ids, want = reference
    rt = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), recall=1.0, block_size=64)
    got = _logits(load_real_model(rt), ids)
    # the sparse path ran on every layer and, at recall 1.0, kept every causal pair
    assert len(rt.records.densities) == 30
    assert min(rt.records.densities) > 0.999
    assert _rel(got, want) < 1e-4


def test_convert_reports_bad_input_in_one_line(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"not a gguf")
    for target, expect in ((tmp_path / "absent.gguf", "no GGUF file"), (bad, "is not a .gguf file")):
        proc = run_cli("convert", str(target), "--out", str(tmp_path / "o"), timeout=120)  # python -m mtrain, forked
        assert proc.returncode == 2
        assert expect in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "o").exists()
