"""One MoE layer through vLLM's modular kernel in a real DP=W + EP setup: petit vs vLLM default.

One process per GPU, each with vLLM's own distributed state
(``vllm_petit_moe/testing/vllm_moe_harness.py``: ``init_distributed_environment`` +
``initialize_model_parallel`` under a DP=W, EP config).
Both kernels come from vLLM's unquantized oracle on the same weights and routing:

- default: ``MoEPrepareAndFinalizeNaiveDPEPModular`` (all-gather / reduce-scatter over NCCL)
  + ``TritonExperts``;
- petit: the same call with ``VLLM_USE_PETIT_MOE=1``, our hook substituting
  ``PetitPrepareAndFinalize`` (symmetric-heap dispatch/combine) + the same ``TritonExperts``;
- with ``--petit-experts-tiles T``, also petit-experts: ``PetitPrepareAndFinalize`` +
  ``PetitExperts`` (our grouped GEMMs, tile family T; ``VLLM_PETIT_MOE_EXPERTS=1``), reported as
  ``petit_experts_us``, ``petit_experts_tflops``, ``petit_experts_speedup`` (vs default);
- the issue's fields as well: ``vllm_us`` (= default), ``composed_us`` (= petit-experts when
  measured), ``roofline_us`` with its parts (``layer_roofline``: weight bytes of the experts
  with rows over the same-run HBM copy rate, FLOPs over the dense bf16 rate, rows over the
  same-run peer-write rate), ``roofline_fraction`` (of the best petit path), ``triton_tuned``;
- with ``--megamoe``, also the fused layer: one ``EpBuffer.megamoe`` launch per rank through
  the hook (``VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS``), at the token counts it takes
  (W * tokens * K <= 2048), reported as ``megamoe_us``, ``megamoe_speedup``,
  ``megamoe_rel_diff``.

For each (preset, routing, tokens per rank): both paths are captured in CUDA graphs (all
ranks with the same token count, as vLLM pads them under graphs) and timed as the median
device time of one replay (CUDA events), the layer time being the slowest rank's median.
Effective TFLOPS per GPU = 2*3*hidden*moe_intermediate * (token-expert pairs of all ranks / W)
/ time; speedup = petit TFLOPS / default TFLOPS = default time / petit time. The two outputs
of the same inputs are compared too (``rel_diff``: relative Frobenius difference).

Routing: ``uniform`` (K distinct experts per token) or ``skewed`` (``reference.random_topk(
skew="hot_rank", hot_fraction=...)``: each token-expert pair lands on rank 0's experts with
probability hot_fraction; ``hot_share`` records the share rank 0 actually got; at W=2 the
default 0.5 equals an even split of pairs, so pass a larger one for skew there), or ``same``
(``skew="same_experts"``: every token of every rank picks the same K experts, as in the decode
steps of a dummy-weight `vllm serve`; not in the default set).

    python examples/bench_moe_layer.py                  # both presets, tokens 1..4096
    python examples/bench_moe_layer.py --quick          # tokens 1, 8, 64, 512, 4096
    python examples/bench_moe_layer.py --replot examples/results/moe_layer_H200_2gpu.jsonl
    python examples/bench_moe_layer.py --profile --tokens 64 1024   # + where the time goes
    python examples/bench_moe_layer.py --world 1        # one GPU: vLLM Triton / composed /
                                                        # MegaMoE / roofline (moe_layer_w1.py)

--profile: after timing, each rank replays each path's graph --profile-replays times under
torch.profiler (CUDA activity only) and sums the device time of its kernels by category
(``bench_env.PROFILE_CATEGORIES``: dispatch, combine, nccl, petit GEMMs / reduce / row
lists, Triton GEMM, Triton align/sum/activation, other); per replay, in us, stored per rank as
``<path>_breakdown`` and printed for the slowest rank. ``kernels_total`` below the replay time
is time with no kernel running (gaps between graph nodes).
Writes examples/results/moe_layer_<gpu>_<G>gpu.jsonl (one rank per GPU: G = W; fields gpu,
world, num_gpus, commit, date, preset,
routing, tokens, petit_tflops, default_tflops, speedup, petit_us, default_us, ...) and a PNG
next to it, and prints a table. The commit comes from $PETIT_COMMIT or git.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

from vllm_petit_moe.ops import TILES
from vllm_petit_moe.testing import vllm_moe_harness as harness
from vllm_petit_moe.testing.bench_env import (
    commit_stamp, device_stamp, format_breakdown, profile_kernels, replot, results_name,
    short_gpu_name, utc_date, write_results)

ROOT = Path(__file__).resolve().parent.parent
PRESETS = harness.PRESETS
TOKENS = [2**i for i in range(13)]  # 1, 2, 4, ..., 4096 tokens per rank
QUICK_TOKENS = [1, 8, 64, 512, 4096]
ROUTINGS = ("uniform", "skewed")  # the default set
# reference.random_topk's skew per routing ("same": every token the same K experts)
SKEWS = {"uniform": None, "skewed": "hot_rank", "same": "same_experts"}

# --------------------------------------------------------------------------------------------
# Roofline (pure: CPU-testable)
# --------------------------------------------------------------------------------------------


def layer_roofline(shape, topk_ids, world, copy_bps, mm_flops, link_bps):
    """The layer's lower bound at W ranks from every rank's routing (``topk_ids``: one
    ``[T, K]`` tensor of global ids per source rank, -1 unused), per rank ``d``:

    - hbm: the weight bytes of d's experts that got rows (3 * H * I * 2 each) / the HBM copy
      rate;
    - flops: d's token-expert pairs * 6 * H * I / the dense bf16 matmul rate;
    - link: the rows d sends and receives over the link (each token once per other
      destination rank, dispatch and again in the combine) * H * 2 / the peer-write rate.

    ``roofline_us`` is the largest part of the slowest rank (perfect overlap); the parts are
    each the slowest rank's."""
    import torch

    num_local = shape.num_experts // world
    expert_bytes = 3 * shape.hidden * shape.intermediate * 2
    row_bytes = shape.hidden * 2
    hbm, flops, link = [0.0] * world, [0.0] * world, [0.0] * world
    sent, received = [0] * world, [0] * world
    for src, ids in enumerate(topk_ids):
        ids = ids.long().cpu()
        owner = torch.where(ids >= 0, ids // num_local, -1)
        for d in range(world):
            if d != src:
                rows = int((owner == d).any(dim=1).sum())
                sent[src] += rows
                received[d] += rows
    pairs = torch.cat([i.long().cpu().flatten() for i in topk_ids])
    for d in range(world):
        mine = pairs[(pairs >= d * num_local) & (pairs < (d + 1) * num_local)]
        hbm[d] = int(torch.unique(mine).numel()) * expert_bytes / copy_bps * 1e6
        flops[d] = int(mine.numel()) * 6 * shape.hidden * shape.intermediate / mm_flops * 1e6
        link[d] = 2 * max(sent[d], received[d]) * row_bytes / link_bps * 1e6
    per_rank = [max(h, f, ln) for h, f, ln in zip(hbm, flops, link)]
    return dict(roofline_us=max(per_rank), roofline_hbm_us=max(hbm),
                roofline_flops_us=max(flops), roofline_link_us=max(link))


# --------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------


def _link_bps(buffer, world, iters=20):
    """Same-run peer-write rate of this rank (bytes/s it pushes to all peers at once, every
    rank pushing), as bench_dispatch_combine's ceiling: up to 32 MB per peer, what the heap's
    combine region holds (the layer is built for >= LINK_MIN_TOKENS tokens for it)."""
    import torch

    region = world * buffer.max_tokens_per_rank * buffer.hidden_size * 2
    bytes_per_peer = min(32 << 20, region) // 16 * 16

    src = torch.randn(bytes_per_peer // 2 + 8, device=buffer.device).bfloat16()
    for _ in range(3):
        buffer.peer_write(src, bytes_per_peer)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        buffer.peer_write(src, bytes_per_peer)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return bytes_per_peer * (world - 1) / statistics.median(times)


# The layer's buffer holds at least this many tokens per rank, so the link ceiling is measured
# with transfers of several MB (a few KB would measure latency, not the link).
LINK_MIN_TOKENS = 1024


def _rank_build(state, preset, max_tokens, seed, petit_via, paths=harness.PATHS,
                fused_max_tokens=harness.FUSED_MAX_TOKENS):
    """Free the previous preset's layer and build this one (local random weights)."""
    import torch

    from vllm_petit_moe.vllm_glue import buffer_cache

    if state.cache.pop("layer", None) is not None:
        torch.cuda.synchronize()
        buffer_cache.close_all_buffers()  # collective in spirit: every rank does it here
        torch.cuda.empty_cache()
    shape = PRESETS[preset]
    num_local = shape.num_experts // state.world_size
    w13, w2 = harness.random_weights(shape, num_local, seed=seed + 1000 * state.rank,
                                     device=state.device)
    layer = harness.build_layer(state, shape, w13, w2, max_num_tokens=max_tokens,
                                petit_via=petit_via, paths=paths,
                                fused_max_tokens=fused_max_tokens)
    state.cache["layer"] = layer
    buffer = layer.kernels["petit"].prepare_finalize.buffer
    from moe_layer_w1 import measure_ceilings
    from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe

    copy_bps, mm_flops = measure_ceilings(state.device)
    state.barrier()  # every rank pushes at once
    link_bps = _link_bps(buffer, state.world_size)
    tuned = vllm_fused_moe.get_moe_configs(num_local, shape.intermediate, None) is not None
    state.cache["ceilings"] = (copy_bps, mm_flops, link_bps)
    return dict(gpu=torch.cuda.get_device_name(state.device), vllm_backend=layer.vllm_backend,
                heap_mib=buffer.footprint_bytes / 2**20,
                weights_gib=(w13.numel() + w2.numel()) * 2 / 2**30,
                copy_bps=copy_bps, mm_flops=mm_flops, link_bps=link_bps, triton_tuned=tuned)


def _rank_bench(state, routing, num_tokens, iters, hot_fraction, seed, profile_replays=0):
    import torch

    layer = state.cache["layer"]
    shape, world, rank = layer.shape, state.world_size, state.rank
    counts = [num_tokens] * world
    skew = SKEWS[routing]
    xs, ids, ws = harness.make_inputs(shape, counts, seed=seed, device=state.device, skew=skew,
                                      hot_fraction=hot_fraction)
    num_local = shape.num_experts // world
    pairs = sum(int((i >= 0).sum()) for i in ids)
    share = [sum(int(((i >= 0) & (i // num_local == d)).sum()) for i in ids) / max(pairs, 1)
             for d in range(world)]

    # The graphs read their inputs from the static tensors' addresses: keep them alive next to
    # the graph (a tensor freed after the capture is reused by the next allocation, and the
    # replays then read whatever that holds).
    captured, statics = {}, {}
    for path, kernel in layer.kernels.items():
        if path == harness.PETIT_FUSED_PATH and \
                num_tokens > kernel.prepare_finalize.megamoe_max_stride:
            continue  # beyond the fused kernel's entries: that step would run composed
        statics[path] = static = (xs[rank].clone(), ids[rank].clone(), ws[rank].clone())
        captured[path] = harness.capture(
            state.device, lambda path=path, static=static: layer.forward(path, *static, counts))
    outs = {}
    for path, (graph, out) in captured.items():
        graph.replay()
        torch.cuda.synchronize()
        outs[path] = out.float().clone()

    def rel_diff(path):  # vs the default path; inf where either output is not finite
        diff = (outs[path] - outs["default"]).norm().item()
        norm = outs["default"].norm().item()
        if not (math.isfinite(diff) and math.isfinite(norm)):
            return math.inf
        return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)

    row = dict(pairs=pairs, hot_share=share[0], max_share=max(share),
               roofline=layer_roofline(shape, ids, world, *state.cache["ceilings"]),
               rel_diff=rel_diff("petit"),
               max_abs_diff=(outs["petit"] - outs["default"]).abs().max().item(),
               petit_experts_rel_diff=(rel_diff(harness.PETIT_EXPERTS_PATH)
                                       if harness.PETIT_EXPERTS_PATH in outs else None),
               megamoe_rel_diff=(rel_diff(harness.PETIT_FUSED_PATH)
                                 if harness.PETIT_FUSED_PATH in outs else None),
               petit_finite=bool(torch.isfinite(outs["petit"]).all()),
               default_finite=bool(torch.isfinite(outs["default"]).all()))
    row["finite"] = row["petit_finite"] and row["default_finite"]
    for path, (graph, _) in captured.items():
        torch.cuda.synchronize()
        state.barrier()
        row[f"{path}_us"] = harness.time_replays_us(graph, iters)
    if profile_replays:
        for path, (graph, _) in captured.items():
            torch.cuda.synchronize()
            state.barrier()  # warmed up by the timed replays above
            row[f"{path}_breakdown"] = profile_kernels(graph.replay, profile_replays)
    del captured, statics, outs
    return row


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def _combine(preset, routing, num_tokens, per_rank, info, hot_fraction, iters):
    """One result row from every rank's measurements (layer time = the slowest rank)."""
    shape = PRESETS[preset]
    world = len(per_rank)
    first = per_rank[0]
    row = dict(preset=preset, routing=routing, tokens=num_tokens)
    flops_per_gpu = shape.flops_per_pair() * first["pairs"] / world
    for path in harness.PATHS + harness.OPTIONAL_PATHS:
        if f"{path}_us" not in first:
            continue
        key = "megamoe" if path == harness.PETIT_FUSED_PATH else path.replace("-", "_")
        us = max(r[f"{path}_us"] for r in per_rank)
        row[f"{key}_us"] = us
        row[f"{key}_tflops"] = flops_per_gpu / (us * 1e-6) / 1e12
        if f"{path}_breakdown" in first:  # per rank
            row[f"{key}_breakdown"] = [r[f"{path}_breakdown"] for r in per_rank]
    row["speedup"] = row["petit_tflops"] / row["default_tflops"]
    if "petit_experts_tflops" in row:
        row["petit_experts_speedup"] = row["petit_experts_tflops"] / row["default_tflops"]
        diffs = [r["petit_experts_rel_diff"] for r in per_rank]
        row["petit_experts_rel_diff"] = None if None in diffs else max(diffs)
    if "megamoe_tflops" in row:  # the fused layer (EpBuffer.megamoe through the hook)
        row["megamoe_speedup"] = row["megamoe_tflops"] / row["default_tflops"]
        row["megamoe_rel_diff"] = max(r["megamoe_rel_diff"] for r in per_rank)
        row["megamoe_us_ranks"] = [r[f"{harness.PETIT_FUSED_PATH}_us"] for r in per_rank]
    # the issue's schema: vLLM's path, the composed path (petit dispatch + petit experts + petit
    # combine, when measured), the fused layer, and the roofline (the most optimistic rank's
    # ceilings; the routing is the same on every rank)
    roof = min((r["roofline"] for r in per_rank), key=lambda x: x["roofline_us"])
    row.update(vllm_us=row["default_us"], composed_us=row.get("petit_experts_us"), **roof)
    best = row.get("megamoe_us") or row.get("petit_experts_us") or row["petit_us"]
    row["roofline_fraction"] = roof["roofline_us"] / best
    row.update(triton_tuned=info["triton_tuned"], hbm_copy_tbps=info["copy_bps"] / 1e12,
               bf16_tflops=info["mm_flops"] / 1e12, link_gbps=info["link_bps"] / 1e9)
    row.update(pairs=first["pairs"], hot_share=first["hot_share"],
               hot_fraction=hot_fraction if routing == "skewed" else None,
               rel_diff=max(r["rel_diff"] for r in per_rank),
               max_abs_diff=max(r["max_abs_diff"] for r in per_rank),
               finite=all(r["finite"] for r in per_rank),
               petit_us_ranks=[r["petit_us"] for r in per_rank],
               default_us_ranks=[r["default_us"] for r in per_rank],
               petit_experts_us_ranks=([r[f"{harness.PETIT_EXPERTS_PATH}_us"] for r in per_rank]
                                       if f"{harness.PETIT_EXPERTS_PATH}_us" in first else None),
               hidden=shape.hidden, moe_intermediate=shape.intermediate,
               num_experts=shape.num_experts, top_k=shape.top_k, iters=iters,
               vllm_backend=info["vllm_backend"])
    return row


HEADER = (f"{'preset':14} {'routing':8} {'tokens':>6} {'default_us':>10} {'petit_us':>9} "
          f"{'default_TF':>10} {'petit_TF':>9} {'speedup':>7} {'hot':>5} {'rel_diff':>8}")


def _print_row(r):
    flag = "" if r["finite"] and r["rel_diff"] < 2e-2 else "   <-- outputs differ"
    extra = ""
    if "petit_experts_us" in r:
        diff = r["petit_experts_rel_diff"]
        extra = (f"   petit-experts {r['petit_experts_us']:.1f} us, speedup "
                 f"{r['petit_experts_speedup']:.2f}, rel_diff "
                 f"{'-' if diff is None else format(diff, '.1e')}")
    if "megamoe_us" in r:
        extra += (f"   megamoe {r['megamoe_us']:.1f} us, speedup {r['megamoe_speedup']:.2f}, "
                  f"rel_diff {r['megamoe_rel_diff']:.1e}")
    extra += f"   roofline {r['roofline_us']:.1f} us ({r['roofline_fraction']:.2f} of the best)"
    print(f"{r['preset']:14} {r['routing']:8} {r['tokens']:>6} {r['default_us']:10.1f} "
          f"{r['petit_us']:9.1f} {r['default_tflops']:10.1f} {r['petit_tflops']:9.1f} "
          f"{r['speedup']:7.2f} {r['hot_share']:5.2f} {r['rel_diff']:8.1e}{flag}{extra}",
          flush=True)
    for key in ("default", "petit", "petit_experts", "megamoe"):
        if f"{key}_breakdown" in r:  # the slowest rank's
            ranks = r[f"{key}_us_ranks"]
            slowest = max(range(len(ranks)), key=ranks.__getitem__)
            print(f"    {key} rank {slowest}: {format_breakdown(r[f'{key}_breakdown'][slowest])}",
                  flush=True)


def _plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r["preset"] for r in rows})
    fig, axes = plt.subplots(len(presets), 2, figsize=(13, 4.2 * len(presets)), squeeze=False)
    for row_axes, preset in zip(axes, presets):
        for routing, marker in zip(SKEWS, ["o", "s", "D"]):
            sel = sorted((r for r in rows if r["preset"] == preset and r["routing"] == routing),
                         key=lambda r: r["tokens"])
            if not sel:
                continue
            toks = [r["tokens"] for r in sel]
            row_axes[0].plot(toks, [r["petit_tflops"] for r in sel], "-" + marker,
                             label=f"petit, {routing}")
            row_axes[0].plot(toks, [r["default_tflops"] for r in sel], "--" + marker,
                             alpha=0.7, label=f"vLLM default, {routing}")
            row_axes[1].plot(toks, [r["speedup"] for r in sel], "-" + marker,
                             label=f"petit prepare/finalize + Triton experts, {routing}")
            pe = [r for r in sel if r.get("petit_experts_tflops")]
            if pe:  # --petit-experts-tiles: petit prepare/finalize + PetitExperts
                ptoks = [r["tokens"] for r in pe]
                row_axes[0].plot(ptoks, [r["petit_experts_tflops"] for r in pe], ":" + marker,
                                 label=f"petit + PetitExperts, {routing}")
                row_axes[1].plot(ptoks, [r["petit_experts_speedup"] for r in pe], ":" + marker,
                                 label=f"petit + PetitExperts, {routing}")
            fused = [r for r in sel if r.get("megamoe_tflops")]
            if fused:  # --megamoe: the fused layer
                ftoks = [r["tokens"] for r in fused]
                row_axes[0].plot(ftoks, [r["megamoe_tflops"] for r in fused], "-." + marker,
                                 label=f"petit fused layer, {routing}")
                row_axes[1].plot(ftoks, [r["megamoe_speedup"] for r in fused], "-." + marker,
                                 label=f"petit fused layer, {routing}")
        row_axes[0].set(xscale="log", yscale="log", xlabel="tokens per rank",
                        ylabel="effective TFLOPS per GPU", title=f"{preset}: TFLOPS")
        row_axes[1].axhline(1.0, color="k", lw=0.8)
        row_axes[1].set(xscale="log", xlabel="tokens per rank",
                        ylabel="speedup (vs vLLM default)", title=f"{preset}: speedup")
        for ax in row_axes:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=sorted(PRESETS), choices=sorted(PRESETS),
                   help="model shapes (default: %(default)s)")
    p.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=list(SKEWS),
                   help="routing patterns (default: %(default)s)")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="tokens per rank (default 1, 2, 4, ..., 4096)")
    p.add_argument("--iters", type=int, default=None, help="timed replays (default 50, quick 20)")
    p.add_argument("--hot-fraction", type=float, default=0.5,
                   help="skewed routing: probability that a pair lands on rank 0's experts "
                        "(default: %(default)s)")
    p.add_argument("--world", type=int, default=None,
                   help="ranks = GPUs (default: all GPUs); 1: the single-GPU layer, vLLM's "
                        "Triton experts vs our composed experts vs MegaMoE (moe_layer_w1.py)")
    p.add_argument("--petit-via", choices=("hook", "direct"), default="hook",
                   help="build petit's kernel through the plugin hook or by hand "
                        "(default: %(default)s)")
    p.add_argument("--petit-experts-tiles", default=None,
                   choices=tuple(TILES),
                   help="also time petit's prepare/finalize + PetitExperts with this tile family")
    p.add_argument("--megamoe", action="store_true",
                   help="also time the fused layer (EpBuffer.megamoe through the hook, "
                        "VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS) at the token counts it takes "
                        "(W * tokens * K <= MEGAMOE_MAX_ENTRIES): megamoe_us")
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=("bf16", "fp8"),
                   help="--world 1: expert weights, bf16 and/or block fp8 (e4m3, 128 x 128 "
                        "scales: vLLM's Triton fp8 experts vs MegaMoE; default: %(default)s)")
    p.add_argument("--seed", type=int, default=1234,
                   help="seed of the inputs and weights (default: %(default)s)")
    p.add_argument("--profile", action="store_true",
                   help="also sum each path's kernel time by category (torch.profiler)")
    p.add_argument("--profile-replays", type=int, default=10,
                   help="replays profiled per path with --profile (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS}, 20 iters")
    p.add_argument("--out-dir", default=None, help="also write the results here")
    p.add_argument("--replot", metavar="JSONL", help="only redraw the plot of a results file")
    args = p.parse_args(argv)
    args.tokens_given = args.tokens
    if args.tokens is None:
        args.tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.iters is None:
        args.iters = 20 if args.quick else 50
    if min(args.tokens) < 1:
        p.error("--tokens must be >= 1")
    if args.profile_replays < 1:
        p.error("--profile-replays must be >= 1")
    if not 0.0 <= args.hot_fraction <= 1.0:
        p.error("--hot-fraction must be in [0, 1]")
    return args


