"""CPU: the dispatch and combine kernels (csrc/comm/dispatch_combine.cu) and their host launchers
run unchanged across W emulated ranks (tests/emu/ep_emu.cpp on the thread-per-GPU-thread
runtime), against the torch reference.

The ranks share one host allocation as the linearized symmetric heap, each rank's grids run on
a thread of their own with all blocks at once, so the ranks wait for each other's flags as on
the GPU. Checks routing, dedup, chunking, the flag/epoch protocol over back-to-back calls with
no barrier between ranks, unequal token counts, 2, 4 and 8 ranks (on GPUs, 8 ranks need at
least 2: tests/test_dispatch_combine_gpu.py), fp8 dispatch and the bounded waits. Says nothing
about performance or the GPU memory model (host atomics are stronger). Needs g++ and the CUDA
headers (uint4/dim3 only).
"""
from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest
import torch

from conftest import assert_case_ok, build_emu_library, run_case
from vllm_petit_moe.config import CombineConfig
from vllm_petit_moe.testing import reference as ref

NUM_EXPERTS = 32
QUANT = {None: 0, "fp8_block128": 1, "fp8_per_token": 2, "fp8_block128_ue8m0": 3}
# heap layout fields (petit_emu_ep_offset)
DISPATCH_ROWS, DISPATCH_IDS, DISPATCH_WEIGHTS, DISPATCH_SCALES, COMBINE_ROWS = 0, 1, 2, 3, 4


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return _load(build_emu_library(tmp_path_factory, "ep_emu"))


def _load(lib):
    lib.petit_emu_ep_create.restype = ctypes.c_void_p
    lib.petit_emu_ep_create.argtypes = [ctypes.c_int] * 6 + [ctypes.c_double]
    lib.petit_emu_ep_destroy.argtypes = [ctypes.c_void_p]
    lib.petit_emu_ep_offset.restype = ctypes.c_longlong
    lib.petit_emu_ep_offset.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.petit_emu_ep_heap.restype = ctypes.c_void_p
    lib.petit_emu_ep_heap.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.petit_emu_ep_recv_group_counts.restype = ctypes.c_void_p
    lib.petit_emu_ep_recv_group_counts.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.petit_emu_ep_epoch.restype = ctypes.c_ulonglong
    lib.petit_emu_ep_epoch.argtypes = [ctypes.c_void_p, ctypes.c_int]
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.petit_emu_ep_dispatch.argtypes = [p, ctypes.c_uint32, p, p, i, p, p, i, i, i, p]
    lib.petit_emu_ep_combine.argtypes = [p, ctypes.c_uint32, p, p, p, i, i, p]
    lib.petit_emu_ep_rounds.argtypes = [p, i, p, p, p, p, i, i, p, p]
    lib.petit_emu_ep_peer_write.argtypes = [p, p, ctypes.c_longlong, i, p]
    lib.petit_emu_ep_set_combine_config.argtypes = [p, i, i, i, i]
    lib.petit_emu_ep_set_combine_config.restype = None
    lib.petit_emu_ep_combine_plan.argtypes = [p, i, i, i, i, p]
    lib.petit_emu_ep_combine_plan.restype = ctypes.c_int
    lib.petit_emu_combine_plan_sizes.argtypes = [i] * 9 + [p, ctypes.c_char_p, i]
    lib.petit_emu_ep_megamoe_check.argtypes = [p] + [i] * 9 + [ctypes.c_char_p, i]
    lib.petit_emu_ep_diagnostics.argtypes = [p, i, p]
    lib.petit_emu_ep_diagnostics.restype = None
    lib.petit_emu_ep_dispatch_each.argtypes = [p, ctypes.c_uint32, p, p, i, p, p, p, p, p, p]
    lib.petit_emu_ep_combine_each.argtypes = [p, p, p, p, p, p, p]
    return lib


def _ptrs(tensors):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def _ints(values):
    return (ctypes.c_int * len(values))(*values)


