"""Issue #28 on the CPU: the 4-GPU recipes launched as a user launches them (accelerate with the 4-GPU config, 4 gloo
processes, DeepSpeed ZeRO-2 on the CPU accelerator) at a tiny length, the true recall measured across a CP group,
and the comparison tables of scripts/e2e4_table.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from real_model import require_real_model
from test_models_cp import torchrun

REPO = Path(__file__).resolve().parents[1]


def test_gathered_true_recall_matches_one_device(tmp_path):
    """Four ranks, each holding its block-stripe shard of q and k, measure the sampled true recall together and
    get what one device holding the whole sequence measures (with and without packed documents)."""
    out = tmp_path / "rows.jsonl"
    proc = torchrun(4, "tests/workers/cp_recall.py", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["documents"] for r in rows] == [False, True]
    for r in rows:
        assert r["err"] < 1e-5, r
        assert all(0.3 < v < 0.999 for v in r["want"][0]), r  # the index really drops attention mass
    assert rows[0]["want"] != rows[1]["want"]  # and document masking changes what it is measured against


@pytest.fixture(scope="module")
def long_packed(tmp_path_factory):
    """The issue's data at a tiny length: long documents from this Python, packed with SmolLM2's tokenizer."""
    model = require_real_model()
    root = tmp_path_factory.mktemp("long")
    (root / "smollm2-512k.yaml").write_text((REPO / "data" / "smollm2-512k.yaml").read_text())
    from mtrain.data.longdocs import write_long_docs

    write_long_docs(root / "longdocs", code_chars=200_000, min_doc_chars=30_000)
    from ranks import run_cli  # python -m mtrain, forked from the CLI's server

    run = run_cli("pack", str(root / "smollm2-512k.yaml"), "--tokenizer", str(model), "--seq-len", "512",
                  "--total-tokens", "2048", "--out", str(root / "packed"), "--no-progress", "--workers", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    return root / "packed"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mtraining", "dense"])
def test_smollm2_recipe_one_step_on_four_processes(tmp_path, long_packed, kind):
    """`accelerate launch --config_file configs/accelerate/4gpu.yaml recipes/train.py recipes/smollm2-512k-KIND.yaml`
    with only the length, data, dtype and run folder changed: 4 processes share the sequence (CP=4) under
    DeepSpeed ZeRO-2 and train one step of the real model. The sparse run logs what the 4-GPU comparison reads:
    density, the true recall measured across the ranks, each rank's share of the work (block-stripe: balanced)."""
    run = tmp_path / "run"
    sets = [f"data.path={long_packed}", "data.seq_len=512", "model.dtype=float32", "train.max_steps=1",
            f"train.output_dir={run}", "logging.wandb=disabled", "train.export=false"]
    if kind == "mtraining":  # at 512 tokens `auto` would run every layer dense: the sparse ring, recall sampled
        sets += ["attention.sparse_policy=always", "logging.recall_every=1"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/4gpu.yaml",
           "recipes/train.py", f"recipes/smollm2-512k-{kind}.yaml"]
    for item in sets:
        cmd += ["--set", item]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"DP 1 x CP 4, DeepSpeed ZeRO-2, attention {kind}" in out, out[-2000:]
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["tokens"] == 512 and 0 < row["loss"] < 20 and row["grad_norm"] > 0
    if kind == "mtraining":
        assert 0 < row["attention_density"] < 1 and row["attention_paths"] == "s" * 30
        assert 0.5 < row["attention_true_recall"] <= 1 and "attn_true_recall/L29" in row
        shares = [row[f"imbalance_rank/r{r}"] for r in range(4)]
        assert max(shares) == pytest.approx(row["imbalance_worker"]) and sum(shares) == pytest.approx(4)
    else:
        assert "attention_density" not in row


