"""CPU: a bounded soak of dispatch -> experts -> combine on the emulated ranks (rare orderings
and shapes that single tests miss must not hang or corrupt a round; docs/faults.md), run
in CI: 32 randomized rounds by default (PETIT_EMU_SOAK_BATCHES x 8; the emulator runs a host
thread per GPU thread, 0.5-2.5 s per round on 2 busy cores, so a few hundred rounds are for
an explicit run), seeds swept, W = 2, 3 and 4, the shapes and routing
patterns of testing.soak: T per rank random with zeros, uniform, hot rank, hot expert, -1
slots, repeated ids), back to back on one buffer per batch with no barrier between ranks
(petit_emu_ep_rounds), identity experts, checked bit for bit against the reference.
The GPU soak (>= 10^4 rounds with the real expert GEMMs and graph replays) is tools/soak.py.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from test_dispatch_combine_emu_cpu import EmuEp, _ints, _load
from vllm_petit_moe.testing import reference as ref
from vllm_petit_moe.testing.soak import draw_round

# Small shapes: the emulator runs a GPU thread per host thread (hidden, inter, top_k, experts).
EMU_SHAPES = ((64, 0, 2, 24), (72, 0, 8, 48), (136, 0, 4, 24), (2048, 0, 3, 48))
ROUNDS_PER_BATCH = 8
NUM_BATCHES = int(os.environ.get("PETIT_EMU_SOAK_BATCHES", "4"))


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    from conftest import build_emu_library
    return _load(build_emu_library(tmp_path_factory, "ep_emu"))


def _batch(emu, batch):
    """ROUNDS_PER_BATCH rounds of one shape on one buffer; returns the rounds checked."""
    world = (2, 3, 2, 4)[batch % 4]
    max_tokens = 40
    rounds = []
    seed = 10_000 * world + batch * ROUNDS_PER_BATCH
    shape = EMU_SHAPES[batch % len(EMU_SHAPES)]
    for r in range(ROUNDS_PER_BATCH):
        rounds.append(draw_round(seed + r, world, max_tokens, shapes=(shape,),
                                 id_dtype=torch.int32))
    hidden, _, top_k, num_experts = shape
    stride = max(max(max(rd.tokens) for rd in rounds), 1)
    x = torch.zeros(len(rounds), world, stride, hidden, dtype=torch.bfloat16)
    ids = torch.full((len(rounds), world, stride, top_k), -1, dtype=torch.int32)
    ws = torch.zeros(len(rounds), world, stride, top_k)
    tokens = torch.zeros(len(rounds), world, dtype=torch.int32)
    for i, rd in enumerate(rounds):
        for rank in range(world):
            t = rd.tokens[rank]
            tokens[i, rank] = t
            x[i, rank, :t], ids[i, rank, :t], ws[i, rank, :t] = \
                rd.xs[rank], rd.topk_ids[rank], rd.topk_weights[rank]
    outs = torch.full((len(rounds), world, stride, hidden), float("nan"), dtype=torch.bfloat16)
    ep = EmuEp(emu, world, max_tokens=stride, hidden=hidden, max_top_k=top_k,
               num_experts=num_experts, num_blocks=1 + batch % 2)
    try:
        results = _ints([0] * world)
        rc = emu.petit_emu_ep_rounds(ep.handle, len(rounds), x.data_ptr(), ids.data_ptr(),
                                     ws.data_ptr(), tokens.data_ptr(), top_k, stride,
                                     outs.data_ptr(), results)
        assert rc == 0, f"batch {batch}: launches returned {list(results)}"
        assert ep.epochs() == [len(rounds)] * world
    finally:
        ep.close()
    for i, rd in enumerate(rounds):
        expected = ref.dispatch_reference(rd.xs, rd.topk_ids, rd.topk_weights, num_experts,
                                          stride)
        want = ref.combine_reference([e.recv_x for e in expected], rd.topk_ids, num_experts)
        for rank in range(world):
            t = rd.tokens[rank]
            assert torch.equal(outs[i, rank, :t], want[rank]), \
                f"seed {rd.seed} ({rd.pattern}, W={world}, shape {shape}), rank {rank}"
    return len(rounds)


def test_emulated_soak_of_randomized_rounds(emu):
    start = time.monotonic()
    checked = sum(_batch(emu, b) for b in range(NUM_BATCHES))
    assert checked == NUM_BATCHES * ROUNDS_PER_BATCH
    print(f"emulated soak: {checked} rounds in {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize("world", [2, 4])
def test_rank_reference_matches_the_ep_reference(world):
    """The GPU soak's per-rank, vectorized reference (testing.soak.RankReference) against the
    EP reference it stands in for, over every shape and routing pattern: float32 to rounding
    of the summation order, bf16 within one bf16 step where a sum in another order rounds the
    other way; a wrong expert, weight or rank would be off by far more."""
    from vllm_petit_moe.testing.soak import SHAPES, RankReference, expert_weights
    for shape in SHAPES:
        w13, w2 = expert_weights(shape)
        reference = RankReference(w13, w2, world)
        for seed in range(6):
            rd = draw_round(1000 * world + seed, world, 12, shapes=(shape,))
            stride = max(max(rd.tokens), 1)
            for precision in ("kernel", "fp32"):
                want = ref.ep_moe_reference(rd.xs, rd.topk_ids, rd.topk_weights, w13, w2, world,
                                            precision, stride)
                for rank in range(world):
                    got = reference(rd.xs[rank], rd.topk_ids[rank], rd.topk_weights[rank],
                                    precision)
                    where = f"seed {rd.seed} ({rd.pattern}), {shape}, rank {rank}, {precision}"
                    assert got.dtype == want[rank].dtype and got.shape == want[rank].shape, where
                    scale = want[rank].float().abs().max().item() if got.numel() else 0.0
                    step = 2.0**-7 if precision == "kernel" else 1e-5
                    diff = (got.float() - want[rank].float()).abs()
                    assert diff.numel() == 0 or diff.max().item() <= step * scale + 1e-6, where


def test_check_round_agrees_with_the_reference_checks():
    """The soak's one-transfer check (testing.soak.check_round) gives reference.check_close's
    verdict under reference.tolerance, fails non-finite outputs, and reports max|got - fp32| /
    max|fp32|: on outputs within and beyond the tolerance, NaN, zero and empty references."""
    from vllm_petit_moe.testing.soak import check_round
    g = torch.Generator().manual_seed(3)
    fp32 = torch.randn(6, 40, generator=g)
    kernel = fp32.bfloat16()

    def verdict(got, kern, want):
        try:
            ref.check_close(got, want, ref.tolerance(kern, want))
        except AssertionError:
            return True
        return not bool(torch.isfinite(got.float()).all())
    cases = [kernel, (fp32 + 0.02 * torch.randn(6, 40, generator=g)).bfloat16(),
             (fp32 * 1.001).bfloat16(), kernel.clone().index_fill_(1, torch.tensor([3]), 9.0)]
    nan = kernel.clone()
    nan[2, 5] = float("nan")
    cases.append(nan)
    verdicts = []
    for got in cases:
        bad, err = check_round(got, kernel, fp32)
        assert bad == verdict(got, kernel, fp32)
        if not bad:
            want = (got.double() - fp32.double()).abs().max() / fp32.abs().max()
            assert abs(err - float(want)) <= 1e-12
        verdicts.append(bad)
    assert verdicts == [False, True, False, True, True]
    zero = torch.zeros(2, 8)
    assert check_round(zero.bfloat16(), zero.bfloat16(), zero) == (False, 0.0)
    assert check_round(torch.ones(2, 8).bfloat16(), zero.bfloat16(), zero)[0]
    empty = torch.zeros(0, 8)
    assert check_round(empty.bfloat16(), empty.bfloat16(), empty) == (False, 0.0)
