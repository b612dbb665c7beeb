"""Build script for vllm-petit-moe.

The compiled extension `vllm_petit_moe._C` is built with torch's CUDAExtension for sm_90a by
default. Override the targets with TORCH_CUDA_ARCH_LIST (e.g. "9.0a" or "9.0a;10.0a"); the
compile runs in parallel (ninja, MAX_JOBS defaults to the core count).

Install into an environment that already has a supported vLLM (0.24-0.33, VLLM_REQUIREMENT):
the extension is compiled against the torch installed there, hence no build isolation (an
isolated build would fetch another torch and build against that). The requirements pin
neither vLLM nor torch to one version, so pip changes neither (vLLM pins its own torch). An
editable build without isolation also needs setuptools >= 64, wheel and ninja:
    pip install "vllm>=0.24,<0.34" wheel ninja     # or keep the vLLM you have
    CUDA_HOME=/usr/local/cuda pip install --no-build-isolation -e ".[test]"
The build needs an nvcc of the same CUDA major version as the installed torch
(torch.version.cuda; torch's cpp_extension checks). Changing torch afterwards (e.g. upgrading
vLLM) needs a rebuild: the extension links against that torch's C++ ABI.
"""
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
CSRC = ROOT / "csrc"

# Sources of the extension: framework-free kernels, heap and EP context + the one torch
# binding file.
KERNEL_SOURCES = ["comm/heap.cpp", "comm/ep_context.cpp", "comm/dispatch_combine.cu",
                  "experts/routing.cu",
                  "experts/tile_choice.cu", "experts/gemm_sm90.cu", "experts/gemm_simt.cu",
                  "experts/reduce.cu", "experts/megamoe.cu"]
BINDING_SOURCES = ["bindings/module.cpp", "bindings/kernels.cpp", "bindings/ep_context.cpp"]

# The vLLM versions the glue supports (vllm_petit_moe/vllm_glue/compat.py SUPPORTED_VLLM, which
# a CPU test keeps equal to this). A range, not a pin: installing into a working vLLM
# environment must not move vLLM, and through vLLM's own exact pin, torch.
VLLM_REQUIREMENT = "vllm>=0.24,<0.34"


def _extension_modules():
    if os.environ.get("PETIT_MOE_SKIP_EXTENSION") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError as exc:
        raise RuntimeError(
            "vllm-petit-moe: building vllm_petit_moe._C needs the torch it will run with, and "
            "none is importable here (an isolated build?). Install vLLM first (it brings its "
            "torch), then this package without build isolation: "
            "pip install --no-build-isolation -e .") from exc

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"  # torch otherwise may guess /usr/local
    # No -std flag: torch's BuildExtension then adds the standard the installed torch's headers
    # need (C++17 for torch 2.11, C++20 for torch 2.14); the sources compile as either.
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-Xptxas=-warn-spills"]
    # The wgmma expert kernels exist only in an sm_90a image; the host code must know whether
    # this build made one (the kernel attributes do not tell sm_90a from sm_90).
    archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
    if "9.0a" in (a.strip().removesuffix("+PTX") for a in archs):
        nvcc_flags.append("-DPETIT_SM90A_BUILT=1")
    ext = CUDAExtension(
        name="vllm_petit_moe._C",
        sources=[str(Path("csrc") / s) for s in KERNEL_SOURCES + BINDING_SOURCES],
        include_dirs=[str(CSRC)],
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},
    )
    return [ext], {"build_ext": _build_ext_class(BuildExtension)}


def _build_ext_class(build_extension):
    """torch's BuildExtension (ninja) compiling into build/temp.torch<version>: one object
    directory per torch build, so re-installs recompile only changed sources (an editable
    install through PEP 660 would otherwise compile in a fresh temporary directory every time)
    and objects of two torch versions never mix."""
    import torch

    class BuildExt(build_extension.with_options(use_ninja=True)):
        def finalize_options(self):
            super().finalize_options()
            self.build_temp = str(ROOT / "build" / f"temp.torch{torch.__version__}")

    return BuildExt


ext_modules, cmdclass = _extension_modules()

setup(
    name="vllm-petit-moe",
    version="0.1.0",
    description="Expert-parallel MoE backend for vLLM: symmetric-heap dispatch/combine "
                "kernels, grouped GEMMs and a fused MegaMoE kernel",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_petit_moe", "vllm_petit_moe.*"]),
    package_data={"vllm_petit_moe": ["configs/*.json", "configs/*/*.json"]},
    install_requires=[VLLM_REQUIREMENT, "torch"],
    # pandas: `vllm bench serve --dataset-name custom` reads its JSONL with it (a vllm[bench]
    # dependency; the rest of that extra is for datasets this project does not use).
    extras_require={"test": ["pytest>=8", "matplotlib", "requests", "pandas"]},
    entry_points={"vllm.general_plugins": ["petit_moe = vllm_petit_moe.plugin:register"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
