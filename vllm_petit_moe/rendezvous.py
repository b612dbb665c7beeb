"""Rendezvous of the linearized symmetric heap: the ranks' bounded setup agreement and the
exchange of heap file descriptors.

- `Agreement`: every setup step ends in a bounded status exchange, so a step that fails on
  one rank raises SetupError on all of them, and a rank that died, hangs or is late makes
  every rank raise at the same step instead of blocking them in a later collective. It runs
  over a key namespace of the group's own key-value store, never as a collective on the
  group: a rank that gives up leaves nothing half-done on a group vLLM keeps using.
- `exchange_fds`: each rank exports its heap allocation as a POSIX file descriptor and hands
  it to every other rank of the node over an abstract Unix-domain socket with SCM_RIGHTS.
  Any local process can reach such a socket, so a descriptor is taken only from the group's
  ranks (docs/faults.md, "Threat model"): the connecting process's pid and uid (SO_PEERCRED,
  given by the kernel) must be those the ranks agreed on, its message must prove the
  buffer's secret and name its own rank; anyone else is refused before a byte is read.
"""
from __future__ import annotations

import array
import hashlib
import hmac
import json
import logging
import os
import re
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

logger = logging.getLogger("vllm.petit_moe.rendezvous")  # inside vLLM's logger tree

SETUP_TIMEOUT_S = 120.0  # bound of every step of `Agreement`, from each rank's arrival
_POLL_S = (0.002, 0.05)  # first and longest pause between looks at the store
_MAX_RECORD_BYTES = 64 * 1024  # a longer record in the store is refused, not parsed
_ERROR_CHARS = 2000  # a rank's error text is shortened to this in its record
_COMPLETE = b"complete"


class SetupError(RuntimeError):
    """An EpBuffer setup step failed on some rank, or a rank did not arrive in time; raised on
    every rank of the group (see `Agreement`)."""


class SetupArgumentError(SetupError, ValueError):
    """A SetupError whose failed ranks all rejected their arguments (ValueError): bad input,
    so it is a ValueError too."""


# ------------------------------------------------------------------------------ agreement
def _group_store(group: dist.ProcessGroup) -> dist.Store:
    """The key-value store torch.distributed built `group` on (vLLM's EP cpu_group: the
    world's TCPStore under the group's prefix).

    WHY  the agreement needs deadlines it owns and must leave nothing half-done on a group
         that vLLM keeps using; a store operation is one request, and a rank that stops
         waiting for a key abandons nothing.
    HOW  torch keeps each group's store in `distributed_c10d._world.pg_map`, read by the
         private `_get_process_group_store` (torch 2.1+).
    REMOVE WHEN torch offers a public accessor of a group's store."""
    from torch.distributed import distributed_c10d as c10d

    getter = getattr(c10d, "_get_process_group_store", None)
    try:
        return getter(group) if getter is not None else c10d._world.pg_map[group][1]
    except (AttributeError, KeyError) as e:
        raise SetupError(f"petit_moe: no key-value store for process group {group!r} "
                         f"(created outside torch.distributed?): {e!r}") from None


_SESSIONS: dict[tuple[str, str], int] = {}  # (group name, session name) -> sessions so far


