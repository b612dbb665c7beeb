"""vLLM general plugin entry point of vllm-petit-moe.

setup.py registers ``petit_moe = vllm_petit_moe.plugin:register`` in the entry-point group
``vllm.general_plugins``; vLLM calls ``register()`` in the API server, in every engine core
and in every worker (``vllm.plugins.load_general_plugins``), possibly several times.

``register()``:

- always registers our environment variables in vLLM's registry, so that vLLM's environment
  validation accepts ``VLLM_USE_PETIT_MOE`` (and ``VLLM_PETIT_MOE_*``), and parses them (a
  malformed value fails here, at start-up);
- with ``VLLM_USE_PETIT_MOE=1``: checks the vLLM version (``compat.UnsupportedVllmVersion``,
  which stops vLLM's start-up with what to install, outside the supported range) and
  installs the hook that substitutes our prepare/finalize in vLLM's modular MoE kernel; the
  hook itself is attached only once vLLM's fused-MoE code is imported, so processes that
  never build a MoE layer import nothing more;
- without the flag: nothing else (outside the supported range, a warning: the plugin does
  nothing, so vLLM runs unchanged);
- logs once per process which MoE backend is in effect.

It is idempotent and imports only this package's light modules, plus ``vllm.envs``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.petit_moe.plugin")

_registered = False


def register() -> None:
    """vLLM plugin entry point; see the module docstring. Safe to call any number of times."""
    global _registered
    if _registered:
        return

    from vllm_petit_moe.vllm_glue import compat, envs

    compat.register_env_vars(envs.ENV_VARS)
    enabled = envs.use_petit_moe()  # raises ValueError on a malformed value, at start-up
    envs.strict()
    envs.petit_experts()
    envs.timeout_s()
    envs.max_wait_s()
    if not enabled:
        compat.warn_if_unsupported_vllm()
        _registered = True
        logger.info(
            "vllm-petit-moe: installed, not enabled (set %s=1); MoE layers use vLLM's own "
            "backends",
            envs.VLLM_USE_PETIT_MOE,
        )
        return

    compat.require_supported_vllm()
    from vllm_petit_moe.vllm_glue import hook

    hook.install()
    _registered = True
    logger.info(
        "vllm-petit-moe: %s=1 (vLLM %s): DP+EP MoE layers on one node will use petit "
        "dispatch/combine in place of allgather/reduce-scatter; each layer kind's choice is "
        "logged when it is built",
        envs.VLLM_USE_PETIT_MOE,
        compat.vllm_version(),
    )
