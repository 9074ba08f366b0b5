"""Bad input gets a clear error naming the file, and a failed pack leaves nothing that looks complete."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mtrain.data import TrainingReader, pack
from mtrain.data.mds import mds_writer
from mtrain.errors import MtrainError
from test_data_pack import make_docs, make_tokenizer, write_prolong_mds


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    src = make_tokenizer(root / "src", 400, llama_like=True)
    make_tokenizer(root / "tgt", 300, llama_like=False)
    write_prolong_mds(root / "mds", make_docs(120, seed=5), src, 256, "web", compression=None)
    write_prolong_mds(root / "mdsz", make_docs(120, seed=6), src, 256, "web", compression="zstd")
    good = root / "good.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(50, seed=7)))
    return root


def run_pack(env: Path, sources, out: Path, **kw):
    kw.setdefault("seq_len", 64)
    return pack([str(s) for s in sources], str(env / "tgt"), kw.pop("seq_len"), str(out), workers=1,
                progress=False, **kw)


def assert_not_complete(out: Path) -> None:
    assert not (out / "index.json").exists() and not (out / "manifest.json").exists()


def copy_tree(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_truncated_shard(env, tmp_path):
    bad = copy_tree(env / "mds", tmp_path / "mds")
    shard = bad / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(MtrainError, match=rf"{shard}: truncated or corrupt shard"):
        run_pack(env, [bad], tmp_path / "out", source_tokenizer=str(env / "src"))
    assert_not_complete(tmp_path / "out")


def test_corrupt_compressed_shard(env, tmp_path):
    bad = copy_tree(env / "mdsz", tmp_path / "mdsz")
    shard = bad / "shard.00000.mds.zstd"
    data = bytearray(shard.read_bytes())
    data[:8] = b"garbage!"  # same size, broken frame
    shard.write_bytes(bytes(data))
    with pytest.raises(MtrainError, match=rf"{shard}: corrupt shard, zstd decompression failed"):
        run_pack(env, [bad], tmp_path / "out", source_tokenizer=str(env / "src"))
    assert_not_complete(tmp_path / "out")


def test_missing_field(env, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine words here"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    with pytest.raises(MtrainError, match=rf"{bad} at byte 28: missing field `text`"):
        run_pack(env, [bad], tmp_path / "out")
    writer = mds_writer(str(tmp_path / "nofield"), {"domain": "str"}, compression=None, size_limit=None)
    writer.write({"domain": "web"})
    writer.finish()
    with pytest.raises(MtrainError, match=r"nofield/index.json: missing field: .* neither `input_ids`"):
        run_pack(env, [tmp_path / "nofield"], tmp_path / "out2")


def test_truncated_jsonl_line(env, tmp_path):
    bad = tmp_path / "cut.jsonl"
    bad.write_text(json.dumps({"text": "whole line"}) + "\n" + '{"text": "cut in the mid')
    with pytest.raises(MtrainError, match=rf"{bad} at byte 23: not a valid JSON line"):
        run_pack(env, [bad], tmp_path / "out")


def test_empty_document_fails_or_is_skipped_and_counted(env, tmp_path):
    bad = tmp_path / "empty.jsonl"
    lines = [json.dumps({"text": t}) for t in make_docs(30, seed=8)]
    lines.insert(4, json.dumps({"text": ""}))
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(MtrainError, match=rf"{bad} at byte \d+: empty document"):
        run_pack(env, [bad], tmp_path / "out")
    assert_not_complete(tmp_path / "out")
    manifest = run_pack(env, [bad], tmp_path / "out-skip", skip_empty=True)
    assert manifest["per_source"][0]["skipped_empty_documents"] == 1
    assert manifest["per_source"][0]["documents_available"] == 30


def test_tokenizer_mismatch(env, tmp_path):
    # the MDS ids come from a 400-token vocabulary; packing them as if they were the 300-token target's fails
    with pytest.raises(MtrainError, match=r"mds/shard\.\d+\.mds sample \d+ document \d+: tokenizer mismatch"):
        run_pack(env, [env / "mds"], tmp_path / "out")
    assert_not_complete(tmp_path / "out")


def test_seq_len_too_small_or_too_large(env, tmp_path):
    with pytest.raises(MtrainError, match="seq_len 2 is too small"):
        run_pack(env, [env / "good.jsonl"], tmp_path / "out", seq_len=2)
    with pytest.raises(MtrainError, match="less than one sample of seq_len 1000000"):
        run_pack(env, [env / "good.jsonl"], tmp_path / "out2", seq_len=1_000_000)
    assert_not_complete(tmp_path / "out2")


def test_output_folder_holding_a_different_dataset(env, tmp_path):
    out = tmp_path / "out"
    run_pack(env, [env / "good.jsonl"], out)
    with pytest.raises(MtrainError, match=rf"{out} holds a different dataset"):
        run_pack(env, [env / "good.jsonl"], out, seed=1)
    # an unfinished pack (failed on an empty document) refuses a different request too
    bad = tmp_path / "empty.jsonl"
    bad.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(MtrainError, match="empty document"):
        run_pack(env, [bad], tmp_path / "half")
    with pytest.raises(MtrainError, match="holds an unfinished pack of a different dataset"):
        run_pack(env, [env / "good.jsonl"], tmp_path / "half")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(MtrainError, match="is not empty and is not an mtrain pack output"):
        run_pack(env, [env / "good.jsonl"], tmp_path / "other")
    with pytest.raises(MtrainError, match="an MDS index.json not made by this pack"):
        run_pack(env, [env / "good.jsonl"], env / "mds")


def test_bad_mixture_and_options(env, tmp_path):
    with pytest.raises(MtrainError, match=r"have no proportion"):
        pack([f"{env / 'good.jsonl'}@0.5", str(env / "mds")], str(env / "tgt"), 64, str(tmp_path / "o"))
    with pytest.raises(MtrainError, match=r"proportion 'half' after '@' is not a number"):
        pack([f"{env / 'good.jsonl'}@half"], str(env / "tgt"), 64, str(tmp_path / "o"))
    with pytest.raises(MtrainError, match=r"unknown option\(s\) \['sequence'\]"):
        pack([str(env / "good.jsonl")], str(env / "tgt"), 64, str(tmp_path / "o"), sequence=3)
    with pytest.raises(MtrainError, match="has no BOS token"):
        pack([str(env / "good.jsonl")], str(env / "tgt"), 64, str(tmp_path / "o"), bos="always")
    with pytest.raises(MtrainError, match="no such file or folder"):
        pack([str(env / "absent.jsonl")], str(env / "tgt"), 64, str(tmp_path / "o"))


def test_cli_reports_one_line(env, tmp_path, capsys):
    from mtrain.cli import main

    code = main(["pack", "--source", str(env / "good.jsonl"), "--tokenizer", str(env / "tgt"), "--seq-len", "2",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("mtrain pack: error: pack: seq_len 2 is too small")


def test_reader_names_a_damaged_output_shard(env, tmp_path):
    out = tmp_path / "out"
    run_pack(env, [env / "good.jsonl"], out, samples_per_shard=4)
    shard = out / "shard.00000.mds"
    os.truncate(shard, shard.stat().st_size - 10)
    reader = TrainingReader(out, shuffle=False)
    with pytest.raises(MtrainError, match=rf"{shard}: truncated or corrupt shard"):
        next(iter(reader))
    assert np.all(reader.epoch_order(0) == np.arange(len(reader)))


def test_repacking_mtrain_output_checks_its_tokenizer(env, tmp_path):
    first = tmp_path / "first"
    made = run_pack(env, [env / "good.jsonl"], first, seq_len=64)
    with pytest.raises(MtrainError, match=rf"{first}/manifest.json: tokenizer mismatch"):
        run_pack(env, [first], tmp_path / "wrong", source_tokenizer=str(env / "src"))
    # with its own tokenizer the packed documents carry over unchanged into another seq_len
    again = run_pack(env, [first], tmp_path / "again", seq_len=48, source_tokenizer=str(env / "tgt"))
    eos, expected = made["eos_id"], 0
    reader = TrainingReader(first, shuffle=False)
    for i in range(made["num_samples"]):
        ids = reader.sample(i)["input_ids"].tolist()
        for a, b in reader.sample(i)["doc_spans"].tolist():
            core = ids[a:b]
            while core and core[-1] == eos:
                core.pop()
            expected += len(core) + 1 if core else 0  # each piece ends with exactly one EOS again
    assert again["per_source"][0]["tokens_available"] == expected


def test_zero_length_span_is_an_empty_document(env, tmp_path):
    writer = mds_writer(str(tmp_path / "spans"), {"input_ids": "ndarray:uint32", "indices": "ndarray:uint32"},
                        compression=None, size_limit=None)
    for _ in range(4):
        writer.write({"input_ids": np.arange(1, 41, dtype=np.uint32),
                      "indices": np.array([[0, 20], [20, 20], [20, 40]], dtype=np.uint32)})
    writer.finish()
    with pytest.raises(MtrainError, match=r"spans/shard\.00000\.mds sample 0 document 1: empty document"):
        run_pack(env, [tmp_path / "spans"], tmp_path / "out", seq_len=16)
    manifest = run_pack(env, [tmp_path / "spans"], tmp_path / "out2", seq_len=16, skip_empty=True)
    assert manifest["per_source"][0]["skipped_empty_documents"] == 4
    assert manifest["per_source"][0]["documents_available"] == 8
