"""One MoE layer through vLLM's real modular kernel, DP=W + EP, one process per GPU.

Used by ``tests/test_vllm_moe_gpu.py``, ``examples/bench_moe_layer.py`` and tools. Everything
below the process pool is vLLM's own code path:

**Distributed setup** (``init_vllm_dp_ep``), as a vLLM GPU worker of DP rank ``r`` does it
(``vllm/v1/worker/gpu_worker.py: init_worker_distributed_environment``):

1. a ``VllmConfig`` whose ``ParallelConfig`` has ``data_parallel_size=W``,
   ``data_parallel_rank=r``, ``enable_expert_parallel=True``, ``is_moe_model=True``,
   ``all2all_backend="allgather_reducescatter"`` (vLLM's default) and one agreed master
   port, made current with ``set_current_vllm_config`` for the process' lifetime;
2. ``init_distributed_environment(world_size=1, rank=0, local_rank=r, backend="nccl")``:
   vLLM itself turns the DP rank into world rank ``r`` of ``W`` and the master ip/port into
   ``tcp://`` (``ParallelConfig.get_next_dp_init_port``);
3. ``initialize_model_parallel(1, 1)``: TP=PP=1, DP group = EP group = all ``W`` ranks
   (vLLM reads ``data_parallel_size`` from the current config); the EP group's device
   communicator carries vLLM's ``AgRsAll2AllManager``;
4. ``init_workspace_manager(device)`` (vLLM's MoE scratch space, as ``GPUWorker`` does).

**The layer** (``build_layer``): not a whole ``FusedMoE`` module (its router would pick the
routing; we want to choose top-k ids/weights so both paths see identical routing), but the
objects ``FusedMoE`` builds and the modular kernel the quant method would hold:
``FusedMoEParallelConfig`` from ``fused_moe.layer.make_parallel_config`` (what ``FusedMoE``
calls), a ``FusedMoEConfig`` filled like ``FusedMoE`` fills it, vLLM's linear ``expert_map``
(``determine_expert_map``), and the kernels:

- ``"default"``: ``oracle/unquantized.py: make_unquantized_moe_kernel(..., TRITON,
  TritonExperts)`` with the plugin flag off, i.e. ``maybe_make_prepare_finalize`` ->
  ``MoEPrepareAndFinalizeNaiveDPEPModular`` (all-gather / reduce-scatter over vLLM's DP group
  with pynccl) + ``TritonExperts``. vLLM's own selection (``select_unquantized_moe_backend``)
  is recorded in ``MoELayer.vllm_backend`` (TRITON on Hopper without FlashInfer);
- ``"petit"``: by default the same oracle call with ``VLLM_USE_PETIT_MOE=1`` and
  ``VLLM_PETIT_MOE_STRICT=1`` and our ``FusedMoEKernel`` hook installed, so the hook's real
  decision (vLLM config + EP group) substitutes ``PetitPrepareAndFinalize`` over the
  process' shared ``EpBuffer`` (``petit_via="hook"``); or ``petit_via="direct"``:
  ``hook.decide`` + ``hook.build_prepare_finalize`` and ``FusedMoEKernel(pf,
  TritonExperts)`` built by hand. Either way the experts are vLLM's ``TritonExperts``.

**A forward** (``MoELayer.forward``) is what ``MoERunner._forward_impl`` does around the
kernel: ``set_forward_context(None, vllm_config, num_tokens=T,
num_tokens_across_dp=<CPU int tensor>)`` (vLLM's ``DPMetadata``), inside it
``dp_metadata.sp_local_sizes(1)`` (the runner's ``_sequence_parallel_context``), then
``FusedMoEKernel.apply(x, w13, w2, topk_weights, topk_ids, SILU, E, expert_map, False)``.
The runner's final TP all-reduce is a no-op at TP=1 and is left out.

**CUDA graphs** (``capture``): inside vLLM's ``graph_capture(device)`` context (a side
stream, as ``GPUModelRunner.capture_model``), eager warm-up calls on the same shapes, then
``torch.cuda.graph(g, stream=...)`` around the forward(s). As under vLLM's graphs, all DP
ranks use the same (padded) token count.

The scratch workspace is reserved for the largest call when a layer is built and then
locked (vLLM locks it after warm-up too): a later growth would free memory that captured
graphs still point to, so it fails loudly instead.
"""
from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_petit_moe.testing.bench_env import VLLM_SAFE_ENV
from vllm_petit_moe.testing.rank_pool import (  # noqa: F401 (re-exported)
    RankPool, RankPoolError, free_port)

