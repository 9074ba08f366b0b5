"""A catalogue of bad inputs and faults, one per line, grouped by stage (config, pack, train, export, eval,
compare): each exits non-zero (2 for a user error) with one line naming the file or key and a fix, no
traceback, and leaves nothing that looks complete. Then planted payloads (pickle in a checkpoint, a `pkl`
MDS column) that must never run, checkpoint fall-back, a run-folder lock, resume with changed optim
settings, SIGTERM's exit status, pack workers dying with their parent, and no network for a mistyped path.

Most cases call `mtrain.cli.main` in-process; a process of its own is used only where the process itself is the
subject: forked from the CLI's server (tests/ranks.py start) for signals, orphans and a second pack, a fresh
interpreter where what it starts with matters (the offline default of a bare `mtrain`, strace, a mount namespace).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from mtrain.cli import main
from mtrain.data.synthetic import CorpusSpec, generate, write_jsonl
from mtrain.tiny import MODEL_CONFIG, TOKENIZER_DIR
from planted import Payload
from ranks import start

REPO = Path(__file__).resolve().parents[1]
SEQ = 128
# files whose presence says "this output is finished": none may appear after a failed command
COMPLETE = ("index.json", "manifest.json", "latest", "results.json", "config.json", "compare.png")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Packed synthetic data, a recipe, a 2-step run with checkpoints at steps 1 and 2, and its export."""
    from mtrain.data import pack

    root = tmp_path_factory.mktemp("world")
    write_jsonl(root / "docs.jsonl", generate(CorpusSpec(num_docs=40, max_sentences=20, seed=5)))
    pack([f"{root / 'docs.jsonl'}:jsonl"], str(TOKENIZER_DIR), SEQ, root / "packed", progress=False, workers=1)
    recipe = {
        "model": {"config": str(MODEL_CONFIG), "tokenizer": str(TOKENIZER_DIR)},
        "data": {"path": str(root / "packed"), "seq_len": SEQ},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "logging": {"wandb": "disabled"},
        "train": {"output_dir": str(root / "run"), "max_steps": 2, "save_every": 1},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(root / "recipe.yaml")]) == 0
    assert (root / "run" / "final" / "config.json").is_file()
    return root


@pytest.fixture(autouse=True)
def fresh_logging(monkeypatch):
    """Each `main()` call logs to the stderr of the test that runs it; the offline variables `main()` sets
    do not outlive the test."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    yield
    root.handlers[:] = saved


def copy_run(world: Path, dest: Path) -> Path:
    shutil.copytree(world / "run", dest, ignore=shutil.ignore_patterns(".mtrain.lock"))
    return dest


def completion_markers(root: Path) -> set[str]:
    """Finished-looking files, outside a pack's `.work/` (kept on failure so a rerun resumes; never read as a pack)."""
    return {str(p) for p in root.rglob("*") if p.name in COMPLETE and ".work" not in p.relative_to(root).parts}


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    return rc, capsys.readouterr().err


