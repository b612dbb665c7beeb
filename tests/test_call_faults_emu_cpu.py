"""CPU emulation: one-sided errors end in a clear failure within one and a half wait bounds, not
in a wait of max_wait_s, and the fused EP layer refuses a grid that cannot
be co-resident; through the kernels' own code on the emulated ranks
(tests/emu/ep_emu.cpp, csrc/comm/ep_sync.h).

- A peer that left the protocol (a call of its that raised before the launch marks its
  heartbeat aborted: comm/heartbeat.h, EpBuffer._collective) fails the waits for it at their
  first look, with that cause, while its process still beats.
- Region strides that differ by 1024 (dispatch) or 256 (combine) are a call mismatch: the
  call tag holds the stride in full.
- A skipped combine (one rank dispatches again while its peer combines) is a call-order
  mismatch at the first expiry, instead of two live ranks waiting for each other for
  max_wait_s.
- The fused EP launch with a grid above occupancy x SMs, or num_sms above the SM count, is
  refused (cudaErrorCooperativeLaunchTooLarge) before anything runs.

The emulated timer runs emu_ptx::kTimerSlowdown (30) times slower than the host clock: a bound
of 0.05 emulated seconds is 1.5 s here. A trap aborts its process, so the failing cases run in
a fresh one (run_case).
"""
from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from conftest import build_emu_library, run_case
from test_dispatch_combine_emu_cpu import EmuEp, _inputs, _ints, _load, _ptrs

TIMEOUT_S = 0.05      # emulated seconds: 1.5 s of host time
SLOWDOWN = 30         # emu_ptx::kTimerSlowdown
BOUND_HOST_S = TIMEOUT_S * SLOWDOWN
MAX_WAIT_BOUNDS = 20  # max_wait_s in bounds: what the old code waited for a live peer
ABORTED = 1 << 63     # api.h kHeartbeatAborted
COOPERATIVE_LAUNCH_TOO_LARGE = 720  # cudaErrorCooperativeLaunchTooLarge


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return _load(build_emu_library(tmp_path_factory, "ep_emu"))


def _beating(lib, ep, ranks, abort_after_s=None):
    """Heartbeat words for `ep` (max_wait_s = MAX_WAIT_BOUNDS bounds), with a Python thread
    beating the words of `ranks` as a live process does, and marking them aborted after
    `abort_after_s` seconds (None: never); returns (words, stop event)."""
    lib.petit_emu_ep_set_heartbeats.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_double]
    lib.petit_emu_ep_set_heartbeats.restype = None
    words = (ctypes.c_uint64 * ep.world_size)()
    lib.petit_emu_ep_set_heartbeats(ep.handle, ctypes.addressof(words),
                                    MAX_WAIT_BOUNDS * TIMEOUT_S)
    stop = threading.Event()

    def beat():
        start = time.monotonic()
        while not stop.is_set():
            aborted = abort_after_s is not None and time.monotonic() - start > abort_after_s
            for r in ranks:  # the beat goes on and keeps the bit, as the C++ beat does
                words[r] = (words[r] + 1) | (ABORTED if aborted else 0)
            time.sleep(BOUND_HOST_S / 8)

    threading.Thread(target=beat, daemon=True).start()
    return words, stop


