"""CPU-only tests of the vLLM plugin: entry point, flag registration, the hook's decision and
substitution, ``PetitPrepareAndFinalize`` inside vLLM's real modular kernel, and
``PetitExperts``' side of vLLM's experts interface (its GEMMs replaced by a torch emulation
of the three kernel steps, ``emulated_experts_forward``).

Runs with the real vLLM (CI: 0.24.0 and 0.33.0, one environment each) and no GPU. vLLM's
config objects, prepare/finalize classes, Triton experts object, expert maps and
``FusedMoEKernel`` are the real ones. Faked, because they need a GPU: the ``EpBuffer``
(``FakeEpBuffer`` below: the architecture.md layout computed with ``vllm_petit_moe.testing.reference``, every rank's inputs known to every rank, as
in pplx-kernels' tests; ``EmulatedEpBuffer``: the same with the real dispatch and combine kernels
on the CPU emulation of tests/emu), the runtime facts of the EP group (``EpRuntime``), and
the Triton GEMMs (``ReferenceExperts``: vLLM's experts contract, expert_map lookup included,
on the reference). The compiled extension is never imported.

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
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config import (  # noqa: E402
    DeviceConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.forward_context import (  # noqa: E402
    DPMetadata,
    create_forward_context,
    override_forward_context,
)
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.expert_map_manager import (  # noqa: E402
    determine_expert_map,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import (  # noqa: E402
    MoEPrepareAndFinalizeNaiveDPEPModular,
    make_moe_prepare_and_finalize_naive_dp_ep,
    make_moe_prepare_and_finalize_no_dp_ep,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # noqa: E402
    TopKWeightAndReduceNoOP,
)

from vllm_petit_moe.testing import reference  # noqa: E402
from vllm_petit_moe.vllm_glue import buffer_cache, compat, envs, hook  # noqa: E402
from vllm_petit_moe.vllm_glue import experts as petit_experts  # noqa: E402
from vllm_petit_moe.vllm_glue.prepare_finalize import (  # noqa: E402
    PetitPrepareAndFinalize,
    linear_expert_map,
    local_to_global_expert_ids,
)

# --------------------------------------------------------------------------------------------
# Fakes of what needs a GPU
# --------------------------------------------------------------------------------------------


@dataclass
class FakeDispatchOutput:
    recv_x: torch.Tensor
    recv_topk_ids: torch.Tensor
    recv_topk_weights: torch.Tensor
    handle: object
    recv_x_scales: torch.Tensor | None = None


@dataclass
class SimulatedCall:
    """One MoE call of all W ranks: every rank's inputs and the global expert weights."""

    xs: list[torch.Tensor]
    topk_ids: list[torch.Tensor]
    topk_weights: list[torch.Tensor]
    w13: torch.Tensor  # [E, 2I, H] bf16
    w2: torch.Tensor  # [E, H, I] bf16

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def local_weights(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_local = self.num_experts // world_size
        experts = slice(rank * num_local, (rank + 1) * num_local)
        return self.w13[experts], self.w2[experts]


class FakeEpBuffer:
    """``EpBuffer``'s API on the CPU. Dispatch returns the reference layout for this rank;
    combine computes the other ranks' expert outputs with the reference (their inputs are
    known here) and combines them with this rank's real ``expert_out``."""

    def __init__(self, rank: int, world_size: int, num_experts: int, call: SimulatedCall | None):
        self.rank = rank
        self.world_size = world_size
        self.num_local_experts = num_experts // world_size
        self.footprint_bytes = 1 << 20
        self.num_experts = num_experts
        self.call = call
        self.region_strides: list[int] = []
        self.paths: list[str] = []  # "dispatch" / "megamoe", per call
        self.reserved_megamoe: list[int] = []  # reserve_megamoe_workspace calls

    def _record_dispatch(self, x, topk_ids, topk_weights, region_stride):
        """The layer hands over this rank's inputs of the call; the stride is recorded."""
        call = self.call
        assert torch.equal(x, call.xs[self.rank])
        assert torch.equal(topk_ids.long(), call.topk_ids[self.rank].long())
        assert topk_weights.dtype == torch.float32
        self.region_strides.append(region_stride)

    def _expert_outs(self, expert_out, received):
        """Every destination's expert output: this rank's `expert_out`, the others' on the
        reference from what they received (received[d] = (recv_x bf16, ids, weights))."""
        expert_outs = []
        for dst_rank, (recv_x, recv_ids, recv_weights) in enumerate(received):
            if dst_rank == self.rank:
                expert_outs.append(expert_out)
                continue
            w13, w2 = self.call.local_weights(dst_rank, self.world_size)
            expert_outs.append(
                reference.experts_reference(recv_x, recv_ids, recv_weights, w13, w2))
        return expert_outs

    def reserve_megamoe_workspace(self, intermediate_size):
        """What EpBuffer allocates on the GPU; recorded here."""
        self.reserved_megamoe.append(intermediate_size)
        return 0

    def _record_megamoe(self, x, topk_ids, topk_weights, w13, w2, region_stride, out):
        """As _record_dispatch, plus the layer's weights (this rank's experts) and `out`."""
        self._record_dispatch(x, topk_ids, topk_weights, region_stride)
        self.paths.append("megamoe")
        local_w13, local_w2 = self.call.local_weights(self.rank, self.world_size)
        assert torch.equal(w13, local_w13) and torch.equal(w2, local_w2)
        assert out is not None and out.shape == x.shape and out.is_contiguous()

    def megamoe(self, x, topk_ids, topk_weights, w13, w2, region_stride=None, out=None):
        """The whole layer of this rank on the reference (every rank's inputs are known)."""
        self._record_megamoe(x, topk_ids, topk_weights, w13, w2, region_stride, out)
        call = self.call
        out.copy_(reference.ep_moe_reference(call.xs, call.topk_ids, call.topk_weights,
                                             call.w13, call.w2, self.world_size)[self.rank])
        return out

    def dispatch(self, x, topk_ids, topk_weights, region_stride=None, quant=None):
        call = self.call
        self._record_dispatch(x, topk_ids, topk_weights, region_stride)
        self.paths.append("dispatch")
        received = reference.dispatch_reference(
            call.xs, call.topk_ids, call.topk_weights, self.num_experts, region_stride, quant
        )[self.rank]
        return FakeDispatchOutput(
            received.recv_x,
            received.recv_topk_ids,
            received.recv_topk_weights,
            handle=("fake-handle", self.rank, region_stride),
            recv_x_scales=received.recv_x_scales,
        )

    def combine(self, expert_out, handle, out=None):
        call = self.call
        assert handle == ("fake-handle", self.rank, self.region_strides[-1])
        region_stride = handle[2]
        assert expert_out.shape[0] == self.world_size * region_stride
        dispatched = reference.dispatch_reference(
            call.xs, call.topk_ids, call.topk_weights, self.num_experts, region_stride
        )
        expert_outs = self._expert_outs(
            expert_out, [(d.recv_x, d.recv_topk_ids, d.recv_topk_weights) for d in dispatched])
        y = reference.combine_reference(expert_outs, call.topk_ids, self.num_experts)[self.rank]
        if out is None:
            return y
        out.copy_(y)
        return out

    def close(self):
        pass


class EmulatedEpBuffer(FakeEpBuffer):
    """``FakeEpBuffer`` whose dispatch and combine run the real kernels on the CPU emulation
    (tests/emu/ep_emu.cpp) for all W ranks at once: this rank's tensors as the layer hands them
    over, the other ranks' inputs from the call and their experts on the reference."""

    def __init__(self, lib, rank: int, world_size: int, num_experts: int, call: SimulatedCall,
                 max_tokens: int = 64, megamoe_lib=None):
        from test_dispatch_combine_emu_cpu import EmuEp

        super().__init__(rank, world_size, num_experts, call)
        self.ep = EmuEp(lib, world_size, max_tokens, hidden=call.xs[0].shape[1],
                        max_top_k=call.topk_ids[0].shape[1], num_experts=num_experts)
        self.megamoe_lib = megamoe_lib
        self._received = None

    def _all_ranks(self, x, topk_ids, topk_weights):
        """Every rank's (xs, ids, weights) of the call, this rank's as the layer handed them."""
        call, rank = self.call, self.rank
        xs, ws = list(call.xs), list(call.topk_weights)
        ids = [i.to(topk_ids.dtype) for i in call.topk_ids]
        xs[rank], ids[rank], ws[rank] = x, topk_ids, topk_weights
        return xs, ids, ws

    def megamoe(self, x, topk_ids, topk_weights, w13, w2, region_stride=None, out=None):
        """The fused layer kernel of every rank at once on the emulation (megamoe_lib)."""
        from test_megamoe_ep_emu_cpu import fused_layer

        self._record_megamoe(x, topk_ids, topk_weights, w13, w2, region_stride, out)
        xs, ids, ws = self._all_ranks(x, topk_ids, topk_weights)
        rc, results, ys, syncs = fused_layer(
            self.ep, self.megamoe_lib.petit_emu_megamoe_sync_ints, xs, ids, ws, self.call.w13,
            self.call.w2, region_stride, topk_ids.shape[1])
        assert rc == 0, f"fused layer launch results {results}"
        assert all(int(sync.abs().sum()) == 0 for sync in syncs), "counters not reset"
        out.copy_(ys[self.rank])
        return out

    def dispatch(self, x, topk_ids, topk_weights, region_stride=None, quant=None):
        rank = self.rank
        self._record_dispatch(x, topk_ids, topk_weights, region_stride)
        self.paths.append("dispatch")
        xs, ids, ws = self._all_ranks(x, topk_ids, topk_weights)
        received = self.ep.dispatch(xs, ids, ws, region_stride, quant=quant)
        assert not isinstance(received, int), f"dispatch launch returned {received}"
        self._received = (received, quant)
        recv_x, recv_ids, recv_w, scales, _ = received[rank]
        return FakeDispatchOutput(recv_x, recv_ids, recv_w,
                                  handle=("emulated-handle", rank, region_stride),
                                  recv_x_scales=scales)

    def combine(self, expert_out, handle, out=None):
        call, rank = self.call, self.rank
        assert handle == ("emulated-handle", rank, self.region_strides[-1])
        (received, quant), region_stride = self._received, handle[2]
        expert_outs = self._expert_outs(expert_out, [
            (recv_x if quant is None
             else reference.dequantize_fp8_reference(recv_x, scales).to(torch.bfloat16),
             recv_ids, recv_w)
            for recv_x, recv_ids, recv_w, scales, _ in received])
        top_k = call.topk_ids[0].shape[1]
        y = self.ep.combine(expert_outs, [t.shape[0] for t in call.xs], top_k,
                            region_stride)[rank]
        if out is None:
            return y
        out.copy_(y)
        return out

    def close(self):
        self.ep.close()


@pytest.fixture(scope="module")
def ep_emu_lib(tmp_path_factory):
    from conftest import build_emu_library
    from test_dispatch_combine_emu_cpu import _load

    return _load(build_emu_library(tmp_path_factory, "ep_emu"))


class ReferenceExperts(mk.FusedMoEExpertsModular):
    """vLLM's Triton experts contract on the CPU: global ``topk_ids`` resolved through the
    layer's ``expert_map`` (non-local -> contributes 0), router weights applied, top-k reduced
    (``TopKWeightAndReduceNoOP``), output ``[M, H]``; the GEMMs are the reference's."""

    @staticmethod
    def activation_format():
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device():
        return True

    @staticmethod
    def _supports_no_act_and_mul():
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key):
        return weight_key is None and activation_key is None

    @staticmethod
    def _supports_activation(activation):
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config):
        return True

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        return (M, topk, max(N, K)), (M, topk, max(N, K)), (M, K)

    def finalize_weight_and_reduce_impl(self):
        return TopKWeightAndReduceNoOP()

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        assert expert_map is not None
        # vLLM's moe_align_block_size needs ids in [0, E): a -1 would index expert_map[-1].
        assert bool(((topk_ids >= 0) & (topk_ids < global_num_experts)).all())
        local_ids = expert_map.long()[topk_ids.long()].to(torch.int32)
        weights = torch.where(local_ids >= 0, topk_weights, 0.0)
        output.copy_(reference.experts_reference(hidden_states, local_ids, weights, w1, w2))


