"""vllm-petit-moe: an expert-parallel MoE backend (symmetric heap, dispatch/combine, expert
grouped GEMMs and a fused MegaMoE kernel) plugged into vLLM."""

# The compiled extension `_C` links against torch's shared libraries (libc10, libtorch) without
# a search path of its own: they resolve only once torch has loaded them, so the package loads
# torch first and `import vllm_petit_moe._C` works on its own. Nothing else is imported here:
# the plugin entry point (`plugin.register`) and the runtime modules load on first use.
import torch  # noqa: F401


def load_extension():
    """The compiled extension ``vllm_petit_moe._C`` (imported on first use by ``ops`` and
    ``buffer``). It is tied to the C++ ABI of the torch it was built with: under another torch
    (vLLM upgraded since the build) it fails to load with an undefined symbol, which becomes an
    ImportError that says to rebuild."""
    try:
        from . import _C
    except ImportError as exc:
        if "undefined symbol" not in str(exc):
            raise
        raise ImportError(
            f"vllm_petit_moe._C does not load with torch {torch.__version__}: it was built "
            "against another torch (did vLLM change since the build?). Rebuild it in this "
            "environment: pip install --no-build-isolation -e <this checkout>. "
            f"Loader: {exc}") from exc
    return _C
