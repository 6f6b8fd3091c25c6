"""hpctrain/comm/shm_memory.py: a shared window's sparse file is backed up front, so a /dev/shm that
cannot hold it gives an error line, not a SIGBUS at the first write (the kernel's MADV_POPULATE_WRITE)."""
import ctypes
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.comm.shm_memory import container_shm_fix, populate

ROOT = Path(__file__).resolve().parents[2]

# A 1 MiB sparse file in a 64 KiB tmpfs mounted over /dev/shm in a private mount namespace: what
# MPICH's Allocate_shared makes (one write at the end, then mmap) where /dev/shm is too small.
SPARSE_IN_TINY_SHM = """
import ctypes, mmap, os, sys, tempfile
from hpctrain.comm.shm_memory import populate
fd, path = tempfile.mkstemp(dir="/dev/shm")
os.pwrite(fd, b"\\0", (1 << 20) - 1)
memory = mmap.mmap(fd, 1 << 20)
os.unlink(path)
view = (ctypes.c_char * len(memory)).from_buffer(memory)
print("REASON", populate(ctypes.addressof(view) + 100, len(memory) - 100), flush=True)
view[len(memory) // 2] = b"x"  # an unbacked page: SIGBUS here (what populate spares the ranks)
"""


def test_populate_backs_ordinary_memory_and_keeps_its_contents():
    memory = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    view = (ctypes.c_char * len(memory)).from_buffer(memory)
    view[10] = b"z"
    assert populate(ctypes.addressof(view) + 10, len(memory) - 10) == ""  # an unaligned start is fine
    assert view[10] == b"z"
    del view
    memory.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a tmpfs in a private mount namespace needs root and unshare(1)")
def test_a_window_that_a_tiny_dev_shm_cannot_hold_is_a_reason_not_a_sigbus():
    script = "mount -t tmpfs -o size=64k tmpfs /dev/shm && exec \"$@\""
    result = subprocess.run(["timeout", "60", "unshare", "--mount", "sh", "-c", script, "sh", sys.executable,
                             "-c", SPARSE_IN_TINY_SHM], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    if "REASON" not in result.stdout and "mount" in result.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    line = next(s for s in result.stdout.splitlines() if s.startswith("REASON"))
    assert "/dev/shm cannot hold it (MADV_POPULATE_WRITE: Bad address; " in line, line
    assert "bytes free there): too small" in line and "or full" in line, line
    assert result.returncode == -7 or result.returncode == 128 + 7, result  # the write itself does SIGBUS


@pytest.mark.parametrize("marker, flag", [
    ("run/.containerenv", "--shm-size="), (".dockerenv", "--shm-size="),
    ("var/run/secrets/kubernetes.io/serviceaccount", "medium: Memory"), (".singularity.d/env", "--bind /dev/shm"),
])
def test_inside_a_container_the_reason_names_the_runtime_flag_for_a_larger_dev_shm(tmp_path, marker, flag):
    assert container_shm_fix(str(tmp_path)) == ""  # no marker: not a container hpctrain recognises
    (tmp_path / marker).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / marker).touch()
    assert flag in container_shm_fix(str(tmp_path))


def test_a_dev_shm_too_small_for_mpi_is_named_before_mpi_starts(tmp_path, monkeypatch):
    from hpctrain.comm import shm_memory

    monkeypatch.setattr(shm_memory, "shm_free_bytes", lambda path=None: 1 << 20)  # podman --shm-size=1m
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".containerenv").write_text("")
    problem = shm_memory.too_small_for_mpi(root=str(tmp_path))
    assert problem and "1.0 MiB free" in problem and "at least 2 MiB" in problem and "--shm-size=1g" in problem
    monkeypatch.setattr(shm_memory, "shm_free_bytes", lambda path=None: 64 << 20)  # podman's default: enough here
    assert shm_memory.too_small_for_mpi(root=str(tmp_path)) is None


def test_the_container_kind_and_its_fixes_for_the_run_directory_and_the_mpi(tmp_path):
    from hpctrain.runtime.container import bind_fix, container_kind, mpi_fix

    assert container_kind(str(tmp_path)) == "" and bind_fix("", "/runs") == "" and mpi_fix("") == ""
    (tmp_path / "run").mkdir()
    (tmp_path / "run/.containerenv").touch()
    kind = container_kind(str(tmp_path))
    assert kind == "podman/docker" and "-v HOST_DIR:/runs, without :ro" in bind_fix(kind, "/runs")
    assert "MPI4PY_LIBMPI" in mpi_fix(kind)
