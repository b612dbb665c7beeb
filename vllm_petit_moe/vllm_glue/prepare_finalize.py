"""``PetitPrepareAndFinalize``: vLLM's modular prepare/finalize over our ``EpBuffer``.

Where it sits in vLLM's modular kernel (``FusedMoEKernelModularImpl.apply``, vLLM 0.24)::

    prepare(a1 [T,H], topk_weights [T,K], topk_ids [T,K] global, ..., expert_map)
        -> (recv_x [W*R,H], None, None, recv_ids [W*R,K] global, recv_weights [W*R,K])
    experts.apply(recv_x, w1, w2, recv_weights, recv_ids, ..., expert_map)     # vLLM's own
        -> fused_out [W*R, H] = per-row weighted sum over this rank's experts
    finalize(output [T,H], fused_out, ...)  -> combine into ``output`` in place

Expert ids. Our dispatch delivers, per received row, *local* expert ids (``0..L-1``) or ``-1``
(slot not routed here, or padding row). vLLM's experts run with the layer's ``expert_map``
(global -> local, ``-1`` for other ranks' experts), which we cannot replace: the modular kernel
passes the layer's map to ``experts.apply``. So ``prepare`` returns *global* ids:

- a local id ``l`` becomes ``rank*L + l``, which ``expert_map`` maps back to ``l``;
- ``-1`` becomes ``((rank+1) % W) * L``: a valid global id owned by another rank, which
  ``expert_map`` maps to ``-1``. vLLM's Triton experts then treat the slot exactly like a
  token routed to another rank in its own allgather path: ``moe_align_block_size`` counts it,
  the block's expert becomes ``expert_map[e] = -1`` and the GEMM kernels write zeros for it,
  so the slot adds exactly 0 to the row's sum (its weight is 0 as well).

  Passing ``-1`` through instead would be wrong: ``expert_map[-1]`` (the map's last entry,
  used by the Python-side lookup ``expert_map[expert_ids]``) is a valid local expert on the
  last rank, and vLLM's CUDA ``moe_align_block_size`` skips negative ids in some versions and
  indexes shared memory with them in others; a skipped slot leaves its intermediate row
  unwritten, which ``moe_sum`` would then add as garbage.

This needs vLLM's linear expert placement (rank ``r`` owns ``[r*L, (r+1)*L)``), which is the
only placement vLLM uses with the allgather/reduce-scatter backend in 0.24
(``determine_expert_placement_strategy`` falls back to linear), and ``E % W == 0``. The hook
checks both from the config; ``prepare`` additionally compares the actual ``expert_map``
tensor once (first eager call).

Weights and reduction. vLLM's Triton experts multiply the router weight in the down GEMM
and sum the ``K`` slots (``moe_sum``); their ``finalize_weight_and_reduce_impl`` is
``TopKWeightAndReduceNoOP``. Their output row is thus exactly the *local weighted sum* that
``EpBuffer.combine`` expects. Experts that leave weighting/reduction to us
(``TopKWeightAndReduceDelegate``) get vLLM's ``TopKWeightAndReduceContiguous`` first, like
vLLM's own allgather finalize does.

Static shapes. ``R`` (the region stride) is the max of all DP ranks' token counts of this step,
read from vLLM's forward context (a CPU tensor: no device sync), so every call with the same
padded batch has the same ``W*R`` rows, as CUDA graphs require; under graphs vLLM pads all DP
ranks to one count anyway. Rows of a source beyond its token count carry only ``-1`` ids.

Quantized activations. With vLLM's dynamic fp8 activation quantization (``quant_dtype``
``float8_e4m3fn``, no static ``a1_scale``) in 1x128 blocks (``block_shape [*, 128]``) or per
token (``per_act_token_quant``), ``prepare`` quantizes at the source *inside* our dispatch
(``EpBuffer.dispatch(quant=...)``, same formulas as vLLM's ``per_token_group_quant_fp8`` /
dynamic per-token ``scaled_fp8_quant``) and returns e4m3 rows plus their scales
(``[W*R, H/128]`` or ``[W*R, 1]`` float32) as ``a1q_scale``, which vLLM's Triton fp8 experts
(and DeepGEMM's) consume as they do after its own quantization: the wire carries half the
bytes. Experts that quantize inside (FlashInfer's CUTLASS experts on block fp8:
``expects_unquantized_inputs``, so vLLM's modular kernel passes ``defer_input_quant``) get
the bf16 rows instead, as from vLLM's own prepare. Other schemes (static or per-tensor
scales, int8, fp4, column-major scales) raise ``NotImplementedError`` here, and the hook
keeps vLLM's path for them (:func:`dispatch_quant_mode` is the one place that decides; which
experts are served at all: :func:`experts_dispatch_mode`).

The fused layer. Once :meth:`PetitPrepareAndFinalize.enable_megamoe` was called (by the hook,
when it puts ``PetitEpExperts`` in place of the experts), a step whose region stride ``R`` is
at most ``EpLayerConfig.megamoe_max_tokens`` runs as one ``EpBuffer.megamoe`` launch per rank
instead of dispatch + experts + combine. vLLM's modular kernel still calls the three steps:
``prepare`` only records the step (``x``, ids, weights, ``R``; no launch) and returns the
tokens unchanged; ``PetitEpExperts.apply`` hands the layer's weights over (no launch);
``finalize`` launches the fused kernel, which writes ``output`` directly. A block-fp8 layer
(``enable_megamoe(..., block_fp8=True)``) runs its fused steps on the bf16 tokens and the
e4m3 weights with their block scales, its composed steps on fp8 rows. ``R`` is equal on
every rank, so every rank takes the same path (mixing a fused call with a peer's dispatch is
reported as a fault, never a silent result). A rank with no tokens still returns one
placeholder row from ``prepare``, because vLLM skips the experts of an empty batch and the
fused call is collective.
"""

