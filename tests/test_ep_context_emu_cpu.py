"""CPU: EpContext (csrc/comm/ep_context.{h,cpp}), the framework-free EP context under
EpBuffer, on a fake runtime (tests/emu/ep_context_emu.cpp): its size checks, its state machine
(map_peers before any call, close, the views' share of the heap, the heartbeat page) and its
error paths, each failing runtime or driver call included.

The fake runtime gives host memory for device memory and logs every call; the fake driver's
heap allocations are memfds, so two contexts in one process exchange descriptors and map each
other's heaps as two ranks' processes do, and their dispatch and combine run the real kernels
on the CPU emulation. The binding's part (tensors in, views out) is not here.
"""
from __future__ import annotations

import ctypes
import os
import re
import threading
import uuid

import pytest
import torch

from conftest import build_emu_library
from test_dispatch_combine_emu_cpu import NUM_EXPERTS, _inputs, _scaled_experts
from vllm_petit_moe.testing import reference as ref

ABORTED = 1 << 63  # api.h kHeartbeatAborted
SM_COUNT = 2  # the emulated device's
# heap layout fields (petit_emu_ctx_offset)
DISPATCH_ROWS, DISPATCH_IDS, DISPATCH_WEIGHTS, DISPATCH_SCALES, COMBINE_ROWS = range(5)
SIZES = dict(rank=0, world_size=2, max_tokens=8, hidden=64, max_top_k=4,
             num_experts=NUM_EXPERTS, num_blocks=2, timeout_s=5.0, reduce_pct=25)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _load(build_emu_library(tmp_path_factory, "ep_context_emu"))


def _load(lib):
    p, i, d, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_double, ctypes.c_char_p
    ll = ctypes.c_longlong
    for name, restype, argtypes in [
        ("petit_emu_rt_reset", None, [i]),
        ("petit_emu_rt_fail", None, [s]),
        ("petit_emu_rt_take_log", None, [p, i]),
        ("petit_emu_rt_live", None, [p]),
        ("petit_emu_ctx_create", p, [i] * 7 + [d, i, p, i]),
        ("petit_emu_ctx_destroy", None, [p]),
        ("petit_emu_ctx_close", None, [p]),
        ("petit_emu_ctx_abort", None, [p]),
        ("petit_emu_ctx_export_fd", i, [p, p, i]),
        ("petit_emu_ctx_map_peers", i, [p, p, i, p, i]),
        ("petit_emu_ctx_attach_heartbeat", i, [p, s, i, d, d, p, i]),
        ("petit_emu_ctx_unlink_heartbeat", None, [s]),
        ("petit_emu_ctx_heap_view", i, [p, i, ll, ll, p, p, p, i]),
        ("petit_emu_ctx_epoch_view", None, [p, p, p]),
        ("petit_emu_view_release", None, [p]),
        ("petit_emu_ctx_offset", ll, [p, i]),
        ("petit_emu_ctx_dispatch", i, [p, p, p, p, i, i, i, i, p, p, i]),
        ("petit_emu_ctx_combine", i, [p, p, p, i, i, i, p, i]),
        ("petit_emu_ctx_megamoe_refused", i, [p, i, i, i, i, i, p, i]),
        ("petit_emu_ctx_diagnostics", i, [p, p, p]),
    ]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@pytest.fixture
def rt(lib):
    """The fake runtime, reset; every test ends with nothing alive."""
    lib.petit_emu_rt_reset(SM_COUNT)
    yield Runtime(lib)
    assert Runtime(lib).live() == dict.fromkeys(LIVE, 0), "left alive after the test"


LIVE = ("device", "host", "registered", "vmm_handles", "maps", "ranges")


class Runtime:
    def __init__(self, lib):
        self.lib = lib

    def live(self) -> dict[str, int]:
        counts = (ctypes.c_int * len(LIVE))()
        self.lib.petit_emu_rt_live(counts)
        return dict(zip(LIVE, counts))

    def take_log(self) -> list[str]:
        buf = ctypes.create_string_buffer(1 << 16)
        self.lib.petit_emu_rt_take_log(buf, len(buf))
        return [c for c in buf.value.decode().split(";") if c]

    def fail(self, call: str) -> None:
        self.lib.petit_emu_rt_fail(call.encode())


