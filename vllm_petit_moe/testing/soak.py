"""Randomized rounds for the soak runs (tools/soak.py on GPUs, tests/test_soak_emu_cpu.py on
the CPU emulation): every rank draws the same round from the seed, so each computes the whole
layer's inputs and its own expected output without collectives.

A round: a shape (hidden H, top-k K, experts E from `SHAPES`), each rank's token count
(random in [0, T_max], zero with probability 0.15), and a routing pattern from `PATTERNS`:
uniform, skewed (one hot rank), a hot expert, -1 slots, repeated ids in a token.

What the GPU soak runs in a round (`RoundPlan`, from `soak_round`) rotates with the seed, so
every 40 consecutive seeds cover every combination and `--seed S --rounds 1` replays round S:
the path (`PATHS`: dispatch -> experts -> combine, the fused kernel as the expert stage, the
whole layer fused with bf16 or block-fp8 weights, or the one-GPU fused op with block-fp8
weights on each rank's own tokens),
the dispatch wire (`WIRES`: bf16 or one of dispatch's fp8 modes) and the ids' dtype (int32 as
vLLM's router gives them, or int64), each where the round's shape admits it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..limits import FP8_BLOCK_MODES, FP8_QUANT_MODES, FP8_SCALE_BLOCK
from . import reference as ref

# (hidden, intermediate, top_k, num_experts): odd and round sizes, small and large top-k.
SHAPES = ((136, 64, 2, 16), (1024, 256, 8, 32), (2048, 128, 4, 64), (256, 96, 6, 32))
PATTERNS = ("uniform", "hot_rank", "hot_expert", "minus_one", "repeated")


# The paths of a soak round. Block-fp8 weights (e4m3, fp32 scales per 128 x 128 block) run in
# "megamoe_w1_fp8": ops.megamoe_forward (W=1, no dispatch) with every expert's weights on this
# rank's own tokens, and in "fused_fp8": the whole EP layer (EpBuffer.megamoe) on this rank's
# experts' fp8 weights.
PATHS = ("composed", "megamoe", "fused", "megamoe_w1_fp8", "fused_fp8")
FP8_WEIGHT_PATHS = ("megamoe_w1_fp8", "fused_fp8")
WIRES = ("bf16",) + FP8_QUANT_MODES  # dispatch's quant: None or an fp8 mode
ID_DTYPES = (torch.int32, torch.int64)  # vLLM's router gives int32


@dataclass(frozen=True)
class RoundPlan:
    """What one soak round runs.

    path: one of `PATHS`; wire: one of `WIRES` (always "bf16" where no dispatch of
    EpBuffer.dispatch runs: the fused layer and the one-GPU op); id_dtype: the dtype of the
    round's top-k ids as the layer receives them (the one-GPU op takes int32 only, so its
    rounds are int32).
    """
    path: str
    wire: str
    id_dtype: torch.dtype

    @property
    def quant(self) -> str | None:
        """EpBuffer.dispatch's `quant` argument."""
        return None if self.wire == "bf16" else self.wire

    @property
    def weights(self) -> str:
        """The experts' weight format: "fp8" (block fp8, 128 x 128 scales) or "bf16"."""
        return "fp8" if self.path in FP8_WEIGHT_PATHS else "bf16"

    @property
    def ids(self) -> str:
        return str(self.id_dtype).removeprefix("torch.")


def path_qualifies(path: str, shape, world: int, stride: int, num_tokens: int) -> bool:
    """Whether the kernels of `path` take a round of `shape` at region stride `stride`
    (`num_tokens`: this round's largest per-rank token count, the one-GPU op's N)."""
    from .. import ops
    hidden, inter, top_k, _ = shape
    if path == "composed":
        return True
    if path == "megamoe_w1_fp8":
        return ops.megamoe_unsupported_reason(num_tokens, top_k, hidden, inter,
                                              fp8=True) is None
    return ops.megamoe_unsupported_reason(world * stride, top_k, hidden, inter,
                                          fp8=path == "fused_fp8") is None


