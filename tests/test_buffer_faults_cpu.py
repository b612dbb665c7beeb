"""CPU: EpBuffer's side of one-sided errors and teardown, on a real
``EpBuffer`` whose compiled context is a recording stand-in (no GPU, no extension).

- A collective call that raises on this rank before its launch (the issue's case: a bad id
  under ``validate_ids=True``; any bad argument, a refused launch) leaves the protocol: the
  context's heartbeat is marked aborted (``EpContext.abort``; the kernels' side is
  tests/test_call_faults_emu_cpu.py) and every later call raises ``BufferAbortedError``.
- ``combine`` answers the latest dispatch, once: a repeated, late or unpaired combine would wait
  at that dispatch's epoch and read stale rows (the flags are those of the first combine), so
  it is refused, and leaves the protocol like any error.
- ``close()`` takes the context out of the buffer before closing it (another thread's call
  then sees a closed buffer, not a context being freed), and closes it once.
"""
from __future__ import annotations

import pytest
import torch

from vllm_petit_moe import buffer as buffer_mod
from vllm_petit_moe.buffer import BufferAbortedError, EpBuffer
from vllm_petit_moe.config import CombineConfig

HIDDEN, EXPERTS, WORLD, TOKENS = 64, 8, 2, 16


class RecordingContext:
    """What EpBuffer's calls reach of the compiled EpContext, recorded."""

    def __init__(self):
        self.calls = []

    def dispatch(self, x, ids, weights, region_stride, quant):
        self.calls.append("dispatch")
        rows = WORLD * region_stride
        return (torch.zeros(rows, HIDDEN, dtype=torch.bfloat16),
                torch.full((rows, ids.shape[1]), -1, dtype=torch.int32),
                torch.zeros(rows, ids.shape[1]), torch.zeros(0, 1))

    def combine(self, expert_out, out, top_k, region_stride, trace):
        self.calls.append("combine")

    def abort(self):
        self.calls.append("abort")

    def diagnostics(self):
        return {}

    def close(self):
        self.calls.append("close")


@pytest.fixture
def buf(monkeypatch):
    """An EpBuffer of rank 0 of 2 as its setup leaves it, over a RecordingContext."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    b = EpBuffer.__new__(EpBuffer)
    b.__dict__.update(
        group=None, rank=0, world_size=WORLD, hidden_size=HIDDEN, num_experts=EXPERTS,
        max_tokens_per_rank=TOKENS, max_top_k=4, validate_ids=True, config=CombineConfig(),
        timeout_s=1.0, max_wait_s=2.0, device=torch.device("cpu"), num_sms=2,
        num_local_experts=EXPERTS // WORLD, _ctx=RecordingContext(), _aborted=None,
        _num_dispatches=0, _combine_due=None, _megamoe_workspaces={})
    yield b
    b.__dict__["_ctx"] = None  # no close() at collection


def _inputs(tokens=4, top_k=2):
    x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    ids = torch.randint(0, EXPERTS, (tokens, top_k), dtype=torch.int32)
    return x, ids, torch.rand(tokens, top_k)


def test_a_bad_id_leaves_the_protocol_and_marks_the_heartbeat(buf):
    """Old code: ValueError on this rank only, its heartbeat kept beating, its peers waited
    max_wait_s (1800 s) for a live peer; the buffer took later calls as if in step."""
    ctx = buf._ctx
    x, ids, w = _inputs()
    ids[1, 0] = EXPERTS + 3
    with pytest.raises(ValueError, match="top-k ids must be in"):
        buf.dispatch(x, ids, w)
    assert ctx.calls == ["abort"], "the heartbeat must be marked before the error propagates"
    ids[1, 0] = 0
    with pytest.raises(BufferAbortedError, match="left the collective protocol after an error "
                                                 "in a dispatch"):
        buf.dispatch(x, ids, w)
    assert ctx.calls == ["abort"], "no launch after leaving the protocol"
    buf.close()
    assert ctx.calls == ["abort", "close"]


@pytest.mark.parametrize("bad", ["quant", "tokens"])
def test_any_error_of_a_collective_call_leaves_the_protocol(buf, bad):
    x, ids, w = _inputs()
    kwargs = {"quant": "fp4"} if bad == "quant" else {"region_stride": 2}
    with pytest.raises(ValueError):
        buf.dispatch(x, ids, w, **kwargs)
    assert buf._ctx.calls == ["abort"]


def test_combine_answers_the_latest_dispatch_once(buf):
    """Old code: a second combine of one dispatch launched, and found its flags already at
    the epoch (the first combine's): stale rows, no error."""
    ctx = buf._ctx
    x, ids, w = _inputs()
    out = buf.dispatch(x, ids, w)
    expert_out = torch.zeros(WORLD * TOKENS, HIDDEN, dtype=torch.bfloat16)
    buf.combine(expert_out, out.handle)
    assert ctx.calls == ["dispatch", "combine"]
    with pytest.raises(ValueError, match="combine must answer this buffer's latest dispatch, "
                                         "once.*already combined"):
        buf.combine(expert_out, out.handle)
    assert ctx.calls == ["dispatch", "combine", "abort"]


def test_a_combine_of_an_older_dispatch_is_refused(buf):
    x, ids, w = _inputs()
    first = buf.dispatch(x, ids, w)
    buf.dispatch(x, ids, w)
    with pytest.raises(ValueError, match="handle of dispatch 1, latest dispatch 2"):
        buf.combine(torch.zeros(WORLD * TOKENS, HIDDEN, dtype=torch.bfloat16), first.handle)
    assert buf._ctx.calls == ["dispatch", "dispatch", "abort"]


def test_close_takes_the_context_out_first_and_closes_it_once(buf):
    ctx = buf._ctx
    seen = []
    ctx.close = lambda: seen.append(buf._ctx)
    buf.close()
    buf.close()
    assert seen == [None], "the buffer must not hand out the context while it is closed"
    with pytest.raises(RuntimeError, match="EpBuffer is closed"):
        buf.dispatch(*_inputs())


def test_describe_fault_of_the_new_causes():
    base = {"rank": 0, "peer": 1, "phase": "dispatch", "group": 0, "expected_epoch": 7,
            "observed_epoch": 8, "expected_tag": 0, "observed_tag": 0}
    text = buffer_mod.describe_fault({**base, "error": "peer_aborted"})
    assert "rank 1 left the protocol at epoch 7" in text and "must restart" in text
    text = buffer_mod.describe_fault({**base, "error": "order", "phase": "combine"})
    assert "call order mismatch: rank 1 is past this call (its dispatch of epoch 8" in text
    text = buffer_mod.describe_fault({**base, "error": "mismatch",
                                      "expected_tag": 7 << 9, "observed_tag": 1031 << 9})
    assert "region stride 1032 vs 8" in text, text


def test_max_tokens_per_rank_is_bounded_by_the_tag():
    with pytest.raises(ValueError, match="max_tokens_per_rank 65537 outside"):
        buffer_mod.validate_config(world_size=2, hidden_size=64, num_experts=8,
                                   max_tokens_per_rank=65537, max_top_k=4)
    buffer_mod.validate_config(world_size=2, hidden_size=64, num_experts=8,
                               max_tokens_per_rank=65536, max_top_k=4)
