"""GPU check of sparse attention within packed documents (`mtrain.models.attention._per_document`): on planted
inputs of a few packed documents, the per-document path at full recall against dense attention within the
documents (FA4 varlen where it runs), forward and backward, for each engine that runs at the block size; then the
time of the per-document path (policy always and auto) against the dense path on a local pattern.

    python -m tools.docs_sparse_check [--seq 32768] [--block-size 128]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch


def planted(lengths, hq, hkv, d, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    S = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths]).float()
    freq = 0.7 ** torch.arange(d // 2)
    feat = torch.cat([(pos[:, None] * freq).cos(), (pos[:, None] * freq).sin()], -1)[None, :, None, :]
    q = 3.0 * feat.expand(1, S, hq, d) + 0.5 * torch.randn(1, S, hq, d, generator=g)
    k = feat.expand(1, S, hkv, d) + 0.5 * torch.randn(1, S, hkv, d, generator=g)
    v = torch.randn(1, S, hkv, d, generator=g)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], ids


def call(rt, q, k, v, settings, policy, engine):
    from mtrain.models.attention import mtrain_attention

    module = SimpleNamespace(training=True, layer_idx=0, mtrain_runtime=rt)
    out, _ = mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              settings=settings, policy=policy, engine=engine, max_error=None)
    return out


def main(argv=None) -> int:
    from mtrain.bench.timing import timed
    from mtrain.attention_settings import PolicySettings
    from mtrain.models.runtime import AttentionRuntime, AttentionSettings
    from mtrain.ops import dense_attention
    from mtrain.parallel import SparseSettings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    S, bs = args.seq, args.block_size
    lengths = [int(S * 0.41), int(S * 0.31), 1000, int(S * 0.19)]
    lengths.append(S - sum(lengths))
    failures = 0
    full = SparseSettings(recall=1.0, block_size=bs, max_vertical=S, max_slash=S)
    (q, k, v), ids = planted(lengths, 9, 3, 64, dev, dt)
    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))  # the layer's attention runtime: the documents, its policy state and records
    RT.set_documents(ids, dev)
    dense = dense_attention(q, k, v, causal=True, documents=RT.inputs.documents)
    dout = torch.randn_like(dense)
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    torch.autograd.backward(dense_attention(*ref, causal=True, documents=RT.inputs.documents), dout)
    for engine in ("triton", "fa4") if bs == 128 else ("triton",):
        got = [t.detach().requires_grad_() for t in (q, k, v)]
        out = call(RT, *got, full, "always", engine)
        torch.autograd.backward(out, dout)
        errs = [float((out.float() - dense.float()).abs().max())] + [
            float((a.grad.float() - b.grad.float()).abs().max()) for a, b in zip(got, ref)]
        ok = errs[0] < 2e-2 and max(errs[1:]) < 5e-2
        failures += not ok
        print(f"full recall {engine}: max |out - dense| {errs[0]:.2e}, grads {[f'{e:.2e}' for e in errs[1:]]} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    local = SparseSettings(block_size=bs)
    for policy in ("always", "auto"):
        RT.records.layers.clear()

        def step():
            got = [t.detach().requires_grad_() for t in (q, k, v)]
            torch.autograd.backward(call(RT, *got, local, policy, "auto"), dout)

        def dense_step():
            got = [t.detach().requires_grad_() for t in (q, k, v)]
            torch.autograd.backward(dense_attention(*got, causal=True, documents=RT.inputs.documents), dout)

        ms, dense_ms = timed(step, 5, warmup=3, back_to_back=True), timed(dense_step, 5, warmup=3, back_to_back=True)
        paths = [(r.path, None if r.density is None else round(float(r.density), 3)) for r in RT.records.layers[-5:]]
        print(f"local pattern, policy {policy}: per-document {ms:.2f} ms, dense varlen {dense_ms:.2f} ms "
              f"({dense_ms / ms:.2f}x); last records {paths}", flush=True)
    RT.set_documents(None)
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
