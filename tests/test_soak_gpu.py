"""GPU soak (randomized rounds find the hangs and wrong rows that single tests miss;
docs/faults.md), selected with ``-m soak`` only: tools/soak.py with 2 and 4 ranks (sharing
the visible GPUs where there are fewer), >= 10^4 randomized rounds per rank of the layer as
vLLM runs it (validate_ids off, no barrier between rounds; in rotation: dispatch -> composed
experts -> combine, the fused kernel as the expert stage, the whole layer fused, the one-GPU
fused op with block-fp8 weights; bf16 and every fp8 wire; int32 and int64 ids) with
CUDA-graph replays, against the reference; each run appends its line to
examples/results/soak_<gpu>_<G>gpu_<R>ranks.jsonl and must count 0 mismatches.

    pytest -q -m soak tests/test_soak_gpu.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import num_gpus, requires_extension, requires_gpu
from script_module import script_env

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = int(os.environ.get("PETIT_SOAK_ROUNDS", "10000"))


@pytest.mark.soak
@requires_gpu
@requires_extension
@pytest.mark.parametrize("world", [2, 4])
def test_soak(world, tmp_path):
    out = tmp_path / "soak.jsonl"
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--ranks",
                             str(world), "--rounds", str(ROUNDS), "--out", str(out)],
                            env=script_env(), capture_output=True, text=True, timeout=6 * 3600)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    row = json.loads(out.read_text().splitlines()[-1])
    from vllm_petit_moe.testing.soak import PATHS, WIRES, soak_results_name
    assert (row["ranks"], row["gpus"]) == (world, min(world, num_gpus())), row
    results = ROOT / "examples" / "results" / (
        soak_results_name(row["gpu"], row["gpus"], row["ranks"]) + ".jsonl")
    with results.open("a") as f:
        f.write(json.dumps(row) + "\n")
    assert row["rounds"] >= ROUNDS * world and row["graph_replays"] > 0, row
    ran = [f"rounds_{p}" for p in PATHS] + [f"rounds_wire_{w}" for w in WIRES] + [
        "rounds_ids_int32", "rounds_ids_int64", "rounds_weights_fp8"]
    assert all(row[key] > 0 for key in ran), row
    assert row["mismatches"] == 0, row
