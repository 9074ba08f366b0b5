"""The embedded default's tiny model and tokenizer: shipped in the repo, rebuilt deterministically offline.

`load_tokenizer()` and `tiny_config()` read `mtrain/assets/`; `build_tokenizer()` regenerates the
tokenizer from the synthetic corpus (`python -m mtrain.tiny --rebuild-tokenizer`).
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


def build_tokenizer(out_dir: str | Path = TOKENIZER_DIR, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE (single-digit numbers, like Qwen's) on the synthetic corpus and save it.

    Training input and settings are fixed, so the result is the same file every time.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mtrain.data.synthetic import CorpusSpec, generate

    docs = generate(CorpusSpec(num_docs=400, max_sentences=60, seed=1234))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=1 << 20
    )
    out_dir = Path(out_dir)
    fast.save_pretrained(out_dir)
    return fast


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
    parser.add_argument("--rebuild-tokenizer", action="store_true", help="retrain and overwrite the shipped tokenizer")
    args = parser.parse_args(argv)
    if args.rebuild_tokenizer:
        tok = build_tokenizer()
        print(f"wrote {TOKENIZER_DIR} ({len(tok)} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
