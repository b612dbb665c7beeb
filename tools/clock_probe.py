#!/usr/bin/env python3
"""SM clock and board power while the expert GEMMs run, against cuBLAS on equal groups of the
same size (examples/bench_experts.py's dense baseline), each for a few seconds back to back on
one GPU, sampled by `nvidia-smi -lms`. A GEMM that draws more power per FLOP (more traffic to
L2 and HBM) runs at lower clocks under the board's power limit, which a kernel-cycle count
under Nsight Compute (base clock) does not show.

    python3 tools/clock_probe.py --preset deepseek-v3 --tokens 8192 --tiles wgmma_mc
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_for(fn, seconds):
    """Calls fn until `seconds` have passed; returns (start, end, calls) in time.time()."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, calls = time.time(), 0
    while time.time() - start < seconds:
        for _ in range(5):
            fn()
        calls += 5
        torch.cuda.synchronize()
    return start, time.time(), calls


def parse_samples(text: str) -> list[tuple[float, float, float]]:
    """(time.time() seconds, SM MHz, W) of each `nvidia-smi --query-gpu=timestamp,clocks.sm,
    power.draw --format=csv,noheader,nounits` line (local-time stamps such as
    "2026/12/01 02:59:01.250"); lines that do not parse (a "[N/A]" reading) are skipped."""
    samples = []
    for line in text.splitlines():
        try:
            stamp, clock, power = (f.strip() for f in line.split(","))
            t = time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S"))
            t += float("0." + stamp.split(".")[1]) if "." in stamp else 0.0
            samples.append((t, float(clock), float(power)))
        except ValueError:
            continue
    return samples


def phase_medians(samples, start: float, end: float, settle: float = 0.5):
    """(median SM MHz, median W, sample count) of the samples in [start + settle, end] (the
    clocks settle in the phase's first half second), or None when there are none."""
    inside = [(c, w) for t, c, w in samples if start + settle <= t <= end]
    if not inside:
        return None
    return (statistics.median(c for c, _ in inside), statistics.median(w for _, w in inside),
            len(inside))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--routing", default="uniform")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--tiles", default="auto")
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()

    import torch

    from vllm_petit_moe.testing.scripts import load_script

    be = load_script(os.path.join(ROOT, "examples", "bench_experts.py"))

    preset = be.PRESETS[args.preset]
    w13, w2 = be.make_weights(args.preset, 2, 0)
    recv_x, local_ids, weights = be.make_routing(args.preset, args.routing, args.tokens, 2, 0.6, 1)
    petit = be.petit_fn(recv_x, local_ids, weights, w13, w2, args.tiles)
    pairs = int((local_ids >= 0).sum())
    petit_flops = 2 * 3 * preset["hidden"] * preset["intermediate"] * pairs
    dense, dense_flops = be.dense_fn(local_ids, w13, w2)

    sampler = subprocess.Popen(
        ["nvidia-smi", "-i", str(torch.cuda.current_device()),
         "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    phases = {}
    for name, fn, flops in (("petit", petit, petit_flops), ("cublas", dense, dense_flops),
                            ("petit again", petit, petit_flops)):
        start, end, calls = run_for(fn, args.seconds)
        phases[name] = (start, end, calls * flops / (end - start) / 1e12)
        time.sleep(0.5)
    sampler.terminate()
    samples = parse_samples(sampler.communicate()[0])
    print(f"{args.preset} {args.routing} {args.tokens} tokens/rank, petit tiles {args.tiles}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'phase':12s} {'TFLOPS':>7s} {'SM MHz (median)':>16s} {'W (median)':>11s} samples")
    for name, (start, end, tflops) in phases.items():
        medians = phase_medians(samples, start, end)
        if medians:
            print(f"{name:12s} {tflops:7.1f} {medians[0]:16.0f} {medians[1]:11.1f} {medians[2]}")
        else:
            print(f"{name:12s} {tflops:7.1f} {'-':>16s} {'-':>11s} 0")

if __name__ == "__main__":
    main()
