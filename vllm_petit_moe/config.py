"""Tuning configs of the kernels: Python mirrors of the structs of csrc/common/config.h.

Each field has the name and the default of the C++ field (tests/test_config_cpu.py parses the
header and checks; where the extension is built, ``_C.config_defaults()`` is checked as well).
The kernels read no environment variable: a config is passed where it applies, as DeepEP
passes its ``Config``::

    buf = EpBuffer(group, ..., config=CombineConfig(reduce_pct=40))
    out = experts_forward(..., config=ExpertConfig(narrow_max_rows=4))

Benchmarks take them on the command line as ``field=value,...`` (:func:`parse_config`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class ExpertConfig:
    """Bounds of ``experts_forward``'s automatic tile choice, in routing entries per local
    expert (N*K / L; exclusive below, inclusive from), where the GPU runs the Hopper family:

    narrow_max_rows: ``wgmma_narrow`` (64 x 128 tiles) below this.
    m64_max_rows: ``wgmma_m64`` (64 x 256 tiles, or the narrow ones where the device finds the
        m64 tiles would leave more than half of the SMs idle) below this.
    mc_min_rows, mc_min_hidden: ``wgmma_mc`` (128 x 256 tiles in clusters of 2 CTAs sharing
        the weight boxes) from mc_min_rows at hidden sizes from mc_min_hidden; ``wgmma``
        otherwise.
    simt_large_min_rows: the SIMT fallback's 128-row tiles from this, its 16-row ones below.
    """
    narrow_max_rows: int = 2
    m64_max_rows: int = 96
    mc_min_rows: int = 256
    mc_min_hidden: int = 4096
    simt_large_min_rows: int = 256

    def __post_init__(self):
        _check_ints(self)
        if min(dataclasses.astuple(self)) < 0 or self.narrow_max_rows > self.m64_max_rows:
            raise ValueError(f"{self}: bounds must be >= 0 with narrow_max_rows <= m64_max_rows")


@dataclass(frozen=True)
class CombineConfig:
    """How ``EpBuffer.combine`` splits its persistent grid and its work (no output bit depends
    on it):

    reduce_pct: share of the grid, in percent (0..90), that only reduces from the start.
    reduce_vectors: 16-byte vectors per row of one reduce item (0: one item per send chunk).
    reduce_items: at most about this many reduce items per block of the grid (0: no bound).
    tail_chunks: hidden chunks of each (token group, peer) pair of a large combine's last send
        round (0 or 1: off).
    """
    reduce_pct: int = 25
    reduce_vectors: int = 128
    reduce_items: int = 8
    tail_chunks: int = 4

    def __post_init__(self):
        _check_ints(self)
        if not (0 <= self.reduce_pct <= 90 and 0 <= self.reduce_vectors <= 2**20
                and 0 <= self.reduce_items <= 2**20 and 0 <= self.tail_chunks <= 2**10):
            raise ValueError(f"{self}: reduce_pct in [0, 90], reduce_vectors and reduce_items "
                             "in [0, 2^20], tail_chunks in [0, 1024]")


@dataclass(frozen=True)
class SingleGpuLayerConfig:
    """Which kernels serve one call of a one-GPU (no EP) MoE layer under the vLLM flag, by the
    call's token count N (Python only: the choice is made before any launch):

    megamoe_max_tokens: the fused MegaMoE kernel (``ops.megamoe_forward``) for N up to this
        (0: never), where the GPU runs sm_90a.
    composed_min_tokens: our composed experts (``ops.experts_forward``) from N = this; vLLM's
        own Triton experts below (and above megamoe_max_tokens).

    The defaults are where each kernel measured at least as fast as vLLM's Triton experts
    (docs/experiments/one-gpu-thresholds.md). ``VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS`` overrides
    megamoe_max_tokens (``vllm_glue.envs.single_gpu_layer_config``).
    """
    megamoe_max_tokens: int = 8
    composed_min_tokens: int = 32

    def __post_init__(self):
        _check_ints(self)
        if self.megamoe_max_tokens < 0 or self.composed_min_tokens < 1:
            raise ValueError(f"{self}: megamoe_max_tokens >= 0, composed_min_tokens >= 1")


@dataclass(frozen=True)
class EpLayerConfig:
    """Which path serves one step of a DP + EP MoE layer under the vLLM flag, by the step's
    region stride R (the largest token count of any DP rank: equal on every rank, so every
    rank takes the same path; Python only):

    megamoe_max_tokens: the fused layer (``EpBuffer.megamoe``: dispatch, this rank's experts
        and combine in one launch per rank) for R up to this, where the layer qualifies (vLLM's
        Triton experts on bf16 or block-fp8 weights, H and I multiples of 64 (128 for fp8),
        W * R * K <= ``MEGAMOE_MAX_ENTRIES``); 0: never. Larger
        steps run the composed path (petit dispatch, the experts, petit combine). Off by
        default until it is measured on several GPUs (docs/vllm_integration.md, "Not yet");
        ``VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS`` sets it (``vllm_glue.envs.ep_layer_config``).
    """
    megamoe_max_tokens: int = 0

    def __post_init__(self):
        _check_ints(self)
        if self.megamoe_max_tokens < 0:
            raise ValueError(f"{self}: megamoe_max_tokens >= 0")


def _check_ints(config) -> None:
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{type(config).__name__}.{field.name} must be an int, got "
                            f"{value!r}")


def as_dict(config) -> dict[str, int]:
    """The ``{field: value}`` dict the compiled extension takes."""
    return dataclasses.asdict(config)


ConfigT = TypeVar("ConfigT", ExpertConfig, CombineConfig)


def parse_config(cls: type[ConfigT], text: str) -> ConfigT:
    """``cls`` from ``"field=value,field=value"`` (empty: the defaults), for command lines."""
    names = {field.name for field in dataclasses.fields(cls)}
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise ValueError(f"{item!r}: expected field=value with a field of {cls.__name__} "
                             f"({', '.join(sorted(names))})")
        values[name] = int(value)
    return cls(**values)
