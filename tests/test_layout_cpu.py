"""CPU tests of the symmetric-heap layout and the buffer configuration limits (the limit values
themselves against the headers and the extension: test_limits_cpu.py).

`vllm_petit_moe.buffer.heap_bytes` (Python, used for sizing and messages) must agree with
`csrc/common/layout.h make_heap_layout` (what the allocator and the kernels use), exposed as
`_C.heap_layout`. The compiled extension imports without a GPU (it resolves the CUDA driver at
run time), so these run on a CPU-only machine; they skip only when `_C` was not built.
The region shapes below are the table of docs/architecture.md ("Symmetric heap").
"""
from __future__ import annotations

import importlib.util

import pytest

from vllm_petit_moe import buffer

ALIGNMENT = 256
TOKEN_GROUP_SIZE = 32

# The construction order of layout.h: the layout *is* this order.
REGION_ORDER = ["dispatch_rows", "dispatch_ids", "dispatch_weights", "dispatch_scales",
                "combine_rows", "dispatch_flags", "combine_flags"]


def _extension():
    # find_spec only says whether the module file exists: a built but broken extension
    # (undefined symbol, wrong torch) must fail here, not skip.
    if importlib.util.find_spec("vllm_petit_moe._C") is None:
        pytest.skip("compiled extension vllm_petit_moe._C not built "
                    "(pip install --no-build-isolation -e .)")
    from vllm_petit_moe import _C
    return _C


