"""CPU-only tests of the vLLM plugin's entry point, flag registration and vLLM version checks
(``compat``), with the real vLLM (CI: 0.24.0 and 0.33.0, one environment each) and no GPU.

Tests that need a fresh process (plugin loading, lazy patching) run a short script in a
subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm_petit_moe.vllm_glue import compat, envs  # noqa: E402


# --------------------------------------------------------------------------------------------
# Entry point and register() (fresh processes)
# --------------------------------------------------------------------------------------------


def run_python(script: str, **env_overrides: str) -> dict:
    """Run ``script`` in a fresh interpreter; it prints one JSON object as its last line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(env_overrides)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_entry_point_is_discovered():
    from importlib.metadata import entry_points

    from vllm_petit_moe import plugin

    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "petit_moe"]
    assert len(found) == 1, "pip install -e . registers the vllm.general_plugins entry point"
    assert found[0].value == "vllm_petit_moe.plugin:register"
    assert found[0].load() is plugin.register


_PROBE = """
    import json, sys
    import vllm.envs as vllm_envs
    from vllm.plugins import load_general_plugins
    mk_name = "vllm.model_executor.layers.fused_moe.modular_kernel"
    out = {{}}
    {body}
    print(json.dumps(out))
"""


def test_flag_is_unknown_to_vllm_without_the_plugin():
    # Control for the next test: vLLM's registry lacks the flag by itself, and where vLLM
    # validates VLLM_* variables (0.24; 0.33 no longer does) its strict check rejects it.
    out = run_python(_PROBE.format(body="""
    from vllm_petit_moe.vllm_glue.compat import validate_vllm_environ
    out["known"] = "VLLM_USE_PETIT_MOE" in vllm_envs.environment_variables
    out["validates"] = hasattr(vllm_envs, "validate_environ")
    try:
        validate_vllm_environ()
        out["rejected"] = False
    except ValueError:
        out["rejected"] = True
    """), VLLM_USE_PETIT_MOE="0")
    assert not out["known"]
    assert out["rejected"] is out["validates"]


def test_register_without_flag_only_registers_the_env_vars():
    out = run_python(_PROBE.format(body="""
    load_general_plugins()
    load_general_plugins()  # vLLM calls it in several places; only the first loads
    from vllm_petit_moe import plugin
    plugin.register()  # idempotent
    from vllm_petit_moe.vllm_glue.compat import validate_vllm_environ
    validate_vllm_environ()  # raises if the flag were unknown (where vLLM validates)
    out["registered"] = sorted(k for k in vllm_envs.environment_variables if "PETIT" in k)
    out["flag"] = vllm_envs.VLLM_USE_PETIT_MOE
    out["mk_imported"] = mk_name in sys.modules
    out["finders"] = [type(f).__name__ for f in sys.meta_path if "PostImport" in type(f).__name__]
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    out["patched"] = hasattr(FusedMoEKernel.__init__, "_petit_moe_original")
    """), VLLM_USE_PETIT_MOE="0")
    assert out == {
        "registered": ["VLLM_PETIT_MOE_EXPERTS", "VLLM_PETIT_MOE_EXPERTS_TILES",
                       "VLLM_PETIT_MOE_MAX_WAIT_S", "VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS",
                       "VLLM_PETIT_MOE_STRICT", "VLLM_PETIT_MOE_TIMEOUT_S", "VLLM_USE_PETIT_MOE"],
        "flag": False,
        "mk_imported": False,
        "finders": [],
        "patched": False,
    }


def test_register_with_flag_patches_lazily_and_once():
    out = run_python(_PROBE.format(body="""
    load_general_plugins()
    from vllm_petit_moe.vllm_glue.compat import validate_vllm_environ
    validate_vllm_environ()
    out["flag"] = vllm_envs.VLLM_USE_PETIT_MOE
    out["mk_imported_after_register"] = mk_name in sys.modules  # register() stays cheap
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    init = FusedMoEKernel.__init__
    out["patched"] = hasattr(init, "_petit_moe_original")
    from vllm_petit_moe import plugin
    from vllm_petit_moe.vllm_glue import hook
    plugin.register()
    hook.install()  # a second installation must not wrap twice
    out["same_patch"] = FusedMoEKernel.__init__ is init
    out["single_layer"] = not hasattr(init._petit_moe_original, "_petit_moe_original")
    out["finders_left"] = [
        type(f).__name__ for f in sys.meta_path if "PostImport" in type(f).__name__
    ]
    """), VLLM_USE_PETIT_MOE="1")
    assert out == {
        "flag": True,
        "mk_imported_after_register": False,
        "patched": True,
        "same_patch": True,
        "single_layer": True,
        "finders_left": [],
    }


