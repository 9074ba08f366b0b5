"""Shared by the real-model tests: the converted SmolLM2-135M checkpoint (`make real-model`) and real prose.

`make test` builds the checkpoint first. Run directly without it, the tests skip with the command to run;
under CI (CI=true) a missing checkpoint fails instead, so CI can never pass without exercising them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

REAL_MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m"


def require_real_model() -> Path:
    if not (REAL_MODEL / "config.json").is_file():
        message = f"no converted real model at {REAL_MODEL}: run `make real-model`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return REAL_MODEL


@functools.lru_cache(maxsize=None)
def prose_ids(n_tokens: int) -> tuple[int, ...]:
    """`n_tokens` ids of stdlib prose under the real model's tokenizer (BOS first)."""
    from transformers import AutoTokenizer

    from mtrain.data.prose import prose_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(require_real_model()))
    return tuple(prose_tokens(tokenizer, n_tokens))


def load_real_model(attention, **config_overrides):
    """The real model in fp32 on the CPU, eval mode, no KV cache, under `attention`: an attn_implementation name, or
    an mtrain attention runtime (`mtrain.models.registry.attention_runtime`), loaded under its name and attached."""
    import torch
    from transformers import AutoModelForCausalLM

    from mtrain.models.runtime import AttentionRuntime, attach_runtime

    runtime = attention if isinstance(attention, AttentionRuntime) else None
    name = attention if runtime is None else runtime.name
    model = AutoModelForCausalLM.from_pretrained(
        str(require_real_model()), dtype=torch.float32, attn_implementation=name, **config_overrides
    )
    if runtime is not None:
        attach_runtime(model, runtime)
    model.config.use_cache = False
    return model.eval()
