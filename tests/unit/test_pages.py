"""Chunk files mapped for serving: a page that cannot be read is an answer, not a
SIGBUS (ckptd/pages.py)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptd.pages import map_readable, populate_read

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="MADV_POPULATE_READ is Linux's")


def test_a_chunk_file_maps_whole_and_read_in(tmp_path: Path) -> None:
    data = os.urandom(3 * mmap.PAGESIZE + 17)
    (tmp_path / "c").write_bytes(data)
    view = map_readable(tmp_path / "c")
    assert view is not None and bytes(view) == data


def test_a_missing_or_empty_chunk_file(tmp_path: Path) -> None:
    assert map_readable(tmp_path / "absent") is None
    (tmp_path / "empty").write_bytes(b"")
    view = map_readable(tmp_path / "empty")
    assert view is not None and len(view) == 0


@linux_only
def test_a_page_cut_off_under_the_map_is_found_before_it_is_touched(tmp_path: Path) -> None:
    path = tmp_path / "c"
    path.write_bytes(os.urandom(4 * mmap.PAGESIZE))
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    assert populate_read(view)
    os.truncate(path, mmap.PAGESIZE)  # the last three pages are gone under the map
    assert not populate_read(view)
    view.release()
    mm.close()


@linux_only
def test_touching_such_a_page_kills_the_process(tmp_path: Path) -> None:
    """Why the check is there: the same map, read without it, is a SIGBUS."""
    path = tmp_path / "c"
    path.write_bytes(os.urandom(4 * mmap.PAGESIZE))
    child = textwrap.dedent(f"""
        import mmap, os
        with open({str(path)!r}, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate({str(path)!r}, mmap.PAGESIZE)
        bytes(memoryview(mm))
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGBUS, done
