"""Tests of the pure-torch reference (vllm_petit_moe/testing/reference.py), the oracle of every
kernel.

CPU only. Every case draws fresh random inputs from a seeded generator (never zeros). The
layout expectations below are computed independently of the reference (plain Python loops
over tokens and slots, or tensors written out by hand), following docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from vllm_petit_moe.limits import MAX_TOP_K
from vllm_petit_moe.testing.reference import (
    Tolerance,
    check_close,
    combine_reference,
    dense_moe_reference,
    dispatch_reference,
    ep_moe_reference,
    expert_row_lists_reference,
    experts_reference,
    identity_experts_reference,
    local_expert_ids,
    owner_rank,
    random_topk,
    tolerance,
    validate_config,
    validate_routing,
)


@dataclass
class Problem:
    """All ranks' inputs of one EP MoE call."""

    xs: list[torch.Tensor]  # per source [T_s, H] bf16
    topk_ids: list[torch.Tensor]  # per source [T_s, K] int64
    topk_weights: list[torch.Tensor]  # per source [T_s, K] f32
    w13: torch.Tensor  # [E, 2I, H] bf16
    w2: torch.Tensor  # [E, H, I] bf16

    @property
    def world_size(self) -> int:
        return len(self.xs)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def make_problem(
    seed: int,
    world_size: int,
    num_experts: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
    num_tokens: list[int],
    *,
    skew: str | None = None,
    unused_slots: bool = False,
) -> Problem:
    """Random inputs; with ``unused_slots`` about a quarter of the slots become ``-1`` (their
    weights stay non-zero, they must be ignored) and each rank's first token has no valid id."""
    assert len(num_tokens) == world_size
    generator = torch.Generator().manual_seed(seed)
    xs, topk_ids, topk_weights = [], [], []
    for rank_tokens in num_tokens:
        xs.append(torch.randn(rank_tokens, hidden_size, generator=generator).bfloat16())
        ids, weights = random_topk(
            rank_tokens, num_experts, top_k, generator=generator, skew=skew, world_size=world_size
        )
        if unused_slots and rank_tokens > 0:
            ids[torch.rand(ids.shape, generator=generator) < 0.25] = -1
            ids[0] = -1
        topk_ids.append(ids)
        topk_weights.append(weights)
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=generator)
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=generator)
    # Scaled so that activations and outputs stay O(1).
    w13 = (w13 / hidden_size**0.5).bfloat16()
    w2 = (w2 / intermediate_size**0.5).bfloat16()
    return Problem(xs, topk_ids, topk_weights, w13, w2)


def run_ep(problem: Problem, precision: str, region_stride: int | None = None):
    return ep_moe_reference(
        problem.xs,
        problem.topk_ids,
        problem.topk_weights,
        problem.w13,
        problem.w2,
        problem.world_size,
        precision=precision,
        region_stride=region_stride,
    )


def run_dense(problem: Problem) -> list[torch.Tensor]:
    return [
        dense_moe_reference(x, ids, weights, problem.w13, problem.w2, precision="fp64")
        for x, ids, weights in zip(problem.xs, problem.topk_ids, problem.topk_weights)
    ]


# --------------------------------------------------------------------------- EP == dense

# (world_size, num_experts, top_k, hidden, intermediate, tokens per rank, options)
EP_CASES = [
    pytest.param(1, 4, 1, 8, 24, [7], {}, id="w1-k1-h8"),
    pytest.param(1, 16, 8, 136, 40, [33], {}, id="w1-k8-h136"),
    pytest.param(2, 8, 2, 24, 40, [19, 0], {}, id="w2-k2-zero-token-rank"),
    pytest.param(2, 8, 8, 1000, 24, [5, 31], {"region_stride": 40}, id="w2-k8-h1000-stride40"),
    pytest.param(2, 2, 1, 24, 24, [10, 13], {"skew": "one_expert"}, id="w2-k1-all-on-expert0"),
    pytest.param(4, 16, 3, 136, 24, [1, 17, 0, 40], {"skew": "one_expert"}, id="w4-k3-one-expert"),
    pytest.param(4, 8, 6, 24, 40, [12, 12, 12, 12], {"unused_slots": True}, id="w4-k6-unused-slots"),
    pytest.param(4, 4, 4, 8, 24, [3, 0, 0, 0], {}, id="w4-k4-one-busy-rank"),
    pytest.param(8, 64, 8, 1000, 40, [21, 3, 0, 64, 9, 1, 30, 17], {"skew": "hot_rank"}, id="w8-k8-hot-rank"),
    pytest.param(8, 16, 7, 8, 40, [4, 0, 9, 2, 0, 11, 6, 1], {"region_stride": 16, "unused_slots": True}, id="w8-k7-stride16-unused"),
    pytest.param(8, 8, 1, 136, 24, [5, 6, 7, 8, 9, 10, 11, 12], {}, id="w8-k1"),
    pytest.param(8, 32, 5, 24, 40, [0, 0, 0, 0, 0, 0, 0, 1], {}, id="w8-k5-single-token"),
]  # fmt: skip


