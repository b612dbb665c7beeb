"""``PetitExperts``: vLLM's modular experts interface over our grouped-GEMM kernels.

Where it sits in vLLM's modular kernel (``FusedMoEKernelModularImpl.apply``, vLLM 0.24)::

    prepare(...)            -> recv_x [M, H], recv_ids [M, K] global, recv_weights [M, K]
    experts.apply(output [M, H], recv_x, w1 = w13 [L, 2I, H], w2 [L, H, I], recv_weights,
                  recv_ids, ..., expert_map, workspace13, workspace2, ...)
    finalize(output [T, H], fused_out [M, H], ..., TopKWeightAndReduceNoOP())

``apply`` maps the global ids it is given back to local ids through the layer's
``expert_map`` on the GPU (``-1`` and other ranks' experts become ``-1``; without a map the
ids already are local) and runs ``vllm_petit_moe.ops.experts_forward``: the gate/up GEMM with
SiLU·mul fused, the down GEMM with the routing weight fused, and the deterministic local
weighted reduction. Its output row is the local weighted sum over the row's top-k slots,
exactly what vLLM's Triton experts produce, so ``finalize_weight_and_reduce_impl`` is
``TopKWeightAndReduceNoOP`` and it pairs with ``PetitPrepareAndFinalize`` (whose combine
expects that sum) as well as with vLLM's own Standard-format prepare/finalize.

Weights are taken exactly as vLLM loaded them for its Triton experts (``w13_weight`` with gate
rows first, ``w2_weight``), bf16, unquantized, no biases, plain SiLU gating.

Workspaces (vLLM's workspace manager; ``workspace_dtype`` is the activation dtype, bf16):

- ``workspace13 (M, K, I)``: the activation ``[M*K, I]`` written by the gate/up GEMM and read
  by the down GEMM. vLLM lets the fused output alias this buffer; that is safe because the
  reduction, the only writer of the output, runs after the down GEMM has read the activation
  (stream order).
- ``workspace2 (M, K, 2H)`` bf16 = ``[M*K, H]`` float32: each routing entry's weighted down
  projection, summed per row afterwards in slot order (deterministic).

The compiled extension is imported on the first ``apply`` (CPU tests instantiate the class
and query its interface without it).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_petit_moe.limits import MAX_LOCAL_EXPERTS, MAX_TOP_K, SIZE_MULTIPLE
from vllm_petit_moe.vllm_glue import compat, envs

compat.require_supported_vllm()  # the classes below subclass vLLM's: say which vLLM they need
_ExpertsModular = compat.fused_moe_symbol("ExpertsModular")
_ActivationFormat = compat.fused_moe_symbol("ActivationFormat")
_TopKWeightAndReduceNoOP = compat.fused_moe_symbol("TopKWeightAndReduceNoOP")
_MoEActivation = compat.fused_moe_symbol("MoEActivation")


def kernel_expert_ids(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(ids, expert_map)`` as ``ops.experts_forward`` takes them: ``[M, K] int32``
    contiguous ids, and vLLM's EP map (global -> local id, ``-1`` for other ranks' experts)
    as a contiguous ``[E] int32`` tensor on the ids' device, or None (the ids are local ids).

    The kernels apply the map themselves (``csrc/common/expert_ids.h``; ids outside ``[0, E)`` and map
    values outside ``[0, L)`` are slots this rank does not serve), so with vLLM's usual int32
    ids and map this returns its inputs and launches nothing.
    """
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    ids = ids.contiguous()
    if expert_map is None:
        return ids, None
    return ids, expert_map.to(device=ids.device, dtype=torch.int32).contiguous()


