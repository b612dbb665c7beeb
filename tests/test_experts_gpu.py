"""GPU: the expert grouped GEMMs (row lists + gate/up + down + local reduction) against the
torch reference, with the tolerance derived from the reference's own bf16-vs-fp32 error.

Every case draws fresh random data from a seeded generator (never zeros), poisons the
outputs and workspaces with NaN before the call, and runs every tile family the GPU has (the
portable SIMT fallback with its ``small`` and ``large`` tiles and, on compute capability 9.0,
the four regimes of the sm_90a ``wgmma*`` family).
"""
from __future__ import annotations

import pytest
import torch

from conftest import requires_extension, requires_gpu
from vllm_petit_moe.config import ExpertConfig
from vllm_petit_moe.testing import reference
from vllm_petit_moe.ops import TILES

pytestmark = [requires_gpu, requires_extension]

HAS_WGMMA = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
WGMMA_FAMILIES = [t for t in TILES if t.startswith("wgmma")] if HAS_WGMMA else []
TILE_FAMILIES = ["small", "large"] + WGMMA_FAMILIES
# The SIMT fallback's two tile heights, forced through ExpertConfig.simt_large_min_rows.
SIMT_SIZES = {"small": ExpertConfig(simt_large_min_rows=2**30),
              "large": ExpertConfig(simt_large_min_rows=0)}


def tiles_kwargs(tiles):
    """experts_forward's tiles (and config) for a name of TILE_FAMILIES or TILES."""
    if tiles in SIMT_SIZES:
        return dict(tiles="simt", config=SIMT_SIZES[tiles])
    return dict(tiles=tiles)


def make_problem(ids, hidden, intermediate, num_local, seed, *, poison_unrouted=True):
    """recv_x, ids, weights, w13, w2 on the GPU for routing `ids` [N, K] int32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = ids.to("cuda", torch.int32).contiguous()
    num_rows, top_k = ids.shape
    recv_x = torch.randn(num_rows, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    if poison_unrouted:  # rows with no local slot are stale in the dispatch layout: never read
        recv_x[~(ids >= 0).any(dim=1)] = float("nan")
    weights = torch.rand(num_rows, top_k, generator=gen, device="cuda") + 0.05
    weights = torch.where(ids >= 0, weights, 0.0).float()
    w13 = torch.randn(num_local, 2 * intermediate, hidden, generator=gen, device="cuda")
    w2 = torch.randn(num_local, hidden, intermediate, generator=gen, device="cuda")
    return (recv_x, ids, weights, (w13 / hidden**0.5).to(torch.bfloat16),
            (w2 / intermediate**0.5).to(torch.bfloat16))


def random_ids(num_rows, top_k, num_local, seed, invalid_fraction=0.3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, num_local, (num_rows, top_k), generator=gen, device="cuda",
                        dtype=torch.int32)
    drop = torch.rand(num_rows, top_k, generator=gen, device="cuda") < invalid_fraction
    return torch.where(drop, -1, ids)


def routing_with_counts(counts, seed):
    """ids [N, K = len(counts)]: local expert e gets exactly counts[e] entries on random rows
    and slots; the other slots are -1."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, top_k = max(counts), len(counts)
    ids = torch.full((num_rows, top_k), -1, dtype=torch.int32)
    for expert, count in enumerate(counts):
        ids[torch.randperm(num_rows, generator=gen)[:count], expert] = expert
    return ids.gather(1, torch.rand(num_rows, top_k, generator=gen).argsort(dim=1))


def decode_ids(routing, num_rows, num_local, seed, *, slots, experts):
    """ids [num_rows, 8] int32: for "same", every row the local `experts` in top-k `slots`
    (a dummy-weight decode: every token the same few experts; the other slots -1), else
    random_ids(num_rows, 8, num_local, seed)."""
    if routing == "same":
        ids = torch.full((num_rows, 8), -1, dtype=torch.int32)
        ids[:, slots] = torch.tensor(experts, dtype=torch.int32)
        return ids
    return random_ids(num_rows, 8, num_local, seed=seed)


