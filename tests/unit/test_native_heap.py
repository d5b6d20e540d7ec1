"""The server fixes glibc's mmap threshold (server/native_heap.py): a large block
freed is given back at once, whatever blocks were freed before it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckptd.server.native_heap import bound_native_heap

# Frees a 16 MiB block (which raises glibc's own threshold to 16 MiB), then makes
# and frees 1 MiB blocks between small long-lived objects, and prints how much of
# them the heap still holds (glibc's mallinfo2: arena bytes not in use).
_PROBE = """
import ctypes, sys
from ckptd.server.native_heap import bound_native_heap
if sys.argv[1] == "bound":
    assert bound_native_heap() == 128 * 1024
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
big = bytearray(16 << 20); del big
kept = []
for i in range(64):
    block = bytearray(1 << 20)
    kept.append(bytearray(64))
    del block
print(libc.mallinfo2().fordblks)
"""


def _free_heap_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_large_blocks_leave_the_heap_once_bounded() -> None:
    # glibc's own threshold: the 1 MiB blocks came from the heap, and its free bytes
    # stay there; bounded: they were mapped apart and are gone.
    assert _free_heap_bytes("glibc") >= 1 << 20
    assert _free_heap_bytes("bound") < 1 << 20


def test_the_threshold_is_left_alone_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_MALLOC_MMAP_THRESHOLD", "0")
    assert bound_native_heap() is None
    monkeypatch.setenv("CKPTD_MALLOC_MMAP_THRESHOLD", "262144")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc's own variable wins
    assert bound_native_heap() is None
