"""`EpBuffer`: the expert-parallel communication buffer (symmetric heap + dispatch/combine).

One `EpBuffer` owns one rank's share of the linearized symmetric heap, the process group and
the configuration; it is created collectively by every rank of one node's EP group. See
docs/architecture.md for the data layout and the flag/epoch protocol.

    buf = EpBuffer(group, hidden_size=7168, num_experts=256, max_tokens_per_rank=4096)
    out = buf.dispatch(x, topk_ids, topk_weights)          # received rows + routing
    expert_out = my_experts(out.recv_x, out.recv_topk_ids, out.recv_topk_weights)
    y = buf.combine(expert_out, out.handle)                 # [T, H], summed at the source
"""
from __future__ import annotations

import contextlib
import logging
import secrets
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import CombineConfig, as_dict
from .rendezvous import (Agreement, SetupError, check_identities, check_single_node,
                         exchange_fds, local_identity, parse_secret)
from .limits import (DEFAULT_MAX_WAIT_S, DEFAULT_TIMEOUT_S, FP8_BLOCK_MODES, FP8_SCALE_BLOCK,
                     MAX_EXPERTS, MAX_TOKENS_PER_RANK, MAX_TOP_K, MAX_WORLD_SIZE,
                     MEGAMOE_BLOCKS_PER_SM, MEGAMOE_MAX_ENTRIES, MEGAMOE_TRACE_SLOTS,
                     MIN_CHUNK_VECTORS, REGION_ALIGNMENT, SIZE_MULTIPLE, TOKEN_GROUP_SIZE,
                     check_max_wait_s, check_timeout_s)

logger = logging.getLogger("vllm.petit_moe.buffer")  # inside vLLM's logger tree

# Wire formats of dispatch (csrc/api.h DispatchQuant); the fp8 math is in csrc/common/fp8.h and
# testing.reference.quantize_fp8_reference.
DISPATCH_QUANT = {None: 0, "fp8_block128": 1, "fp8_per_token": 2, "fp8_block128_ue8m0": 3}
# The slots of one block's row of a combine trace, in the order of csrc/api.h CombineTraceSlot
# (see `EpBuffer.combine`; testing.combine_trace summarizes a trace).
COMBINE_TRACE_SLOTS = ("start", "first_send", "sends_done", "first_reduce_ready",
                       "last_reduce_done", "end", "send_items", "reduce_items", "reduce_wait",
                       "reduce_work")


def _ops():
    from . import load_extension  # imported lazily so CPU-only code never needs it

    return load_extension()


def _local_device(num_sms: int | None) -> tuple[torch.device, int]:
    """This process's current CUDA device and the SMs of the persistent grid (all by
    default), or ValueError / RuntimeError. Replaced in CPU tests."""
    device = torch.device("cuda", torch.cuda.current_device())
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    sms = sm_count if num_sms is None else num_sms
    if not 1 <= sms <= sm_count:
        raise ValueError(f"petit_moe: num_sms {sms} outside [1, {sm_count}]")
    return device, sms


def _synchronize(device: torch.device) -> None:
    torch.cuda.synchronize(device)  # replaced in CPU tests


class PeerFaultError(RuntimeError):
    """A dispatch/combine wait of this rank failed (a peer died, stalled past the timeout,
    left the protocol, or made a different call or another call order): the kernel trapped,
    so this process's CUDA context is lost and the process must restart. The message names
    the phase, the peer, the token group and the epoch (EpBuffer.diagnostics())."""


class BufferAbortedError(RuntimeError):
    """A collective call of this EpBuffer raised on this rank before its launch: the rank left
    the protocol (its heartbeat is marked aborted, so its peers' waits fail within one wait
    bound, docs/faults.md) and the buffer refuses every later call. Rebuild the group."""


# Call tag fields (csrc/common/layout.h call_tag): the region stride in bits [9, 25).
_TAG_STRIDE_SHIFT, _TAG_KIND_SHIFT = 9, 8