@pytest.mark.parametrize(
    "world_size,num_experts,top_k,hidden,intermediate,num_tokens,options", EP_CASES
)
def test_ep_matches_dense(
    world_size, num_experts, top_k, hidden, intermediate, num_tokens, options
):
    region_stride = options.get("region_stride")
    problem = make_problem(
        seed=1000 * world_size + 10 * top_k + hidden,
        world_size=world_size,
        num_experts=num_experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_tokens=num_tokens,
        skew=options.get("skew"),
        unused_slots=options.get("unused_slots", False),
    )
    dense = run_dense(problem)
    y_fp32 = run_ep(problem, "fp32", region_stride)
    y_kernel = run_ep(problem, "kernel", region_stride)
    for y_f, y_k, ref, x in zip(y_fp32, y_kernel, dense, problem.xs):
        assert y_f.dtype == torch.float32 and y_k.dtype == torch.bfloat16
        assert y_f.shape == y_k.shape == x.shape

    # fp32 mode: the same math as the dense MoE, only grouped differently.
    scale = float(torch.cat(dense).abs().max())
    for y_f, ref in zip(y_fp32, dense):
        torch.testing.assert_close(y_f.double(), ref, rtol=1e-5, atol=1e-5 * scale)

    # kernel mode: within the tolerance derived from its own bf16-vs-fp32 error.
    tol = tolerance(y_kernel, y_fp32)
    check_close(y_kernel, dense, tol)
    assert tol.rel_fro < 2.0**-6  # the bound is a bf16-sized one, not a vacuous one

    if options.get("unused_slots"):
        for y_f, y_k in zip(y_fp32, y_kernel):
            if y_f.shape[0] > 0:  # each rank's token 0 has no valid id
                assert not y_f[0].any() and not y_k[0].any()


def test_ep_no_tokens_anywhere():
    problem = make_problem(7, 4, 8, 2, 24, 40, [0, 0, 0, 0])
    for precision in ("kernel", "fp32"):
        ys = run_ep(problem, precision, region_stride=3)
        assert [tuple(y.shape) for y in ys] == [(0, 24)] * 4


def reordered_experts(recv_x, recv_topk_ids, recv_topk_weights, w13, w2):
    """A correct expert computation in another order and accumulation precision than the
    reference (slot by slot, last slot first, float64 sums) with the kernel's two bf16 roundings:
    what a legitimate kernel may differ by."""
    intermediate_size = w13.shape[1] // 2
    out = torch.zeros(recv_x.shape, dtype=torch.float64)
    for slot_idx in reversed(range(recv_topk_ids.shape[1])):
        for expert_idx in recv_topk_ids[:, slot_idx].unique().tolist():
            if expert_idx < 0:
                continue
            row_idx = (recv_topk_ids[:, slot_idx] == expert_idx).nonzero().squeeze(1)
            gate_up = recv_x[row_idx].double() @ w13[expert_idx].double().T
            act = F.silu(gate_up[:, :intermediate_size]) * gate_up[:, intermediate_size:]
            down = act.bfloat16().double() @ w2[expert_idx].double().T
            out[row_idx] += recv_topk_weights[row_idx, slot_idx, None].double() * down
    return out.bfloat16()


