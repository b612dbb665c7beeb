"""Multi-rank GPU tests of EpBuffer dispatch/combine against the torch reference.

Every rank seeds identically, builds *all* ranks' inputs and computes its own expected
output locally with the reference, so checking needs no collectives. Runs W ranks on the
available GPUs (ranks share a GPU when there are fewer GPUs than ranks).
"""
from __future__ import annotations

import pytest
import torch

from vllm_petit_moe.testing.rank_pool import get_buffer
from vllm_petit_moe.config import CombineConfig
from vllm_petit_moe.testing import reference as ref

NUM_EXPERTS = 32
POISON = float("nan")


def _inputs(seed, tokens_per_rank, hidden, top_k, num_experts, world_size, skew, device):
    """All ranks' (x, topk_ids, topk_weights), identical on every rank."""
    gen = torch.Generator(device=device).manual_seed(seed)
    xs, ids, weights = [], [], []
    for t in tokens_per_rank:
        xs.append(torch.randn(t, hidden, generator=gen, device=device).to(torch.bfloat16))
        i, w = ref.random_topk(t, num_experts, top_k, generator=gen, skew=skew,
                               world_size=world_size, device=device)
        ids.append(i)
        weights.append(w)
    return xs, ids, weights


def _scaled_experts(recv_x, recv_ids, recv_weights):
    """A cheap deterministic stand-in for the experts: expert e scales by (1 + e/8).
    Rows whose ids are all -1 are 0."""
    scale = torch.where(recv_ids >= 0, recv_weights * (1 + recv_ids.float() / 8), 0.0)
    return (recv_x.float() * scale.sum(dim=1, keepdim=True)).to(torch.bfloat16)


def _check_dispatch(out, expected, rank, tag):
    assert torch.equal(out.recv_topk_ids, expected.recv_topk_ids.to(out.recv_topk_ids.device)), \
        f"{tag}: routing ids differ on rank {rank}"
    assert torch.equal(out.recv_topk_weights, expected.recv_topk_weights), \
        f"{tag}: routing weights differ on rank {rank}"
    mask = expected.routed_mask
    assert torch.equal(out.recv_x[mask], expected.recv_x[mask]), \
        f"{tag}: received rows differ on rank {rank}"


def _rank_round_trip(state, cfg, seed, tokens_per_rank, top_k, skew, rounds, region_stride,
                     identity):
    rank, world, device = state["rank"], state["world_size"], state["device"]
    buf = get_buffer(state, **cfg)
    hidden, num_experts = cfg["hidden_size"], cfg["num_experts"]
    stride = region_stride or max(tokens_per_rank)
    for r in range(rounds):
        xs, ids, ws = _inputs(seed + r, tokens_per_rank, hidden, top_k, num_experts, world,
                              skew, device)
        out = buf.dispatch(xs[rank], ids[rank], ws[rank], region_stride=stride)
        expected = ref.dispatch_reference(xs, ids, ws, num_experts, stride)
        _check_dispatch(out, expected[rank], rank, f"round {r}")
        experts = ref.identity_experts_reference if identity else _scaled_experts
        expert_out = experts(out.recv_x, out.recv_topk_ids, out.recv_topk_weights)
        y = torch.full_like(xs[rank], POISON)
        buf.combine(expert_out, out.handle, out=y)
        expert_outs = [experts(e.recv_x, e.recv_topk_ids, e.recv_topk_weights) for e in expected]
        want = ref.combine_reference(expert_outs, ids, num_experts)[rank]
        # Same fp32 rank-order sum, same rounding: the combine is bit-exact.
        assert torch.equal(y, want), f"round {r}: combine differs on rank {rank}: max err " \
            f"{(y.float() - want.float()).abs().max().item()}"
        if identity:  # dispatch -> identity experts -> combine returns the input
            tol = ref.tolerance(want, xs[rank].float())
            ref.check_close(y, xs[rank].float(), tol, name="identity round trip")
        counts = buf.recv_tokens_per_rank(out.handle).cpu()
        routed = [int(e.routed_mask[s * stride:(s + 1) * stride].sum()) for e in expected[rank:rank + 1]
                  for s in range(world)]
        assert counts.tolist() == routed
    torch.cuda.synchronize()
    return rounds


