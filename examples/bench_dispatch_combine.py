"""Benchmark of EpBuffer dispatch/combine on the local GPUs (one process per GPU).

For each (preset, routing, tokens per rank, SM count): dispatch and combine kernel latency
(median over CUDA-graph replays, read from the profiler's kernel records), physical GB/s
(rows that cross GPUs), logical GB/s (all received rows, self included: the DeepEP/MORI
convention), the ceiling measured in the same run (every rank at once pushing the same
physical bytes to its peers with a plain SM copy kernel) and the ratio to it, NCCL
all_to_all_single moving the same rows, and the torch reference (dispatch_reference +
combine_reference of all ranks simulated on one GPU).

    python examples/bench_dispatch_combine.py                     # DeepSeek-V3 preset
    python examples/bench_dispatch_combine.py --quick             # fewer sizes
    python examples/bench_dispatch_combine.py --tokens 4096 --trace   # + the combine's timeline
    python examples/bench_dispatch_combine.py --combine-configs "" reduce_pct=40,reduce_items=0
Writes examples/results/dispatch_combine_<gpu>_<G>gpu.jsonl (one rank per GPU: G = W; rows
lead with gpu, world, num_gpus, commit, date) and a PNG plot next to it.

--combine-configs: one or more ``vllm_petit_moe.config.CombineConfig`` settings as
``field=value,...`` ("" for the defaults), each on its own EpBuffer (field ``combine_config``).

--trace: after the timed replays, a second graph of the same step whose combine writes its
per-block timeline (vllm_petit_moe.testing.combine_trace) is replayed a few times; the last
replay's timeline of every rank is printed and stored in the row (``combine_trace``, one summary per
rank: microseconds after the rank's earliest block start).
"""
from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_petit_moe.config import CombineConfig, as_dict, parse_config
from vllm_petit_moe.testing.bench_env import (
    commit_stamp, gpu_name, replot, results_name, utc_date, write_results)
from vllm_petit_moe.testing.combine_trace import format_combine_trace

ROOT = Path(__file__).resolve().parent.parent

PRESETS = {
    "deepseek-v3": dict(hidden=7168, num_experts=256, top_k=8),
    "qwen3-30b-a3b": dict(hidden=2048, num_experts=128, top_k=8),
}
TOKENS = [1, 8, 32, 128, 512, 1024, 4096, 16384]
QUICK_TOKENS = [1, 128, 4096]
def _kernel_times_us(prof, names):
    """Median device time (us) of the kernels whose name contains each of `names`."""
    found = {n: [] for n in names}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        for n in names:
            if n in evt.name:
                found[n].append(evt.device_time)
    return {n: (statistics.median(v) if v else float("nan")) for n, v in found.items()}


def _profile(fn, iters):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof


