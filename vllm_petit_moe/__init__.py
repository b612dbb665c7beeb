"""vllm-petit-moe: an expert-parallel MoE backend (symmetric heap, dispatch/combine, expert
grouped GEMMs and a fused MegaMoE kernel) plugged into vLLM."""
