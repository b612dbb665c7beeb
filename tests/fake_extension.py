"""A stand-in for the compiled extension under ``EpBuffer``'s real setup (the rendezvous
agreement, the descriptor exchange over Unix sockets, the mapping check), for CPU tests that
run that setup in spawned rank processes without a GPU (tests/test_rendezvous_cpu.py,
tests/test_setup_agreement_cpu.py). vLLM-free, so every rank process imports it cheaply.

``SharedFileEpContext``: the ``EpContext`` methods the setup calls, over one shared file as
the linear heap: every rank's process maps the same file, so what a rank writes into its heap
shows in the others' views, as through the linear range. Tests subclass it for the behaviour
they inject. ``install(make_context)``: this process's ``EpBuffer`` runs on it.
"""
from __future__ import annotations

import os
import types

import torch

HEAP_STRIDE = 4096  # bytes of each rank's heap in the shared file


class SharedFileEpContext:
    """The extension's ``EpContext(device, rank, world_size, ...)`` as the setup uses it: the
    exported descriptor is a /dev/null open, ``map_peers`` takes the peers' descriptors (closes
    them, as the extension does), the heartbeat page is an empty file in /dev/shm."""

    def __init__(self, heap_file: str, device, rank: int, world: int, *args,
                 combine_config=None):
        self.rank, self.world = rank, world
        self.heap = torch.from_file(heap_file, shared=True, size=world * HEAP_STRIDE,
                                    dtype=torch.uint8)
        self.heap_bytes = HEAP_STRIDE

    def export_fd(self) -> int:
        return os.open(os.devnull, os.O_RDONLY)

    def map_peers(self, fds) -> None:
        for r, fd in enumerate(fds):
            if r != self.rank:
                os.close(fd)

    def heap_view(self, rank: int, offset: int, num_bytes: int) -> torch.Tensor:
        start = rank * HEAP_STRIDE + offset
        return self.heap[start:start + num_bytes]

    def attach_heartbeat(self, name: str, create: bool, period_s: float,
                         max_wait_s: float) -> None:
        if create:
            open("/dev/shm" + name, "wb").close()

    @staticmethod
    def unlink_heartbeat(name: str) -> None:
        os.unlink("/dev/shm" + name)

    def close(self) -> None:
        self.heap = None


def install(make_context) -> None:
    """This process's ``EpBuffer`` setup runs on stand-ins: the extension's ``EpContext`` is
    ``make_context(*args, **kwargs)`` (called with the extension's arguments), its heap layout
    puts the combine rows at byte 64, the device is the CPU with ``num_sms`` SMs (8 unless
    given), and a device synchronize does nothing."""
    import vllm_petit_moe.buffer as buffer_mod

    ops = types.SimpleNamespace(EpContext=make_context,
                                heap_layout=lambda *args: {"combine_rows": 64})
    buffer_mod._ops = lambda: ops
    buffer_mod._local_device = lambda num_sms: (torch.device("cpu"), num_sms or 8)
    buffer_mod._synchronize = lambda device: None