class ContextError(RuntimeError):
    """A call of the context raised (its message)."""


def _call(fn, *args):
    err = ctypes.create_string_buffer(512)
    result = fn(*args, err, len(err))
    if result is None or result == -1:
        raise ContextError(err.value.decode())
    return result


class Ctx:
    """One EpContext of the fake runtime."""

    def __init__(self, lib, **overrides):
        self.lib = lib
        sizes = {**SIZES, **overrides}
        self.rank, self.hidden = sizes["rank"], sizes["hidden"]
        self.handle = _call(lib.petit_emu_ctx_create, *sizes.values())

    def destroy(self):
        if self.handle:
            self.lib.petit_emu_ctx_destroy(self.handle)
            self.handle = None

    def close(self):
        self.lib.petit_emu_ctx_close(self.handle)

    def export_fd(self) -> int:
        return _call(self.lib.petit_emu_ctx_export_fd, self.handle)

    def map_peers(self, fds) -> None:
        _call(self.lib.petit_emu_ctx_map_peers, self.handle, (ctypes.c_int * len(fds))(*fds),
              len(fds))

    def attach_heartbeat(self, name, create, period_s=0.05, max_wait_s=10.0) -> None:
        _call(self.lib.petit_emu_ctx_attach_heartbeat, self.handle, name.encode(), int(create),
              period_s, max_wait_s)

    def heap_view(self, rank, offset, num_bytes) -> View:
        view, address = ctypes.c_void_p(), ctypes.c_void_p()
        _call(self.lib.petit_emu_ctx_heap_view, self.handle, rank, offset, num_bytes,
              ctypes.byref(view), ctypes.byref(address))
        return View(self.lib, view, address.value, num_bytes)

    def epoch_view(self) -> View:
        view, address = ctypes.c_void_p(), ctypes.c_void_p()
        self.lib.petit_emu_ctx_epoch_view(self.handle, ctypes.byref(view), ctypes.byref(address))
        return View(self.lib, view, address.value, 8)

    def region(self, field, count, dtype):
        """`count` elements of `dtype` at a layout field of this rank's heap (a copy, through a
        heap view)."""
        num_bytes = count * torch.empty((), dtype=dtype).element_size()
        view = self.heap_view(self.rank, self.lib.petit_emu_ctx_offset(self.handle, field),
                              num_bytes)
        try:
            return view.bytes().view(dtype).clone()
        finally:
            view.release()

    def dispatch(self, x, ids, weights, region_stride, quant=0) -> None:
        """int64 ids; the tensors are passed as raw pointers, hence contiguous."""
        x, ids, weights = x.contiguous(), ids.long().contiguous(), weights.contiguous()
        rows = ctypes.c_void_p()
        _call(self.lib.petit_emu_ctx_dispatch, self.handle, x.data_ptr(), ids.data_ptr(),
              weights.data_ptr(), x.shape[0], ids.shape[1], region_stride, quant,
              ctypes.byref(rows))

    def combine(self, expert_out, out, top_k, region_stride) -> None:
        assert expert_out.is_contiguous() and out.is_contiguous()
        _call(self.lib.petit_emu_ctx_combine, self.handle, expert_out.data_ptr(),
              out.data_ptr(), out.shape[0], top_k, region_stride)

    def megamoe(self, num_tokens, top_k, region_stride, intermediate, num_local_experts):
        return _call(self.lib.petit_emu_ctx_megamoe_refused, self.handle, num_tokens, top_k,
                     region_stride, intermediate, num_local_experts)

    def diagnostics(self):
        error, rank = ctypes.c_int(-1), ctypes.c_int(-1)
        if not self.lib.petit_emu_ctx_diagnostics(self.handle, ctypes.byref(error),
                                                  ctypes.byref(rank)):
            return None
        return error.value, rank.value


