"""CPU: what the GPU soak (tools/soak.py) runs and what its results say.

The round schedule (testing.soak.plan_round / soak_round) covers what vLLM runs: int32 and
int64 ids, a bf16 and every fp8 dispatch wire, the composed and the fused paths, fp8 weights
in the one-GPU fused op and in the fused EP layer; the soak's loop (soak_rank, one rank on the CPU with the buffer and
the kernels' launches replaced by the torch reference) builds its buffers with
validate_ids=False, never calls a barrier, sends the planned wire and ids and checks what came
back; the results row says the GPU model, the physical GPUs and the ranks, and so do the file
names of the soak and of the other benchmarks. The soak itself needs GPUs
(tests/test_soak_gpu.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from script_module import load_script, script_help
from vllm_petit_moe.limits import FP8_QUANT_MODES, FP8_SCALE_BLOCK
from vllm_petit_moe.testing import bench_env
from vllm_petit_moe.testing import reference as ref
from vllm_petit_moe.testing.soak import (
    FP8_WEIGHT_PATHS, ID_DTYPES, PATHS, SHAPES, WIRES, RankReference, plan_round, schedule_mix,
    soak_results_name, soak_round, soak_row, wire_rows)

ROOT = Path(__file__).resolve().parent.parent
GOOD, ODD = (1024, 256, 8, 32), (136, 64, 2, 16)  # every path and wire / composed and per-token
EP_PATHS = ("composed", "megamoe", "fused", "fused_fp8")  # the rounds that run EpBuffer
DISPATCH_PATHS = ("composed", "megamoe")  # the rounds that run EpBuffer.dispatch


def test_rotation_reaches_every_path_wire_and_id_dtype():
    """Seeds rotate path (seed % 5), wire (seed // 5 % 4) and ids (seed // 20 % 2): 40 seeds
    hold every combination on a shape that takes them all; a shape that does not falls back
    (composed, fp8_per_token), the fused layers and the one-GPU op take bf16 rows, the one-GPU
    op int32 ids; a fixed choice overrides the rotation."""
    assert GOOD in SHAPES and ODD in SHAPES
    assert set(WIRES) == {"bf16", *FP8_QUANT_MODES} and set(ID_DTYPES) == {torch.int32,
                                                                         torch.int64}
    plans = [plan_round(seed, GOOD, 2, 64) for seed in range(40)]
    assert [p.path for p in plans[:5]] == list(PATHS)
    assert {(p.path, p.wire, p.id_dtype) for p in plans if p.path in DISPATCH_PATHS} == {
        (path, wire, ids) for path in DISPATCH_PATHS for wire in WIRES for ids in ID_DTYPES}
    for fused, weights in (("fused", "bf16"), ("fused_fp8", "fp8")):
        assert {(p.wire, p.id_dtype, p.weights) for p in plans if p.path == fused} == {
            ("bf16", torch.int32, weights), ("bf16", torch.int64, weights)}
    assert {(p.wire, p.id_dtype, p.weights) for p in plans if p.path == "megamoe_w1_fp8"} == {
        ("bf16", torch.int32, "fp8")}
    assert {p.weights for p in plans if p.path not in FP8_WEIGHT_PATHS} == {"bf16"}
    assert [p.quant for p in plans[0:20:5]] == [None, *WIRES[1:]]
    odd = [plan_round(seed, ODD, 2, 8) for seed in range(40)]
    assert {p.path for p in odd} == {"composed"}  # H 136, I 64: no fused kernel
    assert {p.wire for p in odd} == {"bf16", "fp8_per_token"}  # H 136: no 1x128 blocks
    assert plan_round(2, GOOD, 4, 64).path == "fused"
    assert plan_round(4, GOOD, 4, 64).path == "fused_fp8"
    assert plan_round(4, (1024, 192, 8, 32), 2, 8).path == "composed"  # I 192: no fp8 blocks
    assert plan_round(2, GOOD, 4, 65).path == "composed"  # 4 x 65 x 8 > 2048 entries
    fixed = plan_round(5, GOOD, 2, 64, path="megamoe", wire="fp8_block128_ue8m0", ids="int64")
    assert (fixed.path, fixed.quant, fixed.ids) == ("megamoe", "fp8_block128_ue8m0", "int64")
    for bad in (dict(path="triton"), dict(wire="fp8"), dict(ids="int16")):
        with pytest.raises(ValueError):
            plan_round(0, GOOD, 2, 64, **bad)


@pytest.mark.parametrize("world", [2, 4])
def test_schedule_of_a_run_mixes_what_vllm_runs(world):
    """The first 256 rounds of a soak (tools/soak.py's MAX_TOKENS, random shapes and token
    counts): int32 and int64 ids on every EP path, every wire on dispatch's paths, fused
    rounds, fp8 weights on shapes whose H and I take 128 x 128 blocks; schedule_mix counts
    each round once per dimension."""
    soak = load_script("tools/soak.py")
    rounds = [soak_round(seed, world, soak.MAX_TOKENS) for seed in range(256)]
    plans = [plan for _, plan, _ in rounds]
    for rd, plan, stride in rounds:
        assert {t.dtype for t in rd.topk_ids} == {plan.id_dtype}
        assert stride == max(max(rd.tokens), 1)
        if plan.path in FP8_WEIGHT_PATHS:
            hidden, inter, _, _ = rd.shape
            assert hidden % FP8_SCALE_BLOCK == 0 and inter % FP8_SCALE_BLOCK == 0
        if plan.wire in ("fp8_block128", "fp8_block128_ue8m0"):
            assert rd.shape[0] % FP8_SCALE_BLOCK == 0
    seen = {(p.path, p.wire, p.ids) for p in plans}
    for path in EP_PATHS:
        assert {(path, "int32"), (path, "int64")} <= {(pa, ids) for pa, _, ids in seen}, path
    for path in DISPATCH_PATHS:
        assert {w for pa, w, _ in seen if pa == path} == set(WIRES), path
    mix = schedule_mix(plans)
    assert mix["rounds_megamoe_w1_fp8"] + mix["rounds_fused_fp8"] == mix["rounds_weights_fp8"]
    assert mix["rounds_megamoe_w1_fp8"] > 0 and mix["rounds_fused_fp8"] > 0
    assert min(mix[f"rounds_{p}"] for p in PATHS) > 0
    for prefix in ("rounds_wire_", "rounds_ids_", "rounds_weights_"):
        assert sum(v for k, v in mix.items() if k.startswith(prefix)) == len(plans), prefix
    assert sum(mix[f"rounds_{p}"] for p in PATHS) == len(plans)


def test_a_round_replays_from_its_seed_whatever_the_ids():
    """Round S is the same whether a run starts at 0 or at S (`--seed S --rounds 1`), and a
    fixed --ids draws the same values as the rotation, only in the other dtype."""
    rd, plan, stride = soak_round(21, 2, 96)
    again, plan_again, stride_again = soak_round(21, 2, 96)
    other, plan_other, _ = soak_round(21, 2, 96, ids="int32" if plan.ids == "int64" else "int64")
    assert (plan_again, stride_again) == (plan, stride)
    assert plan_other.id_dtype != plan.id_dtype and plan_other.path == plan.path
    for a, b, c in zip(rd.topk_ids, again.topk_ids, other.topk_ids):
        assert torch.equal(a, b) and torch.equal(a.long(), c.long()) and c.dtype != a.dtype
    assert all(torch.equal(a, b) for a, b in zip(rd.xs, other.xs))


def test_wire_rows_are_the_dequantized_fp8_rows():
    """What the reference gives the experts after an fp8 wire: dispatch's quantization,
    dequantized, rounded to bf16 once; the bf16 wire passes x through."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert wire_rows(x, None) is x
    for mode in FP8_QUANT_MODES:
        q, scales = ref.quantize_fp8_reference(x, mode)
        got = wire_rows(x, mode)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, ref.dequantize_fp8_reference(q, scales).bfloat16())
        assert 0 < (got.float() - x.float()).abs().max() < 0.1 * x.float().abs().max()


