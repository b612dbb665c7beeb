"""CPU: the fused MoE layer (csrc/experts/megamoe.cu) runs unchanged under the
thread-per-GPU-thread emulation (tests/emu/megamoe_emu.cpp, mma.sync from emu_ptx.h), against a
plain torch reference: routing in every block's shared memory, ordered task claims, the
gate/up -> down hand-off through per-expert counters, the per-row-tile reduction by the last
arrival, and the counter reset that lets the next call start from zeros.

Every output is poisoned (NaN) before the kernel runs, and inputs are fresh random data.
"""

import ctypes
import re

import pytest
import torch

from conftest import build_emu_library

MAX_ENTRIES = 2048


def reference_moe(x, ids, weights, w13, w2, expert_map=None):
    """out[n] = Σ_k w[n,k] · w2[e] · bf16(silu(x w13[e, :I]^T) * (x w13[e, I:]^T)), in float64,
    e the local expert of slot k (ids mapped through expert_map; invalid slots skipped)."""
    num_local, intermediate = w13.shape[0], w13.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for n in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[n, k])
            if expert_map is not None:
                e = int(expert_map[e]) if 0 <= e < expert_map.numel() else -1
            if not 0 <= e < num_local:
                continue
            h = x[n].double() @ w13[e].double().T
            act = (torch.nn.functional.silu(h[:intermediate]) * h[intermediate:])
            act = act.to(torch.bfloat16).double()
            out[n] += float(weights[n, k]) * (act @ w2[e].double().T)
    return out


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return build_emu_library(tmp_path_factory, "megamoe_emu")


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def make_case(seed, num_rows, top_k, hidden, intermediate, num_local, *, invalid=0.15,
              ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=g).to(torch.bfloat16)
    if ids is None:
        ids = torch.randint(0, num_local, (num_rows, top_k), generator=g, dtype=torch.int32)
        ids[torch.rand(num_rows, top_k, generator=g) < invalid] = -1
    weights = torch.rand(num_rows, top_k, generator=g)
    w13 = (torch.randn(num_local, 2 * intermediate, hidden, generator=g) / hidden**0.5)
    w2 = (torch.randn(num_local, hidden, intermediate, generator=g) / intermediate**0.5)
    return x, ids, weights, w13.to(torch.bfloat16), w2.to(torch.bfloat16)


# the emulated device's L2: with 0 the launcher splits experts' rows into 16-row groups (its
# rule where the grid's weight tiles exceed L2) in every call of more than 16 routing entries;
# WHOLE_L2 keeps one group per expert (passes)
WHOLE_L2 = 1 << 30


def run_emu(emu, x, ids, weights, w13, w2, *, num_sms=1, at_once=True, sync=None,
            expert_map=None, trace=None, l2_bytes=0, w13_scale=None, w2_scale=None):
    num_rows, hidden = x.shape
    top_k, num_local, intermediate = ids.shape[1], w13.shape[0], w13.shape[1] // 2
    entries = max(1, num_rows * top_k)
    act = torch.full((entries, intermediate), float("nan")).to(torch.bfloat16)
    partial = torch.full((entries, hidden), float("nan"))
    out = torch.full((num_rows, hidden), float("nan")).to(torch.bfloat16)
    if sync is None:
        sync = torch.zeros(emu.petit_emu_megamoe_sync_ints(num_local, hidden), dtype=torch.int32)
    rc = emu.petit_emu_megamoe(
        _ptr(x), _ptr(ids.contiguous()), _ptr(expert_map),
        0 if expert_map is None else expert_map.numel(), _ptr(weights.contiguous()),
        _ptr(w13), _ptr(w2), _ptr(act), _ptr(partial), _ptr(sync), _ptr(out), num_rows, top_k,
        hidden, intermediate, num_local, num_sms, int(at_once), _ptr(trace), l2_bytes,
        _ptr(w13_scale), _ptr(w2_scale))
    return rc, out, sync


def assert_close(out, ref):
    assert not out.isnan().any(), "output element never written"
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    # bf16 output rounding alone is ~2e-3 relative; fp32 sums in another order add ~1e-6
    assert err < 4e-3, f"relative error {err}"


