"""The embedded default's tokenizer, rebuilt from the synthetic corpus: `python -m mtrain.data.tiny_tokenizer`.

It lives in the data stage because it reads `mtrain.data.synthetic`; `mtrain.tiny` holds the shipped files'
paths and loads them (and imports nothing of the stages).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mtrain.tiny import EOS, TOKENIZER_DIR, VOCAB_SIZE


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtrain.data.tiny_tokenizer", description=__doc__)
    parser.add_argument("--out", default=str(TOKENIZER_DIR),
                        help="folder to write (default: the shipped mtrain/assets/tiny-tokenizer, overwritten)")
    args = parser.parse_args(argv)
    tok = build_tokenizer(args.out)
    print(f"wrote {args.out} ({len(tok)} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