# --------------------------------------------------------------------------------------------
# Real vLLM config objects
# --------------------------------------------------------------------------------------------


def make_parallel_config(**overrides) -> FusedMoEParallelConfig:
    fields = dict(
        tp_size=1, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=2, dp_rank=0, ep_size=2,
        ep_rank=0, sp_size=1, use_ep=True, all2all_backend="allgather_reducescatter",
        enable_eplb=False,
    )
    fields.update(overrides)
    return FusedMoEParallelConfig(**fields)


def make_moe_config(parallel: FusedMoEParallelConfig | None = None, **overrides) -> FusedMoEConfig:
    parallel = parallel or make_parallel_config()
    num_experts = overrides.pop("num_experts", 16)
    fields = dict(
        num_experts=num_experts,
        experts_per_token=4,
        hidden_dim=1024,
        intermediate_size=512,
        num_local_experts=num_experts // parallel.ep_size,
        num_logical_experts=num_experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
        max_num_tokens=2048,
    )
    fields.update(overrides)
    return FusedMoEConfig(**fields)


def make_vllm_config(**parallel_kwargs) -> VllmConfig:
    parallel_kwargs = {"data_parallel_size": 2, "enable_expert_parallel": True, **parallel_kwargs}
    return VllmConfig(
        parallel_config=ParallelConfig(**parallel_kwargs), device_config=DeviceConfig(device="cpu")
    )


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    return make_vllm_config()


def single_node_cuda(rank: int = 0, world_size: int = 2, **overrides) -> hook.EpRuntime:
    fields = dict(platform="cuda", ep_world_size=world_size, ep_rank=rank, internode=False,
                  cpu_group=object())
    fields.update(overrides)
    return hook.EpRuntime(**fields)


def naive_pf(world_size: int = 2) -> MoEPrepareAndFinalizeNaiveDPEPModular:
    return make_moe_prepare_and_finalize_naive_dp_ep(
        use_monolithic=False, is_sequence_parallel=False, num_dispatchers=world_size
    )


def triton_experts(moe_config, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG, vllm_config=None):
    with set_current_vllm_config(vllm_config or make_vllm_config()):
        return TritonExperts(moe_config, quant_config)


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
                       "VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS", "VLLM_PETIT_MOE_STRICT",
                       "VLLM_PETIT_MOE_TIMEOUT_S", "VLLM_USE_PETIT_MOE"],
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


# --------------------------------------------------------------------------------------------
# Decision logic on real vLLM config objects
# --------------------------------------------------------------------------------------------


def decide(pf=None, experts=None, parallel_config=None, runtime=None, moe_config=None):
    moe_config = moe_config or make_moe_config()
    experts = experts or triton_experts(moe_config)
    pf = pf or naive_pf(moe_config.moe_parallel_config.ep_size)
    parallel_config = parallel_config or make_vllm_config().parallel_config
    runtime = runtime or single_node_cuda(world_size=moe_config.moe_parallel_config.ep_size)
    return hook.decide(pf, experts, parallel_config, lambda: runtime)


def test_decide_substitutes_for_dp_ep_single_node_bf16():
    decision = decide()
    assert decision.substitute and decision.applicable, decision.reason


@pytest.mark.parametrize("world_size, rank", [(2, 1), (4, 3), (8, 5)])
def test_decide_substitutes_on_every_rank(world_size, rank):
    parallel = make_parallel_config(dp_size=world_size, dp_rank=rank, ep_size=world_size,
                                    ep_rank=rank)
    moe_config = make_moe_config(parallel, num_experts=64)
    decision = decide(moe_config=moe_config, runtime=single_node_cuda(rank, world_size),
                      pf=naive_pf(world_size))
    assert decision.substitute, decision.reason


