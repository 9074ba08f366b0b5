"""Offline fixtures for the eval tests: a BPE tokenizer trained in-process and a random tiny Qwen2 checkpoint.

Other eval test files import `tiny_checkpoint`; the tests here pin the fixture's own properties.
"""

from __future__ import annotations

import functools
import tempfile


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(bos: bool = True, max_positions: int = 8192) -> str:
    """A HF folder with a 512-token byte-level BPE tokenizer (adds one BOS when `bos`) and a random tiny Qwen2."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from mtrain.eval.text import NOISE, synthetic_sentences

    path = tempfile.mkdtemp(prefix="mtrain-eval-tiny-")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(synthetic_sentences(s, 200)) for s in range(20)] + [NOISE] * 5 + [
        "The special magic number for key is: 1234567. VAR ABCDE = 12345. 1. word\n2. word"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def test_tokenizer_adds_exactly_one_bos():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint())
    ids = tok("The grass is green.")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "The grass is green."
