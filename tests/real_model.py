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


def load_real_model(attn_implementation: str, **config_overrides):
    """The real model in fp32 on the CPU under `attn_implementation`, eval mode, no KV cache."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(require_real_model()), dtype=torch.float32, attn_implementation=attn_implementation, **config_overrides
    )
    model.config.use_cache = False
    return model.eval()
