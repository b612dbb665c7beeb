"""CPU: bad inputs and cross-rank mismatches of dispatch/combine (each must give a named error
or a defined result, never wrong rows or a hang; docs/faults.md), on the emulated
ranks of tests/emu/ep_emu.cpp (the kernel sources run unchanged as host threads).

- Routing ids outside [-1, E) (int64 ids >= 2^31 * L that used to alias a real expert
  through a narrowing, ids whose owner rank is >= 32, ids < -1) are dropped like -1 and
  counted in the diagnostic record (EpDiagnostics::dropped_ids).
- fp8 dispatch keeps NaN as NaN and turns no infinity into a finite value or the wrong sign:
  bit for bit the oracle (testing.reference.quantize_fp8_reference), and the same NaN/inf
  pattern as vLLM's own native quantizer (QuantFP8).
- A rank that calls dispatch or combine with another region stride, top-k or quant than its
  peers fails with "call mismatch" (the flags' call tags) instead of reading rows at the
  wrong offsets or timing out with a misleading message.
- timeout_s: 0, negative, inf and NaN are refused (the emulator's create as EpContext does,
  the Python check, the environment variable).
"""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

from conftest import run_case
from test_dispatch_combine_emu_cpu import (NUM_EXPERTS, QUANT, EmuEp, _check_round, _inputs,
                                           _ints, _load, _ptrs)
from vllm_petit_moe.limits import MAX_TIMEOUT_S, check_timeout_s
from vllm_petit_moe.testing import reference as ref


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    from conftest import build_emu_library
    return _load(build_emu_library(tmp_path_factory, "ep_emu"))


# ------------------------------------------------------------------------- out-of-range ids
def test_out_of_range_ids_are_dropped_like_minus_one_and_counted(emu):
    """Each bad id is a slot the reference treats as -1; with the old 32-bit owner,
    2^32 * L + 5 was expert 5 of rank 0 and 2^31 * L + 3 an undefined shift."""
    world, hidden, top_k, tokens = 2, 64, 4, [9, 13]
    local = NUM_EXPERTS // world
    bad_values = [2**32 * local + 5, 2**31 * local + 3, 2**40, NUM_EXPERTS,
                  32 * local + 1, 40 * local, -2, -(2**40)]
    ep = EmuEp(emu, world, max_tokens=16, hidden=hidden)
    try:
        xs, ids, ws = _inputs(71, tokens, hidden, top_k, world, id_dtype=torch.int64)
        gen = torch.Generator().manual_seed(3)
        bad_ids, clean_ids, num_bad = [], [], []
        for i in ids:
            mask = torch.rand(i.shape, generator=gen) < 0.3
            values = torch.tensor(bad_values)[torch.randint(0, len(bad_values), i.shape,
                                                            generator=gen)]
            bad_ids.append(torch.where(mask, values, i))
            clean_ids.append(torch.where(mask, torch.full_like(i, -1), i))
            num_bad.append(int(mask.sum()))
        got = ep.dispatch(xs, bad_ids, ws, region_stride=16)
        expected = ref.dispatch_reference(xs, clean_ids, ws, NUM_EXPERTS, 16)
        for rank, ((recv_x, recv_ids, recv_w, _, _), e) in enumerate(zip(got, expected)):
            assert torch.equal(recv_ids, e.recv_topk_ids), f"ids on rank {rank}"
            assert torch.equal(recv_w, e.recv_topk_weights), f"weights on rank {rank}"
            assert torch.equal(recv_x[e.routed_mask], e.recv_x[e.routed_mask]), rank
        expert_outs = [torch.where(e.routed_mask[:, None], g[0], float("nan")).to(torch.bfloat16)
                       for g, e in zip(got, expected)]
        ys = ep.combine(expert_outs, tokens, top_k, 16)
        want = ref.combine_reference(expert_outs, clean_ids, NUM_EXPERTS)
        for rank in range(world):
            assert torch.equal(ys[rank], want[rank]), f"combine on rank {rank}"
            d = ep.diagnostics(rank)
            assert d["error"] == 0 and d["dropped_ids"] == num_bad[rank], d
        # int32 ids: the same rule (ids >= E and < -1 dropped), and the count accumulates
        xs, ids, ws = _inputs(72, tokens, hidden, top_k, world, id_dtype=torch.int32)
        ids[0][0, 0], ids[1][0, 1] = NUM_EXPERTS + 7, -5
        clean = [i.clone() for i in ids]
        clean[0][0, 0], clean[1][0, 1] = -1, -1
        got = ep.dispatch(xs, ids, ws, region_stride=16)
        expected = ref.dispatch_reference(xs, clean, ws, NUM_EXPERTS, 16)
        for rank, (g, e) in enumerate(zip(got, expected)):
            assert torch.equal(g[1], e.recv_topk_ids), rank
            assert ep.diagnostics(rank)["dropped_ids"] == num_bad[rank] + 1
    finally:
        ep.close()


