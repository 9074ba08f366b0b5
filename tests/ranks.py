"""Gloo ranks for the multi-rank CPU tests, forked from a server that imported torch and mtrain once.

Spawned, each rank imports torch, mtrain's ring and what the first backward pulls in (torch.fx's symbolic shapes,
sympy) itself: ~4 s of CPU a rank, paid again by every test that starts ranks. `run_ranks` forks them instead from
a fork server (multiprocessing's `forkserver`) that preloaded those modules and has run no torch op (no OpenMP pool
to inherit); each rank still sets its own threads and process group.

Servers, each started on first use and kept for the session: one for ranks that run torch only (most tests),
one started with TRITON_INTERPRET=1 for ranks that run our Triton kernels in the interpreter (triton.jit reads the
variable when a kernel module is imported, so a rank cannot switch after the server imported them), one that also
imported transformers and mtrain's models for the worker scripts of tests/workers/ (`run_script`), and one for
`python -m mtrain` (`run_mtrain`, `run_module`). `run_script` and `run_module` start a rank as `torchrun
--standalone` would (its variables, one thread, the repository as working directory). The servers are this
module's own, not multiprocessing's global one.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

# What the servers import before forking: a rank starts with torch, the ring and the estimate loaded (none of these
# imports Triton).
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch.fx.experimental.symbolic_shapes",
           "mtrain.parallel", "mtrain.parallel.estimate", "mtrain.parallel.plan", "mtrain.ops.partial_autograd",
           "mtrain.ops.estimate", "mtrain.ops.recall"]

# The interpreter's server imports Triton and our kernels too (interpreted: it runs with TRITON_INTERPRET=1).
PRELOAD_INTERPRET = PRELOAD + ["triton", "mtrain.ops._triton_attention", "mtrain.ops._triton_estimate",
                               "mtrain.ops._triton_index", "mtrain.ops._triton_merge"]

# The worker scripts' server (tests/workers/: tiny HF models under CP) imports transformers and mtrain's models too.
PRELOAD_MODELS = PRELOAD + ["transformers", "transformers.models.qwen2.modeling_qwen2",
                            "transformers.models.llama.modeling_llama", "mtrain.models.registry", "mtrain.tiny",
                            "mtrain.train.loss", "mtrain.config"]

# `python -m mtrain` under a launcher: the trainer, accelerate and the CLI as well. This server starts with the
# environment the CLI sets before it imports anything (mtrain.offline.set_offline: the hub's offline variables, which
# huggingface_hub reads when it is imported); DeepSpeed, which reads DS_ACCELERATOR when imported, is left to the ranks.
PRELOAD_CLI = PRELOAD_MODELS + ["accelerate", "mtrain.cli", "mtrain.train.trainer"]

_SERVERS: dict[str, object] = {}


def _server(kind: str):
    """kind: "torch", "interpret" (TRITON_INTERPRET=1), "models" (the worker scripts) or "cli" (`-m mtrain`)."""
    from multiprocessing import forkserver

    interpret = kind == "interpret"
    if kind not in _SERVERS:
        server = forkserver.ForkServer()
        preload = {"torch": PRELOAD, "interpret": PRELOAD_INTERPRET, "models": PRELOAD_MODELS, "cli": PRELOAD_CLI}[kind]
        server.set_forkserver_preload(preload)
        saved = dict(os.environ)
        os.environ.pop("TRITON_INTERPRET", None)
        if interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        if kind in ("torch", "interpret"):
            # every rank of these servers runs one thread (torchrun sets OMP_NUM_THREADS=1 for several ranks): numpy's
            # OpenBLAS (the interpreter's tl.dot) sizes its pool when the server imports it, from these variables
            os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        if kind == "cli":
            from mtrain.offline import set_offline

            set_offline([])
        try:
            server.ensure_running()  # the server process takes this environment, and its ranks with it
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _SERVERS[kind] = server
    return _SERVERS[kind]


@contextmanager
def _through(server):
    """multiprocessing's forkserver Popen connects through the module function: point it at `server` meanwhile."""
    from multiprocessing import forkserver

    saved = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = saved


def _entry(rank, fn, env, args):
    os.environ.update(env)
    fn(rank, *args)


