"""Resumable eval runs: one append-only, flushed jsonl of predictions per task (`mtrain.eval.predictions`), guarded
by a run manifest.

A rerun skips every (task, length, index) already written; a manifest that disagrees with this run is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

from mtrain.atomic import write_json_atomic
from mtrain.errors import MtrainError
from mtrain.eval.backends.base import Backend, PromptTooLongError, rope_config
# the predictions file format, re-exported: callers import PREDICTIONS, predictions_path and read_records from here
from mtrain.eval.predictions import PREDICTIONS, append_records, drop_torn_tail, predictions_path, read_records
from mtrain.eval.registry import BuildContext, get_task
from mtrain.eval.suite import Suite, TaskRun
from mtrain.models.loading import check_weight_files

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


class ManifestMismatchError(MtrainError):
    """The output folder holds a run of another checkpoint, backend or generation setting."""


def checkpoint_hash(model_path: str) -> str:
    """sha256 over every regular file of the checkpoint folder (name and bytes, sorted by name)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model_path)):
        path = os.path.join(model_path, name)
        if name.startswith(".") or not os.path.isfile(path):
            continue
        digest.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def task_settings(run: TaskRun) -> dict:
    """What of a task changes its prompts or predictions: version, lengths' samples excluded, settings, params."""
    task = get_task(run.name)
    return {"version": task.version, "max_new_tokens": run.max_new_tokens, "stop": run.stop,
            "params": run.params, "decoding": "greedy"}


def _compare(old: dict, new: dict, keys: list[str], where: str) -> None:
    diffs = [k for k in keys if k in old and old[k] != new[k]]
    if diffs:
        detail = "; ".join(f"{k}: was {old[k]!r}, now {new[k]!r}" for k in diffs)
        raise ManifestMismatchError(
            f"{where} belongs to a different run ({detail}); resume only with the same checkpoint, backend and "
            f"settings, or write to a new --out folder"
        )


