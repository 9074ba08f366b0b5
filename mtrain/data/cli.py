"""`mtrain pack`: the data stage's command line, with sources as flags or from a manifest YAML
(`mtrain pack data/prolong-512k.yaml [--out DIR]`; flags given with a manifest override its values).
"""

from __future__ import annotations

import argparse
import json
import os

from mtrain.errors import MtrainError

MANIFEST_KEYS = {"sources", "tokenizer", "source_tokenizer", "seq_len", "out", "root", "description"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pack",
        help="tokenize and pack data sources into fixed-length MDS training samples",
        description="Pack a mixture of sources (ProLong-schema MDS, jsonl, parquet, datasets save_to_disk "
        "folders) into MDS samples of exactly --seq-len target tokens, keeping document spans. A killed run "
        "resumes when rerun with the same arguments.",
    )
    p.add_argument("manifest", nargs="?", help="mixture manifest YAML (e.g. data/prolong-512k.yaml)")
    p.add_argument("--source", action="append", default=None, metavar="PATH[:FORMAT][:field=NAME][@PROPORTION]",
                   help="a source; FORMAT is mds|jsonl|parquet|hf (detected when left out), NAME the field or "
                   "column holding the text (default text), PROPORTION its share of output tokens; repeat for a "
                   "mixture (e.g. posts.jsonl:jsonl:field=body@0.3)")
    p.add_argument("--tokenizer", help="target HF tokenizer folder (the model's)")
    p.add_argument("--source-tokenizer", help="tokenizer of pre-tokenized sources, when it differs")
    p.add_argument("--seq-len", type=int, help="tokens per sample, e.g. 524288")
    p.add_argument("--out", help="output folder (new or empty, or a killed run's to resume)")
    p.add_argument("--seed", type=int, help="seed of document selection and order (default 0)")
    p.add_argument("--total-tokens", type=int, help="tokens to pack (default: as many as the mixture allows)")
    p.add_argument("--order", choices=("shuffle", "length"), help="document order (default shuffle)")
    p.add_argument("--bos", help="BOS per document: auto|always|never or a token (default auto: as the tokenizer does)")
    p.add_argument("--eos", help="EOS per document: auto|always|never or a token, e.g. '<|endoftext|>' "
                   "(default auto: the tokenizer's EOS)")
    p.add_argument("--skip-empty", action="store_true", default=None, help="drop empty documents instead of failing")
    p.add_argument("--samples-per-shard", type=int, help="samples per output shard (default: ~64 MiB shards)")
    p.add_argument("--compression", help="shard compression, e.g. zstd (default none)")
    p.add_argument("--workers", type=int, help="processes (default: all cores)")
    p.add_argument("--keep-work", action="store_true", default=None, help="keep OUT/.work after success")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bars")
    p.set_defaults(func=run)

    from mtrain.data.docmix import DESCRIPTION, add_arguments
    from mtrain.data.docmix import run as run_docmix

    d = subparsers.add_parser("docmix", help="write sequences of real long documents in a fixed mix (benchmarks' packs)",
                              description=DESCRIPTION)
    add_arguments(d)
    d.set_defaults(func=run_docmix)


