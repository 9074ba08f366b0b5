"""A build lock left by a killed compile of DeepSpeed's CPU ops is removed (and said), a live build's is kept."""

from __future__ import annotations

import logging
import os
import time

from mtrain.train.extensions import build_dir, clear_stale_locks


def _folder(root, name, lock_age, newest_file_age=None):
    folder = build_dir(name)
    assert folder.startswith(str(root)), "TORCH_EXTENSIONS_DIR must place the op's folder"
    os.makedirs(folder, exist_ok=True)
    now = time.time()
    lock = os.path.join(folder, "lock")
    open(lock, "w").close()
    os.utime(lock, (now - lock_age, now - lock_age))
    if newest_file_age is not None:
        obj = os.path.join(folder, "shm.o")
        open(obj, "w").close()
        os.utime(obj, (now - newest_file_age, now - newest_file_age))
    return lock


def test_a_stale_lock_is_removed_and_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _folder(tmp_path, "deepspeed_shm_comm", lock_age=3600, newest_file_age=3000)
    with caplog.at_level(logging.WARNING):
        assert clear_stale_locks() == [lock]
    assert not os.path.exists(lock)
    assert lock in caplog.text


def test_a_live_build_keeps_its_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    young = _folder(tmp_path, "deepspeed_shm_comm", lock_age=30)
    writing = _folder(tmp_path, "cpu_adam", lock_age=3600, newest_file_age=5)  # old lock, objects still being written
    assert clear_stale_locks() == []
    assert os.path.exists(young) and os.path.exists(writing)


def test_no_folder_or_no_lock_is_nothing_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert clear_stale_locks() == []
    os.makedirs(build_dir("cpu_adam"), exist_ok=True)
    open(os.path.join(build_dir("cpu_adam"), "cpu_adam.so"), "w").close()
    assert clear_stale_locks(now=time.time() + 10 ** 6) == []


def test_build_dir_is_torchs_and_creates_nothing(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # torch's default root follows the user cache folder
    path = build_dir("no_such_op")
    assert not os.path.exists(path)
    assert path == _get_build_directory("no_such_op", False)