@pytest.mark.parametrize("seed,num_rows,top_k,hidden,intermediate,num_local,num_sms", [
    (0, 1, 1, 64, 64, 1, 1),       # one token, one expert, one k step for one warp only
    (1, 3, 4, 64, 128, 4, 1),
    (2, 5, 2, 192, 64, 3, 2),      # 3 k steps over 8 warps: uneven warp split
    (3, 19, 3, 128, 192, 5, 2),    # odd counts
    (4, 40, 2, 64, 64, 2, 1),      # > 16 rows per expert: several row groups or passes
    (5, 2, 2, 1536, 1344, 2, 1),   # 5-6 k steps per warp, one n-tile
    (6, 12, 2, 1536, 320, 2, 1),   # 5-6 k steps per warp, two n-tiles (> 8 rows per expert)
])
def test_matches_reference(emu, seed, num_rows, top_k, hidden, intermediate, num_local, num_sms):
    """With 16-row groups and with one group per expert (passes): the reference, and the same
    bits."""
    case = make_case(seed, num_rows, top_k, hidden, intermediate, num_local)
    outs = []
    for l2_bytes in (0, WHOLE_L2):
        rc, out, sync = run_emu(emu, *case, num_sms=num_sms, l2_bytes=l2_bytes)
        assert rc == 0
        assert_close(out, reference_moe(*case))
        assert int(sync.abs().sum()) == 0, "counters not reset for the next call"
        outs.append(out.view(torch.int16))
    assert torch.equal(outs[0], outs[1])


