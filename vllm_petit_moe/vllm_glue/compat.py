"""Every vLLM version difference and every monkeypatch of vllm-petit-moe, in one place.

Supported vLLM range: **0.24 – 0.33** (minor versions, inclusive; setup.py requires
``vllm>=0.24,<0.34``). Verified on GPUs: **0.24.0** (torch 2.11.0); the CPU suite runs on
**0.24.0 and 0.33.0** (torch 2.14.0). Outside the range the plugin refuses to act
(``UnsupportedVllmVersion`` at registration with the flag set, and at import of the modules that
subclass vLLM's classes). Inside it, every lookup below is by feature (module / attribute
present), and a missing one fails with an error that names what was looked for, never with
wrong results.

Each entry below carries a comment block:

- WHY   the reason the plugin needs it;
- HOW   what exactly is looked up or changed in vLLM;
- REMOVE WHEN   the vLLM change that would make it unnecessary.

The module imports only the standard library at import time; every vLLM or torch import
happens inside a function, so ``vllm_petit_moe.plugin.register`` stays cheap in processes
that never build a MoE layer (the API server).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm.petit_moe.compat")

MIN_SUPPORTED_VLLM = (0, 24)
MAX_SUPPORTED_VLLM = (0, 33)
"""The supported (major, minor) range, inclusive: setup.py's VLLM_REQUIREMENT (a CPU test keeps
the two equal)."""
GPU_TESTED_VLLM = ("0.24.0",)
"""Versions the GPU suite ran with (H200; the GPU machine's image has torch 2.11.0 only)."""
CPU_TESTED_VLLM = ("0.24.0", "0.33.0")
"""Versions CI runs the CPU suite with, one environment each (.ci/run, CI_VLLM_VERSIONS)."""

_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


# --------------------------------------------------------------------------------------------
# vLLM version
# --------------------------------------------------------------------------------------------


def vllm_version() -> str:
    """``vllm.__version__`` (``"unknown"`` if the attribute is missing)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def is_supported_vllm_version(version: str) -> bool:
    """Whether ``version``'s (major, minor) lies in [MIN_SUPPORTED_VLLM, MAX_SUPPORTED_VLLM].

    Dev/rc/local suffixes are ignored (``0.24.1.dev3+gabc`` counts as 0.24). Unparsable
    versions are reported as unsupported.
    """
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    major_minor = tuple(release[:2]) + (0,) * (2 - len(release[:2]))
    return MIN_SUPPORTED_VLLM <= major_minor <= MAX_SUPPORTED_VLLM


def supported_range_text() -> str:
    """``"0.24-0.33"``: the supported range as people write it."""
    return (f"{MIN_SUPPORTED_VLLM[0]}.{MIN_SUPPORTED_VLLM[1]}-"
            f"{MAX_SUPPORTED_VLLM[0]}.{MAX_SUPPORTED_VLLM[1]}")


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is outside [MIN_SUPPORTED_VLLM, MAX_SUPPORTED_VLLM]."""


def unsupported_vllm_message(version: str) -> str:
    """What to tell a user whose vLLM is ``version`` (outside the supported range)."""
    return (
        f"vllm-petit-moe supports vLLM {supported_range_text()} (verified on GPUs: "
        f"{', '.join(GPU_TESTED_VLLM)}; CPU tests: {', '.join(CPU_TESTED_VLLM)}), but this "
        f"environment has vLLM {version}. Install a supported vLLM "
        f"(pip install 'vllm>={MIN_SUPPORTED_VLLM[0]}.{MIN_SUPPORTED_VLLM[1]},"
        f"<{MAX_SUPPORTED_VLLM[0]}.{MAX_SUPPORTED_VLLM[1] + 1}') and rebuild this package "
        "against its torch (pip install --no-build-isolation -e .), or unset "
        "VLLM_USE_PETIT_MOE to run vLLM without the plugin."
    )


def require_supported_vllm() -> str:
    """The installed vLLM version; ``UnsupportedVllmVersion`` if it is outside the range.

    Called by ``plugin.register`` with the flag set (a vLLM start-up then fails with this
    message) and on import of ``prepare_finalize`` / ``experts`` (they subclass vLLM's classes).
    """
    version = vllm_version()
    if not is_supported_vllm_version(version):
        raise UnsupportedVllmVersion(unsupported_vllm_message(version))
    return version


def warn_if_unsupported_vllm() -> bool:
    """Log the same message once, as a warning (the flag is off: the plugin does nothing, so
    vLLM may run); True if the version is supported."""
    version = vllm_version()
    if is_supported_vllm_version(version):
        return True
    _warn_once("version", "%s", unsupported_vllm_message(version))
    return False


# --------------------------------------------------------------------------------------------
# Environment-variable registry
# --------------------------------------------------------------------------------------------
#
# WHY   vLLM validates VLLM_* variables against its registry (`envs.validate_environ`, run in
#       `EngineArgs.create_engine_config`): with `fail_on_environ_validation` an unknown
#       VLLM_USE_PETIT_MOE is a hard error, otherwise a warning on every start. Registering
#       also makes `vllm.envs.VLLM_USE_PETIT_MOE` resolve and puts the flag's value into
#       `envs.compile_factors()` (the torch.compile cache key), which is harmless.
#       vLLM 0.33 no longer validates (`validate_environ` is gone), but the registry still
#       matters there: `ray_env.get_env_vars_to_copy` copies every registered variable to Ray
#       workers, and `collect_env` reports them.
# HOW   `vllm.envs.environment_variables` is a plain dict name -> zero-argument getter
#       (0.24 and 0.33; the same dict has existed since long before 0.24). We `setdefault` our
#       getters into it. If the dict is missing (a future vLLM with another registry) we do
#       nothing and say so at debug level: the flag still works, vLLM may warn about it.
#       Plugins are loaded (EngineArgs.__post_init__) before validate_environ runs, in the
#       API server and again in engine cores and workers. `validate_vllm_environ` runs vLLM's
#       strict check where it exists (tests).
# REMOVE WHEN vLLM offers a public API for plugins to declare environment variables.


def register_env_vars(getters: dict[str, Callable[[], Any]]) -> bool:
    """Add ``getters`` to vLLM's environment-variable registry; True if a registry exists."""
    import vllm.envs as vllm_envs

    registry = getattr(vllm_envs, "environment_variables", None)
    if not isinstance(registry, dict):
        logger.debug("vllm.envs has no environment_variables dict; flags not registered")
        return False
    for name, getter in getters.items():
        registry.setdefault(name, getter)
    return True


def validate_vllm_environ() -> bool:
    """vLLM's strict check of the VLLM_* variables (ValueError on one it does not know), where
    vLLM has one (0.24: True after it passed); False where it has none (0.33)."""
    import vllm.envs as vllm_envs

    validate = getattr(vllm_envs, "validate_environ", None)
    if validate is None:
        return False
    validate(hard_fail=True)
    return True


# --------------------------------------------------------------------------------------------
# Fused-MoE symbols
# --------------------------------------------------------------------------------------------
#
# WHY   Our prepare/finalize subclasses vLLM's modular prepare/finalize base class, and the hook
#       recognizes vLLM's allgather/reduce-scatter prepare/finalize and Triton experts by type.
# HOW   Look the classes up by (module, name) candidates, newest layout first. 0.24 layout:
#       fused_moe/modular_kernel.py (FusedMoEKernel, FusedMoEPrepareAndFinalizeModular, ...),
#       fused_moe/prepare_finalize/naive_dp_ep.py (MoEPrepareAndFinalizeNaiveDPEP{Modular,
#       Monolithic}), fused_moe/topk_weight_and_reduce.py, fused_moe/experts/triton_moe.py,
#       fused_moe/activation.py (MoEActivation). PetitExperts subclasses the modular experts
#       base (FusedMoEExpertsModular; FusedMoEPermuteExpertsUnpermute in older builds).
#       Older names (FusedMoEModularKernel, FusedMoEPrepareAndFinalize as the modular base,
#       TritonExperts in fused_moe.py) are listed as fallbacks for vLLM builds near 0.24.
#       0.33 keeps every one of these names and modules (FusedMoEKernel still dispatches to
#       FusedMoEKernelModularImpl / FusedMoEKernelMonolithicImpl, as in 0.24); its new base-class
#       members (PrepareAndFinalize.allocate_fused_expert_output / supports_dbo /
#       supports_deferred_moe_finalize, Experts.output_hidden_dim / post_gemm2_hook, an
#       `apply` that may return moe_output.UnfinalizedMoEOutput) all default to what our
#       classes do: no external output buffer, no DBO, finalize always runs, the hidden size
#       unchanged, `apply` writes `output` and returns None. The two that could change a
#       result have their own entries below (pass-through prepare/finalize, GEMM2 hook).
# REMOVE WHEN the supported range starts at a version with one stable layout (then import
#       directly).

_MK = "vllm.model_executor.layers.fused_moe.modular_kernel"
_NAIVE_PF = "vllm.model_executor.layers.fused_moe.prepare_finalize.naive_dp_ep"
_TOPK_REDUCE = "vllm.model_executor.layers.fused_moe.topk_weight_and_reduce"

_SYMBOLS: dict[str, tuple[tuple[str, str], ...]] = {
    "FusedMoEKernel": ((_MK, "FusedMoEKernel"), (_MK, "FusedMoEModularKernel")),
    "PrepareAndFinalizeModular": (
        (_MK, "FusedMoEPrepareAndFinalizeModular"),
        (_MK, "FusedMoEPrepareAndFinalize"),
    ),
    "ActivationFormat": ((_MK, "FusedMoEActivationFormat"),),
    "ExpertsModular": ((_MK, "FusedMoEExpertsModular"), (_MK, "FusedMoEPermuteExpertsUnpermute")),
    "MoEActivation": (("vllm.model_executor.layers.fused_moe.activation", "MoEActivation"),),
    "NaiveDPEPModular": ((_NAIVE_PF, "MoEPrepareAndFinalizeNaiveDPEPModular"),),
    "NaiveDPEPMonolithic": ((_NAIVE_PF, "MoEPrepareAndFinalizeNaiveDPEPMonolithic"),),
    "NoDPEPModular": (
        ("vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep",
         "MoEPrepareAndFinalizeNoDPEPModular"),
        ("vllm.model_executor.layers.fused_moe.prepare_finalize", "MoEPrepareAndFinalizeNoEP"),
    ),
    "PassThrough": (
        ("vllm.model_executor.layers.fused_moe.prepare_finalize.passthrough",
         "PassThroughPrepareAndFinalize"),
    ),
    "TopKWeightAndReduceNoOP": ((_TOPK_REDUCE, "TopKWeightAndReduceNoOP"),),
    "TopKWeightAndReduceContiguous": ((_TOPK_REDUCE, "TopKWeightAndReduceContiguous"),),
    "TopKWeightAndReduceDelegate": ((_TOPK_REDUCE, "TopKWeightAndReduceDelegate"),),
    "TritonExperts": (
        ("vllm.model_executor.layers.fused_moe.experts.triton_moe", "TritonExperts"),
        ("vllm.model_executor.layers.fused_moe.fused_moe", "TritonExperts"),
    ),
    # fp8 experts vLLM's fp8 oracle may pair with the allgather prepare/finalize (below,
    # "DP + EP: vLLM's fp8 experts and the input each expects")
    "TritonOrDeepGemmExperts": (
        ("vllm.model_executor.layers.fused_moe.experts.triton_deep_gemm_moe",
         "TritonOrDeepGemmExperts"),
    ),
    "DeepGemmExperts": (
        ("vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe", "DeepGemmExperts"),
    ),
    "FlashInferExperts": (
        ("vllm.model_executor.layers.fused_moe.experts.flashinfer_cutlass_moe",
         "FlashInferExperts"),
    ),
}


def fused_moe_symbol_or_none(name: str) -> Any:
    """``fused_moe_symbol(name)``, or None where this vLLM lacks it."""
    try:
        return fused_moe_symbol(name)
    except ImportError:
        return None


def fused_moe_symbol(name: str) -> Any:
    """The vLLM class known here as ``name`` (a key of ``_SYMBOLS``); ImportError if absent."""
    tried = []
    for module_name, attr in _SYMBOLS[name]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            tried.append(f"{module_name} (module missing)")
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
        tried.append(f"{module_name}.{attr}")
    raise ImportError(
        f"vllm-petit-moe: vLLM {vllm_version()} lacks {name}; looked for: {', '.join(tried)}. "
        f"Supported vLLM: {supported_range_text()}."
    )


# --------------------------------------------------------------------------------------------
# The one-GPU prepare/finalize, and 0.33's pass-through subclass of it
# --------------------------------------------------------------------------------------------
#
# WHY   The one-GPU path (hook.maybe_substitute_experts) recognizes a layer without DP/EP by
#       vLLM's pass-through prepare/finalize, MoEPrepareAndFinalizeNoDPEPModular. vLLM 0.33
#       added `--all2all-backend passthrough` (experts that dispatch and combine themselves,
#       e.g. the mega-MoE backends) whose PassThroughPrepareAndFinalize *subclasses* it: an
#       isinstance check alone would take such a DP/EP layer for a one-GPU one.
# HOW   NoDPEPModular instances, minus PassThroughPrepareAndFinalize where that class exists
#       (absent in 0.24). Such a layer then goes to `hook.decide`, which keeps it as
#       "not applicable" (--all2all-backend passthrough chosen explicitly), as any backend
#       other than allgather/reduce-scatter.
# REMOVE WHEN the supported range starts at 0.33 (then test for PassThrough directly).


def is_no_dp_ep_prepare_finalize(prepare_finalize: Any) -> bool:
    """Whether ``prepare_finalize`` is vLLM's modular no-DP/no-EP pass-through (one GPU, or TP
    without EP), not a subclass that belongs to an EP backend."""
    no_dp_ep = fused_moe_symbol_or_none("NoDPEPModular")
    if no_dp_ep is None or not isinstance(prepare_finalize, no_dp_ep):
        return False
    pass_through = fused_moe_symbol_or_none("PassThrough")
    return pass_through is None or not isinstance(prepare_finalize, pass_through)


# --------------------------------------------------------------------------------------------
# Block-fp8 layers: activations quantized by the experts
# --------------------------------------------------------------------------------------------
#
# WHY   For a block-fp8 layer vLLM's prepare quantizes the activations to e4m3 (1 x 128 groups)
#       before the experts run; MegaMoE takes them in bf16. Experts that say
#       `expects_unquantized_inputs` get bf16 (prepare defers the quantization, as for
#       FlashInfer-CUTLASS and AITER), and must quantize themselves where they hand a call to
#       vLLM's Triton fp8 experts.
# HOW   `moe_kernel_quantize_input` with the arguments vLLM's no-DP/no-EP prepare passes it
#       (prepare_finalize/no_dp_ep.py, `_quantize_input`), by keyword, as far as the installed
#       signature has them (0.33 added `is_scale_transposed`; False for the Triton experts).
# REMOVE WHEN vLLM exports the prepare step's quantization as a public function.


@functools.cache
def _moe_quantize_input_fn() -> tuple[Callable[..., Any], frozenset[str]]:
    """vLLM's ``moe_kernel_quantize_input`` and the optional keywords of the installed
    version that prepare passes (looked up once, not at every call)."""
    import inspect

    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    params = inspect.signature(moe_kernel_quantize_input).parameters
    return moe_kernel_quantize_input, frozenset(
        name for name in ("is_scale_swizzled", "is_scale_transposed", "mx_alignment")
        if name in params)


def quantize_moe_input(hidden_states: Any, quant_config: Any) -> tuple[Any, Any]:
    """(a1q, a1q_scale): ``hidden_states`` quantized as vLLM's prepare would for a layer of
    ``quant_config`` (block fp8: e4m3 with 1 x 128 dynamic scales)."""
    quantize, optional = _moe_quantize_input_fn()
    kwargs = dict(quant_dtype=quant_config.quant_dtype,
                  per_act_token_quant=quant_config.per_act_token_quant,
                  block_shape=quant_config.block_shape)
    for name in optional:
        if hasattr(quant_config, name):
            kwargs[name] = getattr(quant_config, name)
    return quantize(hidden_states, quant_config.a1_scale, **kwargs)


# --------------------------------------------------------------------------------------------
# DP + EP: vLLM's fp8 experts and the input each expects
# --------------------------------------------------------------------------------------------
#
# WHY   With DP + EP petit's prepare/finalize stands in for vLLM's allgather one, so it must
#       hand the experts vLLM built the input that vLLM's own prepare would have: for a
#       block-fp8 layer that depends on which experts vLLM's fp8 oracle chose. On Hopper
#       (`oracle/fp8.py: _get_priority_backends`, the same rule in 0.24 and 0.33) block-fp8
#       layers with EP > 1 try FlashInfer's CUTLASS experts first (FlashInferExperts, when
#       FlashInfer's CUTLASS MoE is installed), then DeepGEMM (TritonOrDeepGemmExperts, where
#       vLLM's DeepGEMM runs), then Triton; with EP = 1 Triton first. So the choice on a
#       given GPU follows the installed FlashInfer/DeepGEMM more than the vLLM version.
#       What each takes, in both versions:
#       - TritonExperts, TritonOrDeepGemmExperts: e4m3 rows + fp32 [M, H/128] row-major
#         1 x 128 scales (vLLM's prepare quantizes; UE8M0-rounded where
#         `fp8_block_scales_are_ue8m0`); global ids resolved through `expert_map`;
#       - FlashInferExperts: bf16 rows (`expects_unquantized_inputs`: the kernel quantizes
#         inside, so the modular kernel calls prepare with `defer_input_quant=True`); global
#         ids, local experts found from `ep_rank` / `ep_size` (linear placement), `expert_map`
#         unused. 0.33's fp8 oracle also passes `input_dtype` (bf16) to
#         `maybe_make_prepare_finalize` for these experts, which only FlashInfer's one-sided
#         all2all reads: the allgather prepare, like ours, follows `defer_input_quant`;
#       all three reduce the top-k themselves (TopKWeightAndReduceNoOP).
#       DeepGEMM's masked kernel (BatchedDeepGemmExperts) runs only behind DeepEP-LL /
#       NIXL-EP (`--all2all-backend` chosen explicitly): not a layer petit replaces.
#       The weights differ too: vLLM converts them for FlashInfer (w13 as [up; gate],
#       `prepare_fp8_moe_layer_for_fi`) and DeepGEMM (its scale layout,
#       `prepare_fp8_moe_layer_for_deepgemm`); only the Triton experts keep the checkpoint's
#       layout that MegaMoE takes in place.
# HOW   The classes by module and name (`_SYMBOLS`, the same in 0.24 and 0.33);
#       `ep_experts_kind` names the one a layer has (subclasses included).
# REMOVE WHEN never while petit stands in for vLLM's prepare (new experts need an entry);
#       the lookups move with vLLM's modules.

EP_EXPERTS = {
    "triton": "TritonExperts",
    "deep_gemm": "TritonOrDeepGemmExperts",
    "flashinfer_cutlass": "FlashInferExperts",
}
"""The experts petit's prepare/finalize serves with DP + EP: kind -> ``_SYMBOLS`` name."""


def ep_experts_kind(experts: Any) -> str | None:
    """``"triton"``, ``"deep_gemm"`` or ``"flashinfer_cutlass"``: which of vLLM's experts
    (``EP_EXPERTS``) ``experts`` is, or None for any other class."""
    for kind, name in EP_EXPERTS.items():
        cls = fused_moe_symbol_or_none(name)
        if cls is not None and isinstance(experts, cls):
            return kind
    return None


# --------------------------------------------------------------------------------------------
# fp8 activation scales: transposed (0.33)
# --------------------------------------------------------------------------------------------
#
# WHY   vLLM 0.33's FusedMoEQuantConfig has `is_scale_transposed`: its fp8 oracle sets it for
#       FlashInfer's TRT-LLM block-fp8 experts (Blackwell), which read the 1 x 128 activation
#       scales as [H/128, M] (column-major). Our dispatch writes them [M, H/128] row-major, so
#       such experts cannot take our fp8 wire.
# HOW   `getattr(quant_config, "is_scale_transposed", False)` (0.24 has no such field:
#       False); `prepare_finalize.dispatch_quant_mode` refuses the layer when it is set.
# REMOVE WHEN the supported range starts at 0.33 (read the field directly).


def fp8_activation_scales_transposed(quant_config: Any) -> bool:
    """Whether the experts of ``quant_config`` want column-major activation scales."""
    return bool(getattr(quant_config, "is_scale_transposed", False))


# --------------------------------------------------------------------------------------------
# Experts: 0.33's post-GEMM2 hook
# --------------------------------------------------------------------------------------------
#
# WHY   vLLM 0.33's FusedMoEExpertsModular has a `post_gemm2_hook` attribute: a model runner
#       (models/muse_spark/nvidia/muse_moe_runner.py) sets it on the layer's experts object
#       after the kernel is built, and experts that honour it stop after GEMM2 and hand the
#       unreduced rows (moe_output.UnfinalizedMoEOutput) to the hook. Our experts reduce in
#       the kernel; ignoring a set hook would drop the model's own reduction silently.
# HOW   `getattr(experts, "post_gemm2_hook", None)`; our `apply` raises NotImplementedError
#       when it is set (0.24 has no such attribute: None).
# REMOVE WHEN our experts return UnfinalizedMoEOutput for such a hook (or vLLM drops it).


def experts_post_gemm2_hook(experts: Any) -> Any:
    """The GEMM2 hook a model set on ``experts`` (vLLM >= 0.33), or None."""
    return getattr(experts, "post_gemm2_hook", None)


# --------------------------------------------------------------------------------------------
# fp8 block scales: UE8M0 or not
# --------------------------------------------------------------------------------------------
# why:  vLLM's dynamic 1x128 activation quantizer (per_token_group_quant_fp8, reached through
#       fused_moe/utils.py moe_kernel_quantize_input) rounds its scales up to powers of two
#       (UE8M0) whenever `vllm.utils.deep_gemm.is_deep_gemm_e8m0_used()` is true, which on
#       Hopper/Blackwell is the default (vLLM vendors DeepGEMM; VLLM_USE_DEEP_GEMM and
#       VLLM_USE_DEEP_GEMM_E8M0 default to 1), for every fp8 block layer, Triton experts too.
#       Our dispatch quantizes in vLLM's place, so it must make the same choice (2x H200,
#       commit fb2cba5: with exact scales only, our fp8 block layer output was 6.5% away from
#       vLLM's own fp8 path, the per-token one within 2%).
# how:  ask vLLM's own predicate; False if vLLM has none.
# remove when: never while vLLM decides this globally; follow the predicate if it moves.


def fp8_block_scales_are_ue8m0() -> bool:
    """Whether vLLM quantizes fp8 1x128 activation blocks with power-of-two scales here."""
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
    except ImportError:
        return False
    return bool(is_deep_gemm_e8m0_used())


# --------------------------------------------------------------------------------------------
# MONKEYPATCH: FusedMoEKernel.__init__
# --------------------------------------------------------------------------------------------
#
# WHY   `--all2all-backend` rejects unknown values (argparse choices, the pydantic Literal
#       of ParallelConfig.all2all_backend, and the all2all-manager switch), so we cannot add a
#       backend by name. Every modular MoE kernel, for every quant method that owns one
#       (oracle/{unquantized,fp8,int8,nvfp4,mxfp4,int_wna16,w4a8,w4a8_int8}.py, the
#       FusedMoEModularMethod of the old interface, LoRA and elastic-EP rebuilds), is built as
#       `FusedMoEKernel(prepare_finalize, fused_experts)`: the single place where the
#       prepare/finalize chosen by `all2all_utils.maybe_make_prepare_finalize` meets the
#       experts. Patching `maybe_make_prepare_finalize` instead would not work: each oracle
#       imports it by name.
# HOW   Wrap `FusedMoEKernel.__init__`: before the original runs, the plugin's `substitute`
#       callback may return another prepare/finalize (ours) in place of the one passed in,
#       and then the optional `substitute_experts` callback may return another experts object
#       (our PetitExperts in place of vLLM's TritonExperts, opt-in: VLLM_PETIT_MOE_EXPERTS=1).
#       Nothing else changes: the weights, their layout (as loaded for the Triton experts),
#       the quant method and the layer stay as vLLM built them. The wrapper is marked
#       (`_petit_moe_original`) so installing twice is a no-op, and `uninstall_kernel_hook`
#       restores the original (tests).
#       The patch is installed when the modular-kernel module is first imported (see
#       `call_when_imported`) so that `register()` imports no fused-MoE code in processes
#       that never build a MoE layer.
# REMOVE WHEN vLLM lets plugins register an all2all backend / prepare-finalize factory.


def install_kernel_hook(
    substitute: Callable[[Any, Any], Any],
    substitute_experts: Callable[[Any, Any], Any] | None = None,
) -> bool:
    """Patch ``FusedMoEKernel.__init__`` to pass ``prepare_finalize`` through ``substitute``
    (and then ``fused_experts`` through ``substitute_experts``, if given).

    ``substitute(prepare_finalize, fused_experts) -> prepare_finalize``;
    ``substitute_experts(prepare_finalize, fused_experts) -> fused_experts`` sees the
    prepare/finalize ``substitute`` returned. Returns True if this call installed the patch,
    False if it was already installed.
    """
    kernel_cls = fused_moe_symbol("FusedMoEKernel")
    current = kernel_cls.__init__
    if getattr(current, "_petit_moe_original", None) is not None:
        return False
    original = current

    def __init__(self, prepare_finalize, fused_experts, *args, **kwargs):
        prepare_finalize = substitute(prepare_finalize, fused_experts)
        if substitute_experts is not None:
            fused_experts = substitute_experts(prepare_finalize, fused_experts)
        original(self, prepare_finalize, fused_experts, *args, **kwargs)

    __init__._petit_moe_original = original  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    __init__.__qualname__ = getattr(original, "__qualname__", "__init__")
    kernel_cls.__init__ = __init__
    return True


def uninstall_kernel_hook() -> bool:
    """Undo ``install_kernel_hook``; True if a patch was removed."""
    kernel_cls = fused_moe_symbol("FusedMoEKernel")
    original = getattr(kernel_cls.__init__, "_petit_moe_original", None)
    if original is None:
        return False
    kernel_cls.__init__ = original
    return True


# --------------------------------------------------------------------------------------------
# Shutdown: closing our buffers with the group they were built on
# --------------------------------------------------------------------------------------------
# WHY   An EpBuffer holds its heap (~1.8 GiB per rank at 8 ranks x 8192 tokens x 7168), a
#       heartbeat thread and a fault-watch thread until closed, and vLLM has no shutdown hook
#       for a plugin's communication buffers: an engine that shuts down in process (tests,
#       `LLM` deleted and rebuilt, elastic restarts) then builds new groups and new buffers
#       while the old ones live on. vLLM's own EP buffers (its all2all managers) end in
#       `GroupCoordinator.destroy` (through `device_communicator.destroy()`), which vLLM's
#       shutdown reaches for every group: `destroy_model_parallel` (called by
#       `cleanup_dist_env_and_memory`, the in-process shutdown path) destroys `_EP`.
# HOW   Wrap `vllm.distributed.parallel_state.GroupCoordinator.destroy` (once, marked like the
#       kernel hook): before the original runs, `callback(cpu_group)` closes what was built on
#       that coordinator's CPU group (the group `ep_group_facts` hands to the buffer).
#       Where the class or method is missing, nothing is patched (False): buffers then live
#       until the process exits, as before.
# REMOVE WHEN vLLM offers a shutdown callback for communication buffers of a group.


def on_group_destroy(callback: Callable[[Any], None]) -> bool:
    """Call ``callback(coordinator.cpu_group)`` whenever vLLM destroys a GroupCoordinator,
    before the group itself goes (see above). Idempotent per callback; True when the hook is
    in place."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return False
    cls = getattr(parallel_state, "GroupCoordinator", None)
    current = getattr(cls, "destroy", None)
    if current is None:
        return False
    callbacks = getattr(current, "_petit_moe_callbacks", None)
    if callbacks is None:
        original = current
        callbacks = []

        def destroy(self, *args, **kwargs):
            group = getattr(self, "cpu_group", None)
            if group is not None:
                for cb in list(callbacks):
                    try:
                        cb(group)
                    except Exception:  # noqa: BLE001 - vLLM's own teardown must go on
                        logger.exception("vllm-petit-moe: closing buffers of a destroyed "
                                         "group failed")
            return original(self, *args, **kwargs)

        destroy._petit_moe_original = original  # type: ignore[attr-defined]
        destroy._petit_moe_callbacks = callbacks  # type: ignore[attr-defined]
        destroy.__doc__ = original.__doc__
        destroy.__qualname__ = getattr(original, "__qualname__", "destroy")
        cls.destroy = destroy
    if callback not in callbacks:
        callbacks.append(callback)
    return True


def kernel_hook_installed() -> bool:
    """Whether ``FusedMoEKernel.__init__`` currently carries our patch (imports the module)."""
    kernel_cls = fused_moe_symbol("FusedMoEKernel")
    return getattr(kernel_cls.__init__, "_petit_moe_original", None) is not None


# --------------------------------------------------------------------------------------------
# Post-import hook (a patch of the import system, not of vLLM)
# --------------------------------------------------------------------------------------------
#
# WHY   The kernel patch must be in place before the first MoE layer is built, but importing
#       vLLM's fused-MoE package inside `register()` would load it (Triton, custom ops, ...)
#       in every process, including the API server that never builds a layer.
# HOW   If the module is already imported, run the callback now. Otherwise put a finder at
#       the front of `sys.meta_path` that, for that one module name, wraps the real loader so
#       the callback runs right after the module body; the finder removes itself once used.
#       Forked children inherit it, spawned ones call `register()` again.
# REMOVE WHEN the patch above is removed, or if importing the module eagerly is acceptable.

_import_lock = threading.Lock()


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, ... for tools
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, module_name: str, callback: Callable[[ModuleType], None]):
        self.module_name = module_name
        self._callback = callback
        self._searching = False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return None
        _remove_finder(self)
        spec.loader = _CallbackLoader(spec.loader, self._callback)
        return spec


def _remove_finder(finder: _PostImportFinder) -> None:
    with _import_lock:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


def call_when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> bool:
    """Run ``callback(module)`` now if ``module_name`` is imported, else right after its import.

    Returns True if the callback ran now.
    """
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return True
    with _import_lock:
        if not any(
            isinstance(f, _PostImportFinder) and f.module_name == module_name
            for f in sys.meta_path
        ):
            sys.meta_path.insert(0, _PostImportFinder(module_name, callback))
    return False


MODULAR_KERNEL_MODULE = _MK


# --------------------------------------------------------------------------------------------
# Runtime state of vLLM (config, parallel groups, forward context, platform)
# --------------------------------------------------------------------------------------------
#
# WHY   The hook decides per layer from vLLM's config and parallel state; prepare() needs the
#       token counts of all DP ranks of the current step to size its output statically.
# HOW   0.24: `vllm.config.get_current_vllm_config_or_none` (falls back to the raising
#       `get_current_vllm_config`); `vllm.distributed.get_ep_group()` is a GroupCoordinator with
#       `world_size`, `rank_in_group`, `cpu_group` (gloo) and
#       `device_communicator.all2all_manager.internode` (computed by vLLM with a collective at
#       group creation; we fall back to our own `in_the_same_node_as` collective if absent);
#       `vllm.forward_context.get_forward_context().dp_metadata.num_tokens_across_dp_cpu` is a
#       CPU int tensor [DP size] (no device sync to read it).
# REMOVE WHEN never (these are the inputs); only the lookups may need new fallbacks.


def current_vllm_config_or_none() -> Any:
    """The vLLM config of the current ``set_current_vllm_config`` context, or None."""
    from vllm import config as vllm_config_module

    getter = getattr(vllm_config_module, "get_current_vllm_config_or_none", None)
    if getter is not None:
        return getter()
    try:
        return vllm_config_module.get_current_vllm_config()
    except AssertionError:
        return None


def platform_name() -> str:
    """``"cuda"``, ``"rocm"`` or vLLM's device type of the current platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    return str(getattr(current_platform, "device_type", "") or "unspecified")


def ep_group_facts() -> tuple[int, int, bool, Any]:
    """(world size, rank in group, internode, cpu process group) of vLLM's EP group."""
    from vllm.distributed import get_ep_group

    ep_group = get_ep_group()
    communicator = getattr(ep_group, "device_communicator", None)
    manager = getattr(communicator, "all2all_manager", None)
    internode = getattr(manager, "internode", None)
    if internode is None:
        from vllm.distributed.parallel_state import in_the_same_node_as

        internode = not all(in_the_same_node_as(ep_group.cpu_group, source_rank=0))
    return ep_group.world_size, ep_group.rank_in_group, bool(internode), ep_group.cpu_group


_PEER_ACCESS: dict[int, bool | None] = {}


def ep_peer_access(cpu_group: Any) -> bool | None:
    """Whether the GPUs of the EP group (one per rank, found by exchanging physical device ids
    through the group's store with a bound: ``rendezvous.Agreement``, no collective on
    ``cpu_group``) are pairwise connected by NVLink, through
    vLLM's platform (``is_fully_connected``, NVML). Ranks sharing one GPU count as connected.
    None where the platform cannot tell. Collective over ``cpu_group`` on its first call;
    cached per group."""
    key = id(cpu_group)
    if key in _PEER_ACCESS:
        return _PEER_ACCESS[key]
    import torch

    from vllm.platforms import current_platform

    from vllm_petit_moe.rendezvous import Agreement

    physical = None
    try:
        physical = int(current_platform.device_id_to_physical_device_id(
            torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - unknown on this rank: unknown for all
        pass
    ids = Agreement(cpu_group, "peer-access")("peer access", None, physical)
    distinct = sorted(set(ids))
    result: bool | None = True
    if None in distinct:
        result = None
    elif len(distinct) > 1:
        try:
            result = bool(current_platform.is_fully_connected(distinct))
        except Exception:  # noqa: BLE001 - NVML missing: let the heap mapping decide
            result = None
    _PEER_ACCESS[key] = result
    return result


def dp_num_tokens_across_ranks() -> list[int] | None:
    """Token counts of all DP ranks in the current forward pass, or None if vLLM set none.

    Host-side only (a CPU tensor in vLLM 0.24): safe under CUDA-graph capture.
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    dp_metadata = getattr(get_forward_context(), "dp_metadata", None)
    if dp_metadata is None:
        return None
    counts = getattr(dp_metadata, "num_tokens_across_dp_cpu", None)
    if counts is None:
        return None
    return [int(c) for c in counts.tolist()]