def _event_time_us(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _bench_one(buf, rank, world, preset, routing, num_tokens, iters, group, trace=False):
    from vllm_petit_moe.testing import reference as ref
    cfg = PRESETS[preset]
    hidden, num_experts, top_k = cfg["hidden"], cfg["num_experts"], cfg["top_k"]
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(1234 + num_tokens)
    skew = None if routing == "uniform" else "hot_rank"
    xs, ids, ws = [], [], []
    for _ in range(world):
        xs.append(torch.randn(num_tokens, hidden, generator=gen, device=dev).bfloat16())
        i, w = ref.random_topk(num_tokens, num_experts, top_k, generator=gen, skew=skew,
                               world_size=world, hot_fraction=0.5, device=dev)
        ids.append(i.int())
        ws.append(w)
    x, topk_ids, topk_w = xs[rank], ids[rank], ws[rank]
    num_local = num_experts // world
    owners = topk_ids // num_local
    routed_to = [int((owners == d).any(dim=1).sum()) for d in range(world)]  # rows I send
    received = [int(((i // num_local) == rank).any(dim=1).sum()) for i in ids]  # rows I get
    row_bytes = hidden * 2
    phys_send = sum(routed_to[d] for d in range(world) if d != rank) * row_bytes
    phys_back = sum(received[s] for s in range(world) if s != rank) * row_bytes
    logical_recv = sum(received) * row_bytes
    logical_back = sum(routed_to) * row_bytes

    y = torch.empty_like(x)
    expert_out = torch.randn(world * num_tokens, hidden, device=dev).bfloat16()

    def step(combine_trace=None):
        out = buf.dispatch(x, topk_ids, topk_w, region_stride=num_tokens)
        buf.combine(expert_out, out.handle, out=y, trace=combine_trace)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    dist.barrier(group)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier(group)
    prof = _profile(graph.replay, iters)
    t = _kernel_times_us(prof, ["dispatch_kernel", "combine_kernel"])
    dispatch_us, combine_us = t["dispatch_kernel"], t["combine_kernel"]
    dist.barrier(group)
    pair_us = _event_time_us(graph.replay, iters)  # one graph replay, launch included

    # Ceiling: the same physical bytes, every rank pushing at once with a plain SM copy.
    per_peer = max(16, (phys_send // max(world - 1, 1)) // 16 * 16)
    src = torch.randn(per_peer // 2 + 8, device=dev).bfloat16()
    dist.barrier(group)
    torch.cuda.synchronize()
    prof = _profile(lambda: buf.peer_write(src, per_peer), iters)
    ceiling_us = _kernel_times_us(prof, ["peer_write_kernel"])["peer_write_kernel"]
    ceiling_gbps = per_peer * (world - 1) / ceiling_us / 1e3
    dist.barrier(group)

    # NCCL all_to_all_single moving the same rows (deduplicated per rank).
    send = torch.randn(sum(routed_to), hidden, device=dev).bfloat16()
    recv = torch.empty(sum(received), hidden, device=dev, dtype=torch.bfloat16)
    nccl_us = _event_time_us(lambda: dist.all_to_all_single(recv, send, received, routed_to),
                             iters)

    # Torch reference: all ranks simulated on this GPU (few iterations; it is slow).
    def reference():
        outs = ref.dispatch_reference(xs, ids, ws, num_experts, num_tokens)
        ref.combine_reference([o.recv_x for o in outs], ids, num_experts)
    reference_us = _event_time_us(reference, 3, warmup=1)

    def gbps(nbytes, us):
        return nbytes / us / 1e3 if us == us and us > 0 else float("nan")
    row = dict(preset=preset, routing=routing, tokens=num_tokens, num_sms=buf.num_sms,
               dispatch_us=dispatch_us, combine_us=combine_us,
               dispatch_phys_gbps=gbps(phys_send, dispatch_us),
               combine_phys_gbps=gbps(phys_back, combine_us),
               dispatch_logical_gbps=gbps(logical_recv, dispatch_us),
               combine_logical_gbps=gbps(logical_back, combine_us),
               ceiling_gbps=ceiling_gbps, ceiling_us=ceiling_us, graph_pair_us=pair_us,
               nccl_us=nccl_us, reference_us=reference_us,
               phys_send_bytes=phys_send, phys_back_bytes=phys_back)
    row["dispatch_ratio"] = row["dispatch_phys_gbps"] / ceiling_gbps
    row["combine_ratio"] = row["combine_phys_gbps"] / ceiling_gbps
    if trace:
        row["combine_trace"] = _combine_timeline(buf, step, group)
    return row


def _combine_timeline(buf, step, group, replays=3):
    """The combine's per-block timeline in a graph replay of `step` (the last of `replays`)."""
    from vllm_petit_moe import _C
    from vllm_petit_moe.testing.combine_trace import summarize_combine_trace
    trace = buf.new_combine_trace()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(trace)
    for _ in range(replays):
        dist.barrier(group)
        graph.replay()
        torch.cuda.synchronize()
    return summarize_combine_trace(trace, _C.kTimerTicksPerSecond)


def _worker(rank, world, port, args, results):
    from vllm_petit_moe.testing.bench_env import MULTICAST_OFF_ENV
    os.environ.update(MULTICAST_OFF_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    from vllm_petit_moe.buffer import EpBuffer
    rows = []
    for preset in args.presets:
        cfg = PRESETS[preset]
        for num_sms, config in [(n, c) for n in args.num_sms for c in args.combine_configs]:
            buf = EpBuffer(group, hidden_size=cfg["hidden"], num_experts=cfg["num_experts"],
                           max_tokens_per_rank=max(args.tokens), max_top_k=cfg["top_k"],
                           num_sms=num_sms or None, config=config)
            for routing in args.routings:
                for tokens in args.tokens:
                    row = _bench_one(buf, rank, world, preset, routing, tokens, args.iters,
                                     group, trace=args.trace)
                    row["combine_config"] = as_dict(config)
                    gathered = [None] * world
                    dist.all_gather_object(gathered, row, group=group)
                    if rank == 0:
                        rows.append(_average(gathered))
                        _print_row(rows[-1])
                        for r, summary in enumerate(rows[-1].get("combine_trace", [])):
                            print(f"  combine timeline, rank {r}: "
                                  f"{format_combine_trace(summary)}", flush=True)
            dist.barrier(group)
            buf.close()
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _average(per_rank):
    """Mean over ranks of every numeric field (latencies, bandwidths, ratios)."""
    row = dict(per_rank[0])
    for key, value in row.items():
        if isinstance(value, float):
            row[key] = statistics.fmean(r[key] for r in per_rank)
    if "combine_trace" in row:  # one timeline per rank (their timers are not comparable)
        row["combine_trace"] = [r["combine_trace"] for r in per_rank]
    return row


HEADER = (f"{'preset':14} {'routing':8} {'tokens':>6} {'SMs':>4} {'disp_us':>8} {'comb_us':>8} "
          f"{'disp_GB/s':>9} {'comb_GB/s':>9} {'ceil_GB/s':>9} {'d_ratio':>7} {'c_ratio':>7} "
          f"{'nccl_us':>8} {'log_GB/s':>8}")


def _print_row(r):
    print(f"{r['preset']:14} {r['routing']:8} {r['tokens']:>6} {r['num_sms']:>4} "
          f"{r['dispatch_us']:8.1f} {r['combine_us']:8.1f} {r['dispatch_phys_gbps']:9.1f} "
          f"{r['combine_phys_gbps']:9.1f} {r['ceiling_gbps']:9.1f} {r['dispatch_ratio']:7.2f} "
          f"{r['combine_ratio']:7.2f} {r['nccl_us']:8.1f} {r['dispatch_logical_gbps']:8.1f}",
          flush=True)


def _plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for (preset, routing, sms), style in zip(
            sorted({(r["preset"], r["routing"], r["num_sms"]) for r in rows}),
            ["-o", "--s", ":^", "-.v", "-x", "--d", ":*", "-.p"]):
        sel = sorted((r for r in rows if (r["preset"], r["routing"], r["num_sms"]) ==
                      (preset, routing, sms)), key=lambda r: r["tokens"])
        toks = [r["tokens"] for r in sel]
        label = f"{routing}, {sms} SMs"
        axes[0].plot(toks, [r["dispatch_us"] for r in sel], style, label=f"dispatch {label}")
        axes[0].plot(toks, [r["combine_us"] for r in sel], style, alpha=0.6,
                     label=f"combine {label}")
        axes[1].plot(toks, [r["dispatch_ratio"] for r in sel], style, label=f"dispatch {label}")
        axes[1].plot(toks, [r["combine_ratio"] for r in sel], style, alpha=0.6,
                     label=f"combine {label}")
    most_sms = max(r["num_sms"] for r in rows)
    nccl = sorted((r for r in rows if r["routing"] == "uniform" and r["num_sms"] == most_sms),
                  key=lambda r: r["tokens"])
    axes[0].plot([r["tokens"] for r in nccl], [r["nccl_us"] for r in nccl], "k:",
                 label="NCCL all_to_all_single (same rows)")
    axes[0].set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="latency (us)",
                title="latency")
    axes[1].set(xscale="log", xlabel="tokens per rank", ylabel="physical GB/s / ceiling",
                title="fraction of the same-run peer-write ceiling", ylim=(0, 1.1))
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", default=["deepseek-v3"], choices=sorted(PRESETS),
                   help="model shapes (default: %(default)s)")
    p.add_argument("--routings", nargs="+", default=["uniform", "skewed"],
                   help="routing patterns (default: %(default)s)")
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help=f"tokens per rank (default: {TOKENS}; --quick: {QUICK_TOKENS})")
    p.add_argument("--num-sms", nargs="+", type=int, default=[0, 24],
                   help="grid sizes to run; 0 = every SM (default: %(default)s)")
    p.add_argument("--iters", type=int, default=30,
                   help="timed graph replays (default: %(default)s; --quick: 10)")
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS}, 10 iters")
    p.add_argument("--out-dir", default=None, help="also copy the results here")
    p.add_argument("--replot", metavar="JSONL", help="only redraw the plot of a results file")
    p.add_argument("--trace", action="store_true",
                   help="also record and print the combine's per-block timeline")
    p.add_argument("--combine-configs", nargs="+", default=[""], metavar="SPEC",
                   help="CombineConfig settings, field=value,... each ('' = the defaults, "
                        "the default), each run on its own EpBuffer")
    args = p.parse_args()
    try:
        args.combine_configs = [parse_config(CombineConfig, s) for s in args.combine_configs]
    except (TypeError, ValueError) as e:
        p.error(f"--combine-configs: {e}")
    if args.replot:
        # rows before num_gpus ran one rank per GPU too
        return replot(args.replot, _plot, lambda r: f"EpBuffer dispatch/combine, "
                      f"{r.get('num_gpus', r['world'])} x {r['gpu']}, {r['commit']}")
    if args.tokens is None:
        args.tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.quick:
        args.iters = 10
    world = torch.cuda.device_count()
    if world < 2:
        sys.exit("bench_dispatch_combine needs >= 2 GPUs (performance needs separate GPUs)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    print(HEADER, flush=True)
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    rows = None
    while rows is None:  # a worker that dies must not leave the parent waiting forever
        try:
            rows = results.get(timeout=10)
        except queue.Empty:
            if any(not proc.is_alive() and proc.exitcode != 0 for proc in procs):
                for proc in procs:
                    proc.kill()
                sys.exit("bench_dispatch_combine: a worker failed (see its traceback above)")
    for proc in procs:
        proc.join()
    gpu = gpu_name(0)
    commit = commit_stamp(ROOT)
    write_results(ROOT, results_name("dispatch_combine", gpu, world), rows,
                  dict(gpu=gpu, world=world, num_gpus=world, commit=commit, date=utc_date()),
                  _plot, f"EpBuffer dispatch/combine, {world} x {gpu}, {commit}", args.out_dir)


if __name__ == "__main__":
    main()
