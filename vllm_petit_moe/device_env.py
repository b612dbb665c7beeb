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
