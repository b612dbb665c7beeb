"""CPU: the vLLM glue closes what it opened when vLLM's engine shuts down,
and passes the live-peer bound (max_wait_s) on to its buffers.

An engine shutdown in process (``LLM`` deleted, ``cleanup_dist_env_and_memory``) runs vLLM's
``destroy_model_parallel``, which destroys the EP ``GroupCoordinator``; the glue closes the
buffers built on that group's CPU group first (``compat.on_group_destroy``), so a second
engine in the same process does not keep the first one's heap (~1.8 GiB per rank at 8 ranks x
8192 tokens x 7168), heartbeat thread and fault-watch thread. Runs vLLM's real
``destroy_model_parallel`` and ``GroupCoordinator.destroy`` on a coordinator whose process
groups are stand-ins (torch's ``destroy_process_group`` is recorded, not run).
"""
from __future__ import annotations

import gc
import time
import weakref

import pytest

from fakes import build_kernel, make_moe_config, single_node_cuda  # noqa: F401
from vllm_petit_moe.vllm_glue import buffer_cache, envs, hook


class ClosingBuffer:
    """The buffer API the glue touches at creation and shutdown, recording its close; its
    diagnostic record is empty, so the fault watch polls it like a healthy buffer's."""

    num_experts = 16
    rank, world_size, footprint_bytes = 0, 2, 1 << 20
    num_local_experts = 8

    def __init__(self, config):
        self.config = config
        self.closed = 0

    def diagnostics(self):
        return {}

    def fault(self):
        return None

    def reserve_megamoe_workspace(self, intermediate_size):
        return 0

    def close(self):
        self.closed += 1


@pytest.fixture
def engines(kernel_hook, monkeypatch, vllm_config):  # noqa: F811
    """start(): builds one engine's MoE layers on a fresh EP group, returns (group, buffer);
    shutdown(group): vLLM's in-process shutdown of that engine's model-parallel groups."""
    import torch.distributed
    from vllm.distributed import parallel_state

    created = []  # weak: the test checks that nothing else keeps a closed buffer

    def create(group, config):
        buffer = ClosingBuffer(config)
        created.append(weakref.ref(buffer))
        return buffer

    monkeypatch.setattr(buffer_cache, "_create_buffer", create)
    monkeypatch.setenv(envs.VLLM_USE_PETIT_MOE, "1")
    destroyed = []
    monkeypatch.setattr(torch.distributed, "destroy_process_group", destroyed.append)
    monkeypatch.setattr(parallel_state, "_EP", None)

    class Engines:
        def start(self):
            group = object()  # the EP group's CPU group (gloo) as vLLM hands it over
            monkeypatch.setattr(hook, "_runtime_provider",
                                lambda: single_node_cuda(cpu_group=group))
            before = len(created)
            kernel = build_kernel(make_moe_config(), vllm_config)
            assert len(created) == before + 1, "one buffer per engine"
            assert kernel.prepare_finalize.buffer is created[-1]()
            return group, kernel

        def shutdown(self, group):
            coordinator = parallel_state.GroupCoordinator.__new__(parallel_state.GroupCoordinator)
            coordinator.cpu_group = group
            coordinator.device_communicator = None
            coordinator.mq_broadcaster = None
            parallel_state._EP = coordinator
            parallel_state.destroy_model_parallel()  # vLLM's own shutdown path
            assert parallel_state._EP is None and destroyed[-1] is group

    yield Engines()


def test_engine_shutdown_closes_the_buffers_of_its_group(engines):
    """Old code: the first engine's buffer stayed in the process-wide cache (heap, heartbeat
    and fault-watch threads) after its engine shut down, until the process exited."""
    group, kernel = engines.start()
    first = kernel.prepare_finalize.buffer
    watch = first.fault_watch
    assert watch._thread.is_alive()
    del kernel
    engines.shutdown(group)
    assert first.closed == 1, "the engine's shutdown must close its buffer"
    watch._thread.join(timeout=5 * buffer_cache.FAULT_POLL_S)
    assert not watch._thread.is_alive(), "the fault-watch thread must end with it"
    assert all(e.buffer is not first for e in buffer_cache._BUFFERS.values())
    del watch

    second_group, second = engines.start()  # the next engine, in the same process
    assert second.prepare_finalize.buffer is not first
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is None, "nothing of the glue may keep the first engine's buffer"
    engines.shutdown(second_group)
    assert second.prepare_finalize.buffer.closed == 1


def test_another_groups_shutdown_leaves_the_buffer_open(engines):
    group, kernel = engines.start()
    engines.shutdown(object())  # e.g. the TP or DP group of the same engine
    assert kernel.prepare_finalize.buffer.closed == 0
    engines.shutdown(group)
    assert kernel.prepare_finalize.buffer.closed == 1


def test_max_wait_s_reaches_the_buffer(engines, monkeypatch):
    """Old code: the glue's buffers always waited 1800 s for a live peer."""
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_TIMEOUT_S, "20")
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MAX_WAIT_S, "120")
    group, kernel = engines.start()
    config = kernel.prepare_finalize.buffer.config
    assert (config.timeout_s, config.max_wait_s) == (20.0, 120.0)
    engines.shutdown(group)


@pytest.mark.parametrize("value,match", [("10", "must be >= timeout_s=30"),
                                         ("1e9", "<= 86400"), ("soon", "not a number")])
def test_bad_max_wait_s_is_refused_naming_the_variable(monkeypatch, value, match):
    monkeypatch.delenv(envs.VLLM_PETIT_MOE_TIMEOUT_S, raising=False)
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_MAX_WAIT_S, value)
    with pytest.raises(ValueError, match=f"VLLM_PETIT_MOE_MAX_WAIT_S.*{match}"):
        envs.max_wait_s()
    monkeypatch.delenv(envs.VLLM_PETIT_MOE_MAX_WAIT_S)
    assert envs.max_wait_s() == 1800.0
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_TIMEOUT_S, "3600")
    assert envs.max_wait_s() == 3600.0  # never below the timeout


def test_buffer_creation_passes_max_wait_s_to_the_ep_buffer(monkeypatch):
    seen = {}

    class Recording:
        def __init__(self, group, **kwargs):
            seen.update(kwargs)

    import vllm_petit_moe.buffer as buffer_mod
    monkeypatch.setattr(buffer_mod, "EpBuffer", Recording)
    buffer_cache._create_buffer(object(), buffer_cache.BufferConfig(hidden_size=64, num_experts=8,
                                                          max_tokens_per_rank=16,
                                                          max_wait_s=99.0))
    assert seen["max_wait_s"] == 99.0 and seen["validate_ids"] is False
    time.sleep(0)