def _host_view(address, num_bytes):
    """A uint8 tensor over emulated device memory (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * num_bytes).from_address(address),
                            dtype=torch.uint8)


class EmuEp:
    """W emulated ranks with one EpBuffer-like context each (tests/emu/ep_emu.cpp)."""

    def __init__(self, lib, world_size, max_tokens, hidden, max_top_k=8,
                 num_experts=NUM_EXPERTS, num_blocks=2, timeout_s=5.0):
        self.lib, self.world_size = lib, world_size
        self.max_tokens, self.hidden = max_tokens, hidden
        self.handle = lib.petit_emu_ep_create(world_size, max_tokens, hidden, max_top_k,
                                              num_experts, num_blocks, timeout_s)
        assert self.handle, "petit_emu_ep_create rejected its arguments"

    def set_combine_config(self, config):
        """Every rank's CombineConfig from now on."""
        self.lib.petit_emu_ep_set_combine_config(self.handle, *dataclasses.astuple(config))

    def combine_plan(self, rank, num_tokens, top_k, region_stride):
        """plan_combine of one rank's combine: {send_chunks, whole_pairs, send_blocks,
        reduce_chunks, static_reduce, grid}."""
        out = _ints([0] * 6)
        rc = self.lib.petit_emu_ep_combine_plan(self.handle, rank, num_tokens, top_k,
                                                region_stride, out)
        assert rc == 0, f"plan_combine returned {rc}"
        return dict(zip(("send_chunks", "whole_pairs", "send_blocks", "reduce_chunks",
                         "static_reduce", "grid"), list(out)))

    def close(self):
        if self.handle:
            self.lib.petit_emu_ep_destroy(self.handle)
            self.handle = None

    def region(self, rank, field, count, dtype):
        """`count` elements of `dtype` at a layout field of rank `rank`'s heap (a copy)."""
        address = self.lib.petit_emu_ep_heap(self.handle, rank) + \
            self.lib.petit_emu_ep_offset(self.handle, field)
        num_bytes = count * torch.empty((), dtype=dtype).element_size()
        return _host_view(address, num_bytes).view(dtype).clone()

    def dispatch(self, xs, ids, weights, region_stride, quant=None, ranks=None):
        """Every rank's dispatch at once; returns per rank (recv_x, recv_ids, recv_weights,
        recv_scales or None, recv_group_counts [W, groups])."""
        world, H = self.world_size, self.hidden
        K = ids[0].shape[1]
        results = _ints([0] * world)
        mask = sum(1 << r for r in (ranks if ranks is not None else range(world)))
        xs, ids, weights = ([t.contiguous() for t in ts] for ts in (xs, ids, weights))
        rc = self.lib.petit_emu_ep_dispatch(
            self.handle, mask, _ptrs(xs), _ptrs(ids), int(ids[0].dtype == torch.int64),
            _ptrs(weights), _ints([x.shape[0] for x in xs]), K, region_stride, QUANT[quant],
            results)
        if rc != 0:
            return rc
        rows = world * region_stride
        groups = -(-self.max_tokens // 32)
        outs = []
        for r in range(world):
            if quant is None:
                recv_x = self.region(r, DISPATCH_ROWS, rows * H, torch.bfloat16).view(rows, H)
                scales = None
            else:
                recv_x = self.region(r, DISPATCH_ROWS, rows * H, torch.uint8).view(rows, H)
                recv_x = recv_x.view(torch.float8_e4m3fn)
                num_scales = H // 128 if quant.startswith("fp8_block128") else 1
                scales = self.region(r, DISPATCH_SCALES, rows * num_scales,
                                     torch.float32).view(rows, num_scales)
            recv_ids = self.region(r, DISPATCH_IDS, rows * K, torch.int32).view(rows, K)
            recv_w = self.region(r, DISPATCH_WEIGHTS, rows * K, torch.float32).view(rows, K)
            counts_at = self.lib.petit_emu_ep_recv_group_counts(self.handle, r)
            counts = _host_view(counts_at, world * groups * 4).view(torch.int32).clone()
            outs.append((recv_x, recv_ids, recv_w, scales, counts.view(world, groups)))
        return outs

    def combine(self, expert_outs, num_tokens, top_k, region_stride, ranks=None):
        """Every rank's combine at once (or those of `ranks`); outputs poisoned with NaN
        first."""
        ys = [torch.full((t, self.hidden), float("nan"), dtype=torch.bfloat16)
              for t in num_tokens]
        expert_outs = [e.contiguous() for e in expert_outs]
        results = _ints([0] * self.world_size)
        mask = sum(1 << r for r in (ranks if ranks is not None else range(self.world_size)))
        rc = self.lib.petit_emu_ep_combine(self.handle, mask, _ptrs(expert_outs), _ptrs(ys),
                                           _ints(num_tokens), top_k, region_stride, results)
        assert rc == 0, f"combine launch returned {list(results)}"
        return ys

    def diagnostics(self, rank):
        """Rank `rank`'s diagnostic record (api.h EpDiagnostics) as a dict."""
        out = (ctypes.c_longlong * 9)()
        self.lib.petit_emu_ep_diagnostics(self.handle, rank, out)
        return dict(zip(("error", "rank", "peer", "phase", "group", "dropped_ids",
                         "expected_epoch", "observed_flag", "expected_tag"), list(out)))

    def epochs(self):
        return [self.lib.petit_emu_ep_epoch(self.handle, r) for r in range(self.world_size)]


def _inputs(seed, tokens_per_rank, hidden, top_k, world_size, skew=None, id_dtype=torch.int64,
            num_experts=NUM_EXPERTS):
    """Every rank's (x, topk_ids, topk_weights), fresh random data from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    xs, ids, weights = [], [], []
    for t in tokens_per_rank:
        xs.append(torch.randn(t, hidden, generator=gen).to(torch.bfloat16))
        i, w = ref.random_topk(t, num_experts, top_k, generator=gen, skew=skew,
                               world_size=world_size)
        if t > 0:  # some unused slots (-1), as vLLM's padding rows have
            i[torch.rand(t, top_k, generator=gen) < 0.1] = -1
        ids.append(i.to(id_dtype))
        weights.append(w)
    return xs, ids, weights


def _scaled_experts(recv_x, recv_ids, recv_weights, routed_mask):
    """Expert e scales by (1 + e/8); rows not routed here are NaN (the combine must not read
    them)."""
    scale = torch.where(recv_ids >= 0, recv_weights * (1 + recv_ids.float() / 8), 0.0)
    out = (recv_x.float() * scale.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    return torch.where(routed_mask[:, None], out, float("nan")).to(torch.bfloat16)


def _check_round(ep, xs, ids, weights, region_stride, quant=None, tag="",
                 num_experts=NUM_EXPERTS):
    """One dispatch + combine on every rank, checked against the reference."""
    world, K = ep.world_size, ids[0].shape[1]
    got = ep.dispatch(xs, ids, weights, region_stride, quant=quant)
    assert not isinstance(got, int), f"{tag}: dispatch launch returned {got}"
    expected = ref.dispatch_reference(xs, ids, weights, num_experts, region_stride, quant=quant)
    for rank, ((recv_x, recv_ids, recv_w, scales, counts), e) in enumerate(zip(got, expected)):
        assert torch.equal(recv_ids, e.recv_topk_ids), f"{tag}: ids differ on rank {rank}"
        assert torch.equal(recv_w, e.recv_topk_weights), f"{tag}: weights differ on rank {rank}"
        m = e.routed_mask
        if quant is None:
            assert torch.equal(recv_x[m], e.recv_x[m]), f"{tag}: rows differ on rank {rank}"
        else:
            assert torch.equal(recv_x[m].view(torch.uint8), e.recv_x[m].view(torch.uint8)), \
                f"{tag}: fp8 bytes differ on rank {rank}"
            assert torch.equal(scales[m], e.recv_x_scales[m]), f"{tag}: scales on rank {rank}"
        for src in range(world):
            routed = e.routed_mask[src * region_stride:(src + 1) * region_stride]
            per_group = [int(routed[g * 32:(g + 1) * 32].sum())
                         for g in range(-(-region_stride // 32))]
            assert counts[src, :len(per_group)].tolist() == per_group, \
                f"{tag}: group counts from rank {src} differ on rank {rank}"
    if quant is None:
        recv = [g[0] for g in got]
    else:
        recv = [ref.dequantize_fp8_reference(g[0], g[3]) for g in got]
    expert_outs = [_scaled_experts(x, e.recv_topk_ids, e.recv_topk_weights, e.routed_mask)
                   for x, e in zip(recv, expected)]
    ys = ep.combine(expert_outs, [x.shape[0] for x in xs], K, region_stride)
    want = ref.combine_reference(expert_outs, ids, num_experts)  # reads routed rows only
    for rank, (y, w) in enumerate(zip(ys, want)):
        # the same fp32 rank-order sum and one rounding: bit-exact
        assert torch.equal(y, w), f"{tag}: combine differs on rank {rank}: max err " \
            f"{(y.float() - w.float()).abs().max().item() if y.numel() else 0}"


@pytest.mark.parametrize("world_size,tokens,top_k,skew,hidden,num_blocks,id_dtype", [
    (2, [7, 40], 4, None, 136, 2, torch.int64),
    (2, [0, 33], 8, "one_expert", 72, 3, torch.int32),          # a rank with no tokens
    (4, [1, 5, 0, 64], 8, "hot_rank", 136, 2, torch.int64),     # EP4, unequal T
    (8, [3, 0, 9, 1, 2, 33, 4, 1], 8, None, 64, 2, torch.int32),  # EP8
    (2, [32, 20], 2, None, 2048, 4, torch.int64),                # hidden chunks per group
])
def test_dispatch_and_combine_match_reference(emu, world_size, tokens, top_k, skew, hidden,
                                              num_blocks, id_dtype):
    ep = EmuEp(emu, world_size, max_tokens=max(max(tokens), 1) + 3, hidden=hidden,
               num_blocks=num_blocks)
    try:
        for round_ in range(2):  # the second call checks the epoch advance and the flags' reuse
            seed = 1000 * world_size + 17 * hidden + round_
            xs, ids, ws = _inputs(seed, tokens, hidden, top_k, world_size, skew, id_dtype)
            _check_round(ep, xs, ids, ws, region_stride=max(max(tokens), 1),
                         tag=f"round {round_}")
        assert ep.epochs() == [2] * world_size
    finally:
        ep.close()


def test_the_limits_top_k_16_512_experts_hidden_over_8192(emu):
    """The issue's limits at once: top-k 16, 512 experts, a hidden size past 8192 that is a
    multiple of 8 but not of 16 or 128 (8200), 4 ranks, unequal T."""
    world, hidden, top_k, experts, tokens = 4, 8200, 16, 512, [5, 0, 3, 9]
    ep = EmuEp(emu, world, max_tokens=9, hidden=hidden, max_top_k=top_k, num_experts=experts)
    try:
        xs, ids, ws = _inputs(8200, tokens, hidden, top_k, world, num_experts=experts)
        _check_round(ep, xs, ids, ws, region_stride=9, num_experts=experts)
    finally:
        ep.close()


def test_4096_tokens_per_rank_and_a_region_stride_past_them(emu):
    """T = 4096 (128 token groups per source) and T = max tokens on the other rank, with a
    region stride above both (the rows past T are padding every rank skips)."""
    world, hidden, tokens, stride = 2, 32, [4096, 4100], 4104
    ep = EmuEp(emu, world, max_tokens=4104, hidden=hidden)
    try:
        xs, ids, ws = _inputs(4096, tokens, hidden, 8, world, id_dtype=torch.int32)
        _check_round(ep, xs, ids, ws, region_stride=stride)
    finally:
        ep.close()


@pytest.mark.parametrize("world_size,tokens", [(3, [4, 33, 0]), (6, [2, 7, 1, 0, 5, 3])])
def test_world_sizes_that_are_not_powers_of_two(emu, world_size, tokens):
    experts, top_k, hidden = 8 * world_size, 5, 72
    ep = EmuEp(emu, world_size, max_tokens=33, hidden=hidden, num_experts=experts)
    try:
        xs, ids, ws = _inputs(world_size, tokens, hidden, top_k, world_size, num_experts=experts)
        _check_round(ep, xs, ids, ws, region_stride=max(tokens), num_experts=experts)
    finally:
        ep.close()


def test_one_rank_receives_everything(emu):
    """Every token of every rank routed to rank 0's experts only (top-k within them)."""
    world, hidden, tokens = 4, 96, [12, 40, 1, 7]
    ep = EmuEp(emu, world, max_tokens=40, hidden=hidden)
    try:
        gen = torch.Generator().manual_seed(5)
        local = NUM_EXPERTS // world
        xs = [torch.randn(t, hidden, generator=gen).to(torch.bfloat16) for t in tokens]
        ids = [torch.rand(t, local, generator=gen).argsort(dim=1)[:, :4] for t in tokens]
        ws = [torch.rand(t, 4, generator=gen) for t in tokens]
        _check_round(ep, xs, ids, ws, region_stride=40)
    finally:
        ep.close()


@pytest.mark.parametrize("quant", ["fp8_block128", "fp8_per_token", "fp8_block128_ue8m0"])
def test_fp8_dispatch_matches_reference(emu, quant):
    world, hidden, tokens = 2, 256, [9, 40]
    ep = EmuEp(emu, world, max_tokens=40, hidden=hidden)
    try:
        xs, ids, ws = _inputs(77, tokens, hidden, 4, world)
        xs = [x * torch.logspace(-3, 3, x.shape[0])[:, None].to(x.dtype) for x in xs]
        _check_round(ep, xs, ids, ws, region_stride=40, quant=quant, tag=quant)
    finally:
        ep.close()


def test_back_to_back_rounds_without_barriers(emu):
    """Each rank runs dispatch -> identity experts -> combine round after round on its own
    thread, with no barrier between ranks (the buffer-reuse invariant alone keeps them
    apart), fresh data and token counts every round."""
    world, hidden, top_k, rounds, stride = 4, 64, 6, 5, 24
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, stride + 1, (rounds, world), generator=gen, dtype=torch.int32)
    x = torch.zeros(rounds, world, stride, hidden, dtype=torch.bfloat16)
    ids = torch.full((rounds, world, stride, top_k), -1, dtype=torch.int32)
    ws = torch.zeros(rounds, world, stride, top_k)
    per_round = []
    for r in range(rounds):
        xs_r, ids_r, ws_r = _inputs(500 + r, tokens[r].tolist(), hidden, top_k, world,
                                    id_dtype=torch.int32)
        for rank in range(world):
            t = int(tokens[r, rank])
            x[r, rank, :t], ids[r, rank, :t], ws[r, rank, :t] = xs_r[rank], ids_r[rank], ws_r[rank]
        per_round.append((xs_r, ids_r, ws_r))
    outs = torch.full((rounds, world, stride, hidden), float("nan"), dtype=torch.bfloat16)
    ep = EmuEp(emu, world, max_tokens=stride, hidden=hidden)
    try:
        results = _ints([0] * world)
        rc = emu.petit_emu_ep_rounds(ep.handle, rounds, x.data_ptr(), ids.data_ptr(),
                                     ws.data_ptr(), tokens.data_ptr(), top_k, stride,
                                     outs.data_ptr(), results)
        assert rc == 0, f"launches returned {list(results)}"
        assert ep.epochs() == [rounds] * world
    finally:
        ep.close()
    for r, (xs_r, ids_r, ws_r) in enumerate(per_round):
        expected = ref.dispatch_reference(xs_r, ids_r, ws_r, NUM_EXPERTS, stride)
        want = ref.combine_reference([e.recv_x for e in expected], ids_r, NUM_EXPERTS)
        for rank in range(world):
            t = int(tokens[r, rank])
            assert torch.equal(outs[r, rank, :t], want[rank]), f"round {r}, rank {rank}"


