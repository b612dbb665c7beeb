"""Expert grouped GEMMs at one EP rank: petit vs vLLM's Triton experts vs a torch loop.

petit's kernels, vLLM's Triton fused-MoE experts and a torch per-expert matmul loop, on one
GPU, in the same run.

The problem is what rank 0 of an EP world of W ranks receives from the dispatch: W*T rows
(T tokens per rank), each with its top-k slots mapped to rank 0's L = E/W local experts or -1
(``reference.random_topk`` + ``reference.local_expert_ids``). Routing ``uniform`` (K distinct
experts per token), ``skewed`` (``skew="hot_rank"``: each token-expert pair lands on rank 0's
experts with probability --hot-fraction, default 0.6, so rank 0 is the hot rank) or, on
request, ``hot_expert`` (``skew="one_expert"``: every token's first choice is expert 0, so one
local expert gets all rows) or ``same`` (``skew="same_experts"``: every token picks the same K
experts, so rank 0's few of them get all rows, as in a dummy-weight server's decode, where
every sequence emits the same token: examples/dummy_routing_cpu.py).

- petit: ``vllm_petit_moe.ops.experts_forward`` (row lists + gate/up GEMM with SiLU·mul +
  down GEMM with the routing weight + deterministic local reduction), captured in a CUDA graph;
- triton: vLLM's ``fused_experts`` (the Triton experts vLLM runs on the same layout), on the
  same rows with global ids and rank 0's expert_map, captured in a CUDA graph; skipped (with a
  note) when vLLM or its kernels are unavailable;
- torch: a per-expert loop of bf16 matmuls (eager: it syncs to read the expert counts);
- dense: the ceiling of the shapes without the MoE parts, cuBLAS batched matmuls (torch.bmm)
  of the touched experts' weights with the same rows per expert for every expert (the mean,
  rounded up), contiguous A rows, no activation, weighting or reduction, captured in a CUDA
  graph: what the GPU's vendor GEMM reaches on equal groups of these sizes (``dense_tflops``,
  counting its own FLOPs).

Timing: median over --iters of one call (graph replay) between CUDA events, the L2 flushed
before each. Effective TFLOPS = 2*3*H*I * (valid local token-expert pairs) / time. For small T
the cost is streaming the weights of the experts that got rows: ``weight_gbps`` = those bytes
(3*H*I*2 per expert) / time, printed next to ``hbm_gbps``, a large device-to-device copy
(read + write bytes / time) measured in the same run. ``rel_diff``: relative Frobenius
difference of petit's output to the torch loop's.

    python examples/bench_experts.py                        # both presets, W=2, T 1..8192
    python examples/bench_experts.py --quick                # T 1, 128, 2048
    python examples/bench_experts.py --replot examples/results/experts_H200_1gpu.jsonl
    python examples/bench_experts.py --profile --tokens 1 8 32 --tiles wgmma_narrow wgmma_m64
    python examples/bench_experts.py --tokens 8 16 --expert-configs "" narrow_max_rows=4
Each row also records ``launch``: grid, threads, dynamic shared memory and CTAs per cluster of
the two GEMM kernels as launched (``ops.last_gemm_launch``).
--chain N: at decode sizes (tokens <= CHAIN_MAX_TOKENS) also the time per call of N calls back
to back in one CUDA graph, each on its own copy of the weights (made once per preset, as many
as fit the free memory: field ``chain``), so no call finds another's weights in L2: what each
of a decode step's MoE layers pays once the graph launch is amortized and the kernels of
consecutive calls overlap as in a served step (fields ``us_chain``, ``weight_gbps_chain``,
``triton_us_chain``; the single-call ``us`` keeps its L2 flush and graph launch).
--expert-configs: one or more ``vllm_petit_moe.config.ExpertConfig`` settings as
``field=value,...`` ("" for the defaults), each run with every family of --tiles on the same
rows (field ``expert_config``): a sweep of auto's bounds in one run.
--profile: after timing, 10 more calls of petit's and of Triton's path run under torch.profiler
(CUDA activity only); their kernel time per call by category (``bench_env.PROFILE_CATEGORIES``:
petit row lists / GEMMs / reduce, Triton GEMM / align+sum+activation, other) is printed under
each row and stored as ``breakdown`` / ``triton_breakdown``. Petit's kernels are launched with
programmatic dependent launch (field ``breakdown_pdl``): a kernel starts while the previous
one runs and its recorded duration includes that wait, so the categories overlap and
overstate the GEMMs.
Writes examples/results/experts_<gpu>_1gpu.jsonl (one GPU whatever W; fields gpu, num_gpus,
commit, date, preset, routing, tokens, world, tflops, triton_tflops, torch_tflops,
speedup_vs_triton, weight_gbps, hbm_gbps, dense_tflops and more) and a PNG next to it, and prints a table. The commit comes from $PETIT_COMMIT or git.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from vllm_petit_moe.config import ExpertConfig, as_dict, parse_config
from vllm_petit_moe.ops import TILES
from vllm_petit_moe.testing.bench_env import (
    commit_stamp, format_breakdown, gpu_name, profile_kernels, replot, results_name, utc_date,
    write_results)

ROOT = Path(__file__).resolve().parent.parent

PRESETS = {
    "deepseek-v3": dict(hidden=7168, intermediate=2048, num_experts=256, top_k=8),
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768, num_experts=128, top_k=8),
}
ROUTINGS = ("uniform", "skewed")  # the default set
SKEWS = {"uniform": None, "skewed": "hot_rank", "hot_expert": "one_expert",
         "same": "same_experts"}
TOKENS = [1, 2, 8, 32, 128, 512, 2048, 8192]
QUICK_TOKENS = [1, 128, 2048]
L2_FLUSH_BYTES = 256 << 20
PROFILE_CALLS = 10  # calls per path under --profile
HBM_COPY_BYTES = 2 << 30
CHAIN_MAX_TOKENS = 128  # --chain applies to the configurations up to this many tokens/rank
CHAIN_RESERVE_BYTES = 8 << 30  # free memory --chain leaves for the runs


# --------------------------------------------------------------------------------------------
# problem and the three implementations
# --------------------------------------------------------------------------------------------


def make_weights(preset, world, seed):
    import torch

    p = PRESETS[preset]
    num_local = p["num_experts"] // world
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden, inter = p["hidden"], p["intermediate"]
    w13 = torch.empty(num_local, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(num_local, hidden, inter, dtype=torch.bfloat16, device="cuda")
    for e in range(num_local):  # expert by expert: no fp32 copy of all weights at once
        w13[e] = (torch.randn(2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5)
        w2[e] = (torch.randn(hidden, inter, generator=gen, device="cuda") / inter**0.5)
    return w13, w2


def chain_length(requested, copy_bytes, free_bytes, reserve_bytes=CHAIN_RESERVE_BYTES):
    """Calls per chain for --chain: ``requested``, or fewer when the weight copies (one per call
    beyond the first, ``copy_bytes`` each) would leave less than ``reserve_bytes`` of
    ``free_bytes``; 0 (no chain) below 2."""
    if requested < 2:
        return 0
    fit = 1 + max(free_bytes - reserve_bytes, 0) // max(copy_bytes, 1)
    n = min(requested, fit)
    return n if n >= 2 else 0


def chain_us(fns, iters, flush):
    """Median device time per call (us) of ``fns`` run back to back in one CUDA graph."""
    us, captured = time_us(lambda: [fn() for fn in fns], iters, flush)
    return us / len(fns), captured


def make_routing(preset, routing, tokens, world, hot_fraction, seed):
    """Rank 0's received rows: recv_x [W*T, H] bf16, local ids [W*T, K] int32, weights f32."""
    import torch

    from vllm_petit_moe.testing import reference

    p = PRESETS[preset]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_rows = world * tokens
    ids, weights = reference.random_topk(
        num_rows, p["num_experts"], p["top_k"], generator=gen,
        skew=SKEWS[routing], world_size=world,
        hot_fraction=hot_fraction,
    )
    local_ids = reference.local_expert_ids(ids, 0, p["num_experts"], world).contiguous()
    weights = torch.where(local_ids >= 0, weights, 0.0).float().contiguous()
    recv_x = torch.randn(num_rows, p["hidden"], generator=gen, device="cuda").to(torch.bfloat16)
    return recv_x, local_ids, weights


