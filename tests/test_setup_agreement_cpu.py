"""CPU: EpBuffer's setup never hangs and fails on every rank together, so no rank waits in a
collective that a failed peer will never join (docs/faults.md).

W processes join a gloo group and run the real ``EpBuffer.__init__``: its bounded status
agreements (``rendezvous.Agreement``), the signature check, the host check, the heap-descriptor
exchange over Unix sockets (real SCM_RIGHTS, with /dev/null descriptors) and the mapping
check. Only the device pieces are stand-ins (tests/fake_extension.py): the CUDA device query,
and an EpContext whose "heap" is one shared file mapped by every process (so the signature
each rank writes is read back by the others through it, as through the linear range). Faults
are injected on one rank; every rank must raise SetupError naming that rank's reason, within
the bound.
"""
from __future__ import annotations

import glob
import os
import time
import traceback

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import fake_extension
from fake_extension import SharedFileEpContext
from vllm_petit_moe.testing.rank_pool import free_port


class FakeEpContext(SharedFileEpContext):
    """With a fault of this rank injected: `fail` "heap" (the allocation raises), "map"
    (map_peers raises), "mapping" (the peers' bytes do not show in the views)."""

    def __init__(self, heap_file, fail, *args, **kwargs):
        if fail == "heap":
            raise RuntimeError("allocation of a 1234-byte heap failed: out of memory")
        super().__init__(heap_file, *args, **kwargs)
        self.fail = fail

    def attach_heartbeat(self, name, create, period_s, max_wait_s):
        path = "/dev/shm" + name
        assert os.path.exists(path) != create, (name, create)  # rank 0 creates, then the rest
        assert 0 < period_s < max_wait_s
        super().attach_heartbeat(name, create, period_s, max_wait_s)

    def map_peers(self, fds):
        assert fds[self.rank] == -1 and all(fd >= 0 for r, fd in enumerate(fds) if r != self.rank)
        super().map_peers(fds)
        if self.fail == "map":
            raise RuntimeError("granting device 0 access to all heaps failed: no peer-to-peer "
                               "path")

    def heap_view(self, rank, offset, num_bytes):
        view = super().heap_view(rank, offset, num_bytes)
        if self.fail == "mapping" and rank != self.rank:
            return view.clone().zero_()  # a broken mapping: the peers' bytes do not show
        return view


def _worker(rank, world, port, heap_file, faults, kwargs, results):
    import vllm_petit_moe.buffer as buffer_mod
    from vllm_petit_moe import rendezvous

    fail = faults.get(rank)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        if fail == "die":
            os._exit(3)  # dies before setup: the others must not wait for it unbounded
        rendezvous.SETUP_TIMEOUT_S = 5.0
        fake_extension.install(lambda *args, **kw: FakeEpContext(heap_file, fail, *args, **kw))
        args = dict(hidden_size=128, num_experts=12, max_tokens_per_rank=64, num_sms=4)
        args.update(kwargs.get(rank, {}))
        start = time.monotonic()
        try:
            buf = buffer_mod.EpBuffer(dist.group.WORLD, **args)
            outcome = ("ok", buf.signature())
        except Exception as e:  # noqa: BLE001
            outcome = (type(e).__name__, str(e))
        results.put((rank, outcome, time.monotonic() - start))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, ("crash", traceback.format_exc()), 0.0))


def _run(tmp_path, world, faults=None, kwargs=None, timeout=60):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    heap_file = str(tmp_path / "heap")
    procs = [ctx.Process(target=_worker, args=(r, world, free_port_cached[0], heap_file,
                                               faults or {}, kwargs or {}, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    expected = world - sum(1 for f in (faults or {}).values() if f == "die")
    deadline = time.monotonic() + timeout
    while len(out) < expected and time.monotonic() < deadline:
        try:
            rank, outcome, seconds = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - queue.Empty
            break
        out[rank] = (outcome, seconds)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    assert len(out) == expected, f"ranks {sorted(set(range(world)) - set(out))} hung: {out}"
    return out


free_port_cached = [0]


@pytest.fixture(autouse=True)
def _port():
    free_port_cached[0] = free_port()


def test_setup_succeeds_and_checks_the_mapping(tmp_path):
    before = set(glob.glob("/dev/shm/petit_moe_hb_*"))
    out = _run(tmp_path, 3)
    for rank, ((kind, detail), _) in out.items():
        assert kind == "ok", (rank, detail)
    assert set(glob.glob("/dev/shm/petit_moe_hb_*")) == before, "heartbeat page left behind"


@pytest.mark.parametrize("fault,step,reason", [
    ("heap", "heap", "out of memory"),
    ("map", "map", "no peer-to-peer path"),
    ("mapping", "read signatures", "reads a wrong signature from rank"),
])
def test_a_fault_on_one_rank_raises_on_every_rank(tmp_path, fault, step, reason):
    out = _run(tmp_path, 3, faults={1: fault})
    for rank, ((kind, detail), seconds) in out.items():
        assert kind == "SetupError", (rank, kind, detail)
        assert f"step {step!r} failed on rank 1" in detail and reason in detail, detail
        assert seconds < 5.0, f"rank {rank} took {seconds:.1f} s"


def test_an_invalid_argument_on_one_rank_raises_on_every_rank(tmp_path):
    from vllm_petit_moe.rendezvous import SetupArgumentError, SetupError

    assert issubclass(SetupArgumentError, ValueError) and issubclass(SetupArgumentError,
                                                                     SetupError)
    out = _run(tmp_path, 2, kwargs={1: {"timeout_s": float("inf")}})
    for rank, ((kind, detail), _) in out.items():
        assert kind == "SetupArgumentError", (rank, kind, detail)
        assert "failed on rank 1" in detail and "timeout_s=inf must be finite" in detail, detail


def test_arguments_that_differ_between_ranks_are_named(tmp_path):
    from vllm_petit_moe.config import CombineConfig

    differ = {"hidden_size": 256, "max_tokens_per_rank": 32, "num_sms": 2, "max_top_k": 8,
              "config": CombineConfig(reduce_pct=50)}
    out = _run(tmp_path, 2, kwargs={1: differ})
    for rank, ((kind, detail), _) in out.items():
        assert kind == "SetupError", (rank, kind, detail)
        assert "differ between ranks" in detail, detail
        for field in differ:
            assert f"{field}: rank 0" in detail, (field, detail)


def test_a_rank_that_died_makes_the_others_raise_within_the_bound(tmp_path):
    out = _run(tmp_path, 3, faults={2: "die"})
    for rank, ((kind, detail), seconds) in out.items():
        assert kind == "SetupError", (rank, kind, detail)
        assert "not every rank arrived" in detail, detail
        assert seconds < 5.0 + 5.0, f"rank {rank} took {seconds:.1f} s"
