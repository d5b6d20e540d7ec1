"""A staging error kept past ``close()`` stays safe to print: the tensor views of
the pool its traceback frames hold keep their mapping alive (tested in a child
process, which the old code killed with SIGSEGV)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

CHILD = """
    import sys, traceback, torch
    from ckptd.client import Checkpointer

    class Refusing(torch.Tensor):
        '''A tensor whose copy fails: staging raises inside its copy into the pool.'''

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_:
                raise RuntimeError("this tensor refuses to be copied")
            return super().__torch_function__(func, types, args, kwargs or {})

    url, shm = sys.argv[1:]
    state = {"w": torch.randn(1 << 20).as_subclass(Refusing)}
    kept = None
    try:
        with Checkpointer(url, "kept", shm_dir=shm) as ckpt:
            ckpt.save(1, state)
    except RuntimeError as exc:
        kept = exc  # the pool is closed and unmapped by now
    assert kept is not None
    # What a debugger, pytest or an error reporter does with a kept error: its frames'
    # locals, the pool's views among them, are read and printed.
    text = "".join(traceback.TracebackException.from_exception(
        kept, capture_locals=True).format())
    print(repr(kept), "".join(traceback.format_exception(kept)))
    views = 0
    tb = kept.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, torch.Tensor) and not isinstance(value, Refusing):
                views += 1
                print(value.sum().item(), repr(value)[:60])
        tb = tb.tb_next
    print("views", views, "dst =" in text)
"""


def test_a_staging_error_kept_past_close_prints_without_crashing(
    tmp_path: Path, shm: Path
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), f"file://{tmp_path / 'store'}",
         str(shm)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("views ") and int(last.split()[1]) > 0 and last.endswith("True"), last
    assert list(shm.rglob("*")) == []  # closing still removed the pool's files
