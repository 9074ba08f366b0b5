"""Training-step throughput on one GPU: MTraining (online vertical-slash sparse) vs dense attention.

Builds a Qwen2.5-shaped model with random weights (bf16, activation checkpointing per decoder layer,
chunked LM loss, AdamW), runs full training steps (forward, backward, optimizer) at each sequence length
for each attention kind in the same process, and prints tokens/s, model TFLOP/s, peak memory and the
ratio to dense. Before timing it checks on a short sequence that both kinds give the same loss with an
index that keeps every block (recall 1).

    python scripts/bench_train.py --shape qwen2.5-0.5b --seq-lens 65536 131072 --steps 3
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script only

SHAPES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=384, vocab_size=1024, tie_word_embeddings=True),
    # hidden, layers, q heads, kv heads, head dim, intermediate, vocab
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         head_dim=64, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       head_dim=128, intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
}


def build(shape: str, kind: str, seq_len: int, recall: float, max_lines: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mtrain.config import load_recipe
    from mtrain.models.attention import CONTEXT, register_attention
    from mtrain.train.loss import ChunkedLossLM

    recipe = load_recipe(None, [f"attention.kind={kind}", f"attention.recall={recall}",
                                f"attention.max_vertical={max_lines}", f"attention.max_slash={max_lines}",
                                "model.config=mtrain/assets/tiny-qwen2/config.json",
                                "model.tokenizer=mtrain/assets/tiny-tokenizer", "data.path=."])
    name = register_attention(recipe)
    CONTEXT.group, CONTEXT.doc_ids = None, None
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=max(seq_len, 32768), rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return ChunkedLossLM(model, chunk=8192), cfg


def flops_per_token(cfg, n_params: int, seq_len: int) -> float:
    n = n_params - cfg.vocab_size * cfg.hidden_size
    return 6 * n + 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len


def run(shape: str, kind: str, seq_len: int, steps: int, recall: float, max_lines: int) -> dict:
    from mtrain.models.attention import CONTEXT

    model, cfg = build(shape, kind, seq_len, recall, max_lines)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=DEVICE == "cuda")
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), device=DEVICE)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    pos = torch.arange(seq_len, device=DEVICE)[None]
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    try:
        for i in range(steps + 1):  # step 0 compiles / autotunes
            CONTEXT.densities = []
            sync()
            t0 = time.perf_counter()
            loss_sum, n = model(ids, pos, labels)
            (loss_sum / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            if i:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss_sum / n))
    except torch.OutOfMemoryError:
        return {"kind": kind, "seq_len": seq_len, "oom": True}
    finally:
        peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")
        del model, opt
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    step_s = sorted(times)[len(times) // 2]
    return {"kind": kind, "seq_len": seq_len, "step_s": step_s, "tokens_per_s": seq_len / step_s, "peak_gb": peak,
            "loss": losses[-1], "density": (sum(CONTEXT.densities) / len(CONTEXT.densities)) if CONTEXT.densities else 1.0,
            "tflops": flops_per_token(cfg, n_params, seq_len) * seq_len / step_s / 1e12}


def check(shape: str) -> float:
    """Same loss for dense and an all-keeping sparse index (recall 1, unlimited lines) at 4K tokens."""
    out = []
    for kind in ("dense", "mtraining"):
        model, cfg = build(shape, kind, 4096, 1.0, 1 << 20)
        ids = torch.randint(0, cfg.vocab_size, (1, 4096), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
        with torch.no_grad():
            loss_sum, n = model(ids, torch.arange(4096, device=DEVICE)[None], torch.roll(ids, -1, 1))
        out.append(float(loss_sum / n))
        del model
    return abs(out[0] - out[1]) / abs(out[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--kinds", nargs="+", default=["dense", "mtraining"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--recall", type=float, default=0.95)
    p.add_argument("--max-lines", type=int, default=1024, help="max_vertical = max_slash budget")
    args = p.parse_args()
    rel = check(args.shape)
    print(f"check: |loss(dense) - loss(mtraining, recall 1)| / loss = {rel:.2e}")
    assert rel < 2e-2, "sparse path with a full index disagrees with dense"
    rows = [run(args.shape, k, s, args.steps, args.recall, args.max_lines) for s in args.seq_lens for k in args.kinds]
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"\n{args.shape}, bf16, activation checkpointing, AdamW; {where}, torch {torch.__version__}")
    print(f"{'seq':>8} {'kind':<10} {'step s':>8} {'tokens/s':>10} {'TFLOP/s*':>9} {'peak GB':>8} {'density':>8} {'x dense':>8}")
    for s in args.seq_lens:
        dense = next((r for r in rows if r["seq_len"] == s and r["kind"] == "dense" and not r.get("oom")), None)
        for r in (r for r in rows if r["seq_len"] == s):
            if r.get("oom"):
                print(f"{s:>8} {r['kind']:<10} {'OOM':>8}")
                continue
            ratio = r["tokens_per_s"] / dense["tokens_per_s"] if dense else float("nan")
            print(f"{s:>8} {r['kind']:<10} {r['step_s']:>8.2f} {r['tokens_per_s']:>10.0f} {r['tflops']:>9.1f} "
                  f"{r['peak_gb']:>8.1f} {r['density']:>8.3f} {ratio:>8.2f}")
    print("* dense-equivalent model FLOPs (6N + causal attention) per second, recomputation not counted")


if __name__ == "__main__":
    main()
