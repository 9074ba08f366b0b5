"""One real-model layer's attention as training calls it (estimate, choice, kernels, backward), queued back to back:
GPU time per call, host time per call, the host synchronisations (with the line that caused each), and the host
and GPU ops that cost most. For a layer whose back-to-back time (`mtrain bench real`'s "mtrain" column)
exceeds its kernels.

    python -m tools.profile_layer --model DIR --seq-len 32768 --layer 0 [--engine fa4] [--sparse block_size=128]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings

import torch



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25, help="rows of the op tables")
    ap.add_argument("--sparse", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from mtrain.bench import real as bench_real
    from mtrain.data.prose import prose_tokens
    from mtrain.models.attention import mtrain_attention
    from mtrain.attention_settings import PolicySettings
    from mtrain.models.runtime import AttentionRuntime, AttentionSettings
    from mtrain.parallel import SparseSettings

    import yaml

    settings = SparseSettings(**{key: yaml.safe_load(value) for key, _, value in
                                 (item.partition("=") for item in args.sparse)})
    path = bench_real.resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = torch.tensor([prose_tokens(tok, args.seq_len)], device="cuda")
    net, _ = bench_real.load_model(path, args.seq_len, "auto", torch.device("cuda"), torch.bfloat16)
    q, k, v = bench_real.capture_qkv(net, ids)[args.layer]
    del net
    torch.cuda.empty_cache()
    scale = q.shape[-1] ** -0.5
    dout = torch.randn_like(q)

    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))  # the layer's attention runtime: its policy state and records

    class _Layer:
        layer_idx = args.layer
        training = True
        mtrain_runtime = RT

    def call():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out, _ = mtrain_attention(_Layer, qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), None,
                                  scaling=scale, settings=settings, policy=args.policy, engine=args.engine)
        torch.autograd.backward(out, dout)

    RT.settings.set_policy(dense_hold_steps=0)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    for mode in ("back to back", "one at a time"):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = 0.0
        a.record()
        for _ in range(args.calls):
            t0 = time.perf_counter()
            call()
            host += time.perf_counter() - t0
            if mode == "one at a time":
                torch.cuda.synchronize()
        b.record()
        torch.cuda.synchronize()
        print(f"{mode}: {a.elapsed_time(b) / args.calls:.2f} ms per call on the GPU clock, host {host * 1e3 / args.calls:.2f}"
              f" ms per call; path {RT.records.layers[-1].path if RT.records.layers else '?'}", flush=True)
    found = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            found[(f"{os.path.basename(w.filename)}:{w.lineno}", str(w.message)[:70])] += 1
    print(f"host synchronisations per call: {sum(found.values())}")
    for (where, msg), c in found.most_common():
        print(f"  {c:3d}x {where}  {msg}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    print(ka.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
