"""``python -m ckptd`` and the ``ckptd`` command. The CLI's imports take a few
tenths of a second: a Ctrl-C among them ends the command as one later does (exit
130, no traceback), since nothing of the CLI is there yet to catch it."""

import sys


def main() -> None:
    try:
        from ckptd.cli import main as cli
    except KeyboardInterrupt:
        sys.exit(130)
    cli()


if __name__ == "__main__":
    main()
