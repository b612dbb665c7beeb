"""The combine timeline's host side (buffer.COMBINE_TRACE_SLOTS, buffer.check_combine_trace,
vllm_petit_moe.testing.combine_trace): slot order against csrc/api.h and the extension, the
trace tensor's checks and the summary's arithmetic, on hand-made traces."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from vllm_petit_moe.buffer import COMBINE_TRACE_SLOTS, check_combine_trace
from vllm_petit_moe.testing.combine_trace import format_combine_trace, summarize_combine_trace


def test_slots_match_the_extension():
    if importlib.util.find_spec("vllm_petit_moe._C") is None:  # built but broken: fails below
        pytest.skip("compiled extension vllm_petit_moe._C not built")
    from vllm_petit_moe import _C
    assert len(COMBINE_TRACE_SLOTS) == _C.kCombineTraceSlots
    assert _C.kTimerTicksPerSecond in (1e9, 100e6)  # CUDA global timer (ns), HIP 100 MHz


def _row(start, first_send=0, sends_done=0, first_ready=0, last_done=0, end=0, sends=0,
         reduces=0, wait=0, work=0):
    return [start, first_send, sends_done, first_ready, last_done, end, sends, reduces, wait,
            work]


def test_summary_of_a_hand_made_trace():
    t = 1_000_000  # ns
    rows = [
        _row(t + 0, t + 1000, t + 90_000, t + 95_000, t + 99_000, t + 100_000, 5, 2,
             5000, 3000),                                                   # sender
        _row(t + 2000, t + 3000, t + 88_000, 0, 0, t + 88_500, 5, 0),       # sender only
        _row(t + 500, 0, 0, t + 20_000, t + 101_000, t + 102_000, 0, 9,
             54_000, 27_000),                                               # reducer
        _row(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1),                       # not launched
    ]
    s = summarize_combine_trace(torch.tensor(rows, dtype=torch.int64))
    assert (s["blocks"], s["senders"], s["reducers"]) == (3, 2, 2)
    assert (s["send_items"], s["reduce_items"]) == (10, 11)
    assert s["kernel_us"] == pytest.approx(102.0)
    assert s["start"] == {"n": 3, "min": 0.0, "median": 0.5, "max": 2.0}
    assert s["first_send"] == {"n": 2, "min": 1.0, "median": 2.0, "max": 3.0}
    assert s["sends_done"]["max"] == pytest.approx(90.0)
    assert s["first_reduce_ready"] == {"n": 2, "min": 20.0, "median": 57.5, "max": 95.0}
    assert s["last_reduce_done"]["max"] == pytest.approx(101.0)
    assert s["tail_us"] == pytest.approx(11.0)  # last reduction 101 us, last send flag 90 us
    assert s["reduce_only"] == {"blocks": 1, "items": 9, "wait_us": pytest.approx(54.0),
                                "work_us": pytest.approx(27.0)}
    assert s["senders_reducing"] == {"blocks": 1, "items": 2, "wait_us": pytest.approx(5.0),
                                     "work_us": pytest.approx(3.0)}
    text = format_combine_trace(s)
    assert "kernel 102.0 us, 3 blocks" in text and "11.0 us" in text
    assert "1 did 9 items; per item 6.0 us waiting, 3.0 us reducing" in text
    # Nested lists work too, and another timer rate scales every time.
    s100 = summarize_combine_trace(rows, ticks_per_second=100e6)
    assert s100["kernel_us"] == pytest.approx(1020.0)


def test_summary_refuses_empty_or_malformed_traces():
    with pytest.raises(ValueError, match="no launched block"):
        summarize_combine_trace([_row(-1)])
    with pytest.raises(ValueError, match="10 slots"):
        summarize_combine_trace([[1, 2, 3]])


def test_trace_tensor_checks():
    dev = torch.device("cpu")
    n = len(COMBINE_TRACE_SLOTS)
    good = torch.full((4, n), -1, dtype=torch.int64)
    check_combine_trace(good, 4, dev)
    cases = [
        (good.int(), "int64"),
        (good[:3], rf"\[4, {n}\]"),
        (good[:, :4], rf"\[4, {n}\]"),
        (torch.full((n, 4), -1, dtype=torch.int64).t(), "contiguous"),
        ([[0] * n] * 4, "got list"),
    ]
    for trace, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            check_combine_trace(trace, 4, dev)
    with pytest.raises(ValueError, match="must be on cuda:0"):
        check_combine_trace(good, 4, torch.device("cuda", 0))
