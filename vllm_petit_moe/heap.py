"""Rendezvous of the linearized symmetric heap: file-descriptor exchange between the ranks.

Each rank exports its heap allocation as a POSIX file descriptor; the descriptors travel to
every other rank of the node over abstract Unix-domain sockets with SCM_RIGHTS (no files,
no ptrace permission needed), with torch.distributed for the out-of-band rendezvous.

Every setup step ends in `agree`, a bounded status exchange over the (CPU) group: a step
that fails on one rank raises SetupError on all of them, and a rank that died or hangs makes
the others raise after the bound instead of blocking them in a later collective.
"""
from __future__ import annotations

import os
import pickle
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

_RANK_BYTES = 4


def _socket_name(token: str, rank: int) -> str:
    return f"\0petit-moe-{token}-{rank}"  # leading NUL: Linux abstract namespace


class SetupError(RuntimeError):
    """An EpBuffer setup step failed on some rank, or a rank did not arrive in time; raised on
    every rank of the group (see `agree`)."""


class SetupArgumentError(SetupError, ValueError):
    """A SetupError whose failed ranks all rejected their arguments (ValueError): bad input,
    so it is a ValueError too."""


# Bytes of one rank's record in `agree` (a pickled (step, error, payload) tuple, the error
# text shortened to fit).
_RECORD_BYTES = 4096
SETUP_TIMEOUT_S = 120.0


def _record(step: str, error: str | None, payload) -> torch.Tensor:
    for limit in (None, 1000, 200):
        text = error if error is None or limit is None else error[:limit] + " ..."
        data = pickle.dumps((step, text, payload))
        if len(data) <= _RECORD_BYTES - 4:
            break
    else:
        raise ValueError(f"petit_moe: setup record of step {step!r} exceeds {_RECORD_BYTES} bytes")
    record = torch.zeros(_RECORD_BYTES, dtype=torch.uint8)
    record[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    record[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return record


def agree(group: dist.ProcessGroup, step: str, error: str | None, payload=None,
          timeout_s: float | None = None) -> list:
    """One bounded status exchange of setup step `step` over `group` (a CPU/gloo group): every
    rank passes its own outcome (`error`: None = success, else why it failed) and a small
    picklable `payload`; returns every rank's payload, by group rank.

    Raises SetupError on every rank when any rank's step failed (naming each failed rank and
    its reason; SetupArgumentError, also a ValueError, when each failed on a ValueError), when the ranks are at different steps, or when the exchange does not complete
    within `timeout_s` (default SETUP_TIMEOUT_S; a rank died or hangs before reaching it). So
    a fault on one rank never leaves the others blocked in a later collective. Collective over
    `group`."""
    timeout_s = SETUP_TIMEOUT_S if timeout_s is None else timeout_s
    world = dist.get_world_size(group)
    mine = _record(step, error, payload)
    records = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(records, mine, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise SetupError(f"petit_moe: EP buffer setup step {step!r}: not every rank arrived "
                         f"within {timeout_s:g} s (a rank failed before it, died or hangs): "
                         f"{e}") from None
    outcomes = []
    for record in records:
        size = int.from_bytes(bytes(record[:4].tolist()), "little")
        outcomes.append(pickle.loads(bytes(record[4:4 + size].tolist())))
    steps = {s for s, _, _ in outcomes}
    if len(steps) != 1:
        raise SetupError(f"petit_moe: EP buffer setup out of step: ranks are at steps "
                         f"{[s for s, _, _ in outcomes]}")
    failed = [(r, err) for r, (_, err, _) in enumerate(outcomes) if err is not None]
    if failed:
        bad_input = all(err.startswith("ValueError:") for _, err in failed)
        raise (SetupArgumentError if bad_input else SetupError)(
            f"petit_moe: EP buffer setup step {step!r} failed on "
            + "; ".join(f"rank {r}: {err}" for r, err in failed))
    return [p for _, _, p in outcomes]


def check_single_node(hosts: list[str]) -> None:
    """Raise RuntimeError unless every rank (hosts[r] = rank r's host name) is on one host."""
    if len(set(hosts)) != 1:
        raise RuntimeError(
            "petit_moe: all expert-parallel ranks must be on one node (the symmetric heap "
            f"maps peer GPU memory over NVLink); got hosts {sorted(set(hosts))}")


def exchange_fds(group: dist.ProcessGroup, local_fd: int, token: str,
                 timeout_s: float = 60.0) -> list[int]:
    """Send `local_fd` to every other rank of `group`; return the fds received, indexed by
    group rank (entry [rank] is -1). `token`: equal on all ranks, unique to this exchange (it
    names the sockets). Closes `local_fd`. Collective over `group`; every socket operation is
    bounded by `timeout_s`, and the ranks agree that all servers listen before any connects."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        error = None
        try:
            server.bind(_socket_name(token, rank))
            server.listen(max(world, 1))
            server.settimeout(timeout_s)
        except OSError as e:
            error = f"heap descriptor socket: {e}"
        agree(group, "listen", error)  # every server is listening
        for peer in range(world):
            if peer == rank:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout_s)
                conn.connect(_socket_name(token, peer))
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
