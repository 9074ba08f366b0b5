"""`mtrain convert GGUF_FILE --out DIR`: a plain HF checkpoint (safetensors, config.json, tokenizer) from a
Llama / Qwen2 GGUF file that transformers can read.

transformers loads a GGUF file dequantized but refuses to `save_pretrained` it (the model carries a gguf
`quantization_config`). The converter therefore builds the same architecture from the config without that
field, copies the dequantized weights into it (every key must match) and exports it like any trained
model, so recipes, `mtrain eval` and the benchmarks take the folder as a normal HF model.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mtrain.errors import MtrainError

log = logging.getLogger(__name__)

_DTYPES = ("float32", "bfloat16", "float16")


def check_gguf(src: Path) -> None:
    """A whole GGUF file: its magic, a header the gguf reader parses, and every tensor's bytes present. Raises
    MtrainError naming the file (a short file otherwise fails inside transformers as a reshape or struct error)."""
    import gguf

    size = src.stat().st_size
    with open(src, "rb") as fh:
        magic = fh.read(4)
    fix = "download it again and compare its size and sha256 with the source's"
    if len(magic) < 4 and b"GGUF".startswith(magic):
        raise MtrainError(f"{src}: truncated GGUF file ({size} bytes); {fix}")
    if magic != b"GGUF":
        raise MtrainError(f"{src}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); give the .gguf model "
                          "file itself")
    try:
        reader = gguf.GGUFReader(src)
    except Exception as exc:  # struct.error, ValueError, IndexError...: the reader stops where the bytes end
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:120]
        raise MtrainError(f"{src}: truncated or damaged GGUF file ({size} bytes; its header or tensor table cannot "
                          f"be read: {reason}); {fix}") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=int(reader.data_offset))
    if end > size:
        raise MtrainError(f"{src}: truncated GGUF file ({size} bytes, its tensors end at byte {end}); {fix}")


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Convert `gguf_file` to a plain HF checkpoint in `out_dir` (written atomically); returns `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from mtrain.models.loading import MODEL_FAMILIES, check_checkpoint_out, export_hf

    src = Path(gguf_file).expanduser().resolve()
    if not src.is_file():
        raise MtrainError(f"no GGUF file at '{gguf_file}'")
    if src.suffix.lower() != ".gguf":
        raise MtrainError(f"'{gguf_file}' is not a .gguf file")
    if dtype not in _DTYPES:
        raise MtrainError(f"--dtype must be one of {', '.join(_DTYPES)}; got '{dtype}'")
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError:
        raise MtrainError("reading GGUF needs the 'gguf' package: pip install gguf (or: make real-model)") from None
    check_gguf(src)
    out = Path(out_dir).expanduser().resolve()
    check_checkpoint_out(out, "converting")

    where, name = str(src.parent), src.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name)
    except (OSError, ValueError, KeyError) as exc:
        raise MtrainError(f"transformers cannot read a model config from '{src}': {exc}") from None
    if config.model_type not in MODEL_FAMILIES:
        raise MtrainError(
            f"'{src.name}' holds a '{config.model_type}' model; mtrain trains {', '.join(MODEL_FAMILIES)} models"
        )
    torch_dtype = getattr(torch, dtype)
    log.info("reading %s (%s, dequantized to %s)", src.name, config.model_type, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    except (OSError, ValueError, KeyError) as exc:
        raise MtrainError(f"transformers cannot read a tokenizer from '{src}' ({' '.join(str(exc).split())[:200]}); "
                          "mtrain convert needs a GGUF file that carries its tokenizer (tokenizer.ggml.* fields)") from None
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch_dtype)
    state = loaded.state_dict()
    clean = loaded.config
    if hasattr(clean, "quantization_config"):
        delattr(clean, "quantization_config")
    del loaded
    model = AutoModelForCausalLM.from_config(clean, dtype=torch_dtype)
    result = model.load_state_dict(state, strict=False)
    # A tied lm_head may be absent from one side; anything else missing means a layout mismatch.
    tied = {"lm_head.weight"} if getattr(clean, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise MtrainError(
            f"the GGUF weights do not fit the {config.model_type} architecture: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    if tied:
        model.tie_weights()
    model.config.dtype = dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    export_hf(model, tokenizer, out)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("wrote %s: %d layers, %.1fM parameters", out, clean.num_hidden_layers, n_params / 1e6)
    return out


def register(sub) -> None:
    p = sub.add_parser(
        "convert", help="write a plain HF checkpoint from a Llama/Qwen2 GGUF file",
        description="Dequantize a Llama or Qwen2 GGUF file (through transformers and the 'gguf' package) and "
        "write safetensors + config.json + tokenizer to --out, usable as model.path in recipes, by mtrain eval "
        "and by the benchmarks. `make real-model` does this for SmolLM2-135M.",
    )
    p.add_argument("gguf_file", help="path of the .gguf file")
    p.add_argument("--out", required=True, help="output folder: new, empty, or a HF checkpoint folder (replaced "
                   "atomically); a folder of other files is refused")
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="weight dtype of the checkpoint (default float32)")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    out = convert_gguf(args.gguf_file, args.out, args.dtype)
    print(f"wrote {out}")
    return 0
