"""`pack`: tokenize a mixture of sources and pack it into fixed-length MDS samples in ProLong's schema.

Stages: tokenize chunks (parallel, one committed file each) -> plan the mixture (seeded) -> write numbered
shards (parallel, one journal entry each) -> manifest.json, then index.json (the completeness marker).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Iterator

import numpy as np

from mtrain.data import tokenize as tk
from mtrain.data.mds import file_sha256, mds_writer
from mtrain.data.sources import Chunk, SourceSpec, list_chunks, parse_source_spec, source_from_dict
from mtrain.errors import MtrainError, writing

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
COLUMNS = {"input_ids": "ndarray:uint32", "indices": "ndarray:uint32", "domain": "str", "length": "int"}
SHARD_BYTES = 64 << 20
ORDERS = ("shuffle", "length")


@dataclass
class PackOptions:
    """Packing knobs beyond sources / tokenizers / seq_len (also the keys a manifest YAML may set)."""

    seed: int = 0
    """Seeds document selection and order; the same seed and inputs give byte-identical output."""
    total_tokens: int | None = None
    """Tokens to pack; None: as many as the scarcest non-replay source allows at its share."""
    order: str = "shuffle"
    """shuffle: documents in seeded random order; length: longest first, so samples hold similar lengths."""
    bos: str = "auto"
    """auto | always | never | a token: auto adds BOS when the target tokenizer adds one itself (Llama-3,
    not Qwen); a token string (e.g. "<|begin_of_text|>") starts every document with that token."""
    eos: str = "auto"
    """auto | always | never | a token: auto ends every document with the tokenizer's EOS; a token string
    (e.g. "<|endoftext|>" for a Qwen instruct tokenizer whose EOS is <|im_end|>) ends it with that token."""
    skip_empty: bool = False
    """Drop empty documents (counted in the manifest) instead of stopping with an error."""
    samples_per_shard: int | None = None
    """Samples per output shard; None: about 64 MiB per shard."""
    compression: str | None = None
    """MDS shard compression (e.g. zstd); None keeps shards memory-mappable for the reader."""
    workers: int | None = None
    """Processes for tokenization and writing; None: every core this process may use."""
    keep_work: bool = False
    """Keep OUT/.work (tokenized chunks) after success."""
    progress: bool = True
    """Show tqdm progress bars (tokens/s)."""


def _as_spec(source: SourceSpec | str | dict) -> SourceSpec:
    if isinstance(source, SourceSpec):
        return source
    if isinstance(source, dict):
        return source_from_dict(source, None, "source")
    return parse_source_spec(str(source))


def _tokenizer_record(info: tk.TokenizerInfo | None) -> dict | None:
    return None if info is None else {"path": info.path, "sha256": info.sha256, "vocab_size": info.vocab_size}


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with tk.removed_on_error(tmp), writing(path, tk.SPACE_FIX, "packing"):
        with open(tmp, "w") as fh:
            json.dump(obj, fh, indent=1, sort_keys=True)
            fh.write("\n")
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    with open(path) as fh:
        return json.load(fh)


def pack(
    sources: Iterable[SourceSpec | str | dict],
    tokenizer: str | os.PathLike,
    seq_len: int,
    out_dir: str | os.PathLike,
    *,
    source_tokenizer: str | os.PathLike | None = None,
    seed: int = 0,
    **options: Any,
) -> dict:
    """Pack `sources` into `out_dir` as MDS samples of exactly `seq_len` target tokens; return the manifest.

    sources: `SourceSpec`s, `PATH[:FORMAT][:field=NAME][@PROPORTION]` strings or manifest-style dicts.
    tokenizer: the target HF tokenizer (folder or offline hub id). source_tokenizer: the tokenizer of
    pre-tokenized (MDS `input_ids`) sources; when it differs from the target each document is decoded and
    re-encoded. options: fields of `PackOptions`. Re-running on a killed run's `out_dir` resumes it; on a
    finished one with the same inputs it returns the stored manifest.
    """
    unknown = set(options) - set(PackOptions.__dataclass_fields__)
    if unknown:
        raise MtrainError(f"pack: unknown option(s) {sorted(unknown)}; known: {sorted(PackOptions.__dataclass_fields__)}")
    opts = PackOptions(seed=seed, **options)
    return _Packer([_as_spec(s) for s in sources], str(tokenizer), int(seq_len), str(out_dir),
                   str(source_tokenizer) if source_tokenizer else None, opts).run()


@contextlib.contextmanager
def _out_lock(out_dir: str):
    """Hold an exclusive lock on the --out folder for one pack (flock on the folder itself, so nothing is added to
    it; the kernel drops it when the process dies, kill -9 included): a second `mtrain pack` into the same folder
    fails at once instead of racing the first over its work files. A folder created here is removed again if the
    pack leaves it empty."""
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MtrainError(f"pack: --out {out_dir} is being written by another `mtrain pack` right now; wait for "
                              "it to finish (the same command then returns its result) or choose another --out") from None
        yield
    finally:
        os.close(fd)  # releases the lock
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)  # only if still empty


@dataclass
class _Plan:
    """Selected documents in output order (parallel arrays) and per-source statistics."""

    source: np.ndarray
    chunk: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    stats: list[dict] = field(default_factory=list)
    num_samples: int = 0
    dropped_tokens: int = 0
    """Tokens after the last whole sample: the end of the cut document and the documents after it."""
    dropped_documents: int = 0


class _Packer:
    def __init__(self, specs, tokenizer, seq_len, out_dir, source_tokenizer, opts: PackOptions):
        self.specs: list[SourceSpec] = specs
        self.out_dir = out_dir
        self.work_dir = os.path.join(out_dir, ".work")
        self.opts = opts
        self.seq_len = seq_len
        if not specs:
            raise MtrainError("pack: no sources given")
        if opts.order not in ORDERS:
            raise MtrainError(f"pack: order {opts.order!r}: use one of {ORDERS}")
        given = [s.proportion is not None for s in specs]
        if any(given) and not all(given):
            missing = [s.label() for s in specs if s.proportion is None]
            raise MtrainError(f"pack: sources {missing} have no proportion; give every source one or none")
        if any(given) and any(s.proportion <= 0 for s in specs):
            raise MtrainError("pack: every proportion must be > 0 (drop a source instead of giving it 0)")
        labels = [s.label() for s in specs]
        if len(set(labels)) != len(labels):
            raise MtrainError(f"pack: two sources share a name in {labels}; give them distinct `name`s")
        self.target = tk.load_tokenizer(tokenizer)
        self.source_tok = tk.load_tokenizer(source_tokenizer) if source_tokenizer else None
        self.policy = tk.SpecialPolicy.resolve(self.target, opts.bos, opts.eos)
        minimum = 2 + (self.policy.bos is not None) + (self.policy.eos is not None)
        if not isinstance(seq_len, int) or seq_len < minimum:
            raise MtrainError(
                f"pack: seq_len {seq_len} is too small: a sample needs at least {minimum} tokens "
                f"(BOS/EOS plus two tokens of text to predict); typical values are 65536 or 524288"
            )
        per_shard = opts.samples_per_shard or max(1, SHARD_BYTES // (4 * seq_len))
        if per_shard < 1 or per_shard * (4 * seq_len + 64) >= 2**32:
            raise MtrainError(f"pack: samples_per_shard {per_shard} must be >= 1 and keep a shard under 4 GiB")
        self.per_shard = per_shard
        self.workers = opts.workers or cores()

    # ---------------------------------------------------------------- identity and output folder
    def _identity(self) -> dict:
        sources = []
        self.chunks: list[list[Chunk]] = []
        for i, spec in enumerate(self.specs):
            chunks, fingerprint = list_chunks(i, spec)
            self.chunks.append(chunks)
            self._check_mds_tokenizer(spec, fingerprint["format"])
            # absolute paths: the same request from another working directory is the same dataset
            sources.append({**spec.to_dict(), "path": os.path.abspath(spec.path), "name": spec.label(), **fingerprint})
        return {
            "format_version": FORMAT_VERSION,
            "sources": sources,
            "tokenizer": _tokenizer_record(self.target),
            "source_tokenizer": _tokenizer_record(self.source_tok),
            "seq_len": self.seq_len,
            "bos_id": self.policy.bos,
            "eos_id": self.policy.eos,
            "samples_per_shard": self.per_shard,
            **{k: v for k, v in asdict(self.opts).items() if k not in ("workers", "keep_work", "progress")},
        }

    def _check_mds_tokenizer(self, spec: SourceSpec, fmt: str) -> None:
        """An MDS source packed by mtrain names its tokenizer: it must be the declared source tokenizer."""
        manifest_path = os.path.join(spec.path, "manifest.json")
        if fmt != "mds" or not os.path.exists(manifest_path):
            return
        made_with = (_read_json(manifest_path).get("tokenizer") or {}).get("sha256")
        declared = self.source_tok or self.target
        if made_with and made_with != declared.sha256:
            flag = "--source-tokenizer" if self.source_tok else "--tokenizer (or give --source-tokenizer)"
            raise MtrainError(
                f"{manifest_path}: tokenizer mismatch: this source was packed with tokenizer sha256 "
                f"{made_with[:12]}, not {declared.path} ({declared.sha256[:12]}); pass the right {flag}"
            )

    @staticmethod
    def _hash(identity: dict) -> str:
        # tokenizer paths may differ between machines; the tokenizer content hash is what matters
        stable = json.loads(json.dumps(identity))
        for key in ("tokenizer", "source_tokenizer"):
            if stable[key]:
                stable[key].pop("path")
        return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()

    def _prepare_out_dir(self, config_hash: str) -> dict | None:
        """Return the stored manifest when the same dataset is already complete; set up resume otherwise."""
        out, work = self.out_dir, self.work_dir
        manifest_path = os.path.join(out, "manifest.json")
        index_path = os.path.join(out, "index.json")
        config_path = os.path.join(work, "config.json")
        if os.path.exists(index_path) and os.path.exists(manifest_path):
            manifest = _read_json(manifest_path)
            if manifest.get("config_hash") == config_hash:
                return manifest
            raise MtrainError(
                f"{out} holds a different dataset (manifest.json config_hash {manifest.get('config_hash', '?')[:12]}, "
                f"this request {config_hash[:12]}); choose another --out or delete that folder"
            )
        if os.path.exists(config_path):
            stored = _read_json(config_path).get("config_hash")
            if stored != config_hash:
                raise MtrainError(
                    f"{out} holds an unfinished pack of a different dataset (config_hash {str(stored)[:12]}, "
                    f"this request {config_hash[:12]}); rerun that pack to finish it, or delete {out}"
                )
            log.info("resuming the unfinished pack in %s", out)
            return None
        if os.path.exists(index_path):
            raise MtrainError(f"{out} holds a different dataset (an MDS index.json not made by this pack); "
                              "choose another --out")
        if os.path.isdir(out) and os.listdir(out):
            raise MtrainError(f"{out} is not empty and is not an mtrain pack output; choose an empty or new --out")
        os.makedirs(work, exist_ok=True)
        return None

    # ---------------------------------------------------------------- stage 1: tokenize
    def _parallel(self, fn, items: list, initializer, initargs: tuple) -> Iterator:
        """fn(item) for every item, in completion order: inline with one worker, else in worker processes."""
        if self.workers == 1 or len(items) <= 1:
            initializer(*initargs)
            yield from map(fn, items)
            return
        # fork: workers inherit the loaded modules and start in milliseconds. A process pool executor
        # (unlike multiprocessing.Pool) reports a worker killed by the OS instead of waiting forever.
        executor = ProcessPoolExecutor(min(self.workers, len(items)), mp_context=multiprocessing.get_context("fork"),
                                       initializer=_die_with_parent, initargs=(os.getpid(), initializer, *initargs))
        try:
            for future in as_completed([executor.submit(fn, item) for item in items]):
                yield future.result()
        except BrokenProcessPool:
            raise MtrainError(
                f"pack: a worker process died (killed by the OS, e.g. out of memory?); the finished work in "
                f"{self.work_dir} is kept: rerun the same command to resume, with fewer --workers if memory is short"
            ) from None
        finally:
            executor.shutdown(wait=True, cancel_futures=True)

    def _tokenize(self) -> None:
        config = tk.WorkerConfig(
            self.target, self.source_tok, self.policy, tuple(s.field for s in self.specs),
            self.opts.skip_empty, self.work_dir,
        )
        todo = [c for chunks in self.chunks for c in chunks if not os.path.exists(tk.chunk_paths(self.work_dir, c)[1])]
        total = sum(len(c) for c in self.chunks)
        if not todo:
            return
        log.info("tokenizing %d of %d chunks with %d worker(s)", len(todo), total, self.workers)
        bar = self._bar("tokenize", None)
        for counts in self._parallel(tk.tokenize_chunk, todo, tk.init_worker, (config,)):
            bar.update(counts["tokens"])
        bar.close()

    def _bar(self, desc: str, total: int | None):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, disable=not self.opts.progress,
                    dynamic_ncols=True, smoothing=0.1)

    # ---------------------------------------------------------------- stage 2: plan
    def _plan(self) -> _Plan:
        per_source, dropped = [], []
        for i, chunks in enumerate(self.chunks):
            lens, chunk_ids, offsets = [], [], []
            dropped.append({"skipped_empty": 0, "special_only": 0})
            for c in chunks:
                lengths_path = tk.chunk_paths(self.work_dir, c)[1]
                lengths = np.load(lengths_path)
                counts = _read_json(tk.counts_path(lengths_path))
                for key in dropped[i]:
                    dropped[i][key] += counts[key]
                lens.append(lengths)
                chunk_ids.append(np.full(len(lengths), c.index, np.int64))
                offsets.append(np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64))
            lengths = np.concatenate(lens) if lens else np.zeros(0, np.int64)
            if lengths.sum() == 0:
                raise MtrainError(f"source {self.specs[i].path}: holds no documents")
            per_source.append((lengths, np.concatenate(chunk_ids), np.concatenate(offsets)))
        available = np.array([p[0].sum() for p in per_source], dtype=np.float64)
        budgets = self._budgets(available)

        picked_source, picked_index, stats = [], [], []
        for i, ((lengths, _, _), budget) in enumerate(zip(per_source, budgets)):
            spec = self.specs[i]
            taken, passes, chosen = 0, 0, []
            while taken < budget:
                if passes >= 1 and not spec.replay:
                    if taken >= available[i] and budget <= available[i] * (1 + 1e-9):
                        break  # float rounding of the scarcest source's own budget
                    raise MtrainError(
                        f"source {spec.path}: has {int(available[i])} tokens but its share needs "
                        f"{int(budget)}; lower total_tokens, lower its proportion, or mark it `replay: true`"
                    )
                order = np.random.default_rng([self.opts.seed, 1, i, passes]).permutation(len(lengths))
                cum = np.cumsum(lengths[order])
                # documents whose start lies inside the remaining budget (overshoot < one document)
                n = int(np.searchsorted(cum - lengths[order], budget - taken, side="left"))
                chosen.append(order[:n])
                taken += int(cum[n - 1]) if n else 0
                passes += 1
            idx = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
            picked_source.append(np.full(len(idx), i, np.int64))
            picked_index.append(idx)
            stats.append({
                "name": spec.label(), "documents_available": int(len(lengths)), "tokens_available": int(available[i]),
                "documents_packed": int(len(idx)), "tokens_packed": int(lengths[idx].sum()), "passes": passes,
                "target_share": None if spec.proportion is None else float(budget / budgets.sum()),
                "skipped_empty_documents": dropped[i]["skipped_empty"],
                "special_token_only_spans": dropped[i]["special_only"],
            })
        # one flat table of all documents; a picked document is base[source] + its index in the source
        base = np.concatenate([[0], np.cumsum([len(p[0]) for p in per_source])[:-1]]).astype(np.int64)
        flat_len, flat_chunk, flat_offset = (np.concatenate([p[c] for p in per_source]) for c in range(3))
        src = np.concatenate(picked_source)
        flat = base[src] + np.concatenate(picked_index)
        order = np.random.default_rng([self.opts.seed, 2]).permutation(len(src))
        if self.opts.order == "length":
            order = order[np.argsort(-flat_len[flat[order]], kind="stable")]
        src, flat = src[order], flat[order]
        length, chunk, offset = flat_len[flat], flat_chunk[flat], flat_offset[flat]
        # the stream is cut into whole samples: documents starting past the last sample are left out and
        # the one crossing its end is cut; the statistics count what is written
        total = int(length.sum())
        num_samples = total // self.seq_len
        if num_samples == 0:
            raise MtrainError(
                f"pack: the selected data holds {total} tokens, less than one sample of seq_len {self.seq_len}; "
                "add data, raise total_tokens or lower --seq-len"
            )
        end = num_samples * self.seq_len
        starts = np.cumsum(length) - length
        kept = int(np.searchsorted(starts, end, side="left"))
        written = np.minimum(length[:kept], end - starts[:kept])
        for i, s in enumerate(stats):
            mine = src[:kept] == i
            s["documents_packed"], s["tokens_packed"] = int(mine.sum()), int(written[mine].sum())
            s["share"] = s["tokens_packed"] / end
        plan = _Plan(src[:kept], chunk[:kept], offset[:kept], length[:kept], stats)
        plan.num_samples = num_samples
        plan.dropped_tokens, plan.dropped_documents = total - end, len(src) - kept
        return plan

    def _budgets(self, available: np.ndarray) -> np.ndarray:
        specs = self.specs
        if specs[0].proportion is None:
            if self.opts.total_tokens is not None:
                raise MtrainError("pack: total_tokens needs a proportion for every source")
            return available.copy()
        shares = np.array([s.proportion for s in specs], dtype=np.float64)
        shares /= shares.sum()
        if self.opts.total_tokens is not None:
            return shares * float(self.opts.total_tokens)
        bound = [available[i] / shares[i] for i, s in enumerate(specs) if not s.replay]
        if not bound:
            raise MtrainError("pack: every source is `replay`; set total_tokens to say how much to pack")
        return shares * min(bound)

    # ---------------------------------------------------------------- stage 3: write shards
    def _write(self, plan: _Plan) -> list[dict]:
        plan_dir = os.path.join(self.work_dir, "plan")
        os.makedirs(plan_dir, exist_ok=True)
        for name in ("source", "chunk", "offset", "length"):
            tk.save_atomic(os.path.join(plan_dir, f"{name}.npy"), getattr(plan, name))
        num_samples = plan.num_samples
        num_shards = -(-num_samples // self.per_shard)
        shard_dir = os.path.join(self.work_dir, "shards")
        os.makedirs(shard_dir, exist_ok=True)
        todo = [k for k in range(num_shards) if not os.path.exists(os.path.join(shard_dir, f"{k:05d}.json"))]
        state = _WriterState(self.work_dir, self.out_dir, self.seq_len, self.per_shard, num_samples,
                             [s.label() for s in self.specs], self.opts.compression)
        bar = self._bar("write", num_samples * self.seq_len)
        bar.update((num_shards - len(todo)) * self.per_shard * self.seq_len)
        for tokens in self._parallel(_write_shard, todo, _init_writer, (state,)):
            bar.update(tokens)
        bar.close()
        return [_read_json(os.path.join(shard_dir, f"{k:05d}.json")) for k in range(num_shards)]

    # ---------------------------------------------------------------- driver
    def run(self) -> dict:
        with _out_lock(self.out_dir):
            return self._run()

    def _run(self) -> dict:
        started = time.time()
        identity = self._identity()
        config_hash = self._hash(identity)
        done = self._prepare_out_dir(config_hash)
        if done is not None:
            log.info("%s already holds this dataset; nothing to do", self.out_dir)
            if not self.opts.keep_work:  # left by a run stopped right after writing index.json
                shutil.rmtree(self.work_dir, ignore_errors=True)
            return done
        _write_json_atomic(os.path.join(self.work_dir, "config.json"), {"config_hash": config_hash, **identity})
        self._tokenize()
        plan = self._plan()
        entries = self._write(plan)
        num_samples = sum(e["index"]["samples"] for e in entries)
        manifest = {
            "config_hash": config_hash,
            **identity,
            "schema": COLUMNS,
            "num_samples": num_samples,
            "num_tokens": num_samples * self.seq_len,
            "num_documents": int(len(plan.length)),
            "dropped_tail_tokens": plan.dropped_tokens,
            "dropped_tail_documents": plan.dropped_documents,
            "per_source": plan.stats,
            "shards": [{k: e[k] for k in ("file", "samples", "bytes", "sha256")} for e in entries],
        }
        _write_json_atomic(os.path.join(self.out_dir, "manifest.json"), manifest)
        # index.json last: its presence is what makes the folder a readable MDS dataset
        _write_json_atomic(os.path.join(self.out_dir, "index.json"),
                           {"shards": [e["index"] for e in entries], "version": 2})
        if not self.opts.keep_work:
            shutil.rmtree(self.work_dir)
        log.info("packed %d samples x %d tokens into %s in %.1f s", num_samples, self.seq_len, self.out_dir,
                 time.time() - started)
        return manifest


def _die_with_parent(parent: int, initializer, *initargs) -> None:
    """Worker start-up: ask the kernel to kill this worker when the packing process dies (kill -9 and
    SIGTERM included, which skip every clean-up), so no orphan keeps running; then the stage's initializer."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):  # not Linux: orphans end when their queue closes
        pass
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)
    initializer(*initargs)