from __future__ import annotations

import torch

from vllm_petit_moe.limits import (FP8_BLOCK_MODES, FP8_SCALE_BLOCK, MEGAMOE_MAX_ENTRIES,
                                   MEGAMOE_SIZE_MULTIPLE)
from vllm_petit_moe.vllm_glue import compat

compat.require_supported_vllm()  # the classes below subclass vLLM's: say which vLLM they need
_PrepareAndFinalizeModular = compat.fused_moe_symbol("PrepareAndFinalizeModular")
_ActivationFormat = compat.fused_moe_symbol("ActivationFormat")
_TopKWeightAndReduceDelegate = compat.fused_moe_symbol("TopKWeightAndReduceDelegate")
_TopKWeightAndReduceContiguous = compat.fused_moe_symbol("TopKWeightAndReduceContiguous")
_TopKWeightAndReduceNoOP = compat.fused_moe_symbol("TopKWeightAndReduceNoOP")

# Buffer reuse invariant (docs/architecture.md, "Buffer reuse"): a rank may start dispatch n+1
# on a buffer only after its combine n returned. All MoE layers share one buffer, so this
# holds only if every prepare() is followed by its layer's finalize() before any other
# layer's prepare() on the same buffer. vLLM's modular kernel runs prepare -> experts ->
# finalize synchronously per layer and layers one after another on one stream; DBO
# (two micro-batches interleaving layers) would break it and is rejected by the hook. We
# still check it on the host: id(buffer) -> the prepare/finalize that has dispatched and not
# yet combined.
_PENDING_DISPATCH: dict[int, "PetitPrepareAndFinalize"] = {}


def local_to_global_expert_ids(
    recv_topk_ids: torch.Tensor, *, rank: int, num_local_experts: int, world_size: int
) -> torch.Tensor:
    """Map dispatched local ids to global ids for vLLM's experts + ``expert_map``.

    recv_topk_ids: ``[N, K] int32``, local ids of ``rank`` or ``-1``. Returns ``[N, K] int32``:
    ``rank*L + id`` for local ids; for ``-1`` the first expert of rank ``(rank+1) % W``, which
    vLLM's linear ``expert_map`` maps to ``-1`` (not local). Needs ``world_size > 1``.
    No host sync; CUDA-graph capturable.
    """
    if world_size < 2:
        raise ValueError("local_to_global_expert_ids needs world_size >= 2 (a non-local id)")
    first_local = rank * num_local_experts
    non_local = ((rank + 1) % world_size) * num_local_experts
    return torch.where(recv_topk_ids >= 0, recv_topk_ids + first_local, non_local).to(
        torch.int32
    )