@pytest.mark.parametrize("world_size,tokens", [(2, [9, 20]), (4, [3, 0, 17, 6]),
                                               (8, [5, 1, 0, 12, 3, 7, 2, 9])])
def test_moe_layer_on_emulated_ranks(emu, tmp_path_factory, world_size, tokens):
    """The whole layer as the plugin runs it, every kernel emulated: dispatch, each rank's
    experts on what it received (the expert emulation's launch_experts with its routing ids
    and weights as dispatched, local ids or -1), combine; against the reference layer."""
    from test_experts_emu_cpu import load_experts_emu, run_emulated

    experts = load_experts_emu(tmp_path_factory)
    hidden, inter, top_k, stride = 64, 32, 4, max(tokens)
    gen = torch.Generator().manual_seed(23 + world_size)
    xs, ids, ws = _inputs(31 * world_size, tokens, hidden, top_k, world_size)
    w13 = (torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=gen) / hidden**0.5)
    w2 = (torch.randn(NUM_EXPERTS, hidden, inter, generator=gen) / inter**0.5)
    w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    local = NUM_EXPERTS // world_size
    ep = EmuEp(emu, world_size, max_tokens=stride, hidden=hidden)
    try:
        got = ep.dispatch(xs, ids, ws, stride)
        assert not isinstance(got, int), f"dispatch launch returned {got}"
        expert_outs = [
            run_emulated(experts, recv_x, recv_ids, recv_w,
                         w13[d * local:(d + 1) * local].contiguous(),
                         w2[d * local:(d + 1) * local].contiguous())[0]
            for d, (recv_x, recv_ids, recv_w, _, _) in enumerate(got)]
        ys = ep.combine(expert_outs, tokens, top_k, stride)
    finally:
        ep.close()
    kernel_ref = ref.ep_moe_reference(xs, ids, ws, w13, w2, world_size, "kernel", stride)
    fp32_ref = ref.ep_moe_reference(xs, ids, ws, w13, w2, world_size, "fp32", stride)
    ref.check_close(ys, fp32_ref, ref.tolerance(kernel_ref, fp32_ref), name="emulated layer")


