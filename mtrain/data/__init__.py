"""The data stage: pack text / ProLong MDS sources into fixed-length MDS samples, and read them for training.

`pack(...)` builds a packed dataset; `TrainingReader(...)` feeds it to the trainer (imports are lazy so that
`import mtrain.data` stays light).
"""

from __future__ import annotations

from typing import Any

__all__ = ["pack", "PackOptions", "SourceSpec", "TrainingReader", "sample_to_tensors"]

_WHERE = {
    "pack": "mtrain.data.packer",
    "PackOptions": "mtrain.data.packer",
    "SourceSpec": "mtrain.data.sources",
    "TrainingReader": "mtrain.data.reader",
    "sample_to_tensors": "mtrain.data.reader",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'mtrain.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)
