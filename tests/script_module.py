"""Load one of the repository's scripts (examples/*.py, tools/*.py) as a module, for the CPU
tests of their helpers, or run its --help."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_petit_moe.testing import scripts

ROOT = Path(__file__).resolve().parent.parent


def load_script(relpath: str):
    """The script at ROOT/relpath, executed as the module named after its file (registered in
    sys.modules, where dataclasses and pickling look a module up). The sibling scripts it
    imports by name (examples import each other that way) come from examples/, which
    pyproject.toml's pytest ``pythonpath`` lists, as when it runs as a script."""
    return scripts.load_script(ROOT / relpath)


def script_help(relpath: str) -> str:
    """The --help text of the script at ROOT/relpath, run in a fresh interpreter (asserting it
    exits 0, with its stderr in the message otherwise)."""
    result = subprocess.run([sys.executable, str(ROOT / relpath), "--help"],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout
