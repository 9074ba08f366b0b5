"""The one place mtrain imports mosaicml-streaming, plus an MDS folder reader that checks shards.

`import streaming` runs streaming/__init__.py, which imports `streaming.vision`, `streaming.text` and
`streaming.multimodal` and so torchvision, PIL and parts of transformers (torchvision cannot be installed
beside the CPU torch build). The MDS writer and codecs live in `streaming.base`, which needs none of them:
`streaming_base()` registers an empty `streaming` package object (with the installed package's `__path__`)
so that `streaming.base` imports without running the top-level `__init__`, whether or not torchvision is
there. `MDSFolder` reads shards itself (raw ones memory-mapped, compressed ones decompressed in memory, which
`streaming.LocalDataset` cannot do for zstd) and names a truncated or corrupt shard in its error.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
import types
from collections import OrderedDict
from functools import lru_cache
from typing import Any

import numpy as np

from mtrain.errors import MtrainError

OPEN_SHARDS = 4


@lru_cache(maxsize=None)
def streaming_base() -> types.ModuleType:
    """Return the `streaming.base` module of mosaicml-streaming, importable without torchvision."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or not spec.submodule_search_locations:
            raise MtrainError(
                "mosaicml-streaming is not installed; install it with "
                "`pip install --no-deps mosaicml-streaming zstd python-snappy Brotli catalogue`"
            )
        package = types.ModuleType("streaming")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        package.__file__ = spec.origin
        sys.modules["streaming"] = package
    return importlib.import_module("streaming.base")


def mds_writer(out_dir: str, columns: dict[str, str], *, compression: str | None, size_limit: int):
    """An `MDSWriter` writing into `out_dir` (which must be empty or absent)."""
    streaming_base()
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter(out=out_dir, columns=columns, compression=compression, size_limit=size_limit)


def _decompress(algo: str, data: bytes) -> bytes:
    streaming_base()
    from streaming.base.compression import decompress

    return decompress(algo, data)


def _mds_reader(dirname: str, shard_info: dict[str, Any]):
    streaming_base()
    from streaming.base.format.mds.reader import MDSReader

    return MDSReader.from_json(dirname, None, shard_info)


def _hash(algo: str, data: bytes) -> str:
    streaming_base()
    from streaming.base.hashing import get_hash

    return get_hash(algo, data)


# MDS encodings that run code when decoded (`pkl` is pickle.loads): a dataset is data, never code
UNSAFE_ENCODINGS = ("pkl",)


def refuse_unsafe_columns(info: dict[str, Any], where: str) -> None:
    """Refuse an MDS shard (an entry of index.json's `shards`) whose columns would be unpickled on read.

    The reader decodes column i with encoding i, whatever the names: every encoding is checked by position, and
    names must be distinct strings matching the encodings one to one (a name listed twice would hide a column
    from any lookup by name, and its value would replace the other's in the decoded sample)."""
    names, encodings = info.get("column_names"), info.get("column_encodings")
    if not isinstance(names, list) or not isinstance(encodings, list) or len(names) != len(encodings):
        raise MtrainError(f"{where}: corrupt MDS index (column_names and column_encodings must be two lists of one "
                          "entry per column); re-create the dataset")
    if not all(isinstance(x, str) for x in names + encodings) or len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1}, key=str)
        raise MtrainError(f"{where}: MDS column names must be distinct strings, got {names}"
                          f"{f' ({twice} listed more than once)' if twice else ''}; re-create the dataset")
    unsafe = [name for name, enc in zip(names, encodings) if enc.split(":")[0] in UNSAFE_ENCODINGS]
    if unsafe:
        raise MtrainError(
            f"{where}: column(s) {unsafe} are encoded as pickle (`pkl`), which runs code when read; mtrain does "
            "not read them: re-encode the dataset with ndarray/str/int/json columns"
        )