# ------------------------------------------------------------------------------------------
# soak_rank on the CPU: one rank, the buffer and the kernels' launches replaced by the torch
# reference (the ops' own Python checks still run), so the loop's plumbing is what is tested
# ------------------------------------------------------------------------------------------

class ReferenceBuffer:
    """EpBuffer at W=1 on the reference: dispatch copies the rows into a region of R rows
    (quantized at the source with an fp8 `quant`), combine returns the first T rows, megamoe
    is the two composed (on block-fp8 weights: the dequantized ones, read by `kernels`' loader).
    Records every call's (what, quant, ids dtype)."""

    def __init__(self, calls, wrong_wire, kernels, **config):
        self.calls, self.wrong_wire, self.kernels, self.config = calls, wrong_wire, kernels, config

    def dispatch(self, x, topk_ids, topk_weights, region_stride=None, quant=None):
        assert topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.dtype == torch.float32
        self.calls.append(("dispatch", quant, topk_ids.dtype))
        (num_tokens, hidden), top_k = x.shape, topk_ids.shape[1]
        rows = torch.zeros(region_stride, hidden, dtype=torch.bfloat16)
        rows[:num_tokens] = x
        ids = torch.full((region_stride, top_k), -1, dtype=torch.int32)
        ids[:num_tokens] = topk_ids.to(torch.int32)  # W=1: the global ids are the local ones
        weights = torch.zeros(region_stride, top_k)
        weights[:num_tokens] = topk_weights
        scales = None
        if quant is not None:  # wrong_wire: a broken dispatch that quantizes in another mode
            rows, scales = ref.quantize_fp8_reference(rows, self.wrong_wire.get(quant, quant))
        return SimpleNamespace(recv_x=rows, recv_topk_ids=ids, recv_topk_weights=weights,
                               recv_x_scales=scales, handle=num_tokens)

    def combine(self, expert_out, handle, out=None):
        y = expert_out[:handle]
        return y.clone() if out is None else out.copy_(y)

    def megamoe(self, x, topk_ids, topk_weights, w13, w2, region_stride=None, out=None,
                w13_scale=None, w2_scale=None):
        fp8 = w13.dtype == torch.float8_e4m3fn
        assert fp8 == (w13_scale is not None) == (w2_scale is not None)
        self.calls.append(("fused_fp8" if fp8 else "fused", None, topk_ids.dtype))
        if fp8:
            reference = RankReference(self.kernels.dequantize(w13, w13_scale),
                                      self.kernels.dequantize(w2, w2_scale), 1)
            y = reference(x, topk_ids, topk_weights, "kernel")
        else:
            y = ref.experts_reference(x, topk_ids.to(torch.int32), topk_weights, w13, w2)
        return y if out is None else out.copy_(y)


