"""CPU: who may hand a rank a heap descriptor, and how the setup fails.

W spawned processes join a gloo group, make a second gloo group that stands for vLLM's EP
``cpu_group``, and build an ``EpBuffer`` on it with the real setup (``rendezvous``: the
agreement, the descriptor exchange over abstract Unix sockets with SCM_RIGHTS). Stand-ins
(tests/fake_extension.py): the device query, and an EpContext whose exported "heap" is a
memfd holding the text "heap of rank r" (``map_peers`` reads what it was handed) and whose
linear range is one shared file. After setup each rank runs an ``all_reduce`` on the group,
as vLLM would.

- A process outside the group (uid 65534 when root, else only another pid) that connects to
  rank 0's socket before rank 1 does is refused; the genuine rank 1 still connects and both
  ranks map only each other's heaps.
- A peer that sends a malformed descriptor message (two descriptors, none, a rank index out
  of range or not its own, a short message) makes every rank raise SetupError at the same
  step, and no rank's descriptor count changes.
- A rank that fails its part of the exchange (cannot connect) fails every rank at once,
  not after the bound.
- A rank 5 s late with a 3 s bound: both ranks raise SetupError at the same step, and the
  group's next all_reduce is correct (nothing was left half-done on it).
"""
from __future__ import annotations

import os
import re
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fake_extension
from fake_extension import SharedFileEpContext
from vllm_petit_moe.testing.rank_pool import free_port

_SOCKET_PREFIX = "petit-moe-"


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class FakeEpContext(SharedFileEpContext):
    """The exported heap is a memfd holding "heap of rank r"; `mapped` records what each
    peer's descriptor held."""

    def __init__(self, heap_file, mapped, *args, **kwargs):
        super().__init__(heap_file, *args, **kwargs)
        self.mapped = mapped

    def export_fd(self):
        fd = os.memfd_create(f"fake-heap-{self.rank}")
        os.write(fd, f"heap of rank {self.rank}".encode())
        return fd

    def map_peers(self, fds):  # takes the descriptors, like the extension's
        for r, fd in enumerate(fds):
            if r != self.rank:
                self.mapped[r] = os.pread(fd, 64, 0).decode()
                os.close(fd)


def _misbehave(how: str) -> None:
    """Make this process a peer that sends malformed descriptor messages (`how`), by
    rewriting what it sends over Unix sockets (gloo and the store use TCP)."""
    import array
    import socket

    original = socket.socket.sendmsg

    def sendmsg(self, buffers, ancdata=(), *args):
        if self.family != socket.AF_UNIX:
            return original(self, buffers, ancdata, *args)
        data = b"".join(buffers)
        extra = os.open(os.devnull, os.O_RDONLY)
        try:
            if how == "two_descriptors":
                level, kind, fds = ancdata[0]
                ancdata = [(level, kind, array.array("i", list(array.array("i", fds)) + [extra]))]
            elif how == "no_descriptor":
                ancdata = []
            elif how == "rank_out_of_range":
                data = (7).to_bytes(4, "little") + data[4:]
            elif how.startswith("claims_rank_"):
                data = int(how.rsplit("_", 1)[1]).to_bytes(4, "little") + data[4:]
            elif how == "short":
                data = data[:2]
            return original(self, [data], ancdata, *args)
        finally:
            os.close(extra)

    socket.socket.sendmsg = sendmsg


def _refuse_connects() -> None:
    """This rank cannot connect to its peers' heap sockets (fails its part of the exchange
    after the sockets are listening)."""
    import socket

    original = socket.socket.connect

    def connect(self, address):
        if isinstance(address, str) and address.startswith("\0" + _SOCKET_PREFIX):
            raise ConnectionRefusedError("refused by the test")
        return original(self, address)

    socket.socket.connect = connect


def _wait_before_connecting(marker: str) -> None:
    """Delay this rank's connects to the heap sockets until `marker` exists (the stranger
    has connected first), at most 25 s."""
    import socket

    original = socket.socket.connect

    def connect(self, address):
        if isinstance(address, str) and address.startswith("\0" + _SOCKET_PREFIX):
            deadline = time.monotonic() + 25
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.02)
        return original(self, address)

    socket.socket.connect = connect


