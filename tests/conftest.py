"""Shared fixtures. GPU tests skip with a reason on machines without CUDA devices; the
multi-rank pool runs W ranks on however many GPUs there are (ranks share GPUs if needed)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_petit_moe.testing.rank_pool import RankPool, ep_rank_pool


def num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def extension_available() -> bool:
    try:
        from vllm_petit_moe import _C  # noqa: F401
        return True
    except ImportError:
        return False


_emu_libraries: dict[str, ctypes.CDLL] = {}


def build_emu_library(tmp_path_factory, source: str) -> ctypes.CDLL:
    """tests/emu/<source>.cpp (kernel sources on the CPU emulation runtime) built with g++ into
    a shared library and loaded, once per test session; skips without g++ or the CUDA headers
    (uint4/dim3 only)."""
    if source in _emu_libraries:
        return _emu_libraries[source]
    root = Path(__file__).resolve().parent.parent
    cuda_include = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None or not (cuda_include / "cuda_runtime.h").exists():
        pytest.skip(f"needs g++ and the CUDA headers ({cuda_include}/cuda_runtime.h)")
    lib_path = tmp_path_factory.mktemp("emu") / f"{source}.so"
    cmd = [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread",
           f"-I{root / 'csrc'}", f"-I{cuda_include}", str(root / "tests" / "emu" / f"{source}.cpp"),
           "-o", str(lib_path)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    # the emulation links no CUDA runtime or driver: a symbol of theirs would resolve only in
    # a process that has loaded them (beside a CUDA build of torch), not on a CPU-only one
    nm = shutil.which("nm")
    if nm is not None:
        undefined = subprocess.run([nm, "-D", "-u", str(lib_path)], capture_output=True,
                                   text=True, check=True).stdout.split()
        cuda = sorted(sym for sym in undefined if sym.startswith("cu"))
        assert not cuda, f"{source}.so needs CUDA symbols the emulation does not define: {cuda}"
    _emu_libraries[source] = ctypes.CDLL(str(lib_path))
    return _emu_libraries[source]


def run_case(test_file: str, *args, env: dict | None = None,
             timeout: float = 900) -> subprocess.CompletedProcess:
    """``_case(*args)`` of the test module at ``test_file`` (pass its ``__file__``) in a fresh
    Python process, with ``env`` added to the environment: for what must not share the test
    process (a trap aborts it, a GPU fault ends its CUDA context, knobs are read once per
    process). The module's folder leads the child's PYTHONPATH, so it imports by name."""
    path = Path(test_file)
    pythonpath = os.pathsep.join(filter(None, [str(path.parent), os.environ.get("PYTHONPATH")]))
    code = f"import {path.stem} as t; t._case(*{args!r})"
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})})


def assert_case_ok(result: subprocess.CompletedProcess, what: str) -> None:
    """A run_case process exited 0 after printing "ok" last."""
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"{what} failed in its own process (exit {result.returncode}):\n"
        + (result.stdout + result.stderr)[-3000:])


requires_gpu = pytest.mark.skipif(num_gpus() == 0, reason="needs a CUDA GPU")
requires_extension = pytest.mark.skipif(not extension_available(),
                                        reason="compiled extension vllm_petit_moe._C not built")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "soak: long randomized GPU soak; runs only with -m soak")


def pytest_collection_modifyitems(config, items):
    """Soak tests run only when selected (``-m soak``), never by default."""
    if "soak" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="soak test: select it with -m soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def rank_pools():
    """Factory: rank_pools(W) -> a live RankPool of W ranks (restarted after a failure)."""
    def get(world_size: int) -> RankPool:
        if num_gpus() == 0:
            pytest.skip("needs a CUDA GPU")
        if not extension_available():
            pytest.skip("compiled extension vllm_petit_moe._C not built")
        max_ranks_per_gpu = int(os.environ.get("PETIT_TEST_MAX_RANKS_PER_GPU", "4"))
        if world_size > num_gpus() * max_ranks_per_gpu:
            pytest.skip(f"{world_size} ranks need >= {world_size // max_ranks_per_gpu} GPUs")
        pool = _pools.get(world_size)
        if pool is None or not pool.healthy:
            pool = _pools[world_size] = ep_rank_pool(world_size, num_gpus())
        return pool
    yield get
    for pool in _pools.values():
        pool.close()


# --------------------------------------------------------------------------------------------
# The vLLM plugin's CPU tests (tests/test_plugin_*_cpu.py, test_glue_faults_cpu.py): vLLM and
# tests/fakes.py are imported inside the fixtures, as only those modules need them (they skip
# without vLLM).
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_config():
    """fakes.make_vllm_config(): DP=2 + EP on the CPU device."""
    from fakes import make_vllm_config

    return make_vllm_config()


@pytest.fixture
def kernel_hook(monkeypatch):
    """The FusedMoEKernel patch installed for one test, with the GPU-only parts faked."""
    from fakes import FakeEpBuffer, single_node_cuda
    from vllm_petit_moe.vllm_glue import buffer_cache, compat, envs, hook

    created = []

    def create_buffer(group, config):
        buffer = FakeEpBuffer(0, 2, config.num_experts, call=None)
        created.append((group, config, buffer))
        return buffer

    runtime = single_node_cuda()
    monkeypatch.setattr(hook, "_runtime_provider", lambda: runtime)
    monkeypatch.setattr(buffer_cache, "_create_buffer", create_buffer)
    monkeypatch.setattr(hook, "_reported", set())
    monkeypatch.delenv(envs.VLLM_PETIT_MOE_STRICT, raising=False)
    monkeypatch.delenv(envs.VLLM_PETIT_MOE_EXPERTS, raising=False)
    monkeypatch.delenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, raising=False)
    buffer_cache.close_all_buffers()
    installed = compat.install_kernel_hook(hook.maybe_substitute, hook.maybe_substitute_experts)
    try:
        yield created
    finally:
        if installed:
            compat.uninstall_kernel_hook()
        buffer_cache.close_all_buffers()


@pytest.fixture(scope="module")
def workspace():
    from vllm.v1.worker import workspace as vllm_workspace

    if not vllm_workspace.is_workspace_manager_initialized():
        vllm_workspace.init_workspace_manager(torch.device("cpu"))


@pytest.fixture(scope="module")
def ep_emu_lib(tmp_path_factory):
    from test_dispatch_combine_emu_cpu import _load

    return _load(build_emu_library(tmp_path_factory, "ep_emu"))


@pytest.fixture(scope="module")
def megamoe_emu_lib(tmp_path_factory):
    return build_emu_library(tmp_path_factory, "megamoe_emu")
