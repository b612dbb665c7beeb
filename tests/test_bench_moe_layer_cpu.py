"""CPU tests of examples/bench_moe_layer.py (arguments) and of the benchmarks' --profile
kernel breakdown (vllm_petit_moe/testing/bench_env.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script

BENCH_PATH = Path(__file__).resolve().parent.parent / "examples" / "bench_moe_layer.py"


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("vllm")  # the harness it imports builds on vLLM
    return load_script("examples/bench_moe_layer.py")


def test_kernel_breakdown_categories():
    from vllm_petit_moe.testing import bench_env

    kernels = [
        ("void petit::(anonymous namespace)::dispatch_kernel(petit::DispatchArgs)", 300.0),
        ("void petit::(anonymous namespace)::combine_kernel(petit::CombineArgs)", 500.0),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 70.0),
        ("void petit::expert_gate_up_tc_kernel<petit::Sm90WgmmaMainloop<...>>(...)", 900.0),
        ("void petit::expert_down_tc_kernel<petit::Sm90WgmmaMainloop<...>>(...)", 600.0),
        ("void petit::expert_fused_ws_kernel<petit::gemm::Sm90WgmmaWsMainloop<...>>(...)", 100.0),
        ("void petit::expert_reduce_kernel(petit::ExpertGemmArgs)", 40.0),
        ("void petit::row_list_histogram_kernel(petit::RowListArgs)", 10.0),
        ("void petit::row_list_scatter_kernel(petit::RowListArgs)", 10.0),
        ("fused_moe_kernel", 2000.0),
        ("void vllm::moe::moe_align_block_size_kernel<int>(...)", 30.0),
        ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>(...)", 20.0),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 8.0),
        ("Memset (Device)", 2.0),
    ]
    out = bench_env.kernel_breakdown(kernels, replays=10)
    assert out == pytest.approx({
        "dispatch": 30.0, "combine": 50.0, "nccl": 7.0, "petit_gemm": 160.0,
        "petit_reduce": 4.0, "petit_row_lists": 2.0, "triton_gemm": 200.0,
        "triton_align_sum_act": 5.0, "other": 1.0, "kernels_total": 459.0})
    assert list(out)[:2] == ["dispatch", "combine"] and list(out)[-1] == "kernels_total"
    # empty categories are left out; nothing traced gives a zero total
    assert bench_env.kernel_breakdown([("combine_kernel", 4.0)], 2) == {
        "combine": 2.0, "kernels_total": 2.0}
    assert bench_env.kernel_breakdown([], 3) == {"kernels_total": 0.0}
    with pytest.raises(ValueError, match="replays"):
        bench_env.kernel_breakdown(kernels, 0)
    text = bench_env.format_breakdown(out)
    assert text.startswith("dispatch 30.0, combine 50.0") and text.endswith("(kernels 459.0 us)")


def test_parse_args(bench):
    a = bench.parse_args(["--quick", "--profile"])
    assert a.tokens == bench.QUICK_TOKENS and a.iters == 20 and a.profile
    assert a.profile_replays == 10
    for bad in (["--tokens", "0"], ["--profile-replays", "0"], ["--hot-fraction", "2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_w1_routing_and_replot(bench, tmp_path):
    """--world 1's routing draws K distinct experts per token (skewed: half of the picks on
    the hot eighth), and --replot redraws the plot of a W=1 results file."""
    import json

    import torch

    import moe_layer_w1 as w1

    preset = w1.W1_PRESETS["qwen3-30b-a3b"]
    g = torch.Generator().manual_seed(0)
    ids, weights = w1.random_routing(4096, preset, "uniform", g, "cpu")
    assert ids.shape == (4096, preset.top_k) and ids.dtype == torch.int32
    assert all(len(set(row)) == preset.top_k for row in ids.tolist())
    assert torch.allclose(weights.sum(-1), torch.ones(4096))
    hot = preset.num_experts // 8
    uniform_share = (ids < hot).float().mean().item()
    skewed, _ = w1.random_routing(4096, preset, "skewed", g, "cpu")
    skewed_share = (skewed < hot).float().mean().item()
    assert abs(uniform_share - 1 / 8) < 0.02 and skewed_share > 0.3
    row = dict(gpu="H200", world=1, commit="abc1234", date="2026-12-02T00:00:00Z",
               preset="qwen3-30b-a3b", routing="uniform", tokens=1, vllm_us=30.0,
               composed_us=32.0, megamoe_us=31.0, roofline_us=18.0, vllm_over_megamoe=30 / 31,
               roofline_fraction=18 / 31)
    path = tmp_path / "moe_layer_H200_1gpu.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert bench.main(["--world", "1", "--replot", str(path)]) == 0
    assert path.with_suffix(".png").stat().st_size > 0


def test_w2_rows_with_the_fused_layer(bench, tmp_path, capsys):
    """--megamoe: the fused path's per-rank times become megamoe_us (the slowest rank),
    megamoe_speedup and megamoe_rel_diff; a row without it has none of them; both print and
    plot."""
    from vllm_petit_moe.testing import vllm_moe_harness as harness

    def rank(default_us, petit_us, fused_us=None):
        r = dict(pairs=64, hot_share=0.5, rel_diff=1e-3, max_abs_diff=1e-2, finite=True,
                 petit_experts_rel_diff=None, megamoe_rel_diff=None,
                 default_us=default_us, petit_us=petit_us,
                 roofline=dict(roofline_us=30.0, roofline_hbm_us=30.0, roofline_flops_us=1.0,
                               roofline_link_us=2.0))
        if fused_us is not None:
            r[f"{harness.PETIT_FUSED_PATH}_us"] = fused_us
            r["megamoe_rel_diff"] = 2e-3
        return r

    info = dict(vllm_backend="TRITON", triton_tuned=True, copy_bps=4.2e12, mm_flops=7e14,
                link_bps=3.5e11)
    fused = bench._combine("qwen3-30b-a3b", "uniform", 8, [rank(100.0, 90.0, 50.0),
                                                            rank(110.0, 95.0, 60.0)], info, 0.5, 20)
    assert fused["megamoe_us"] == 60.0 and fused["megamoe_us_ranks"] == [50.0, 60.0]
    assert fused["megamoe_speedup"] == pytest.approx(110.0 / 60.0)
    assert fused["megamoe_rel_diff"] == 2e-3 and fused["speedup"] == pytest.approx(110 / 95)
    assert fused["vllm_us"] == 110.0 and fused["composed_us"] is None
    assert fused["roofline_us"] == 30.0 and fused["roofline_fraction"] == pytest.approx(0.5)
    assert fused["link_gbps"] == pytest.approx(350.0) and fused["triton_tuned"]
    composed = bench._combine("qwen3-30b-a3b", "uniform", 512, [rank(300.0, 250.0)] * 2, info,
                              0.5, 20)
    assert not any(k.startswith("megamoe") for k in composed)
    for row in (fused, composed):
        bench._print_row(row)
    assert "megamoe 60.0 us, speedup 1.83" in capsys.readouterr().out
    bench._plot([fused, composed], tmp_path / "w2.png", "test")
    assert (tmp_path / "w2.png").stat().st_size > 0
    assert bench.parse_args(["--megamoe"]).megamoe


def test_layer_roofline_parts(bench):
    """The W >= 2 roofline from the routing: weight bytes of the experts with rows, pairs,
    and rows over the link (once per token and other destination rank, both directions)."""
    import torch

    from vllm_petit_moe.testing import vllm_moe_harness as harness

    shape = harness.MoEShape(hidden=64, intermediate=32, num_experts=8, top_k=2)  # L = 4
    ids = [torch.tensor([[0, 1], [0, 5], [-1, -1]]), torch.tensor([[6, 7]])]
    r = bench.layer_roofline(shape, ids, 2, copy_bps=1e6, mm_flops=1e9, link_bps=1e3)
    expert_bytes = 3 * 64 * 32 * 2
    # rank 0: experts 0, 1 (3 pairs); rank 1: experts 5, 6, 7 (3 pairs)
    assert r["roofline_hbm_us"] == pytest.approx(3 * expert_bytes / 1e6 * 1e6)
    assert r["roofline_flops_us"] == pytest.approx(3 * 6 * 64 * 32 / 1e9 * 1e6)
    # rank 0 sends 1 row (token 1 to rank 1), rank 1 sends 1 row (to rank 0): 2 x 1 x 128 B
    assert r["roofline_link_us"] == pytest.approx(2 * 1 * 128 / 1e3 * 1e6)
    assert r["roofline_us"] == max(r["roofline_hbm_us"], r["roofline_flops_us"],
                                   r["roofline_link_us"])


def test_w1_agreement_rule_per_dtype():
    """bf16 rows agree within 2e-2 of vLLM; fp8 rows agree when MegaMoE is no farther from the
    fp32 reference than vLLM's w8a8 (which rounds the activations to e4m3), whatever their
    mutual difference."""
    from moe_layer_w1 import _agrees
    assert _agrees(1e-2, {}) and not _agrees(3e-2, {})
    assert _agrees(5e-2, {"vllm": 4.7e-2, "mega": 1.7e-3})
    assert not _agrees(5e-2, {"vllm": 4.7e-2, "mega": 6e-2})
    assert _agrees(1e-3, {"vllm": 1e-3, "mega": 1.5e-2})  # both tiny: under 2e-2


def test_replot_draws_the_newest_row_of_each_configuration(tmp_path):
    """A results file gathers runs of several commits: with a key, replot draws each
    configuration's last row once, and the title names the commits drawn."""
    import json

    from vllm_petit_moe.testing.bench_env import replot

    def row(commit, tokens, us):
        return dict(commit=commit, preset="qwen3-30b-a3b", dtype="fp8", routing="uniform",
                    tokens=tokens, megamoe_us=us)

    path = tmp_path / "moe_layer_H100_1gpu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        row("old1234", 1, 31.0), row("old1234", 64, 280.0), row("new5678", 1, 30.2))))
    drawn = {}

    def plot(rows, png, title):
        drawn.update(rows=rows, png=png, title=title)

    key = ("preset", "dtype", "routing", "tokens")
    assert replot(path, plot, lambda r: f"W=1, {r['commit']}", key=key) == 0
    assert [(r["tokens"], r["megamoe_us"]) for r in drawn["rows"]] == [(1, 30.2), (64, 280.0)]
    assert drawn["title"] == "W=1, new5678 + old1234" and drawn["png"] == path.with_suffix(".png")
    replot(path, plot, lambda r: r["commit"])  # no key: every row
    assert len(drawn["rows"]) == 3 and drawn["title"] == "old1234 + new5678"