def kernel_inputs(hidden_states, topk_ids, topk_weights, expert_map, activation, a1q_scale,
                  apply_router_weight_on_input):
    """``(ids, expert_map, weights)`` for our kernels from an ``apply`` call's arguments
    (``kernel_expert_ids``; float32 routing weights, ones where vLLM already applied them to
    the input); NotImplementedError for what the kernels do not take."""
    if activation != _MoEActivation.SILU:
        raise NotImplementedError(f"vllm-petit-moe: our experts support SiLU only, got "
                                  f"{activation}")
    if a1q_scale is not None or hidden_states.dtype != torch.bfloat16:
        raise NotImplementedError(
            "vllm-petit-moe: our experts take bf16 activations only (got "
            f"{hidden_states.dtype}, scale {'set' if a1q_scale is not None else 'none'})")
    ids, kernel_map = kernel_expert_ids(topk_ids, expert_map)
    if apply_router_weight_on_input:
        weights = torch.ones(topk_ids.shape, dtype=torch.float32, device=topk_ids.device)
    else:
        weights = topk_weights.to(torch.float32).contiguous()
    return ids, kernel_map, weights


def _refuse_gemm2_hook(experts) -> None:
    """NotImplementedError if a model set vLLM 0.33's post-GEMM2 hook on ``experts``
    (``compat.experts_post_gemm2_hook``): our kernels reduce the top-k themselves."""
    if compat.experts_post_gemm2_hook(experts) is not None:
        raise NotImplementedError(
            "vllm-petit-moe: this model set a post-GEMM2 hook on its MoE experts (vLLM >= 0.33) "
            "to do the top-k reduction itself; petit's experts reduce in the kernel. Serve this "
            "model without VLLM_USE_PETIT_MOE.")


def layer_intermediate_size(moe_config: Any) -> int:
    """The intermediate size of this rank's experts (``I`` of ``w2 [L, H, I]``)."""
    intermediate = int(getattr(moe_config, "intermediate_size_per_partition", -1))
    return intermediate if intermediate > 0 else int(moe_config.intermediate_size)


def is_quantized(quant_config: Any) -> bool:
    """Whether a layer's ``FusedMoEQuantConfig`` quantizes its weights or activations."""
    return quant_config is not None and (quant_config.quant_dtype is not None
                                         or quant_config.weight_quant_dtype is not None)


def block_fp8_unsupported_reason(quant_config: Any) -> str | None:
    """None where a layer's quantization is what MegaMoE takes in place: e4m3 weights with one
    fp32 scale per 128 x 128 block and activations quantized dynamically in 1 x 128 groups
    (DeepSeek-V3/R1, Qwen3-*-FP8 and Kimi K2 checkpoints as vLLM's fp8 method loads them);
    else why not."""
    fp8 = torch.float8_e4m3fn
    if quant_config is None or quant_config.weight_quant_dtype != fp8:
        dtype = None if quant_config is None else quant_config.weight_quant_dtype
        return f"quantization: weights {dtype} (fp8 MegaMoE takes float8_e4m3fn only)"
    if quant_config.quant_dtype != fp8:
        return f"quantization: activations {quant_config.quant_dtype} (not fp8 w8a8)"
    if quant_config.block_shape != [128, 128]:
        what = ("per-token activations" if quant_config.per_act_token_quant else
                "per-channel weights" if quant_config.per_out_ch_quant else
                f"block {quant_config.block_shape}" if quant_config.block_shape else
                "per-tensor scales")
        return f"quantization: fp8 with {what} (fp8 MegaMoE takes 128 x 128 weight blocks only)"
    if quant_config.a1_scale is not None:
        return "quantization: static activation scales (fp8 MegaMoE takes dynamic 1 x 128 ones)"
    for name in ("w1_scale", "w2_scale"):
        scale = getattr(quant_config, name)
        if scale is None or scale.dtype != torch.float32 or scale.dim() != 3 \
                or not scale.is_contiguous():
            return (f"quantization: {name} "
                    f"{None if scale is None else (scale.dtype, tuple(scale.shape))} (fp8 "
                    "MegaMoE takes contiguous float32 [L, rows/128, k/128] block scales)")
    return None


