"""CPU-only tests of block-fp8 MoE layers with DP + EP under the flag: the kernels vLLM's fp8
oracle builds (``make_fp8_moe_kernel`` with the experts it may pick on Hopper: Triton,
DeepGEMM's TritonOrDeepGemmExperts, FlashInfer's CUTLASS experts), what petit's
prepare/finalize hands each of them (the tensors recorded at the experts' ``apply``, whose
GEMMs run on the reference), the layer output of every rank against a dense reference, the
fused layer on block-fp8 weights (opt-in), and the logged reasons where petit keeps vLLM's
path. Runs with the real vLLM (0.24 and 0.33) and no GPU.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig  # noqa: E402
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import (  # noqa: E402
    MoEPrepareAndFinalizeNaiveDPEPModular,
)

from vllm_petit_moe.testing import reference  # noqa: E402
from vllm_petit_moe.vllm_glue import compat, envs, hook  # noqa: E402
from vllm_petit_moe.vllm_glue import experts as petit_experts  # noqa: E402
from vllm_petit_moe.vllm_glue.prepare_finalize import (  # noqa: E402
    PetitPrepareAndFinalize,
    dispatch_quant_mode,
)

from fakes import (  # noqa: E402
    build_fp8_kernel,
    caplog_at,
    make_block_fp8_call,
    make_moe_config,
    make_parallel_config,
    make_vllm_config,
    record_experts_inputs,
    run_rank_through_the_hook,
)

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 128, 128, 8

# vLLM's fp8 backends petit serves with DP + EP: (experts class, how it finds its experts)
SERVED = {
    "TRITON": ("TritonExperts", "expert_map"),
    "DEEPGEMM": ("TritonOrDeepGemmExperts", "expert_map"),
    "FLASHINFER_CUTLASS": ("FlashInferExperts", "ep_rank"),
}


def block_fp8_kernel(backend, call=None, **quant):
    """build(moe_config) for run_rank_through_the_hook / a direct call: vLLM's fp8 kernel for
    ``backend`` on this rank's block scales of ``call`` (ones without a call)."""
    def build(moe_config, vllm_config=None):
        mpc = moe_config.moe_parallel_config
        if call is not None:
            _, _, w1_scale, w2_scale = call.layer_weights(mpc.ep_rank, mpc.ep_size)
        else:
            num_local, hidden = moe_config.num_local_experts, moe_config.hidden_dim
            inter = moe_config.intermediate_size
            w1_scale = torch.ones(num_local, 2 * inter // 128, hidden // 128)
            w2_scale = torch.ones(num_local, hidden // 128, inter // 128)
        fields = {"w1_scale": w1_scale, "w2_scale": w2_scale, **quant}
        return build_fp8_kernel(moe_config, vllm_config or make_vllm_config(
            data_parallel_size=mpc.dp_size), backend, **fields)
    return build


def experts_class(backend):
    return compat.fused_moe_symbol(SERVED[backend][0])


def expected_outputs(call, wire):
    """Every rank's layer output (float64) when the experts compute on ``wire``: None (the
    bf16 tokens) or a dispatch quant mode (each token quantized as dispatch does, then
    dequantized): the dense MoE on the dequantized weights."""
    outs = []
    for x, ids, weights in zip(call.xs, call.topk_ids, call.topk_weights):
        if wire is not None and x.shape[0]:
            x = reference.dequantize_fp8_reference(*reference.quantize_fp8_reference(x, wire))
        outs.append(reference.dense_moe_reference(x, ids, weights, call.w13, call.w2))
    return outs


def rel_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_rank_output(out, call, rank, num_tokens, expected, other_wire, what):
    """Rank ``rank``'s output: bf16 of its input's shape and, where it has tokens, within 1e-2
    of ``expected`` and more than that from ``other_wire`` (so the test can tell the two
    ``what`` apart)."""
    assert out.shape == call.xs[rank].shape and out.dtype == torch.bfloat16
    if num_tokens[rank] == 0:
        return
    err = rel_error(out, expected[rank])
    assert err < 1e-2, f"rank {rank}: relative error {err}"
    assert rel_error(out, other_wire[rank]) > 1e-2, f"rank {rank}: {what} indistinct"


def warnings_of(records):
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


# --------------------------------------------------------------------------------------------
# The fp8 experts vLLM picks, and what petit's prepare hands them
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", sorted(SERVED))
def test_hook_substitutes_for_each_fp8_experts_vllm_picks(backend, kernel_hook, monkeypatch):
    """vLLM's fp8 oracle kernel for a block-fp8 DP + EP layer: petit's prepare/finalize in
    place of the allgather one whatever experts vLLM chose, which stay; the log line names the
    wire: fp8 1x128 for Triton and DeepGEMM, bf16 for FlashInfer (it quantizes inside)."""
    moe_config = make_moe_config(num_experts=16, hidden_dim=1024, intermediate_size=512)
    monkeypatch.delenv(envs.VLLM_USE_PETIT_MOE, raising=False)
    kernel = block_fp8_kernel(backend)(moe_config)
    assert type(kernel.prepare_finalize) is MoEPrepareAndFinalizeNaiveDPEPModular
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    with caplog_at(hook.logger) as records:
        kernel = block_fp8_kernel(backend)(moe_config)
    assert isinstance(kernel.prepare_finalize, PetitPrepareAndFinalize)
    assert type(kernel.fused_experts) is experts_class(backend)
    fi = backend == "FLASHINFER_CUTLASS"
    assert kernel.fused_experts.expects_unquantized_inputs == fi
    messages = [r.getMessage() for r in records if r.levelno == logging.INFO]
    wire = "bf16 (the experts quantize inside)" if fi else "fp8_block128"
    assert any(f"{wire} dispatch to vLLM's {SERVED[backend][0]}" in m for m in messages), messages


RUNS = [(2, [5, 3]), (2, [0, 4]), (4, [2, 7, 0, 3])]  # (W, tokens per rank): one rank empty


@pytest.mark.parametrize("world_size, num_tokens", RUNS)
@pytest.mark.parametrize("backend, kernels", [
    (backend, "reference") for backend in sorted(SERVED)
] + [("TRITON", "emulated"), ("FLASHINFER_CUTLASS", "emulated")])  # DeepGEMM: Triton's wire
def test_fp8_experts_get_the_input_they_expect(backend, kernels, world_size, num_tokens,
                                               kernel_hook, vllm_config, workspace, monkeypatch,
                                               request):
    """Every rank of a block-fp8 layer through vLLM's fp8 kernel with petit's prepare/finalize
    substituted by the hook (with "emulated" the real dispatch and combine kernels, fp8 wire
    included): Triton and DeepGEMM receive e4m3 rows with fp32 [W*R, H/128] scales,
    FlashInfer bf16 rows and no scales; all get global ids; every rank's output matches the
    dense MoE on the activations those experts saw (and not the other wire's)."""
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setattr(compat, "fp8_block_scales_are_ue8m0", lambda: False)
    call = make_block_fp8_call(world_size, num_tokens, num_experts=NUM_EXPERTS, hidden=HIDDEN,
                               intermediate=INTERMEDIATE, seed=3)
    class_name, contract = SERVED[backend]
    calls = record_experts_inputs(monkeypatch, experts_class(backend), contract)
    fi = contract == "ep_rank"
    wire = None if fi else "fp8_block128"
    expected, other_wire = expected_outputs(call, wire), expected_outputs(
        call, "fp8_block128" if fi else None)
    libs = {} if kernels == "reference" else dict(ep_emu_lib=request.getfixturevalue(
        "ep_emu_lib"))
    stride = max(num_tokens)
    vllm_config = make_vllm_config(data_parallel_size=world_size)
    for rank in range(world_size):
        calls.clear()
        out, kernel, buffer = run_rank_through_the_hook(
            block_fp8_kernel(backend, call), call, rank, num_tokens, vllm_config, monkeypatch,
            **libs)
        assert isinstance(kernel.prepare_finalize, PetitPrepareAndFinalize)
        assert type(kernel.fused_experts).__name__ == class_name
        assert buffer.paths == ["dispatch"] and buffer.quants == [wire]
        assert len(calls) == 1, f"rank {rank}: the experts ran {len(calls)} times"
        handed = calls[0]
        rows = world_size * stride
        assert handed["hidden_states"].shape == (rows, HIDDEN)
        if fi:
            assert handed["hidden_states"].dtype == torch.bfloat16
            assert handed["a1q_scale"] is None
        else:
            assert handed["hidden_states"].dtype == torch.float8_e4m3fn
            scale = handed["a1q_scale"]
            assert scale is not None and scale.dtype == torch.float32
            assert scale.shape == (rows, HIDDEN // 128)
        ids = handed["topk_ids"]
        assert ids.dtype == torch.int32 and bool(((ids >= 0) & (ids < NUM_EXPERTS)).all())
        assert_rank_output(out, call, rank, num_tokens, expected, other_wire, "wires")


def test_dispatch_quant_mode_refuses_column_major_activation_scales():
    """vLLM 0.33's is_scale_transposed (FlashInfer's TRT-LLM block-fp8 experts read [H/128,
    M] scales): our dispatch's row-major scales do not fit, so the layer keeps vLLM's path."""
    block = FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128])
    assert not compat.fp8_activation_scales_transposed(block)
    assert dispatch_quant_mode(block)[1] is None
    try:
        transposed = FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128],
                                              is_scale_transposed=True)
    except TypeError:  # vLLM 0.24: no such field
        assert not hasattr(block, "is_scale_transposed")
        return
    assert compat.fp8_activation_scales_transposed(transposed)
    mode, reason = dispatch_quant_mode(transposed)
    assert mode is None and "column-major" in reason


