"""vLLM's offline API behind three calls (greedy generation, prompt log-probs, describe), here or in a worker.

`Engine` wraps one `vllm.LLM`. Run as a script by another venv's python (`.venv-vllm/bin/python
vllm_worker.py`), it serves the same calls as JSON lines on stdin/stdout, so the main venv (whose
transformers vLLM does not accept) can drive a vLLM installed beside it. Imports only the standard library
and vLLM, so the worker venv needs no mtrain.

Protocol: one JSON object a line each way. Requests `{"op": "init", "model": DIR, "max_tokens": N,
"engine": {...}, "hf_overrides": {...}}`, then `{"op": "generate", ...}`, `{"op": "prompt_logprobs", ...}`
or `{"op": "close"}`; replies `{"ok": true, "result": ...}` or `{"ok": false, "error": "..."}`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Sequence


class Engine:
    """One `vllm.LLM` over a HF checkpoint folder; prompts go in as token ids, never re-tokenized."""

    def __init__(self, model: str, max_tokens: int, engine: dict[str, Any], hf_overrides: dict[str, Any]):
        """`max_tokens`: the longest prompt + generation the caller sends (it refuses longer ones itself).

        vLLM wants room for one output token even when only prompt log-probs are asked for, so a prompt of
        exactly `max_tokens` needs `max_model_len = max_tokens + 1`, one over the limit a config such as YaRN's
        declares. That slot only ever holds the discarded token sampled after the last prompt position: no
        position past `max_tokens` runs through the model, so vLLM's override for that check is safe here.
        """
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
        import vllm

        self.version = vllm.__version__
        self.llm = vllm.LLM(model=model, tokenizer=model, max_model_len=max_tokens + 1,
                            hf_overrides=hf_overrides or None, **engine)

    def describe(self) -> dict:
        """Versions and the context limit vLLM settled on (it may refuse one the config does not allow)."""
        import torch
        import transformers

        config = self.llm.llm_engine.model_config
        return {"versions": {"vllm": self.version, "torch": torch.__version__,
                             "transformers": transformers.__version__},
                "max_model_len": int(config.max_model_len), "dtype": str(config.dtype).replace("torch.", ""),
                "max_num_batched_tokens": int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: Sequence[str]) -> list[dict]:
        """Greedy continuations: vLLM's text (cut before the first stop string), token ids, finish reason."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), stop=list(stop) or None)
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], params, use_tqdm=False)
        return [{"text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids),
                 "finish_reason": out.outputs[0].finish_reason} for out in outputs]

    def prompt_logprobs(self, ids: Sequence[int]) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1, from `prompt_logprobs=0` (the actual token's log-prob only).

        vLLM computes them chunk by chunk as it prefills (at most `max_num_batched_tokens` rows of logits at
        a time), so a long prompt never holds [T, vocab] logits at once.
        """
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
        rows = out.prompt_logprobs
        if rows is None or len(rows) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if rows is None else len(rows)} prompt log-prob rows for a "
                               f"{len(ids)}-token prompt")
        return [float(row[token].logprob) for token, row in zip(ids[1:], rows[1:])]

    def close(self) -> None:
        """Stop vLLM's engine (its engine-core process, if it started one) and drop the model."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del self.llm


def serve(requests, replies) -> None:
    """Answer JSON-line requests until `close` or end of input; an error answers the request, not the loop."""
    engine: Engine | None = None
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "init":
                engine = Engine(request["model"], int(request["max_tokens"]), request.get("engine") or {},
                                request.get("hf_overrides") or {})
                result: Any = engine.describe()
            elif op == "close":
                if engine is not None:
                    engine.close()
                replies.write(json.dumps({"ok": True, "result": None}) + "\n")
                replies.flush()
                return
            elif engine is None:
                raise RuntimeError(f"request {op!r} before init")
            elif op == "generate":
                result = engine.generate(request["prompts"], request["max_new_tokens"], request.get("stop") or [])
            elif op == "prompt_logprobs":
                result = engine.prompt_logprobs(request["ids"])
            else:
                raise RuntimeError(f"unknown request {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as exc:  # the client turns this into an MtrainError naming the request
            reply = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    if engine is not None:
        engine.close()


def main() -> int:
    # Run as a script, this file's folder leads sys.path, and mtrain's own vllm.py beside it would shadow vLLM.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    # Replies go to the original stdout; everything printed or logged from here on (vLLM's logs) to stderr.
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin, replies)
    return 0


if __name__ == "__main__":  # vLLM may spawn processes that re-import this module: serve only in the first
    sys.exit(main())
