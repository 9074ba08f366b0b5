"""Packing throughput benchmark: real text packed three ways (re-encode, text, same tokenizer) in one run.

Run: `python -m tools.pack_throughput --source-tokenizer LLAMA3_DIR --tokenizer QWEN_DIR --mb 32 --workers 1,2`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import sysconfig
import tempfile
import time

import numpy as np

PROLONG_512K_TOKENS = 40e9


def corpus(max_bytes: int) -> list[str]:
    """Deterministic documents from this Python install: .py files (code) and dist-info METADATA (prose)."""
    site = sysconfig.get_paths()["purelib"]
    code = sorted(glob.glob(os.path.join(site, "**", "*.py"), recursive=True))
    prose = sorted(glob.glob(os.path.join(site, "*.dist-info", "METADATA")))
    docs, total = [], 0
    # interleave 3 code files per prose file until the budget is reached
    for i, path in enumerate(p for group in zip(code[::3], code[1::3], code[2::3], prose * 100) for p in group):
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 2000:
            continue
        docs.append(text)
        total += len(text.encode())
        if total >= max_bytes:
            break
    return docs


def write_source(docs: list[str], tokenizer_dir: str, out: str, sample_len: int = 65536) -> int:
    """A ProLong-schema MDS source (BOS + doc + EOS in the source tokenizer, cut every `sample_len`)."""
    from transformers import AutoTokenizer

    from mtrain.data.mds import mds_writer
    from mtrain.data.packer import COLUMNS

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream, bounds = [], [0]
    for ids in tok(docs, add_special_tokens=True)["input_ids"]:
        stream.extend(ids + [tok.eos_token_id])
        bounds.append(len(stream))
    bounds_arr = np.array(bounds)
    # 1 MiB shards: enough chunks to keep many workers busy
    writer = mds_writer(out, COLUMNS, compression="zstd", size_limit=1 << 20)
    for begin in range(0, len(stream), sample_len):
        end = min(begin + sample_len, len(stream))
        inner = bounds_arr[(bounds_arr > begin) & (bounds_arr < end)].tolist()
        cuts = [begin, *inner, end]
        spans = np.array([[a - begin, b - begin] for a, b in zip(cuts[:-1], cuts[1:])], dtype=np.uint32)
        writer.write({"input_ids": np.array(stream[begin:end], dtype=np.uint32), "indices": spans,
                      "domain": "bench", "length": end - begin})
    writer.finish()
    return len(stream)


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the pool workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source-tokenizer", required=True, help="tokenizer of the MDS source (Llama-3)")
    parser.add_argument("--tokenizer", required=True, help="target tokenizer (Qwen2.5)")
    parser.add_argument("--mb", type=int, default=48, help="MB of text")
    parser.add_argument("--seq-len", type=int, default=524288)
    parser.add_argument("--workers", default=None, help="worker counts to time, comma-separated (default: all cores)")
    parser.add_argument("--cases", default="reencode,text,same", help="subset of reencode,text,same")
    parser.add_argument("--node-cores", type=int, default=32)
    args = parser.parse_args(argv)

    from mtrain.data.packer import cores, pack

    worker_counts = [int(w) for w in args.workers.split(",")] if args.workers else [cores()]
    work = tempfile.mkdtemp(prefix="mtrain-bench-")
    try:
        docs = corpus(args.mb << 20)
        text_bytes = sum(len(d.encode()) for d in docs)
        with open(os.path.join(work, "text.jsonl"), "w") as fh:
            fh.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        source_tokens = write_source(docs, args.source_tokenizer, os.path.join(work, "mds"))
        cases = {
            "reencode": ("MDS Llama-3 ids -> decode -> Qwen ids", [os.path.join(work, "mds")],
                         args.source_tokenizer, args.tokenizer),
            "text": ("jsonl text -> Qwen ids", [os.path.join(work, "text.jsonl")], None, args.tokenizer),
            "same": ("MDS Llama-3 ids, same tokenizer (no re-encode)", [os.path.join(work, "mds")],
                     args.source_tokenizer, args.source_tokenizer),
        }
        rows = []
        for key, workers in ((k, w) for k in args.cases.split(",") for w in worker_counts):
            name, sources, source_tok, target_tok = cases[key]
            out = os.path.join(work, "out")
            shutil.rmtree(out, ignore_errors=True)
            cpu_before = _cpu_seconds()
            start = time.perf_counter()
            manifest = pack(sources, target_tok, args.seq_len, out, source_tokenizer=source_tok, workers=workers,
                            progress=False)
            seconds = time.perf_counter() - start
            cpu = _cpu_seconds() - cpu_before
            tokens = manifest["num_tokens"] + manifest["dropped_tail_tokens"]
            rows.append((name, workers, tokens, seconds, cpu))
        print(f"text: {len(docs)} documents, {text_bytes / 1e6:.1f} MB; source tokens {source_tokens}; "
              f"seq_len {args.seq_len}; cores {cores()}")
        # tokens per CPU-second does not depend on what else shares the machine; the node estimate assumes
        # every core busy (chunks are independent) and no other bottleneck
        print(f"| case | workers | output tokens | wall s | tokens/s (wall) | CPU s | tokens per CPU-s | "
              f"40B tokens on {args.node_cores} cores |")
        print("|---|---|---|---|---|---|---|---|")
        for name, workers, tokens, seconds, cpu in rows:
            per_cpu = tokens / cpu
            hours = PROLONG_512K_TOKENS / (per_cpu * args.node_cores) / 3600
            print(f"| {name} | {workers} | {tokens} | {seconds:.1f} | {tokens / seconds / 1e6:.3f} M | {cpu:.1f} | "
                  f"{per_cpu / 1e6:.3f} M | {hours:.1f} h |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
