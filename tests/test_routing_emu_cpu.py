"""CPU: the row-list kernels (csrc/experts/routing.cu) run unchanged under the thread-per-GPU-thread
emulation (tests/emu/routing_emu.cpp, warp primitives included), against the reference.

Both launch paths: one block (<= kRowListChunk entries, decode sizes) and the three launches
(chunk histograms, scan, chunk scatter), with local ids and with global ids + an expert_map.
Checks the index math, the stable order within an expert, the warp-level ranks and the
barrier placement; says nothing about performance or the GPU memory model. Needs g++ and the
CUDA headers (for uint4/dim3 only).
"""
from __future__ import annotations

import ctypes
import re

import pytest
import torch

from conftest import build_emu_library
from vllm_petit_moe.testing.reference import expert_row_lists_reference

POISON = -7


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    lib = build_emu_library(tmp_path_factory, "routing_emu")
    lib.petit_emu_row_list_workspace_ints.restype = ctypes.c_longlong
    return lib


def run_emulated(lib, ids, num_local, expert_map=None, expert_done=None):
    """launch_expert_row_lists on the CPU, outputs poisoned first (expert_done: the fused
    GEMMs' counters, which the kernels zero)."""
    ids = ids.contiguous()
    num_entries = ids.numel()
    workspace = torch.full((lib.petit_emu_row_list_workspace_ints(num_entries, num_local),),
                           POISON, dtype=torch.int32)
    counts = torch.full((num_local,), POISON, dtype=torch.int32)
    offsets = torch.full((num_local + 1,), POISON, dtype=torch.int32)
    sorted_entries = torch.full((max(num_entries, 1),), POISON, dtype=torch.int32)
    rc = lib.petit_emu_row_lists(
        ctypes.c_void_p(ids.data_ptr()),
        ctypes.c_void_p(expert_map.data_ptr() if expert_map is not None else None),
        expert_map.numel() if expert_map is not None else 0, num_entries, num_local,
        *[ctypes.c_void_p(t.data_ptr()) for t in (workspace, counts, offsets, sorted_entries)],
        ctypes.c_void_p(expert_done.data_ptr() if expert_done is not None else None))
    assert rc == 0, f"launch_expert_row_lists returned {rc}"
    return counts, offsets, sorted_entries[:num_entries]


def random_ids(num_rows, top_k, num_local, seed, invalid_fraction=0.4):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_local, (num_rows, top_k), generator=gen, dtype=torch.int32)
    drop = torch.rand(num_rows, top_k, generator=gen) < invalid_fraction
    return torch.where(drop, torch.full_like(ids, -1), ids)


def test_one_block_bound_is_the_chunk(emu):
    assert emu.petit_emu_row_list_chunk() == 1024


@pytest.mark.parametrize("num_rows,top_k,num_local", [
    (0, 8, 16),       # no entries
    (1, 1, 1),
    (5, 8, 512),      # one block, two experts per scan thread, most experts empty
    (128, 8, 64),     # exactly one chunk (1024 entries): the one-block path
    (129, 8, 64),     # one entry row past it: three launches, two chunks
    (300, 10, 37),    # three chunks, odd sizes
])
def test_row_lists_match_reference(emu, num_rows, top_k, num_local):
    ids = random_ids(num_rows, top_k, num_local, seed=num_rows * 31 + num_local)
    got = run_emulated(emu, ids, num_local)
    want = expert_row_lists_reference(ids, num_local)
    for g, w, name in zip(got, want, ("counts", "offsets", "sorted_entries")):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("num_rows", [40, 200])  # one block; three launches
def test_every_entry_on_one_expert_keeps_entry_order(emu, num_rows):
    """All valid entries of one expert from many warps and rounds: their order is the
    entry order (the warp ranks and the per-warp offsets must add up exactly)."""
    ids = torch.full((num_rows, 8), 3, dtype=torch.int32)
    ids[::7, 2] = -1
    counts, offsets, sorted_entries = run_emulated(emu, ids, 8)
    want = expert_row_lists_reference(ids, 8)
    assert torch.equal(counts, want[0]) and torch.equal(offsets, want[1])
    assert torch.equal(sorted_entries, want[2])
    valid = sorted_entries[: int(offsets[-1])]
    assert torch.all(valid[1:] > valid[:-1])


@pytest.mark.parametrize("num_rows,top_k,num_global,num_local", [(37, 8, 256, 128),
                                                                  (300, 8, 64, 32)])
def test_global_ids_with_expert_map(emu, num_rows, top_k, num_global, num_local):
    """Global ids mapped by vLLM's expert_map in the kernels; ids outside [0, E) and map values
    outside [0, L) are skipped like -1."""
    gen = torch.Generator().manual_seed(num_rows + num_global)
    expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    expert_map[num_local:2 * num_local] = torch.randperm(num_local, generator=gen).int()
    ids = torch.randint(-2, num_global + 3, (num_rows, top_k), generator=gen, dtype=torch.int32)
    in_range = (ids >= 0) & (ids < num_global)
    local = torch.where(in_range, expert_map[ids.clamp(0, num_global - 1).long()], -1)
    got = run_emulated(emu, ids, num_local, expert_map=expert_map)
    want = expert_row_lists_reference(local, num_local)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("num_rows", [3, 128, 129, 300])
def test_row_lists_zero_the_fused_gemm_counters(emu, num_rows):
    """The fused expert GEMMs' per-expert arrival counters and claim counter
    (RowListArgs::expert_done, L + 1 ints) are set to 0 by both launch paths (one block up to 1024 entries, three launches above), garbage
    before; the row lists themselves are unchanged."""
    ids = random_ids(num_rows, 8, 37, seed=300 + num_rows)
    done = torch.full((38,), 0x5A5A5A5A, dtype=torch.int32)  # 37 experts + the claim counter
    with_done = run_emulated(emu, ids, 37, expert_done=done)
    assert torch.equal(done, torch.zeros(38, dtype=torch.int32))
    for got, want in zip(with_done, run_emulated(emu, ids, 37)):
        assert torch.equal(got, want)


# row_lists_check (csrc/experts/routing.cu): the row lists' limits, whose message the binding
# (expert_row_lists) raises before it allocates the lists.
@pytest.mark.parametrize("num_entries,num_local,num_global,pattern", [
    (8, 0, -1, r"^num_local_experts 0 outside \[1, 512\]$"),
    (8, 513, -1, r"^num_local_experts 513 outside \[1, 512\]$"),
    (-1, 4, -1, r"^-1 routing entries must be >= 0$"),
    (8, 4, 0, r"^an expert_map needs >= 1 entries, got 0$"),
])
def test_row_lists_check_names_the_limit(emu, num_entries, num_local, num_global, pattern):
    err = ctypes.create_string_buffer(512)
    rc = emu.petit_emu_row_lists_check(num_entries, num_local, num_global, err, len(err))
    assert rc != 0 and re.search(pattern, err.value.decode()), (rc, err.value)
    for args in ((0, 1, -1), (8, 512, -1), (2**31 - 1, 4, 1)):  # the limits themselves
        assert emu.petit_emu_row_lists_check(*args, err, len(err)) == 0, (args, err.value)
