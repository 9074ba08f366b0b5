"""torchrun worker: one forward/backward of the tiny Qwen2 model with each baseline attention kind (moba,
xattention, ulysses) under the recipe's layout, context-parallel over all ranks, compared with the same step on
one rank (the whole sequence), with and without packed documents. Writes one JSON line per case."""

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from cp_step import batch, compare, configs, finish, packed_folder
from mtrain.config import load_recipe
from mtrain.models.registry import layout_name, recipe_runtime
from mtrain.models.runtime import attach_runtime
from mtrain.parallel import Layout
from mtrain.train.loss import ChunkedLossLM

CASES = (("moba", "zigzag"), ("moba", "block-stripe"), ("xattention", "zigzag"), ("xattention", "block-stripe"),
         ("ulysses", "block-stripe"))


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batch()
    packed = packed_folder("baselines_cp_step_")
    rows = []
    for kind, layout in CASES:
        recipe = load_recipe(None, [f"attention.kind={kind}", "attention.block_size=32", "attention.moba_chunk_size=64",
                                    "attention.moba_topk=2", "attention.xattn_stride=8",
                                    "attention.xattn_threshold=0.6", f"parallel.cp_size={world}",
                                    f"parallel.layout={layout}", "parallel.granularity=32",
                                    "model.config=mtrain/assets/tiny-qwen2/config.json",
                                    "model.tokenizer=mtrain/assets/tiny-tokenizer", f"data.path={packed}"])
        rt = recipe_runtime(recipe)
        torch.manual_seed(1)
        hf = attach_runtime(AutoModelForCausalLM.from_config(configs()["qwen2"], attn_implementation=rt.name), rt)
        model = ChunkedLossLM(hf, chunk=200)
        lay = Layout.create(layout_name(recipe), world_size=world, granularity=32)
        for docs in (None, data[-1]):
            rows.append({"kind": kind, "layout": layout, "world": world, "documents": docs is not None,
                         **compare(model, lay, rank, data, docs)})
    finish(rank, out_path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
