"""CPU tests of the fp8 e4m3 quantization that dispatch applies at the source.

- csrc/common/fp8.h ``petit_float_to_e4m3`` (the portable conversion the kernels use where the GPU
  has no fp8 convert instruction), run on the host through ``_C.float_to_e4m3``, must equal
  torch's round-to-nearest-even ``float8_e4m3fn`` cast bit for bit, and saturate to +-448.
- ``reference.quantize_fp8_reference`` (the oracle the GPU tests compare dispatch with):
  scale layout, the 1x128-block and per-token formulas, round-trip error bounds, bad input.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from vllm_petit_moe import limits
from vllm_petit_moe.testing import reference as ref


def _extension():
    if importlib.util.find_spec("vllm_petit_moe._C") is None:
        pytest.skip("compiled extension vllm_petit_moe._C not built")
    from vllm_petit_moe import _C
    return _C


def _torch_e4m3(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float8_e4m3fn).view(torch.uint8)


def test_conversion_matches_torch_on_every_e4m3_value_and_midpoint():
    _C = _extension()
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).float()
    finite = grid[torch.isfinite(grid)].unique()
    # every representable value, the midpoints between neighbours (ties: round to even),
    # and values just beside each midpoint
    mids = (finite[1:] + finite[:-1]) / 2
    values = torch.cat([finite, mids, torch.nextafter(mids, torch.tensor(float("inf"))),
                        torch.nextafter(mids, torch.tensor(float("-inf"))), -mids])
    values = values[values.abs() <= 448]
    assert torch.equal(_C.float_to_e4m3(values), _torch_e4m3(values))


def test_conversion_matches_torch_on_random_floats():
    _C = _extension()
    gen = torch.Generator().manual_seed(5)
    values = torch.cat([
        torch.randn(200_000, generator=gen) * 10.0 ** torch.randint(-9, 3, (200_000,), generator=gen),
        (torch.rand(100_000, generator=gen) - 0.5) * 2 ** -5,  # subnormal range
        torch.tensor([0.0, -0.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 448.0, -448.0]),
    ])
    values = values[values.abs() <= 448]
    got, want = _C.float_to_e4m3(values), _torch_e4m3(values)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. {values[bad[:5]].tolist()}"


def test_conversion_saturates_and_keeps_nan():
    _C = _extension()
    values = torch.tensor([449.0, 463.9, 464.0, 1e6, float("inf"), -500.0, float("-inf"),
                           float("nan")])
    got = _C.float_to_e4m3(values).tolist()
    assert got[:5] == [0x7E] * 5 and got[5:7] == [0xFE] * 2
    assert got[7] & 0x7F == 0x7F  # NaN


@pytest.mark.parametrize("mode", limits.FP8_QUANT_MODES)
def test_reference_quantizer_layout_and_error(mode):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(37, 512, generator=gen)
         * torch.logspace(-4, 4, 37)[:, None]).to(torch.bfloat16)
    x[3] = 0  # an all-zero token: minimum scale, zeros out
    q, scales = ref.quantize_fp8_reference(x, mode)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == torch.float32
    assert scales.shape == ((37, 4) if mode.startswith("fp8_block128") else (37, 1))
    assert q.float().abs().max() <= 448
    assert torch.all(q[3].float() == 0)
    back = ref.dequantize_fp8_reference(q, scales)
    # e4m3 keeps 3 mantissa bits: error <= 2^-4 of each scale group's max (2^-3 with
    # power-of-two scales, up to 2x coarser), or half the smallest subnormal step
    # (2^-10 * scale) where a minimum scale applies
    group = x.float().view(37, scales.shape[1], -1)
    amax = group.abs().amax(dim=-1, keepdim=True)
    rel = 2.0 ** -3 if mode.endswith("ue8m0") else 2.0 ** -4
    bound = torch.maximum(amax * rel, scales[..., None] * 2.0 ** -10)
    err = (back.view_as(group) - group).abs()
    assert torch.all(err <= bound)
    # a group's largest element maps to +-448 unless its scale is the minimum one
    unclamped = (amax[..., 0] / 448.0 > (limits.FP8_TOKEN_MIN_SCALE if mode == "fp8_per_token"
                                         else limits.FP8_BLOCK_MIN_AMAX / 448.0))
    top = q.float().view_as(group).abs().amax(dim=-1)
    if mode.endswith("ue8m0"):  # a power-of-two scale >= amax/448: the top lands in [224, 448]
        assert torch.all(top[unclamped] >= 224) and torch.all(top <= 448)
        assert torch.all(torch.log2(scales).frac() == 0)
    else:
        assert unclamped.sum() > 20 and torch.all(top[unclamped] == 448)


def test_reference_quantizer_formulas_match_vllm_conventions():
    x = torch.tensor([[1.0] * 127 + [-896.0]], dtype=torch.bfloat16)
    q, s = ref.quantize_fp8_reference(x, "fp8_block128")
    assert s.item() == pytest.approx(896.0 / 448.0)
    q, s = ref.quantize_fp8_reference(torch.zeros(1, 128, dtype=torch.bfloat16), "fp8_per_token")
    assert s.item() == pytest.approx(1.0 / (448.0 * 512.0))  # vLLM's minimum per-token scale
    q, s = ref.quantize_fp8_reference(torch.zeros(1, 128, dtype=torch.bfloat16), "fp8_block128")
    assert s.item() == pytest.approx(1e-10 / 448.0)  # vLLM's per_token_group_quant eps


def test_pow2_ceil_is_exact():
    values = torch.tensor([1.0, 1.0000001, 0.75, 2.0 ** -30, 3.0 * 2.0 ** -20, 448.0, 1e-10 / 448])
    got = ref.pow2_ceil(values)
    want = torch.tensor([1.0, 2.0, 1.0, 2.0 ** -30, 2.0 ** -18, 512.0, 2.0 ** -42])
    assert torch.equal(got, want)


def test_reference_quantizer_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 128|% 128"):
        ref.quantize_fp8_reference(torch.zeros(2, 136, dtype=torch.bfloat16), "fp8_block128")
    with pytest.raises(ValueError, match="fp8 mode"):
        ref.quantize_fp8_reference(torch.zeros(2, 128, dtype=torch.bfloat16), "fp8")