class ReferenceKernels:
    """The extension's experts_forward / megamoe_forward launches on the reference
    (`one_scale`: a broken fp8 loader that reads every block with its expert's first scale)."""

    def __init__(self, calls, one_scale=False):
        self.calls, self.one_scale = calls, one_scale

    def experts_forward(self, x, topk_ids, topk_weights, w13, w2, *, out=None, **_):
        self.calls.append(("experts", None, topk_ids.dtype))
        y = ref.experts_reference(x, topk_ids, topk_weights, w13, w2)
        return y if out is None else out.copy_(y)

    def dequantize(self, q, s):
        """The fp8 loader: e4m3 weights times their blocks' scales (`one_scale`: the first)."""
        if self.one_scale:
            s = s[:, :1, :1].expand_as(s)
        return q.float() * s.repeat_interleave(FP8_SCALE_BLOCK, 1).repeat_interleave(
            FP8_SCALE_BLOCK, 2)

    def megamoe_forward(self, x, topk_ids, topk_weights, w13, w2, out, *_, w13_scale=None,
                        w2_scale=None, **__):
        fp8 = w13.dtype == torch.float8_e4m3fn
        self.calls.append(("megamoe_fp8" if fp8 else "megamoe", None, topk_ids.dtype))
        if fp8:
            reference = RankReference(self.dequantize(w13, w13_scale),
                                      self.dequantize(w2, w2_scale), 1)
            out.copy_(reference(x, topk_ids, topk_weights, "kernel"))
        else:
            out.copy_(ref.experts_reference(x, topk_ids, topk_weights, w13, w2))


def _run_soak_rank(monkeypatch, rounds, wrong_wire=None, one_scale=False):
    """soak_rank of tools/soak.py on the CPU at W=1 (tokens <= 8): (stats, buffer configs,
    calls)."""
    from vllm_petit_moe import ops
    from vllm_petit_moe.testing import rank_pool
    soak = load_script("tools/soak.py")
    calls, configs = [], []
    kernels = ReferenceKernels(calls, one_scale)

    def get_buffer(state, **config):
        configs.append(config)
        return ReferenceBuffer(calls, wrong_wire or {}, kernels, **config)

    def no_barrier(*args, **kwargs):
        raise AssertionError("the soak called a barrier between rounds")

    monkeypatch.setattr(soak, "MAX_TOKENS", 8)
    monkeypatch.setattr(rank_pool, "get_buffer", get_buffer)
    monkeypatch.setattr(ops, "_ops", lambda: kernels)
    monkeypatch.setattr(ops, "_megamoe_sync_buffer", lambda *args: torch.zeros(1))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.distributed, "barrier", no_barrier)
    monkeypatch.setattr(torch.distributed, "all_reduce", no_barrier)
    state = dict(rank=0, world_size=1, device=torch.device("cpu"), group=None)
    stats = soak.soak_rank(state, rounds, 0, 0, 0)
    return stats, configs, calls