def test_fp8_layers_petit_cannot_serve_keep_vllms_path(kernel_hook, monkeypatch):
    """fp8 layers whose activations our dispatch cannot quantize as vLLM would (per-tensor
    dynamic or static scales, other block sizes) keep vLLM's allgather/reduce-scatter, with
    the reason logged once; strict mode fails instead."""
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    moe_config = make_moe_config(num_experts=16, hidden_dim=1024, intermediate_size=512)
    per_tensor = dict(w1_scale=torch.ones(8), w2_scale=torch.ones(8), block_shape=None)
    cases = {
        "per-tensor": ("TRITON", per_tensor),
        "static": ("FLASHINFER_CUTLASS", dict(per_tensor, a1_scale=torch.ones(1),
                                              a2_scale=torch.ones(1))),
        "1x128": ("TRITON", dict(block_shape=(64, 64))),
    }
    for why, (backend, quant) in cases.items():
        with caplog_at(hook.logger) as records:
            kernel = block_fp8_kernel(backend, **quant)(moe_config)
        assert type(kernel.prepare_finalize) is MoEPrepareAndFinalizeNaiveDPEPModular, why
        assert any("quantized activations" in m and why in m for m in warnings_of(records)), \
            (why, warnings_of(records))
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")
    with pytest.raises(RuntimeError, match="per-tensor"):
        block_fp8_kernel("TRITON", **per_tensor)(moe_config)