def _worker(rank, world, port, tmp, scenario, results):
    import vllm_petit_moe.buffer as buffer_mod
    from vllm_petit_moe import rendezvous

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        group = dist.new_group(backend="gloo")  # stands for vLLM's EP cpu_group
        rendezvous.SETUP_TIMEOUT_S = scenario.get("timeout_s", 5.0)
        mapped: dict[int, str] = {}
        fake_extension.install(
            lambda *args, **kw: FakeEpContext(os.path.join(tmp, "heap"), mapped, *args, **kw))
        if rank == 1 and "misbehave" in scenario:
            _misbehave(scenario["misbehave"])
        if rank == 1 and "wait_for" in scenario:
            _wait_before_connecting(os.path.join(tmp, scenario["wait_for"]))
        if rank == 1 and scenario.get("refuse_connects"):
            _refuse_connects()
        if rank == 1 and "late_s" in scenario:
            time.sleep(scenario["late_s"])
        fds_before = _num_fds()
        start = time.monotonic()
        try:
            buf = buffer_mod.EpBuffer(group, hidden_size=128, num_experts=12,
                                      max_tokens_per_rank=64, num_sms=4)
            buf.close()
            outcome = ("ok", "")
        except Exception as e:  # noqa: BLE001
            outcome = (type(e).__name__, str(e))
        seconds = time.monotonic() - start
        fds_after = _num_fds()
        total = torch.tensor([float(rank + 1)])
        work = dist.all_reduce(total, group=group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=20))
            reduced = float(total.item())
        except RuntimeError as e:
            reduced = f"{type(e).__name__}: {e}"
        results.put((rank, dict(outcome=outcome, fds=(fds_before, fds_after), mapped=mapped,
                                all_reduce=reduced, seconds=seconds)))
    except BaseException:
        results.put((rank, dict(outcome=("crash", traceback.format_exc()))))
    results.close()
    results.join_thread()
    os._exit(0)  # no teardown: a group whose collective never completed would hang in it