def quantize_block_fp8(w, block=128):
    """[L, R, C] float -> (e4m3 [L, R, C], fp32 scales [L, R/128, C/128], the dequantized
    weights in float64): the checkpoints' 128 x 128 block quantization (scale = amax / 448)."""
    num, rows, cols = w.shape
    blocks = w.view(num, rows // block, block, cols // block, block)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0
    expand = scale[:, :, None, :, None]
    q = (blocks / expand).to(torch.float8_e4m3fn)
    deq = (q.double() * expand.double()).view(num, rows, cols)
    return q.view(num, rows, cols).contiguous(), scale.float().contiguous(), deq


def make_fp8_case(seed, num_rows, top_k, hidden, intermediate, num_local, **kwargs):
    """A case with block-fp8 weights: (x, ids, weights, w13 e4m3, w2 e4m3), the scales and
    the dequantized weights the reference uses. The blocks' magnitudes differ by up to ~e^8, so
    a wrong block's scale shows; the e4m3 values include subnormals and both signs."""
    x, ids, weights, w13, w2 = make_case(seed, num_rows, top_k, hidden, intermediate, num_local,
                                         **kwargs)
    g = torch.Generator().manual_seed(seed + 1000)
    block_gain = torch.exp(2 * torch.randn(num_local, 2 * intermediate // 128, 1, hidden // 128,
                                           1, generator=g))
    w13f = (w13.float().view(num_local, 2 * intermediate // 128, 128, hidden // 128, 128)
            * block_gain).view(w13.shape)
    w2f = w2.float()
    q13, s13, d13 = quantize_block_fp8(w13f)
    q2, s2, d2 = quantize_block_fp8(w2f)
    return (x, ids, weights, q13.view(torch.uint8), q2.view(torch.uint8)), (s13, s2), (d13, d2)


@pytest.mark.parametrize("seed,num_rows,top_k,hidden,intermediate,num_local,num_sms", [
    (20, 1, 1, 128, 128, 1, 1),     # one token, one k step for one warp only
    (21, 3, 4, 256, 128, 4, 1),
    (22, 19, 3, 128, 384, 5, 2),    # odd counts, 3 down k steps over 4 warps
    (23, 40, 2, 128, 128, 2, 1),    # > 8 rows per expert: several 8-row passes
    (24, 2, 2, 1536, 1408, 2, 1),   # 3 k steps per warp
])
def test_fp8_weights_match_reference(emu, seed, num_rows, top_k, hidden, intermediate,
                                     num_local, num_sms):
    """Block-fp8 weights (e4m3 + one fp32 scale per 128 x 128 block, vLLM's layout): the
    reference on the dequantized weights, with 16-row groups and with one group per expert;
    the same bits either way."""
    case, (s13, s2), (d13, d2) = make_fp8_case(seed, num_rows, top_k, hidden, intermediate,
                                               num_local)
    x, ids, weights = case[:3]
    ref = reference_moe(x, ids, weights, d13, d2)
    outs = []
    for l2_bytes in (0, WHOLE_L2):
        rc, out, sync = run_emu(emu, *case, num_sms=num_sms, l2_bytes=l2_bytes, w13_scale=s13,
                                w2_scale=s2)
        assert rc == 0
        assert_close(out, ref)
        assert int(sync.abs().sum()) == 0, "counters not reset for the next call"
        outs.append(out.view(torch.int16))
    assert torch.equal(outs[0], outs[1])


def test_fp8_limits_rejected(emu):
    """fp8 weights need H and I multiples of the 128 scale block and both scale tensors."""
    case, (s13, s2), _ = make_fp8_case(25, 2, 2, 128, 128, 2)
    rc, out, _ = run_emu(emu, *case, w13_scale=s13, w2_scale=None)
    assert rc != 0 and out.isnan().all()
    x, ids, weights, w13, w2 = make_case(26, 2, 2, 192, 128, 2)
    w13_bytes = w13.view(torch.uint8)[..., :192].contiguous()
    rc, out, _ = run_emu(emu, x, ids, weights, w13_bytes, w2.view(torch.uint8)[..., :128].contiguous(),
                         w13_scale=torch.ones(2, 2, 2), w2_scale=torch.ones(2, 2, 1))
    assert rc != 0 and out.isnan().all()


def wide_fp8_tasks(num_rows, top_k, num_local, hidden, intermediate, grid):
    """The launcher's choice for e4m3 weights at W = 1 (megamoe.cu, wide_mask), from the
    expected active experts under uniform routing, L (1 - (1 - K/L)^N): gate/up tasks of two
    16-column tiles where the 16-column tasks would outnumber the grid; down tasks of two 32-row
    tiles too where I < 1024 and the 32-row tasks would be at least 8 grids."""
    active = num_local * (1 - (1 - min(1.0, top_k / num_local)) ** num_rows)
    if active * (intermediate // 16) <= grid:
        return False, False
    return True, intermediate < 1024 and active * (hidden // 32) >= 8 * grid


@pytest.mark.parametrize("hidden,intermediate,rows,num_sms,want", [
    (256, 256, [1], 8, (False, False)),          # 1 expert: 16 gate/up tasks, 16 blocks
    (256, 256, [1], 1, (True, False)),           # 16 on 2 blocks: wide gate/up; 8 down tasks
    (256, 256, [1, 2, 17], 1, (True, True)),     # ~4 experts: 32 short down tasks on 2 blocks
    (256, 1024, [1, 2, 17], 1, (True, False)),   # I = 1024: down tasks of 8 k steps
])
def test_fp8_wide_tasks_where_the_launcher_says(emu, hidden, intermediate, rows, num_sms, want):
    """e4m3 weights: the call's tasks are as many as the launcher's choice gives (every block's
    trace counts the tasks it ran), and the output matches the reference, with 16-row groups
    and with one group per expert. Experts of 1, 2 and 17 rows: the third makes three 8-row
    passes over both tiles of a wide task, or two row groups (20 entries > 16: the launcher
    splits where the tiles exceed L2)."""
    from vllm_petit_moe.limits import MEGAMOE_BLOCKS_PER_SM, MEGAMOE_TRACE_SLOTS
    num_local, grid = 4, MEGAMOE_BLOCKS_PER_SM * num_sms
    flat = torch.tensor([e for e, n in enumerate(rows) for _ in range(n)], dtype=torch.int32)
    ids = flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(3))]
    case, (s13, s2), (d13, d2) = make_fp8_case(40, ids.numel(), 1, hidden, intermediate,
                                               num_local, ids=ids.view(-1, 1))
    assert wide_fp8_tasks(ids.numel(), 1, num_local, hidden, intermediate, grid) == want
    subs = [2 if w else 1 for w in want]
    ref = reference_moe(*case[:3], d13, d2)
    for l2_bytes in (0, WHOLE_L2):
        groups = len(rows) + (l2_bytes == 0 and max(rows) > 16)  # 17 rows: two groups
        trace = torch.full((grid, MEGAMOE_TRACE_SLOTS), -1, dtype=torch.int64)
        rc, out, sync = run_emu(emu, *case, num_sms=num_sms, l2_bytes=l2_bytes, trace=trace,
                                w13_scale=s13, w2_scale=s2)
        assert rc == 0
        assert_close(out, ref)
        assert int(sync.abs().sum()) == 0, "counters not reset for the next call"
        tasks = groups * (intermediate // (16 * subs[0]) + hidden // (32 * subs[1])) + hidden // 32
        assert int(trace[:, 3].clamp_min(0).sum()) == tasks, (want, trace[:, 3])


def test_skewed_rows_in_groups_or_passes(emu):
    """Where the launcher splits experts' rows into 16-row groups, an expert with more than 16
    rows gets one task per group (the last one partial); otherwise one task makes a pass per 16
    rows. One hot expert with 71 rows, one with 17, one with 16 exactly, one with 1: both
    schedules match the reference, and bit for bit each other (a row's sums do not depend on
    which task or pass computed it)."""
    hidden, intermediate, num_local = 128, 64, 5
    counts = {0: 71, 2: 17, 3: 16, 4: 1}
    flat = torch.tensor([e for e, c in counts.items() for _ in range(c)], dtype=torch.int32)
    g = torch.Generator().manual_seed(12)
    flat = flat[torch.randperm(flat.numel(), generator=g)]
    ids = torch.cat([flat, torch.full((1,), -1, dtype=torch.int32)]).view(-1, 2)  # 106 = 53 x 2
    case = make_case(13, ids.shape[0], 2, hidden, intermediate, num_local, ids=ids)
    ref, first = reference_moe(*case), None
    for num_sms, l2_bytes in ((1, 0), (3, 0), (2, WHOLE_L2)):
        rc, out, sync = run_emu(emu, *case, num_sms=num_sms, l2_bytes=l2_bytes)
        assert rc == 0
        assert_close(out, ref)
        assert int(sync.abs().sum()) == 0
        first = out if first is None else first
        assert torch.equal(out.view(torch.int16), first.view(torch.int16))


def test_deterministic_across_grids_and_schedules(emu):
    """Each output is a fixed-order computation: the same bits whatever block ran which task
    (co-resident blocks claiming concurrently, or blocks one after another, other grid
    sizes), and back-to-back calls on one sync buffer agree."""
    case = make_case(5, 11, 4, 64, 64, 6)
    rc, first, sync = run_emu(emu, *case, num_sms=2)
    assert rc == 0
    for num_sms, at_once in ((1, True), (3, True), (2, False)):
        rc, again, sync = run_emu(emu, *case, num_sms=num_sms, at_once=at_once, sync=sync)
        assert rc == 0 and torch.equal(again.view(torch.int16), first.view(torch.int16))
        assert int(sync.abs().sum()) == 0


def test_edge_routing(emu):
    hidden, intermediate, num_local = 64, 64, 4
    # every slot invalid: the output is 0 (written, not left poisoned)
    x, ids, w, w13, w2 = make_case(6, 7, 2, hidden, intermediate, num_local, invalid=1.0)
    rc, out, _ = run_emu(emu, x, ids, w, w13, w2, num_sms=2)
    assert rc == 0 and torch.equal(out.float(), torch.zeros_like(out.float()))
    # repeated ids within a token, every token on one expert, ids past L
    # and a token with no valid slot among the others (its row is exactly 0)
    ids = torch.tensor([[2, 2, -1], [2, 7, 2], [2, 2, 2], [-1, 9, -3], [0, -5, 2]],
                       dtype=torch.int32)
    case = make_case(7, 5, 3, hidden, intermediate, num_local, ids=ids)
    rc, out, _ = run_emu(emu, *case, num_sms=2)
    assert rc == 0
    assert_close(out, reference_moe(*case))
    assert torch.equal(out[3].float(), torch.zeros(hidden))


def test_expert_map(emu):
    """Global ids through vLLM's EP map (global -> local or -1), as the composed kernels do."""
    hidden, intermediate, num_local, num_global = 64, 64, 3, 8
    expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    expert_map[torch.tensor([1, 4, 6])] = torch.tensor([2, 0, 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(-1, num_global + 2, (9, 3), generator=g, dtype=torch.int32)
    case = make_case(8, 9, 3, hidden, intermediate, num_local, ids=ids)
    rc, out, _ = run_emu(emu, *case, num_sms=2, expert_map=expert_map)
    assert rc == 0
    assert_close(out, reference_moe(*case, expert_map=expert_map))


def test_limits_rejected(emu):
    """Outside the limits the launcher returns an error (no launch, nothing written)."""
    hidden, intermediate = 64, 64
    case = make_case(9, MAX_ENTRIES // 2 + 1, 2, hidden, intermediate, 2)
    rc, out, _ = run_emu(emu, *case)
    assert rc != 0 and out.isnan().all()
    case = make_case(10, 2, 2, 96, intermediate, 2)  # H not a multiple of 64
    rc, out, _ = run_emu(emu, *case)
    assert rc != 0 and out.isnan().all()


# megamoe_check (csrc/experts/megamoe.cu): the one home of the fused layer's limits, whose
# message the binding raises ("fused MoE layer: ...") and EpContext through megamoe_ep_check.
# Valid sizes, then one field at a time outside its limit: (overrides, the message's pattern).
MEGAMOE_CHECK_VALID = dict(num_rows=4, top_k=2, hidden=64, intermediate=128, num_local_experts=3,
                           num_sms=0, timeout_ticks=1, num_global_experts=-1, fp8=0,
                           misaligned=None)


def megamoe_check(emu, **overrides):
    """(rc, message) of petit_emu_megamoe_check on MEGAMOE_CHECK_VALID with `overrides`."""
    emu.petit_emu_megamoe_check.argtypes = [ctypes.c_int] * 6 + [
        ctypes.c_ulonglong, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p,
        ctypes.c_int]
    args = {**MEGAMOE_CHECK_VALID, **overrides}
    if args["misaligned"] is not None:
        args["misaligned"] = args["misaligned"].encode()
    err = ctypes.create_string_buffer(512)
    rc = emu.petit_emu_megamoe_check(*args.values(), err, len(err))
    return rc, err.value.decode()


@pytest.mark.parametrize("overrides,pattern", [
    (dict(num_rows=-1), r"^token count -1 must be >= 0$"),
    (dict(top_k=0), r"^top-k 0 outside \[1, 16\]$"),
    (dict(top_k=17), r"^top-k 17 outside \[1, 16\]$"),
    (dict(hidden=96), r"^hidden size 96 must be a positive multiple of 64$"),
    (dict(hidden=0), r"^hidden size 0 must be"),
    (dict(intermediate=32), r"^intermediate size 32 must be a positive multiple of 64$"),
    (dict(num_local_experts=0), r"^0 local experts outside \[1, 512\]$"),
    (dict(num_local_experts=513), r"^513 local experts outside"),
    (dict(num_rows=MAX_ENTRIES // 2 + 1),
     r"^N\*K = 2050 routing entries above the fused layer's 2048$"),
    (dict(num_sms=-1), r"^num_sms -1 must be >= 0 \(0: the device's SM count\)$"),
    (dict(timeout_ticks=0), r"^timeout_ticks must be > 0$"),
    (dict(misaligned="x"), r"^x must be 16-byte aligned$"),
    (dict(misaligned="w2"), r"^w2 must be 16-byte aligned$"),
    (dict(misaligned="partial"), r"^partial must be 16-byte aligned$"),
    (dict(misaligned="sync"), r"^no sync buffer \(megamoe_sync_ints\)$"),
    (dict(num_global_experts=0), r"^an expert_map needs >= 1 entries, got 0$"),
    (dict(fp8=1, misaligned="w2_scale", hidden=128),
     r"^block fp8 weights need both w13_scale and w2_scale$"),
    (dict(fp8=1), r"^block fp8 weights need hidden \(64\) and intermediate \(128\) sizes that "
                  r"are multiples of 128$"),
    (dict(fp8=1, hidden=128, misaligned="w13_scale"),
     r"^w13_scale and w2_scale must be 4-byte aligned$"),
])
def test_megamoe_check_names_the_limit(emu, overrides, pattern):
    assert megamoe_check(emu) == (0, "")
    rc, message = megamoe_check(emu, **overrides)
    assert rc != 0 and re.search(pattern, message), (rc, message)


def test_megamoe_check_accepts_the_edges(emu):
    """The limits' own values pass: K = 16, L = 512, N*K = 2048, no rows, a map, fp8 sizes."""
    for overrides in (dict(top_k=16), dict(num_local_experts=512), dict(num_rows=0),
                      dict(num_rows=MAX_ENTRIES // 2), dict(num_global_experts=1),
                      dict(num_sms=132), dict(fp8=1, hidden=128, intermediate=256)):
        assert megamoe_check(emu, **overrides) == (0, ""), overrides


def test_timeout_check_is_the_one_message(emu):
    """timeout_check (csrc/api.h): the wait bound megamoe_forward and EpContext take, its
    message, and its ticks (ns on CUDA)."""
    emu.petit_emu_timeout_check.argtypes = [ctypes.c_double, ctypes.c_void_p, ctypes.c_char_p,
                                            ctypes.c_int]
    err, ticks = ctypes.create_string_buffer(512), ctypes.c_ulonglong()
    for timeout_s, want in ((0.5, 500_000_000), (3600.0, 3_600_000_000_000)):
        assert emu.petit_emu_timeout_check(timeout_s, ctypes.byref(ticks), err, len(err)) == 0
        assert ticks.value == want and err.value == b""
    for timeout_s, shown in ((0.0, "0"), (-1.0, "-1"), (3601.0, "3601"), (float("nan"), "nan"),
                             (float("inf"), "inf")):
        assert emu.petit_emu_timeout_check(timeout_s, ctypes.byref(ticks), err, len(err)) != 0
        assert err.value.decode() == (f"timeout_s {shown} outside (0, 3600] seconds (the bound "
                                      f"of every spin-wait)"), err.value


def test_megamoe_max_blocks(emu):
    """Two blocks per SM, num_sms = 0: the device's SMs (a trace's rows)."""
    emu.petit_emu_megamoe_max_blocks.restype = ctypes.c_longlong
    assert emu.petit_emu_megamoe_max_blocks(0, 132) == 264
    assert emu.petit_emu_megamoe_max_blocks(5, 132) == 10
    assert emu.petit_emu_megamoe_max_blocks(2**30, 132) == 2**31
    assert emu.petit_emu_megamoe_max_blocks(-1, 132) == -1


def _trace_tool():
    from script_module import load_script
    return load_script("tools/megamoe_trace.py")


def test_trace_records_every_task_once_in_order(emu):
    """The optional trace (tools/megamoe_trace.py): per block entry <= routed <= each task's
    ready <= done <= the next task's ready <= exit, and the blocks' tasks together are every
    (expert, row group) gate/up and down task and every reduction exactly once. Expert 0 has
    20 rows (two groups), expert 1 has 3: 3 * (64/16 + 64/32) + 64/32 = 20 tasks, all within
    one block's kMegaMoeTraceTasks records whichever block claims them."""
    from vllm_petit_moe.limits import (MEGAMOE_BLOCKS_PER_SM, MEGAMOE_TRACE_HEADER,
                                       MEGAMOE_TRACE_SLOTS)
    num_rows, top_k, hidden, inter, num_local, num_sms = 23, 1, 64, 64, 2, 2
    ids = torch.tensor([0] * 20 + [1] * 3, dtype=torch.int32)
    ids = ids[torch.randperm(num_rows, generator=torch.Generator().manual_seed(8))].view(-1, 1)
    case = make_case(8, num_rows, top_k, hidden, inter, num_local, ids=ids)
    tool = _trace_tool()
    grid = MEGAMOE_BLOCKS_PER_SM * num_sms
    trace = torch.full((grid, MEGAMOE_TRACE_SLOTS), -1, dtype=torch.int64)
    rc, out, _ = run_emu(emu, *case, num_sms=num_sms, trace=trace)
    assert rc == 0
    assert_close(out, reference_moe(*case))
    seen = []
    for block in trace:
        entry, routed, exit_, count, read, counted, issued = (int(v) for v in block[:7])
        assert 0 < entry <= read <= counted <= routed <= exit_, block[:7]
        assert counted <= issued <= routed, block[:7]
        last = routed
        for i in range(count):
            first = MEGAMOE_TRACE_HEADER + 3 * i
            task, ready, done = (int(v) for v in block[first:first + 3])
            assert last <= ready <= done <= exit_, (i, last, ready, done, exit_)
            last = done
            seen.append(tool.task_fields(task))
    groups = {0: 2, 1: 1}
    want = [(0, e, r, t) for e in groups for r in range(groups[e]) for t in range(inter // 16)]
    want += [(1, e, r, t) for e in groups for r in range(groups[e]) for t in range(hidden // 32)]
    want += [(2, 0, 0, t) for t in range(hidden // 32)]
    assert sorted(seen) == sorted(want)
    # tools/megamoe_trace.py's summary of the same trace
    blocks = tool.blocks_from_trace(trace.tolist())
    summary = tool.summarize(blocks, min(b["entry"] for b in blocks))
    assert summary["blocks"] == grid and summary["truncated_blocks"] == 0
    steps = summary["routing_steps_us_median"]
    assert list(steps) == ["ids", "counts", "first_loads", "sort"] and min(steps.values()) >= 0
    assert [summary["kinds"][k]["count"] for k in tool.KINDS] == \
        [sum(1 for w in want if w[0] == i) for i in range(len(tool.KINDS))]
    assert summary["span_us"] > 0 and summary["handoff_us_max"] >= summary["handoff_us_median"]


def test_trace_records_warp_0s_e4m3_steps(emu):
    """With e4m3 weights the trace also holds warp 0's ring steps (wait begun, weights in).
    H = 512 and I = 256 give a gate/up task 4 k steps (warp 0 takes one per pass) and a down
    task 2 (warps 1 and 3 take them); 12 rows on one expert make two 8-row passes, so warp 0
    takes two steps in every gate/up task and none in a down task (four in a task of two tiles,
    which the launcher picks here: 16 narrow tasks outnumber the 4 blocks). Each step lies in
    one of its block's task records, and tools/megamoe_trace.py's step summary counts them."""
    from vllm_petit_moe.limits import (MEGAMOE_BLOCKS_PER_SM, MEGAMOE_TRACE_SLOTS,
                                       MEGAMOE_TRACE_TASKS)
    num_sms = 2
    ids = torch.zeros(12, 1, dtype=torch.int32)
    case, (s13, s2), (d13, d2) = make_fp8_case(31, 12, 1, 512, 256, 1, ids=ids)
    grid = MEGAMOE_BLOCKS_PER_SM * num_sms
    trace = torch.full((grid, MEGAMOE_TRACE_SLOTS), -1, dtype=torch.int64)
    rc, out, _ = run_emu(emu, *case, num_sms=num_sms, trace=trace, w13_scale=s13, w2_scale=s2)
    assert rc == 0
    assert_close(out, reference_moe(*case[:3], d13, d2))
    tool = _trace_tool()
    blocks = tool.blocks_from_trace(trace.tolist())
    gate_up_tasks, subs = 0, 2  # tiles per gate/up task (wide_mask: 16 > 4 blocks)
    for b in blocks:
        assert b["count"] <= MEGAMOE_TRACE_TASKS, "a block's task records were truncated"
        tasks = [t for t in b["tasks"] if t["kind"] == "gate/up"]
        gate_up_tasks += len(tasks)
        assert len(b["steps"]) == 2 * subs * len(tasks), (b["steps"], tasks)
        for begun, arrived in b["steps"]:
            assert begun <= arrived
            assert sum(t["ready"] <= begun <= t["done"] for t in tasks) == 1, (begun, tasks)
    assert gate_up_tasks == 256 // 16 // subs
    steps = tool.summarize(blocks, min(b["entry"] for b in blocks))["steps"]
    assert list(steps) == ["gate/up"] and steps["gate/up"]["tasks"] == gate_up_tasks
    k = steps["gate/up"]
    assert k["steps_median"] == 2 * subs and k["wait_us_median"] >= 0 and k["work_us_median"] >= 0
    assert k["first_work_us_median"] >= 0
