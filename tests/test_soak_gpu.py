"""GPU soak (randomized rounds find the hangs and wrong rows that single tests miss;
docs/faults.md), selected with ``-m soak`` only: tools/soak.py at W=2 and W=4 (ranks
sharing the visible GPUs), >= 10^4 randomized rounds per rank of the EP layer (dispatch ->
composed experts -> combine, the fused kernel as the expert stage, or the whole layer fused,
in rotation where the shape qualifies) with CUDA-graph replays, against the reference; each
run appends its line to
examples/results/soak_<gpu>x<W>.jsonl and must count 0 mismatches.

    pytest -q -m soak tests/test_soak_gpu.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_extension, requires_gpu
from script_module import script_env

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = int(os.environ.get("PETIT_SOAK_ROUNDS", "10000"))


@pytest.mark.soak
@requires_gpu
@requires_extension
@pytest.mark.parametrize("world", [2, 4])
def test_soak(world, tmp_path):
    out = tmp_path / "soak.jsonl"
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--world",
                             str(world), "--rounds", str(ROUNDS), "--out", str(out)],
                            env=script_env(), capture_output=True, text=True, timeout=6 * 3600)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    row = json.loads(out.read_text().splitlines()[-1])
    results = ROOT / "examples" / "results" / f"soak_{row['gpu']}x{world}.jsonl"
    with results.open("a") as f:
        f.write(json.dumps(row) + "\n")
    assert row["rounds"] >= ROUNDS * world and row["graph_replays"] > 0, row
    assert row["rounds_megamoe"] > 0 and row["rounds_fused"] > 0, row
    assert row["mismatches"] == 0, row
