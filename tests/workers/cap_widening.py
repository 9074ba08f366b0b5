"""torchrun worker: cap widening (attention.widen_caps) under context parallelism.

Each rank runs four training calls of one layer on its block-stripe shard of the local pattern of
`attention_choice` with caps that bind (16 lines; recall 0.5) under "auto". Rank 0 writes one JSON line per call:
every rank's (path, cap scale the call ran with, whether it widened, mean estimated recall, the widest vertical
list of its lines)."""

import dataclasses
import sys
from types import SimpleNamespace

import torch.distributed as dist

from attention_choice import BS, inputs
from cp_step import finish
from mtrain.models.attention import mtrain_attention
from mtrain.attention_settings import PolicySettings
from mtrain.models.runtime import AttentionRuntime, AttentionSettings
from mtrain.ops import cost
from mtrain.parallel import Layout, SparseSettings


def main(out_path: str) -> None:
    cost.CPU = dataclasses.replace(cost.CPU, estimate=(0.0, 0.0))  # the kernels' costs only, as attention_choice
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout.create("block-stripe", world_size=world, granularity=BS)
    settings = SparseSettings(recall=0.5, block_size=BS, max_vertical=16, max_slash=16, min_vertical=0, min_slash=0)
    q, k, v = (layout.shard(t, rank, dim=1) for t in inputs("local"))
    RT = AttentionRuntime(AttentionSettings.of(policy=PolicySettings.every_layer_sparse()))  # the layer's attention runtime: its topology, holds, caps and records
    RT.topology.group, RT.topology.layout, RT.inputs.doc_ids, RT.records.layers = dist.group.WORLD, layout, None, []
    RT.topology.local_world_size, RT.topology.inner_group, RT.topology.outer_group = None, None, None
    RT.settings.set_policy(dense_hold_steps=4, widen_caps=True)
    rows = []
    for step in range(4):
        RT.inputs.step = step
        module = SimpleNamespace(training=True, layer_idx=5, mtrain_runtime=RT)
        mtrain_attention(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, settings=settings,
                         policy="auto")
        r = RT.records.layers[-1]
        mine = (r.path, r.cap_scale, r.widened, float(r.est_recall.float().mean()))
        every = [None] * world
        dist.all_gather_object(every, mine)
        rows.append({"step": step, "ranks": every, "scale_after": RT.policy.cap_scale.get(5, 1),
                     "held": 5 in RT.policy.dense_until})
    finish(rank, out_path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
