"""Test doubles and builders of the vLLM plugin's CPU tests (tests/test_plugin_*_cpu.py,
test_glue_faults_cpu.py, test_bench_tpot_cpu.py, test_vllm_harness_cpu.py). Without vLLM
importing it skips the importing module (``pytest.importorskip``). Their fixtures
(``vllm_config``, ``kernel_hook``, ``workspace``, ``ep_emu_lib``, ``megamoe_emu_lib``) are in
conftest.py.

vLLM's config objects, prepare/finalize classes, Triton experts object, expert maps and
``FusedMoEKernel`` are the real ones. Faked, because they need a GPU: the ``EpBuffer``
(``FakeEpBuffer`` below: the architecture.md layout computed with ``vllm_petit_moe.testing.reference``, every rank's inputs known to every rank, as
in pplx-kernels' tests; ``EmulatedEpBuffer``: the same with the real dispatch and combine kernels
on the CPU emulation of tests/emu), the runtime facts of the EP group (``EpRuntime``), and
the Triton GEMMs (``ReferenceExperts``: vLLM's experts contract, expert_map lookup included,
on the reference), and ``ops.experts_forward`` (``emulated_experts_forward``: a torch emulation
of the three kernel steps). For block-fp8 layers: vLLM's own fp8 oracle kernel
(``build_fp8_kernel``) with the GEMMs of whichever experts it holds replaced by their contract
on the reference (``record_experts_inputs``, which also records what they were handed), and
block-fp8 weights whose dequantization is exact in bf16 (``make_block_fp8_call``). The compiled
extension is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402
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
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.expert_map_manager import (  # noqa: E402
    determine_expert_map,
)
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize import (  # noqa: E402
    MoEPrepareAndFinalizeNaiveDPEPModular,
    make_moe_prepare_and_finalize_naive_dp_ep,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # noqa: E402
    TopKWeightAndReduceNoOP,
)

from vllm_petit_moe.testing import reference  # noqa: E402
from vllm_petit_moe.vllm_glue import hook  # noqa: E402
from vllm_petit_moe.vllm_glue import experts as petit_experts  # noqa: E402
from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize  # noqa: E402


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
    w13: torch.Tensor  # [E, 2I, H] bf16 (block fp8: the dequantized weights, exact in bf16)
    w2: torch.Tensor  # [E, H, I] bf16
    # block fp8 (make_block_fp8_call): (w13 e4m3, w13 scales [E, 2I/128, H/128], w2 e4m3,
    # w2 scales [E, H/128, I/128]), the weights the layer holds; None: bf16 weights
    fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def _local(self, rank: int, world_size: int) -> slice:
        num_local = self.num_experts // world_size
        return slice(rank * num_local, (rank + 1) * num_local)

    def local_weights(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts in bf16 (the dequantized ones for block fp8)."""
        experts = self._local(rank, world_size)
        return self.w13[experts], self.w2[experts]

    def layer_weights(self, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
        """What this rank's layer holds: (w13, w2, w13_scale, w2_scale), the scales None for
        bf16 weights."""
        if self.fp8 is None:
            return (*self.local_weights(rank, world_size), None, None)
        experts = self._local(rank, world_size)
        w13, w13_scale, w2, w2_scale = (t[experts].contiguous() for t in self.fp8)
        return w13, w2, w13_scale, w2_scale


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
        self.quants: list[str | None] = []  # the quant mode of each dispatch
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

    def _record_megamoe(self, x, topk_ids, topk_weights, w13, w2, region_stride, out,
                        w13_scale=None, w2_scale=None):
        """As _record_dispatch, plus the layer's weights (this rank's experts: e4m3 bytes and
        block scales for block fp8) and `out`."""
        self._record_dispatch(x, topk_ids, topk_weights, region_stride)
        self.paths.append("megamoe")
        assert x.dtype == torch.bfloat16  # the fused kernel takes the bf16 tokens
        handed = (w13, w2, w13_scale, w2_scale)
        for name, got, want in zip(("w13", "w2", "w13_scale", "w2_scale"), handed,
                                   self.call.layer_weights(self.rank, self.world_size)):
            assert (got is None) == (want is None), f"{name}: {got} handed over, want {want}"
            assert got is None or (got.dtype == want.dtype and torch.equal(
                got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)), name
        assert out is not None and out.shape == x.shape and out.is_contiguous()

    def megamoe(self, x, topk_ids, topk_weights, w13, w2, region_stride=None, out=None,
                w13_scale=None, w2_scale=None):
        """The whole layer of this rank on the reference (every rank's inputs are known; block
        fp8: on the dequantized weights)."""
        self._record_megamoe(x, topk_ids, topk_weights, w13, w2, region_stride, out, w13_scale,
                             w2_scale)
        call = self.call
        out.copy_(reference.ep_moe_reference(call.xs, call.topk_ids, call.topk_weights,
                                             call.w13, call.w2, self.world_size)[self.rank])
        return out

    def dispatch(self, x, topk_ids, topk_weights, region_stride=None, quant=None):
        call = self.call
        self._record_dispatch(x, topk_ids, topk_weights, region_stride)
        self.paths.append("dispatch")
        self.quants.append(quant)
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
        quant = self.quants[-1]
        dispatched = reference.dispatch_reference(
            call.xs, call.topk_ids, call.topk_weights, self.num_experts, region_stride, quant
        )
        # the other ranks' experts see what dispatch delivered (fp8: dequantized)
        expert_outs = self._expert_outs(expert_out, [
            (d.recv_x if quant is None else
             reference.dequantize_fp8_reference(d.recv_x, d.recv_x_scales).to(torch.bfloat16),
             d.recv_topk_ids, d.recv_topk_weights) for d in dispatched])
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

    def megamoe(self, x, topk_ids, topk_weights, w13, w2, region_stride=None, out=None,
                w13_scale=None, w2_scale=None):
        """The fused layer kernel of every rank at once on the emulation (megamoe_lib), on
        every rank's weights as its layer holds them (block fp8: e4m3 + scales)."""
        from test_megamoe_ep_emu_cpu import fused_layer

        self._record_megamoe(x, topk_ids, topk_weights, w13, w2, region_stride, out, w13_scale,
                             w2_scale)
        xs, ids, ws = self._all_ranks(x, topk_ids, topk_weights)
        weights, scales = (self.call.w13, self.call.w2), None
        if self.call.fp8 is not None:
            q13, s13, q2, s2 = self.call.fp8
            weights, scales = (q13.view(torch.uint8), q2.view(torch.uint8)), (s13, s2)
        rc, results, ys, syncs = fused_layer(
            self.ep, self.megamoe_lib.petit_emu_megamoe_sync_ints, xs, ids, ws, *weights,
            region_stride, topk_ids.shape[1], scales=scales)
        assert rc == 0, f"fused layer launch results {results}"
        assert all(int(sync.abs().sum()) == 0 for sync in syncs), "counters not reset"
        out.copy_(ys[self.rank])
        return out

    def dispatch(self, x, topk_ids, topk_weights, region_stride=None, quant=None):
        rank = self.rank
        self._record_dispatch(x, topk_ids, topk_weights, region_stride)
        self.paths.append("dispatch")
        self.quants.append(quant)
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
# Kernels built through vLLM (with kernel_hook, conftest.py: through the plugin's hook)
# --------------------------------------------------------------------------------------------


def build_kernel(moe_config, vllm_config, pf=None, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG):
    with set_current_vllm_config(vllm_config):
        experts = TritonExperts(moe_config, quant_config)
        return mk.FusedMoEKernel(pf or naive_pf(), experts)


# --------------------------------------------------------------------------------------------
# One rank's forward through vLLM's modular kernel
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


def block_fp8_weights(w: torch.Tensor, block: int = 128
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert weights ``[L, R, C]`` as a block-fp8 checkpoint (e4m3, one fp32 scale per
    ``block`` x ``block``), with power-of-two scales so that the dequantized weights are exact
    in bf16 (an e4m3 value times 2^k): (e4m3, scales ``[L, R/block, C/block]``, dequantized
    bf16)."""
    num, rows, cols = w.shape
    blocks = w.float().view(num, rows // block, block, cols // block, block)
    scale = reference.pow2_ceil(blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0)
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return (q.view(num, rows, cols).contiguous(), scale.contiguous(),
            dequantize_block_fp8(q.view(num, rows, cols), scale).to(torch.bfloat16))


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[L, R, C]`` from e4m3 ``[L, R, C]`` and its block scales ``[L, R/b, C/b]``."""
    num, rows, cols = q.shape
    block_r, block_c = rows // scale.shape[1], cols // scale.shape[2]
    return (q.float().view(num, scale.shape[1], block_r, scale.shape[2], block_c)
            * scale[:, :, None, :, None]).view(num, rows, cols)


def make_block_fp8_call(world_size, num_tokens, *, num_experts=8, hidden=128, intermediate=128,
                        top_k=3, seed=0) -> SimulatedCall:
    """``make_call`` with block-fp8 expert weights (``block_fp8_weights``): ``fp8`` holds what
    the layer holds, ``w13`` / ``w2`` their exact bf16 dequantization."""
    call = make_call(world_size, num_tokens, num_experts=num_experts, hidden=hidden,
                     intermediate=intermediate, top_k=top_k, seed=seed)
    q13, s13, d13 = block_fp8_weights(call.w13)
    q2, s2, d2 = block_fp8_weights(call.w2)
    return SimulatedCall(call.xs, call.topk_ids, call.topk_weights, d13, d2,
                         fp8=(q13, s13, q2, s2))


def dp_step(vllm_config, num_tokens):
    """A forward context carrying vLLM's DP metadata for one step."""
    dp_metadata = DPMetadata(torch.tensor(num_tokens, dtype=torch.int32))
    return override_forward_context(create_forward_context(None, vllm_config, dp_metadata))


def rank_moe_config(call, rank, world_size):
    """The FusedMoEConfig of DP rank ``rank`` of ``world_size`` (EP over the same ranks) for
    the layer of ``call``."""
    parallel = make_parallel_config(dp_size=world_size, dp_rank=rank, ep_size=world_size,
                                    ep_rank=rank)
    return make_moe_config(parallel, num_experts=call.num_experts,
                           experts_per_token=call.topk_ids[0].shape[1],
                           hidden_dim=call.xs[0].shape[1], intermediate_size=call.w2.shape[2])


def apply_on_rank(kernel, call, rank, num_tokens, vllm_config, w13, w2):
    """``kernel.apply`` on rank ``rank``'s inputs of ``call`` in one DP step, with the layer's
    weights ``w13`` / ``w2`` and vLLM's linear expert_map."""
    world_size = len(num_tokens)
    _, expert_map, _ = determine_expert_map(world_size, rank, call.num_experts, "linear")
    with dp_step(vllm_config, num_tokens):
        return kernel.apply(
            call.xs[rank], w13, w2, call.topk_weights[rank], call.topk_ids[rank],
            activation=MoEActivation.SILU, global_num_experts=call.num_experts,
            expert_map=expert_map, apply_router_weight_on_input=False,
        )


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
    moe_config = rank_moe_config(call, rank, world_size)
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
    try:
        out = apply_on_rank(kernel, call, rank, num_tokens, vllm_config,
                            *call.local_weights(rank, world_size))
    finally:
        buffer.close()
    return out, buffer


# --------------------------------------------------------------------------------------------
# Torch stand-ins of the kernels, logs
# --------------------------------------------------------------------------------------------


def emulated_experts_forward(x, topk_ids, topk_weights, w13, w2, *, out, expert_map=None,
                             act_workspace, partial_workspace, tiles="auto"):
    """``ops.experts_forward`` in torch, step by step on the caller's buffers like the kernels:
    act in sorted order -> per-entry bf16 partials -> slot-order fp32 sum into ``out``. ``out``
    may alias ``act_workspace`` (vLLM's fused output shares workspace13). Ids follow the kernels'
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


# --------------------------------------------------------------------------------------------
# vLLM's fp8 experts on the CPU: the input each receives, their GEMMs on the reference
# --------------------------------------------------------------------------------------------


def build_fp8_kernel(moe_config, vllm_config, backend: str, *, w1_scale, w2_scale,
                     block_shape=(128, 128), per_act_token_quant=False, per_out_ch_quant=False,
                     a1_scale=None, a2_scale=None):
    """The ``FusedMoEKernel`` vLLM's fp8 oracle builds for a layer whose experts it chose as
    ``backend`` (an ``Fp8MoeBackend`` name: ``"TRITON"``, ``"FLASHINFER_CUTLASS"``,
    ``"DEEPGEMM"``, ...): its quant config (``make_fp8_moe_quant_config``) and kernel
    (``make_fp8_moe_kernel``: the allgather prepare/finalize with DP + EP, then the experts
    class), so with the kernel hook installed our substitution sees what vLLM built. vLLM's
    EP all2all manager (a GPU communicator) is stood in for by its world size."""
    from unittest import mock

    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.oracle import fp8 as fp8_oracle

    class All2AllManager:
        world_size = moe_config.moe_parallel_config.ep_size

    fp8_backend = fp8_oracle.Fp8MoeBackend[backend]
    quant_config = fp8_oracle.make_fp8_moe_quant_config(
        fp8_backend, w1_scale=w1_scale, w2_scale=w2_scale, a1_scale=a1_scale,
        a2_scale=a2_scale, block_shape=None if block_shape is None else list(block_shape),
        per_act_token_quant=per_act_token_quant, per_out_ch_quant=per_out_ch_quant)
    experts_class = fp8_oracle.backend_to_kernel_cls(fp8_backend)[0]
    # the manager's lookup: _get_ep_all2all_manager (0.24), get_ep_all2all_manager (0.33)
    patches = [mock.patch.object(all2all_utils, name, lambda *args, **kwargs: All2AllManager())
               for name in ("_get_ep_all2all_manager", "get_ep_all2all_manager")
               if hasattr(all2all_utils, name)]
    with set_current_vllm_config(vllm_config):
        for patch in patches:
            patch.start()
        try:
            return fp8_oracle.make_fp8_moe_kernel(quant_config, moe_config, experts_class,
                                                  fp8_backend)
        finally:
            for patch in patches:
                patch.stop()


def record_experts_inputs(monkeypatch, experts_class, kind: str) -> list[dict]:
    """Replace ``experts_class.apply`` (GPU kernels) by vLLM's contract of that kind on the
    reference, recording what each call was handed: ``"expert_map"`` (Triton, DeepGEMM:
    e4m3 rows dequantized with ``a1q_scale``, global ids through ``expert_map``) or
    ``"ep_rank"`` (FlashInfer-CUTLASS: bf16 rows, which it quantizes itself, global ids
    of experts ``[ep_rank L, (ep_rank + 1) L)``). Both: ids in ``[0, E)``, block-fp8 weights
    dequantized with the quant config's scales, the router weights applied, the top-k
    reduced into ``output``. Returns the list the calls are recorded in (hidden_states,
    a1q_scale, topk_ids, expert_map as handed over)."""
    calls: list[dict] = []

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        calls.append(dict(hidden_states=hidden_states.clone(), topk_ids=topk_ids.clone(),
                          a1q_scale=None if a1q_scale is None else a1q_scale.clone(),
                          expert_map=expert_map))
        assert bool(((topk_ids >= 0) & (topk_ids < global_num_experts)).all())
        num_local = w1.shape[0]
        if kind == "ep_rank":
            first = self.moe_config.moe_parallel_config.ep_rank * num_local
            mine = (topk_ids >= first) & (topk_ids < first + num_local)
            local_ids = torch.where(mine, topk_ids - first, -1).to(torch.int32)
        else:
            local_ids = expert_map.long()[topk_ids.long()].to(torch.int32)
        x = hidden_states
        if a1q_scale is not None:
            x = reference.dequantize_fp8_reference(x, a1q_scale)
        w13, w2 = w1, w2
        if self.quant_config.w1_scale is not None:
            w13 = dequantize_block_fp8(w1, self.quant_config.w1_scale)
            w2 = dequantize_block_fp8(w2, self.quant_config.w2_scale)
        weights = torch.where(local_ids >= 0, topk_weights.float(), 0.0)
        output.copy_(reference.experts_reference(
            x.to(torch.bfloat16), local_ids, weights, w13.to(torch.bfloat16),
            w2.to(torch.bfloat16)))

    monkeypatch.setattr(experts_class, "apply", apply)
    return calls


def run_rank_through_the_hook(build, call, rank, num_tokens, vllm_config, monkeypatch, *,
                              ep_emu_lib=None, megamoe_lib=None):
    """Rank ``rank``'s forward of ``call`` through the kernel ``build(moe_config)`` makes (as
    vLLM builds it) while the plugin's hook is installed (conftest's ``kernel_hook``): the
    decision, the substitution and the experts step as a server of DP rank ``rank`` would
    take them, with the layer's weights as ``call.layer_weights`` and vLLM's linear
    expert_map. The buffer is a ``FakeEpBuffer`` (with ``ep_emu_lib`` an ``EmulatedEpBuffer``:
    the real dispatch / combine, with ``megamoe_lib`` the fused layer, on the CPU emulation).
    Returns (output, kernel, buffer or None where nothing was substituted)."""
    from vllm_petit_moe.vllm_glue import buffer_cache

    world_size, num_experts = len(num_tokens), call.num_experts
    moe_config = rank_moe_config(call, rank, world_size)
    buffers = []

    def create_buffer(group, config):
        if ep_emu_lib is None:
            buffer = FakeEpBuffer(rank, world_size, num_experts, call)
        else:
            buffer = EmulatedEpBuffer(ep_emu_lib, rank, world_size, num_experts, call,
                                      megamoe_lib=megamoe_lib)
        buffers.append(buffer)
        return buffer

    runtime = single_node_cuda(rank, world_size)
    monkeypatch.setattr(hook, "_runtime_provider", lambda: runtime)
    monkeypatch.setattr(buffer_cache, "_create_buffer", create_buffer)
    buffer_cache.close_all_buffers()
    try:
        kernel = build(moe_config)
        w13, w2, _, _ = call.layer_weights(rank, world_size)
        out = apply_on_rank(kernel, call, rank, num_tokens, vllm_config, w13, w2)
    finally:
        buffer_cache.close_all_buffers()
    return out, kernel, (buffers[0] if buffers else None)
