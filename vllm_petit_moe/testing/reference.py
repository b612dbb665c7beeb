"""Pure-torch reference of the expert-parallel MoE layer: the oracle for every kernel.

All ``W`` ranks of one node are simulated in one process. The data layout follows
``docs/architecture.md`` exactly (names ``W, E, L, T_s, R, K, H, I`` as defined there):

- dispatch: per-rank dedup; token ``i`` of source ``s`` is row ``s*R + i`` at every destination;
- per-local-expert row lists (the counting sort the expert kernels build on the GPU);
- experts with the local weighted reduction (one row per token per rank);
- combine: at most ``W`` rows per token, summed in fp32 in rank order.

Two precisions, used together to derive test tolerances (see :func:`tolerance`):

- ``"kernel"``: what our kernels compute: bf16 operands, fp32 accumulation, the SiLU·mul
  activation rounded to bf16 once, the local weighted sum rounded to bf16 once. bf16 outputs.
- ``"fp32"``: the same math on upcast inputs with no intermediate rounding. It is computed in
  float64 (so a global TF32 setting cannot leak into the oracle) and returned as float32.

Everything here may synchronize with the host (``.tolist()``, data-dependent shapes): this is
test and benchmark code, never the forward path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from vllm_petit_moe.limits import (FP8_BLOCK_MIN_AMAX, FP8_BLOCK_MODES, FP8_E4M3_MAX,
                                  FP8_QUANT_MODES, FP8_SCALE_BLOCK, FP8_TOKEN_MIN_SCALE,
                                  MAX_TOP_K, SIZE_MULTIPLE)

Precision = Literal["kernel", "fp32"]
Skew = Literal["one_expert", "hot_rank", "same_experts"]
# same_experts routing: the experts every token picks, a fixed draw (the same on every rank).
SAME_EXPERTS_SEED = 20261130

_ID_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- validation


def validate_config(
    num_experts: int,
    world_size: int,
    *,
    top_k: int | None = None,
    hidden_size: int | None = None,
) -> None:
    """Check the sizes of an EP MoE call against the limits of docs/architecture.md.

    Touches no tensor data, so the op layer can call it on the forward path. Raises
    ``ValueError`` naming the violated limit.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts % world_size != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by world_size ({world_size})"
        )
    if top_k is not None:
        _check_top_k(top_k)
    if hidden_size is not None:
        _check_hidden_size(hidden_size)


def _check_top_k(top_k: int) -> None:
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be in [1, {MAX_TOP_K}] (MAX_TOP_K), got {top_k}")


def _check_hidden_size(hidden_size: int) -> None:
    if hidden_size <= 0 or hidden_size % SIZE_MULTIPLE:
        raise ValueError(
            f"hidden_size must be a positive multiple of {SIZE_MULTIPLE}, got {hidden_size}"
        )


