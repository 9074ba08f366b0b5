"""What the real-model benchmarks share (`mtrain bench real`, its packed-documents form and the ring's model
rows): finding and loading a pretrained checkpoint with YaRN for the length, pointing the model's attention at a
function, capturing every layer's post-RoPE q/k/v, and the perplexity of a token sequence."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mtrain.errors import MtrainError

BENCH_NAME = "mtrain-bench"
"""The attention name the benchmarks' models are loaded with (`register_bench_attention` points it)."""


def resolve_model(model: str, cache_dir: str | None = None) -> Path:
    """An HF checkpoint folder for `model`: the folder itself, or a .gguf file converted once into
    `cache_dir` (default: beside the file, `<name>.hf/`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MtrainError(f"--model '{model}' has no config.json: not an HF checkpoint folder")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        from mtrain.models.convert import convert_gguf

        out = Path(cache_dir) if cache_dir else path.with_name(path.stem + ".hf")
        if not (out / "config.json").is_file():
            convert_gguf(path, out)
        return out
    raise MtrainError(f"--model '{model}' is neither an HF checkpoint folder nor a .gguf file")


def yarn_factor(seq_len: int, original: int, requested: str | float = "auto") -> float:
    """YaRN factor for `seq_len` tokens on a model trained to `original`: 'auto' = seq_len / original when
    that exceeds 1 (no scaling otherwise), 'none' = 1, or the given number."""
    if requested == "none":
        return 1.0
    if requested == "auto":
        return max(1.0, seq_len / original)
    factor = float(requested)
    if not factor >= 1.0:
        raise MtrainError(f"--yarn must be 'auto', 'none' or a factor >= 1; got {requested}")
    return factor


def load_model(path: Path, seq_len: int, yarn: str | float, device, dtype):
    """The checkpoint under the bench's attention name, with YaRN written into its config as training would."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    original = int(params.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = yarn_factor(seq_len, original, yarn)
    if factor > 1.0:
        config.rope_parameters = {"rope_type": "yarn", "factor": factor, "rope_theta": theta,
                                  "original_max_position_embeddings": original}
        config.max_position_embeddings = int(original * factor)
    from mtrain.attention_settings import PolicySettings
    from mtrain.models.runtime import AttentionRuntime, AttentionSettings, attach_runtime

    register_bench_attention(None)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype,
                                                 attn_implementation=BENCH_NAME)
    # the model's own attention runtime (dense settings; the bench's calls pass theirs): the bench's layer calls
    # (`as_trained`) share it, so the caps and escalations they settle on are those the perplexity passes run with
    attach_runtime(model, AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse())))
    model.config.use_cache = False
    return model.to(device).eval(), factor


def register_bench_attention(fn) -> None:
    """Point the bench's attention name at `fn(module, q, k, v, mask, scaling=..., **kw)` (None: dense).
    transformers looks the function up by name at every call, so one loaded model serves every phase."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from mtrain.models.attention import mtrain_attention
    from mtrain.models.context import no_mask

    if fn is None:
        import functools

        fn = functools.partial(mtrain_attention, settings=None)
    AttentionInterface.register(BENCH_NAME, fn)
    AttentionMaskInterface.register(BENCH_NAME, no_mask)


def capture_qkv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Post-RoPE (q, k, v) of every layer, [1, S, H, D] each, from one dense forward over `ids` [1, S] (with the
    documents of the model's runtime masked where there are some: `AttentionRuntime.set_documents`)."""
    from mtrain.models.runtime import runtime_of
    from mtrain.ops import dense_attention

    documents = runtime_of(model).inputs.documents

    captured = {}

    def grab(module, query, key, value, attention_mask, scaling=None, **kwargs):
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        captured[module.layer_idx] = (q, k, v)
        return dense_attention(q, k, v, causal=True, softmax_scale=scaling, documents=documents), None

    register_bench_attention(grab)
    try:
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
    finally:
        register_bench_attention(None)
    return [captured[i] for i in sorted(captured)]


def perplexity(model, ids: torch.Tensor, chunk: int = 4096) -> float:
    """exp(mean next-token NLL) over `ids` [1, S], the vocabulary projection taken in chunks of rows."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        head = model.get_output_embeddings()
        nll, count = 0.0, 0
        for start in range(0, ids.shape[1] - 1, chunk):
            stop = min(start + chunk, ids.shape[1] - 1)
            logits = head(hidden[start:stop]).float()
            nll += float(torch.nn.functional.cross_entropy(logits, ids[0, start + 1 : stop + 1], reduction="sum"))
            count += stop - start
    return math.exp(nll / count)


def fwd_bwd(fn, q, k, v, dout):
    """A call of fn(q, k, v) with fresh leaf copies of q, k, v and its backward from `dout` (what one training
    step's attention costs), for `mtrain.bench.timing.timed`."""
    def run():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        torch.autograd.backward(fn(qq, kk, vv), dout)
    return run


def as_trained(layer: int, scale: float, rt, **options):
    """fn(q, k, v) [B, S, H, D] -> out: mtrain's attention exactly as a model layer in training mode calls it (HF's
    [B, H, S, D] layout in, `layer_idx` = layer, the model's attention runtime `rt`: `mtrain.models.runtime`); options:
    `mtrain_attention`'s keywords (settings, policy, engine, max_error, ...)."""
    from mtrain.models.attention import mtrain_attention

    class _Layer:
        layer_idx = layer
        training = True
        mtrain_runtime = rt

    def call(qq, kk, vv):
        out, _ = mtrain_attention(_Layer, qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), None,
                                  scaling=scale, **options)
        return out

    return call