def unsupported_reason(moe_config: Any, quant_config: Any, *,
                       allow_block_fp8: bool = False) -> str | None:
    """Why ``PetitExperts`` cannot serve a layer (None if it can), from vLLM's
    ``FusedMoEConfig`` and ``FusedMoEQuantConfig`` only. ``allow_block_fp8``: block-fp8 layers
    (``block_fp8_unsupported_reason``) are taken too (the one-GPU experts: MegaMoE, else vLLM's
    fp8 Triton experts)."""
    activation = getattr(moe_config, "activation", None)
    if activation != _MoEActivation.SILU:
        return f"activation {activation} (only SiLU gating)"
    if not getattr(moe_config, "is_act_and_mul", True):
        return "non-gated MLP (act_and_mul=False)"
    if getattr(moe_config, "in_dtype", None) is not torch.bfloat16:
        return f"activation dtype {getattr(moe_config, 'in_dtype', None)} (only bfloat16)"
    if getattr(moe_config, "has_bias", False):
        return "expert biases"
    hidden = int(moe_config.hidden_dim)
    intermediate = layer_intermediate_size(moe_config)
    if hidden % SIZE_MULTIPLE or intermediate % SIZE_MULTIPLE:
        return f"hidden {hidden} / intermediate {intermediate} not multiples of {SIZE_MULTIPLE}"
    if int(moe_config.experts_per_token) > MAX_TOP_K:
        return f"top-k {moe_config.experts_per_token} > {MAX_TOP_K}"
    if int(moe_config.num_local_experts) > MAX_LOCAL_EXPERTS:
        return f"{moe_config.num_local_experts} local experts > {MAX_LOCAL_EXPERTS}"
    if quant_config is not None:
        quantized = is_quantized(quant_config)
        if quantized and allow_block_fp8:
            reason = block_fp8_unsupported_reason(quant_config)
            if reason is not None:
                return reason
        elif quantized:
            return (
                f"quantization (activations {quant_config.quant_dtype}, weights "
                f"{quant_config.weight_quant_dtype}); only bf16 weights and activations"
            )
        if quant_config.w1_bias is not None or quant_config.w2_bias is not None:
            return "expert biases"
        if quant_config.gemm1_clamp_limit is not None or quant_config.gemm1_alpha not in (
            None, 1.0
        ) or quant_config.gemm1_beta not in (None, 0.0):
            return "clamped / parameterized SwiGLU"
    return None