def validate_routing(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    world_size: int,
    *,
    hidden_size: int | None = None,
) -> None:
    """Check one rank's routing input: ``topk_ids [T, K] int32|int64``, ``topk_weights [T, K]
    float32``, ids in ``[-1, num_experts)`` (``-1`` = unused slot), plus :func:`validate_config`.

    Reads the ids (a host sync). Raises ``ValueError`` naming the violated limit.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D [T, K], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} must equal "
            f"topk_ids shape {tuple(topk_ids.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    validate_config(num_experts, world_size, top_k=topk_ids.shape[1], hidden_size=hidden_size)
    if topk_ids.numel() > 0:
        min_id, max_id = int(topk_ids.min()), int(topk_ids.max())
        if min_id < -1 or max_id >= num_experts:
            raise ValueError(
                f"expert ids must lie in [-1, {num_experts}) (num_experts={num_experts}), "
                f"found min {min_id}, max {max_id}"
            )


def _validate_sources(
    xs: Sequence[torch.Tensor],
    topk_ids: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    num_experts: int,
    region_stride: int | None,
) -> int:
    """Validate per-source inputs (one list entry per source rank); return the region stride."""
    world_size = len(xs)
    if world_size < 1:
        raise ValueError("need at least one source rank (xs is empty)")
    if len(topk_ids) != world_size or len(topk_weights) != world_size:
        raise ValueError(
            f"xs, topk_ids and topk_weights must have one entry per rank: got lengths "
            f"{len(xs)}, {len(topk_ids)}, {len(topk_weights)}"
        )
    hidden_size = xs[0].shape[-1]
    top_k = topk_ids[0].shape[-1]
    for rank, (x, ids, weights) in enumerate(zip(xs, topk_ids, topk_weights)):
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(
                f"xs[{rank}] must be a 2-D bfloat16 tensor [T, H], "
                f"got {x.dtype} of shape {tuple(x.shape)}"
            )
        if x.shape[1] != hidden_size:
            raise ValueError(f"xs[{rank}] has hidden size {x.shape[1]}, xs[0] has {hidden_size}")
        validate_routing(ids, weights, num_experts, world_size, hidden_size=hidden_size)
        if ids.shape[1] != top_k:
            raise ValueError(f"topk_ids[{rank}] has top_k {ids.shape[1]}, topk_ids[0] has {top_k}")
        if ids.shape[0] != x.shape[0]:
            raise ValueError(
                f"topk_ids[{rank}] has {ids.shape[0]} tokens, xs[{rank}] has {x.shape[0]}"
            )
    max_num_tokens = max(x.shape[0] for x in xs)
    if region_stride is None:
        return max_num_tokens
    if region_stride < max_num_tokens:
        raise ValueError(
            f"region_stride ({region_stride}) must be >= every rank's token count "
            f"(max is {max_num_tokens})"
        )
    return region_stride


# --------------------------------------------------------------------------- expert ownership


def owner_rank(expert_ids: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """Rank that owns each global expert id: ``id // (E / W)``; ``-1`` stays ``-1``.

    ``expert_ids``: any shape, int32|int64, values in ``[-1, E)``. Returns int64, same shape.
    """
    validate_config(num_experts, world_size)
    num_local_experts = num_experts // world_size
    expert_ids = expert_ids.long()
    return torch.where(expert_ids >= 0, expert_ids // num_local_experts, -1)


def local_expert_ids(
    expert_ids: torch.Tensor, rank: int, num_experts: int, world_size: int
) -> torch.Tensor:
    """Global ids as seen by ``rank``: ``id - rank*L`` where ``rank`` owns the id, else ``-1``.

    ``expert_ids``: any shape, int32|int64, values in ``[-1, E)``. Returns int32, same shape.
    """
    num_local_experts = num_experts // world_size
    is_local = owner_rank(expert_ids, num_experts, world_size) == rank
    local_ids = expert_ids.long() - rank * num_local_experts
    return torch.where(is_local, local_ids, -1).to(torch.int32)


# --------------------------------------------------------------------------- random routing


def random_topk(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    generator: torch.Generator,
    skew: Skew | None = None,
    world_size: int = 1,
    hot_fraction: float = 0.5,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing, deterministic from ``generator`` (created on the CPU or on ``device``).

    Returns ``topk_ids [T, K] int64`` (``K`` distinct experts per token, never ``-1``) and
    ``topk_weights [T, K] float32`` (positive, each row summing to 1), on ``device``
    (default: the generator's device).

    ``skew``:
      - ``None``: every token picks ``K`` distinct experts uniformly.
      - ``"one_expert"``: every token's first choice is expert 0 (all tokens hit one expert);
        the other ``K-1`` choices are uniform over the remaining experts.
      - ``"hot_rank"``: each token-expert pair lands on rank 0's experts with probability
        ``hot_fraction`` (the 40-60% hot rank seen in serving), as far as distinctness allows
        (a token has at most ``L`` pairs on rank 0 and at most ``E-L`` elsewhere). The slot
        order of each token is shuffled.
      - ``"same_experts"``: every token picks the same ``K`` experts, a fixed random draw
        (``SAME_EXPERTS_SEED``: the same set for every call and rank, wherever the generator
        is): every decode token routing alike, as in a `vllm serve --load-format dummy`
        decode step, where every sequence emits the same token (README, "Where a decode
        step's time goes"; examples/dummy_routing_cpu.py). Only the weights stay random.
    """
    validate_config(num_experts, world_size, top_k=top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
    if not 0.0 <= hot_fraction <= 1.0:
        raise ValueError(f"hot_fraction must be in [0, 1], got {hot_fraction}")

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator, device=generator.device)

    def distinct_random(num_choices: int, num_picks: int) -> torch.Tensor:
        # A random permutation of range(num_choices) per token, truncated.
        return rand(num_tokens, num_choices).argsort(dim=1)[:, :num_picks]

    num_local_experts = num_experts // world_size
    if skew is None or (skew == "hot_rank" and world_size == 1):
        topk_ids = distinct_random(num_experts, top_k)
    elif skew == "one_expert":
        others = distinct_random(num_experts - 1, top_k - 1) + 1
        first_choice = torch.zeros(num_tokens, 1, dtype=others.dtype, device=others.device)
        topk_ids = torch.cat([first_choice, others], dim=1)
    elif skew == "hot_rank":
        num_cold_experts = num_experts - num_local_experts
        num_hot = (rand(num_tokens, top_k) < hot_fraction).sum(dim=1, keepdim=True)
        num_hot = num_hot.clamp(
            min=max(0, top_k - num_cold_experts), max=min(num_local_experts, top_k)
        )
        hot = distinct_random(num_local_experts, top_k)
        cold = distinct_random(num_cold_experts, top_k) + num_local_experts
        slot_idx = torch.arange(top_k, device=generator.device).expand(num_tokens, top_k)
        # Slots [0, num_hot) take hot experts, the rest take cold ones, each without repeats.
        hot_pick = hot.gather(1, slot_idx.clamp(max=hot.shape[1] - 1))
        cold_pick = cold.gather(1, (slot_idx - num_hot).clamp(0, cold.shape[1] - 1))
        topk_ids = torch.where(slot_idx < num_hot, hot_pick, cold_pick)
        topk_ids = topk_ids.gather(1, rand(num_tokens, top_k).argsort(dim=1))
    elif skew == "same_experts":
        fixed = torch.randperm(num_experts, generator=torch.Generator().manual_seed(
            SAME_EXPERTS_SEED))[:top_k].to(generator.device)
        topk_ids = fixed.expand(num_tokens, top_k).clone()
    else:
        raise ValueError(f"unknown skew {skew!r}; expected None, 'one_expert', 'hot_rank' or "
                         f"'same_experts'")

    raw_weights = rand(num_tokens, top_k) + 0.05
    topk_weights = raw_weights / raw_weights.sum(dim=1, keepdim=True)
    return topk_ids.to(device), topk_weights.to(device=device, dtype=torch.float32)