def _other_experts_class():
    class OtherExperts(ReferenceExperts):  # a Standard-format, non-Triton experts class
        pass

    return OtherExperts


UNSUPPORTED = {
    "multi-node": dict(runtime=single_node_cuda(internode=True)),
    "non-cuda platform": dict(runtime=single_node_cuda(platform="rocm")),
    "ep group mismatch": dict(runtime=single_node_cuda(rank=1)),
    "tp inside dp": dict(moe_config=make_moe_config(make_parallel_config(ep_size=4))),
    "pcp": dict(moe_config=make_moe_config(make_parallel_config(pcp_size=2, ep_size=2))),
    "sequence parallel": dict(moe_config=make_moe_config(make_parallel_config(sp_size=2))),
    "eplb": dict(moe_config=make_moe_config(make_parallel_config(enable_eplb=True))),
    "dbo": dict(parallel_config=ParallelConfig(data_parallel_size=2, enable_expert_parallel=True,
                                               enable_dbo=True)),
    "lora": dict(moe_config=make_moe_config(is_lora_enabled=True)),
    "fp16 activations": dict(moe_config=make_moe_config(in_dtype=torch.float16)),
    "uneven experts": dict(moe_config=make_moe_config(num_experts=15, num_local_experts=8)),
    "top-k above 16": dict(moe_config=make_moe_config(num_experts=64, experts_per_token=17)),
    "hidden not multiple of 8": dict(moe_config=make_moe_config(hidden_dim=1020)),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_decide_keeps_vllm_for_unsupported_setups(case):
    decision = decide(**UNSUPPORTED[case])
    assert not decision.substitute
    assert decision.applicable, "a DP+EP layer we cannot serve must warn, not pass silently"


def test_decide_substitutes_for_dynamic_fp8_activations():
    moe_config = make_moe_config()
    for quant, mode in (
        (FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128]), "fp8_block128"),
        (FusedMoEQuantConfig.make(torch.float8_e4m3fn, per_act_token_quant=True),
         "fp8_per_token"),
    ):
        decision = decide(moe_config=moe_config, experts=triton_experts(moe_config, quant))
        assert decision.substitute, decision.reason
        assert mode in decision.reason


def test_decide_keeps_vllm_for_other_quantized_activations():
    moe_config = make_moe_config()
    for quant, why in (
        # per-tensor dynamic scales
        (FusedMoEQuantConfig.make(torch.float8_e4m3fn), "per-tensor"),
        # static activation scale
        (FusedMoEQuantConfig.make(torch.float8_e4m3fn, per_act_token_quant=True,
                                  a1_scale=torch.ones(1)), "static"),
        # activation blocks other than 1x128
        (FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[64, 64]), "1x128"),
        (FusedMoEQuantConfig.make(torch.int8, per_act_token_quant=True), "only fp8"),
    ):
        decision = decide(moe_config=moe_config, experts=triton_experts(moe_config, quant))
        assert not decision.substitute and decision.applicable, why
        assert "quantized activations" in decision.reason and why in decision.reason, \
            decision.reason


def test_dispatch_quant_mode(monkeypatch):
    from vllm_petit_moe.vllm_glue import compat
    from vllm_petit_moe.vllm_glue.prepare_finalize import dispatch_quant_mode

    assert dispatch_quant_mode(None) == (None, None)
    assert dispatch_quant_mode(FUSED_MOE_UNQUANTIZED_CONFIG) == (None, None)
    block = FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128])
    # vLLM's own choice of power-of-two block scales (DeepGEMM E8M0) is followed
    for ue8m0, mode in ((False, "fp8_block128"), (True, "fp8_block128_ue8m0")):
        monkeypatch.setattr(compat, "fp8_block_scales_are_ue8m0", lambda: ue8m0)
        assert dispatch_quant_mode(block) == (mode, None)
    token = FusedMoEQuantConfig.make(torch.float8_e4m3fn, per_act_token_quant=True)
    assert dispatch_quant_mode(token) == ("fp8_per_token", None)


def test_decide_keeps_vllm_for_non_triton_and_monolithic_experts():
    moe_config = make_moe_config()
    other = _other_experts_class()(moe_config, FUSED_MOE_UNQUANTIZED_CONFIG)
    decision = decide(moe_config=moe_config, experts=other)
    assert not decision.substitute and decision.applicable and "OtherExperts" in decision.reason

    monolithic_pf = make_moe_prepare_and_finalize_naive_dp_ep(
        use_monolithic=True, is_sequence_parallel=False, num_dispatchers=2
    )
    decision = decide(moe_config=moe_config, pf=monolithic_pf)
    assert not decision.substitute and decision.applicable and "monolithic" in decision.reason


def test_decide_keeps_vllm_without_a_current_vllm_config():
    moe_config = make_moe_config()
    decision = hook.decide(naive_pf(), triton_experts(moe_config), None, single_node_cuda)
    assert not decision.substitute and decision.applicable


NOT_APPLICABLE = {
    "dp=1": dict(moe_config=make_moe_config(make_parallel_config(dp_size=1, ep_size=2)),
                 pf=make_moe_prepare_and_finalize_no_dp_ep(use_monolithic=False)),
    "dp without ep": dict(
        moe_config=make_moe_config(make_parallel_config(use_ep=False, ep_size=1))
    ),
    "other all2all backend": dict(
        moe_config=make_moe_config(make_parallel_config(all2all_backend="deepep_low_latency"))
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_APPLICABLE))
def test_decide_leaves_other_setups_alone(case):
    decision = decide(**NOT_APPLICABLE[case])
    assert not decision.substitute and not decision.applicable


def test_decide_probes_the_runtime_only_after_config_checks():
    def must_not_run():
        raise AssertionError("probed the EP group for a layer the config already rules out")

    moe_config = make_moe_config(is_lora_enabled=True)
    decision = hook.decide(naive_pf(), triton_experts(moe_config),
                           make_vllm_config().parallel_config, must_not_run)
    assert not decision.substitute


# --------------------------------------------------------------------------------------------
# The hook inside vLLM's FusedMoEKernel
# --------------------------------------------------------------------------------------------


@pytest.fixture
def kernel_hook(monkeypatch):
    """The FusedMoEKernel patch installed for one test, with the GPU-only parts faked."""
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


def build_kernel(moe_config, vllm_config, pf=None, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG):
    with set_current_vllm_config(vllm_config):
        experts = TritonExperts(moe_config, quant_config)
        return mk.FusedMoEKernel(pf or naive_pf(), experts)


def test_hook_substitutes_with_flag_and_shares_one_buffer(kernel_hook, monkeypatch, vllm_config):
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    moe_config = make_moe_config()
    first = build_kernel(moe_config, vllm_config)
    second = build_kernel(moe_config, vllm_config)

    for kernel in (first, second):
        pf = kernel.prepare_finalize
        assert isinstance(pf, PetitPrepareAndFinalize)
        assert kernel.output_is_reduced()
        assert pf.activation_format == mk.FusedMoEActivationFormat.Standard
        assert pf.topk_indices_dtype() == torch.int32
        assert pf.num_dispatchers() == 2
        assert pf.max_num_tokens_per_rank() == moe_config.max_num_tokens
        assert isinstance(kernel.fused_experts, TritonExperts)  # experts stay vLLM's
    assert first.prepare_finalize.buffer is second.prepare_finalize.buffer
    assert len(kernel_hook) == 1  # one collective creation for all layers
    group, config, _ = kernel_hook[0]
    assert (config.hidden_size, config.num_experts) == (1024, 16)
    assert config.max_tokens_per_rank == moe_config.max_num_tokens


