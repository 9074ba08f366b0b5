"""`mtrain train RECIPE [--set k=v ...]` and `mtrain export`: run a recipe, write a plain HF checkpoint."""

from __future__ import annotations

import argparse
import sys


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (see recipes/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe key, e.g. --set train.max_steps=10 (repeatable; VALUE is YAML)")


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train a recipe (resumes automatically from OUTPUT_DIR/checkpoints/latest)",
        description="Run a training recipe. The same code runs under `mtrain train`, `accelerate launch "
        "recipes/train.py` and `torchrun -m mtrain train`. Rerunning the same command resumes from the "
        "last checkpoint in train.output_dir.",
    )
    add_recipe_args(p)
    p.set_defaults(func=run_train)

    e = sub.add_parser(
        "export", help="write a plain HF checkpoint from a run's latest training checkpoint",
        description="Load the latest checkpoint of a run (its saved config.yaml) and write safetensors + "
        "config.json (with the recipe's RoPE/YaRN settings) + tokenizer to --out.",
    )
    e.add_argument("run_dir", help="a run folder (train.output_dir) holding checkpoints/latest")
    e.add_argument("--out", required=True, help="output folder for the HF checkpoint")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="model.KEY=VALUE",
                   help="replace a model setting of the run's saved config (repeatable), e.g. the model's files "
                        "where they are now after the run or its assets moved: --set model.config=PATH")
    e.set_defaults(func=run_export)


def run_train(args) -> int:
    from mtrain.config import load_recipe
    from mtrain.train.trainer import Trainer

    recipe = load_recipe(args.recipe, args.overrides)
    trainer = Trainer(recipe)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    if result:
        print(f"step {result['step']}: loss {result['loss']:.4f}, {result['tokens']} tokens")
    if trainer.stop_signal is not None:  # checkpointed, not finished: say so in the exit status
        print(f"mtrain train: stopped by signal {trainer.stop_signal} at step {trainer.state.step} after a "
              "checkpoint; rerun the same command to resume", file=sys.stderr)
        return 128 + trainer.stop_signal
    return 0


def run_export(args) -> int:
    from mtrain.train.export import export_run

    out = export_run(args.run_dir, args.out, args.overrides)
    print(f"wrote {out}")
    return 0
