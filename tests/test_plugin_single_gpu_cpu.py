"""CPU-only tests of the one-GPU layer (no DP, no EP): ``PetitSingleGpuExperts`` in place of
vLLM's Triton experts behind vLLM's own prepare/finalize, its per-call path choice, and vLLM's
real one-GPU ``FusedMoEKernel`` with the composed path on the torch stand-in of the kernels
and MegaMoE on the CPU emulation. Runs with the real vLLM and no GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402

from vllm_petit_moe.testing import reference  # noqa: E402
from vllm_petit_moe.vllm_glue import compat, envs, hook  # noqa: E402
from vllm_petit_moe.vllm_glue import experts as petit_experts  # noqa: E402

from fakes import (  # noqa: E402
    build_kernel,
    caplog_at,
    dp_step,
    emulated_experts_forward,
    make_moe_config,
    make_parallel_config,
    make_vllm_config,
    naive_pf,
)


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


def emulated_megamoe_forward(lib):
    """``ops.megamoe_forward`` as the real kernel on the CPU emulation, on the caller's
    workspaces (two blocks per emulated SM, all at once)."""
    import ctypes

    def forward(x, topk_ids, topk_weights, w13, w2, *, out, expert_map=None, act_workspace,
                partial_workspace, num_sms=0, timeout_s, w13_scale=None, w2_scale=None):
        num_rows, hidden = x.shape
        top_k, num_local, intermediate = topk_ids.shape[1], w13.shape[0], w13.shape[1] // 2
        sync = torch.zeros(lib.petit_emu_megamoe_sync_ints(num_local, hidden), dtype=torch.int32)
        ptr = lambda t: None if t is None else ctypes.c_void_p(t.data_ptr())  # noqa: E731
        rc = lib.petit_emu_megamoe(
            ptr(x), ptr(topk_ids), ptr(expert_map),
            0 if expert_map is None else expert_map.numel(), ptr(topk_weights), ptr(w13),
            ptr(w2), ptr(act_workspace), ptr(partial_workspace), ptr(sync), ptr(out), num_rows,
            top_k, hidden, intermediate, num_local, 2, 1, None,  # no trace
            1 << 30,  # l2_bytes: the emulated L2 holds every weight tile (no row groups)
            ptr(w13_scale), ptr(w2_scale))
        assert rc == 0 and int(sync.abs().sum()) == 0
        return out

    return forward


def through_vllms_kernel(x, ids, weights, w13, w2, quant_config, layer_config, path):
    """One call of vLLM's real one-GPU FusedMoEKernel (its pass-through prepare/finalize,
    workspaces and output aliasing) with PetitSingleGpuExperts holding vLLM's Triton experts
    for ``quant_config``, after checking that ``layer_config`` sends the call to ``path``."""
    (num_tokens, hidden), top_k = x.shape, ids.shape[1]
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    moe_config = single_gpu_moe_config(num_experts=num_experts, experts_per_token=top_k,
                                       hidden_dim=hidden, intermediate_size=intermediate)
    vllm_config = single_gpu_vllm_config()
    with set_current_vllm_config(vllm_config):
        triton = TritonExperts(moe_config, quant_config)
        experts = petit_experts.PetitSingleGpuExperts(moe_config, quant_config, fallback=triton,
                                                      layer_config=layer_config)
        kernel = mk.FusedMoEKernel(no_dp_ep_pf(), experts)
    assert experts.path_for(num_tokens, top_k, hidden, intermediate) == path
    with dp_step(vllm_config, [num_tokens]):
        return kernel.apply(x, w13, w2, weights, ids, activation=MoEActivation.SILU,
                            global_num_experts=num_experts, expert_map=None,
                            apply_router_weight_on_input=False)


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
    layer_config = SingleGpuLayerConfig(
        megamoe_max_tokens=num_tokens if path == "megamoe" else 0, composed_min_tokens=1)
    out = through_vllms_kernel(x, ids, weights, w13, w2, FUSED_MOE_UNQUANTIZED_CONFIG,
                               layer_config, path)
    ref = reference.dense_moe_reference(x, ids, weights, w13, w2)
    assert out.shape == (num_tokens, hidden) and not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


# --------------------------------------------------------------------------------------------
# One GPU, block-fp8 checkpoints: MegaMoE on the e4m3 weights in place of vLLM's fp8 Triton
# --------------------------------------------------------------------------------------------


def block_fp8_quant_config(num_experts, hidden, intermediate, **overrides):
    """vLLM's quant config of a block-fp8 checkpoint's MoE layer (what its fp8 method builds for
    Triton: e4m3 weights, fp32 scales per 128 x 128 block, dynamic 1 x 128 activations)."""
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    fields = dict(w1_scale=torch.ones(num_experts, 2 * intermediate // 128, hidden // 128),
                  w2_scale=torch.ones(num_experts, hidden // 128, intermediate // 128),
                  block_shape=[128, 128])
    fields.update(overrides)
    return fp8_w8a8_moe_quant_config(**fields)


def test_single_gpu_block_fp8_layer_uses_megamoe(kernel_hook, monkeypatch):
    """A block-fp8 layer on one GPU (vLLM's fp8 Triton experts, its pass-through prepare):
    PetitSingleGpuExperts on the same quant config, taking bf16 activations from prepare,
    MegaMoE up to megamoe_max_tokens and vLLM's fp8 Triton experts above (never the bf16
    composed experts); per-tensor and per-channel fp8 keep vLLM's experts with the reason."""
    import logging

    from vllm_petit_moe import ops
    from vllm_petit_moe.config import SingleGpuLayerConfig

    monkeypatch.setattr(compat, "platform_name", lambda: "cuda")
    monkeypatch.setattr(ops, "sm90a_kernels_supported", lambda: True)
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    moe_config = single_gpu_moe_config(num_experts=16, hidden_dim=1024, intermediate_size=512)
    quant = block_fp8_quant_config(16, 1024, 512)
    kernel = build_kernel(moe_config, single_gpu_vllm_config(), pf=no_dp_ep_pf(),
                          quant_config=quant)
    experts = kernel.fused_experts
    assert isinstance(experts, petit_experts.PetitSingleGpuExperts)
    assert type(experts.fallback) is TritonExperts and experts.fp8
    assert experts.expects_unquantized_inputs
    cfg = SingleGpuLayerConfig()
    assert experts.path_for(1, 4, 1024, 512) == "megamoe"
    assert experts.path_for(cfg.megamoe_max_tokens, 4, 1024, 512) == "megamoe"
    assert experts.path_for(cfg.megamoe_max_tokens + 1, 4, 1024, 512) == "triton"
    assert experts.path_for(cfg.composed_min_tokens, 4, 1024, 512) == "triton"
    assert experts.path_for(1, 4, 1024, 448) == "triton"  # I not whole 128-blocks
    # the bf16 layer is unchanged: prepare quantizes nothing there anyway
    bf16 = build_kernel(moe_config, single_gpu_vllm_config(), pf=no_dp_ep_pf())
    assert not bf16.fused_experts.expects_unquantized_inputs
    # other fp8 schemes keep vLLM's experts, with the reason logged
    schemes = {
        "per-tensor": dict(w1_scale=torch.ones(16), w2_scale=torch.ones(16), block_shape=None),
        "per-channel": dict(w1_scale=torch.ones(16, 1024), w2_scale=torch.ones(16, 1024),
                            block_shape=None, per_out_ch_quant=True, per_act_token_quant=True),
        "block [64, 64]": dict(block_shape=[64, 64]),
    }
    for what, fields in schemes.items():
        with caplog_at(hook.logger) as records:
            kernel = build_kernel(moe_config, single_gpu_vllm_config(), pf=no_dp_ep_pf(),
                                  quant_config=block_fp8_quant_config(16, 1024, 512, **fields))
        assert type(kernel.fused_experts) is TritonExperts, what
        messages = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        assert any("128 x 128" in m for m in messages), (what, messages)


