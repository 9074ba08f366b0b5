"""Packing must-shows: a ProLong-schema MDS source in one tokenizer packed into another, exact lengths,
recoverable documents, mixture shares, byte-identical reruns, and SIGKILL + resume giving the same bytes."""

from __future__ import annotations

import collections
import json
import os
import random
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mtrain.data import pack
from mtrain.data.mds import MDSFolder, mds_writer
from mtrain.data.packer import COLUMNS
from ranks import start

WORDS = ("river stone light window market garden paper engine silver winter quiet number seven orange "
         "history signal bridge forest memory ocean yellow cotton north 42 1917 ,. ;").split()


def make_docs(n: int, seed: int, min_words: int = 3, max_words: int = 120) -> list[str]:
    """Deterministic pseudo-text documents of varied length."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def make_tokenizer(out_dir: Path, vocab_size: int, *, llama_like: bool):
    """A byte-level BPE saved as a HF fast tokenizer. llama_like: BOS <s> added by the tokenizer and EOS </s>
    (like Llama-3); otherwise only an EOS <|endoftext|> (like Qwen2.5)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>"] if llama_like else ["<|endoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(make_docs(300, seed=vocab_size), trainer=trainer)
    if llama_like:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return fast


def write_prolong_mds(out_dir: Path, docs: list[str], tok, sample_len: int, domain: str,
                      compression: str | None = "zstd", split: bool = False) -> None:
    """ProLong's layout: documents (BOS + text + EOS in the source tokenizer) packed into samples with
    `indices` = each document's (start, end) inside its sample. split=False: whole documents, greedily,
    up to `sample_len` (a longer one alone); split=True: the stream cut every `sample_len` tokens, so
    documents continue in the next sample (and a piece may hold only BOS)."""
    samples, current, stream, bounds = [], [], [], [0]
    for text in docs:
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        stream.extend(ids)
        bounds.append(len(stream))
        if current and sum(map(len, current)) + len(ids) > sample_len:
            samples.append(current)
            current = []
        current.append(ids)
    samples.append(current)
    if split:
        samples = []
        for begin in range(0, len(stream), sample_len):
            end = min(begin + sample_len, len(stream))
            cuts = sorted({begin, end, *[b for b in bounds if begin < b < end]})
            samples.append([stream[a:b] for a, b in zip(cuts[:-1], cuts[1:])])
    writer = mds_writer(str(out_dir), COLUMNS, compression=compression, size_limit=1 << 14)
    for pieces in samples:
        ends = np.cumsum([len(p) for p in pieces])
        spans = np.stack([ends - [len(p) for p in pieces], ends], axis=1).astype(np.uint32)
        writer.write({"input_ids": np.array([t for p in pieces for t in p], dtype=np.uint32), "indices": spans,
                      "domain": domain, "length": int(ends[-1])})
    writer.finish()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two tokenizers, two ProLong-schema MDS sources (source tokenizer) and a jsonl source (text)."""
    root = tmp_path_factory.mktemp("pack")
    src_tok = make_tokenizer(root / "tok-src", 400, llama_like=True)
    tgt_tok = make_tokenizer(root / "tok-tgt", 330, llama_like=False)
    docs = {
        "books": make_docs(60, seed=1, min_words=100, max_words=700),  # some longer than seq_len: split
        "web": make_docs(400, seed=2),
        "notes": make_docs(300, seed=3, max_words=60),
    }
    write_prolong_mds(root / "books", docs["books"], src_tok, 1024, "books")
    write_prolong_mds(root / "web", docs["web"], src_tok, 1024, "web")
    with open(root / "notes.jsonl", "w") as fh:
        for text in docs["notes"]:
            fh.write(json.dumps({"text": text, "id": 0}) + "\n")
    return {"root": root, "src_tok": src_tok, "tgt_tok": tgt_tok, "docs": docs}


SEQ = 512
SHARES = {"books": 0.5, "web": 0.3, "notes": 0.2}


def pack_args(world, out: Path) -> dict:
    root = world["root"]
    return dict(
        sources=[f"{root / 'books'}@0.5", f"{root / 'web'}:mds@0.3", f"{root / 'notes.jsonl'}@0.2"],
        tokenizer=str(root / "tok-tgt"), seq_len=SEQ, out_dir=str(out),
        source_tokenizer=str(root / "tok-src"), seed=7, samples_per_shard=4, progress=False,
    )


def read_all(out: Path) -> list[dict]:
    folder = MDSFolder(str(out))
    return [folder[i] for i in range(len(folder))]


def recover_documents(samples: list[dict], eos: int) -> tuple[list[tuple], tuple]:
    """Join the span pieces of the stream back into documents: a piece not ending in EOS continues in the
    next sample's first span. Returns the complete documents and the cut-off tail (maybe empty)."""
    docs, current = [], []
    for s in samples:
        for a, b in np.asarray(s["indices"]).reshape(-1, 2):
            current.extend(s["input_ids"][a:b].tolist())
            if current[-1] == eos:
                docs.append(tuple(current))
                current = []
    return docs, tuple(current)