class Agreement:
    """The bounded agreement of one setup sequence among the ranks of `group`.

    Each call ``agreement(step, error, payload)`` is one step: every rank passes its own
    outcome (`error`: None = success, else why it failed) and a small JSON-serializable
    `payload`, and gets every rank's payload back, by group rank. Over the group's store
    (`_group_store`), in the namespace ``petit_moe/<name>/<n>/`` where n counts this
    process's sessions of that name on that group, so every rank must open its sessions in
    the same order (as EpBuffers are created). No collective runs on `group`.

    A step writes this rank's record, waits until every rank's record is there or
    `timeout_s` (default SETUP_TIMEOUT_S, read at each step) has passed since this rank
    arrived, then settles the step's verdict with one compare-and-set: "complete" or "timed
    out" (by whichever rank decides first). A rank that arrives after another gave up reads
    that verdict and fails at the same step; so every rank raises at the same step or none.

    Raises SetupError on every rank when any rank's step failed (naming each failed rank and
    its reason; SetupArgumentError, also a ValueError, when each failed on a ValueError),
    when the ranks are at different steps, or when the step timed out.
    """

    def __init__(self, group: dist.ProcessGroup, name: str, timeout_s: float | None = None,
                 store: dist.Store | None = None):
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.name, self.timeout_s = name, timeout_s
        key = (str(getattr(group, "group_name", id(group))), name)
        session = _SESSIONS.get(key, 0)
        _SESSIONS[key] = session + 1
        base = _group_store(group) if store is None else store
        self._store = dist.PrefixStore(f"petit_moe/{name}/{session}/", base)
        self._num_steps = 0

    def __call__(self, step: str, error: str | None, payload: Any = None) -> list:
        timeout_s = SETUP_TIMEOUT_S if self.timeout_s is None else self.timeout_s
        index = self._num_steps
        self._num_steps += 1
        keys = [f"{index}/rank{r}" for r in range(self.world_size)]
        verdict_key = f"{index}/verdict"
        if error is not None and len(error) > _ERROR_CHARS:
            error = error[:_ERROR_CHARS] + " ..."
        try:
            record = json.dumps({"step": step, "error": error, "payload": payload})
        except (TypeError, ValueError) as e:
            raise TypeError(f"petit_moe: setup payload of step {step!r} is not JSON: {e}") from e
        try:
            self._store.set(keys[self.rank], record.encode())
            arrived = self._wait(keys, verdict_key, time.monotonic() + timeout_s)
            missing = [] if arrived else [r for r in range(self.world_size)
                                          if not self._store.check([keys[r]])]
            mine = _COMPLETE if arrived else json.dumps(
                {"rank": self.rank, "missing": missing}).encode()
            verdict = bytes(self._store.compare_set(verdict_key, "", mine))
            if verdict != _COMPLETE:
                raise SetupError(f"petit_moe: EP buffer setup step {step!r}: not every rank "
                                 f"arrived within {timeout_s:g} s (a rank failed before it, "
                                 f"died, hangs or is late): {_describe_timeout(verdict)}")
            outcomes = [self._read(r, keys[r]) for r in range(self.world_size)]
            if index > 0:  # every rank has read the previous step: it arrived at this one
                self._store.delete_key(f"{index - 1}/rank{self.rank}")
        except SetupError:
            raise
        except Exception as e:  # noqa: BLE001 - the store is unreachable (its host died)
            raise SetupError(f"petit_moe: EP buffer setup step {step!r}: the group's store "
                             f"failed: {type(e).__name__}: {e}") from None
        steps = [o["step"] for o in outcomes]
        if len(set(steps)) != 1:
            raise SetupError(f"petit_moe: EP buffer setup out of step: ranks are at steps "
                             f"{steps}")
        failed = [(r, o["error"]) for r, o in enumerate(outcomes) if o["error"] is not None]
        if failed:
            bad_input = all(err.startswith("ValueError:") for _, err in failed)
            raise (SetupArgumentError if bad_input else SetupError)(
                f"petit_moe: EP buffer setup step {step!r} failed on "
                + "; ".join(f"rank {r}: {err}" for r, err in failed))
        return [o["payload"] for o in outcomes]

    def failed_ahead(self) -> list[int]:
        """Other ranks whose record of the next step is already in the store with an error:
        they failed their part of the work before it, so a rank waiting for them there (the
        descriptor exchange) can stop at once; the step then fails on every rank."""
        index, failed = self._num_steps, []
        for r in range(self.world_size):
            key = f"{index}/rank{r}"
            if r != self.rank and self._store.check([key]):
                try:
                    if self._read(r, key)["error"] is not None:
                        failed.append(r)
                except SetupError:
                    failed.append(r)
        return failed

    def _wait(self, keys: list[str], verdict_key: str, deadline: float) -> bool:
        """True once every key is in the store; False at `deadline` or as soon as another
        rank settled the verdict (it gave up: waiting on would not change the outcome)."""
        pause = _POLL_S[0]
        while True:
            if self._store.check(keys):
                return True
            if self._store.check([verdict_key]) or time.monotonic() >= deadline:
                return False
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, _POLL_S[1])

    def _read(self, rank: int, key: str) -> dict:
        """Rank `rank`'s record, checked: a JSON object with a step name, an error (None or
        text) and a payload, of at most _MAX_RECORD_BYTES."""
        data = bytes(self._store.get(key))
        try:
            if len(data) > _MAX_RECORD_BYTES:
                raise ValueError(f"{len(data)} bytes")
            record = json.loads(data)
            if not isinstance(record, dict) or not isinstance(record.get("step"), str) or \
                    not isinstance(record.get("error"), (str, type(None))):
                raise ValueError("not a step record")
        except ValueError as e:
            raise SetupError(f"petit_moe: rank {rank}'s setup record is malformed: {e}") from None
        return record


def _describe_timeout(verdict: bytes) -> str:
    try:
        v = json.loads(verdict)
        return (f"rank {int(v['rank'])} stopped waiting for rank(s) "
                f"{[int(r) for r in v['missing']]}")
    except (ValueError, KeyError, TypeError):
        return "a rank stopped waiting"


def check_single_node(hosts: list) -> None:
    """Raise SetupError unless every rank (hosts[r] = rank r's host name) is on one host."""
    if len(set(map(str, hosts))) != 1:
        raise SetupError(
            "petit_moe: all expert-parallel ranks must be on one node (the symmetric heap "
            f"maps peer GPU memory over NVLink); got hosts {sorted(set(map(str, hosts)))}")