def assert_one_line(err: str, *needles: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("mtrain ")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------- the catalogue
# Each case: (id, setup) where setup(ctx) returns (argv, [substrings of the error line], exit code).


class Ctx:
    def __init__(self, world: Path, tmp: Path):
        self.world, self.tmp = world, tmp
        self.recipe = str(world / "recipe.yaml")

    def train(self, *overrides: str) -> list[str]:
        args = ["train", self.recipe, "--set", f"train.output_dir={self.tmp / 'out'}"]
        for o in overrides:
            args += ["--set", o]
        return args

    def file(self, name: str, text: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path

    def folder(self, name: str, files: dict | None = None) -> Path:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        for k, v in (files or {}).items():
            (path / k).write_text(v)
        return path

    def run_copy(self) -> Path:
        return copy_run(self.world, self.tmp / "run")

    def model_copy(self) -> Path:
        return Path(shutil.copytree(self.world / "run" / "final", self.tmp / "model"))

    def pack(self, *extra: str, tokenizer: str | None = None, out: str | None = None) -> list[str]:
        return ["pack", "--source", f"{self.world / 'docs.jsonl'}:jsonl", "--tokenizer", tokenizer or str(TOKENIZER_DIR),
                "--seq-len", str(SEQ), "--out", out or str(self.tmp / "packed"), "--workers", "1", "--no-progress",
                *extra]


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _latest(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


def _pkl_mds(folder: Path, columns: dict, sample: dict) -> Path:
    from mtrain.data.mds import mds_writer

    writer = mds_writer(str(folder), columns, compression=None, size_limit=None)
    writer.write(sample)
    writer.finish()
    return folder


def _hidden_pkl_mds(folder: Path, columns: dict, sample: dict, payload: Payload, under: str) -> Path:
    """An MDS folder whose `pkl` column is listed under the name `under` of another column: a lookup by name sees
    only the other column's encoding, while the reader decodes every column by position (the payload first)."""
    _pkl_mds(folder, {"_hidden": "pkl", **columns}, {"_hidden": payload, **sample})  # sorted: _hidden comes first
    index = json.loads((folder / "index.json").read_text())
    for shard in index["shards"]:
        assert shard["column_names"][0] == "_hidden" and shard["column_encodings"][0] == "pkl"
        shard["column_names"][0] = under
    (folder / "index.json").write_text(json.dumps(index))
    return folder


def _damage_every_checkpoint(c: Ctx) -> Path:
    run = c.run_copy()
    for ckpt in (run / "checkpoints").glob("step-*"):
        _truncate(ckpt / "model.safetensors")
    return run


CONFIG = [
    ("grad_clip-negative", lambda c: (c.train("optim.grad_clip=-1"), ["optim.grad_clip", ">= 0"], 2)),
    ("lr-nan", lambda c: (c.train("optim.lr=.nan"), ["optim.lr", "finite"], 2)),
    ("lr-inf", lambda c: (c.train("optim.lr=.inf"), ["optim.lr", "finite"], 2)),
    ("lr-zero", lambda c: (c.train("optim.lr=0"), ["optim.lr", "positive"], 2)),
    ("lr-text", lambda c: (c.train("optim.lr=fast"), ["optim.lr", "expected a number"], 2)),
    ("eps-zero", lambda c: (c.train("optim.eps=0"), ["optim.eps", "positive"], 2)),
    ("betas-one", lambda c: (c.train("optim.betas=[0.9, 1.0]"), ["optim.betas", "[0, 1)"], 2)),
    ("betas-short", lambda c: (c.train("optim.betas=[0.9]"), ["optim.betas", "2 values"], 2)),
    ("weight_decay-negative", lambda c: (c.train("optim.weight_decay=-0.1"), ["optim.weight_decay", ">= 0"], 2)),
    ("warmup_steps-negative", lambda c: (c.train("optim.warmup_steps=-1"), ["optim.warmup_steps", ">= 0"], 2)),
    ("warmup_ratio-over-1", lambda c: (c.train("optim.warmup_ratio=1.5"), ["warmup_ratio"], 2)),
    ("min_lr_ratio-over-1", lambda c: (c.train("optim.min_lr_ratio=2"), ["min_lr_ratio"], 2)),
    ("schedule-typo", lambda c: (c.train("optim.schedule=cosin"), ["optim.schedule", "did you mean 'cosine'"], 2)),
    ("max_steps-zero", lambda c: (c.train("train.max_steps=0"), ["train.max_steps", "positive"], 2)),
    ("max_steps-text", lambda c: (c.train("train.max_steps=ten"), ["train.max_steps", "integer"], 2)),
    ("save_every-negative", lambda c: (c.train("train.save_every=-1"), ["train.save_every", ">= 0"], 2)),
    ("seed-negative", lambda c: (c.train("train.seed=-3"), ["train.seed", ">= 0"], 2)),
    ("max_bad_steps-negative", lambda c: (c.train("train.max_bad_steps=-1"), ["train.max_bad_steps", ">= 0"], 2)),
    ("micro_batch-zero", lambda c: (c.train("train.micro_batch_size=0"), ["train.micro_batch_size", "positive"], 2)),
    ("grad_accum-negative", lambda c: (c.train("train.grad_accum=-2"), ["train.grad_accum", "positive"], 2)),
    ("loss_chunk-zero", lambda c: (c.train("train.loss_chunk=0"), ["train.loss_chunk", "positive"], 2)),
    ("seq_len-zero", lambda c: (c.train("data.seq_len=0"), ["data.seq_len", "positive"], 2)),
    ("rope_theta-zero", lambda c: (c.train("model.rope_theta=0"), ["model.rope_theta", "positive"], 2)),
    ("rope_factor-negative", lambda c: (c.train("model.rope_scaling={rope_type: yarn, factor: -4, "
                                                "original_max_position_embeddings: 64}"),
                                        ["model.rope_scaling.factor", "positive"], 2)),
    ("yarn-no-original", lambda c: (c.train("model.rope_scaling={rope_type: yarn, factor: 4}"),
                                    ["original_max_position_embeddings"], 2)),
    ("max_position-negative", lambda c: (c.train("model.max_position_embeddings=-1"),
                                         ["model.max_position_embeddings", "positive"], 2)),
    ("recall-over-1", lambda c: (c.train("attention.recall=1.5"), ["attention.recall"], 2)),
    ("attention-kind-typo", lambda c: (c.train("attention.kind=mtrainig"), ["attention.kind", "mtraining"], 2)),
    ("cp_size-zero", lambda c: (c.train("parallel.cp_size=0"), ["parallel.cp_size", "positive"], 2)),
    ("layout-unknown", lambda c: (c.train("parallel.layout=diagonal"), ["parallel.layout"], 2)),
    ("wandb-mode-unknown", lambda c: (c.train("logging.wandb=sometimes"), ["logging.wandb"], 2)),
    ("log_every-zero", lambda c: (c.train("logging.log_every=0"), ["logging.log_every", "positive"], 2)),
    ("unknown-key", lambda c: (c.train("train.max_step=3"), ["train.max_step'", "did you mean 'max_steps'"], 2)),
    ("unknown-section", lambda c: (c.train("trian.max_steps=3"), ["unknown section 'trian'"], 2)),
    ("override-no-equals", lambda c: (c.train("train.max_steps"), ["section.key=value"], 2)),
    ("recipe-missing", lambda c: (["train", str(c.tmp / "nope.yaml")], ["nope.yaml", "does not exist"], 2)),
    ("recipe-torn-yaml", lambda c: (["train", str(c.file("torn.yaml", "model: {config: [unclosed\n"))],
                                    ["torn.yaml", "not valid YAML"], 2)),
    ("recipe-a-list", lambda c: (["train", str(c.file("list.yaml", "- a\n- b\n"))], ["list.yaml", "mapping"], 2)),
    ("model-path-and-config", lambda c: (c.train(f"model.path={c.world / 'run' / 'final'}"),
                                         ["exactly one of 'model.path'"], 2)),
    ("model-config-missing", lambda c: (c.train(f"model.config={c.tmp / 'small.json'}"),
                                        ["model.config", "small.json", "does not exist"], 2)),
    ("model-config-a-folder", lambda c: (c.train(f"model.config={c.folder('cfgdir')}"),
                                         ["model.config", "cfgdir", "not a file"], 2)),
    ("model-config-torn", lambda c: (c.train("model.config=" + str(c.file("torn.json", '{"model_type": "qw'))),
                                     ["model.config", "torn.json", "not readable JSON"], 2)),
    ("model-config-no-type", lambda c: (c.train(f"model.config={c.file('notype.json', '{}')}"),
                                        ["model.config", "notype.json", "model_type"], 2)),
    ("tokenizer-folder-empty", lambda c: (c.train(f"model.tokenizer={c.folder('tok', {'tokenizer_config.json': '{}'})}"),
                                          ["model.tokenizer", "tok", "no tokenizer files"], 2)),
    ("model-path-no-config", lambda c: (c.train("model.config=null", f"model.path={c.folder('ckpt')}"),
                                        ["model.path", "ckpt", "no config.json"], 2)),
    ("model-path-without-tokenizer", lambda c: (
        c.train("model.config=null", "model.tokenizer=null",
                f"model.path={c.folder('bare', {'config.json': json.dumps({'model_type': 'qwen2'})})}"),
        ["model.path", "bare", "no tokenizer files"], 2)),
    ("model-path-hub-shaped-typo", lambda c: (c.train("model.config=null", "model.path=modles/smollm2-135m"),
                                              ["model.path", "modles/smollm2-135m", "not a local path"], 2)),
    ("data-path-missing", lambda c: (c.train(f"data.path={c.tmp / 'nodata'}"), ["data.path", "nodata", "mtrain pack"], 2)),
    ("data-path-unfinished-pack", lambda c: (c.train(f"data.path={c.folder('half', {'manifest.json': '{}'})}"),
                                             ["data.path", "half", "index.json"], 2)),
    ("output_dir-is-a-file", lambda c: (c.train(f"train.output_dir={c.file('outfile', 'x')}"),
                                        ["train.output_dir", "outfile", "is a file"], 2)),
    ("output_dir-under-a-file", lambda c: (c.train(f"train.output_dir={c.file('blocker', 'x') / 'run'}"),
                                           ["train.output_dir", "blocker", "is a file"], 2)),
    ("deepspeed-missing", lambda c: (c.train(f"train.deepspeed={c.tmp / 'z2.json'}"), ["train.deepspeed", "z2.json"], 2)),
    ("deepspeed-a-folder", lambda c: (c.train(f"train.deepspeed={c.folder('dsdir')}"), ["train.deepspeed", "dsdir"], 2)),
]


def _latin1_jsonl(c: Ctx) -> list[str]:
    """Good lines around one written in Latin-1 (an e-acute as the single byte 0xe9, not UTF-8)."""
    lines = (c.world / "docs.jsonl").read_bytes().splitlines()
    bad = c.file("latin.jsonl", b"\n".join([*lines[:3], '{"text": "caf\u00e9 au lait"}'.encode("latin-1"),
                                            *lines[3:6]]) + b"\n")
    return c.pack()[:1] + ["--source", f"{bad}:jsonl"] + c.pack()[3:]


def _body_jsonl(c: Ctx) -> Path:
    """The world's documents under the key `body` instead of `text`."""
    lines = (c.world / "docs.jsonl").read_text().splitlines()
    return c.file("body.jsonl", "".join(json.dumps({"body": json.loads(line)["text"]}) + "\n" for line in lines))


def _with_source(c: Ctx, source: str) -> list[str]:
    return c.pack()[:1] + ["--source", source] + c.pack()[3:]


def _changed_mds_source(c: Ctx) -> list[str]:
    """A copy of the world's packed data (mtrain's manifest.json lists each shard's sha256) in which one token id
    of the first sample got its high byte set, as a flipped bit on disk would: read as tokens it is an id outside
    the tokenizer (what pack used to report, a tokenizer mismatch)."""
    import numpy as np

    from mtrain.data.mds import MDSFolder

    data = Path(shutil.copytree(c.world / "packed", c.tmp / "mdssrc"))
    ids = np.asarray(MDSFolder(str(data))[0]["input_ids"], dtype=np.uint32)
    shard = data / "shard.00000.mds"
    raw = bytearray(shard.read_bytes())
    at = raw.find(ids[:16].tobytes())
    assert at > 0 and raw.find(ids[:16].tobytes(), at + 1) < 0
    raw[at + 4 * 5 + 3] = 0x01  # token 5 + 2**24
    shard.write_bytes(bytes(raw))
    return ["pack", "--source", f"{data}:mds", "--tokenizer", str(TOKENIZER_DIR), "--seq-len", "64", "--out",
            str(c.tmp / "p"), "--workers", "1", "--no-progress"]


def _pack_manifest(c: Ctx, text: str) -> list[str]:
    return ["pack", str(c.file("mix.yaml", text)), "--no-progress"]


PACK = [
    ("no-sources", lambda c: (["pack", "--tokenizer", str(TOKENIZER_DIR), "--seq-len", "128", "--out",
                               str(c.tmp / "p")], ["give sources"], 2)),
    ("no-seq-len", lambda c: (["pack", "--source", "x.jsonl", "--tokenizer", str(TOKENIZER_DIR), "--out",
                               str(c.tmp / "p")], ["--seq-len is required"], 2)),
    ("source-missing", lambda c: (c.pack() [:1] + ["--source", str(c.tmp / "gone.jsonl")] + c.pack()[3:],
                                  ["gone.jsonl", "no such file"], 2)),
    ("seq_len-one", lambda c: (c.pack()[:6] + ["1"] + c.pack()[7:], ["seq_len 1 is too small"], 2)),
    ("seq_len-negative", lambda c: (c.pack()[:6] + ["-5"] + c.pack()[7:], ["too small"], 2)),
    ("workers-zero", lambda c: (c.pack()[:10] + ["0"] + c.pack()[11:], ["--workers", ">= 1"], 2)),
    ("total_tokens-zero", lambda c: (c.pack("--total-tokens", "0"), ["--total-tokens", ">= 1"], 2)),
    ("samples_per_shard-zero", lambda c: (c.pack("--samples-per-shard", "0"), ["--samples-per-shard", ">= 1"], 2)),
    ("proportion-nan", lambda c: (["pack", "--source", f"{c.world / 'docs.jsonl'}:jsonl@nan", "--tokenizer",
                                   str(TOKENIZER_DIR), "--seq-len", "128", "--out", str(c.tmp / "p")],
                                  ["proportion", "finite"], 2)),
    ("proportion-text", lambda c: (["pack", "--source", f"{c.world / 'docs.jsonl'}@lots", "--tokenizer",
                                    str(TOKENIZER_DIR), "--seq-len", "128", "--out", str(c.tmp / "p")],
                                   ["proportion 'lots'"], 2)),
    ("tokenizer-missing-folder", lambda c: (c.pack(tokenizer=str(c.tmp / "toks")), ["--tokenizer", "toks",
                                                                                     "no such folder"], 2)),
    ("tokenizer-hub-shaped-typo", lambda c: (c.pack(tokenizer="assets/tiny-tokenzier"),
                                             ["assets/tiny-tokenzier", "no hub tokenizer in the local cache"], 2)),
    ("tokenizer-is-a-file", lambda c: (c.pack(tokenizer=str(TOKENIZER_DIR / "tokenizer.json")),
                                       ["tokenizer.json", "is a file"], 2)),
    ("out-is-a-file", lambda c: (c.pack(out=str(c.file("pfile", "x"))), ["--out", "pfile", "is a file"], 2)),
    ("out-not-empty", lambda c: (c.pack(out=str(c.folder("busy", {"notes.txt": "mine"}))),
                                 ["busy", "not empty"], 2)),
    ("source-not-utf8", lambda c: (_latin1_jsonl(c), ["latin.jsonl", "at byte", "not UTF-8", "e9", "re-encode"], 2)),
    ("manifest-missing", lambda c: (["pack", str(c.tmp / "mix.yaml")], ["mix.yaml", "no such manifest"], 2)),
    ("manifest-torn-yaml", lambda c: (_pack_manifest(c, "sources: [unclosed\n"), ["mix.yaml", "not valid YAML"], 2)),
    ("manifest-unknown-key", lambda c: (_pack_manifest(c, "sources: []\nseq_lenn: 4\n"), ["mix.yaml", "seq_lenn"], 2)),
    ("manifest-source-no-path", lambda c: (_pack_manifest(c, "sources: [{name: web}]\n"), ["needs a `path`"], 2)),
    ("jsonl-without-text-field", lambda c: (_with_source(c, f"{_body_jsonl(c)}:jsonl"),
                                            ["body.jsonl", "missing field `text`", "'body'",
                                             "--source PATH:FORMAT:field=NAME"], 2)),
    ("field-option-empty", lambda c: (_with_source(c, f"{_body_jsonl(c)}:jsonl:field="),
                                      ["field=", "names no field"], 2)),
    ("format-unknown", lambda c: (_with_source(c, f"{c.world / 'docs.jsonl'}:jsonlines"),
                                  ["unknown format 'jsonlines'", "mds, jsonl, parquet, hf"], 2)),
    ("format-unknown-in-manifest", lambda c: (_pack_manifest(c, f"sources: [{{path: {c.world / 'docs.jsonl'}, format: "
                                                                f"jsonlines}}]\ntokenizer: {TOKENIZER_DIR}\nseq_len: 128"
                                                                f"\nout: {c.tmp / 'p'}\n"),
                                              ["unknown format 'jsonlines'", "mds, jsonl, parquet, hf"], 2)),
    ("tokenizer-folder-without-tokenizer-files", lambda c: (
        c.pack(tokenizer=str(c.folder("tok", {"tokenizer_config.json": "{}", "config.json": "{}"}))),
        ["tokenizer", "tok", "no tokenizer files", "tokenizer.json", "tokenizer.model"], 2)),
    ("mds-source-shard-changed", lambda c: (_changed_mds_source(c),
                                            ["mdssrc/shard.00000.mds", "sha256 does not match manifest.json"], 2)),
    ("mds-source-pkl-column", lambda c: (
        ["pack", "--source", f"{_pkl_mds(c.tmp / 'pklsrc', {'text': 'pkl'}, {'text': Payload(c.tmp / 'PWNED')})}:mds",
         "--tokenizer", str(TOKENIZER_DIR), "--seq-len", "128", "--out", str(c.tmp / "p"), "--workers", "1"],
        ["pklsrc", "pickle", "re-encode"], 2)),
    ("mds-source-pkl-under-a-duplicate-name", lambda c: (
        ["pack", "--source", str(_hidden_pkl_mds(c.tmp / "dupsrc", {"text": "str"}, {"text": "plain words " * 200},
                                                 Payload(c.tmp / "PWNED"), "text")) + ":mds",
         "--tokenizer", str(TOKENIZER_DIR), "--seq-len", "128", "--out", str(c.tmp / "p"), "--workers", "1"],
        ["dupsrc", "distinct", "'text'", "listed more than once"], 2)),
]


def _with_broken_data(c: Ctx, damage) -> list[str]:
    data = Path(shutil.copytree(c.world / "packed", c.tmp / "data"))
    damage(data)
    return c.train(f"data.path={data}")


def _flip_shard(data: Path) -> None:
    shard = next(data.glob("shard.*.mds"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))


def _marked_run(c: Ctx, text: str) -> Path:
    run = c.run_copy()
    (run / "checkpoints" / "latest").write_text(text)
    return run


def _marker(c: Ctx, text: str) -> list[str]:
    return c.train(f"train.output_dir={_marked_run(c, text)}", "train.max_steps=3")


def _escape_link(c: Ctx) -> list[str]:
    run = c.run_copy()
    outside = Path(shutil.copytree(_latest(run), c.tmp / "elsewhere"))
    shutil.rmtree(run / "checkpoints" / "step-0000002")
    (run / "checkpoints" / "step-0000002").symlink_to(outside)
    return c.train(f"train.output_dir={run}", "train.max_steps=3")


def _small_embedding(c: Ctx, rows: int) -> list[str]:
    """The tiny model with fewer embedding rows than the tiny tokenizer (and the packed data) has tokens."""
    config = json.loads(MODEL_CONFIG.read_text())
    config["vocab_size"] = rows
    return c.train(f"model.config={c.file('small.json', json.dumps(config))}")


TRAIN = [
    ("tokenizer-larger-than-embedding", lambda c: (_small_embedding(c, 512),
                                                   ["model.tokenizer", "tokens", "small.json", "512 rows",
                                                    "vocab_size >="], 2)),
    ("model-path-weights-truncated", lambda c: (c.train("model.config=null", "model.path=" + str(_eval_model(
        c, lambda m: _truncate(m / "model.safetensors")))), ["model.path", "model.safetensors", "truncated",
                                                             "restore the checkpoint"], 2)),
    ("max_steps-below-resumed-step", lambda c: (c.train(f"train.output_dir={c.run_copy()}", "train.max_steps=1"),
                                                ["train.max_steps=1", "below step 2", "step-0000002",
                                                 "train.max_steps >= 2", "train.output_dir"], 2)),
    ("data-seq_len-mismatch", lambda c: (c.train("data.seq_len=64"), ["data.seq_len=64", "seq_len=128"], 2)),
    ("data-shard-truncated", lambda c: (_with_broken_data(c, lambda d: _truncate(next(d.glob("shard.*.mds")))),
                                        ["shard.00000.mds", "truncated"], 2)),
    ("data-shard-bitflip", lambda c: (_with_broken_data(c, _flip_shard), ["shard.00000.mds", "sha256", "manifest.json"], 2)),
    ("data-manifest-torn", lambda c: (_with_broken_data(c, lambda d: _truncate(d / "manifest.json")),
                                      ["manifest.json", "corrupt manifest"], 2)),
    ("data-index-torn", lambda c: (_with_broken_data(c, lambda d: _truncate(d / "index.json")),
                                   ["index.json", "corrupt MDS index"], 2)),
    ("marker-escapes-run", lambda c: (_marker(c, "../../elsewhere"), ["latest", "not a checkpoint folder"], 2)),
    ("marker-names-missing", lambda c: (_marker(c, "step-0000009"), ["latest", "missing folder"], 2)),
    ("checkpoint-link-outside", lambda c: (_escape_link(c), ["outside"], 2)),
    ("every-checkpoint-damaged", lambda c: (c.train(f"train.output_dir={_damage_every_checkpoint(c)}",
                                                    "train.max_steps=3"),
                                            ["no intact checkpoint", "model.safetensors", "move"], 2)),
]


def _export_damaged(c: Ctx) -> list[str]:
    run = c.run_copy()
    _truncate(_latest(run) / "model.safetensors")
    return ["export", str(run), "--out", str(c.tmp / "hf")]


EXPORT = [
    ("run-missing", lambda c: (["export", str(c.tmp / "norun"), "--out", str(c.tmp / "hf")], ["norun", "no such run"], 2)),
    ("run-without-checkpoints", lambda c: (["export", str(c.folder("empty")), "--out", str(c.tmp / "hf")],
                                           ["empty", "no checkpoints/latest"], 2)),
    ("out-is-a-file", lambda c: (["export", str(c.world / "run"), "--out", str(c.file("hffile", "x"))],
                                 ["hffile", "not a HF checkpoint folder"], 2)),
    ("out-holds-other-files", lambda c: (["export", str(c.world / "run"), "--out", str(c.folder("mine", {"a.txt": "x"}))],
                                         ["mine", "would replace"], 2)),
    ("latest-damaged", lambda c: (_export_damaged(c), ["step-0000002", "model.safetensors", "previous intact",
                                                       "step-0000001"], 2)),
    ("marker-escapes", lambda c: (["export", str(_marked_run(c, "/etc")), "--out", str(c.tmp / "hf")],
                                  ["latest", "not a checkpoint folder"], 2)),
]


def _eval(c: Ctx, model: Path, *extra: str) -> list[str]:
    return ["eval", "--model", str(model), "--out", str(c.tmp / "ev"), "--tasks", "niah", "--lengths", "256",
            "--samples", "1", "--no-progress", *extra]


def _eval_model(c: Ctx, damage) -> Path:
    model = c.model_copy()
    damage(model)
    return model


def _torn_predictions(c: Ctx) -> list[str]:
    pred = c.folder("ev/predictions")
    (pred / "niah.jsonl").write_text('{"task": "niah", "length": 256, "index": 0}\n{"task": "ni\n')
    return ["eval", "--score-only", "--out", str(c.tmp / "ev")]


EVAL = [
    ("model-missing", lambda c: (_eval(c, c.tmp / "nomodel"), ["nomodel", "no such folder"], 2)),
    ("model-hub-shaped-typo", lambda c: (_eval(c, Path("runs/tiny/fnial")), ["runs/tiny/fnial", "no such folder"], 2)),
    ("model-no-config", lambda c: (_eval(c, _eval_model(c, lambda m: (m / "config.json").unlink())),
                                   ["model", "no config.json"], 2)),
    ("model-config-torn", lambda c: (_eval(c, _eval_model(c, lambda m: _truncate(m / "config.json"))),
                                     ["config.json", "not valid JSON"], 2)),
    ("model-no-tokenizer", lambda c: (_eval(c, _eval_model(c, lambda m: (m / "tokenizer.json").unlink())),
                                      ["model", "no tokenizer files"], 2)),
    ("model-weights-truncated", lambda c: (_eval(c, _eval_model(c, lambda m: _truncate(m / "model.safetensors"))),
                                           ["--model", "model.safetensors", "truncated", "export the run again"], 2)),
    ("model-no-weights", lambda c: (_eval(c, _eval_model(c, lambda m: (m / "model.safetensors").unlink())),
                                    ["model", "no weights"], 2)),
    ("predictions-torn-line", lambda c: (_torn_predictions(c), ["niah.jsonl:2", "damaged prediction record"], 2)),
    ("run-manifest-torn", lambda c: (_eval(c, c.world / "run" / "final", "--out", str(c.file("ev2/manifest.json",
                                                                                          '{"check').parent)),
                                     ["manifest.json", "damaged run manifest"], 2)),
    ("samples-zero", lambda c: (_eval(c, c.world / "run" / "final", "--samples", "0"), ["--samples", "positive"], 2)),
    ("lengths-zero", lambda c: (_eval(c, c.world / "run" / "final", "--lengths", "0"), ["--lengths", "positive"], 2)),
    ("suite-missing", lambda c: (_eval(c, c.world / "run" / "final") + [str(c.tmp / "suite.yaml")],
                                 ["suite.yaml", "not found"], 2)),
    ("suite-torn-yaml", lambda c: (_eval(c, c.world / "run" / "final") + [str(c.file("suite.yaml", "tasks: [x\n"))],
                                   ["suite.yaml", "not valid YAML"], 2)),
    ("out-is-a-file", lambda c: (["eval", "--model", str(c.world / "run" / "final"), "--out", str(c.file("evf", "x"))],
                                 ["evf", "is a file"], 2)),
    ("score-only-empty", lambda c: (["eval", "--score-only", "--out", str(c.folder("ev"))], ["no predictions"], 2)),
]


def _compare_run(c: Ctx, metrics: str | None = None, config: str | None = None) -> str:
    run = c.folder("cr")
    if metrics is not None:
        (run / "metrics.jsonl").write_text(metrics)
    if config is not None:
        (run / "config.yaml").write_text(config)
    return str(run)


ROW = json.dumps({"step": 1, "loss": 5.0, "tokens": 128, "tokens_per_s": 10.0}) + "\n"
COMPARE = [
    ("run-missing", lambda c: (["compare", str(c.tmp / "gone")], ["gone", "no such run folder"], 2)),
    ("no-metrics", lambda c: (["compare", _compare_run(c)], ["cr", "no metrics.jsonl"], 2)),
    ("metrics-empty", lambda c: (["compare", _compare_run(c, metrics="")], ["metrics.jsonl", "no complete steps"], 2)),
    ("metrics-foreign-rows", lambda c: (["compare", _compare_run(c, metrics='{"step": 1}\n')],
                                        ["metrics.jsonl", "record 1", "loss"], 2)),
    ("metrics-text-loss", lambda c: (["compare", _compare_run(c, metrics=ROW.replace("5.0", '"low"'))],
                                     ["metrics.jsonl", "loss"], 2)),
    ("config-torn", lambda c: (["compare", _compare_run(c, metrics=ROW, config="optim: {lr: [\n")],
                               ["config.yaml", "not valid YAML"], 2)),
    ("plot-is-a-folder", lambda c: (["compare", str(c.world / "run"), "--plot", str(c.folder("plotdir"))],
                                    ["--plot", "plotdir"], 2)),
    ("csv-is-a-folder", lambda c: (["compare", str(c.world / "run"), "--plot", str(c.tmp / "compare.png"),
                                    "--csv", str(c.folder("csvdir"))], ["--csv", "csvdir"], 2)),
    ("nothing-to-compare", lambda c: (["compare"], ["nothing to compare", "--wandb"], 2)),
    ("wandb-runs-without-project", lambda c: (["compare", "--runs", "abc123"], ["--runs", "--wandb ENTITY/PROJECT"], 2)),
    ("wandb-project-not-entity-slash-project", lambda c: (["compare", "--wandb", "mtrain", "--runs", "abc123"],
                                                          ["--wandb mtrain", "ENTITY/PROJECT"], 2)),
    ("wandb-without-run-ids", lambda c: (["compare", "--wandb", "team/mtrain"], ["--wandb team/mtrain", "--runs"], 2)),
    ("wandb-log-foreign", lambda c: (["compare", str(c.folder("offline-run-x", {"run-x.wandb": "not a log"}))],
                                     ["run-x.wandb", "not a wandb run log"], 2)),
    ("wandb-log-header-only", lambda c: (["compare", str(c.file("offline-run-y/run-y.wandb", b":W&B\xe1\xbe\x00").parent)],
                                         ["offline-run-y", "no training steps"], 2)),
]

CATALOGUE = [pytest.param(stage, setup, id=f"{stage}:{name}") for stage, cases in
             (("config", CONFIG), ("pack", PACK), ("train", TRAIN), ("export", EXPORT), ("eval", EVAL),
              ("compare", COMPARE))
             for name, setup in cases]


def test_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 60
    assert {p.values[0] for p in CATALOGUE} == {"config", "pack", "train", "export", "eval", "compare"}


@pytest.mark.parametrize("stage, setup", CATALOGUE)
def test_bad_input(stage, setup, world, tmp_path, capsys):
    ctx = Ctx(world, tmp_path)
    argv, needles, code = setup(ctx)
    before = completion_markers(tmp_path)
    world_before = completion_markers(world)
    rc, err = run_cli(argv, capsys)
    assert rc == code, err
    assert_one_line(err, *needles)
    assert completion_markers(tmp_path) <= before, "a failed command left an output that looks complete"
    assert completion_markers(world) == world_before
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------------------------------------- OS faults


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EACCES], ids=["no-space", "read-only", "permission"])
def test_checkpoint_write_fault_is_one_line(world, tmp_path, capsys, monkeypatch, err):
    """A save that the disk refuses: one line naming the folder and the cause; the old checkpoint is kept."""
    from accelerate import Accelerator

    run = copy_run(world, tmp_path / "run")

    def refuse(self, output_dir=None, **kw):
        raise OSError(err, os.strerror(err), str(Path(output_dir) / "model.safetensors"))

    monkeypatch.setattr(Accelerator, "save_state", refuse)
    rc, out = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.max_steps=3"], capsys)
    assert rc == 2
    assert_one_line(out, "step-0000003.tmp", os.strerror(err), "previous checkpoint is untouched")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-0000001", "step-0000002"]


def test_full_disk_inside_torch_save_is_named(world, tmp_path, capsys, monkeypatch):
    """torch.save reports a full disk as RuntimeError('... unexpected pos ...'): still one line, GiB free shown."""
    from accelerate import Accelerator

    run = copy_run(world, tmp_path / "run")
    monkeypatch.setattr(Accelerator, "save_state", lambda self, output_dir=None, **kw: (_ for _ in ()).throw(
        RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 4480 vs 4368")))
    rc, out = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.max_steps=3"], capsys)
    assert rc == 2
    assert_one_line(out, "unexpected pos", "GiB free")
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"


def test_os_error_outside_checks_is_one_line(tmp_path, capsys, monkeypatch):
    """An OS error no check foresaw still ends as one line naming the path (exit 1, not a traceback)."""
    import mtrain.compare as compare

    def fail(args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/metrics.jsonl")

    monkeypatch.setattr(compare, "run", fail)
    rc, err = run_cli(["compare", str(tmp_path)], capsys)
    assert rc == 1
    assert_one_line(err, "/ro/metrics.jsonl", "read-only", "writable")


@pytest.mark.parametrize("command", ["train", "eval"])
def test_out_of_gpu_memory_is_one_line_with_what_to_change(tmp_path, capsys, monkeypatch, command):
    """Running out of GPU memory is not a bug: one line (exit 1) saying so, what a rerun resumes from and which
    settings make the work fit; another error stays an internal error."""
    import torch

    import mtrain.eval.cli as eval_cli
    import mtrain.train.cli as train_cli

    module, name = (train_cli, "run_train") if command == "train" else (eval_cli, "run")
    argv = ["train", str(tmp_path / "recipe.yaml")] if command == "train" else ["eval", "--out", str(tmp_path / "o")]

    def oom(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity "
                                     "of 79.18 GiB of which 77.44 MiB is free.")

    monkeypatch.setattr(module, name, oom)
    rc, err = run_cli(argv, capsys)
    assert rc == 1
    if command == "train":
        assert_one_line(err, "out of GPU memory", "Tried to allocate 96.00 MiB", "last checkpoint", "parallel.cp_size")
    else:
        assert_one_line(err, "out of GPU memory", "Tried to allocate 96.00 MiB", "rerun the same command", "--lengths")

    def bug(args):
        raise RuntimeError("index out of range")

    monkeypatch.setattr(module, name, bug)
    rc, err = run_cli(argv, capsys)
    assert rc == 1 and "internal error" in err and "out of GPU memory" not in err


def test_max_steps_below_the_resumed_step_leaves_the_run_as_it_was(world, tmp_path, capsys):
    """Resuming a run at step 2 with train.max_steps=1 is refused before anything is written: config.yaml keeps the
    run's settings and final/ its weights (it used to exit 0, re-export final/ from step 2 and record max_steps 1)."""
    run = copy_run(world, tmp_path / "run")
    config, weights = (run / "config.yaml").read_bytes(), (run / "final" / "model.safetensors").read_bytes()
    stamp = (run / "final" / "model.safetensors").stat().st_mtime_ns
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.max_steps=1"], capsys)
    assert rc == 2
    assert_one_line(err, "train.max_steps=1", "below step 2")
    assert (run / "config.yaml").read_bytes() == config
    assert (run / "final" / "model.safetensors").read_bytes() == weights
    assert (run / "final" / "model.safetensors").stat().st_mtime_ns == stamp
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.max_steps=2"], capsys)  # equal: nothing to train, final/ written again
    assert rc == 0, err


def test_data_packed_with_a_larger_tokenizer_is_refused(world, tmp_path, capsys):
    """The model's tokenizer fits its embedding but the data was packed with a larger one: refused at load from the
    manifest's tokenizer size; without a manifest (an MDS folder of another tool) at the first batch holding an id
    past the embedding, naming data.path, instead of an IndexError."""
    from mtrain.data.tiny_tokenizer import build_tokenizer

    small_tok = tmp_path / "tok300"
    build_tokenizer(small_tok, vocab_size=300)
    config = json.loads(MODEL_CONFIG.read_text())
    config["vocab_size"] = 512  # the tokenizer's 300 tokens fit, the packed data's 731 do not
    (tmp_path / "small.json").write_text(json.dumps(config))
    data = Path(shutil.copytree(world / "packed", tmp_path / "data"))
    base = ["train", str(world / "recipe.yaml"), "--set", f"model.config={tmp_path / 'small.json'}",
            "--set", f"model.tokenizer={small_tok}", "--set", f"data.path={data}"]
    rc, err = run_cli([*base, "--set", f"train.output_dir={tmp_path / 'a'}"], capsys)
    assert rc == 2
    assert_one_line(err, "data.path", "731-token tokenizer", "512 rows", "pack the data with the model's tokenizer")
    (data / "manifest.json").unlink()
    rc, err = run_cli([*base, "--set", f"train.output_dir={tmp_path / 'b'}"], capsys)
    assert rc == 2
    assert_one_line(err, "data.path", "token id", "512-row embedding", "pack the data with the model's tokenizer")


def test_deepspeed_without_a_launcher_or_mpi4py_says_how_to_launch(world, tmp_path, capsys, monkeypatch):
    """`mtrain train` of a DeepSpeed recipe in a bare process: DeepSpeed would look for MPI and stop, after the model
    is built, with "No module named 'mpi4py'"; mtrain names the launcher to use and the accelerate configs."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # this machine without mpi4py, whether or not it is installed
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={tmp_path / 'run'}",
                       "--set", f"train.deepspeed={REPO / 'configs' / 'deepspeed' / 'zero2.json'}"], capsys)
    assert rc == 2
    assert_one_line(err, "train.deepspeed", "zero2.json", "launcher", "mpi4py",
                    "accelerate launch --config_file configs/accelerate/", "recipes/train.py")
    assert not (tmp_path / "run" / "checkpoints").exists()


def _tiny_gguf(path: Path) -> Path:
    """A small llama GGUF: header, metadata and two float32 tensors (about 40 KB)."""
    import numpy as np
    gguf = pytest.importorskip("gguf")

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_vocab_size(100)
    writer.add_tensor("token_embd.weight", np.ones((100, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("keep", [0, 2, 100, 0.5, 0.99], ids=["empty", "in-magic", "in-metadata", "in-tensors",
                                                               "last-bytes"])
def test_truncated_gguf_is_named(tmp_path, capsys, keep):
    """`mtrain convert` of a GGUF file cut short anywhere: one line naming the file, the word truncated and the fix
    (before: "internal error: error: unpack_from requires a buffer ..." or "transformers cannot read a model
    config: cannot reshape array ...")."""
    whole = _tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "model.gguf"
    cut.write_bytes(whole[: keep if isinstance(keep, int) else int(len(whole) * keep)])
    rc, err = run_cli(["convert", str(cut), "--out", str(tmp_path / "hf")], capsys)
    assert rc == 2, err
    assert_one_line(err, "model.gguf", "truncated", "download it again")
    assert not (tmp_path / "hf").exists()


def test_convert_keeps_a_folder_it_did_not_write(tmp_path, capsys):
    """`mtrain convert --out DIR` into a folder of other files is refused in one line, and the files stay (before:
    the folder was replaced whole, its files gone without a word); export refuses the same --out."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    rc, err = run_cli(["convert", str(_tiny_gguf(tmp_path / "whole.gguf")), "--out", str(out)], capsys)
    assert rc == 2, err
    assert_one_line(err, "notes", "not a HF checkpoint folder", "new or empty folder")
    assert (out / "notes.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_whole_gguf_passes_the_truncation_check(tmp_path):
    from mtrain.models.convert import check_gguf

    check_gguf(_tiny_gguf(tmp_path / "whole.gguf"))


def test_debug_shows_the_traceback(world, tmp_path):
    from mtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="optim.grad_clip"):
        main(["--debug", "train", str(world / "recipe.yaml"), "--set", "optim.grad_clip=-1"])


# ---------------------------------------------------------------------------------------------- payloads


def _plant(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Payload(marker)))


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "scheduler.bin", "optimizer.bin", "random_states_0.pkl"])
def test_pickle_in_checkpoint_never_runs(world, tmp_path, capsys, caplog, name):
    """A pickle payload planted in the latest checkpoint does not run. Files resume never reads are ignored;
    files it reads fail the weights-only unpickler, so that checkpoint counts as damaged (the previous one
    is used, with a warning naming the file)."""
    run = copy_run(world, tmp_path / "run")
    latest = _latest(run)
    marker = tmp_path / "PWNED"
    _plant(latest / name, marker)
    # the planted file is listed as intact, so only loading can catch it
    listing = json.loads((latest / "files.json").read_text())
    listing.pop(name, None)
    (latest / "files.json").write_text(json.dumps(listing))
    caplog.set_level(logging.WARNING)
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.max_steps=3", "--set", "train.export=false"], capsys)
    assert not marker.exists(), f"code planted in {name} ran"
    assert rc == 0, err
    if name in ("optimizer.bin", "random_states_0.pkl"):  # what resume reads: refused in one line naming it
        assert f"step-0000002 is damaged: {latest / name}: not a torch tensor file" in caplog.text
        assert "resumed from the previous intact checkpoint" in caplog.text
    assert "weights_only" not in caplog.text + err  # torch's advice to unpickle anyway never reaches the user


@pytest.mark.parametrize("edit", ["data", "state"])
def test_hand_edited_trainer_state_names_the_file(world, tmp_path, capsys, edit):
    """A trainer_state_rank0.json edited by hand (valid JSON, files.json updated to vouch for it) whose data cursor or
    counters are not what mtrain writes: refused in one line naming the file and how to resume from an earlier
    checkpoint (before: "internal error")."""
    run = copy_run(world, tmp_path / "run")
    latest = _latest(run)
    path = latest / "trainer_state_rank0.json"
    saved = json.loads(path.read_text())
    if edit == "data":
        saved["data"] = "epoch 3"
    else:
        saved["state"]["step"] = {"value": 2}
    path.write_text(json.dumps(saved))
    listing = json.loads((latest / "files.json").read_text())
    listing.pop(path.name, None)
    (latest / "files.json").write_text(json.dumps(listing))
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.max_steps=3", "--set", "train.export=false"], capsys)
    assert rc == 2, err
    assert_one_line(err, "trainer_state_rank0.json", "not a trainer state", "latest")


def _plant_zero2_files(ckpt: Path, marker: Path) -> None:
    """Files named and laid out as accelerate + DeepSpeed ZeRO-2 write them (pytorch_model/mp_rank_00_model_states.pt,
    pytorch_model/zero_pp_rank_R_mp_rank_00_optim_states.pt), each a torch.save'd dict holding a payload among its
    tensors; model.safetensors removed and files.json rewritten to vouch for them (the sender writes it too)."""
    import torch

    from mtrain.train.run_folder import write_file_list

    (ckpt / "model.safetensors").unlink()
    ds = ckpt / "pytorch_model"
    ds.mkdir()
    torch.save({"module": {"w": torch.zeros(2)}, "ds_version": Payload(marker)}, ds / "mp_rank_00_model_states.pt")
    for rank in range(2):
        torch.save({"optimizer_state_dict": {"zero_stage": Payload(marker)}, "ds_version": "0.19.8"},
                   ds / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (ckpt / "files.json").unlink()
    write_file_list(ckpt)


def test_pickle_in_zero2_layout_never_runs_on_export(world, tmp_path, capsys):
    """`mtrain export` of a checkpoint holding ZeRO-2 files with a planted payload: refused in one line naming the
    file, nothing run. DeepSpeed's own zero_to_fp32 runs the same files' payload (what export used to call)."""
    run = copy_run(world, tmp_path / "run")
    marker = tmp_path / "PWNED"
    _plant_zero2_files(_latest(run), marker)
    rc, err = run_cli(["export", str(run), "--out", str(tmp_path / "hf")], capsys)
    assert not marker.exists()
    assert rc == 2
    assert_one_line(err, "step-0000002", "pytorch_model/mp_rank_00_model_states.pt", "holds a pickled object",
                    "tensors only", "previous intact checkpoint is")
    assert "weights_only" not in err and not (tmp_path / "hf" / "config.json").exists()

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with pytest.raises(Exception):  # the crafted files are no real partitions, but the payload runs first
        get_fp32_state_dict_from_zero_checkpoint(str(_latest(run)), tag="pytorch_model")
    assert marker.exists(), "the planted payload is not live: this test would prove nothing"


def test_pkl_column_in_training_data_never_runs(world, tmp_path, capsys):
    import numpy as np

    marker = tmp_path / "PWNED"
    data = _pkl_mds(tmp_path / "data", {"input_ids": "pkl", "indices": "ndarray:uint32"},
                    {"input_ids": Payload(marker), "indices": np.zeros((1, 2), np.uint32)})
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"data.path={data}",
                       "--set", f"train.output_dir={tmp_path / 'out'}"], capsys)
    assert rc == 2
    assert_one_line(err, "input_ids", "pickle")
    assert not marker.exists()


def test_pkl_column_under_a_duplicate_name_in_training_data_never_runs(world, tmp_path, capsys):
    """The `pkl` column named like the ndarray column after it: refused before any sample is decoded."""
    import numpy as np

    marker = tmp_path / "PWNED"
    data = _hidden_pkl_mds(tmp_path / "data", {"input_ids": "ndarray:uint32", "indices": "ndarray:uint32"},
                           {"input_ids": np.arange(SEQ, dtype=np.uint32), "indices": np.array([[0, SEQ]], np.uint32)},
                           Payload(marker), "input_ids")
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"data.path={data}",
                       "--set", f"train.output_dir={tmp_path / 'out'}"], capsys)
    assert not marker.exists()
    assert rc == 2
    assert_one_line(err, "index.json", "'input_ids'", "listed more than once")


def test_yaml_recipe_cannot_build_objects(world, tmp_path, capsys):
    """A recipe is read with yaml.safe_load: python tags are refused, not executed."""
    marker = tmp_path / "PWNED"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"model: !!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path "
                      f"['{marker}']]\n")
    rc, err = run_cli(["train", str(recipe)], capsys)
    assert rc == 2 and not marker.exists()
    assert_one_line(err, "evil.yaml", "not valid YAML")


# ---------------------------------------------------------------------------------------------- checkpoints


def test_damaged_latest_falls_back_to_previous(world, tmp_path, capsys, caplog):
    """Truncated model.safetensors in the latest checkpoint: named in a warning, step 1 is used instead."""
    run = copy_run(world, tmp_path / "run")
    _truncate(run / "checkpoints" / "step-0000002" / "model.safetensors")
    caplog.set_level(logging.WARNING)
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.export=false"], capsys)
    assert rc == 0, err
    assert "step-0000002/model.safetensors: truncated" in caplog.text
    assert "resumed from the previous intact checkpoint" in caplog.text and "step-0000001" in caplog.text
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # step 2 retrained, its old metrics line replaced, not duplicated
    # the retrained step 2 replaced the damaged folder and is intact again
    from mtrain.train.run_folder import verify_file_list

    verify_file_list(run / "checkpoints" / "step-0000002")


def test_truncated_state_without_file_list_is_caught_on_load(world, tmp_path, capsys, caplog):
    """A checkpoint from before files.json: the damaged optimizer.bin is caught by loading it, and named."""
    run = copy_run(world, tmp_path / "run")
    latest = _latest(run)
    (latest / "files.json").unlink()
    _truncate(latest / "optimizer.bin")
    caplog.set_level(logging.WARNING)
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.export=false"], capsys)
    assert rc == 0, err
    assert "step-0000002 is damaged" in caplog.text and "resumed from the previous intact checkpoint" in caplog.text


def _as_older_checkpoints(run: Path) -> None:
    """Rewrite every checkpoint's meta.json as mtrain wrote it before it recorded the process count and the model
    (files.json vouching for the new bytes, as it did for the old)."""
    from mtrain.train.run_folder import write_file_list

    for ckpt in (run / "checkpoints").glob("step-*"):
        (ckpt / "meta.json").write_text(json.dumps({"git_revision": None, "step": int(ckpt.name[5:])}))
        (ckpt / "files.json").unlink()
        write_file_list(ckpt)


@pytest.mark.parametrize("meta", ["recorded", "older"])
def test_resume_with_two_processes_of_a_one_process_run_is_refused_not_damaged(world, tmp_path, meta):
    """A one-process run resumed by two processes: each rank says in one line what differs and how to resume; the
    intact checkpoints are never called damaged nor is moving them away advised (rank 1 used to find no
    trainer_state_rank1.json and call every checkpoint damaged). Older checkpoints are counted by their
    trainer_state_rankN.json files."""
    run = copy_run(world, tmp_path / "run")
    if meta == "older":
        _as_older_checkpoints(run)
    config = (run / "config.yaml").read_bytes()
    from ranks import run_mtrain

    # as torchrun --standalone --nproc_per_node=2 -m mtrain ..., the ranks forked (tests/ranks.py)
    returncode, out = run_mtrain(2, "train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}", "--set",
                                 "train.max_steps=3")
    assert returncode != 0, out[-3000:]
    # one per rank (split on the prefix: two ranks writing to one pipe at once could join two lines)
    lines = ["mtrain train: error:" + part for part in out.split("mtrain train: error:")[1:]]
    assert len(lines) == 2, out[-3000:]
    for line in lines:
        assert f"checkpoint {run / 'checkpoints' / 'step-0000002'} was written by 1 process; this run has 2: " \
               "resume with 1 process, or start a new run (another train.output_dir)" in line, line
    assert "damaged" not in out and "move" not in out
    assert str(REPO / "mtrain") not in out  # no traceback through mtrain (torchrun prints its own ChildFailedError)
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"
    assert (run / "config.yaml").read_bytes() == config


@pytest.mark.parametrize("field, value, meta, needles", [
    ("num_hidden_layers", 3, "recorded", ["holds a model with num_hidden_layers=2", "has num_hidden_layers=3"]),
    ("hidden_size", 64, "recorded", ["holds a model with hidden_size=128", "has hidden_size=64"]),
    ("num_hidden_layers", 3, "older", ["another architecture", "Missing key(s)", "layers.2."]),
    ("hidden_size", 64, "older", ["another architecture", "size mismatch", "torch.Size([1024, 128])"]),
])
def test_resume_with_another_model_is_refused_not_damaged(world, tmp_path, capsys, caplog, field, value, meta,
                                                          needles):
    """A run resumed with a model.config of another architecture: one line naming the checkpoint, what differs (from
    meta.json, or for older checkpoints torch's first difference) and the fix; no checkpoint is called damaged and
    none is to be moved away (every checkpoint used to be reported damaged)."""
    run = copy_run(world, tmp_path / "run")
    if meta == "older":
        _as_older_checkpoints(run)
    config = json.loads(MODEL_CONFIG.read_text())
    config[field] = value
    (tmp_path / "other.json").write_text(json.dumps(config))
    caplog.set_level(logging.WARNING)
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}", "--set",
                       "train.max_steps=3", "--set", f"model.config={tmp_path / 'other.json'}"], capsys)
    assert rc == 2
    line = assert_one_line(err, f"checkpoint {run / 'checkpoints' / 'step-0000002'}", *needles,
                           f"model.config {tmp_path / 'other.json'}", "resume with the model the run was started with",
                           "start a new run (another train.output_dir)")
    assert "damaged" not in line + caplog.text and "move" not in line
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"


def test_second_trainer_on_one_folder_refuses(world, tmp_path, capsys):
    from mtrain.train.run_folder import RunLock

    run = copy_run(world, tmp_path / "run")
    held = RunLock(run).acquire()  # stands for a first `mtrain train` still running
    try:
        rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                           "--set", "train.max_steps=3"], capsys)
    finally:
        held.release()
    assert rc == 2
    assert_one_line(err, str(run), "in use by another `mtrain train`", "another train.output_dir")
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"


def test_changed_lr_on_resume_is_applied_and_logged(world, tmp_path, capsys, caplog):
    """optim.lr changed between runs: the resumed step uses the new LR (constant schedule) and says so."""
    run = copy_run(world, tmp_path / "run")
    caplog.set_level(logging.WARNING)
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}",
                       "--set", "train.max_steps=3", "--set", "optim.lr=1e-4", "--set", "optim.betas=[0.8, 0.9]",
                       "--set", "train.export=false"], capsys)
    assert rc == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([3e-3, 3e-3, 1e-4])
    assert "lr 0.003 -> 0.0001" in caplog.text and "betas [0.9, 0.95] -> [0.8, 0.9]" in caplog.text
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["optim"]["lr"] == pytest.approx(1e-4)
    import torch

    state = torch.load(run / "checkpoints" / "step-0000003" / "optimizer.bin", weights_only=True)
    assert state["param_groups"][0]["betas"] == (0.8, 0.9)


def test_wandb_online_without_key_falls_back_offline(world, tmp_path, capsys, caplog, monkeypatch):
    """wandb online without an API key: the run logs offline with one warning saying how to upload later."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    from mtrain.train.metrics import usable_wandb_mode

    caplog.set_level(logging.WARNING)
    assert usable_wandb_mode("online") == "offline"
    assert "no wandb API key" in caplog.text and "wandb sync" in caplog.text
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert usable_wandb_mode("online") == "online"
    assert usable_wandb_mode("disabled") == "disabled"


# ---------------------------------------------------------------------------------------------- processes


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                               "TRANSFORMERS_OFFLINE", "MTRAIN_ONLINE")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def test_sigterm_checkpoints_then_exits_143(world, tmp_path):
    run = copy_run(world, tmp_path / "run")
    shutil.rmtree(run / "final")
    # `python -m mtrain train`, forked from the CLI's server (tests/ranks.py start: a process of its own)
    proc = start(1, "-m mtrain", "train", str(world / "recipe.yaml"), "--set", f"train.output_dir={run}", "--set",
                 "train.max_steps=1000", launcher=False)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        returncode = proc.wait(timeout=120)
        out, err = proc.output()
    finally:
        proc.close()
    assert returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by signal 15" in err and "Traceback" not in err
    latest = (run / "checkpoints" / "latest").read_text()
    assert int(latest.split("-")[1]) >= 3 and not (run / "final").exists()


def test_pack_workers_die_with_their_parent(world, tmp_path):
    """kill -9 of `mtrain pack` mid-tokenization: its worker processes end too (no orphans)."""
    for i in range(3):
        shutil.copy(world / "docs.jsonl", tmp_path / f"part{i}.jsonl")
    script = (
        "import sys, time\n"
        "import mtrain.data.tokenize as tk\n"
        "real = tk.tokenize_chunk\n"
        "def slow(chunk):\n    time.sleep(600)\n    return real(chunk)\n"
        "tk.tokenize_chunk = slow\n"
        "from mtrain.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    (tmp_path / "slow_pack.py").write_text(script)
    # `python slow_pack.py pack ...`, forked from the CLI's server (tests/ranks.py start: a process of its own)
    proc = start(1, str(tmp_path / "slow_pack.py"), "pack", "--source", f"{tmp_path}:jsonl", "--tokenizer",
                 str(TOKENIZER_DIR), "--seq-len", "128", "--out", str(tmp_path / "packed"), "--workers", "3",
                 "--no-progress", launcher=False)
    pid = proc.pids[0]

    def children() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
        return found

    deadline = time.time() + 60
    workers: list[int] = []
    while time.time() < deadline and len(workers) < 3:
        workers = children()
        time.sleep(0.2)
    assert len(workers) >= 3, "the pack never started its workers"
    proc.kill()  # SIGKILL, and reaped
    proc.close()
    deadline = time.time() + 10
    alive = workers
    while time.time() < deadline and alive:
        alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()
                 and "Z" not in (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0:1] or ["Z"])]
        time.sleep(0.2)
    assert not alive, f"orphaned pack workers {alive}"
    assert not (tmp_path / "packed" / "index.json").exists()


def test_second_pack_into_one_out_fails_at_once(world, tmp_path, capsys):
    """Two `mtrain pack` into one --out at once: the second fails at once with one line (it used to race the first
    over its work files); the first finishes cleanly (index.json and manifest.json, no .work left)."""
    out = tmp_path / "packed"
    script = (
        "import sys, time\n"
        "import mtrain.data.tokenize as tk\n"
        "real = tk.tokenize_chunk\n"
        "def slow(chunk):\n    time.sleep(4)\n    return real(chunk)\n"
        "tk.tokenize_chunk = slow\n"
        "from mtrain.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["pack", "--source", f"{world / 'docs.jsonl'}:jsonl", "--tokenizer", str(TOKENIZER_DIR), "--seq-len",
            "128", "--out", str(out), "--workers", "1", "--no-progress"]
    (tmp_path / "slow_pack.py").write_text(script)
    # the first: `python slow_pack.py ARGV`, forked from the CLI's server (tests/ranks.py start: a process of its own)
    first = start(1, str(tmp_path / "slow_pack.py"), *argv, launcher=False)
    try:
        deadline = time.time() + 60
        while not (out / ".work" / "config.json").exists():  # the first holds the folder and is tokenizing
            assert first.poll() is None and time.time() < deadline, first.output()
            time.sleep(0.05)
        started = time.time()
        rc, err = run_cli(argv, capsys)
        assert time.time() - started < 2.0 and first.poll() is None  # refused at once, while the first still runs
        assert rc == 2
        assert_one_line(err, str(out), "another `mtrain pack`", "another --out")
        returncode = first.wait(timeout=120)
        first_err = first.output()[1]
    finally:
        first.close()
    assert returncode == 0, first_err[-3000:]
    assert (out / "index.json").is_file() and (out / "manifest.json").is_file() and not (out / ".work").exists()


def test_pack_takes_the_text_field_from_source(world, tmp_path, capsys):
    """A jsonl whose documents are under `body`: `--source PATH:jsonl:field=body` packs it (there was no way to name
    the field on the command line), into the same tokens as the same documents under `text`."""
    from mtrain.data import TrainingReader
    from mtrain.data.sources import parse_source_spec

    spec = parse_source_spec("posts.jsonl:jsonl:field=body@0.5")
    assert (spec.path, spec.format, spec.field, spec.proportion) == ("posts.jsonl", "jsonl", "body", 0.5)
    assert parse_source_spec("posts.jsonl:field=body").field == "body"
    c = Ctx(world, tmp_path)
    rc, err = run_cli(_with_source(c, f"{_body_jsonl(c)}:jsonl:field=body"), capsys)
    assert rc == 0, err
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert manifest["sources"][0]["field"] == "body"
    mine, theirs = TrainingReader(tmp_path / "packed", shuffle=False), TrainingReader(world / "packed", shuffle=False)
    assert len(mine) == len(theirs)
    assert all(mine.sample(i)["input_ids"].equal(theirs.sample(i)["input_ids"]) for i in range(len(mine)))


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    where.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.parametrize("size, stage", [("8k", "tok/s000/c000000.tokens.npy"),
                                         pytest.param("96k", "output shard 0", marks=pytest.mark.slow)],
                         ids=["tokens", "shard"])  # the output shard's full disk under slow: the same check, ~8 s
@pytest.mark.slow
def test_pack_on_a_full_disk_names_the_file_and_resumes(world, tmp_path, size, stage):
    """`mtrain pack` into a small tmpfs (a real full disk, in a private mount namespace): one line naming the file,
    "no space left on device" and the fix, where it used to say "?: 11694 requested and 992 written" (numpy's short
    write) or "?: No space left on device"; then, with room made, the same command resumes and finishes."""
    disk = tmp_path / "disk"
    if not _can_mount_tmpfs(disk):
        pytest.skip("needs unshare and a tmpfs mount in a user namespace")
    out = disk / "packed"
    pack = " ".join([sys.executable, "-m", "mtrain", "pack", "--source", f"{world / 'docs.jsonl'}:jsonl", "--tokenizer",
                     str(TOKENIZER_DIR), "--seq-len", str(SEQ), "--out", str(out), "--workers", "1", "--no-progress"])
    script = (f"mount -t tmpfs -o size={size} tmpfs {disk} || exit 99; {pack}; echo rc=$?; echo === | tee /dev/stderr; "
              f"mount -o remount,size=4m {disk}; {pack}; echo rc=$?; ls -a {out}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    (out1, out2), (err1, err2) = proc.stdout.split("===\n"), proc.stderr.split("===\n")
    assert out1.strip() == "rc=2", proc.stdout + proc.stderr
    line = assert_one_line(err1, str(out / ".work"), "no space left on device", "MiB free there",
                           "rerun the same command")
    assert stage in line
    assert "requested and" not in line and "?:" not in line
    assert "rc=0" in out2.splitlines() and "resuming the unfinished pack" in err2, proc.stdout + proc.stderr
    assert "index.json" in out2.splitlines() and ".work" not in out2.splitlines()


def test_export_from_another_directory_after_the_data_is_gone(world, tmp_path, capsys, monkeypatch):
    """A run launched with relative paths exports from any directory, also once its training data is deleted (export
    never reads it): the saved config.yaml holds absolute paths. A run saved with relative ones (older mtrain) is
    refused from elsewhere in one line that names the key and says where to run export."""
    from mtrain.train.run_folder import write_file_list

    shutil.copytree(world / "packed", tmp_path / "data")
    shutil.copytree(TOKENIZER_DIR, tmp_path / "assets" / "tok")
    shutil.copy(MODEL_CONFIG, tmp_path / "assets" / "config.json")
    monkeypatch.chdir(tmp_path)
    rc, err = run_cli(["train", str(world / "recipe.yaml"), "--set", "model.config=assets/config.json", "--set",
                       "model.tokenizer=assets/tok", "--set", "data.path=data", "--set", "train.output_dir=run",
                       "--set", "train.max_steps=1", "--set", "train.export=false"], capsys)
    assert rc == 0, err
    saved = yaml.safe_load((tmp_path / "run" / "checkpoints" / "step-0000001" / "config.yaml").read_text())
    assert saved["model"]["config"] == str(tmp_path / "assets" / "config.json")
    assert saved["data"]["path"] == str(tmp_path / "data")
    shutil.rmtree(tmp_path / "data")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rc, err = run_cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")], capsys)
    assert rc == 0, err
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()

    ckpt = tmp_path / "run" / "checkpoints" / "step-0000001"
    saved["model"]["config"] = "assets/config.json"  # as older runs saved it
    (ckpt / "config.yaml").write_text(yaml.safe_dump(saved))
    (ckpt / "files.json").unlink()
    write_file_list(ckpt)
    rc, err = run_cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf2")], capsys)
    assert rc == 2
    assert_one_line(err, f"{ckpt / 'config.yaml'}", "model.config", "assets/config.json",
                    "--set model.path=", "from the directory the run was launched in")
    # the advice works: the model's files where they are now, from anywhere (the assets moved, say)
    shutil.move(tmp_path / "assets", tmp_path / "moved")
    rc, err = run_cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf3"), "--set",
                       f"model.config={tmp_path / 'moved' / 'config.json'}", "--set",
                       f"model.tokenizer={tmp_path / 'moved' / 'tok'}"], capsys)
    assert rc == 0, err
    rc, err = run_cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf4"), "--set", "train.seed=3"],
                      capsys)
    assert rc == 2 and "export reads only the model section" in err
    shutil.move(tmp_path / "moved", tmp_path / "assets")
    monkeypatch.chdir(tmp_path)  # ... or from where the run was launched
    rc, err = run_cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf2")], capsys)
    assert rc == 0, err


def test_bare_mtrain_with_mistyped_path_never_touches_the_network(world, tmp_path):
    """No offline variables set, as a user's shell: a hub-shaped typo fails at once, naming the path, and
    nothing connects to the (local, recording) hub endpoint."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    hits: list = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                hits.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    env = _env(HF_ENDPOINT=f"http://127.0.0.1:{port}", HTTPS_PROXY=f"http://127.0.0.1:{port}",
               HTTP_PROXY=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf-home"))
    commands = [
        ["train", str(world / "recipe.yaml"), "--set", "model.config=null", "--set", "model.path=modles/smollm2-135m"],
        ["pack", "--source", f"{world / 'docs.jsonl'}:jsonl", "--tokenizer", "HuggingFaceTB/SmolLM2-135M",
         "--seq-len", "128", "--out", str(tmp_path / "p")],
    ]
    try:
        for args in commands:
            started = time.time()
            proc = subprocess.run([sys.executable, "-m", "mtrain", *args], cwd=REPO, env=env, capture_output=True,
                                  text=True, timeout=120)
            took = time.time() - started
            assert proc.returncode == 2, proc.stderr
            assert_one_line(proc.stderr, args[-1].split("=")[-1] if args[0] == "train" else "HuggingFaceTB/SmolLM2-135M",
                            "--online")
            assert took < 30, f"{args[0]} took {took:.0f}s"
    finally:
        stop.set()
        thread.join()
        server.close()
    assert not hits, "mtrain connected to the hub endpoint"


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to watch every process's connections")
@pytest.mark.slow
def test_wandb_offline_resolves_no_server_name(world, tmp_path):
    """logging.wandb: offline (the default) opens no internet socket in any process (wandb's own service
    included): no DNS query, no connection; its run log is still written."""
    run = tmp_path / "run"
    trace = tmp_path / "connect.trace"
    env = _env(WANDB_SILENT="true")
    env.pop("WANDB_ERROR_REPORTING", None)
    # --seccomp-bpf: the kernel stops only the traced calls (not every system call) for strace to see
    proc = subprocess.run(["strace", "-f", "--seccomp-bpf", "-qq", "-e", "trace=connect,sendto,sendmmsg", "-o",
                           str(trace), sys.executable, "-m", "mtrain", "train", str(world / "recipe.yaml"), "--set",
                           f"train.output_dir={run}", "--set", "train.max_steps=1", "--set", "logging.wandb=offline",
                           "--set", "train.export=false"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(run.glob("wandb/offline-run-*/run-*.wandb")), "wandb wrote no offline run log"
    internet = [line for line in trace.read_text().splitlines() if "AF_INET" in line or "htons(53)" in line]
    assert not internet, internet[:5]


def test_planted_module_function_is_named_in_one_line(tmp_path):
    """A payload calling a function of a blocked module (os.system, which this torch words as "Trying to load
    unsupported GLOBAL posix.system whose module posix is blocked") is refused naming the object, without torch's
    advice to load with weights_only=False (before: a garbled line quoting torch's preamble)."""
    import os

    import torch

    from mtrain.errors import MtrainError
    from mtrain.safe_load import load_tensors

    class SystemCall:
        def __reduce__(self):
            return os.system, ("true",)

    path = tmp_path / "planted.pt"
    torch.save({"w": torch.zeros(2), "x": SystemCall()}, path)
    with pytest.raises(MtrainError) as exc:
        load_tensors(path)
    line = str(exc.value)
    assert "holds a pickled object" in line and "system" in line and str(path) in line
    assert "weights_only" not in line and "\n" not in line
