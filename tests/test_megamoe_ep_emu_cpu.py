"""CPU emulation: the fused MoE layer kernel (csrc/experts/megamoe.cu) as the expert stage of
expert parallelism, on the dispatch layout: W ranks dispatch (csrc/comm/dispatch_combine.cu,
tests/emu/ep_emu.cpp), each rank runs MegaMoE over its W x R received rows (local expert ids,
-1 for slots routed elsewhere and for the padding rows past each source's tokens, whose bytes
are stale), and combine sums every token's W partial results at its source. The layer output
is checked against a dense float64 torch reference of the whole MoE, per source rank.

This is what the W >= 2 fused kernel must equal, and the form in which the fused kernel
already serves EP today: dispatch -> one MegaMoE launch -> combine (instead of row lists,
gate/up, down and the local reduction).
"""
import ctypes
import re

import pytest
import torch

from test_dispatch_combine_emu_cpu import EmuEp, _inputs
from test_megamoe_emu_cpu import reference_moe, run_emu

from vllm_petit_moe.testing.soak import expert_weights

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 128, 64, 32


def check_layer(ys, xs, ids, ws, w13, w2, tag):
    """Every source rank's output of the layer against the dense float64 MoE of its tokens:
    written, and within the bf16 rounding of the activations, of each rank's partial sum and
    of the output."""
    for src, (y, x, i, w) in enumerate(zip(ys, xs, ids, ws)):
        if x.shape[0] == 0:
            continue
        want = reference_moe(x, i.to(torch.int32), w, w13, w2)
        assert not y.isnan().any(), f"{tag}, rank {src}: output not written"
        err = ((y.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < 6e-3, f"{tag}, rank {src}: relative error {err}"


@pytest.mark.parametrize("world,tokens,top_k,skew", [
    (2, [16, 9], 4, None),          # unequal token counts: padding rows in rank 1's region
    (2, [0, 12], 8, None),          # a rank with no tokens
    (4, [7, 16, 1, 11], 4, "one_expert"),
    (4, [13, 5, 16, 3], 6, "hot_rank"),
])
def test_dispatch_megamoe_combine_is_the_moe_layer(ep_emu_lib, megamoe_emu_lib, world, tokens,
                                                   top_k, skew):
    region_stride = 16
    w13, w2 = expert_weights((HIDDEN, INTERMEDIATE, top_k, NUM_EXPERTS),
                             seed=1000 + world * 10 + top_k)
    local = NUM_EXPERTS // world
    ep = EmuEp(ep_emu_lib, world, max_tokens=region_stride, hidden=HIDDEN, num_blocks=2)
    try:
        for round_ in range(2):  # a second round on the same buffers and counters
            xs, ids, ws = _inputs(77 + round_, tokens, HIDDEN, top_k, world, skew=skew,
                                  num_experts=NUM_EXPERTS)
            got = ep.dispatch(xs, ids, ws, region_stride)
            assert not isinstance(got, int), f"dispatch returned {got}"
            expert_outs = []
            for rank, (recv_x, recv_ids, recv_w, _, _) in enumerate(got):
                sl = slice(rank * local, (rank + 1) * local)
                rc, out, sync = run_emu(megamoe_emu_lib, recv_x.contiguous(), recv_ids, recv_w,
                                        w13[sl].contiguous(), w2[sl].contiguous(), num_sms=1)
                assert rc == 0, f"rank {rank}: megamoe returned {rc}"
                assert int(sync.abs().sum()) == 0, "counters not reset"
                expert_outs.append(out)
            ys = ep.combine(expert_outs, tokens, top_k, region_stride)
            check_layer(ys, xs, ids, ws, w13, w2, f"round {round_}")
    finally:
        ep.close()


# ------------------------------------------------------------------ the fused layer across ranks
def _ptr_array(tensors):
    import ctypes
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def fused_layer(ep, megamoe_sync_ints, xs, ids, ws, w13, w2, region_stride, top_k, syncs=None,
                traces=None, scales=None):
    """petit_emu_ep_megamoe on every rank at once (w13 [E, 2I, H] / w2 [E, H, I]: all ranks'
    experts): outputs and workspaces poisoned with NaN first; traces: per rank an int64
    [2 x num_blocks, MEGAMOE_TRACE_SLOTS] tensor or None; scales: (w13_scale [E, 2I/128, H/128],
    w2_scale [E, H/128, I/128]) of block-fp8 weights (w13, w2 then e4m3 bytes), or None."""
    import ctypes
    world, local = ep.world_size, w13.shape[0] // ep.world_size
    hidden, inter = w13.shape[2], w2.shape[2]
    lib = ep.lib
    lib.petit_emu_ep_megamoe.restype = ctypes.c_int
    entries = world * region_stride * top_k
    xs = [x.contiguous() for x in xs]
    ids = [i.to(torch.int32).contiguous() for i in ids]
    ws = [w.contiguous() for w in ws]
    w13s = [w13[r * local:(r + 1) * local].contiguous() for r in range(world)]
    w2s = [w2[r * local:(r + 1) * local].contiguous() for r in range(world)]
    scale_arrays = (None, None)
    if scales is not None:
        scale_arrays = tuple(_ptr_array([s[r * local:(r + 1) * local].contiguous()
                                         for r in range(world)]) for s in scales)
    acts = [torch.full((entries, inter), float("nan")).to(torch.bfloat16)
            for _ in range(world)]
    partials = [torch.full((entries, hidden), float("nan")) for _ in range(world)]
    if syncs is None:
        syncs = [torch.zeros(megamoe_sync_ints(local, hidden), dtype=torch.int32)
                 for _ in range(world)]
    outs = [torch.full((x.shape[0], hidden), float("nan")).to(torch.bfloat16) for x in xs]
    results = (ctypes.c_int * world)()
    rc = lib.petit_emu_ep_megamoe(
        ctypes.c_void_p(ep.handle), (1 << world) - 1, _ptr_array(xs), _ptr_array(ids),
        _ptr_array(ws), (ctypes.c_int * world)(*[x.shape[0] for x in xs]), top_k,
        region_stride, _ptr_array(w13s), _ptr_array(w2s), inter, _ptr_array(acts),
        _ptr_array(partials), _ptr_array(syncs), _ptr_array(outs), results,
        None if traces is None else _ptr_array(traces), *scale_arrays)
    return rc, list(results), outs, syncs


@pytest.mark.parametrize("world,tokens,top_k,skew", [
    (2, [16, 9], 4, None),
    (2, [0, 12], 8, None),          # a rank with no tokens still reduces and sums for the others
    (4, [7, 16, 1, 11], 4, "one_expert"),
    (4, [13, 5, 16, 3], 6, "hot_rank"),
])
def test_the_fused_layer_across_ranks_is_the_moe_layer(ep_emu_lib, megamoe_emu_lib, world, tokens,
                                                        top_k, skew):
    """One fused launch per rank (dispatch, experts, combine inside): three calls on the same
    buffers and counters against the dense MoE, then a standalone dispatch + combine round on
    the same heap, whose epochs must follow the fused calls'."""
    from test_dispatch_combine_emu_cpu import _check_round
    sync_ints = megamoe_emu_lib.petit_emu_megamoe_sync_ints
    region_stride = 16
    w13, w2 = expert_weights((HIDDEN, INTERMEDIATE, top_k, NUM_EXPERTS),
                             seed=2000 + world * 10 + top_k)
    ep = EmuEp(ep_emu_lib, world, max_tokens=region_stride, hidden=HIDDEN, num_blocks=2)
    try:
        syncs = None
        for round_ in range(3):
            xs, ids, ws = _inputs(300 + round_, tokens, HIDDEN, top_k, world, skew=skew,
                                  num_experts=NUM_EXPERTS)
            rc, results, ys, syncs = fused_layer(ep, sync_ints, xs, ids, ws, w13, w2,
                                                 region_stride, top_k, syncs)
            assert rc == 0, f"round {round_}: launch results {results}"
            assert all(int(s.abs().sum()) == 0 for s in syncs), "counters not reset"
            assert ep.epochs() == [round_ + 1] * world, ep.epochs()
            check_layer(ys, xs, ids, ws, w13, w2, f"round {round_}")
        xs, ids, ws = _inputs(399, tokens, HIDDEN, top_k, world, skew=skew,
                              num_experts=NUM_EXPERTS)
        _check_round(ep, xs, ids, ws, region_stride=region_stride, tag="after the fused calls")
    finally:
        ep.close()


@pytest.mark.parametrize("world,tokens,top_k", [(2, [16, 9], 4), (4, [7, 16, 1, 11], 6)])
def test_the_fused_layer_with_block_fp8_weights(ep_emu_lib, megamoe_emu_lib, world, tokens, top_k):
    """Block-fp8 experts (e4m3 + one fp32 scale per 128 x 128 block, each rank its share) in
    the fused EP layer: every rank's output against the dense MoE on the dequantized weights,
    two calls on the same buffers and counters."""
    from vllm_petit_moe.testing.reference import block_fp8_quantize
    hidden, inter, num_experts, region_stride = 128, 256, 16, 16
    w13, w2 = expert_weights((hidden, inter, top_k, num_experts), seed=3000 + world)
    q13, s13, d13 = block_fp8_quantize(w13)
    q2, s2, d2 = block_fp8_quantize(w2)
    ep = EmuEp(ep_emu_lib, world, max_tokens=region_stride, hidden=hidden, num_experts=num_experts,
               num_blocks=2)
    try:
        syncs = None
        for round_ in range(2):
            xs, ids, ws = _inputs(500 + round_, tokens, hidden, top_k, world,
                                  num_experts=num_experts)
            rc, results, ys, syncs = fused_layer(
                ep, megamoe_emu_lib.petit_emu_megamoe_sync_ints, xs, ids, ws,
                q13.view(torch.uint8), q2.view(torch.uint8), region_stride, top_k, syncs,
                scales=(s13, s2))
            assert rc == 0, f"round {round_}: launch results {results}"
            assert all(int(s.abs().sum()) == 0 for s in syncs), "counters not reset"
            check_layer(ys, xs, ids, ws, d13, d2, f"fp8 round {round_}")
    finally:
        ep.close()


def _case(ep_lib_path, megamoe_lib_path, case):
    """Run by run_case in a fresh process (a trap aborts it): rank 0 makes a fused call while
    rank 1 makes a standalone dispatch of the same epoch (and never the fused call's
    reductions)."""
    import ctypes
    import threading

    from test_dispatch_combine_emu_cpu import EmuEp, _load
    ep_emu_lib = _load(ctypes.CDLL(ep_lib_path))
    ep_emu_lib.petit_emu_ep_megamoe.restype = ctypes.c_int
    megamoe_emu_lib = ctypes.CDLL(megamoe_lib_path)
    ep = EmuEp(ep_emu_lib, 2, max_tokens=16, hidden=HIDDEN, num_blocks=2, timeout_s=0.2)
    xs, ids, ws = _inputs(5, [8, 8], HIDDEN, 4, 2, num_experts=NUM_EXPERTS)
    gen = torch.Generator().manual_seed(5)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.05).bfloat16()
    fused = threading.Thread(target=fused_layer_on, args=(
        ep, megamoe_emu_lib.petit_emu_megamoe_sync_ints, xs, ids, ws, w13, w2, 16, 4, 1))
    fused.start()
    ep.dispatch(xs, ids, ws, region_stride=16, ranks=[1])
    fused.join()
    print("returned")


def fused_layer_on(ep, sync_ints, xs, ids, ws, w13, w2, region_stride, top_k, ranks_mask):
    """fused_layer for the ranks of ranks_mask only."""
    import ctypes
    world, local = ep.world_size, NUM_EXPERTS // ep.world_size
    entries = world * region_stride * top_k
    keep = [xs, ids, ws]
    ids = [i.to(torch.int32).contiguous() for i in ids]
    w13s = [w13[r * local:(r + 1) * local].contiguous() for r in range(world)]
    w2s = [w2[r * local:(r + 1) * local].contiguous() for r in range(world)]
    acts = [torch.zeros(entries, INTERMEDIATE, dtype=torch.bfloat16) for _ in range(world)]
    partials = [torch.zeros(entries, HIDDEN) for _ in range(world)]
    syncs = [torch.zeros(sync_ints(local, HIDDEN), dtype=torch.int32) for _ in range(world)]
    outs = [torch.zeros(x.shape[0], HIDDEN, dtype=torch.bfloat16) for x in xs]
    results = (ctypes.c_int * world)()
    ep.lib.petit_emu_ep_megamoe(
        ctypes.c_void_p(ep.handle), ranks_mask, _ptr_array(xs), _ptr_array(ids), _ptr_array(ws),
        (ctypes.c_int * world)(*[x.shape[0] for x in xs]), top_k, region_stride,
        _ptr_array(w13s), _ptr_array(w2s), INTERMEDIATE, _ptr_array(acts), _ptr_array(partials),
        _ptr_array(syncs), _ptr_array(outs), results, None, None, None)
    del keep


def test_a_fused_call_against_a_peers_standalone_calls_fails_clearly(ep_emu_lib, megamoe_emu_lib):
    """Rank 0 fused, rank 1 a standalone dispatch of the same epoch: rank 1's dispatch takes
    rank 0's rows (the same layout and tag), but rank 0 waits for rank 1's reductions, which
    never come: its bounded wait reports the peer and the phase, never a hang or a result."""
    from conftest import run_case
    result = run_case(__file__, ep_emu_lib._name, megamoe_emu_lib._name, "mixed", timeout=300,
                      env={"PETIT_EMU_EXPECT_TRAP": "1"})  # kept out of CI's trap log
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "returned" not in result.stdout, out[-3000:]
    assert "petit_moe: combine timed out on rank 0 waiting for rank 1, token group 0: " \
        "expected epoch 1, flag holds epoch 0" in out, out[-3000:]


# megamoe_ep_check (csrc/experts/megamoe.cu): a fused EP call's limits against its context,
# with the message EpContext raises ("fused EP layer: ..."). A context of 2 ranks, 8 tokens per
# rank, hidden 128, top-k <= 4, 32 experts (16 per rank), a grid of 2 blocks; valid sizes, then
# one field at a time outside its limit.
EP_CHECK_VALID = dict(num_tokens=5, top_k=2, region_stride=8, hidden=-1, intermediate=64,
                      num_local_experts=-1, num_sms=-1, with_map=0)


@pytest.mark.parametrize("overrides,pattern", [
    (dict(with_map=1), r"^global ids take no expert_map \(the context maps them\)$"),
    (dict(region_stride=9), r"^need tokens \(5\) <= region stride \(9\) <= max tokens per "
                            r"rank \(8\), region stride >= 1$"),
    (dict(region_stride=4), r"^need tokens \(5\) <= region stride \(4\)"),
    (dict(num_tokens=-1), r"^need tokens \(-1\)"),
    (dict(num_tokens=0, region_stride=0), r"^need tokens \(0\) <= region stride \(0\)"),
    (dict(top_k=5), r"^top-k 5 outside \[1, 4\]$"),
    (dict(top_k=0), r"^top-k 0 outside \[1, 16\]$"),  # megamoe_check on the received rows
    (dict(hidden=64), r"^hidden size 64 != the context's 128$"),
    (dict(num_local_experts=17), r"^17 local experts != the context's 16$"),
    (dict(num_sms=0), r"^num_sms 0 must be >= 1 \(the context's grid\)$"),
    (dict(intermediate=60), r"^intermediate size 60 must be a positive multiple of 64$"),
])
def test_megamoe_ep_check_limits(ep_emu_lib, overrides, pattern):
    ep = EmuEp(ep_emu_lib, 2, max_tokens=8, hidden=128, max_top_k=4, num_experts=32,
               num_blocks=2)
    try:
        err = ctypes.create_string_buffer(512)
        rc = ep_emu_lib.petit_emu_ep_megamoe_check(ep.handle, 0, *EP_CHECK_VALID.values(), err,
                                                   len(err))
        assert rc == 0 and err.value == b"", err.value
        rc = ep_emu_lib.petit_emu_ep_megamoe_check(
            ep.handle, 0, *{**EP_CHECK_VALID, **overrides}.values(), err, len(err))
        assert rc != 0 and re.search(pattern, err.value.decode()), (rc, err.value)
    finally:
        ep.close()


def test_megamoe_ep_check_limits_on_the_received_rows(ep_emu_lib):
    """W*R*K against the fused layer's 2048 entries: 8 ranks x 64 rows x 4 slots is the limit,
    one more row of stride is past it; the limits themselves pass."""
    ep = EmuEp(ep_emu_lib, 8, max_tokens=65, hidden=64, max_top_k=4, num_experts=8,
               num_blocks=1)
    try:
        err = ctypes.create_string_buffer(512)
        sizes = dict(EP_CHECK_VALID, top_k=4)
        for overrides in (dict(region_stride=64), dict(region_stride=64, num_tokens=64),
                          dict(num_tokens=0, region_stride=1)):
            rc = ep_emu_lib.petit_emu_ep_megamoe_check(
                ep.handle, 3, *{**sizes, **overrides}.values(), err, len(err))
            assert rc == 0 and err.value == b"", (overrides, err.value)
        rc = ep_emu_lib.petit_emu_ep_megamoe_check(
            ep.handle, 3, *dict(sizes, region_stride=65).values(), err, len(err))
        assert rc != 0 and err.value.decode() == (
            "W*R*K = 8*65*4 = 2080 received routing entries above the fused layer's 2048")
    finally:
        ep.close()


# Shapes the fused layer takes (H, I multiples of 64) with E divisible by 2, 3 and 4.
FUSED_SOAK_SHAPES = ((128, 64, 4, 24), (192, 128, 8, 48), (64, 64, 2, 12))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fused_layer_soak(ep_emu_lib, megamoe_emu_lib, world):
    """A bounded soak of the fused layer (run in CI): randomized rounds of testing.soak (token
    counts with zeros, uniform / hot rank / hot expert / -1 slots / repeated ids) back to back
    on one buffer and one set of counters, a standalone dispatch + combine round between, the
    outputs poisoned, against the dense float64 MoE."""
    from test_dispatch_combine_emu_cpu import _check_round

    from vllm_petit_moe.testing.soak import draw_round
    sync_ints = megamoe_emu_lib.petit_emu_megamoe_sync_ints
    max_tokens, rounds = 16, 4
    seeds = [70_000 + 100 * world + r for r in range(rounds)]
    drawn = [draw_round(s, world, max_tokens, shapes=FUSED_SOAK_SHAPES, id_dtype=torch.int32)
             for s in seeds]
    patterns = {rd.pattern for rd in drawn}
    for shape in {rd.shape for rd in drawn}:
        hidden, _, top_k, num_experts = shape
        ep = EmuEp(ep_emu_lib, world, max_tokens=max_tokens, hidden=hidden, max_top_k=top_k,
                   num_experts=num_experts, num_blocks=1 + world % 2)
        w13, w2 = expert_weights(shape, seed=world)
        syncs = None
        try:
            for n, rd in enumerate(r for r in drawn if r.shape == shape):
                stride = max(max(rd.tokens), 1)
                rc, results, ys, syncs = fused_layer(ep, sync_ints, rd.xs, rd.topk_ids,
                                                     rd.topk_weights, w13, w2, stride, top_k,
                                                     syncs)
                tag = f"seed {rd.seed} ({rd.pattern}, tokens {rd.tokens}, shape {shape})"
                assert rc == 0, f"{tag}: launch results {results}"
                assert all(int(s.abs().sum()) == 0 for s in syncs), f"{tag}: counters not reset"
                check_layer(ys, rd.xs, rd.topk_ids, rd.topk_weights, w13, w2, tag)
                if n == 0:  # a standalone round between fused calls on the same heap
                    _check_round(ep, rd.xs, rd.topk_ids, rd.topk_weights, region_stride=stride,
                                 tag=f"after {tag}", num_experts=num_experts)
        finally:
            ep.close()
    assert len(patterns) >= 2, patterns


@pytest.mark.parametrize("world,tokens,top_k,num_experts,hidden,inter", [
    (8, [32] * 8, 8, 8, 64, 64),                    # W R K = 2048 entries (the limit), L = 1
    (2, [5, 0], 1, 2, 64, 128),                     # top-1, one expert per rank
    (8, [1, 0, 0, 0, 0, 0, 0, 3], 2, 64, 128, 64),  # eight ranks, six without tokens
])
def test_fused_layer_edges(ep_emu_lib, megamoe_emu_lib, world, tokens, top_k, num_experts, hidden,
                           inter):
    """The fused layer at its limits: the most routing entries one call takes, eight ranks,
    top-1 and a single local expert, mostly empty ranks; against the dense MoE."""
    w13, w2 = expert_weights((hidden, inter, top_k, num_experts), seed=5)
    stride = max(max(tokens), 1)
    ep = EmuEp(ep_emu_lib, world, max_tokens=stride, hidden=hidden, max_top_k=top_k,
               num_experts=num_experts, num_blocks=1)
    try:
        xs, ids, ws = _inputs(9, tokens, hidden, top_k, world, num_experts=num_experts)
        rc, results, ys, syncs = fused_layer(ep, megamoe_emu_lib.petit_emu_megamoe_sync_ints, xs,
                                             ids, ws, w13, w2, stride, top_k)
        assert rc == 0, f"launch results {results}"
        assert all(int(s.abs().sum()) == 0 for s in syncs), "counters not reset"
        assert ep.epochs() == [1] * world, ep.epochs()
        check_layer(ys, xs, ids, ws, w13, w2, f"{world} ranks, top-{top_k}")
    finally:
        ep.close()


def test_fused_layer_trace_per_rank(ep_emu_lib, megamoe_emu_lib):
    """The optional trace of the fused EP layer (EpBuffer.megamoe(trace=...),
    tools/megamoe_trace.py under torchrun): on every rank entry <= routed (after every rank's
    rows arrived) <= each task's ready <= done <= exit, the rank's tasks are its gate/up,
    down, reduction and final tasks exactly once each, and the tool's summary counts them.
    Top-1 over 3 tokens: at most 3 active experts, so at most 3 * (64/16 + 128/32) + 2 * 4 =
    32 tasks per rank, all within one block's kMegaMoeTraceTasks records whichever block
    claims them."""
    import importlib.util
    from pathlib import Path

    from vllm_petit_moe.limits import (MEGAMOE_BLOCKS_PER_SM, MEGAMOE_TRACE_HEADER,
                                       MEGAMOE_TRACE_SLOTS)
    world, tokens, top_k, num_blocks = 2, [2, 1], 1, 2
    gen = torch.Generator().manual_seed(11)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * 0.05).bfloat16()
    ep = EmuEp(ep_emu_lib, world, max_tokens=8, hidden=HIDDEN, num_blocks=num_blocks)
    traces = [torch.full((MEGAMOE_BLOCKS_PER_SM * num_blocks, MEGAMOE_TRACE_SLOTS), -1,
                         dtype=torch.int64) for _ in range(world)]
    try:
        xs, ids, ws = _inputs(12, tokens, HIDDEN, top_k, world, num_experts=NUM_EXPERTS)
        rc, results, ys, _ = fused_layer(ep, megamoe_emu_lib.petit_emu_megamoe_sync_ints, xs, ids,
                                         ws, w13, w2, 8, top_k, traces=traces)
        assert rc == 0, results
    finally:
        ep.close()
    spec = importlib.util.spec_from_file_location(
        "megamoe_trace", Path(__file__).resolve().parent.parent / "tools" / "megamoe_trace.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    local = NUM_EXPERTS // world
    for rank, trace in enumerate(traces):
        seen = []
        for block in trace:
            entry, routed, exit_, count, read, counted, issued = (int(v) for v in block[:7])
            assert 0 < entry <= read <= counted <= routed <= exit_, (rank, block[:7])
            assert counted <= issued <= routed, (rank, block[:7])
            last = routed
            for i in range(count):
                first = MEGAMOE_TRACE_HEADER + 3 * i
                task, ready, done = (int(v) for v in block[first:first + 3])
                assert last <= ready <= done <= exit_, (rank, i, last, ready, done, exit_)
                last = done
                seen.append(tool.task_fields(task))
        active = sorted({int(e) - rank * local for i in ids for e in i.flatten().tolist()
                         if rank * local <= e < (rank + 1) * local})
        want = [(0, e, 0, t) for e in active for t in range(INTERMEDIATE // 16)]
        want += [(1, e, 0, t) for e in active for t in range(HIDDEN // 32)]
        want += [(k, 0, 0, t) for k in (2, 3) for t in range(HIDDEN // 32)]
        assert sorted(seen) == sorted(want), f"rank {rank}"
        blocks = tool.blocks_from_trace(trace.tolist())
        summary = tool.summarize(blocks, min(b["entry"] for b in blocks))
        assert [summary["kinds"][k]["count"] for k in tool.KINDS] == \
            [sum(1 for w in want if w[0] == i) for i in range(len(tool.KINDS))]
