"""CPU: the expert kernels (csrc/experts/experts.cu) run unchanged under a thread-per-GPU-thread
emulation (tests/emu/experts_emu.cpp), against the torch reference.

This checks the kernels' index math, bounds handling, persistent tile loop, scheduler scan and
barrier placement before (and besides) the GPU tests in test_experts_gpu.py; it says nothing
about performance or the GPU memory model. The tensor-core families (sm_80 mma, the sm_90a wgmma
ones, the warp-specialized ones included) run too, on an emulation of their PTX
(tests/emu/emu_ptx.h: cp.async and wgmma completing as late as allowed, ldmatrix / mma.sync
across the warp's lanes, mbarriers), with the emulated device reporting compute capability 9.0.
The row lists come from the reference (the routing kernel has its own GPU test). Needs g++ and
the CUDA headers (for uint4/float4/dim3 only).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import build_emu_library
from vllm_petit_moe.testing import reference
from vllm_petit_moe.ops import TILE_NAMES, TILES

TENSOR_CORE = ("mma",) + tuple(t for t in TILES if t.startswith("wgmma"))


@pytest.fixture(scope="session")
def emu(tmp_path_factory):
    return load_experts_emu(tmp_path_factory)


def load_experts_emu(tmp_path_factory):
    """tests/emu/experts_emu.cpp built (once per session) and its result types set."""
    lib = build_emu_library(tmp_path_factory, "experts_emu")
    lib.petit_emu_experts.restype = ctypes.c_int
    lib.petit_emu_set_compute_capability.restype = None
    lib.petit_emu_last_gemm_launch.restype = None
    lib.petit_emu_resolve_tiles.restype = ctypes.c_int
    lib.petit_emu_split_floats_written.restype = ctypes.c_int64
    lib.petit_emu_fused_gemms.restype = ctypes.c_int
    lib.petit_emu_fused_auto_narrow.restype = ctypes.c_int
    return lib


def last_launch(lib, gate_up):
    shape = (ctypes.c_int * 4)()
    lib.petit_emu_last_gemm_launch(int(gate_up), shape)
    return dict(zip(("grid", "threads", "smem_bytes", "cluster"), shape))


@pytest.fixture
def sm90(emu):
    """The emulated device reports compute capability 9.0 (the tensor-core families run), then
    2.0."""
    emu.petit_emu_set_compute_capability(9, 0)
    yield emu
    emu.petit_emu_set_compute_capability(2, 0)


def run_emulated(lib, recv_x, ids, weights, w13, w2, *, tiles="auto", num_sms=1,
                 expert_map=None):
    """launch_experts on the CPU; act/partial/out poisoned with NaN first. With `expert_map`
    ([E] int32), `ids` are global ids that the kernels map."""
    num_rows, hidden = recv_x.shape
    top_k = ids.shape[1]
    num_local, intermediate = w13.shape[0], w13.shape[1] // 2
    local_ids = ids
    if expert_map is not None:
        num_global = expert_map.numel()
        in_range = (ids >= 0) & (ids < num_global)
        local_ids = torch.where(in_range, expert_map[ids.clamp(0, num_global - 1).long()], -1)
    # The routing kernel skips ids outside [0, L) like -1; the reference rejects them.
    local_ids = torch.where((local_ids >= 0) & (local_ids < num_local), local_ids, -1)
    _, offsets, sorted_entries = reference.expert_row_lists_reference(local_ids, num_local)
    act = torch.full((num_rows * top_k, intermediate), float("nan"), dtype=torch.bfloat16)
    partial = torch.full((num_rows * top_k, hidden), float("nan"), dtype=torch.bfloat16)
    out = torch.full((num_rows, hidden), float("nan"), dtype=torch.bfloat16)
    used = ctypes.c_int(-1)
    tensors = [recv_x, ids, weights, w13, w2, offsets, sorted_entries, act, partial, out]
    assert all(t.is_contiguous() for t in tensors)
    rc = lib.petit_emu_experts(
        *[ctypes.c_void_p(t.data_ptr()) for t in tensors],
        num_rows, top_k, hidden, intermediate, num_local, TILES[tiles], num_sms,
        ctypes.c_void_p(expert_map.data_ptr() if expert_map is not None else None),
        expert_map.numel() if expert_map is not None else 0,
        ctypes.byref(used),
    )
    assert rc == 0, f"launch_experts returned {rc}"
    return out, TILE_NAMES[used.value]


def make_problem(ids, hidden, intermediate, num_local, seed):
    """Fresh random data for routing `ids` [N, K] int32 (never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, top_k = ids.shape
    recv_x = torch.randn(num_rows, hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(num_rows, top_k, generator=gen) + 0.05
    weights = torch.where(ids >= 0, weights, 0.0).float()
    w13 = (torch.randn(num_local, 2 * intermediate, hidden, generator=gen) / hidden**0.5)
    w2 = (torch.randn(num_local, hidden, intermediate, generator=gen) / intermediate**0.5)
    return recv_x, ids.contiguous(), weights, w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def routing_with_counts(counts, seed):
    """ids [N, K = len(counts)] where local expert e gets exactly counts[e] entries, on
    random rows, in random slots (the other slots -1)."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, top_k = max(counts), len(counts)
    ids = torch.full((num_rows, top_k), -1, dtype=torch.int32)
    for expert, count in enumerate(counts):
        ids[torch.randperm(num_rows, generator=gen)[:count], expert] = expert
    slot_order = torch.rand(num_rows, top_k, generator=gen).argsort(dim=1)
    return ids.gather(1, slot_order).contiguous()


def top1_ids(counts, seed):
    """ids [sum(counts), 1]: counts[e] rows routed to local expert e alone, in random order."""
    ids = torch.cat([torch.full((c, 1), e, dtype=torch.int32) for e, c in enumerate(counts)])
    return ids[torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(seed))]


def run_with_knob(lib, monkeypatch, knob, value, problem, tiles, num_sms):
    """run_emulated with the environment knob set to value, asserting it ran `tiles`."""
    monkeypatch.setenv(knob, value)
    out, used = run_emulated(lib, *problem, tiles=tiles, num_sms=num_sms)
    assert used == tiles
    return out


def knob_on_equals_off(lib, monkeypatch, knob, problem, tiles, num_sms):
    """run_with_knob at 1 and at 0 on the same problem: asserts bit-equal outputs, checks the
    one with the knob on against the reference and returns it."""
    on = run_with_knob(lib, monkeypatch, knob, "1", problem, tiles, num_sms)
    assert torch.equal(on, run_with_knob(lib, monkeypatch, knob, "0", problem, tiles, num_sms))
    check_against_reference(on, problem)
    return on


def check_against_reference(out, problem):
    kernel_ref = reference.experts_reference(*problem, precision="kernel")
    fp32_ref = reference.experts_reference(*problem, precision="fp32")
    reference.check_close(out, fp32_ref, reference.tolerance(kernel_ref, fp32_ref))
    no_local = ~(problem[1] >= 0).any(dim=1)
    assert bool((out[no_local] == 0).all()), "rows without a local id must be 0"


@pytest.mark.parametrize("tiles", ["small", "large", "decode"])
@pytest.mark.parametrize("hidden, intermediate", [(136, 40), (8, 8), (40, 136)])
def test_random_routing_odd_shapes(emu, tiles, hidden, intermediate):
    gen = torch.Generator().manual_seed(hidden * 7 + intermediate)
    ids = torch.randint(0, 5, (37, 4), generator=gen, dtype=torch.int32)
    ids = torch.where(torch.rand(37, 4, generator=gen) < 0.3, -1, ids)
    ids[3] = -1  # a row with no local slot
    problem = make_problem(ids, hidden, intermediate, 5, seed=1)
    out, used = run_emulated(emu, *problem, tiles=tiles, num_sms=2)
    assert used == tiles
    check_against_reference(out, problem)


@pytest.mark.parametrize("top_k", [1, 8])
def test_empty_experts_and_one_expert_with_all_rows(emu, top_k):
    ids = torch.full((300, top_k), -1, dtype=torch.int32)
    ids[:, top_k - 1] = 4  # expert 4 of 6 gets every row, experts 0-3 and 5 none
    problem = make_problem(ids, 24, 16, 6, seed=2)
    for tiles in ("small", "large", "decode"):
        out, _ = run_emulated(emu, *problem, tiles=tiles)
        check_against_reference(out, problem)


def test_rows_per_expert_1_to_4096(emu):
    counts = [1, 2, 3, 15, 16, 17, 127, 128, 129, 4096]
    ids = routing_with_counts(counts, seed=3)
    assert torch.bincount(ids[ids >= 0].long()).tolist() == counts
    problem = make_problem(ids, 16, 8, len(counts), seed=4)
    for tiles in ("small", "large", "decode"):
        out, _ = run_emulated(emu, *problem, tiles=tiles, num_sms=4)
        check_against_reference(out, problem)


def test_all_rows_unrouted_give_zeros(emu):
    ids = torch.full((9, 2), -1, dtype=torch.int32)
    ids[4, 1] = 7  # outside [0, L): not local either
    problem = make_problem(ids, 16, 8, 3, seed=5)
    out, _ = run_emulated(emu, *problem)
    assert bool((out == 0).all())


def test_deterministic_and_batch_invariant(emu):
    """Fixed-order fp32 FMA chains and a fixed-order slot sum: bit-identical across tile
    families, repeated runs, grid sizes and batch compositions (what PetitExperts claims)."""
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(-1, 4, (40, 3), generator=gen, dtype=torch.int32)
    problem = make_problem(ids, 72, 24, 4, seed=7)
    small, _ = run_emulated(emu, *problem, tiles="small", num_sms=1)
    large, _ = run_emulated(emu, *problem, tiles="large", num_sms=3)
    again, _ = run_emulated(emu, *problem, tiles="small", num_sms=5)
    assert torch.equal(small, large) and torch.equal(small, again)
    first = 11
    x, i, w, w13, w2 = problem
    part, _ = run_emulated(emu, x[:first].contiguous(), i[:first].contiguous(),
                           w[:first].contiguous(), w13, w2, tiles="small")
    assert torch.equal(part, small[:first])


def test_decode_tiles_are_deterministic_and_batch_invariant(emu):
    """The decode family sums each dot product in a fixed order (lane-strided fp32 chains, then
    the 32 lanes in order): repeatable over grid sizes and batch compositions. (Its order
    differs from the SIMT families', so it is compared with them only through the
    reference.)"""
    gen = torch.Generator().manual_seed(16)
    ids = torch.randint(-1, 4, (40, 3), generator=gen, dtype=torch.int32)
    problem = make_problem(ids, 264, 72, 4, seed=17)  # K spans several lane strides
    one, _ = run_emulated(emu, *problem, tiles="decode", num_sms=1)
    three, _ = run_emulated(emu, *problem, tiles="decode", num_sms=3)
    assert torch.equal(one, three)
    check_against_reference(one, problem)
    first = 11
    x, i, w, w13, w2 = problem
    part, _ = run_emulated(emu, x[:first].contiguous(), i[:first].contiguous(),
                           w[:first].contiguous(), w13, w2, tiles="decode")
    assert torch.equal(part, one[:first])


def test_auto_tiles_follow_rows_per_expert(emu):
    # The large tiles from N*K / L >= 256 rows per expert on (experts.cu).
    ids = torch.zeros((64, 8), dtype=torch.int32)
    x, ids, w, w13, w2 = make_problem(ids, 8, 8, 2, seed=8)
    _, used = run_emulated(emu, x, ids, w, w13, w2)  # 64*8 / 2 = 256
    assert used == "large"
    _, used = run_emulated(emu, x[:63].contiguous(), ids[:63].contiguous(),
                           w[:63].contiguous(), w13, w2)  # 252
    assert used == "small"


@pytest.mark.parametrize("tiles", TENSOR_CORE)
def test_tensor_core_families_on_emulated_ptx(sm90, tiles):
    """The tensor-core families' data path on the CPU: cp.async tile loads into the swizzled
    ring, ldmatrix / mma.sync fragments or wgmma descriptors and accumulator layout, the
    epilogues, and for the *_ws families the producer/consumer ring over mbarriers. Odd K
    (3 and 4 k-tiles, the last partial), several tiles per block (the ring wraps around its
    stages and, warp-specialized, runs on across tiles), an expert with no rows, a row with no
    local slot."""
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 4, (45, 3), generator=gen, dtype=torch.int32)
    ids = torch.where(ids == 3, -1, ids)  # expert 3 of 5 never, expert 4 never either
    ids[7] = -1
    problem = make_problem(ids, 136, 200, 5, seed=22)
    out, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=2)
    assert used == tiles
    check_against_reference(out, problem)


@pytest.mark.parametrize("ws,plain", [("wgmma_ws", "wgmma"), ("wgmma_m64_ws", "wgmma_m64"),
                                     ("wgmma_narrow_ws", "wgmma_narrow"),
                                     ("wgmma_ws_mc", "wgmma_ws")])
def test_warp_specialized_families_equal_their_tiles(sm90, ws, plain):
    gen = torch.Generator().manual_seed(24)
    ids = torch.randint(-1, 3, (60, 2), generator=gen, dtype=torch.int32)
    problem = make_problem(ids, 200, 136, 3, seed=25)  # 4 and 3 k-tiles, the ring wraps
    got, _ = run_emulated(sm90, *problem, tiles=ws, num_sms=1)
    want, _ = run_emulated(sm90, *problem, tiles=plain, num_sms=1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("hidden,inter", [(72, 64), (520, 296)])
def test_clusters_with_odd_m_tiles_and_several_clusters(sm90, hidden, inter):
    """wgmma_ws_mc: clusters of 2 CTAs take two m-tiles of one (expert, n-tile) together and
    multicast the weight boxes into both; an expert's odd last m-tile is split by n-tile
    between the two CTAs, each loading its own weights. Experts with 1, 2 and 3 m-tiles of 128
    rows; 1 n-tile per GEMM (the second CTA of a split unit has no n-tile, no rows, and still
    walks the unit's k-tiles) or 3 (an odd count: the last split unit's second CTA again has
    none); 2 clusters (4 CTAs) walking several units each: bit-equal to wgmma_ws."""
    counts = [100, 200, 300]
    ids = top1_ids(counts, seed=31)
    problem = make_problem(ids.contiguous(), hidden, inter, 3, seed=32)
    got, used = run_emulated(sm90, *problem, tiles="wgmma_ws_mc", num_sms=4)
    assert used == "wgmma_ws_mc"
    for gate_up in (True, False):  # 2 clusters of 2 CTAs of 384 threads
        shape = last_launch(sm90, gate_up)
        assert (shape["grid"], shape["threads"], shape["cluster"]) == (4, 384, 2), shape
    want, _ = run_emulated(sm90, *problem, tiles="wgmma_ws", num_sms=4)
    assert torch.equal(got, want)
    check_against_reference(got, problem)
    assert last_launch(sm90, True)["cluster"] == 1
    # an odd SM count: whole clusters only (3 -> 1 cluster of 2)
    again, _ = run_emulated(sm90, *problem, tiles="wgmma_ws_mc", num_sms=3)
    assert torch.equal(again, got)
    assert (last_launch(sm90, False)["grid"], last_launch(sm90, False)["cluster"]) == (2, 2)


@pytest.mark.parametrize("tiles,num_sms", [("wgmma_ws", 1), ("wgmma_ws", 3), ("wgmma_ws_mc", 2),
                                           ("wgmma_ws_mc", 4)])
def test_staged_down_epilogue_equals_the_plain_one(sm90, monkeypatch, tiles, num_sms):
    """PETIT_MOE_STAGED_EPILOGUE=1: the down GEMM of wgmma_ws / wgmma_ws_mc writes its tile
    through a shared-memory staging buffer and per-row bulk copies (3-stage ring), bit-equal to
    the plain epilogue. Several tiles per block (the staging buffer is rewritten while the
    previous tile's copies may still read it), a partial last n-tile (hidden 520: 8 columns),
    experts with 1-3 m-tiles of rows, one with none."""
    counts = [100, 0, 200, 300]
    ids = top1_ids(counts, seed=61)
    problem = make_problem(ids.contiguous(), 520, 136, 4, seed=62)
    knob = "PETIT_MOE_STAGED_EPILOGUE"
    staged = run_with_knob(sm90, monkeypatch, knob, "1", problem, tiles, num_sms)
    assert last_launch(sm90, False)["smem_bytes"] > last_launch(sm90, True)["smem_bytes"]
    plain = run_with_knob(sm90, monkeypatch, knob, "0", problem, tiles, num_sms)
    assert torch.equal(staged, plain)
    check_against_reference(staged, problem)


@pytest.mark.parametrize("tiles,num_sms", [("wgmma_ws", 1), ("wgmma_ws", 3), ("wgmma_ws_mc", 4)])
def test_down_act_rows_by_tma_equal_the_gather(sm90, monkeypatch, tiles, num_sms):
    """PETIT_MOE_DOWN_A_TMA=1: the staged down GEMM of wgmma_ws / wgmma_ws_mc loads its act
    rows as one TMA box per stage (the TMA issuer the stage's only arrival) instead of the
    producer warpgroup's cp.async: bit-equal. The boxes also read rows past each tile's last
    (the next expert's, and NaN-poisoned workspace rows past the last valid entry), which
    must not reach the output; experts with 0-3 m-tiles, a partial last n-tile and k-tile
    (hidden 520, intermediate 136)."""
    counts = [100, 0, 200, 300]
    ids = top1_ids(counts, seed=63)
    ids = torch.cat([ids, torch.full_like(ids[:50], -1)])  # unrouted rows: act rows never written
    problem = make_problem(ids.contiguous(), 520, 136, 4, seed=64)
    knob_on_equals_off(sm90, monkeypatch, "PETIT_MOE_DOWN_A_TMA", problem, tiles, num_sms)


def test_a_trap_reports_to_stderr_and_appends_to_the_trap_log(emu, tmp_path):
    """A trap of the emulation (a pipeline wait past its bound, a bad barrier, ...) aborts the
    process, which loses pytest's capture of stderr: the message also goes to the file
    $PETIT_EMU_TRAP_LOG (appended; .ci/run prints it)."""
    log = tmp_path / "trap.log"
    log.write_text("earlier\n")
    code = f"import ctypes; ctypes.CDLL({emu._name!r}).petit_emu_trap(b'test trap')"
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True, env={**os.environ, "PETIT_EMU_TRAP_LOG": str(log)},
                            timeout=120)
    assert result.returncode == -signal.SIGABRT, result
    line = "emu_ptx: trap: test trap (block 0, thread 0)"
    assert line in result.stderr
    assert log.read_text() == f"earlier\n{line}\n"


def test_auto_bounds_on_an_sm90_device(sm90):
    """auto's choice by the rows-per-expert estimate N*K / L and the hidden size, where the
    wgmma families run: wgmma_narrow_ws below 2, wgmma_m64_ws below 96, wgmma_ws from there,
    wgmma_ws_mc from 256 at hidden >= 4096 (the bounds measured on H200, csrc/experts/experts.cu)."""
    def auto(num_rows, top_k, num_local, hidden):
        return TILE_NAMES[sm90.petit_emu_resolve_tiles(num_rows, top_k, num_local, hidden, 0)]

    L = 128  # N*K / L = num_rows * 8 / 128 = num_rows / 16
    assert auto(0, 8, L, 7168) == "wgmma_narrow_ws"
    assert auto(31, 8, L, 7168) == "wgmma_narrow_ws"    # 1.9375
    assert auto(32, 8, L, 7168) == "wgmma_m64_ws"       # 2
    assert auto(1535, 8, L, 7168) == "wgmma_m64_ws"     # 95.9
    assert auto(1536, 8, L, 7168) == "wgmma_ws"         # 96
    assert auto(4095, 8, L, 7168) == "wgmma_ws"         # 255.9
    assert auto(4096, 8, L, 7168) == "wgmma_ws_mc"      # 256
    assert auto(4096, 8, L, 4096) == "wgmma_ws_mc"
    assert auto(4096, 8, L, 4088) == "wgmma_ws"         # below the hidden bound
    assert auto(65536, 8, L, 2048) == "wgmma_ws"        # Qwen3's hidden size: never clustered
    for name in ("small", "wgmma_m64", "wgmma_ws_mc"):   # an explicit family stays
        assert TILE_NAMES[sm90.petit_emu_resolve_tiles(4, 8, L, 7168, TILES[name])] == name


def test_auto_without_wgmma(emu):
    """Compute capability 2.0 (the emulator's default): auto takes the portable SIMT tiles,
    small below 256 routing entries per local expert, large from there."""
    assert TILE_NAMES[emu.petit_emu_resolve_tiles(4095, 8, 128, 7168, 0)] == "small"
    assert TILE_NAMES[emu.petit_emu_resolve_tiles(4096, 8, 128, 7168, 0)] == "large"


@pytest.mark.parametrize("tiles", ["mma", "wgmma_ws"])
def test_tensor_core_families_need_their_device(emu, tiles):
    # Compute capability 2.0 (the emulator's default): asked-for tensor-core families fail
    # cleanly (launch_experts returns an error, nothing runs).
    problem = make_problem(torch.zeros((4, 1), dtype=torch.int32), 16, 8, 1, seed=23)
    with pytest.raises(AssertionError, match="returned"):
        run_emulated(emu, *problem, tiles=tiles)


def test_reduction_maps_global_ids_through_the_expert_map(emu):
    """With vLLM's expert_map the local reduction applies the same validity rule to global ids
    as the row lists (csrc/common/expert_ids.h): bit-equal to the run on the mapped local ids."""
    num_local, num_global = 6, 20
    gen = torch.Generator().manual_seed(5)
    owned = torch.randperm(num_global, generator=gen)[:num_local]
    expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    expert_map[owned] = torch.randperm(num_local, generator=gen).int()
    global_ids = torch.randint(-1, num_global + 2, (40, 4), generator=gen, dtype=torch.int32)
    in_range = (global_ids >= 0) & (global_ids < num_global)
    local_ids = torch.where(in_range, expert_map[global_ids.clamp(0, num_global - 1).long()],
                            -1).int()
    assert int((local_ids >= 0).sum()) > 20 and int((local_ids < 0).sum()) > 20
    recv_x, _, weights, w13, w2 = make_problem(local_ids, 48, 24, num_local, seed=6)
    want, _ = run_emulated(emu, recv_x, local_ids, weights, w13, w2, tiles="small")
    got, _ = run_emulated(emu, recv_x, global_ids, weights, w13, w2, tiles="small",
                          expert_map=expert_map)
    assert torch.equal(got, want)


def test_reduction_kernels_one_wave_and_grid_agree(emu):
    """The local reduction runs batched loads in one wave when the call's 8-column chunks fit
    kReduceBlocksPerSmBatched (6) blocks of 256 threads per SM, else one load at a time over
    a grid (experts.cu, launch_expert_reduce). Same problem, 2600 chunks (40 rows, hidden 520):
    11 blocks > 6 on 1 SM (the grid kernel), <= 12 on 2 SMs (one wave): bit-equal (the GEMMs
    do not depend on the grid), and right against the reference, with 1-8 valid slots per row
    (top-k 8: a wave's batches of 4 and their remainder)."""
    gen = torch.Generator().manual_seed(17)
    ids = torch.randint(0, 6, (40, 8), generator=gen, dtype=torch.int32)
    ids = torch.where(torch.rand(40, 8, generator=gen) < 0.4, -1, ids)
    ids[0] = torch.arange(8, dtype=torch.int32) % 6  # every slot valid
    ids[1, 1:] = -1
    problem = make_problem(ids, 520, 24, 6, seed=18)
    on_grid, _ = run_emulated(emu, *problem, tiles="small", num_sms=1)
    one_wave, _ = run_emulated(emu, *problem, tiles="small", num_sms=2)
    assert torch.equal(on_grid, one_wave)
    check_against_reference(one_wave, problem)


@pytest.mark.parametrize("tiles,num_sms", [("wgmma_narrow_ws", 16), ("wgmma_m64_ws", 8),
                                           ("wgmma_m64_ws", 3)])
def test_split_k_matches_the_reference(sm90, monkeypatch, tiles, num_sms):
    """PETIT_MOE_SPLIT_K=4 (the 64-row ws families): with fewer tiles than twice the blocks,
    each tile's k-tiles run as up to 4 shares on neighbouring blocks (uneven shares: 17 and 9
    k-tiles), fp32 partials summed by the tile's last share in share order. Partials written
    (so the split ran), against the reference, the same on a repeat; the emulation checks
    that every arrival counter is back at zero."""
    ids = torch.full((6, 2), -1, dtype=torch.int32)
    ids[0, 0] = 1                # expert 1: 1 row
    ids[1:4, 1] = 3              # expert 3: 3 rows
    ids[4, 0], ids[4, 1] = 3, 1  # a row in both
    problem = make_problem(ids, 1032, 520, 5, seed=81)
    monkeypatch.setenv("PETIT_MOE_SPLIT_K", "4")
    split, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert used == tiles
    assert sm90.petit_emu_split_floats_written() > 0, "no tile was split"
    check_against_reference(split, problem)
    again, _ = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert torch.equal(split, again)
    monkeypatch.setenv("PETIT_MOE_SPLIT_K", "1")
    plain, _ = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert sm90.petit_emu_split_floats_written() == 0
    check_against_reference(plain, problem)


def test_split_k_is_not_taken_where_it_does_not_pay(sm90, monkeypatch):
    """Many tiles per block (or k too short for 2 shares of 4 k-tiles): PETIT_MOE_SPLIT_K
    changes nothing, bit for bit."""
    ids = torch.randint(0, 4, (200, 2), generator=torch.Generator().manual_seed(9),
                        dtype=torch.int32)
    problem = make_problem(ids, 264, 136, 4, seed=82)  # 5 and 3 k-tiles
    monkeypatch.setenv("PETIT_MOE_SPLIT_K", "4")
    split, _ = run_emulated(sm90, *problem, tiles="wgmma_m64_ws", num_sms=2)
    assert sm90.petit_emu_split_floats_written() == 0
    monkeypatch.setenv("PETIT_MOE_SPLIT_K", "1")
    plain, _ = run_emulated(sm90, *problem, tiles="wgmma_m64_ws", num_sms=2)
    assert torch.equal(split, plain)


def decode_routing(seed):
    """Decode-like routing: rows with 0 to 4 local slots, experts with 0 to several rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (23, 4), generator=gen, dtype=torch.int32)
    ids = torch.where(torch.rand(23, 4, generator=gen) < 0.35, -1, ids)
    ids[2] = -1      # no local slot
    ids[7] = torch.tensor([0, 1, 2, 3], dtype=torch.int32)  # four local slots
    ids[ids == 4] = 3  # expert 4 gets no row
    return ids.contiguous()


# The emulation runs blocks one after another, so the first block of a fused launch claims
# every tile (its producer waiting for its own consumers' gate/up arrivals before each down
# tile) and the others claim none: one tagged end stage each.
@pytest.mark.parametrize("tiles", ["wgmma_narrow_ws", "wgmma_m64_ws"])
@pytest.mark.parametrize("num_sms", [1, 3])
def test_fused_gemms_equal_the_two_launches(sm90, monkeypatch, tiles, num_sms):
    """PETIT_MOE_FUSED_GEMMS=1 (the 64-row ws families): gate/up and down tiles in one launch
    on one ring, each down tile after its expert's gate/up arrivals; bit-equal to the two
    launches, with partial last column tiles (hidden 392, intermediate 72) and an expert with
    no row."""
    problem = make_problem(decode_routing(91), 392, 72, 5, seed=92)
    monkeypatch.setenv("PETIT_MOE_FUSED_GEMMS", "1")
    fused, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert used == tiles and sm90.petit_emu_fused_gemms() == 1
    monkeypatch.setenv("PETIT_MOE_FUSED_GEMMS", "0")
    plain, _ = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert sm90.petit_emu_fused_gemms() == 0
    assert torch.equal(fused, plain)
    check_against_reference(fused, problem)


@pytest.mark.parametrize("tiles", ["wgmma_narrow_ws", "wgmma_m64_ws"])
@pytest.mark.parametrize("ahead,num_sms", [("1", 1), ("3", 3), ("64", 1)])
def test_fused_gemms_weights_ahead_of_the_wait(sm90, monkeypatch, tiles, ahead, num_sms):
    """PETIT_MOE_FUSED_B_AHEAD=N: a down tile's TMA issuer issues the w2 boxes of its first
    min(N, k-tiles, stages) k-tiles before the gate/up wait, produce() adds only their A rows;
    bit-equal to the fused launch without it. Intermediate 584: 10 down k-tiles, more than
    either family's ring (5 / 8 stages), so the ring wraps inside a tile; 64 is clamped."""
    problem = make_problem(decode_routing(95), 136, 584, 5, seed=96)
    monkeypatch.setenv("PETIT_MOE_FUSED_GEMMS", "1")
    monkeypatch.setenv("PETIT_MOE_FUSED_B_AHEAD", ahead)
    ahead_out, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert used == tiles and sm90.petit_emu_fused_gemms() == 1
    monkeypatch.delenv("PETIT_MOE_FUSED_B_AHEAD")
    plain, _ = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert torch.equal(ahead_out, plain)
    check_against_reference(ahead_out, problem)


def test_auto_narrow_bound_from_the_environment(sm90, monkeypatch):
    """PETIT_MOE_NARROW_MAX_ROWS=R moves auto's wgmma_narrow_ws / wgmma_m64_ws bound (default
    2 routing entries per local expert; 0: never narrow; clamped to 96). 40 rows x top-4 over
    5 experts is 32 entries per expert; 2 rows x top-4 is 1.6."""
    many = make_problem(torch.randint(0, 5, (40, 4), generator=torch.Generator().manual_seed(3),
                                      dtype=torch.int32), 136, 40, 5, seed=98)
    few = make_problem(torch.tensor([[3, -1, 0, 4], [1, 3, -1, -1]], dtype=torch.int32), 136,
                       40, 5, seed=99)
    for value, want_many, want_few in [(None, "wgmma_m64_ws", "wgmma_narrow_ws"),
                                       ("33", "wgmma_narrow_ws", "wgmma_narrow_ws"),
                                       ("1000", "wgmma_narrow_ws", "wgmma_narrow_ws"),
                                       ("0", "wgmma_m64_ws", "wgmma_m64_ws")]:
        if value is None:
            monkeypatch.delenv("PETIT_MOE_NARROW_MAX_ROWS", raising=False)
        else:
            monkeypatch.setenv("PETIT_MOE_NARROW_MAX_ROWS", value)
        out, used = run_emulated(sm90, *many, tiles="auto", num_sms=2)
        assert used == want_many, value
        check_against_reference(out, many)
        assert run_emulated(sm90, *few, tiles="auto", num_sms=2)[1] == want_few, value
    monkeypatch.setenv("PETIT_MOE_NARROW_MAX_ROWS", "32")  # the bound is exclusive
    assert run_emulated(sm90, *many, tiles="auto", num_sms=2)[1] == "wgmma_m64_ws"


@pytest.mark.parametrize("num_sms", [1, 19, 20, 64])
def test_auto_fused_gemms_pick_the_tiles_on_the_device(sm90, monkeypatch, num_sms):
    """PETIT_MOE_DEVICE_TILES=1 (the default; 0 = off): auto between 2 and 96 routing entries
    per local expert resolves to wgmma_m64_ws and fuses in a kernel that runs the narrow tiles
    when twice the m64 gate/up tiles (m-tiles x n-tiles of 128 columns) are no more than the
    SMs, else the m64 ones. 40 rows x top-4 over 5 experts (32 entries each, one m-tile each)
    with intermediate 136 (2 n-tiles): 10 m64 tiles, so narrow from 20 SMs, m64 below. Either
    way bit-equal to both explicit families (fused) and within the reference's tolerance."""
    ids = torch.randint(0, 5, (40, 4), generator=torch.Generator().manual_seed(3),
                        dtype=torch.int32)
    problem = make_problem(ids, 136, 136, 5, seed=101)
    monkeypatch.setenv("PETIT_MOE_FUSED_GEMMS", "1")
    monkeypatch.setenv("PETIT_MOE_DEVICE_TILES", "1")
    sm90.petit_emu_fused_auto_narrow()  # forget earlier runs
    out, used = run_emulated(sm90, *problem, tiles="auto", num_sms=num_sms)
    assert used == "wgmma_m64_ws" and sm90.petit_emu_fused_gemms() == 1
    assert sm90.petit_emu_fused_auto_narrow() == (1 if num_sms >= 20 else 0)
    check_against_reference(out, problem)
    for tiles in ("wgmma_narrow_ws", "wgmma_m64_ws"):
        assert torch.equal(out, run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)[0])
        assert sm90.petit_emu_fused_auto_narrow() == -1  # explicit families: the plain kernels
    monkeypatch.setenv("PETIT_MOE_DEVICE_TILES", "0")  # off: auto runs the plain m64 kernel
    assert torch.equal(out, run_emulated(sm90, *problem, tiles="auto", num_sms=num_sms)[0])
    assert sm90.petit_emu_fused_auto_narrow() == -1
    monkeypatch.delenv("PETIT_MOE_DEVICE_TILES")  # on by default
    assert torch.equal(out, run_emulated(sm90, *problem, tiles="auto", num_sms=num_sms)[0])
    assert sm90.petit_emu_fused_auto_narrow() == (1 if num_sms >= 20 else 0)


def test_fused_gemms_many_tiles_per_expert_and_expert_map(sm90, monkeypatch):
    """Several m-tiles per expert (an expert's down tiles wait for all of its gate/up tiles:
    m-tiles x n-tiles x consumer warps arrivals) and global ids through vLLM's expert map."""
    gen = torch.Generator().manual_seed(93)
    ids = torch.randint(0, 3, (110, 2), generator=gen, dtype=torch.int32)  # ~73 per expert
    problem = make_problem(ids, 264, 136, 3, seed=94)
    monkeypatch.setenv("PETIT_MOE_FUSED_GEMMS", "1")
    fused, _ = run_emulated(sm90, *problem, tiles="wgmma_narrow_ws", num_sms=1)
    assert sm90.petit_emu_fused_gemms() == 1
    check_against_reference(fused, problem)
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[1::3] = torch.arange(3, dtype=torch.int32)  # local e is global 3e + 1
    x, local_ids, w, w13, w2 = problem
    global_ids = torch.where(local_ids >= 0, 3 * local_ids + 1, -1).int().contiguous()
    mapped, _ = run_emulated(sm90, x, global_ids, w, w13, w2, tiles="wgmma_m64_ws", num_sms=1,
                             expert_map=expert_map)
    monkeypatch.setenv("PETIT_MOE_FUSED_GEMMS", "0")
    want, _ = run_emulated(sm90, x, local_ids, w, w13, w2, tiles="wgmma_m64_ws", num_sms=1)
    assert torch.equal(mapped, want)


@pytest.mark.parametrize("tiles", ["wgmma_ws", "small", "decode"])
def test_fused_gemms_only_where_the_family_has_them(sm90, monkeypatch, tiles):
    """Families without a fused kernel keep the two launches under PETIT_MOE_FUSED_GEMMS=1."""
    problem = make_problem(decode_routing(94), 136, 40, 5, seed=95)
    monkeypatch.setenv("PETIT_MOE_FUSED_GEMMS", "1")
    out, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=2)
    assert used == tiles and sm90.petit_emu_fused_gemms() == 0
    check_against_reference(out, problem)


def test_fused_gemms_off_with_split_k_and_on_under_auto(sm90, monkeypatch):
    """Split-K (PETIT_MOE_SPLIT_K > 1) keeps the two launches; auto at a decode size picks
    wgmma_narrow_ws on an sm_90 device and fuses (the path of vLLM's PetitExperts)."""
    ids = torch.tensor([[3, -1, 0, 4], [1, 3, -1, -1]], dtype=torch.int32)
    problem = make_problem(ids, 264, 40, 5, seed=97)
    monkeypatch.setenv("PETIT_MOE_FUSED_GEMMS", "1")
    monkeypatch.setenv("PETIT_MOE_SPLIT_K", "4")
    split, _ = run_emulated(sm90, *problem, tiles="wgmma_narrow_ws", num_sms=1)
    assert sm90.petit_emu_fused_gemms() == 0
    monkeypatch.delenv("PETIT_MOE_SPLIT_K")
    fused, used = run_emulated(sm90, *problem, tiles="auto", num_sms=1)
    assert used == "wgmma_narrow_ws" and sm90.petit_emu_fused_gemms() == 1
    assert torch.equal(fused, split)
