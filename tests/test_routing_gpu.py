"""GPU: the routing block -> per-local-expert row lists kernel against the reference."""
import pytest
import torch

from conftest import requires_extension, requires_gpu
from vllm_petit_moe.testing.reference import expert_row_lists_reference

pytestmark = [requires_gpu, requires_extension]


def _random_routing_block(num_rows, top_k, num_local, gen, invalid_fraction=0.5):
    ids = torch.randint(0, num_local, (num_rows, top_k), generator=gen, device="cuda",
                        dtype=torch.int32)
    drop = torch.rand(num_rows, top_k, generator=gen, device="cuda") < invalid_fraction
    return torch.where(drop, torch.full_like(ids, -1), ids)


def test_row_lists_bad_input():
    from vllm_petit_moe import _C
    ids = torch.zeros(4, 2, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="int32"):
        _C.expert_row_lists(ids, 4)
    with pytest.raises(RuntimeError, match="num_local_experts"):
        _C.expert_row_lists(ids.int(), 513)


@pytest.mark.parametrize("num_rows,top_k,num_local", [
    (1, 1, 1), (7, 3, 5), (64, 8, 128), (1000, 8, 32), (4096, 8, 128), (8192, 16, 512),
    (16384, 8, 8), (3, 2, 512), (128, 8, 64), (129, 8, 64)])  # the one-block bound
def test_row_lists_match_reference(num_rows, top_k, num_local):
    from vllm_petit_moe import _C
    gen = torch.Generator(device="cuda").manual_seed(num_rows * 131 + top_k)
    ids = _random_routing_block(num_rows, top_k, num_local, gen)
    counts, offsets, sorted_entries = _C.expert_row_lists(ids, num_local)
    ref_counts, ref_offsets, ref_sorted = expert_row_lists_reference(ids.cpu(), num_local)
    assert torch.equal(counts.cpu(), ref_counts)
    assert torch.equal(offsets.cpu(), ref_offsets)
    assert torch.equal(sorted_entries.cpu(), ref_sorted)


def test_row_lists_all_on_one_expert_and_empty():
    from vllm_petit_moe import _C
    ids = torch.full((3000, 4), -1, dtype=torch.int32, device="cuda")
    ids[:, 2] = 6
    counts, offsets, sorted_entries = _C.expert_row_lists(ids, 8)
    assert counts.tolist() == [0] * 6 + [3000, 0]
    assert offsets.tolist() == [0] * 7 + [3000, 3000]
    assert torch.equal(sorted_entries[:3000].cpu(), torch.arange(3000, dtype=torch.int32) * 4 + 2)
    assert bool((sorted_entries[3000:] == -1).all())
    empty = torch.full((5, 2), -1, dtype=torch.int32, device="cuda")
    counts, offsets, sorted_entries = _C.expert_row_lists(empty, 4)
    assert counts.tolist() == [0] * 4 and offsets.tolist() == [0] * 5
    assert sorted_entries.tolist() == [-1] * 10


def test_row_lists_poisoned_outputs_fully_written_under_graph():
    """Captured in a CUDA graph and replayed with fresh routing: no host sync inside."""
    from vllm_petit_moe import _C
    gen = torch.Generator(device="cuda").manual_seed(7)
    static_ids = _random_routing_block(512, 8, 16, gen)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _C.expert_row_lists(static_ids, 16)
    for _ in range(5):
        static_ids.copy_(_random_routing_block(512, 8, 16, gen))
        for t in outs:
            t.fill_(-12345)  # poison: every element must be rewritten by the replay
        graph.replay()
        ref = expert_row_lists_reference(static_ids.cpu(), 16)
        for got, want in zip(outs, ref):
            assert torch.equal(got.cpu(), want)
    torch.cuda.synchronize()
    del graph, outs




def _ep_expert_map(num_global, num_local, rank, gen):
    """vLLM's linear EP map for `rank`, then shuffled entries so ids are not just offsets."""
    expert_map = torch.full((num_global,), -1, dtype=torch.int32, device="cuda")
    owned = torch.randperm(num_global, generator=gen, device="cuda")[:num_local]
    expert_map[owned] = torch.randperm(num_local, generator=gen, device="cuda").int()
    return expert_map


@pytest.mark.parametrize("num_rows,top_k,num_global,num_local", [
    (1, 1, 2, 1), (37, 8, 256, 128), (4096, 8, 128, 64), (300, 16, 1024, 512)])
def test_row_lists_with_expert_map_equal_local_ids(num_rows, top_k, num_global, num_local):
    """Global ids + vLLM's expert_map give the row lists of the mapped local ids; global ids
    outside [0, E) (and -1) are skipped like -1."""
    from vllm_petit_moe import _C
    gen = torch.Generator(device="cuda").manual_seed(num_rows * 7 + num_global)
    expert_map = _ep_expert_map(num_global, num_local, rank=1, gen=gen)
    ids = torch.randint(-2, num_global + 3, (num_rows, top_k), generator=gen, device="cuda",
                        dtype=torch.int32)
    in_range = (ids >= 0) & (ids < num_global)
    local = torch.where(in_range, expert_map[ids.clamp(0, num_global - 1).long()], -1)
    got = _C.expert_row_lists(ids, num_local, expert_map=expert_map)
    want = expert_row_lists_reference(local.cpu(), num_local)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)
    with pytest.raises(RuntimeError, match="expert_map must be"):
        _C.expert_row_lists(ids, num_local, expert_map=expert_map.long())