class Manifest:
    """The run manifest in OUT/manifest.json: checkpoint hash, rope config, seed, backend, per-task settings."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, MANIFEST)
        self.data: dict[str, Any] = {}
        if os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    self.data = json.load(f)
            except ValueError as exc:
                raise MtrainError(f"{self.path}: damaged run manifest ({exc}); delete the --out folder's "
                                  "manifest.json only if its predictions belong to this checkpoint, else use a new --out") from None

    def check_and_set(self, keys: dict[str, Any]) -> None:
        _compare(self.data, keys, list(keys), self.path)
        self.data.update(keys)

    def check_and_set_task(self, name: str, settings: dict) -> None:
        tasks = self.data.setdefault("tasks", {})
        if name in tasks:
            _compare(tasks[name], settings, list(settings), f"{self.path} (task {name})")
        tasks[name] = settings

    def save(self) -> None:
        write_json_atomic(self.path, self.data, indent=2, sort_keys=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def check_checkpoint_folder(model_path: str) -> None:
    """A HF checkpoint folder with a readable config.json, weights and tokenizer files, before anything loads."""
    if not os.path.isdir(model_path):
        raise MtrainError(f"--model {model_path!r}: no such folder; give a HF checkpoint folder (e.g. RUN/final)")
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise MtrainError(f"--model {model_path!r} is not a HF checkpoint folder (no config.json)")
    rope_config(model_path)  # a torn config.json fails here, in one line
    names = os.listdir(model_path)
    if not any(n.endswith(".safetensors") or n.endswith(".bin") for n in names):
        raise MtrainError(f"--model {model_path!r} holds no weights (*.safetensors); export the run again")
    check_weight_files(model_path, "--model", "export the run again (mtrain export RUN --out FOLDER) or copy the "
                       "file again")
    if not any(n in TOKENIZER_FILES for n in names):
        raise MtrainError(f"--model {model_path!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy "
                          "the model's tokenizer into it (tokenizer.save_pretrained)")


BACKENDS = ("hf", "vllm")


def resolve_backend(name: str) -> str:
    """`auto` is vllm where vLLM can run (imports here, or a worker venv is set up), else hf."""
    if name != "auto":
        return name
    from mtrain.eval.backends.vllm import vllm_available

    return "vllm" if vllm_available() else "hf"


def suite_backend_options(settings: dict, backend: str) -> dict:
    """The suite's `backend:` settings for `backend`: top-level keys belong to the backend the suite names
    (`name`, default hf), so hf's prefill_chunk never reaches vllm; a mapping under a backend's name
    (`vllm: {max_num_batched_tokens: 4096}`) applies to that backend whichever the suite names."""
    top = {k: v for k, v in settings.items() if k != "name" and k not in BACKENDS}
    return {**(top if settings.get("name", "hf") == backend else {}), **(settings.get(backend) or {})}


def make_backend(name: str, model_path: str, **options) -> Backend:
    """Load a backend by name: `hf` (transformers) or `vllm` (vLLM here or in a worker venv, see backends/vllm.py)."""
    if name == "hf":
        from mtrain.eval.backends.hf import HFBackend

        return HFBackend(model_path, **options)
    if name == "vllm":
        from mtrain.eval.backends.vllm import VLLMBackend

        return VLLMBackend(model_path, **options)
    raise MtrainError(f"unknown eval backend {name!r}; choose hf, vllm or auto")


def run_suite(suite: Suite, model_path: str, out_dir: str, *, backend: str = "hf",
              backend_options: dict | None = None, progress: bool = True) -> dict:
    """Evaluate `model_path` on every task of `suite` into `out_dir`, resuming what is there; returns results.

    Writes OUT/manifest.json, OUT/predictions/<task>.jsonl (one record per sample), then scores the files
    (results.json, results.csv, ruler_table.md, niah_heatmap.png, pg19_perplexity.png).
    """
    from mtrain.eval.scoring import score_run

    check_checkpoint_folder(model_path)
    for run in suite.tasks:  # missing data files fail here, before anything is hashed or loaded
        check = get_task(run.name).check_data
        if check:
            check(run.params)
    os.makedirs(os.path.join(out_dir, PREDICTIONS), exist_ok=True)
    manifest = Manifest(out_dir)
    started = time.time()
    # cheap checks first, so a mismatched resume is refused before a large model is loaded
    manifest.check_and_set({"checkpoint_sha256": checkpoint_hash(model_path), "rope": rope_config(model_path),
                            "seed": suite.seed})
    log.info("checkpoint hashed in %.1fs", time.time() - started)
    backend = resolve_backend(backend)
    options = {**suite_backend_options(suite.backend, backend), **(backend_options or {})}
    engine = make_backend(backend, model_path, **options)
    manifest.check_and_set({"backend": engine.describe()})
    for run in suite.tasks:
        manifest.check_and_set_task(run.name, task_settings(run))
        too_long = [n for n in run.lengths if n > engine.max_length]
        if too_long:
            raise PromptTooLongError(
                f"task {run.name} asks for lengths {too_long}, over the {engine.name} backend limit of "
                f"{engine.max_length} tokens; drop them with --lengths or raise the limit with --max-length "
                f"(only if the model's rope scaling supports it)")
    manifest.save()

    contexts = {run.name: BuildContext(tokenizer=engine.tokenizer, seed=suite.seed, task_name=run.name,
                                       params={**run.params, "max_new_tokens": run.max_new_tokens,
                                               "samples": run.samples})
                for run in suite.tasks}
    pending, total = [], 0
    for run in suite.tasks:
        path = predictions_path(out_dir, run.name)
        drop_torn_tail(path)
        done = {(r["length"], r["index"]) for r in read_records(path)}
        task = get_task(run.name)
        for length in run.lengths:
            count = task.num_samples(contexts[run.name], length, run.samples)
            total += count
            pending += [(run, length, i) for i in range(count) if (length, i) not in done]
    log.info("%d of %d samples to run (%d already written)", len(pending), total, total - len(pending))

    from tqdm import tqdm

    with tqdm(total=len(pending), desc="eval", unit="sample", disable=not progress) as bar:
        for batch in _batches(pending, engine.batch_size):
            run, length = batch[0][0], batch[0][1]
            records = evaluate_samples(engine, run, contexts[run.name], length, [index for _, _, index in batch])
            append_records(predictions_path(out_dir, run.name), records)
            bar.update(len(batch))
    return score_run(out_dir)


def _batches(pending: list, size: int):
    """Consecutive runs of at most `size` samples sharing one task and length."""
    batch: list = []
    for item in pending:
        if batch and (len(batch) == size or item[:2] != batch[0][:2]):
            yield batch
            batch = []
        batch.append(item)
    if batch:
        yield batch


def evaluate_samples(engine: Backend, run: TaskRun, ctx: BuildContext, length: int, indices: list[int]) -> list[dict]:
    """Build the samples, run them through the backend (one batch), return their prediction records."""
    task = get_task(run.name)
    try:
        samples = [task.build(ctx, length, index) for index in indices]
    except MtrainError as exc:  # name the task and length the builder could not satisfy
        raise type(exc)(f"{run.name} at length {length}: {exc}") from None
    budget = run.max_new_tokens if task.kind == "generate" else 0
    for sample in samples:
        if len(sample.prompt_ids) + budget > length:
            raise MtrainError(f"{run.name} built a prompt of {len(sample.prompt_ids)} tokens for length {length} "
                              f"with {budget} new tokens: prompt sizing is broken")
    started = time.time()
    if task.kind == "generate":
        outputs = [{"prediction": p} for p in
                   engine.generate_many([s.prompt_ids for s in samples], run.max_new_tokens, run.stop)]
    else:
        outputs = [dict(zip(("nll", "tokens"), engine.loglikelihood(s.prompt_ids))) for s in samples]
    seconds = round((time.time() - started) / len(samples), 4)
    return [{
        "task": run.name, "length": length, "index": s.index, "prompt_tokens": len(s.prompt_ids),
        "prompt_sha256": hashlib.sha256(json.dumps(s.prompt_ids).encode()).hexdigest()[:16],
        "references": s.references, "meta": s.meta, **out, "seconds": seconds,
    } for s, out in zip(samples, outputs)]