def _rank_fp8_dispatch(state, cfg, seed, tokens_per_rank, top_k, quant, rounds, graph):
    """fp8 dispatch: e4m3 bytes and scales of routed rows bit-equal to the reference
    quantizer; routing blocks equal; combine of the dequantized rows equal to the reference.
    With `graph`, the dispatch + combine run as CUDA-graph replays with fresh inputs."""
    rank, world, device = state["rank"], state["world_size"], state["device"]
    buf = get_buffer(state, **cfg)
    hidden, num_experts = cfg["hidden_size"], cfg["num_experts"]
    stride = max(tokens_per_rank)

    def experts(out_x, scales, ids, weights):
        return _scaled_experts(ref.dequantize_fp8_reference(out_x, scales), ids, weights)

    def round_inputs(r):
        xs, ids, ws = _inputs(seed + r, tokens_per_rank, hidden, top_k, num_experts, world,
                              None, device)
        # Rows of very different magnitudes (scales must follow each block / token).
        xs = [x * torch.logspace(-3, 3, x.shape[0], device=device)[:, None].to(x.dtype)
              for x in xs]
        return xs, ids, ws

    static = None
    for r in range(rounds):
        xs, ids, ws = round_inputs(r)
        y = torch.full_like(xs[rank], POISON)
        if graph:
            if static is None:
                static = [xs[rank].clone(), ids[rank].clone(), ws[rank].clone(),
                          torch.empty_like(xs[rank])]
                holder = {}

                def step():
                    out = buf.dispatch(static[0], static[1], static[2], region_stride=stride,
                                       quant=quant)
                    buf.combine(experts(out.recv_x, out.recv_x_scales, out.recv_topk_ids,
                                        out.recv_topk_weights), out.handle, out=static[3])
                    holder["out"] = out
                step()  # warm-up (collective), then capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
            for t, v in zip(static[:3], (xs[rank], ids[rank], ws[rank])):
                t.copy_(v)
            static[3].fill_(POISON)
            g.replay()
            out, y = holder["out"], static[3]
        else:
            out = buf.dispatch(xs[rank], ids[rank], ws[rank], region_stride=stride, quant=quant)
            buf.combine(experts(out.recv_x, out.recv_x_scales, out.recv_topk_ids,
                                out.recv_topk_weights), out.handle, out=y)
        expected = ref.dispatch_reference(xs, ids, ws, num_experts, stride, quant=quant)
        e = expected[rank]
        assert out.recv_x.dtype == torch.float8_e4m3fn and out.recv_x.shape == e.recv_x.shape
        assert out.recv_x_scales.shape == e.recv_x_scales.shape
        assert torch.equal(out.recv_topk_ids, e.recv_topk_ids), f"round {r}: ids differ"
        assert torch.equal(out.recv_topk_weights, e.recv_topk_weights), f"round {r}: weights"
        mask = e.routed_mask
        got_q = out.recv_x[mask].view(torch.uint8)
        want_q = e.recv_x[mask].view(torch.uint8)
        bad = (got_q != want_q).nonzero()
        if bad.numel():
            rows = mask.nonzero().flatten()[bad[:4, 0]]
            cols = bad[:4, 1]
            scale_cols = cols // 128 if quant.startswith("fp8_block128") else cols * 0
            src = [(int(row) // stride, int(row) % stride) for row in rows]
            inputs = [xs[s_][i, c].item() for (s_, i), c in zip(src, cols.tolist())]
            raise AssertionError(
                f"round {r}: {bad.shape[0]} of {got_q.numel()} fp8 bytes differ on rank {rank} "
                f"({quant}); e.g. got {got_q[bad[:4, 0], bad[:4, 1]].tolist()} want "
                f"{want_q[bad[:4, 0], bad[:4, 1]].tolist()} for x {inputs}, scales "
                f"{out.recv_x_scales[rows, scale_cols].tolist()} vs "
                f"{e.recv_x_scales[rows, scale_cols].tolist()}")
        assert torch.equal(out.recv_x_scales[mask], e.recv_x_scales[mask]), \
            f"round {r}: scales differ on rank {rank} ({quant})"
        expert_outs = [experts(o.recv_x, o.recv_x_scales, o.recv_topk_ids, o.recv_topk_weights)
                       for o in expected]
        want = ref.combine_reference(expert_outs, ids, num_experts)[rank]
        assert torch.equal(y, want), f"round {r}: combine after fp8 dispatch differs"
        # The received views above are only valid until any rank's next dispatch: no rank
        # may start round r+1 before every rank has checked round r.
        torch.distributed.barrier(group=state["group"])
    torch.cuda.synchronize()
    return rounds


def _rank_cuda_graph(state, cfg, seed, num_tokens, top_k, replays):
    rank, world, device = state["rank"], state["world_size"], state["device"]
    buf = get_buffer(state, **cfg)
    hidden, num_experts = cfg["hidden_size"], cfg["num_experts"]
    xs, ids, ws = _inputs(seed, [num_tokens] * world, hidden, top_k, num_experts, world, None,
                          device)
    static_x, static_ids, static_w = xs[rank].clone(), ids[rank].clone(), ws[rank].clone()
    static_y = torch.empty_like(static_x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (collective)
        out = buf.dispatch(static_x, static_ids, static_w, region_stride=num_tokens)
        buf.combine(_scaled_experts(out.recv_x, out.recv_topk_ids, out.recv_topk_weights),
                    out.handle, out=static_y)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = buf.dispatch(static_x, static_ids, static_w, region_stride=num_tokens)
        buf.combine(_scaled_experts(out.recv_x, out.recv_topk_ids, out.recv_topk_weights),
                    out.handle, out=static_y)
    for r in range(replays):
        xs, ids, ws = _inputs(seed + 1 + r, [num_tokens] * world, hidden, top_k, num_experts,
                              world, None, device)
        static_x.copy_(xs[rank])
        static_ids.copy_(ids[rank])
        static_w.copy_(ws[rank])
        static_y.fill_(POISON)
        graph.replay()
        expected = ref.dispatch_reference(xs, ids, ws, num_experts, num_tokens)
        _check_dispatch(out, expected[rank], rank, f"replay {r}")
        expert_outs = [_scaled_experts(e.recv_x, e.recv_topk_ids, e.recv_topk_weights)
                       for e in expected]
        want = ref.combine_reference(expert_outs, ids, num_experts)[rank]
        assert torch.equal(static_y, want), f"replay {r}: combine differs on rank {rank}"
        torch.distributed.barrier(group=state["group"])  # views valid until the next dispatch
    torch.cuda.synchronize()
    return replays


def _rank_traced_combine(state, cfg, seed, tokens_per_rank, top_k):
    """A combine with its per-block timeline: the output is the untraced one's (bit-exact
    against the reference), the launched rows are the planned grid, every send and reduce
    item is counted once, and each block's stamps are in phase order."""
    from vllm_petit_moe import _C
    from vllm_petit_moe.testing.combine_trace import COMBINE_TRACE_SLOTS, summarize_combine_trace
    rank, world, device = state["rank"], state["world_size"], state["device"]
    buf = get_buffer(state, **cfg)
    hidden, num_experts = cfg["hidden_size"], cfg["num_experts"]
    stride = max(tokens_per_rank)
    xs, ids, ws = _inputs(seed, tokens_per_rank, hidden, top_k, num_experts, world, None,
                          device)
    out = buf.dispatch(xs[rank], ids[rank], ws[rank], region_stride=stride)
    expected = ref.dispatch_reference(xs, ids, ws, num_experts, stride)
    expert_out = _scaled_experts(out.recv_x, out.recv_topk_ids, out.recv_topk_weights)
    y = torch.full_like(xs[rank], POISON)
    trace = buf.new_combine_trace()
    # refused before a launch (checked directly: a combine that raises leaves the protocol,
    # EpBuffer._collective, and the buffer is shared by the pool's later cases)
    from vllm_petit_moe.buffer import check_combine_trace
    for bad in (trace[:, :4], trace.int(), trace.cpu(), trace[:1]):
        with pytest.raises(ValueError, match="trace must be"):
            check_combine_trace(bad, buf.num_sms, buf.device)
    buf.combine(expert_out, out.handle, out=y, trace=trace)
    expert_outs = [_scaled_experts(e.recv_x, e.recv_topk_ids, e.recv_topk_weights)
                   for e in expected]
    want = ref.combine_reference(expert_outs, ids, num_experts)[rank]
    assert torch.equal(y, want), f"traced combine differs on rank {rank}"

    plan = _C.combine_plan(world, hidden, tokens_per_rank[rank], stride, buf.num_sms)
    rows = trace.cpu().tolist()
    launched = [dict(zip(COMBINE_TRACE_SLOTS, r)) for r in rows if r[0] != -1]
    assert len(launched) == plan["grid"] and all(r[0] == -1 for r in rows[plan["grid"]:])
    pairs = -(-stride // 32) * (world - 1)
    whole = plan["whole_pairs"]
    send_items = whole + (pairs - whole) * plan["send_chunks"]
    reduce_items = -(-tokens_per_rank[rank] // 32) * plan["reduce_chunks"]
    assert sum(r["send_items"] for r in launched) == send_items
    assert sum(r["reduce_items"] for r in launched) == reduce_items
    for b, r in enumerate(launched):
        assert 0 < r["start"] <= r["end"], f"block {b}: {r}"
        assert (r["send_items"] > 0) == (b < plan["send_blocks"] and b < send_items)
        if r["send_items"]:
            assert r["start"] <= r["first_send"] <= r["sends_done"] <= r["end"], f"block {b}: {r}"
        else:
            assert r["first_send"] == r["sends_done"] == 0, f"block {b}: {r}"
        if r["reduce_items"]:
            assert r["start"] <= r["first_reduce_ready"] <= r["last_reduce_done"] <= r["end"], \
                f"block {b}: {r}"
            # waiting and reducing: thread 0's spans inside the block's life
            assert r["reduce_wait"] >= 0 and r["reduce_work"] >= 0, f"block {b}: {r}"
            assert r["reduce_wait"] + r["reduce_work"] <= r["end"] - r["start"], f"block {b}: {r}"
        else:
            assert r["first_reduce_ready"] == r["last_reduce_done"] == 0, f"block {b}: {r}"
            assert r["reduce_wait"] == r["reduce_work"] == 0, f"block {b}: {r}"
    summary = summarize_combine_trace(trace, _C.kTimerTicksPerSecond)
    assert summary["blocks"] == plan["grid"] and summary["send_items"] == send_items
    assert 0 <= summary["kernel_us"] < cfg["timeout_s"] * 1e6
    torch.distributed.barrier(group=state["group"])
    return True


def _rank_megamoe_expert_stage(state, cfg, seed, tokens_per_rank, top_k, inter, rounds):
    """dispatch -> ops.megamoe_forward over this rank's received rows (the fused layer kernel
    as the expert stage; padding rows carry only -1 ids) -> combine, and the whole layer as one
    fused launch per rank (EpBuffer.megamoe), against the dense fp64 MoE of this rank's tokens
    and against the composed experts (ops.experts_forward) on the same received rows; the
    dispatch / combine calls and the fused ones alternate on one buffer (their epochs)."""
    from vllm_petit_moe import ops
    from script_module import load_script
    rank, world, device = state["rank"], state["world_size"], state["device"]
    buf = get_buffer(state, **cfg)
    hidden, num_experts = cfg["hidden_size"], cfg["num_experts"]
    local = num_experts // world
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device)
           / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=device)
          / inter**0.5).to(torch.bfloat16)
    mine = slice(rank * local, (rank + 1) * local)
    stride = max(tokens_per_rank)
    for r in range(rounds):
        xs, ids, ws = _inputs(seed + 1 + r, tokens_per_rank, hidden, top_k, num_experts, world,
                              None, device)
        ys = []
        for experts in ("megamoe", "composed"):  # a dispatch each: one combine per dispatch
            out = buf.dispatch(xs[rank], ids[rank], ws[rank], region_stride=stride)
            stage_out = torch.full_like(out.recv_x, POISON)
            fn = ops.megamoe_forward if experts == "megamoe" else ops.experts_forward
            kwargs = {"num_sms": buf.num_sms} if experts == "megamoe" else {}
            fn(out.recv_x, out.recv_topk_ids, out.recv_topk_weights, w13[mine].contiguous(),
               w2[mine].contiguous(), out=stage_out, **kwargs)
            y = torch.full_like(xs[rank], POISON)
            buf.combine(stage_out, out.handle, out=y)
            ys.append(y)
        fused = torch.full_like(xs[rank], POISON)
        buf.megamoe(xs[rank], ids[rank], ws[rank], w13[mine].contiguous(), w2[mine].contiguous(),
                    region_stride=stride, out=fused)
        ys.append(fused)
        if xs[rank].shape[0] == 0:
            continue
        want = ref.dense_moe_reference(xs[rank], ids[rank], ws[rank], w13, w2)
        for name, y in zip(("megamoe", "composed", "fused layer"), ys):
            assert not y.isnan().any(), f"round {r}: {name} left outputs unwritten on rank {rank}"
            err = ((y.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
            assert err < 6e-3, f"round {r}: {name} relative error {err} on rank {rank}"
        diff = ((ys[0].float() - ys[1].float()).norm() / ys[1].float().norm()).item()
        assert diff < 8e-3, f"round {r}: megamoe vs composed {diff} on rank {rank}"
    # traced once: every block of the grid stamped its entry <= routing <= exit and, over the
    # grid, the rank's reduction and final tasks (H / 32 each) ran
    trace = buf.new_megamoe_trace()
    buf.megamoe(xs[rank], ids[rank], ws[rank], w13[mine].contiguous(), w2[mine].contiguous(),
                region_stride=stride, trace=trace)
    rows = trace.cpu()
    assert bool(((rows[:, 0] > 0) & (rows[:, 0] <= rows[:, 1]) & (rows[:, 1] <= rows[:, 2]))
                .all()), "trace: a block without ordered entry/routing/exit stamps"
    tool = load_script("tools/megamoe_trace.py")
    kinds = [task["kind"] for block in tool.blocks_from_trace(rows.tolist())
             for task in block["tasks"]]
    assert kinds.count("reduce") == kinds.count("final") == hidden // 32, \
        "trace: reductions / final sums"
    # the fused layer in a CUDA graph, replayed with fresh inputs copied in (same count on
    # every rank)
    x, i, w = (t.clone() for t in (xs[rank], ids[rank], ws[rank]))
    y = torch.empty_like(x)
    w13_mine, w2_mine = w13[mine].contiguous(), w2[mine].contiguous()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.megamoe(x, i, w, w13_mine, w2_mine, region_stride=stride, out=y)
    for r in range(3):
        xs2, ids2, ws2 = _inputs(seed + 100 + r, tokens_per_rank, hidden, top_k, num_experts,
                                 world, None, device)
        x.copy_(xs2[rank])
        i.copy_(ids2[rank])
        w.copy_(ws2[rank])
        y.fill_(POISON)
        graph.replay()
        if x.shape[0]:
            want = ref.dense_moe_reference(xs2[rank], ids2[rank], ws2[rank], w13, w2)
            err = ((y.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
            assert err < 6e-3, f"replay {r}: fused layer relative error {err} on rank {rank}"
    torch.cuda.synchronize()
    return rounds


def _rank_bad_inputs(state, cfg):
    """Each bad call raises ValueError before its launch and leaves the protocol (the buffer
    refuses later calls, BufferAbortedError): one fresh buffer per case, built collectively."""
    from vllm_petit_moe.buffer import BufferAbortedError, EpBuffer
    bufs = []

    class Fresh:  # buf.dispatch(...) of a new buffer per case
        def dispatch(self, *args, **kwargs):
            bufs.append(EpBuffer(state["group"], **cfg))
            return bufs[-1].dispatch(*args, **kwargs)

    buf = Fresh()
    dev, H, T = state["device"], cfg["hidden_size"], 4
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    ids = torch.zeros(T, 2, dtype=torch.int64, device=dev)
    w = torch.full((T, 2), 0.5, device=dev)
    cases = [
        (lambda: buf.dispatch(x.float(), ids, w), "bfloat16"),
        (lambda: buf.dispatch(x[:, :8].contiguous(), ids, w), "hidden size"),
        (lambda: buf.dispatch(x, ids + cfg["num_experts"], w), r"\[-1, %d\)" % cfg["num_experts"]),
        (lambda: buf.dispatch(x, ids - 2, w), "top-k ids"),
        (lambda: buf.dispatch(x, torch.zeros(T, 17, dtype=torch.int64, device=dev),
                              torch.zeros(T, 17, device=dev)), "top-k 17"),
        (lambda: buf.dispatch(torch.randn(cfg["max_tokens_per_rank"] + 1, H, device=dev).bfloat16(),
                              torch.zeros(cfg["max_tokens_per_rank"] + 1, 2, dtype=torch.int64, device=dev),
                              torch.zeros(cfg["max_tokens_per_rank"] + 1, 2, device=dev)),
         "max_tokens_per_rank"),
        (lambda: buf.dispatch(x, ids, w, region_stride=2), "region_stride"),
        (lambda: buf.dispatch(x, ids, w.double()), "float32"),
        (lambda: buf.dispatch(x, ids, w, quant="fp8"), "quant must be one of"),
    ]
    if H % 128:
        cases.append((lambda: buf.dispatch(x, ids, w, quant="fp8_block128"),
                      "multiple of 128"))
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()
        with pytest.raises(BufferAbortedError, match="left the collective protocol"):
            bufs[-1].dispatch(x, ids, w)
        bufs[-1].close()
    return True


def _rank_world_mismatch(state):
    """Creating a buffer whose experts do not split over the world size is refused."""
    from vllm_petit_moe.buffer import EpBuffer
    with pytest.raises(ValueError, match="divisible by the world size"):
        EpBuffer(state["group"], hidden_size=64, num_experts=state["world_size"] * 3 + 1,
                 max_tokens_per_rank=8)
    return True


def _cfg(hidden=136, max_tokens=256, num_experts=NUM_EXPERTS, timeout_s=20.0):
    return dict(hidden_size=hidden, num_experts=num_experts, max_tokens_per_rank=max_tokens,
                timeout_s=timeout_s)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("tokens,top_k,skew", [
    ("equal:1", 1, None), ("equal:7", 4, None), ("equal:128", 8, None),
    ("unequal", 8, None), ("zero_one", 2, None), ("equal:100", 8, "one_expert"),
    ("equal:96", 6, "hot_rank")])
def test_dispatch_combine_matches_reference(rank_pools, world_size, tokens, top_k, skew):
    pool = rank_pools(world_size)
    if tokens == "unequal":
        per_rank = [(37 * (r + 1)) % 200 + 1 for r in range(world_size)]
    elif tokens == "zero_one":
        per_rank = [0 if r % 2 == 0 else 1 for r in range(world_size)]
    else:
        per_rank = [int(tokens.split(":")[1])] * world_size
    pool.run(_rank_round_trip, _cfg(), 1000 + top_k, per_rank, top_k, skew, 3, None, False)


@pytest.mark.parametrize("tokens,top_k,skew", [("unequal", 8, None), ("equal:96", 6, "hot_rank"),
                                               ("zero_one", 2, None)])
def test_dispatch_combine_eight_ranks(rank_pools, tokens, top_k, skew):
    # EP8's flag and region logic (W-1 = 7 peers, 8 regions) on whatever GPUs there are: with
    # fewer than 8, ranks share a GPU (PETIT_TEST_MAX_RANKS_PER_GPU, default 4).
    test_dispatch_combine_matches_reference(rank_pools, 8, tokens, top_k, skew)


@pytest.mark.parametrize("hidden", [8, 7168, 8200])
def test_hidden_sizes_and_identity_round_trip(rank_pools, hidden):
    pool = rank_pools(2)
    pool.run(_rank_round_trip, _cfg(hidden=hidden, max_tokens=300), 7, [300, 129], 8, None, 2,
             None, True)


@pytest.mark.parametrize("hidden,tokens", [(7168, [1, 2]), (2048, [5, 8]), (7168, [8, 1])])
def test_decode_rows_split_over_warps(rank_pools, hidden, tokens):
    # Fewer routed rows per token group than warps: each row's copy is cut into spans over
    # the block's warps (row_parts in dispatch_combine.cu); rows must still arrive exact.
    pool = rank_pools(2)
    pool.run(_rank_round_trip, _cfg(hidden=hidden, max_tokens=64), 71, tokens, 8, None, 3,
             None, True)


def test_combine_reduce_items_straddle_send_chunks(rank_pools):
    # A combine reduce item waits for every send chunk its hidden range overlaps. With 64 SMs
    # (48 may send), hidden 7168 (896 vectors; reduce items of 128) and a region stride of
    # 1024 tokens (32 groups), every group goes out in 2 hidden chunks split at vector 448,
    # so the reduce item [384, 512) spans both, here with claimed reduce items (more of them
    # than reduce-only blocks; rank 1 has 600 tokens). At decode sizes, one block per reduce
    # item: 8 tokens (3 chunks, split at 298 and 597) in test_decode_rows_split_over_warps.
    pool = rank_pools(2)
    cfg = _cfg(hidden=7168, max_tokens=1024)
    cfg["num_sms"] = 64
    pool.run(_rank_round_trip, cfg, 81, [1024, 600], 8, None, 2, None, False)


@pytest.mark.parametrize("num_sms,max_tokens,tokens", [(132, 4096, [4096, 4096]),
                                                       (100, 6000, [6000, 2500])])
def test_combine_tail_split(rank_pools, num_sms, max_tokens, tokens):
    # Large combines send their last round of (group, peer) pairs in hidden chunks, the
    # earlier pairs whole with a flag per chunk (plan_combine's tail split; the plans are
    # pinned in tests/test_layout_cpu.py): 132 SMs and 4096 tokens: groups 0-63 whole, 64-127
    # in 4 chunks, two rounds of 64 senders; 100 SMs and a 6000-token stride: 125 of 188
    # groups whole, three rounds of 63 senders, rank 1's reduction over fewer groups.
    pool = rank_pools(2)
    cfg = _cfg(hidden=7168, max_tokens=max_tokens)
    cfg["num_sms"] = num_sms
    pool.run(_rank_round_trip, cfg, 91, tokens, 8, None, 2, None, False)


@pytest.mark.parametrize("config", [
    CombineConfig(reduce_pct=50, reduce_vectors=0, tail_chunks=0),  # whole pairs, coarse items
    CombineConfig(reduce_pct=0, reduce_vectors=64, reduce_items=0, tail_chunks=14),
])
def test_combine_config_keeps_the_bits(rank_pools, config):
    # EpBuffer(config=CombineConfig(...)) changes how the combine cuts its grid and its work
    # (senders, send and reduce chunks, the tail split), never a bit of the result: bit-equal
    # to the reference at a tail-split size (4096 tokens, 132 SMs) and on unequal ranks.
    pool = rank_pools(2)
    cfg = _cfg(hidden=7168, max_tokens=4096)
    cfg["num_sms"] = 132
    cfg["config"] = config
    pool.run(_rank_round_trip, cfg, 95, [4096, 2500], 8, None, 2, None, False)


@pytest.mark.parametrize("num_sms,max_tokens,tokens", [(132, 4096, [4096, 3000]),
                                                       (24, 512, [512, 512]),
                                                       (132, 64, [7, 64])])
def test_combine_trace(rank_pools, num_sms, max_tokens, tokens):
    # The optional timeline (EpBuffer.combine(trace=...)): at 4096 tokens/rank the tail split
    # with claimed reduce items, on 24 SMs whole pairs, at decode sizes a reduce-only block
    # per item (static reduce). Skipped where the GPU has fewer SMs than asked for.
    pool = rank_pools(2)  # skips without GPUs
    if torch.cuda.get_device_properties(0).multi_processor_count < num_sms:
        pytest.skip(f"needs {num_sms} SMs")
    cfg = _cfg(hidden=7168, max_tokens=max_tokens)
    cfg["num_sms"] = num_sms
    pool.run(_rank_traced_combine, cfg, 95, tokens, 8)


def test_max_tokens_4096_and_region_stride(rank_pools):
    pool = rank_pools(2)
    pool.run(_rank_round_trip, _cfg(hidden=2048, max_tokens=4096), 11, [4096, 4096], 8, None,
             2, None, False)
    # A region stride above every rank's T (padding rows must come back as -1).
    pool.run(_rank_round_trip, _cfg(hidden=2048, max_tokens=4096), 12, [100, 3000], 8, None,
             2, 4000, False)


def test_one_rank_receives_everything(rank_pools):
    # top-1 on expert 0 for every token: rank 0 receives all rows, the others nothing.
    pool = rank_pools(2)
    pool.run(_rank_round_trip, _cfg(), 21, [200, 50], 1, "one_expert", 2, None, True)


def test_200_back_to_back_rounds(rank_pools):
    pool = rank_pools(2)
    pool.run(_rank_round_trip, _cfg(hidden=256), 31, [64, 45], 8, None, 200, None, False)


def test_cuda_graph_replays(rank_pools):
    pool = rank_pools(2)
    pool.run(_rank_cuda_graph, _cfg(hidden=512), 41, 96, 8, 17)


@pytest.mark.parametrize("quant", ["fp8_block128", "fp8_per_token", "fp8_block128_ue8m0"])
@pytest.mark.parametrize("world_size,hidden,tokens", [
    (2, 7168, [1, 130]), (2, 2048, [300, 300]), (4, 256, [33, 0, 7, 64])])
def test_fp8_dispatch_matches_reference(rank_pools, quant, world_size, hidden, tokens):
    pool = rank_pools(world_size)
    pool.run(_rank_fp8_dispatch, _cfg(hidden=hidden, max_tokens=300), 51, tokens, 8, quant, 3,
             False)


@pytest.mark.parametrize("quant", ["fp8_block128", "fp8_per_token"])
def test_fp8_dispatch_cuda_graph_replays(rank_pools, quant):
    pool = rank_pools(2)
    pool.run(_rank_fp8_dispatch, _cfg(hidden=512), 61, [96, 96], 8, quant, 17, True)


@pytest.mark.parametrize("world_size,tokens,top_k", [
    (2, [1, 16], 8), (2, [0, 7], 4), (4, [16, 3, 9, 1], 8)])
def test_megamoe_as_the_expert_stage(rank_pools, world_size, tokens, top_k):
    """The fused layer kernel on the dispatch layout at W >= 2 (ranks sharing the GPU)."""
    pool = rank_pools(world_size)
    pool.run(_rank_megamoe_expert_stage, _cfg(hidden=256, max_tokens=16), 71, tokens, top_k,
             128, 3)


def _rank_megamoe_fp8(state, cfg, seed, tokens_per_rank, top_k, inter, rounds):
    """The fused EP layer (EpBuffer.megamoe) on block-fp8 experts (e4m3 + fp32 scale per
    128 x 128 block, each rank its share), against the dense fp64 MoE on the dequantized
    weights, two calls on one buffer."""
    from vllm_petit_moe.testing.reference import block_fp8_quantize
    rank, world, device = state["rank"], state["world_size"], state["device"]
    buf = get_buffer(state, **cfg)
    hidden, num_experts = cfg["hidden_size"], cfg["num_experts"]
    local = num_experts // world
    gen = torch.Generator(device=device).manual_seed(seed)
    w13, s13, d13 = block_fp8_quantize(
        torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5)
    w2, s2, d2 = block_fp8_quantize(
        torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter**0.5)
    mine = slice(rank * local, (rank + 1) * local)
    stride = max(tokens_per_rank)
    for r in range(rounds):
        xs, ids, ws = _inputs(seed + 1 + r, tokens_per_rank, hidden, top_k, num_experts, world,
                              None, device)
        y = torch.full_like(xs[rank], POISON)
        buf.megamoe(xs[rank], ids[rank], ws[rank], w13[mine].contiguous(), w2[mine].contiguous(),
                    region_stride=stride, out=y, w13_scale=s13[mine].contiguous(),
                    w2_scale=s2[mine].contiguous())
        if xs[rank].shape[0] == 0:
            continue
        want = ref.dense_moe_reference(xs[rank], ids[rank], ws[rank], d13, d2)
        assert not y.isnan().any(), f"round {r}: outputs unwritten on rank {rank}"
        err = ((y.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < 6e-3, f"round {r}: relative error {err} on rank {rank}"
    return True


@pytest.mark.parametrize("world_size,tokens", [(2, [16, 9]), (4, [7, 16, 1, 11])])
def test_megamoe_with_block_fp8_weights(rank_pools, world_size, tokens):
    """The fused EP layer on block-fp8 experts (ranks sharing the GPU)."""
    pool = rank_pools(world_size)
    pool.run(_rank_megamoe_fp8, _cfg(hidden=256, max_tokens=16), 81, tokens, 4, 256, 2)


def test_bad_inputs_raise_clear_errors(rank_pools):
    pool = rank_pools(2)
    pool.run(_rank_bad_inputs, _cfg(max_tokens=64))
    pool.run(_rank_world_mismatch)


def _rank_timeout(state):
    """Rank 0 dispatches, the others never do (alive, so their heartbeat moves): rank 0's wait
    must fail the call once max_wait_s has passed."""
    import time
    buf = get_buffer(state, **_cfg(hidden=64, max_tokens=32, timeout_s=1.0), max_wait_s=3.0)
    if state["rank"] != 0:
        time.sleep(5)
        return None
    x = torch.randn(4, 64, device=state["device"]).bfloat16()
    ids = torch.zeros(4, 1, dtype=torch.int64, device=state["device"])
    w = torch.ones(4, 1, device=state["device"])
    buf.dispatch(x, ids, w)
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        return {"error": str(e), **buf.diagnostics()}
    return {"error": None}


def test_spin_wait_is_bounded(rank_pools):
    pool = rank_pools(2)
    results = pool.run(_rank_timeout, timeout_s=120)
    pool.close()  # rank 0's CUDA context is gone after the trap
    r0 = results[0]
    assert r0["error"] is not None, "dispatch without a peer must fail, not hang or succeed"
    assert r0["timed_out"] == 1 and r0["rank"] == 0 and r0["peer"] == 1
    assert r0["peer_alive"] == 1, "rank 1 was alive: the wait must have ended at max_wait_s"
    assert r0["phase"] == "dispatch" and r0["expected_epoch"] == 1


def _rank_leaves_on_a_bad_id(state):
    """Rank 1's dispatch raises before its launch (an id out of range, validate_ids): it leaves
    the protocol and marks its heartbeat aborted. Rank 0's dispatch waits for rank 1's rows and
    must fail within 1.5 x timeout_s naming that, long before max_wait_s (60 s)."""
    import time

    from vllm_petit_moe.buffer import BufferAbortedError, PeerFaultError
    timeout_s = 1.0
    buf = get_buffer(state, **_cfg(hidden=64, max_tokens=32, timeout_s=timeout_s),
                     max_wait_s=60.0)
    x = torch.randn(4, 64, device=state["device"]).bfloat16()
    ids = torch.zeros(4, 1, dtype=torch.int64, device=state["device"])
    w = torch.ones(4, 1, device=state["device"])
    if state["rank"] == 1:
        ids[2, 0] = NUM_EXPERTS + 5
        try:
            buf.dispatch(x, ids, w)
        except ValueError as e:
            error = str(e)
        else:
            return {"error": None}
        try:
            buf.dispatch(x, ids.clamp(max=0), w)
        except BufferAbortedError as e:
            return {"error": error, "then": str(e)}
        return {"error": error, "then": None}
    start = time.monotonic()
    buf.dispatch(x, ids, w)
    try:
        buf.synchronize()
    except PeerFaultError as e:
        return {"message": str(e), "elapsed": time.monotonic() - start,
                "timeout_s": timeout_s, **buf.diagnostics()}
    return {"message": None}


def test_a_rank_that_leaves_on_an_error_fails_its_peers_fast(rank_pools):
    pool = rank_pools(2)
    results = pool.run(_rank_leaves_on_a_bad_id, timeout_s=120)
    pool.close()  # rank 0's CUDA context is gone after the trap
    r0, r1 = results
    assert r1["error"] is not None and "top-k ids must be in" in r1["error"], r1
    assert r1["then"] is not None and "left the collective protocol" in r1["then"], r1
    assert r0["message"] is not None, "rank 0's dispatch must fail, not hang or succeed"
    assert r0["error"] == "peer_aborted" and r0["peer"] == 1, r0
    assert "rank 1 left the protocol" in r0["message"], r0
    assert r0["elapsed"] < 1.5 * r0["timeout_s"] + 2.0, r0  # + the launch and sync
