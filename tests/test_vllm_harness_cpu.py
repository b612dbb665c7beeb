"""CPU run of ``vllm_moe_harness`` (the real-vLLM DP + EP harness of test_vllm_moe_gpu.py) with
stand-ins for what needs a GPU, so its wiring is tested before any GPU time is spent.

Two spawned processes run the harness' own code against the real vLLM: ``init_vllm_dp_ep``
(vLLM's ``init_distributed_environment`` / ``initialize_model_parallel`` under a DP=2, EP
config; vLLM falls back from nccl to gloo), ``build_layer`` (vLLM's oracle, our hook, the
workspace reservation), ``MoELayer.forward`` (forward context, DP metadata, modular kernel) and
the rank functions of test_vllm_moe_gpu.py. Replaced, because they need a GPU:

- the EP group's device communicator (pynccl): ``CpuTestCommunicator`` below, vLLM's
  ``AgRsAll2AllManager`` over gloo all-gather / all-reduce;
- the experts' Triton GEMMs: ``fakes.ReferenceExperts`` (vLLM's experts contract,
  expert_map lookup included, on the reference);
- the ``EpBuffer``: ``fakes.FakeEpBuffer`` (the architecture.md layout from the
  reference; it is told every rank's inputs);
- the platform name seen by the hook ("cuda"), ``torch.cuda.set_device`` and the workspace
  device (CPU).

CUDA graphs and timing cannot run here. Skipped on machines with CUDA GPUs, where
test_vllm_moe_gpu.py runs the real thing.
"""
from __future__ import annotations

import traceback

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.distributed.device_communicators.base_device_communicator import (  # noqa: E402
    DeviceCommunicatorBase,
)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU stand-in run of the harness; with GPUs test_vllm_moe_gpu.py runs the real path")

SMALL = dict(hidden=64, intermediate=32, num_experts=8, top_k=3)


