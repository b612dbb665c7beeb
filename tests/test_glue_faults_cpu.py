"""CPU: the vLLM glue under setup faults and peer faults: a fault must end in vLLM's own path
or a named error, never a hang or a silent wrong result (docs/faults.md).

- A buffer setup that fails (on every rank together: EpBuffer agrees on each setup step)
  makes the layers keep vLLM's prepare/finalize with a logged reason, once: later layers do
  not retry the collective creation; with VLLM_PETIT_MOE_STRICT=1 it raises at start-up.
- decide() refuses GPUs without a peer-to-peer (NVLink) path.
- The fault watch logs a failed wait's diagnostic record (phase, peer, token group, epoch)
  as soon as the kernel writes it, and dropped out-of-range ids as a warning.
- compat.ep_peer_access over a real gloo group (2 processes).
"""
from __future__ import annotations

import logging
import time

import pytest

from fakes import build_kernel, make_moe_config, single_node_cuda
from vllm_petit_moe.buffer import describe_fault
from vllm_petit_moe.rendezvous import SetupError
from vllm_petit_moe.vllm_glue import buffer_cache, envs, hook


def test_setup_failure_falls_back_to_vllm_with_a_logged_reason(kernel_hook, monkeypatch,
                                                               vllm_config, caplog):
    calls = []

    def failing(group, config):
        calls.append(config)
        raise SetupError("petit_moe: EP buffer setup step 'heap' failed on rank 1: "
                         "RuntimeError: out of memory")

    monkeypatch.setattr(buffer_cache, "_create_buffer", failing)
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    from vllm.model_executor.layers.fused_moe.prepare_finalize.naive_dp_ep import (
        MoEPrepareAndFinalizeNaiveDPEPModular)
    with caplog.at_level(logging.WARNING, logger="vllm.petit_moe"):
        first = build_kernel(make_moe_config(), vllm_config)
        second = build_kernel(make_moe_config(), vllm_config)
    for kernel in (first, second):
        assert isinstance(kernel.prepare_finalize, MoEPrepareAndFinalizeNaiveDPEPModular)
    assert len(calls) == 1, "a failed creation must not be retried (a new collective)"
    text = caplog.text
    assert "EP buffer setup failed" in text and "failed on rank 1" in text, text


def test_setup_failure_raises_at_start_up_in_strict_mode(kernel_hook, monkeypatch,
                                                         vllm_config):
    def failing(group, config):
        raise SetupError("petit_moe: EP buffer setup step 'map' failed on rank 0: no path")

    monkeypatch.setattr(buffer_cache, "_create_buffer", failing)
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")
    with pytest.raises(RuntimeError, match="EP buffer setup failed.*failed on rank 0"):
        build_kernel(make_moe_config(), vllm_config)


def test_decide_refuses_gpus_without_peer_access(kernel_hook, monkeypatch,
                                                 vllm_config):
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    monkeypatch.setattr(hook, "_runtime_provider",
                        lambda: single_node_cuda(peer_access=False))
    kernel = build_kernel(make_moe_config(), vllm_config)
    assert type(kernel.prepare_finalize).__name__ != "PetitPrepareAndFinalize"
    assert not kernel_hook, "no buffer may be created"
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_STRICT, "1")
    with pytest.raises(RuntimeError, match="not all connected peer to peer"):
        build_kernel(make_moe_config(), vllm_config)


class _RecordBuffer:
    """A buffer whose diagnostic record the test writes (as the kernel does)."""

    num_experts = 32

    def __init__(self):
        self.record = {"error": "", "timed_out": 0, "rank": 0, "peer": 0, "phase": "dispatch",
                       "group": 0, "expected_epoch": 0, "observed_epoch": 0,
                       "expected_tag": 0, "observed_tag": 0, "dropped_ids": 0}

    def diagnostics(self):
        return dict(self.record)

    def fault(self):
        return describe_fault(self.record)


def test_the_fault_watch_logs_the_record_as_soon_as_it_is_written(caplog):
    buf = _RecordBuffer()
    watch = buffer_cache.FaultWatch(buf, interval_s=0.02)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.petit_moe"):
            time.sleep(0.1)
            assert "vllm-petit-moe" not in caplog.text
            buf.record.update(dropped_ids=3)
            time.sleep(0.1)
            assert "treated 3 routing slots" in caplog.text
            buf.record.update(error="timeout", timed_out=1, rank=1, peer=0, phase="combine",
                              group=2, expected_epoch=1696, observed_epoch=1695)
            time.sleep(0.1)
    finally:
        watch.stop()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, caplog.text
    message = errors[0].getMessage()
    assert ("combine on rank 1, waiting for rank 0, token group 2: timed out: expected epoch "
            "1696, the flag holds epoch 1695") in message, message
    assert "must restart" in message


def test_describe_fault_of_a_mismatch():
    text = describe_fault({"error": "mismatch", "rank": 0, "peer": 1, "phase": "dispatch",
                           "group": 0, "expected_epoch": 3, "observed_epoch": 3,
                           "expected_tag": 0x20c, "observed_tag": 0x40c})
    assert "dispatch on rank 0, waiting for rank 1" in text and "call mismatch at epoch 3" in text
    assert describe_fault({"error": "", "timed_out": 0}) is None


def _peer_access_worker(rank, world, port, results):
    import torch.distributed as dist

    from vllm_petit_moe.vllm_glue import compat

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        results.put((rank, compat.ep_peer_access(dist.group.WORLD)))
    except BaseException as e:  # noqa: BLE001
        results.put((rank, f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()


def test_peer_access_probe_is_a_bounded_exchange_that_agrees_on_every_rank():
    """On CPU no rank knows its GPU: every rank gets None (unknown, so decide() leaves the
    check to the heap mapping), and none hangs or raises."""
    import torch.multiprocessing as mp

    from vllm_petit_moe.testing.rank_pool import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_peer_access_worker, args=(r, 2, port, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: None, 1: None}, got