# ------------------------------------------------------------------- who may hand in an fd
@dataclass(frozen=True)
class RankIdentity:
    """A rank's process as the kernel names it (SO_PEERCRED): pid and uid."""
    pid: int
    uid: int


def local_identity() -> list[int]:
    """This process's [pid, uid], for the agreement's payload (see `check_identities`)."""
    return [os.getpid(), os.getuid()]


def check_identities(words: list) -> list[RankIdentity]:
    """The ranks' identities from their agreed [pid, uid] words (words[r]: rank r's), checked:
    positive distinct pids (one process per rank, sharing this process's pid namespace) and
    every uid equal to this process's (we trust only our own user). Raises SetupError."""
    try:
        ids = [RankIdentity(int(w[0]), int(w[1])) for w in words
               if isinstance(w, list) and len(w) == 2 and all(type(x) is int for x in w)]
        if len(ids) != len(words):
            raise ValueError("a rank's identity is not [pid, uid]")
        if any(i.pid <= 0 for i in ids) or len({i.pid for i in ids}) != len(ids):
            raise ValueError("pids must be positive and distinct (one process per rank, in "
                             "one pid namespace)")
        if any(i.uid != os.getuid() for i in ids):
            raise ValueError(f"every rank must run as this process's user (uid "
                             f"{os.getuid()}): the heap is shared only between one user's "
                             "processes")
    except ValueError as e:
        raise SetupError(f"petit_moe: EP ranks' process identities {words!r}: {e}") from None
    return ids


def parse_secret(text: Any) -> bytes:
    """The buffer's secret from its agreed hex text (32 random bytes), or SetupError."""
    if not isinstance(text, str) or not re.fullmatch(r"[0-9a-f]{64}", text):
        raise SetupError("petit_moe: the EP buffer's descriptor secret is malformed")
    return bytes.fromhex(text)


# ------------------------------------------------------------------------ the fd exchange
# A descriptor message: the sender's rank (u32, little-endian) and a proof that it holds the
# buffer's secret (HMAC-SHA256 of "fd <sender> <receiver>"; the secret itself never travels
# over the socket), with exactly one descriptor attached.
_RANK = struct.Struct("<I")
_PROOF_BYTES = 32
_MESSAGE_BYTES = _RANK.size + _PROOF_BYTES
_MAX_FDS = 8  # room for this many descriptors in a message: any beyond one are closed
_BACKLOG = 64  # pending connections per socket: a few strangers do not crowd out the ranks


def _mac(secret: bytes, text: str) -> bytes:
    return hmac.new(secret, text.encode(), hashlib.sha256).digest()


def socket_name(secret: bytes, rank: int) -> str:
    """Rank `rank`'s abstract socket name (leading NUL: Linux abstract namespace). Derived
    from the secret, so a process that does not hold it cannot take a rank's name first."""
    return "\0petit-moe-" + _mac(secret, f"socket {rank}").hex()[:32]


def descriptor_message(secret: bytes, sender: int, receiver: int) -> bytes:
    return _RANK.pack(sender) + _mac(secret, f"fd {sender} {receiver}")


def _peer_identity(conn: socket.socket) -> RankIdentity:
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    return RankIdentity(pid, uid)