# Set in every rank process before torch/vLLM touch NCCL.
SAFE_ENV = VLLM_SAFE_ENV

PATHS = ("default", "petit")
# Optional third path: petit's prepare/finalize + PetitExperts (our grouped GEMMs, tile family
# from VLLM_PETIT_MOE_EXPERTS_TILES), built through the hook with VLLM_PETIT_MOE_EXPERTS=1.
PETIT_EXPERTS_PATH = "petit-experts"
# Optional path: the fused layer (EpBuffer.megamoe) for steps of up to FUSED_MAX_TOKENS tokens
# per rank, vLLM's Triton experts behind petit's dispatch/combine above, built through the hook
# with VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS.
PETIT_FUSED_PATH = "petit-fused"
FUSED_MAX_TOKENS = 64
OPTIONAL_PATHS = (PETIT_EXPERTS_PATH, PETIT_FUSED_PATH)


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: hidden size H, moe_intermediate I, E experts, top-k K."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int

    def flops_per_pair(self) -> int:
        """gate/up GEMM (2*H*2I) + down GEMM (2*I*H) per token-expert pair."""
        return 2 * 3 * self.hidden * self.intermediate


PRESETS = {
    "deepseek-v3": MoEShape(hidden=7168, intermediate=2048, num_experts=256, top_k=8),
    "qwen3-30b-a3b": MoEShape(hidden=2048, intermediate=768, num_experts=128, top_k=8),
    "deepseek-v2-lite": MoEShape(hidden=2048, intermediate=1408, num_experts=64, top_k=6),
    "qwen3-235b-a22b": MoEShape(hidden=4096, intermediate=1536, num_experts=128, top_k=8),
}


def apply_safe_env() -> None:
    """SAFE_ENV, and none of the plugin's variables (``envs.ENV_VARS``): they are toggled per
    kernel build here, and a value inherited from the caller would change what "default"
    means (``VLLM_PETIT_MOE_EXPERTS=1`` would also swap in PetitExperts, and build_layer
    expects vLLM's TritonExperts on both paths)."""
    from vllm_petit_moe.vllm_glue import envs

    os.environ.update(SAFE_ENV)
    for name in envs.ENV_VARS:
        os.environ.pop(name, None)


@contextlib.contextmanager
def env_override(**overrides: str | None):
    """Set (str) or unset (None) environment variables for the duration of the block."""
    saved = {k: os.environ.get(k) for k in overrides}
    try:
        for k, v in overrides.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------------------
# vLLM distributed setup (one process per rank)
# --------------------------------------------------------------------------------------------


@dataclass
class RankState:
    """Per-process state of a rank: vLLM's config and a cache for the caller's objects."""

    rank: int
    world_size: int
    device: torch.device
    vllm_config: Any
    cache: dict = field(default_factory=dict)

    def barrier(self) -> None:
        """CPU (gloo) barrier over vLLM's world group."""
        from vllm.distributed.parallel_state import get_world_group

        get_world_group().barrier()

    def all_gather_object(self, obj: Any) -> list:
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_world_group

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=get_world_group().cpu_group)
        return out


