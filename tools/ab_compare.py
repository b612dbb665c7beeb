#!/usr/bin/env python3
"""Summarize an A/B sweep of examples/bench_experts.py or examples/bench_dispatch_combine.py
(interleaved repeats of settings A and B, e.g. tools/vllm_gpu_check.sh bench-experts with
EXPERTS_SWEEP="A B A B", tools/gpu_check.sh with BENCH_SWEEP, or tools/ab_trees.sh): per
configuration, the median of each setting over its repeats and the ratio B/A; last, the
geometric mean of the ratios of one metric over the configurations in --tokens (all if
omitted).

    python3 tools/ab_compare.py OUT/ab-old OUT/ab-new [--tokens 1 2 4]
    python3 tools/ab_compare.py OUT/ab-old OUT/ab-new --metric combine_us [--num-sms 24]

A and B are directory prefixes: A matches A, A_r2, A_r3, ... The kind of results is read from
the records: expert results (key preset, routing, tokens, tiles; metrics us and, from
bench_experts --chain, us_chain; the verdict on --metric, default us, over the configurations
that have it), MoE-layer results of bench_moe_layer.py (key preset, dtype, routing, tokens;
metrics vllm_us, composed_us, megamoe_us, the verdict on --metric, default megamoe_us) or
dispatch/combine results (key preset, routing, tokens, num_sms; metrics dispatch_us and
combine_us, the verdict on --metric, default combine_us). Exit status 0 when B is faster
(geometric mean < 1), 1 when it is not, 2 when there is nothing to compare.
"""
import argparse
import glob
import json
import math
import os
import statistics
import sys

KINDS = {  # kind: (key fields, metrics, the verdict's default metric)
    # us_chain: bench_experts --chain (decode sizes only; a configuration without it shows -)
    # tiles: the family asked for (tiles_requested where recorded: "auto" resolves to names
    # that changed between trees)
    "experts": (("preset", "routing", "tokens", "tiles"), ("us", "us_chain"), "us"),
    # dtype: bf16 or fp8 (rows written before fp8 existed have none: bf16)
    "moe_layer": (("preset", "dtype", "routing", "tokens"), ("vllm_us", "composed_us", "megamoe_us"),
                  "megamoe_us"),
    "dispatch_combine": (("preset", "routing", "tokens", "num_sms"),
                         ("dispatch_us", "combine_us"), "combine_us"),
}


def kind_of(record):
    if "tiles" in record:
        return "experts"
    return "moe_layer" if "vllm_us" in record else "dispatch_combine"


def load(prefix):
    """(kind, {key: {metric: [value, ...]}}) over the repeats of one setting."""
    values, kind = {}, None
    dirs = [prefix] + sorted(glob.glob(prefix + "_r[0-9]*"))
    for d in dirs:
        for path in glob.glob(os.path.join(d, "*.jsonl")):
            with open(path) as f:
                for line in f:
                    r = json.loads(line)
                    kind = kind or kind_of(r)
                    fields, metrics, _ = KINDS[kind]
                    key = tuple(r.get("tiles_requested", r[k]) if k == "tiles" else
                                r.get(k, "bf16") if k == "dtype" else r[k] for k in fields)
                    per_key = values.setdefault(key, {})
                    for m in metrics:
                        if r.get(m) is not None:
                            per_key.setdefault(m, []).append(r[m])
    return kind, values


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tokens", type=int, nargs="*", help="configurations in the mean")
    p.add_argument("--num-sms", type=int, nargs="*", help="dispatch/combine: SM counts in the mean")
    p.add_argument("--metric",
                   help="the verdict's metric (us or us_chain; vllm_us, composed_us or "
                        "megamoe_us; dispatch_us or combine_us)")
    args = p.parse_args(argv)
    (kind_a, a), (kind_b, b) = load(args.a), load(args.b)
    keys = sorted(set(a) & set(b))
    if not keys or kind_a != kind_b:
        print(f"nothing to compare: {args.a} and {args.b} share no configuration")
        return 2
    fields, metrics, default_metric = KINDS[kind_a]
    metric = args.metric or default_metric
    if metric not in metrics:
        print(f"--metric {metric}: these results have {', '.join(metrics)}")
        return 2
    name_a, name_b = os.path.basename(args.a), os.path.basename(args.b)
    print(" ".join(f"{f:>14s}" for f in fields) + "".join(
        f" {m + ' A':>14s} {m + ' B':>14s} {'B/A':>6s}" for m in metrics) +
        f"   A={name_a} B={name_b}")
    logs = []
    for key in keys:
        row = " ".join(f"{str(v):>14s}" for v in key)
        for m in metrics:
            if m not in a[key] or m not in b[key]:
                row += f" {'-':>14s} {'-':>14s} {'-':>6s}"
                continue
            ta, tb = statistics.median(a[key][m]), statistics.median(b[key][m])
            ratio = tb / ta
            row += f" {ta:14.1f} {tb:14.1f} {ratio:6.3f}"
            in_mean = (not args.tokens or key[fields.index("tokens")] in args.tokens) and (
                kind_a != "dispatch_combine" or not args.num_sms or key[3] in args.num_sms)
            if m == metric and in_mean:
                logs.append(math.log(ratio))
        print(row)
    if not logs:
        print("no configuration with those tokens")
        return 2
    mean = math.exp(sum(logs) / len(logs))
    print(f"geometric mean B/A of {metric} over {len(logs)} configurations: {mean:.3f} "
          f"({'B faster' if mean < 1 else 'B not faster'})")
    return 0 if mean < 1 else 1


if __name__ == "__main__":
    sys.exit(main())
