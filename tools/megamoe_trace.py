#!/usr/bin/env python3
"""Where one fused MoE layer call (ops.megamoe_forward, W=1) spends its time, from the
kernel's own timer stamps (the optional `trace` argument; layout in csrc/common/layout.h): per
block its entry, end of routing, exit, and per task the moment its inputs were ready (after the
control warp's wait) and the moment its stores were issued.

Prints, for one preset at a few token counts (uniform routing over the global experts, the
preset's local share; fresh random weights; 3 untraced calls first):
- the span of the call (first block entry -> last block exit) and the routing time, split
  into its steps (medians over blocks): the rows' ids read (EP: after every rank's rows
  arrived), the experts' counts and offsets, the first weight loads issued, the sort;
- per task kind (gate/up, down, reduction): count, first ready / last done, median duration;
- the wait before each task (previous task done -> this one ready: claims, the control warp's
  input wait) per kind;
- per expert, the gate/up -> down hand-off: its first down task ready minus its last gate/up
  task done;
- the blocks' time split: routing, working, waiting, tail (last task -> exit);
- with --dtype fp8, warp 0's ring steps per task kind: the wait for a task's first step's
  weights and for its later steps', and a step's own work (weights in -> next step's wait),
  the first step's apart (it also waits for the task's first input and scale loads).

    python tools/megamoe_trace.py --preset deepseek-v3 --tokens 1 8 64 [--out DIR]

Under torchrun with several ranks (one GPU each) it traces the fused layer across the EP group
instead (EpBuffer.megamoe: the preset's experts split over the ranks, the tokens per rank;
rows of kind "final" are the sums of each rank's own tokens), printing rank 0's summary and
writing every rank's file (megamoe_trace_<preset>_<tokens>_W<W>r<rank>.json):

    torchrun --nproc-per-node 2 tools/megamoe_trace.py --preset qwen3-30b-a3b --tokens 1 8

A GPU tool (sm_90a, the extension built); writes megamoe_trace_<preset>_<tokens>.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from vllm_petit_moe import ops
from vllm_petit_moe.limits import (MEGAMOE_BLOCKS_PER_SM, MEGAMOE_TRACE_HEADER,
                                   MEGAMOE_TRACE_SLOTS, MEGAMOE_TRACE_STEPS,
                                   MEGAMOE_TRACE_TASKS)
from vllm_petit_moe.testing.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
# the one-GPU layer benchmark's (the top-k picks from num_experts ids)
PRESETS = load_script(ROOT / "examples" / "moe_layer_w1.py").W1_PRESETS
KINDS = ("gate/up", "down", "reduce", "final")  # final: EP calls only


def traced_call(preset: str, tokens: int, seed: int = 0,
                dtype: str = "bf16") -> tuple[list[dict], float]:
    """The one-GPU layer, bf16 weights or (dtype "fp8") their block-fp8 quantization."""
    shape = PRESETS[preset]
    hidden, inter, top_k = shape.hidden, shape.intermediate, shape.top_k
    local, pick = shape.num_local, shape.num_experts
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(local, 2 * inter, hidden, generator=g, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(local, hidden, inter, generator=g, device="cuda") * 0.02).bfloat16()
    scales = {}
    if dtype == "fp8":
        from vllm_petit_moe.testing.reference import block_fp8_quantize
        w13, s13, _ = block_fp8_quantize(w13)
        w2, s2, _ = block_fp8_quantize(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.full((MEGAMOE_BLOCKS_PER_SM * sms, MEGAMOE_TRACE_SLOTS), -1,
                       dtype=torch.int64, device="cuda")
    for i in range(4):
        x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(pick, generator=g, device="cuda")[:top_k]
                           for _ in range(tokens)]).int()
        ids[0, 0] = 0  # at least one local expert (ids >= local are other ranks')
        w = torch.rand(tokens, top_k, generator=g, device="cuda")
        ops.megamoe_forward(x, ids, w, w13, w2, trace=trace if i == 3 else None, **scales)
    torch.cuda.synchronize()
    blocks = blocks_from_trace(trace.cpu().tolist())
    return blocks, float(min(b["entry"] for b in blocks))


def traced_ep_call(buf, preset: str, tokens: int, seed: int = 0) -> tuple[list[dict], float]:
    """The fused layer across the EP group of `buf` (every rank calls it): this rank's blocks
    and the earliest entry stamp of every rank (the ranks' timers are the GPUs' globaltimer,
    comparable within a node)."""
    import torch.distributed as dist
    shape = PRESETS[preset]
    hidden, inter, top_k = shape.hidden, shape.intermediate, shape.top_k
    num_experts = shape.num_experts
    local = num_experts // buf.world_size
    g = torch.Generator(device="cuda").manual_seed(seed + buf.rank)
    w13 = (torch.randn(local, 2 * inter, hidden, generator=g, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(local, hidden, inter, generator=g, device="cuda") * 0.02).bfloat16()
    trace = buf.new_megamoe_trace()
    for i in range(4):
        x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
        ids = torch.stack([torch.randperm(num_experts, generator=g, device="cuda")[:top_k]
                           for _ in range(tokens)]).int()
        w = torch.rand(tokens, top_k, generator=g, device="cuda")
        buf.megamoe(x, ids, w, w13, w2, region_stride=tokens, trace=trace if i == 3 else None)
    torch.cuda.synchronize()
    blocks = blocks_from_trace(trace.cpu().tolist())
    entries = [None] * buf.world_size
    dist.all_gather_object(entries, min(b["entry"] for b in blocks), group=buf.group)
    return blocks, float(min(entries))


def task_fields(record: int) -> tuple[int, int, int, int]:
    """A task record of the trace (megamoe.cu): (kind index into KINDS, local expert, row
    group, tile); expert and group are 0 for reductions and final sums."""
    return record >> 48, (record >> 32) & 0xFFFF, (record >> 16) & 0xFFFF, record & 0xFFFF


def blocks_from_trace(rows: list[list[int]]) -> list[dict]:
    """The trace tensor's rows (one per block, layout.h) as dicts; unused rows skipped."""
    blocks = []
    for row in rows:
        if row[0] < 0:  # a block the grid did not have
            continue
        tasks = []
        for i in range(min(row[3], MEGAMOE_TRACE_TASKS)):
            first = MEGAMOE_TRACE_HEADER + 3 * i
            task, ready, done = row[first:first + 3]
            kind, expert, group, tile = task_fields(task)
            tasks.append({"kind": KINDS[kind], "expert": expert, "group": group, "tile": tile,
                          "ready": ready, "done": done})
        # warp 0's e4m3 ring steps (W = 1 fp8 only): (wait begun, weights in); -1 unused
        first = MEGAMOE_TRACE_HEADER + 3 * MEGAMOE_TRACE_TASKS
        steps = [(row[first + 2 * i], row[first + 2 * i + 1]) for i in range(MEGAMOE_TRACE_STEPS)
                 if row[first + 2 * i] >= 0]
        blocks.append({"entry": row[0], "routed": row[1], "exit": row[2], "count": row[3],
                       "ids": row[4], "counted": row[5], "issued": row[6], "tasks": tasks,
                       "steps": steps})
    return blocks