@pytest.mark.parametrize("world_size,num_blocks", [(2, 1), (4, 3)])
def test_peer_write_fills_every_peers_combine_region(emu, world_size, num_blocks):
    """The benchmark ceiling's kernel (bench_dispatch_combine's peer-write rate): rank r's
    source goes to every other rank's combine region, in 4 KB spans of 16-byte vectors (the
    last span partial), and nothing to its own. With more than one writer per region each
    vector holds one of the writers' (they race, as on the GPU: the kernel only measures the
    rate)."""
    num_bytes = 16 * 1000  # 3.9 spans of 4 KB per peer
    ep = EmuEp(emu, world_size, max_tokens=64, hidden=128)
    try:
        gen = torch.Generator().manual_seed(world_size)
        srcs = [torch.randint(0, 256, (num_bytes,), generator=gen, dtype=torch.uint8)
                for _ in range(world_size)]
        results = _ints([0] * world_size)
        assert emu.petit_emu_ep_peer_write(ep.handle, _ptrs(srcs), num_bytes, num_blocks,
                                           results) == 0, list(results)
        for r in range(world_size):
            got = ep.region(r, COMBINE_ROWS, num_bytes, torch.uint8).view(-1, 16)
            from_peer = torch.zeros(got.shape[0], dtype=torch.bool)
            for s in range(world_size):
                if s != r:
                    from_peer |= (got == srcs[s].view(-1, 16)).all(dim=1)
            assert bool(from_peer.all()), \
                f"rank {r}: {int((~from_peer).sum())} vectors hold no peer's bytes"
    finally:
        ep.close()