class CpuTestCommunicator(DeviceCommunicatorBase):
    """vLLM's CudaCommunicator for the EP group, on gloo: all-gather(v), reduce-scatter(v) and
    the all2all manager (vLLM's own AgRsAll2AllManager)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.use_all2all:
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

            self.all2all_manager = AgRsAll2AllManager(self.cpu_group)

    def all_gatherv(self, input_, dim=0, sizes=None):
        import torch.distributed as dist

        assert dim == 0

        def gather(t):
            sizes_ = sizes or [t.shape[0]] * self.world_size
            assert t.shape[0] == sizes_[self.rank_in_group]
            padded = torch.zeros((max(sizes_),) + tuple(t.shape[1:]), dtype=t.dtype)
            padded[: t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded, group=self.device_group)
            return torch.cat([p[:s] for p, s in zip(parts, sizes_)])

        return gather(input_) if isinstance(input_, torch.Tensor) else [gather(t) for t in input_]

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        import torch.distributed as dist

        assert dim == 0
        sizes_ = sizes or [input_.shape[0] // self.world_size] * self.world_size
        total = input_.float().clone()  # fp32 sum, rounded once: what the reference does
        dist.all_reduce(total, group=self.device_group)
        start = sum(sizes_[: self.rank_in_group])
        return total[start : start + sizes_[self.rank_in_group]].to(input_.dtype)

    def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False,
                 extra_tensors=None):
        return self.all2all_manager.dispatch(hidden_states, topk_weights, topk_ids,
                                             is_sequence_parallel, extra_tensors=extra_tensors)

    def combine(self, hidden_states, is_sequence_parallel=False):
        return self.all2all_manager.combine(hidden_states, is_sequence_parallel)


def _install_stand_ins(fake_buffers: list):
    import torch.distributed as dist
    import vllm.v1.worker.workspace as workspace
    from vllm.platforms import current_platform

    import fakes
    from vllm_petit_moe.testing import vllm_moe_harness as harness
    from vllm_petit_moe.vllm_glue import buffer_cache, compat

    torch.cuda.set_device = lambda *a, **k: None
    backend_available = dist.is_backend_available
    dist.is_backend_available = lambda b: b != "nccl" and backend_available(b)
    init_workspace = workspace.init_workspace_manager
    workspace.init_workspace_manager = lambda device, n=None: init_workspace(
        torch.device("cpu"), n)
    type(current_platform).get_device_communicator_cls = classmethod(
        lambda cls: f"{__name__}.CpuTestCommunicator")
    make_config = harness.make_vllm_config
    harness.make_vllm_config = lambda r, w, port: make_config(r, w, port, device="cpu")
    compat.platform_name = lambda: "cuda"

    def create_buffer(group, config):
        buffer = fakes.FakeEpBuffer(dist.get_rank(group), dist.get_world_size(group),
                                  config.num_experts, None)
        buffer.config = config
        fake_buffers.append(buffer)
        return buffer

    buffer_cache._create_buffer = create_buffer


def _rank_main(rank, world_size, port, results):
    try:
        fake_buffers: list = []
        _install_stand_ins(fake_buffers)
        from vllm.distributed.parallel_state import get_dp_group, get_ep_group
        from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
        from vllm.v1.worker.workspace import current_workspace_manager

        import fakes
        import test_vllm_moe_gpu as gpu_tests
        from vllm_petit_moe.testing import vllm_moe_harness as harness

        out = {}
        state = harness.init_vllm_dp_ep(rank, world_size, port)
        state.device = torch.device("cpu")
        out["groups"] = [(g.rank_in_group, g.world_size) for g in (get_dp_group(),
                                                                   get_ep_group())]
        shape = harness.MoEShape(**SMALL)
        layer, w13, w2 = gpu_tests._layer(state, shape)
        out["kernels"] = {p: (type(k.prepare_finalize).__name__, type(k.fused_experts).__name__)
                          for p, k in layer.kernels.items()}
        out["workspace_locked"] = current_workspace_manager().is_locked()
        direct = harness.build_layer(state, shape, layer.w13, layer.w2,
                                     max_num_tokens=gpu_tests.MAX_TOKENS, paths=("petit",),
                                     petit_via="direct")
        out["buffers"] = len(fake_buffers)
        current_workspace_manager().unlock()  # the reference experts' workspace differs
        for lay in (layer, direct):
            for kernel in lay.kernels.values():
                kernel.impl.fused_experts = fakes.ReferenceExperts(lay.moe_config,
                                                                 FUSED_MOE_UNQUANTIZED_CONFIG)
        out["compare"] = []
        for counts, paths, skew in (([5, 3], ("default", "petit"), None),
                                    ([1, 1], ("default", "petit"), None),
                                    ([9, 4], ("default", "petit"), "hot_rank"),
                                    ([0, 6], ("petit",), None)):
            seed = 11 + sum(counts)
            xs, ids, ws = harness.make_inputs(shape, counts, seed=seed, device=state.device,
                                              skew=skew)
            fake_buffers[0].call = fakes.SimulatedCall(xs, ids, ws, w13, w2)
            report = gpu_tests._rank_compare(state, shape, seed, counts, paths, skew)
            y = direct.forward("petit", xs[rank], ids[rank], ws[rank], counts)
            z = layer.forward("petit", xs[rank], ids[rank], ws[rank], counts)
            out["compare"].append((counts, report, bool(torch.equal(y, z))))
        out["strides"] = fake_buffers[0].region_strides[-4:]

        from vllm.model_executor.layers.fused_moe import modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

        from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize

        fp8 = FusedMoEQuantConfig.make(torch.float8_e4m3fn)  # per-tensor: unsupported
        pf = PetitPrepareAndFinalize(fake_buffers[0], num_experts=shape.num_experts,
                                     max_tokens_per_rank=gpu_tests.MAX_TOKENS)
        with harness.env_override(VLLM_USE_PETIT_MOE=None):
            layer.kernels["fp8"] = mk.FusedMoEKernel(pf, TritonExperts(layer.moe_config, fp8))
        xs, ids, ws = harness.make_inputs(shape, [4, 4], seed=3, device=state.device)
        try:
            layer.forward("fp8", xs[rank], ids[rank], ws[rank], [4, 4])
            out["fp8"] = None
        except NotImplementedError as e:
            out["fp8"] = str(e)
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def test_harness_wiring_on_cpu():
    import torch.multiprocessing as mp

    from vllm_petit_moe.testing import vllm_moe_harness as harness

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = harness.free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, results), daemon=True)
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        answers = {r: (ok, v) for r, ok, v in (results.get(timeout=300) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(2):
        ok, out = answers[rank]
        assert ok, f"rank {rank}:\n{out}"
        assert out["groups"] == [(rank, 2), (rank, 2)]
        assert out["kernels"] == {
            "default": ("MoEPrepareAndFinalizeNaiveDPEPModular", "TritonExperts"),
            "petit": ("PetitPrepareAndFinalize", "TritonExperts"),
        }
        assert out["workspace_locked"]
        assert out["buffers"] == 1, "hook-built and hand-built kernels share one EpBuffer"
        for counts, report, direct_equal in out["compare"]:
            assert direct_equal, f"rank {rank} {counts}: hand-built kernel differs"
            if "default" in report:
                assert report["bitwise_equal_fraction"] == 1.0, (rank, counts, report)
        # region stride R = max over the DP ranks' token counts ([9, 4], then [0, 6])
        assert out["strides"] == [9, 6, 6, 6]
        assert out["fp8"] and "per-tensor activation scales" in out["fp8"], out["fp8"]