def make_vllm_config(rank: int, world_size: int, port: int, device: str = "auto"):
    """The ``VllmConfig`` of DP rank ``rank`` of ``world_size`` with EP (no model config).

    device: vLLM's ``DeviceConfig.device`` ("auto": the current platform, as vLLM does).

    ``_data_parallel_master_port_list=[port]``: ``ParallelConfig.__post_init__`` otherwise
    draws random free ports in each process (the engine normally ships one config to all
    ranks); with one agreed port every rank meets at ``tcp://127.0.0.1:port``.
    """
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    parallel_config = ParallelConfig(
        data_parallel_size=world_size,
        data_parallel_rank=rank,
        data_parallel_master_ip="127.0.0.1",
        _data_parallel_master_port_list=[port],
        enable_expert_parallel=True,
        is_moe_model=True,
        all2all_backend="allgather_reducescatter",
    )
    vllm_config = VllmConfig(parallel_config=parallel_config,
                             device_config=DeviceConfig(device=device))
    vllm_config.compilation_config.fast_moe_cold_start = False  # as vLLM's own MoE tests
    return vllm_config


def init_vllm_dp_ep(rank: int, world_size: int, port: int) -> RankState:
    """vLLM's distributed init for DP rank ``rank`` of ``world_size`` with EP; see the module
    docstring. Leaves the config current (``set_current_vllm_config``) for the process."""
    apply_safe_env()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_dp_group,
        get_ep_group,
        get_tensor_model_parallel_world_size,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.v1.worker.workspace import init_workspace_manager

    vllm_config = make_vllm_config(rank, world_size, port)
    config_ctx = set_current_vllm_config(vllm_config)
    config_ctx.__enter__()  # current for the rest of the process (kernels read it)
    # world_size/rank are the TP x PP ones inside this DP rank; vLLM adds the DP offset.
    init_distributed_environment(
        world_size=vllm_config.parallel_config.world_size,
        rank=0,
        distributed_init_method="env://",  # replaced by vLLM with tcp://<dp master>:<port>
        local_rank=rank,
        backend="nccl",
    )
    initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    init_workspace_manager(device)

    dp, ep = get_dp_group(), get_ep_group()
    if not (dp.world_size == ep.world_size == world_size and dp.rank_in_group == rank
            and ep.rank_in_group == rank and get_tensor_model_parallel_world_size() == 1):
        raise RuntimeError(
            f"unexpected vLLM groups on rank {rank}: DP {dp.rank_in_group}/{dp.world_size}, "
            f"EP {ep.rank_in_group}/{ep.world_size}, TP {get_tensor_model_parallel_world_size()}"
        )
    manager = getattr(ep.device_communicator, "all2all_manager", None)
    if type(manager).__name__ != "AgRsAll2AllManager":
        raise RuntimeError(f"EP group all2all manager is {type(manager).__name__}, expected "
                           "vLLM's AgRsAll2AllManager (allgather_reducescatter)")
    state = RankState(rank, world_size, device, vllm_config)
    state.cache["_config_ctx"] = config_ctx
    return state


def shutdown_vllm(state: RankState | None) -> None:
    """Close the EpBuffers (collective in spirit: all ranks) and vLLM's process groups."""
    torch.cuda.synchronize()
    try:
        from vllm_petit_moe.vllm_glue import buffer_cache

        buffer_cache.close_all_buffers()
    finally:
        from vllm.distributed.parallel_state import (
            destroy_distributed_environment,
            destroy_model_parallel,
        )

        destroy_model_parallel()
        destroy_distributed_environment()


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------