def _listening_sockets(pid: int) -> dict[str, int]:
    """Abstract heap sockets process `pid` listens on: name -> socket type."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    names = {}
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and int(fields[3], 16) & 0x10000 \
                    and fields[7].startswith("@" + _SOCKET_PREFIX):
                names[fields[7][1:]] = int(fields[4], 16)
    return names


class Stranger:
    """A process outside the group, forked from the test (as uid `uid`: setuid after the fork,
    no exec): for each (socket type, abstract name) it is sent, it connects and sends a
    descriptor of its own (a memfd) claiming to be rank 1, as the old exchange read a message
    (a 4-byte rank first); `feed` returns what happened."""

    def __init__(self, uid: int):
        to_child, self._to_child = os.pipe()
        self._from_child, from_child = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: plain os / socket calls only, then _exit
            code = 0
            try:
                os.close(self._to_child)
                os.close(self._from_child)
                if uid != os.getuid():
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                self._serve(to_child, from_child)
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        os.close(to_child)
        os.close(from_child)

    @staticmethod
    def _serve(requests: int, replies: int) -> None:
        import array
        import socket

        while True:
            line = os.read(requests, 4096).decode()
            if not line:
                return
            kind, name = line.split()
            reply = "failed to connect"
            try:
                with socket.socket(socket.AF_UNIX, int(kind)) as s:
                    s.settimeout(5)
                    s.connect("\0" + name)
                    reply = f"connected as uid {os.getuid()} pid {os.getpid()}"
                    fd = os.memfd_create("stranger")
                    os.write(fd, b"heap of a stranger")
                    s.sendmsg([(1).to_bytes(4, "little") + bytes(32)],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                    reply += ", sent"
            except OSError as e:
                reply += f": {e}"
            os.write(replies, reply.encode())

    def feed(self, kind: int, name: str) -> str:
        os.write(self._to_child, f"{kind} {name}".encode())
        return os.read(self._from_child, 4096).decode()

    def stop(self) -> None:
        os.close(self._to_child)
        os.close(self._from_child)
        os.waitpid(self.pid, 0)


def _run(tmp_path, world, scenario, stranger_uid=None, timeout=120):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    fed, stranger_log = set(), []
    stranger = Stranger(stranger_uid) if stranger_uid is not None else None
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(tmp_path), scenario,
                                               results)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world and time.monotonic() < deadline:
            if stranger is not None and not os.path.exists(tmp_path / "stranger-connected"):
                try:  # feed the stranger rank 0's heap sockets as they appear
                    for name, kind in _listening_sockets(procs[0].pid).items():
                        if name not in fed:
                            fed.add(name)
                            stranger_log.append(stranger.feed(kind, name))
                            if stranger_log[-1].startswith("connected"):
                                (tmp_path / "stranger-connected").touch()
                except FileNotFoundError:  # rank 0 exited
                    pass
            try:
                rank, result = results.get(timeout=0.02)
                out[rank] = result
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if stranger is not None:
            stranger.stop()
    assert len(out) == world, f"ranks {sorted(set(range(world)) - set(out))} hung: {out}"
    for rank, result in out.items():
        assert result["outcome"][0] != "crash", (rank, result)
    return out, stranger_log


def _step_of(message: str) -> str | None:
    found = re.search(r"step '([^']+)'", message)
    return found.group(1) if found else None


@pytest.mark.parametrize("stranger_uid", sorted({65534 if os.getuid() == 0 else os.getuid(),
                                                 os.getuid()}))
def test_a_process_outside_the_group_is_refused(tmp_path, stranger_uid):
    out, log = _run(tmp_path, 2, {"wait_for": "stranger-connected", "timeout_s": 30.0},
                    stranger_uid=stranger_uid)
    assert any(line.startswith("connected") for line in log), \
        f"the stranger never reached rank 0's socket: {log}"
    for rank, result in out.items():
        assert result["mapped"] == {1 - rank: f"heap of rank {1 - rank}"}, (rank, result)
        assert result["outcome"] == ("ok", ""), (rank, result)
        assert result["all_reduce"] == 3.0, (rank, result)


@pytest.mark.parametrize("how,world", [("two_descriptors", 2), ("no_descriptor", 2),
                                       ("rank_out_of_range", 2), ("claims_rank_0", 2),
                                       ("claims_rank_2", 3), ("short", 2)])
def test_a_malformed_descriptor_fails_every_rank_and_leaks_nothing(tmp_path, how, world):
    out, _ = _run(tmp_path, world, {"misbehave": how})
    steps = set()
    for rank, result in out.items():
        kind, message = result["outcome"]
        assert kind == "SetupError", (rank, result)
        assert "rank 0" in message and "rank 1" in message, (rank, message)
        steps.add(_step_of(message))
        before, after = result["fds"]
        assert before == after, f"rank {rank}: {after - before} descriptors more after setup"
        assert result["all_reduce"] == world * (world + 1) / 2, (rank, result)
    assert len(steps) == 1 and None not in steps, out


def test_a_rank_that_fails_its_exchange_does_not_leave_the_others_waiting(tmp_path):
    out, _ = _run(tmp_path, 2, {"refuse_connects": True, "timeout_s": 60.0})
    for rank, result in out.items():
        kind, message = result["outcome"]
        assert kind == "SetupError" and _step_of(message) == "descriptors", (rank, result)
        assert "rank 1: heap descriptor exchange: ConnectionRefusedError: refused by the test" \
            in message, message
        assert result["seconds"] < 30.0, f"rank {rank} waited {result['seconds']:.1f} s"
        assert result["fds"][0] == result["fds"][1], (rank, result["fds"])
        assert result["all_reduce"] == 3.0, (rank, result)


def test_a_late_rank_fails_at_the_same_step_and_the_group_stays_usable(tmp_path):
    out, _ = _run(tmp_path, 2, {"late_s": 5.0, "timeout_s": 3.0})
    steps = {rank: _step_of(result["outcome"][1]) for rank, result in out.items()}
    for rank, result in out.items():
        assert result["outcome"][0] == "SetupError", (rank, result)
        assert "not every rank arrived" in result["outcome"][1], (rank, result)
        assert result["all_reduce"] == 3.0, (rank, result)
        before, after = result["fds"]
        assert before == after, (rank, result["fds"])
    assert steps[0] == steps[1] is not None, steps


def test_a_descriptor_is_sent_only_to_the_process_that_agreed_to_be_the_rank():
    """A socket with rank 1's name held by another process (here: this one, while rank 1
    agreed on another pid) gets nothing: the sender checks the holder before sending."""
    import secrets
    import socket

    from vllm_petit_moe import rendezvous

    secret = secrets.token_bytes(32)
    uid = os.getuid()
    identities = [rendezvous.RankIdentity(os.getpid(), uid),
                  rendezvous.RankIdentity(os.getpid() + 1, uid)]
    read_end, write_end = os.pipe()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as squatter:
        squatter.bind(rendezvous.socket_name(secret, 1))
        squatter.listen(1)
        with pytest.raises(RuntimeError, match=f"held by pid {os.getpid()} uid {uid}, not by "
                                               f"rank 1 .pid {os.getpid() + 1}"):
            rendezvous._send_all(0, identities, secret, read_end, time.monotonic() + 5)
        conn, _ = squatter.accept()
        with conn:
            msg, ancillary, _, _ = conn.recvmsg(64, socket.CMSG_SPACE(16))
            assert (msg, ancillary) == (b"", [])  # closed without a message
    os.close(read_end)
    os.close(write_end)


def test_identities_must_be_distinct_processes_of_this_user():
    from vllm_petit_moe import rendezvous

    uid = os.getuid()
    assert rendezvous.check_identities([[10, uid], [11, uid]]) == [
        rendezvous.RankIdentity(10, uid), rendezvous.RankIdentity(11, uid)]
    for words, reason in [([[10, uid], [10, uid]], "distinct"), ([[10, uid], [11, uid + 1]],
                                                                  "this process's user"),
                          ([[10, uid], [0, uid]], "positive"), ([[10, uid], [11]], "[pid, uid]"),
                          ([[10, uid], ["11", uid]], "[pid, uid]")]:
        with pytest.raises(rendezvous.SetupError, match=re.escape(reason)):
            rendezvous.check_identities(words)
    for text in (None, "ab", "g" * 64, "A" * 64):
        with pytest.raises(rendezvous.SetupError, match="secret is malformed"):
            rendezvous.parse_secret(text)