def ep_with_experts(problem: Problem, experts_fn) -> list[torch.Tensor]:
    num_local_experts = problem.num_experts // problem.world_size
    dispatched = dispatch_reference(
        problem.xs, problem.topk_ids, problem.topk_weights, problem.num_experts
    )
    expert_outs = []
    for rank, received in enumerate(dispatched):
        local = slice(rank * num_local_experts, (rank + 1) * num_local_experts)
        expert_outs.append(
            experts_fn(
                received.recv_x,
                received.recv_topk_ids,
                received.recv_topk_weights,
                problem.w13[local],
                problem.w2[local],
            )
        )
    return combine_reference(expert_outs, problem.topk_ids, problem.num_experts)


@pytest.fixture(scope="module")
def tolerance_problem():
    problem = make_problem(42, 4, 16, 8, 1000, 40, [20, 33, 7, 25])
    tol = tolerance(run_ep(problem, "kernel"), run_ep(problem, "fp32"))
    return problem, tol, run_dense(problem)


def test_tolerance_accepts_reordered_kernel(tolerance_problem):
    problem, tol, dense = tolerance_problem
    check_close(ep_with_experts(problem, reordered_experts), dense, tol)


def test_tolerance_rejects_changed_routing_weight(tolerance_problem):
    problem, tol, dense = tolerance_problem
    problem.topk_weights = [w.clone() for w in problem.topk_weights]
    problem.topk_weights[1][5, 0] *= 0.9
    with pytest.raises(AssertionError, match="differs from the fp32 reference"):
        check_close(run_ep(problem, "kernel"), dense, tol)


def test_tolerance_rejects_changed_expert_weight(tolerance_problem):
    problem, tol, dense = tolerance_problem
    problem.w2 = problem.w2.clone()
    problem.w2[int(problem.topk_ids[0][0, 0]), 3, :] *= 1.1  # one output feature of one expert
    with pytest.raises(AssertionError, match="differs from the fp32 reference"):
        check_close(run_ep(problem, "kernel"), dense, tol)


def test_check_close_rejects_nan():
    ref = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    candidate = ref.clone()
    candidate[1, 2] = float("nan")
    with pytest.raises(AssertionError):
        check_close(candidate, ref, Tolerance(max_abs=1.0, rel_fro=1.0))


# --------------------------------------------------------------------------- dispatch layout


@pytest.mark.parametrize(
    "world_size,num_experts,top_k,num_tokens,region_stride",
    [
        (1, 4, 2, [9], None),
        (2, 8, 3, [6, 0], 8),
        (4, 8, 5, [3, 7, 1, 5], None),
        (8, 16, 4, [2, 0, 5, 1, 3, 4, 0, 6], 9),
    ],
)
def test_dispatch_layout(world_size, num_experts, top_k, num_tokens, region_stride):
    problem = make_problem(
        5 + world_size, world_size, num_experts, top_k, 24, 24, num_tokens, unused_slots=True
    )
    stride = max(num_tokens) if region_stride is None else region_stride
    num_local_experts = num_experts // world_size
    dispatched = dispatch_reference(
        problem.xs, problem.topk_ids, problem.topk_weights, num_experts, region_stride
    )
    assert len(dispatched) == world_size
    for dst_rank, received in enumerate(dispatched):
        num_rows = world_size * stride
        assert received.recv_x.shape == (num_rows, 24) and received.recv_x.dtype == torch.bfloat16
        assert received.recv_topk_ids.shape == (num_rows, top_k)
        assert received.recv_topk_ids.dtype == torch.int32
        assert received.recv_topk_weights.shape == (num_rows, top_k)
        assert received.recv_topk_weights.dtype == torch.float32
        assert received.routed_mask.shape == (num_rows,)
        assert received.routed_mask.dtype == torch.bool
        for src_rank in range(world_size):
            ids = problem.topk_ids[src_rank].tolist()
            weights = problem.topk_weights[src_rank].tolist()
            for token_idx in range(stride):
                row_idx = src_rank * stride + token_idx
                if token_idx >= num_tokens[src_rank]:
                    assert received.recv_topk_ids[row_idx].tolist() == [-1] * top_k
                    assert received.recv_topk_weights[row_idx].tolist() == [0.0] * top_k
                    assert not received.routed_mask[row_idx]
                    continue
                expected_ids, expected_weights = [], []
                for expert_id, weight in zip(ids[token_idx], weights[token_idx]):
                    is_local = expert_id >= 0 and expert_id // num_local_experts == dst_rank
                    local_id = expert_id - dst_rank * num_local_experts
                    expected_ids.append(local_id if is_local else -1)
                    expected_weights.append(weight if is_local else 0.0)
                routed = any(local_id >= 0 for local_id in expected_ids)
                assert received.recv_topk_ids[row_idx].tolist() == expected_ids
                assert received.recv_topk_weights[row_idx].tolist() == expected_weights
                assert bool(received.routed_mask[row_idx]) == routed
                if routed:
                    assert torch.equal(received.recv_x[row_idx], problem.xs[src_rank][token_idx])
                else:
                    assert not received.recv_x[row_idx].any()