def petit_fn(recv_x, local_ids, weights, w13, w2, tiles, config=None):
    import torch

    from vllm_petit_moe import ops

    out = torch.empty_like(recv_x)
    (act_shape, act_dtype), (partial_shape, partial_dtype) = ops.experts_workspace_shapes(
        recv_x.shape[0], local_ids.shape[1], recv_x.shape[1], w13.shape[1] // 2)
    act = torch.empty(act_shape, dtype=act_dtype, device="cuda")
    partial = torch.empty(partial_shape, dtype=partial_dtype, device="cuda")

    def run():
        return ops.experts_forward(recv_x, local_ids, weights, w13, w2, out=out,
                                   act_workspace=act, partial_workspace=partial, tiles=tiles,
                                   config=config)

    return run


def dense_fn(local_ids, w13, w2):
    """cuBLAS's reference for the same work: ``torch.bmm`` over the touched experts' weights
    with the mean rows per expert for every one of them (contiguous rows, no gather, no
    activation or weighting). Returns (call, its FLOPs), or (None, 0) when no pair is local."""
    import torch

    valid = local_ids >= 0
    pairs = int(valid.sum())
    if not pairs:
        return None, 0
    touched = int(torch.unique(local_ids[valid]).numel())
    rows = -(-pairs // touched)
    hidden, inter = w13.shape[2], w2.shape[2]
    a1 = torch.randn(touched, rows, hidden, dtype=torch.bfloat16, device="cuda")
    a2 = torch.randn(touched, rows, inter, dtype=torch.bfloat16, device="cuda")
    w13_t, w2_t = w13[:touched].transpose(1, 2), w2[:touched].transpose(1, 2)

    def run():
        return torch.bmm(a1, w13_t), torch.bmm(a2, w2_t)

    return run, 2 * 3 * hidden * inter * rows * touched


_triton_note: list[str] = []


def triton_fn(recv_x, local_ids, weights, w13, w2, num_experts, world):
    """vLLM's Triton experts on rank 0's rows (global ids + expert_map, as vLLM runs them
    behind its all-gather: non-local slots get another rank's expert, mapped to -1)."""
    import torch

    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except Exception as exc:  # vLLM missing or its GPU kernels unavailable
        if not _triton_note:
            _triton_note.append(f"vLLM Triton experts unavailable ({type(exc).__name__}: {exc})")
            print(f"# NOTE: {_triton_note[0]}; triton column skipped", flush=True)
        return None
    num_local = num_experts // world
    if world > 1:
        global_ids = torch.where(local_ids >= 0, local_ids, num_local).to(torch.int32)
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device="cuda")
        expert_map[:num_local] = torch.arange(num_local, dtype=torch.int32, device="cuda")
    else:
        global_ids, expert_map = local_ids, None

    def run():
        return fused_experts(recv_x, w13, w2, weights, global_ids,
                             global_num_experts=num_experts, expert_map=expert_map)

    return run


def torch_loop(recv_x, local_ids, weights, w13, w2):
    """Per-expert bf16 matmuls, fp32 weighted sum; the plain-torch baseline (host syncs)."""
    import torch
    import torch.nn.functional as F

    top_k = local_ids.shape[1]
    inter = w13.shape[1] // 2
    flat = local_ids.reshape(-1).long()
    valid = flat >= 0
    keys = torch.where(valid, flat, w13.shape[0])
    order = torch.sort(keys, stable=True).indices
    counts = torch.bincount(flat[valid], minlength=w13.shape[0]).tolist()
    flat_weights = weights.reshape(-1)
    out = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
    begin = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        entries = order[begin:begin + count]
        begin += count
        rows = entries // top_k
        gate_up = recv_x[rows] @ w13[expert].T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, (act @ w2[expert].T).float() * flat_weights[entries, None])
    return out.to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def time_us(fn, iters, flush, graph=True):
    """Median device time (us) of one call; CUDA-graph replays when capturable."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    call = fn
    captured = False
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            call, captured = g.replay, True
        except Exception as exc:  # not capturable: time it eagerly
            print(f"# note: CUDA-graph capture failed ({type(exc).__name__}); timing eagerly",
                  flush=True)
            torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        flush.zero_()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), captured


def hbm_copy_gbps(iters=10):
    """Device-to-device copy bandwidth, (read + write) bytes / time, in GB/s."""
    import torch

    src = torch.empty(HBM_COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * HBM_COPY_BYTES / statistics.median(times) / 1e9


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def bench_one(preset, routing, tokens, args, w13, w2, flush, hbm_gbps, copies=()):
    """One configuration: every family of --tiles with every --expert-configs on the same
    rows, against vLLM's Triton experts and the torch loop (each measured once). ``copies``:
    further (w13, w2) copies for --chain (used up to CHAIN_MAX_TOKENS tokens/rank). Returns
    one row per (family, config)."""
    import torch

    from vllm_petit_moe import ops

    p = PRESETS[preset]
    hidden, inter = p["hidden"], p["intermediate"]
    recv_x, local_ids, weights = make_routing(preset, routing, tokens, args.world,
                                              args.hot_fraction, args.seed + tokens)
    valid = local_ids >= 0
    pairs = int(valid.sum())
    experts_touched = int(torch.unique(local_ids[valid]).numel()) if pairs else 0
    hot_share = pairs / local_ids.numel()  # share of all W ranks' pairs that rank 0 serves
    flops = 2 * 3 * hidden * inter * pairs
    weight_bytes = experts_touched * 3 * hidden * inter * 2
    chain = [(w13, w2), *copies] if copies and tokens <= CHAIN_MAX_TOKENS and pairs else []

    petit = []  # (requested family, config, resolved family, us, output, breakdown, launch,
    #             us_chain)
    for family, config in [(f, c) for c in args.expert_configs for f in args.tiles]:
        run_petit = petit_fn(recv_x, local_ids, weights, w13, w2, family, config)
        out = run_petit().clone()
        launch = ({"gate_up": ops.last_gemm_launch(True), "down": ops.last_gemm_launch(False)}
                  if pairs else None)  # no rows: nothing was launched
        us, _ = time_us(run_petit, args.iters, flush)
        us_chain = None
        if chain:
            us_chain, _ = chain_us([petit_fn(recv_x, local_ids, weights, c13, c2, family, config)
                                    for c13, c2 in chain], args.iters, flush)
        breakdown = None
        if args.profile:  # eager calls, warmed up by the timing above
            breakdown = profile_kernels(run_petit, PROFILE_CALLS)
        resolved = ops.resolve_tiles(recv_x.shape[0], local_ids.shape[1], w13.shape[0],
                                     recv_x.shape[1], family, config)
        petit.append((family, config, resolved, us, out, breakdown, launch, us_chain))
        del run_petit

    triton_us = triton_breakdown = triton_us_chain = None
    run_triton = None if args.no_triton else triton_fn(recv_x, local_ids, weights, w13, w2,
                                                       p["num_experts"], args.world)
    if run_triton is not None:
        triton_us, _ = time_us(run_triton, args.iters, flush)
        if chain:
            triton_us_chain, _ = chain_us(
                [triton_fn(recv_x, local_ids, weights, c13, c2, p["num_experts"], args.world)
                 for c13, c2 in chain], args.iters, flush)
        if args.profile:
            triton_breakdown = profile_kernels(run_triton, PROFILE_CALLS)

    torch_out = torch_loop(recv_x, local_ids, weights, w13, w2)
    torch_us, _ = time_us(lambda: torch_loop(recv_x, local_ids, weights, w13, w2),
                          max(3, args.iters // 5), flush, graph=False)

    dense_us = dense_tflops = None
    run_dense, dense_flops = dense_fn(local_ids, w13, w2)
    if run_dense is not None:
        dense_us, _ = time_us(run_dense, args.iters, flush)
        dense_tflops = dense_flops / (dense_us * 1e-6) / 1e12
        del run_dense

    def tflops(us):
        return flops / (us * 1e-6) / 1e12 if us and pairs else 0.0

    rows = []
    for family, config, resolved, petit_us, petit_out, breakdown, launch, us_chain in petit:
        diff = (petit_out.float() - torch_out.float()).norm()
        row = dict(
            preset=preset, routing=routing, tokens=tokens, world=args.world,
            local_experts=w13.shape[0], pairs=pairs, experts_touched=experts_touched,
            hot_share=hot_share, tiles=resolved, tiles_requested=family,
            expert_config=as_dict(config),
            us=petit_us, triton_us=triton_us, torch_us=torch_us,
            tflops=tflops(petit_us),
            triton_tflops=tflops(triton_us) if triton_us else None,
            torch_tflops=tflops(torch_us),
            speedup_vs_triton=(triton_us / petit_us) if triton_us else None,
            weight_bytes=weight_bytes,
            weight_gbps=weight_bytes / (petit_us * 1e-6) / 1e9,
            hbm_gbps=hbm_gbps,
            dense_us=dense_us, dense_tflops=dense_tflops,
            launch=launch,  # grid / threads / smem / cluster of the two GEMM kernels
            rel_diff=float(diff / torch_out.float().norm().clamp_min(1e-30)),
            finite=bool(torch.isfinite(petit_out).all()),
        )
        if chain:
            row.update(chain=len(chain), us_chain=us_chain, triton_us_chain=triton_us_chain,
                       weight_gbps_chain=weight_bytes / (us_chain * 1e-6) / 1e9)
        if args.profile:
            row.update(breakdown=breakdown, breakdown_pdl=True,
                       triton_breakdown=triton_breakdown)
        rows.append(row)
    del run_triton, petit, torch_out
    torch.cuda.empty_cache()
    return rows


HEADER = (f"{'preset':14} {'routing':8} {'tokens':>6} {'tiles':>12} {'petit_us':>9} "
          f"{'triton_us':>9} {'torch_us':>9} {'petit_TF':>8} {'triton_TF':>9} {'speedup':>7} "
          f"{'weight_GB/s':>11} {'hbm_GB/s':>8} {'dense_TF':>8} {'rel_diff':>8}")


def _fmt(value, spec):
    return format(value, spec) if value is not None else format("-", spec.split(".")[0] + "s")


def print_row(r):
    flag = "" if r["finite"] and r["rel_diff"] < 2e-2 else "   <-- differs from torch loop"
    print(f"{r['preset']:14} {r['routing']:8} {r['tokens']:>6} {r['tiles']:>12} "
          f"{r['us']:9.1f} {_fmt(r['triton_us'], '9.1f')} {r['torch_us']:9.1f} "
          f"{r['tflops']:8.2f} {_fmt(r['triton_tflops'], '9.2f')} "
          f"{_fmt(r['speedup_vs_triton'], '7.2f')} {r['weight_gbps']:11.0f} "
          f"{r['hbm_gbps']:8.0f} {_fmt(r.get('dense_tflops'), '8.1f')} {r['rel_diff']:8.1e}{flag}",
          flush=True)
    if r.get("chain"):
        print(f"    chain of {r['chain']} calls: petit {r['us_chain']:.1f} us/call "
              f"({r['weight_gbps_chain']:.0f} GB/s of weights, "
              f"{r['weight_gbps_chain'] / r['hbm_gbps']:.2f} of the HBM copy)"
              + (f", Triton {r['triton_us_chain']:.1f} us/call"
                 if r.get("triton_us_chain") else ""), flush=True)
    for key, name in (("breakdown", "petit"), ("triton_breakdown", "triton")):
        if r.get(key):
            print(f"    {name}: {format_breakdown(r[key])}", flush=True)


def _variant(row):
    """A results row's petit variant: its requested family, and its ExpertConfig where that is
    not the default."""
    config = row.get("expert_config") or {}
    changed = {k: v for k, v in config.items() if as_dict(ExpertConfig()).get(k) != v}
    return row.get("tiles_requested", "") + "".join(f" {k}={v}" for k, v in changed.items())


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({r["preset"] for r in rows})
    fig, axes = plt.subplots(len(presets), 2, figsize=(13, 4.2 * len(presets)), squeeze=False)
    for row_axes, preset in zip(axes, presets):
        hbm = None
        # one petit line per requested family and config (files from before --tiles took
        # several: one)
        families = list(dict.fromkeys(_variant(r) for r in rows))
        for routing, marker in zip(SKEWS, ["o", "s", "^", "D"]):
            for index, family in enumerate(families):
                sel = sorted((r for r in rows if r["preset"] == preset and r["routing"] == routing
                              and _variant(r) == family),
                             key=lambda r: r["tokens"])
                if not sel:
                    continue
                toks = [r["tokens"] for r in sel]
                name = f"petit {family}" if len(families) > 1 else "petit"
                row_axes[0].plot(toks, [r["tflops"] for r in sel], "-" + marker,
                                 label=f"{name}, {routing}")
                row_axes[1].plot(toks, [r["weight_gbps"] for r in sel], "-" + marker,
                                 label=f"{name} weight bytes/s, {routing}")
                hbm = sel[0]["hbm_gbps"]
                if index:
                    continue  # the baselines were measured once per configuration
                if any(r["triton_tflops"] for r in sel):
                    row_axes[0].plot(toks, [r["triton_tflops"] or float("nan") for r in sel],
                                     "--" + marker, alpha=0.7, label=f"vLLM Triton, {routing}")
                row_axes[0].plot(toks, [r["torch_tflops"] for r in sel], ":" + marker,
                                 alpha=0.6, label=f"torch loop, {routing}")
        row_axes[0].set(xscale="log", yscale="log", xlabel="tokens per rank",
                        ylabel="effective TFLOPS", title=f"{preset}: TFLOPS")
        if hbm:
            row_axes[1].axhline(hbm, color="k", lw=0.8, label=f"HBM copy {hbm:.0f} GB/s")
        row_axes[1].set(xscale="log", xlabel="tokens per rank", ylabel="GB/s",
                        title=f"{preset}: expert-weight bytes / time")
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
                   help=f"tokens per rank (default: {TOKENS}; --quick: {QUICK_TOKENS})")
    p.add_argument("--world", type=int, default=2,
                   help="EP world size W: rank 0 gets E/W local experts and W*T rows "
                        "(default: %(default)s)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 30, quick 10)")
    p.add_argument("--hot-fraction", type=float, default=0.6,
                   help="skewed routing: probability that a pair lands on rank 0's experts "
                        "(default: %(default)s; 1/W would be an even split)")
    p.add_argument("--tiles", nargs="+", choices=tuple(TILES), default=["auto"],
                   help="petit tile families, each run on the same rows against the same "
                        "baselines (default: auto, i.e. wgmma_narrow / _m64 / wgmma / _mc on "
                        "H100/H200 by rows per expert; see vllm_petit_moe.ops.TILES)")
    p.add_argument("--expert-configs", nargs="+", default=[""], metavar="SPEC",
                   help="ExpertConfig settings, field=value,... each ('' = the defaults), "
                        "every one run with every --tiles family")
    p.add_argument("--no-triton", action="store_true", help="skip vLLM's Triton experts")
    p.add_argument("--profile", action="store_true",
                   help="also sum each path's kernel time by category (torch.profiler)")
    p.add_argument("--chain", type=int, default=1, metavar="N",
                   help=f"at <= {CHAIN_MAX_TOKENS} tokens/rank also time N calls back to back "
                        "in one CUDA graph, each on its own weight copy (default: %(default)s; "
                        "1: off)")
    p.add_argument("--seed", type=int, default=1234,
                   help="seed of the rows, routing and weights (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS}, 10 iters")
    p.add_argument("--out-dir", default=None, help="also write the results here")
    p.add_argument("--replot", metavar="JSONL", help="only redraw the plot of a results file")
    args = p.parse_args(argv)
    try:
        args.expert_configs = [parse_config(ExpertConfig, spec) for spec in args.expert_configs]
    except (TypeError, ValueError) as e:
        p.error(f"--expert-configs: {e}")
    if args.tokens is None:
        args.tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.iters is None:
        args.iters = 10 if args.quick else 30
    if min(args.tokens) < 1:
        p.error("--tokens must be >= 1")
    if args.iters < 1:
        p.error("--iters must be >= 1")
    if args.chain < 1:
        p.error("--chain must be >= 1")
    if not 0.0 <= args.hot_fraction <= 1.0:
        p.error("--hot-fraction must be in [0, 1]")
    for preset in args.presets:
        if args.world < 1 or PRESETS[preset]["num_experts"] % args.world:
            p.error(f"--world {args.world} must divide {preset}'s "
                    f"{PRESETS[preset]['num_experts']} experts")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot, plot, lambda r: f"expert GEMMs, {r['gpu']}, {r['commit']}")

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_experts needs a CUDA GPU")
    gpu = gpu_name()
    commit = commit_stamp(ROOT)
    date = utc_date()
    hbm_gbps = hbm_copy_gbps()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    print(f"# {gpu}, commit {commit}, HBM copy {hbm_gbps:.0f} GB/s (read+write), W={args.world}",
          flush=True)
    rows = []
    for preset in args.presets:
        w13, w2 = make_weights(preset, args.world, args.seed)
        print(f"# {preset}: {PRESETS[preset]}, {w13.shape[0]} local experts, weights "
              f"{(w13.numel() + w2.numel()) * 2 / 2**30:.1f} GiB", flush=True)
        copies = []
        if args.chain > 1 and min(args.tokens) <= CHAIN_MAX_TOKENS:
            copy_bytes = (w13.numel() + w2.numel()) * 2
            n = chain_length(args.chain, copy_bytes, torch.cuda.mem_get_info()[0])
            copies = [(w13.clone(), w2.clone()) for _ in range(max(n - 1, 0))]
            print(f"# --chain {args.chain}: {n or 'no'} calls per chain "
                  f"({len(copies)} weight copies)", flush=True)
        print(HEADER, flush=True)
        for routing in args.routings:
            for tokens in args.tokens:
                for row in bench_one(preset, routing, tokens, args, w13, w2, flush, hbm_gbps,
                                     copies):
                    rows.append(row)
                    print_row(row)
        del w13, w2, copies
        torch.cuda.empty_cache()

    # one GPU whatever --world: the rows are rank 0's share of a W-rank EP world (field world)
    write_results(ROOT, results_name("experts", gpu, 1), rows,
                  dict(gpu=gpu, num_gpus=1, commit=commit, date=date), plot,
                  f"expert GEMMs at rank 0 of W={args.world}, {gpu}, {commit}", args.out_dir)
    bad = [r for r in rows if not r["finite"] or r["rel_diff"] >= 2e-2]
    if bad:
        print(f"WARNING: {len(bad)} configurations where petit's output differs from the torch "
              "loop (rel_diff >= 2e-2 or non-finite)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
