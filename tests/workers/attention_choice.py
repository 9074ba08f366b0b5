"""torchrun worker: the per-layer sparse/dense choice (attention.sparse_policy=auto) under context parallelism.

Each rank runs mtrain_attention on its block-stripe shard of the same q/k/v for a local pattern (low density)
and a flat one (high density) under "auto", then under the path it chose forced ("always" / "never"). Rank 0
writes one JSON line per pattern: every rank's path, whether auto's output equals the forced path's bit for
bit, and the worst error of the gathered output against dense attention on one device.
"""

import dataclasses
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from cp_step import finish
from mtrain.models.attention import mtrain_attention
from mtrain.attention_settings import PolicySettings
from mtrain.models.runtime import AttentionRuntime, AttentionSettings
from mtrain.ops import cost
from mtrain.parallel import Layout, SparseSettings

SEQ, HQ, HKV, D, BS = 2048, 4, 2, 16, 64


def inputs(kind: str):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, SEQ, HQ, D, generator=g)
    k = torch.randn(1, SEQ, HKV, D, generator=g)
    v = torch.randn(1, SEQ, HKV, D, generator=g)
    if kind == "local":  # rotary-style features: q_t . k_s peaks at s = t and falls off with the distance
        freq = 0.5 ** torch.arange(D // 2)
        angle = torch.arange(SEQ)[:, None] * freq[None, :]
        feat = torch.cat([angle.cos(), angle.sin()], -1)[None, :, None, :]  # [1, S, 1, D]
        # plus noise, so no two lines tie for a place in the budget
        q, k = 2.0 * feat.expand(1, SEQ, HQ, D) + 0.3 * q, feat.expand(1, SEQ, HKV, D) + 0.3 * k
    else:  # flat attention: no line stands out, the recall target needs most of the pattern
        q, k = q * 0.01, k * 0.01
    return q, k, v


RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))
"""The attention runtime of the layer `run` calls (`mtrain.models.runtime`)."""


def run(q, k, v, settings, policy):
    module = SimpleNamespace(training=True, layer_idx=0, mtrain_runtime=RT)
    out, _ = mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                              settings=settings, policy=policy)
    return out


def main(out_path: str) -> None:
    # the choice between the kernels, without the online estimate's own cost (it changes with the estimator)
    cost.CPU = dataclasses.replace(cost.CPU, estimate=(0.0, 0.0))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout.create("block-stripe", world_size=world, granularity=BS)
    rows = []
    for kind, settings in (("local", SparseSettings(recall=0.4, block_size=BS, max_vertical=4, max_slash=4, min_vertical=0, min_slash=0)),
                           ("flat", SparseSettings(recall=1.0, block_size=BS))):
        q, k, v = inputs(kind)
        RT.topology.group, RT.topology.layout, RT.inputs.doc_ids, RT.records.layers = dist.group.WORLD, layout, None, []
        RT.topology.local_world_size, RT.topology.inner_group, RT.topology.outer_group = None, None, None
        shard = [layout.shard(t, rank, dim=1) for t in (q, k, v)]
        auto = run(*shard, settings, "auto")
        record = RT.records.layers[-1]
        paths = [None] * world
        dist.all_gather_object(paths, record.path)
        # the auto call took exactly the path it names: the same output as that path forced
        forced = run(*shard, settings, "always" if record.path == "sparse" else "never")
        shards = [torch.empty_like(auto) for _ in range(world)]
        dist.all_gather(shards, auto.contiguous())
        RT.topology.group, RT.topology.layout = None, None
        single_dense = run(q, k, v, None, "never")  # settings None: the dense kind on one device
        rows.append({"pattern": kind, "paths": paths, "density": float(record.density), "same_as_forced": torch.equal(auto, forced),
                     "err_vs_single_dense": float((layout.unshard(shards, dim=1) - single_dense).abs().max()),
                     "dense_ms": record.dense_ms, "sparse_ms": record.sparse_ms})
    finish(rank, out_path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