def test_dispatch_dedups_per_rank():
    # W=2, E=8 (L=4): token 0 hits three experts of rank 0, token 1 hits both ranks,
    # token 2 only rank 1, token 3 nothing.
    ids = torch.tensor([[0, 3, 1], [2, 6, -1], [7, 5, 4], [-1, -1, -1]])
    weights = torch.tensor(
        [[0.5, 0.3, 0.2], [0.6, 0.4, 0.9], [0.2, 0.3, 0.5], [0.7, 0.2, 0.1]]
    )
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(4, 16, generator=generator).bfloat16()
    x1 = torch.randn(2, 16, generator=generator).bfloat16()
    ids1 = torch.tensor([[4, 0, 1], [1, 2, 3]])
    weights1 = torch.tensor([[0.1, 0.2, 0.7], [0.3, 0.3, 0.4]])
    rank0, rank1 = dispatch_reference([x, x1], [ids, ids1], [weights, weights1], num_experts=8)
    # R = 4: source 0 rows 0..3, source 1 rows 4..7 (rows 6, 7 beyond T_1 = 2).
    assert rank0.routed_mask.tolist() == [True, True, False, False, True, True, False, False]
    assert rank1.routed_mask.tolist() == [False, True, True, False, True, False, False, False]
    assert rank0.recv_topk_ids.tolist() == [
        [0, 3, 1], [2, -1, -1], [-1, -1, -1], [-1, -1, -1],
        [-1, 0, 1], [1, 2, 3], [-1, -1, -1], [-1, -1, -1],
    ]  # fmt: skip
    assert rank1.recv_topk_ids.tolist() == [
        [-1, -1, -1], [-1, 2, -1], [3, 1, 0], [-1, -1, -1],
        [0, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1],
    ]  # fmt: skip
    expected_weights0 = torch.tensor([
        [0.5, 0.3, 0.2], [0.6, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0],
        [0.0, 0.2, 0.7], [0.3, 0.3, 0.4], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0],
    ])  # fmt: skip
    assert torch.equal(rank0.recv_topk_weights, expected_weights0)
    assert torch.equal(rank0.recv_x[:2], x[:2]) and torch.equal(rank0.recv_x[4:6], x1)
    assert torch.equal(rank1.recv_x[1:3], x[1:3]) and torch.equal(rank1.recv_x[4], x1[0])


# --------------------------------------------------------------------------- row lists


def test_row_lists_hand_built():
    # entry = row*K + k with K=2:  row0 -> entries 0 (id 0), 1 (id 2); row1 -> 2 (-1), 3 (id 0);
    # row2 -> 4 (id 1), 5 (-1); row3 -> 6 (id 2), 7 (id 1).
    ids = torch.tensor([[0, 2], [-1, 0], [1, -1], [2, 1]], dtype=torch.int32)
    counts, offsets, entries = expert_row_lists_reference(ids, num_local_experts=4)
    assert counts.dtype == offsets.dtype == entries.dtype == torch.int32
    assert counts.tolist() == [2, 2, 2, 0]
    assert offsets.tolist() == [0, 2, 4, 6, 6]
    assert entries.tolist() == [0, 3, 4, 7, 1, 6, -1, -1]