def run_petit(problem, tiles, *, with_workspaces=True):
    """ops.experts_forward with NaN-poisoned out (and workspaces)."""
    from vllm_petit_moe import ops

    recv_x, ids, _, w13, _ = problem
    num_rows, hidden = recv_x.shape
    (act_shape, act_dtype), (partial_shape, partial_dtype) = ops.experts_workspace_shapes(
        num_rows, ids.shape[1], hidden, w13.shape[1] // 2)
    out = torch.full((num_rows, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    kwargs = dict(out=out, **tiles_kwargs(tiles))
    if with_workspaces:
        kwargs["act_workspace"] = torch.full(act_shape, float("nan"), dtype=act_dtype,
                                             device="cuda")
        kwargs["partial_workspace"] = torch.full(partial_shape, float("nan"),
                                                 dtype=partial_dtype, device="cuda")
    result = ops.experts_forward(*problem, **kwargs)
    assert result.data_ptr() == out.data_ptr()
    return out


def check(out, problem, name="experts"):
    recv_x, ids, weights, w13, w2 = problem
    kernel_ref = reference.experts_reference(recv_x.nan_to_num(), ids, weights, w13, w2, "kernel")
    fp32_ref = reference.experts_reference(recv_x.nan_to_num(), ids, weights, w13, w2, "fp32")
    reference.check_close(out, fp32_ref, reference.tolerance(kernel_ref, fp32_ref), name=name)
    no_local = ~(ids >= 0).any(dim=1)
    assert bool((out[no_local] == 0).all()), "rows without a local id must be exactly 0"


@pytest.mark.parametrize("tiles", TILE_FAMILIES)
@pytest.mark.parametrize("num_rows, top_k, hidden, intermediate, num_local", [
    (1, 1, 8, 8, 1),
    (37, 4, 136, 40, 5),          # odd multiples of 8
    (64, 8, 1024, 512, 16),
    (200, 8, 2048, 768, 64),      # Qwen3-30B-A3B shapes, 2 ranks
    (129, 8, 7168, 2048, 8),      # DeepSeek-V3 shapes, few experts
    (300, 16, 264, 88, 512),      # max top-k and local experts (~9 rows per expert)
])
def test_random_routing_matches_reference(tiles, num_rows, top_k, hidden, intermediate,
                                          num_local):
    ids = random_ids(num_rows, top_k, num_local, seed=num_rows * 31 + top_k)
    problem = make_problem(ids, hidden, intermediate, num_local, seed=num_rows + hidden)
    check(run_petit(problem, tiles), problem)


@pytest.mark.parametrize("tiles", TILE_FAMILIES)
@pytest.mark.parametrize("top_k", [1, 8])
def test_empty_experts_and_one_expert_with_all_rows(tiles, top_k):
    ids = torch.full((1000, top_k), -1, dtype=torch.int32)
    ids[:, top_k // 2] = 5  # local expert 5 of 8 gets every row; the others none
    problem = make_problem(ids, 136, 40, 8, seed=11 + top_k)
    check(run_petit(problem, tiles), problem)


@pytest.mark.parametrize("tiles", TILE_FAMILIES)
def test_rows_per_expert_1_to_4096(tiles):
    counts = [1, 2, 3, 7, 15, 16, 17, 127, 128, 129, 1000, 4096]
    ids = routing_with_counts(counts, seed=12)
    problem = make_problem(ids, 136, 40, len(counts), seed=13)
    check(run_petit(problem, tiles, with_workspaces=False), problem)


@pytest.mark.parametrize("tiles", TILE_FAMILIES)
def test_rows_without_local_ids_are_zero(tiles):
    ids = random_ids(64, 8, 4, seed=14)
    ids[::3] = -1
    ids[1, 2] = 4  # ids outside [0, L) are not local either
    problem = make_problem(ids, 136, 40, 4, seed=15)
    out = run_petit(problem, tiles)
    assert bool((out[::3] == 0).all())
    masked = (problem[0], torch.where(ids < 4, ids, -1), *problem[2:])
    check(out, masked)
    all_unrouted = make_problem(torch.full((16, 2), -1, dtype=torch.int32), 64, 16, 2, seed=16)
    assert bool((run_petit(all_unrouted, tiles) == 0).all())


def test_dispatch_layout_from_the_reference():
    """Rows as the dispatch delivers them at rank 0 of 2 (DeepSeek-like routing, padding
    rows, stale unrouted rows)."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    num_experts, top_k, hidden, intermediate, world = 32, 8, 256, 96, 2
    xs, ids, ws = [], [], []
    for tokens in (50, 23):
        topk_ids, topk_weights = reference.random_topk(tokens, num_experts, top_k,
                                                       generator=gen)
        xs.append(torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16))
        ids.append(topk_ids)
        ws.append(topk_weights)
    received = reference.dispatch_reference(xs, ids, ws, num_experts, region_stride=64)[0]
    num_local = num_experts // world
    _, _, _, w13, w2 = make_problem(received.recv_topk_ids, hidden, intermediate, num_local, 18)
    recv_x = torch.where(received.routed_mask[:, None], received.recv_x, float("nan"))
    problem = (recv_x.to(torch.bfloat16), received.recv_topk_ids, received.recv_topk_weights,
               w13, w2)
    for tiles in TILE_FAMILIES:
        check(run_petit(problem, tiles), problem)


def test_deterministic_and_tile_family_invariant():
    ids = random_ids(500, 8, 16, seed=19)
    problem = make_problem(ids, 1024, 256, 16, seed=20)
    small = run_petit(problem, "small")
    assert torch.equal(small, run_petit(problem, "small"))
    assert torch.equal(small, run_petit(problem, "large"))
    from vllm_petit_moe import ops

    auto_family = ops.resolve_tiles(500, 8, 16, 1024)  # "auto" is exactly what it resolves to
    assert torch.equal(run_petit(problem, auto_family),
                       run_petit(problem, "auto", with_workspaces=False))
    # The Hopper family sums in another fp32 order: deterministic, not bit-equal to SIMT.
    for family in WGMMA_FAMILIES:
        out = run_petit(problem, family)
        check(out, problem)
        assert torch.equal(out, run_petit(problem, family))
    # A row's result does not depend on the rest of the batch (batch invariance).
    head = tuple(t[:100].contiguous() if t.dim() == 2 else t for t in problem[:3]) + problem[3:]
    assert torch.equal(run_petit(head, "small"), small[:100])


def test_cuda_graph_capture_and_replay_with_new_inputs():
    from vllm_petit_moe import ops

    num_rows, top_k, hidden, intermediate, num_local = 96, 8, 136, 40, 8
    static = list(make_problem(random_ids(num_rows, top_k, num_local, seed=21), hidden,
                               intermediate, num_local, seed=22, poison_unrouted=False))
    out = torch.empty(num_rows, hidden, dtype=torch.bfloat16, device="cuda")
    for tiles in TILE_FAMILIES:  # warm-up outside the graph
        ops.experts_forward(*static, out=out, **tiles_kwargs(tiles))
    torch.cuda.synchronize()
    graphs = {}
    for tiles in TILE_FAMILIES:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.experts_forward(*static, out=out, **tiles_kwargs(tiles))
        graphs[tiles] = graph
    for replay in range(5):  # odd count; fresh routing, rows and weights every replay
        tiles = TILE_FAMILIES[replay % len(TILE_FAMILIES)]
        fresh = make_problem(random_ids(num_rows, top_k, num_local, seed=100 + replay), hidden,
                             intermediate, num_local, seed=200 + replay, poison_unrouted=False)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        out.fill_(float("nan"))
        graphs[tiles].replay()
        torch.cuda.synchronize()
        check(out, tuple(t.clone() for t in static), name=f"replay {replay} ({tiles})")
    del graphs


def test_errors_name_the_limit():
    from vllm_petit_moe import _C, ops

    problem = make_problem(random_ids(4, 2, 2, seed=23), 16, 8, 2, seed=24)
    recv_x, ids, weights, w13, w2 = problem
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.experts_forward(recv_x[:, :12].contiguous(), ids, weights, w13[:, :, :12].contiguous(),
                            w2[:, :12].contiguous())
    with pytest.raises(ValueError, match="int32"):
        ops.experts_forward(recv_x, ids.long(), weights, w13, w2)
    with pytest.raises(ValueError, match="MAX_LOCAL_EXPERTS"):
        big = torch.zeros(513, 16, 16, dtype=torch.bfloat16, device="cuda")
        ops.experts_forward(recv_x, ids, weights, big, w2)
    with pytest.raises(ValueError, match="bfloat16"):
        ops.experts_forward(recv_x, ids, weights, w13.half(), w2)
    with pytest.raises(ValueError, match="tiles"):
        ops.experts_forward(*problem, tiles="huge")
    with pytest.raises(ValueError, match="tiles"):
        ops.experts_forward(*problem, tiles="wgmma_ws")  # a removed family's name
    with pytest.raises(TypeError, match="ExpertConfig"):
        ops.experts_forward(*problem, config={"narrow_max_rows": 4})
    with pytest.raises(RuntimeError, match="no field"):
        _C.experts_forward(*problem, config={"split_k": 4})
    with pytest.raises(RuntimeError, match="narrow_max_rows"):
        _C.experts_forward(*problem, config={"narrow_max_rows": 100})
    with pytest.raises(ValueError, match="partial_workspace"):
        ops.experts_forward(*problem, partial_workspace=torch.empty(3, device="cuda"))
    # The binding checks on its own (snprintf-formatted messages).
    with pytest.raises(RuntimeError, match="w2 must be"):
        _C.experts_forward(recv_x, ids, weights, w13, w2[:, :8].contiguous())
    with pytest.raises(RuntimeError, match="top-k"):
        _C.experts_forward(recv_x, torch.zeros(4, 17, dtype=torch.int32, device="cuda"),
                           torch.zeros(4, 17, device="cuda"), w13, w2)


def test_zero_rows():
    from vllm_petit_moe import ops

    problem = make_problem(torch.zeros((0, 4), dtype=torch.int32), 16, 8, 2, seed=25)
    out = ops.experts_forward(*problem)
    assert out.shape == (0, 16)


def test_auto_picks_the_fastest_family_this_gpu_runs():
    from vllm_petit_moe import ops

    simt = "simt"
    # 1.5 and 2 entries per expert: either side of the narrow bound
    assert ops.resolve_tiles(3, 8, 16, 7168) == ("wgmma_narrow" if HAS_WGMMA else simt)
    assert ops.resolve_tiles(4, 8, 16, 7168) == ("wgmma_m64" if HAS_WGMMA else simt)
    assert ops.resolve_tiles(100, 8, 16, 7168) == ("wgmma_m64" if HAS_WGMMA else simt)
    # 95.5 and 96 entries per expert: either side of the 64-row bound
    assert ops.resolve_tiles(191, 8, 16, 7168) == ("wgmma_m64" if HAS_WGMMA else simt)
    assert ops.resolve_tiles(192, 8, 16, 7168) == ("wgmma" if HAS_WGMMA else simt)
    # 255.5 and 256 entries per expert: either side of the cluster bound, at hidden >= 4096
    assert ops.resolve_tiles(511, 8, 16, 7168) == ("wgmma" if HAS_WGMMA else simt)
    assert ops.resolve_tiles(512, 8, 16, 7168) == ("wgmma_mc" if HAS_WGMMA else simt)
    assert ops.resolve_tiles(4096, 8, 16, 4096) == ("wgmma_mc" if HAS_WGMMA else simt)
    assert ops.resolve_tiles(4096, 8, 16, 4088) == ("wgmma" if HAS_WGMMA else simt)
    # the bounds are ExpertConfig's
    config = ExpertConfig(narrow_max_rows=8, mc_min_rows=128)
    assert ops.resolve_tiles(4, 8, 16, 7168, config=config) == (
        "wgmma_narrow" if HAS_WGMMA else simt)
    assert ops.resolve_tiles(256, 8, 16, 7168, config=config) == (
        "wgmma_mc" if HAS_WGMMA else simt)


@pytest.mark.skipif(not HAS_WGMMA, reason="needs an sm_90a device (compute capability 9.0)")
def test_cluster_launch_shape():
    """wgmma_mc runs as whole clusters of 2 CTAs, at most one CTA per SM (its persistent
    grid is capped by the clusters that fit at once), wgmma without clusters."""
    from vllm_petit_moe import ops

    ids = random_ids(512, 8, 16, seed=61)
    problem = make_problem(ids, 1032, 520, 16, seed=62)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for tiles, cluster in (("wgmma_mc", 2), ("wgmma", 1)):
        check(run_petit(problem, tiles), problem, name=tiles)
        for gate_up in (True, False):
            shape = ops.last_gemm_launch(gate_up)
            assert shape["cluster"] == cluster and shape["threads"] == 384, shape
            assert 0 < shape["grid"] <= sms and shape["grid"] % cluster == 0, shape


@pytest.mark.parametrize("tiles", ["auto", "small"])
def test_programmatic_launch_sees_every_input(tiles):
    """Programmatic dependent launch (sm_90+, experts/persistent_launch.h launch_kernel): each kernel of a call
    may be scheduled before the previous one has drained and must still see all of its
    output. 12 calls with fresh data, sizes on both sides of auto's 64-row bound and
    NaN-poisoned workspaces (a kernel reading its input early would read NaN or the previous
    call's rows): against the reference, and bit-equal on a repeat."""
    for round_ in range(12):
        ids = random_ids(64 + 37 * round_, 8, 16, seed=300 + round_)
        problem = make_problem(ids, 1032, 520, 16, seed=400 + round_)
        first = run_petit(problem, tiles)
        check(first, problem, name=f"round {round_}")
        assert torch.equal(first, run_petit(problem, tiles)), f"round {round_}"


@pytest.mark.skipif(not HAS_WGMMA, reason="needs an sm_90a device (compute capability 9.0)")
@pytest.mark.parametrize("tiles,same_as", [("wgmma_narrow", "wgmma_m64"), ("wgmma_mc", "wgmma")])
@pytest.mark.parametrize("rows_per_expert", [3, 200, 700])
def test_hopper_regimes_give_the_same_bits(tiles, same_as, rows_per_expert):
    """Same k order, same epilogue formulas: narrow and m64 (64-row tiles of other widths, both
    fused), multicast and wgmma (the same tiles, in clusters or not) agree bit for bit, with
    NaN-poisoned workspaces. 17 k-tiles per tile (the rings wrap); from 200 rows per expert
    more tiles than SMs (blocks run on into further tiles; the staged down epilogue rewrites
    its buffer while earlier copies may read it); a partial last n-tile and k-tile."""
    num_local, top_k = 8, 4
    ids = random_ids(rows_per_expert * num_local // top_k * 2, top_k, num_local, seed=51)
    problem = make_problem(ids, 1032, 1032, num_local, seed=52)
    got = run_petit(problem, tiles)
    check(got, problem, name=tiles)
    assert torch.equal(got, run_petit(problem, same_as))


@pytest.mark.skipif(not HAS_WGMMA, reason="needs an sm_90a device (compute capability 9.0)")
@pytest.mark.parametrize("tiles", ["wgmma_narrow", "wgmma_m64"])
@pytest.mark.parametrize("num_rows,hidden,intermediate,num_local", [
    (1, 2048, 768, 64), (16, 2048, 768, 64),   # Qwen3-30B-A3B decode, 2 ranks
    (8, 7168, 2048, 16), (200, 1032, 520, 8),  # DeepSeek-V3 shapes; many tiles per SM
    (600, 264, 136, 3),                        # ~1100 rows per expert: many m-tiles each
])
def test_fused_gemms(tiles, num_rows, hidden, intermediate, num_local):
    """The 64-row regimes: gate/up and down in one persistent launch, each down tile's act
    rows read once its expert's gate/up tiles have all arrived. With NaN-poisoned workspaces
    (an act row read before it was written gives NaN), 5 rounds of fresh data, each within the
    reference's tolerance and bit-equal on a repeat and to the other 64-row regime (other
    tiles, other claim order)."""
    other = "wgmma_m64" if tiles == "wgmma_narrow" else "wgmma_narrow"
    for round_ in range(5):
        ids = random_ids(num_rows, 8, num_local, seed=700 + 13 * round_ + num_rows)
        problem = make_problem(ids, hidden, intermediate, num_local, seed=800 + round_)
        fused = run_petit(problem, tiles)
        check(fused, problem, name=f"{tiles} fused GEMMs, round {round_}")
        assert torch.equal(fused, run_petit(problem, tiles)), f"round {round_}"
        assert torch.equal(fused, run_petit(problem, other)), f"{other}, round {round_}"


@pytest.mark.skipif(not HAS_WGMMA, reason="needs an sm_90a device (compute capability 9.0)")
@pytest.mark.parametrize("routing,num_rows,hidden,intermediate,num_local", [
    # every row the same 4 local experts (m64 gate/up tiles: 4 x m-tiles x intermediate/128;
    # narrow where twice that is at most the SMs)
    ("same", 16, 2048, 768, 64),     # Qwen3-30B-A3B: 4 x 1 x 6 = 24 tiles: narrow on H200
    ("same", 64, 7168, 2048, 128),   # DeepSeek-V3: 4 x 1 x 16 = 64, 128 <= 132 SMs: narrow
    ("same", 96, 7168, 2048, 128),   # 4 x 2 x 16 = 128: m64
    ("random", 16, 2048, 768, 64),   # spread decode routing: ~50 experts x 6 tiles: m64
    ("random", 40, 7168, 2048, 128),
])
def test_auto_fused_gemms_equal_both_regimes(routing, num_rows, hidden, intermediate,
                                             num_local):
    """auto in the 64-row range fuses in one kernel that picks, on the device, the narrow
    tiles when they fit in one wave of the SMs (few experts with rows) and the m64 tiles
    otherwise; on fresh data each round its output is bit-equal to both explicit regimes and
    within the reference's tolerance."""
    for round_ in range(3):
        seed = 950 + 19 * round_ + num_rows
        ids = decode_ids(routing, num_rows, num_local, seed, slots=[1, 2, 5, 7],
                         experts=[3, 17, 40, 63])
        problem = make_problem(ids, hidden, intermediate, num_local, seed=seed + 1)
        auto = run_petit(problem, "auto")
        check(auto, problem, name=f"auto fused GEMMs, {routing}, round {round_}")
        for tiles in ("wgmma_narrow", "wgmma_m64"):
            assert torch.equal(auto, run_petit(problem, tiles)), f"{tiles}, round {round_}"


@pytest.mark.skipif(not HAS_WGMMA, reason="needs an sm_90a device (compute capability 9.0)")
def test_fused_gemms_in_a_cuda_graph():
    """The fused GEMMs captured in a CUDA graph (their per-expert counters are zeroed by the
    row lists inside it) and replayed with fresh routing, rows and weights, against the same
    call run eagerly."""
    from vllm_petit_moe import ops

    num_rows, top_k, hidden, intermediate, num_local = 24, 8, 2048, 768, 64
    static = list(make_problem(random_ids(num_rows, top_k, num_local, seed=31), hidden,
                               intermediate, num_local, seed=32, poison_unrouted=False))
    out = torch.empty(num_rows, hidden, dtype=torch.bfloat16, device="cuda")
    ops.experts_forward(*static, out=out, tiles="auto")  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.experts_forward(*static, out=out, tiles="auto")
    for replay in range(4):
        fresh = make_problem(random_ids(num_rows, top_k, num_local, seed=300 + replay), hidden,
                             intermediate, num_local, seed=400 + replay, poison_unrouted=False)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = run_petit(tuple(t.clone() for t in static), "auto")
        assert torch.equal(out, want), f"replay {replay}"
    del graph


@pytest.mark.parametrize("tiles", TILE_FAMILIES)
def test_global_ids_with_expert_map_equal_local_ids(tiles):
    """vLLM's expert_map applied inside the kernels: global ids + map give exactly the output
    of the mapped local ids (bit for bit: same row lists, same order), ids outside [0, E)
    skipped."""
    from vllm_petit_moe import ops

    num_rows, top_k, num_local, num_global = 300, 8, 16, 48
    ids = random_ids(num_rows, top_k, num_local, seed=41)
    problem = make_problem(ids, 264, 88, num_local, seed=42)
    gen = torch.Generator(device="cuda").manual_seed(43)
    owned = torch.randperm(num_global, generator=gen, device="cuda")[:num_local]
    expert_map = torch.full((num_global,), -1, dtype=torch.int32, device="cuda")
    expert_map[owned] = torch.arange(num_local, dtype=torch.int32, device="cuda")
    local = problem[1]
    foreign = torch.randint(0, num_global, local.shape, generator=gen, device="cuda")
    foreign = torch.where(expert_map[foreign] >= 0, num_global + 5, foreign)  # not ours
    global_ids = torch.where(local >= 0, owned[local.clamp(min=0).long()], foreign).int()
    want = run_petit(problem, tiles)
    got = ops.experts_forward(problem[0], global_ids.contiguous(), *problem[2:],
                              expert_map=expert_map, **tiles_kwargs(tiles))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="expert_map must be"):
        ops.experts_forward(problem[0], global_ids, *problem[2:], expert_map=expert_map.long())
