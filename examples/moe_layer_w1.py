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
                                      ("deepseek-v2-lite", 64), ("qwen3-235b-a22b", 128))}


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


def _agrees(rel_diff, errors):
    """Whether MegaMoE's output is as good as vLLM's: bf16, within 2e-2 of vLLM's (relative
    Frobenius; both round the same products); fp8, where vLLM quantizes the activations to e4m3
    and MegaMoE keeps them in bf16, its error against the fp32 MoE on the dequantized weights
    no larger than vLLM's (or under 2e-2)."""
    if not errors:
        return rel_diff < 2e-2
    return errors["mega"] <= max(errors["vllm"], 2e-2)


def _moe_fp32(x, ids, weights, w13, w2, num_local):
    """fp32 MoE on float weights (e.g. the dequantized fp8 ones), act rounded to bf16 as every
    path does: the reference of the fp8 rows' errors."""
    import torch
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        if not 0 <= e < num_local:
            continue
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        h = x[rows].float() @ w13[e].T
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(torch.bfloat16)
        out.index_add_(0, rows, (act.float() @ w2[e].T) * weights[rows, slots, None])
    return out


def run_w1(preset_names, routings, tokens_list, iters, seed, log=print, dtype="bf16"):
    """Rows of the W=1 benchmark (see the module docstring). dtype fp8: the weights as a block
    fp8 checkpoint holds them (e4m3, one fp32 scale per 128 x 128 block): vLLM's Triton fp8 w8a8
    experts (block [128, 128], activations quantized per 1 x 128 inside) against MegaMoE on the
    same e4m3 weights and scales (bf16 activations); no composed path; each row's errors are
    against an fp32 MoE on the dequantized weights (err_vllm, err_megamoe)."""
    import torch
    from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe

    from vllm_petit_moe import ops
    from vllm_petit_moe.testing.reference import block_fp8_quantize
    fp8 = dtype == "fp8"

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
        quant_config, scales, deq = None, {}, None
        if fp8:
            from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
            w13, s13, d13 = block_fp8_quantize(w13)
            w2, s2, d2 = block_fp8_quantize(w2)
            quant_config = fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2,
                                                     block_shape=[128, 128])
            scales, deq = dict(w13_scale=s13, w2_scale=s2), (d13, d2)
        expert_map = None
        if p.num_local < p.num_experts:
            expert_map = torch.full((p.num_experts,), -1, dtype=torch.int32, device=device)
            expert_map[: p.num_local] = torch.arange(p.num_local, dtype=torch.int32,
                                                     device=device)
        tuned = vllm_fused_moe.get_moe_configs(
            p.num_local, p.intermediate, "fp8_w8a8" if fp8 else None,
            *((128, 128) if fp8 else ())) is not None
        # an expert's weight bytes (fp8: and its block scales)
        expert_bytes = (3 * p.hidden * p.intermediate + 3 * p.hidden * p.intermediate // 128**2 * 4
                        if fp8 else 3 * p.hidden * p.intermediate * 2)
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
                                                       p.intermediate, fp8=fp8) is None

                def vllm_path():
                    for i in range(CHAIN):
                        ids, w = routes[i]
                        outs["vllm"][i].copy_(vllm_fused_moe.fused_experts(
                            xs[i], w13, w2, w, ids, global_num_experts=p.num_experts,
                            expert_map=expert_map, quant_config=quant_config))

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
                                                expert_map=expert_map, **scales)
                        elif fp8:
                            outs["mega"][i].copy_(vllm_fused_moe.fused_experts(
                                xs[i], w13, w2, w, ids, global_num_experts=p.num_experts,
                                expert_map=expert_map, quant_config=quant_config))
                        else:
                            ops.experts_forward(xs[i], ids, w, w13, w2, out=outs["mega"][i],
                                                expert_map=expert_map)

                # fp8 has no composed path: nothing to capture
                paths = {"vllm": vllm_path, "mega": megamoe_path}
                if not fp8:
                    paths["comp"] = composed_path
                us, graphs = {}, []
                for _ in range(2):  # a second interleaved round; each path's best median
                    for key, fn in paths.items():
                        t, graph = _graph_us(fn, iters)
                        us[key] = min(us.get(key, t), t)
                        graphs.append(graph)
                vllm_us, mega_us, comp_us = us["vllm"], us["mega"], us.get("comp", float("nan"))
                torch.cuda.synchronize()
                diffs = []
                for i in range(CHAIN):
                    ref = outs["vllm"][i].float()
                    diffs.append(((outs["mega"][i].float() - ref).norm()
                                  / ref.norm().clamp_min(1e-30)).item())
                comp_diff = None if fp8 else max(
                    ((outs["comp"][i].float() - outs["vllm"][i].float()).norm()
                     / outs["vllm"][i].float().norm().clamp_min(1e-30)).item()
                    for i in range(CHAIN))
                errors = {}
                if fp8:  # against the fp32 MoE on the dequantized weights, first call
                    ids0, w0 = routes[0]
                    local0 = torch.where((ids0 >= 0) & (ids0 < p.num_local), ids0, -1)
                    ref = _moe_fp32(xs[0], local0, w0, *deq, p.num_local)
                    for key in ("vllm", "mega"):
                        errors[key] = ((outs[key][0].float() - ref).norm()
                                       / ref.norm().clamp_min(1e-30)).item()
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
                row = dict(preset=name, dtype=dtype, routing=routing, tokens=tokens,
                           vllm_us=vllm_us, composed_us=None if fp8 else comp_us,
                           megamoe_us=mega_us, roofline_us=roof_us,
                           roofline_hbm_us=hbm_us, roofline_flops_us=flops_us,
                           weight_bytes=weight_bytes, flops=flops,
                           hbm_copy_tbps=copy_rate / 1e12, bf16_tflops=mm_rate / 1e12,
                           triton_tuned=tuned, megamoe_path="fused" if fused else "composed",
                           vllm_over_megamoe=vllm_us / mega_us,
                           composed_over_megamoe=None if fp8 else comp_us / mega_us,
                           err_vllm=errors.get("vllm"), err_megamoe=errors.get("mega"),
                           roofline_fraction=roof_us / mega_us,
                           rel_diff=max(diffs), composed_rel_diff=comp_diff, chain=CHAIN,
                           agrees=_agrees(max(diffs), errors))
                rows.append(row)
                err = (f" err vllm {errors['vllm']:.1e} mega {errors['mega']:.1e}" if fp8
                       else "")
                log(f"{name:14} {routing:8} {tokens:>6} {vllm_us:9.1f} {comp_us:9.1f} "
                    f"{mega_us:9.1f} {roof_us:9.1f} {row['vllm_over_megamoe']:6.2f} "
                    f"{row['composed_over_megamoe'] or float('nan'):6.2f} "
                    f"{row['roofline_fraction']:6.2f} "
                    f"{row['megamoe_path']} diff {row['rel_diff']:.1e}{err}")
                del graphs
        del w13, w2
        torch.cuda.empty_cache()
    return rows