class PetitExperts(_ExpertsModular):
    """Our grouped-GEMM experts in vLLM's Standard activation format (see module docstring).

    moe_config / quant_config: the layer's ``FusedMoEConfig`` and ``FusedMoEQuantConfig``
    (as vLLM built them for its Triton experts).
    """

    allow_block_fp8 = False  # the one-GPU experts take block-fp8 layers too

    def __init__(self, moe_config, quant_config):
        super().__init__(moe_config, quant_config)
        reason = unsupported_reason(moe_config, quant_config,
                                    allow_block_fp8=self.allow_block_fp8)
        if reason is not None:
            raise ValueError(f"vllm-petit-moe: PetitExperts cannot serve this layer: {reason}")
        self.tiles = envs.petit_experts_tiles()  # the GEMMs' tile family (ops.TILES)

    # --- vLLM's kernel-selection interface ----------------------------------------------

    @staticmethod
    def activation_format():
        return _ActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        from vllm.platforms import current_platform

        # The extension is built for CUDA (sm_90a by default); the portable kernels would also
        # run on other CUDA architectures the build targets.
        return current_platform.is_cuda()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key is None and activation_key is None

    @staticmethod
    def _supports_activation(activation) -> bool:
        return activation == _MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        # Same exclusion as vLLM's Triton experts: FlashInfer's NVLink all2all kernels bring
        # their own expert layout.
        return not (
            getattr(moe_parallel_config, "use_fi_nvl_two_sided_kernels", False)
            or getattr(moe_parallel_config, "use_fi_nvl_one_sided_kernels", False)
        )

    @staticmethod
    def _supports_shape(hidden_dim: int) -> bool:
        return hidden_dim % SIZE_MULTIPLE == 0

    @staticmethod
    def _supports_batch_invariance() -> bool:
        # Every output element is a fixed-order fp32 FMA chain over k (both tile families
        # step k in the same order), then a fixed-order slot sum: a row's result does not
        # depend on the other rows of the batch.
        return True

    def supports_expert_map(self) -> bool:
        """Global ids + ``expert_map`` are resolved in ``apply`` (asked by vLLM < 0.24 and
        some experts classes; not part of 0.24's base interface)."""
        return True

    def supports_chunking(self) -> bool:
        """No activation chunking: the reduction needs all of a row's slots in one call
        (0.24 has no chunking; older vLLM versions asked)."""
        return False

    def finalize_weight_and_reduce_impl(self):
        # apply() leaves the weighted sum over the top-k slots in `output`.
        return _TopKWeightAndReduceNoOP()

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
        expert_tokens_meta,
        activation,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``M`` rows, ``N = 2I`` (rows of w13), ``K = H``. Returns
        ``workspace13 (M, topk, I)`` (the activation, bf16), ``workspace2 (M, topk, H)`` (the
        per-entry weighted partials, bf16) and the output ``(M, H)``."""
        intermediate = N // 2
        return (M, topk, intermediate), (M, topk, K), (M, K)

    # --- the computation -------------------------------------------------------------------

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta,
        apply_router_weight_on_input: bool,
    ) -> None:
        """output ``[M, H] bf16`` <- Σ_k w[m,k] · expert_{local(id[m,k])}(hidden_states[m]).

        hidden_states ``[M, H] bf16``; w1 ``[L, 2I, H]``, w2 ``[L, H, I]`` bf16; topk_weights
        ``[M, K]``; topk_ids ``[M, K]`` global ids (local ids when ``expert_map`` is None).
        With ``apply_router_weight_on_input`` the weights were already applied to the input
        (top-1) and are not applied again.
        """
        from vllm_petit_moe import ops

        _refuse_gemm2_hook(self)
        num_rows, top_k = topk_ids.shape
        hidden, intermediate = hidden_states.size(1), w1.size(1) // 2
        ids, kernel_map, weights = kernel_inputs(
            hidden_states, topk_ids, topk_weights, expert_map, activation, a1q_scale,
            apply_router_weight_on_input)
        num_entries = num_rows * top_k
        act = workspace13.reshape(-1)[: num_entries * intermediate]
        partial = workspace2.reshape(-1)[: num_entries * hidden]
        ops.experts_forward(
            hidden_states, ids, weights, w1, w2,
            out=output, act_workspace=act, partial_workspace=partial, tiles=self.tiles,
            expert_map=kernel_map,
        )


class PetitSingleGpuExperts(PetitExperts):
    """The one-GPU (no DP, no EP) MoE layer behind vLLM's own pass-through prepare/finalize
    (``MoEPrepareAndFinalizeNoDPEPModular``): each call runs, by its token count
    (``SingleGpuLayerConfig``), MegaMoE (our fused persistent kernel, ``ops.megamoe_forward``),
    our composed experts (``ops.experts_forward``), or vLLM's Triton experts that it replaced
    (``fallback``), so the flag never runs a kernel measured slower than vLLM's for that size.

    Block-fp8 layers (``block_fp8_unsupported_reason``): MegaMoE on the e4m3 weights and their
    block scales as loaded, with bf16 activations (``expects_unquantized_inputs``: vLLM's
    prepare leaves them unquantized), else vLLM's fp8 Triton experts on activations quantized
    here as prepare would have; no composed path.

    Workspaces: vLLM lets the fused output alias ``workspace13``, and the fused kernel still
    reads activations while it writes finished output tiles, so ours live in ``workspace2``:
    the bf16 activations ``[M*K, I]``, then the partials ``[M*K, H]`` (fp32 for MegaMoE, bf16
    for the composed path). Both are sized for the Triton fallback as well.
    """

    allow_block_fp8 = True

    def __init__(self, moe_config, quant_config, fallback, layer_config=None):
        from vllm_petit_moe.config import SingleGpuLayerConfig

        super().__init__(moe_config, quant_config)
        self.fp8 = quant_config is not None and quant_config.weight_quant_dtype is not None
        self.fallback = fallback
        self.layer_config = layer_config or SingleGpuLayerConfig()
        self.timeout_s = envs.timeout_s()
        if self.layer_config.megamoe_max_tokens > 0 and torch.cuda.is_available():
            from vllm_petit_moe import ops

            if ops.sm90a_kernels_supported():
                # MegaMoE's counters now, while the model is built: allocated at a first call
                # inside a CUDA-graph capture they would come from the graph's pool, their
                # zeros only recorded, not written
                ops._megamoe_sync_buffer(torch.device("cuda", torch.cuda.current_device()),
                                         int(moe_config.num_local_experts),
                                         int(moe_config.hidden_dim))

    @staticmethod
    def _supports_batch_invariance() -> bool:
        # A row's bits depend on which kernel the batch's size chose.
        return False

    @property
    def expects_unquantized_inputs(self) -> bool:
        """Block fp8: prepare hands over bf16 activations (MegaMoE's input); ``apply``
        quantizes them for the Triton fp8 experts where it runs those."""
        return self.fp8

    def path_for(self, num_rows: int, top_k: int, hidden: int, intermediate: int) -> str:
        """``"megamoe"``, ``"composed"`` or ``"triton"``: what ``apply`` runs for a call
        (MegaMoE only where the GPU runs its sm_90a image: H100/H200; block fp8: MegaMoE or
        Triton)."""
        from vllm_petit_moe import ops

        cfg = self.layer_config
        if (num_rows <= cfg.megamoe_max_tokens and ops.megamoe_unsupported_reason(
                num_rows, top_k, hidden, intermediate, fp8=self.fp8) is None
                and ops.sm90a_kernels_supported()):
            return "megamoe"
        return "composed" if num_rows >= cfg.composed_min_tokens and not self.fp8 else "triton"

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        """``M`` rows, ``N = 2I``, ``K = H``: workspace13 as the Triton fallback's,
        workspace2 ``(M, topk, max(I + 2H, Triton's))``, output ``(M, H)``."""
        ws13, ws2, out = self.fallback.workspace_shapes(
            M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation)
        return ws13, (M, topk, max(N // 2 + 2 * K, ws2[-1])), out

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input) -> None:
        """As ``PetitExperts.apply`` (same arguments and result), through the kernel
        ``path_for`` chooses."""
        from vllm_petit_moe import ops

        _refuse_gemm2_hook(self)
        num_rows, top_k = topk_ids.shape
        hidden, intermediate = hidden_states.size(1), w1.size(1) // 2
        path = self.path_for(num_rows, top_k, hidden, intermediate)
        if path == "triton":
            if self.fp8:  # prepare left them in bf16 (expects_unquantized_inputs)
                hidden_states, a1q_scale = compat.quantize_moe_input(hidden_states,
                                                                     self.quant_config)
            self.fallback.apply(output, hidden_states, w1, w2, topk_weights, topk_ids,
                                activation, global_num_experts, expert_map, a1q_scale, a2_scale,
                                workspace13, workspace2, expert_tokens_meta,
                                apply_router_weight_on_input)
            return
        if path == "composed":
            super().apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                          global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                          workspace2, expert_tokens_meta, apply_router_weight_on_input)
            return
        ids, kernel_map, weights = kernel_inputs(
            hidden_states, topk_ids, topk_weights, expert_map, activation, a1q_scale,
            apply_router_weight_on_input)
        entries = num_rows * top_k
        space = workspace2.reshape(-1)
        act = space[: entries * intermediate]
        partial = space[entries * intermediate: entries * (intermediate + 2 * hidden)]
        scales = {}
        if self.fp8:
            scales = dict(w13_scale=self.quant_config.w1_scale,
                          w2_scale=self.quant_config.w2_scale)
        ops.megamoe_forward(hidden_states, ids, weights, w1, w2, out=output,
                            expert_map=kernel_map, act_workspace=act,
                            partial_workspace=partial.view(torch.float32),
                            timeout_s=self.timeout_s, **scales)


class PetitEpExperts(PetitExperts):
    """The experts of a DP + EP layer behind ``PetitPrepareAndFinalize``: on a step that the
    prepare/finalize runs as the fused layer (``enable_megamoe``) ``apply`` only hands the
    layer's weights over and ``finalize`` launches ``EpBuffer.megamoe``; on the other steps
    (the composed path) it runs our grouped GEMMs (``fallback`` None) or the vLLM Triton
    experts it replaced (``fallback``).

    Block-fp8 layers (``block_fp8_unsupported_reason``): the fused steps run on the e4m3
    weights and the quant config's block scales as loaded, on the bf16 tokens; the composed
    steps need vLLM's fp8 Triton experts as ``fallback`` (our grouped GEMMs take bf16
    weights), and get what they expect from prepare (``expects_unquantized_inputs`` is the
    fallback's: e4m3 activations with their 1 x 128 scales, quantized inside dispatch).

    The choice is the prepare/finalize's, per step, from the region stride ``R`` that every
    rank shares (``EpLayerConfig``), so all ranks run the same path.
    """

    allow_block_fp8 = True

    def __init__(self, moe_config, quant_config, prepare_finalize, fallback=None):
        super().__init__(moe_config, quant_config)
        self.fp8 = is_quantized(quant_config)
        if self.fp8 and fallback is None:
            raise ValueError("vllm-petit-moe: a block-fp8 layer's composed steps need vLLM's "
                             "fp8 experts as the fallback (petit's grouped GEMMs take bf16 "
                             "weights)")
        self.prepare_finalize = prepare_finalize
        self.fallback = fallback

    @staticmethod
    def _supports_batch_invariance() -> bool:
        # A row's bits depend on the path its step's size chose.
        return False

    @property
    def expects_unquantized_inputs(self) -> bool:
        """The composed path's experts' wish (the fused steps take the bf16 tokens anyway)."""
        return bool(self.fallback is not None and self.fallback.expects_unquantized_inputs)

    def finalize_weight_and_reduce_impl(self):
        if self.fallback is not None:
            return self.fallback.finalize_weight_and_reduce_impl()
        return super().finalize_weight_and_reduce_impl()

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):
        """The composed path's experts' shapes (a fused step uses none of them)."""
        owner = self.fallback if self.fallback is not None else super()
        return owner.workspace_shapes(M, N, K, topk, global_num_experts, local_num_experts,
                                      expert_tokens_meta, activation)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input) -> None:
        """A fused step: hand ``w1``/``w2`` to the prepare/finalize (no launch). Otherwise as
        ``PetitExperts.apply`` or the fallback's ``apply`` (same arguments and result)."""
        if self.prepare_finalize.megamoe_step_pending():
            _refuse_gemm2_hook(self)
            if activation != _MoEActivation.SILU:
                raise NotImplementedError(f"vllm-petit-moe: the fused layer supports SiLU only, "
                                          f"got {activation}")
            scales = {}
            if self.fp8:
                scales = dict(w13_scale=self.quant_config.w1_scale,
                              w2_scale=self.quant_config.w2_scale)
            self.prepare_finalize.set_megamoe_weights(w1, w2, **scales)
            return
        owner = self.fallback if self.fallback is not None else super()
        owner.apply(output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                    global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                    workspace2, expert_tokens_meta, apply_router_weight_on_input)