def test_soak_rank_runs_the_layer_as_the_glue_does(monkeypatch):
    """80 rounds (every combination of the rotation, twice: a shape without a fused kernel
    turns a round composed): buffers with validate_ids=False (as
    vllm_glue/buffer_cache.py builds them), no barrier, every wire sent to dispatch with int32
    and int64 ids, the fused layer on bf16 and on fp8 weights, the one-GPU op with fp8 weights
    and int32 ids; every round matches the reference and the counts add up."""
    stats, configs, calls = _run_soak_rank(monkeypatch, 80)
    assert configs and all(c["validate_ids"] is False for c in configs)
    assert len(configs) == len(SHAPES)
    assert stats["rounds"] == 80 and stats["mismatches"] == 0, stats
    assert {(quant, dtype) for what, quant, dtype in calls if what == "dispatch"} == {
        (quant, dtype) for quant in (None, *FP8_QUANT_MODES) for dtype in ID_DTYPES}
    assert {dtype for what, _, dtype in calls if what == "fused"} == set(ID_DTYPES)
    assert {dtype for what, _, dtype in calls if what == "fused_fp8"} == set(ID_DTYPES)
    assert {dtype for what, _, dtype in calls if what == "megamoe_fp8"} == {torch.int32}
    assert {"experts", "megamoe", "megamoe_fp8"} <= {what for what, _, _ in calls}
    mix = stats["mix"]
    assert mix == schedule_mix(soak_round(seed, 1, 8)[1] for seed in range(80))
    assert min(mix[f"rounds_{p}"] for p in PATHS) > 0 and mix["rounds_ids_int64"] > 0
    assert min(mix[f"rounds_wire_{w}"] for w in WIRES) > 0 and mix["rounds_weights_fp8"] > 0


def test_soak_rank_sees_a_wire_in_the_wrong_mode(monkeypatch):
    """A dispatch that quantizes fp8_block128_ue8m0 rounds with fp8_block128's scales (not
    power-of-two) leaves the reference's tolerance in those rounds only: the check compares
    with the rows of the wire asked for."""
    stats, _, _ = _run_soak_rank(monkeypatch, 40,
                                 wrong_wire={"fp8_block128_ue8m0": "fp8_block128"})
    assert 0 < stats["mismatches"] <= stats["mix"]["rounds_wire_fp8_block128_ue8m0"], stats
    assert stats["first_mismatch"]["wire"] == "fp8_block128_ue8m0", stats


def test_soak_rank_sees_fp8_weights_read_with_the_wrong_scales(monkeypatch):
    """The fp8 weights' blocks have gains of their own (testing.soak.fp8_expert_weights), so
    a kernel that scales every block by one block's scale fails the fp8-weight rounds (the
    one-GPU op and the fused EP layer), and only those."""
    stats, _, _ = _run_soak_rank(monkeypatch, 40, one_scale=True)
    assert 0 < stats["mismatches"] <= stats["mix"]["rounds_weights_fp8"], stats
    assert stats["first_mismatch"]["path"] in FP8_WEIGHT_PATHS, stats


def test_fp8_expert_weights_are_a_block_fp8_checkpoint():
    from vllm_petit_moe.testing.soak import fp8_expert_weights
    shape = (256, 128, 4, 8)
    q13, s13, q2, s2, d13, d2 = fp8_expert_weights(shape)
    assert (q13.dtype, q2.dtype, s13.dtype, s2.dtype) == (torch.float8_e4m3fn,) * 2 + (
        torch.float32,) * 2
    assert tuple(q13.shape) == (8, 256, 256) and tuple(s13.shape) == (8, 2, 2)
    assert tuple(q2.shape) == (8, 256, 128) and tuple(s2.shape) == (8, 2, 1)
    for q, scale, deq in ((q13, s13, d13), (q2, s2, d2)):
        expand = scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
        assert torch.equal(deq, q.float() * expand)
    assert s13.max() / s13.min() > 4  # the blocks' gains spread their scales


# ------------------------------------------------------------------------------------------
# rows and file names
# ------------------------------------------------------------------------------------------

