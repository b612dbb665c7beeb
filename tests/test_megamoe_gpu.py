"""GPU: the fused MoE layer (ops.megamoe_forward, csrc/experts/megamoe.cu) against a torch
reference and the composed path (ops.experts_forward) on real model shapes, under CUDA-graph
replays with fresh inputs, back-to-back layers on one stream, and its limits."""

import pytest
import torch

from conftest import requires_extension, requires_gpu

pytestmark = [requires_gpu, requires_extension]


def reference_moe(x, ids, weights, w13, w2, expert_map=None):
    """fp32 torch MoE with the kernels' roundings (act to bf16 once), any shapes."""
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    local = ids.long()
    if expert_map is not None:
        valid = (local >= 0) & (local < expert_map.numel())
        local = torch.where(valid, expert_map.long()[local.clamp(0, expert_map.numel() - 1)], -1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(local).tolist():
        if not 0 <= e < num_local:
            continue
        rows, slots = torch.nonzero(local == e, as_tuple=True)
        h = x[rows].float() @ w13[e].float().T
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(torch.bfloat16)
        y = act.float() @ w2[e].float().T
        out.index_add_(0, rows, y * weights[rows, slots, None])
    return out


def make_case(num_rows, top_k, hidden, inter, num_local, *, seed, device="cuda",
              num_global=None, invalid=0.1):
    g = torch.Generator(device=device).manual_seed(seed)
    num_ids = num_global or num_local
    x = torch.randn(num_rows, hidden, generator=g, device=device).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_ids, generator=g, device=device)[:top_k]
                       for _ in range(num_rows)]).to(torch.int32) if num_rows else \
        torch.empty(0, top_k, dtype=torch.int32, device=device)
    ids[torch.rand(ids.shape, generator=g, device=device) < invalid] = -1
    w = torch.rand(num_rows, top_k, generator=g, device=device)
    w13 = (torch.randn(num_local, 2 * inter, hidden, generator=g, device=device)
           / hidden**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_local, hidden, inter, generator=g, device=device)
          / inter**0.5).to(torch.bfloat16)
    return x, ids, w, w13, w2


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("num_rows", [1, 2, 3, 8, 33, 256])
@pytest.mark.parametrize("shape", ["qwen3", "odd"])
def test_matches_reference_and_composed(num_rows, shape):
    from vllm_petit_moe import ops

    hidden, inter, num_local, top_k = {"qwen3": (2048, 768, 128, 8),
                                       "odd": (448, 192, 7, 3)}[shape]
    case = make_case(num_rows, top_k, hidden, inter, num_local, seed=num_rows)
    out = torch.full((num_rows, hidden), float("nan"), device="cuda").to(torch.bfloat16)
    ops.megamoe_forward(*case, out=out)
    ref = reference_moe(*case)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 4e-3
    composed = ops.experts_forward(*case)
    assert rel_err(out, composed.float()) < 8e-3


def test_expert_map_deepseek_share():
    """DeepSeek-V3's EP8 share: 256 global ids, 32 local experts through vLLM's expert_map."""
    from vllm_petit_moe import ops

    expert_map = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    expert_map[64:96] = torch.arange(32, dtype=torch.int32, device="cuda")
    case = make_case(64, 8, 7168, 2048, 32, seed=7, num_global=256, invalid=0.0)
    out = ops.megamoe_forward(*case, expert_map=expert_map)
    assert rel_err(out, reference_moe(*case, expert_map=expert_map)) < 4e-3


