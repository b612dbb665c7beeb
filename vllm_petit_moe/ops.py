"""Python ops over the compiled kernels that are not tied to an ``EpBuffer``.

``experts_forward``: this rank's local experts on the dispatch layout, with the local weighted
reduction (docs/architecture.md, "Expert kernels"). Everything runs on the current CUDA stream
with no host synchronization, so it can be captured in a CUDA graph; the checks below read
only shapes, dtypes and devices.

The compiled extension is imported on first use, so importing this module needs no GPU.
"""

from __future__ import annotations

import torch

from .config import ExpertConfig, as_dict
from .limits import (DEFAULT_TIMEOUT_S, FP8_SCALE_BLOCK, MAX_ENTRIES, MAX_LOCAL_EXPERTS,
                     MAX_TOP_K, MEGAMOE_MAX_ENTRIES, MEGAMOE_SIZE_MULTIPLE, SIZE_MULTIPLE,
                     check_timeout_s)

TILES = {"auto": 0, "simt": 1, "wgmma_narrow": 2, "wgmma_m64": 3, "wgmma": 4, "wgmma_mc": 5}
"""Tile families of the expert GEMMs (csrc/api.h ExpertTiles). ``auto`` (the default) chooses;
the others force one, for tests and debugging (``VLLM_PETIT_MOE_EXPERTS_TILES``):

- the Hopper family (sm_90a: H100/H200; warp-specialized wgmma, a producer warpgroup loading
  the rows by cp.async and the weights by TMA) in four regimes: ``wgmma_narrow`` (64 x 128
  tiles) and ``wgmma_m64`` (64 x 256 tiles), each running both GEMMs of a call as one fused
  launch; ``wgmma`` (128 x 256 tiles, a launch per GEMM); ``wgmma_mc`` (the ``wgmma`` tiles in
  clusters of 2 CTAs that load each weight tile once for both, TMA multicast).
  ``wgmma_narrow`` and ``wgmma_m64`` give the same bits, as do ``wgmma`` and ``wgmma_mc``.
  They fail with "operation not supported" where the GPU or the build lacks sm_90a (HIP,
  other GPUs, a build without 9.0a in TORCH_CUDA_ARCH_LIST);
- ``simt``: the portable fallback, its 16-row tiles below ``ExpertConfig.simt_large_min_rows``
  routing entries per local expert and its 128-row tiles from there.

``auto``, by the routing entries (rows x top_k) per local expert and the bounds of
:class:`~vllm_petit_moe.config.ExpertConfig`: where the GPU runs sm_90a, ``wgmma_narrow`` below
``narrow_max_rows`` (2), ``wgmma_m64`` below ``m64_max_rows`` (96; its fused kernel runs the
narrow tiles instead where the m64 ones would leave more than half of the SMs without a tile,
decided on the device from how the entries spread over the experts), ``wgmma_mc`` from
``mc_min_rows`` (256) at hidden sizes from ``mc_min_hidden`` (4096), ``wgmma`` otherwise;
elsewhere ``simt``."""
TILE_NAMES = {code: name for name, code in TILES.items()}


def _ops():
    from . import load_extension  # imported lazily so CPU-only code never needs it

    return load_extension()


def experts_workspace_shapes(
    num_rows: int, top_k: int, hidden_size: int, intermediate_size: int
) -> tuple[tuple[tuple[int, int], torch.dtype], tuple[tuple[int, int], torch.dtype]]:
    """Shapes and dtypes of the two workspaces of :func:`experts_forward`:

    - act ``[N*K, I] bfloat16``: the SiLU·mul activation of every routing entry, in the
      per-expert sorted order (only the first ``#valid entries`` rows are written);
    - partial ``[N*K, H] bfloat16``: the weighted down-projection of every routing entry,
      rounded to bf16 (as vLLM's Triton experts round theirs before the sum), indexed by the
      entry ``row*K + k`` (only valid entries are written).

    The partial workspace is what makes the local reduction deterministic (each token's <= K
    entries are summed afterwards in fp32, in slot order); it is ``N*K*H*2`` bytes, e.g.
    0.9 GiB for N = 8192 rows, K = 8, H = 7168.
    """
    entries = num_rows * top_k
    return ((entries, intermediate_size), torch.bfloat16), ((entries, hidden_size), torch.bfloat16)


