"""Randomized rounds for the soak runs (tools/soak.py on GPUs, tests/test_soak_emu_cpu.py on
the CPU emulation): every rank draws the same round from the seed, so each computes the whole
layer's inputs and its own expected output without collectives.

A round: a shape (hidden H, top-k K, experts E from `SHAPES`), each rank's token count
(random in [0, T_max], zero with probability 0.15), and a routing pattern from `PATTERNS`:
uniform, skewed (one hot rank), a hot expert, -1 slots, repeated ids in a token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import reference as ref

# (hidden, intermediate, top_k, num_experts): odd and round sizes, small and large top-k.
SHAPES = ((136, 64, 2, 16), (1024, 256, 8, 32), (2048, 128, 4, 64), (256, 96, 6, 32))
PATTERNS = ("uniform", "hot_rank", "hot_expert", "minus_one", "repeated")


@dataclass
class Round:
    seed: int
    shape: tuple[int, int, int, int]
    pattern: str
    xs: list[torch.Tensor]
    topk_ids: list[torch.Tensor]
    topk_weights: list[torch.Tensor]

    @property
    def tokens(self) -> list[int]:
        return [x.shape[0] for x in self.xs]


def draw_round(seed: int, world_size: int, max_tokens: int, *, shapes=SHAPES,
               device: torch.device | str = "cpu", id_dtype=torch.int64) -> Round:
    """Round `seed` of a soak: the same on every rank and device (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda n: int(torch.randint(0, n, (1,), generator=gen))  # noqa: E731
    shape = shapes[pick(len(shapes))]
    hidden, _, top_k, num_experts = shape
    pattern = PATTERNS[pick(len(PATTERNS))]
    tokens = torch.randint(0, max_tokens + 1, (world_size,), generator=gen)
    tokens = torch.where(torch.rand(world_size, generator=gen) < 0.15, 0, tokens).tolist()
    xs, ids, weights = [], [], []
    for t in tokens:
        xs.append(torch.randn(t, hidden, generator=gen).to(torch.bfloat16))
        skew = {"hot_rank": "hot_rank", "hot_expert": "one_expert"}.get(pattern)
        i, w = ref.random_topk(t, num_experts, top_k, generator=gen, skew=skew,
                               world_size=world_size)
        if pattern == "minus_one" and t > 0:
            i[torch.rand(t, top_k, generator=gen) < 0.3] = -1
        if pattern == "repeated" and t > 0 and top_k > 1:
            rows = torch.rand(t, generator=gen) < 0.5
            i[rows, 1] = i[rows, 0]
        ids.append(i.to(id_dtype))
        weights.append(w)
    move = lambda ts: [t.to(device) for t in ts]  # noqa: E731
    return Round(seed, shape, pattern, move(xs), move(ids), move(weights))


def expert_weights(shape, seed: int = 0, device: torch.device | str = "cpu"):
    """Global (w13 [E, 2I, H], w2 [E, H, I]) bf16 weights of a soak shape, scaled so that
    outputs stay O(1)."""
    hidden, inter, _, num_experts = shape
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(torch.bfloat16).to(device), w2.to(torch.bfloat16).to(device)


class RankReference:
    """One rank's expected output of the EP MoE layer, vectorized over the experts: the same
    rounding model as ``reference.ep_moe_reference`` (``"kernel"``: bf16 activation, each
    entry's weighted down row in bf16, each destination rank's sum in bf16, the sum over the
    ranks in fp32 rounded to bf16; ``"fp32"``: the same in float64 without rounding), but
    computed for this rank's tokens only, densely over every expert (a few batched matmuls and
    no host synchronization, so a soak round costs milliseconds where ranks share one GPU).
    Sums are taken in another order than the reference's, which the tolerance absorbs.

    w13 ``[E, 2I, H]`` and w2 ``[E, H, I]`` global bf16 weights; their upcast copies are made
    once here.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, world_size: int):
        self.world_size = world_size
        self.num_experts, self.inter = w13.shape[0], w13.shape[1] // 2
        self.weights = {dtype: (w13.to(dtype), w2.to(dtype))
                        for dtype in (torch.float32, torch.float64)}

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 precision: str) -> torch.Tensor:
        """x ``[T, H]`` bf16, topk_ids ``[T, K]`` global ids or -1, topk_weights ``[T, K]``:
        ``[T, H]`` bf16 (``"kernel"``) or float32 (``"fp32"``)."""
        kernel = precision == "kernel"
        dtype = torch.float32 if kernel else torch.float64
        w13, w2 = self.weights[dtype]
        E, I = self.num_experts, self.inter  # noqa: E741
        T, K = topk_ids.shape
        valid = (topk_ids >= 0) & (topk_ids < E)
        ids = torch.where(valid, topk_ids, 0).long()
        gate_up = torch.einsum("th,eih->eti", x.to(dtype), w13)  # [E, T, 2I]
        act = torch.nn.functional.silu(gate_up[..., :I]) * gate_up[..., I:]
        if kernel:
            act = act.to(torch.bfloat16).to(dtype)
        down = torch.einsum("eti,ehi->eth", act, w2)  # [E, T, H]
        rows = torch.arange(T, device=x.device)[:, None].expand(T, K)
        weighted = down[ids, rows] * topk_weights.to(dtype)[..., None]  # [T, K, H]
        if kernel:
            weighted = weighted.to(torch.bfloat16).to(dtype)
        owner = ids // (E // self.world_size)
        route = torch.nn.functional.one_hot(owner, self.world_size).to(dtype) * valid[..., None]
        per_rank = torch.einsum("tkw,tkh->twh", route, weighted)  # each destination's rows
        if kernel:
            per_rank = per_rank.to(torch.bfloat16).to(dtype)
        y = per_rank.sum(1)
        return y.to(torch.bfloat16) if kernel else y.to(torch.float32)


def check_round(got: torch.Tensor, kernel: torch.Tensor, fp32: torch.Tensor) -> tuple[bool, float]:
    """(mismatch, relative error) of a layer output against its reference: the verdict of
    ``reference.check_close(got, fp32, reference.tolerance(kernel, fp32))`` or a non-finite
    value, and ``max|got - fp32| / max(max|fp32|, 1e-6)``, computed where the tensors are with
    one transfer to the host (the reference's functions copy each tensor to the host, a
    synchronization each, which costs time slices where ranks share a GPU)."""
    if fp32.numel() == 0:
        return False, 0.0
    g, k, f = (t.double() for t in (got, kernel, fp32))
    dk, dg = k - f, g - f
    k_abs, k_norm, g_abs, g_norm, f_norm, f_max, finite = torch.stack([
        dk.abs().max(), dk.norm(), dg.abs().max(), dg.norm(), f.norm(), f.abs().max(),
        torch.isfinite(g).all().double()]).tolist()

    def rel(norm: float) -> float:
        return norm / f_norm if f_norm > 0 else (0.0 if norm == 0 else float("inf"))
    tol = ref.tolerance_from_errors(k_abs, rel(k_norm), f_max)
    bad = not (g_abs <= tol.max_abs and rel(g_norm) <= tol.rel_fro) or finite != 1.0
    return bad, g_abs / max(f_max, 1e-6)
