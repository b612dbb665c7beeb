"""CPU-only tests of the plugin hook's decision (``hook.decide`` on real vLLM config objects)
and of its substitution inside vLLM's real ``FusedMoEKernel``, with the GPU-only parts faked
(tests/fakes.py). Runs with the real vLLM and no GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config import ParallelConfig  # noqa: E402
from vllm.model_executor.layers.fused_moe import modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import (  # noqa: E402
    MoEPrepareAndFinalizeNaiveDPEPModular,
    make_moe_prepare_and_finalize_naive_dp_ep,
    make_moe_prepare_and_finalize_no_dp_ep,
)

from vllm_petit_moe.vllm_glue import envs, hook  # noqa: E402
from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize  # noqa: E402

from fakes import (  # noqa: E402
    ReferenceExperts,
    build_kernel,
    caplog_at,
    make_moe_config,
    make_parallel_config,
    make_vllm_config,
    naive_pf,
    single_node_cuda,
    triton_experts,
)


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
