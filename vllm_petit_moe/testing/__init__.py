"""Testing oracles and diagnostics, apart from the runtime: `reference` (the plain-torch oracle
of every kernel) and `combine_trace` (the combine timeline's summary); and what tests,
benchmarks and tools share: `bench_env` (the GPU hosts' environment, result stamps and files),
`rank_pool` (one process per rank) and `vllm_moe_harness` (one MoE layer through vLLM's
modular kernel on W ranks). Tests, examples and tools import them; the runtime modules never
do."""
