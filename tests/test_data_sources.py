"""Packing features: jsonl / parquet / save_to_disk sources, same-tokenizer MDS with the BOS/EOS policy,
replay of a short source, length-sorted order, the CLI (flags and manifest YAML) and the shipped manifests."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from mtrain.data import pack
from mtrain.data.mds import MDSFolder
from mtrain.errors import MtrainError
from test_data_pack import make_docs, make_tokenizer, recover_documents, write_prolong_mds

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {"qwen": (root / "qwen", make_tokenizer(root / "qwen", 320, llama_like=False)),
            "llama": (root / "llama", make_tokenizer(root / "llama", 360, llama_like=True))}


def samples_of(out) -> list[dict]:
    folder = MDSFolder(str(out))
    return [folder[i] for i in range(len(folder))]


def test_text_formats_jsonl_parquet_hf_documents_kept(toks, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok_dir, tok = toks["qwen"]
    docs = {"jsonl": make_docs(80, seed=21), "parquet": make_docs(70, seed=22), "hf": make_docs(60, seed=23)}
    (tmp_path / "web").mkdir()
    for part, chunk in enumerate((docs["jsonl"][:50], docs["jsonl"][50:])):  # a folder of two files
        with open(tmp_path / "web" / f"part{part}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in chunk)
    pq.write_table(pa.table({"text": docs["parquet"]}), tmp_path / "books.parquet", row_group_size=20)
    datasets.Dataset.from_dict({"text": docs["hf"]}).save_to_disk(str(tmp_path / "wiki"))
    manifest = pack([str(tmp_path / "web"), str(tmp_path / "books.parquet"), f"{tmp_path / 'wiki'}:hf"],
                    str(tok_dir), 128, str(tmp_path / "out"), workers=2, progress=False)
    assert [s["name"] for s in manifest["per_source"]] == ["web", "books", "wiki"]
    assert [s["documents_available"] for s in manifest["per_source"]] == [80, 70, 60]
    complete, tail = recover_documents(samples_of(tmp_path / "out"), tok.eos_token_id)
    expected = collections.Counter(tuple(tok(t)["input_ids"] + [tok.eos_token_id]) for d in docs.values() for t in d)
    got = collections.Counter(complete)
    missing = expected - got
    assert not (got - expected)
    # missing: only what lies past the last whole sample (the cut document and those after it)
    assert sum(missing.values()) == manifest["dropped_tail_documents"] + bool(tail)
    assert sum(map(len, missing.elements())) - len(tail) == manifest["dropped_tail_tokens"] < 128
    assert not tail or any(doc[: len(tail)] == tail for doc in missing)


def test_same_tokenizer_mds_keeps_ids_and_applies_bos_eos(toks, tmp_path):
    tok_dir, tok = toks["llama"]
    docs = make_docs(120, seed=31)
    starts = np.cumsum([0] + [len(tok(t)["input_ids"]) + 1 for t in docs])[:-1]
    # a sample length that cuts some document right after its BOS: that span holds only BOS
    sample_len = next(n for n in range(150, 400) if np.any((starts[1:] + 1) % n == 0))
    write_prolong_mds(tmp_path / "src", docs, tok, sample_len, "web", compression=None, split=True)
    source = MDSFolder(str(tmp_path / "src"))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    expected, special_only = collections.Counter(), 0
    for i in range(len(source)):
        s = source[i]
        for a, b in s["indices"]:
            core = [t for t in s["input_ids"][a:b].tolist()]
            while core and core[0] == bos:
                core = core[1:]
            while core and core[-1] == eos:
                core = core[:-1]
            if core:
                expected[tuple([bos, *core, eos])] += 1  # auto policy: this tokenizer adds BOS itself
            else:
                special_only += 1
    manifest = pack([str(tmp_path / "src")], str(tok_dir), 96, str(tmp_path / "out"), source_tokenizer=str(tok_dir),
                    workers=1, progress=False)
    assert manifest["bos_id"] == bos and manifest["eos_id"] == eos
    assert manifest["per_source"][0]["special_token_only_spans"] == special_only > 0
    complete, tail = recover_documents(samples_of(tmp_path / "out"), eos)
    got = collections.Counter(complete)
    assert not (got - expected)
    assert sum((expected - got).values()) == manifest["dropped_tail_documents"] + bool(tail)


def test_replay_repeats_a_short_source_to_its_share(toks, tmp_path):
    tok_dir, tok = toks["qwen"]
    for name, n, seed in (("long", 300, 41), ("short", 25, 42)):
        with open(tmp_path / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in make_docs(n, seed=seed))
    specs = [{"path": str(tmp_path / "long.jsonl"), "proportion": 0.6},
             {"path": str(tmp_path / "short.jsonl"), "proportion": 0.4, "replay": True}]
    manifest = pack(specs, str(tok_dir), 128, str(tmp_path / "out"), workers=1, progress=False)
    long, short = manifest["per_source"]
    assert long["passes"] == 1 and long["documents_packed"] == 300
    assert short["passes"] >= 5 and short["documents_packed"] > short["documents_available"] * (short["passes"] - 1)
    assert abs(short["share"] - 0.4) < 0.02 and abs(long["share"] - 0.6) < 0.02
    specs[1]["replay"] = False
    with pytest.raises(MtrainError, match="mark it `replay: true`"):
        pack(specs, str(tok_dir), 128, str(tmp_path / "out2"), total_tokens=10**6, workers=1, progress=False)


def test_length_order_puts_long_documents_first(toks, tmp_path):
    tok_dir, tok = toks["qwen"]
    with open(tmp_path / "d.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in make_docs(150, seed=51))
    pack([str(tmp_path / "d.jsonl")], str(tok_dir), 256, str(tmp_path / "out"), order="length", workers=1,
         progress=False)
    complete, _ = recover_documents(samples_of(tmp_path / "out"), tok.eos_token_id)
    lengths = [len(d) for d in complete]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > 3 * lengths[-1]


def test_cli_flags_and_manifest_yaml(toks, tmp_path, capsys):
    from mtrain.cli import main

    tok_dir, _ = toks["qwen"]
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "a.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in make_docs(60, seed=61))
    with open(tmp_path / "src" / "b.jsonl", "w") as fh:
        fh.writelines(json.dumps({"body": t}) + "\n" for t in make_docs(60, seed=62))
    flags = ["pack", "--source", f"{tmp_path / 'src' / 'a.jsonl'}:jsonl@0.7", "--tokenizer", str(tok_dir),
             "--seq-len", "64", "--out", str(tmp_path / "by-flags"), "--workers", "1", "--no-progress"]
    # b.jsonl keeps its text under `body`: only a manifest can say so; with flags it is a missing field
    assert main(flags + ["--source", f"{tmp_path / 'src' / 'b.jsonl'}@0.3"]) == 2
    assert "missing field `text`" in capsys.readouterr().err
    (tmp_path / "mix.yaml").write_text(
        f"root: src\ntokenizer: {tok_dir}\nseq_len: 64\nout: by-yaml\nworkers: 1\nprogress: false\n"
        "sources:\n  - {path: a.jsonl, format: jsonl, proportion: 0.7}\n"
        "  - {path: b.jsonl, field: body, proportion: 0.3}\n"
    )
    assert main(["pack", str(tmp_path / "mix.yaml")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["seq_len"] == 64 and abs(summary["shares"]["a"] - 0.7) < 0.02
    manifest = json.loads((tmp_path / "by-yaml" / "manifest.json").read_text())
    assert manifest["num_samples"] == summary["num_samples"]
    with pytest.raises(SystemExit) as exc:
        main(["pack", "--help"])
    assert exc.value.code == 0 and "PROPORTION" in capsys.readouterr().out


@pytest.mark.parametrize("name,seq_len,shares", [
    ("prolong-512k.yaml", 524288, {"code-repos-512K": 0.15, "code-repos-64K": 0.15, "books-512K": 0.05,
                                   "books-64K": 0.25, "fineweb-edu": 0.10, "fineweb-2023-50": 0.10,
                                   "stackexchange": 0.04, "wikipedia": 0.04, "tulu-v2": 0.03, "arxiv": 0.03,
                                   "openwebmath": 0.03, "textbooks": 0.03}),
    ("prolong-64k.yaml", 65536, {"code-repos-64K": 0.30, "books-64K": 0.30, "fineweb-edu": 0.10,
                                 "fineweb-2023-50": 0.10, "stackexchange": 0.04, "wikipedia": 0.04,
                                 "tulu-v2": 0.03, "arxiv": 0.03, "openwebmath": 0.03, "textbooks": 0.03}),
])
def test_shipped_prolong_manifests(name, seq_len, shares):
    from mtrain.data.cli import _load_manifest
    from mtrain.data.sources import source_from_dict

    config = _load_manifest(str(ROOT / "data" / name))
    assert config["seq_len"] == seq_len
    specs = [source_from_dict(e, "root", name) for e in config["sources"]]
    assert {s.label(): s.proportion for s in specs} == shares
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(s.format == "mds" and s.path.startswith("root/") for s in specs)


def test_special_token_text_inside_a_document_is_not_a_boundary(toks, tmp_path):
    tok_dir, tok = toks["qwen"]
    docs = ["river stone <|endoftext|> light window " * 3, "market garden " * 5]
    with open(tmp_path / "d.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    pack([str(tmp_path / "d.jsonl")], str(tok_dir), 16, str(tmp_path / "out"), workers=1, progress=False,
         order="length")
    stream = np.concatenate([s["input_ids"] for s in samples_of(tmp_path / "out")]).tolist()
    eos = tok.eos_token_id
    first_doc = stream[: stream.index(eos) + 1]
    # one EOS, at the end; the literal text is spelled out in ordinary tokens
    assert tok.decode(first_doc[:-1]) == docs[0]


def test_explicit_separator_token_and_no_bos(toks, tmp_path):
    tok_dir, tok = toks["llama"]
    docs = make_docs(40, seed=71)
    with open(tmp_path / "d.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    manifest = pack([str(tmp_path / "d.jsonl")], str(tok_dir), 64, str(tmp_path / "out"), bos="never", eos="<s>",
                    order="length", workers=1, progress=False)
    sep = tok.convert_tokens_to_ids("<s>")
    assert manifest["bos_id"] is None and manifest["eos_id"] == sep
    complete, _ = recover_documents(samples_of(tmp_path / "out"), sep)
    expected = {tuple(tok(t, add_special_tokens=False)["input_ids"] + [sep]) for t in docs}
    assert complete and all(doc in expected for doc in complete)
    with pytest.raises(MtrainError, match="'<nope>': not a token of"):
        pack([str(tmp_path / "d.jsonl")], str(tok_dir), 64, str(tmp_path / "o2"), eos="<nope>")