def validate_experts_inputs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    allow_fp8: bool = False,
) -> None:
    """Raise ``ValueError`` naming the limit if :func:`experts_forward` (or
    :func:`megamoe_forward`, which has further limits and, with ``allow_fp8``, also takes
    float8_e4m3fn weights) cannot take these tensors. Reads shapes, dtypes and devices only (no
    host sync)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be a 2-D bfloat16 tensor [N, H], got {x.dtype} {tuple(x.shape)}")
    num_rows, hidden_size = x.shape
    if hidden_size <= 0 or hidden_size % SIZE_MULTIPLE:
        raise ValueError(
            f"hidden size H={hidden_size} must be a positive multiple of {SIZE_MULTIPLE}"
        )
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32:
        raise ValueError(
            f"topk_ids must be a 2-D int32 tensor [N, K], got {topk_ids.dtype} "
            f"{tuple(topk_ids.shape)}"
        )
    top_k = topk_ids.shape[1]
    if topk_ids.shape[0] != num_rows or tuple(topk_weights.shape) != (num_rows, top_k):
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [N={num_rows}, K]"
        )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top-k K={top_k} must be in [1, {MAX_TOP_K}] (MAX_TOP_K)")
    if num_rows * top_k > MAX_ENTRIES:
        raise ValueError(f"N*K = {num_rows * top_k} routing entries exceed {MAX_ENTRIES}")
    weight_dtypes = (torch.bfloat16, torch.float8_e4m3fn) if allow_fp8 else (torch.bfloat16,)
    if w13.dtype not in weight_dtypes or w2.dtype != w13.dtype:
        raise ValueError(
            f"w13 and w2 must both be {' or '.join(str(d) for d in weight_dtypes)}, got "
            f"{w13.dtype} and {w2.dtype}"
        )
    if w13.dim() != 3 or w13.shape[2] != hidden_size or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [L, 2I, H={hidden_size}], got {tuple(w13.shape)}")
    num_local_experts, intermediate_size = w13.shape[0], w13.shape[1] // 2
    if not 1 <= num_local_experts <= MAX_LOCAL_EXPERTS:
        raise ValueError(
            f"L={num_local_experts} local experts must be in [1, {MAX_LOCAL_EXPERTS}] "
            "(MAX_LOCAL_EXPERTS)"
        )
    if intermediate_size <= 0 or intermediate_size % SIZE_MULTIPLE:
        raise ValueError(
            f"intermediate size I={intermediate_size} must be a positive multiple of "
            f"{SIZE_MULTIPLE}"
        )
    if tuple(w2.shape) != (num_local_experts, hidden_size, intermediate_size):
        raise ValueError(
            f"w2 must be [L={num_local_experts}, H={hidden_size}, I={intermediate_size}], "
            f"got {tuple(w2.shape)}"
        )
    tensors = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "w13": w13, "w2": w2}
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")


def _check_expert_map(expert_map: torch.Tensor | None, device: torch.device) -> None:
    if expert_map is not None and (
        expert_map.dim() != 1 or expert_map.dtype != torch.int32 or expert_map.numel() == 0
        or not expert_map.is_contiguous() or expert_map.device != device
    ):
        raise ValueError(
            f"expert_map must be a contiguous non-empty int32 [E] tensor on {device}, "
            f"got {expert_map.dtype} {tuple(expert_map.shape)} on {expert_map.device}"
        )


def experts_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    act_workspace: torch.Tensor | None = None,
    partial_workspace: torch.Tensor | None = None,
    tiles: str = "auto",
    config: ExpertConfig | None = None,
) -> torch.Tensor:
    """This rank's local experts with the local weighted reduction.

    x ``[N, H] bfloat16``: the rows, e.g. dispatch's ``recv_x`` (rows with no local id are
        never read).
    topk_ids ``[N, K] int32``: local expert ids ``0..L-1``; ``-1`` (or any id outside
        ``[0, L)``) marks a slot this rank does not serve. With ``expert_map``: global ids.
    topk_weights ``[N, K] float32``: routing weights (read for valid slots only).
    w13 ``[L, 2I, H] bfloat16``: gate rows ``[0, I)``, up rows ``[I, 2I)`` (vLLM's layout).
    w2 ``[L, H, I] bfloat16``.
    out ``[N, H] bfloat16`` (optional): written in full.
    expert_map ``[E] int32`` (optional): vLLM's EP map, global id -> local id or ``-1``; the
        kernels apply it to ``topk_ids`` (ids outside ``[0, E)`` and map values outside
        ``[0, L)`` mark slots this rank does not serve), so no id conversion runs before them.
    act_workspace / partial_workspace (optional): contiguous bfloat16 tensors (both) of at
        least the sizes of :func:`experts_workspace_shapes` (any shape); allocated when absent.
    tiles: a name of ``TILES`` (``"auto"``, ``"simt"``, ``"wgmma_narrow"``, ``"wgmma_m64"``,
        ``"wgmma"``, ``"wgmma_mc"``); results do not depend on it beyond fp32 rounding order.
    config: the bounds of ``auto``'s choice (:class:`~vllm_petit_moe.config.ExpertConfig`;
        default: its defaults).

    Returns ``out [N, H] bfloat16``: ``Σ_{k: id valid} w[r,k] · expert_{id}(x[r])``, with
    bf16 GEMM operands, fp32 accumulation, the SiLU·mul activation rounded to bf16 once and
    the sum over slots ``k = 0..K-1`` in fp32 rounded to bf16 once (deterministic); rows with
    no valid id are 0. H, I must be multiples of 8, L <= 512, K <= 16.
    """
    validate_experts_inputs(x, topk_ids, topk_weights, w13, w2)
    _check_expert_map(expert_map, x.device)
    if tiles not in TILES:
        raise ValueError(f"tiles must be one of {sorted(TILES)}, got {tiles!r}")
    num_rows, hidden_size = x.shape
    if out is not None and (
        tuple(out.shape) != (num_rows, hidden_size) or out.dtype != torch.bfloat16
    ):
        raise ValueError(
            f"out must be bfloat16 [N={num_rows}, H={hidden_size}], got {out.dtype} "
            f"{tuple(out.shape)}"
        )
    (act_shape, _), (partial_shape, _) = experts_workspace_shapes(
        num_rows, topk_ids.shape[1], hidden_size, w13.shape[1] // 2
    )
    for name, workspace, shape, dtype in (
        ("act_workspace", act_workspace, act_shape, torch.bfloat16),
        ("partial_workspace", partial_workspace, partial_shape, torch.bfloat16),
    ):
        if workspace is not None and (
            workspace.dtype != dtype or workspace.numel() < shape[0] * shape[1]
        ):
            raise ValueError(
                f"{name} must be {dtype} with >= {shape[0]}*{shape[1]} elements, got "
                f"{workspace.dtype} {tuple(workspace.shape)}"
            )
    return _ops().experts_forward(
        x, topk_ids, topk_weights, w13, w2,
        out=out, act_workspace=act_workspace, partial_workspace=partial_workspace,
        tiles=TILES[tiles], expert_map=expert_map, config=_config_dict(config),
    )


def _config_dict(config: ExpertConfig | None) -> dict[str, int]:
    if config is None:
        return {}
    if not isinstance(config, ExpertConfig):
        raise TypeError(f"config must be an ExpertConfig, got {type(config).__name__}")
    return as_dict(config)


def last_gemm_launch(gate_up: bool) -> dict[str, int]:
    """Launch shape of this process's most recent gate/up (``gate_up=True``) or down GEMM
    kernel launch, for diagnostics: ``grid`` (blocks of the persistent grid), ``threads``,
    ``smem_bytes`` (dynamic shared memory) and ``cluster`` (CTAs per thread-block cluster, 1
    without). All zeros before the first launch. CUDA-graph replays do not update it."""
    grid, threads, smem_bytes, cluster = _ops().last_expert_gemm_launch(bool(gate_up))
    return dict(grid=int(grid), threads=int(threads), smem_bytes=int(smem_bytes),
                cluster=int(cluster))


def resolve_tiles(num_rows: int, top_k: int, num_local_experts: int, hidden: int,
                  tiles: str = "auto", config: ExpertConfig | None = None) -> str:
    """The tile family (a name of ``TILES``, never ``"auto"``) :func:`experts_forward` runs for
    these sizes (received rows, top-k, local experts, hidden size) and ``config`` on the
    current device."""
    if tiles not in TILES:
        raise ValueError(f"tiles must be one of {sorted(TILES)}, got {tiles!r}")
    code = _ops().resolve_expert_tiles(num_rows, top_k, num_local_experts, hidden, TILES[tiles],
                                       config=_config_dict(config))
    return TILE_NAMES[int(code)]


# ------------------------------------------------------------------------------------------
# MegaMoE at W=1: the whole layer in one launch (csrc/experts/megamoe.cu)
# ------------------------------------------------------------------------------------------


_megamoe_sync: dict[int, torch.Tensor] = {}
_sm90a_supported: dict[int, bool] = {}


def sm90a_kernels_supported() -> bool:
    """Whether the current CUDA device runs this build's sm_90a kernels (the Hopper GEMM
    family and :func:`megamoe_forward`): the build made sm_90a images and the device has
    compute capability 9.0 (H100/H200). False without a CUDA device. Cached per device."""
    if not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device()
    if index not in _sm90a_supported:
        _sm90a_supported[index] = bool(_ops().sm90a_kernels_supported())
    return _sm90a_supported[index]


def megamoe_unsupported_reason(num_rows: int, top_k: int, hidden_size: int,
                               intermediate_size: int, *, fp8: bool = False) -> str | None:
    """Why :func:`megamoe_forward` cannot take a call of these sizes (None if it can); fp8:
    with block-fp8 weights."""
    if num_rows * top_k > MEGAMOE_MAX_ENTRIES:
        return (f"N*K = {num_rows}*{top_k} routing entries > {MEGAMOE_MAX_ENTRIES} "
                "(MEGAMOE_MAX_ENTRIES)")
    if hidden_size % MEGAMOE_SIZE_MULTIPLE or intermediate_size % MEGAMOE_SIZE_MULTIPLE:
        return (f"hidden {hidden_size} / intermediate {intermediate_size} not multiples of "
                f"{MEGAMOE_SIZE_MULTIPLE}")
    if fp8 and (hidden_size % FP8_SCALE_BLOCK or intermediate_size % FP8_SCALE_BLOCK):
        return (f"fp8 weights: hidden {hidden_size} / intermediate {intermediate_size} not "
                f"multiples of the {FP8_SCALE_BLOCK} scale block")
    return None


def check_block_scales(fp8: bool, w13_scale: torch.Tensor | None,
                        w2_scale: torch.Tensor | None, num_local_experts: int, hidden_size: int,
                        intermediate_size: int, device: torch.device) -> None:
    """The block scales of fp8 weights: contiguous float32 [L, 2I/128, H/128] and
    [L, H/128, I/128] on the weights' device; none with bf16 weights."""
    if not fp8:
        if w13_scale is not None or w2_scale is not None:
            raise ValueError("w13_scale / w2_scale are for float8_e4m3fn weights; w13 and w2 "
                             "are bfloat16")
        return
    blocks_h, blocks_i = hidden_size // FP8_SCALE_BLOCK, intermediate_size // FP8_SCALE_BLOCK
    want = {"w13_scale": (num_local_experts, 2 * blocks_i, blocks_h),
            "w2_scale": (num_local_experts, blocks_h, blocks_i)}
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if scale is None or tuple(scale.shape) != want[name] or scale.dtype != torch.float32 \
                or not scale.is_contiguous() or scale.device != device:
            got = "None" if scale is None else f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
            raise ValueError(f"float8_e4m3fn weights need {name}: a contiguous float32 tensor "
                             f"{want[name]} (128 x 128 blocks) on {device}, got {got}")


