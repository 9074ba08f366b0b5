"""The `mtrain` command line: one subcommand per stage (pack, train, export, convert, eval, compare, bench).

Each stage module exposes `register(subparsers)`; it adds its parser and sets `func`. Stage modules keep
heavy imports (torch, transformers) inside their run functions so `mtrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from mtrain.errors import MtrainError, os_error_line, out_of_memory
from mtrain.offline import OFFLINE_VARS, set_offline  # noqa: F401  (OFFLINE_VARS: re-exported, its old home)

# subcommand module -> registered in this order in `mtrain --help`
STAGE_MODULES = (
    "mtrain.data.cli",
    "mtrain.train.cli",
    "mtrain.models.convert",
    "mtrain.eval.cli",
    "mtrain.compare",
    "mtrain.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtrain",
        description="Context extension for HF Qwen2.5/Llama models with distributed dynamic sparse "
        "ring attention: pack data, train, evaluate, compare runs.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--online", action="store_true",
                        help="allow downloads from the HF hub (default: offline, local files and the hub cache only)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in STAGE_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # stage not part of this install
                continue
            raise
        module.register(sub)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


OOM_ADVICE = {
    "train": "Training resumes from its last checkpoint when rerun. To fit: more GPUs for the sequence "
             "(parallel.cp_size), model.gradient_checkpointing: true, model.mlp_chunk, train.offload_activations, "
             "DeepSpeed optimizer offload (configs/deepspeed/zero2-offload.json), or a shorter data.seq_len; "
             "`mtrain bench plan RECIPE` estimates the memory per GPU.",
    "eval": "The predictions written so far are kept: rerun the same command to resume. To fit: fewer evaluations "
            "side by side on one GPU, fewer --lengths, or a smaller prefill_chunk in the suite's backend.",
    None: "Nothing was lost that a rerun would not redo; run it on a GPU with more memory or with smaller sizes.",
}
"""What to tell a user whose command ran out of GPU memory, by command."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    set_offline(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("MTRAIN_DEBUG") == "1"
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        result = args.func(args)
    except MtrainError as exc:
        if debug:
            raise
        print(f"mtrain {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the system refused (no space, read-only, permission, a file where a folder goes)
        if debug:
            raise
        print(f"mtrain {args.command}: error: {_one_line(os_error_line(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mtrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line here, the traceback with --debug
        if debug:
            raise
        if out_of_memory(exc):  # not a bug: the work does not fit as set; say what was kept and what to change
            print(f"mtrain {args.command}: error: out of GPU memory ({_one_line(exc)[:300]}). "
                  f"{OOM_ADVICE.get(args.command, OOM_ADVICE[None])}", file=sys.stderr)
            return 1
        print(f"mtrain {args.command}: internal error: {type(exc).__name__}: {_one_line(exc)[:500]}; "
              "rerun with --debug for the traceback and report it", file=sys.stderr)
        return 1
    return int(result or 0)