def test_row_lists_one_hot_expert_and_empty():
    ids = torch.tensor([[1, -1, -1], [-1, -1, 1], [-1, -1, -1]], dtype=torch.int32)
    counts, offsets, entries = expert_row_lists_reference(ids, num_local_experts=2)
    assert counts.tolist() == [0, 2]
    assert offsets.tolist() == [0, 0, 2]
    assert entries.tolist() == [0, 5, -1, -1, -1, -1, -1, -1, -1]

    all_unused = torch.full((3, 2), -1, dtype=torch.int32)
    counts, offsets, entries = expert_row_lists_reference(all_unused, num_local_experts=3)
    assert counts.tolist() == [0, 0, 0] and offsets.tolist() == [0, 0, 0, 0]
    assert entries.tolist() == [-1] * 6

    counts, offsets, entries = expert_row_lists_reference(
        torch.empty(0, 4, dtype=torch.int32), num_local_experts=2
    )
    assert counts.tolist() == [0, 0] and offsets.tolist() == [0, 0, 0] and entries.numel() == 0


@pytest.mark.parametrize("seed", range(4))
def test_row_lists_invariants(seed):
    generator = torch.Generator().manual_seed(seed)
    num_rows, top_k, num_local_experts = 257, 1 + seed * 2, [1, 3, 8, 32][seed]
    ids = torch.randint(-1, num_local_experts, (num_rows, top_k), generator=generator)
    ids = ids.to(torch.int32)
    counts, offsets, entries = expert_row_lists_reference(ids, num_local_experts)
    flat_ids = ids.view(-1).long()
    assert counts.tolist() == [int((flat_ids == e).sum()) for e in range(num_local_experts)]
    assert offsets[0] == 0 and offsets[1:].tolist() == counts.long().cumsum(0).tolist()
    total = int(offsets[-1])
    assert total == int((flat_ids >= 0).sum())
    for expert_idx in range(num_local_experts):
        segment = entries[offsets[expert_idx] : offsets[expert_idx + 1]].long()
        assert (flat_ids[segment] == expert_idx).all()
        assert (segment[1:] > segment[:-1]).all()  # ascending, no repeats
    assert entries[total:].eq(-1).all()
    assert sorted(entries[:total].tolist()) == (flat_ids >= 0).nonzero().squeeze(1).tolist()


# --------------------------------------------------------------------------- experts, combine


def test_experts_ignore_unrouted_rows():
    # Rows whose ids are all -1 hold stale data in the kernels: they must yield 0 and must not
    # influence other rows, even if they hold NaN.
    generator = torch.Generator().manual_seed(21)
    recv_x = torch.randn(6, 24, generator=generator).bfloat16()
    recv_x[2] = float("nan")
    ids = torch.tensor([[0, 1], [-1, -1], [-1, -1], [1, -1], [-1, 0], [-1, -1]], dtype=torch.int32)
    weights = torch.where(ids >= 0, torch.rand(6, 2, generator=generator), 0.0)
    w13 = (torch.randn(2, 80, 24, generator=generator) / 5).bfloat16()
    w2 = (torch.randn(2, 24, 40, generator=generator) / 6).bfloat16()
    for precision in ("kernel", "fp32"):
        out = experts_reference(recv_x, ids, weights, w13, w2, precision)
        assert out.dtype == (torch.bfloat16 if precision == "kernel" else torch.float32)
        assert not out[[1, 2, 5]].any()
        assert out[[0, 3, 4]].isfinite().all() and out[[0, 3, 4]].abs().sum(dim=1).gt(0).all()


def test_combine_sums_routed_rows_in_rank_order():
    # W=3, E=3 (one expert per rank), R=4. Unrouted rows hold NaN: combine must not read them.
    generator = torch.Generator().manual_seed(8)
    ids = [torch.tensor([[0, 2], [1, -1], [-1, -1]]), torch.tensor([[2, 1]]), torch.empty(0, 2)]
    ids[2] = ids[2].long()
    expert_outs = [torch.randn(12, 16, generator=generator).bfloat16() for _ in range(3)]
    routed_rows = {0: [0, 4], 1: [1, 4], 2: [0, 4]}  # destination -> rows routed there
    for dst_rank, out in enumerate(expert_outs):
        unrouted = [row for row in range(12) if row not in routed_rows[dst_rank]]
        out[unrouted] = float("nan")
    y0, y1, y2 = combine_reference(expert_outs, ids, num_experts=3)
    expected_row0 = (expert_outs[0][0].float() + expert_outs[2][0].float()).bfloat16()
    assert torch.equal(y0[0], expected_row0)
    assert torch.equal(y0[1], expert_outs[1][1])
    assert torch.equal(y0[2], torch.zeros(16, dtype=torch.bfloat16))
    expected_y1 = (expert_outs[1][4].float() + expert_outs[2][4].float()).bfloat16()
    assert torch.equal(y1[0], expected_y1)
    assert y2.shape == (0, 16)

    fp32_outs = [out.float() for out in expert_outs]
    assert all(y.dtype == torch.float32 for y in combine_reference(fp32_outs, ids, num_experts=3))