def run_ranks(fn, world: int, args: tuple = (), *, interpret: bool = False, env: dict | None = None) -> None:
    """Run `fn(rank, *args)` on `world` processes forked from the server, and wait for them (as `mp.spawn(fn,
    args, nprocs=world, join=True)`; a rank's exception fails the call). `fn` must be importable by name (a
    module-level function of a test module or helper). `env` is set in each rank before `fn` runs: the
    parent's later environment does not reach a forked rank. `interpret`: the ranks run Triton's interpreter."""
    import torch.multiprocessing as mp

    server = _server("interpret" if interpret else "torch")
    with _through(server):
        mp.start_processes(_entry, args=(fn, dict(env or {}), tuple(args)), nprocs=world, join=True,
                           start_method="forkserver")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script_entry(rank, world, port, script, argv, env=None, log_dir=None):
    """A rank as torchrun --standalone starts one: its environment, one OpenMP thread, `python SCRIPT ARGS` (or
    `python -m MODULE ARGS` where `script` is "-m MODULE"); with `log_dir`, its stdout and stderr go to
    log_dir/rank{N}.log."""
    import runpy
    import sys

    import torch

    if log_dir is not None:
        log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd in (1, 2):
            os.dup2(log, fd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    os.environ.update(env or {})
    torch.set_num_threads(1)  # torchrun sets OMP_NUM_THREADS=1 for several ranks; the server's OpenMP read none
    os.chdir(REPO)
    if script.startswith("-m "):
        module = script[3:]
        sys.argv = [module, *argv]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    path = os.path.join(REPO, script)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:  # a free port for the ranks' store (torchrun --standalone picks one too)
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script(world: int, script: str, *argv: str):
    """`torchrun --standalone --nproc_per_node=WORLD SCRIPT ARGV` (SCRIPT relative to the repository) with the ranks
    forked from the models' server. Returns a subprocess.CompletedProcess: returncode 0, or 1 with the failing rank's
    traceback (or its signal, as torchrun's "exitcode: -N") in stderr."""
    import subprocess

    import torch.multiprocessing as mp

    try:
        with _through(_server("models")):
            mp.start_processes(_script_entry, args=(world, _free_port(), script, tuple(argv)), nprocs=world,
                               join=True, start_method="forkserver")
    except mp.ProcessExitedException as err:
        return subprocess.CompletedProcess(script, 1, "", f"{err}\nexitcode: {err.exit_code}\n")
    except mp.ProcessRaisedException as err:
        return subprocess.CompletedProcess(script, 1, "", str(err))
    return subprocess.CompletedProcess(script, 0, "", "")


def run_module(world: int, module: str, *argv: str, env: dict | None = None) -> tuple[int, str]:
    """`torchrun --standalone --nproc_per_node=WORLD -m MODULE ARGV` with the ranks forked from the CLI's server;
    `env` is set in each rank first (DS_ACCELERATOR=cpu for DeepSpeed). Returns (0 or 1, the ranks' stdout and
    stderr: rank 0's log, then the others', then a failing rank's traceback or signal)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as log_dir:
        returncode, failure = 0, ""
        try:
            with _through(_server("cli")):
                mp.start_processes(_script_entry, args=(world, _free_port(), f"-m {module}", tuple(argv),
                                                        dict(env or {}), log_dir),
                                   nprocs=world, join=True, start_method="forkserver")
        except mp.ProcessExitedException as err:
            returncode, failure = 1, f"{err}\nexitcode: {err.exit_code}\n"
        except mp.ProcessRaisedException as err:
            returncode, failure = 1, str(err)
        logs = []
        for rank in range(world):
            path = os.path.join(log_dir, f"rank{rank}.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    logs.append(f.read())
    return returncode, "".join(logs) + failure


def run_mtrain(world: int, *argv: str, env: dict | None = None) -> tuple[int, str]:
    """`torchrun --standalone --nproc_per_node=WORLD -m mtrain ARGV`, as `run_module`."""
    return run_module(world, "mtrain", *argv, env=env)


def _main_entry(_, target, argv, env, log_dir, cwd):
    """One process as `python TARGET ARGV` starts (no launcher variables): `target` "-m MODULE" or a script path
    relative to the repository; its stdout and stderr go to log_dir/stdout and log_dir/stderr. An uncaught exception
    prints its traceback and exits 1, as the interpreter does."""
    import runpy
    import sys
    import traceback

    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(os.path.join(log_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.update(env)
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.chdir(cwd)
    try:
        if target.startswith("-m "):
            sys.argv = [target[3:], *argv]
            runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
        else:
            path = os.path.join(REPO, target)
            sys.argv = [path, *argv]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)


class Launch:
    """Processes started by `start`: poll / wait / kill them as a launcher's process group, read their output."""

    def __init__(self, world, target, argv, env, launcher, cwd):
        import tempfile

        import torch.multiprocessing as mp

        self.world, self.returncode = world, None
        self._dir = tempfile.TemporaryDirectory()
        self.log_dir = self._dir.name
        with _through(_server("cli")):
            if launcher:
                args = (world, _free_port(), target, tuple(argv), dict(env or {}), self.log_dir)
                self._context = mp.start_processes(_script_entry, args=args, nprocs=world, join=False,
                                                   start_method="forkserver")
            else:
                self._context = mp.start_processes(_main_entry, args=(target, tuple(argv), dict(env or {}),
                                                                      self.log_dir, str(cwd or REPO)),
                                                   nprocs=1, join=False, start_method="forkserver")
        self._launcher, self._failure = launcher, ""

    def _join(self, timeout) -> bool:
        import torch.multiprocessing as mp

        try:
            done = self._context.join(timeout)
        except mp.ProcessExitedException as err:
            if self._launcher:  # as torchrun: 1, and the rank's exit code or signal in its report
                self.returncode, self._failure = 1, f"{err}\nexitcode: {err.exit_code}\n"
            else:  # the process's own status (a signal as -N, as subprocess reports it)
                self.returncode = err.exit_code
            return True
        except mp.ProcessRaisedException as err:
            self.returncode, self._failure = 1, str(err)
            return True
        if done:
            self.returncode = 0
        return done

    def poll(self):
        if self.returncode is None:
            self._join(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess
        import time

        deadline = None if timeout is None else time.time() + timeout
        while self.returncode is None and not self._join(1.0):
            if deadline is not None and time.time() > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(str(self._context), timeout)
        return self.returncode

    @property
    def pids(self) -> list[int]:
        """The processes' ids (one for a plain `python` start)."""
        return [process.pid for process in self._context.processes]

    def send_signal(self, sig) -> None:
        """Send `sig` to every process still running (as `Popen.send_signal`); `wait` then gives the exit status."""
        for process in self._context.processes:
            if process.is_alive():
                os.kill(process.pid, sig)

    def kill(self) -> None:
        """SIGKILL every process, as `kill -9` of a launcher's process group, and reap them."""
        import signal

        for process in self._context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
        for process in self._context.processes:
            process.join()
        self.returncode = -signal.SIGKILL

    def output(self) -> tuple[str, str]:
        """(stdout, stderr): with the launcher, rank 0's log, then the others', in stdout, and a failing rank's
        traceback or signal in stderr."""
        def read(name):
            path = os.path.join(self.log_dir, name)
            if not os.path.exists(path):
                return ""
            with open(path, errors="replace") as f:
                return f.read()

        if self._launcher:
            return "".join(read(f"rank{rank}.log") for rank in range(self.world)), self._failure
        return read("stdout"), read("stderr")

    def close(self) -> None:
        self._dir.cleanup()


def start(world: int, target: str, *argv: str, env: dict | None = None, launcher: bool = True, cwd=None) -> Launch:
    """Start `torchrun --standalone --nproc_per_node=WORLD TARGET ARGV` (`launcher`; TARGET "-m MODULE" or a script
    relative to the repository; the repository as working directory), or with `launcher=False` one plain `python
    TARGET ARGV` (no launcher variables; in `cwd`, by default the repository), its processes forked from the CLI's
    server; returns at once (`Launch`)."""
    if not launcher and world != 1:
        raise ValueError("a plain python process is one process")
    return Launch(world, target, argv, env, launcher, cwd)


def run_cli(*argv: str, module: str = "mtrain", env: dict | None = None, timeout: float = 300, cwd=None):
    """`python -m MODULE ARGV` (in `cwd`, by default the repository root), forked from the CLI's server instead of a
    fresh interpreter (the same program: runpy runs MODULE as __main__, in a process of its own); returns a
    subprocess.CompletedProcess with its exit status, stdout and stderr."""
    import subprocess

    launch = start(1, f"-m {module}", *argv, env=env, launcher=False, cwd=cwd)
    try:
        returncode = launch.wait(timeout)
        out, err = launch.output()
    finally:
        launch.close()
    return subprocess.CompletedProcess([module, *argv], returncode, out, err)