def _metrics(run: Path, rows: list[dict]) -> Path:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_comparison_tables(tmp_path):
    """scripts/e2e4_table.py: median tokens/s after the warm-up, the speed-up against its target, the per-step
    loss difference, peak memory per rank, and the longest-context table."""
    dense = _metrics(tmp_path / "d", [{"step": s, "loss": 3.0 - 0.1 * s, "tokens": 100 * s, "tokens_per_s": tps,
                                       "peak_mem_gb": 10.0, "peak_mem_gb/rank0": 10.0, "peak_mem_gb/rank1": 9.5}
                                      for s, tps in ((1, 10.0), (2, 100.0), (3, 110.0), (4, 90.0))])
    sparse = _metrics(tmp_path / "s", [{"step": s, "loss": (3.0 - 0.1 * s) * 1.005, "tokens": 100 * s,
                                        "tokens_per_s": tps, "attention_density": 0.1, "attention_true_recall": 0.98,
                                        "imbalance_worker": 1.01, "imbalance_step": 1.02, "imbalance_rank/r0": 0.99,
                                        "imbalance_rank/r1": 1.01} for s, tps in ((1, 5.0), (2, 400.0), (3, 420.0))])
    qwen_ok = _metrics(tmp_path / "q1", [{"step": s, "loss": 12.0, "tokens": 2 * s, "tokens_per_s": 40000.0,
                                          "peak_mem_gb": 70.0} for s in (1, 2)])
    (qwen_ok / "config.yaml").write_text("data:\n  seq_len: 1048576\ntrain:\n  max_steps: 2\n")
    (qwen_ok / "status.txt").write_text("time box\n")  # every step ran; the box stopped its final save
    qwen_short = _metrics(tmp_path / "q3", [{"step": 1, "loss": 12.0, "tokens": 3, "tokens_per_s": 9000.0,
                                             "peak_mem_gb": 120.0}])
    (qwen_short / "config.yaml").write_text("data:\n  seq_len: 2097152\ntrain:\n  max_steps: 2\n")
    (qwen_short / "status.txt").write_text("time box\n")  # 1 of its 2 steps: not counted as trained
    qwen_oom = tmp_path / "q2"
    qwen_oom.mkdir()
    (qwen_oom / "config.yaml").write_text("data:\n  seq_len: 1572864\n")
    (qwen_oom / "status.txt").write_text("OOM\n")
    md = tmp_path / "summary.md"
    run = subprocess.run([sys.executable, "scripts/e2e4_table.py", "--pair", "256K", str(sparse), str(dense),
                          "--target", "3", "--longest", str(qwen_ok), str(qwen_oom), str(qwen_short), "--out", str(md)],
                         capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr
    text = md.read_text()
    assert "| mtraining | 3 | 300 | 420 |" in text and "| dense | 4 | 400 | 100 | 10.0 (10.0, 9.5) |" in text
    assert "**4.20x** (target >= 3x: met)" in text  # 420 / 100: the medians of the steps after 2
    assert "largest +0.50%" in text and "(within 1%)" in text and "unequal steps: mtraining 3, dense 4" in text
    assert "| 1,048,576 | time box in the final save, after its 2 steps | 2 |" in text
    assert "| 1,572,864 | OOM | 0 |" in text and "| 2,097,152 | time box | 1 |" in text
    assert "longest that trained: **1,048,576 tokens** (target >= 1,048,576: met)" in text


def test_gpu_script_refuses_unknown_stage(tmp_path):
    run = subprocess.run(["bash", "scripts/gpu_e2e4.sh", "bogus"], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, OUT=str(tmp_path)))
    assert run.returncode == 2 and "usage:" in run.stderr and not list(tmp_path.iterdir())


def test_gpu_script_reaps_workers_left_writing_a_log(tmp_path):
    """A launcher killed by its time box leaves torch's workers running (each in a session of its own), holding
    their GPU memory: the script kills whatever still writes the launch's log, and nothing else."""
    log, other = tmp_path / "run.log", tmp_path / "other.log"
    with open(log, "w") as out, open(other, "w") as keep:
        orphan = subprocess.Popen(["sleep", "300"], stdout=out, start_new_session=True)
        bystander = subprocess.Popen(["sleep", "300"], stdout=keep, start_new_session=True)
    try:
        run = subprocess.run(["bash", "scripts/gpu_e2e4.sh", "reap", str(log)], capture_output=True, text=True,
                             cwd=REPO, env=dict(os.environ, OUT=str(tmp_path / "out")), timeout=120)
        assert run.returncode == 0, run.stderr
        assert orphan.wait(timeout=10) == -9 and bystander.poll() is None
        assert f"killing the workers still writing {log}: {orphan.pid}" in run.stdout
        again = subprocess.run(["bash", "scripts/gpu_e2e4.sh", "reap", str(log)], capture_output=True, text=True,
                               cwd=REPO, env=dict(os.environ, OUT=str(tmp_path / "out")), timeout=120)
        assert again.returncode == 0 and "killing" not in again.stdout
    finally:
        for p in (orphan, bystander):
            if p.poll() is None:
                p.kill()
                p.wait()
