"""CPU emulation: the fused MoE layer kernel (csrc/experts/megamoe.cu) as the expert stage of
expert parallelism, on the dispatch layout: W ranks dispatch (csrc/comm/dispatch_combine.cu,
tests/emu/ep_emu.cpp), each rank runs MegaMoE over its W x R received rows (local expert ids,
-1 for slots routed elsewhere and for the padding rows past each source's tokens, whose bytes
are stale), and combine sums every token's W partial results at its source. The layer output
is checked against a dense float64 torch reference of the whole MoE, per source rank.

This is what the W >= 2 fused kernel must equal, and the form in which the fused kernel
already serves EP today: dispatch -> one MegaMoE launch -> combine (instead of row lists,
gate/up, down and the local reduction).
"""
import pytest
import torch

from conftest import build_emu_library
from test_dispatch_combine_emu_cpu import EmuEp, _inputs, _load
from test_megamoe_emu_cpu import reference_moe, run_emu

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 128, 64, 32


@pytest.fixture(scope="module")
def ep_lib(tmp_path_factory):
    return _load(build_emu_library(tmp_path_factory, "ep_emu"))


@pytest.fixture(scope="module")
def megamoe_lib(tmp_path_factory):
    return build_emu_library(tmp_path_factory, "megamoe_emu")


@pytest.mark.parametrize("world,tokens,top_k,skew", [
    (2, [16, 9], 4, None),          # unequal token counts: padding rows in rank 1's region
    (2, [0, 12], 8, None),          # a rank with no tokens
    (4, [7, 16, 1, 11], 4, "one_expert"),
    (4, [13, 5, 16, 3], 6, "hot_rank"),
])
def test_dispatch_megamoe_combine_is_the_moe_layer(ep_lib, megamoe_lib, world, tokens, top_k,
                                                   skew):
    region_stride = 16
    gen = torch.Generator().manual_seed(1000 + world * 10 + top_k)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen)
           / HIDDEN**0.5).to(torch.bfloat16)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen)
          / INTERMEDIATE**0.5).to(torch.bfloat16)
    local = NUM_EXPERTS // world
    ep = EmuEp(ep_lib, world, max_tokens=region_stride, hidden=HIDDEN, num_blocks=2)
    try:
        for round_ in range(2):  # a second round on the same buffers and counters
            xs, ids, ws = _inputs(77 + round_, tokens, HIDDEN, top_k, world, skew=skew,
                                  num_experts=NUM_EXPERTS)
            got = ep.dispatch(xs, ids, ws, region_stride)
            assert not isinstance(got, int), f"dispatch returned {got}"
            expert_outs = []
            for rank, (recv_x, recv_ids, recv_w, _, _) in enumerate(got):
                sl = slice(rank * local, (rank + 1) * local)
                rc, out, sync = run_emu(megamoe_lib, recv_x.contiguous(), recv_ids, recv_w,
                                        w13[sl].contiguous(), w2[sl].contiguous(), num_sms=1)
                assert rc == 0, f"rank {rank}: megamoe returned {rc}"
                assert int(sync.abs().sum()) == 0, "counters not reset"
                expert_outs.append(out)
            ys = ep.combine(expert_outs, tokens, top_k, region_stride)
            for src, (y, x, i, w) in enumerate(zip(ys, xs, ids, ws)):
                if x.shape[0] == 0:
                    continue
                want = reference_moe(x, i.to(torch.int32), w, w13, w2)
                assert not y.isnan().any(), f"round {round_}, rank {src}: output not written"
                err = ((y.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
                # bf16 rounding of the activations, of each rank's partial sum and of the output
                assert err < 6e-3, f"round {round_}, rank {src}: relative error {err}"
    finally:
        ep.close()
