"""vLLM backend: the documented offline API (`LLM` + `SamplingParams`) over token-id prompts, in this process or
in a worker process of a second venv.

Greedy generation is `SamplingParams(temperature=0, max_tokens, stop)`; perplexity sums `prompt_logprobs=0`
(vLLM computes them as it prefills, `max_num_batched_tokens` rows at a time). `max_model_len` and the rope
settings (YaRN) come from the checkpoint's config.json, or from `hf_overrides` (e.g. {"rope_parameters": {...}}).
Where vLLM runs: in this process when it imports here (GPU machines: `pip install -e ".[vllm]"`); otherwise
through `vllm_worker.py` under the python of `MTRAIN_VLLM_PYTHON` (or the `python` option), e.g. the
`.venv-vllm` that `make setup` builds on CPU machines beside the main venv, whose transformers vLLM refuses.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import tempfile
import weakref
from typing import Any, Sequence

from mtrain.errors import MtrainError
from mtrain.eval.backends.base import Backend, context_limit, rope_config

log = logging.getLogger(__name__)

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
PYTHON_ENV = "MTRAIN_VLLM_PYTHON"


def worker_python(python: str | None = None) -> str | None:
    """The python of a venv holding vLLM for the worker: the `python` option, else $MTRAIN_VLLM_PYTHON, else None."""
    return python or os.environ.get(PYTHON_ENV) or None


def vllm_available(python: str | None = None) -> bool:
    """Whether the vllm backend can run here: vLLM imports in this process, or a worker python is given."""
    return importlib.util.find_spec("vllm") is not None or worker_python(python) is not None


class VLLMBackend(Backend):
    """Batches of prompts through one `vllm.LLM`; each prompt is given as token ids, never re-tokenized."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        max_length: int | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool | None = None,
        hf_overrides: dict[str, Any] | None = None,
        batch_size: int = 16,
        python: str | None = None,
        cpu_kvcache_gib: int = 2,
    ):
        """`dtype` auto: bfloat16 with a GPU, float32 on a CPU (exact comparison with the hf backend).
        `enforce_eager` None: True on a CPU (no compilation), vLLM's default (CUDA graphs) with a GPU.
        `python`: the worker's interpreter (default $MTRAIN_VLLM_PYTHON; unused when vLLM imports here).
        `cpu_kvcache_gib`: KV cache of vLLM's CPU build (VLLM_CPU_KVCACHE_SPACE, unless that is set).
        """
        import torch
        from transformers import AutoTokenizer

        on_gpu = torch.cuda.is_available()
        self.model_path = model_path
        self.hf_overrides = dict(hf_overrides or {})
        self.max_length = int(max_length) if max_length else self._limit_with_overrides()
        self.batch_size = int(batch_size)
        if self.batch_size <= 0:
            raise MtrainError(f"backend.batch_size must be positive, got {batch_size}")
        engine = {
            "dtype": ("bfloat16" if on_gpu else "float32") if dtype == "auto" else dtype,
            "tensor_parallel_size": int(tensor_parallel_size),
            "gpu_memory_utilization": float(gpu_memory_utilization),
            "enforce_eager": (not on_gpu) if enforce_eager is None else bool(enforce_eager),
        }
        if max_num_batched_tokens is not None:
            engine["max_num_batched_tokens"] = int(max_num_batched_tokens)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if importlib.util.find_spec("vllm") is not None:
            from mtrain.eval.backends.vllm_worker import Engine

            self.where = "in process"
            self._engine: Any = Engine(model_path, self.max_length, engine, self.hf_overrides)
            info = self._engine.describe()
        else:
            python = worker_python(python)
            if python is None:
                raise MtrainError(
                    "the vllm backend needs vLLM: on a GPU machine pip install 'mtrain[vllm]'; on a CPU machine "
                    f"`make setup` builds .venv-vllm, then set {PYTHON_ENV}=.venv-vllm/bin/python (make eval does); "
                    "or run with --backend hf")
            self.where = f"worker {python}"
            self._engine = _Worker(python, cpu_kvcache_gib)
            info = self._engine.call("init", model=os.path.abspath(model_path), max_tokens=self.max_length,
                                     engine=engine, hf_overrides=self.hf_overrides)
        if info["max_model_len"] != self.max_length + 1:  # one slot for the token sampled after a scored prompt
            raise MtrainError(f"vLLM set max_model_len {info['max_model_len']}, not the {self.max_length + 1} asked "
                              "for; pass --max-length within what the checkpoint's config allows")
        self.versions = info["versions"]
        # what vLLM settled on (its defaults included): the chunk of prompt rows it scores at a time
        self.settings = {**engine, "dtype": info["dtype"], "max_num_batched_tokens": info["max_num_batched_tokens"]}
        log.info("vllm backend: vLLM %s %s", self.versions["vllm"], self.where)

    def _limit_with_overrides(self) -> int:
        """The checkpoint's context limit after `hf_overrides` (a YaRN override raises it)."""
        if not self.hf_overrides:
            return context_limit(self.model_path)
        with open(os.path.join(self.model_path, "config.json")) as f:
            config = {**json.load(f), **self.hf_overrides}
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f)
            return context_limit(tmp)

    def describe(self) -> dict:
        return {
            "backend": self.name,
            "versions": self.versions,
            "max_length": self.max_length,
            "rope": {**rope_config(self.model_path), **{k: v for k, v in self.hf_overrides.items() if "rope" in k}},
            "hf_overrides": self.hf_overrides,
            **self.settings,
        }

    def _call(self, op: str, **fields):
        if self._engine is None:
            raise MtrainError("the vllm backend was closed; make a new one")
        if isinstance(self._engine, _Worker):
            return self._engine.call(op, **fields)
        return getattr(self._engine, op)(**fields)

    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Sequence[str]) -> list[str]:
        for ids in prompts:
            self.check_fits(len(ids), max_new_tokens)
        outputs = self._call("generate", prompts=[list(map(int, ids)) for ids in prompts],
                             max_new_tokens=int(max_new_tokens), stop=list(stop))
        return [out["text"] for out in outputs]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str]) -> str:
        return self.generate_many([prompt_ids], max_new_tokens, stop)[0]

    def loglikelihood(self, ids: Sequence[int]) -> tuple[float, int]:
        self.check_fits(len(ids), 0)
        logprobs = self._call("prompt_logprobs", ids=list(map(int, ids)))
        return -sum(logprobs), len(ids) - 1

    def token_logprobs(self, ids: Sequence[int]) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1, one float per predicted token (what `loglikelihood` sums)."""
        self.check_fits(len(ids), 0)
        return self._call("prompt_logprobs", ids=list(map(int, ids)))

    def close(self) -> None:
        """Shut vLLM down (the worker process exits); the backend cannot be used after."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None