def captured(forward):
    """``forward`` run once eagerly on a side stream, then captured in a CUDA graph there."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        forward()
    return graph


def replay_with_fresh_inputs(graph, x, ids, w, out, eager, replays, seed):
    """``replays`` replays of ``graph`` with fresh x, ids (-1 .. 127) and weights copied in and
    ``out`` poisoned first, each bit-equal to ``eager()``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(replays):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        ids.copy_(torch.randint(-1, 128, ids.shape, generator=g, device="cuda"))
        w.copy_(torch.rand(w.shape, generator=g, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out.view(torch.int16), eager().view(torch.int16))


def test_graph_replays_fresh_inputs_back_to_back():
    """Two layers back to back in one graph, 101 replays with fresh inputs copied in: every
    replay bit-equal to an eager call (the kernel is deterministic) and the counters zero."""
    from vllm_petit_moe import ops

    layers = [make_case(16, 8, 2048, 768, 128, seed=s) for s in (1, 2)]
    x, ids, w = (t.clone() for t in layers[0][:3])
    mid = torch.empty_like(x)
    out = torch.empty_like(x)

    def forward():
        ops.megamoe_forward(x, ids, w, *layers[0][3:], out=mid)
        ops.megamoe_forward(mid, ids, w, *layers[1][3:], out=out)

    def eager():
        return ops.megamoe_forward(ops.megamoe_forward(x, ids, w, *layers[0][3:]), ids, w,
                                   *layers[1][3:])

    replay_with_fresh_inputs(captured(forward), x, ids, w, out, eager, 101, seed=3)
    torch.cuda.synchronize()
    assert int(ops._megamoe_sync_buffer(x.device, 128, 2048).abs().sum()) == 0


def test_limits_raise():
    from vllm_petit_moe import ops

    case = make_case(257, 8, 2048, 768, 16, seed=1)
    with pytest.raises(ValueError, match="MEGAMOE_MAX_ENTRIES"):
        ops.megamoe_forward(*case)
    case = make_case(2, 2, 2080, 768, 4, seed=1)
    with pytest.raises(ValueError, match="multiples of 64"):
        ops.megamoe_forward(*case)
    case = make_case(2, 2, 2048, 768, 4, seed=1)
    with pytest.raises(ValueError, match="timeout_s"):
        ops.megamoe_forward(*case, timeout_s=0)


def make_fp8_case(num_rows, top_k, hidden, inter, num_local, *, seed, **kwargs):
    """A case with block-fp8 weights as a checkpoint holds them (e4m3 + fp32 scale per 128 x 128
    block; blocks' magnitudes spread over ~e^+-4, so a wrong block's scale shows): (x, ids, w,
    w13 e4m3, w2 e4m3), (w13_scale, w2_scale), the dequantized (w13, w2) in float32."""
    from vllm_petit_moe.testing.reference import block_fp8_quantize

    x, ids, w, w13, w2 = make_case(num_rows, top_k, hidden, inter, num_local, seed=seed,
                                   **kwargs)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    gains = torch.exp(torch.randn(num_local, 2 * inter // 128, 1, hidden // 128, 1,
                                  generator=g, device="cuda"))
    w13 = (w13.float().view(num_local, 2 * inter // 128, 128, hidden // 128, 128)
           * gains).view(num_local, 2 * inter, hidden)
    q13, s13, d13 = block_fp8_quantize(w13)
    q2, s2, d2 = block_fp8_quantize(w2)
    return (x, ids, w, q13, q2), (s13, s2), (d13, d2)


@pytest.mark.parametrize("num_rows", [1, 2, 8, 33])
@pytest.mark.parametrize("shape", ["qwen3", "qwen3-235b", "deepseek-share"])
def test_fp8_weights_match_dequantized_reference(num_rows, shape):
    """Block-fp8 weights used in place: the fp32 reference on the dequantized weights, within
    the bf16 output's rounding (the kernel's products are exact, its sums fp32)."""
    from vllm_petit_moe import ops

    hidden, inter, num_local, top_k = {"qwen3": (2048, 768, 128, 8),
                                       "qwen3-235b": (4096, 1536, 128, 8),
                                       "deepseek-share": (7168, 2048, 32, 8)}[shape]
    case, (s13, s2), deq = make_fp8_case(num_rows, top_k, hidden, inter, num_local,
                                         seed=num_rows)
    out = torch.full((num_rows, hidden), float("nan"), device="cuda").to(torch.bfloat16)
    ops.megamoe_forward(*case, out=out, w13_scale=s13, w2_scale=s2)
    assert not out.isnan().any()
    assert rel_err(out, reference_moe(*case[:3], *deq)) < 4e-3


def test_fp8_every_e4m3_code_widens_exactly():
    """Weights drawn from every finite e4m3 code (subnormals, zeros, both signs), and a layer
    whose weights are all subnormal codes (a flush to zero would leave out = 0): the fp32
    reference on the dequantized weights."""
    from vllm_petit_moe import ops

    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    subnormal = torch.tensor([c for c in range(256) if (c & 0x78) == 0 and c & 7],
                             dtype=torch.uint8)
    hidden, inter, num_local, top_k = 256, 256, 4, 2
    g = torch.Generator().manual_seed(5)
    for table in (codes, subnormal):
        x, ids, w, _, _ = make_case(6, top_k, hidden, inter, num_local, seed=9, invalid=0.0)
        w13 = table[torch.randint(0, table.numel(), (num_local, 2 * inter, hidden), generator=g)]
        w2 = table[torch.randint(0, table.numel(), (num_local, hidden, inter), generator=g)]
        w13, w2 = (t.view(torch.float8_e4m3fn).cuda() for t in (w13, w2))
        s13 = torch.rand(num_local, 2 * inter // 128, hidden // 128, generator=g).cuda() + 0.5
        s2 = torch.rand(num_local, hidden // 128, inter // 128, generator=g).cuda() + 0.5
        if table is subnormal:
            s13, s2 = s13 * 256, s2 * 64  # dequantized weights of O(1)
        deq = [(q.float().view(q.shape[0], q.shape[1] // 128, 128, q.shape[2] // 128, 128)
                * s[:, :, None, :, None]).view(q.shape) for q, s in ((w13, s13), (w2, s2))]
        out = ops.megamoe_forward(x, ids, w, w13, w2, w13_scale=s13, w2_scale=s2)
        ref = reference_moe(x, ids, w, *deq)
        assert ref.abs().max() > 0
        assert rel_err(out, ref) < 4e-3


def test_fp8_graph_replays_equal_eager():
    """fp8 weights in a CUDA graph, 31 replays with fresh inputs: bit-equal to eager calls."""
    from vllm_petit_moe import ops

    case, (s13, s2), _ = make_fp8_case(4, 8, 2048, 768, 128, seed=11)
    x, ids, w = (t.clone() for t in case[:3])
    out = torch.empty_like(x)
    graph = captured(lambda: ops.megamoe_forward(x, ids, w, *case[3:], out=out, w13_scale=s13,
                                                 w2_scale=s2))
    replay_with_fresh_inputs(
        graph, x, ids, w, out,
        lambda: ops.megamoe_forward(x, ids, w, *case[3:], w13_scale=s13, w2_scale=s2), 31,
        seed=12)


def test_fp8_limits_raise():
    from vllm_petit_moe import ops

    case, (s13, s2), _ = make_fp8_case(2, 2, 256, 128, 2, seed=1)
    with pytest.raises(ValueError, match="w2_scale"):
        ops.megamoe_forward(*case, w13_scale=s13)
    with pytest.raises(ValueError, match="w13_scale"):
        ops.megamoe_forward(*case, w13_scale=s13[:, :1], w2_scale=s2)
    x, ids, w, w13, w2 = make_case(2, 2, 192, 128, 2, seed=1)
    with pytest.raises(ValueError, match="scale block"):
        ops.megamoe_forward(x, ids, w, w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="float8_e4m3fn weights"):
        ops.megamoe_forward(*make_case(2, 2, 256, 128, 2, seed=1), w13_scale=s13, w2_scale=s2)