# -------------------------------------------------------------------- shard writer (runs in workers)
@dataclass(frozen=True)
class _WriterState:
    work_dir: str
    out_dir: str
    seq_len: int
    per_shard: int
    num_samples: int
    labels: list[str]
    compression: str | None


_W: dict = {}


def _init_writer(state: _WriterState) -> None:
    # an earlier pack in this process may have used the same paths for files since deleted
    _chunk_tokens.cache_clear()
    plan_dir = os.path.join(state.work_dir, "plan")
    _W["state"] = state
    for name in ("source", "chunk", "offset", "length"):
        _W[name] = np.load(os.path.join(plan_dir, f"{name}.npy"), mmap_mode="r")
    _W["starts"] = np.concatenate([[0], np.cumsum(_W["length"])])


@lru_cache(maxsize=256)
def _chunk_tokens(work_dir: str, source: int, chunk: int) -> np.ndarray:
    tokens_path, _ = tk.chunk_paths(work_dir, Chunk(source, chunk, "", ""))
    return np.load(tokens_path, mmap_mode="r")


def _sample(j: int) -> dict:
    """Sample `j`: tokens [j*S, (j+1)*S) of the planned document stream, with the document spans."""
    state: _WriterState = _W["state"]
    seq = state.seq_len
    begin, end = j * seq, (j + 1) * seq
    starts = _W["starts"]
    first = int(np.searchsorted(starts, begin, side="right")) - 1
    last = int(np.searchsorted(starts, end, side="left"))  # exclusive
    pieces, spans, names = [], [], set()
    for d in range(first, last):
        lo, hi = max(begin, int(starts[d])), min(end, int(starts[d + 1]))
        if hi <= lo:
            continue
        s, c, off = int(_W["source"][d]), int(_W["chunk"][d]), int(_W["offset"][d])
        tokens = _chunk_tokens(state.work_dir, s, c)
        doc_start = int(starts[d])
        pieces.append(tokens[off + lo - doc_start: off + hi - doc_start])
        spans.append((lo - begin, hi - begin))
        names.add(state.labels[s])
    ids = np.concatenate(pieces).astype(np.uint32)
    assert len(ids) == seq, "planned stream shorter than the sample count"
    return {"input_ids": ids, "indices": np.asarray(spans, dtype=np.uint32), "domain": "+".join(sorted(names)),
            "length": seq}