def test_deepgemm_masked_experts_behind_deepep_ll_are_not_ours(kernel_hook, monkeypatch,
                                                              vllm_config):
    """DeepGEMM's masked kernel (BatchedDeepGemmExperts, what vLLM runs with DeepEP-LL) comes
    with an --all2all-backend chosen explicitly: nothing of petit's to replace, logged at INFO
    (not a warning), and the kernel stays as vLLM built it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts)
    from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import (
        BatchedPrepareAndFinalize)

    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    moe_config = make_moe_config(make_parallel_config(all2all_backend="deepep_low_latency"),
                                 num_experts=16, hidden_dim=1024, intermediate_size=512)
    quant = fp8_w8a8_moe_quant_config(w1_scale=torch.ones(8, 8, 8),
                                      w2_scale=torch.ones(8, 8, 4), block_shape=[128, 128])
    with set_current_vllm_config(vllm_config), caplog_at(hook.logger) as records:
        experts = BatchedDeepGemmExperts(moe_config=moe_config, quant_config=quant,
                                         max_num_tokens=64, num_dispatchers=2)
        pf = BatchedPrepareAndFinalize(max_num_tokens=64, num_local_experts=8,
                                       num_dispatchers=2, rank=0)
        kernel = mk.FusedMoEKernel(pf, experts)
    assert kernel.prepare_finalize is pf and kernel.fused_experts is experts
    assert not warnings_of(records)
    assert any("deepep_low_latency chosen explicitly" in r.getMessage() for r in records
               if r.levelno == logging.INFO), [r.getMessage() for r in records]


# --------------------------------------------------------------------------------------------
# The fused layer on block-fp8 weights with DP + EP (opt-in: VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS)
# --------------------------------------------------------------------------------------------


def test_hook_enables_the_fused_layer_on_block_fp8_weights(kernel_hook, monkeypatch):
    """With VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, as for bf16: vLLM's fp8 Triton experts become
    PetitEpExperts holding them for the composed steps (which keep their fp8 wire) and the
    fused layer is enabled on the e4m3 weights. Experts whose weights vLLM converted
    (FlashInfer, DeepGEMM), other fp8 schemes, and petit's GEMMs alone keep vLLM's experts
    with the reason logged; strict mode fails."""
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, "32")
    moe_config = make_moe_config(num_experts=16, hidden_dim=1024, intermediate_size=512)
    with caplog_at(hook.logger) as records:
        kernel = block_fp8_kernel("TRITON")(moe_config)
    pf, experts = kernel.prepare_finalize, kernel.fused_experts
    assert isinstance(pf, PetitPrepareAndFinalize) and pf.megamoe_max_stride == 32
    assert isinstance(experts, petit_experts.PetitEpExperts) and experts.fp8
    assert type(experts.fallback) is TritonExperts and experts.prepare_finalize is pf
    assert not experts.expects_unquantized_inputs  # the composed steps: fp8 rows for Triton
    assert pf.buffer.reserved_megamoe == [512]
    assert any("the fused layer on block-fp8 weights for steps of up to 32 tokens per rank, "
               "else vLLM's TritonExperts" in r.getMessage() for r in records)

    for backend in ("FLASHINFER_CUTLASS", "DEEPGEMM"):
        with caplog_at(hook.logger) as records:
            kernel = block_fp8_kernel(backend)(moe_config)
        assert isinstance(kernel.prepare_finalize, PetitPrepareAndFinalize)
        assert kernel.prepare_finalize.megamoe_max_stride == 0
        name = SERVED[backend][0]
        assert type(kernel.fused_experts) is experts_class(backend)
        assert any(name in m and "own layout" in m for m in warnings_of(records)), backend

    per_channel = dict(block_shape=None, per_act_token_quant=True, per_out_ch_quant=True,
                       w1_scale=torch.ones(8, 1024, 1), w2_scale=torch.ones(8, 1024, 1))
    with caplog_at(hook.logger) as records:
        kernel = block_fp8_kernel("TRITON", **per_channel)(moe_config)
    assert isinstance(kernel.prepare_finalize, PetitPrepareAndFinalize)  # fp8 per-token wire
    assert type(kernel.fused_experts) is TritonExperts
    assert any("128 x 128" in m for m in warnings_of(records)), warnings_of(records)

    monkeypatch.setenv(envs.VLLM_PETIT_MOE_EXPERTS, "1")  # and the fused layer: GEMMs not used
    with caplog_at(hook.logger) as records:
        kernel = block_fp8_kernel("TRITON")(moe_config)
    assert isinstance(kernel.fused_experts, petit_experts.PetitEpExperts)
    assert type(kernel.fused_experts.fallback) is TritonExperts
    assert any("composed steps" in m for m in warnings_of(records)), warnings_of(records)
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, "0")  # petit's GEMMs alone
    with caplog_at(hook.logger) as records:
        kernel = block_fp8_kernel("TRITON")(moe_config)
    assert type(kernel.fused_experts) is TritonExperts
    assert any("bf16 weights" in m for m in warnings_of(records)), warnings_of(records)

    monkeypatch.delenv(envs.VLLM_PETIT_MOE_EXPERTS)
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, "32")
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")
    with pytest.raises(RuntimeError, match="FlashInferExperts"):
        block_fp8_kernel("FLASHINFER_CUTLASS")(moe_config)


@pytest.mark.parametrize("world_size, num_tokens", RUNS)
@pytest.mark.parametrize("kernels", ["reference", "emulated"])
@pytest.mark.parametrize("fused", [True, False])
def test_fused_block_fp8_layer_through_vllms_kernel(fused, kernels, world_size, num_tokens,
                                                    kernel_hook, workspace, monkeypatch,
                                                    request):
    """Every rank of a block-fp8 layer built by vLLM's fp8 oracle (Triton experts) with the
    fused layer switched on by the variable: a step within the bound is one EpBuffer.megamoe
    call per rank on the bf16 tokens and the layer's e4m3 weights and block scales (with
    "emulated" the real fused kernel of every rank on the CPU emulation), vLLM's experts never
    run; a larger step dispatches fp8 rows to vLLM's Triton experts. Both against the dense
    MoE on the dequantized weights."""
    stride = max(num_tokens)
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, str(stride if fused else
                                                                   stride - 1))
    monkeypatch.setattr(compat, "fp8_block_scales_are_ue8m0", lambda: False)
    call = make_block_fp8_call(world_size, num_tokens, num_experts=NUM_EXPERTS, hidden=HIDDEN,
                               intermediate=INTERMEDIATE, seed=5)
    calls = record_experts_inputs(monkeypatch, TritonExperts, "expert_map")
    wire = None if fused else "fp8_block128"
    expected, other_wire = expected_outputs(call, wire), expected_outputs(
        call, "fp8_block128" if fused else None)
    libs = {}
    if kernels == "emulated":
        libs = dict(ep_emu_lib=request.getfixturevalue("ep_emu_lib"),
                    megamoe_lib=request.getfixturevalue("megamoe_emu_lib"))
    vllm_config = make_vllm_config(data_parallel_size=world_size)
    for rank in range(world_size):
        calls.clear()
        out, kernel, buffer = run_rank_through_the_hook(
            block_fp8_kernel("TRITON", call), call, rank, num_tokens, vllm_config, monkeypatch,
            **libs)
        assert isinstance(kernel.fused_experts, petit_experts.PetitEpExperts)
        assert buffer.paths == ["megamoe" if fused else "dispatch"], buffer.paths
        assert buffer.region_strides == [stride]
        if fused:
            assert calls == [], "vLLM's experts ran in a fused step"
        else:
            assert len(calls) == 1 and buffer.quants == [wire]
            assert calls[0]["hidden_states"].dtype == torch.float8_e4m3fn
            assert calls[0]["a1q_scale"].shape == (world_size * stride, HIDDEN // 128)
        assert_rank_output(out, call, rank, num_tokens, expected, other_wire, "paths")