def _region_bytes(world, max_tokens, hidden, top_k):
    """Unaligned size of every region, from docs/architecture.md."""
    rows = world * max_tokens
    groups = -(-max_tokens // TOKEN_GROUP_SIZE)
    chunks = max(1, TOKEN_GROUP_SIZE * (hidden // 8) // 2048)  # 32 KB send chunks of a group
    return {
        "dispatch_rows": rows * hidden * 2,      # [W, T_max, H] bf16
        "dispatch_ids": rows * top_k * 4,        # [W, T_max, K_max] int32
        "dispatch_weights": rows * top_k * 4,    # [W, T_max, K_max] f32
        "dispatch_scales": rows * -(-hidden // 128) * 4,  # [W, T_max, ceil(H/128)] f32
        "combine_rows": rows * hidden * 2,       # [W, T_max, H] bf16
        "dispatch_flags": world * groups * 8,    # [W, G_max] u64
        "combine_flags": world * groups * chunks * 8,  # [W, G_max, C_max] u64
    }


# (world, max_tokens, hidden, top_k): odd token counts, odd world sizes, hidden sizes whose
# rows are not 256-byte multiples, the limits, and a DeepSeek-V3-sized buffer (> 2 GiB).
CONFIGS = [
    (1, 1, 8, 1),
    (2, 1, 7168, 8),
    (2, 19, 104, 3),
    (3, 33, 1000, 5),
    (5, 31, 2048, 8),
    (7, 97, 8, 16),
    (8, 4097, 2056, 7),
    (32, 1, 8, 16),
    (32, 129, 4096, 16),
    (8, 8192, 7168, 16),
]


@pytest.mark.parametrize("world,max_tokens,hidden,top_k", CONFIGS)
def test_heap_layout_matches_python(world, max_tokens, hidden, top_k):
    _C = _extension()
    layout = _C.heap_layout(world, max_tokens, hidden, top_k)
    assert buffer.heap_bytes(world, max_tokens, hidden, top_k) == layout["total_bytes"]
    assert layout["max_groups"] == -(-max_tokens // TOKEN_GROUP_SIZE)
    assert layout["max_chunks"] == buffer.max_group_chunks(hidden)

    sizes = _region_bytes(world, max_tokens, hidden, top_k)
    end = 0
    for name in REGION_ORDER:
        offset = layout[name]
        assert offset % ALIGNMENT == 0, f"{name} at {offset} is not {ALIGNMENT}-byte aligned"
        assert offset >= end, f"{name} at {offset} overlaps the previous region (ends {end})"
        # Regions are packed: the next one starts at the aligned end of the previous one.
        assert offset == -(-end // ALIGNMENT) * ALIGNMENT, f"gap before {name}"
        end = offset + sizes[name]
    assert layout["total_bytes"] == -(-end // ALIGNMENT) * ALIGNMENT
    assert layout["total_bytes"] % ALIGNMENT == 0

    # The zeroed-at-creation range is exactly the two flag regions.
    assert layout["flags_begin"] == layout["dispatch_flags"]
    assert layout["flags_end"] == layout["total_bytes"]
    assert layout["combine_flags"] + sizes["combine_flags"] <= layout["flags_end"]


# --------------------------------------------------------------------------------------------
# validate_config: pure Python, no extension needed
# --------------------------------------------------------------------------------------------

VALID = dict(world_size=2, hidden_size=7168, num_experts=256, max_tokens_per_rank=4096,
             max_top_k=8)


@pytest.mark.parametrize("overrides", [
    {},
    dict(world_size=1, num_experts=1, hidden_size=8, max_tokens_per_rank=1, max_top_k=1),
    dict(world_size=32, num_experts=512, max_top_k=16),
    dict(world_size=3, num_experts=129, hidden_size=104, max_tokens_per_rank=19),
])
def test_validate_config_accepts(overrides):
    buffer.validate_config(**{**VALID, **overrides})


# Each bad configuration and a pattern the message must match: the parameter and its limit.
@pytest.mark.parametrize("overrides,pattern", [
    (dict(hidden_size=7170), r"(?i)hidden.*\b8\b"),
    (dict(hidden_size=100), r"(?i)hidden.*\b8\b"),
    (dict(world_size=3, num_experts=256), r"(?i)num_experts.*divisible.*\b3\b"),
    (dict(world_size=1, num_experts=513), r"(?i)num_experts.*512"),
    (dict(world_size=4, num_experts=1024), r"(?i)num_experts.*512"),
    (dict(max_top_k=17), r"(?i)top_?k.*16"),
    (dict(world_size=33, num_experts=33), r"(?i)world.*32"),
    (dict(world_size=64, num_experts=256), r"(?i)world.*32"),
    (dict(max_tokens_per_rank=0), r"(?i)max_tokens_per_rank.*1"),
    (dict(max_tokens_per_rank=-5), r"(?i)max_tokens_per_rank.*1"),
])
def test_validate_config_rejects(overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        buffer.validate_config(**{**VALID, **overrides})


# --------------------------------------------------------------------- combine launch plan
# _C.combine_plan runs the combine's host-side planning (csrc/comm/dispatch_combine.cu
# plan_combine: send chunks and senders, reduce chunks, static or claimed reduction, grid)
# without a GPU, with the default CombineConfig unless one is given.
def _combine_plan_ext():
    return _extension()


@pytest.mark.parametrize("tokens,num_blocks,expected", [
    # DeepSeek-V3 rows (hidden 7168: 896 vectors, 14 send chunks at most), 2 ranks.
    # 1 token: one send item, 7 reduce items of 128 vectors, each its own reduce-only block.
    (1, 132, dict(send_chunks=1, whole_pairs=0, send_blocks=1, reduce_chunks=7,
                  static_reduce=True, grid=8)),
    # 128 tokens: 4 groups of 14 send chunks; reduce items as fine as the send chunks.
    (128, 132, dict(send_chunks=14, whole_pairs=0, send_blocks=56, reduce_chunks=14,
                    static_reduce=True, grid=112)),
    # 4096 tokens: 128 group items on 64 senders (two equal rounds of the 99 allowed); the
    # tail split sends groups 0-63 whole and groups 64-127 in 4 chunks each (4 sub-rounds);
    # reduction cut into 7 chunks of 128 vectors, claimed by the whole grid.
    (4096, 132, dict(send_chunks=4, whole_pairs=64, send_blocks=64, reduce_chunks=7,
                     static_reduce=False, grid=132)),
    # 8192 tokens: 256 groups, three rounds of 86 senders; the last 86 groups split.
    (8192, 132, dict(send_chunks=4, whole_pairs=170, send_blocks=86, reduce_chunks=5,
                     static_reduce=False, grid=132)),
    # 24 SMs: 18 senders allowed, 8 rounds of 16, no tail split (too few senders); the
    # reduce chunking bounded at ~8 items per block (2 chunks, not 7: the 24-SM slowdown
    # fixed at 23c8603).
    (4096, 24, dict(send_chunks=1, whole_pairs=0, send_blocks=16, reduce_chunks=2,
                    static_reduce=False, grid=24)),
    # 16384 tokens: six rounds, no tail split.
    (16384, 132, dict(send_chunks=1, whole_pairs=0, send_blocks=86, reduce_chunks=3,
                      static_reduce=False, grid=132)),
    (16384, 24, dict(send_chunks=1, whole_pairs=0, send_blocks=18, reduce_chunks=1,
                     static_reduce=False, grid=24)),
])
def test_combine_plan_deepseek_v3(tokens, num_blocks, expected):
    ext = _combine_plan_ext()
    assert ext.combine_plan(2, 7168, tokens, tokens, num_blocks) == expected


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("hidden", [8, 2048, 4104, 7168])
def test_combine_plan_invariants(world, hidden):
    """Over many sizes: the send chunks fit the flag slots, the grid fits the SMs, reduce
    items are at least as fine as the send chunks, the reduce chunking stays within ~8 items
    per block once it goes beyond the send chunks, and a static reduction has a block per
    item."""
    ext = _combine_plan_ext()
    max_chunks = buffer.max_group_chunks(hidden)
    for num_blocks in (1, 2, 8, 24, 64, 132):
        for tokens in (0, 1, 7, 31, 32, 33, 128, 1000, 4096, 16384):
            for stride in {max(tokens, 1), max(tokens, 1) + 40}:
                plan = ext.combine_plan(world, hidden, tokens, stride, num_blocks)
                where = f"W={world} H={hidden} T={tokens} R={stride} blocks={num_blocks}: {plan}"
                assert 1 <= plan["send_chunks"] <= max(1, max_chunks), where
                assert 1 <= plan["grid"] <= num_blocks, where
                assert 0 <= plan["send_blocks"] <= plan["grid"], where
                assert plan["reduce_chunks"] >= plan["send_chunks"], where
                pairs = -(-stride // 32) * (world - 1)
                if plan["whole_pairs"]:  # the tail split: the last round's pairs in chunks
                    assert plan["send_blocks"] >= 48, where
                    assert pairs - plan["whole_pairs"] == plan["send_blocks"], where
                    assert plan["whole_pairs"] <= 2 * plan["send_blocks"], where  # <= 3 rounds
                groups = -(-tokens // 32)
                reduce_items = groups * plan["reduce_chunks"]
                if plan["reduce_chunks"] > plan["send_chunks"] and groups:
                    assert reduce_items <= 8 * num_blocks + groups, where
                if plan["static_reduce"]:
                    assert plan["grid"] - plan["send_blocks"] >= reduce_items, where


def test_combine_plan_rejects_bad_sizes():
    ext = _combine_plan_ext()
    with pytest.raises(RuntimeError, match="world size"):
        ext.combine_plan(1, 7168, 1, 1, 132)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ext.combine_plan(2, 7170, 1, 1, 132)
    with pytest.raises(RuntimeError, match="region_stride"):
        ext.combine_plan(2, 7168, 10, 5, 132)
    with pytest.raises(RuntimeError, match="reduce_pct"):
        ext.combine_plan(2, 7168, 10, 10, 132, combine_config=dict(reduce_pct=91))
    with pytest.raises(RuntimeError, match="has no field"):
        ext.combine_plan(2, 7168, 10, 10, 132, combine_config=dict(send_chunks=4))
    # the C API's message (plan_combine_sizes) as it is; sizes past 32 bits refused by name
    with pytest.raises(RuntimeError, match=r"petit_moe: need 0 <= num_tokens \(10\) <= "
                                           r"region_stride \(5\), region_stride >= 1"):
        ext.combine_plan(2, 7168, 10, 5, 132)
    with pytest.raises(RuntimeError, match="world size 4294967298 does not fit 32 bits"):
        ext.combine_plan(2**32 + 2, 7168, 1, 1, 132)


@pytest.mark.parametrize("config,tokens,num_blocks,expected", [
    # the bound off: the 128-vector chunking alone (7 reduce chunks on 24 SMs, the slowdown)
    (dict(reduce_items=0), 4096, 24, dict(send_chunks=1, reduce_chunks=7)),
    # reduce items as the send chunks (the tail split's 4)
    (dict(reduce_vectors=0), 4096, 132, dict(send_chunks=4, reduce_chunks=4)),
    # the tail split off, or as fine as the flag slots allow (14 for hidden 7168)
    (dict(tail_chunks=0), 4096, 132, dict(send_chunks=1, whole_pairs=0, send_blocks=64)),
    (dict(tail_chunks=99), 4096, 132,
     dict(send_chunks=14, whole_pairs=64, send_blocks=64, reduce_chunks=14)),
    (dict(reduce_pct=50), 4096, 132, dict(send_blocks=64)),  # 66 allowed
    # 53 allowed: 3 rounds of 43 senders, too few for the tail split
    (dict(reduce_pct=60), 4096, 132, dict(send_blocks=43, whole_pairs=0)),
])
def test_combine_plan_config(config, tokens, num_blocks, expected):
    """CombineConfig fields move the plan (no output bit depends on it)."""
    ext = _combine_plan_ext()
    plan = ext.combine_plan(2, 7168, tokens, tokens, num_blocks, combine_config=config)
    assert {k: plan[k] for k in expected} == expected, plan
