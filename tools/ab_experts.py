#!/usr/bin/env python3
"""Summarize an A/B sweep of examples/bench_experts.py (tools/vllm_gpu_check.sh bench-experts
with EXPERTS_SWEEP="A B A B ..."): per configuration (preset, routing, tokens, tile family),
the median time of each setting over its repeats and the ratio B/A; last, the geometric mean
of the ratios over the configurations in --tokens (all if omitted).

    python3 tools/ab_experts.py OUT/experts-PETIT_MOE_SPLIT_K_1 OUT/experts-PETIT_MOE_SPLIT_K_4 \
        [--tokens 1 2 4]

A and B are directory prefixes: A matches A, A_r2, A_r3, ... Exit status 0 when B is faster
(geometric mean < 1), 1 when it is not, 2 when there is nothing to compare.
"""
import argparse
import glob
import json
import math
import os
import statistics
import sys


def load(prefix):
    """{(preset, routing, tokens, tiles): [us, ...]} over the repeats of one setting."""
    times = {}
    dirs = [prefix] + sorted(glob.glob(prefix + "_r[0-9]*"))
    for d in dirs:
        for path in glob.glob(os.path.join(d, "*.jsonl")):
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    key = (r["preset"], r["routing"], r["tokens"], r["tiles"])
                    times.setdefault(key, []).append(r["us"])
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tokens", type=int, nargs="*", help="configurations in the mean")
    args = p.parse_args(argv)
    a, b = load(args.a), load(args.b)
    keys = sorted(set(a) & set(b))
    if not keys:
        print(f"nothing to compare: {args.a} and {args.b} share no configuration")
        return 2
    name_a, name_b = os.path.basename(args.a), os.path.basename(args.b)
    print(f"{'preset':14s} {'routing':8s} {'tokens':>6s} {'tiles':16s} "
          f"{'A us':>9s} {'B us':>9s} {'B/A':>6s}   A={name_a} B={name_b}")
    logs = []
    for key in keys:
        ta, tb = statistics.median(a[key]), statistics.median(b[key])
        ratio = tb / ta
        if not args.tokens or key[2] in args.tokens:
            logs.append(math.log(ratio))
        print(f"{key[0]:14s} {key[1]:8s} {key[2]:6d} {key[3]:16s} {ta:9.1f} {tb:9.1f} {ratio:6.3f}")
    if not logs:
        print("no configuration with those tokens")
        return 2
    mean = math.exp(sum(logs) / len(logs))
    print(f"geometric mean B/A over {len(logs)} configurations: {mean:.3f} "
          f"({'B faster' if mean < 1 else 'B not faster'})")
    return 0 if mean < 1 else 1


if __name__ == "__main__":
    sys.exit(main())