def test_register_with_flag_patches_an_already_imported_kernel():
    out = run_python(_PROBE.format(body="""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
    from vllm_petit_moe import plugin
    plugin.register()
    out["patched"] = hasattr(FusedMoEKernel.__init__, "_petit_moe_original")
    """), VLLM_USE_PETIT_MOE="true")
    assert out == {"patched": True}


def test_malformed_flag_fails_at_registration(monkeypatch):
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "maybe")
    with pytest.raises(ValueError, match="VLLM_USE_PETIT_MOE"):
        envs.use_petit_moe()
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_TIMEOUT_S, "-1")
    with pytest.raises(ValueError, match="VLLM_PETIT_MOE_TIMEOUT_S"):
        envs.timeout_s()
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_EXPERTS, "2")
    with pytest.raises(ValueError, match="VLLM_PETIT_MOE_EXPERTS"):
        envs.petit_experts()
    assert envs.petit_experts_tiles() == "auto"
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_EXPERTS_TILES, "SIMT")
    assert envs.petit_experts_tiles() == "simt"
    for removed in ("huge", "decode", "wgmma_ws"):  # wgmma_ws: the warp-specialized one's old name
        monkeypatch.setenv(envs.VLLM_PETIT_MOE_EXPERTS_TILES, removed)
        with pytest.raises(ValueError, match="VLLM_PETIT_MOE_EXPERTS_TILES.*wgmma_mc"):
            envs.petit_experts_tiles()


# --------------------------------------------------------------------------------------------
# compat
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, supported",
    [("0.24.0", True), ("0.24.1.dev3+gabcdef", True), ("0.33.9", True), ("0.23.2", False),
     ("0.34.0", False), ("1.0.0", False), ("not-a-version", False)],
)
def test_supported_version_range(version, supported):
    assert compat.is_supported_vllm_version(version) is supported


def test_installed_vllm_is_in_range_and_setup_py_requires_the_same():
    """The installed vLLM is supported; the range setup.py gave pip is compat's, and neither
    vLLM nor torch is pinned to one version (installing must not move them)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    assert compat.require_supported_vllm() == compat.vllm_version()
    reqs = {r.name: r for r in map(Requirement, requires("vllm-petit-moe"))
            if r.marker is None}
    lo, hi = compat.MIN_SUPPORTED_VLLM, compat.MAX_SUPPORTED_VLLM
    assert str(reqs["vllm"].specifier) == f"<{hi[0]}.{hi[1] + 1},>={lo[0]}.{lo[1]}"
    assert str(reqs["torch"].specifier) == ""  # vLLM pins its torch; we build against it
    assert set(compat.GPU_TESTED_VLLM) <= set(compat.CPU_TESTED_VLLM)
    assert all(compat.is_supported_vllm_version(v) for v in compat.CPU_TESTED_VLLM)


def test_extension_built_for_another_torch_says_rebuild(monkeypatch):
    """The extension under a torch other than its build's fails with an undefined symbol;
    loading it says to rebuild (vLLM upgraded in place brings another torch)."""
    import importlib.abc

    import vllm_petit_moe

    class BuiltForAnotherTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "vllm_petit_moe._C":
                raise ImportError("_C.so: undefined symbol: _ZN3c104cuda29c10_cuda_check")
            return None

    monkeypatch.delitem(sys.modules, "vllm_petit_moe._C", raising=False)
    monkeypatch.delattr(vllm_petit_moe, "_C", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BuiltForAnotherTorch(), *sys.meta_path])
    with pytest.raises(ImportError, match=rf"torch {re.escape(torch.__version__)}.*Rebuild.*"
                                          r"--no-build-isolation.*undefined symbol"):
        vllm_petit_moe.load_extension()


def test_unsupported_vllm_fails_registration_with_the_flag_and_warns_without(monkeypatch,
                                                                              caplog):
    import logging

    import vllm

    from vllm_petit_moe import plugin

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    with pytest.raises(compat.UnsupportedVllmVersion,
                       match=r"supports vLLM 0\.24-0\.33 .*has vLLM 0\.35\.0.*pip install "
                             r"'vllm>=0\.24,<0\.34'.*VLLM_USE_PETIT_MOE"):
        plugin.register()
    assert not plugin._registered
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "0")
    with caplog.at_level(logging.WARNING, logger="vllm.petit_moe.compat"):
        plugin.register()  # the plugin does nothing: vLLM may run
    assert plugin._registered
    assert any("has vLLM 0.35.0" in r.getMessage() for r in caplog.records)


def test_call_when_imported(tmp_path, monkeypatch):
    (tmp_path / "petit_probe_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    assert compat.call_when_imported("petit_probe_mod", lambda m: seen.append(m.VALUE + 1)) is False
    assert seen == []
    import petit_probe_mod  # noqa: F401

    assert seen == [42]
    assert compat.call_when_imported("petit_probe_mod", lambda m: seen.append(m.VALUE)) is True
    assert seen == [42, 41]
    monkeypatch.delitem(sys.modules, "petit_probe_mod")
