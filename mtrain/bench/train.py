"""Training-step throughput on one GPU: MTraining (online vertical-slash sparse) vs dense attention.

Builds a Qwen2.5-shaped model with random weights (bf16, activation checkpointing per decoder layer,
chunked LM loss, AdamW), runs full training steps (forward, backward, optimizer) at each sequence length
for each attention kind in the same process, and prints tokens/s, model TFLOP/s, peak memory and the
ratio to dense. Before timing it checks on a short sequence that both kinds give the same loss with an
index that keeps every block (recall 1).

    mtrain bench train --shape qwen2.5-0.5b --seq-lens 65536 131072 --steps 3

With --find-max it instead finds the longest context one device trains with DeepSpeed (ZeRO-2 with CPU
optimizer offload), running the trainer's own Accelerator + DeepSpeedPlugin path:

    mtrain bench train --shape qwen2.5-3b --deepspeed configs/deepspeed/zero2-offload.json \
        --find-max 131072,262144,393216,524288 --steps 2 --max-lines 32
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import time

import torch

from mtrain.errors import out_of_memory

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


def bench_recipe(kind: str, recall: float, max_lines: int, extra: list[str] = ()):
    """A recipe carrying the benchmark's attention settings (model and data fields are placeholders)."""
    from mtrain.config import parse_recipe

    return parse_recipe(None, [f"attention.kind={kind}", f"attention.recall={recall}",
                              f"attention.max_vertical={max_lines}", f"attention.max_slash={max_lines}",
                              "model.config=mtrain/assets/tiny-qwen2/config.json",
                              "model.tokenizer=mtrain/assets/tiny-tokenizer", "data.path=.", *extra])


def build(shape: str, kind: str, seq_len: int, recall: float, max_lines: int, device: str = DEVICE):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mtrain.models.registry import recipe_runtime
    from mtrain.models.runtime import attach_runtime
    from mtrain.train.loss import ChunkedLossLM

    rt = recipe_runtime(bench_recipe(kind, recall, max_lines))  # one device, no documents
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=max(seq_len, 32768), rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(device):
        model = attach_runtime(AutoModelForCausalLM.from_config(cfg, attn_implementation=rt.name,
                                                                dtype=torch.bfloat16), rt)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return ChunkedLossLM(model, chunk=8192), cfg


def flops_per_token(cfg, n_params: int, seq_len: int) -> float:
    n = n_params - cfg.vocab_size * cfg.hidden_size
    return 6 * n + 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len


def run(shape: str, kind: str, seq_len: int, steps: int, recall: float, max_lines: int) -> dict:
    from mtrain.models.runtime import runtime_of

    model, cfg = build(shape, kind, seq_len, recall, max_lines)
    rt = runtime_of(model)
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
            rt.drain()
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
            "loss": losses[-1],
            "density": (sum(rt.records.densities) / len(rt.records.densities)) if rt.records.densities else 1.0,
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