def round_id_dtype(seed: int, ids: str = "alternate") -> torch.dtype:
    """The dtype of round `seed`'s ids before any path's restriction: ID_DTYPES[seed // 20 % 2]
    ("alternate"), or "int32" / "int64"."""
    if ids == "alternate":
        return ID_DTYPES[seed // (len(PATHS) * len(WIRES)) % len(ID_DTYPES)]
    names = {str(d).removeprefix("torch."): d for d in ID_DTYPES}
    if ids not in names:
        raise ValueError(f"soak: ids must be 'alternate' or one of {sorted(names)}, got {ids!r}")
    return names[ids]


def plan_round(seed: int, shape, world: int, stride: int, num_tokens: int | None = None, *,
               path: str = "alternate", wire: str = "alternate",
               ids: str = "alternate") -> RoundPlan:
    """The plan of round `seed`: each of path, wire and ids rotates with the seed ("alternate":
    path = PATHS[seed % 5], wire = WIRES[seed // 5 % 4], ids = ID_DTYPES[seed // 20 % 2]) or
    is fixed by name. Where the shape does not admit the choice: a path falls back to
    "composed", a 1x128-block wire (H not a multiple of 128) to "fp8_per_token"; the fused
    layer and the one-GPU op take no wire ("bf16"), the one-GPU op int32 ids only."""
    num_tokens = stride if num_tokens is None else num_tokens
    path = PATHS[seed % len(PATHS)] if path == "alternate" else path
    wire = WIRES[seed // len(PATHS) % len(WIRES)] if wire == "alternate" else wire
    id_dtype = round_id_dtype(seed, ids)
    if path not in PATHS or wire not in WIRES:
        raise ValueError(f"soak: path must be one of {PATHS}, wire one of {WIRES}; got "
                         f"{path!r}, {wire!r}")
    if not path_qualifies(path, shape, world, stride, num_tokens):
        path = "composed"
    if wire in FP8_BLOCK_MODES and shape[0] % FP8_SCALE_BLOCK:
        wire = "fp8_per_token"
    if path in ("fused", *FP8_WEIGHT_PATHS):
        wire = "bf16"
    if path == "megamoe_w1_fp8":
        id_dtype = torch.int32
    return RoundPlan(path, wire, id_dtype)


def wire_rows(x: torch.Tensor, quant: str | None) -> torch.Tensor:
    """x ``[T, H]`` bf16 as the experts see it after a dispatch with `quant`: itself (bf16
    wire) or its fp8 quantization (testing.reference.quantize_fp8_reference, the formulas
    dispatch quantizes with) dequantized and rounded to bf16, the experts' input format."""
    if quant is None:
        return x
    return dequantize_wire(*ref.quantize_fp8_reference(x, quant))


def dequantize_wire(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """dispatch's fp8 rows ``[N, H]`` float8_e4m3fn and their float32 scales (``[N, H/128]``
    or ``[N, 1]``) as bf16 ``[N, H]`` (e4m3 · scale in fp32, rounded once)."""
    return ref.dequantize_fp8_reference(q, scales).to(torch.bfloat16)


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


def soak_round(seed: int, world_size: int, max_tokens: int, *, shapes=SHAPES,
               path: str = "alternate", wire: str = "alternate", ids: str = "alternate",
               device: torch.device | str = "cpu") -> tuple[Round, RoundPlan, int]:
    """Round `seed` of the GPU soak and its plan: (the round with ids of the plan's dtype, the
    plan, the region stride R = max(max tokens, 1) every rank uses). The ids' dtype is chosen
    before the shape is drawn, so a fixed `ids` draws the same round as its rotation."""
    id_dtype = round_id_dtype(seed, ids)
    rd = draw_round(seed, world_size, max_tokens, shapes=shapes, device=device,
                    id_dtype=id_dtype)
    stride = max(max(rd.tokens), 1)
    plan = plan_round(seed, rd.shape, world_size, stride, max(rd.tokens), path=path, wire=wire,
                      ids=ids)
    if plan.id_dtype != id_dtype:  # the one-GPU op's int32
        rd.topk_ids = [t.to(plan.id_dtype) for t in rd.topk_ids]
    return rd, plan, stride


def schedule_mix(plans) -> dict[str, int]:
    """Rounds per path, wire, ids dtype and weight format of `plans` (RoundPlan), as the
    soak's results row counts them: ``rounds_<path>``, ``rounds_wire_<wire>``,
    ``rounds_ids_<dtype>``, ``rounds_weights_<format>``, every key present (0 where none ran)."""
    mix = {f"rounds_{p}": 0 for p in PATHS}
    mix.update({f"rounds_wire_{w}": 0 for w in WIRES})
    mix.update({f"rounds_ids_{str(d).removeprefix('torch.')}": 0 for d in ID_DTYPES})
    mix.update({"rounds_weights_bf16": 0, "rounds_weights_fp8": 0})
    for plan in plans:
        for key in (f"rounds_{plan.path}", f"rounds_wire_{plan.wire}", f"rounds_ids_{plan.ids}",
                    f"rounds_weights_{plan.weights}"):
            mix[key] += 1
    return mix


def fp8_expert_weights(shape, seed: int = 0, device: torch.device | str = "cpu"):
    """`expert_weights` of `shape` (H and I multiples of 128), each 128 x 128 block scaled by
    its own gain (e^N(0,1), so that a block read with another block's scale shows), as a
    block-fp8 checkpoint holds them (testing.reference.block_fp8_quantize): (w13 e4m3
    ``[E, 2I, H]``, its float32 scales ``[E, 2I/128, H/128]``, w2 e4m3 ``[E, H, I]``, scales
    ``[E, H/128, I/128]``, and the dequantized float32 w13 and w2 the reference multiplies
    with)."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for w in expert_weights(shape, seed):
        num, rows, cols = w.shape
        b = FP8_SCALE_BLOCK
        gains = torch.exp(torch.randn(num, rows // b, 1, cols // b, 1, generator=gen))
        w = (w.float().view(num, rows // b, b, cols // b, b) * gains).view(num, rows, cols)
        out.append(ref.block_fp8_quantize(w))
    (q13, s13, d13), (q2, s2, d2) = out
    return tuple(t.to(device) for t in (q13, s13, q2, s2, d13, d2))


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


def soak_results_name(gpu: str, num_gpus: int, ranks: int) -> str:
    """The soak's results file name (no extension): ``soak_<gpu>_<G>gpu_<R>ranks``, the GPU
    model, the physical GPUs and the ranks on them (bench_env.results_name)."""
    from .bench_env import results_name
    return results_name("soak", gpu, num_gpus, ranks)


def soak_row(per_rank: list[dict], *, gpu: str, num_gpus: int, seed: int, rounds_asked: int,
             path: str, wire: str, ids: str, commit: str, date: str, seconds: float) -> dict:
    """The results line of one soak run from every rank's stats (tools/soak.py's
    ``soak_rank``: rounds, mix (`schedule_mix` of the plans of the rounds it ran),
    graph_replays, mismatches, max_rel_err, first_mismatch).

    What ran: gpu (model), gpus (physical GPUs) and ranks (processes on them, rank r on GPU
    r % gpus), with num_gpus and world repeating them under the names of the older soak rows
    and the other benchmarks; the layer as vLLM's glue runs it (validate_ids False, no
    barrier between rounds); the rotation asked for (path, wire, ids) and the rounds that ran
    on every rank together by path, wire, ids dtype and weight format (`schedule_mix`)."""
    ranks = len(per_rank)
    row = dict(gpu=gpu, gpus=num_gpus, ranks=ranks, num_gpus=num_gpus, world=ranks,
               commit=commit, date=date, seed=seed, path=path, wire=wire, ids=ids,
               validate_ids=False, round_barrier=False,
               rounds=sum(r["rounds"] for r in per_rank))
    mix = schedule_mix(())
    for key in mix:
        mix[key] = sum(r["mix"][key] for r in per_rank)
    row.update(mix)
    row.update(rounds_per_rank=per_rank[0]["rounds"] if per_rank else 0,
               rounds_asked=rounds_asked,
               graph_replays=sum(r["graph_replays"] for r in per_rank),
               mismatches=sum(r["mismatches"] for r in per_rank),
               max_rel_err=max((r["max_rel_err"] for r in per_rank), default=0.0),
               first_mismatch=next((r["first_mismatch"] for r in per_rank
                                    if r["first_mismatch"]), None),
               seconds=round(seconds, 1))
    return row
