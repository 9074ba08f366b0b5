"""The embedded default's tiny model and tokenizer: shipped in the repo, rebuilt deterministically offline.

`load_tokenizer()` and `tiny_config()` read `mtrain/assets/`; `mtrain.data.tiny_tokenizer.build_tokenizer()`
regenerates the tokenizer from the synthetic corpus (`python -m mtrain.data.tiny_tokenizer`). This module
imports no other part of mtrain, so every stage may import it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS / "tiny-tokenizer"
MODEL_CONFIG = ASSETS / "tiny-qwen2" / "config.json"

EOS = "<|endoftext|>"
VOCAB_SIZE = 1024


def load_tokenizer(path: str | Path = TOKENIZER_DIR):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tiny_config(**overrides):
    """The tiny Qwen2-architecture config (about 0.5M parameters), with optional field overrides."""
    from transformers import Qwen2Config

    fields = json.loads(MODEL_CONFIG.read_text())
    fields.update(overrides)
    return Qwen2Config(**fields)


def build_tiny_model(seed: int = 0, **overrides):
    """A randomly initialised tiny Qwen2ForCausalLM (fp32), reproducible from `seed`."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config(**overrides))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtrain.tiny", description=__doc__)
    parser.add_argument("--rebuild-tokenizer", action="store_true",
                        help="moved: python -m mtrain.data.tiny_tokenizer retrains and overwrites the shipped tokenizer")
    args = parser.parse_args(argv)
    if args.rebuild_tokenizer:
        # the builder reads the synthetic corpus, so it lives in the data stage (this module imports no stage)
        parser.error("the tokenizer builder moved to the data stage: run python -m mtrain.data.tiny_tokenizer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
