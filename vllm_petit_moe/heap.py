"""Rendezvous of the linearized symmetric heap: file-descriptor exchange between the ranks.

Each rank exports its heap allocation as a POSIX file descriptor; the descriptors travel to
every other rank of the node over abstract Unix-domain sockets with SCM_RIGHTS (no files,
no ptrace permission needed), with torch.distributed for the out-of-band rendezvous.
"""
from __future__ import annotations

import os
import socket
import uuid

import torch.distributed as dist

_RANK_BYTES = 4


def _socket_name(token: str, rank: int) -> str:
    return f"\0petit-moe-{token}-{rank}"  # leading NUL: Linux abstract namespace


def check_single_node(group: dist.ProcessGroup) -> None:
    """Raise RuntimeError unless every rank of `group` runs on this host."""
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) != 1:
        raise RuntimeError(
            "petit_moe: all expert-parallel ranks must be on one node (the symmetric heap "
            f"maps peer GPU memory over NVLink); got hosts {sorted(set(hosts))}")


def exchange_fds(group: dist.ProcessGroup, local_fd: int, timeout_s: float = 60.0) -> list[int]:
    """Send `local_fd` to every other rank of `group`; return the fds received, indexed by
    group rank (entry [rank] is -1). Closes `local_fd`. Collective over `group`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(_socket_name(token[0], rank))
        server.listen(max(world, 1))
        server.settimeout(timeout_s)
        dist.barrier(group=group)  # every server is listening
        for peer in range(world):
            if peer == rank:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout_s)
                conn.connect(_socket_name(token[0], peer))
                socket.send_fds(conn, [rank.to_bytes(_RANK_BYTES, "little")], [local_fd])
        fds = [-1] * world
        for _ in range(world - 1):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(timeout_s)
                msg, received, _, _ = socket.recv_fds(conn, _RANK_BYTES, 1)
                if len(received) != 1 or len(msg) != _RANK_BYTES:
                    raise RuntimeError("petit_moe: malformed heap descriptor message")
                fds[int.from_bytes(msg, "little")] = received[0]
        missing = [r for r in range(world) if r != rank and fds[r] < 0]
        if missing:
            raise RuntimeError(f"petit_moe: no heap descriptor from ranks {missing}")
        return fds
    finally:
        server.close()
        os.close(local_fd)
