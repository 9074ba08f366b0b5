"""torchrun worker: one forward/backward of tiny Qwen2 and Llama models with each mtrain attention kind,
context-parallel over all ranks, compared with the same step on one rank (the whole sequence).

Writes one JSON line per (model, kind, with or without packed documents) with the worst relative error of the loss and of every gradient.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from mtrain.config import load_recipe
from mtrain.models.registry import layout_name, recipe_runtime
from mtrain.models.runtime import attach_runtime, runtime_of
from mtrain.parallel import Layout
from mtrain.tiny import tiny_config
from mtrain.train.loss import ChunkedLossLM

SEQ = 512


def configs():
    qwen = tiny_config()
    fields = {k: getattr(qwen, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim")}
    return {"qwen2": qwen, "llama": LlamaConfig(**fields, max_position_embeddings=4096, tie_word_embeddings=False)}


def step(model, ids, pos, labels, n_valid):
    model.zero_grad(set_to_none=True)
    loss_sum, _ = model(ids, pos, labels)
    (loss_sum / n_valid).backward()
    return loss_sum.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def batch():
    """(ids, pos, labels, n_valid, doc_ids) of the one sequence every case trains on; doc_ids for the masked
    variant: boundaries mid-block and mid-shard, and a one-token document."""
    torch.manual_seed(0)
    ids = torch.randint(0, 700, (1, SEQ))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    pos = torch.arange(SEQ)[None]
    n_valid = int((labels != -100).sum())
    starts = [0, 37, 38, 200, 301, 480]
    doc_ids = torch.zeros(1, SEQ, dtype=torch.long)
    for i, start in enumerate(starts):
        doc_ids[:, start:] = i
    return ids, pos, labels, n_valid, doc_ids


def packed_folder(prefix: str) -> str:
    """A folder that passes the recipe's data.path check (the recipe is loaded only for its attention settings)."""
    packed = tempfile.mkdtemp(prefix=prefix)
    Path(packed, "index.json").write_text("{}")
    return packed


def compare(model, layout, rank: int, data, docs) -> dict:
    """The step on one rank (whole sequence) and context-parallel over the world under `layout`: the reference
    loss, the relative errors of the loss and of the worst gradient, and the mean attention density."""
    ids, pos, labels, n_valid, _ = data
    rt = runtime_of(model)
    rt.topology.group, rt.inputs.doc_ids, rt.records.densities = None, docs, []
    ref_loss, ref_grads = step(model, ids, pos, labels, n_valid)
    density = float(sum(rt.records.densities)) / len(rt.records.densities) if rt.records.densities else 1.0
    rt.topology.group, rt.topology.layout = dist.group.WORLD, layout
    loss, grads = step(model, layout.shard(ids, rank), layout.shard(pos, rank), layout.shard(labels, rank), n_valid)
    dist.all_reduce(loss)
    worst = 0.0
    for key, g in grads.items():
        dist.all_reduce(g)
        scale = max(1e-6, float(ref_grads[key].abs().max()))
        worst = max(worst, float((g - ref_grads[key]).abs().max()) / scale)
    return {"loss": float(ref_loss), "loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            "grad_rel": worst, "density": density}


def finish(rank: int, out_path: str, rows: list) -> None:
    """Rank 0 writes the rows (one JSON line each); every rank leaves the group."""
    if rank == 0:
        with open(out_path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batch()
    doc_ids = data[-1]
    rows = []
    packed = packed_folder("cp_step_")
    for model_name, config in configs().items():
        for kind in ("dense", "mtraining", "zigzag-dense", "zigzag-sparse"):
            recipe = load_recipe(None, [f"attention.kind={kind}", "attention.block_size=32", "attention.last_q=32",
                                        "attention.recall=0.6", "attention.max_vertical=16", "attention.max_slash=16",
                                        "attention.sparse_policy=always",
                                        # one rank's reference: the whole sequence, documents masked, as CP runs it
                                        "attention.per_document=false",
                                        f"parallel.cp_size={world}", "parallel.granularity=32",
                                        "model.config=mtrain/assets/tiny-qwen2/config.json",
                                        "model.tokenizer=mtrain/assets/tiny-tokenizer", f"data.path={packed}"])
            rt = recipe_runtime(recipe)
            torch.manual_seed(1)
            hf = attach_runtime(AutoModelForCausalLM.from_config(config, attn_implementation=rt.name), rt)
            model = ChunkedLossLM(hf, chunk=200)
            layout = Layout.create(layout_name(recipe), world_size=world, granularity=32)
            for docs in (None, doc_ids):
                rows.append({"model": model_name, "kind": kind, "world": world, "documents": docs is not None,
                             **compare(model, layout, rank, data, docs)})
    finish(rank, out_path, rows)


if __name__ == "__main__":
    main(sys.argv[1])