def test_soak_row_says_what_ran():
    """soak_row: gpu, gpus, ranks (and num_gpus, world: the older rows' names), the glue's
    settings, the rotation asked for, rounds per path / wire / ids / weights summed over the
    ranks, the first mismatch; the file name carries the GPU model, GPUs and ranks."""
    def rank(rounds, seeds, bad=None):
        return dict(rounds=rounds, mix=schedule_mix(soak_round(s, 2, 8)[1] for s in seeds),
                    graph_replays=5, mismatches=int(bad is not None), max_rel_err=0.01,
                    first_mismatch=bad)
    per_rank = [rank(32, range(32)), rank(32, range(32), dict(seed=3, path="fused"))]
    row = soak_row(per_rank, gpu="H100-80GB-HBM3", num_gpus=1, seed=0, rounds_asked=40,
                   path="alternate", wire="alternate", ids="alternate", commit="abc1234",
                   date="2026-12-04T00:00:00Z", seconds=12.34)
    assert list(row)[:5] == ["gpu", "gpus", "ranks", "num_gpus", "world"]
    assert (row["gpus"], row["ranks"], row["num_gpus"], row["world"]) == (1, 2, 1, 2)
    assert row["validate_ids"] is False and row["round_barrier"] is False
    assert (row["rounds"], row["rounds_per_rank"], row["rounds_asked"]) == (64, 32, 40)
    one = schedule_mix(soak_round(s, 2, 8)[1] for s in range(32))
    assert all(row[key] == 2 * one[key] for key in one)
    assert (row["mismatches"], row["graph_replays"], row["seconds"]) == (1, 10, 12.3)
    assert row["first_mismatch"] == dict(seed=3, path="fused")
    json.dumps(row)  # a JSON line
    assert soak_results_name("H100", 1, 2) == "soak_H100_1gpu_2ranks"
    assert soak_results_name(row["gpu"], row["gpus"], row["ranks"]) == \
        "soak_H100-80GB-HBM3_1gpu_2ranks"


def test_results_names_and_stamps_say_the_physical_gpus(monkeypatch):
    """bench_env.results_name: <bench>_<gpu>_<G>gpu[_<R>ranks]<suffix>; device_stamp leads
    with gpu, world, num_gpus (1 for a one-GPU tool, whatever world it models)."""
    assert bench_env.results_name("dispatch_combine", "H200", 2) == "dispatch_combine_H200_2gpu"
    assert bench_env.results_name("experts", "H200", 1) == "experts_H200_1gpu"
    assert bench_env.results_name("tpot_gsm8k", "H200", 2, suffix="_fp8") == \
        "tpot_gsm8k_H200_2gpu_fp8"
    assert bench_env.results_name("soak", "H200", 1, 4) == "soak_H200_1gpu_4ranks"
    for bad in ((0, None), (1, 0)):
        with pytest.raises(ValueError):
            bench_env.results_name("soak", "H200", *bad)
    assert bench_env.short_gpu_name("NVIDIA H100 80GB HBM3") == "H100-80GB-HBM3"
    assert bench_env.short_gpu_name("NVIDIA H200") == "H200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    stamp = bench_env.device_stamp(ROOT, 2)
    assert list(stamp)[:3] == ["gpu", "world", "num_gpus"]
    assert (stamp["gpu"], stamp["world"], stamp["num_gpus"]) == ("H200", 2, 1)
    assert bench_env.device_stamp(ROOT, 2, num_gpus=2)["num_gpus"] == 2


RESULTS_NAME = re.compile(r"^[a-z0-9_]+?_[A-Za-z0-9-]+_(?P<gpus>\d+)gpu(_(?P<ranks>\d+)ranks)?"
                          r"(_[A-Za-z0-9_.-]+)?\.(jsonl|json|png)$")


def test_committed_results_are_named_by_physical_gpus_and_the_readme_links_them():
    """Every GPU results file in examples/results says its GPU count (soak files their ranks
    too), rows written since num_gpus agree with the name, and the README's links to
    results files resolve."""
    results = ROOT / "examples" / "results"
    gpu_files = [p for p in results.iterdir() if "_cpu" not in p.name]
    assert gpu_files
    for path in gpu_files:
        match = RESULTS_NAME.match(path.name)
        assert match, f"{path.name}: not <bench>_<gpu>_<G>gpu[_<R>ranks]"
        assert path.name.startswith("soak_") == (match["ranks"] is not None), path.name
        if path.suffix != ".jsonl":
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "num_gpus" in row:
                assert row["num_gpus"] == int(match["gpus"]), path.name
            if match["ranks"]:
                assert row["world"] == int(match["ranks"]), path.name
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((examples/results/[^)]+)\)", readme)
    assert links and all((ROOT / link).is_file() for link in links), links


def test_soak_help_shows_the_defaults():
    text = " ".join(script_help("tools/soak.py").split())
    for option in ("--ranks RANKS, --world RANKS", "--path", "--wire", "--ids"):
        assert option in text
    assert "rounds per rank (default: 10000)" in text
    assert "(default: alternate)" in text and "(default: 250)" in text
