"""`mtrain eval`: run an eval suite on a HF checkpoint folder with the hf or vllm backend, resumable.

`register(subparsers)` adds the subcommand; heavy imports happen inside `run` so `mtrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os

from mtrain.attention_settings import PolicySettings, inference_keys
from mtrain.errors import MtrainError

DEFAULT_SUITE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "eval", "tiny.yaml")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint: RULER, needle-in-a-haystack, PG-19 perplexity, InfiniteBench",
        description="Evaluate a HF checkpoint folder on a suite (eval/*.yaml). Predictions are appended per "
        "sample to OUT/predictions/*.jsonl, so a rerun with the same --out resumes; a run of another "
        "checkpoint or setting in OUT is refused. Writes OUT/results.json, results.csv, ruler_table.md, "
        "niah_heatmap.png, pg19_perplexity.png.",
    )
    parser.add_argument("suite", nargs="?", default=DEFAULT_SUITE,
                        help="suite YAML (default: eval/tiny.yaml, the embedded default)")
    parser.add_argument("--model", help="HF checkpoint folder (config.json, weights, tokenizer)")
    parser.add_argument("--backend", choices=("hf", "vllm", "auto"), default=None,
                        help="hf (transformers), vllm (vLLM here, or its worker venv: $MTRAIN_VLLM_PYTHON) or auto "
                        "(vllm where it can run, else hf); default: the suite's backend.name")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="backend.KEY=VALUE",
                        help="backend option, e.g. --set backend.max_num_batched_tokens=4096 (repeatable; VALUE is YAML)")
    parser.add_argument("--attention", metavar="KIND",
                        help="attention the hf backend runs: mtrain's dense, mtraining, zigzag-dense, zigzag-sparse, or "
                        "transformers' sdpa, eager (default: the suite's backend.attn_implementation, else sdpa)")
    parser.add_argument("--attention-from", metavar="RECIPE_OR_RUN",
                        help="the attention a recipe YAML or a training run's folder (its config.yaml) names: the kind "
                        "and every sparse setting, the quality check and recall escalation included, so a trained "
                        "model is evaluated with the attention it trained with; --sparse items refine it")
    parser.add_argument("--sparse", dest="sparse", action="append", default=[], metavar="KEY=VALUE",
                        help="setting of a sparse --attention (mtrain.attention_settings.SparseSettings fields, "
                        "sparse_policy, engine: auto, triton, flex, fa4, max_output_error, escalate_recall, "
                        "per_document, min_sparse_document: PolicySettings less the training-only keys; the "
                        "defaults are the recipe's: sparse_policy auto with the quality check), "
                        "e.g. --sparse recall=0.95 --sparse sparse_policy=always (repeatable; VALUE is YAML)")
    parser.add_argument("--tasks", help="comma-separated task names or patterns, e.g. niah,ruler/*,pg19")
    parser.add_argument("--lengths", type=_int_list,
                        help="comma-separated lengths replacing the suite's, e.g. 4096,8192")
    parser.add_argument("--samples", type=int, help="samples per length for every task (niah: haystacks per cell)")
    parser.add_argument("--max-length", type=int,
                        help="backend context limit (default: from the checkpoint config and its rope scaling)")
    parser.add_argument("--out", required=True, help="output folder; reuse it to resume")
    parser.add_argument("--score-only", action="store_true", help="only re-score OUT/predictions; loads no model")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mtrain.eval.runner import run_suite
    from mtrain.eval.scoring import score_run
    from mtrain.eval.suite import load_suite

    for flag, value in (("--samples", args.samples), ("--max-length", args.max_length)):
        if value is not None and value <= 0:
            raise MtrainError(f"{flag} must be positive, got {value}")
    if args.lengths is not None and (not args.lengths or min(args.lengths) <= 0):
        raise MtrainError(f"--lengths must list positive token counts, got {args.lengths}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise MtrainError(f"--out {args.out}: is a file, not a folder; choose another --out")
    if args.score_only:
        if not os.path.isdir(os.path.join(args.out, "predictions")):
            raise MtrainError(f"--out {args.out}: holds no predictions/ to score; run the eval first")
        results = score_run(args.out)
    else:
        if not args.model:
            raise MtrainError("--model is required (a HF checkpoint folder) unless --score-only")
        suite = load_suite(args.suite, tasks=args.tasks.split(",") if args.tasks else None,
                           lengths=args.lengths, samples=args.samples)
        backend = args.backend or suite.backend.get("name", "hf")
        options = {"max_length": args.max_length} if args.max_length else {}
        options.update(_backend_overrides(args.overrides))
        attention = attention_options(args.attention, args.sparse, suite.backend, from_path=args.attention_from)
        if attention:
            if backend == "vllm":
                raise MtrainError("--attention/--attention-from/--sparse choose the hf backend's attention; vLLM "
                                  "runs its own: use --backend hf")
            backend = "hf"  # auto too: only the hf backend runs mtrain's attention
            options.update(attention)
        results = run_suite(suite, args.model, args.out, backend=backend, backend_options=options,
                            progress=not args.no_progress)
        with open(os.path.join(args.out, "manifest.json")) as f:
            ran = json.load(f)["backend"]
        print("backend: " + ran["backend"] + " (" + ", ".join(f"{k} {v}" for k, v in ran["versions"].items()) + ")")
    print(summary(results))
    print(f"wrote {os.path.join(args.out, 'results.json')}")
    return 0


def _backend_overrides(items: list[str]) -> dict:
    """`--set backend.KEY=VALUE` items as backend options (VALUE read as YAML: 1 -> int, true -> bool)."""
    from mtrain.config import parse_override_value

    options = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.startswith("backend.") or key == "backend.":
            raise MtrainError(f"--set {item!r}: expected backend.KEY=VALUE, e.g. backend.max_num_batched_tokens=4096")
        options[key[len("backend."):]] = parse_override_value(text)
    return options


# transformers' own attention implementations --attention passes through; mtrain's kinds become mtrain-KIND
TRANSFORMERS_ATTENTION = ("sdpa", "eager")


def attention_options(kind: str | None, sparse_items: list[str], suite_backend: dict,
                      from_path: str | None = None) -> dict:
    """hf backend options from `--attention KIND`, `--attention-from RECIPE_OR_RUN` and `--sparse KEY=VALUE` items,
    validated (one line naming the bad kind or key). Without either, --sparse applies to the suite's
    `attn_implementation` and refines its sparse settings; with one, it refines that one's."""
    from mtrain.attention_settings import SparseSettings, keys_of, settings_from_keys
    from mtrain.config import parse_override_value
    from mtrain.models.registry import KINDS

    if kind is None and from_path is None and not sparse_items:
        return {}
    if kind is not None and from_path is not None:
        raise MtrainError("--attention and --attention-from both choose the attention: give one")
    options: dict = {}
    settings: dict = {}
    if from_path is not None:
        kind, settings = _recipe_attention(from_path)
        options["attn_implementation"] = f"mtrain-{kind}"
    elif kind is not None:
        name = kind[len("mtrain-"):] if kind.startswith("mtrain-") else kind
        if name in KINDS:
            options["attn_implementation"] = f"mtrain-{name}"
        elif name in TRANSFORMERS_ATTENTION and not kind.startswith("mtrain-"):
            options["attn_implementation"] = name
        else:
            raise MtrainError(f"--attention {kind!r}: unknown attention kind; choose one of "
                              f"{', '.join([*KINDS, *TRANSFORMERS_ATTENTION])}")
    else:
        settings = dict(suite_backend.get("sparse") or {})
    implementation = options.get("attn_implementation") or suite_backend.get("attn_implementation", "sdpa")
    sparse_kind = implementation[len("mtrain-"):] if implementation.startswith("mtrain-") else None
    sparse = sparse_kind in KINDS and KINDS[sparse_kind][0]
    if sparse_items:
        if not sparse:
            raise MtrainError(f"--sparse needs a sparse attention kind (--attention mtraining or zigzag-sparse), "
                              f"not {implementation!r}")
        valid = [*keys_of(SparseSettings), *POLICY_KEYS]
        for item in sparse_items:
            key, sep, text = item.partition("=")
            if not sep or not key:
                raise MtrainError(f"--sparse {item!r}: expected KEY=VALUE, e.g. recall=0.95")
            if key not in valid:
                raise MtrainError(f"--sparse {item!r}: unknown key {key!r}; valid keys: {', '.join(valid)}")
            settings[key] = parse_override_value(text)
    if sparse and settings:
        # where the settings came from, for the message: --sparse items, else the recipe, else the suite
        source = "--sparse" if sparse_items else f"--attention-from {from_path}" if from_path else "backend.sparse"
        try:  # values checked here, before any model is loaded, by the objects the runtime is built of
            settings_from_keys(sparse_kind, settings)
        except MtrainError as err:
            raise MtrainError(f"{source}: {' '.join(str(err).split())}") from None
    if settings:
        options["sparse"] = settings
    return options