def _load_manifest(path: str) -> dict:
    import yaml

    try:
        with open(path) as fh:
            obj = yaml.safe_load(fh)
    except FileNotFoundError:
        raise MtrainError(f"{path}: no such manifest") from None
    except yaml.YAMLError as exc:
        raise MtrainError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(obj, dict):
        raise MtrainError(f"{path}: a manifest is a mapping with `sources`, `tokenizer`, `seq_len`, ...")
    from mtrain.data.packer import PackOptions

    known = MANIFEST_KEYS | set(PackOptions.__dataclass_fields__)
    unknown = set(obj) - known
    if unknown:
        raise MtrainError(f"{path}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    return obj


def _check_request(config: dict, options: dict, sources: list) -> None:
    """Numbers in range and paths usable, before any tokenizer loads or worker starts."""
    import math

    from mtrain.config import HUB_ID, check_hub_id

    if not isinstance(config["seq_len"], int) or isinstance(config["seq_len"], bool):
        raise MtrainError(f"pack: seq_len must be an integer, got {config['seq_len']!r}")
    for key, least in (("seed", 0), ("workers", 1), ("total_tokens", 1), ("samples_per_shard", 1)):
        value = options.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise MtrainError(f"pack: --{key.replace('_', '-')} must be an integer >= {least}, got {value!r}")
    for spec in sources:
        if spec.proportion is not None and not (isinstance(spec.proportion, (int, float))
                                                and math.isfinite(spec.proportion) and spec.proportion > 0):
            raise MtrainError(f"source {spec.path}: proportion must be a positive finite number, got {spec.proportion!r}")
    for key in ("tokenizer", "source_tokenizer"):
        value = config.get(key)
        if value is None or os.path.isdir(value):
            continue
        if os.path.exists(value):
            raise MtrainError(f"pack: --{key.replace('_', '-')} {value} is a file; give the tokenizer's folder")
        if not HUB_ID.fullmatch(value):
            raise MtrainError(f"pack: --{key.replace('_', '-')} {value}: no such folder; fix the path")
        try:
            check_hub_id(key, value)
        except MtrainError:
            raise MtrainError(f"pack: --{key.replace('_', '-')} {value}: no such folder and no hub tokenizer in the "
                              "local cache; fix the path, or run `mtrain --online pack ...` for a hub id") from None
    out = config["out"]
    if os.path.exists(out) and not os.path.isdir(out):
        raise MtrainError(f"pack: --out {out} is a file; choose a new or empty folder")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise MtrainError(f"pack: --out {out}: {parent} is a file, not a folder; choose another --out")


def run(args: argparse.Namespace) -> int:
    from mtrain.data.packer import PackOptions, pack
    from mtrain.data.sources import parse_source_spec, source_from_dict

    config: dict = {}
    sources = []
    if args.manifest:
        config = _load_manifest(args.manifest)
        base = os.path.dirname(os.path.abspath(args.manifest))
        root = config.get("root")
        root = os.path.join(base, root) if root and not os.path.isabs(root) else (root or base)
        entries = config.get("sources") or []
        if not isinstance(entries, list):
            raise MtrainError(f"{args.manifest}: `sources` must be a list")
        sources = [source_from_dict(e, root, f"{args.manifest} sources[{i}]") for i, e in enumerate(entries)]
        # `out` and local tokenizer folders are relative to the manifest; hub ids pass through
        if config.get("out") and not os.path.isabs(config["out"]):
            config["out"] = os.path.join(base, config["out"])
        for key in ("tokenizer", "source_tokenizer"):
            value = config.get(key)
            if value and not os.path.isabs(value) and os.path.exists(os.path.join(base, value)):
                config[key] = os.path.join(base, value)
    if args.source:
        sources = [parse_source_spec(s) for s in args.source]
    for key, flag in (("tokenizer", "tokenizer"), ("source_tokenizer", "source_tokenizer"), ("seq_len", "seq_len"),
                      ("out", "out")):
        if getattr(args, flag) is not None:
            config[key] = getattr(args, flag)
    for key in ("tokenizer", "seq_len", "out"):
        if config.get(key) is None:
            raise MtrainError(f"pack: --{key.replace('_', '-')} is required (or set `{key}` in the manifest)")
    if not sources:
        raise MtrainError("pack: give sources with --source PATH[:FORMAT][:field=NAME][@PROPORTION] or a manifest YAML")
    options = {k: config[k] for k in PackOptions.__dataclass_fields__ if k in config}
    for key in PackOptions.__dataclass_fields__:
        value = getattr(args, key, None)
        if value is not None:
            options[key] = value
    _check_request(config, options, sources)
    manifest = pack(sources, config["tokenizer"], int(config["seq_len"]), config["out"],
                    source_tokenizer=config.get("source_tokenizer"), **options)
    summary = {k: manifest[k] for k in ("num_samples", "seq_len", "num_tokens", "num_documents")}
    summary["shares"] = {s["name"]: round(s["share"], 4) for s in manifest["per_source"]}
    print(json.dumps(summary))
    return 0
