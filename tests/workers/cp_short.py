"""torchrun worker: one forward/backward of the tiny Qwen2 model with a sparse kind on the shortest shards a recipe
allows (one 64-token block per rank, a rank holding only the sink block, shards of half a block), micro-batches of
two different sequences, with and without packed documents, context-parallel over all ranks and compared with the
same step on one rank. Layer 0 measures the CP imbalance on every call, as a logged training step does.

Writes one JSON line per case: the relative errors of the loss and of the worst gradient, and the measured
imbalance.
"""

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from cp_step import compare, configs, finish, packed_folder
from mtrain.config import load_recipe
from mtrain.models.registry import layout_name, recipe_runtime
from mtrain.models.runtime import attach_runtime
from mtrain.parallel import Layout
from mtrain.train.loss import ChunkedLossLM

BLOCK = 64


def cases(world: int):
    """(kind, seq_len, granularity, policy): per rank one block (rank 0 then holds only the sink block), half a
    block (every rank's rows list only block 0), and zigzag's shortest (2W chunks of half a block)."""
    return [("mtraining", BLOCK * world, BLOCK, "always"), ("mtraining", BLOCK * world, BLOCK, "auto"),
            ("mtraining", BLOCK, BLOCK // world, "always"), ("zigzag-sparse", BLOCK * world, BLOCK, "always")]


def batch(seq_len: int, micro_batch: int = 2):
    """(ids, pos, labels, n_valid, doc_ids) of `micro_batch` different sequences; doc_ids: a boundary inside
    the first block of each row and another mid-sequence."""
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, 700, (micro_batch, seq_len), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    pos = torch.arange(seq_len).expand(micro_batch, -1)
    doc_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    for row in range(micro_batch):
        doc_ids[row, 5 + row:] = 1
        doc_ids[row, seq_len // 2 + 3:] = 2
    return ids, pos, labels, int((labels != -100).sum()), doc_ids


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    packed = packed_folder("cp_short_")
    rows = []
    for kind, seq_len, granularity, policy in cases(world):
        recipe = load_recipe(None, [f"attention.kind={kind}", f"attention.block_size={BLOCK}", "attention.last_q=16",
                                    "attention.recall=0.6", "attention.max_vertical=4", "attention.max_slash=64",
                                    f"attention.sparse_policy={policy}", f"parallel.cp_size={world}",
                                    # one rank's reference: the whole sequence, documents masked, as CP runs it
                                    "attention.per_document=false",
                                    f"parallel.granularity={granularity}", f"data.seq_len={seq_len}",
                                    "model.config=mtrain/assets/tiny-qwen2/config.json",
                                    "model.tokenizer=mtrain/assets/tiny-tokenizer", f"data.path={packed}"])
        rt = recipe_runtime(recipe)
        torch.manual_seed(1)
        hf = attach_runtime(AutoModelForCausalLM.from_config(configs()["qwen2"], attn_implementation=rt.name), rt)
        model = ChunkedLossLM(hf, chunk=200)
        layout = Layout.create(layout_name(recipe), world_size=world, granularity=granularity)
        data = batch(seq_len)
        for docs in (None, data[-1]):
            rt.records.imbalances, rt.inputs.sample_imbalance = [], True
            row = compare(model, layout, rank, data, docs)
            row.update(kind=kind, seq_len=seq_len, granularity=granularity, policy=policy, world=world,
                       documents=docs is not None, imbalances=rt.records.imbalances)
            rows.append(row)
    finish(rank, out_path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