def _main_w1(args):
    """--world 1: vLLM's Triton experts vs our composed experts vs MegaMoE (moe_layer_w1.py)."""
    import moe_layer_w1 as w1

    presets = [p for p in args.presets if p in w1.W1_PRESETS]
    tokens = args.tokens_given or (w1.W1_QUICK_TOKENS if args.quick else w1.W1_TOKENS)
    routings = [r for r in args.routings if r in ("uniform", "skewed")]
    rows = [row for dtype in args.dtypes
            for row in w1.run_w1(presets, routings, tokens, args.iters, args.seed, dtype=dtype)]
    if not rows:
        return 1
    stamp = device_stamp(ROOT, 1, num_gpus=1)
    write_results(ROOT, results_name("moe_layer", stamp["gpu"], 1), rows, stamp, w1.plot_w1,
                  f"MoE layer at W=1, {stamp['gpu']}, {stamp['commit']}", args.out_dir)
    bad = [r for r in rows if not r["agrees"]]
    if bad:
        print(f"WARNING: {len(bad)} configurations where MegaMoE's output is worse than vLLM's "
              "(bf16: differs from it; fp8: farther from the fp32 reference)")
        return 1
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.replot and args.world is None:  # the file's own world (its first row's)
        import json
        with open(args.replot) as f:
            args.world = json.loads(f.readline())["world"]
    if args.replot and args.world == 1:
        import moe_layer_w1 as w1
        return replot(args.replot, w1.plot_w1,
                      lambda r: f"MoE layer at W=1, {r['gpu']}, {r['commit']}",
                      key=("preset", "dtype", "routing", "tokens"))
    if args.replot:
        # rows before num_gpus ran one rank per GPU too
        return replot(args.replot, _plot, lambda r: f"MoE layer via vLLM, "
                      f"{r.get('num_gpus', r['world'])} x {r['gpu']}, {r['commit']}")

    import torch

    world = args.world or torch.cuda.device_count()
    if world == 1:
        return _main_w1(args)
    if world < 2 or torch.cuda.device_count() < world:
        sys.exit(f"bench_moe_layer needs >= 2 GPUs, one per rank (have "
                 f"{torch.cuda.device_count()}, asked for {world})")
    commit = commit_stamp(ROOT)
    date = utc_date()
    paths = harness.PATHS
    if args.petit_experts_tiles:
        paths += (harness.PETIT_EXPERTS_PATH,)
        os.environ["VLLM_PETIT_MOE_EXPERTS_TILES"] = args.petit_experts_tiles  # rank processes
    if args.megamoe:
        paths += (harness.PETIT_FUSED_PATH,)
    pool = harness.VllmRankPool(world)
    rows, gpu = [], "unknown"
    try:
        for preset in args.presets:
            infos = pool.run(_rank_build, preset, max(max(args.tokens), LINK_MIN_TOKENS),
                             args.seed, args.petit_via, paths, max(args.tokens), timeout_s=900)
            info = infos[0]
            gpu = short_gpu_name(info["gpu"])
            print(f"# {preset}: {PRESETS[preset]}, W={world}, vLLM backend {info['vllm_backend']},"
                  f" petit heap {info['heap_mib']:.0f} MiB/rank, weights "
                  f"{info['weights_gib']:.1f} GiB/rank, commit {commit}", flush=True)
            print(HEADER, flush=True)
            for routing in args.routings:
                for num_tokens in args.tokens:
                    per_rank = pool.run(_rank_bench, routing, num_tokens, args.iters,
                                        args.hot_fraction, args.seed + num_tokens,
                                        args.profile_replays if args.profile else 0,
                                        timeout_s=600)
                    row = _combine(preset, routing, num_tokens, per_rank, info,
                                   args.hot_fraction, args.iters)
                    rows.append(row)
                    _print_row(row)
    finally:
        pool.close()
    if not rows:
        return 1
    write_results(ROOT, results_name("moe_layer", gpu, world), rows,
                  dict(gpu=gpu, world=world, num_gpus=world, commit=commit, date=date), _plot,
                  f"MoE layer via vLLM's modular kernel, {world} x {gpu}, {commit}", args.out_dir)
    bad = [r for r in rows if not r["finite"] or r["rel_diff"] >= 2e-2]
    if bad:
        print(f"WARNING: {len(bad)} configurations where petit and vLLM's outputs differ "
              "(rel_diff >= 2e-2 or non-finite)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
