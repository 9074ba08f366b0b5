"""`mtrain compare`: a continued run on its parent's token axis, and the eval scores of runs side by side."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from mtrain.compare import format_eval_table, summarize, token_offsets


def _run(root, name, tokens, model_path=None, results=None):
    run = root / name
    run.mkdir()
    rows = [{"step": s, "tokens": s * tokens, "loss": 5.0 / s, "tokens_per_s": 100.0} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"train": {"output_dir": str(run)}, "model": {"path": model_path} if model_path else {"config": "x"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    if results is not None:
        (run / "eval").mkdir()
        (run / "eval" / "results.json").write_text(json.dumps(results))
    return str(run)


def test_stage_two_continues_stage_one_token_axis(tmp_path):
    one = _run(tmp_path, "tiny", 1000)
    two = _run(tmp_path, "tiny-extend", 8000, model_path=str(tmp_path / "tiny" / "final"))
    twin = _run(tmp_path, "tiny-extend-dense", 8000, model_path=str(tmp_path / "tiny" / "checkpoints" / "step-2"))
    other = _run(tmp_path, "other", 10, model_path=str(tmp_path / "elsewhere" / "final"))
    summaries = [summarize(r) for r in (one, two, twin, other)]
    assert token_offsets(summaries) == [0, 2000, 2000, 0]
    assert token_offsets(summaries[1:]) == [0, 0, 0]  # the parent is not compared: no offset


def test_eval_scores_side_by_side(tmp_path, capsys):
    from mtrain.cli import main

    niah = {"1024": {"0.0": 100.0, "50.0": 50.0}, "8192": {"0.0": 100.0, "50.0": 100.0}}
    ruler = {"1024": {"average": 12.5, "tasks": 13}, "8192": {"average": 4.0, "tasks": 13}}
    one = _run(tmp_path, "tiny", 1000)
    two = _run(tmp_path, "tiny-extend", 8000, str(tmp_path / "tiny" / "final"), {"tasks": {}, "niah": niah,
                                                                                   "ruler": ruler})
    twin = _run(tmp_path, "tiny-extend-dense", 8000, str(tmp_path / "tiny" / "final"),
                {"tasks": {}, "niah": {"1024": {"0.0": 0.0}}})
    table = format_eval_table([summarize(r) for r in (one, two, twin)]).splitlines()
    assert table[0].split() == ["run", "NIAH", "1K", "NIAH", "8K", "RULER", "avg", "1K", "RULER", "avg", "8K"]
    assert table[2].split() == ["tiny-extend", "75.0", "100.0", "12.5", "4.0"]
    assert table[3].split() == ["tiny-extend-dense", "0.0", "-", "-", "-"]
    assert format_eval_table([summarize(one)]) is None
    # results that carry standard errors (mtrain.eval.scoring) show them beside the score
    with_errors = _run(tmp_path, "tiny-extend-se", 8000, str(tmp_path / "tiny" / "final"),
                       {"tasks": {"niah": {"1024": {"score": 75.0, "stderr": 12.5, "n": 10}}},
                        "niah": {"1024": {"0.0": 100.0, "50.0": 50.0}},
                        "ruler": {"1024": {"average": 12.5, "stderr": 3.25, "tasks": 13, "n": 65}}})
    assert format_eval_table([summarize(with_errors)]).splitlines()[2].split() == [
        "tiny-extend-se", "75.0", "±12.5", "12.5", "±3.2"]
    plot = tmp_path / "cmp.png"
    assert main(["compare", one, two, twin, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "eval scores" in out and "tiny-extend-dense" in out and plot.stat().st_size > 0


def _no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] if args else kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _offline_wandb_run(run_dir, rows, config):
    """What `logging.wandb: offline` leaves in RUN_DIR/wandb: written by wandb itself in offline mode."""
    import wandb

    run_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(mode="offline", dir=str(run_dir), project="mtrain", name=run_dir.name, id="cafe0001",
                     config=config, settings=wandb.Settings(silent=True, console="off"))
    for row in rows:
        run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    run.finish()
    # wandb's service may still be flushing the log when finish() returns: wait for every step to be there
    from mtrain.compare import read_wandb_records

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
        if logs and sum(r.WhichOneof("record_type") == "history" for r in read_wandb_records(logs[0])) == len(rows):
            return run_dir
        time.sleep(0.1)
    raise AssertionError(f"wandb wrote no complete offline log under {run_dir} in 30 s")


def test_local_and_offline_wandb_runs_without_network(tmp_path, capsys, monkeypatch):
    import csv

    from mtrain.cli import main

    monkeypatch.delenv("WANDB_MODE", raising=False)
    local = _run(tmp_path, "tiny", 5000)
    rows = [{"step": s, "tokens": s * 4096, "loss": 4.0 / s, "tokens_per_s": 50.0 * s, "tflops": 0.01 * s,
             "attention_density": 0.25, "attention_true_recall": 0.9 + 0.01 * s, "imbalance_worker": 1.5,
             "imbalance_step": 2.0, "peak_mem_gb": 1.0 + s} for s in (1, 2, 3)]
    config = {"train": {"output_dir": "x"}, "model": {"path": str(tmp_path / "tiny" / "final")},
              "attention": {"kind": "mtraining"}}
    wb = _offline_wandb_run(tmp_path / "sparse", rows, config)
    (wb / "eval").mkdir()
    (wb / "eval" / "results.json").write_text(json.dumps({"niah": {"1024": {"0.0": 80.0, "50.0": 100.0}}}))
    offline = next((wb / "wandb").glob("offline-run-*"))
    _no_network(monkeypatch)

    summary = summarize(offline)  # the offline-run folder itself; RUN_DIR (no metrics.jsonl) reads the same
    assert [r["loss"] for r in summary["rows"]] == [4.0, 2.0, 4.0 / 3]
    assert summary["run"] == "sparse" and summary["config"]["attention.kind"] == "mtraining"
    assert summary["tokens_per_s"] == 125.0 and summary["peak_mem_gb"] == 4.0
    assert summary["true_recall"] == pytest.approx(0.92) and summary["eval"]["niah"]
    assert summarize(wb)["rows"] == summary["rows"]

    out = {name: tmp_path / "out" / name for name in ("cmp-loss.png", "table.csv", "table.md")}
    assert main(["compare", local, str(offline), "--plot", str(out["cmp-loss.png"]), "--csv", str(out["table.csv"]),
                 "--markdown", str(out["table.md"])]) == 0
    printed = capsys.readouterr().out
    for header in ("final loss", "best loss", "tokens/s", "TFLOP/s", "peak mem GB", "attn density", "true recall",
                   "imbalance w/s", "loss @10,000 tok", "NIAH 1K"):
        assert header in printed
    line = next(line for line in printed.splitlines() if line.startswith("sparse"))
    assert line.split()[3:6] == ["1.3333", "1.3333", "2.0000"]  # final, best, at 10,000 tokens (step 2: 8,192)
    assert out["cmp-loss.png"].stat().st_size > 1000
    assert (tmp_path / "out" / "cmp-throughput.png").stat().st_size > 1000
    table = list(csv.DictReader(out["table.csv"].open()))
    assert [r["run"] for r in table] == ["tiny", "sparse"]
    assert float(table[1]["final_loss"]) == pytest.approx(4.0 / 3) and table[1]["niah_1024"] == "90.0"
    assert table[1]["imbalance_step"] == "2.0" and table[0]["tflops"] == ""
    assert table[1]["source"] == "wandb offline cafe0001"
    markdown = out["table.md"].read_text().splitlines()
    assert markdown[0].startswith("| run | steps |") and markdown[3].startswith("| sparse |")
    assert not list((tmp_path / "out").glob(".*tmp"))  # written atomically: no temporary left


class _FakeRun:
    def __init__(self, run_id, delay=0.0):
        self.name, self.config, self.delay = f"api-{run_id}", {"attention": {"kind": "dense"}, "_wandb": {}}, delay

    def scan_history(self):
        time.sleep(self.delay)
        return [{"_step": s, "tokens": 100 * s, "loss": 3.0 / s, "tokens_per_s": 10.0} for s in (1, 2)]


def _fake_api(monkeypatch, delay=0.0):
    import wandb

    calls = []

    class Api:
        def __init__(self, timeout=None, **kwargs):
            calls.append(("Api", timeout))

        def run(self, path):
            calls.append(("run", path))
            return _FakeRun(path.rsplit("/", 1)[-1], delay)

    monkeypatch.setattr(wandb, "Api", Api)
    return calls


def test_wandb_api_runs_join_local_ones(tmp_path, capsys, monkeypatch):
    from mtrain.cli import main

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    calls = _fake_api(monkeypatch)
    local = _run(tmp_path, "tiny", 1000)
    assert main(["compare", local, "--wandb", "team/mtrain", "--runs", "ab12, cd34", "--wandb-timeout", "5",
                 "--plot", str(tmp_path / "c.png"), "--csv", str(tmp_path / "c.csv")]) == 0
    assert ("run", "team/mtrain/ab12") in calls and ("run", "team/mtrain/cd34") in calls and ("Api", 5) in calls
    printed = capsys.readouterr().out
    assert "api-ab12" in printed and "api-cd34" in printed and "wandb:team/mtrain/cd34" in (tmp_path / "c.csv").read_text()
    assert (tmp_path / "c-throughput.png").stat().st_size > 1000


def test_wandb_api_never_hangs_and_stays_off_when_offline(tmp_path, capsys, monkeypatch):
    from mtrain.cli import main

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    calls = _fake_api(monkeypatch, delay=30)
    monkeypatch.setenv("WANDB_MODE", "offline")
    argv = ["compare", "--wandb", "team/mtrain", "--runs", "ab12", "--plot", str(tmp_path / "c.png")]
    assert main(argv) == 2 and not calls  # WANDB_MODE=offline: the API is never built
    err = capsys.readouterr().err
    assert "WANDB_MODE=offline" in err and len(err.strip().splitlines()) == 1
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert main(argv) == 2 and not calls  # no API key: refused before any request
    err = capsys.readouterr().err
    assert "no wandb API key" in err and "WANDB_API_KEY" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    start = time.monotonic()
    assert main(argv + ["--wandb-timeout", "0.5"]) == 2
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert "no answer from the wandb API within 0.5 s" in err and "--wandb-timeout" in err
    assert not (tmp_path / "c.png").exists()


def test_a_trained_offline_wandb_run_reads_as_its_metrics_jsonl(tmp_path, monkeypatch):
    """A real `mtrain train` with logging.wandb: offline (2 steps of the tiny model): its wandb log, read offline,
    gives the same steps and figures as its metrics.jsonl."""
    from mtrain.cli import main
    from mtrain.data import pack
    from mtrain.data.synthetic import CorpusSpec, generate, write_jsonl
    from mtrain.tiny import MODEL_CONFIG, TOKENIZER_DIR

    monkeypatch.delenv("WANDB_MODE", raising=False)
    write_jsonl(tmp_path / "docs.jsonl", generate(CorpusSpec(num_docs=20, max_sentences=20, seed=5)))
    pack([f"{tmp_path / 'docs.jsonl'}:jsonl"], str(TOKENIZER_DIR), 128, tmp_path / "packed", progress=False, workers=1)
    out = tmp_path / "run"
    recipe = {"model": {"config": str(MODEL_CONFIG), "tokenizer": str(TOKENIZER_DIR)},
              "data": {"path": str(tmp_path / "packed"), "seq_len": 128}, "logging": {"wandb": "offline"},
              "train": {"output_dir": str(out), "max_steps": 2, "save_every": 0, "micro_batch_size": 1,
                        "export": False}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp_path / "r.yaml")]) == 0
    logs = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1
    from mtrain.compare import read_wandb_records

    deadline = time.monotonic() + 30  # wandb's service may still be flushing
    while sum(r.WhichOneof("record_type") == "history" for r in read_wandb_records(logs[0])) < 2:
        assert time.monotonic() < deadline, "wandb wrote no complete offline log in 30 s"
        time.sleep(0.1)
    _no_network(monkeypatch)
    local, offline = summarize(out), summarize(logs[0].parent)
    assert offline["source"].startswith("wandb offline") and local["source"] == "metrics.jsonl"
    for key in ("steps", "tokens", "final_loss", "best_loss", "tokens_per_s", "tflops"):
        assert offline[key] == pytest.approx(local[key]), key
    assert offline["config"]["data.seq_len"] == 128 and offline["run"] == local["run"] == "run"
