"""`mtrain bench plan`: the cost model of a training step on a cluster (`mtrain.planner`); `--check` sets it
against the runs measured in BENCHMARKS.md."""

from __future__ import annotations

import argparse
import json

from mtrain.bench.units import token_count
from mtrain.errors import MtrainError

HELP = "cost model of a training step: per-rank FLOPs, memory, link bytes, step time; does it fit"
DESCRIPTION = ("Cost model of one training step for a model shape, sequence length and CP size on a cluster "
               "(flat or hierarchical ring, node size, link bandwidths): per-rank FLOPs, memory per GPU (weights, ZeRO-2 "
               "optimizer, activations, ring KV buffers, index rows), bytes per link, the expected step time, what bounds "
               "it, and whether it fits. Attention times from mtrain.ops.cost (H200 kernel figures, scaled by the GPU's "
               "speed). Settings come from RECIPE when given; flags override them. --check prints the model against the "
               "runs measured in BENCHMARKS.md.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", default=None, help="a recipe YAML (model, seq_len, cp_size, attention, ...)")
    p.add_argument("--model", default=None, help="shape name (qwen2.5-3b, ...), a HF config.json or a model folder "
                   "(default: the recipe's model, else qwen2.5-3b)")
    p.add_argument("--seq-len", type=token_count, default=None, help="tokens per sequence (512K, 1M accepted)")
    p.add_argument("--cp", type=int, default=None, help="context-parallel size")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the cluster (default: the CP size)")
    p.add_argument("--node-size", type=int, default=8, help="GPUs per node")
    p.add_argument("--ring", choices=("flat", "hierarchical"), default="hierarchical")
    p.add_argument("--gpu", default="h200", help="GPU kind: h200, h100, a100-40gb, a100-80gb")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="override the GPU kind's memory")
    p.add_argument("--nvlink-gbs", type=float, default=None, help="intra-node GB/s per GPU, one direction")
    p.add_argument("--network-gbs", type=float, default=None, help="inter-node GB/s per GPU, one direction")
    p.add_argument("--host-memory-gb", type=float, default=1024.0, help="host memory per node")
    p.add_argument("--attention", choices=("dense", "sparse"), default=None,
                   help="default: sparse for the mtraining / zigzag-sparse kinds, else dense")
    p.add_argument("--density", type=float, default=0.05, help="fraction of causal pairs the sparse index keeps")
    p.add_argument("--verticals", type=int, default=1024, help="vertical columns per head")
    p.add_argument("--grad-accum", type=int, default=None)
    p.add_argument("--offload", choices=("yes", "no"), default=None,
                   help="ZeRO-2 optimizer offload to the host (default: the recipe's DeepSpeed config, else yes)")
    p.add_argument("--check", action="store_true", help="print the model against the measured runs and exit")
    p.add_argument("--json", default=None, help="also write the plan (or the check rows) as JSON to this file")




def _plan_spec(args):
    import dataclasses

    from mtrain import planner

    recipe = None
    if args.recipe:
        from mtrain.config import parse_recipe

        recipe = parse_recipe(args.recipe)
    model = args.model or (recipe and (recipe.model.config or recipe.model.path)) or "qwen2.5-3b"
    if args.gpu not in planner.GPUS:
        raise MtrainError(f"--gpu {args.gpu!r}: unknown; choose one of {', '.join(planner.GPUS)}")
    gpu = planner.GPUS[args.gpu]
    changes = {k: v for k, v in (("memory_gb", args.gpu_memory_gb), ("nvlink_gbs", args.nvlink_gbs),
                                 ("network_gbs", args.network_gbs)) if v is not None}
    for name, value in changes.items():
        if value <= 0:
            raise MtrainError(f"--{name.replace('_', '-')} must be > 0; got {value}")
    gpu = dataclasses.replace(gpu, **changes)
    kw = {}
    if recipe is not None:
        a = recipe.attention
        from mtrain.ops.estimate import sample_height
        kw = dict(seq_len=recipe.data.seq_len, cp=recipe.parallel.cp_size, block_size=a.block_size,
                  scored_rows=a.last_q + a.sample_blocks * sample_height(a.block_size, a.sample_rows),
                  max_vertical=a.max_vertical, max_slash=a.max_slash, mlp_chunk=recipe.model.mlp_chunk or 0,
                  offload_activations=recipe.train.offload_activations,
                  grad_accum=recipe.train.grad_accum * recipe.train.micro_batch_size,
                  checkpointing=recipe.model.gradient_checkpointing, loss_chunk=recipe.train.loss_chunk,
                  attention="sparse" if a.kind in ("mtraining", "zigzag-sparse") else "dense",
                  offload="offload" in str(recipe.train.deepspeed or ""))
    for key, value in (("seq_len", args.seq_len), ("cp", args.cp), ("grad_accum", args.grad_accum),
                       ("attention", args.attention)):
        if value is not None:
            kw[key] = value
    if args.offload is not None:
        kw["offload"] = args.offload == "yes"
    kw.setdefault("seq_len", 512 << 10)
    kw.setdefault("cp", 8)
    gpus = args.gpus if args.gpus is not None else kw["cp"]
    return planner.PlanSpec(shape=planner.load_shape(model), gpus=gpus, node_size=args.node_size, ring=args.ring,
                            gpu=gpu, density=args.density, verticals=args.verticals,
                            host_memory_gb=args.host_memory_gb, **kw)


def run(args) -> int:
    from mtrain import planner

    if args.check:
        rows = planner.check()
        print(f"{'measured run (BENCHMARKS.md)':<54} {'metric':<7} {'measured':>9} {'model':>9} {'error':>7} sample")
        for r in rows:
            unit = {"step": "s", "attn": "ms", "mem": "GB"}[r["metric"]]
            print(f"{r['run']:<54} {r['metric'] + ' ' + unit:<7} {r['measured']:9.2f} {r['predicted']:9.2f} "
                  f"{r['error']:+7.1%} {r['sample']}")
        for sample in ("in", "out"):
            for metric in ("step", "attn", "mem"):
                for device in ("GPU", "CPU"):
                    errs = [abs(r["error"]) for r in rows if r["metric"] == metric and r["sample"] == sample
                            and r["run"].startswith("CPU") == (device == "CPU")]
                    if errs:
                        where = "in sample" if sample == "in" else "out of sample"
                        print(f"{device} {metric}, {where}: mean |error| {sum(errs) / len(errs):.1%}, "
                              f"worst {max(errs):.1%} over {len(errs)} runs")
        payload = rows
    else:
        result = planner.plan(_plan_spec(args))
        print(planner.format_plan(result))
        payload = {"memory_gb": result.memory_gb, "link_bytes": result.link_bytes, "times_s": result.times_s,
                   "flops": result.flops, "micro_step_s": result.micro_s, "step_s": result.step_s,
                   "bound": result.bound, "fits": result.fits, "notes": result.notes}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mtrain bench plan", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