# --sparse keys besides the SparseSettings fields: how the kind runs per layer (the PolicySettings fields an evaluation
# reads, `inference_keys`; its defaults, the recipe's, where not given: sparse_policy auto with the quality check)
POLICY_KEYS = inference_keys(PolicySettings)


def _recipe_attention(path: str) -> tuple[str, dict]:
    """The attention kind and sparse settings of a recipe YAML, or of a run folder's config.yaml (what `mtrain train`
    saved): the recipe's keys of the settings objects its kind reads (`mtrain.attention_settings`; nulls included:
    they mean no check, no escalation), less those that only training reads (the dense hold, cap widening)."""
    from mtrain.attention_settings import BaselineSettings, SparseSettings
    from mtrain.config import SETTINGS_KEYS, parse_recipe
    from mtrain.errors import ConfigError
    from mtrain.models import attention
    from mtrain.models.baselines import BASELINE_KINDS

    recipe_path = os.path.join(path, "config.yaml") if os.path.isdir(path) else path
    if not os.path.isfile(recipe_path):
        where = "holds no config.yaml (the settings `mtrain train` saves in its output_dir)" if os.path.isdir(path) \
            else "does not exist"
        raise MtrainError(f"--attention-from {path}: {where}; give a recipe YAML or a training run's folder")
    try:
        recipe = parse_recipe(recipe_path)
        recipe.attention.settings()  # checked as training checks them
    except ConfigError as err:
        raise MtrainError(f"--attention-from {path}: {' '.join(str(err).split())}") from None
    kind = recipe.attention.kind
    if kind in attention.KINDS and not attention.KINDS[kind][0]:  # a dense kind reads none of them
        return kind, {}
    groups = (BaselineSettings,) if kind in BASELINE_KINDS else (SparseSettings, PolicySettings)
    return kind, {key: getattr(recipe.attention, key) for group in groups for key in inference_keys(group)
                  if key in SETTINGS_KEYS}


def summary(results: dict) -> str:
    """A short text table: task x length scores, then the RULER averages."""
    lines = []
    for name, by_length in results["tasks"].items():
        cells = ", ".join(f"{L}: {c['score']:.2f}" for L, c in by_length.items())
        lines.append(f"{name:28s} {by_length[next(iter(by_length))]['metric']:>18s}  {cells}")
    if "ruler" in results:
        lines.append("ruler average                " + json.dumps(
            {L: round(c["average"], 2) for L, c in results["ruler"].items()}))
    return "\n".join(lines)