def _case(lib_path, case):
    """Run by run_case in a fresh process."""
    lib = _load(ctypes.CDLL(lib_path))
    if case in ("aborted", "aborted_thread"):
        # rank 0 dispatches; rank 1's process lives (beats) but its dispatch raised before
        # the launch: it marks its heartbeat aborted and never calls
        ep = EmuEp(lib, 2, max_tokens=8, hidden=64, timeout_s=TIMEOUT_S)
        if case == "aborted":
            _beating(lib, ep, [1], abort_after_s=BOUND_HOST_S / 2)
        else:  # the beat of EpContext itself (comm/heartbeat.h)
            words, _ = _beating(lib, ep, [])
            lib.petit_emu_heartbeat_start.restype = ctypes.c_void_p
            lib.petit_emu_heartbeat_start.argtypes = [ctypes.c_void_p, ctypes.c_double]
            lib.petit_emu_heartbeat_abort.argtypes = [ctypes.c_void_p]
            beat = lib.petit_emu_heartbeat_start(ctypes.addressof(words) + 8, BOUND_HOST_S / 8)
            time.sleep(BOUND_HOST_S / 2)
            assert words[1] > 0 and not words[1] & ABORTED, words[1]
            lib.petit_emu_heartbeat_abort(ctypes.c_void_p(beat))
            before = words[1]
            time.sleep(BOUND_HOST_S / 4)
            assert words[1] & ABORTED and words[1] > before, "the beat goes on, marked"
        xs, ids, ws = _inputs(9, [4, 4], 64, 2, 2)
        print(f"returned {ep.dispatch(xs, ids, ws, region_stride=4, ranks=[0])}")
    elif case in ("dispatch_stride", "combine_stride"):
        # strides equal modulo 1024 (dispatch) / 256 (combine): the old tags could not tell
        big = 8 + (1024 if case == "dispatch_stride" else 256)
        # a short bound: the old code let the rank with the longer stride wait for rows that
        # never come (a timeout, not a mismatch)
        ep = EmuEp(lib, 2, max_tokens=big, hidden=64, timeout_s=0.5)
        xs, ids, ws = _inputs(9, [8, 8], 64, 4, 2)
        xs, ids, ws = ([t.contiguous() for t in ts] for ts in (xs, ids, ws))
        if case == "dispatch_stride":
            rc = lib.petit_emu_ep_dispatch_each(ep.handle, 3, _ptrs(xs), _ptrs(ids), 1,
                                                _ptrs(ws), _ints([8, 8]), _ints([4, 4]),
                                                _ints([8, big]), _ints([0, 0]), _ints([0, 0]))
        else:
            got = ep.dispatch(xs, ids, ws, region_stride=big)
            assert not isinstance(got, int), got
            outs = [torch.zeros(8, 64, dtype=torch.bfloat16) for _ in range(2)]
            expert_outs = [g[0] for g in got]
            strides = [8, big]
            expert_outs = [e[:2 * s].contiguous() for e, s in zip(expert_outs, strides)]
            rc = lib.petit_emu_ep_combine_each(ep.handle, _ptrs(expert_outs), _ptrs(outs),
                                               _ints([8, 8]), _ints([4, 4]), _ints(strides),
                                               _ints([0, 0]))
        print(f"returned {rc}")
    elif case == "skipped_combine":
        # both ranks dispatch (epoch 1); rank 0 combines, rank 1 skips its combine and
        # dispatches again (epoch 2); both processes beat throughout
        ep = EmuEp(lib, 2, max_tokens=8, hidden=64, timeout_s=TIMEOUT_S)
        _beating(lib, ep, [0, 1])
        xs, ids, ws = _inputs(9, [4, 4], 64, 2, 2)
        got = ep.dispatch(xs, ids, ws, region_stride=4)
        assert not isinstance(got, int), got
        expert_outs = [g[0][:8].contiguous() for g in got]
        combine = threading.Thread(target=ep.combine, args=(expert_outs, [4, 4], 2, 4),
                                   kwargs={"ranks": [0]})
        combine.start()
        print(f"returned {ep.dispatch(xs, ids, ws, region_stride=4, ranks=[1])}")
        combine.join()


def _failing_case(emu, case):
    """Run `case` in a fresh process, which must trap; (output, seconds). PETIT_EMU_EXPECT_TRAP
    keeps the expected trap out of CI's trap log (tests/emu/emu_ptx.h)."""
    start = time.monotonic()
    result = run_case(__file__, emu._name, case, timeout=600, env={"PETIT_EMU_EXPECT_TRAP": "1"})
    elapsed = time.monotonic() - start
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "returned" not in result.stdout, out[-3000:]
    return out, elapsed


@pytest.mark.parametrize("case", ["aborted", "aborted_thread"])
def test_a_peer_that_left_the_protocol_fails_the_wait_at_the_first_look(emu, case):
    """Old code: the aborted peer still beats, so rank 0 waited max_wait_s (20 bounds here,
    30 minutes by default) and reported a live, stuck peer."""
    out, elapsed = _failing_case(emu, case)
    assert ("dispatch on rank 0 waiting for rank 1, token group 0, epoch 1: rank 1 left the "
            "protocol (its heartbeat is marked aborted") in out, out[-3000:]
    # the first look, one bound after the wait began (plus the process start and the setup)
    assert elapsed < 1.5 * BOUND_HOST_S + 20, f"reported after {elapsed:.1f} s"


