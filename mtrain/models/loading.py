"""Build HF Qwen2.5/Llama models for training and export them as plain HF checkpoints.

One table keyed by `model_type` says what each supported family needs; no model files are vendored.
RoPE settings from the recipe (theta, YaRN) go into the config and into the saved config.json in the
forms both transformers 5 (`rope_parameters`) and older readers such as vLLM (`rope_scaling`) use.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from mtrain.errors import ConfigError, MtrainError


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    decoder_layer_attr: str = "layers"
    """Attribute of the base model holding the decoder layers (for activation checkpointing)."""


# model_type -> family; Qwen2 covers Qwen2 and Qwen2.5, llama covers Llama 2/3/3.1.
MODEL_FAMILIES = {
    "qwen2": ModelFamily("qwen2"),
    "llama": ModelFamily("llama"),
}

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def rope_fields(model_cfg) -> dict:
    """The config fields the recipe's RoPE settings imply (empty when the recipe keeps the checkpoint's)."""
    fields: dict = {}
    params: dict = {}
    if model_cfg.rope_scaling is not None:
        params.update({k: v for k, v in model_cfg.rope_scaling.items() if k != "type"})
        params["rope_type"] = model_cfg.rope_scaling.get("rope_type", model_cfg.rope_scaling.get("type"))
        if params["rope_type"] == "yarn" and model_cfg.max_position_embeddings is None:
            fields["max_position_embeddings"] = int(params["original_max_position_embeddings"] * params["factor"])
    if model_cfg.rope_theta is not None:
        params["rope_theta"] = float(model_cfg.rope_theta)
    if model_cfg.max_position_embeddings is not None:
        fields["max_position_embeddings"] = model_cfg.max_position_embeddings
    if params:
        fields["rope_parameters"] = params
    return fields


def _apply_rope(config, model_cfg) -> None:
    fields = rope_fields(model_cfg)
    if "rope_parameters" in fields:
        current = dict(getattr(config, "rope_parameters", None) or {})
        if "rope_type" in fields["rope_parameters"]:
            # a new scaling replaces the old one, keeping only the base frequency
            current = {"rope_theta": current.get("rope_theta", getattr(config, "rope_theta", 10000.0))}
        current.update(fields["rope_parameters"])
        current.setdefault("rope_type", "default")
        config.rope_parameters = current
    if "max_position_embeddings" in fields:
        config.max_position_embeddings = fields["max_position_embeddings"]


def check_weight_files(folder: str | os.PathLike, key: str, fix: str) -> None:
    """Open the header of every `*.safetensors` file in `folder` (no tensor is read): a truncated or damaged file
    raises MtrainError naming `key`, the file and `fix`, before transformers reports it without the file's name."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="np"):
                pass
        except (SafetensorError, OSError) as exc:
            reason = " ".join(str(exc).split())[:160]
            raise MtrainError(f"{key}: {path} is truncated or damaged ({reason}); {fix}") from None


def load_model(model_cfg, attn_implementation: str, runtime=None):
    """The model the recipe names: a checkpoint (`model.path`) or a fresh init from `model.config`, with
    `attn_implementation`; `runtime` (an `mtrain.models.runtime.AttentionRuntime`, needed for an mtrain kind: its
    `name` is the attn_implementation) attached to it, the model's own from then on."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = model_cfg.path or model_cfg.config
    try:
        if model_cfg.config is not None:
            # exactly the file named, not a config.json that may sit beside it
            fields = json.loads(Path(model_cfg.config).read_text())
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        key = "model.config" if model_cfg.config is not None else "model.path"
        raise ConfigError(f"{key}: cannot read a HF config from '{source}' ({exc}); restore or replace it") from None
    if config.model_type not in MODEL_FAMILIES:
        raise ConfigError(
            f"model: model_type '{config.model_type}' is not supported; supported: {', '.join(MODEL_FAMILIES)}"
        )
    _apply_rope(config, model_cfg)
    dtype = getattr(torch, _DTYPES[model_cfg.dtype])
    if model_cfg.path is not None:
        check_weight_files(model_cfg.path, "model.path", "restore the checkpoint (or export its run again)")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_cfg.path, config=config, dtype=dtype, attn_implementation=attn_implementation
            )
        except (OSError, ValueError, RuntimeError) as exc:  # missing, truncated or mismatched weights
            raise MtrainError(f"model.path: cannot load the weights in '{model_cfg.path}' "
                              f"({' '.join(str(exc).split())[:300]}); restore the checkpoint") from None
    else:
        config._attn_implementation = attn_implementation
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if runtime is not None:
        from mtrain.models.runtime import attach_runtime

        attach_runtime(model, runtime)
    if model_cfg.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if runtime is not None:  # the recomputation replays each layer's sparse-or-dense choice and index
            kwargs["context_fn"] = runtime.checkpoint_contexts
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if model_cfg.mlp_chunk:
        from mtrain.models.memory import chunk_mlp

        chunk_mlp(model, model_cfg.mlp_chunk)  # each layer's MLP in checkpointed token chunks
    model.config.use_cache = False
    return model


def _legacy_rope_scaling(rope_parameters: dict) -> dict | None:
    """`rope_scaling` as pre-v5 transformers and vLLM read it (None for plain RoPE)."""
    kind = rope_parameters.get("rope_type", "default")
    if kind == "default":
        return None
    legacy = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    legacy["type"] = kind
    return legacy


def check_checkpoint_out(out: str | os.PathLike, action: str) -> None:
    """MtrainError unless `out` (a command's --out) is new, an empty folder, or a HF checkpoint folder (config.json):
    `export_hf` replaces the folder whole, so a folder of anything else would lose its files. action: what the
    command would do there ("exporting", "converting")."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file())):
        raise MtrainError(f"--out {out}: exists and is not a HF checkpoint folder, so {action} would replace it and "
                          "its files; choose a new or empty folder")


def export_hf(model, tokenizer, out_dir: str | os.PathLike) -> Path:
    """Write a plain HF checkpoint (safetensors + config.json + tokenizer) atomically to `out_dir`.

    config.json carries the RoPE settings both as transformers 5's `rope_parameters` and as the
    `rope_scaling` / `rope_theta` / `max_position_embeddings` fields other loaders (vLLM) read, so no
    reader silently falls back to factor 1.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    config_file = tmp / "config.json"
    config = json.loads(config_file.read_text())
    params = config.get("rope_parameters") or {}
    if params:
        config["rope_theta"] = params.get("rope_theta", config.get("rope_theta"))
        legacy = _legacy_rope_scaling(params)
        if legacy is not None:
            config["rope_scaling"] = legacy
    config.pop("use_cache", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def load_tokenizer(model_cfg):
    from transformers import AutoTokenizer

    path = model_cfg.tokenizer or model_cfg.path
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise MtrainError(f"model.tokenizer: cannot load a tokenizer from '{path}': {exc}") from None
