"""Pools of W spawned worker processes (one per rank) kept for a whole test session.

``RankPool(world_size, setup, setup_args, teardown)``: worker ``r`` builds its state with
``setup(r, world_size, *setup_args)`` (a module-level function: it is pickled by reference),
answers "ready", then runs module-level functions sent to it, ``fn(state, *args)``, until the
pool closes (then ``teardown(state)``). Every rank runs the same function, so collectives line
up. Errors come back as ``RankPoolError`` with every failing rank's traceback; a rank that dies
or does not answer in time fails the call too (``RankPoolError`` naming it) instead of hanging
the test session, and any failure closes the pool (the fixtures start a new one).

``ep_rank_pool(world_size, num_gpus)``: the EpBuffer tests' pool: every worker joins a gloo
process group and picks GPU ``rank % num_gpus`` (so W ranks can share fewer GPUs: the ranks
then time-slice one device through the same heap mapping); its state is a dict
(``rank, world_size, group, device`` and the cached ``buffers`` of ``get_buffer``).
``vllm_moe_harness.VllmRankPool`` is the same pool with vLLM's distributed setup.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

# bench_env holds the GPU hosts' environment rules, for the tests as for the benchmarks.
from vllm_petit_moe.testing.bench_env import MULTICAST_OFF_ENV


class RankPoolError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank, world_size, setup, setup_args, teardown, tasks, results):
    """Worker main: build the state, answer "ready", run tasks until None, tear down."""
    try:
        state = setup(rank, world_size, *setup_args)
    except BaseException:
        results.put((rank, False, "setup: " + traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args = task
            try:
                results.put((rank, True, fn(state, *args)))
            except BaseException:  # report everything, the parent decides
                results.put((rank, False, traceback.format_exc()))
    finally:
        if teardown is not None:
            try:
                teardown(state)
            except BaseException:
                traceback.print_exc()


class RankPool:
    """W spawned processes running ``fn(state, *args)`` on every rank (see the module doc)."""

    # After one rank failed, how long the others get to answer: they may wait in a collective
    # that will never complete (our kernels trap after VLLM_PETIT_MOE_TIMEOUT_S, NCCL never).
    peer_grace_s = 45.0

    def __init__(self, world_size: int, setup, setup_args: tuple = (), teardown=None,
                 init_timeout_s: float = 300.0, what: str = "rank pool setup"):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_serve, daemon=True,
                                   args=(r, world_size, setup, setup_args, teardown,
                                         self._tasks[r], self._results))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self.healthy = True
        self._collect(what, init_timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list:
        results, errors, answered = [None] * self.world_size, [], 0
        deadline = time.monotonic() + timeout_s
        while answered < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=min(5.0, timeout_s))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = (f"ranks {dead} died" if dead
                           else f"no answer within {timeout_s:g} s")
                    raise RankPoolError(f"{what}: {why} ({answered} of {self.world_size} "
                                        "answered)" + ("\n" + "\n".join(errors) if errors
                                                       else "")) from None
                continue
            answered += 1
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                deadline = min(deadline, time.monotonic() + self.peer_grace_s)
        if errors:
            self.close()
            raise RankPoolError(f"{what} failed:\n" + "\n".join(errors))
        return results

    def run(self, fn, *args, timeout_s: float = 300.0) -> list:
        """Run ``fn(state, *args)`` on every rank; return the per-rank results."""
        if not self.healthy:
            raise RankPoolError("rank pool is broken by an earlier failure")
        for q in self._tasks:
            q.put((fn, args))
        return self._collect(getattr(fn, "__name__", str(fn)), timeout_s)

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.healthy = False


# --------------------------------------------------------------------------------------------
# The EpBuffer tests' pool
# --------------------------------------------------------------------------------------------


def _ep_setup(rank, world_size, num_gpus, port):
    os.environ.update(MULTICAST_OFF_ENV)
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank % num_gpus)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    return {"rank": rank, "world_size": world_size, "group": dist.group.WORLD,
            "device": torch.device("cuda", rank % num_gpus)}


def _ep_teardown(state):
    import torch.distributed as dist
    for buf in state.get("buffers", {}).values():
        buf.close()
    dist.destroy_process_group()


def ep_rank_pool(world_size: int, num_gpus: int) -> RankPool:
    return RankPool(world_size, _ep_setup, (num_gpus, free_port()), _ep_teardown,
                    what="EP rank pool setup (gloo group)")


def get_buffer(state: dict, **config):
    """The worker's EpBuffer for `config` (created collectively on first use)."""
    from vllm_petit_moe.buffer import EpBuffer
    buffers = state.setdefault("buffers", {})
    key = tuple(sorted(config.items()))
    if key not in buffers:
        buffers[key] = EpBuffer(state["group"], **config)
    return buffers[key]
