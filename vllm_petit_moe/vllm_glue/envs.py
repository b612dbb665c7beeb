"""Environment variables of vllm-petit-moe (read with ``os`` only; no vLLM import), and the one
place that turns them into the configs they feed (``single_gpu_layer_config``,
``ep_layer_config``). Defaults live where the setting does: ``limits.DEFAULT_TIMEOUT_S``,
``config.SingleGpuLayerConfig``, ``config.EpLayerConfig``; an unset variable leaves them.

They are also registered in vLLM's own registry (``vllm.envs.environment_variables``) by
``vllm_petit_moe.plugin.register`` so that vLLM's environment validation knows them
(see ``compat.register_env_vars``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

VLLM_USE_PETIT_MOE = "VLLM_USE_PETIT_MOE"
"""``1`` switches DP+EP MoE layers to our dispatch/combine, and on one GPU (no DP, TP or EP)
vLLM's Triton experts to ``PetitSingleGpuExperts`` (which kernel serves which call size:
``config.SingleGpuLayerConfig``). Default off."""

VLLM_PETIT_MOE_STRICT = "VLLM_PETIT_MOE_STRICT"
"""``1``: with the flag on, fail (RuntimeError) instead of falling back to vLLM's backend for
a MoE layer we cannot serve. For benchmarks and CI, where a silent fallback would measure the
wrong thing. Default off (fall back with a warning)."""

VLLM_PETIT_MOE_EXPERTS = "VLLM_PETIT_MOE_EXPERTS"
"""``1`` (opt-in, experimental): where petit's prepare/finalize is substituted and the layer
runs vLLM's unquantized Triton experts, also substitute ``PetitExperts`` (our grouped-GEMM
kernels, tile family ``VLLM_PETIT_MOE_EXPERTS_TILES``, on the same weights). Only meaningful
with ``VLLM_USE_PETIT_MOE=1``. Default off (measurements: README, "Performance", and
docs/experiments/)."""

VLLM_PETIT_MOE_EXPERTS_TILES = "VLLM_PETIT_MOE_EXPERTS_TILES"
"""Debug override of the tile family of ``PetitExperts``' GEMMs: ``auto`` (default), ``simt``,
``wgmma_narrow``, ``wgmma_m64``, ``wgmma`` or ``wgmma_mc`` (``vllm_petit_moe.ops.TILES``)."""

VLLM_PETIT_MOE_TIMEOUT_S = "VLLM_PETIT_MOE_TIMEOUT_S"
"""Bound, in seconds, of every spin-wait of the dispatch/combine kernels before they report
the rank/flag/epoch they waited on and fail. Default ``limits.DEFAULT_TIMEOUT_S``."""

VLLM_PETIT_MOE_MAX_WAIT_S = "VLLM_PETIT_MOE_MAX_WAIT_S"
"""Bound, in seconds, of a dispatch/combine wait on a peer whose process is alive (its
heartbeat moves) but does not make the call: the kernels then report a live, stuck peer. At
least ``VLLM_PETIT_MOE_TIMEOUT_S`` and at most ``limits.MAX_WAIT_S``. Default 1800 (vLLM's own
collectives wait as long); a peer that died or left the protocol is reported within 1.5 x the
timeout whatever this is."""

VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS = "VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS"
"""Steps of up to this many tokens per rank run the fused MegaMoE layer (one launch per rank
per layer): on one GPU, calls of up to N tokens (``config.SingleGpuLayerConfig``); with
DP + EP, steps whose largest DP rank has up to N tokens (``config.EpLayerConfig``; larger steps
keep the composed path). An integer >= 0; ``0``: never; unset: each config's own default
(``SingleGpuLayerConfig.megamoe_max_tokens``, ``EpLayerConfig.megamoe_max_tokens``)."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _parse_bool(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected one of 1/0, true/false, yes/no, on/off"
    )


def use_petit_moe() -> bool:
    """Whether ``VLLM_USE_PETIT_MOE`` is set to a true value."""
    return _parse_bool(VLLM_USE_PETIT_MOE)


