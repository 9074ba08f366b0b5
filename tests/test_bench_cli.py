"""`mtrain bench`: one home for measurement. `mtrain bench --help` lists the eight subcommands; each runs a CPU smoke
test here (tiny sizes: they check that the subcommand runs end to end and prints its table, not its numbers); the
benchmarks edit no `sys.path` and import nothing from tests/; `scripts/` holds launch helpers only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ranks import run_cli
from test_ops_interpreter import needs_interpreter

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ("attention", "documents", "real", "ring", "train", "cost", "plan", "imbalance", "check")


def mtrain(*args, env=None, timeout=300, module="mtrain"):
    """`python -m MODULE ARGS` from the repository root; returns the finished process (its exit status checked).
    Forked from the CLI's server (tests/ranks.py run_cli: the same program, without a fresh interpreter's imports),
    but where Triton's interpreter is asked for: transformers imported Triton in that server, so such a run starts
    a fresh interpreter."""
    if "TRITON_INTERPRET" in (env or {}):
        run = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                             timeout=timeout, env={**os.environ, **env})
    else:
        run = run_cli(*args, module=module, env=env, timeout=timeout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run


def test_help_lists_every_subcommand():
    out = mtrain("bench", "--help").stdout
    for name in SUBCOMMANDS:
        assert f"    {name}" in out, out
    from mtrain.bench import SUBCOMMANDS as registered

    assert tuple(registered) == SUBCOMMANDS


def test_options_and_help_pass_through_to_the_subcommand():
    """Everything after a subcommand's name reaches its own parser, --help included; `python -m mtrain.bench.NAME`
    is the same program."""
    assert "--densities-only" in mtrain("bench", "attention", "--help").stdout
    assert "--tokens-per-gpu" in mtrain("bench", "ring", "--help").stdout
    assert "--find-max" in mtrain("bench", "train", "--help").stdout
    assert "--model" in mtrain("bench", "real", "--help").stdout
    assert "--write-table" in mtrain("bench", "cost", "--help").stdout
    assert "--quick" in mtrain("bench", "check", "--help").stdout
    assert "--ring-cp" in mtrain("bench", "documents", "--help").stdout
    assert "--node-size" in mtrain("--help", module="mtrain.bench.plan", timeout=120).stdout


def test_plan_and_imbalance(capsys):
    from mtrain.cli import main

    assert main(["bench", "plan", "--seq-len", "128K", "--cp", "2", "--gpu", "h100"]) == 0
    assert "expected: micro-step" in capsys.readouterr().out
    assert main(["bench", "imbalance", "--lengths", "8K", "--cp", "2", "--layouts", "zigzag"]) == 0
    out = capsys.readouterr().out
    assert "zigzag" in out and "8K" in out


def test_attention_smoke(tmp_path):
    out = mtrain("bench", "attention", "--densities-only", "--seqs", "1024", "--block-sizes", "64", "--recalls", "0.9",
                 "--out", str(tmp_path)).stdout
    assert "S=1024 bs=64 recall=0.9: block density" in out
    assert (tmp_path / "bench_attention.log").is_file()


def test_real_smoke(tmp_path):
    from mtrain.tiny import build_tiny_model, load_tokenizer

    model = tmp_path / "tiny"
    build_tiny_model(seed=0).save_pretrained(model)
    load_tokenizer().save_pretrained(model)
    out = mtrain("bench", "real", "--model", str(model), "--seq-len", "256", "--layers", "0", "--iters", "1",
                 "--hold", "2", "--recall-rows", "32", "--sparse", "block_size=64", "--sparse", "last_q=32",
                 "--out", str(tmp_path / "out")).stdout
    assert "perplexity, dense:" in out and "perplexity, every layer sparse:" in out
    assert (tmp_path / "out" / "real_256.json").is_file()


def test_train_smoke():
    out = mtrain("bench", "train", "--shape", "tiny", "--seq-lens", "256", "--steps", "1").stdout
    assert "check: |loss(dense) - loss(mtraining, recall 1)|" in out
    assert [line.split()[1] for line in out.splitlines() if line.strip().startswith("256 ")] == ["dense", "mtraining"]


def test_cost_fit_smoke(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(dict(kind="estimate", S=S, Hq=9, Hkv=3, D=64, bs=64, rows=1088, scorer="triton",
                                            ms_estimate=0.5 + 3.0 * 9 * 1088 * S / 1e9)) + "\n"
                            for S in (8192, 32768, 131072)))
    mtrain("bench", "cost", "--fit", str(rows), "--write-table", str(tmp_path / "table.json"))
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["estimate"] == pytest.approx([0.5, 3.0], rel=1e-3)


def test_cost_fit_appends_rows_the_measured_asset_builds_its_table_from(tmp_path):
    """`mtrain bench cost --fit ROWS --rows FILE`: the fitted coefficients become result rows (cost.TABLE.*) that
    validate, and the cost table built from them (`mtrain.ops.cost.table_from`, what mtrain/assets/measured.json
    feeds) holds the coefficients the timings were made from (the rows are exact in them: within 0.1%)."""
    from mtrain.bench.results import read_rows
    from mtrain.ops.cost import table_from

    dense, sparse, index, estimate = (0.5, 2.0), (0.3, 0.7, 1.5, 4.0), (0.2, 0.01, 3.0, 5.0), (0.4, 3.0)
    timings = []
    for S in (8192, 32768, 131072):
        unit = 9 * S ** 2 / 2 * 64 / 1e12
        timings.append(dict(kind="dense", D=64, Hq=9, S=S, ms_fwd_bwd=dense[0] + dense[1] * unit,
                            ms_fwd=(dense[0] + dense[1] * unit) / 2))
        for i, (blocks, cols) in enumerate(((S // 8, S), (S // 4, 2 * S), (S // 2, S // 2))):
            x = (1, 9 * S / 1e6, blocks * 64 * 64 * 64 / 1e12, cols * 64 * 64 / 1e12)
            ms = sum(c * v for c, v in zip(sparse, x))
            ms_index = sum(c * v for c, v in zip(index, (1, 9 * S / 1e6, blocks / 1e6, cols / 1e6)))
            timings.append(dict(kind="sparse", D=64, bs=64, Hq=9, S=S, blocks=blocks, cols=cols, ms_fwd_bwd=ms,
                                ms_fwd=ms, ms_index=ms_index))
        timings.append(dict(kind="estimate", D=64, Hq=9, S=S, rows=1088, ms_estimate=estimate[0] + estimate[1] * 9 * 1088 * S / 1e9))
    measured = tmp_path / "timings.jsonl"
    measured.write_text("".join(json.dumps(r) + "\n" for r in timings))
    out = tmp_path / "results.jsonl"
    mtrain("bench", "cost", "--fit", str(measured), "--rows", str(out), "--table", "testgpu", "--gpu", "1x TestGPU",
           "--versions", "torch 2.13", "--commit", "abc1234")
    rows = read_rows(out)  # validated as result rows
    assert {r["gpu"] for r in rows} == {"1x TestGPU"} and all(r["measure"].startswith("cost.testgpu.") for r in rows)
    table = table_from({r["measure"]: r["value"] for r in rows}, "cost.testgpu.", name="test", source="rows")
    for got, want in ((table.dense[64]["train"], dense), (table.sparse[(64, 64)]["train"], sparse),
                      (table.index, index), (table.estimate, estimate)):
        assert got == pytest.approx(want, rel=1e-3, abs=1e-3)
    refused = run_cli("bench", "cost", "--fit", str(measured), "--rows", str(out))
    assert refused.returncode != 0 and "--rows needs --fit JSONL, --gpu and --versions" in refused.stderr + refused.stdout


@needs_interpreter  # run by tests/test_ops_interpreter.py in its Triton-interpreter process (QUICK_ELSEWHERE)
def test_check_smoke(capsys):
    """The gate's Triton engines on the CPU, the list-free columns beside the lists: each case says ok (`mtrain bench
    check`, in the interpreter's process: --jobs 1 runs the cases in it)."""
    from mtrain.cli import main

    engines = ("triton-det", "triton-listfree", "triton-lf-atomic")
    assert main(["bench", "check", "--device", "cpu", "--quick", "--jobs", "1", "--block-sizes", "64", "--dtypes",
                 "float32", "--engines", *engines]) == 0
    out = capsys.readouterr().out
    assert "0 failures" in out
    for name in engines:
        assert sum(line.startswith(f"ok   {name} ") for line in out.splitlines()) == 2, (name, out[-2000:])


@pytest.mark.slow
def test_ring_smoke():
    """Two gloo ranks under torchrun with the Triton interpreter (`--cpu`), at half the sizes of the script's documented
    smoke run (128 tokens per rank, 4 blocks of 32, a 32-token window: about 2/3 of its time on 2 cores); every
    correctness case and timed variant still runs: none may fail but PyTorch's context_parallel, which needs CUDA."""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "mtrain.bench.ring", "--cpu", "--tokens-per-gpu", "128", "--heads", "2", "--kv-heads",
                          "1", "--dim", "16", "--block-size", "32", "--window", "32", "--far-slashes", "2",
                          "--verticals", "4", "--iters", "1", "--warmup", "0", "--check-len", "128",
                          "--graph-estimate"],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "HEADLINE" in run.stdout
    # the script reports a failing variant and carries on: at these sizes every one must run
    failed = [line for line in run.stdout.splitlines() if "failed:" in line]
    assert all("CUDA only" in line for line in failed), failed
    # --graph-estimate adds the graphed variant (eager off CUDA: the same code path around the estimate)
    assert "gather, estimate from a CUDA graph" in run.stdout
    assert "MiB as wide as the lists used" in run.stdout  # the index's bytes, as held and as the pattern uses them
    for name in ("dense ", "sparse ", "estimated ", "sparse-g ", "estimated-g ", "estimated-lf ",
                 "estimated-lf-g "):  # the correctness cases
        (line,) = [line for line in run.stdout.splitlines() if line.startswith(name) and " out " in line]
        # the -lf cases read the columns list-free (under the gathered schedule with static widths), the others not
        assert ("columns list-free" in line) == ("-lf" in name), line
        assert ("static widths" in line) == (name == "estimated-lf-g "), line
        words = line.split()
        errors = {key: float(words[words.index(key) + 1]) for key in ("out", "dq", "dk")}
        # fp32 in the interpreter against one device: rounding only (~1e-7; a wrong block or column is ~1e-1)
        assert max(errors.values()) < 1e-4, line
        assert "same lines as one device: False" not in line, line


def test_benchmarks_edit_no_import_path_and_import_nothing_from_tests():
    bad = []
    for path in sorted((REPO / "mtrain" / "bench").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "sys.path" in text or "from tests" in text or "import tests" in text:
            bad.append(str(path.relative_to(REPO)))
    assert not bad, bad


def test_scripts_holds_launch_helpers_only():
    """Benchmarks live in mtrain/bench/, developer tools in tools/; scripts/ keeps the shell launchers, the table
    builder of the 4-GPU launcher, the stack locker of `make lock`, the generator of BENCHMARKS.md and the generator
    of the measured-constants asset (mtrain/assets/measured.json)."""
    tracked = subprocess.run(["git", "ls-files", "scripts"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    allowed = ("scripts/e2e4_table.py", "scripts/lock_stack.py", "scripts/benchmarks_md.py", "scripts/measured_asset.py")
    extra = [p for p in tracked if not (p.endswith(".sh") or p in allowed)]
    assert not extra, extra


def test_line_differences_count_the_lines_each_side_alone_chose():
    """`mtrain bench ring --model` reports where the ring's lines differ from one device's: per head, the verticals
    and slashes only one side chose (sets: order and padding do not count)."""
    import torch

    from mtrain.bench.ring import line_differences

    one_v = torch.tensor([[[5, 9, 40, -1], [0, 3, -1, -1]]])
    one_s = torch.tensor([[[0, 64, -1], [0, 128, 256]]])
    same = line_differences((one_v, one_s), (one_v.flip(-1), one_s.flip(-1), None))
    assert same == {"verticals_only_one_device": 0, "verticals_only_ring": 0, "slashes_only_one_device": 0,
                    "slashes_only_ring": 0, "heads_differing": 0}
    # head 0: vertical 40 swapped for 41 (a near-tie at the cutoff); head 1: one more slash on the ring's side
    ring_v = torch.tensor([[[41, 9, 5, -1, -1], [3, 0, -1, -1, -1]]])
    ring_s = torch.tensor([[[64, 0, -1, -1], [0, 128, 256, 320]]])
    assert line_differences((one_v, one_s), (ring_v, ring_s)) == {
        "verticals_only_one_device": 1, "verticals_only_ring": 1, "slashes_only_one_device": 0,
        "slashes_only_ring": 1, "heads_differing": 2}


@pytest.mark.slow  # two gloo ranks, the Triton interpreter, SmolLM2's first two layers at 512 tokens
def test_ring_on_real_attention_lists_one_devices_lines():
    """`mtrain bench ring --model` on SmolLM2's captured q/k/v, CP=2 block-stripe: the ring's online estimate gives one
    device's lines on every layer (no line only one side chose), with the true recall near the target."""
    from real_model import require_real_model

    model = require_real_model()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "mtrain.bench.ring", "--cpu", "--model", str(model), "--tokens-per-gpu", "256",
                          "--block-size", "32", "--layers", "2", "--iters", "1", "--warmup", "0", "--skip-dense",
                          "--schedules", "ring", "--recall-rows", "16", "--compare-columns", "--bytes-cp", "4"],
                         cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"layer"')]
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert r["same_lines_as_one_device"], r
        assert set(r["line_differences"].values()) == {0}, r
        assert r["true_recall_mean"] > 0.95, r
        assert r["index_bytes_list_free"] > 0, r  # the rank's rows with list-free columns, reported beside the lists
        assert r["ring_sparse_lists_ms"] > 0, r  # --compare-columns: the same ring with the rank's column lists
        assert 0 < r["estimate_ring_ms"], r  # the estimate alone, timed apart
        (b,) = r["rank_bytes"]  # rank 0 of CP=4 over the same 512 tokens: 4 of its 16 query blocks
        assert b["cp"] == 4 and b["rows"] == 4 and 0 < b["list_free"] < b["cap_wide"] and b["lists"] <= b["cap_wide"], b
    assert "lines equal one device's on every layer and rank: True" in run.stdout
    assert "512 tokens of prose, CP=2" in run.stdout  # --text: prose by default
    assert "with list-free columns, as the ring reads them at large caps" in run.stdout
    assert "with the column lists instead: ring" in run.stdout and "rank 0 of CP=4" in run.stdout


@pytest.mark.parametrize("args, words", [
    (["--heads", "9/3"], "want HQ/HKV/D"),
    (["--heads", "9/2/64"], "HKV dividing HQ"),
    (["--seqs", "1000"], "16 documents"),
    (["--ring-cp", "1"], "CP sizes must be >= 2"),
])
def test_bench_documents_refuses_bad_arguments(args, words, capsys):
    from mtrain.bench.documents import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_bench_documents_mixes():
    from mtrain.bench.documents import causal_pairs, document_lengths

    assert document_lengths("long", 131072) == [53029, 41022, 25013, 12008]  # 53 : 41 : 25 : 12
    assert document_lengths("long", 262144) == document_lengths("long", 131072) * 2
    assert document_lengths("short", 32768) == [2048] * 16
    assert causal_pairs([2, 3]) == 3 + 6
    with pytest.raises(ValueError, match="one of"):
        document_lengths("medium", 4096)


@pytest.mark.parametrize("argv, words", [
    (["bench", "imbalance", "--density", "5"], "--density 5.0: the fraction of causal blocks computed must be in (0, 1]"),
    (["bench", "real", "--model", "nowhere", "--seq-len", "1024", "--sparse", "recal=0.9"], "unknown key 'recal'"),
    (["bench", "real", "--model", "nowhere", "--seq-len", "1024", "--sparse", "recall=5"], "attention.recall: must be in (0, 1]"),
    (["bench", "real", "--model", "nowhere", "--seq-len", "1024", "--sparse", "engine=fa4"], "--engine"),
])
def test_bench_arguments_refused_in_one_line(argv, words, capsys):
    """Bad benchmark arguments are refused up front in one line naming the bad value, as the rest of the CLI does
    (before: --density 5 accepted; --sparse unchecked until a TypeError deep in a run)."""
    from mtrain.cli import main

    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv, words", [
    (["--schedules", "ring,gathr"], "--schedules ring,gathr: each must be one of ring, gather"),
    (["--emulate-cp", "4", "--node-size", "3"], "--node-size 3: the hierarchical ring needs nodes"),
    (["--node-size", "-1"], "--node-size -1"),
])
def test_bench_ring_checks_its_arguments_before_running(argv, words, capsys):
    """`mtrain bench ring` refuses a bad --schedules or --node-size before it starts (before: minutes of running,
    then a traceback or a silently dropped variant)."""
    from mtrain.bench.ring import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err
