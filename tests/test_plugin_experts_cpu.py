"""CPU-only tests of ``PetitExperts``' side of vLLM's experts interface (its GEMMs replaced
by a torch emulation of the three kernel steps, ``emulated_experts_forward``) and of the fused
layer (``PetitEpExperts``, ``EpBuffer.megamoe`` on the reference or the CPU emulation) inside
vLLM's real modular kernel. Runs with the real vLLM and no GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.expert_map_manager import (  # noqa: E402
    determine_expert_map,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import (  # noqa: E402
    MoEPrepareAndFinalizeNaiveDPEPModular,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # noqa: E402
    TopKWeightAndReduceNoOP,
)

from vllm_petit_moe.testing import reference  # noqa: E402
from vllm_petit_moe.vllm_glue import envs  # noqa: E402
from vllm_petit_moe.vllm_glue import experts as petit_experts  # noqa: E402
from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize  # noqa: E402

from fakes import (  # noqa: E402
    FakeEpBuffer,
    ReferenceExperts,
    build_kernel,
    dp_step,
    emulated_experts_forward,
    make_call,
    make_moe_config,
    make_vllm_config,
    run_rank_through_modular_kernel,
)


# --------------------------------------------------------------------------------------------
# PetitExperts: vLLM's experts interface (the kernels themselves are tested on the GPU and in
# tests/test_experts_emu_cpu.py)
# --------------------------------------------------------------------------------------------


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
