"""The process's cache of ``EpBuffer`` objects (``vllm_petit_moe.buffer``): one communication
buffer per process, shared by all MoE layers of a model.

``get_or_create_buffer`` semantics (what the glue relies on):

- **Collective on first use**: the first call for a key constructs an ``EpBuffer``, which is a
  collective over ``group`` (every EP rank allocates its heap and maps its peers'). Callers
  must therefore make the same sequence of calls, with the same arguments, on every rank.
  vLLM builds its MoE layers in the same order on every rank from the same config, and the
  hook's decision depends only on that config and on facts that are equal on all ranks, so
  the calls it makes from ``FusedMoEKernel.__init__`` meet this.
- **Key**: (group, hidden_size, num_experts). Layers with the same key share one buffer (the
  normal case: all layers of a model). A layer with another hidden size or expert count gets
  a buffer of its own, created collectively like the first.
- **No growth**: a later call for an existing key that asks for more tokens per rank or a
  larger top-k than the buffer was built with raises ``ValueError`` (all layers of one vLLM
  instance ask for the same sizes, so this indicates a bug, not a configuration to support).
  Smaller requests reuse the buffer.
- The footprint of each new buffer is logged at INFO on every rank.
- **Failures are remembered**: a creation that raised (on every rank together: ``EpBuffer``'s
  setup agrees on each step) raises the same error for every later call with that key,
  without a new collective, so all layers fall back to vLLM's path alike.
- **Faults are logged as they happen**: a daemon thread per buffer reads its diagnostic
  record (``EpBuffer.diagnostics()``, pinned host memory: no device sync) twice a second and
  logs a failed wait (phase, peer, token group, epoch) at ERROR the moment the kernel writes
  it, before the trap surfaces as a generic CUDA error in vLLM; and warns when dispatch
  dropped routing ids outside [-1, E).

- **Closed with their group**: when vLLM's shutdown destroys a group (``GroupCoordinator
  .destroy``, reached by ``destroy_model_parallel``), the buffers built on it are closed first
  and forgotten, fault watch included (``compat.on_group_destroy``), so an engine rebuilt in
  the same process does not keep the previous one's heap and threads.

The compiled extension is imported only when a buffer is actually created
(``vllm_petit_moe.buffer`` imports it), never by this module or by the hook's decision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_petit_moe.limits import DEFAULT_MAX_WAIT_S, DEFAULT_TIMEOUT_S, MAX_TOP_K

logger = logging.getLogger("vllm.petit_moe.buffer_cache")


@dataclass(frozen=True)
class BufferConfig:
    """Sizes an ``EpBuffer`` is built for (see ``vllm_petit_moe.buffer.EpBuffer``)."""

    hidden_size: int
    num_experts: int
    max_tokens_per_rank: int
    max_top_k: int = MAX_TOP_K
    num_sms: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_wait_s: float = DEFAULT_MAX_WAIT_S


@dataclass
class _Entry:
    group: Any  # kept alive so that id(group) stays unique while the entry exists
    config: BufferConfig
    buffer: Any


_BUFFERS: dict[tuple[int, int, int], _Entry] = {}
_FAILED: dict[tuple[int, int, int], Exception] = {}
FAULT_POLL_S = 0.5


class FaultWatch:
    """Logs a buffer's faults from its diagnostic record (see the module docstring)."""

    def __init__(self, buffer: Any, interval_s: float = FAULT_POLL_S):
        import threading

        self.buffer, self.interval_s = buffer, interval_s
        self.reported_fault = False
        self.dropped_ids = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="petit-moe-fault-watch",
                                        daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """One look at the record: log a new fault (ERROR, once) or more dropped ids."""
        d = self.buffer.diagnostics()
        if not d:
            return
        fault = self.buffer.fault()
        if fault is not None and not self.reported_fault:
            self.reported_fault = True
            logger.error("vllm-petit-moe: %s. Diagnostic record: %s", fault, d)
        dropped = int(d.get("dropped_ids", 0))
        if dropped > self.dropped_ids:
            logger.warning(
                "vllm-petit-moe: dispatch treated %d routing slots with expert ids outside "
                "[-1, %s) as unused (-1) so far", dropped, getattr(self.buffer, "num_experts",
                                                                      "E"))
            self.dropped_ids = dropped

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the buffer closed under us
                return

    def stop(self) -> None:
        self._stop.set()