@pytest.mark.parametrize(
    "world_size,num_experts,top_k", [(1, 4, 2), (2, 8, 8), (4, 8, 3), (8, 64, 8)]
)
def test_identity_expert_round_trip(world_size, num_experts, top_k):
    problem = make_problem(
        3 * world_size, world_size, num_experts, top_k, 136, 24, [9 + r for r in range(world_size)]
    )
    dispatched = dispatch_reference(
        problem.xs, problem.topk_ids, problem.topk_weights, num_experts
    )
    expert_outs = [
        identity_experts_reference(d.recv_x, d.recv_topk_ids, d.recv_topk_weights)
        for d in dispatched
    ]
    ys = combine_reference(expert_outs, problem.topk_ids, num_experts)
    for y, x in zip(ys, problem.xs):
        # Each of the <= W partial rows x*S_d is rounded to bf16 (error <= 2**-9 |x| S_d, with
        # Σ S_d = 1), then the sum once more (<= 2**-9 |y|): within 2**-7 |x| in all.
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        assert ((y.float() - x.float()).abs() <= 2.0**-7 * x.float().abs()).all()
    if world_size == 1:
        assert torch.equal(ys[0], problem.xs[0])


# --------------------------------------------------------------------------- routing helpers


def test_owner_and_local_ids():
    ids = torch.tensor([[0, 3, -1], [4, 7, 5]])
    assert owner_rank(ids, num_experts=8, world_size=2).tolist() == [[0, 0, -1], [1, 1, 1]]
    assert local_expert_ids(ids, 1, num_experts=8, world_size=2).tolist() == [
        [-1, -1, -1],
        [0, 3, 1],
    ]
    assert local_expert_ids(ids, 0, 8, 2).dtype == torch.int32