def describe_fault(d: dict) -> str | None:
    """The sentence for a diagnostic record (EpBuffer.diagnostics()), or None when it holds
    no error."""
    error = d.get("error") or ("timeout" if d.get("timed_out") else "")
    if not error:
        return None
    where = (f"{d['phase']} on rank {d['rank']}, waiting for rank {d['peer']}, token group "
             f"{d['group']}")
    observed, expected = d.get("observed_tag", 0), d.get("expected_tag", 0)
    stride = lambda tag: ((tag >> _TAG_STRIDE_SHIFT) & 0xFFFF) + 1  # noqa: E731
    if error == "timeout":
        what = (f"timed out: expected epoch {d['expected_epoch']}, the flag holds epoch "
                f"{d['observed_epoch']}"
                + ("; the peer's process is alive but the wait reached max_wait_s"
                   if d.get("peer_alive") else ""))
    elif error == "peer_aborted":
        what = (f"rank {d['peer']} left the protocol at epoch {d['expected_epoch']} (its "
                "heartbeat is marked aborted: an error on that rank before its call, a failed "
                "wait of its own, or it closed its buffer; its log says which)")
    elif error == "order":
        kind = "combine" if (observed >> _TAG_KIND_SHIFT) & 1 else "dispatch"
        what = (f"call order mismatch: rank {d['peer']} is past this call (its {kind} of "
                f"epoch {d['observed_epoch']} is here, this rank waits at epoch "
                f"{d['expected_epoch']}): a call skipped or made in another order")
    else:
        what = (f"call mismatch at epoch {d['expected_epoch']}: the peer's call tag "
                f"0x{observed:07x} != this rank's 0x{expected:07x} (region stride "
                f"{stride(observed)} vs {stride(expected)}; call kind, region stride, top-k "
                "and quant must be equal on all ranks)")
    return (f"petit_moe: {where}: {what}. The kernel trapped: this process's CUDA context is "
            "lost (a sticky error), so the process must restart")


@dataclass(frozen=True)
class CombineHandle:
    """What `combine` needs from the `dispatch` it answers. Valid for one combine, until the
    next dispatch or fused call on the same buffer (`dispatch_index` names its dispatch)."""
    num_tokens: int
    top_k: int
    region_stride: int
    dispatch_index: int = -1


@dataclass(frozen=True)
class DispatchOutput:
    """Result of `EpBuffer.dispatch` at this (destination) rank; W = world size,
    R = region stride. The tensors are views of the heap, valid until the next dispatch; each
    holds a share of the heap, so after `EpBuffer.close()` they read stale rows, never freed
    memory, and the heap is freed when the last of them is gone.

    recv_x:            [W*R, H] bfloat16 (float8_e4m3fn with an fp8 `quant`); row s*R+i =
                       token i of source s if routed here (other rows are stale).
    recv_topk_ids:     [W*R, K] int32 local expert ids, -1 where the expert is not local
                       (rows of tokens i >= T_s are all -1).
    recv_topk_weights: [W*R, K] float32, 0 where the id is -1.
    handle:            pass to `EpBuffer.combine`.
    recv_x_scales:     fp8 only: [W*R, H/128] ("fp8_block128*") or [W*R, 1]
                       ("fp8_per_token") float32 dequantization scales; None for bf16.
    """
    recv_x: torch.Tensor
    recv_topk_ids: torch.Tensor
    recv_topk_weights: torch.Tensor
    handle: CombineHandle
    recv_x_scales: torch.Tensor | None = None


def check_combine_trace(trace: torch.Tensor, num_blocks: int, device: torch.device) -> None:
    """Raise ValueError unless `trace` is an int64 [num_blocks, slots] contiguous tensor on
    `device` (what the kernel writes into)."""
    want = (num_blocks, len(COMBINE_TRACE_SLOTS))
    if not isinstance(trace, torch.Tensor) or trace.dtype != torch.int64 or \
            tuple(trace.shape) != want or not trace.is_contiguous():
        got = (f"{trace.dtype} {list(trace.shape)}" if isinstance(trace, torch.Tensor)
               else type(trace).__name__)
        raise ValueError(f"petit_moe: trace must be a contiguous int64 tensor {list(want)} "
                         f"(num_sms x combine trace slots), got {got}")
    if trace.device != torch.device(device):
        raise ValueError(f"petit_moe: trace must be on {device}, got {trace.device}")