def linear_expert_map(
    num_experts: int, *, rank: int, world_size: int, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """The expert map vLLM builds for linear placement with ``E % W == 0`` (CPU tensor)."""
    num_local = num_experts // world_size
    expert_map = torch.full((num_experts,), -1, dtype=dtype)
    expert_map[rank * num_local : (rank + 1) * num_local] = torch.arange(num_local, dtype=dtype)
    return expert_map


def dispatch_quant_mode(quant_config, hidden_size: int | None = None
                        ) -> tuple[str | None, str | None]:
    """The ``EpBuffer.dispatch`` ``quant`` mode for a layer's activation quantization
    (``hidden_size``, when given, is checked against the mode's limits).

    Returns ``(mode, None)`` with mode ``None`` (bf16 activations), ``"fp8_block128"``,
    ``"fp8_block128_ue8m0"`` (power-of-two scales: what vLLM's own quantizer produces when its
    DeepGEMM E8M0 scales are on, ``compat.fp8_block_scales_are_ue8m0``) or
    ``"fp8_per_token"``; or ``(None, reason)`` when the scheme is not supported.
    """
    quant_dtype = getattr(quant_config, "quant_dtype", None)
    if quant_dtype is None:
        return None, None
    block_shape = getattr(quant_config, "block_shape", None)
    per_token = bool(getattr(quant_config, "per_act_token_quant", False))
    what = (f"quantized activations (quant_dtype={quant_dtype}, block_shape={block_shape}, "
            f"per_act_token_quant={per_token})")
    if quant_dtype is not torch.float8_e4m3fn:
        return None, f"{what}: only fp8 e4m3 activations (or bf16) are supported"
    if getattr(quant_config, "a1_scale", None) is not None:
        return None, f"{what}: static activation scales (only dynamic fp8 is supported)"
    if compat.fp8_activation_scales_transposed(quant_config):
        return None, (f"{what}: the experts read column-major [H/128, M] activation scales; "
                      "dispatch delivers them row-major")
    if block_shape is not None:
        if per_token or len(block_shape) != 2 or int(block_shape[1]) != FP8_SCALE_BLOCK:
            return None, f"{what}: only 1x128 activation blocks are supported"
        if hidden_size is not None and hidden_size % FP8_SCALE_BLOCK:
            return None, (f"{what}: 1x128 blocks need a hidden size that is a multiple of "
                          f"{FP8_SCALE_BLOCK}, got {hidden_size}")
        return ("fp8_block128_ue8m0" if compat.fp8_block_scales_are_ue8m0()
                else "fp8_block128"), None
    if per_token:
        return "fp8_per_token", None
    return None, f"{what}: per-tensor activation scales (only 1x128 blocks or per token)"


def experts_dispatch_mode(fused_experts, hidden_size: int | None = None
                          ) -> tuple[str | None, str | None]:
    """What ``prepare`` hands ``fused_experts`` (the experts vLLM built for a DP + EP layer):
    ``(mode, None)``, mode as in :func:`dispatch_quant_mode` (None: bf16 rows), or
    ``(None, reason)`` where petit cannot serve them. The experts must be ones whose input
    contract is known (``compat.EP_EXPERTS``: vLLM's Triton, DeepGEMM and FlashInfer-CUTLASS
    experts; all take global ids of which they serve only this rank's, like the rows of
    vLLM's allgather) in the Standard format and reduce the top-k themselves (what
    ``combine`` sums). Experts that quantize inside (``expects_unquantized_inputs``: vLLM's
    modular kernel then calls ``prepare`` with ``defer_input_quant``) get bf16 rows; the
    others the activations quantized as vLLM's prepare would (fp8 inside dispatch)."""
    name = type(fused_experts).__name__
    if compat.ep_experts_kind(fused_experts) is None:
        return None, (f"experts {name} (petit's dispatch serves vLLM's "
                      f"{', '.join(compat.EP_EXPERTS.values())})")
    if fused_experts.activation_format() != _ActivationFormat.Standard:
        return None, f"experts {name} take the {fused_experts.activation_format()} format"
    if not isinstance(fused_experts.finalize_weight_and_reduce_impl(), _TopKWeightAndReduceNoOP):
        return None, f"experts {name} do not reduce top-k"
    if getattr(fused_experts, "expects_unquantized_inputs", False):
        return None, None
    return dispatch_quant_mode(getattr(fused_experts, "quant_config", None), hidden_size)


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PetitPrepareAndFinalize(_PrepareAndFinalizeModular):
    """vLLM modular prepare/finalize that dispatches/combines through an ``EpBuffer``.

    buffer: an ``EpBuffer`` of this rank (shared by all layers; see ``buffer_cache``).
    num_experts: global expert count ``E`` of the layer (``E % W == 0``).
    max_tokens_per_rank: the largest region stride ``R`` a call may use (the buffer's size).
    """

    def __init__(self, buffer, *, num_experts: int, max_tokens_per_rank: int):
        super().__init__()
        world_size, rank = int(buffer.world_size), int(buffer.rank)
        if world_size < 2:
            raise ValueError(f"EpBuffer world_size must be >= 2, got {world_size}")
        if num_experts % world_size != 0:
            raise ValueError(f"num_experts={num_experts} is not divisible by W={world_size}")
        num_local = num_experts // world_size
        buffer_local = getattr(buffer, "num_local_experts", num_local)
        if int(buffer_local) != num_local:
            raise ValueError(
                f"EpBuffer has {buffer_local} local experts, the layer {num_local} "
                f"({num_experts} experts over {world_size} ranks)"
            )
        self.buffer = buffer
        self.rank = rank
        self.world_size = world_size
        self.num_experts = num_experts
        self.num_local_experts = num_local
        self._max_tokens_per_rank = max_tokens_per_rank
        self._handle = None
        self._num_rows = 0
        self._expert_map_checked = False
        self._megamoe_max_stride = 0  # steps with R up to this run fused (enable_megamoe)
        self._megamoe_block_fp8 = False  # the fused layer runs on block-fp8 weights
        self._megamoe_step = None  # (x, ids, weights, R) of a fused step between prepare/finalize
        self._megamoe_weights = None  # (w13, w2, scales) handed over by PetitEpExperts.apply

    # --- the fused layer ------------------------------------------------------------------

    def enable_megamoe(self, max_tokens: int, *, hidden_size: int, intermediate_size: int,
                       top_k: int, block_fp8: bool = False) -> str | None:
        """Let steps whose region stride ``R`` is at most ``max_tokens`` run the fused layer
        (``EpBuffer.megamoe``); only for experts that hand their weights over in ``apply``
        (``PetitEpExperts``). ``block_fp8``: the weights are e4m3 with 128 x 128 block scales
        (the experts hand the scales over too); a fused step then takes the bf16 tokens
        whatever the layer's activation quantization (the composed steps keep it). Returns
        why the layer cannot run fused (None: enabled, for ``R <= megamoe_max_stride``)."""
        if hidden_size % MEGAMOE_SIZE_MULTIPLE or intermediate_size % MEGAMOE_SIZE_MULTIPLE:
            return (f"hidden {hidden_size} / intermediate {intermediate_size} are not multiples "
                    f"of {MEGAMOE_SIZE_MULTIPLE}")
        if block_fp8 and (hidden_size % FP8_SCALE_BLOCK or intermediate_size % FP8_SCALE_BLOCK):
            return (f"block-fp8 weights: hidden {hidden_size} / intermediate "
                    f"{intermediate_size} are not multiples of the {FP8_SCALE_BLOCK} scale block")
        max_stride = min(int(max_tokens), MEGAMOE_MAX_ENTRIES // (self.world_size * top_k))
        if max_stride < 1:
            return (f"W * K = {self.world_size} * {top_k} routing entries per token row exceed "
                    f"MEGAMOE_MAX_ENTRIES = {MEGAMOE_MAX_ENTRIES}")
        # now, while vLLM builds the model: its memory profile then includes the workspace
        self.buffer.reserve_megamoe_workspace(intermediate_size)
        self._megamoe_max_stride = max_stride
        self._megamoe_block_fp8 = bool(block_fp8)
        return None

    @property
    def megamoe_max_stride(self) -> int:
        """The largest region stride a fused step takes (0: the fused layer is off)."""
        return self._megamoe_max_stride

    def megamoe_step_pending(self) -> bool:
        """Whether the step between ``prepare`` and ``finalize`` runs the fused layer."""
        return self._megamoe_step is not None

    def set_megamoe_weights(self, w13: torch.Tensor, w2: torch.Tensor,
                            w13_scale: torch.Tensor | None = None,
                            w2_scale: torch.Tensor | None = None) -> None:
        """The layer's local experts for the pending fused step (from the experts' apply):
        w13 ``[L, 2I, H]``, w2 ``[L, H, I]``; with block-fp8 weights (``enable_megamoe(...,
        block_fp8=True)``) e4m3 and their fp32 scales ``[L, 2I/128, H/128]``,
        ``[L, H/128, I/128]``."""
        if self._megamoe_step is None:
            raise RuntimeError("vllm-petit-moe: fused-layer weights handed over outside a fused "
                               "step")
        if self._megamoe_block_fp8 != (w13_scale is not None and w2_scale is not None):
            raise RuntimeError(
                "vllm-petit-moe: the fused layer was enabled for "
                f"{'block-fp8' if self._megamoe_block_fp8 else 'bf16'} weights, the experts "
                f"handed over {'no ' if w13_scale is None or w2_scale is None else ''}scales")
        scales = {} if w13_scale is None else dict(w13_scale=w13_scale, w2_scale=w2_scale)
        self._megamoe_weights = (w13, w2, scales)

    # --- interface properties -----------------------------------------------------------

    @property
    def activation_format(self):
        return _ActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        # The router then emits int32 ids, which our dispatch reads natively.
        return torch.int32

    def max_num_tokens_per_rank(self) -> int | None:
        return self._max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.world_size

    def output_is_reduced(self) -> bool:
        # finalize() leaves in `output` the complete MoE output of this rank's tokens (summed
        # over all ranks' experts); nothing is left for the layer's all-reduce.
        return True

    def supports_async(self) -> bool:
        return False

    # --- helpers --------------------------------------------------------------------------

    def region_stride(self, num_tokens: int) -> int:
        """``R`` of this step: the max token count over all DP ranks (equal on every rank)."""
        counts = compat.dp_num_tokens_across_ranks()
        if counts is None:
            raise RuntimeError(
                "vllm-petit-moe: no DP metadata in the forward context; the region stride must "
                "be agreed on by all EP ranks and is taken from vLLM's num_tokens_across_dp"
            )
        if len(counts) != self.world_size:
            raise RuntimeError(
                f"vllm-petit-moe: DP metadata has {len(counts)} ranks, the EP group "
                f"{self.world_size}; only DP size == EP size (TP=1) is supported"
            )
        stride = max(counts)
        if num_tokens > stride:
            raise RuntimeError(
                f"vllm-petit-moe: this rank has {num_tokens} tokens, more than the DP maximum "
                f"{stride} of this step ({counts})"
            )
        if stride > self._max_tokens_per_rank:
            raise RuntimeError(
                f"vllm-petit-moe: {stride} tokens on one DP rank exceed the EpBuffer's "
                f"max_tokens_per_rank={self._max_tokens_per_rank} (vLLM's "
                "max_num_batched_tokens when the buffer was built)"
            )
        return stride

    def _check_expert_map(self, expert_map: torch.Tensor | None) -> None:
        if expert_map is None:
            raise RuntimeError(
                "vllm-petit-moe: the experts run without an expert_map; dispatched ids are "
                "global ids that need vLLM's EP expert_map to select local experts"
            )
        if self._expert_map_checked or _is_capturing():
            return
        # One host sync, on the first eager call (vLLM's profile/warm-up runs come before any
        # CUDA-graph capture); the map is static afterwards (EPLB is rejected by the hook).
        expected = linear_expert_map(self.num_experts, rank=self.rank, world_size=self.world_size)
        actual = expert_map.detach().to("cpu", torch.int32)
        if actual.shape != expected.shape or not torch.equal(actual, expected):
            raise RuntimeError(
                "vllm-petit-moe: the layer's expert_map is not vLLM's linear placement of "
                f"{self.num_experts} experts over {self.world_size} ranks (rank {self.rank}); "
                "our dispatch sends global expert e to rank e // L"
            )
        self._expert_map_checked = True

    # --- prepare / finalize --------------------------------------------------------------

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config,
        defer_input_quant: bool = False,
    ):
        """Dispatch this rank's tokens; return what this rank's experts must process.

        a1 ``[T, H] bf16``, topk_weights ``[T, K] float32``, topk_ids ``[T, K]`` global ids.
        Returns ``(recv_x [W*R, H] bf16 or float8_e4m3fn, recv_scales (fp8: [W*R, H/128] or
        [W*R, 1] float32, else None), None, recv_ids [W*R, K] int32 global,
        recv_weights [W*R, K] float32)``; see the module docstring for ids and fp8.
        """
        quant_mode, unsupported = (None, None) if defer_input_quant else \
            dispatch_quant_mode(quant_config, a1.size(1))
        if unsupported is not None:
            raise NotImplementedError(f"vllm-petit-moe: {unsupported}")
        if a1.dtype != torch.bfloat16:
            raise NotImplementedError(
                f"vllm-petit-moe: MoE activations must be bfloat16, got {a1.dtype}"
            )
        if num_experts != self.num_experts:
            raise RuntimeError(
                f"vllm-petit-moe: layer called with {num_experts} experts, prepared for "
                f"{self.num_experts}"
            )
        self._check_expert_map(expert_map)

        if apply_router_weight_on_input:
            # Same contract as vLLM's allgather prepare: top-1 only, weight folded into x; the
            # experts then skip the weight (the dispatched weights are unused).
            if topk_ids.size(1) != 1:
                raise NotImplementedError(
                    "apply_router_weight_on_input is only supported for top-1 routing"
                )
            a1 = a1 * topk_weights.to(a1.dtype)

        buffer_key = id(self.buffer)
        pending = _PENDING_DISPATCH.get(buffer_key)
        if pending is not None:
            raise RuntimeError(
                "vllm-petit-moe: dispatch on a shared EpBuffer while a previous dispatch has not "
                "been combined (interleaved MoE layers, e.g. dual-batch overlap, are not "
                "supported)"
            )

        stride = self.region_stride(a1.size(0))
        self._num_rows = self.world_size * stride
        self._megamoe_step = self._megamoe_weights = None
        if 0 < stride <= self._megamoe_max_stride and (quant_mode is None
                                                        or self._megamoe_block_fp8):
            # the fused kernel takes the bf16 tokens (a block-fp8 layer's composed steps keep
            # vLLM's fp8 activations)
            return self._prepare_megamoe(a1, topk_weights, topk_ids, stride,
                                         apply_router_weight_on_input)
        if stride == 0:
            # All DP ranks have 0 tokens (equal on all ranks: nobody dispatches).
            hidden, top_k = a1.size(1), topk_ids.size(1)
            self._handle = None
            scales = None
            if quant_mode is not None:  # same dtypes and scale widths as a dispatch would give
                num_scales = hidden // FP8_SCALE_BLOCK if quant_mode in FP8_BLOCK_MODES else 1
                scales = a1.new_empty((0, num_scales), dtype=torch.float32)
            return (
                a1.new_empty((0, hidden), dtype=torch.float8_e4m3fn if quant_mode else a1.dtype),
                scales,
                None,
                topk_ids.new_empty((0, top_k), dtype=torch.int32),
                topk_weights.new_empty((0, top_k), dtype=torch.float32),
            )

        out = self.buffer.dispatch(
            a1.contiguous(),
            topk_ids.contiguous(),
            topk_weights.to(torch.float32).contiguous(),
            region_stride=stride,
            quant=quant_mode,
        )
        _PENDING_DISPATCH[buffer_key] = self
        self._handle = out.handle
        recv_ids = local_to_global_expert_ids(
            out.recv_topk_ids,
            rank=self.rank,
            num_local_experts=self.num_local_experts,
            world_size=self.world_size,
        )
        return out.recv_x, out.recv_x_scales, None, recv_ids, out.recv_topk_weights

    def _prepare_megamoe(self, a1, topk_weights, topk_ids, stride, weights_applied):
        """Record a fused step (no launch) and hand vLLM's experts step this rank's tokens."""
        x = a1.contiguous()
        ids = topk_ids.contiguous()
        weights = (torch.ones(topk_ids.shape, dtype=torch.float32, device=a1.device)
                   if weights_applied else topk_weights.to(torch.float32).contiguous())
        self._megamoe_step = (x, ids, weights, stride)
        _PENDING_DISPATCH[id(self.buffer)] = self
        if x.size(0) == 0:
            # vLLM runs no experts for an empty batch, but the fused call is collective: one
            # placeholder row makes it call PetitEpExperts.apply, which hands the weights over.
            return (x.new_zeros((1, x.size(1))), None, None,
                    ids.new_zeros((1, ids.size(1)), dtype=torch.int32),
                    weights.new_zeros((1, ids.size(1))))
        return x, None, None, ids, weights

    def _finalize_megamoe(self, output: torch.Tensor) -> None:
        (x, ids, weights, stride), self._megamoe_step = self._megamoe_step, None
        layer_weights, self._megamoe_weights = self._megamoe_weights, None
        _PENDING_DISPATCH.pop(id(self.buffer), None)
        if layer_weights is None:
            raise RuntimeError(
                "vllm-petit-moe: a fused-layer step reached finalize without the experts' "
                "weights; only PetitEpExperts can run behind a prepare/finalize with the fused "
                "layer enabled")
        w13, w2, scales = layer_weights
        target = output if output.is_contiguous() else torch.empty_like(x)
        self.buffer.megamoe(x, ids, weights, w13, w2, region_stride=stride, out=target,
                            **scales)
        if target is not output:
            output.copy_(target)

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl,
    ) -> None:
        """Combine the experts' rows back to their source ranks, into ``output [T, H]``.

        fused_expert_output: ``[W*R, H]`` (reduced experts) or ``[W*R, K, H]`` / ``[W*R*K, H]``
        (experts that delegate weighting and reduction); topk_weights / topk_ids are the
        dispatched ``[W*R, K]`` tensors that prepare returned.
        """
        if self._num_rows == 0:
            return
        if self._megamoe_step is not None:
            self._finalize_megamoe(output)
            return
        if isinstance(weight_and_reduce_impl, _TopKWeightAndReduceDelegate):
            weight_and_reduce_impl = _TopKWeightAndReduceContiguous()
        expert_out = weight_and_reduce_impl.apply(
            output=None,
            fused_expert_output=fused_expert_output,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            apply_router_weight_on_input=apply_router_weight_on_input,
        )
        expected_shape = (self._num_rows, output.size(1))
        if tuple(expert_out.shape) != expected_shape:
            raise RuntimeError(
                f"vllm-petit-moe: experts produced {tuple(expert_out.shape)}, combine needs the "
                f"local weighted sum {expected_shape}"
            )
        if expert_out.dtype != torch.bfloat16:
            expert_out = expert_out.to(torch.bfloat16)

        handle, self._handle = self._handle, None
        _PENDING_DISPATCH.pop(id(self.buffer), None)
        result = self.buffer.combine(expert_out.contiguous(), handle, out=output)
        if result is not None and result.data_ptr() != output.data_ptr():
            output.copy_(result)