def summarize(blocks: list[dict], t0: float) -> dict:
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    med = lambda v: statistics.median(v) if v else 0.0  # noqa: E731
    out = {"blocks": len(blocks), "span_us": us(max(b["exit"] for b in blocks)),
           "routing_us_median": med([(b["routed"] - b["entry"]) / 1e3 for b in blocks]),
           # the routing's steps, each from the previous stamp
           "routing_steps_us_median": {
               step: med([(b[end] - b[begin]) / 1e3 for b in blocks])
               for step, begin, end in (("ids", "entry", "ids"), ("counts", "ids", "counted"),
                                        ("first_loads", "counted", "issued"),
                                        ("sort", "issued", "routed"))},
           "truncated_blocks": sum(b["count"] > len(b["tasks"]) for b in blocks)}
    split = {"routing": 0.0, "working": 0.0, "waiting": 0.0, "tail": 0.0}
    per_kind = {k: {"count": 0, "durations": [], "waits": [], "first_ready": None,
                    "last_done": None} for k in KINDS}
    gate_up_done, down_ready = {}, {}
    for b in blocks:
        split["routing"] += (b["routed"] - b["entry"]) / 1e3
        last = b["routed"]
        for t in b["tasks"]:
            k = per_kind[t["kind"]]
            k["count"] += 1
            k["durations"].append((t["done"] - t["ready"]) / 1e3)
            k["waits"].append((t["ready"] - last) / 1e3)
            split["working"] += (t["done"] - t["ready"]) / 1e3
            split["waiting"] += (t["ready"] - last) / 1e3
            k["first_ready"] = min(k["first_ready"] or t["ready"], t["ready"])
            k["last_done"] = max(k["last_done"] or t["done"], t["done"])
            if t["kind"] == "gate/up":
                gate_up_done[t["expert"]] = max(gate_up_done.get(t["expert"], 0), t["done"])
            elif t["kind"] == "down":
                down_ready[t["expert"]] = min(down_ready.get(t["expert"], t["ready"]), t["ready"])
            last = t["done"]
        split["tail"] += (b["exit"] - last) / 1e3
    out["block_time_us"] = split
    out["kinds"] = {k: {"count": v["count"],
                        "first_ready_us": us(v["first_ready"]) if v["count"] else None,
                        "last_done_us": us(v["last_done"]) if v["count"] else None,
                        "duration_us_median": med(v["durations"]),
                        "wait_us_median": med(v["waits"]), "wait_us_max": max(v["waits"] or [0])}
                    for k, v in per_kind.items()}
    handoff = [(down_ready[e] - gate_up_done[e]) / 1e3 for e in down_ready if e in gate_up_done]
    out["handoff_us_median"] = med(handoff)
    out["handoff_us_max"] = max(handoff or [0.0])
    out["steps"] = summarize_steps(blocks)
    return out


