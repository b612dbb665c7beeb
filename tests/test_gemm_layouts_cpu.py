"""CPU: the Hopper tile configurations' thread -> (row, column) maps, checked on the host
against the PTX accumulator layout of wgmma.m64nNk16 (tests/emu/gemm_layout_check.cu, built
with nvcc): every output of a tile produced exactly once, and each accumulator fed by the
shared-memory B row of its own group and column (the gated gate/up order included)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nvcc() -> str | None:
    cuda_home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    candidate = cuda_home / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else shutil.which("nvcc")


def test_tile_configs_match_the_wgmma_accumulator_layout(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc (CUDA_HOME/bin/nvcc)")
    binary = tmp_path / "gemm_layout_check"
    build = subprocess.run(
        [nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}",
         str(ROOT / "tests/emu/gemm_layout_check.cu"), "-o", str(binary)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK: 0 failure(s)"), run.stdout
    for config in ("wgmma gate/up", "wgmma down", "wgmma_m64 gate/up", "wgmma_m64 down",
                   "wgmma_narrow gate/up", "wgmma_narrow down", "wgmma_mc gate/up",
                   "wgmma_mc down"):
        assert f"\n{config}:" in "\n" + run.stdout, run.stdout
