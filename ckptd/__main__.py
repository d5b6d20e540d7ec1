"""``python -m ckptd`` and the ``ckptd`` command. The CLI's imports take a few
tenths of a second: a Ctrl-C among them ends the command as one later does (exit
130, no traceback), since nothing of the CLI is there yet to catch it.

SIGTERM ends a command as Ctrl-C does (its cleanup, its one line), with exit 143.
Python leaves SIGTERM to the kernel's default, which kills the process, except
for a container's first process (PID 1: an image's ``ENTRYPOINT ["ckptd"]``),
which the kernel never kills for a signal it has no handler for: an init
container's ``ckptd restore`` or a Job's ``ckptd gc`` waited out the whole grace
period, then SIGKILL. ``ckptd serve`` has uvicorn's own handler (it drains)."""

import signal
import sys
from types import FrameType

_terminated = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _terminated
    _terminated = True
    raise KeyboardInterrupt  # (every command's Ctrl-C way out)


def main() -> None:
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # (not one ignored on purpose)
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from ckptd.cli import main as cli
    except KeyboardInterrupt:
        sys.exit(143 if _terminated else 130)
    try:
        cli()
    except SystemExit as exc:
        if _terminated and exc.code == 130:
            sys.exit(143)
        raise


if __name__ == "__main__":
    main()
