"""The MoE layer at W=1 (one GPU, no EP): vLLM's Triton experts vs our composed experts vs the
fused MegaMoE kernel, with the same-run roofline. Run through ``bench_moe_layer.py --world 1``.

Per (preset, routing, tokens): the three paths on the same weights and routing, each captured
in a CUDA graph of ``CHAIN`` calls with different routing (so the weights of one call are not
in L2 for the next, as in a model's consecutive layers), timed as the median replay / CHAIN:

- ``vllm_us``: ``vllm...fused_moe.fused_experts`` (what vLLM's unquantized Triton path runs at
  W=1); ``triton_tuned`` says whether vLLM found a tuned config for (E, N) on this GPU;
- ``composed_us``: ``ops.experts_forward`` (row lists, gate/up, down, reduction);
- ``megamoe_us``: ``ops.megamoe_forward`` where the call qualifies (``megamoe_path`` =
  ``fused``), else the op the vLLM glue runs instead (composed);
- ``roofline_us`` = max(weight bytes of the experts that got rows / the same-run HBM copy rate,
  FLOPs / the same-run dense bf16 matmul rate), with both parts, and the ratios.

Presets: Qwen3-30B-A3B (128 experts, all local), DeepSeek-V3's EP8 share (256 global experts,
32 local through vLLM's expert_map, so ~1 of a token's 8 slots is served) and DeepSeek-V2-Lite
(64 experts, top-6, intermediate 1408: a model served on one GPU; its shared experts are
outside the fused MoE layer). Routing: uniform (K distinct experts per token) or skewed (half
of the probability mass on 1/8 of the experts).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from vllm_petit_moe.testing import vllm_moe_harness as harness

CHAIN = 8
W1_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192]
W1_QUICK_TOKENS = [1, 2, 4, 8, 32, 256, 1024]


@dataclass(frozen=True)
class W1Preset:
    hidden: int
    intermediate: int
    num_experts: int        # global
    num_local: int          # local (the first num_local global ids)
    top_k: int


# the harness' shapes, with the local experts of each
W1_PRESETS = {name: W1Preset(**asdict(harness.PRESETS[name]), num_local=num_local)
              for name, num_local in (("qwen3-30b-a3b", 128), ("deepseek-v3", 32),
                                      ("deepseek-v2-lite", 64))}


def random_routing(num_tokens, preset, routing, generator, device):
    import torch
    probs = torch.ones(preset.num_experts)
    if routing == "skewed":
        hot = max(1, preset.num_experts // 8)
        probs[:hot] = (preset.num_experts - hot) / hot  # half of the mass on 1/8 of the experts
    ids = torch.multinomial(probs.expand(num_tokens, -1), preset.top_k, replacement=False,
                            generator=generator).to(torch.int32)
    weights = torch.rand(num_tokens, preset.top_k, generator=generator)
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(device), weights.to(device)


def measure_ceilings(device):
    """(HBM copy rate in bytes/s counting read + write, dense bf16 matmul FLOP/s), measured."""
    import torch

    from bench_experts import hbm_copy_gbps

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.mm(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return hbm_copy_gbps() * 1e9, 2 * 8192**3 / statistics.median(times)


def _graph_us(fn, iters):
    """``fn`` (CHAIN calls) captured in a CUDA graph after two eager calls on a side stream:
    (median device time of one replay / CHAIN in us, the graph)."""
    import torch

    from vllm_petit_moe.testing.vllm_moe_harness import time_replays_us

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return time_replays_us(graph, iters) / CHAIN, graph


def run_w1(preset_names, routings, tokens_list, iters, seed, log=print):
    """Rows of the W=1 benchmark (see the module docstring)."""
    import torch
    from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe

    from vllm_petit_moe import ops

    device = torch.device("cuda", torch.cuda.current_device())
    copy_rate, mm_rate = measure_ceilings(device)
    log(f"# ceilings: HBM copy {copy_rate / 1e12:.2f} TB/s (read + write), dense bf16 "
        f"{mm_rate / 1e12:.0f} TFLOP/s")
    rows = []
    for name in preset_names:
        p = W1_PRESETS[name]
        g = torch.Generator().manual_seed(seed)
        w13 = (torch.randn(p.num_local, 2 * p.intermediate, p.hidden, generator=g)
               / p.hidden**0.5).to(torch.bfloat16).to(device)
        w2 = (torch.randn(p.num_local, p.hidden, p.intermediate, generator=g)
              / p.intermediate**0.5).to(torch.bfloat16).to(device)
        expert_map = None
        if p.num_local < p.num_experts:
            expert_map = torch.full((p.num_experts,), -1, dtype=torch.int32, device=device)
            expert_map[: p.num_local] = torch.arange(p.num_local, dtype=torch.int32,
                                                     device=device)
        tuned = vllm_fused_moe.get_moe_configs(p.num_local, p.intermediate, None) is not None
        expert_bytes = 3 * p.hidden * p.intermediate * 2
        log(f"# {name}: H={p.hidden} I={p.intermediate} E={p.num_experts} local={p.num_local} "
            f"K={p.top_k}, vLLM tuned config: {tuned}")
        log(f"{'preset':14} {'routing':8} {'tokens':>6} {'vllm_us':>9} {'composed':>9} "
            f"{'megamoe':>9} {'roofline':>9} {'v/m':>6} {'c/m':>6} {'roof/m':>6} path")
        for routing in routings:
            for tokens in tokens_list:
                xs = [torch.randn(tokens, p.hidden, generator=g).to(torch.bfloat16).to(device)
                      for _ in range(CHAIN)]
                routes = [random_routing(tokens, p, routing, g, device) for _ in range(CHAIN)]
                outs = {k: [torch.empty_like(x) for x in xs] for k in ("vllm", "comp", "mega")}
                fused = ops.megamoe_unsupported_reason(tokens, p.top_k, p.hidden,
                                                       p.intermediate) is None

                def vllm_path():
                    for i in range(CHAIN):
                        ids, w = routes[i]
                        outs["vllm"][i].copy_(vllm_fused_moe.fused_experts(
                            xs[i], w13, w2, w, ids, global_num_experts=p.num_experts,
                            expert_map=expert_map))

                def composed_path():
                    for i in range(CHAIN):
                        ids, w = routes[i]
                        ops.experts_forward(xs[i], ids, w, w13, w2, out=outs["comp"][i],
                                            expert_map=expert_map)

                def megamoe_path():
                    for i in range(CHAIN):
                        ids, w = routes[i]
                        if fused:
                            ops.megamoe_forward(xs[i], ids, w, w13, w2, out=outs["mega"][i],
                                                expert_map=expert_map)
                        else:
                            ops.experts_forward(xs[i], ids, w, w13, w2, out=outs["mega"][i],
                                                expert_map=expert_map)

                vllm_us, gv = _graph_us(vllm_path, iters)
                comp_us, gc = _graph_us(composed_path, iters)
                mega_us, gm = _graph_us(megamoe_path, iters)
                # interleave a second round and keep each path's best median
                vllm_us = min(vllm_us, _graph_us(vllm_path, iters)[0])
                comp_us = min(comp_us, _graph_us(composed_path, iters)[0])
                mega_us = min(mega_us, _graph_us(megamoe_path, iters)[0])
                torch.cuda.synchronize()
                diffs = []
                for i in range(CHAIN):
                    ref = outs["vllm"][i].float()
                    diffs.append(((outs["mega"][i].float() - ref).norm()
                                  / ref.norm().clamp_min(1e-30)).item())
                comp_diff = max(((outs["comp"][i].float() - outs["vllm"][i].float()).norm()
                                 / outs["vllm"][i].float().norm().clamp_min(1e-30)).item()
                                for i in range(CHAIN))
                active, pairs = [], []
                for ids, _ in routes:
                    local = ids[(ids >= 0) & (ids < p.num_local)]
                    active.append(int(torch.unique(local).numel()))
                    pairs.append(int(local.numel()))
                weight_bytes = statistics.mean(active) * expert_bytes
                flops = statistics.mean(pairs) * 2 * 3 * p.hidden * p.intermediate
                hbm_us = weight_bytes / copy_rate * 1e6
                flops_us = flops / mm_rate * 1e6
                roof_us = max(hbm_us, flops_us)
                row = dict(preset=name, routing=routing, tokens=tokens, vllm_us=vllm_us,
                           composed_us=comp_us, megamoe_us=mega_us, roofline_us=roof_us,
                           roofline_hbm_us=hbm_us, roofline_flops_us=flops_us,
                           weight_bytes=weight_bytes, flops=flops,
                           hbm_copy_tbps=copy_rate / 1e12, bf16_tflops=mm_rate / 1e12,
                           triton_tuned=tuned, megamoe_path="fused" if fused else "composed",
                           vllm_over_megamoe=vllm_us / mega_us,
                           composed_over_megamoe=comp_us / mega_us,
                           roofline_fraction=roof_us / mega_us,
                           rel_diff=max(diffs), composed_rel_diff=comp_diff, chain=CHAIN)
                rows.append(row)
                log(f"{name:14} {routing:8} {tokens:>6} {vllm_us:9.1f} {comp_us:9.1f} "
                    f"{mega_us:9.1f} {roof_us:9.1f} {row['vllm_over_megamoe']:6.2f} "
                    f"{row['composed_over_megamoe']:6.2f} {row['roofline_fraction']:6.2f} "
                    f"{row['megamoe_path']} diff {row['rel_diff']:.1e}")
                del gv, gc, gm
        del w13, w2
        torch.cuda.empty_cache()
    return rows


def plot_w1(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r["preset"] for r in rows})
    fig, axes = plt.subplots(len(presets), 2, figsize=(13, 4.2 * len(presets)), squeeze=False)
    for row_axes, preset in zip(axes, presets):
        for routing, marker in zip(("uniform", "skewed"), "os"):
            sel = sorted((r for r in rows if r["preset"] == preset and r["routing"] == routing),
                         key=lambda r: r["tokens"])
            if not sel:
                continue
            t = [r["tokens"] for r in sel]
            for key, style, label in (("vllm_us", "--", "vLLM Triton"),
                                      ("composed_us", ":", "petit composed"),
                                      ("megamoe_us", "-", "petit MegaMoE"),
                                      ("roofline_us", "-.", "roofline")):
                row_axes[0].plot(t, [r[key] for r in sel], style + marker,
                                 label=f"{label}, {routing}")
            row_axes[1].plot(t, [r["vllm_over_megamoe"] for r in sel], "-" + marker,
                             label=f"vLLM / MegaMoE, {routing}")
            row_axes[1].plot(t, [r["roofline_fraction"] for r in sel], "-." + marker,
                             label=f"roofline / MegaMoE, {routing}")
        row_axes[0].set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per layer call",
                        title=f"{preset}: time")
        row_axes[1].axhline(1.0, color="k", lw=0.8)
        row_axes[1].set(xscale="log", xlabel="tokens", ylabel="ratio",
                        title=f"{preset}: speedup and roofline fraction")
        for ax in row_axes:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