def summarize_steps(blocks: list[dict]) -> dict:
    """Warp 0's e4m3 ring steps per task kind (W = 1, fp8 weights; empty otherwise), each step
    placed in the task whose ready..done holds its wait's start: the wait for the task's first
    step's weights and for its later steps' (median us), the time from a step's weights in to
    the next step's wait (the step's own work: widening, multiplies, next loads) for the first
    step and for the later ones, and the steps a task's warp 0 took."""
    med = lambda v: round(statistics.median(v), 3) if v else None  # noqa: E731
    per_kind = {}
    for b in blocks:
        for t in b["tasks"]:
            mine = [s for s in b["steps"] if t["ready"] <= s[0] <= t["done"]]
            if not mine:
                continue
            k = per_kind.setdefault(t["kind"], {"first_wait": [], "wait": [], "first_work": [],
                                                "work": [], "steps": []})
            k["steps"].append(len(mine))
            k["first_wait"].append((mine[0][1] - mine[0][0]) / 1e3)
            k["wait"] += [(s[1] - s[0]) / 1e3 for s in mine[1:]]
            work = [(nxt[0] - cur[1]) / 1e3 for cur, nxt in zip(mine, mine[1:])]
            k["first_work"] += work[:1]
            k["work"] += work[1:]
    return {kind: {"tasks": len(k["steps"]), "steps_median": med(k["steps"]),
                   "first_wait_us_median": med(k["first_wait"]),
                   "wait_us_median": med(k["wait"]),
                   "first_work_us_median": med(k["first_work"]),
                   "work_us_median": med(k["work"])}
            for kind, k in per_kind.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="deepseek-v3")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                   help="expert weights (one GPU): bf16 or block fp8 (e4m3, 128 x 128 scales)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.dtype == "fp8" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--dtype fp8: one GPU only")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    buf, rank, tag = None, 0, ""
    if world > 1:  # under torchrun: the fused layer across the EP group
        import torch.distributed as dist

        from vllm_petit_moe.buffer import EpBuffer
        rank = int(os.environ["RANK"])
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("gloo")
        shape = PRESETS[args.preset]
        buf = EpBuffer(dist.group.WORLD, hidden_size=shape.hidden, num_experts=shape.num_experts,
                       max_tokens_per_rank=max(args.tokens))
        tag = f"_W{world}r{rank}"
    for tokens in args.tokens:
        blocks, t0 = (traced_call(args.preset, tokens, dtype=args.dtype) if buf is None
                      else traced_ep_call(buf, args.preset, tokens))
        s = summarize(blocks, t0)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            fp8 = "_fp8" if args.dtype == "fp8" else ""
            path = args.out / f"megamoe_trace_{args.preset}{fp8}_{tokens}{tag}.json"
            path.write_text(json.dumps({"preset": args.preset, "tokens": tokens,
                                        "world": world, "rank": rank,
                                        "summary": s, "blocks": blocks}))
        if rank != 0:
            continue
        where = f" per rank, W={world}, rank 0" if world > 1 else ""
        print(f"=== {args.preset} {args.dtype}, {tokens} tokens{where}: span "
              f"{s['span_us']:.1f} us over "
              f"{s['blocks']} blocks, routing {s['routing_us_median']:.2f} us (median)"
              + (f", {s['truncated_blocks']} blocks' task lists truncated"
                 if s["truncated_blocks"] else ""))
        print("routing steps (median us): " + ", ".join(
            f"{step} {v:.2f}" for step, v in s["routing_steps_us_median"].items()))
        print(f"{'kind':8} {'count':>6} {'first ready':>12} {'last done':>10} {'median us':>10} "
              f"{'wait med':>9} {'wait max':>9}")
        for kind, k in s["kinds"].items():
            if k["count"]:
                print(f"{kind:8} {k['count']:6d} {k['first_ready_us']:12.1f} "
                      f"{k['last_done_us']:10.1f} {k['duration_us_median']:10.2f} "
                      f"{k['wait_us_median']:9.2f} {k['wait_us_max']:9.2f}")
        split = s["block_time_us"]
        total = sum(split.values()) or 1.0
        print("block time: " + ", ".join(f"{name} {100 * v / total:.0f}%"
                                         for name, v in split.items())
              + f"; gate/up -> down hand-off per expert: median {s['handoff_us_median']:.2f} us,"
              f" max {s['handoff_us_max']:.2f} us")
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        for kind, k in s["steps"].items():
            print(f"warp 0's e4m3 steps, {kind}: {k['tasks']} tasks of {fmt(k['steps_median'])}"
                  f" steps; median us: first weights' wait {fmt(k['first_wait_us_median'])}, "
                  f"later steps' wait {fmt(k['wait_us_median'])}; work of the first step "
                  f"{fmt(k['first_work_us_median'])}, of a later step {fmt(k['work_us_median'])}")
    if buf is not None:
        buf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