def _write_shard(k: int) -> int:
    """Write output shard `k` and commit it (shard file renamed into place, then its journal entry)."""
    state: _WriterState = _W["state"]
    # per-process scratch: a worker orphaned by a killed run may still be writing shard k when a resumed run
    # does too; both produce the same bytes, and the rename below is atomic
    tmp = os.path.join(state.work_dir, "shards", f"tmp{k:05d}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    first, stop = k * state.per_shard, min((k + 1) * state.per_shard, state.num_samples)
    try:
        with writing(tmp, tk.SPACE_FIX, f"writing output shard {k}"):
            writer = mds_writer(tmp, COLUMNS, compression=state.compression, size_limit=None)
            for j in range(first, stop):
                writer.write(_sample(j))
            writer.finish()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk keeps the room it had
        raise
    (entry,) = _read_json(os.path.join(tmp, "index.json"))["shards"]
    stored = entry["zip_data"] if entry.get("zip_data") else entry["raw_data"]
    final_name = f"shard.{k:05d}.mds" + (f".{state.compression}" if state.compression else "")
    os.replace(os.path.join(tmp, stored["basename"]), os.path.join(state.out_dir, final_name))
    entry["raw_data"]["basename"] = f"shard.{k:05d}.mds"
    if entry.get("zip_data"):
        entry["zip_data"]["basename"] = final_name
    record = {"file": final_name, "samples": stop - first, "bytes": stored["bytes"],
              "sha256": file_sha256(os.path.join(state.out_dir, final_name)), "index": entry}
    _write_json_atomic(os.path.join(state.work_dir, "shards", f"{k:05d}.json"), record)
    shutil.rmtree(tmp)
    return (stop - first) * state.seq_len
