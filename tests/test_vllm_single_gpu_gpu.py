"""A block-fp8 MoE layer on one GPU (no DP, no EP) through real vLLM, as `vllm serve` runs it
with ``VLLM_USE_PETIT_MOE=1``: vLLM's one-GPU ``FusedMoEKernel`` (pass-through
prepare/finalize) built with vLLM's fp8 Triton experts, the plugin's real hook putting
``PetitSingleGpuExperts`` in their place (MegaMoE on the e4m3 weights and block scales up to
``megamoe_max_tokens``, vLLM's fp8 Triton experts above). Against the same kernel built
without the flag and the fp32 MoE on the dequantized weights: petit no less accurate than
vLLM's w8a8 (it keeps the activations in bf16), within vLLM's own error of it, and CUDA graph
replays with fresh inputs bit-equal to eager calls.

Needs an sm_90a GPU, vLLM and the compiled extension (Qwen3-30B-A3B's H and I, 16 experts).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from conftest import requires_extension, requires_gpu  # noqa: E402

pytestmark = [requires_gpu, requires_extension]

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 16, 8, 2048, 768


@pytest.fixture(scope="module")
def sm90a():
    from vllm_petit_moe import ops

    if not ops.sm90a_kernels_supported():
        pytest.skip("MegaMoE needs an sm_90a GPU")


@pytest.fixture
def cuda_workspace():
    """vLLM's workspace manager on the GPU (a CPU test of the same process may have made one
    on the CPU)."""
    from vllm.v1.worker import workspace

    workspace.reset_workspace_manager()
    workspace.init_workspace_manager(torch.device("cuda"))
    yield
    workspace.reset_workspace_manager()


@pytest.fixture
def layer(sm90a, cuda_workspace, monkeypatch):
    """(vLLM's fp8 kernel, petit's, the weights): both built by ``FusedMoEKernel`` on vLLM's
    fp8 Triton experts, petit's with the flag and the plugin's hook installed."""
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular)

    from fakes import make_moe_config, make_parallel_config
    from vllm_petit_moe.testing import reference
    from vllm_petit_moe.vllm_glue import compat, envs, hook
    from vllm_petit_moe.vllm_glue.experts import PetitSingleGpuExperts

    g = torch.Generator(device="cuda").manual_seed(5)
    w13, s13, d13 = reference.block_fp8_quantize(
        torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) / 16)
    w2, s2, d2 = reference.block_fp8_quantize(
        torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda", generator=g) / 16)
    quant = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[128, 128])
    parallel = make_parallel_config(dp_size=1, ep_size=1, use_ep=False)
    moe_config = make_moe_config(parallel, num_experts=NUM_EXPERTS, experts_per_token=TOP_K,
                                 hidden_dim=HIDDEN, intermediate_size=INTER, device="cuda")
    vllm_config = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=1),
                             device_config=DeviceConfig(device="cuda"))

    def build():
        with set_current_vllm_config(vllm_config):
            return mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                                     TritonExperts(moe_config, quant))

    for name in (envs.VLLM_PETIT_MOE_STRICT, envs.VLLM_PETIT_MOE_EXPERTS,
                 envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(envs.VLLM_USE_PETIT_MOE, raising=False)
    default = build()
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")  # a refusal fails the test
    installed = compat.install_kernel_hook(hook.maybe_substitute, hook.maybe_substitute_experts)
    try:
        petit = build()
    finally:
        if installed:
            compat.uninstall_kernel_hook()
    assert type(default.fused_experts) is TritonExperts
    assert isinstance(petit.fused_experts, PetitSingleGpuExperts) and petit.fused_experts.fp8
    return dict(default=default, petit=petit, vllm_config=vllm_config, w13=w13, w2=w2, d13=d13,
                d2=d2)


def inputs(num_tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, device="cuda", generator=g)[:TOP_K]
                       for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, TOP_K, device="cuda", generator=g)
    return x, ids, weights


def apply(layer, which, x, ids, weights):
    """One call of the kernel, its output copied out of vLLM's workspace (shared by calls)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from fakes import dp_step

    with dp_step(layer["vllm_config"], [x.shape[0]]):
        out = layer[which].apply(x, layer["w13"], layer["w2"], weights, ids,
                                 activation=MoEActivation.SILU, global_num_experts=NUM_EXPERTS,
                                 expert_map=None, apply_router_weight_on_input=False)
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("num_tokens", [1, 2, 8, 9, 64])
def test_block_fp8_layer_matches_vllm_and_the_reference(layer, num_tokens):
    """MegaMoE up to 8 tokens, vLLM's fp8 Triton experts from 9 (the default config): the
    output in full, no less accurate than vLLM's own path against the fp32 reference."""
    from vllm_petit_moe.config import SingleGpuLayerConfig
    from vllm_petit_moe.testing import reference

    experts = layer["petit"].fused_experts
    path = experts.path_for(num_tokens, TOP_K, HIDDEN, INTER)
    assert path == ("megamoe" if num_tokens <= SingleGpuLayerConfig().megamoe_max_tokens
                    else "triton")
    x, ids, weights = inputs(num_tokens, seed=num_tokens)
    y_default = apply(layer, "default", x, ids, weights).clone()
    y_petit = apply(layer, "petit", x, ids, weights).clone()
    ref = reference.dense_moe_reference(x, ids, weights, layer["d13"], layer["d2"], "fp32")
    assert y_petit.shape == (num_tokens, HIDDEN) and y_petit.dtype == torch.bfloat16
    assert bool(torch.isfinite(y_petit).all())
    err_petit, err_default = rel(y_petit, ref), rel(y_default, ref)
    numbers = (f"{path}: petit {err_petit:.2e}, vLLM {err_default:.2e} against fp32; "
               f"petit vs vLLM {rel(y_petit, y_default):.2e}")
    if path == "megamoe":  # bf16 activations: ~1.6e-3 where vLLM's w8a8 is ~4.5e-2
        assert err_petit < 1e-2 and err_petit <= err_default, numbers
    else:  # vLLM's own experts, the activations quantized by the experts instead of prepare
        assert rel(y_petit, y_default) < 1e-3, numbers
    assert rel(y_petit, y_default) <= err_default + 1e-2, numbers


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_block_fp8_layer_graph_replays(layer, num_tokens):
    """The layer captured in a CUDA graph (as vLLM's decode graphs hold it), replayed with
    fresh inputs copied in and the output poisoned: each replay bit-equal to an eager call."""
    x, ids, weights = inputs(num_tokens, seed=100 + num_tokens)
    static = [t.clone() for t in (x, ids, weights)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apply(layer, "petit", *static)  # warm-up: vLLM's workspace at its size
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = apply(layer, "petit", *static)
    for replay in range(4):
        for t, v in zip(static, inputs(num_tokens, seed=200 + replay)):
            t.copy_(v)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager = apply(layer, "petit", *static).clone()
        assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16)), replay
    del graph
