"""CPU: the expert kernels (csrc/experts/: gemm_sm90.cu, gemm_simt.cu, reduce.cu, launched as
tile_choice.cu chooses) run unchanged under a thread-per-GPU-thread emulation
(tests/emu/experts_emu.cpp), against the torch reference.

This checks the kernels' index math, bounds handling, persistent tile loop, scheduler scan and
barrier placement before (and besides) the GPU tests in test_experts_gpu.py; it says nothing
about performance or the GPU memory model. The Hopper regimes (warp-specialized wgmma) run too,
on an emulation of their PTX (tests/emu/emu_ptx.h: cp.async, TMA and wgmma completing as late as
allowed, mbarriers, clusters), with the emulated device reporting compute capability 9.0.
The row lists come from the reference (the routing kernel has its own GPU test). Needs g++ and
the CUDA headers (for uint4/float4/dim3 only).
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
from dataclasses import astuple

import pytest
import torch

from conftest import build_emu_library
from vllm_petit_moe.config import ExpertConfig
from vllm_petit_moe.testing import reference
from vllm_petit_moe.ops import TILE_NAMES, TILES

HOPPER = tuple(t for t in TILES if t.startswith("wgmma"))
# The SIMT fallback's two tile heights, forced through ExpertConfig.simt_large_min_rows.
SIMT_SIZES = {"small": ExpertConfig(simt_large_min_rows=2**30),
              "large": ExpertConfig(simt_large_min_rows=0)}


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
    lib.petit_emu_set_expert_config.restype = None
    lib.petit_emu_default_expert_config.restype = None
    lib.petit_emu_fused_gemms.restype = ctypes.c_int
    lib.petit_emu_fused_claims.restype = ctypes.c_int
    lib.petit_emu_experts_check.restype = ctypes.c_int
    lib.petit_emu_experts_check.argtypes = [ctypes.c_int] * 8 + [ctypes.c_char_p, ctypes.c_int]
    return lib


def set_config(lib, config=None):
    """The ExpertConfig of the emulation's next calls (None: the defaults; a tuple: its
    fields in order, unchecked)."""
    fields = astuple(config or ExpertConfig()) if not isinstance(config, tuple) else config
    lib.petit_emu_set_expert_config(*fields)


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
                 expert_map=None, config=None):
    """launch_experts on the CPU; act/partial/out poisoned with NaN first. With `expert_map`
    ([E] int32), `ids` are global ids that the kernels map. `tiles` "small" / "large": the
    SIMT family with that tile height (SIMT_SIZES); `config`: an ExpertConfig."""
    if tiles in SIMT_SIZES:
        tiles, config = "simt", SIMT_SIZES[tiles]
    set_config(lib, config)
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
    set_config(lib)
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


def check_against_reference(out, problem):
    kernel_ref = reference.experts_reference(*problem, precision="kernel")
    fp32_ref = reference.experts_reference(*problem, precision="fp32")
    reference.check_close(out, fp32_ref, reference.tolerance(kernel_ref, fp32_ref))
    no_local = ~(problem[1] >= 0).any(dim=1)
    assert bool((out[no_local] == 0).all()), "rows without a local id must be 0"


@pytest.mark.parametrize("tiles", ["small", "large"])
@pytest.mark.parametrize("hidden, intermediate", [(136, 40), (8, 8), (40, 136)])
def test_random_routing_odd_shapes(emu, tiles, hidden, intermediate):
    gen = torch.Generator().manual_seed(hidden * 7 + intermediate)
    ids = torch.randint(0, 5, (37, 4), generator=gen, dtype=torch.int32)
    ids = torch.where(torch.rand(37, 4, generator=gen) < 0.3, -1, ids)
    ids[3] = -1  # a row with no local slot
    problem = make_problem(ids, hidden, intermediate, 5, seed=1)
    out, used = run_emulated(emu, *problem, tiles=tiles, num_sms=2)
    assert used == "simt"
    check_against_reference(out, problem)


@pytest.mark.parametrize("top_k", [1, 8])
def test_empty_experts_and_one_expert_with_all_rows(emu, top_k):
    ids = torch.full((300, top_k), -1, dtype=torch.int32)
    ids[:, top_k - 1] = 4  # expert 4 of 6 gets every row, experts 0-3 and 5 none
    problem = make_problem(ids, 24, 16, 6, seed=2)
    for tiles in ("small", "large"):
        out, _ = run_emulated(emu, *problem, tiles=tiles)
        check_against_reference(out, problem)


def test_rows_per_expert_1_to_4096(emu):
    counts = [1, 2, 3, 15, 16, 17, 127, 128, 129, 4096]
    ids = routing_with_counts(counts, seed=3)
    assert torch.bincount(ids[ids >= 0].long()).tolist() == counts
    problem = make_problem(ids, 16, 8, len(counts), seed=4)
    for tiles in ("small", "large"):
        out, _ = run_emulated(emu, *problem, tiles=tiles, num_sms=4)
        check_against_reference(out, problem)


def test_all_rows_unrouted_give_zeros(emu):
    ids = torch.full((9, 2), -1, dtype=torch.int32)
    ids[4, 1] = 7  # outside [0, L): not local either
    problem = make_problem(ids, 16, 8, 3, seed=5)
    out, _ = run_emulated(emu, *problem)
    assert bool((out == 0).all())


def test_deterministic_and_batch_invariant(emu):
    """Fixed-order fp32 FMA chains and a fixed-order slot sum: bit-identical across the SIMT
    tile heights, repeated runs, grid sizes and batch compositions (what PetitExperts
    claims)."""
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


@pytest.mark.parametrize("tiles", ["auto", "simt"])
def test_simt_tile_height_follows_rows_per_expert(emu, tiles):
    """The SIMT family's 128-row tiles from ExpertConfig.simt_large_min_rows (256) routing
    entries per local expert (N*K / L), its 16-row ones below; auto picks the family on a
    device without sm_90a. Seen in the persistent grid on 1 SM: 2 blocks of the large tiles,
    4 of the small ones (their blocks per SM), the problem having more tiles than that."""
    ids = torch.zeros((64, 8), dtype=torch.int32)
    x, ids, w, w13, w2 = make_problem(ids, 8, 8, 2, seed=8)
    out, used = run_emulated(emu, x, ids, w, w13, w2, tiles=tiles)  # 64*8 / 2 = 256
    assert used == "simt" and last_launch(emu, True)["grid"] == 2
    check_against_reference(out, (x, ids, w, w13, w2))
    head = (x[:63].contiguous(), ids[:63].contiguous(), w[:63].contiguous(), w13, w2)
    _, used = run_emulated(emu, *head, tiles=tiles)  # 252
    assert used == "simt" and last_launch(emu, True)["grid"] == 4
    _, used = run_emulated(emu, *head, tiles=tiles,
                           config=ExpertConfig(simt_large_min_rows=252))  # the bound moved
    assert used == "simt" and last_launch(emu, True)["grid"] == 2


@pytest.mark.parametrize("tiles", HOPPER)
def test_hopper_regimes_on_emulated_ptx(sm90, tiles):
    """The Hopper regimes' data path on the CPU: cp.async row gathers and TMA weight boxes into
    the swizzled ring, wgmma descriptors and accumulator layout, the producer/consumer ring
    over mbarriers, the epilogues (the staged one of wgmma / wgmma_mc, the fused launch of
    wgmma_narrow / wgmma_m64). Odd K (3 and 4 k-tiles, the last partial), several tiles per
    block (the ring wraps around its stages and runs on across tiles), an expert with no rows,
    a row with no local slot."""
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, 4, (45, 3), generator=gen, dtype=torch.int32)
    ids = torch.where(ids == 3, -1, ids)  # expert 3 of 5 never, expert 4 never either
    ids[7] = -1
    problem = make_problem(ids, 136, 200, 5, seed=22)
    out, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=2)
    assert used == tiles
    check_against_reference(out, problem)


@pytest.mark.parametrize("tiles,same_as", [("wgmma_narrow", "wgmma_m64"), ("wgmma_mc", "wgmma"),
                                           ("wgmma_m64", "wgmma")])
def test_hopper_regimes_give_the_same_bits(sm90, tiles, same_as):
    """The Hopper regimes sum every output in the same k order with the same epilogue
    formulas: narrow and m64 (same 64 rows, other columns per tile), multicast and wgmma (same
    tiles, in clusters), m64 and wgmma (64- and 128-row tiles) agree bit for bit. 4 and 3
    k-tiles (the rings wrap), experts with 0 to ~40 rows."""
    gen = torch.Generator().manual_seed(24)
    ids = torch.randint(-1, 3, (60, 2), generator=gen, dtype=torch.int32)
    problem = make_problem(ids, 200, 136, 3, seed=25)
    got, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=1)
    assert used == tiles
    want, _ = run_emulated(sm90, *problem, tiles=same_as, num_sms=1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("hidden,inter", [(72, 64), (520, 296)])
def test_clusters_with_odd_m_tiles_and_several_clusters(sm90, hidden, inter):
    """wgmma_mc: clusters of 2 CTAs take two m-tiles of one (expert, n-tile) together and
    multicast the weight boxes into both; an expert's odd last m-tile is split by n-tile
    between the two CTAs, each loading its own weights. Experts with 1, 2 and 3 m-tiles of 128
    rows; 1 n-tile per GEMM (the second CTA of a split unit has no n-tile, no rows, and still
    walks the unit's k-tiles) or 3 (an odd count: the last split unit's second CTA again has
    none); 2 clusters (4 CTAs) walking several units each: bit-equal to wgmma."""
    counts = [100, 200, 300]
    ids = top1_ids(counts, seed=31)
    problem = make_problem(ids.contiguous(), hidden, inter, 3, seed=32)
    got, used = run_emulated(sm90, *problem, tiles="wgmma_mc", num_sms=4)
    assert used == "wgmma_mc"
    for gate_up in (True, False):  # 2 clusters of 2 CTAs of 384 threads
        shape = last_launch(sm90, gate_up)
        assert (shape["grid"], shape["threads"], shape["cluster"]) == (4, 384, 2), shape
    want, _ = run_emulated(sm90, *problem, tiles="wgmma", num_sms=4)
    assert torch.equal(got, want)
    check_against_reference(got, problem)
    assert last_launch(sm90, True)["cluster"] == 1
    # an odd SM count: whole clusters only (3 -> 1 cluster of 2)
    again, _ = run_emulated(sm90, *problem, tiles="wgmma_mc", num_sms=3)
    assert torch.equal(again, got)
    assert (last_launch(sm90, False)["grid"], last_launch(sm90, False)["cluster"]) == (2, 2)


@pytest.mark.parametrize("tiles,num_sms", [("wgmma", 1), ("wgmma", 3), ("wgmma_mc", 2),
                                           ("wgmma_mc", 4)])
def test_staged_down_epilogue(sm90, tiles, num_sms):
    """The down GEMM of wgmma / wgmma_mc writes its tile through a shared-memory staging
    buffer and per-row bulk copies (a 3-stage ring, so more dynamic shared memory than the
    gate/up kernel's 4-stage one): against the reference and bit-equal to wgmma_m64, whose
    down GEMM stores straight from its registers. Several tiles per block (the staging buffer
    is rewritten while the previous tile's copies may still read it), a partial last n-tile
    (hidden 520: 8 columns), experts with 1-3 m-tiles of rows, one with none."""
    counts = [100, 0, 200, 300]
    ids = top1_ids(counts, seed=61)
    problem = make_problem(ids.contiguous(), 520, 136, 4, seed=62)
    staged, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert used == tiles
    assert last_launch(sm90, False)["smem_bytes"] > last_launch(sm90, True)["smem_bytes"]
    check_against_reference(staged, problem)
    plain, _ = run_emulated(sm90, *problem, tiles="wgmma_m64", num_sms=num_sms)
    assert torch.equal(staged, plain)


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
    # a trap the test expects (PETIT_EMU_EXPECT_TRAP=1) says so and stays out of the log
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True, timeout=120,
                            env={**os.environ, "PETIT_EMU_TRAP_LOG": str(log),
                                 "PETIT_EMU_EXPECT_TRAP": "1"})
    assert result.returncode == -signal.SIGABRT, result
    assert "emu_ptx: expected trap: test trap (block 0, thread 0)" in result.stderr
    assert log.read_text() == f"earlier\n{line}\n"


def test_auto_bounds_on_an_sm90_device(sm90):
    """auto's choice by the rows-per-expert estimate N*K / L and the hidden size, where the
    Hopper family runs, with ExpertConfig's default bounds (csrc/common/config.h): wgmma_narrow
    below 2, wgmma_m64 below 96, wgmma from there, wgmma_mc from 256 at hidden >= 4096."""
    def auto(num_rows, top_k, num_local, hidden):
        return TILE_NAMES[sm90.petit_emu_resolve_tiles(num_rows, top_k, num_local, hidden, 0)]

    defaults = (ctypes.c_int * 5)()
    sm90.petit_emu_default_expert_config(defaults)
    assert tuple(defaults) == (2, 96, 256, 4096, 256) == astuple(ExpertConfig())

    L = 128  # N*K / L = num_rows * 8 / 128 = num_rows / 16
    assert auto(0, 8, L, 7168) == "wgmma_narrow"
    assert auto(31, 8, L, 7168) == "wgmma_narrow"    # 1.9375
    assert auto(32, 8, L, 7168) == "wgmma_m64"       # 2
    assert auto(1535, 8, L, 7168) == "wgmma_m64"     # 95.9
    assert auto(1536, 8, L, 7168) == "wgmma"         # 96
    assert auto(4095, 8, L, 7168) == "wgmma"         # 255.9
    assert auto(4096, 8, L, 7168) == "wgmma_mc"      # 256
    assert auto(4096, 8, L, 4096) == "wgmma_mc"
    assert auto(4096, 8, L, 4088) == "wgmma"         # below the hidden bound
    assert auto(65536, 8, L, 2048) == "wgmma"        # Qwen3's hidden size: never clustered
    for name in ("simt", "wgmma_m64", "wgmma_mc"):    # an explicit family stays
        assert TILE_NAMES[sm90.petit_emu_resolve_tiles(4, 8, L, 7168, TILES[name])] == name


def test_auto_bounds_follow_the_config(sm90):
    """ExpertConfig moves every bound of auto's choice (exclusive below, inclusive from);
    narrow_max_rows = 0 never picks wgmma_narrow."""
    def auto(num_rows, hidden, config):
        set_config(sm90, config)
        try:
            return TILE_NAMES[sm90.petit_emu_resolve_tiles(num_rows, 8, 128, hidden, 0)]
        finally:
            set_config(sm90)

    # N*K / L = num_rows / 16
    assert auto(63, 7168, ExpertConfig(narrow_max_rows=4)) == "wgmma_narrow"   # 3.9
    assert auto(64, 7168, ExpertConfig(narrow_max_rows=4)) == "wgmma_m64"      # 4
    assert auto(0, 7168, ExpertConfig(narrow_max_rows=0)) == "wgmma_m64"
    assert auto(32, 7168, ExpertConfig(narrow_max_rows=0, m64_max_rows=0)) == "wgmma"
    assert auto(1600, 7168, ExpertConfig(m64_max_rows=101)) == "wgmma_m64"     # 100
    assert auto(1600, 7168, ExpertConfig(mc_min_rows=100)) == "wgmma_mc"
    assert auto(1600, 7168, ExpertConfig(mc_min_rows=100, mc_min_hidden=8192)) == "wgmma"
    assert auto(4096, 7168, ExpertConfig()) == "wgmma_mc"


def test_invalid_config_is_refused(sm90):
    """launch_experts refuses an ExpertConfig with narrow_max_rows > m64_max_rows (the
    binding and config.py refuse it before)."""
    with pytest.raises(ValueError, match="narrow_max_rows"):
        ExpertConfig(narrow_max_rows=100)
    problem = make_problem(torch.zeros((4, 1), dtype=torch.int32), 16, 8, 1, seed=26)
    run_emulated(sm90, *problem, config=(96, 96, 256, 4096, 256))  # equal bounds: fine
    with pytest.raises(AssertionError, match="returned"):
        run_emulated(sm90, *problem, config=(100, 96, 256, 4096, 256))


# experts_check (csrc/experts/tile_choice.cu): the one home of experts_forward's limits, whose
# message the binding raises. Valid sizes, then one field at a time outside its limit:
# (field overrides, ExpertConfig fields or None, the message's pattern).
CHECK_VALID = dict(num_rows=4, top_k=2, hidden=16, intermediate=8, num_local_experts=2,
                   tiles=0, num_sms=0, num_global_experts=-1)


@pytest.mark.parametrize("overrides,config,pattern", [
    (dict(hidden=12), None, r"^hidden size 12 must be a positive multiple of 8$"),
    (dict(hidden=0), None, r"^hidden size 0 must be"),
    (dict(intermediate=4), None, r"^intermediate size 4 must be a positive multiple of 8$"),
    (dict(top_k=17), None, r"^top-k 17 outside \[1, 16\]$"),
    (dict(top_k=0), None, r"^top-k 0 outside"),
    (dict(num_local_experts=513), None, r"^513 local experts outside \[1, 512\]$"),
    (dict(num_local_experts=0), None, r"^0 local experts outside"),
    (dict(num_rows=2**30), None,
     r"^N\*K = 2147483648 routing entries outside \[0, 2\^31 - 1\]$"),
    (dict(num_rows=-1), None, r"^N\*K = -2 routing entries"),
    (dict(tiles=6), None, r"^tiles 6 must be 0 \(auto\), 1 \(simt\)"),
    (dict(tiles=-1), None, r"^tiles -1 must be"),
    (dict(num_sms=-1), None, r"^num_sms -1 must be >= 0"),
    ({}, (100, 96, 256, 4096, 256), r"^ExpertConfig: bounds must be >= 0 with narrow_max_rows "
                                    r"<= m64_max_rows, got narrow_max_rows 100, m64_max_rows 96$"),
    ({}, (0, 96, 256, 4096, -1), r"^ExpertConfig: bounds"),
    (dict(num_global_experts=0), None, r"^an expert_map needs >= 1 entries, got 0$"),
])
def test_experts_check_names_the_limit(emu, overrides, config, pattern):
    err = ctypes.create_string_buffer(512)
    assert emu.petit_emu_experts_check(*CHECK_VALID.values(), err, len(err)) == 0, err.value
    assert err.value == b""
    set_config(emu, config)
    try:
        rc = emu.petit_emu_experts_check(*{**CHECK_VALID, **overrides}.values(), err, len(err))
    finally:
        set_config(emu)
    assert rc != 0 and re.search(pattern, err.value.decode()), (rc, err.value)


def test_experts_check_accepts_the_edges(emu):
    """The limits' own values pass: K = 16, L = 512, N*K = 2^31 - 1, every family, a map."""
    err = ctypes.create_string_buffer(512)
    for overrides in (dict(top_k=16), dict(num_local_experts=512), dict(num_rows=0),
                      dict(num_rows=2**31 - 1, top_k=1), dict(tiles=5), dict(num_sms=132),
                      dict(num_global_experts=1), dict(hidden=8, intermediate=8)):
        rc = emu.petit_emu_experts_check(*{**CHECK_VALID, **overrides}.values(), err, len(err))
        assert rc == 0, (overrides, err.value)


def test_auto_without_wgmma(emu):
    """Compute capability 2.0 (the emulator's default): auto takes the SIMT fallback."""
    assert TILE_NAMES[emu.petit_emu_resolve_tiles(4095, 8, 128, 7168, 0)] == "simt"
    assert TILE_NAMES[emu.petit_emu_resolve_tiles(4096, 8, 128, 7168, 0)] == "simt"


@pytest.mark.parametrize("tiles", ["wgmma_narrow", "wgmma"])
def test_hopper_regimes_need_their_device(emu, tiles):
    # Compute capability 2.0 (the emulator's default): asked-for Hopper regimes fail cleanly
    # (launch_experts returns an error, nothing runs).
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
    a grid (reduce.cu, launch_expert_reduce). Same problem, 2600 chunks (40 rows, hidden 520):
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
@pytest.mark.parametrize("tiles", ["wgmma_narrow", "wgmma_m64"])
@pytest.mark.parametrize("num_sms", [1, 3])
def test_fused_gemms_equal_the_two_launches_of_wgmma(sm90, tiles, num_sms):
    """The 64-row regimes run gate/up and down tiles in one launch on one ring, each down tile
    after its expert's gate/up arrivals: bit-equal to wgmma's two launches, with partial last
    column tiles (hidden 392, intermediate 72) and an expert with no row."""
    problem = make_problem(decode_routing(91), 392, 72, 5, seed=92)
    fused, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)
    assert used == tiles and sm90.petit_emu_fused_gemms() == 1
    plain, _ = run_emulated(sm90, *problem, tiles="wgmma", num_sms=num_sms)
    assert sm90.petit_emu_fused_gemms() == 0
    assert torch.equal(fused, plain)
    check_against_reference(fused, problem)


@pytest.mark.parametrize("num_sms", [1, 19, 20, 64])
def test_auto_fused_gemms_pick_the_tiles_on_the_device(sm90, num_sms):
    """auto between 2 and 96 routing entries per local expert resolves to wgmma_m64 and fuses
    in a kernel that runs the narrow tiles when twice the m64 gate/up tiles (m-tiles x n-tiles
    of 128 columns) are no more than the SMs, else the m64 ones. 40 rows x top-4 over 5
    experts (32 entries each, one m-tile each) with intermediate 136 (2 n-tiles): 10 m64
    tiles, so narrow from 20 SMs, m64 below. Which tiles ran shows in the tile claim counter
    (gate_up_done[L]: the call's units plus one claim past them per block). Either way
    bit-equal to both explicit regimes (whose kernels make no such choice) and within the
    reference's tolerance."""
    ids = torch.randint(0, 5, (40, 4), generator=torch.Generator().manual_seed(3),
                        dtype=torch.int32)
    problem = make_problem(ids, 136, 136, 5, seed=101)
    m_tiles = sum((int(n) + 63) // 64 for n in torch.bincount(ids.flatten().long(), minlength=5))
    assert m_tiles == 5

    def units(block_n_gate_up, block_n_down):  # the call's gate/up + down tiles
        return m_tiles * (-(-136 // block_n_gate_up) + -(-136 // block_n_down))

    out, used = run_emulated(sm90, *problem, tiles="auto", num_sms=num_sms)
    assert used == "wgmma_m64" and sm90.petit_emu_fused_gemms() == 1
    # which tiles ran: every block's last claim is the one past the call's units
    ran = sm90.petit_emu_fused_claims() - last_launch(sm90, True)["grid"]
    assert ran == (units(64, 128) if num_sms >= 20 else units(128, 256))
    check_against_reference(out, problem)
    for tiles, block_n in (("wgmma_narrow", (64, 128)), ("wgmma_m64", (128, 256))):
        assert torch.equal(out, run_emulated(sm90, *problem, tiles=tiles, num_sms=num_sms)[0])
        assert sm90.petit_emu_fused_claims() - last_launch(sm90, True)["grid"] == units(*block_n)


def test_auto_narrow_bound_from_the_config(sm90):
    """ExpertConfig.narrow_max_rows moves auto's wgmma_narrow / wgmma_m64 bound (default 2
    routing entries per local expert; 0: never narrow). 40 rows x top-4 over 5 experts is 32
    entries per expert; 2 rows x top-4 is 1.6."""
    many = make_problem(torch.randint(0, 5, (40, 4), generator=torch.Generator().manual_seed(3),
                                      dtype=torch.int32), 136, 40, 5, seed=98)
    few = make_problem(torch.tensor([[3, -1, 0, 4], [1, 3, -1, -1]], dtype=torch.int32), 136,
                       40, 5, seed=99)
    for bound, want_many, want_few in [(None, "wgmma_m64", "wgmma_narrow"),
                                       (33, "wgmma_narrow", "wgmma_narrow"),
                                       (96, "wgmma_narrow", "wgmma_narrow"),
                                       (32, "wgmma_m64", "wgmma_narrow"),  # exclusive
                                       (0, "wgmma_m64", "wgmma_m64")]:
        config = None if bound is None else ExpertConfig(narrow_max_rows=bound)
        out, used = run_emulated(sm90, *many, tiles="auto", num_sms=2, config=config)
        assert used == want_many, bound
        check_against_reference(out, many)
        assert run_emulated(sm90, *few, tiles="auto", num_sms=2, config=config)[1] == want_few


def test_fused_gemms_many_tiles_per_expert_and_expert_map(sm90):
    """Several m-tiles per expert (an expert's down tiles wait for all of its gate/up tiles:
    m-tiles x n-tiles x consumer warps arrivals) and global ids through vLLM's expert map."""
    gen = torch.Generator().manual_seed(93)
    ids = torch.randint(0, 3, (110, 2), generator=gen, dtype=torch.int32)  # ~73 per expert
    problem = make_problem(ids, 264, 136, 3, seed=94)
    fused, _ = run_emulated(sm90, *problem, tiles="wgmma_narrow", num_sms=1)
    assert sm90.petit_emu_fused_gemms() == 1
    check_against_reference(fused, problem)
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[1::3] = torch.arange(3, dtype=torch.int32)  # local e is global 3e + 1
    x, local_ids, w, w13, w2 = problem
    global_ids = torch.where(local_ids >= 0, 3 * local_ids + 1, -1).int().contiguous()
    mapped, _ = run_emulated(sm90, x, global_ids, w, w13, w2, tiles="wgmma_m64", num_sms=1,
                             expert_map=expert_map)
    assert torch.equal(mapped, fused)
    want, _ = run_emulated(sm90, x, local_ids, w, w13, w2, tiles="wgmma", num_sms=1)
    assert torch.equal(mapped, want)


@pytest.mark.parametrize("tiles", ["wgmma", "wgmma_mc", "small"])
def test_fused_gemms_only_in_the_64_row_regimes(sm90, tiles):
    """The other regimes run a launch per GEMM."""
    problem = make_problem(decode_routing(94), 136, 40, 5, seed=95)
    out, used = run_emulated(sm90, *problem, tiles=tiles, num_sms=2)
    assert used == (tiles if tiles != "small" else "simt") and sm90.petit_emu_fused_gemms() == 0
    check_against_reference(out, problem)


def test_auto_fuses_at_decode_sizes(sm90):
    """auto at a decode size picks wgmma_narrow on an sm_90 device and fuses (the path of
    vLLM's PetitExperts)."""
    ids = torch.tensor([[3, -1, 0, 4], [1, 3, -1, -1]], dtype=torch.int32)
    problem = make_problem(ids, 264, 40, 5, seed=97)
    fused, used = run_emulated(sm90, *problem, tiles="auto", num_sms=1)
    assert used == "wgmma_narrow" and sm90.petit_emu_fused_gemms() == 1
    check_against_reference(fused, problem)
