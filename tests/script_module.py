"""Load one of the repository's scripts (examples/*.py, tools/*.py) as a module, for the CPU
tests of their helpers, or run its --help."""
from __future__ import annotations

import os
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


def script_env() -> dict:
    """The environment with this checkout first on PYTHONPATH, for a script run in a fresh
    interpreter: it imports this checkout's vllm_petit_moe, not another one installed."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath}


def script_help(relpath: str) -> str:
    """The --help text of the script at ROOT/relpath, run in a fresh interpreter (asserting it
    exits 0, with its stderr in the message otherwise)."""
    result = subprocess.run([sys.executable, str(ROOT / relpath), "--help"], env=script_env(),
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout
