"""CPU-only tests of ``PetitPrepareAndFinalize`` inside vLLM's real modular kernel, against
the reference: expert ids through vLLM's expert_map, every rank's output over a
``FakeEpBuffer`` or over the real dispatch and combine kernels on the CPU emulation
(``EmulatedEpBuffer``, tests/fakes.py), and its errors. Runs with the real vLLM and no GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.expert_map_manager import (  # noqa: E402
    determine_expert_map,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # noqa: E402
    TopKWeightAndReduceNoOP,
)

from vllm_petit_moe.testing import reference  # noqa: E402
from vllm_petit_moe.vllm_glue.prepare_finalize import (  # noqa: E402
    PetitPrepareAndFinalize,
    linear_expert_map,
    local_to_global_expert_ids,
)

from fakes import (  # noqa: E402
    FakeEpBuffer,
    ReferenceExperts,
    dp_step,
    make_call,
    run_rank_through_modular_kernel,
)


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
