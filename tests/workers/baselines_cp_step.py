"""torchrun worker: one forward/backward of the tiny Qwen2 model with each baseline attention kind (moba,
xattention, ulysses) under the recipe's layout, context-parallel over all ranks, compared with the same step on
one rank (the whole sequence), with and without packed documents. Writes one JSON line per case."""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from cp_step import SEQ, configs, step
from mtrain.config import load_recipe
from mtrain.models.attention import CONTEXT, layout_name, register_attention
from mtrain.parallel import Layout
from mtrain.train.loss import ChunkedLossLM

CASES = (("moba", "zigzag"), ("moba", "block-stripe"), ("xattention", "zigzag"), ("xattention", "block-stripe"),
         ("ulysses", "block-stripe"))


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ids = torch.randint(0, 700, (1, SEQ))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    pos = torch.arange(SEQ)[None]
    n_valid = int((labels != -100).sum())
    doc_ids = torch.zeros(1, SEQ, dtype=torch.long)
    for start in (37, 38, 200, 301, 480):
        doc_ids[:, start:] += 1
    packed = tempfile.mkdtemp(prefix="baselines_cp_step_")
    Path(packed, "index.json").write_text("{}")
    rows = []
    for kind, layout in CASES:
        recipe = load_recipe(None, [f"attention.kind={kind}", "attention.block_size=32", "attention.moba_chunk_size=64",
                                    "attention.moba_topk=2", "attention.xattn_stride=8",
                                    "attention.xattn_threshold=0.6", f"parallel.cp_size={world}",
                                    f"parallel.layout={layout}", "parallel.granularity=32",
                                    "model.config=mtrain/assets/tiny-qwen2/config.json",
                                    "model.tokenizer=mtrain/assets/tiny-tokenizer", f"data.path={packed}"])
        name = register_attention(recipe)
        torch.manual_seed(1)
        model = ChunkedLossLM(AutoModelForCausalLM.from_config(configs()["qwen2"], attn_implementation=name), chunk=200)
        lay = Layout.create(layout_name(recipe), world_size=world, granularity=32)
        for docs in (None, doc_ids):
            CONTEXT.group, CONTEXT.doc_ids, CONTEXT.densities = None, docs, []
            ref_loss, ref_grads = step(model, ids, pos, labels, n_valid)
            density = float(sum(CONTEXT.densities)) / len(CONTEXT.densities) if CONTEXT.densities else 1.0
            CONTEXT.group, CONTEXT.layout = dist.group.WORLD, lay
            loss, grads = step(model, lay.shard(ids, rank), lay.shard(pos, rank), lay.shard(labels, rank), n_valid)
            dist.all_reduce(loss)
            worst = 0.0
            for key, g in grads.items():
                dist.all_reduce(g)
                scale = max(1e-6, float(ref_grads[key].abs().max()))
                worst = max(worst, float((g - ref_grads[key]).abs().max()) / scale)
            rows.append({"kind": kind, "layout": layout, "world": world, "documents": docs is not None,
                         "loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)), "grad_rel": worst,
                         "density": density})
    if rank == 0:
        with open(out_path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