def test_launchers_reject_bad_arguments(emu):
    """The launchers' own checks (the Python layer checks first and names the limit)."""
    ep = EmuEp(emu, 2, max_tokens=16, hidden=72, max_top_k=4)
    try:
        xs, ids, ws = _inputs(3, [4, 4], 72, 4, 2)
        assert ep.dispatch(xs, ids, ws, region_stride=17) != 0  # region stride > max tokens
        xs8, ids8, ws8 = _inputs(3, [4, 4], 72, 8, 2)
        assert ep.dispatch(xs8, ids8, ws8, region_stride=4) != 0  # top-k > the buffer's 4
        # fp8 1x128 blocks need hidden % 128 == 0
        assert ep.dispatch(xs, ids, ws, region_stride=4, quant="fp8_block128") != 0
        assert ep.epochs() == [0, 0], "a rejected call must not launch"
    finally:
        ep.close()


def test_create_rejects_bad_configurations(emu):
    for args in [(0, 8, 64, 4, 32, 2), (33, 8, 64, 4, 33 * 2, 2), (2, 8, 60, 4, 32, 2),
                 (2, 8, 64, 17, 32, 2), (3, 8, 64, 4, 32, 2), (2, 8, 64, 4, 32, 0)]:
        assert not emu.petit_emu_ep_create(*args, 1.0), args


