"""Estimated vs true recall of the online vertical-slash estimate on a real model, per layer, and whole-model
perplexity dense vs sparse, on real prose (CPython's pydoc_data topics) at fp32 on the CPU.

  .venv/bin/python -m tools.real_recall --model models/smollm2-135m --seq-len 4096 [--ppl] [--set key=value ...]

--set passes SparseSettings fields to the estimator (e.g. --set last_q=256 --set sample_blocks=0).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch


from mtrain.attention_settings import PolicySettings
from mtrain.ops import estimate_vertical_slash, true_recall
from mtrain.parallel import SparseSettings


def prose_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """The first n_tokens tokens of CPython's reference documentation topics (real English prose)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise SystemExit(f"only {ids.shape[1]} tokens of prose; ask for --seq-len <= {ids.shape[1]}")
    return ids


def capture_qk(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Post-RoPE (q [B, S, Hq, D], k [B, S, Hkv, D], scaling) of every layer, from one dense forward."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured = []

    def record(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured.append((query.transpose(1, 2).detach().clone(), key.transpose(1, 2).detach().clone(), scaling))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("capture-qk", record)
    model.set_attn_implementation("capture-qk")
    with torch.no_grad():
        model(ids, use_cache=False)
    return captured


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return math.exp(float(model(ids, labels=ids, use_cache=False).loss))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--set", action="append", default=[], help="SparseSettings field=value")
    ap.add_argument("--ppl", action="store_true", help="also whole-model perplexity dense vs sparse")
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer table")
    ap.add_argument("--rows", type=int, default=0, help="true recall on this many sampled rows (0 = all)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fields = {f.name: f for f in dataclasses.fields(SparseSettings)}
    settings = {}
    for item in args.set:
        key, value = item.split("=", 1)
        if key not in fields:
            raise SystemExit(f"--set {key}: not a SparseSettings field ({', '.join(fields)})")
        settings[key] = None if value == "None" else type(getattr(SparseSettings(), key) or 0.0)(
            value if not isinstance(getattr(SparseSettings(), key), bool) else value.lower() in ("1", "true"))
    s = SparseSettings(**settings)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = prose_ids(tok, args.seq_len)
    print(f"# {args.model} S={args.seq_len} settings={s}", flush=True)
    if not args.no_layers:
        t0 = time.time()
        layers = capture_qk(model, ids)
        print(f"layer density est_recall true_recall  (captured in {time.time() - t0:.0f} s)")
        dens, est, tru = [], [], []
        gen = torch.Generator().manual_seed(0)
        for i, (q, k, scale) in enumerate(layers):
            kwargs = {f: getattr(s, f) for f in fields}
            kwargs["last_q"] = min(s.last_q, q.shape[1])
            index = estimate_vertical_slash(q, k, softmax_scale=scale, **kwargs)
            rows = None if args.rows == 0 else torch.randperm(q.shape[1], generator=gen)[: args.rows]
            tr = true_recall(q, k, index, softmax_scale=scale, rows=rows)
            d, e, t = index.density(), float(index._cache["est_recall"].mean()), float(tr.mean())
            dens.append(d), est.append(e), tru.append(t)
            print(f"{i:5d} {d:7.3f} {e:10.4f} {t:11.4f}  min-head true {float(tr.min()):.4f}", flush=True)
        print(f"mean  {sum(dens) / len(dens):7.3f} {sum(est) / len(est):10.4f} {sum(tru) / len(tru):11.4f}"
              f"  worst layer true {min(tru):.4f}")
        del layers
    if args.ppl:
        from mtrain.models.registry import attention_runtime
        from mtrain.models.runtime import attach_runtime

        dense_rt = attention_runtime("dense")
        model.set_attn_implementation(dense_rt.name)
        dense = perplexity(attach_runtime(model, dense_rt), ids)
        rt = attention_runtime("mtraining", policy=PolicySettings.every_layer_sparse(), **settings)  # the model's attention runtime from here on
        model.set_attn_implementation(rt.name)
        attach_runtime(model, rt)
        import mtrain.ops

        # mtrain.models.attention passes a fixed subset of the settings to the estimator: hand it all of them.
        plain = mtrain.ops.estimate_vertical_slash

        def every_setting(q, k, **kw):
            return plain(q, k, **{**kw, **{f: getattr(s, f) for f in fields if f != "last_q"}})

        mtrain.ops.estimate_vertical_slash = every_setting

        rt.drain()
        t0 = time.time()
        sparse = perplexity(model, ids)
        mean_density = sum(rt.records.densities) / max(1, len(rt.records.densities))
        print(f"ppl dense {dense:.4f} sparse {sparse:.4f} delta {100 * (sparse / dense - 1):+.2f}% "
              f"mean density {mean_density:.3f} ({time.time() - t0:.0f} s sparse forward)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