class MDSShard:
    """One MDS shard held in memory (or memory-mapped when stored raw): `len()` samples, `[i]` a dict."""

    def __init__(self, dirname: str, info: dict[str, Any], checksums: dict[str, str] | None = None):
        if info.get("format") != "mds":
            raise MtrainError(
                f"{os.path.join(dirname, 'index.json')}: shard format {info.get('format')!r} is not "
                "supported; mtrain reads MDS shards (written by MDSWriter)"
            )
        self.info = info
        refuse_unsafe_columns(info, os.path.join(dirname, "index.json"))
        self.columns = dict(zip(info["column_names"], info["column_encodings"]))
        raw = info["raw_data"]
        zipped = info.get("zip_data")
        raw_path = os.path.join(dirname, raw["basename"])
        if os.path.exists(raw_path):
            self.path = raw_path
            self._data = self._load(raw_path, raw, mmap=True)
        elif zipped and info.get("compression"):
            self.path = os.path.join(dirname, zipped["basename"])
            compressed = self._load(self.path, zipped, mmap=False)
            try:
                data = _decompress(info["compression"], bytes(compressed))
            except Exception as exc:  # every codec raises its own type on corrupt input
                raise MtrainError(
                    f"{self.path}: corrupt shard, {info['compression']} decompression failed ({exc}); "
                    "re-download or re-create it"
                ) from exc
            self._check(data, raw, self.path + " (decompressed)")
            self._data = np.frombuffer(data, np.uint8)
        else:
            raise MtrainError(f"{raw_path}: shard listed in index.json is missing")
        expected = (checksums or {}).get(os.path.basename(self.path))
        if expected is not None:
            with open(self.path, "rb") as fh:
                digest = hashlib.file_digest(fh, "sha256").hexdigest()
            if digest != expected:
                raise MtrainError(f"{self.path}: corrupt shard (sha256 does not match manifest.json); "
                                  "re-create the dataset with `mtrain pack`")
        self.num_samples = int(info["samples"])
        header = self._data[: 4 * (self.num_samples + 2)].view(np.uint32)
        if len(header) < self.num_samples + 2 or header[0] != self.num_samples:
            raise MtrainError(f"{self.path}: corrupt shard header (sample count does not match index.json)")
        self._offsets = header[1 : self.num_samples + 2].astype(np.int64)
        if self._offsets[-1] != len(self._data) or np.any(np.diff(self._offsets) < 0):
            raise MtrainError(f"{self.path}: corrupt shard (sample offsets do not match the file size)")
        self._reader = _mds_reader(dirname, info)

    @staticmethod
    def _load(path: str, file_info: dict[str, Any], *, mmap: bool) -> np.ndarray:
        size = os.path.getsize(path)
        if size != file_info["bytes"]:
            raise MtrainError(
                f"{path}: truncated or corrupt shard ({size} bytes, index.json says {file_info['bytes']}); "
                "re-download or re-create it"
            )
        if mmap and size:
            data = np.memmap(path, dtype=np.uint8, mode="r")
        else:
            with open(path, "rb") as fh:
                data = np.frombuffer(fh.read(), np.uint8)
        MDSShard._check(data, file_info, path)
        return data

    @staticmethod
    def _check(data, file_info: dict[str, Any], path: str) -> None:
        if len(data) != file_info["bytes"]:
            raise MtrainError(f"{path}: truncated or corrupt shard ({len(data)} bytes, expected {file_info['bytes']})")
        for algo, expected in (file_info.get("hashes") or {}).items():
            if _hash(algo, bytes(data)) != expected:
                raise MtrainError(f"{path}: corrupt shard ({algo} checksum does not match index.json)")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, Any]:
        begin, end = self._offsets[idx], self._offsets[idx + 1]
        try:
            return self._reader.decode_sample(bytes(self._data[begin:end]))
        except Exception as exc:  # a codec fails in its own way on garbage bytes
            raise MtrainError(f"{self.path}: corrupt sample {idx} ({exc})") from exc


class MDSFolder:
    """An MDS dataset folder (`index.json` + shards): shard list, total samples, per-sample access."""

    def __init__(self, dirname: str, checksums: dict[str, str] | None = None):
        self.dirname = dirname
        self.checksums = checksums
        """Shard file name -> sha256 promised by a manifest; each shard is checked when first opened."""
        index_path = os.path.join(dirname, "index.json")
        try:
            with open(index_path) as fh:
                index = json.load(fh)
            self.shards_info: list[dict[str, Any]] = index["shards"]
        except FileNotFoundError:
            raise MtrainError(f"{index_path}: not found; is {dirname} an MDS folder (written by MDSWriter)?") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise MtrainError(f"{index_path}: corrupt MDS index ({exc})") from exc
        if not self.shards_info:
            raise MtrainError(f"{index_path}: the MDS index lists no shards")
        for info in self.shards_info:  # before anything is decoded
            if not isinstance(info, dict):
                raise MtrainError(f"{index_path}: corrupt MDS index (a shard entry is not a mapping)")
            refuse_unsafe_columns(info, index_path)
        self.columns = dict(zip(self.shards_info[0]["column_names"], self.shards_info[0]["column_encodings"]))
        counts = np.array([int(s["samples"]) for s in self.shards_info], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)])
        self._open: OrderedDict[int, MDSShard] = OrderedDict()

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def shard(self, k: int) -> MDSShard:
        """Shard `k`; the last few opened stay open, so that shuffled reads of compressed shards do not
        decompress a whole shard for every sample."""
        if k in self._open:
            self._open.move_to_end(k)
        else:
            self._open[k] = MDSShard(self.dirname, self.shards_info[k], self.checksums)
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        return self._open[k]

    def __getitem__(self, idx: int) -> dict[str, Any]:
        k = int(np.searchsorted(self.shard_starts, idx, side="right")) - 1
        return self.shard(k)[idx - int(self.shard_starts[k])]


def read_manifest(dirname: str) -> dict | None:
    """mtrain's manifest.json of a packed folder (None for MDS folders written by other tools)."""
    path = os.path.join(dirname, "manifest.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            obj = json.load(fh)
        obj["config_hash"], int(obj["seq_len"])
    except (ValueError, KeyError, TypeError) as exc:
        raise MtrainError(f"{path}: corrupt manifest ({type(exc).__name__}: {exc}); re-create the dataset "
                          "with `mtrain pack`") from None
    return obj


def shard_checksums(manifest: dict | None) -> dict[str, str]:
    """Shard file name -> the sha256 mtrain's manifest records for it (for `MDSFolder`, which checks each shard)."""
    return {e["file"]: e["sha256"] for e in (manifest or {}).get("shards", []) if "sha256" in e}


def file_sha256(path: str) -> str:
    """Hex sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()
