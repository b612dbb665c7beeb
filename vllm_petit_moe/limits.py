"""Limits and constants of the compiled kernels: the one Python source of them.

Every value mirrors a constant of csrc/common/layout.h or csrc/common/fp8.h (named in the
comment next to it); tests/test_limits_cpu.py parses those headers and checks the two agree,
and, where the extension is built, checks the values it exposes as well. The runtime (`ops`,
`buffer`, `vllm_glue`) and the testing oracle import the values from here, never redefine them.
"""
from __future__ import annotations

# --------------------------------------------------------------------------- shapes
MAX_TOP_K = 16  # kMaxTopK: experts per token
MAX_WORLD_SIZE = 32  # kMaxWorldSize: token -> rank masks are uint32
MAX_EXPERTS = 512  # kMaxExperts: experts of an EpBuffer
MAX_TOKENS_PER_RANK = 65536  # kMaxTokensPerRank: the call tag holds the region stride in full
MAX_LOCAL_EXPERTS = MAX_EXPERTS  # experts_forward's L, checked against kMaxExperts too
SIZE_MULTIPLE = 8  # kSizeMultiple: H and I are multiples of one 16-byte vector of bf16
MAX_ENTRIES = 2**31 - 1  # N*K routing entries of experts_forward are indexed with int32
MEGAMOE_MAX_ENTRIES = 2048  # kMegaMoeMaxEntries: N*K of one fused-layer call
MEGAMOE_SIZE_MULTIPLE = 64  # kMegaMoeSizeMultiple: H and I of the fused layer
MEGAMOE_TRACE_HEADER = 7  # kMegaMoeTraceHeader: a block's phase stamps before its task records
MEGAMOE_TRACE_TASKS = 32  # kMegaMoeTraceTasks: (task, ready, done) records per block
MEGAMOE_TRACE_STEPS = 64  # kMegaMoeTraceSteps: warp 0's e4m3 ring steps per block (W = 1)
MEGAMOE_TRACE_SLOTS = 231  # kMegaMoeTraceSlots: int64 stamps per block of the fused layer's trace
MEGAMOE_BLOCKS_PER_SM = 2  # kMegaMoeBlocksPerSm: the fused layer's grid, per SM at most

# --------------------------------------------------------------------------- waits
DEFAULT_TIMEOUT_S = 30.0  # kDefaultTimeoutS: default bound of every in-kernel spin-wait, seconds
MAX_TIMEOUT_S = 3600.0  # kMaxTimeoutS: largest bound of an in-kernel spin-wait, in seconds
MAX_WAIT_S = 86400.0  # kMaxWaitS: bound of a wait on a live (heartbeating) peer, in seconds


def check_timeout_s(value, what: str = "timeout_s") -> float:
    """`value` as a float in (0, MAX_TIMEOUT_S] seconds, else ValueError naming `what` and the
    limit: 0 would fail every wait at once, inf or NaN never bound one, a negative value is
    meaningless."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"petit_moe: {what}={value!r} is not a number of seconds") from None
    if not 0.0 < seconds <= MAX_TIMEOUT_S:  # False for NaN too
        raise ValueError(f"petit_moe: {what}={value!r} must be finite, > 0 and <= "
                         f"{MAX_TIMEOUT_S:g} seconds (the bound of every spin-wait)")
    return seconds


DEFAULT_MAX_WAIT_S = 1800.0  # EpBuffer's max_wait_s (vLLM's own collectives wait as long)


def check_max_wait_s(value, timeout_s: float) -> float:
    """`value` as a float in [timeout_s, MAX_WAIT_S] seconds, else ValueError naming the
    limits."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"petit_moe: max_wait_s={value!r} is not a number of seconds") from None
    if not timeout_s <= seconds <= MAX_WAIT_S:  # False for NaN too
        raise ValueError(f"petit_moe: max_wait_s={value!r} must be >= timeout_s={timeout_s:g} "
                         f"and <= {MAX_WAIT_S:g} seconds (the bound of a wait on a live peer)")
    return seconds


# --------------------------------------------------------------------------- heap layout
TOKEN_GROUP_SIZE = 32  # kTokenGroupSize: tokens per readiness flag
MIN_CHUNK_VECTORS = 2048  # kMinChunkVectors: 16-byte vectors of a combine send chunk, at least
REGION_ALIGNMENT = 256  # kRegionAlignment: bytes; every heap region starts aligned to it

# --------------------------------------------------------------------------- fp8 dispatch
FP8_E4M3_MAX = 448.0  # kFp8E4m3Max: largest finite float8_e4m3fn
FP8_SCALE_BLOCK = 128  # kFp8ScaleBlock: elements per scale of the 1x128 block modes
FP8_BLOCK_MIN_AMAX = 1e-10  # kFp8BlockMinAmax: vLLM per_token_group_quant eps
FP8_TOKEN_MIN_SCALE = 1.0 / (448.0 * 512.0)  # kFp8TokenMinScale: vLLM per-token minimum scale
# The fp8 wire formats of dispatch (csrc/api.h DispatchQuant, buffer.DISPATCH_QUANT).
FP8_QUANT_MODES = ("fp8_block128", "fp8_per_token", "fp8_block128_ue8m0")
FP8_BLOCK_MODES = ("fp8_block128", "fp8_block128_ue8m0")  # one scale per 1x128 block