def test_hook_is_inert_without_flag(kernel_hook, monkeypatch, vllm_config):
    monkeypatch.delenv(envs.VLLM_USE_PETIT_MOE, raising=False)
    kernel = build_kernel(make_moe_config(), vllm_config)
    assert type(kernel.prepare_finalize) is MoEPrepareAndFinalizeNaiveDPEPModular
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "0")
    kernel = build_kernel(make_moe_config(), vllm_config)
    assert type(kernel.prepare_finalize) is MoEPrepareAndFinalizeNaiveDPEPModular
    assert kernel_hook == []


def test_hook_falls_back_with_a_warning_and_strict_mode_fails(kernel_hook, monkeypatch,
                                                              vllm_config):
    import logging

    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    fp8 = FusedMoEQuantConfig.make(torch.float8_e4m3fn)  # per-tensor: unsupported
    with caplog_at(hook.logger) as records:
        for _ in range(2):
            kernel = build_kernel(make_moe_config(), vllm_config, quant_config=fp8)
            assert type(kernel.prepare_finalize) is MoEPrepareAndFinalizeNaiveDPEPModular
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per process and reason"
    assert "quantized activations" in warnings[0].getMessage()

    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")
    with pytest.raises(RuntimeError, match="quantized activations"):
        build_kernel(make_moe_config(), vllm_config, quant_config=fp8)
    assert kernel_hook == []


def test_hook_leaves_a_multi_node_deployment_alone(kernel_hook, monkeypatch, vllm_config):
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setattr(hook, "_runtime_provider", lambda: single_node_cuda(internode=True))
    kernel = build_kernel(make_moe_config(), vllm_config)
    assert type(kernel.prepare_finalize) is MoEPrepareAndFinalizeNaiveDPEPModular
    assert kernel_hook == []


# --------------------------------------------------------------------------------------------
# Expert ids and vLLM's expert_map
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_local_ids_map_through_vllms_expert_map(world_size):
    num_experts = 8 * world_size
    num_local = num_experts // world_size
    recv_ids = torch.tensor([[l, -1] for l in range(num_local)] + [[-1, -1]], dtype=torch.int32)
    for rank in range(world_size):
        _, expert_map, _ = determine_expert_map(world_size, rank, num_experts, "linear")
        assert torch.equal(expert_map, linear_expert_map(num_experts, rank=rank,
                                                         world_size=world_size))
        global_ids = local_to_global_expert_ids(
            recv_ids, rank=rank, num_local_experts=num_local, world_size=world_size
        )
        assert global_ids.dtype == torch.int32
        assert bool(((global_ids >= 0) & (global_ids < num_experts)).all())
        # Exactly what vLLM's experts will see through the layer's expert_map:
        assert torch.equal(expert_map[global_ids.long()], recv_ids)


def test_prepare_rejects_a_non_linear_expert_map(vllm_config):
    call = make_call(world_size=2, num_tokens=[3, 2])
    pf = PetitPrepareAndFinalize(FakeEpBuffer(0, 2, 8, call), num_experts=8,
                                 max_tokens_per_rank=64)
    _, round_robin, _ = determine_expert_map(2, 0, 8, "round_robin")
    with dp_step(vllm_config, [3, 2]), pytest.raises(RuntimeError, match="linear placement"):
        pf.prepare(call.xs[0], call.topk_weights[0], call.topk_ids[0], 8, round_robin, False,
                   FUSED_MOE_UNQUANTIZED_CONFIG)


# --------------------------------------------------------------------------------------------
# PetitPrepareAndFinalize inside vLLM's modular kernel, against the reference
# --------------------------------------------------------------------------------------------


def make_call(world_size, num_tokens, *, num_experts=8, hidden=40, intermediate=24, top_k=3,
              seed=0) -> SimulatedCall:
    """All ranks' inputs, seeded identically everywhere; some -1 ids punched in."""
    gen = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for tokens in num_tokens:
        topk_ids, topk_weights = reference.random_topk(tokens, num_experts, top_k, generator=gen)
        if tokens > 1:
            topk_ids[1, 0] = -1
            topk_weights[1, 0] = 0.0
        xs.append(torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16))
        ids.append(topk_ids.to(torch.int32))
        ws.append(topk_weights)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate**0.5)
    return SimulatedCall(xs, ids, ws, w13.to(torch.bfloat16), w2.to(torch.bfloat16))


def dp_step(vllm_config, num_tokens):
    """A forward context carrying vLLM's DP metadata for one step."""
    dp_metadata = DPMetadata(torch.tensor(num_tokens, dtype=torch.int32))
    return override_forward_context(create_forward_context(None, vllm_config, dp_metadata))


@pytest.fixture(scope="module")
def workspace():
    from vllm.v1.worker import workspace as vllm_workspace

    if not vllm_workspace.is_workspace_manager_initialized():
        vllm_workspace.init_workspace_manager(torch.device("cpu"))


def run_rank_through_modular_kernel(call, rank, num_tokens, vllm_config, experts_class,
                                    ep_emu_lib=None, megamoe_max_tokens=0, megamoe_lib=None):
    """Rank `rank`'s forward of `call` through vLLM's FusedMoEKernel with our prepare/finalize
    (over a FakeEpBuffer, or with `ep_emu_lib` an EmulatedEpBuffer: the real dispatch and
    combine kernels, and with `megamoe_lib` the fused layer, on the CPU emulation) and
    `experts_class`, with vLLM's linear expert_map. With `megamoe_max_tokens` the experts are
    PetitEpExperts over `experts_class` and the fused layer is enabled up to that stride.
    Returns the output and the buffer."""
    world_size = len(num_tokens)
    num_experts, top_k = call.num_experts, call.topk_ids[0].shape[1]
    hidden, intermediate = call.xs[0].shape[1], call.w2.shape[2]
    parallel = make_parallel_config(dp_size=world_size, dp_rank=rank, ep_size=world_size,
                                    ep_rank=rank)
    moe_config = make_moe_config(parallel, num_experts=num_experts, experts_per_token=top_k,
                                 hidden_dim=hidden, intermediate_size=intermediate)
    if ep_emu_lib is None:
        buffer = FakeEpBuffer(rank, world_size, num_experts, call)
    else:
        buffer = EmulatedEpBuffer(ep_emu_lib, rank, world_size, num_experts, call,
                                  megamoe_lib=megamoe_lib)
    pf = PetitPrepareAndFinalize(buffer, num_experts=num_experts, max_tokens_per_rank=64)
    experts = experts_class(moe_config, FUSED_MOE_UNQUANTIZED_CONFIG)
    if megamoe_max_tokens:
        assert pf.enable_megamoe(megamoe_max_tokens, hidden_size=hidden,
                                 intermediate_size=intermediate, top_k=top_k) is None
        experts = petit_experts.PetitEpExperts(moe_config, FUSED_MOE_UNQUANTIZED_CONFIG, pf,
                                               fallback=experts)
    with set_current_vllm_config(vllm_config):
        kernel = mk.FusedMoEKernel(pf, experts)
    _, expert_map, _ = determine_expert_map(world_size, rank, num_experts, "linear")
    w13, w2 = call.local_weights(rank, world_size)
    try:
        with dp_step(vllm_config, num_tokens):
            out = kernel.apply(
                call.xs[rank], w13, w2, call.topk_weights[rank], call.topk_ids[rank],
                activation=MoEActivation.SILU, global_num_experts=num_experts,
                expert_map=expert_map, apply_router_weight_on_input=False,
            )
    finally:
        buffer.close()
    return out, buffer


@pytest.mark.parametrize(
    "world_size, num_tokens",
    [(2, [5, 3]), (2, [1, 1]), (2, [0, 4]), (4, [2, 7, 0, 3])],
)
@pytest.mark.parametrize("kernels", ["reference", "emulated"])
def test_modular_kernel_matches_reference(world_size, num_tokens, kernels, vllm_config, workspace,
                                          request):
    """With "emulated" the dispatch and combine are the real kernels on the CPU emulation:
    the prepare/finalize and the kernels agree on the layout, bit-exactly."""
    call = make_call(world_size, num_tokens)
    expected = reference.ep_moe_reference(
        call.xs, call.topk_ids, call.topk_weights, call.w13, call.w2, world_size
    )
    lib = request.getfixturevalue("ep_emu_lib") if kernels == "emulated" else None
    for rank in range(world_size):
        out, buffer = run_rank_through_modular_kernel(call, rank, num_tokens, vllm_config,
                                                      ReferenceExperts, lib)
        assert buffer.region_strides == [max(num_tokens)]
        assert out.shape == call.xs[rank].shape
        assert torch.equal(out, expected[rank]), f"rank {rank}"