def _megamoe_sync_buffer(device: torch.device, num_local_experts: int,
                         hidden_size: int) -> torch.Tensor:
    """The device's int32 arrival counters of the fused kernel: zero between calls (each call
    resets what it used), so one buffer serves every layer called in stream order."""
    need = int(_ops().megamoe_sync_ints(num_local_experts, hidden_size))
    index = device.index if device.index is not None else torch.cuda.current_device()
    buf = _megamoe_sync.get(index)
    if buf is None or buf.numel() < need:
        # room for any L and H <= 8192 at once, so a call captured in a CUDA graph never sees
        # the buffer it recorded replaced by a later, larger layer's
        buf = torch.zeros(max(need, int(_ops().megamoe_sync_ints(MAX_LOCAL_EXPERTS, 8192))),
                          dtype=torch.int32, device=device)
        _megamoe_sync[index] = buf
    return buf


def megamoe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    act_workspace: torch.Tensor | None = None,
    partial_workspace: torch.Tensor | None = None,
    num_sms: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    trace: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer of :func:`experts_forward` (its arguments ``x`` to ``partial_workspace``,
    in its order, and its result up to fp32 rounding order; W=1: no dispatch) as ONE
    persistent kernel: routing, gate/up + SiLU·mul, down + routing weight and the top-k sum.

    x ``[N, H] bfloat16``; topk_ids ``[N, K] int32`` (local ids, ``-1`` or any id outside
    ``[0, L)`` unused; with ``expert_map``: global ids); topk_weights ``[N, K] float32``;
    w13 ``[L, 2I, H]``, w2 ``[L, H, I]`` bfloat16, or block fp8: float8_e4m3fn with
    ``w13_scale [L, 2I/128, H/128]`` and ``w2_scale [L, H/128, I/128]`` float32 (weight = e4m3 ·
    scale of its 128 x 128 block: the checkpoints' layout as vLLM loads it, used in place; the
    products are exact and summed in fp32). ``N*K <= MEGAMOE_MAX_ENTRIES`` and H, I multiples
    of ``MEGAMOE_SIZE_MULTIPLE`` (fp8: of ``FP8_SCALE_BLOCK``; :func:`megamoe_unsupported_reason`).
    act_workspace ``>= N*K*I`` bfloat16, partial_workspace ``>= N*K*H`` float32 (the fused
    kernel keeps its partials in fp32, :func:`experts_forward` rounds them to bf16); both
    allocated when absent. num_sms: SMs the grid may use (0: all; two blocks per SM).
    timeout_s: bound of the kernel's internal waits (a bug, not a peer, would exceed it: the
    kernel then traps).
    trace: diagnostics only (``tools/megamoe_trace.py``): an int64 CUDA tensor of at least
    ``MEGAMOE_BLOCKS_PER_SM * SMs * MEGAMOE_TRACE_SLOTS`` elements that receives, per block,
    timer stamps (ns) of its phases and tasks (layout: ``csrc/common/layout.h``).

    Calls on one device must be ordered on one stream (they share the device's counters).
    Returns ``out [N, H] bfloat16``: ``Σ_k w[n,k] · expert(x[n])`` summed in fp32 in slot order.
    """
    validate_experts_inputs(x, topk_ids, topk_weights, w13, w2, allow_fp8=True)
    num_rows, hidden_size = x.shape
    top_k = topk_ids.shape[1]
    num_local_experts, intermediate_size = w13.shape[0], w13.shape[1] // 2
    fp8 = w13.dtype == torch.float8_e4m3fn
    reason = megamoe_unsupported_reason(num_rows, top_k, hidden_size, intermediate_size,
                                        fp8=fp8)
    if reason is not None:
        raise ValueError(f"megamoe_forward: {reason}")
    check_block_scales(fp8, w13_scale, w2_scale, num_local_experts, hidden_size,
                        intermediate_size, x.device)
    timeout_s = check_timeout_s(timeout_s)
    if num_sms < 0:
        raise ValueError(f"num_sms must be >= 0, got {num_sms}")
    if trace is not None and (trace.dtype != torch.int64 or trace.device != x.device
                              or not trace.is_contiguous()):
        raise ValueError(f"trace must be a contiguous int64 tensor on {x.device}, got "
                         f"{trace.dtype} on {trace.device}")
    _check_expert_map(expert_map, x.device)
    if out is None:
        out = torch.empty_like(x)
    elif tuple(out.shape) != (num_rows, hidden_size) or out.dtype != torch.bfloat16 \
            or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bfloat16 [N={num_rows}, H={hidden_size}], "
                         f"got {out.dtype} {tuple(out.shape)}")
    entries = max(1, num_rows * top_k)
    if act_workspace is None:
        act_workspace = torch.empty(entries * intermediate_size, dtype=torch.bfloat16,
                                    device=x.device)
    if partial_workspace is None:
        partial_workspace = torch.empty(entries * hidden_size, dtype=torch.float32,
                                        device=x.device)
    if num_rows == 0:
        return out
    sync = _megamoe_sync_buffer(x.device, w13.shape[0], hidden_size)
    _ops().megamoe_forward(x, topk_ids, topk_weights, w13, w2, out, act_workspace,
                           partial_workspace, sync, expert_map=expert_map, num_sms=num_sms,
                           timeout_s=float(timeout_s), trace=trace, w13_scale=w13_scale,
                           w2_scale=w2_scale)
    return out