# ---- in a fresh process (run_case): a trap aborts the process
def _case(lib_path, case):
    """Run by run_case in a fresh process."""
    lib = _load(ctypes.CDLL(lib_path))
    if case == "missing_rank":  # rank 1 never dispatches: rank 0's wait must expire
        ep = EmuEp(lib, 2, max_tokens=8, hidden=64, timeout_s=0.05)
        xs, ids, ws = _inputs(9, [4, 4], 64, 2, 2)
        ep.dispatch(xs, ids, ws, region_stride=4, ranks=[0])
        print("dispatch returned")
    elif case == "zero_token_combine":  # rank 1 has no tokens; rank 0 never combines
        ep = EmuEp(lib, 2, max_tokens=8, hidden=64, timeout_s=0.05)
        xs, ids, ws = _inputs(9, [4, 0], 64, 2, 2)
        recv = ep.dispatch(xs, ids, ws, region_stride=4)
        ep.combine([r[0] for r in recv], [4, 0], 2, 4, ranks=[1])
        print("combine returned")
    else:
        raise ValueError(case)


@pytest.mark.parametrize("config,plan", [
    (CombineConfig(), dict(reduce_chunks=2, static_reduce=0)),
    # reduce items = the send chunks
    (CombineConfig(reduce_vectors=0), dict(reduce_chunks=1, static_reduce=0)),
    (CombineConfig(reduce_items=0, reduce_vectors=64), dict(reduce_chunks=4, static_reduce=0)),
    # half the grid reduce-only, the senders claiming reduce items after their sends
    (CombineConfig(reduce_pct=50, reduce_vectors=64, reduce_items=0),
     dict(send_blocks=2, reduce_chunks=4, static_reduce=0)),
    # one sender, the other two blocks reduce from the start
    (CombineConfig(reduce_pct=90, reduce_vectors=0), dict(send_blocks=1, reduce_chunks=1)),
])
def test_the_combine_config_keeps_the_results(emu, config, plan):
    """The CombineConfig changes how the combine's work is cut (hidden chunks, 3 token groups,
    3 blocks per rank; the plan checked), never a result bit: two rounds against the
    reference, on one buffer."""
    ep = EmuEp(emu, 2, max_tokens=96, hidden=2048, num_blocks=3)
    try:
        ep.set_combine_config(config)
        got = ep.combine_plan(0, 96, 4, 96)
        assert {k: got[k] for k in plan} == plan, got
        for round_ in range(2):
            xs, ids, ws = _inputs(40 + round_, [96, 70], 2048, 4, 2)
            _check_round(ep, xs, ids, ws, region_stride=96, tag=f"round {round_}")
    finally:
        ep.close()


