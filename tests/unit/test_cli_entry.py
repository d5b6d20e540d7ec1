"""The ``ckptd`` command's entry point: a Ctrl-C while the CLI still imports ends
it as a later one does (exit 130, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

# A Ctrl-C that lands while ``ckptd.cli`` imports typer: raised where the signal's
# KeyboardInterrupt would be, deterministically (a real one lands anywhere in ~0.3 s).
_INTERRUPTED_IMPORT = """
import sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "typer":
            raise KeyboardInterrupt
        return None
sys.meta_path.insert(0, Interrupt())
from importlib.metadata import entry_points
(script,) = [e for e in entry_points(group="console_scripts") if e.name == "ckptd"]
sys.argv = ["ckptd", "--version"]
sys.exit(script.load()())
"""


def test_the_command_is_the_guarded_entry_point() -> None:
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "ckptd"]
    assert script.value == "ckptd.__main__:main"


def test_a_ctrl_c_while_the_cli_imports_is_exit_130_without_a_traceback() -> None:
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


def test_python_dash_m_runs_the_same_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "ckptd", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("ckptd "), done