@pytest.mark.parametrize("skew", [None, "one_expert", "hot_rank", "same_experts"])
def test_random_topk_properties(skew):
    num_tokens, num_experts, top_k, world_size = 2048, 64, 8, 8
    ids, weights = random_topk(
        num_tokens,
        num_experts,
        top_k,
        generator=torch.Generator().manual_seed(0),
        skew=skew,
        world_size=world_size,
    )
    assert ids.shape == weights.shape == (num_tokens, top_k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.min() >= 0 and ids.max() < num_experts
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # distinct per token
    assert (weights > 0).all()
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(num_tokens))
    again = random_topk(
        num_tokens, num_experts, top_k, generator=torch.Generator().manual_seed(0),
        skew=skew, world_size=world_size,
    )  # fmt: skip
    assert torch.equal(ids, again[0]) and torch.equal(weights, again[1])

    hot_share = float((ids < num_experts // world_size).float().mean())
    if skew == "one_expert":
        assert (ids[:, 0] == 0).all() and (ids[:, 1:] != 0).all()
    elif skew == "hot_rank":
        assert abs(hot_share - 0.5) < 0.03
        assert ids.unique().numel() == num_experts
    elif skew == "same_experts":  # one fixed set, whatever the generator's seed
        assert (ids == ids[0]).all() and ids.unique().numel() == top_k
        other = random_topk(3, num_experts, top_k, generator=torch.Generator().manual_seed(7),
                            skew=skew, world_size=world_size)[0]
        assert (other == ids[0]).all()
    else:
        assert abs(hot_share - 1 / world_size) < 0.03


def test_random_topk_hot_fraction_extremes():
    def hot_rank_ids(num_experts, world_size, hot_fraction):
        generator = torch.Generator().manual_seed(1)
        return random_topk(
            256, num_experts, 4, generator=generator, skew="hot_rank",
            world_size=world_size, hot_fraction=hot_fraction,
        )[0]  # fmt: skip

    assert (hot_rank_ids(32, 4, hot_fraction=1.0) < 8).all()
    assert (hot_rank_ids(32, 4, hot_fraction=0.0) >= 8).all()
    # L=2 < K=4: at most two pairs per token fit on rank 0.
    assert ((hot_rank_ids(16, 8, hot_fraction=1.0) < 2).sum(dim=1) == 2).all()


# --------------------------------------------------------------------------- bad inputs


def _one_rank_inputs(num_tokens=4, hidden=16, top_k=2, num_experts=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).bfloat16()
    ids, weights = random_topk(num_tokens, num_experts, top_k, generator=generator)
    return x, ids, weights


def test_bad_expert_ids_raise():
    x, ids, weights = _one_rank_inputs()
    too_big = ids.clone()
    too_big[1, 0] = 8
    with pytest.raises(ValueError, match=r"\[-1, 8\)"):
        dispatch_reference([x], [too_big], [weights], num_experts=8)
    too_small = ids.clone()
    too_small[0, 1] = -2
    with pytest.raises(ValueError, match=r"\[-1, 8\)"):
        dispatch_reference([x], [too_small], [weights], num_experts=8)
    with pytest.raises(ValueError, match=r"\[-1, 2\)"):
        expert_row_lists_reference(torch.tensor([[0, 2]], dtype=torch.int32), num_local_experts=2)


def test_bad_config_raises():
    with pytest.raises(ValueError, match=r"num_experts \(6\) .* divisible by world_size \(4\)"):
        validate_config(6, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        validate_config(8, 2, hidden_size=20)
    with pytest.raises(ValueError, match=rf"\[1, {MAX_TOP_K}\]"):
        validate_config(64, 2, top_k=17)
    with pytest.raises(ValueError, match="float32"):
        validate_routing(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2).bfloat16(), 8, 2)

    xs, ids, weights = zip(*[_one_rank_inputs(seed=s, num_experts=6) for s in range(4)])
    with pytest.raises(ValueError, match="divisible by world_size"):
        dispatch_reference(list(xs), list(ids), list(weights), num_experts=6)

    x, ids, weights = _one_rank_inputs(hidden=20)
    with pytest.raises(ValueError, match="multiple of 8"):
        dispatch_reference([x], [ids], [weights], num_experts=8)

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 16, generator=generator).bfloat16()
    ids, weights = random_topk(3, 32, 16, generator=generator)
    dispatch_reference([x], [ids], [weights], num_experts=32)  # top-k 16 is the limit
    ids17 = torch.cat([ids, ids[:, :1]], dim=1)
    weights17 = torch.cat([weights, weights[:, :1]], dim=1)
    with pytest.raises(ValueError, match=rf"\[1, {MAX_TOP_K}\]"):
        dispatch_reference([x], [ids17], [weights17], num_experts=32)
    with pytest.raises(ValueError, match=rf"\[1, {MAX_TOP_K}\]"):
        random_topk(3, 32, 17, generator=generator)


def test_bad_region_stride_and_lists_raise():
    inputs = [_one_rank_inputs(num_tokens=t, seed=t) for t in (5, 3)]
    xs, ids, weights = (list(column) for column in zip(*inputs))
    with pytest.raises(ValueError, match=r"region_stride \(4\) must be >= .* \(max is 5\)"):
        dispatch_reference(xs, ids, weights, num_experts=8, region_stride=4)
    with pytest.raises(ValueError, match="one entry per rank"):
        dispatch_reference(xs, ids[:1], weights, num_experts=8)
    with pytest.raises(ValueError, match="one entry per rank"):
        dispatch_reference(xs, ids, weights[:1], num_experts=8)
    with pytest.raises(ValueError, match="one entry per rank"):
        combine_reference([torch.zeros(10, 16).bfloat16()], ids, num_experts=8)
    with pytest.raises(ValueError, match="region stride R=2"):
        combine_reference([torch.zeros(4, 16).bfloat16()] * 2, ids, num_experts=8)
    w13 = torch.zeros(8, 48, 16).bfloat16()
    w2 = torch.zeros(8, 16, 24).bfloat16()
    with pytest.raises(ValueError, match=r"world_size=4"):
        ep_moe_reference(xs, ids, weights, w13, w2, world_size=4)
