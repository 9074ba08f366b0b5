"""transformers backend: greedy generation and log-likelihood with chunked prefill over a KV cache.

Works on a CPU with tiny models and on GPUs; `attn_implementation` selects a transformers kernel ("sdpa",
"eager", ...) or one of mtrain's ("mtrain-dense", "mtrain-mtraining", ...: `mtrain.models.registry.KINDS`).
With a sparse mtrain kind, a prompt prefilled in one chunk runs the online vertical-slash sparse attention
(settings from `sparse`); later chunks and decoding steps attend densely over the KV cache.
"""

from __future__ import annotations

import logging
from typing import Sequence

from mtrain.eval.backends.base import Backend, context_limit, rope_config

log = logging.getLogger(__name__)


class HFBackend(Backend):
    """A HF causal LM run one sequence at a time; prefill in chunks so activations stay O(chunk)."""

    name = "hf"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        device: str | None = None,
        attn_implementation: str = "sdpa",
        prefill_chunk: int = 8192,
        max_length: int | None = None,
        sparse: dict | None = None,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from mtrain.errors import MtrainError

        self.runtime = None  # an mtrain kind's: the model's settings, policy state and records (mtrain.models.runtime)
        if attn_implementation.startswith("mtrain-"):
            from mtrain.models.registry import attention_runtime

            self.runtime = attention_runtime(attn_implementation[len("mtrain-"):], **(sparse or {}))
            attn_implementation = self.runtime.name
        elif sparse:
            raise MtrainError(f"backend.sparse needs an mtrain sparse attention (attn_implementation: "
                              f"mtrain-mtraining), not {attn_implementation!r}")
        self.sparse = dict(sparse or {})

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":  # bf16 where the hardware has it, fp32 on CPU for exact small-model checks
            dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.dtype = dtype
        self.attn_implementation = attn_implementation
        self.prefill_chunk = int(prefill_chunk)
        self.model_path = model_path
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
        ).to(self.device)
        if self.runtime is not None:
            from mtrain.models.runtime import attach_runtime

            attach_runtime(self.model, self.runtime)
        self.model.eval()
        self.max_length = int(max_length) if max_length else context_limit(model_path)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))

    def describe(self) -> dict:
        import torch
        import transformers

        return {
            "backend": self.name,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "dtype": self.dtype,
            "attn_implementation": self.attn_implementation,
            "sparse": self.sparse,
            "prefill_chunk": self.prefill_chunk,
            "max_length": self.max_length,
            "rope": rope_config(self.model_path),
        }

    def _prefill(self, ids, cache):
        """Run `ids` [1, T] through the decoder chunk by chunk; returns hidden states of every chunk."""
        decoder = self.model.get_decoder()
        for start in range(0, ids.shape[1], self.prefill_chunk):
            out = decoder(input_ids=ids[:, start:start + self.prefill_chunk], past_key_values=cache, use_cache=True)
            yield start, out.last_hidden_state

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str]) -> str:
        try:
            return self._generate(prompt_ids, max_new_tokens, stop)
        finally:
            _forget_records(self.runtime)

    def _generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop: Sequence[str]) -> str:
        import torch
        from transformers import DynamicCache

        self.check_fits(len(prompt_ids), max_new_tokens)
        lm_head = self.model.get_output_embeddings()
        decoder = self.model.get_decoder()
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        generated: list[int] = []
        text = ""
        with torch.inference_mode():
            last_hidden = None
            for _, hidden in self._prefill(ids, cache):
                last_hidden = hidden[:, -1:]
            for _ in range(max_new_tokens):
                token = int(lm_head(last_hidden).float().argmax(dim=-1).item())
                if token in self.eos_ids:
                    break
                generated.append(token)
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                cut = _first_stop(text, stop)
                if cut is not None:
                    return text[:cut]
                step = torch.tensor([[token]], dtype=torch.long, device=self.device)
                last_hidden = decoder(input_ids=step, past_key_values=cache, use_cache=True).last_hidden_state
        return text

    def loglikelihood(self, ids: Sequence[int]) -> tuple[float, int]:
        try:
            return self._loglikelihood(ids)
        finally:
            _forget_records(self.runtime)

    def _loglikelihood(self, ids: Sequence[int]) -> tuple[float, int]:
        import torch
        from transformers import DynamicCache

        self.check_fits(len(ids), 0)
        lm_head = self.model.get_output_embeddings()
        cache = DynamicCache(config=self.model.config)
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        total = 0.0
        with torch.inference_mode():
            for start, hidden in self._prefill(tokens, cache):
                # position p predicts token p + 1; the chunk's last position predicts the next chunk's first token
                targets = tokens[0, start + 1:start + 1 + hidden.shape[1]]
                hidden = hidden[0, : targets.shape[0]]
                for s in range(0, targets.shape[0], 1024):  # bound the [block, vocab] fp32 logits
                    logits = lm_head(hidden[s:s + 1024]).float()
                    logp = torch.log_softmax(logits, dim=-1)
                    total -= float(logp.gather(1, targets[s:s + 1024, None]).sum())
        return total, len(ids) - 1


def _forget_records(runtime) -> None:
    """Drop the records mtrain's attention kinds leave per call in the model's runtime (`AttentionRuntime.drain`;
    None: not an mtrain kind, nothing to drop): the trainer drains them every step; here nothing reads them, and over
    an evaluation's samples they would pile up."""
    if runtime is not None:
        runtime.drain()


def _first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index of the earliest stop string in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else None
