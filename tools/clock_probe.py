#!/usr/bin/env python3
"""SM clock and board power while the expert GEMMs run, against cuBLAS on equal groups of the
same size (examples/bench_experts.py's dense baseline), each for a few seconds back to back on
one GPU, sampled by `nvidia-smi -lms`. A GEMM that draws more power per FLOP (more traffic to
L2 and HBM) runs at lower clocks under the board's power limit, which a kernel-cycle count
under Nsight Compute (base clock) does not show.

    python3 tools/clock_probe.py --preset deepseek-v3 --tokens 8192 --tiles wgmma_ws_mc
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v3")
    p.add_argument("--routing", default="uniform")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--tiles", default="auto")
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()

    import torch

    import bench_experts as be

    preset = be.PRESETS[args.preset]
    w13, w2 = be.make_weights(args.preset, 2, 0)
    recv_x, local_ids, weights = be.make_routing(args.preset, args.routing, args.tokens, 2, 0.6, 1)
    petit = be.petit_fn(recv_x, local_ids, weights, w13, w2, args.tiles)
    valid = local_ids >= 0
    pairs = int(valid.sum())
    touched = int(torch.unique(local_ids[valid]).numel())
    rows = -(-pairs // touched)
    hidden, inter = preset["hidden"], preset["intermediate"]
    a1 = torch.randn(touched, rows, hidden, dtype=torch.bfloat16, device="cuda")
    a2 = torch.randn(touched, rows, inter, dtype=torch.bfloat16, device="cuda")
    w13_t, w2_t = w13[:touched].transpose(1, 2), w2[:touched].transpose(1, 2)

    def dense():
        torch.bmm(a1, w13_t)
        torch.bmm(a2, w2_t)

    sampler = subprocess.Popen(
        ["nvidia-smi", "-i", str(torch.cuda.current_device()),
         "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    phases = {}
    for name, fn, flops in (("petit", petit, 2 * 3 * hidden * inter * pairs),
                            ("cublas", dense, 2 * 3 * hidden * inter * rows * touched),
                            ("petit again", petit, 2 * 3 * hidden * inter * pairs)):
        start, end, calls = run_for(fn, args.seconds)
        phases[name] = (start, end, calls * flops / (end - start) / 1e12)
        time.sleep(0.5)
    sampler.terminate()
    samples = []
    for line in sampler.communicate()[0].splitlines():
        try:
            stamp, clock, power = (f.strip() for f in line.split(","))
            t = time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S"))
            t += float("0." + stamp.split(".")[1]) if "." in stamp else 0.0
            samples.append((t, float(clock), float(power)))
        except ValueError:
            continue
    print(f"{args.preset} {args.routing} {args.tokens} tokens/rank, petit tiles {args.tiles}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'phase':12s} {'TFLOPS':>7s} {'SM MHz (median)':>16s} {'W (median)':>11s} samples")
    for name, (start, end, tflops) in phases.items():
        # the middle of the phase (past the first half second: clocks settle)
        inside = [(c, w) for t, c, w in samples if start + 0.5 <= t <= end]
        if inside:
            print(f"{name:12s} {tflops:7.1f} {statistics.median(c for c, _ in inside):16.0f} "
                  f"{statistics.median(w for _, w in inside):11.1f} {len(inside)}")
        else:
            print(f"{name:12s} {tflops:7.1f} {'-':>16s} {'-':>11s} 0")


if __name__ == "__main__":
    main()
