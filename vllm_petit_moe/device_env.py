"""Environment every multi-GPU process of this project runs with (tests, benchmarks, servers).

NVLink multicast must stay off on the shared GPU hosts: a program using it can take the
host's GPUs out of service. vLLM's symmetric-memory all-reduce uses multicast operations, its
FlashInfer sampler is not in the offline vLLM bundle, and the GPU machines have no network.
"""

MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

VLLM_SAFE_ENV = {
    **MULTICAST_OFF_ENV,
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def commit_stamp(repo_root) -> str:
    """The commit a result was made at: $PETIT_COMMIT (the GPU machines get a copy of the
    tree without .git), else git's short hash of `repo_root`, else "unknown"."""
    import os
    import subprocess
    if os.environ.get("PETIT_COMMIT"):
        return os.environ["PETIT_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(repo_root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"