def test_back_to_back_layers_share_one_buffer(vllm_config):
    call = make_call(2, [4, 2])
    buffer = FakeEpBuffer(0, 2, 8, call)
    layers = [PetitPrepareAndFinalize(buffer, num_experts=8, max_tokens_per_rank=64)
              for _ in range(2)]
    _, expert_map, _ = determine_expert_map(2, 0, 8, "linear")
    args = (call.xs[0], call.topk_weights[0], call.topk_ids[0], 8, expert_map, False,
            FUSED_MOE_UNQUANTIZED_CONFIG)
    with dp_step(vllm_config, [4, 2]):
        recv_x, _, _, recv_ids, recv_w = layers[0].prepare(*args)
        with pytest.raises(RuntimeError, match="not been combined"):
            layers[1].prepare(*args)
        expert_out = torch.zeros(recv_x.shape, dtype=torch.bfloat16)
        output = torch.empty_like(call.xs[0])
        layers[0].finalize(output, expert_out, recv_w, recv_ids, False, TopKWeightAndReduceNoOP())
        layers[1].prepare(*args)  # fine once the first layer has combined


def test_prepare_errors_are_explicit(vllm_config):
    call = make_call(2, [4, 2])
    _, expert_map, _ = determine_expert_map(2, 0, 8, "linear")

    def prepare(pf, x=None, quant=FUSED_MOE_UNQUANTIZED_CONFIG, expert_map=expert_map):
        x = call.xs[0] if x is None else x
        return pf.prepare(x, call.topk_weights[0], call.topk_ids[0], 8, expert_map, False, quant)

    pf = PetitPrepareAndFinalize(FakeEpBuffer(0, 2, 8, call), num_experts=8,
                                 max_tokens_per_rank=64)
    with dp_step(vllm_config, [4, 2]):
        fp8 = FusedMoEQuantConfig.make(torch.float8_e4m3fn)  # per-tensor: unsupported
        with pytest.raises(NotImplementedError, match="per-tensor activation scales"):
            prepare(pf, quant=fp8)
        fp8 = FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128])
        with pytest.raises(NotImplementedError, match="multiple of 128"):
            prepare(pf, quant=fp8)  # hidden size 40
        with pytest.raises(NotImplementedError, match="bfloat16"):
            prepare(pf, x=call.xs[0].half())
        with pytest.raises(RuntimeError, match="expert_map"):
            prepare(pf, expert_map=None)

    small = PetitPrepareAndFinalize(FakeEpBuffer(0, 2, 8, call), num_experts=8,
                                    max_tokens_per_rank=3)
    with dp_step(vllm_config, [4, 2]), pytest.raises(RuntimeError, match="max_tokens_per_rank"):
        prepare(small)
    with pytest.raises(RuntimeError, match="no DP metadata"):
        prepare(pf)


# --------------------------------------------------------------------------------------------
# PetitExperts: vLLM's experts interface (the kernels themselves are tested on the GPU and in
# tests/test_experts_emu_cpu.py)
# --------------------------------------------------------------------------------------------


def emulated_experts_forward(x, topk_ids, topk_weights, w13, w2, *, out, expert_map=None,
                             act_workspace, partial_workspace, tiles="auto"):
    """``ops.experts_forward`` in torch, step by step on the caller's buffers like the kernels:
    act in sorted order -> per-entry bf16 partials -> slot-order fp32 sum into ``out``. ``out``
    may
    alias ``act_workspace`` (vLLM's fused output shares workspace13). Ids follow the kernels'
    rule (csrc/common/expert_ids.h): global ids through ``expert_map`` when given, then anything
    outside ``[0, L)`` is a slot this rank does not serve."""
    num_rows, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_local, intermediate = w13.shape[0], w13.shape[1] // 2
    if expert_map is not None:
        num_global = expert_map.numel()
        in_range = (topk_ids >= 0) & (topk_ids < num_global)
        topk_ids = torch.where(
            in_range, expert_map[topk_ids.clamp(0, num_global - 1).long()], -1)
    topk_ids = torch.where((topk_ids >= 0) & (topk_ids < num_local), topk_ids, -1).int()
    entries = num_rows * top_k
    act = act_workspace.reshape(-1)[: entries * intermediate].view(entries, intermediate)
    partial = partial_workspace.reshape(-1)[: entries * hidden].view(entries, hidden)
    _, offsets, order = reference.expert_row_lists_reference(topk_ids, num_local)
    flat_weights = topk_weights.reshape(-1)
    spans = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    for expert, (begin, end) in enumerate(spans):
        rows = order[begin:end].long() // top_k
        gate_up = x[rows].float() @ w13[expert].float().T
        act[begin:end] = (torch.nn.functional.silu(gate_up[:, :intermediate])
                          * gate_up[:, intermediate:]).to(torch.bfloat16)
    for expert, (begin, end) in enumerate(spans):
        entry = order[begin:end].long()
        partial[entry] = (flat_weights[entry, None]
                          * (act[begin:end].float() @ w2[expert].float().T)).to(partial.dtype)
    valid = (topk_ids >= 0) & (topk_ids < num_local)
    total = torch.zeros(num_rows, hidden)
    for k in range(top_k):
        total = total + torch.where(valid[:, k, None],
                                    partial.view(num_rows, top_k, hidden)[:, k].float(), 0.0)
    out.copy_(total.to(torch.bfloat16))
    return out


def petit_experts_for(moe_config, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG, vllm_config=None):
    with set_current_vllm_config(vllm_config or make_vllm_config()):
        return petit_experts.PetitExperts(moe_config, quant_config)


def test_petit_experts_interface():
    moe_config = make_moe_config()
    experts = petit_experts_for(moe_config)
    assert isinstance(experts, mk.FusedMoEExpertsModular)
    assert not experts.is_monolithic()
    assert experts.activation_format() == mk.FusedMoEActivationFormat.Standard
    assert isinstance(experts.finalize_weight_and_reduce_impl(), TopKWeightAndReduceNoOP)
    assert experts.supports_expert_map() and not experts.supports_chunking()
    assert not experts.supports_lora()
    assert experts.workspace_dtype(torch.bfloat16) == torch.bfloat16
    assert experts._supports_quant_scheme(None, None)
    assert experts._supports_activation(MoEActivation.SILU)
    assert not experts._supports_activation(MoEActivation.GELU)
    assert not experts._supports_no_act_and_mul()
    assert experts._supports_shape(1024) and not experts._supports_shape(1020)
    assert experts._supports_batch_invariance()
    assert experts._supports_parallel_config(moe_config.moe_parallel_config)
    # vLLM's own selection helper (device check aside: it runs on a CPU-only machine here).
    ok, reason = mk.FusedMoEExperts.is_supported_config(
        _SupportedOnThisDevice, moe_config, None, None, mk.FusedMoEActivationFormat.Standard
    )
    assert ok, reason
    ok, _ = mk.FusedMoEExperts.is_supported_config(
        _SupportedOnThisDevice, moe_config, None, None, mk.FusedMoEActivationFormat.BatchedExperts
    )
    assert not ok


class _SupportedOnThisDevice(petit_experts.PetitExperts):
    @staticmethod
    def _supports_current_device():
        return True


@pytest.mark.parametrize("num_rows, top_k, hidden, intermediate", [(7, 4, 1024, 512),
                                                                    (1, 1, 136, 40)])