# --------------------------------------------------------------------------- dispatch


@dataclass
class DispatchOutput:
    """What destination rank ``d`` holds after one dispatch (``N = W*R`` rows).

    recv_x: ``[N, H] bf16``; row ``s*R+i`` = ``x_s[i]`` if that token is routed to ``d``,
        else zero (kernels leave it stale: compare only rows where ``routed_mask`` is set).
    recv_topk_ids: ``[N, K] int32``; local expert ids (``global - d*L``) or ``-1``.
    recv_topk_weights: ``[N, K] float32``; the weight where the id is local, else ``0.0``.
    routed_mask: ``[N] bool``; whether the row holds a token routed to ``d``.
    """

    recv_x: torch.Tensor
    recv_topk_ids: torch.Tensor
    recv_topk_weights: torch.Tensor
    routed_mask: torch.Tensor
    recv_x_scales: torch.Tensor | None = None  # fp8 dispatch: [N, H/128] or [N, 1] float32


# --------------------------------------------------------------------------- fp8

# The constants (FP8_E4M3_MAX, FP8_SCALE_BLOCK, ...) and modes come from vllm_petit_moe.limits.
Fp8Quant = Literal["fp8_block128", "fp8_per_token", "fp8_block128_ue8m0"]


def pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= y (float32, positive normal), exact on the bits: the UE8M0
    scale (2^ceil(log2 y)) vLLM uses when its DeepGEMM E8M0 scales are on. NaN and infinity
    stay as they are (as exp2(ceil(log2 y)) keeps them)."""
    bits = y.float().contiguous().view(torch.int32)
    up = (bits & 0x7F800000) + 0x800000
    keep = ((bits & 0x7FFFFF) == 0) | ((bits & 0x7F800000) == 0x7F800000)
    return torch.where(keep, bits, up).view(torch.float32)


def quantize_fp8_reference(x: torch.Tensor, mode: Fp8Quant) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic fp8 e4m3 quantization of activations, exactly as dispatch does it at the source.

    x: ``[T, H] bf16``. ``"fp8_block128"``: one scale per 1x128 block (``H % 128 == 0``),
    ``s = max(amax, 1e-10) / 448``, ``q = clamp(x / s)``; scales ``[T, H/128]``.
    ``"fp8_block128_ue8m0"``: the same with ``s`` rounded up to a power of two.
    ``"fp8_per_token"``: ``s = max(amax / 448, 1/(448*512))``, ``q = clamp(x * (1/s))``;
    scales ``[T, 1]``. The clamp is to ``[-448, 448]`` in fp32, then round-to-nearest-even to
    ``float8_e4m3fn``. Returns ``(q [T, H] float8_e4m3fn, scales float32)``;
    ``q.float() * scales`` (broadcast per block / token) dequantizes.
    """
    if mode not in FP8_QUANT_MODES:
        raise ValueError(f"fp8 mode must be one of {FP8_QUANT_MODES}, got {mode!r}")
    num_tokens, hidden_size = x.shape
    xf = x.float()
    # Every division is tensor / tensor: torch turns division by a Python number into a
    # multiplication by its (rounded) reciprocal, which is not the IEEE quotient the kernel
    # computes.
    if mode in FP8_BLOCK_MODES:
        if hidden_size % FP8_SCALE_BLOCK:
            raise ValueError(f"{mode} needs hidden_size % {FP8_SCALE_BLOCK} == 0, got "
                             f"{hidden_size}")
        blocks = xf.view(num_tokens, hidden_size // FP8_SCALE_BLOCK, FP8_SCALE_BLOCK)
        amax = blocks.abs().amax(dim=-1).clamp(min=FP8_BLOCK_MIN_AMAX)
        scales = amax / torch.full_like(amax, FP8_E4M3_MAX)
        if mode == "fp8_block128_ue8m0":
            scales = pow2_ceil(scales)
        q = (blocks / scales[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return q.view(num_tokens, hidden_size).to(torch.float8_e4m3fn), scales
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scales = (amax / torch.full_like(amax, FP8_E4M3_MAX)).clamp(min=FP8_TOKEN_MIN_SCALE)
    q = (xf * (torch.ones_like(scales) / scales)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scales


def block_fp8_quantize(w: torch.Tensor, block: int = 128
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert weights ``[L, R, C]`` (R, C multiples of ``block``) as an fp8 checkpoint stores
    them: (e4m3 ``[L, R, C]``, fp32 scales ``[L, R/block, C/block]`` with scale = block amax /
    448, the dequantized weights e4m3 · scale in float32)."""
    num, rows, cols = w.shape
    blocks = w.float().view(num, rows // block, block, cols // block, block)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / FP8_E4M3_MAX
    expand = scale[:, :, None, :, None]
    q = (blocks / expand).to(torch.float8_e4m3fn)
    deq = (q.float() * expand).view(num, rows, cols)
    return q.view(num, rows, cols).contiguous(), scale.contiguous(), deq


def dequantize_fp8_reference(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` float32 from :func:`quantize_fp8_reference`'s output (either mode)."""
    num_tokens, hidden_size = q.shape
    group = hidden_size // scales.shape[1]
    return (q.float().view(num_tokens, scales.shape[1], group) * scales[..., None]).view(
        num_tokens, hidden_size)


def dispatch_reference(
    xs: Sequence[torch.Tensor],
    topk_ids: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    num_experts: int,
    region_stride: int | None = None,
    quant: Fp8Quant | None = None,
) -> list[DispatchOutput]:
    """Dispatch of all ``W = len(xs)`` ranks at once.

    xs[s]: ``[T_s, H] bf16``; topk_ids[s]: ``[T_s, K] int32|int64`` global ids or ``-1``;
    topk_weights[s]: ``[T_s, K] float32``. ``region_stride`` (``R``) defaults to ``max T_s``
    and must be ``>= max T_s``. ``quant``: ``None`` (bf16 rows) or an fp8 mode of
    :func:`quantize_fp8_reference` (rows ``float8_e4m3fn`` + ``recv_x_scales``).
    Returns one :class:`DispatchOutput` per destination rank.
    """
    region_stride = _validate_sources(xs, topk_ids, topk_weights, num_experts, region_stride)
    world_size = len(xs)
    hidden_size, top_k = xs[0].shape[1], topk_ids[0].shape[1]
    num_rows = world_size * region_stride
    device = xs[0].device
    quantized = [quantize_fp8_reference(x, quant) for x in xs] if quant else None

    outputs = []
    for dst_rank in range(world_size):
        recv_x = torch.zeros(num_rows, hidden_size, dtype=torch.bfloat16, device=device)
        recv_scales = None
        if quantized:
            recv_x = recv_x.to(torch.float8_e4m3fn)
            recv_scales = torch.zeros(num_rows, quantized[0][1].shape[1], dtype=torch.float32,
                                      device=device)
        recv_ids = torch.full((num_rows, top_k), -1, dtype=torch.int32, device=device)
        recv_weights = torch.zeros(num_rows, top_k, dtype=torch.float32, device=device)
        routed_mask = torch.zeros(num_rows, dtype=torch.bool, device=device)
        for src_rank, (x, ids, weights) in enumerate(zip(xs, topk_ids, topk_weights)):
            rows = slice(src_rank * region_stride, src_rank * region_stride + x.shape[0])
            local_ids = local_expert_ids(ids, dst_rank, num_experts, world_size)
            is_local = local_ids >= 0
            routed = is_local.any(dim=1)  # per-rank dedup: one row however many local hits
            recv_ids[rows] = local_ids
            recv_weights[rows] = torch.where(is_local, weights, 0.0)
            if quantized:
                q, scales = quantized[src_rank]
                recv_x[rows] = q  # compare only routed rows (routed_mask)
                recv_scales[rows] = scales
            else:
                recv_x[rows] = torch.where(routed[:, None], x, 0)
            routed_mask[rows] = routed
        outputs.append(DispatchOutput(recv_x, recv_ids, recv_weights, routed_mask, recv_scales))
    return outputs


# --------------------------------------------------------------------------- experts


def expert_row_lists_reference(
    recv_topk_ids: torch.Tensor, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-local-expert row lists (counting sort) of ``recv_topk_ids [N, K] int32``.

    Entries are numbered ``entry = row*K + k``. Returns
    ``expert_counts [L] int32`` (entries per local expert),
    ``expert_offsets [L+1] int32`` (exclusive prefix sum; ``offsets[L]`` = total) and
    ``sorted_entries [N*K] int32`` (expert ``e``'s entries at ``[offsets[e], offsets[e+1])``,
    ascending; positions ``>= offsets[L]`` hold ``-1``).
    """
    if recv_topk_ids.dim() != 2:
        raise ValueError(f"recv_topk_ids must be 2-D [N, K], got {tuple(recv_topk_ids.shape)}")
    if num_local_experts < 1:
        raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")
    flat_ids = recv_topk_ids.reshape(-1).long()
    if flat_ids.numel() > 0:
        min_id, max_id = int(flat_ids.min()), int(flat_ids.max())
        if min_id < -1 or max_id >= num_local_experts:
            raise ValueError(
                f"local expert ids must lie in [-1, {num_local_experts}) "
                f"(num_local_experts={num_local_experts}), found min {min_id}, max {max_id}"
            )
    is_valid = flat_ids >= 0
    counts = torch.bincount(flat_ids[is_valid], minlength=num_local_experts)
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=flat_ids.device)
    offsets[1:] = counts.cumsum(0)
    # Unused slots sort last (key L); a stable sort keeps each expert's entries ascending.
    sort_keys = torch.where(is_valid, flat_ids, num_local_experts)
    order = torch.sort(sort_keys, stable=True).indices
    sorted_entries = torch.where(sort_keys[order] < num_local_experts, order, -1)
    return counts.to(torch.int32), offsets.to(torch.int32), sorted_entries.to(torch.int32)


def _validate_expert_inputs(
    recv_x: torch.Tensor,
    recv_topk_ids: torch.Tensor,
    recv_topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> None:
    num_rows, hidden_size = recv_x.shape
    if recv_x.dtype != torch.bfloat16:
        raise ValueError(f"recv_x must be bfloat16, got {recv_x.dtype}")
    _check_top_k(recv_topk_ids.shape[1])
    _check_hidden_size(hidden_size)
    if recv_topk_ids.shape[0] != num_rows or recv_topk_weights.shape != recv_topk_ids.shape:
        raise ValueError(
            f"recv_topk_ids {tuple(recv_topk_ids.shape)} and recv_topk_weights "
            f"{tuple(recv_topk_weights.shape)} must both be [N={num_rows}, K]"
        )
    if recv_topk_weights.dtype != torch.float32:
        raise ValueError(f"recv_topk_weights must be float32, got {recv_topk_weights.dtype}")
    if w13.dim() != 3 or w13.shape[2] != hidden_size or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [L, 2I, H={hidden_size}], got {tuple(w13.shape)}")
    num_local_experts, intermediate_size = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_local_experts, hidden_size, intermediate_size):
        raise ValueError(
            f"w2 must be [L={num_local_experts}, H={hidden_size}, I={intermediate_size}], "
            f"got {tuple(w2.shape)}"
        )
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise ValueError(f"w13 and w2 must be bfloat16, got {w13.dtype} and {w2.dtype}")


def experts_reference(
    recv_x: torch.Tensor,
    recv_topk_ids: torch.Tensor,
    recv_topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    precision: Precision = "kernel",
) -> torch.Tensor:
    """Local experts with the local weighted reduction, at one destination rank.

    recv_x ``[N, H] bf16``, recv_topk_ids ``[N, K] int32`` (local ids or ``-1``),
    recv_topk_weights ``[N, K] float32``, w13 ``[L, 2I, H] bf16`` (gate rows ``[0, I)``, up rows
    ``[I, 2I)``), w2 ``[L, H, I] bf16``. Returns expert_out ``[N, H]``:
    ``Σ_{k: id >= 0} w[r,k] · expert_{id}(recv_x[r])``; rows whose ids are all ``-1`` are 0.

    ``"kernel"`` precision: both GEMMs on bf16 values with fp32 accumulation, the activation
    ``silu(gate)*up`` in fp32 rounded to bf16 once, each entry's weighted down-projection
    rounded to bf16, their sum over a row's local experts in fp32 (ascending local expert
    order) rounded to bf16 once; returns bf16.
    ``"fp32"``: the same in float64 without intermediate rounding; returns float32.

    Works expert by expert on the row lists of :func:`expert_row_lists_reference`, gathering
    only the routed rows, so it stays fast for many rows.
    """
    _validate_expert_inputs(recv_x, recv_topk_ids, recv_topk_weights, w13, w2)
    if precision not in ("kernel", "fp32"):
        raise ValueError(f"precision must be 'kernel' or 'fp32', got {precision!r}")
    compute_dtype = torch.float32 if precision == "kernel" else torch.float64
    num_local_experts, intermediate_size = w13.shape[0], w13.shape[1] // 2
    top_k = recv_topk_ids.shape[1]

    _, offsets, sorted_entries = expert_row_lists_reference(recv_topk_ids, num_local_experts)
    flat_weights = recv_topk_weights.reshape(-1).to(compute_dtype)
    out = torch.zeros(recv_x.shape, dtype=compute_dtype, device=recv_x.device)
    offsets_list = offsets.tolist()
    for expert_idx in range(num_local_experts):
        entries = sorted_entries[offsets_list[expert_idx] : offsets_list[expert_idx + 1]].long()
        if entries.numel() == 0:
            continue
        row_idx = entries // top_k
        # bf16 x bf16 products are exact in fp32 (and in TF32), so upcast-then-matmul is the
        # kernel's bf16-operand GEMM with fp32 accumulation.
        x = recv_x[row_idx].to(compute_dtype)
        gate_up = x @ w13[expert_idx].to(compute_dtype).T
        activation = F.silu(gate_up[:, :intermediate_size]) * gate_up[:, intermediate_size:]
        if precision == "kernel":
            activation = activation.to(torch.bfloat16).to(compute_dtype)
        down = activation @ w2[expert_idx].to(compute_dtype).T
        weighted = down * flat_weights[entries, None]
        if precision == "kernel":  # each entry's weighted row is stored in bf16
            weighted = weighted.to(torch.bfloat16).to(compute_dtype)
        out.index_add_(0, row_idx, weighted)
    return out.to(torch.bfloat16 if precision == "kernel" else torch.float32)


def identity_experts_reference(
    recv_x: torch.Tensor, recv_topk_ids: torch.Tensor, recv_topk_weights: torch.Tensor
) -> torch.Tensor:
    """Experts replaced by the identity: ``bf16(fp32(recv_x[r]) · Σ_{k: id >= 0} w[r,k])``.

    recv_x ``[N, H] bf16``, recv_topk_ids ``[N, K] int32``, recv_topk_weights ``[N, K] float32``.
    Returns ``[N, H] bf16``. With dispatch and combine around it, the layer returns its input
    (within bf16 rounding) when each token's weights sum to 1.
    """
    local_weight_sum = torch.where(recv_topk_ids >= 0, recv_topk_weights, 0.0).sum(dim=1)
    return (recv_x.float() * local_weight_sum[:, None]).to(torch.bfloat16)


# --------------------------------------------------------------------------- combine


def combine_reference(
    expert_outs: Sequence[torch.Tensor],
    topk_ids: Sequence[torch.Tensor],
    num_experts: int,
) -> list[torch.Tensor]:
    """Combine of all ``W = len(expert_outs)`` ranks at once.

    expert_outs[d]: ``[W*R, H]`` bf16 (or float32) expert output at destination ``d``; only
    rows routed to ``d`` are read. topk_ids[s]: ``[T_s, K]`` global ids or ``-1`` of source
    ``s`` (they decide which destinations a token was routed to; ``R`` is
    ``expert_outs[d].shape[0] // W``). Returns ``y[s] [T_s, H]``:
    ``y[i] = round(Σ_{d routed by token i, d = 0..W-1} expert_out_d[s*R + i])``, summed in fp32
    and rounded to bf16 for bf16 inputs (bit-exact target for the combine kernel), summed in
    float64 and returned as float32 for float32 inputs. Tokens with no valid id get 0.
    """
    world_size = len(expert_outs)
    if world_size < 1 or len(topk_ids) != world_size:
        raise ValueError(
            f"expert_outs and topk_ids must have one entry per rank: got lengths "
            f"{len(expert_outs)}, {len(topk_ids)}"
        )
    validate_config(num_experts, world_size)
    out_dtype = expert_outs[0].dtype
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"expert_outs must be bfloat16 or float32, got {out_dtype}")
    num_rows = expert_outs[0].shape[0]
    if num_rows % world_size:
        raise ValueError(f"expert_outs rows ({num_rows}) must be W*R with W={world_size}")
    if any(out.shape != expert_outs[0].shape or out.dtype != out_dtype for out in expert_outs):
        raise ValueError("all expert_outs must share one shape [W*R, H] and dtype")
    region_stride = num_rows // world_size
    accumulate_dtype = torch.float32 if out_dtype == torch.bfloat16 else torch.float64

    ys = []
    for src_rank, ids in enumerate(topk_ids):
        num_tokens = ids.shape[0]
        if num_tokens > region_stride:
            raise ValueError(
                f"topk_ids[{src_rank}] has {num_tokens} tokens, more than the region stride "
                f"R={region_stride} implied by expert_outs"
            )
        device = expert_outs[0].device
        owners = owner_rank(ids.to(device), num_experts, world_size)
        rows = slice(src_rank * region_stride, src_rank * region_stride + num_tokens)
        acc = torch.zeros(num_tokens, expert_outs[0].shape[1], dtype=accumulate_dtype, device=device)
        for dst_rank, expert_out in enumerate(expert_outs):
            routed = (owners == dst_rank).any(dim=1)
            # Adding +0.0 for unrouted destinations leaves the rank-order sum bit-identical.
            acc += torch.where(routed[:, None], expert_out[rows].to(accumulate_dtype), 0.0)
        ys.append(acc.to(out_dtype))
    return ys


# --------------------------------------------------------------------------- whole layer


def ep_moe_reference(
    xs: Sequence[torch.Tensor],
    topk_ids: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    w13_global: torch.Tensor,
    w2_global: torch.Tensor,
    world_size: int,
    precision: Precision = "kernel",
    region_stride: int | None = None,
) -> list[torch.Tensor]:
    """The whole EP MoE layer: dispatch -> each rank's experts -> combine.

    xs / topk_ids / topk_weights: one entry per source rank, as in :func:`dispatch_reference`.
    w13_global ``[E, 2I, H] bf16``, w2_global ``[E, H, I] bf16``; rank ``d`` runs experts
    ``[d*L, (d+1)*L)``. Returns ``y[s] [T_s, H]``: bf16 for ``"kernel"``, float32 for ``"fp32"``.
    """
    if len(xs) != world_size:
        raise ValueError(f"expected one entry per rank (world_size={world_size}), got {len(xs)}")
    num_experts = w13_global.shape[0]
    validate_config(num_experts, world_size)
    num_local_experts = num_experts // world_size
    dispatched = dispatch_reference(xs, topk_ids, topk_weights, num_experts, region_stride)
    expert_outs = []
    for dst_rank, received in enumerate(dispatched):
        local = slice(dst_rank * num_local_experts, (dst_rank + 1) * num_local_experts)
        expert_outs.append(
            experts_reference(
                received.recv_x,
                received.recv_topk_ids,
                received.recv_topk_weights,
                w13_global[local],
                w2_global[local],
                precision,
            )
        )
    return combine_reference(expert_outs, topk_ids, num_experts)


def dense_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    precision: Literal["fp32", "fp64"] = "fp64",
) -> torch.Tensor:
    """Single-rank MoE, written directly: ``y[t] = Σ_{k: id >= 0} w[t,k] · expert_{id}(x[t])``.

    x ``[T, H]``, topk_ids ``[T, K]`` global ids or ``-1``, topk_weights ``[T, K]``,
    w13 ``[E, 2I, H]``, w2 ``[E, H, I]``. All math in ``precision`` (float32 or float64) on
    upcast inputs, no rounding in between; returns ``[T, H]`` in that dtype.
    """
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[precision]
    intermediate_size = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for expert_idx in range(w13.shape[0]):
        token_weight = torch.where(topk_ids == expert_idx, topk_weights.to(dtype), 0.0).sum(dim=1)
        token_idx = (topk_ids == expert_idx).any(dim=1).nonzero().squeeze(1)
        if token_idx.numel() == 0:
            continue
        x_e = x[token_idx].to(dtype)
        gate = x_e @ w13[expert_idx, :intermediate_size].to(dtype).T
        up = x_e @ w13[expert_idx, intermediate_size:].to(dtype).T
        expert_out = (F.silu(gate) * up) @ w2[expert_idx].to(dtype).T
        y[token_idx] += token_weight[token_idx, None] * expert_out
    return y


# --------------------------------------------------------------------------- tolerances


@dataclass(frozen=True)
class Tolerance:
    """Error bounds of a candidate against the fp32-mode reference (see :func:`tolerance`).

    max_abs: bound on ``max |candidate - fp32_ref|``.
    rel_fro: bound on ``||candidate - fp32_ref||_F / ||fp32_ref||_F``.
    """

    max_abs: float
    rel_fro: float


TensorOrList = torch.Tensor | Sequence[torch.Tensor]


def _flat_float64(tensors: TensorOrList) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def _errors(candidate: TensorOrList, fp32_ref: TensorOrList) -> tuple[float, float]:
    """(max abs error, relative Frobenius error) of ``candidate`` against ``fp32_ref``."""
    cand, ref = _flat_float64(candidate), _flat_float64(fp32_ref)
    if cand.shape != ref.shape:
        raise ValueError(f"candidate has {cand.numel()} elements, reference {ref.numel()}")
    if cand.numel() == 0:
        return 0.0, 0.0
    diff = cand - ref
    max_abs = float(diff.abs().max())
    diff_norm, ref_norm = float(diff.norm()), float(ref.norm())
    if ref_norm > 0:
        rel_fro = diff_norm / ref_norm
    else:
        rel_fro = 0.0 if diff_norm == 0 else float("inf")
    return max_abs, rel_fro


def tolerance(
    kernel_ref: TensorOrList, fp32_ref: TensorOrList, *, factor: float = 2.0
) -> Tolerance:
    """Tolerance for a bf16 kernel, derived from the reference's own bf16-vs-fp32 error.

    ``kernel_ref`` and ``fp32_ref`` are the same reference computation (a tensor or a list of
    tensors, e.g. per-source outputs) in ``"kernel"`` and ``"fp32"`` precision. Their
    difference is what bf16 rounding costs on exactly this problem (shapes, data, routing). A
    kernel doing the same math in another order may round differently, so it may err
    ``factor`` times as much, plus a floor for problems the reference happens to get (almost)
    exactly right:

        max_abs = factor * max|kernel_ref - fp32_ref|             + 2**-9 * max|fp32_ref|
        rel_fro = factor * ||kernel_ref - fp32_ref|| / ||fp32_ref|| + 2**-12

    (``2**-9 * max|fp32_ref|`` is at most half a bf16 ulp of the largest element.) Use with
    :func:`check_close`, which compares the candidate against ``fp32_ref``.
    """
    max_abs, rel_fro = _errors(kernel_ref, fp32_ref)
    ref_flat = _flat_float64(fp32_ref)
    ref_max = float(ref_flat.abs().max()) if ref_flat.numel() else 0.0
    return tolerance_from_errors(max_abs, rel_fro, ref_max, factor=factor)


def tolerance_from_errors(max_abs: float, rel_fro: float, ref_max: float, *,
                          factor: float = 2.0) -> Tolerance:
    """:func:`tolerance` from the reference's own errors (max abs, relative Frobenius) and
    ``max|fp32_ref|``, for callers that compute them elsewhere (on the device)."""
    return Tolerance(
        max_abs=factor * max_abs + 2.0**-9 * ref_max,
        rel_fro=factor * rel_fro + 2.0**-12,
    )


def check_close(
    candidate: TensorOrList, fp32_ref: TensorOrList, tol: Tolerance, *, name: str = "output"
) -> None:
    """Raise ``AssertionError`` unless ``candidate`` is within ``tol`` of ``fp32_ref`` in both
    max-abs and relative-Frobenius error (NaN or inf anywhere fails)."""
    max_abs, rel_fro = _errors(candidate, fp32_ref)
    if not (max_abs <= tol.max_abs and rel_fro <= tol.rel_fro):
        raise AssertionError(
            f"{name} differs from the fp32 reference: max abs error {max_abs:.3e} "
            f"(bound {tol.max_abs:.3e}), relative Frobenius error {rel_fro:.3e} "
            f"(bound {tol.rel_fro:.3e})"
        )
