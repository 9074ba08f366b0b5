"""The one interface every eval backend implements: greedy generation from token ids, prompt log-likelihood.

A prompt that does not fit the backend's context limit is an error here, never silently cut.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Sequence

from mtrain.errors import MtrainError


class PromptTooLongError(MtrainError):
    """A prompt (plus the tokens to generate) exceeds the backend's context limit."""


class Backend(abc.ABC):
    """Greedy generation and prompt log-likelihood over token ids, for one loaded checkpoint."""

    name: str = ""
    max_length: int = 0  # tokens of prompt + generation the backend accepts
    batch_size: int = 1  # prompts the runner hands to `generate_many` at once

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Refuse a request whose prompt plus generation budget exceeds `max_length`."""
        if n_prompt + max_new_tokens > self.max_length:
            raise PromptTooLongError(
                f"prompt of {n_prompt} tokens + {max_new_tokens} new tokens exceeds the {self.name} backend "
                f"limit of {self.max_length} tokens; evaluate at shorter --lengths or raise the limit with "
                f"--max-length (only if the model's rope scaling supports it)"
            )

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str]) -> str:
        """Greedy continuation of `prompt_ids`, cut before the first stop string or end-of-sequence token."""

    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Sequence[str]) -> list[str]:
        """`generate` for several prompts; backends that batch (vLLM) override it."""
        return [self.generate(ids, max_new_tokens, stop) for ids in prompts]

    @abc.abstractmethod
    def loglikelihood(self, ids: Sequence[int]) -> tuple[float, int]:
        """(sum of -log p(ids[t] | ids[:t]) for t >= 1, number of predicted tokens = len(ids) - 1)."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """Backend name, library versions and settings that change results (goes into the run manifest)."""


def rope_config(model_path: str) -> dict:
    """The checkpoint's position-encoding settings from config.json (theta, scaling, max positions)."""
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except ValueError as exc:
        raise MtrainError(f"{path}: not valid JSON ({exc}); restore the checkpoint's config.json") from None
    if not isinstance(config, dict):
        raise MtrainError(f"{path}: not a HF config (a JSON object); restore the checkpoint's config.json")
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
    return {k: config[k] for k in keys if k in config}


def context_limit(model_path: str) -> int:
    """Longest sequence the checkpoint's config declares, scaled positions included.

    HF configs keep `max_position_embeddings` at the pre-extension value for some scaling types (e.g. Qwen2.5
    with YaRN factor 4 says 32768), so a scaling factor without its own original length multiplies it.
    """
    cfg = rope_config(model_path)
    limit = int(cfg.get("max_position_embeddings", 0))
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    kind = (scaling.get("rope_type") or scaling.get("type") or "default") if isinstance(scaling, dict) else "default"
    if factor and kind != "default":
        original = scaling.get("original_max_position_embeddings")
        scaled = int(original * factor) if original else int(limit * factor)
        limit = max(limit, scaled)
    if limit <= 0:
        raise MtrainError(f"{model_path}/config.json declares no max_position_embeddings; pass --max-length")
    return limit