def test_static_reduction_of_small_combines(emu):
    """A combine with no more reduce items than reduce-only blocks gives each item its own
    block (no claim counter): 1 token group in 4 send and reduce chunks, 8 blocks."""
    ep = EmuEp(emu, 2, max_tokens=32, hidden=2048, num_blocks=8)
    try:
        plan = ep.combine_plan(0, 20, 2, 32)
        assert plan["static_reduce"] == 1 and plan["reduce_chunks"] == 4, plan
        assert plan["grid"] - plan["send_blocks"] >= plan["reduce_chunks"], plan
        for round_ in range(2):
            xs, ids, ws = _inputs(60 + round_, [20, 32], 2048, 2, 2)
            _check_round(ep, xs, ids, ws, region_stride=32, tag=f"round {round_}")
    finally:
        ep.close()


def test_invalid_combine_config_is_refused(emu):
    ep = EmuEp(emu, 2, max_tokens=32, hidden=64, num_blocks=2)
    try:
        emu.petit_emu_ep_set_combine_config(ep.handle, 91, 128, 8, 4)
        out = _ints([0] * 6)
        assert emu.petit_emu_ep_combine_plan(ep.handle, 0, 8, 2, 32, out) != 0
    finally:
        ep.close()


def combine_plan_sizes(lib, world, hidden, tokens, stride, num_blocks, config=CombineConfig()):
    """(rc, plan dict, message) of plan_combine_sizes (csrc/api.h: a combine's plan without a
    context, the binding's combine_plan); config: a CombineConfig or its fields (a tuple, which
    may be invalid)."""
    fields = config if isinstance(config, tuple) else dataclasses.astuple(config)
    out, err = _ints([0] * 6), ctypes.create_string_buffer(512)
    rc = lib.petit_emu_combine_plan_sizes(world, hidden, tokens, stride, num_blocks, *fields,
                                          out, err, len(err))
    plan = dict(zip(("send_chunks", "whole_pairs", "send_blocks", "reduce_chunks",
                     "static_reduce", "grid"), list(out)))
    return rc, plan, err.value.decode()