def test_petit_experts_workspace_shapes(num_rows, top_k, hidden, intermediate):
    experts = petit_experts_for(make_moe_config(hidden_dim=hidden, intermediate_size=intermediate))
    ws13, ws2, out = experts.workspace_shapes(num_rows, 2 * intermediate, hidden, top_k, 16, 8,
                                              None, MoEActivation.SILU)
    assert ws13 == (num_rows, top_k, intermediate)  # the activation, bf16
    assert ws2 == (num_rows, top_k, hidden)  # the weighted partials, bf16 [M*K, H]
    assert out == (num_rows, hidden)
    # The first dimension is the token count (vLLM's convention for workspaces).
    assert ws13[0] == ws2[0] == out[0] == num_rows


@pytest.mark.parametrize("case, overrides, quant", [
    ("gelu", dict(activation=MoEActivation.GELU), None),
    ("bias", dict(has_bias=True), None),
    ("hidden", dict(hidden_dim=1020), None),
    ("fp8", {}, FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128])),
])
def test_petit_experts_rejects_what_its_kernels_cannot_run(case, overrides, quant):
    moe_config = make_moe_config(**overrides)
    quant = quant or FUSED_MOE_UNQUANTIZED_CONFIG
    assert petit_experts.unsupported_reason(moe_config, quant) is not None
    with pytest.raises(ValueError, match="PetitExperts cannot serve"):
        petit_experts_for(moe_config, quant)


def test_kernel_expert_ids_pass_vllms_ids_and_map_through():
    """PetitExperts hands vLLM's global ids and EP map to the kernels, which map them
    (tests/test_experts_emu_cpu.py, test_routing_gpu.py, test_experts_gpu.py): with vLLM's
    int32 tensors nothing is copied (no kernel launches), other dtypes are converted."""
    _, expert_map, _ = determine_expert_map(2, 1, 8, "linear")  # rank 1 owns 4..7
    ids = torch.tensor([[4, 7, 0, -1], [5, 3, 6, 2]], dtype=torch.int32)
    assert expert_map.dtype == torch.int32
    got_ids, got_map = petit_experts.kernel_expert_ids(ids, expert_map)
    assert got_ids is ids and got_map is expert_map
    got_ids, got_map = petit_experts.kernel_expert_ids(ids.long(), expert_map.long())
    assert got_ids.dtype == got_map.dtype == torch.int32
    assert torch.equal(got_ids, ids) and torch.equal(got_map, expert_map)
    got_ids, got_map = petit_experts.kernel_expert_ids(ids.t(), None)  # local ids, no map
    assert got_map is None and got_ids.is_contiguous() and torch.equal(got_ids, ids.t())


def test_hook_substitutes_petit_experts_only_when_opted_in(kernel_hook, monkeypatch,
                                                           vllm_config):
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    moe_config = make_moe_config()
    kernel = build_kernel(moe_config, vllm_config)
    assert isinstance(kernel.prepare_finalize, PetitPrepareAndFinalize)
    assert type(kernel.fused_experts) is TritonExperts  # default: vLLM's experts stay

    monkeypatch.setenv(envs.VLLM_PETIT_MOE_EXPERTS, "1")
    kernel = build_kernel(moe_config, vllm_config)
    assert isinstance(kernel.prepare_finalize, PetitPrepareAndFinalize)
    assert isinstance(kernel.fused_experts, petit_experts.PetitExperts)
    assert kernel.fused_experts.moe_config is moe_config
    assert kernel.output_is_reduced()

    # Without petit's prepare/finalize the experts opt-in does nothing.
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "0")
    kernel = build_kernel(moe_config, vllm_config)
    assert type(kernel.prepare_finalize) is MoEPrepareAndFinalizeNaiveDPEPModular
    assert type(kernel.fused_experts) is TritonExperts


def test_hook_keeps_triton_experts_for_layers_petit_experts_cannot_run(kernel_hook, monkeypatch,
                                                                       vllm_config):
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_EXPERTS, "1")
    moe_config = make_moe_config(activation=MoEActivation.GELU)
    kernel = build_kernel(moe_config, vllm_config)
    assert isinstance(kernel.prepare_finalize, PetitPrepareAndFinalize)
    assert type(kernel.fused_experts) is TritonExperts
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")
    with pytest.raises(RuntimeError, match="PetitExperts cannot serve"):
        build_kernel(moe_config, vllm_config)


@pytest.mark.parametrize(
    "world_size, num_tokens",
    [(2, [5, 3]), (2, [0, 4]), (4, [2, 7, 0, 3])],
)
@pytest.mark.parametrize("kernels", ["reference", "emulated"])
def test_modular_kernel_with_petit_experts_matches_reference(world_size, num_tokens, kernels,
                                                             vllm_config, workspace, monkeypatch,
                                                             request):
    """With "emulated", dispatch and combine are the real kernels on the CPU emulation."""
    from vllm_petit_moe import ops

    monkeypatch.setattr(ops, "experts_forward", emulated_experts_forward)
    call = make_call(world_size, num_tokens)
    expected_kernel = reference.ep_moe_reference(
        call.xs, call.topk_ids, call.topk_weights, call.w13, call.w2, world_size
    )
    expected_fp32 = reference.ep_moe_reference(
        call.xs, call.topk_ids, call.topk_weights, call.w13, call.w2, world_size, "fp32"
    )
    tol = reference.tolerance(expected_kernel, expected_fp32)
    lib = request.getfixturevalue("ep_emu_lib") if kernels == "emulated" else None
    for rank in range(world_size):
        out, _ = run_rank_through_modular_kernel(call, rank, num_tokens, vllm_config,
                                                 petit_experts.PetitExperts, lib)
        assert out.shape == call.xs[rank].shape and out.dtype == torch.bfloat16
        reference.check_close(out, expected_fp32[rank], tol, name=f"rank {rank}")


@pytest.mark.parametrize(
    "world_size, num_tokens",
    [(2, [5, 3]), (2, [0, 4]), (4, [2, 7, 0, 3])],
)
@pytest.mark.parametrize("kernels", ["reference", "emulated"])
@pytest.mark.parametrize("fused", [True, False])
def test_fused_layer_through_vllms_kernel(world_size, num_tokens, kernels, fused, vllm_config,
                                          workspace, request):
    """With the fused layer enabled (PetitEpExperts over the reference experts), a step whose
    region stride is within the bound is one EpBuffer.megamoe call per rank (no dispatch;
    with "emulated" the real fused kernel of every rank on the CPU emulation), a rank with no
    tokens included; a larger step runs composed."""
    call = make_call(world_size, num_tokens, hidden=128, intermediate=64, seed=7)
    stride = max(num_tokens)
    expected = reference.ep_moe_reference(call.xs, call.topk_ids, call.topk_weights, call.w13,
                                          call.w2, world_size)
    expected_fp32 = reference.ep_moe_reference(call.xs, call.topk_ids, call.topk_weights,
                                               call.w13, call.w2, world_size, "fp32")
    libs = {}
    if kernels == "emulated":
        libs = dict(ep_emu_lib=request.getfixturevalue("ep_emu_lib"),
                    megamoe_lib=request.getfixturevalue("megamoe_emu_lib"))
    for rank in range(world_size):
        out, buffer = run_rank_through_modular_kernel(
            call, rank, num_tokens, vllm_config, ReferenceExperts,
            megamoe_max_tokens=stride if fused else stride - 1, **libs)
        assert buffer.paths == ["megamoe" if fused else "dispatch"], buffer.paths
        assert buffer.region_strides == [stride]
        assert out.shape == call.xs[rank].shape and out.dtype == torch.bfloat16
        if kernels == "reference" or not fused:
            assert torch.equal(out, expected[rank]), f"rank {rank}"
        else:
            tol = reference.tolerance(expected[rank], expected_fp32[rank])
            reference.check_close(out, expected_fp32[rank], tol, name=f"rank {rank}")


