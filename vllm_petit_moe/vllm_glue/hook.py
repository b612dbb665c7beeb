"""The hook: substitute ``PetitPrepareAndFinalize`` where vLLM builds its modular MoE kernel.

vLLM 0.24 builds every modular MoE kernel as ``FusedMoEKernel(prepare_finalize, experts)``
(``vllm/model_executor/layers/fused_moe/modular_kernel.py``); with ``--data-parallel-size N
--enable-expert-parallel`` and the default ``--all2all-backend allgather_reducescatter`` the
prepare/finalize is ``MoEPrepareAndFinalizeNaiveDPEPModular``. ``install()`` patches that
constructor (``compat.install_kernel_hook``); for each kernel, ``decide()`` looks at vLLM's
config objects and a few runtime facts and either substitutes ours or keeps vLLM's with a
logged reason. Decisions depend only on values that are equal on all EP ranks, so all ranks
substitute together (the buffer creation behind a substitution is a collective).

Outcomes, each logged once per process and reason:

- **substitute** (INFO): the layer's dispatch/combine run through our ``EpBuffer``.
- **not applicable** (INFO): nothing of ours to replace (no DP>1 with EP, or another
  ``--all2all-backend`` chosen explicitly).
- **unsupported** (WARNING): a DP+EP layer we cannot serve yet; vLLM's allgather/reduce-
  scatter stays. With ``VLLM_PETIT_MOE_STRICT=1`` both non-substitute outcomes raise instead.

The experts vLLM chose stay behind our prepare/finalize when their input contract is known
(``prepare_finalize.experts_dispatch_mode``: vLLM's Triton, DeepGEMM and FlashInfer-CUTLASS
experts, each handed the rows it expects). Where our prepare/finalize was substituted,
``maybe_substitute_experts`` puts ``PetitEpExperts`` in place of vLLM's Triton experts, on
the same weights, when our grouped GEMMs are asked for (``VLLM_PETIT_MOE_EXPERTS=1``, bf16) or
the fused layer is (``VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS`` > 0, ``config.EpLayerConfig``; bf16
or block-fp8 weights): steps up to that many tokens per rank then run as one fused launch per
rank, the others composed, with our GEMMs or vLLM's Triton experts. Both are off by default
until validated on two GPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_petit_moe.limits import MAX_TOP_K, SIZE_MULTIPLE
from vllm_petit_moe.vllm_glue import buffer_cache, compat, envs

logger = logging.getLogger("vllm.petit_moe.hook")

SUPPORTED_PLATFORMS = ("cuda",)


@dataclass(frozen=True)
class EpRuntime:
    """Facts about this process that vLLM's config objects do not hold.

    platform: ``compat.platform_name()`` (``"cuda"``, ``"rocm"``, ...).
    ep_world_size / ep_rank: vLLM's EP group.
    internode: whether the EP group spans more than one node.
    cpu_group: the EP group's CPU (gloo) process group, handed to ``EpBuffer``.
    peer_access: whether every pair of the group's GPUs has an NVLink peer-to-peer path
        (the symmetric heap maps the peers' memory); None where it could not be determined
        (then the heap mapping itself checks it, and a failure there falls back too).
    """

    platform: str
    ep_world_size: int
    ep_rank: int
    internode: bool
    cpu_group: Any = None
    peer_access: bool | None = None


def probe_runtime() -> EpRuntime:
    """Read ``EpRuntime`` from vLLM's platform and parallel state; the peer-access check is a
    bounded exchange of the GPUs' physical ids over the EP group's CPU group, made once per
    group (every rank probes at the same layer: decisions depend on equal facts only)."""
    world_size, rank, internode, cpu_group = compat.ep_group_facts()
    peer_access = None if internode else compat.ep_peer_access(cpu_group)
    return EpRuntime(compat.platform_name(), world_size, rank, internode, cpu_group,
                     peer_access)


@dataclass(frozen=True)
class Decision:
    """Outcome of ``decide``: ``substitute`` or not, and why (one short sentence)."""

    substitute: bool
    reason: str
    applicable: bool = True  # False: no DP+EP allgather/reduce-scatter layer to replace


def _unsupported(reason: str) -> Decision:
    return Decision(False, reason, applicable=True)


def _not_applicable(reason: str) -> Decision:
    return Decision(False, reason, applicable=False)


def decide(
    prepare_finalize: Any,
    fused_experts: Any,
    parallel_config: Any,
    runtime_provider: Callable[[], EpRuntime],
) -> Decision:
    """Whether to replace ``prepare_finalize`` by ours for this ``FusedMoEKernel``.

    prepare_finalize / fused_experts: the objects vLLM passes to ``FusedMoEKernel``.
    parallel_config: vLLM's ``ParallelConfig`` of the current vLLM config, or None if no vLLM
        config is current (then DBO cannot be ruled out: unsupported).
    runtime_provider: returns the ``EpRuntime``; called only once the config checks passed.
    Pure apart from ``runtime_provider``: no logging, no allocation.
    """
    import torch

    from vllm_petit_moe.vllm_glue.prepare_finalize import (
        PetitPrepareAndFinalize,
        experts_dispatch_mode,
    )

    if isinstance(prepare_finalize, PetitPrepareAndFinalize):
        return Decision(True, "already a PetitPrepareAndFinalize")

    moe = getattr(fused_experts, "moe_config", None)
    mpc = getattr(moe, "moe_parallel_config", None)
    if moe is None or mpc is None:
        return _not_applicable("experts carry no FusedMoEConfig")

    # 1. Is this vLLM's DP+EP allgather/reduce-scatter layer at all?
    if not (mpc.dp_size > 1 and mpc.use_ep):
        return _not_applicable(
            f"no data+expert parallelism (dp_size={mpc.dp_size}, use_ep={mpc.use_ep})"
        )
    if mpc.all2all_backend != "allgather_reducescatter":
        return _not_applicable(
            f"--all2all-backend={mpc.all2all_backend} chosen explicitly; petit replaces only "
            "the default allgather_reducescatter"
        )
    if isinstance(prepare_finalize, compat.fused_moe_symbol("NaiveDPEPMonolithic")):
        return _unsupported(
            f"monolithic experts ({type(fused_experts).__name__}: router fused into the "
            "kernel) take router logits, not top-k ids"
        )
    if not isinstance(prepare_finalize, compat.fused_moe_symbol("NaiveDPEPModular")):
        return _not_applicable(
            f"prepare/finalize is {type(prepare_finalize).__name__}, not vLLM's "
            "allgather/reduce-scatter one"
        )

    # 2. Parallel layout: one EP rank per DP rank, no TP/PCP/SP inside, static placement.
    if mpc.ep_size != mpc.dp_size or mpc.pcp_size != 1:
        return _unsupported(
            f"EP group is not the DP group (ep_size={mpc.ep_size}, dp_size={mpc.dp_size}, "
            f"pcp_size={mpc.pcp_size}): tensor/context parallelism inside a DP rank"
        )
    if mpc.sp_size > 1:
        return _unsupported(f"sequence-parallel MoE (sp_size={mpc.sp_size})")
    if mpc.enable_eplb:
        return _unsupported("EPLB (expert load balancing, redundant experts)")
    if parallel_config is None:
        return _unsupported("no current vLLM config (cannot rule out dual-batch overlap)")
    if getattr(parallel_config, "enable_dbo", False) or getattr(
        parallel_config, "use_ubatching", False
    ):
        return _unsupported("dual-batch overlap / micro-batching (--enable-dbo)")
    if getattr(parallel_config, "enable_elastic_ep", False):
        return _unsupported("elastic EP")

    # 3. The layer: bf16 activations, sizes within our kernels' limits, no LoRA.
    if getattr(moe, "is_lora_enabled", False):
        return _unsupported("LoRA on MoE layers")
    if moe.in_dtype is not torch.bfloat16:
        return _unsupported(f"activation dtype {moe.in_dtype} (only bfloat16 so far)")
    if moe.hidden_dim % SIZE_MULTIPLE != 0:
        return _unsupported(f"hidden size {moe.hidden_dim} is not a multiple of {SIZE_MULTIPLE}")
    if moe.experts_per_token > MAX_TOP_K:
        return _unsupported(f"top-k {moe.experts_per_token} > {MAX_TOP_K}")
    even_split = moe.num_experts % mpc.ep_size == 0
    if not even_split or moe.num_local_experts != moe.num_experts // mpc.ep_size:
        return _unsupported(
            f"{moe.num_experts} experts do not split evenly over {mpc.ep_size} EP ranks "
            f"(this rank has {moe.num_local_experts})"
        )

    # 4. The experts and the input they expect: bf16 rows, or the activations quantized as
    # vLLM's prepare would (fp8 inside dispatch), for experts whose contract is known.
    quant_mode, quant_unsupported = experts_dispatch_mode(fused_experts, moe.hidden_dim)
    if quant_unsupported is not None:
        return _unsupported(quant_unsupported)

    # 5. This process: a supported GPU, the EP group on one node and matching the config.
    runtime = runtime_provider()
    if runtime.platform not in SUPPORTED_PLATFORMS:
        return _unsupported(f"platform {runtime.platform} (supported: {SUPPORTED_PLATFORMS})")
    if runtime.internode:
        return _unsupported("EP group spans several nodes (intranode NVLink only)")
    if runtime.peer_access is False:
        return _unsupported("the EP group's GPUs are not all connected peer to peer (NVLink): "
                            "the symmetric heap cannot map the peers' memory")
    if runtime.ep_world_size != mpc.ep_size or runtime.ep_rank != mpc.ep_rank:
        return _unsupported(
            f"EP group (rank {runtime.ep_rank} of {runtime.ep_world_size}) does not match the "
            f"layer's parallel config (rank {mpc.ep_rank} of {mpc.ep_size})"
        )
    wire = quant_mode or ("bf16 (the experts quantize inside)"
                          if getattr(fused_experts, "quant_config", None) is not None
                          and fused_experts.quant_config.quant_dtype is not None else "bf16")
    return Decision(True, f"DP={mpc.dp_size} x EP={mpc.ep_size} on one node, {wire} dispatch "
                          f"to vLLM's {type(fused_experts).__name__}")


# --------------------------------------------------------------------------------------------
# Reporting (once per process and reason)
# --------------------------------------------------------------------------------------------

_reported: set[tuple[bool, str]] = set()


def _report(decision: Decision, kept_class: str,
            what: str = "PetitPrepareAndFinalize (petit dispatch/combine)") -> None:
    key = (decision.substitute, decision.reason)
    if decision.substitute:
        if key not in _reported:
            _reported.add(key)
            logger.info(
                "vllm-petit-moe: MoE layers use %s instead of %s: %s",
                what,
                kept_class,
                decision.reason,
            )
        return
    if envs.strict():
        raise RuntimeError(
            f"vllm-petit-moe: VLLM_USE_PETIT_MOE=1 and VLLM_PETIT_MOE_STRICT=1, but a MoE layer "
            f"cannot use petit: {decision.reason}"
        )
    if key in _reported:
        return
    _reported.add(key)
    if decision.applicable:
        logger.warning(
            "vllm-petit-moe: VLLM_USE_PETIT_MOE=1 but unsupported here: %s. These MoE layers "
            "keep vLLM's %s.",
            decision.reason,
            kept_class,
        )
    else:
        logger.info(
            "vllm-petit-moe: not used for these MoE layers (%s); they keep vLLM's %s.",
            decision.reason,
            kept_class,
        )


# --------------------------------------------------------------------------------------------
# The substitution and its installation
# --------------------------------------------------------------------------------------------

# Replaced in CPU tests (no GPU, no process group).
_runtime_provider: Callable[[], EpRuntime] = probe_runtime


def build_prepare_finalize(fused_experts: Any, runtime: EpRuntime) -> Any:
    """Our prepare/finalize for the layer of ``fused_experts`` (creates/reuses the buffer)."""
    from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize

    moe = fused_experts.moe_config
    # vLLM's max_num_batched_tokens bounds the tokens of one step on one DP rank, padding for
    # CUDA graphs and across DP included (capture sizes do not exceed it).
    max_tokens = max(int(moe.max_num_tokens), int(getattr(moe, "max_capture_size", 0) or 0))
    config = buffer_cache.BufferConfig(
        hidden_size=moe.hidden_dim,
        num_experts=moe.num_experts,
        max_tokens_per_rank=max_tokens,
        max_top_k=MAX_TOP_K,
        timeout_s=envs.timeout_s(),
        max_wait_s=envs.max_wait_s(),
    )
    buffer = buffer_cache.get_or_create_buffer(runtime.cpu_group, config)
    return PetitPrepareAndFinalize(
        buffer, num_experts=moe.num_experts, max_tokens_per_rank=max_tokens
    )


def maybe_substitute(prepare_finalize: Any, fused_experts: Any) -> Any:
    """``FusedMoEKernel.__init__`` hook: ours if ``decide`` says so, else ``prepare_finalize``."""
    if not envs.use_petit_moe():
        return prepare_finalize
    if _is_single_gpu_layer(prepare_finalize):
        return prepare_finalize  # W=1: vLLM's pass-through stays; the experts step decides
    parallel_config = getattr(compat.current_vllm_config_or_none(), "parallel_config", None)
    runtime: list[EpRuntime] = []

    def provide_runtime() -> EpRuntime:
        runtime.append(_runtime_provider())
        return runtime[0]

    decision = decide(prepare_finalize, fused_experts, parallel_config, provide_runtime)
    _report(decision, type(prepare_finalize).__name__)
    if not decision.substitute or not runtime:  # `not runtime`: it was already ours
        return prepare_finalize
    try:
        return build_prepare_finalize(fused_experts, runtime[0])
    except Exception as e:  # noqa: BLE001 - the buffer's setup: every rank fails together
        # EpBuffer's setup agrees on every step (rendezvous.Agreement), so a failure on one
        # rank raises on all of them and all fall back together; buffer_cache caches the
        # failure, so later layers fall back without a new collective.
        fallback = Decision(False, f"EP buffer setup failed: {e}")
        _report(fallback, type(prepare_finalize).__name__)  # raises in strict mode
        return prepare_finalize


def _is_single_gpu_layer(prepare_finalize: Any) -> bool:
    """Whether vLLM built this layer with its no-DP/no-EP pass-through prepare/finalize (one
    GPU, or TP without EP); not vLLM 0.33's pass-through of EP backends that subclasses it."""
    return compat.is_no_dp_ep_prepare_finalize(prepare_finalize)


def decide_single_gpu(fused_experts: Any) -> Decision:
    """Whether ``PetitSingleGpuExperts`` replaces vLLM's experts of a layer built with the
    no-DP/no-EP prepare/finalize. Pure: no logging, no allocation."""
    from vllm_petit_moe.vllm_glue.experts import unsupported_reason

    if not isinstance(fused_experts, compat.fused_moe_symbol("TritonExperts")):
        return _unsupported(
            f"experts {type(fused_experts).__name__} (only vLLM's Triton experts are replaced)")
    moe = getattr(fused_experts, "moe_config", None)
    if moe is None:
        return _not_applicable("experts carry no FusedMoEConfig")
    if getattr(moe, "is_lora_enabled", False):
        return _unsupported("LoRA on MoE layers")
    mpc = getattr(moe, "moe_parallel_config", None)
    if mpc is not None and (getattr(mpc, "tp_size", 1) > 1 or getattr(mpc, "use_ep", False)):
        return _unsupported(
            f"tensor-parallel experts (tp_size={getattr(mpc, 'tp_size', 1)}): the fused layer "
            "serves one GPU holding whole experts")
    quant_config = fused_experts.quant_config
    reason = unsupported_reason(moe, quant_config, allow_block_fp8=True)
    if reason is not None:
        return _unsupported(reason)
    if compat.platform_name() not in SUPPORTED_PLATFORMS:
        return _unsupported(f"platform {compat.platform_name()} (supported: "
                            f"{SUPPORTED_PLATFORMS})")
    cfg = envs.single_gpu_layer_config()
    if quant_config is not None and quant_config.weight_quant_dtype is not None:
        return Decision(True, f"one GPU, block fp8: MegaMoE up to {cfg.megamoe_max_tokens} "
                              f"tokens per call on the e4m3 weights, vLLM's fp8 Triton experts "
                              f"above (SingleGpuLayerConfig)")
    return Decision(True, f"one GPU: petit's composed experts from {cfg.composed_min_tokens} "
                          f"tokens per call, vLLM's Triton experts below, MegaMoE up to "
                          f"{cfg.megamoe_max_tokens} tokens (SingleGpuLayerConfig)")


def _refuse_or_warn(message: str) -> None:
    """RuntimeError in strict mode, else one WARNING per message."""
    if envs.strict():
        raise RuntimeError(f"vllm-petit-moe: {message} ({envs.VLLM_PETIT_MOE_STRICT}=1)")
    key = (False, message)
    if key not in _reported:
        _reported.add(key)
        logger.warning("vllm-petit-moe: %s.", message)


def maybe_substitute_experts(prepare_finalize: Any, fused_experts: Any) -> Any:
    """``FusedMoEKernel.__init__`` hook, second step. On one GPU: ``PetitSingleGpuExperts``
    (``decide_single_gpu``). With DP + EP, where our prepare/finalize was just substituted and
    ``VLLM_PETIT_MOE_EXPERTS=1`` or ``VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS`` > 0:
    ``PetitEpExperts`` in place of vLLM's Triton experts (the fused layer enabled on the
    prepare/finalize for the steps it covers). Otherwise ``fused_experts`` unchanged.

    Only layers that already passed ``decide`` get here; ``experts.unsupported_reason`` adds
    what the kernels need on top (SiLU gating, bf16 or block-fp8 weights, no biases, sizes).
    Block-fp8 layers (``experts.block_fp8_unsupported_reason``) run fused on their e4m3
    weights and keep vLLM's fp8 Triton experts for the composed steps (petit's grouped GEMMs
    take bf16 weights). The weights are taken as vLLM loaded them for its Triton experts, so
    other experts (FlashInfer's, DeepGEMM's: weights converted to their own layouts) keep
    theirs. A layer that cannot be served keeps vLLM's experts with a logged reason (or fails
    in strict mode).
    """
    if envs.use_petit_moe() and _is_single_gpu_layer(prepare_finalize):
        from vllm_petit_moe.vllm_glue.experts import PetitSingleGpuExperts

        if isinstance(fused_experts, PetitSingleGpuExperts):
            return fused_experts
        decision = decide_single_gpu(fused_experts)
        _report(decision, type(fused_experts).__name__, what="PetitSingleGpuExperts")
        if not decision.substitute:
            return fused_experts
        return PetitSingleGpuExperts(fused_experts.moe_config, fused_experts.quant_config,
                                     fallback=fused_experts,
                                     layer_config=envs.single_gpu_layer_config())
    if not envs.use_petit_moe():
        return fused_experts
    from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize

    if not isinstance(prepare_finalize, PetitPrepareAndFinalize):
        return fused_experts
    from vllm_petit_moe.vllm_glue.experts import (PetitEpExperts, is_quantized,
                                                  layer_intermediate_size, unsupported_reason)

    if isinstance(fused_experts, PetitEpExperts):
        return fused_experts
    petit_gemms = envs.petit_experts()
    fused_tokens = envs.ep_layer_config().megamoe_max_tokens
    if not petit_gemms and fused_tokens == 0:
        return fused_experts

    asked = " and ".join(
        ([f"{envs.VLLM_PETIT_MOE_EXPERTS}=1"] if petit_gemms else [])
        + ([f"{envs.VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS}={fused_tokens}"] if fused_tokens else []))
    kept = type(fused_experts).__name__
    if not isinstance(fused_experts, compat.fused_moe_symbol("TritonExperts")):
        _refuse_or_warn(f"{asked}, but these MoE layers run vLLM's {kept}, whose weights vLLM "
                        "converted to that kernel's own layout; petit's experts take them as "
                        f"loaded for vLLM's TritonExperts; they keep {kept}")
        return fused_experts
    moe, quant_config = fused_experts.moe_config, fused_experts.quant_config
    block_fp8 = is_quantized(quant_config)
    reason = unsupported_reason(moe, quant_config, allow_block_fp8=True)
    if reason is None and block_fp8 and not fused_tokens:
        reason = "block-fp8 weights: petit's grouped GEMMs take bf16 weights"
    if reason is None and fused_tokens:
        fused_reason = prepare_finalize.enable_megamoe(
            fused_tokens, hidden_size=int(moe.hidden_dim),
            intermediate_size=layer_intermediate_size(moe), top_k=int(moe.experts_per_token),
            block_fp8=block_fp8)
        if fused_reason is not None and (block_fp8 or not petit_gemms):
            reason = f"the fused layer: {fused_reason}"
        elif fused_reason is not None:  # our GEMMs still serve: composed only
            _refuse_or_warn(f"{asked}, but these MoE layers cannot run fused ({fused_reason}); "
                            "they run composed with PetitExperts")
    if reason is not None:
        _refuse_or_warn(f"{asked}, but PetitExperts cannot serve these MoE layers ({reason}); "
                        f"they keep vLLM's {kept}")
        return fused_experts
    if block_fp8 and petit_gemms:
        _refuse_or_warn(f"{asked}, but petit's grouped GEMMs take bf16 weights: the composed "
                        f"steps of these block-fp8 MoE layers keep vLLM's {kept}")
    use_gemms = petit_gemms and not block_fp8
    fused_what = (f"the fused layer{' on block-fp8 weights' if block_fp8 else ''} for steps of "
                  f"up to {prepare_finalize.megamoe_max_stride} tokens per rank, else "
                  if prepare_finalize.megamoe_max_stride else "")
    composed_what = (f"petit grouped GEMMs (tile family {envs.petit_experts_tiles()})"
                     if use_gemms else f"vLLM's {kept}")
    key = (True, "experts: " + fused_what + composed_what)
    if key not in _reported:
        _reported.add(key)
        logger.info("vllm-petit-moe: MoE layers use PetitEpExperts (%s%s) instead of %s (%s)",
                    fused_what, composed_what, kept, asked)
    return PetitEpExperts(moe, quant_config, prepare_finalize,
                          fallback=None if use_gemms else fused_experts)


def install() -> None:
    """Install the ``FusedMoEKernel`` hook now or when vLLM's modular kernel is imported."""

    def _install(_module) -> None:
        if compat.install_kernel_hook(maybe_substitute, maybe_substitute_experts):
            logger.debug("vllm-petit-moe: FusedMoEKernel hook installed")

    compat.call_when_imported(compat.MODULAR_KERNEL_MODULE, _install)
