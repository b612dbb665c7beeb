"""The combine kernel's optional per-block timeline (`EpBuffer.combine(..., trace=...)`).

Each block of a traced combine writes one row of ``buffer.COMBINE_TRACE_SLOTS`` (the order
of ``CombineTraceSlot`` in csrc/api.h): timer ticks (``kTimerTicksPerSecond`` of the extension;
nanoseconds on CUDA) when the block starts, when its first send item starts copying, after its
last send item's flags, when the flags of its first reduce item have all been seen, after its
last reduction and at its end, then how many send and reduce items it did, then the ticks its
thread 0 spent over all its reduce items waiting (from claiming an item to seeing its flags)
and reducing. A phase the block had no part in holds 0; rows of blocks the kernel did not
launch keep what the tensor held (-1 from `EpBuffer.new_combine_trace`). The timer is the
GPU's global timer, so the stamps of one rank's blocks are comparable with each other (1 us
resolution on some GPUs), not with another GPU's.

`summarize_combine_trace` turns one rank's trace into microseconds after the earliest block
start: where the call's time goes (start spread, the senders' copies, the last flags, the
reductions after the transfer, and how the reducing blocks split their time between waiting
for rows and reducing them).
"""
from __future__ import annotations

import statistics
from typing import Sequence

import torch

from vllm_petit_moe.buffer import COMBINE_TRACE_SLOTS

_TIME_SLOTS = COMBINE_TRACE_SLOTS[:6]


def _spread(values: Sequence[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "min": min(values), "median": statistics.median(values),
            "max": max(values)}


def summarize_combine_trace(trace, ticks_per_second: float = 1e9) -> dict:
    """One rank's combine timeline in microseconds after the earliest block start.

    Args:
        trace: [blocks, slots] int64 (tensor or nested lists) as the kernel wrote it; rows
            whose start is negative (never launched) are skipped.
        ticks_per_second: the timer's rate (the extension's kTimerTicksPerSecond).
    Returns a dict: ``blocks``, ``send_items``, ``reduce_items`` (totals); ``kernel_us`` (last
    end - first start); per phase the spread over the blocks that had it (``start``,
    ``first_send``, ``sends_done`` over senders; ``first_reduce_ready``, ``last_reduce_done``
    over reducers; ``end`` over all), each {n, min, median, max}; ``tail_us``: the last
    reduction's end after the last of this rank's send flags (the reductions left once this
    rank's transfer is out); ``reduce_only`` and ``senders_reducing``: for the blocks that
    only reduce and for the senders that also reduced, {blocks, items, wait_us, work_us}
    (thread 0's time, summed over their items, waiting for an item's rows and reducing it).
    """
    rows = trace.tolist() if isinstance(trace, torch.Tensor) else [list(r) for r in trace]
    if any(len(r) != len(COMBINE_TRACE_SLOTS) for r in rows):
        raise ValueError(f"petit_moe: trace rows must have {len(COMBINE_TRACE_SLOTS)} slots")
    rows = [dict(zip(COMBINE_TRACE_SLOTS, r)) for r in rows if r[0] >= 0]
    if not rows:
        raise ValueError("petit_moe: the trace holds no launched block (every start < 0)")
    t0 = min(r["start"] for r in rows)
    us = 1e6 / ticks_per_second

    def phase(slot: str, blocks: list) -> dict:
        return _spread([(r[slot] - t0) * us for r in blocks if r[slot] > 0])

    senders = [r for r in rows if r["send_items"] > 0]
    reducers = [r for r in rows if r["reduce_items"] > 0]
    out = {
        "blocks": len(rows),
        "senders": len(senders),
        "reducers": len(reducers),
        "send_items": sum(r["send_items"] for r in rows),
        "reduce_items": sum(r["reduce_items"] for r in rows),
        "kernel_us": (max(r["end"] for r in rows) - t0) * us,
    }
    for slot in _TIME_SLOTS:
        out[slot] = phase(slot, senders if slot in ("first_send", "sends_done")
                          else reducers if slot in ("first_reduce_ready", "last_reduce_done")
                          else rows)
    for name, blocks in (("reduce_only", [r for r in reducers if r["send_items"] == 0]),
                         ("senders_reducing", [r for r in reducers if r["send_items"] > 0])):
        out[name] = {"blocks": len(blocks), "items": sum(r["reduce_items"] for r in blocks),
                     "wait_us": sum(r["reduce_wait"] for r in blocks) * us,
                     "work_us": sum(r["reduce_work"] for r in blocks) * us}
    if senders and reducers:
        out["tail_us"] = (max(r["last_reduce_done"] for r in reducers)
                          - max(r["sends_done"] for r in senders)) * us
    return out


def format_combine_trace(summary: dict) -> str:
    """A few lines of `summarize_combine_trace`'s result for a printed table."""
    def fmt(p: dict) -> str:
        if not p.get("n"):
            return "-"
        return f"{p['min']:.1f} / {p['median']:.1f} / {p['max']:.1f} (n={p['n']})"
    lines = [f"kernel {summary['kernel_us']:.1f} us, {summary['blocks']} blocks "
             f"({summary['senders']} sent {summary['send_items']} items, "
             f"{summary['reducers']} reduced {summary['reduce_items']})"]
    lines += [f"  {slot:<18} min / median / max us: {fmt(summary[slot])}"
              for slot in _TIME_SLOTS]
    for name, label in (("reduce_only", "reduce-only blocks"),
                        ("senders_reducing", "senders reducing")):
        part = summary.get(name, {})
        if part.get("items"):
            lines.append(f"  {label + ':':<19} {part['blocks']} did {part['items']} items; per "
                         f"item {part['wait_us'] / part['items']:.1f} us waiting, "
                         f"{part['work_us'] / part['items']:.1f} us reducing")
    if "tail_us" in summary:
        lines.append(f"  last reduction after the last send flag: {summary['tail_us']:.1f} us")
    return "\n".join(lines)