def make_moe_config(state: RankState, shape: MoEShape, max_num_tokens: int):
    """``FusedMoEConfig`` as ``FusedMoE`` builds it (``fused_moe/layer.py``), bf16, SiLU.

    max_num_tokens: vLLM's ``max_num_batched_tokens`` (tokens per DP rank and step); also
        what ``hook.build_prepare_finalize`` sizes the EpBuffer from.
    """
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, RoutingMethodType
    from vllm.model_executor.layers.fused_moe.layer import make_parallel_config

    vllm_config = state.vllm_config
    moe_parallel_config = make_parallel_config(
        tp_size=None, dp_size=None, pcp_size=None, is_sequence_parallel=False,
        parallel_config=vllm_config.parallel_config)
    if shape.num_experts % moe_parallel_config.ep_size:
        raise ValueError(f"{shape.num_experts} experts do not split over "
                         f"{moe_parallel_config.ep_size} EP ranks")
    return FusedMoEConfig(
        num_experts=shape.num_experts,
        experts_per_token=shape.top_k,
        hidden_dim=shape.hidden,
        intermediate_size=shape.intermediate,
        num_local_experts=shape.num_experts // moe_parallel_config.ep_size,
        num_logical_experts=shape.num_experts,
        activation=MoEActivation.SILU,
        device=state.device,
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=moe_parallel_config,
        in_dtype=torch.bfloat16,
        moe_backend=vllm_config.kernel_config.moe_backend,
        max_num_tokens=max_num_tokens,
        max_capture_size=0,
    )


@dataclass
class MoELayer:
    """One MoE layer of this rank: local weights, vLLM's expert map and the kernels."""

    state: RankState
    shape: MoEShape
    moe_config: Any
    w13: torch.Tensor  # [L, 2I, H] bf16, local experts (gate rows [0, I), up rows [I, 2I))
    w2: torch.Tensor  # [L, H, I] bf16
    expert_map: torch.Tensor  # [E] int32 on the device: global -> local id or -1
    kernels: dict  # path -> FusedMoEKernel
    vllm_backend: str  # what vLLM's select_unquantized_moe_backend picks here
    max_num_tokens: int
    # path -> (w13, w2) for paths whose experts take other weights (fp8 paths, add_fp8_paths)
    weights: dict = field(default_factory=dict)

    def forward(self, path: str, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, num_tokens_across_dp: Sequence[int]) -> torch.Tensor:
        """This rank's MoE output ``[T, H] bf16`` through kernel ``path``.

        x ``[T, H] bf16``, topk_ids ``[T, K] int32`` global ids, topk_weights ``[T, K] f32``;
        num_tokens_across_dp: every DP rank's T for this step (equal on all ranks, and all
        equal under CUDA graphs). Collective: every rank calls it with the same ``path``.
        """
        from vllm.forward_context import get_forward_context, set_forward_context
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        counts = [int(c) for c in num_tokens_across_dp]
        if len(counts) != self.state.world_size or counts[self.state.rank] != x.shape[0]:
            raise ValueError(f"num_tokens_across_dp {counts} does not match rank "
                             f"{self.state.rank}'s {x.shape[0]} tokens")
        if max(counts) > self.max_num_tokens:
            raise ValueError(f"{max(counts)} tokens per rank exceed the layer's "
                             f"max_num_tokens {self.max_num_tokens}")
        kernel = self.kernels[path]
        with set_forward_context(
            None,
            self.state.vllm_config,
            num_tokens=x.shape[0],
            num_tokens_across_dp=torch.tensor(counts, dtype=torch.int32, device="cpu"),
        ):
            dp_metadata = get_forward_context().dp_metadata
            with dp_metadata.sp_local_sizes(1):  # MoERunner._sequence_parallel_context
                w13, w2 = self.weights.get(path, (self.w13, self.w2))
                return kernel.apply(
                    x, w13, w2, topk_weights, topk_ids,
                    activation=MoEActivation.SILU,
                    global_num_experts=self.shape.num_experts,
                    expert_map=self.expert_map,
                    apply_router_weight_on_input=False,
                )


