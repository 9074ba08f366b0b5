"""vLLM backend (optional GPU extra): the documented offline API, LLM + SamplingParams, over token-id prompts.

Greedy generation is SamplingParams(temperature=0, max_tokens, stop); perplexity uses prompt_logprobs. The rope
settings (YaRN) come from the checkpoint's config.json, or from `hf_overrides` (e.g. {"rope_parameters": {...}}).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from mtrain.errors import MtrainError
from mtrain.eval.backends.base import Backend, context_limit, rope_config


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
        hf_overrides: dict[str, Any] | None = None,
        batch_size: int = 16,
        enforce_eager: bool = False,
    ):
        try:
            import vllm
        except ImportError:
            raise MtrainError("the vllm backend needs vLLM on a GPU machine: pip install 'mtrain[vllm]' "
                              "(or run with --backend hf)") from None
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.hf_overrides = dict(hf_overrides or {})
        self.max_length = int(max_length) if max_length else self._limit_with_overrides()
        self.batch_size = int(batch_size)
        self.settings = {"dtype": dtype, "tensor_parallel_size": tensor_parallel_size,
                         "gpu_memory_utilization": gpu_memory_utilization, "enforce_eager": enforce_eager}
        self.version = vllm.__version__
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.llm = vllm.LLM(
            model=model_path, tokenizer=model_path, max_model_len=self.max_length, hf_overrides=self.hf_overrides,
            **self.settings,
        )

    def _limit_with_overrides(self) -> int:
        """The checkpoint's context limit after `hf_overrides` (a YaRN override raises it)."""
        if not self.hf_overrides:
            return context_limit(self.model_path)
        import tempfile

        with open(os.path.join(self.model_path, "config.json")) as f:
            config = {**json.load(f), **self.hf_overrides}
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f)
            return context_limit(tmp)

    def describe(self) -> dict:
        import torch
        import transformers

        return {
            "backend": self.name,
            "versions": {"vllm": self.version, "torch": torch.__version__, "transformers": transformers.__version__},
            "max_length": self.max_length,
            "rope": {**rope_config(self.model_path), **{k: v for k, v in self.hf_overrides.items() if "rope" in k}},
            "hf_overrides": self.hf_overrides,
            **self.settings,
        }

    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Sequence[str]) -> list[str]:
        from vllm import SamplingParams

        for ids in prompts:
            self.check_fits(len(ids), max_new_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop=list(stop) or None)
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params, use_tqdm=False)
        return [out.outputs[0].text for out in outputs]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str]) -> str:
        return self.generate_many([prompt_ids], max_new_tokens, stop)[0]

    def loglikelihood(self, ids: Sequence[int]) -> tuple[float, int]:
        from vllm import SamplingParams

        self.check_fits(len(ids), 1)
        # prompt_logprobs=0: only the logprob of each actual prompt token; position 0 has none
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        out = self.llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
        total = 0.0
        for token, logprobs in zip(ids[1:], out.prompt_logprobs[1:]):
            total -= logprobs[token].logprob
        return total, len(ids) - 1