def plot_w1(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({(r["preset"], r.get("dtype", "bf16")) for r in rows})
    fig, axes = plt.subplots(len(presets), 2, figsize=(13, 4.2 * len(presets)), squeeze=False)
    for row_axes, (preset, dtype) in zip(axes, presets):
        for routing, marker in zip(("uniform", "skewed"), "os"):
            sel = sorted((r for r in rows if r["preset"] == preset and r["routing"] == routing
                          and r.get("dtype", "bf16") == dtype), key=lambda r: r["tokens"])
            if not sel:
                continue
            t = [r["tokens"] for r in sel]
            for key, style, label in (("vllm_us", "--", "vLLM Triton"),
                                      ("composed_us", ":", "petit composed"),
                                      ("megamoe_us", "-", "petit MegaMoE"),
                                      ("roofline_us", "-.", "roofline")):
                if any(r[key] is None for r in sel):  # fp8 rows: no composed path
                    continue
                row_axes[0].plot(t, [r[key] for r in sel], style + marker,
                                 label=f"{label}, {routing}")
            row_axes[1].plot(t, [r["vllm_over_megamoe"] for r in sel], "-" + marker,
                             label=f"vLLM / MegaMoE, {routing}")
            row_axes[1].plot(t, [r["roofline_fraction"] for r in sel], "-." + marker,
                             label=f"roofline / MegaMoE, {routing}")
        row_axes[0].set(xscale="log", yscale="log", xlabel="tokens", ylabel="us per layer call",
                        title=f"{preset} {dtype}: time")
        row_axes[1].axhline(1.0, color="k", lw=0.8)
        row_axes[1].set(xscale="log", xlabel="tokens", ylabel="ratio",
                        title=f"{preset} {dtype}: speedup and roofline fraction")
        for ax in row_axes:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