def _create_buffer(group: Any, config: BufferConfig) -> Any:
    """Construct an ``EpBuffer`` (collective over ``group``). Replaced in CPU tests."""
    from vllm_petit_moe.buffer import EpBuffer

    return EpBuffer(
        group,
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        max_tokens_per_rank=config.max_tokens_per_rank,
        max_top_k=config.max_top_k,
        num_sms=config.num_sms,
        timeout_s=config.timeout_s,
        max_wait_s=config.max_wait_s,
        # No host sync on vLLM's forward path (DESIGN.md): validate_ids would sync once per
        # layer in every eager step (prefills beyond the CUDA-graph sizes, --enforce-eager).
        # vLLM's router only emits ids in [0, E).
        validate_ids=False,
    )


def _close_with_the_group() -> None:
    """Have vLLM's shutdown close our buffers before it destroys their group (compat)."""
    try:
        from vllm_petit_moe.vllm_glue import compat

        installed = compat.on_group_destroy(close_buffers_of_group)
    except Exception:  # noqa: BLE001 - no vLLM (benchmarks, tests): close_all_buffers remains
        installed = False
    if not installed:
        logger.debug("vllm-petit-moe: no group-destroy hook; buffers close at process exit")


def get_or_create_buffer(group: Any, config: BufferConfig) -> Any:
    """The process's ``EpBuffer`` for ``(group, config.hidden_size, config.num_experts)``.

    Creates it (a collective over ``group``) on first use; see the module docstring.
    """
    key = (id(group), config.hidden_size, config.num_experts)
    if key in _FAILED:
        raise RuntimeError(f"vllm-petit-moe: EP buffer creation failed earlier: {_FAILED[key]}")
    entry = _BUFFERS.get(key)
    if entry is not None:
        built = entry.config
        if (
            config.max_tokens_per_rank > built.max_tokens_per_rank
            or config.max_top_k > built.max_top_k
        ):
            raise ValueError(
                f"vllm-petit-moe: a MoE layer needs an EpBuffer with max_tokens_per_rank="
                f"{config.max_tokens_per_rank}, max_top_k={config.max_top_k}, but the shared "
                f"buffer was built for {built.max_tokens_per_rank}, {built.max_top_k}; "
                "growing a buffer is not supported (it would need a collective re-creation "
                "while other layers hold the old one)"
            )
        return entry.buffer

    try:
        buffer = _create_buffer(group, config)
    except Exception as e:
        _FAILED[key] = e
        raise
    _BUFFERS[key] = _Entry(group, config, buffer)
    _close_with_the_group()
    if callable(getattr(buffer, "fault", None)):
        buffer.fault_watch = FaultWatch(buffer)
    footprint = getattr(buffer, "footprint_bytes", None)
    logger.info(
        "vllm-petit-moe: EpBuffer rank %s/%s, hidden %d, %d experts, %d tokens/rank, "
        "top-k <= %d: %s",
        getattr(buffer, "rank", "?"),
        getattr(buffer, "world_size", "?"),
        config.hidden_size,
        config.num_experts,
        config.max_tokens_per_rank,
        config.max_top_k,
        f"{footprint / 2**20:.1f} MiB" if isinstance(footprint, int) else "footprint unknown",
    )
    return buffer


def _close_entry(entry: _Entry) -> None:
    watch = getattr(entry.buffer, "fault_watch", None)
    if watch is not None:
        watch.stop()
    close = getattr(entry.buffer, "close", None)
    if close is not None:
        close()


def close_all_buffers() -> None:
    """Close and forget every cached buffer (tests, benchmarks, clean shutdown).

    Collective in the same sense as creation if ``EpBuffer.close`` is: call it on all ranks.
    """
    _FAILED.clear()
    while _BUFFERS:
        _, entry = _BUFFERS.popitem()
        _close_entry(entry)


def close_buffers_of_group(group: Any) -> int:
    """Close and forget the buffers built on ``group`` (and forget its failed creations):
    what vLLM's engine shutdown calls, through ``compat.on_group_destroy``, before it
    destroys the group. Returns how many were closed. Every rank's shutdown destroys its EP
    group, so this runs on all ranks, like the creation."""
    for key in [k for k in _FAILED if k[0] == id(group)]:
        del _FAILED[key]
    closed = 0
    for key, entry in list(_BUFFERS.items()):
        if entry.group is group:
            del _BUFFERS[key]
            _close_entry(entry)
            closed += 1
    if closed:
        logger.info("vllm-petit-moe: closed %d EP buffer(s) with their group", closed)
    return closed
