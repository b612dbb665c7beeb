#!/usr/bin/env python3
"""Where the first microseconds of an expert call go, block by block: the start-up probe of
the warp-specialized expert kernels (csrc/common/probe.h) on examples/bench_experts.py's rows and
weights, with the L2 flushed before every call. Each block records the %globaltimer at marked
points (kernel entry, after griddepcontrol.wait, tile scheduler built, first tile claimed,
first weight boxes issued, first stage full, first tile multiplied and stored, the fused
kernel's first down tile claimed / ready / full / multiplied, last store, exit); the tool
prints, per point, the earliest, median and latest block in microseconds after the earliest
block's entry (medians over the calls).

    PETIT_MOE_PROBE=1 pip install --no-build-isolation -e .   # a diagnostics build
    python3 tools/expert_startup_probe.py --presets qwen3-30b-a3b --routings same uniform \
        --tokens 1 4 --tiles wgmma_narrow --out probe.jsonl

Needs a GPU and an extension built with PETIT_MOE_PROBE=1 (the serving build has no probe and
the tool says so). The kernels are launched with programmatic dependent launch (always, on
sm_90): a kernel's blocks may enter while the previous kernel still runs, and "entry" says
when they did. With the two GEMM launches (wgmma, wgmma_mc) both kernels write the same slots:
the "first" points are then the gate/up kernel's and "last stored" / "exit" the down
kernel's.
"""
import argparse
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# csrc/common/probe.h's ProbeSlot, in order: (name, kind) with kind "time" or "count"
POINTS = (
    ("entry", "time"), ("waited", "time"), ("scheduled", "time"), ("first claim", "time"),
    ("first weights issued", "time"), ("first stage full", "time"),
    ("first tile multiplied", "time"), ("first tile stored", "time"),
    ("down claimed", "time"), ("down ready", "time"), ("down stage full", "time"),
    ("down multiplied", "time"), ("last stored", "time"), ("exit", "time"),
    ("tiles", "count"), ("k-tiles", "count"),
)


def summarize(probe):
    """One call's probe ([blocks, slots] int64 ns, 0 = not reached) -> {point: (earliest,
    median, latest, blocks)} in us after the earliest entry (counts: per block, not us)."""
    entries = [int(v) for v in probe[:, 0].tolist() if v]
    if not entries:
        return None
    t0 = min(entries)
    out = {}
    for slot, (name, kind) in enumerate(POINTS):
        values = [int(v) for v in probe[:, slot].tolist() if v]
        if not values:
            continue
        if kind == "time":
            values = [(v - t0) / 1e3 for v in values]
        out[name] = (min(values), statistics.median(values), max(values), len(values))
    return out


def median_summary(summaries):
    """Point-wise medians of several calls' summaries (points every call reached)."""
    names = [n for n, _ in POINTS if all(n in s for s in summaries)]
    return {n: tuple(statistics.median(s[n][i] for s in summaries) for i in range(4))
            for n in names}


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Needs a GPU and the extension built with PETIT_MOE_PROBE=1 in the environment.")
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b"])
    p.add_argument("--routings", nargs="+", default=["same", "uniform"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4])
    p.add_argument("--tiles", nargs="+", default=["wgmma_narrow"])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSONL, one line per point and configuration")
    args = p.parse_args(argv)

    import torch

    from vllm_petit_moe import _C
    from vllm_petit_moe.testing.bench_env import device_stamp, write_jsonl
    from vllm_petit_moe.testing.scripts import load_script

    bench = load_script(os.path.join(ROOT, "examples", "bench_experts.py"))

    _C.expert_probe_read()  # raises in a build without the probe; clears it otherwise
    stamp = device_stamp(ROOT, args.world)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for preset in args.presets:
        w13, w2 = bench.make_weights(preset, args.world, args.seed)
        for routing in args.routings:
            for tokens in args.tokens:
                recv_x, local_ids, weights = bench.make_routing(
                    preset, routing, tokens, args.world, 0.6, args.seed + tokens)
                experts = int(torch.unique(local_ids[local_ids >= 0]).numel())
                for family in args.tiles:
                    fused = int(family in ("wgmma_narrow", "wgmma_m64", "auto"))
                    call = bench.petit_fn(recv_x, local_ids, weights, w13, w2, family)
                    for _ in range(3):
                        call()
                    _C.expert_probe_read()
                    summaries = []
                    for _ in range(args.calls):
                        flush.zero_()
                        call()
                        s = summarize(_C.expert_probe_read())
                        if s is not None:
                            summaries.append(s)
                    if not summaries:
                        print(f"{preset} {routing} {tokens} {family} fused={fused}: no "
                              "probed kernel ran (not a warp-specialized family?)")
                        continue
                    med = median_summary(summaries)
                    print(f"\n{preset} {routing} tokens/rank={tokens} {family} fused={fused} "
                          f"experts={experts} calls={len(summaries)} (us after the first "
                          "entry; medians over the calls)")
                    print(f"  {'point':24} {'earliest':>9} {'median':>9} {'latest':>9} "
                          f"{'blocks':>7}")
                    for name, kind in POINTS:
                        if name not in med:
                            continue
                        lo, mid, hi, n = med[name]
                        print(f"  {name:24} {lo:9.2f} {mid:9.2f} {hi:9.2f} {n:7.0f}")
                        rows.append(dict(**stamp, preset=preset, routing=routing,
                                         tokens=tokens, tiles=family, fused=fused,
                                         experts=experts, point=name, kind=kind,
                                         earliest=round(lo, 3), median=round(mid, 3),
                                         latest=round(hi, 3), blocks=n,
                                         calls=len(summaries)))
    if args.out:
        write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
