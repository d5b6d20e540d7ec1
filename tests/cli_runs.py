"""``ckptd ARGS`` as the tests run it: ``ckptd()`` returns what a shell would see
(exit code, stdout, stderr) as a ``subprocess.CompletedProcess``.

By default a command runs in the test's own process, through ``ckptd.cli.main``,
the function the installed ``ckptd`` script calls once ``ckptd.__main__`` has set
its SIGTERM handler: the same parsing, the same one-line mistakes, the same exit
codes, without an interpreter start and the CLI's imports (about 0.6 CPU-s each, a
few minutes of the CI machine over the suite). Its stdout, stderr, environment,
working directory, console width and logging are its own while it runs, and put
back after.

A command runs as its own process (``spawn=True``, or ``CKPTD_TEST_SPAWN=1`` for
every one) where the process is what is tested: the entry point and its signals
(``tests/unit/test_cli_entry.py``, ``test_cli_sigterm.py``), ``demo`` (it starts
torchrun), ``code=`` (a Python program of the test's), or
commands run side by side (``ckptd_each``)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A command that starts processes of its own (torchrun): always spawned. (``serve``
# runs here: a test that wants a server running starts a ``ServerProcess``.)
_SPAWNED = frozenset({"demo"})
# One command in this process at a time: its streams, argv and directory are the
# process's (a test's own threads may ask for several at once).
_ONE_HERE = threading.Lock()


def ckptd(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
          code: str | None = None, spawn: bool = False, inherit: bool = False,
          environ: dict[str, str] | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``ckptd ARGS`` in the test's environment with ``CKPTD_*`` cleared (``inherit``:
    kept), then no retries, 80 columns and ``env`` over it; or in exactly ``environ``
    (what ``subprocess.run(env=...)`` gives)."""
    if environ is not None:
        whole = dict(environ)
    else:
        whole = {k: v for k, v in os.environ.items()
                 if inherit or not k.startswith("CKPTD_")}
        whole.update({"CKPTD_RETRIES": "0", "COLUMNS": "80", **(env or {})})
    if (spawn or code is not None or os.environ.get("CKPTD_TEST_SPAWN") == "1"
            or _SPAWNED & set(args[:1])):
        return _spawned(args, whole, cwd, code, timeout)
    return _here(args, whole, cwd)


def ckptd_each(*commands: Sequence[str], env: dict[str, str] | None = None,
               cwd: Path | None = None) -> list[subprocess.CompletedProcess[str]]:
    """``ckptd()`` of each of ``commands``, independent ones, in the order given: in
    this process one after another, or spawned side by side (each a process that
    mostly imports: one after another, they left a core of the CI machine idle)."""
    if os.environ.get("CKPTD_TEST_SPAWN") != "1":
        return [ckptd(*args, env=env, cwd=cwd) for args in commands]
    with ThreadPoolExecutor(min(len(commands), 4)) as pool:
        return list(pool.map(lambda args: ckptd(*args, env=env, cwd=cwd), commands))


def _spawned(args: Sequence[str], whole: dict[str, str], cwd: Path | None,
             code: str | None, timeout: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "ckptd",
                                                               *args]
    return subprocess.run(argv, capture_output=True, text=True, env=whole, cwd=cwd or REPO,
                          timeout=timeout)


def _here(args: Sequence[str], whole: dict[str, str],
          cwd: Path | None) -> subprocess.CompletedProcess[str]:
    from click.testing import CliRunner

    from ckptd import cli

    env: dict[str, str | None] = {k: None for k in os.environ if k not in whole}
    env.update(whole)
    columns = whole.get("COLUMNS", "")
    code: int | str | None = 0
    with (_ONE_HERE, CliRunner().isolation(env=env) as (out, err, _),
          _console_width(int(columns) if columns.isdigit() else 80), _argv(args),
          _cwd(cwd or REPO), _own_logging()):
        try:
            cli.main()
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # what the process would have died of: its traceback
            traceback.print_exc(file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        said_out, said_err = out.getvalue(), err.getvalue()
    if isinstance(code, str):  # (``sys.exit("text")``: the text on stderr, exit 1)
        said_err += (code + "\n").encode()
        code = 1
    return subprocess.CompletedProcess(
        ["ckptd", *args], 0 if code is None else code,
        said_out.decode("utf-8", "replace"), said_err.decode("utf-8", "replace"))


@contextlib.contextmanager
def _argv(args: Sequence[str]) -> Iterator[None]:
    before = sys.argv
    sys.argv = ["ckptd", *args]
    try:
        yield
    finally:
        sys.argv = before


@contextlib.contextmanager
def _cwd(where: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(where)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _console_width(columns: int) -> Iterator[None]:
    """The CLI's consoles read ``COLUMNS`` when made (at import): set as a process
    started with it would have them."""
    from ckptd import cli

    consoles = (cli.console, cli.err_console)
    before = [c._width for c in consoles]
    for c in consoles:
        c.width = columns
    try:
        yield
    finally:
        for c, width in zip(consoles, before, strict=True):
            c._width = width


@contextlib.contextmanager
def _own_logging() -> Iterator[None]:
    """A fresh process's logging (no root handler, so the command's ``basicConfig``
    writes to its stderr), and the test's put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logger.level for name, logger in logging.Logger.manager.loggerDict.items()
              if isinstance(logger, logging.Logger)}
    root.handlers = []
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = handlers, level
        for name, logger in logging.Logger.manager.loggerDict.items():
            if isinstance(logger, logging.Logger):
                logger.setLevel(levels.get(name, logging.NOTSET))