def reserve_workspace(layer: MoELayer, path: str | None = None) -> int:
    """Grow vLLM's MoE workspace to what the largest call of ``layer`` needs, then lock it.

    Mirrors ``FusedMoEKernelModularImpl._allocate_buffers`` for ``M = W * max_num_tokens``
    rows (petit's ``W*R``; the default path's ``sum(T_s)`` is never larger) with the experts
    of ``path`` (default: the first kernel's). Returns bytes.
    """
    from math import prod

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.v1.worker.workspace import current_workspace_manager

    experts = layer.kernels[path or next(iter(layer.kernels))].fused_experts
    num_rows = layer.state.world_size * layer.max_num_tokens
    n, k = layer.w13.shape[1], layer.shape.hidden
    ws13, ws2, out = experts.workspace_shapes(
        num_rows, n, k, layer.shape.top_k, layer.shape.num_experts, layer.w13.shape[0], None,
        MoEActivation.SILU)
    dtype = experts.workspace_dtype(torch.bfloat16)
    manager = current_workspace_manager()
    manager.unlock()
    views = manager.get_simultaneous(((max(prod(ws13), prod(out)),), dtype), (ws2, dtype))
    manager.lock()
    return sum(v.numel() * v.element_size() for v in views)


def _petit_kernel_via_hook(moe_config, quant_config, petit_experts: bool = False,
                           megamoe_max_tokens: int | None = None):
    """The oracle's kernel with the plugin flag on: our hook substitutes the prepare/finalize
    (and, with ``petit_experts`` or ``megamoe_max_tokens``, the experts by ``PetitEpExperts``).

    Strict mode: a fallback to vLLM's path would raise instead of silently measuring vLLM.
    """
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        make_unquantized_moe_kernel,
    )

    from vllm_petit_moe.vllm_glue import hook

    hook.install()  # wraps FusedMoEKernel.__init__ (idempotent; inert while the flag is off)
    with env_override(VLLM_USE_PETIT_MOE="1", VLLM_PETIT_MOE_STRICT="1",
                      VLLM_PETIT_MOE_EXPERTS="1" if petit_experts else None,
                      VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS=None if megamoe_max_tokens is None
                      else str(megamoe_max_tokens)):
        return make_unquantized_moe_kernel(quant_config, moe_config,
                                           UnquantizedMoeBackend.TRITON, TritonExperts)


