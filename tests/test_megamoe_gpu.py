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

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        forward()
    g = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(101):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        ids.copy_(torch.randint(-1, 128, ids.shape, generator=g, device="cuda"))
        w.copy_(torch.rand(w.shape, generator=g, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        expect = ops.megamoe_forward(ops.megamoe_forward(x, ids, w, *layers[0][3:]), ids, w,
                                     *layers[1][3:])
        assert torch.equal(out.view(torch.int16), expect.view(torch.int16))
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