# ------------------------------------------------------------------------------ fp8 NaN/inf
def _vllm_native_quant(x, quant):
    """vLLM's own native dynamic fp8 quantizer (QuantFP8.forward_native's paths, plain
    torch), called on a stand-in of its instance: (q, scales)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    if quant.startswith("fp8_block128"):
        me = SimpleNamespace(group_size=128, use_ue8m0=quant.endswith("ue8m0"),
                             column_major_scales=False)
        return QuantFP8._quantize_group_native(me, x)
    me = SimpleNamespace(is_group_quant=False, static=False, group_shape=GroupShape.PER_TOKEN,
                         num_token_padding=None)
    return QuantFP8.forward_native(me, x)


@pytest.mark.parametrize("quant", ["fp8_block128", "fp8_per_token", "fp8_block128_ue8m0"])
def test_fp8_dispatch_keeps_nan_and_inf_visible(emu, quant):
    world, hidden, tokens = 2, 256, [6, 5]
    ep = EmuEp(emu, world, max_tokens=8, hidden=hidden)
    try:
        gen = torch.Generator().manual_seed(5)
        xs, ids, ws = _inputs(81, tokens, hidden, 4, world)
        ids = [torch.randint(0, NUM_EXPERTS, i.shape, generator=gen) for i in ids]  # all routed
        specials = {(0, 0, 3): float("nan"), (0, 1, 130): float("inf"),
                    (0, 2, 5): float("-inf"), (1, 0, 200): float("nan"),
                    (1, 1, 0): float("inf"), (1, 1, 255): float("nan")}
        for (rank, token, col), value in specials.items():
            xs[rank][token, col] = value
        got = ep.dispatch(xs, ids, ws, region_stride=8, quant=quant)
        expected = ref.dispatch_reference(xs, ids, ws, NUM_EXPERTS, 8, quant=quant)
        for rank, ((recv_x, _, _, scales, _), e) in enumerate(zip(got, expected)):
            m = e.routed_mask
            got_deq = ref.dequantize_fp8_reference(recv_x[m], scales[m])
            want_deq = ref.dequantize_fp8_reference(e.recv_x[m], e.recv_x_scales[m])
            assert torch.equal(got_deq.isnan(), want_deq.isnan()), f"NaN pattern, rank {rank}"
            finite = ~want_deq.isnan()
            assert torch.equal(got_deq[finite], want_deq[finite]), f"values, rank {rank}"
            assert not got_deq.isinf().any(), "an infinity survived as a wrong-signed one"
        # vLLM's quantizer on the source rows: the same NaN pattern after dequantization, the
        # same values elsewhere (rows whose scale rule agrees: amax above 448/512 here).
        for rank in range(world):
            q, s = _vllm_native_quant(xs[rank].float(), quant)
            vllm_deq = ref.dequantize_fp8_reference(q, s.view(q.shape[0], -1))
            q_ref, s_ref = ref.quantize_fp8_reference(xs[rank], quant)
            ours = ref.dequantize_fp8_reference(q_ref, s_ref)
            assert torch.equal(ours.isnan(), vllm_deq.isnan()), f"vLLM NaN pattern, {rank}"
            for token in range(tokens[rank]):
                if torch.isnan(ours[token]).any():
                    assert torch.isnan(ours[token]).any()
                    continue
                assert torch.equal(ours[token], vllm_deq[token]), (rank, token)
            # the rows with a NaN or an inf really are NaN where vLLM's are
            special_rows = {t for (r, t, _) in specials if r == rank}
            assert all(bool(vllm_deq[t].isnan().any()) for t in special_rows)
    finally:
        ep.close()


def test_ue8m0_scale_of_nan_and_inf_stays_nan_and_inf():
    y = torch.tensor([float("nan"), float("inf"), 3.0, 4.0, 1e-30])
    got = ref.pow2_ceil(y)
    assert math.isnan(got[0]) and got[1] == float("inf")
    assert got[2:].tolist() == [4.0, 4.0, 2.0 ** math.ceil(math.log2(1e-30))]


# ---------------------------------------------------------------------- cross-rank mismatch
def _case(lib_path, case):
    """Run by run_case in a fresh process (a trap aborts it)."""
    lib = _load(ctypes.CDLL(lib_path))
    world, hidden = 2, 128
    ep = EmuEp(lib, world, max_tokens=16, hidden=hidden, timeout_s=30.0)
    xs, ids, ws = _inputs(9, [8, 8], hidden, 4, world)
    k, stride, quant = [4, 4], [16, 16], [0, 0]
    if case == "region_stride":
        stride = [8, 16]
    elif case == "top_k":
        k = [4, 2]
        ids[1], ws[1] = ids[1][:, :2].contiguous(), ws[1][:, :2].contiguous()
    elif case == "quant":
        quant = [0, QUANT["fp8_per_token"]]
    if case == "combine_top_k":
        got = ep.dispatch(xs, ids, ws, region_stride=16)
        outs = [torch.zeros(8, hidden, dtype=torch.bfloat16) for _ in range(world)]
        expert_outs = [g[0] for g in got]
        rc = lib.petit_emu_ep_combine_each(ep.handle, _ptrs(expert_outs), _ptrs(outs),
                                           _ints([8, 8]), _ints([4, 3]), _ints([16, 16]),
                                           _ints([0, 0]))
    else:
        xs, ids, ws = ([t.contiguous() for t in ts] for ts in (xs, ids, ws))
        rc = lib.petit_emu_ep_dispatch_each(ep.handle, 3, _ptrs(xs), _ptrs(ids), 1, _ptrs(ws),
                                            _ints([8, 8]), _ints(k), _ints(stride),
                                            _ints(quant), _ints([0, 0]))
    print(f"returned {rc}")


@pytest.mark.parametrize("case,phase", [("region_stride", "dispatch"), ("top_k", "dispatch"),
                                        ("quant", "dispatch"), ("combine_top_k", "combine")])
def test_a_rank_with_another_call_fails_with_a_mismatch(emu, case, phase):
    """R 8 vs 16 used to give all rows wrong and no error; a top-k or quant mismatch a
    misleading timeout or garbage. Now the first wait that sees the peer's flag with the
    epoch but another tag reports the mismatch, within far less than the 30 s timeout."""
    import time
    start = time.monotonic()
    # the mismatch traps: expected, so kept out of CI's trap log (tests/emu/emu_ptx.h)
    result = run_case(__file__, emu._name, case, env={"PETIT_EMU_EXPECT_TRAP": "1"})
    elapsed = time.monotonic() - start
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "returned" not in result.stdout, out[-2000:]
    assert f"petit_moe: {phase} call mismatch on rank" in out, out[-2000:]
    assert "epoch 1 differs" in out, out[-2000:]
    assert elapsed < 25, f"took {elapsed:.1f} s: a timeout, not the mismatch check"


def test_equal_calls_still_match_the_reference_after_the_tag_change(emu):
    """Odd region strides (mod 1024 and 256 in the tags), top-k 16 and fp8: the tags agree."""
    ep = EmuEp(emu, 3, max_tokens=40, hidden=256, max_top_k=16, num_experts=48)
    try:
        for round_, (stride, quant) in enumerate([(37, None), (40, "fp8_block128"),
                                                  (33, "fp8_per_token")]):
            xs, ids, ws = _inputs(90 + round_, [stride, 5, 0], 256, 16, 3, num_experts=48)
            _check_round(ep, xs, ids, ws, region_stride=stride, quant=quant,
                         tag=f"round {round_}", num_experts=48)
    finally:
        ep.close()


# ----------------------------------------------------------------------------------- timeout
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), MAX_TIMEOUT_S * 2])
def test_bad_timeouts_are_refused(emu, value, monkeypatch):
    assert not emu.petit_emu_ep_create(2, 8, 64, 4, 32, 2, value), value
    with pytest.raises(ValueError, match="must be finite, > 0 and <= 3600 seconds"):
        check_timeout_s(value)
    from vllm_petit_moe.vllm_glue import envs
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_TIMEOUT_S, repr(value) if value == value else "nan")
    with pytest.raises(ValueError, match="VLLM_PETIT_MOE_TIMEOUT_S"):
        envs.timeout_s()


def test_good_timeouts_are_kept(emu, monkeypatch):
    assert check_timeout_s("2.5") == 2.5 and check_timeout_s(MAX_TIMEOUT_S) == MAX_TIMEOUT_S
    with pytest.raises(ValueError, match="not a number"):
        check_timeout_s("soon")
    handle = emu.petit_emu_ep_create(2, 8, 64, 4, 32, 2, 0.5)
    assert handle
    emu.petit_emu_ep_destroy(handle)
    from vllm_petit_moe.vllm_glue import envs
    monkeypatch.setenv(envs.VLLM_PETIT_MOE_TIMEOUT_S, "45")
    assert envs.timeout_s() == 45.0
