"""Load one of the repository's scripts (examples/*.py, tools/*.py) as a module, for the CPU
tests of their helpers, or run its --help."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(relpath: str):
    """The script at ROOT/relpath, executed as the module named after its file (registered in
    sys.modules, where dataclasses and pickling look a module up), with its folder on sys.path
    as when it runs as a script (examples import each other and bench_env that way)."""
    path = ROOT / relpath
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def script_help(relpath: str) -> str:
    """The --help text of the script at ROOT/relpath, run in a fresh interpreter (asserting it
    exits 0, with its stderr in the message otherwise)."""
    result = subprocess.run([sys.executable, str(ROOT / relpath), "--help"],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout
