"""torchrun worker: the sampled true recall measured across a CP group (`gathered_true_recall`, each rank holding
its block-stripe shard) equals `true_recall` of the whole sequence on one device, with and without documents.
Rank 0 writes one JSON line per case to argv[1]."""

import json
import sys

import torch
import torch.distributed as dist

from mtrain.ops.index import SparseIndex
from mtrain.ops.recall import gathered_true_recall, sampled_rows, true_recall
from mtrain.parallel import Layout

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
S, B, Hq, Hkv, D, BS = 1024, 1, 4, 2, 16, 64
gen = torch.Generator().manual_seed(0)
q = torch.randn(B, S, Hq, D, generator=gen, dtype=torch.float64)
k = torch.randn(B, S, Hkv, D, generator=gen, dtype=torch.float64)
q[:, :, :, 0] += 3.0  # a shared direction: some keys stand out (peaked rows)
k[:, 5, :, 0] += 6.0
vertical = torch.tensor([[[5, 300, 700, -1]] * Hq])
slash = torch.tensor([[[0, 1, 129, 400]] * Hq])
layout = Layout.create("block-stripe", world_size=world, granularity=BS)
positions = layout.indices(S, rank)
rows = []
for docs in (None, torch.cat([torch.zeros(1, 400), torch.ones(1, S - 400)], dim=1).long()):
    full = SparseIndex.from_lines(vertical, slash, S, BS, impl="torch")
    want = true_recall(q, k, full, doc_ids=docs, rows=sampled_rows(S, 32))
    got = gathered_true_recall(q[:, positions], k[:, positions], positions, (vertical, slash), S, BS, None,
                               doc_ids=docs, n_rows=32)
    rows.append({"documents": docs is not None, "want": want.tolist(), "got": got.tolist(),
                 "err": float((got.double() - want.double()).abs().max())})
if rank == 0:
    with open(sys.argv[1], "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
dist.destroy_process_group()
