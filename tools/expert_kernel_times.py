#!/usr/bin/env python3
"""Device time of each kernel of one expert call (examples/bench_experts.py's rows and
weights), under torch.profiler, with the L2 flushed before every call: the row lists, the
gate/up and down GEMMs (or the fused kernel) and the reduction, each on its own line, with the
weight bytes each GEMM streams and the rate per busy SM (bytes / time / min(tiles, SMs)).
What bench_experts --profile sums into categories, kernel by kernel, for the decode calls
whose few tiles leave SMs idle.

    python3 tools/expert_kernel_times.py --presets qwen3-30b-a3b --routings same uniform \
        --tokens 1 4 --tiles wgmma_narrow wgmma --out results.jsonl

Needs a GPU with the extension built. The kernels are launched with programmatic dependent
launch (always, on sm_90): a kernel may start while the previous one runs, and its time then
includes that wait. wgmma_narrow / wgmma_m64 run both GEMMs as one fused kernel.
"""
import argparse
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# per family: (gate/up block_n per group, down block_n, rows per m-tile)
TILE_N = {"wgmma_narrow": (64, 128, 64), "wgmma_m64": (128, 256, 64),
          "wgmma": (128, 256, 128)}
FUSED = ("wgmma_narrow", "wgmma_m64")  # both GEMMs in one launch
# bench_env.profile_kernels categories: one per kernel of a call (anything else: "other")
KERNELS = tuple((name, (name,)) for name in (
    "row_list", "expert_fused", "expert_gate_up", "expert_down", "expert_reduce"))


def expected_tiles(family, local_ids, hidden, inter):
    """m-tiles x n-tiles of each GEMM, from the row counts per local expert."""
    import torch

    gate_n, down_n, block_m = TILE_N[family]
    valid = local_ids[local_ids >= 0]
    counts = torch.bincount(valid.flatten().long())
    m_tiles = int(((counts + block_m - 1) // block_m).sum())
    return m_tiles * math.ceil(inter / gate_n), m_tiles * math.ceil(hidden / down_n)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b"])
    p.add_argument("--routings", nargs="+", default=["same", "uniform"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    p.add_argument("--tiles", nargs="+", default=["wgmma_narrow"], choices=sorted(TILE_N))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSONL, one line per kernel and configuration")
    args = p.parse_args(argv)

    import torch

    from vllm_petit_moe.testing.bench_env import device_stamp, profile_kernels, write_jsonl
    from vllm_petit_moe.testing.scripts import load_script

    bench = load_script(os.path.join(ROOT, "examples", "bench_experts.py"))
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    stamp = device_stamp(ROOT, args.world)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    print(f"{'preset':14} {'routing':8} {'tok':>4} {'tiles':16} {'fused':>5} {'kernel':15} "
          f"{'us':>7} {'tiles':>6} {'MB':>6} {'GB/s':>6} {'GB/s/SM':>8}")
    for preset in args.presets:
        w13, w2 = bench.make_weights(preset, args.world, args.seed)
        hidden, inter = bench.PRESETS[preset]["hidden"], bench.PRESETS[preset]["intermediate"]
        for routing in args.routings:
            for tokens in args.tokens:
                recv_x, local_ids, weights = bench.make_routing(
                    preset, routing, tokens, args.world, 0.6, args.seed + tokens)
                experts = int(torch.unique(local_ids[local_ids >= 0]).numel())
                gemm_bytes = {"expert_gate_up": experts * 2 * inter * hidden * 2,
                              "expert_down": experts * hidden * inter * 2}
                gemm_bytes["expert_fused"] = sum(gemm_bytes.values())
                for family in args.tiles:
                    gate_tiles, down_tiles = expected_tiles(family, local_ids, hidden, inter)
                    tiles = {"expert_gate_up": gate_tiles, "expert_down": down_tiles,
                             "expert_fused": gate_tiles + down_tiles}
                    fused = int(family in FUSED)
                    call = bench.petit_fn(recv_x, local_ids, weights, w13, w2, family)
                    for _ in range(3):
                        call()
                    times = profile_kernels(lambda: (flush.zero_(), call()), args.calls,
                                            KERNELS)
                    for name, us in times.items():
                        if name in ("other", "kernels_total"):  # the flush, the sum
                            continue
                        mb = gemm_bytes.get(name, 0) / 1e6
                        busy = min(tiles.get(name, 0), num_sms)
                        gbps = mb * 1e3 / us if mb else 0.0
                        row = dict(**stamp, preset=preset, routing=routing, tokens=tokens,
                                   tiles=family, fused=fused, kernel=name, us=round(us, 2),
                                   gemm_tiles=tiles.get(name), weight_mb=round(mb, 2),
                                   weight_gbps=round(gbps, 1),
                                   gbps_per_busy_sm=round(gbps / busy, 1) if busy else None,
                                   experts=experts)
                        rows.append(row)
                        print(f"{preset:14} {routing:8} {tokens:4d} {family:16} {fused:5d} "
                              f"{name:15} {us:7.1f} {tiles.get(name, 0):6d} {mb:6.1f} "
                              f"{gbps:6.0f} {gbps / busy if busy else 0:8.1f}")
    if args.out:
        write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
