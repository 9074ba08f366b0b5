"""Export a run's latest training checkpoint as a plain HF checkpoint (safetensors + config + tokenizer)."""

from __future__ import annotations

from pathlib import Path

from mtrain.errors import MtrainError


def _checkpoint_state_dict(ckpt: Path) -> dict:
    """Model weights from an accelerate checkpoint folder (plain, or DeepSpeed ZeRO partitions)."""
    from safetensors.torch import load_file

    plain = ckpt / "model.safetensors"
    if plain.exists():
        return load_file(str(plain))
    ds_dirs = [p for p in ckpt.iterdir() if p.is_dir() and any(p.glob("*optim_states.pt"))]
    if ds_dirs:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=ds_dirs[0].name)
    raise MtrainError(f"{ckpt} holds neither model.safetensors nor DeepSpeed ZeRO partitions")


def export_run(run_dir: str | Path, out: str | Path) -> Path:
    from mtrain.config import load_recipe
    from mtrain.models import export_hf, load_model, load_tokenizer

    run_dir = Path(run_dir)
    marker = run_dir / "checkpoints" / "latest"
    if not marker.exists():
        raise MtrainError(f"{run_dir} has no checkpoints/latest; train it first (mtrain train RECIPE)")
    ckpt = run_dir / "checkpoints" / marker.read_text().strip()
    recipe = load_recipe(ckpt / "config.yaml")
    model = load_model(recipe.model, "sdpa")
    # the trainer checkpoints the model inside its ChunkedLossLM wrapper: drop the wrapper's prefix
    state = {k.removeprefix("model."): v for k, v in _checkpoint_state_dict(ckpt).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight") or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise MtrainError(f"{ckpt}: weights do not match the recipe's model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return export_hf(model, load_tokenizer(recipe.model), out)
