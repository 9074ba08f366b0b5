"""Runs the Triton kernel tests of mtrain.ops in Triton's CPU interpreter, in a fresh process: triton.jit
reads TRITON_INTERPRET when triton and our kernels are first imported, and at run time, so it cannot be
switched on inside a test session that may already have imported triton for compiled use."""

import os
import subprocess
import sys

import pytest
import torch

KERNEL_TEST_FILES = [
    "test_ops_partial.py", "test_ops_sparse_attention.py", "test_ops_docmask.py", "test_ops_subtile.py",
    "test_ops_estimate_kernel.py", "test_ops_merge_kernel.py", "test_ops_columns.py",
]
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not IN_INTERPRETER, reason="Triton kernel test: run by test_kernel_tests_in_interpreter_process"
)


@pytest.mark.skipif(IN_INTERPRETER, reason="this process already runs the kernel tests in the interpreter")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests are for CPU machines")
def test_kernel_tests_in_interpreter_process():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    files = [os.path.join(here, name) for name in KERNEL_TEST_FILES]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                         cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