def test_single_gpu_block_fp8_layer_through_vllms_kernel(workspace, monkeypatch,
                                                         megamoe_emu_lib):
    """vLLM's real one-GPU FusedMoEKernel on a block-fp8 layer with PetitSingleGpuExperts:
    prepare leaves the activations in bf16, MegaMoE (the real kernel on the CPU emulation)
    runs on the e4m3 weights and block scales of the quant config, against the dense
    reference on the dequantized weights."""
    from vllm_petit_moe import ops
    from vllm_petit_moe.config import SingleGpuLayerConfig

    monkeypatch.setattr(ops, "megamoe_forward", emulated_megamoe_forward(megamoe_emu_lib))
    monkeypatch.setattr(ops, "sm90a_kernels_supported", lambda: True)
    num_tokens, num_experts, top_k, hidden, intermediate = 5, 4, 2, 128, 256
    g = torch.Generator().manual_seed(21)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                       for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=g)
    w13, s13, d13 = reference.block_fp8_quantize(
        torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / 8)
    w2, s2, d2 = reference.block_fp8_quantize(
        torch.randn(num_experts, hidden, intermediate, generator=g) / 8)
    quant = block_fp8_quant_config(num_experts, hidden, intermediate, w1_scale=s13,
                                   w2_scale=s2)
    out = through_vllms_kernel(x, ids, weights, w13, w2, quant,
                               SingleGpuLayerConfig(megamoe_max_tokens=num_tokens), "megamoe")
    ref = reference.dense_moe_reference(x, ids, weights, d13, d2)
    assert out.shape == (num_tokens, hidden) and not out.isnan().any()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