def strict() -> bool:
    """Whether ``VLLM_PETIT_MOE_STRICT`` is set to a true value."""
    return _parse_bool(VLLM_PETIT_MOE_STRICT)


def petit_experts() -> bool:
    """Whether ``VLLM_PETIT_MOE_EXPERTS`` is set to a true value."""
    return _parse_bool(VLLM_PETIT_MOE_EXPERTS)


def petit_experts_tiles() -> str:
    """``VLLM_PETIT_MOE_EXPERTS_TILES`` (default ``auto``), validated."""
    from vllm_petit_moe.ops import TILES

    value = os.environ.get(VLLM_PETIT_MOE_EXPERTS_TILES, "").strip().lower() or "auto"
    if value not in TILES:
        raise ValueError(f"{VLLM_PETIT_MOE_EXPERTS_TILES}={value!r}: expected one of "
                         f"{', '.join(TILES)}")
    return value


def timeout_s() -> float:
    """``VLLM_PETIT_MOE_TIMEOUT_S`` in seconds (default ``limits.DEFAULT_TIMEOUT_S``): finite,
    > 0 and at most ``limits.MAX_TIMEOUT_S``; anything else (0, negative, inf, nan, not a
    number) raises ValueError naming the variable and the limit."""
    from vllm_petit_moe.limits import DEFAULT_TIMEOUT_S, check_timeout_s

    raw = os.environ.get(VLLM_PETIT_MOE_TIMEOUT_S, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    return check_timeout_s(raw, VLLM_PETIT_MOE_TIMEOUT_S)


def max_wait_s() -> float:
    """``VLLM_PETIT_MOE_MAX_WAIT_S`` in seconds (default ``limits.DEFAULT_MAX_WAIT_S``, 1800):
    at least ``timeout_s()`` and at most ``limits.MAX_WAIT_S``; anything else raises ValueError
    naming the variable and the limits."""
    from vllm_petit_moe.limits import DEFAULT_MAX_WAIT_S, check_max_wait_s

    raw = os.environ.get(VLLM_PETIT_MOE_MAX_WAIT_S, "").strip()
    timeout = timeout_s()
    if not raw:
        return max(DEFAULT_MAX_WAIT_S, timeout)
    try:
        return check_max_wait_s(raw, timeout)
    except ValueError as e:
        raise ValueError(f"{VLLM_PETIT_MOE_MAX_WAIT_S}={raw!r}: {e}") from None


def megamoe_max_tokens() -> int | None:
    """``VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS`` as an int >= 0, or None when unset (the layer
    configs' default applies); anything else raises ValueError naming the variable."""
    raw = os.environ.get(VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS}={raw!r}: expected an integer "
                         ">= 0 (tokens per rank; 0 = never)")
    return value


def single_gpu_layer_config():
    """``config.SingleGpuLayerConfig`` with ``VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS`` where it is
    set (its defaults otherwise)."""
    from vllm_petit_moe.config import SingleGpuLayerConfig

    tokens = megamoe_max_tokens()
    return SingleGpuLayerConfig() if tokens is None else SingleGpuLayerConfig(
        megamoe_max_tokens=tokens)


def ep_layer_config():
    """``config.EpLayerConfig`` with ``VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS`` where it is set (its
    default otherwise)."""
    from vllm_petit_moe.config import EpLayerConfig

    tokens = megamoe_max_tokens()
    return EpLayerConfig() if tokens is None else EpLayerConfig(megamoe_max_tokens=tokens)


ENV_VARS: dict[str, Callable[[], Any]] = {
    VLLM_USE_PETIT_MOE: use_petit_moe,
    VLLM_PETIT_MOE_STRICT: strict,
    VLLM_PETIT_MOE_EXPERTS: petit_experts,
    VLLM_PETIT_MOE_EXPERTS_TILES: petit_experts_tiles,
    VLLM_PETIT_MOE_TIMEOUT_S: timeout_s,
    VLLM_PETIT_MOE_MAX_WAIT_S: max_wait_s,
    VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS: megamoe_max_tokens,
}
"""Name -> getter, in the form of vLLM's ``environment_variables`` registry."""