def test_fused_layer_bounds_and_errors(vllm_config):
    """enable_megamoe refuses sizes the kernel cannot take and caps the stride at
    MEGAMOE_MAX_ENTRIES / (W K); a fused step whose experts never hand the weights over fails
    in finalize, naming the cause."""
    from vllm_petit_moe.limits import MEGAMOE_MAX_ENTRIES

    call = make_call(2, [4, 2], hidden=128, intermediate=64)
    pf = PetitPrepareAndFinalize(FakeEpBuffer(0, 2, 8, call), num_experts=8,
                                 max_tokens_per_rank=64)
    assert "multiples of 64" in pf.enable_megamoe(64, hidden_size=40, intermediate_size=64,
                                                  top_k=3)
    assert pf.megamoe_max_stride == 0
    assert "MEGAMOE_MAX_ENTRIES" in pf.enable_megamoe(64, hidden_size=128, intermediate_size=64,
                                                      top_k=MEGAMOE_MAX_ENTRIES)
    assert pf.buffer.reserved_megamoe == []  # nothing reserved for a refused layer
    assert pf.enable_megamoe(10**6, hidden_size=128, intermediate_size=64, top_k=8) is None
    assert pf.megamoe_max_stride == MEGAMOE_MAX_ENTRIES // (2 * 8)
    assert pf.buffer.reserved_megamoe == [64]  # the workspace, while the model is built
    _, expert_map, _ = determine_expert_map(2, 0, 8, "linear")
    with dp_step(vllm_config, [4, 2]):
        x, _, _, ids, weights = pf.prepare(call.xs[0], call.topk_weights[0], call.topk_ids[0],
                                           8, expert_map, False, FUSED_MOE_UNQUANTIZED_CONFIG)
        assert x is not None and pf.megamoe_step_pending()
        with pytest.raises(RuntimeError, match="only PetitEpExperts"):
            pf.finalize(torch.empty_like(call.xs[0]), x, weights, ids, False,
                        TopKWeightAndReduceNoOP())
        assert not pf.megamoe_step_pending()
    with pytest.raises(RuntimeError, match="outside a fused step"):
        pf.set_megamoe_weights(*call.local_weights(0, 2))


def test_hook_enables_the_fused_layer(kernel_hook, monkeypatch, vllm_config):
    """VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS > 0: PetitEpExperts with vLLM's Triton experts for the
    composed steps (ours with VLLM_PETIT_MOE_EXPERTS=1) and the fused layer enabled; a layer
    the fused kernel cannot take keeps vLLM's experts (or runs composed with ours), with a
    logged reason, and strict mode fails; a malformed value fails."""
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, "32")
    moe_config = make_moe_config()  # H 1024, I 512, top-4, W 2
    kernel = build_kernel(moe_config, vllm_config)
    pf, experts = kernel.prepare_finalize, kernel.fused_experts
    assert isinstance(pf, PetitPrepareAndFinalize) and pf.megamoe_max_stride == 32
    assert isinstance(experts, petit_experts.PetitEpExperts)
    assert type(experts.fallback) is TritonExperts and experts.prepare_finalize is pf
    assert kernel.output_is_reduced()

    monkeypatch.setenv(envs.VLLM_PETIT_MOE_EXPERTS, "1")
    kernel = build_kernel(moe_config, vllm_config)
    assert kernel.fused_experts.fallback is None  # composed steps: petit's GEMMs
    assert kernel.prepare_finalize.megamoe_max_stride == 32

    odd = make_moe_config(hidden_dim=1000)  # a multiple of 8, not of 64
    kernel = build_kernel(odd, vllm_config)
    assert isinstance(kernel.fused_experts, petit_experts.PetitEpExperts)
    assert kernel.prepare_finalize.megamoe_max_stride == 0
    monkeypatch.delenv(envs.VLLM_PETIT_MOE_EXPERTS)
    kernel = build_kernel(odd, vllm_config)
    assert type(kernel.fused_experts) is TritonExperts
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")
    with pytest.raises(RuntimeError, match="multiples of 64"):
        build_kernel(odd, vllm_config)
    monkeypatch.delenv(envs.VLLM_PETIT_MOE_STRICT)

    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, "0")
    kernel = build_kernel(moe_config, vllm_config)
    assert type(kernel.fused_experts) is TritonExperts
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, bad)
        with pytest.raises(ValueError, match="VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS"):
            build_kernel(moe_config, vllm_config)


# --------------------------------------------------------------------------------------------
# One GPU (no DP, no EP): MegaMoE in place of vLLM's Triton experts
# --------------------------------------------------------------------------------------------


def single_gpu_vllm_config() -> VllmConfig:
    return make_vllm_config(data_parallel_size=1, enable_expert_parallel=False)


def single_gpu_moe_config(**overrides) -> FusedMoEConfig:
    parallel = make_parallel_config(dp_size=1, ep_size=1, use_ep=False)
    return make_moe_config(parallel, **overrides)


def no_dp_ep_pf():
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular)
    return MoEPrepareAndFinalizeNoDPEPModular()


def test_single_gpu_hook_runs_the_fused_layer(kernel_hook, monkeypatch):
    """vLLM's real one-GPU kernel (no-DP/EP pass-through + TritonExperts): with the flag the
    experts become PetitSingleGpuExperts behind vLLM's own prepare/finalize, holding the Triton
    experts as its fallback, and no buffer is made; without it nothing changes."""
    from vllm_petit_moe.config import SingleGpuLayerConfig

    monkeypatch.setattr(compat, "platform_name", lambda: "cuda")
    vllm_config = single_gpu_vllm_config()
    pf_class = type(no_dp_ep_pf())
    monkeypatch.delenv(envs.VLLM_USE_PETIT_MOE, raising=False)
    kernel = build_kernel(single_gpu_moe_config(), vllm_config, pf=no_dp_ep_pf())
    assert type(kernel.fused_experts) is TritonExperts
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    kernel = build_kernel(single_gpu_moe_config(), vllm_config, pf=no_dp_ep_pf())
    experts = kernel.fused_experts
    assert type(kernel.prepare_finalize) is pf_class
    assert isinstance(experts, petit_experts.PetitSingleGpuExperts)
    assert type(experts.fallback) is TritonExperts
    assert not kernel.output_is_reduced()
    assert kernel_hook == []
    # workspaces: ours in workspace2 (workspace13 may alias the output), Triton's fit too
    args = (5, 2 * 512, 1024, 4, 16, 16, None, MoEActivation.SILU)
    ws13, ws2, out = experts.workspace_shapes(*args)
    t13, t2, t_out = experts.fallback.workspace_shapes(*args)
    assert ws13 == t13 and out == t_out == (5, 1024)
    assert ws2 == (5, 4, max(512 + 2 * 1024, t2[-1]))
    # the per-call choice by token count
    cfg = SingleGpuLayerConfig()
    assert experts.path_for(cfg.composed_min_tokens - 1, 4, 1024, 512) == "triton"
    assert experts.path_for(cfg.composed_min_tokens, 4, 1024, 512) == "composed"
    # MegaMoE by default up to megamoe_max_tokens, only where the GPU runs sm_90a
    assert 0 < cfg.megamoe_max_tokens < cfg.composed_min_tokens - 1
    from vllm_petit_moe import ops
    monkeypatch.setattr(ops, "sm90a_kernels_supported", lambda: False)
    assert experts.path_for(1, 4, 1024, 512) == "triton"
    monkeypatch.setattr(ops, "sm90a_kernels_supported", lambda: True)
    assert experts.path_for(1, 4, 1024, 512) == "megamoe"
    assert experts.path_for(cfg.megamoe_max_tokens, 4, 1024, 512) == "megamoe"
    assert experts.path_for(cfg.megamoe_max_tokens + 1, 4, 1024, 512) == "triton"
    experts.layer_config = SingleGpuLayerConfig(megamoe_max_tokens=64, composed_min_tokens=8)
    assert experts.path_for(64, 4, 1024, 512) == "megamoe"
    assert experts.path_for(65, 4, 1024, 512) == "composed"
    assert experts.path_for(64, 4, 1024, 480) == "composed"  # I not a multiple of 64
    assert experts.path_for(600, 4, 1024, 512) == "composed"
    with pytest.raises(ValueError):
        SingleGpuLayerConfig(composed_min_tokens=0)
    # VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS reaches the one-GPU layer's config and its log line
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, "64")
    monkeypatch.setattr(hook, "_reported", set())
    with caplog_at(hook.logger) as records:
        experts = build_kernel(single_gpu_moe_config(), vllm_config,
                               pf=no_dp_ep_pf()).fused_experts
    assert experts.layer_config == SingleGpuLayerConfig(megamoe_max_tokens=64)
    assert experts.path_for(8, 4, 1024, 512) == "megamoe"
    assert any("MegaMoE up to 64 tokens" in r.getMessage() for r in records)


