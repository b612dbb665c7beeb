"""GPU: a killed or stuck peer becomes a clear Python error on the survivor, a slow one does
not (docs/faults.md: a dead peer must not hang the survivor, a slow one must not be taken for
dead).

Two rank processes share GPU 0 (each its own CUDA context and half the SMs), build one
EpBuffer (timeout_s = TIMEOUT_S, max_wait_s = MAX_WAIT_S) and run a few rounds. Then rank 1
stops at a given point and rank 0 makes the next call:
- killed (SIGKILL) before dispatch or combine: ``EpBuffer.synchronize()`` raises
  PeerFaultError naming the phase, the peer and the epoch within 1.5 x TIMEOUT_S + 5 s (its
  heartbeat stopped);
- alive but asleep past MAX_WAIT_S: PeerFaultError saying the peer is alive, after MAX_WAIT_S;
- alive and calling 3 x TIMEOUT_S late: no error, the call completes.
The survivor's CUDA context is lost after a trap, so each case uses fresh processes.

    pytest -q tests/test_peer_faults_gpu.py      # on a GPU machine, after building _C
"""
from __future__ import annotations

import os
import signal
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from conftest import requires_extension, requires_gpu
from vllm_petit_moe.testing.rank_pool import free_port

pytestmark = [requires_gpu, requires_extension]
TIMEOUT_S = 3.0
MAX_WAIT_S = 12.0
WARM_ROUNDS = 3


def _round_inputs(round_, rank, device):
    gen = torch.Generator(device="cpu").manual_seed(100 * round_ + rank)
    x = torch.randn(40, 256, generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, 16, (40, 4), generator=gen).to(device)
    w = torch.rand(40, 4, generator=gen).to(device)
    return x, ids, w


def _worker(rank, port, case, events, results):
    try:
        from vllm_petit_moe.testing.bench_env import MULTICAST_OFF_ENV
        os.environ.update(MULTICAST_OFF_ENV)
    except ImportError:
        pass
    import torch.distributed as dist

    from vllm_petit_moe.buffer import EpBuffer, PeerFaultError

    try:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        sms = torch.cuda.get_device_properties(0).multi_processor_count // 2
        buf = EpBuffer(dist.group.WORLD, hidden_size=256, num_experts=16,
                       max_tokens_per_rank=64, max_top_k=4, num_sms=sms, timeout_s=TIMEOUT_S,
                       max_wait_s=MAX_WAIT_S)
        device = buf.device
        for r in range(WARM_ROUNDS):
            x, ids, w = _round_inputs(r, rank, device)
            d = buf.dispatch(x, ids, w, region_stride=40)
            buf.combine(d.recv_x.clone(), d.handle)
        buf.synchronize()
        dist.barrier()
        epoch = WARM_ROUNDS + 1
        x, ids, w = _round_inputs(epoch, rank, device)
        if case == "combine":  # both ranks dispatch epoch e; rank 1 then stops before combine
            d = buf.dispatch(x, ids, w, region_stride=40)
            buf.synchronize()
        if rank == 1:
            results.put(("stopping", rank, epoch))
            if case == "slow":  # alive, and calls late
                time.sleep(3 * TIMEOUT_S)
                buf.dispatch(x, ids, w, region_stride=40)
                buf.synchronize()
            time.sleep(10 * TIMEOUT_S + 30)  # killed by the test, or stuck
            return
        events.wait(60)  # rank 1 stopped (killed or asleep)
        if case == "combine":
            start = time.monotonic()
            buf.combine(d.recv_x.clone(), d.handle)
        else:
            start = time.monotonic()
            d = buf.dispatch(x, ids, w, region_stride=40)
        try:
            buf.synchronize()
            results.put(("no error", rank, time.monotonic() - start, {}))
        except PeerFaultError as e:
            results.put(("PeerFaultError", str(e), time.monotonic() - start,
                         buf.diagnostics()))
        results.close()
        results.join_thread()  # put() sends from a thread: flush it before the hard exit
        os._exit(0)  # the context is gone: no teardown
    except BaseException:
        results.put(("crash", traceback.format_exc(), 0.0, {}))


@pytest.mark.parametrize("case,phase,kill", [("dispatch", "dispatch", True),
                                             ("combine", "combine", True),
                                             ("stuck", "dispatch", False),
                                             ("slow", "dispatch", False)])
def test_a_stopped_peer_raises_a_clear_error_a_slow_one_none(case, phase, kill):
    ctx = mp.get_context("spawn")
    results, events = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, case, events, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        first = results.get(timeout=300)
        assert first[0] == "stopping", first
        epoch = first[2]
        if kill:
            os.kill(procs[1].pid, signal.SIGKILL)
            procs[1].join(timeout=30)
        time.sleep(0.5)
        events.set()
        kind, message, elapsed, diag = results.get(timeout=10 * TIMEOUT_S + 60)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
    if case == "slow":
        assert kind == "no error", (kind, message)
        assert elapsed >= 3 * TIMEOUT_S - 1.0, f"returned after {elapsed:.1f} s, before the peer"
        print(f"slow: the call completed after {elapsed:.2f} s")
        return
    assert kind == "PeerFaultError", (kind, message)
    assert f"{phase} on rank 0, waiting for rank 1" in message, message
    assert f"expected epoch {epoch}" in message and "must restart" in message, message
    assert diag["error"] == "timeout" and diag["peer"] == 1 and diag["phase"] == phase, diag
    if case == "stuck":
        assert diag["peer_alive"] == 1 and "alive" in message, (diag, message)
        assert MAX_WAIT_S - 1.0 <= elapsed <= MAX_WAIT_S + 1.5 * TIMEOUT_S + 5.0, elapsed
    else:
        assert diag["peer_alive"] == 0, diag
        assert elapsed <= 1.5 * TIMEOUT_S + 5.0, f"{case}: raised after {elapsed:.1f} s"
    print(f"{case}: PeerFaultError after {elapsed:.2f} s: {message}")
