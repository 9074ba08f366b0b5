"""Tokenizers for packing: identity hash, BOS/EOS policy, and the per-chunk tokenization worker.

Workers use the Rust `tokenizers` backend directly; each chunk's tokens are committed to the work folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mtrain.data.sources import Chunk, read_chunk
from mtrain.errors import MtrainError, writing

POLICIES = ("auto", "always", "never")
SPACE_FIX = ("free space on that disk (or choose another --out) and rerun the same command: the work already "
             "finished is kept and the pack resumes from it")


@dataclass(frozen=True)
class TokenizerInfo:
    """What packing needs to know about a HF tokenizer; `sha256` identifies it across machines."""

    path: str
    sha256: str
    json: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    adds_bos: bool
    """The tokenizer puts BOS in front when called with special tokens (Llama-3 does, Qwen2.5 does not)."""


def load_tokenizer(path: str) -> TokenizerInfo:
    """Load a HF (fast) tokenizer folder or hub id available offline (cached in this process while the
    folder's files are unchanged: a 150K-token vocabulary takes seconds to load)."""
    stamp = ()
    if os.path.isdir(path):
        from mtrain.config import TOKENIZER_FILES

        if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
            raise MtrainError(f"tokenizer {path}: the folder holds no tokenizer files (expected one of "
                              f"{', '.join(TOKENIZER_FILES)}); give the folder of the model's tokenizer")
        stamp = tuple((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in sorted(os.scandir(path), key=lambda e: e.name))
    return _load_tokenizer(path, stamp)


@lru_cache(maxsize=8)
def _load_tokenizer(path: str, stamp: tuple) -> TokenizerInfo:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError/... for a bad folder
        raise MtrainError(f"tokenizer {path}: cannot load it ({exc})") from exc
    if not getattr(tok, "is_fast", False):
        raise MtrainError(f"tokenizer {path}: a fast (tokenizer.json) tokenizer is needed")
    text = tok.backend_tokenizer.to_str()
    probe = tok("a")["input_ids"]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    digest = hashlib.sha256(f"{text}\n{bos}\n{eos}".encode()).hexdigest()
    return TokenizerInfo(path, digest, text, len(tok), bos, eos, bos is not None and probe[:1] == [bos])


@dataclass(frozen=True)
class SpecialPolicy:
    """Resolved BOS/EOS choice for target documents."""

    bos: int | None
    eos: int | None

    @staticmethod
    def resolve(info: TokenizerInfo, bos: str, eos: str) -> "SpecialPolicy":
        """bos / eos: auto | always | never, or a token of the vocabulary to use instead (e.g. eos
        `<|endoftext|>` with a Qwen instruct tokenizer whose own EOS is the chat-turn end `<|im_end|>`)."""
        explicit = {}
        for name, value in (("bos", bos), ("eos", eos)):
            if value not in POLICIES:
                from tokenizers import Tokenizer

                token_id = Tokenizer.from_str(info.json).token_to_id(value)
                if token_id is None:
                    raise MtrainError(f"{name} {value!r}: not a token of {info.path}; use one of {POLICIES} "
                                      "or a token of that tokenizer")
                explicit[name] = token_id
        if explicit:
            rest = SpecialPolicy.resolve(info, "never" if "bos" in explicit else bos,
                                         "never" if "eos" in explicit else eos)
            return SpecialPolicy(explicit.get("bos", rest.bos), explicit.get("eos", rest.eos))
        if bos == "always" and info.bos_id is None:
            raise MtrainError(f"tokenizer {info.path} has no BOS token; use bos: auto or never")
        if eos == "always" and info.eos_id is None:
            raise MtrainError(f"tokenizer {info.path} has no EOS token; use eos: auto or never")
        # auto: BOS as the tokenizer adds it itself; EOS whenever there is one, so documents stay separated
        want_bos = bos == "always" or (bos == "auto" and info.adds_bos)
        want_eos = eos == "always" or (eos == "auto" and info.eos_id is not None)
        return SpecialPolicy(info.bos_id if want_bos else None, info.eos_id if want_eos else None)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a tokenization worker needs (picklable)."""

    target: TokenizerInfo
    source: TokenizerInfo | None
    policy: SpecialPolicy
    fields: tuple[str, ...]
    skip_empty: bool
    work_dir: str
    batch: int = 256
    batch_chars: int = 8 << 20


_STATE: dict = {}


def init_worker(config: WorkerConfig) -> None:
    """Pool initializer; the Rust tokenizers are built on first use (a 150K vocabulary takes ~1 s, and
    same-tokenizer MDS sources need none)."""
    # one process per core already; Rust threads inside each would oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE.clear()
    _STATE["config"] = config
    _STATE["same"] = config.source is None or config.source.sha256 == config.target.sha256


def _backend(role: str):
    """The worker's Rust tokenizer for `role` ("source" or "target")."""
    if role not in _STATE:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(getattr(_STATE["config"], role).json)
        # a literal "<|endoftext|>" inside a document is text, not a document boundary: boundaries come
        # only from the BOS/EOS policy
        backend.encode_special_tokens = True
        _STATE[role] = backend
    return _STATE[role]


def chunk_paths(work_dir: str, chunk: Chunk) -> tuple[str, str]:
    """Token file and length file of a tokenized chunk (the length file is written last: the commit)."""
    base = os.path.join(work_dir, "tok", f"s{chunk.source:03d}", f"c{chunk.index:06d}")
    return base + ".tokens.npy", base + ".lengths.npy"


def _strip(ids: np.ndarray, info: TokenizerInfo) -> np.ndarray:
    """Drop the source tokenizer's BOS run at the start and EOS run at the end of a document."""
    lo, hi = 0, len(ids)
    while info.bos_id is not None and lo < hi and ids[lo] == info.bos_id:
        lo += 1
    while info.eos_id is not None and hi > lo and ids[hi - 1] == info.eos_id:
        hi -= 1
    return ids[lo:hi]


def _encode(pending: list[tuple[str, object]]) -> list[np.ndarray | None]:
    """Target-token arrays (no BOS/EOS yet) for a batch of (where, text | source ids); None for a
    pre-tokenized span holding only the source's BOS/EOS (a boundary piece, not an empty document)."""
    config: WorkerConfig = _STATE["config"]
    out: list[np.ndarray | None] = [None] * len(pending)
    texts: list[str] = []
    text_slots: list[int] = []
    decode: list[list[int]] = []
    decode_slots: list[int] = []
    reference = config.source or config.target
    for i, (where, doc) in enumerate(pending):
        if isinstance(doc, str):
            texts.append(doc)
            text_slots.append(i)
            continue
        ids = np.asarray(doc)
        if ids.size and int(ids.max()) >= reference.vocab_size:
            raise MtrainError(
                f"{where}: tokenizer mismatch: token id {int(ids.max())} is outside the vocabulary "
                f"({reference.vocab_size}) of {reference.path}; pass the tokenizer the source was "
                "made with as --source-tokenizer"
            )
        if ids.size == 0:  # a zero-length span: an empty document (the caller fails or skips it)
            out[i] = ids.astype(np.uint32)
            continue
        ids = _strip(ids, reference)
        if ids.size == 0:
            continue
        if _STATE["same"]:
            out[i] = ids.astype(np.uint32)
        else:
            decode.append(ids.tolist())
            decode_slots.append(i)
    if decode:
        decoded = _backend("source").decode_batch(decode, skip_special_tokens=False)
        texts.extend(decoded)
        text_slots.extend(decode_slots)
    if texts:
        # the fast variant skips offset tracking, which packing never uses
        encodings = _backend("target").encode_batch_fast(texts, add_special_tokens=False)
        for slot, enc in zip(text_slots, encodings):
            out[slot] = np.asarray(enc.ids, dtype=np.uint32)
    return out  # type: ignore[return-value]


def tokenize_chunk(chunk: Chunk) -> dict[str, int]:
    """Tokenize one chunk into the work folder; returns its counts (also stored beside the tokens)."""
    config: WorkerConfig = _STATE["config"]
    policy = config.policy
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    counts = {"documents": 0, "tokens": 0, "skipped_empty": 0, "special_only": 0}
    pending: list[tuple[str, object]] = []

    def flush() -> None:
        for (where, _), ids in zip(pending, _encode(pending)):
            if ids is None:
                counts["special_only"] += 1
                continue
            if ids.size == 0:
                if config.skip_empty:
                    counts["skipped_empty"] += 1
                    continue
                raise MtrainError(f"{where}: empty document; remove it or pack with skip_empty")
            if policy.bos is not None:
                ids = np.concatenate([np.array([policy.bos], np.uint32), ids])
            if policy.eos is not None:
                ids = np.concatenate([ids, np.array([policy.eos], np.uint32)])
            pieces.append(ids)
            lengths.append(len(ids))
        pending.clear()

    pending_size = 0
    for item in read_chunk(chunk, config.fields[chunk.source]):
        pending.append(item)
        pending_size += len(item[1]) if isinstance(item[1], str) else 4 * len(item[1])
        # bound a batch by size too: a batch of 512K-token documents would hold gigabytes of encodings
        if len(pending) >= config.batch or pending_size >= config.batch_chars:
            flush()
            pending_size = 0
    flush()
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)
    counts["documents"], counts["tokens"] = len(lengths), int(tokens.size)
    tok_path, len_path = chunk_paths(config.work_dir, chunk)
    os.makedirs(os.path.dirname(tok_path), exist_ok=True)
    save_atomic(tok_path, tokens)
    tmp = f"{counts_path(len_path)}.tmp{os.getpid()}"
    with removed_on_error(tmp), writing(counts_path(len_path), SPACE_FIX, "tokenizing"):
        with open(tmp, "w") as fh:
            json.dump(counts, fh)
    os.replace(tmp, counts_path(len_path))
    save_atomic(len_path, np.asarray(lengths, dtype=np.int64))  # last: marks the chunk done
    return counts


def counts_path(lengths_path: str) -> str:
    return lengths_path.replace(".lengths.npy", ".counts.json")


@contextlib.contextmanager
def removed_on_error(path: str):
    """Delete the half-written file `path` when the block fails (a full disk gets back the room it took)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise


def save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with removed_on_error(tmp), writing(path, SPACE_FIX, "packing"):
        with open(tmp, "wb") as fh:
            np.save(fh, array)
    os.replace(tmp, path)
