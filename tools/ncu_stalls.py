#!/usr/bin/env python3
"""Where the warps of a kernel wait, from an Nsight Compute report's per-instruction (SASS)
counters: `ncu --import REP --page source --csv --print-source sass` piped in (or a file).

Prints, per kernel in the export, the instructions with the most warp-stall samples, with
their share of the kernel's samples and the stall reasons that make up each (the report's
per-reason sample columns), so that a pipeline's waits (mbarrier try_wait loops, wgmma waits,
epilogue stores) can be told apart from its work. Needs a report taken with the SourceCounters
section (ncu --set full)."""
from __future__ import annotations

import argparse
import csv
import io
import sys


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(lines: list[str], top: int) -> None:
    # The export holds one CSV table per kernel, each after a line naming the kernel.
    blocks: list[tuple[str, list[str]]] = []
    title = "kernel"
    current: list[str] = []
    for line in lines:
        if line.startswith('"Kernel Name"') or line.startswith("Kernel Name"):
            if current:
                blocks.append((title, current))
                current = []
            title = line.strip()
        elif line.startswith('"Address"') or line.startswith("Address"):
            if current:
                blocks.append((title, current))
            current = [line]
        elif current and (line.startswith('"') or line[:1].isdigit()):
            current.append(line)
        else:
            if current:
                blocks.append((title, current))
                current = []
            if line.strip():
                title = line.strip()
    if current:
        blocks.append((title, current))
    if not blocks:
        print("no source table found (take the report with --set full)")
        return
    printed = set()
    for title, rows in blocks:
        if (title, len(rows), rows[-1]) in printed:  # the same kernel's table again
            continue
        printed.add((title, len(rows), rows[-1]))
        table = list(csv.reader(io.StringIO("".join(rows))))
        header, body = table[0], table[1:]
        try:
            all_col = next(i for i, h in enumerate(header)
                           if h.startswith("Warp Stall Sampling (All"))
        except StopIteration:
            print(f"{title}: no warp stall sampling column; columns: {header}")
            continue
        src_col = next((i for i, h in enumerate(header) if h == "Source"), 1)
        reason_cols = [i for i, h in enumerate(header)
                       if i != all_col and ("stall" in h.lower() or h.startswith("smsp__pcsamp"))
                       and "Not-issued" not in h and "Not Issued" not in h]  # subsets
        total = sum(_num(r[all_col]) for r in body if len(r) > all_col) or 1.0
        print(f"== {title[:160]}")
        print(f"   {int(total)} warp stall samples; top {top} instructions:")
        ranked = sorted((r for r in body if len(r) > all_col), key=lambda r: -_num(r[all_col]))
        for r in ranked[:top]:
            reasons = sorted(((_num(r[i]), header[i]) for i in reason_cols if _num(r[i]) > 0),
                             reverse=True)[:4]
            why = ", ".join(f"{name.replace('Warp Stall Sampling ', '')} {v / total:.1%}"
                            for v, name in reasons)
            print(f"   {_num(r[all_col]) / total:6.1%}  {r[src_col][:70]:70s} {why}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="?", help="the export (default: stdin)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    text = open(args.csv).read() if args.csv else sys.stdin.read()
    summarize(text.splitlines(keepends=True), args.top)


if __name__ == "__main__":
    main()
