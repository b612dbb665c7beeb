"""vllm-petit-moe: an expert-parallel MoE backend (symmetric heap, dispatch/combine, expert
grouped GEMMs and a fused MegaMoE kernel) plugged into vLLM."""

# The compiled extension `_C` links against torch's shared libraries (libc10, libtorch) without
# a search path of its own: they resolve only once torch has loaded them, so the package loads
# torch first and `import vllm_petit_moe._C` works on its own. Nothing else is imported here:
# the plugin entry point (`plugin.register`) and the runtime modules load on first use.
import torch  # noqa: F401