def _petit_kernel_direct(moe_config, quant_config, parallel_config):
    """``hook.decide`` + ``hook.build_prepare_finalize`` by hand, ``FusedMoEKernel`` direct."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.prepare_finalize import (
        make_moe_prepare_and_finalize_naive_dp_ep,
    )

    from vllm_petit_moe.vllm_glue import hook

    experts = TritonExperts(moe_config, quant_config)
    runtime = hook.probe_runtime()
    vllm_pf = make_moe_prepare_and_finalize_naive_dp_ep(
        use_monolithic=False, is_sequence_parallel=False, num_dispatchers=runtime.ep_world_size)
    decision = hook.decide(vllm_pf, experts, parallel_config, lambda: runtime)
    if not decision.substitute:
        raise RuntimeError(f"hook.decide keeps vLLM's path here: {decision.reason}")
    with env_override(VLLM_USE_PETIT_MOE=None):  # the hook, if installed, must not act again
        return mk.FusedMoEKernel(hook.build_prepare_finalize(experts, runtime), experts)


def build_layer(state: RankState, shape: MoEShape, w13_local: torch.Tensor,
                w2_local: torch.Tensor, *, max_num_tokens: int,
                paths: Sequence[str] = PATHS, petit_via: str = "hook",
                fused_max_tokens: int = FUSED_MAX_TOKENS) -> MoELayer:
    """Build this rank's layer on the given local weights (collective: all ranks, same order).

    w13_local ``[L, 2I, H]``, w2_local ``[L, H, I]`` (bf16, this rank's experts
    ``[rank*L, (rank+1)*L)``). ``paths``: subset of ``PATHS + OPTIONAL_PATHS``;
    ``fused_max_tokens``: the fused path's bound (capped at what the kernel takes,
    ``MEGAMOE_MAX_ENTRIES / (W K)``).
    """
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        make_unquantized_moe_kernel,
        select_unquantized_moe_backend,
    )
    from vllm.model_executor.layers.fused_moe.prepare_finalize import (
        MoEPrepareAndFinalizeNaiveDPEPModular,
    )

    from vllm_petit_moe.limits import MEGAMOE_MAX_ENTRIES
    from vllm_petit_moe.vllm_glue.experts import PetitEpExperts
    from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize

    moe_config = make_moe_config(state, shape, max_num_tokens)
    num_local = moe_config.num_local_experts
    want13 = (num_local, 2 * shape.intermediate, shape.hidden)
    want2 = (num_local, shape.hidden, shape.intermediate)
    if tuple(w13_local.shape) != want13 or tuple(w2_local.shape) != want2:
        raise ValueError(f"local weights must be w13 {want13}, w2 {want2}; got "
                         f"{tuple(w13_local.shape)}, {tuple(w2_local.shape)}")
    mpc = moe_config.moe_parallel_config
    _, expert_map, _ = determine_expert_map(mpc.ep_size, mpc.ep_rank, shape.num_experts,
                                            "linear")
    try:
        vllm_backend = select_unquantized_moe_backend(moe_config)[0].value
    except Exception as e:  # recorded, not fatal: the comparison is against Triton anyway
        vllm_backend = f"selection failed: {type(e).__name__}: {e}"

    quant = FUSED_MOE_UNQUANTIZED_CONFIG
    kernels = {}
    for path in paths:
        expected_experts = TritonExperts
        if path == PETIT_EXPERTS_PATH:
            kernel = _petit_kernel_via_hook(moe_config, quant, petit_experts=True)
            expected, expected_experts = PetitPrepareAndFinalize, PetitEpExperts
        elif path == PETIT_FUSED_PATH:
            kernel = _petit_kernel_via_hook(moe_config, quant,
                                            megamoe_max_tokens=fused_max_tokens)
            expected, expected_experts = PetitPrepareAndFinalize, PetitEpExperts
            want = min(fused_max_tokens,
                       MEGAMOE_MAX_ENTRIES // (state.world_size * shape.top_k))
            if kernel.prepare_finalize.megamoe_max_stride != want:
                raise RuntimeError(f"{path}: fused layer up to "
                                   f"{kernel.prepare_finalize.megamoe_max_stride} tokens/rank, "
                                   f"expected {want}")
        elif path == "default":
            with env_override(VLLM_USE_PETIT_MOE=None):
                kernel = make_unquantized_moe_kernel(quant, moe_config,
                                                     UnquantizedMoeBackend.TRITON, TritonExperts)
            expected = MoEPrepareAndFinalizeNaiveDPEPModular
        elif path == "petit":
            if petit_via == "hook":
                kernel = _petit_kernel_via_hook(moe_config, quant)
            elif petit_via == "direct":
                kernel = _petit_kernel_direct(moe_config, quant,
                                              state.vllm_config.parallel_config)
            else:
                raise ValueError(f"petit_via must be 'hook' or 'direct', got {petit_via!r}")
            expected = PetitPrepareAndFinalize
        else:
            raise ValueError(f"unknown path {path!r}; expected one of "
                             f"{PATHS + OPTIONAL_PATHS}")
        if not isinstance(kernel, mk.FusedMoEKernel) or \
                type(kernel.prepare_finalize) is not expected or \
                not isinstance(kernel.fused_experts, expected_experts):
            raise RuntimeError(f"{path}: built {type(kernel.prepare_finalize).__name__} + "
                               f"{type(kernel.fused_experts).__name__}, expected "
                               f"{expected.__name__} + {expected_experts.__name__}")
        kernels[path] = kernel

    layer = MoELayer(state, shape, moe_config, w13_local.contiguous(), w2_local.contiguous(),
                     expert_map.to(state.device), kernels, vllm_backend, max_num_tokens)
    for path in kernels:  # the largest workspace any path's experts need
        reserve_workspace(layer, path)
    return layer


FP8_MODES = ("fp8_block128", "fp8_per_token")


def quantize_weights_fp8(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights ``[L, N, K]`` bf16 -> (``float8_e4m3fn [L, N, K]``, float32 scales) as
    vLLM's fp8 checkpoints hold them: ``"fp8_block128"``: one scale per 128x128 block
    (``[L, N/128, K/128]``, N and K multiples of 128); ``"fp8_per_token"`` (per-token
    activations pair with per-output-channel weights): ``[L, N, 1]``."""
    num, n, k = w.shape
    wf = w.float()
    if mode == "fp8_block128":
        if n % 128 or k % 128:
            raise ValueError(f"128x128 weight blocks need N, K multiples of 128; got {n}, {k}")
        blocks = wf.view(num, n // 128, 128, k // 128, 128)
        scales = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
        q = (blocks / scales[:, :, None, :, None]).clamp(-448.0, 448.0)
        return q.view(num, n, k).to(torch.float8_e4m3fn), scales
    if mode == "fp8_per_token":
        scales = wf.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 448.0
        return (wf / scales).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scales
    raise ValueError(f"mode must be one of {FP8_MODES}, got {mode!r}")


def dequantize_weights_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_weights_fp8` (float32)."""
    num, n, k = q.shape
    if scales.shape[-1] == 1:
        return q.float() * scales
    sn, sk = n // scales.shape[1], k // scales.shape[2]
    return (q.float().view(num, scales.shape[1], sn, scales.shape[2], sk)
            * scales[:, :, None, :, None]).view(num, n, k)


def add_fp8_paths(layer: MoELayer, mode: str) -> tuple[str, str]:
    """Add ``"default-<mode>"`` and ``"petit-<mode>"`` to ``layer``: vLLM's Triton fp8 w8a8
    experts on fp8 copies of the layer's weights (:func:`quantize_weights_fp8`), with dynamic
    activation quantization in 1x128 blocks or per token; the default path quantizes with vLLM
    before its all-gather, petit inside our dispatch. Collective. Returns the two path names."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        make_unquantized_moe_kernel,
    )

    from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize

    w13q, w13s = quantize_weights_fp8(layer.w13, mode)
    w2q, w2s = quantize_weights_fp8(layer.w2, mode)
    if mode == "fp8_block128":
        quant = FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128],
                                         w1_scale=w13s, w2_scale=w2s)
    else:
        quant = FusedMoEQuantConfig.make(torch.float8_e4m3fn, per_act_token_quant=True,
                                         per_out_ch_quant=True, w1_scale=w13s, w2_scale=w2s)
    default, petit = f"default-{mode}", f"petit-{mode}"
    with env_override(VLLM_USE_PETIT_MOE=None):
        layer.kernels[default] = make_unquantized_moe_kernel(
            quant, layer.moe_config, UnquantizedMoeBackend.TRITON, TritonExperts)
    layer.kernels[petit] = _petit_kernel_via_hook(layer.moe_config, quant)
    if type(layer.kernels[petit].prepare_finalize) is not PetitPrepareAndFinalize:
        raise RuntimeError(f"{petit}: the hook did not substitute PetitPrepareAndFinalize")
    for path in (default, petit):
        layer.weights[path] = (w13q, w2q)
        reserve_workspace(layer, path)
    return default, petit


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def random_weights(shape: MoEShape, num_experts: int, *, seed: int, device: torch.device,
                   scale: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [n, 2I, H]``, ``w2 [n, H, I]`` bf16 ~ N(0, scale^2) for ``n = num_experts``.

    scale 0.02 keeps the activations O(1) at these sizes (gate/up ~ sqrt(H)*0.02), so
    outputs are neither saturated nor degenerate.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(num_experts, 2 * shape.intermediate, shape.hidden, device=device,
                      dtype=torch.bfloat16)
    w2 = torch.empty(num_experts, shape.hidden, shape.intermediate, device=device,
                     dtype=torch.bfloat16)
    for w in (w13, w2):
        for e in range(num_experts):  # per expert: no fp32 copy of a whole 7 GB tensor
            w[e].copy_(torch.randn(w.shape[1:], generator=gen, device=device) * scale)
    return w13, w2


def make_inputs(shape: MoEShape, tokens_per_rank: Sequence[int], *, seed: int,
                device: torch.device, skew: str | None = None, hot_fraction: float = 0.5,
                world_size: int | None = None):
    """Every rank's ``(x [T_s, H] bf16, topk_ids [T_s, K] int32, topk_weights [T_s, K] f32)``,
    identical on every rank that calls it with the same arguments (pplx-style testing: each
    rank knows all inputs, so references need no collectives)."""
    from vllm_petit_moe.testing import reference as ref

    world_size = world_size or len(tokens_per_rank)
    gen = torch.Generator(device=device).manual_seed(seed)
    xs, ids, ws = [], [], []
    for num_tokens in tokens_per_rank:
        xs.append(torch.randn(num_tokens, shape.hidden, generator=gen, device=device)
                  .to(torch.bfloat16))
        topk_ids, topk_weights = ref.random_topk(
            num_tokens, shape.num_experts, shape.top_k, generator=gen, skew=skew,
            world_size=world_size, hot_fraction=hot_fraction, device=device)
        ids.append(topk_ids.to(torch.int32))
        ws.append(topk_weights)
    return xs, ids, ws


# --------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------


def capture(device: torch.device, fn: Callable[[], Any], warmup: int = 2):
    """Capture ``fn()`` (collective forwards on static tensors) in a CUDA graph, as vLLM does.

    Inside vLLM's ``graph_capture(device)`` (a side stream): ``warmup`` eager calls first
    (Triton JIT, the expert-map check, buffer growth), then the capture. Returns
    ``(graph, outputs of the captured call)``; replay with ``graph.replay()``. The graph reads
    and writes the addresses ``fn`` used: the caller keeps every input tensor of ``fn`` alive
    as long as it replays the graph (a freed input's memory is handed to the next allocation).
    """
    from vllm.distributed.parallel_state import graph_capture

    with graph_capture(device=device) as ctx:
        for _ in range(warmup):
            fn()
        ctx.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=ctx.stream):
            outputs = fn()
    torch.cuda.synchronize(device)
    return graph, outputs


def time_replays_us(graph, iters: int, warmup: int = 3) -> float:
    """Median over ``iters`` replays of one ``graph.replay()``, on device events (us)."""
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


# --------------------------------------------------------------------------------------------
# A pool of rank processes with vLLM's distributed state (kept for a whole test session)
# --------------------------------------------------------------------------------------------


def _vllm_setup(rank, world_size, port):
    apply_safe_env()
    return init_vllm_dp_ep(rank, world_size, port)


class VllmRankPool(RankPool):
    """W spawned processes, rank r on GPU r, each with vLLM's DP=W + EP setup
    (``init_vllm_dp_ep``; ``shutdown_vllm`` when the pool closes).

    ``run(fn, *args)`` calls the module-level ``fn(state: RankState, *args)`` on every rank
    and returns the per-rank results; an error, a dead rank or a timeout on any rank raises
    ``RankPoolError`` (with every failing rank's traceback) and closes the pool
    (``vllm_petit_moe.testing.rank_pool``).
    """

    def __init__(self, world_size: int, init_timeout_s: float = 600.0):
        if torch.cuda.device_count() < world_size:
            raise RankPoolError(f"{world_size} ranks need {world_size} GPUs, have "
                                f"{torch.cuda.device_count()}")
        super().__init__(world_size, _vllm_setup, (free_port(),), shutdown_vllm,
                         init_timeout_s=init_timeout_s, what="vLLM distributed init")

    def run(self, fn: Callable, *args, timeout_s: float = 600.0) -> list:
        return super().run(fn, *args, timeout_s=timeout_s)
