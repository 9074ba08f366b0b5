"""Resumable eval runs: a run killed midway and rerun recomputes nothing already written; a mismatched resume
is refused; the CLI writes every report and turns a missing data file into one line.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import yaml
from ranks import start
from test_eval_helpers import tiny_checkpoint

from mtrain.eval.backends.hf import HFBackend
from mtrain.eval.runner import ManifestMismatchError, predictions_path, read_records, run_suite
from mtrain.eval.suite import parse_suite

SUITE = {
    "name": "test", "seed": 0, "lengths": [256, 384], "samples": 2,
    "data": {"essay_path": "synthetic", "pg19_path": "synthetic"},
    "tasks": {"niah": {"depths": [0, 50, 100], "haystacks": 1, "max_new_tokens": 8},
              "ruler/niah_single_1": {"max_new_tokens": 8},
              "ruler/fwe": {"max_new_tokens": 8},
              "infbench/passkey": {}, "pg19": {}},
}
TOTAL = 2 * (3 + 2 + 2 + 2 + 2)  # lengths x (niah grid + four tasks of 2 samples)


@pytest.fixture
def counting(monkeypatch):
    """Count the samples the hf backend is asked to run."""
    calls = {"n": 0}
    generate, loglikelihood = HFBackend.generate, HFBackend.loglikelihood

    def counted_generate(self, *args, **kwargs):
        calls["n"] += 1
        return generate(self, *args, **kwargs)

    def counted_loglikelihood(self, *args, **kwargs):
        calls["n"] += 1
        return loglikelihood(self, *args, **kwargs)

    monkeypatch.setattr(HFBackend, "generate", counted_generate)
    monkeypatch.setattr(HFBackend, "loglikelihood", counted_loglikelihood)
    return calls


def _lines(out: str) -> dict[str, list[str]]:
    folder = os.path.join(out, "predictions")
    return {name: open(os.path.join(folder, name)).read().splitlines() for name in sorted(os.listdir(folder))}


def test_killed_run_resumes_without_recomputing(tmp_path, counting):
    model, out = tiny_checkpoint(), str(tmp_path / "out")
    suite_file = tmp_path / "suite.yaml"
    suite_file.write_text(yaml.safe_dump(SUITE))
    # `python -m mtrain eval`, forked from the CLI's server (tests/ranks.py start: a process of its own)
    proc = start(1, "-m mtrain", "eval", str(suite_file), "--model", model, "--out", out, "--no-progress",
                 launcher=False)
    niah_file = predictions_path(out, "niah")
    deadline = time.time() + 120
    while time.time() < deadline and len(read_records(niah_file)) < 3:
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no chance to clean up, as with a crash or a lost node
    proc.close()
    before = _lines(out)
    written = sum(len(read_records(os.path.join(out, "predictions", n))) for n in before)
    assert 3 <= written < TOTAL, written
    with open(niah_file, "a") as f:
        f.write('{"task": "niah", "length": 384, "ind')  # a torn record, as a kill mid-write leaves

    results = run_suite(parse_suite(SUITE), model, out, progress=False)
    assert counting["n"] == TOTAL - written  # nothing already written ran again
    after = _lines(out)
    for name, lines in before.items():
        complete = [line for line in lines if line.endswith("}")]
        assert after[name][: len(complete)] == complete  # earlier records untouched, torn tail replaced
    assert all(json.loads(line) for lines in after.values() for line in lines)
    assert sum(len(v) for v in after.values()) == TOTAL
    assert set(results["tasks"]) == {"niah", "ruler/niah_single_1", "ruler/fwe", "infbench/passkey", "pg19"}

    counting["n"] = 0
    run_suite(parse_suite(SUITE), model, out, progress=False)
    assert counting["n"] == 0 and _lines(out) == after


def test_mismatched_resume_is_refused(tmp_path, counting):
    out = str(tmp_path / "out")
    small = {**SUITE, "lengths": [256], "tasks": {"ruler/niah_single_1": {"max_new_tokens": 8}}}
    run_suite(parse_suite(small), tiny_checkpoint(), out, progress=False)
    changed = {**small, "tasks": {"ruler/niah_single_1": {"max_new_tokens": 4}}}
    with pytest.raises(ManifestMismatchError, match="max_new_tokens"):
        run_suite(parse_suite(changed), tiny_checkpoint(), out, progress=False)
    with pytest.raises(ManifestMismatchError, match="checkpoint_sha256"):
        run_suite(parse_suite(small), tiny_checkpoint(bos=False), out, progress=False)


def test_cli_writes_reports_and_rescores(tmp_path):
    from mtrain.cli import main

    out = str(tmp_path / "out")
    suite_file = tmp_path / "suite.yaml"
    suite_file.write_text(yaml.safe_dump(SUITE))
    tasks = "niah,pg19,ruler/niah_single_1,ruler/fwe"
    assert main(["eval", str(suite_file), "--model", tiny_checkpoint(), "--out", out, "--tasks", tasks,
                 "--lengths", "256", "--no-progress"]) == 0
    for name in ("manifest.json", "results.json", "results.csv", "ruler_table.md", "niah_heatmap.png",
                 "pg19_perplexity.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    results = json.load(open(os.path.join(out, "results.json")))
    assert set(results["tasks"]) == {"niah", "pg19", "ruler/niah_single_1", "ruler/fwe"}
    assert results["tasks"]["pg19"]["256"]["score"] > 1.0
    assert "| niah_single_1 |" in open(os.path.join(out, "ruler_table.md")).read()
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["backend"]["backend"] == "hf" and manifest["rope"]["max_position_embeddings"] == 8192
    assert set(manifest["backend"]["versions"]) == {"torch", "transformers"}
    os.remove(os.path.join(out, "results.json"))
    assert main(["eval", "--score-only", "--out", out]) == 0  # scoring needs only the prediction files
    assert json.load(open(os.path.join(out, "results.json"))) == results


def test_cli_missing_data_file_is_one_line(tmp_path, capsys):
    from mtrain.cli import main

    suite_file = tmp_path / "suite.yaml"
    missing = str(tmp_path / "nowhere" / "dev-v2.0.json")
    suite_file.write_text(yaml.safe_dump({"lengths": [256], "data": {"squad_path": missing},
                                          "tasks": {"ruler/qa_1": {}}}))
    code = main(["eval", str(suite_file), "--model", tiny_checkpoint(), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("mtrain eval: error: missing squad data") and missing in err[0]


def test_suite_patterns_overrides_and_bad_keys():
    from mtrain.errors import ConfigError

    raw = {"lengths": [1024], "samples": 3, "tasks": {"ruler/niah_*": {"max_new_tokens": 16},
                                                      "ruler/niah_single_1": {"samples": 5}}}
    suite = parse_suite(raw)
    runs = {r.name: r for r in suite.tasks}
    assert len(runs) == 8 and runs["ruler/niah_multiquery"].max_new_tokens == 16
    assert runs["ruler/niah_single_1"].samples == 5 and runs["ruler/niah_single_1"].max_new_tokens == 16
    assert runs["ruler/niah_single_2"].samples == 3
    cli = parse_suite(raw, tasks=["ruler/niah_single_2", "pg19"], lengths=[2048], samples=1)
    assert [(r.name, r.lengths, r.samples) for r in cli.tasks] == [("ruler/niah_single_2", [2048], 1),
                                                                   ("pg19", [2048], 1)]
    with pytest.raises(ConfigError, match="unknown key.*'depth'.*niah"):
        parse_suite({"tasks": {"niah": {"depth": [0]}}})
    with pytest.raises(ConfigError, match="unknown suite key"):
        parse_suite({"task": {}})
    with pytest.raises(ConfigError, match="max_new_tokens 128"):
        parse_suite({"lengths": [128], "tasks": {"ruler/vt": {}, "ruler/niah_single_1": {}}})
