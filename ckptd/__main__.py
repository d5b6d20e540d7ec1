"""``python -m ckptd`` and the ``ckptd`` command. The CLI's imports take a few
tenths of a second: a Ctrl-C among them ends the command as one later does (exit
130, no traceback), since nothing of the CLI is there yet to catch it.

SIGTERM ends a command as Ctrl-C does (its cleanup, its line if it has one), with
exit 143. Python leaves SIGTERM to the kernel's default, which kills the process,
except for a container's first process (PID 1: an image's ``ENTRYPOINT
["ckptd"]``), which the kernel never kills for a signal it has no handler for: an
init container's ``ckptd restore`` or a Job's ``ckptd gc`` waited out the whole
grace period, then SIGKILL. ``ckptd serve`` has uvicorn's own handler (it drains).
A SIGTERM in the interpreter's own start, before ``main`` sets the handler (some
tens of ms), meets the kernel's default: it kills the process (143 in a shell),
or, for a PID 1, is lost.

An interrupt raised wherever the main thread is may land where nothing expects it
(among the imports, where pydantic turns it into a schema error; with a worker
thread left idle that the interpreter's exit then waits for): so once terminated
the process ends with ``os._exit(143)`` after its streams are flushed, not through
the interpreter's own exit, and a watchdog ends it so if the way out takes longer
than ``TERM_GRACE_S``. Where it lands in code whose exceptions Python prints and
drops (a weakref's callback, such as the imports' module locks, or a ``__del__``),
the interrupt is raised again at once, outside it, and nothing is printed."""

import contextlib
import os
import signal
import sys
import threading
from types import FrameType

TERM_GRACE_S = 5.0

_terminated = False
_dropped = False  # (the handler's interrupt landed where Python drops exceptions)


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # (closed, or a broken pipe)
            stream.flush()
    os._exit(code)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _terminated, _dropped
    if _terminated and not _dropped:
        return  # (a second SIGTERM: the first's way out, or its watchdog, ends it)
    if not _terminated:
        _terminated = True
        watchdog = threading.Timer(TERM_GRACE_S, _exit_now, (128 + signum,))
        watchdog.daemon = True
        watchdog.start()
    _dropped = False
    on_sigint = signal.getsignal(signal.SIGINT)
    if callable(on_sigint) and on_sigint is not signal.default_int_handler:
        # ``asyncio.run``'s own Ctrl-C handler: it cancels the loop's main task, so the
        # loop's cleanup runs, then raises the KeyboardInterrupt itself. One raised
        # here could land in one of the loop's tasks and end ``asyncio.run``'s
        # shutdown before any cleanup (a collection's lease was kept, not handed back).
        on_sigint(signal.SIGINT, frame)
        return
    raise KeyboardInterrupt  # (every command's Ctrl-C way out)


def _on_unraisable(unraisable: "sys.UnraisableHookArgs") -> None:
    """An interrupt raised where Python drops exceptions (it would print it and go
    on) is raised again by its signal, sent once that code has returned: from
    another thread, as a handler runs at once in the thread that signals itself."""
    global _dropped
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)
        return
    _dropped = _terminated  # (a Ctrl-C's handler raises it again as it is)
    again = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM if _terminated
                                            else signal.SIGINT))
    again.daemon = True
    again.start()


def main() -> None:
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # (not one ignored on purpose)
        signal.signal(signal.SIGTERM, _on_sigterm)
    sys.unraisablehook = _on_unraisable
    code: str | int | None = 0
    try:
        from ckptd.cli import main as cli

        cli()
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        if not _terminated:
            if isinstance(sys.exc_info()[1], KeyboardInterrupt):
                sys.exit(130)  # (a Ctrl-C among the imports)
            raise
    if _terminated:
        _exit_now(143)
    sys.exit(code)


if __name__ == "__main__":
    main()
