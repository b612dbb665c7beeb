"""CPU emulation: a dispatch wait whose bound expired tells a slow peer from a dead one by
the peer process's heartbeat word (docs/faults.md, "Slow-but-alive peers"), through the
kernels' own code (tests/emu/ep_emu.cpp, csrc/comm/dispatch_combine.cu):

- a peer that beats but calls only after several bounds: the wait goes on, the call completes
  and its rows are right;
- a peer that never beats: reported as stopped within 1.5 bounds;
- a peer that beats but never calls: reported as alive once max_wait_s has passed.

The emulated timer runs emu_ptx::kTimerSlowdown (30) times slower than the host clock: a
bound of 0.05 emulated seconds is 1.5 s here. A trap aborts its process, so each case runs
in a fresh one (run_case).
"""
import ctypes
import threading
import time

import torch

from conftest import build_emu_library, run_case
from test_dispatch_combine_emu_cpu import NUM_EXPERTS, _inputs, _load
from vllm_petit_moe.testing import reference as ref

import pytest

TIMEOUT_S = 0.05      # emulated seconds: 1.5 s of host time
SLOWDOWN = 30         # emu_ptx::kTimerSlowdown
BOUND_HOST_S = TIMEOUT_S * SLOWDOWN


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return _load(build_emu_library(tmp_path_factory, "ep_emu"))


def _case(lib_path, case):
    """Run by run_case in a fresh process: rank 0 dispatches; rank 1 beats or not, and
    dispatches late or never."""
    from test_dispatch_combine_emu_cpu import EmuEp
    lib = _load(ctypes.CDLL(lib_path))
    lib.petit_emu_ep_set_heartbeats.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_double]
    lib.petit_emu_ep_set_heartbeats.restype = None
    ep = EmuEp(lib, 2, max_tokens=8, hidden=64, timeout_s=TIMEOUT_S)
    words = (ctypes.c_uint64 * 2)()
    max_wait_s = 4 * TIMEOUT_S if case == "stuck" else 100 * TIMEOUT_S
    lib.petit_emu_ep_set_heartbeats(ep.handle, ctypes.addressof(words), max_wait_s)
    stop = threading.Event()

    def beat():  # rank 1's process: alive (the C++ thread of EpContext::attach_heartbeat)
        while not stop.is_set():
            words[1] += 1
            time.sleep(BOUND_HOST_S / 8)

    if case in ("late", "stuck"):
        threading.Thread(target=beat, daemon=True).start()
    xs, ids, ws = _inputs(9, [4, 4], 64, 2, 2)
    got = {}
    start = time.monotonic()
    rank0 = threading.Thread(target=lambda: got.update(
        r0=ep.dispatch(xs, ids, ws, region_stride=4, ranks=[0])))
    rank0.start()
    if case == "late":  # rank 1 calls after 3 bounds
        time.sleep(3 * BOUND_HOST_S)
        got["r1"] = ep.dispatch(xs, ids, ws, region_stride=4, ranks=[1])
    rank0.join()
    elapsed = time.monotonic() - start
    stop.set()
    for name in ("r0", "r1"):
        assert not isinstance(got[name], int), f"rank {name[1]}'s dispatch failed: {got[name]}"
    assert elapsed > 3 * BOUND_HOST_S, elapsed
    # each rank's receive buffers as of its own call's return, against the reference
    expected = ref.dispatch_reference(xs, ids, ws, NUM_EXPERTS, 4)
    for rank, mine in ((0, got["r0"][0]), (1, got["r1"][1])):
        recv_x, recv_ids, recv_w, _, counts = mine
        e = expected[rank]
        assert torch.equal(recv_ids, e.recv_topk_ids) and torch.equal(recv_w, e.recv_topk_weights)
        assert torch.equal(recv_x[e.routed_mask], e.recv_x[e.routed_mask]), f"rows of rank {rank}"
        assert int(counts[1 - rank].sum()) == int(e.routed_mask[4 * (1 - rank):][:4].sum())
    print(f"late peer: waited {elapsed:.1f} s ({elapsed / BOUND_HOST_S:.1f} bounds)")
    print("ok")


def test_a_slow_peer_that_beats_is_waited_for(emu):
    result = run_case(__file__, emu._name, "late", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), out[-3000:]
    assert "timed out" not in out, out[-3000:]


def _failing_case(emu, case):
    """Run `case` in a fresh process, which must fail (its wait traps: expected, so kept out of
    CI's trap log, tests/emu/emu_ptx.h); (output, seconds)."""
    start = time.monotonic()
    result = run_case(__file__, emu._name, case, timeout=300, env={"PETIT_EMU_EXPECT_TRAP": "1"})
    elapsed = time.monotonic() - start
    out = result.stdout + result.stderr
    assert result.returncode != 0 and not result.stdout.strip().endswith("ok"), out[-3000:]
    return out, elapsed


def test_a_peer_that_stopped_beating_is_reported_within_one_and_a_half_bounds(emu):
    out, elapsed = _failing_case(emu, "dead")
    assert ("dispatch timed out on rank 0 waiting for rank 1, token group 0: expected epoch 1, "
            "flag holds epoch 0") in out and "its process stopped (no heartbeat)" in out, out[-3000:]
    # 1.5 bounds plus the process start and the emulator's setup
    assert elapsed < 1.5 * BOUND_HOST_S + 20, f"reported after {elapsed:.1f} s"


def test_a_peer_that_beats_but_never_calls_is_reported_after_max_wait(emu):
    out, elapsed = _failing_case(emu, "stuck")
    assert "its process is alive but the wait reached max_wait_s" in out, out[-3000:]
    assert elapsed > 4 * BOUND_HOST_S, f"reported after {elapsed:.1f} s, before max_wait_s"
