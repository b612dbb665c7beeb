"""A pool of W worker processes (one per EP rank) kept for a whole test session.

Each worker joins a gloo process group, picks GPU `rank % num_gpus` (so W ranks can share
fewer GPUs: the ranks then time-slice one device through the same heap mapping), and runs
module-level functions sent to it: `fn(state, *args)` where `state` is a per-worker dict
(cached buffers). Every rank runs the same function, so collectives line up. Errors and
hangs come back as exceptions naming the rank; a failed pool is restarted by the fixture.
"""
from __future__ import annotations

import os
import queue
import socket
import traceback

import torch.multiprocessing as mp

from vllm_petit_moe.device_env import MULTICAST_OFF_ENV


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, num_gpus, port, tasks, results):
    os.environ.update(MULTICAST_OFF_ENV)
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank % num_gpus)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    state = {"rank": rank, "world_size": world_size, "group": dist.group.WORLD,
             "device": torch.device("cuda", rank % num_gpus)}
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(state, *args)))
        except BaseException:  # report everything, the parent decides
            results.put((rank, False, traceback.format_exc()))
    for buf in state.get("buffers", {}).values():
        buf.close()
    dist.destroy_process_group()


class RankPoolError(RuntimeError):
    pass


class RankPool:
    def __init__(self, world_size: int, num_gpus: int):
        self.world_size = world_size
        self.num_gpus = num_gpus
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world_size, num_gpus, port, self._tasks[r],
                                         self._results))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self.healthy = True

    def run(self, fn, *args, timeout_s: float = 300.0) -> list:
        """Run fn(state, *args) on every rank; return the per-rank results."""
        if not self.healthy:
            raise RankPoolError("rank pool is broken by an earlier failure")
        for q in self._tasks:
            q.put((fn, args))
        results, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout_s)
            except queue.Empty:
                self.healthy = False
                self.close()
                raise RankPoolError(f"{fn.__name__}: ranks did not answer within {timeout_s} s "
                                    f"(got {self.world_size - len(errors)} answers)") from None
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            self.healthy = False
            self.close()
            raise RankPoolError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return results

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.healthy = False


def get_buffer(state: dict, **config):
    """The worker's EpBuffer for `config` (created collectively on first use)."""
    from vllm_petit_moe.buffer import EpBuffer
    buffers = state.setdefault("buffers", {})
    key = tuple(sorted(config.items()))
    if key not in buffers:
        buffers[key] = EpBuffer(state["group"], **config)
    return buffers[key]
