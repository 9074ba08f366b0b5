"""Export a run's latest training checkpoint as a plain HF checkpoint (safetensors + config + tokenizer)."""

from __future__ import annotations

from pathlib import Path

from mtrain.errors import DamagedCheckpointError, MtrainError
from mtrain.safe_load import check_checkpoint_files
from mtrain.train.run_folder import checkpoint_candidates, verify_file_list


def _intact(ckpt: Path) -> bool:
    try:
        verify_file_list(ckpt)
        _checkpoint_state_dict(ckpt)
    except MtrainError:
        return False
    return True


def _checkpoint_state_dict(ckpt: Path) -> dict:
    """Model weights from an accelerate checkpoint folder (plain, or DeepSpeed ZeRO partitions)."""
    from safetensors.torch import load_file

    plain = ckpt / "model.safetensors"
    if plain.exists():
        try:
            return load_file(str(plain))
        except Exception as exc:  # safetensors raises its own error type on a torn file
            raise DamagedCheckpointError(f"{plain}: unreadable ({' '.join(str(exc).split())[:200]})") from None
    ds_dirs = [p for p in ckpt.iterdir() if p.is_dir() and any(p.glob("*optim_states.pt"))]
    if ds_dirs:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        check_checkpoint_files(ckpt)  # zero_to_fp32 unpickles with weights_only=False: tensors only first
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=ds_dirs[0].name)
    raise MtrainError(f"{ckpt} holds neither model.safetensors nor DeepSpeed ZeRO partitions")


def _saved_model_recipe(path: Path, overrides: list[str] = ()):
    """The run's saved recipe, checked only for what export uses (the model section: it never reads the training
    data, which may be gone), with `overrides` (model.KEY=VALUE items: the model's files where they are now). Older
    runs saved relative paths, taken from the directory they were launched in."""
    from mtrain.config import check_model_section, parse_recipe
    from mtrain.errors import ConfigError

    other = [item for item in overrides if not item.startswith("model.")]
    if other:
        raise MtrainError(f"--set {other[0]}: export reads only the model section; give model.KEY=VALUE items")
    try:
        recipe = parse_recipe(path, list(overrides))
        check_model_section(recipe.model)
    except ConfigError as exc:
        raise MtrainError(f"{path} (the run's recipe): {exc}; give the model's files where they are now (mtrain "
                          "export RUN --out DIR --set model.path=... / model.config=... / model.tokenizer=...), or "
                          "run export from the directory the run was launched in") from None
    return recipe


def export_run(run_dir: str | Path, out: str | Path, overrides: list[str] = ()) -> Path:
    from mtrain.models import export_hf, load_model, load_tokenizer
    from mtrain.models.loading import check_checkpoint_out

    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise MtrainError(f"{run_dir}: no such run folder; give a train.output_dir")
    check_checkpoint_out(out, "exporting")
    candidates = checkpoint_candidates(run_dir / "checkpoints")
    if not candidates:
        raise MtrainError(f"{run_dir} has no checkpoints/latest; train it first (mtrain train RECIPE)")
    ckpt = candidates[0]
    try:
        verify_file_list(ckpt)
        raw_state = _checkpoint_state_dict(ckpt)
    except DamagedCheckpointError as exc:
        intact = next((c for c in candidates[1:] if _intact(c)), None)
        offer = f"; the previous intact checkpoint is {intact}" if intact else ""
        raise MtrainError(f"checkpoint {ckpt} is damaged ({exc}){offer}: restore it, or point checkpoints/latest "
                          "at an intact one") from None
    recipe = _saved_model_recipe(ckpt / "config.yaml", overrides)
    model = load_model(recipe.model, "sdpa")
    # the trainer checkpoints the model inside its ChunkedLossLM wrapper: drop the wrapper's prefix
    state = {k.removeprefix("model."): v for k, v in raw_state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight") or not model.config.tie_word_embeddings]
    if missing or unexpected:
        raise MtrainError(f"{ckpt}: weights do not match the recipe's model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return export_hf(model, load_tokenizer(recipe.model), out)
