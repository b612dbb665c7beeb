"""CPU checks of examples/bench_experts.py: argument parsing, --help, its torch baseline
against the reference, and the plot of a results file. The GPU parts (timing, petit, Triton)
run on a GPU machine only."""
from __future__ import annotations

import json

import pytest
from script_module import load_script, script_help
import torch

from vllm_petit_moe.config import ExpertConfig
from vllm_petit_moe.testing import reference


@pytest.fixture(scope="module")
def bench():
    return load_script("examples/bench_experts.py")


def test_help_runs_without_a_gpu():
    out = script_help("examples/bench_experts.py")
    assert "--tokens" in out and "--hot-fraction" in out


def test_parse_args(bench):
    args = bench.parse_args([])
    assert args.tokens == bench.TOKENS and args.iters == 30 and args.world == 2
    assert args.routings == ["uniform", "skewed"] and args.tiles == ["auto"]
    assert not args.profile and bench.parse_args(["--profile", "--tiles", "wgmma_narrow"]).profile
    assert bench.parse_args(["--tiles", "wgmma", "wgmma_mc"]).tiles == ["wgmma", "wgmma_mc"]
    assert args.expert_configs == [ExpertConfig()]
    sweep = bench.parse_args(["--expert-configs", "", "narrow_max_rows=4,m64_max_rows=64"])
    assert sweep.expert_configs == [ExpertConfig(),
                                    ExpertConfig(narrow_max_rows=4, m64_max_rows=64)]
    quick = bench.parse_args(["--quick", "--presets", "qwen3-30b-a3b", "--routings",
                              "hot_expert", "--world", "8"])
    assert quick.tokens == bench.QUICK_TOKENS and quick.iters == 10
    assert quick.presets == ["qwen3-30b-a3b"] and quick.world == 8
    for bad in (["--world", "3"], ["--tokens", "0"], ["--hot-fraction", "1.5"],
                ["--routings", "zipf"], ["--iters", "0"], ["--chain", "0"],
                ["--tiles", "wgmma_ws"], ["--expert-configs", "narrow_rows=4"],
                ["--expert-configs", "narrow_max_rows=200"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_chain_length_fits_the_copies_in_free_memory(bench):
    gib = 1 << 30
    assert bench.parse_args([]).chain == 1 and bench.parse_args(["--chain", "8"]).chain == 8
    assert bench.chain_length(1, gib, 100 * gib) == 0  # off
    assert bench.chain_length(8, gib, 100 * gib) == 8
    # 10.5 GiB copies (DeepSeek-V3 at W=2) in 80 GiB free with 8 GiB reserved: 1 + 6
    assert bench.chain_length(8, int(10.5 * gib), 80 * gib, 8 * gib) == 7
    assert bench.chain_length(8, 20 * gib, 27 * gib, 8 * gib) == 0  # not even one copy
    assert bench.chain_length(8, 20 * gib, 28 * gib, 8 * gib) == 2
    assert bench.chain_length(4, gib, 0, 8 * gib) == 0


def test_torch_baseline_matches_reference(bench):
    gen = torch.Generator().manual_seed(0)
    num_rows, top_k, hidden, inter, num_local = 23, 4, 48, 16, 5
    ids = torch.randint(-1, num_local, (num_rows, top_k), generator=gen, dtype=torch.int32)
    weights = torch.where(ids >= 0, torch.rand(num_rows, top_k, generator=gen), 0.0)
    recv_x = torch.randn(num_rows, hidden, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(num_local, hidden, inter, generator=gen) / inter**0.5).bfloat16()
    problem = (recv_x, ids, weights, w13, w2)
    kernel_ref = reference.experts_reference(*problem, precision="kernel")
    fp32_ref = reference.experts_reference(*problem, precision="fp32")
    # bf16 matmuls round the gate/up and down outputs once more than the kernels do.
    tol = reference.tolerance(kernel_ref, fp32_ref, factor=8.0)
    reference.check_close(bench.torch_loop(*problem), fp32_ref, tol)


def test_replot(bench, tmp_path):
    rows = []
    for preset in bench.PRESETS:
        for routing in bench.ROUTINGS:
            for tokens in (1, 128):
                rows.append(dict(
                    gpu="H200", commit="abc1234", date="2026-01-01T00:00:00Z", preset=preset,
                    routing=routing, tokens=tokens, tflops=1.0 * tokens,
                    triton_tflops=None if tokens == 1 else 2.0, torch_tflops=0.5,
                    speedup_vs_triton=None, weight_gbps=3000.0, hbm_gbps=4000.0))
    path = tmp_path / "experts_H200_1gpu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.main(["--replot", str(path)]) == 0
    assert path.with_suffix(".png").stat().st_size > 0
    # Several families per configuration (--tiles a b): one petit line each.
    several = [dict(r, tiles_requested=family) for r in rows for family in ("wgmma", "wgmma_mc")]
    several += [dict(r, tiles_requested="auto", expert_config=dict(narrow_max_rows=4))
                for r in rows]
    assert bench._variant(several[-1]) == "auto narrow_max_rows=4"
    path = tmp_path / "experts_H200_1gpu_families.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in several))
    assert bench.main(["--replot", str(path)]) == 0
    assert path.with_suffix(".png").stat().st_size > 0