@pytest.mark.parametrize("sizes,config,pattern", [
    ((1, 64, 1, 1, 2), CombineConfig(), r"^world size 1 outside \[2, 32\]$"),
    ((33, 64, 1, 1, 2), CombineConfig(), r"^world size 33 outside"),
    ((2, 60, 1, 1, 2), CombineConfig(), r"^hidden size 60 must be a positive multiple of 8$"),
    ((2, 0, 1, 1, 2), CombineConfig(), r"^hidden size 0 must be"),
    ((2, 64, 10, 5, 2), CombineConfig(),
     r"^need 0 <= num_tokens \(10\) <= region_stride \(5\), region_stride >= 1$"),
    ((2, 64, -1, 5, 2), CombineConfig(), r"^need 0 <= num_tokens \(-1\)"),
    ((2, 64, 0, 0, 2), CombineConfig(), r"region_stride \(0\), region_stride >= 1$"),
    ((2, 64, 1, 1, 0), CombineConfig(), r"^num_blocks 0 must be >= 1$"),
    ((2, 64, 1, 1, 2), (91, 128, 8, 4), r"^CombineConfig: reduce_pct in \[0, 90\]"),
])
def test_combine_plan_sizes_bad_sizes_name_the_limit(emu, sizes, config, pattern):
    rc, _, message = combine_plan_sizes(emu, *sizes, config=config)
    assert rc != 0 and re.search(pattern, message), (rc, message)


@pytest.mark.parametrize("world,hidden,tokens,stride,num_blocks,config", [
    (2, 7168, 1, 1, 132, CombineConfig()),
    (2, 2048, 96, 96, 3, CombineConfig(reduce_pct=50, reduce_vectors=64, reduce_items=0)),
    (4, 64, 0, 40, 2, CombineConfig()),
    (8, 1024, 100, 117, 24, CombineConfig(reduce_vectors=0)),
])
def test_combine_plan_sizes_is_a_contexts_plan(emu, world, hidden, tokens, stride, num_blocks,
                                               config):
    """Without a context, the plan a context of region_stride tokens per rank makes."""
    rc, plan, message = combine_plan_sizes(emu, world, hidden, tokens, stride, num_blocks, config)
    assert rc == 0 and message == "", message
    ep = EmuEp(emu, world, max_tokens=stride, hidden=hidden, max_top_k=1,
               num_experts=world, num_blocks=num_blocks)
    try:
        ep.set_combine_config(config)
        assert ep.combine_plan(0, tokens, 1, stride) == plan
    finally:
        ep.close()


def test_a_rank_without_tokens_waits_for_its_peers_combine(emu):
    """A rank with no tokens reduces nothing, yet its combine must not return before every
    peer's combine of the epoch has started: else its next dispatch can overwrite its flag in
    a peer that has not read it yet, and that peer waits for an epoch the flag no longer shows
    (the W = 2 soak's hang at 0 tokens on both ranks, 22c66b7). Rank 0 never combines: rank
    1's combine must time out naming rank 0."""
    _assert_case_traps(emu, "zero_token_combine", "combine",
                       "combine timed out on rank 1 waiting for rank 0, token group 0: "
                       "expected epoch 1, flag holds epoch 0")


def test_a_missing_rank_times_out_naming_rank_peer_and_epoch(emu):
    _assert_case_traps(emu, "missing_rank", "dispatch",
                       "dispatch timed out on rank 0 waiting for rank 1, token group 0: "
                       "expected epoch 1, flag holds epoch 0")


def _assert_case_traps(emu, case, phase, message):
    """_case(case) in a fresh process must trap (its `phase` never returns) printing message;
    PETIT_EMU_EXPECT_TRAP keeps the expected trap out of CI's trap log (tests/emu/emu_ptx.h)."""
    result = run_case(__file__, emu._name, case, env={"PETIT_EMU_EXPECT_TRAP": "1"})
    assert result.returncode != 0, f"{case}: the {phase} returned instead of trapping"
    assert f"{phase} returned" not in result.stdout
    out = result.stdout + result.stderr
    assert message in out, out[-2000:]
