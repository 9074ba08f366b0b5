"""Loading torch files without running anything they hold: tensors, containers, numbers and strings, plus the few
plain classes that accelerate and DeepSpeed checkpoints store, through torch's weights-only unpickler; any other
pickled object is refused in one line (never with torch's advice to retry with weights_only=False)."""

from __future__ import annotations

import pickle
import re
import sys
import zipfile
from pathlib import Path

import torch

from mtrain.errors import DamagedCheckpointError, MtrainError

# what torch.load may read in a checkpoint folder (accelerate: *.bin / *.pkl; DeepSpeed: <tag>/*.pt)
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")


def allowed_globals() -> list:
    """The classes besides tensors that the checkpoints mtrain writes hold. The weights-only unpickler builds them
    from their fields without running any of their code: numpy arrays and dtypes (accelerate's RNG states);
    DeepSpeed's loss scalers, ZeRO stage and fragment addresses (its ZeRO partitions), once DeepSpeed is imported
    (a DeepSpeed run, or export through zero_to_fp32: importing it only to check a plain checkpoint costs ~10 s)."""
    import numpy as np

    numpy_core = np._core if hasattr(np, "_core") else np.core
    allowed = [numpy_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    if "deepspeed" not in sys.modules:
        return allowed
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return allowed + [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _refusal(path: Path, exc: Exception) -> str:
    """One line for a file the weights-only unpickler refused: the object it holds, not torch's advice."""
    text = " ".join(str(exc).split())
    # torch's wordings across versions: "Unsupported global: GLOBAL x.y" (2.6-2.11), "Trying to load unsupported
    # GLOBAL x.y whose module x is blocked" (2.13), "... but got <class 'x.y'>"
    found = re.search(r"unsupported(?: global:)? GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", text, re.IGNORECASE)
    if found:
        what = next(g for g in found.groups() if g)
        return (f"{path}: holds a pickled object ({what}) besides tensors; mtrain loads tensors only, so its code "
                "is never run: use files that mtrain wrote, or re-create them")
    # what the unpickler stopped at, without torch's preamble and its advice to load with weights_only=False
    reason = text.split("WeightsUnpickler error: ")[-1].split("trusted source.")[-1]
    reason = reason.split(" Check the documentation")[0].strip()
    return f"{path}: not a torch tensor file (the weights-only unpickler stops: {reason[:100]})"


def load_tensors(path: str | Path, *, error: type = MtrainError, mmap: bool = False):
    """torch.load(path) on the CPU through the weights-only unpickler (`allowed_globals`). Raises `error` with one
    line naming the file when it holds anything else or is not a torch file at all. mmap: map the storages instead
    of reading them (zip-format files; a legacy pickle is read whole)."""
    path = Path(path)
    try:
        mmap = mmap and zipfile.is_zipfile(path)
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise error(_refusal(path, exc)) from None
    except (RuntimeError, EOFError, ValueError, KeyError, AttributeError) as exc:  # torn zip, bad magic, short file
        raise error(f"{path}: not a readable torch file ({type(exc).__name__}: "
                    f"{' '.join(str(exc).split())[:160]}); re-create it") from None


def check_checkpoint_files(folder: str | Path) -> None:
    """Load every file of a checkpoint folder that torch.load could read (TORCH_SUFFIXES, at any depth) through
    `load_tensors` (storages mapped, not read), raising DamagedCheckpointError on the first that holds more than
    tensors. Run before handing the folder to a loader that unpickles without weights_only (DeepSpeed's
    `load_checkpoint` and `zero_to_fp32`): a payload planted in a checkpoint someone sent is refused before anything
    runs it. (A file swapped by another process on this machine between the check and DeepSpeed's load is not
    caught: that process could change the code that loads it just as well.)"""
    for path in sorted(Path(folder).rglob("*")):
        if path.suffix in TORCH_SUFFIXES and path.is_file():
            load_tensors(path, error=DamagedCheckpointError, mmap=True)
