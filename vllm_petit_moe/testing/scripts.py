"""Load one of the repository's scripts (examples/*.py, tools/*.py) as a module by its path: for
a tool that reuses a benchmark's inputs, and for the CPU tests of the scripts' helpers."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_script(path):
    """The script at ``path``, executed as the module named after its file (registered in
    sys.modules, where dataclasses and pickling look a module up). Only the file itself is
    loaded by path: the modules it imports by name (a sibling script such as
    ``bench_tpot_gsm8k``) must be importable, as they are when its folder is on the path (a
    script's own folder is when it runs; under pytest, pyproject.toml's ``pythonpath``)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