def max_group_chunks(hidden_size: int) -> int:
    """Combine flags per (rank, token group): the most hidden chunks of a group's bf16 rows
    (a full group of TOKEN_GROUP_SIZE rows, MIN_CHUNK_VECTORS 16-byte vectors per chunk).
    Mirrors csrc/common/layout.h max_group_chunks."""
    return max(1, TOKEN_GROUP_SIZE * (hidden_size // SIZE_MULTIPLE) // MIN_CHUNK_VECTORS)


def heap_bytes(world_size: int, max_tokens_per_rank: int, hidden_size: int,
               max_top_k: int) -> int:
    """Bytes of one rank's heap (before rounding to the allocation granularity). Mirrors
    csrc/common/layout.h make_heap_layout; tests check the two agree."""
    align = lambda n: -(-n // REGION_ALIGNMENT) * REGION_ALIGNMENT  # noqa: E731
    rows = world_size * max_tokens_per_rank
    groups = -(-max_tokens_per_rank // TOKEN_GROUP_SIZE)
    chunks = max_group_chunks(hidden_size)
    total = 0
    scales = -(-hidden_size // FP8_SCALE_BLOCK)
    for nbytes in (rows * hidden_size * 2, rows * max_top_k * 4, rows * max_top_k * 4,
                   rows * scales * 4, rows * hidden_size * 2, world_size * groups * 8,
                   world_size * groups * chunks * 8):
        total += align(nbytes)
    return total


def validate_config(*, world_size: int, hidden_size: int, num_experts: int,
                    max_tokens_per_rank: int, max_top_k: int) -> None:
    """Raise ValueError naming the limit for an unsupported buffer configuration."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"petit_moe: world size {world_size} outside [1, {MAX_WORLD_SIZE}]")
    if hidden_size <= 0 or hidden_size % SIZE_MULTIPLE != 0:
        raise ValueError(f"petit_moe: hidden size {hidden_size} must be a positive multiple "
                         f"of {SIZE_MULTIPLE} (16-byte bf16 vectors)")
    if not 1 <= num_experts <= MAX_EXPERTS or num_experts % world_size != 0:
        raise ValueError(f"petit_moe: num_experts {num_experts} must be in [1, {MAX_EXPERTS}] "
                         f"and divisible by the world size {world_size}")
    if not 1 <= max_top_k <= MAX_TOP_K:
        raise ValueError(f"petit_moe: max_top_k {max_top_k} outside [1, {MAX_TOP_K}]")
    if not 1 <= max_tokens_per_rank <= MAX_TOKENS_PER_RANK:
        raise ValueError(f"petit_moe: max_tokens_per_rank {max_tokens_per_rank} outside [1, "
                         f"{MAX_TOKENS_PER_RANK}] (the call tag carries the region stride in "
                         "full)")


_CONFIG_FIELDS = {"signature", "host", "identity", "token", "secret"}


def _check_token(text) -> str:
    """Rank 0's agreed token (20 hex digits: names the heartbeat page), or SetupError."""
    if not isinstance(text, str) or len(text) != 20 or \
            any(c not in "0123456789abcdef" for c in text):
        raise SetupError("petit_moe: the EP buffer's token is malformed")
    return text


def check_consistent(signatures: list[dict]) -> None:
    """Raise SetupError naming each differing argument and every rank's value unless all
    ranks' `EpBuffer.signature()` agree: a rank with another hidden size, expert count, token
    or top-k bound (the heap layout), SM count or CombineConfig (the combine's flags per
    group) would read its peers' rows at the wrong offsets."""
    if not all(isinstance(sig, dict) for sig in signatures):
        raise SetupError("petit_moe: a rank's EpBuffer signature is malformed")
    differ = [key for key in signatures[0]
              if any(sig.get(key) != signatures[0][key] for sig in signatures[1:])]
    if differ:
        raise SetupError("petit_moe: EpBuffer arguments differ between ranks (they must be "
                         "equal on all): " + "; ".join(
                             f"{key}: " + ", ".join(f"rank {r} {sig.get(key)!r}"
                                                    for r, sig in enumerate(signatures))
                             for key in differ))


class EpBuffer:
    """Expert-parallel dispatch/combine over a linearized symmetric heap (one node, bf16).

    Collective: every rank of `group` constructs it with the same arguments, in the same
    order relative to other EpBuffers. `group` may be any torch.distributed group (gloo is
    fine; it only carries the rendezvous).

    Args:
        group: the EP process group (all ranks on this node).
        hidden_size: H, a multiple of 8.
        num_experts: E, divisible by the world size, <= 512.
        max_tokens_per_rank: the largest T a dispatch may carry; sizes the heap
            (2 * W * T_max * H * 2 bytes of rows per rank), at most
            limits.MAX_TOKENS_PER_RANK (65536: the flags' call tag holds the region stride in
            full). Larger calls raise ValueError.
        max_top_k: the largest top-k (<= 16).
        num_sms: blocks of the persistent dispatch/combine grid (default: every SM).
        timeout_s: bound of every spin-wait, in (0, 3600] seconds (limits.MAX_TIMEOUT_S).
            When it expires the kernel reads the peer process's heartbeat (a host word its
            thread increments every timeout_s / 8): a peer that still beats is slow, not dead,
            and the wait goes on; one that stopped is reported (rank, peer, token group and
            epoch: `diagnostics`) within 1.5 x timeout_s and the kernel traps.
        max_wait_s: bound of a wait on a peer whose process still beats, in
            [timeout_s, 86400] seconds (limits.MAX_WAIT_S): a live but stuck peer is reported
            after it.
        validate_ids: check expert ids on the host (one sync) when not capturing a graph.
            Like any error of a collective call, a bad id raises on this rank and ends its
            part in the protocol (its peers are told within one wait bound; later calls raise
            BufferAbortedError).
        config: how combine splits its grid and its work
            (:class:`~vllm_petit_moe.config.CombineConfig`; default: its defaults). Equal on
            all ranks, like the other arguments: the chunks a peer's flags count follow it.
    """

    def __init__(self, group: dist.ProcessGroup, *, hidden_size: int, num_experts: int,
                 max_tokens_per_rank: int, max_top_k: int = MAX_TOP_K,
                 num_sms: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S, validate_ids: bool = True,
                 config: CombineConfig | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._ctx = None
        self._aborted: str | None = None  # why this rank left the protocol (_collective)
        self._num_dispatches = 0  # dispatches so far; CombineHandle.dispatch_index
        self._combine_due: int | None = None  # the dispatch a combine may answer now
        self._megamoe_workspaces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.max_tokens_per_rank = max_tokens_per_rank
        self.max_top_k = max_top_k
        self.validate_ids = validate_ids
        self.config = CombineConfig() if config is None else config
        self.timeout_s = timeout_s
        # Setup: every step ends in a bounded agreement (rendezvous.Agreement, over the
        # group's store: no collective on `group`), so a step that fails on one rank raises
        # SetupError on all, at the same step, and none blocks in a later collective.
        self._agreement = Agreement(group, "ep-buffer")
        error = None
        try:
            validate_config(world_size=self.world_size, hidden_size=hidden_size,
                            num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank,
                            max_top_k=max_top_k)
            self.timeout_s = check_timeout_s(timeout_s)
            self.max_wait_s = check_max_wait_s(max_wait_s, self.timeout_s)
            if not isinstance(self.config, CombineConfig):
                raise TypeError(f"petit_moe: config must be a CombineConfig, got "
                                f"{type(self.config).__name__}")
            self.device, self.num_sms = _local_device(num_sms)
        except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
            error = f"{type(e).__name__}: {e}"
        self.num_local_experts = num_experts // max(self.world_size, 1)
        # What must be equal on every rank (the heap layout, the owner of each expert id, the
        # combine's plan), with the host name and the process (pid, uid) of each rank, and
        # rank 0's token (names the heartbeat page) and descriptor secret (32 random bytes:
        # names the sockets and signs the descriptor messages; docs/faults.md, "Threat model").
        first = self.rank == 0
        records = self._agreement("config", error, {
            "signature": self.signature(), "host": socket.gethostname(),
            "identity": local_identity(),
            "token": secrets.token_hex(10) if first else None,
            "secret": secrets.token_hex(32) if first else None})
        # Every rank checks the same agreed records, so each check raises on all or none.
        if not all(isinstance(r, dict) and _CONFIG_FIELDS <= r.keys() for r in records):
            raise SetupError("petit_moe: a rank's EP buffer configuration record is malformed")
        check_consistent([r["signature"] for r in records])
        check_single_node([r["host"] for r in records])
        identities = check_identities([r["identity"] for r in records])
        secret = parse_secret(records[0]["secret"])
        token = _check_token(records[0]["token"])
        self._ctx = self._step("heap", lambda: _ops().EpContext(
            self.device.index, self.rank, self.world_size, max_tokens_per_rank, hidden_size,
            max_top_k, num_experts, self.num_sms, self.timeout_s,
            combine_config=as_dict(self.config)))
        try:
            fds = exchange_fds(self._agreement, self._ctx.export_fd, identities, secret)
            # map_peers takes the descriptors (closes every one, mapped or not) and zeroes
            # this rank's flags: the agreement orders that before any peer writes them.
            self._step("map", lambda: self._ctx.map_peers(fds))
            self._verify_mapping()
            self._attach_heartbeat(f"/petit_moe_hb_{token}")
        except BaseException:
            self._ctx.close()
            self._ctx = None
            raise
        self.footprint_bytes = self._ctx.heap_bytes
        logger.info("petit_moe: EP buffer rank %d/%d: heap %.1f MiB per rank (%d tokens/rank "
                    "x hidden %d x top-%d), %d SMs", self.rank, self.world_size,
                    self.footprint_bytes / 2**20, max_tokens_per_rank, hidden_size,
                    max_top_k, self.num_sms)

    def signature(self) -> dict:
        """The arguments that must be equal on every rank (exchanged at creation)."""
        return {"world_size": self.world_size, "hidden_size": self.hidden_size,
                "num_experts": self.num_experts,
                "max_tokens_per_rank": self.max_tokens_per_rank, "max_top_k": self.max_top_k,
                "num_sms": getattr(self, "num_sms", None),
                "config": as_dict(self.config) if isinstance(self.config, CombineConfig)
                else repr(self.config)}

    def _step(self, name: str, fn):
        """fn() on this rank, then agree on every rank's outcome; returns fn's result."""
        result, error = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank by the agreement
            error = f"{type(e).__name__}: {e}"
        try:
            self._agreement(name, error)
        except BaseException:
            close = getattr(result, "close", None)
            if close is not None:
                close()
            raise
        return result

    # ------------------------------------------------------------------ setup checks
    def _attach_heartbeat(self, name: str) -> None:
        """The heartbeat page (docs/faults.md): rank 0 creates it, then the others open it;
        every rank maps it for its GPU and starts its beat. Unlinked (rank 0) once all have it
        mapped, or on failure: nothing is left in /dev/shm."""
        period_s = self.timeout_s / 8
        attach = lambda create: lambda: self._ctx.attach_heartbeat(  # noqa: E731
            name, create, period_s, self.max_wait_s)
        try:
            self._step("heartbeat page", attach(True) if self.rank == 0 else lambda: None)
            self._step("heartbeat", attach(False) if self.rank != 0 else lambda: None)
        finally:
            if self.rank == 0:
                self._ctx.unlink_heartbeat(name)

    def _verify_mapping(self) -> None:
        """Every rank writes a signature into its own heap; each reads all of them back
        through the linear range. Catches a broken mapping before any kernel relies on it."""
        offset = _ops().heap_layout(self.world_size, self.max_tokens_per_rank,
                                    self.hidden_size, self.max_top_k)["combine_rows"]
        signature = lambda r: torch.arange(16, dtype=torch.uint8, device=self.device) + 16 * r  # noqa: E731

        def write():
            self._ctx.heap_view(self.rank, offset, 16).copy_(signature(self.rank))
            _synchronize(self.device)

        def read():
            for r in range(self.world_size):
                got = self._ctx.heap_view(r, offset, 16)
                if not torch.equal(got, signature(r)):
                    raise RuntimeError(f"rank {self.rank} reads a wrong signature from rank "
                                       f"{r}'s heap through the linear mapping")

        self._step("write signature", write)
        self._step("read signatures", read)  # nobody overwrites the region before all read

    def _check_open(self) -> None:
        if self._aborted is not None:
            raise BufferAbortedError(
                f"petit_moe: EpBuffer rank {self.rank} left the collective protocol after an "
                f"error in a {self._aborted} (its peers were told: its heartbeat is marked "
                "aborted); close it and rebuild the group")
        if self._ctx is None:
            raise RuntimeError("petit_moe: EpBuffer is closed")

    @contextlib.contextmanager
    def _collective(self, what: str):
        """One collective call (dispatch, combine, megamoe). When it raises on this rank
        (bad arguments or ids, a refused launch, an interrupt), the peers already wait for
        this call and would see a live process for max_wait_s: the rank leaves the protocol
        instead, marking its heartbeat aborted (EpContext.abort) so their waits fail within
        one bound, and the buffer refuses later calls (BufferAbortedError)."""
        self._check_open()
        try:
            yield
        except BaseException:
            self._aborted = what
            ctx = self._ctx
            if ctx is not None:
                try:
                    ctx.abort()
                except Exception:  # noqa: BLE001 - the original error is the one to raise
                    logger.exception("petit_moe: marking rank %d's heartbeat aborted failed",
                                     self.rank)
            logger.error("petit_moe: EpBuffer rank %d left the protocol: its %s raised; its "
                         "peers' waits will fail (peer aborted)", self.rank, what)
            raise

    # -------------------------------------------------------------------- hot path
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 region_stride: int | None = None, quant: str | None = None) -> DispatchOutput:
        """Send each token once to every rank owning one of its experts.

        Args:
            x: [T, H] bfloat16 tokens of this rank (T <= region_stride).
            topk_ids: [T, K] int32/int64 global expert ids in [0, E), -1 = unused slot.
            topk_weights: [T, K] float32.
            region_stride: R, equal on every rank and >= every rank's T
                (default: max_tokens_per_rank). The output has W*R rows.
            quant: None (bf16 rows), "fp8_block128" (e4m3 + one scale per 1x128 block,
                H % 128 == 0), "fp8_block128_ue8m0" (the same with power-of-two scales, as
                vLLM quantizes when its DeepGEMM E8M0 scales are on) or "fp8_per_token" (e4m3
                + one scale per token): quantized at the source inside dispatch, so the wire
                carries half the bytes. Equal on every rank. Formulas:
                testing.reference.quantize_fp8_reference.
        No host synchronization (unless validate_ids and not capturing); capturable in a
        CUDA graph. Collective: every rank calls it.
        """
        with self._collective("dispatch"):
            region_stride = self.max_tokens_per_rank if region_stride is None else region_stride
            self._validate_dispatch(x, topk_ids, topk_weights, region_stride)
            if quant not in DISPATCH_QUANT:
                raise ValueError(f"petit_moe: quant must be one of {list(DISPATCH_QUANT)}, got "
                                 f"{quant!r}")
            if quant in FP8_BLOCK_MODES and self.hidden_size % FP8_SCALE_BLOCK:
                raise ValueError(f"petit_moe: {quant} needs a hidden size that is a multiple "
                                 f"of {FP8_SCALE_BLOCK}, got {self.hidden_size}")
            recv_x, recv_ids, recv_weights, recv_scales = self._ctx.dispatch(
                x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), region_stride,
                DISPATCH_QUANT[quant])
            self._num_dispatches += 1
            self._combine_due = self._num_dispatches
            handle = CombineHandle(num_tokens=x.shape[0], top_k=topk_ids.shape[1],
                                   region_stride=region_stride,
                                   dispatch_index=self._num_dispatches)
            return DispatchOutput(recv_x, recv_ids, recv_weights, handle,
                                  recv_scales if quant else None)

    def megamoe(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor, w2: torch.Tensor, region_stride: int | None = None,
                out: torch.Tensor | None = None,
                trace: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The whole EP MoE layer in one launch per rank (the fused kernel,
        csrc/experts/megamoe.cu): dispatch, this rank's experts on the rows it receives, and
        combine. The result equals ``combine(experts_forward(dispatch(...)))`` up to fp32
        rounding order.

        Args:
            x, topk_ids, topk_weights, region_stride: as in :meth:`dispatch` (bf16 rows).
            w13: [L, 2I, H] bf16 and w2: [L, H, I] bf16, this rank's experts
                (L = num_experts / W), H and I multiples of 64; W * R * K <= 2048 routing
                entries (``ops.MEGAMOE_MAX_ENTRIES``). Or block fp8: float8_e4m3fn with
                ``w13_scale [L, 2I/128, H/128]`` and ``w2_scale [L, H/128, I/128]`` float32
                (as :func:`ops.megamoe_forward` takes them; H and I multiples of 128).
            out: [T, H] bf16 (optional), written in full.
            trace: optional int64 [2 * num_sms, MEGAMOE_TRACE_SLOTS] on this buffer's device
                (:meth:`new_megamoe_trace`): thread 0 of each block stamps its timeline (entry,
                routing done after every rank's rows arrived, each task's ready and done,
                exit; layout.h), read by ``tools/megamoe_trace.py``. For diagnosis only.
        Returns out. sm_90a only. No host synchronization (unless validate_ids and not
        capturing); capturable in a CUDA graph. Collective: every rank calls it (not mixed
        with another rank's dispatch or combine of the same epoch: that is reported as a
        fault). The grid takes two blocks on each of the buffer's num_sms SMs, all resident at once
        (its blocks and ranks spin on each other): a grid the GPU cannot hold (occupancy x
        SMs) is refused at launch (RuntimeError, which ends the buffer like any error of a
        collective call). What no launch can check, the caller guarantees: those SMs are
        free for it, no other kernel running on the GPU meanwhile (another stream, another
        process or rank sharing the GPU, MPS clients); otherwise the waits time out and trap
        (docs/faults.md). recv_tokens_per_rank does not describe these calls.
        """
        from .ops import _megamoe_sync_buffer, check_block_scales, megamoe_unsupported_reason
        with self._collective("megamoe"):
            region_stride = self.max_tokens_per_rank if region_stride is None else region_stride
            self._validate_dispatch(x, topk_ids, topk_weights, region_stride)
            top_k, local = topk_ids.shape[1], self.num_local_experts
            if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != local or w2.shape[0] != local \
                    or w13.shape[2] != self.hidden_size or w2.shape[1] != self.hidden_size \
                    or w2.shape[2] * 2 != w13.shape[1] \
                    or w13.dtype not in (torch.bfloat16, torch.float8_e4m3fn) \
                    or w2.dtype != w13.dtype:
                raise ValueError(f"petit_moe: megamoe needs w13 [L={local}, 2I, H="
                                 f"{self.hidden_size}] and w2 [L, H, I], both bfloat16 or both "
                                 f"float8_e4m3fn, got {w13.dtype} {tuple(w13.shape)} and "
                                 f"{w2.dtype} {tuple(w2.shape)}")
            inter = w2.shape[2]
            fp8 = w13.dtype == torch.float8_e4m3fn
            reason = megamoe_unsupported_reason(self.world_size * region_stride, top_k,
                                                self.hidden_size, inter, fp8=fp8)
            if reason is not None:
                raise ValueError(f"petit_moe: megamoe over W x R = {self.world_size} x "
                                 f"{region_stride} rows: {reason}")
            check_block_scales(fp8, w13_scale, w2_scale, local, self.hidden_size, inter,
                                self.device)
            if out is None:
                out = torch.empty_like(x)
            elif out.shape != x.shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
                raise ValueError(f"petit_moe: out must be contiguous bfloat16 {tuple(x.shape)}")
            act, partial = self._megamoe_workspace(inter)
            # int64 ids outside [-1, E) become E (dropped and counted by the kernel), never an
            # int32 alias of a real expert
            ids = topk_ids if topk_ids.dtype == torch.int32 else torch.where(
                (topk_ids >= -1) & (topk_ids < self.num_experts), topk_ids,
                self.num_experts).to(torch.int32)
            self._ctx.megamoe(x.contiguous(), ids.contiguous(), topk_weights.contiguous(),
                              w13.contiguous(), w2.contiguous(), out, act, partial,
                              _megamoe_sync_buffer(self.device, local, self.hidden_size),
                              region_stride, trace=trace, w13_scale=w13_scale,
                              w2_scale=w2_scale)
            self._combine_due = None  # the fused call took the epoch: no combine answers it
            return out

    def new_megamoe_trace(self) -> torch.Tensor:
        """A trace tensor for :meth:`megamoe`: int64 [2 * num_sms, MEGAMOE_TRACE_SLOTS],
        filled with -1."""
        return torch.full((MEGAMOE_BLOCKS_PER_SM * self.num_sms, MEGAMOE_TRACE_SLOTS), -1,
                          dtype=torch.int64, device=self.device)

    def megamoe_workspace_bytes(self, intermediate_size: int) -> int:
        """Device bytes of :meth:`megamoe`'s workspace for layers of this intermediate size
        (besides the heap): the activations (bf16) and partial rows (fp32) of
        ``MEGAMOE_MAX_ENTRIES`` routing entries, allocated at the first call (or by
        :meth:`reserve_megamoe_workspace`) and shared by every layer of that size."""
        return MEGAMOE_MAX_ENTRIES * (2 * intermediate_size + 4 * self.hidden_size)

    def reserve_megamoe_workspace(self, intermediate_size: int) -> int:
        """Allocate :meth:`megamoe`'s workspace for layers of this intermediate size now
        (idempotent; vLLM's glue calls it while the model is built, so the memory profiler
        counts it); returns its bytes."""
        self._check_open()
        self._megamoe_workspace(intermediate_size)
        return self.megamoe_workspace_bytes(intermediate_size)

    def _megamoe_workspace(self, intermediate_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Sized for the largest call, so a step's tensors never change between calls: a CUDA
        # graph captured with them stays valid whatever R later steps use.
        spaces = self._megamoe_workspaces
        if intermediate_size not in spaces:
            spaces[intermediate_size] = (
                torch.empty(MEGAMOE_MAX_ENTRIES * intermediate_size, dtype=torch.bfloat16,
                            device=self.device),
                torch.empty(MEGAMOE_MAX_ENTRIES * self.hidden_size, dtype=torch.float32,
                            device=self.device))
        return spaces[intermediate_size]

    def combine(self, expert_out: torch.Tensor, handle: CombineHandle,
                out: torch.Tensor | None = None,
                trace: torch.Tensor | None = None) -> torch.Tensor:
        """Return each destination's reduced row to its source and sum them there.

        Args:
            expert_out: [W*R, H] bfloat16 in the dispatch layout; row s*R+i must hold the
                weighted sum over this rank's experts of token i of source s (only rows
                routed here are read).
            handle: from the dispatch this answers (the latest one on this buffer).
            out: optional [T, H] bfloat16 output.
            trace: optional int64 [num_sms, len(COMBINE_TRACE_SLOTS)] on this buffer's device
                (see :meth:`new_combine_trace`): each block of the kernel writes its timeline
                into its row (``COMBINE_TRACE_SLOTS``;
                ``testing.combine_trace.summarize_combine_trace`` reads it).
                For diagnosis: the untraced combine is the one to time.
        Returns y [T, H] bfloat16: y[i] = sum over ranks d routed by token i of
        expert_out_d[rank*R + i], accumulated in fp32.
        """
        with self._collective("combine"):
            if not isinstance(handle, CombineHandle) or handle.dispatch_index < 1 or \
                    handle.dispatch_index != self._combine_due:
                raise ValueError(
                    "petit_moe: combine must answer this buffer's latest dispatch, once (the "
                    "kernel waits at that dispatch's epoch: a repeated, late or unpaired "
                    f"combine would read stale rows); handle of dispatch "
                    f"{getattr(handle, 'dispatch_index', None)}, latest dispatch "
                    f"{self._num_dispatches}"
                    + (" already combined or followed by a fused call"
                       if self._combine_due is None else ""))
            rows = self.world_size * handle.region_stride
            if expert_out.dtype != torch.bfloat16 or tuple(expert_out.shape) != (rows, self.hidden_size):
                raise ValueError(f"petit_moe: expert_out must be bfloat16 [{rows}, {self.hidden_size}]"
                                 f" (world*region_stride, hidden), got {expert_out.dtype} "
                                 f"{list(expert_out.shape)}")
            if out is None:
                out = torch.empty(handle.num_tokens, self.hidden_size, dtype=torch.bfloat16,
                                  device=self.device)
            elif out.dtype != torch.bfloat16 or tuple(out.shape) != (handle.num_tokens, self.hidden_size):
                raise ValueError(f"petit_moe: out must be bfloat16 [{handle.num_tokens}, "
                                 f"{self.hidden_size}], got {out.dtype} {list(out.shape)}")
            if trace is not None:
                check_combine_trace(trace, self.num_sms, self.device)
            self._ctx.combine(expert_out.contiguous(), out, handle.top_k, handle.region_stride,
                              trace)
            self._combine_due = None
            return out

    def new_combine_trace(self) -> torch.Tensor:
        """A trace tensor for :meth:`combine`: int64 [num_sms, slots], filled with -1 (rows
        of blocks the combine does not launch stay -1)."""
        return torch.full((self.num_sms, len(COMBINE_TRACE_SLOTS)), -1, dtype=torch.int64,
                          device=self.device)

    def _validate_dispatch(self, x, topk_ids, topk_weights, region_stride) -> None:
        if x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(f"petit_moe: x must be a 2-D bfloat16 tensor, got {x.dtype} "
                             f"{list(x.shape)}")
        if x.shape[1] != self.hidden_size:
            raise ValueError(f"petit_moe: x hidden size {x.shape[1]} != buffer hidden size "
                             f"{self.hidden_size}")
        num_tokens = x.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or \
                topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"petit_moe: topk_ids must be int32/int64 [{num_tokens}, K], got "
                             f"{topk_ids.dtype} {list(topk_ids.shape)}")
        top_k = topk_ids.shape[1]
        if not 1 <= top_k <= self.max_top_k:
            raise ValueError(f"petit_moe: top-k {top_k} outside [1, {self.max_top_k}] "
                             "(max_top_k of this buffer)")
        if topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != (num_tokens, top_k):
            raise ValueError(f"petit_moe: topk_weights must be float32 [{num_tokens}, {top_k}], "
                             f"got {topk_weights.dtype} {list(topk_weights.shape)}")
        if region_stride > self.max_tokens_per_rank:
            raise ValueError(f"petit_moe: region_stride {region_stride} exceeds the buffer's "
                             f"max_tokens_per_rank {self.max_tokens_per_rank}")
        if num_tokens > region_stride:
            raise ValueError(f"petit_moe: {num_tokens} tokens exceed "
                             + (f"the buffer's max_tokens_per_rank {self.max_tokens_per_rank}"
                                if region_stride == self.max_tokens_per_rank
                                else f"region_stride {region_stride}")
                             + "; split the call into chunks")
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if t.device != self.device:
                raise ValueError(f"petit_moe: {name} is on {t.device}, the buffer on {self.device}")
        if self.validate_ids and num_tokens > 0 and not torch.cuda.is_current_stream_capturing():
            bad = (topk_ids < -1) | (topk_ids >= self.num_experts)
            if bool(bad.any()):
                raise ValueError(f"petit_moe: top-k ids must be in [-1, {self.num_experts}) "
                                 f"(num_experts); got min {int(topk_ids.min())}, "
                                 f"max {int(topk_ids.max())}")

    # ------------------------------------------------------------------ inspection
    def recv_tokens_per_rank(self, handle: CombineHandle) -> torch.Tensor:
        """[W] int32 on the device: rows received from each source in the last dispatch."""
        groups = -(-handle.region_stride // TOKEN_GROUP_SIZE)
        return self._ctx.recv_group_counts()[:, :groups].sum(dim=1, dtype=torch.int32)

    def diagnostics(self) -> dict:
        """The buffer's diagnostic record (pinned host memory: no device sync, readable after
        a trap): ``error`` ("" none, "timeout", "mismatch"), ``timed_out`` (0/1), ``rank``,
        ``peer``, ``phase`` ("dispatch"/"combine"), ``group``, ``expected_epoch``,
        ``observed_epoch``, ``expected_tag``, ``observed_tag``, ``peer_alive`` (1: the peer's
        process still beat, the wait reached max_wait_s) of the first failed wait; and
        ``dropped_ids``: routing slots with ids outside [-1, num_experts) that dispatches
        treated as -1 (validate_ids=False or under graph capture), as far as the device has
        written it."""
        return dict(self._ctx.diagnostics()) if self._ctx is not None else {}

    def fault(self) -> str | None:
        """The sentence describing a failed wait (see `PeerFaultError`), or None."""
        return describe_fault(self.diagnostics())

    def synchronize(self) -> None:
        """torch.cuda.synchronize on this buffer's device, turning a trapped dispatch/combine
        into a PeerFaultError that names the phase, peer, token group and epoch."""
        try:
            _synchronize(self.device)
        except RuntimeError as e:
            fault = self.fault()
            if fault is not None:
                raise PeerFaultError(fault) from e
            raise

    def peer_write(self, src: torch.Tensor, bytes_per_peer: int) -> None:
        """Benchmark ceiling: push `bytes_per_peer` of `src` into every peer's heap with the
        same SM copy loop and grid as dispatch (self excluded). Not a collective sync."""
        self._check_open()
        self._ctx.peer_write(src, bytes_per_peer, self.num_sms)

    def close(self) -> None:
        """Wait for the device (without holding the GIL), then stop the heartbeat (marked
        aborted: a peer still waiting for this rank fails within one bound) and release the
        heap: unmapped once no DispatchOutput tensor holds it either. Collective in spirit:
        peers must not use this rank's heap afterwards. Idempotent."""
        ctx, self._ctx = self._ctx, None  # no call of another thread starts on it from here
        self._megamoe_workspaces = {}
        if ctx is not None:
            ctx.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