def _one_process_env() -> None:
    """accelerate starts DeepSpeed only in a launched process (LOCAL_RANK set): give a plain `python` run
    the environment of a one-process launch, so the same Accelerator + DeepSpeedPlugin path as the trainer runs."""
    if "LOCAL_RANK" in os.environ:
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _host_gb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in GiB; the offloaded optimizer lives here."""
    import psutil

    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return psutil.Process().memory_info().rss / 2**30, peak_kb / 2**20


def predicted_fit(points: list[tuple[int, float]], candidates: list[int], limit_gb: float) -> int | None:
    """The longest of `candidates` whose peak memory, extrapolated linearly from the last two measured
    (length, peak GB) `points`, stays under `limit_gb`; None with fewer than two points or none fitting."""
    if len(points) < 2:
        return None
    (s1, p1), (s2, p2) = points[-2:]
    slope = (p2 - p1) / (s2 - s1)
    fitting = [c for c in candidates if p2 + slope * (c - s2) <= limit_gb]
    return max(fitting) if fitting else None


def find_max(args) -> None:
    """Train `args.steps` DeepSpeed steps at each length of `args.find_max` (ascending) until one runs out of
    GPU memory or the time budget would be overrun; print one line per length and the longest that trained.
    Once two lengths have trained, lengths shorter than the longest one predicted to fit (peak memory is
    linear in the length) are skipped, so the run spends its time near the limit. It stops at the first OOM:
    DeepSpeed's ZeRO-2 gradient bookkeeping is not reset by an exception in the middle of backward.

    The model, DeepSpeed engine and offloaded optimizer are built once and reused for every length (the
    weights do not depend on the sequence length), through the trainer's own Accelerator + DeepSpeedPlugin.
    """
    from mtrain.models.runtime import runtime_of
    from mtrain.train.trainer import Trainer

    t_start = time.perf_counter()
    _one_process_env()
    lengths = sorted(set(args.find_max))
    recipe = bench_recipe(args.kind, args.recall, args.max_lines,
                          [f"train.deepspeed={args.deepspeed}", "model.dtype=bfloat16", "optim.grad_clip=1.0",
                           "train.micro_batch_size=1", "train.grad_accum=1", "optim.lr=1e-5"])
    trainer = Trainer(recipe)
    accelerator = trainer._accelerator()
    device = accelerator.device
    model, cfg = build(args.shape, args.kind, lengths[-1], args.recall, args.max_lines, device=str(device))
    n_params = sum(p.numel() for p in model.parameters())
    rt = runtime_of(model)
    model, optimizer = accelerator.prepare(model, trainer._optimizer(model))
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    zero = accelerator.deepspeed_plugin.deepspeed_config["zero_optimization"]
    offload = zero.get("offload_optimizer", {}).get("device", "none")
    where = torch.cuda.get_device_name() if on_gpu else "CPU"
    inner = getattr(model, "basic_optimizer", None)  # the client optimizer inside DeepSpeed's ZeRO wrapper
    print(f"{args.shape}: {n_params / 1e6:.0f}M parameters, bf16, activation checkpointing, {args.kind} "
          f"(recall {args.recall}, max lines {args.max_lines}); DeepSpeed ZeRO-{zero['stage']}, optimizer offload "
          f"{offload}, {type(inner).__name__}; {where}, torch {torch.__version__}; "
          f"set-up {time.perf_counter() - t_start:.0f} s", flush=True)
    print(f"{'seq':>8} {'status':<22} {'step s':>8} {'tokens/s':>10} {'TFLOP/s*':>9} {'peak GB':>8} "
          f"{'host GB':>8} {'host pk':>8} {'density':>8} {'loss':>7}", flush=True)
    longest, last, fitted = None, None, []
    total_gb = torch.cuda.get_device_properties(device).total_memory / 2**30 if on_gpu else float("inf")
    for i, seq in enumerate(lengths):
        elapsed = time.perf_counter() - t_start
        jump = predicted_fit(fitted, lengths[i:], args.fill * total_gb)
        if jump is not None and jump > seq:
            # peak memory grows linearly with the length: skip lengths that a longer one predicted to fit covers
            print(f"{seq:>8} {'skipped':<22} {jump} is predicted to fit", flush=True)
            continue
        if last is not None:
            # cost grows a little faster than linearly (attention, index); 1.15 keeps a margin
            predicted = args.steps * last[1] * (seq / last[0]) ** 1.15
            if elapsed + predicted > args.time_budget:
                print(f"{seq:>8} {'skipped (time budget)':<22} predicted {predicted:.0f} s, "
                      f"{args.time_budget - elapsed:.0f} s left", flush=True)
                break
        if on_gpu:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        gen = torch.Generator().manual_seed(seq)
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=gen).to(device)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        pos = torch.arange(seq, device=device)[None]
        times, loss, status = [], float("nan"), "ok"
        rt.drain()
        try:
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                loss_sum, n = model(ids, pos, labels)
                accelerator.backward(loss_sum / n)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
                times.append(time.perf_counter() - t0)
                loss = float(loss_sum.detach() / n)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not out_of_memory(exc):
                raise
            status = f"OOM after {len(times)} steps"
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")
        host, host_peak = _host_gb()
        density = sum(rt.records.densities) / len(rt.records.densities) if rt.records.densities else 1.0
        if status != "ok":
            del ids, labels, pos
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
            print(f"{seq:>8} {status:<22} {'':>8} {'':>10} {'':>9} {peak:>8.1f} {host:>8.1f} {host_peak:>8.1f}",
                  flush=True)
            break  # lengths ascend: a longer one needs more memory still
        step_s = times[-1]  # the first step at a length also autotunes kernels
        tflops = flops_per_token(cfg, n_params, seq) * seq / step_s / 1e12
        print(f"{seq:>8} {status:<22} {step_s:>8.2f} {seq / step_s:>10.0f} {tflops:>9.1f} {peak:>8.1f} {host:>8.1f} "
              f"{host_peak:>8.1f} {density:>8.3f} {loss:>7.3f}", flush=True)
        longest, last = seq, (seq, step_s)
        if on_gpu:
            fitted.append((seq, peak))
    print("* dense-equivalent model FLOPs (6N + causal attention) per second, recomputation not counted")
    total = time.perf_counter() - t_start
    if longest is None:
        print(f"longest context that trained: none of {lengths} ({total:.0f} s)")
    else:
        print(f"longest context that trained: {longest} tokens ({args.shape}, {args.steps} DeepSpeed steps each; "
              f"{total:.0f} s in all)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--kinds", nargs="+", default=["dense", "mtraining"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--recall", type=float, default=0.95)
    p.add_argument("--max-lines", type=int, default=1024, help="max_vertical = max_slash budget")
    p.add_argument("--deepspeed", metavar="JSON", help="with --find-max: DeepSpeed config, run through the "
                   "trainer's accelerate path, e.g. configs/deepspeed/zero2-offload.json")
    p.add_argument("--find-max", type=lambda v: [int(x) for x in v.split(",")], metavar="L1,L2,...",
                   help="longest context that trains: DeepSpeed steps at these lengths (ascending) until OOM")
    p.add_argument("--kind", default="mtraining", help="attention kind of --find-max")
    p.add_argument("--fill", type=float, default=0.92,
                   help="--find-max: skip lengths below the longest predicted to peak under this share of GPU memory")
    p.add_argument("--time-budget", type=float, default=330.0,
                   help="--find-max: seconds; a length predicted to end later is not started")
    args = p.parse_args(argv)
    if args.find_max:
        if not args.deepspeed:
            p.error("--find-max needs --deepspeed CONFIG (the ZeRO-2 offload path is what it measures)")
        find_max(args)
        return 0
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