@pytest.mark.parametrize("case,phase,strides", [("dispatch_stride", "dispatch", (1032, 8)),
                                                ("combine_stride", "combine", (264, 8))])
def test_region_strides_equal_modulo_a_power_of_two_are_a_mismatch(emu, case, phase, strides):
    """Old code: R against R + 1024 (dispatch) or R + 256 (combine) had equal tags, and the
    ranks read each other's rows at the wrong offsets without an error."""
    out, elapsed = _failing_case(emu, case)
    assert f"petit_moe: {phase} call mismatch on rank" in out, out[-3000:]
    assert "region stride %d vs %d" % strides in out or \
        "region stride %d vs %d" % strides[::-1] in out, out[-3000:]
    assert elapsed < 25, f"took {elapsed:.1f} s: a timeout, not the tag check"


def test_a_skipped_combine_is_a_call_order_mismatch(emu):
    """Old code: rank 0 waited in its combine for rank 1's, rank 1 in its next dispatch for
    rank 0's; both alive, both reported only after max_wait_s."""
    out, elapsed = _failing_case(emu, "skipped_combine")
    assert ("combine call order mismatch on rank 0: rank 1 is past this call (its dispatch of "
            "epoch 2") in out, out[-3000:]
    assert elapsed < 1.5 * BOUND_HOST_S + 25, f"reported after {elapsed:.1f} s"


def test_equal_calls_with_long_strides_still_match(emu):
    """The full-stride tags agree between ranks making the same calls (strides above 1024)."""
    from test_dispatch_combine_emu_cpu import _check_round
    ep = EmuEp(emu, 2, max_tokens=1100, hidden=64, max_top_k=4)
    try:
        for round_, stride in enumerate([1090, 33, 1100]):
            xs, ids, ws = _inputs(40 + round_, [min(stride, 40), 7], 64, 4, 2)
            _check_round(ep, xs, ids, ws, region_stride=stride, tag=f"stride {stride}")
    finally:
        ep.close()


# ------------------------------------------------------------------------ the fused grid
@pytest.fixture
def device(emu):
    emu.petit_emu_set_device.argtypes = [ctypes.c_int, ctypes.c_int]
    emu.petit_emu_set_device.restype = None
    yield emu.petit_emu_set_device
    emu.petit_emu_set_device(2, 2)  # the emulator's defaults


@pytest.mark.parametrize("sm_count,blocks_per_sm,num_blocks", [
    (2, 1, 2),   # 2 x 2 blocks, but the kernel's occupancy holds 1 per SM
    (1, 2, 2),   # num_sms above the device's SM count
])
def test_a_fused_grid_that_cannot_be_resident_is_refused(emu, device, megamoe_emu_lib,
                                                         sm_count, blocks_per_sm, num_blocks):
    """Old code: launched anyway (on a GPU, blocks that never start while their peers spin:
    a trap after the wait bound)."""
    from test_megamoe_ep_emu_cpu import HIDDEN, INTERMEDIATE, NUM_EXPERTS, fused_layer

    from vllm_petit_moe.testing.soak import expert_weights
    device(sm_count, blocks_per_sm)
    ep = EmuEp(emu, 2, max_tokens=16, hidden=HIDDEN, num_blocks=num_blocks, timeout_s=0.2)
    try:
        w13, w2 = expert_weights((HIDDEN, INTERMEDIATE, 4, NUM_EXPERTS), seed=7)
        xs, ids, ws = _inputs(5, [8, 8], HIDDEN, 4, 2, num_experts=NUM_EXPERTS)
        rc, results, outs, _ = fused_layer(ep, megamoe_emu_lib.petit_emu_megamoe_sync_ints, xs, ids,
                                           ws, w13, w2, 16, 4)
        assert results == [COOPERATIVE_LAUNCH_TOO_LARGE] * 2, results
        assert all(o.isnan().all() for o in outs), "nothing may run"
        assert ep.epochs() == [0, 0]
    finally:
        ep.close()