def _close_all(fds) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _send_descriptor(conn: socket.socket, message: bytes, fd: int) -> None:
    """One message with `fd` attached (replaced in tests by a peer that misbehaves)."""
    conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def _receive_descriptor(conn: socket.socket, expected: bytes, sender: int) -> int:
    """The one descriptor of rank `sender`'s message on `conn`, whose bytes must equal
    `expected`; RuntimeError otherwise. Every descriptor the message carried is closed on
    every failing path (a received descriptor holds the sender's allocation alive)."""
    msg, ancillary, flags, _ = conn.recvmsg(
        _MESSAGE_BYTES + 1, socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    try:
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or len(fds) != 1:
            raise RuntimeError(f"rank {sender} sent {len(fds)} descriptors"
                               + (" or more" if flags & socket.MSG_CTRUNC else "")
                               + " in one message, expected 1")
        if len(msg) != len(expected):
            raise RuntimeError(f"rank {sender} sent a {len(msg)}"
                               + ("+" if flags & socket.MSG_TRUNC else "")
                               + f"-byte message, expected {len(expected)}")
        claimed = _RANK.unpack_from(msg)[0]
        if claimed != sender:
            raise RuntimeError(f"the process of rank {sender} claims to be rank {claimed}")
        if not hmac.compare_digest(msg, expected):
            raise RuntimeError(f"rank {sender}'s message does not prove the buffer's secret")
    except BaseException:
        _close_all(fds)
        raise
    return fds[0]


def _send_all(rank: int, identities: list[RankIdentity], secret: bytes, fd: int,
              deadline: float) -> None:
    """Hand `fd` to every other rank, each checked (SO_PEERCRED) to be the process that
    agreed to be that rank before anything is sent."""
    for peer, identity in enumerate(identities):
        if peer == rank:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as conn:
            conn.settimeout(max(1e-3, deadline - time.monotonic()))
            conn.connect(socket_name(secret, peer))
            holder = _peer_identity(conn)
            if holder != identity:
                raise RuntimeError(f"rank {peer}'s socket is held by pid {holder.pid} uid "
                                   f"{holder.uid}, not by rank {peer} (pid {identity.pid} uid "
                                   f"{identity.uid}): descriptor not sent")
            _send_descriptor(conn, descriptor_message(secret, rank, peer), fd)


_ACCEPT_SLICE_S = 0.2  # between two looks at whether a peer already failed its part


def _receive_all(agreement: Agreement, server: socket.socket, identities: list[RankIdentity],
                 secret: bytes, fds: list[int], deadline: float, timeout_s: float) -> None:
    """Accept until every other rank's descriptor is in `fds` (fds[r] = rank r's). A process
    that is not one of the group's ranks is closed at once, before any of its bytes (or
    descriptors) is read, logged and otherwise ignored: the genuine rank may still connect.
    Stops early when a peer has already reported its part failed (`failed_ahead`)."""
    rank = agreement.rank
    rank_of = {identity: r for r, identity in enumerate(identities) if r != rank}
    pending = set(rank_of.values())
    refused: list[RankIdentity] = []
    while pending:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            server.settimeout(min(remaining, _ACCEPT_SLICE_S))
            conn, _ = server.accept()
        except TimeoutError:
            if remaining > _ACCEPT_SLICE_S:
                failed = agreement.failed_ahead()
                if failed:
                    raise RuntimeError(f"stopped waiting: rank(s) {failed} failed their part "
                                       "of the exchange") from None
                continue
            raise RuntimeError(
                f"no heap descriptor from rank(s) {sorted(pending)} within {timeout_s:g} s"
                + (f"; refused {len(refused)} connection(s) of processes outside the group: "
                   + ", ".join(f"pid {i.pid} uid {i.uid}" for i in refused[:4])
                   if refused else "")) from None
        with conn:
            identity = _peer_identity(conn)
            sender = rank_of.get(identity)
            if sender is None:
                refused.append(identity)
                logger.warning("petit_moe: rank %d refused a heap-descriptor connection of "
                               "pid %d uid %d, not a rank of its group", rank, identity.pid,
                               identity.uid)
                continue
            if sender not in pending:
                raise RuntimeError(f"rank {sender} connected twice")
            conn.settimeout(max(1e-3, deadline - time.monotonic()))
            fds[sender] = _receive_descriptor(conn, descriptor_message(secret, sender, rank),
                                              sender)
            pending.discard(sender)


def exchange_fds(agreement: Agreement, export: Callable[[], int],
                 identities: list[RankIdentity], secret: bytes,
                 timeout_s: float | None = None) -> list[int]:
    """Hand this rank's heap descriptor (`export()`, called here and always closed here) to
    every other rank of the agreement's group; return the descriptors received, by group
    rank (entry [rank] is -1); the caller owns them.

    `identities`: every rank's process (`check_identities` of the agreed words); `secret`:
    the buffer's secret, equal on all ranks (it names the sockets and signs the messages).
    Two agreement steps: "listen" (every rank's socket is bound before any connects) and
    "descriptors" (every rank got all its peers' descriptors). Any failure on any rank
    (export, bind, connect, a refused holder of a rank's socket, a malformed or duplicate
    message, a rank that never sends within `timeout_s`, default SETUP_TIMEOUT_S) raises
    SetupError on every rank, and then every descriptor this rank received is closed."""
    rank = agreement.rank
    timeout_s = SETUP_TIMEOUT_S if timeout_s is None else timeout_s
    fds: list[int] | None = [-1] * agreement.world_size
    local_fd, server = -1, None
    try:
        error = None
        try:
            local_fd = export()
            server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            server.bind(socket_name(secret, rank))
            server.listen(_BACKLOG)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
            error = f"heap descriptor socket: {type(e).__name__}: {e}"
        agreement("listen", error)
        error = None
        try:
            deadline = time.monotonic() + timeout_s
            _send_all(rank, identities, secret, local_fd, deadline)
            _receive_all(agreement, server, identities, secret, fds, deadline, timeout_s)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
            error = f"heap descriptor exchange: {type(e).__name__}: {e}"
        agreement("descriptors", error)
        received, fds = fds, None
        return received
    finally:
        if server is not None:
            server.close()  # pending connections, and descriptors in them, are dropped
        if local_fd >= 0:
            os.close(local_fd)
        if fds is not None:
            _close_all(fds)
