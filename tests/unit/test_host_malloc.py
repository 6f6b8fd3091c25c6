"""train.host_malloc (hpctrain/runtime/host_malloc.py): under `keep` a freed 24 MiB block is reused without its
pages faulting in again; the C library's own behaviour maps it apart and returns it, so they fault again. Each
setting in a process of its own (mallopt is process-wide)."""
import subprocess
import sys

import pytest

from hpctrain.runtime.host_malloc import _glibc

PROGRAM = """
import ctypes, resource, sys, torch
from hpctrain.runtime.host_malloc import configure_host_malloc
print(configure_host_malloc(sys.argv[1], torch.device(sys.argv[2])))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 24 * 2**20
block = libc.malloc(size); libc.memset(block, 1, size); libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size); libc.memset(block, 1, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setting: str, device: str = "cpu") -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, setting, device], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    return out[0], int(out[1])


@pytest.mark.skipif(_glibc() is None, reason="mallopt is glibc's")
def test_keep_reuses_freed_blocks_and_system_leaves_the_c_library_alone():
    pages = 24 * 2**20 // 4096
    words, faults = _faults("auto")  # a CPU device: keep
    assert "freed memory kept for reuse" in words and faults < pages // 10, (words, faults)
    words, faults = _faults("keep", "meta")  # asked for on any device
    assert "freed memory kept for reuse" in words and faults < pages // 10, (words, faults)
    for setting, device in (("system", "cpu"), ("auto", "meta")):  # auto off the CPU: the C library's own
        words, faults = _faults(setting, device)
        assert "the C library's own" in words and faults >= pages * 9 // 10, (setting, device, words, faults)
