"""GPU: a killed or stalled peer becomes a clear Python error on the survivor (issue 31).

Two rank processes share GPU 0 (each its own CUDA context and half the SMs), build one
EpBuffer (timeout_s = TIMEOUT_S) and run a few checked rounds. Then rank 1 stops at a given
point (killed with SIGKILL by this test, or alive but asleep) and rank 0 makes the next call:
``EpBuffer.synchronize()`` must raise PeerFaultError naming the phase, the peer and the
epoch within TIMEOUT_S + 5 s of the call. The survivor's CUDA context is lost after the
trap, so each case uses fresh processes.

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
from rank_pool import free_port

pytestmark = [requires_gpu, requires_extension]
TIMEOUT_S = 3.0
WARM_ROUNDS = 3


def _round_inputs(round_, rank, device):
    gen = torch.Generator(device="cpu").manual_seed(100 * round_ + rank)
    x = torch.randn(40, 256, generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, 16, (40, 4), generator=gen).to(device)
    w = torch.rand(40, 4, generator=gen).to(device)
    return x, ids, w


def _worker(rank, port, case, events, results):
    try:
        from bench_env import MULTICAST_OFF_ENV
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
                       max_tokens_per_rank=64, max_top_k=4, num_sms=sms, timeout_s=TIMEOUT_S)
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
            time.sleep(10 * TIMEOUT_S + 30)  # killed by the test, or stalled
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
                                             ("stall", "dispatch", False)])
def test_a_stopped_peer_raises_a_clear_error_within_the_timeout(case, phase, kill):
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
    assert kind == "PeerFaultError", (kind, message)
    assert f"{phase} on rank 0, waiting for rank 1" in message, message
    assert f"expected epoch {epoch}" in message and "must restart" in message, message
    assert diag["error"] == "timeout" and diag["peer"] == 1 and diag["phase"] == phase, diag
    assert elapsed <= TIMEOUT_S + 5.0, f"{case}: raised after {elapsed:.1f} s"
    print(f"{case}: PeerFaultError after {elapsed:.2f} s: {message}")
