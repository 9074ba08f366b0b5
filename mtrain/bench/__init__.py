"""`mtrain bench`: every measurement of mtrain, one subcommand each (`mtrain bench --help` lists them).

    attention  sparse attention kernels against dense attention on planted inputs (GPU; CPU smoke)
    documents  dense attention over packed documents: FA4 varlen, cuDNN per document, ours; the dense ring's rank
    real       sparse attention on a pretrained model's captured q/k/v: recall, perplexity, time; with
               --documents, over packed real documents against FA4 varlen
    ring       ring attention on one host's GPUs (torchrun -m mtrain.bench.ring; --cpu: gloo smoke)
    train      training-step throughput, MTraining against dense; --find-max: the longest context
    cost       the measurements behind the attention cost model (mtrain.ops.cost), and their fit
    plan       the cost model of a training step on a cluster (mtrain.planner), --check against measured runs
    imbalance  how evenly a sparse index's work falls on workers and ring steps (CPU)
    check      the GPU correctness gate: every attention engine against a float64 reference

Each lives in `mtrain/bench/<name>.py` with a `main(argv)`; `python -m mtrain.bench.<name>` runs it too. Shared
helpers: `mtrain.bench.timing` (the one `timed()`), `mtrain.bench.synthetic` (the synthetic vertical-slash index and
planted inputs). Tuning sweeps, profilers and kernel-variant benchmarks that only developers run are in the
repository's `tools/` (`python -m tools.<name>` from a checkout; not installed with the package). `plan` and
`imbalance` parse their options here; the others hand everything after their name to their own parser, which loads
torch only when they run.
"""

from __future__ import annotations

import argparse
import importlib

# name -> one-line help; the order of `mtrain bench --help`
SUBCOMMANDS = {
    "attention": "sparse attention kernels against dense attention (cuDNN, flash, FA4, Flex) on planted inputs "
                 "(GPU; CPU smoke)",
    "documents": "dense attention over packed documents (FA4 varlen, cuDNN per document, ours) and the gathered "
                 "dense ring's rank against CP=1 (GPU)",
    "real": "sparse attention on a pretrained model's attention over real text: recall, perplexity, time",
    "ring": "ring attention on one host's GPUs (torchrun --nproc_per_node N -m mtrain.bench.ring; --cpu: gloo smoke)",
    "train": "training-step throughput, MTraining against dense (one GPU); --find-max: the longest context",
    "cost": "measurements behind the attention cost model (mtrain.ops.cost) and their least-squares fit",
    "plan": "cost model of a training step: per-rank FLOPs, memory, link bytes, step time; does it fit",
    "imbalance": "worker- and step-level imbalance per layout, CP size and length",
    "check": "GPU correctness gate: every attention engine against a float64 reference (CPU: --device cpu --quick)",
}
# parsed by `mtrain bench` itself (their options appear in `mtrain bench NAME --help` without importing torch)
PARSED_HERE = ("plan", "imbalance")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(SUBCOMMANDS),
        description="Benchmarks and the GPU correctness gate. `plan` and `imbalance` need only the CPU; the others "
        "time on a GPU and run a CPU smoke test where a GPU is missing. Developer tools (sweeps, profilers): "
        "python -m tools.NAME from a checkout.",
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    for name, text in SUBCOMMANDS.items():
        if name in PARSED_HERE:
            module = importlib.import_module(f"mtrain.bench.{name}")
            p = benches.add_parser(name, help=text, description=module.DESCRIPTION,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
            module.add_arguments(p)
            p.set_defaults(func=module.run)
        else:
            # everything after the name goes to the module's own parser, options and --help included (no prefix
            # characters here, so nothing after the name is read as an option of this parser)
            p = benches.add_parser(name, help=text, add_help=False, prefix_chars="\0")
            p.add_argument("argv", nargs=argparse.REMAINDER)
            p.set_defaults(func=_run_module, module=f"mtrain.bench.{name}")


def _run_module(args) -> int:
    return importlib.import_module(args.module).main(args.argv)