class View:
    """A share of context memory (OwnedPtr) held by the test, as a tensor view holds one."""

    def __init__(self, lib, handle, address, num_bytes):
        self.lib, self.handle, self.address, self.num_bytes = lib, handle, address, num_bytes

    def bytes(self) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_uint8 * self.num_bytes).from_address(self.address),
                                dtype=torch.uint8)

    def release(self):
        self.lib.petit_emu_view_release(self.handle)


def _mapped_pair(lib, **overrides):
    """Two contexts (ranks 0 and 1) that exchanged descriptors and mapped each other's heaps."""
    ctxs = [Ctx(lib, rank=r, **overrides) for r in range(2)]
    fds = [c.export_fd() for c in ctxs]
    ctxs[0].map_peers([-1, fds[1]])
    ctxs[1].map_peers([fds[0], -1])
    return ctxs


def _waited_before(log: list[str], call: str) -> bool:
    """Whether every `call` in the log comes inside a run_blocking section, after a device
    synchronize of that section."""
    depth, synced = 0, []
    for entry in log:
        if entry == "blocking{":
            depth, synced = depth + 1, synced + [False]
        elif entry == "}blocking":
            depth, synced = depth - 1, synced[:-1]
        elif entry.startswith("synchronize") and synced:
            synced[-1] = True
        elif entry == call and not (depth > 0 and synced[-1]):
            return False
    return True


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _heartbeat_word(name: str, rank: int) -> int:
    with open("/dev/shm" + name, "rb") as f:
        return int.from_bytes(f.read()[8 * rank:8 * rank + 8], "little")


@pytest.fixture
def heartbeat_name():
    name = f"/petit_moe_test_hb_{uuid.uuid4().hex}"
    yield name
    if os.path.exists("/dev/shm" + name):
        os.unlink("/dev/shm" + name)


# ------------------------------------------------------------------------ construction
@pytest.mark.parametrize("overrides,message", [
    (dict(world_size=0), r"^world size 0 outside \[1, 32\]$"),
    (dict(world_size=33, num_experts=33), r"^world size 33 outside \[1, 32\]$"),
    (dict(rank=2), r"^rank 2 outside \[0, 2\)$"),
    (dict(rank=-1), r"^rank -1 outside \[0, 2\)$"),
    (dict(hidden=60), r"^hidden size 60 must be a positive multiple of 8$"),
    (dict(max_top_k=17), r"^max top-k 17 outside \[1, 16\]$"),
    (dict(num_experts=3), r"^3 experts must be a multiple of the world size 2 and at most 512$"),
    (dict(num_experts=514), r"^514 experts must be"),
    (dict(max_tokens=0), r"^max tokens per rank 0 outside \[1, 65536\]"),
    (dict(max_tokens=65537), r"^max tokens per rank 65537 outside"),
    (dict(timeout_s=0.0), r"^timeout_s 0 outside \(0, 3600\] seconds"),
    (dict(timeout_s=3601.0), r"^timeout_s 3601 outside"),
    (dict(num_blocks=3), r"^num_sms 3 must be in \[1, 2\] \(the persistent grid must be "
                         r"co-resident\)$"),
    (dict(num_blocks=0), r"^num_sms 0 must be in \[1, 2\]"),
    (dict(reduce_pct=91), r"^CombineConfig: reduce_pct in \[0, 90\]"),
])
def test_sizes_outside_the_limits_are_refused(lib, rt, overrides, message):
    with pytest.raises(ContextError) as raised:
        Ctx(lib, **overrides)
    assert re.search(message, str(raised.value)), str(raised.value)
    assert not any(call in rt.take_log() for call in ("malloc", "mem_create", "host_alloc"))


def test_the_limits_themselves_are_accepted(lib, rt):
    for overrides in (dict(world_size=1, num_experts=1), dict(max_top_k=16),
                      dict(max_tokens=65536), dict(timeout_s=3600.0), dict(num_blocks=1),
                      dict(num_experts=512), dict(hidden=8), dict(reduce_pct=90)):
        Ctx(lib, **overrides).destroy()


