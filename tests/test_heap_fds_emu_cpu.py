"""CPU: csrc/comm/heap.cpp closes every peer descriptor on every path.

`SymmetricHeap::map_all` takes the descriptors received from the peers: an open descriptor of
a peer's allocation keeps that allocation alive for the life of the process, also after a
failed setup has fallen back to vLLM. Built with g++ on a fake CUDA driver
(tests/emu/heap_emu.cpp); the descriptors are /dev/null opens, checked closed with fcntl.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os

import pytest

from conftest import build_emu_library


@pytest.fixture(scope="module")
def heap_emu(tmp_path_factory):
    lib = build_emu_library(tmp_path_factory, "heap_emu")
    lib.petit_emu_heap_map.restype = ctypes.c_int
    lib.petit_emu_heap_map.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_char_p, ctypes.c_int,
                                       ctypes.POINTER(ctypes.c_int)]
    return lib


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
        return True
    except OSError as e:
        assert e.errno == errno.EBADF
        return False


def _map(lib, world, rank, fail_rank=-1, fail_reserve=False, missing=()):
    fds = [-1 if r == rank or r in missing else os.open(os.devnull, os.O_RDONLY)
           for r in range(world)]
    fail_fd = fds[fail_rank] if fail_rank >= 0 else -1
    err = ctypes.create_string_buffer(512)
    live = ctypes.c_int(-1)
    try:
        code = lib.petit_emu_heap_map((ctypes.c_int * world)(*fds), world, rank, fail_fd,
                                      int(fail_reserve), err, len(err),
                                      ctypes.byref(live))
        still_open = [r for r, fd in enumerate(fds) if fd >= 0 and _is_open(fd)]
    finally:
        for fd in fds:
            if fd >= 0 and _is_open(fd):
                os.close(fd)
    return code, err.value.decode(), still_open, live.value


def test_mapping_closes_every_peer_descriptor(heap_emu):
    code, err, still_open, live = _map(heap_emu, 4, 1)
    assert code == 0, err
    assert still_open == [] and live == 0


@pytest.mark.parametrize("fail_rank", [0, 2, 3])
def test_a_failed_import_closes_the_remaining_descriptors(heap_emu, fail_rank):
    code, err, still_open, live = _map(heap_emu, 4, 1, fail_rank=fail_rank)
    assert code != 0 and f"import of rank {fail_rank}'s heap handle" in err, err
    assert still_open == [], f"descriptors of ranks {still_open} left open"
    assert live == 0, "imported handles not released"


def test_a_missing_descriptor_fails_and_closes_the_others(heap_emu):
    code, err, still_open, live = _map(heap_emu, 4, 0, missing=(2,))
    assert code != 0 and "import of rank 2's heap handle" in err, err
    assert still_open == [] and live == 0


def test_a_failed_reservation_releases_the_imported_handles(heap_emu):
    code, err, still_open, live = _map(heap_emu, 3, 2, fail_reserve=True)
    assert code != 0 and "reservation" in err, err
    assert still_open == [] and live == 0
