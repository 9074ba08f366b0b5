"""Time per sample of the hf eval backend on a Qwen2.5-3B-shaped model (random weights) at long lengths.

`python -m tools.eval_backend --out DIR --lengths 32768,65536` builds the checkpoint, runs NIAH, RULER niah_single_2
and PG-19-style perplexity through `run_suite`, and prints seconds per sample by task, length and prefill chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# Qwen2.5-3B's shape (config of the public checkpoint), with YaRN x4 as its card recommends beyond 32K
QWEN25_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True,
                 rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})


def build_checkpoint(path: str, layers: int | None) -> None:
    """A random bf16 Qwen2.5-3B-shaped checkpoint with the embedded default's tokenizer (ids fit any vocab)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mtrain.tiny import load_tokenizer

    if os.path.exists(os.path.join(path, "config.json")):
        return
    config = Qwen2Config(**{**QWEN25_3B, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    load_tokenizer().save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.eval_backend", description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="32768,65536")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--chunks", default="8192,131072", help="prefill chunk sizes to compare")
    parser.add_argument("--layers", type=int, help="fewer layers than Qwen2.5-3B's 36 (quick checks)")
    args = parser.parse_args(argv)

    import torch
    import transformers

    from mtrain.eval.runner import run_suite
    from mtrain.eval.suite import parse_suite

    lengths = [int(x) for x in args.lengths.split(",")]
    model = os.path.join(args.out, "qwen25-3b-shaped")
    started = time.time()
    build_checkpoint(model, args.layers)
    print(f"checkpoint ready in {time.time() - started:.1f}s")
    suite = parse_suite({
        "seed": 0, "lengths": lengths, "samples": args.samples,
        "data": {"essay_path": "synthetic", "pg19_path": "synthetic"},
        "tasks": {"niah": {"depths": [50], "haystacks": args.samples, "max_new_tokens": 32},
                  "ruler/niah_single_2": {"max_new_tokens": 32}, "pg19": {}},
    })
    rows = []
    for chunk in (int(x) for x in args.chunks.split(",")):
        out = os.path.join(args.out, f"chunk{chunk}")
        torch.cuda.reset_peak_memory_stats()
        run_suite(suite, model, out, backend_options={"prefill_chunk": chunk}, progress=False)
        peak = torch.cuda.max_memory_allocated() / 2**30
        for name in ("niah", "ruler__niah_single_2", "pg19"):
            with open(os.path.join(out, "predictions", name + ".jsonl")) as f:
                records = [json.loads(line) for line in f]
            for length in lengths:
                secs = [r["seconds"] for r in records if r["length"] == length]
                # the first sample of a run also pays CUDA warm-up: report the best and the mean of the rest
                rows.append((name.replace("__", "/"), length, chunk, len(secs), min(secs),
                             sum(secs[1:]) / max(1, len(secs) - 1) if len(secs) > 1 else secs[0], peak))
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    print("| task | length | prefill chunk | samples | best s/sample | mean s/sample (after the first) | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for name, length, chunk, n, best, mean, peak in rows:
        print(f"| {name} | {length} | {chunk} | {n} | {best:.2f} | {mean:.2f} | {peak:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