def caplog_at(logger):
    """Records of `logger` (INFO and up) within a with-block, whatever vLLM's logging
    configuration propagates."""
    import contextlib
    import logging

    @contextlib.contextmanager
    def capture():
        records = []
        handler = logging.Handler(logging.INFO)
        handler.emit = records.append
        old_level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            yield records
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
    return capture()


def test_pass_through_of_ep_backends_is_not_a_one_gpu_layer():
    """vLLM 0.33's PassThroughPrepareAndFinalize (--all2all-backend passthrough) subclasses
    the no-DP/EP one; only the latter marks a one-GPU layer."""
    assert compat.is_no_dp_ep_prepare_finalize(no_dp_ep_pf())
    assert not compat.is_no_dp_ep_prepare_finalize(naive_pf())
    pass_through = compat.fused_moe_symbol_or_none("PassThrough")
    if pass_through is not None:  # vLLM >= 0.33
        assert not compat.is_no_dp_ep_prepare_finalize(pass_through())


def test_experts_refuse_a_post_gemm2_hook(monkeypatch):
    """vLLM 0.33 lets a model hook the unreduced GEMM2 rows; our experts reduce in the kernel,
    so a set hook fails loudly instead of being skipped."""
    monkeypatch.setattr(compat, "platform_name", lambda: "cuda")
    moe = single_gpu_moe_config()
    with set_current_vllm_config(single_gpu_vllm_config()):
        experts = petit_experts.PetitSingleGpuExperts(
            moe, FUSED_MOE_UNQUANTIZED_CONFIG,
            fallback=TritonExperts(moe, FUSED_MOE_UNQUANTIZED_CONFIG))
    assert compat.experts_post_gemm2_hook(experts) is None
    experts.post_gemm2_hook = lambda unfinalized, output: None
    x = torch.zeros(2, moe.hidden_dim, dtype=torch.bfloat16)
    ids = torch.zeros(2, moe.experts_per_token, dtype=torch.int32)
    for apply in (experts.apply, super(petit_experts.PetitSingleGpuExperts, experts).apply):
        with pytest.raises(NotImplementedError, match="post-GEMM2 hook"):
            apply(x, x, None, None, ids.float(), ids, MoEActivation.SILU, moe.num_experts,
                  None, None, None, x, x, None, False)


def test_single_gpu_hook_falls_back_with_a_reason_and_strict_mode_fails(kernel_hook,
                                                                        monkeypatch):
    import logging

    monkeypatch.setattr(compat, "platform_name", lambda: "cuda")
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    fp8 = FusedMoEQuantConfig.make(torch.float8_e4m3fn)
    with caplog_at(hook.logger) as records:
        kernel = build_kernel(single_gpu_moe_config(), single_gpu_vllm_config(),
                              pf=no_dp_ep_pf(), quant_config=fp8)
    assert type(kernel.fused_experts) is TritonExperts
    assert any("quantization" in r.getMessage() for r in records
               if r.levelno == logging.WARNING)
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")
    with pytest.raises(RuntimeError, match="quantization"):
        build_kernel(single_gpu_moe_config(), single_gpu_vllm_config(), pf=no_dp_ep_pf(),
                     quant_config=fp8)


@pytest.fixture(scope="module")
def megamoe_emu_lib(tmp_path_factory):
    from conftest import build_emu_library

    return build_emu_library(tmp_path_factory, "megamoe_emu")


def emulated_megamoe_forward(lib):
    """``ops.megamoe_forward`` as the real kernel on the CPU emulation, on the caller's
    workspaces (two blocks per emulated SM, all at once)."""
    import ctypes

    def forward(x, topk_ids, topk_weights, w13, w2, *, out, expert_map=None, act_workspace,
                partial_workspace, num_sms=0, timeout_s):
        num_rows, hidden = x.shape
        top_k, num_local, intermediate = topk_ids.shape[1], w13.shape[0], w13.shape[1] // 2
        sync = torch.zeros(lib.petit_emu_megamoe_sync_ints(num_local, hidden), dtype=torch.int32)
        ptr = lambda t: None if t is None else ctypes.c_void_p(t.data_ptr())  # noqa: E731
        rc = lib.petit_emu_megamoe(
            ptr(x), ptr(topk_ids), ptr(expert_map),
            0 if expert_map is None else expert_map.numel(), ptr(topk_weights), ptr(w13),
            ptr(w2), ptr(act_workspace), ptr(partial_workspace), ptr(sync), ptr(out), num_rows,
            top_k, hidden, intermediate, num_local, 2, 1, None,  # no trace
            1 << 30)  # l2_bytes: the emulated L2 holds every weight tile (no row groups)
        assert rc == 0 and int(sync.abs().sum()) == 0
        return out

    return forward


@pytest.mark.parametrize("path", ["composed", "megamoe"])
def test_single_gpu_layer_through_vllms_kernel(path, workspace, monkeypatch, megamoe_emu_lib):
    """vLLM's real one-GPU FusedMoEKernel (pass-through prepare/finalize, its workspaces and
    output aliasing) with PetitSingleGpuExperts, the composed path on the torch stand-in of
    the kernels and MegaMoE as the real kernel on the CPU emulation: both against the dense
    reference, the output written in full."""
    from vllm_petit_moe import ops
    from vllm_petit_moe.config import SingleGpuLayerConfig

    monkeypatch.setattr(ops, "experts_forward", emulated_experts_forward)
    monkeypatch.setattr(ops, "megamoe_forward", emulated_megamoe_forward(megamoe_emu_lib))
    monkeypatch.setattr(ops, "sm90a_kernels_supported", lambda: True)  # the emulation runs it
    num_tokens, num_experts, top_k, hidden, intermediate = 6, 4, 2, 64, 64
    # inputs of their own per path: vLLM's workspace (the output's memory) is shared between
    # the cases, so a path that wrote nothing could not pass on the other's result
    g = torch.Generator().manual_seed(11 if path == "composed" else 12)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                       for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=g)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / 8).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=g) / 8).to(torch.bfloat16)
    moe_config = single_gpu_moe_config(num_experts=num_experts, experts_per_token=top_k,
                                       hidden_dim=hidden, intermediate_size=intermediate)
    vllm_config = single_gpu_vllm_config()
    with set_current_vllm_config(vllm_config):
        triton = TritonExperts(moe_config, FUSED_MOE_UNQUANTIZED_CONFIG)
        experts = petit_experts.PetitSingleGpuExperts(
            moe_config, FUSED_MOE_UNQUANTIZED_CONFIG, fallback=triton,
            layer_config=SingleGpuLayerConfig(
                megamoe_max_tokens=num_tokens if path == "megamoe" else 0,
                composed_min_tokens=1))
        kernel = mk.FusedMoEKernel(no_dp_ep_pf(), experts)
    assert experts.path_for(num_tokens, top_k, hidden, intermediate) == path
    with dp_step(vllm_config, [num_tokens]):
        out = kernel.apply(x, w13, w2, weights, ids, activation=MoEActivation.SILU,
                           global_num_experts=num_experts, expert_map=None,
                           apply_router_weight_on_input=False)
    ref = reference.dense_moe_reference(x, ids, weights, w13, w2)
    assert out.shape == (num_tokens, hidden) and not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
