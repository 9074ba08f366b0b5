"""Runs the Triton kernel tests of mtrain.ops in Triton's CPU interpreter, in fresh processes: triton.jit
reads TRITON_INTERPRET when triton and our kernels are first imported, and at run time, so it cannot be
switched on inside a test session that may already have imported triton for compiled use.

Only the tests marked `needs_interpreter` run there: this module, loaded as a plugin of those processes
(`-p test_ops_interpreter`), deselects the others (torch-only cases, which this session runs already). A few kernel
tests, one per kernel family, run in the quick suite (`QUICK`), with the interpreter tests of other files
(`QUICK_ELSEWHERE`) in the same process; all the others under `slow`, in two processes at once
(each on a share of the files: the interpreter runs one thread, and this session only waits)."""

import os
import subprocess
import sys

import pytest
import torch

KERNEL_TEST_FILES = [
    "test_ops_partial.py", "test_ops_sparse_attention.py", "test_ops_docmask.py", "test_ops_subtile.py",
    "test_ops_estimate_kernel.py", "test_ops_merge_kernel.py", "test_ops_columns.py", "test_ops_index.py",
]
# the slow run's two processes, about equal in interpreter time (seconds on 2 cores, by file: index 30, estimate_kernel
# 25, columns 22, sparse_attention 22, partial 10, subtile 8, docmask 7, merge 3)
SHARDS = [["test_ops_index.py", "test_ops_columns.py", "test_ops_docmask.py", "test_ops_merge_kernel.py"],
          ["test_ops_estimate_kernel.py", "test_ops_sparse_attention.py", "test_ops_partial.py", "test_ops_subtile.py"]]
# the quick suite's kernel tests: the attention kernels' forward and backward against float64 (GQA, ragged lengths),
# a ring step's partial results merged, the fused merge, the Triton scorer's recall, the Triton index builder, the
# list-free columns (the ring's at large caps)
QUICK = ["test_ops_sparse_attention.py::test_triton_fp32_matches_float64_reference",
         "test_ops_partial.py::test_two_shards_merge_to_full_attention",
         "test_ops_merge_kernel.py::test_fused_merge_equals_the_torch_merge",
         "test_ops_estimate_kernel.py::test_triton_scorer_est_recall_against_float64",
         "test_ops_index.py::test_triton_builder_covers_full_and_empty_patterns",
         "test_ops_columns.py::test_attention_with_list_free_columns_matches_reference[triton-72-16-1-1-False-False]"]
# kernel tests of other files, run in the same quick process (each would otherwise start an interpreter of its own): the
# quality check's output error, moba and xattention, `mtrain bench check`'s Triton engines
QUICK_ELSEWHERE = ["test_quality_check.py::test_block_output_error_through_the_triton_kernels_in_the_interpreter",
                   "test_quality_check.py::test_block_output_error_plans_its_dense_lists_on_the_host",
                   "test_baselines_interpreter.py::test_baselines_through_triton_kernels_in_interpreter",
                   "test_bench_cli.py::test_check_smoke"]
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
REASON = "Triton kernel test: run by test_kernel_tests_in_interpreter_process"
needs_interpreter = pytest.mark.skipif(not IN_INTERPRETER, reason=REASON)
ONLY_KERNEL_TESTS = "MTRAIN_ONLY_INTERPRETER_TESTS"  # set in the interpreter's processes: deselect the rest
HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    """A plugin hook (`-p test_ops_interpreter`, in the interpreter's processes only): keep the tests marked
    `needs_interpreter`, deselect the others."""
    if os.environ.get(ONLY_KERNEL_TESTS) != "1":
        return
    keep, drop = [], []
    for item in items:
        marked = any(m.kwargs.get("reason") == REASON for m in item.iter_markers("skipif"))
        (keep if marked else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _run_in_interpreter(tmp_path, runs: list[list[str]]) -> None:
    """`pytest ARGS` for each ARGS of `runs`, all at once, each in a fresh process running Triton's interpreter with
    one thread; each must pass every test it selects, skipping none."""
    paths = [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", **{ONLY_KERNEL_TESTS: "1"})
    procs, logs = [], []
    for n, args in enumerate(runs):
        logs.append((tmp_path / f"run{n}.out", tmp_path / f"run{n}.err"))
        with open(logs[-1][0], "w") as out, open(logs[-1][1], "w") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                                           "test_ops_interpreter", *args], cwd=os.path.dirname(HERE), env=env,
                                          stdout=out, stderr=err))
    try:
        for proc in procs:
            proc.wait(timeout=900)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (out, err) in zip(procs, logs):
        out, err = out.read_text(), err.read_text()
        assert proc.returncode == 0, out[-4000:] + err[-2000:]
        last = out.strip().splitlines()[-1]
        # every selected test ran and passed, none skipped (a kernel test skipped in the interpreter tests nothing)
        assert " passed" in last and "skipped" not in last, out[-2000:]


skip_here = [pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the kernel tests in the interpreter"),
             pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests are for CPU machines")]


@skip_here[0]
@skip_here[1]
def test_kernel_tests_in_interpreter_process(tmp_path):
    """The quick suite's kernel tests (`QUICK`, `QUICK_ELSEWHERE`)."""
    _run_in_interpreter(tmp_path, [[f"tests/{node}" for node in QUICK + QUICK_ELSEWHERE]])


@skip_here[0]
@skip_here[1]
@pytest.mark.slow  # the other ~100 kernel tests: ~1 min of two processes
def test_all_other_kernel_tests_in_interpreter_processes(tmp_path):
    assert sorted(sum(SHARDS, [])) == sorted(KERNEL_TEST_FILES)
    assert all(node.split("::")[0] in KERNEL_TEST_FILES for node in QUICK)
    quick = [arg for node in QUICK for arg in ("--deselect", f"tests/{node}")]  # node ids: from the root
    _run_in_interpreter(tmp_path, [[*quick, *[f"tests/{name}" for name in shard]] for shard in SHARDS])
