"""vLLM glue of vllm-petit-moe: the plugin's hook into vLLM's fused-MoE modular kernel.

Modules (see docs/vllm_integration.md):

- ``envs``: the environment variables of the plugin (pure ``os``; no vLLM import).
- ``compat``: every vLLM version difference and every monkeypatch, each with why / how /
  remove-when.
- ``hook``: decides, per MoE layer, whether to substitute our prepare/finalize.
- ``prepare_finalize``: ``PetitPrepareAndFinalize``, vLLM's modular prepare/finalize over an
  ``EpBuffer``.
- ``experts``: ``PetitExperts``, vLLM's modular experts over our grouped GEMMs (opt-in).
- ``buffer_cache``: the process's ``EpBuffer`` per (group, hidden size, experts), shared by
  all MoE layers.

Importing this package imports nothing from vLLM, torch or the compiled extension: the
plugin entry point must stay cheap in every vLLM process.
"""
