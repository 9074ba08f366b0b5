"""Packing sources: `PATH[:FORMAT][:field=NAME][@PROPORTION]` specs, format detection, and reading documents by chunk.

A chunk (MDS shard, parquet row group, jsonl byte range, save_to_disk row range) is the unit of parallel
tokenization and of resume.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Iterator

import numpy as np

from mtrain.errors import MtrainError

FORMATS = ("mds", "jsonl", "parquet", "hf")
SPEC_FORM = "PATH[:FORMAT][:field=NAME][@PROPORTION]"
FIELD_FIX = "name the text field with --source PATH:FORMAT:field=NAME (a manifest source: `field: NAME`)"
JSONL_CHUNK_BYTES = 8 << 20
HF_CHUNK_ROWS = 4096


@dataclass
class SourceSpec:
    """One mixture component."""

    path: str
    """File or folder; a folder of *.jsonl / *.parquet files is one source."""
    format: str | None = None
    """mds | jsonl | parquet | hf (a datasets `save_to_disk` folder); detected from the path when None."""
    proportion: float | None = None
    """Share of output tokens; all sources give one or none does (then every source is used whole)."""
    name: str | None = None
    """Domain label written into the output `domain` field; defaults to the folder / file stem."""
    field: str = "text"
    """Text column of jsonl / parquet / hf / text-MDS sources."""
    replay: bool = False
    """May be repeated (another shuffled pass) to reach its share: replay of short data."""
    split: str = "train"
    """Split to read when an hf folder holds a DatasetDict."""

    def label(self) -> str:
        if self.name:
            return self.name
        stem = os.path.basename(os.path.normpath(self.path))
        for ext in (".jsonl", ".json", ".parquet"):
            stem = stem.removesuffix(ext)
        return stem

    def to_dict(self) -> dict:
        return asdict(self)


def parse_source_spec(text: str) -> SourceSpec:
    """Parse `PATH[:FORMAT][:field=NAME][@PROPORTION]`, e.g. `data/books:mds@0.25`, `web.jsonl@0.1` or
    `posts.jsonl:jsonl:field=body` (documents in the `body` field instead of `text`)."""
    path, proportion = text, None
    if "@" in path:
        head, tail = path.rsplit("@", 1)
        try:
            proportion = float(tail)
        except ValueError:
            raise MtrainError(f"--source {text!r}: proportion {tail!r} after '@' is not a number") from None
        path = head
    options = {}
    head, sep, tail = path.rpartition(":")
    if sep and tail.startswith("field="):
        name = tail.removeprefix("field=")
        if not name:
            raise MtrainError(f"--source {text!r}: `field=` names no field; write {SPEC_FORM}, e.g. "
                              "posts.jsonl:jsonl:field=body")
        path, options["field"] = head, name
    fmt = None
    if ":" in path:
        head, tail = path.rsplit(":", 1)
        if tail in FORMATS:
            path, fmt = head, tail
        elif re.fullmatch(r"[A-Za-z][\w-]*", tail) and not os.path.exists(path):
            raise MtrainError(f"--source {text!r}: unknown format {tail!r}; the formats are {', '.join(FORMATS)} "
                              f"(or leave it out to detect it from the path): write {SPEC_FORM}")
    spec = SourceSpec(path=path, format=fmt, proportion=proportion, **options)
    return spec


def source_from_dict(obj: dict, root: str | None, where: str) -> SourceSpec:
    """A SourceSpec from a manifest entry; relative paths resolve against `root`."""
    known = set(SourceSpec.__dataclass_fields__)
    unknown = set(obj) - known
    if unknown:
        raise MtrainError(f"{where}: unknown source key(s) {sorted(unknown)}; known: {sorted(known)}")
    if "path" not in obj:
        raise MtrainError(f"{where}: a source needs a `path`")
    spec = SourceSpec(**obj)
    if root and not os.path.isabs(spec.path):
        spec.path = os.path.join(root, spec.path)
    return spec


def detect_format(spec: SourceSpec) -> str:
    """The source's format, from the spec or from what the path holds."""
    path = spec.path
    if not os.path.exists(path):
        raise MtrainError(f"source {path}: no such file or folder")
    if spec.format:
        if spec.format not in FORMATS:
            raise MtrainError(f"source {path}: unknown format {spec.format!r}; the formats are {', '.join(FORMATS)} "
                              "(or leave it out to detect it from the path)")
        return spec.format
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "index.json")):
            return "mds"
        if os.path.exists(os.path.join(path, "state.json")) or os.path.exists(
            os.path.join(path, "dataset_dict.json")
        ):
            return "hf"
        if glob.glob(os.path.join(path, "*.jsonl")) or glob.glob(os.path.join(path, "*.json")):
            return "jsonl"
        if glob.glob(os.path.join(path, "*.parquet")):
            return "parquet"
        raise MtrainError(
            f"source {path}: cannot tell the format (no index.json, state.json, *.jsonl or *.parquet); "
            "give it as PATH:FORMAT"
        )
    if path.endswith((".jsonl", ".json")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    raise MtrainError(f"source {path}: cannot tell the format from the name; give it as PATH:FORMAT")


def _files(path: str, patterns: tuple[str, ...]) -> list[str]:
    if os.path.isfile(path):
        return [path]
    files = sorted(f for p in patterns for f in glob.glob(os.path.join(path, p)))
    if not files:
        raise MtrainError(f"source {path}: no {' / '.join(patterns)} files in the folder")
    return files


def _hf_dir(path: str, split: str) -> str:
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as fh:
            splits = json.load(fh).get("splits", [])
        if split not in splits:
            raise MtrainError(f"source {path}: DatasetDict has no split {split!r} (splits: {splits})")
        return os.path.join(path, split)
    return path


@dataclass
class Chunk:
    """A unit of tokenization work: one shard / row group / byte range / row range of one source."""

    source: int
    index: int
    format: str
    path: str
    begin: int = 0
    end: int = 0
    meta: dict = field(default_factory=dict)


def list_chunks(source_index: int, spec: SourceSpec) -> tuple[list[Chunk], dict]:
    """Chunks of a source, in a fixed order, and a fingerprint of its files (names and sizes)."""
    fmt = detect_format(spec)
    chunks: list[Chunk] = []
    files: list[str] = []
    if fmt == "mds":
        from mtrain.data.mds import MDSFolder

        folder = MDSFolder(spec.path)
        if "input_ids" not in folder.columns and spec.field not in folder.columns:
            raise MtrainError(
                f"{os.path.join(spec.path, 'index.json')}: missing field: the MDS columns "
                f"{sorted(folder.columns)} have neither `input_ids` nor the text field `{spec.field}`; {FIELD_FIX}"
            )
        for k, info in enumerate(folder.shards_info):
            chunks.append(Chunk(source_index, k, fmt, spec.path, k, k + 1))
            stored = [os.path.join(spec.path, d["basename"]) for d in (info["raw_data"], info.get("zip_data")) if d]
            present = [f for f in stored if os.path.exists(f)]
            if not present:
                raise MtrainError(f"{stored[0]}: shard listed in {spec.path}/index.json is missing")
            files.append(present[0])
        files.append(os.path.join(spec.path, "index.json"))
    elif fmt == "jsonl":
        for f in _files(spec.path, ("*.jsonl", "*.json")):
            files.append(f)
            size = os.path.getsize(f)
            begin = 0
            with open(f, "rb") as fh:
                while begin < size:
                    fh.seek(min(begin + JSONL_CHUNK_BYTES, size))
                    fh.readline()  # move to the next line boundary
                    end = min(fh.tell(), size)
                    chunks.append(Chunk(source_index, len(chunks), fmt, f, begin, end))
                    begin = end
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for f in _files(spec.path, ("*.parquet",)):
            files.append(f)
            try:
                meta = pq.ParquetFile(f).metadata
            except Exception as exc:  # pyarrow raises ArrowInvalid / OSError on a damaged footer
                raise MtrainError(f"{f}: not a readable parquet file ({exc})") from exc
            if spec.field not in meta.schema.names:
                raise MtrainError(f"{f}: missing field `{spec.field}` (columns: {meta.schema.names}); {FIELD_FIX}")
            for g in range(meta.num_row_groups):
                chunks.append(Chunk(source_index, len(chunks), fmt, f, g, g + 1))
    else:
        import datasets

        directory = _hf_dir(spec.path, spec.split)
        try:
            ds = datasets.load_from_disk(directory)
        except Exception as exc:  # datasets raises several types for a damaged folder
            raise MtrainError(f"{directory}: not a readable datasets `save_to_disk` folder ({exc})") from exc
        if spec.field not in ds.column_names:
            raise MtrainError(f"{directory}: missing field `{spec.field}` (columns: {ds.column_names}); {FIELD_FIX}")
        files.extend(sorted(glob.glob(os.path.join(directory, "*.arrow"))))
        for begin in range(0, len(ds), HF_CHUNK_ROWS):
            end = min(begin + HF_CHUNK_ROWS, len(ds))
            chunks.append(Chunk(source_index, len(chunks), fmt, directory, begin, end))
    base = spec.path if os.path.isdir(spec.path) else os.path.dirname(spec.path)
    fingerprint = {"format": fmt, "files": [[os.path.relpath(f, base), os.path.getsize(f)] for f in files]}
    return chunks, fingerprint


def read_chunk(chunk: Chunk, field_name: str) -> Iterator[tuple[str, object]]:
    """Yield `(where, document)` for a chunk: `where` names file and position for error messages; the
    document is a `str` or a `np.ndarray` of token ids (pre-tokenized MDS, `indices` spans cut out)."""
    if chunk.format == "mds":
        from mtrain.data.mds import MDSFolder, read_manifest, shard_checksums

        # a folder packed by mtrain lists each shard's sha256: a changed byte is named as such, not read as tokens
        folder = MDSFolder(chunk.path, shard_checksums(read_manifest(chunk.path)))
        shard = folder.shard(chunk.begin)
        tokenized = "input_ids" in shard.columns
        for i in range(len(shard)):
            sample = shard[i]
            where = f"{shard.path} sample {i}"
            if not tokenized:
                yield where, _text(sample, field_name, where)
                continue
            ids = np.asarray(sample["input_ids"])
            spans = sample.get("indices")
            if spans is None:
                yield where, ids
                continue
            spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
            for j, (s, e) in enumerate(spans):
                if not 0 <= s <= e <= len(ids):
                    raise MtrainError(f"{where}: corrupt `indices` span {j} = ({s}, {e}) for {len(ids)} tokens")
                yield f"{where} document {j}", ids[s:e]
    elif chunk.format == "jsonl":
        with open(chunk.path, "rb") as fh:
            fh.seek(chunk.begin)
            data = fh.read(chunk.end - chunk.begin)
        offset = chunk.begin
        for line in data.split(b"\n"):
            where = f"{chunk.path} at byte {offset}"
            offset += len(line) + 1
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise MtrainError(f"{where}: not a valid JSON line ({exc.msg}); is the file truncated or not "
                                  "JSON Lines?") from None
            except UnicodeDecodeError as exc:  # json.loads decodes bytes as UTF-8 (or UTF-16/32 by their BOM)
                bad = line[exc.start:exc.end].hex(" ")
                raise MtrainError(f"{chunk.path} at byte {offset - len(line) - 1 + exc.start}: not UTF-8 text (bytes "
                                  f"{bad}); JSON Lines must be UTF-8: re-encode the file (e.g. iconv -f latin1 -t "
                                  "utf-8) or drop that line") from None
            yield where, _text(record, field_name, where)
    elif chunk.format == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(chunk.path).read_row_group(chunk.begin, columns=[field_name])
        except Exception as exc:  # pyarrow raises several types on damaged pages
            raise MtrainError(f"{chunk.path}: cannot read row group {chunk.begin} ({exc})") from exc
        for r, text in enumerate(table.column(field_name).to_pylist()):
            where = f"{chunk.path} row group {chunk.begin} row {r}"
            yield where, _text({field_name: text}, field_name, where)
    else:
        import datasets

        ds = datasets.load_from_disk(chunk.path).select(range(chunk.begin, chunk.end))
        for r, text in enumerate(ds[field_name]):
            where = f"{chunk.path} row {chunk.begin + r}"
            yield where, _text({field_name: text}, field_name, where)


def _text(record, field_name: str, where: str) -> str:
    if not isinstance(record, dict) or field_name not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise MtrainError(f"{where}: missing field `{field_name}` (has {keys}); {FIELD_FIX}")
    text = record[field_name]
    if not isinstance(text, str):
        raise MtrainError(f"{where}: field `{field_name}` is {type(text).__name__}, not text")
    return text