class _Worker:
    """`vllm_worker.py` in a subprocess of another venv's python, spoken to in JSON lines; its log goes to a file."""

    def __init__(self, python: str, cpu_kvcache_gib: int):
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise MtrainError(f"{PYTHON_ENV} / backend.python {python!r} is not an executable python; build the vLLM "
                              "venv with `make setup` (it writes .venv-vllm) or point it at a python that imports vllm")
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cpu_kvcache_gib)))  # the CPU build's KV cache, GiB
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker is already a process of its own
        env.pop("PYTHONPATH", None)  # the main venv's paths must not leak into the other venv
        self.python = python
        self.log = tempfile.NamedTemporaryFile(prefix="mtrain-vllm-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, WORKER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, encoding="utf-8", env=env)
        self._finalizer = weakref.finalize(self, _stop_worker, self.proc, self.log.name)
        log.info("vLLM worker pid %d (%s), log %s", self.proc.pid, python, self.log.name)

    def call(self, op: str, **fields):
        """Send one request and wait for its reply; a worker that died or failed is an MtrainError with its log."""
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self.proc.wait()
            raise MtrainError(f"the vLLM worker ({self.python}) exited with code {code} during {op!r}; the end of its "
                              f"log {self.log.name}:\n{_tail(self.log.name)}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise MtrainError(f"vLLM failed on {op!r}: {reply['error']} (worker log: {self.log.name})")
        return reply["result"]

    def close(self) -> None:
        self._finalizer()


def _stop_worker(proc: subprocess.Popen, log_path: str, timeout: float = 60.0) -> None:
    """Ask the worker to close vLLM and exit; kill it if it does not within `timeout`; drop its log if it was clean."""
    if proc.poll() is None:
        try:
            proc.stdin.write(json.dumps({"op": "close"}) + "\n")
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()
    if proc.returncode == 0:
        os.unlink(log_path)


def _tail(path: str, lines: int = 20) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:]).rstrip()
