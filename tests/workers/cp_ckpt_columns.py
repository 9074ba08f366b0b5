"""torchrun worker: one training step of the tiny Qwen2 model with MTraining attention under gradient checkpointing,
context-parallel over all ranks, with the rank indexes built without column lists (the ring reads its columns
list-free, as at the recipes' caps: the runtime's `Switches.static_width_bytes` (parallel.static_width_mib) set below
every index here), and compared with the same step on one rank. The recomputation for the backward rebuilds each
layer's rank index from the remembered lines (`mtrain.parallel.estimate.rank_index_of_lines`); the worker records how
many of those it built and how many held no column lists.

Writes one JSON line per case (with and without packed documents): relative errors of the loss and worst gradient,
and the index counts.
"""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import mtrain.parallel.estimate as estimate
from cp_step import batch, compare, configs, finish, packed_folder
from mtrain.config import load_recipe
from mtrain.models.registry import layout_name, recipe_runtime
from mtrain.models.runtime import attach_runtime
from mtrain.parallel import Layout
from mtrain.train.loss import ChunkedLossLM


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batch()
    built = {"calls": 0, "list_free": 0}
    real = estimate.rank_index_of_lines

    def counting(*args, **kwargs):
        index = real(*args, **kwargs)
        built["calls"] += 1
        built["list_free"] += index.col_ids is None
        return index

    estimate.rank_index_of_lines = counting
    recipe = load_recipe(None, ["attention.kind=mtraining", "attention.block_size=32", "attention.last_q=32",
                                "attention.recall=0.6", "attention.max_vertical=16", "attention.max_slash=16",
                                "attention.sparse_policy=always", f"parallel.cp_size={world}",
                                # one rank's reference estimates the whole sequence with the documents masked, as CP does
                                "attention.per_document=false",
                                # the quality check and escalation (the defaults): the check's figure kept on the index
                                # must not reach the backward, or the recomputation saves fewer tensors
                                "attention.max_output_error=0.025", "attention.escalate_recall=0.995",
                                "parallel.granularity=32", "model.config=mtrain/assets/tiny-qwen2/config.json",
                                "model.tokenizer=mtrain/assets/tiny-tokenizer",
                                f"data.path={packed_folder('cp_ckpt_')}"])
    rt = recipe_runtime(recipe)
    # every rank index takes its widths from the host read: no column lists (the recomputation passes the same)
    rt.settings.switches = dataclasses.replace(rt.switches, static_width_bytes=-1)
    torch.manual_seed(1)
    hf = attach_runtime(AutoModelForCausalLM.from_config(configs()["qwen2"], attn_implementation=rt.name), rt)
    hf.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": rt.checkpoint_contexts})
    model = ChunkedLossLM(hf, chunk=200)
    model.train()
    layout = Layout.create(layout_name(recipe), world_size=world, granularity=32)
    rows = []
    for docs in (None, data[-1]):
        built.update(calls=0, list_free=0)
        rows.append({"world": world, "documents": docs is not None, **compare(model, layout, rank, data, docs),
                     **built})
    finish(rank, out_path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