def files_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def packed(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "out"
    manifest = pack(**pack_args(world, out), workers=2)
    return out, manifest


def test_samples_exact_length_and_documents_recoverable(world, packed):
    out, manifest = packed
    samples = read_all(out)
    assert len(samples) == manifest["num_samples"] > 10
    tgt = world["tgt_tok"]
    for s in samples:
        assert len(s["input_ids"]) == SEQ and s["length"] == SEQ
        spans = np.asarray(s["indices"]).reshape(-1, 2)
        assert spans[0, 0] == 0 and spans[-1, 1] == SEQ and np.all(spans[1:, 0] == spans[:-1, 1])
    # independent reference: each source document encoded by the target tokenizer, EOS appended, no BOS
    expected = {}
    for name, docs in world["docs"].items():
        for text in docs:
            expected[tuple(tgt(text)["input_ids"] + [tgt.eos_token_id])] = name
    complete, tail = recover_documents(samples, tgt.eos_token_id)
    assert all(doc in expected for doc in complete)
    assert not tail or any(doc[: len(tail)] == tail for doc in expected)  # the cut-off tail: a prefix
    assert max(collections.Counter(complete).values()) == 1  # no document twice
    assert len(complete) + bool(tail) == manifest["num_documents"]
    assert sum(map(len, complete)) + len(tail) == len(samples) * SEQ
    assert sum(s["tokens_packed"] for s in manifest["per_source"]) == len(samples) * SEQ
    assert 0 <= manifest["dropped_tail_tokens"] < SEQ
    # long documents were split across samples: some joined document is longer than a sample
    assert max(len(d) for d in complete) > SEQ
    # mixture shares (of packed tokens), measured from the recovered documents
    tokens = collections.Counter()
    for doc in complete:
        tokens[expected[doc]] += len(doc)
    total = sum(tokens.values())
    for name, share in SHARES.items():
        assert abs(tokens[name] / total - share) < 0.02, (name, tokens[name] / total)
    assert manifest["tokenizer"]["sha256"] != manifest["source_tokenizer"]["sha256"]


def test_two_runs_byte_identical(world, packed, tmp_path):
    out, _ = packed
    again = tmp_path / "again"
    pack(**pack_args(world, again), workers=1)  # a different worker count must not change a byte
    assert files_bytes(out) == files_bytes(again)
    assert not (again / ".work").exists()


KILLER = textwrap.dedent("""
    import json, os, signal, sys
    import mtrain.data.packer as P
    import mtrain.data.tokenize as T
    args, stage, after = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    calls = {"n": 0}
    def killing(real):
        def wrapper(*a):
            result = real(*a)
            calls["n"] += 1
            if calls["n"] >= after:
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception handlers
            return result
        return wrapper
    if stage == "write":
        P._write_shard = killing(P._write_shard)
    else:
        T.tokenize_chunk = killing(T.tokenize_chunk)
    P.pack(**args, workers=1)
""")


@pytest.mark.parametrize("stage,after", [("tokenize", 2), ("write", 3)])
def test_killed_run_resumes_to_identical_output(world, packed, tmp_path, stage, after):
    out, _ = packed
    killed = tmp_path / "killed"
    args = pack_args(world, killed)
    (tmp_path / "killer.py").write_text(KILLER)
    # `python killer.py ARGS`, forked from the CLI's server (tests/ranks.py start: a process of its own)
    launch = start(1, str(tmp_path / "killer.py"), json.dumps(args), stage, str(after), launcher=False)
    try:
        returncode = launch.wait(timeout=120)
        err = launch.output()[1]
    finally:
        launch.close()
    assert returncode == -9, err[-2000:]
    # nothing looks complete: no index.json / manifest.json; the work journal is there
    assert not (killed / "index.json").exists() and not (killed / "manifest.json").exists()
    assert (killed / ".work" / "config.json").exists()
    if stage == "write":
        assert len(list(killed.glob("shard.*.mds"))) == after
    pack(**args, workers=2)
    assert files_bytes(killed) == files_bytes(out)


def test_rerun_on_finished_output_is_a_no_op(world, packed):
    out, manifest = packed
    before = files_bytes(out)
    assert pack(**pack_args(world, out), workers=1) == json.loads((out / "manifest.json").read_text())
    assert files_bytes(out) == before


def test_repacking_a_deleted_output_path_in_one_process(world, tmp_path):
    """Caches keyed by path (tokenized chunks, tokenizers) must not serve a deleted earlier run's files."""
    import shutil

    out = tmp_path / "same-path"
    args = pack_args(world, out)
    first = pack(**args, workers=1)
    shutil.rmtree(out)
    args["sources"] = args["sources"][::-1]  # source 0 / chunk 0 now names other tokens
    second = pack(**args, workers=1)
    assert first["config_hash"] != second["config_hash"]
    complete, _ = recover_documents(read_all(out), world["tgt_tok"].eos_token_id)
    assert sum(map(len, complete)) > 0.9 * second["num_tokens"]
    expected = {tuple(world["tgt_tok"](t)["input_ids"] + [world["tgt_tok"].eos_token_id])
                for docs in world["docs"].values() for t in docs}
    assert all(doc in expected for doc in complete)


def test_worker_killed_by_the_os_is_reported_and_resumable(world, packed, tmp_path, monkeypatch):
    import functools
    import signal

    import mtrain.data.tokenize as tk
    from mtrain.errors import MtrainError

    out, _ = packed
    real = tk.tokenize_chunk

    @functools.wraps(real)  # same qualified name: the worker finds it when unpickling the task
    def dying(chunk):
        if chunk.source == 1 and chunk.index == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        return real(chunk)

    monkeypatch.setattr(tk, "tokenize_chunk", dying)
    args = pack_args(world, tmp_path / "oom")
    with pytest.raises(MtrainError, match="a worker process died"):
        pack(**args, workers=2)
    assert not (tmp_path / "oom" / "index.json").exists()
    monkeypatch.undo()
    pack(**args, workers=2)
    assert files_bytes(tmp_path / "oom") == files_bytes(out)
