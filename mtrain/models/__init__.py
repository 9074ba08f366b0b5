"""HF model hookup: loading Qwen2.5/Llama with the recipe's RoPE and attention, and HF export."""

from mtrain.models.loading import MODEL_FAMILIES, export_hf, load_model, load_tokenizer, rope_fields

__all__ = ["MODEL_FAMILIES", "export_hf", "load_model", "load_tokenizer", "rope_fields"]