@pytest.mark.parametrize("failing,message", [
    ("mem_create", r"^allocation of a \d+-byte heap with a POSIX fd handle on device 0 failed: "
                   r"fake driver error"),
    ("malloc", r"^device state allocation failed: fake runtime error$"),
    ("memset", r"^device state initialization failed: fake runtime error$"),
    ("synchronize", r"^device state initialization failed: fake runtime error$"),
    ("host_alloc", r"^pinned diagnostics allocation failed: fake runtime error$"),
    ("host_device_pointer", r"^diagnostics device pointer failed: fake runtime error$"),
])
def test_a_failed_allocation_raises_and_leaves_nothing_behind(lib, rt, failing, message):
    rt.fail(failing)
    with pytest.raises(ContextError) as raised:
        Ctx(lib)
    assert re.search(message, str(raised.value)), str(raised.value)
    # (the rt fixture: nothing alive afterwards) what was allocated before the failure is
    # freed after a device wait, both through run_blocking
    log = rt.take_log()
    assert _waited_before(log, "mem_release") and _waited_before(log, "free"), log


# ---------------------------------------------------------------- the heap and its mapping
def test_calls_before_map_peers_are_refused(lib, rt):
    ctx = Ctx(lib)
    try:
        x, ids, w = (t[0] for t in _inputs(1, [4], ctx.hidden, 2, 2))
        not_mapped = "^the symmetric heap is not mapped \\(closed, or map_peers not run\\)$"
        with pytest.raises(ContextError, match=not_mapped):
            ctx.dispatch(x, ids, w, region_stride=4)
        with pytest.raises(ContextError, match=not_mapped):
            ctx.combine(torch.zeros(8, ctx.hidden, dtype=torch.bfloat16),
                        torch.zeros(4, ctx.hidden, dtype=torch.bfloat16), 2, 4)
        with pytest.raises(ContextError, match=not_mapped):
            ctx.heap_view(0, 0, 16)
        with pytest.raises(ContextError, match=not_mapped):
            ctx.megamoe(4, 2, 4, 64, NUM_EXPERTS // 2)
    finally:
        ctx.destroy()


def test_map_peers_takes_every_descriptor_on_every_path(lib, rt):
    """A descriptor received from a peer keeps the peer's allocation alive while it is open:
    map_peers closes every one it is given, also when it refuses or fails."""
    peer = Ctx(lib, rank=1)
    ctxs = []
    try:
        def refused(prepare, message, extra_fds=()):
            ctx = Ctx(lib)
            ctxs.append(ctx)
            prepare(ctx)
            fds = [-1, peer.export_fd(), *extra_fds]
            with pytest.raises(ContextError) as raised:
                ctx.map_peers(fds)
            assert re.search(message, str(raised.value)), str(raised.value)
            assert not any(_is_open(fd) for fd in fds[1:]), "a peer's descriptor left open"

        refused(lambda ctx: None, "^expected 2 descriptors, got 3$",
                extra_fds=[os.open(os.devnull, os.O_RDONLY)])
        refused(lambda ctx: rt.fail("mem_import"),
                "^import of rank 1's heap handle failed: fake driver error")
        refused(lambda ctx: rt.fail("map"),
                "^mapping rank 0's heap into the linear range failed: fake driver error")
        refused(lambda ctx: rt.fail("set_access"), "^granting device 0 access to all 2 heaps")
        refused(lambda ctx: ctx.close(), "^context is closed$")
        with pytest.raises(ContextError, match="^context is closed$"):
            ctxs[-1].export_fd()
    finally:
        for ctx in ctxs + [peer]:
            ctx.destroy()


def test_heap_views_stay_inside_the_heap(lib, rt):
    ctx = Ctx(lib, world_size=1, num_experts=1)
    try:
        ctx.map_peers([-1])
        ctx.heap_view(0, 0, 16).release()
        for rank, offset, num_bytes, message in [
                (1, 0, 16, "^rank 1 out of range$"), (-1, 0, 16, "^rank -1 out of range$"),
                (0, -16, 16, "^heap view out of range$"), (0, 0, -1, "^heap view out of range$"),
                (0, 1 << 40, 16, "^heap view out of range$")]:
            with pytest.raises(ContextError, match=message):
                ctx.heap_view(rank, offset, num_bytes)
    finally:
        ctx.destroy()


# ------------------------------------------------------------------- calls through the context
def test_two_ranks_dispatch_and_combine_through_their_contexts(lib, rt):
    """Two contexts in one process, mapped through their exported descriptors: dispatch and
    combine (the real kernels, emulated) match the reference twice, and each context's epoch
    view counts its calls."""
    ctxs = _mapped_pair(lib)
    epochs = [c.epoch_view() for c in ctxs]
    hidden, top_k, stride, tokens = SIZES["hidden"], 2, 8, [5, 8]
    try:
        for round_ in range(2):
            xs, ids, ws = _inputs(40 + round_, tokens, hidden, top_k, 2)
            errors = []

            def on_both(fn):
                def run(rank):
                    try:
                        fn(rank)
                    except ContextError as e:
                        errors.append(e)
                threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert not errors, errors

            on_both(lambda r: ctxs[r].dispatch(xs[r], ids[r], ws[r], stride))
            expected = ref.dispatch_reference(xs, ids, ws, NUM_EXPERTS, stride)
            rows = 2 * stride
            expert_outs = []
            for ctx, e in zip(ctxs, expected):
                recv_x = ctx.region(DISPATCH_ROWS, rows * hidden, torch.bfloat16).view(rows,
                                                                                       hidden)
                recv_ids = ctx.region(DISPATCH_IDS, rows * top_k, torch.int32).view(rows, top_k)
                recv_w = ctx.region(DISPATCH_WEIGHTS, rows * top_k, torch.float32).view(rows,
                                                                                        top_k)
                m = e.routed_mask
                assert torch.equal(recv_ids, e.recv_topk_ids), f"round {round_}, rank {ctx.rank}"
                assert torch.equal(recv_w, e.recv_topk_weights)
                assert torch.equal(recv_x[m], e.recv_x[m]), f"round {round_}, rank {ctx.rank}"
                expert_outs.append(_scaled_experts(recv_x, e.recv_topk_ids, e.recv_topk_weights,
                                                   m))
            ys = [torch.full((t, hidden), float("nan"), dtype=torch.bfloat16) for t in tokens]
            on_both(lambda r: ctxs[r].combine(expert_outs[r], ys[r], top_k, stride))
            for y, want in zip(ys, ref.combine_reference(expert_outs, ids, NUM_EXPERTS)):
                assert torch.equal(y, want), f"round {round_}: combine differs"
            assert [int(e.bytes().view(torch.int64)[0]) for e in epochs] == [round_ + 1] * 2
        assert [c.diagnostics() for c in ctxs] == [(0, 0)] * 2  # no error recorded
    finally:
        for view in epochs:
            view.release()
        for c in ctxs:
            c.destroy()


def test_calls_outside_the_limits_carry_their_checks_message(lib, rt):
    """Refused before a launch, with the C API check's own message (dispatch_check,
    combine_check, megamoe_ep_check) or the launcher's refusal, and the epoch stays."""
    ctxs = _mapped_pair(lib)
    ctx, epoch = ctxs[0], ctxs[0].epoch_view()
    hidden, local = SIZES["hidden"], NUM_EXPERTS // 2
    try:
        x, ids, w = (t[0] for t in _inputs(2, [5], hidden, 5, 2))
        for call, message in [
            (lambda: ctx.dispatch(x, ids, w, 8), r"^top-k 5 outside \[1, 4\]$"),
            (lambda: ctx.dispatch(x, ids[:, :2].contiguous(), w[:, :2].contiguous(), 9),
             r"^need tokens \(5\) <= region stride \(9\) <= max tokens per rank \(8\)$"),
            (lambda: ctx.dispatch(x, ids[:, :2].contiguous(), w[:, :2].contiguous(), 4),
             r"^need tokens \(5\) <= region stride \(4\)"),
            (lambda: ctx.dispatch(x, ids[:, :2].contiguous(), w[:, :2].contiguous(), 8, quant=4),
             r"^quant 4 is not a DispatchQuant$"),
            (lambda: ctx.dispatch(x, ids[:, :2].contiguous(), w[:, :2].contiguous(), 8, quant=1),
             r"^fp8 1x128 block dispatch needs a hidden size that is a multiple of 128, got "
             r"64$"),
            (lambda: ctx.combine(torch.zeros(16, hidden, dtype=torch.bfloat16),
                                 torch.zeros(5, hidden, dtype=torch.bfloat16), 0, 8),
             r"^top-k 0 outside \[1, 4\]$"),
            (lambda: ctx.megamoe(5, 2, 9, 64, local),
             r"^fused EP layer: need tokens \(5\) <= region stride \(9\) <= max tokens per "
             r"rank \(8\), region stride >= 1$"),
            (lambda: ctx.megamoe(5, 2, 8, 64, local + 1),
             rf"^fused EP layer: {local + 1} local experts != the context's {local}$"),
            (lambda: ctx.megamoe(5, 2, 8, 60, local),
             r"^fused EP layer: intermediate size 60 must be a positive multiple of 64$"),
        ]:
            with pytest.raises(ContextError) as raised:
                call()
            assert re.search(message, str(raised.value)), str(raised.value)
        # a device with fewer SMs than the context's grid (2): the launcher refuses the fused
        # layer's grid, which could not be co-resident
        lib.petit_emu_rt_reset(1)
        with pytest.raises(ContextError, match=r"^fused EP layer: its grid of 2 x num_sms = 4 "
                                               r"blocks cannot all be resident"):
            ctx.megamoe(5, 2, 8, 64, local)
        assert int(epoch.bytes().view(torch.int64)[0]) == 0
    finally:
        epoch.release()
        for c in ctxs:
            c.destroy()


# ------------------------------------------------------------------------ close and views
def test_close_waits_for_the_device_then_leaves_the_protocol_then_frees(lib, rt,
                                                                         heartbeat_name):
    ctx = Ctx(lib, world_size=1, num_experts=1)
    try:
        ctx.map_peers([-1])
        ctx.attach_heartbeat(heartbeat_name, create=True)
        assert _heartbeat_word(heartbeat_name, 0) & ABORTED == 0
        rt.take_log()
        ctx.close()
        log = rt.take_log()
        # the device first, with this rank still beating (a kernel of ours still running must
        # not look dead to its peers); then the heap, once the device is done with it; then the
        # diagnostics record and the page
        assert log[0] == "synchronize(beating)", log
        released = log.index("mem_release")
        assert log.index("blocking{") < released < log.index("}blocking"), log
        assert released < log.index("free_host") < log.index("host_unregister"), log
        assert _heartbeat_word(heartbeat_name, 0) & ABORTED, "close left the rank beating"
        assert rt.live() == dict(device=1, host=0, registered=0, vmm_handles=0, maps=0,
                                 ranges=0)
        ctx.close()  # idempotent: nothing left to wait for or free
        assert rt.take_log() == []
        assert ctx.diagnostics() is None
        with pytest.raises(ContextError, match="not mapped"):
            ctx.heap_view(0, 0, 16)
        ctx.destroy()  # the device state, after a device wait, through run_blocking
        log = rt.take_log()
        assert log[0] == "blocking{" and log[-1] == "}blocking" and "free" in log, log
    finally:
        ctx.destroy()
        lib.petit_emu_ctx_unlink_heartbeat(heartbeat_name.encode())


def test_views_keep_their_memory_past_close_and_destruction(lib, rt):
    ctx = Ctx(lib, world_size=1, num_experts=1)
    view = epoch = None
    try:
        ctx.map_peers([-1])
        view, epoch = ctx.heap_view(0, 64, 16), ctx.epoch_view()
        view.bytes()[:] = torch.arange(16, dtype=torch.uint8)
        ctx.close()
        assert rt.live()["maps"] == 1 and rt.live()["vmm_handles"] == 1, "the heap went early"
        assert view.bytes().tolist() == list(range(16))
        ctx.destroy()
        assert rt.live()["device"] == 1, "the device state went with a view of it alive"
        assert int(epoch.bytes().view(torch.int64)[0]) == 0
        rt.take_log()
        view.release()
        view = None
        log = rt.take_log()
        assert log[0] == "blocking{" and log[-1] == "}blocking", log
        assert log.index("synchronize") < log.index("unmap") < log.index("mem_release"), log
        epoch.release()
        epoch = None
    finally:
        for v in (view, epoch):
            if v is not None:
                v.release()
        ctx.destroy()


def test_destroying_an_open_context_closes_it(lib, rt, heartbeat_name):
    ctxs = _mapped_pair(lib)
    try:
        ctxs[1].attach_heartbeat(heartbeat_name, create=True)
        rt.take_log()
        ctxs[1].destroy()  # as close(), inside run_blocking (the destructor runs under the GIL)
        log = rt.take_log()
        assert log[:2] == ["blocking{", "synchronize(beating)"] and log[-1] == "}blocking", log
        assert "host_unregister" in log and "free" in log, log
        assert _heartbeat_word(heartbeat_name, 1) & ABORTED
        assert rt.live()["device"] == 1 and rt.live()["vmm_handles"] == 2  # rank 0's
    finally:
        for c in ctxs:
            c.destroy()
        lib.petit_emu_ctx_unlink_heartbeat(heartbeat_name.encode())


# ------------------------------------------------------------------------ heartbeat page
def test_heartbeat_page_errors(lib, rt, heartbeat_name):
    ctx = Ctx(lib)
    try:
        for args, message in [
            (dict(period_s=2.5), r"^heartbeat period 2.5 s must be below half the wait bound$"),
            (dict(period_s=0.0), r"^heartbeat period 0 s must be"),
            (dict(max_wait_s=4.0), r"^max_wait_s 4 outside \[timeout_s, 86400\]$"),
            (dict(max_wait_s=86401.0), r"^max_wait_s 86401 outside"),
            (dict(create=False), r"^heartbeat page .* shm_open failed \(errno 2\)$"),
        ]:
            with pytest.raises(ContextError) as raised:
                ctx.attach_heartbeat(heartbeat_name, **{"create": True, **args})
            assert re.search(message, str(raised.value)), str(raised.value)
        for failing in ("host_register", "host_device_pointer"):
            rt.fail(failing)
            with pytest.raises(ContextError, match="registering it with the GPU failed"):
                ctx.attach_heartbeat(heartbeat_name, create=failing == "host_register")
            with open("/proc/self/maps") as maps:  # the page is not left mapped ...
                assert heartbeat_name.lstrip("/") not in maps.read(), failing
            assert rt.live()["registered"] == 0, failing  # ... nor registered
        with pytest.raises(ContextError, match=r"shm_open failed \(errno 17\)$"):
            ctx.attach_heartbeat(heartbeat_name, create=True)  # the page exists now
        ctx.attach_heartbeat(heartbeat_name, create=False)
        with pytest.raises(ContextError, match="^the heartbeat is attached already$"):
            ctx.attach_heartbeat(heartbeat_name, create=False)
        assert _heartbeat_word(heartbeat_name, 0) & ABORTED == 0
        lib.petit_emu_ctx_abort(ctx.handle)  # left the protocol: peers see the mark at once
        assert _heartbeat_word(heartbeat_name, 0) & ABORTED
    finally:
        ctx.destroy()
        lib.petit_emu_ctx_unlink_heartbeat(heartbeat_name.encode())
