"""GPU: EpBuffer.close() on a one-rank buffer, each case in a fresh process
(a use of unmapped memory ends the CUDA context).

- close() waits for the device without holding the GIL: a Python thread keeps running while
  a long kernel (torch.cuda._sleep) holds close() in its device wait. Before: frozen for the
  whole wait.
- A DispatchOutput tensor used after close() reads the rows it held (the views own a share of
  the heap), and the heap is freed once the last of them is gone. Before: the views pointed
  into an unmapped range (an illegal address).

    pytest -q tests/test_teardown_gpu.py      # on a GPU machine, after building _C
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from conftest import assert_case_ok, requires_extension, requires_gpu, run_case

pytestmark = [requires_gpu, requires_extension]


def _buffer(hidden_size=256, max_tokens_per_rank=64):
    import torch.distributed as dist

    from vllm_petit_moe.buffer import EpBuffer
    from vllm_petit_moe.testing.rank_pool import free_port

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    return EpBuffer(dist.group.WORLD, hidden_size=hidden_size, num_experts=8,
                    max_tokens_per_rank=max_tokens_per_rank, max_top_k=4, timeout_s=5.0,
                    max_wait_s=10.0)


def _case(case):
    # "views": a heap (~32 MiB) far above the 2 MiB pages of the context's own small device
    # allocations, which close() may free while the views keep the heap
    hidden = 2048 if case == "views" else 256
    buf = _buffer(hidden, 4096 if case == "views" else 64)
    x = torch.randn(16, hidden, device="cuda").bfloat16()
    ids = torch.randint(0, 8, (16, 4), device="cuda")
    w = torch.rand(16, 4, device="cuda")
    out = buf.dispatch(x, ids, w, region_stride=16)
    torch.cuda.synchronize()
    if case == "gil":
        ticks = []
        stop = threading.Event()

        def count():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.01)

        thread = threading.Thread(target=count)
        thread.start()
        torch.cuda._sleep(int(3e9))  # ~2 s of device time ahead of close()
        start = time.monotonic()
        buf.close()
        waited = time.monotonic() - start
        stop.set()
        thread.join()
        during = [t for t in ticks if start <= t <= start + waited]
        assert waited > 0.5, f"close() did not wait for the device ({waited:.2f} s)"
        assert len(during) > 10, f"the Python thread ran {len(during)} times in {waited:.2f} s"
    elif case == "views":
        recv_x = out.recv_x
        want = recv_x.clone()
        heap = buf.footprint_bytes
        assert heap >= 16 << 20, heap
        free_before = torch.cuda.mem_get_info()[0]
        buf.close()
        freed = torch.cuda.mem_get_info()[0] - free_before
        assert freed < heap // 2, f"freed under a view: {freed} of the heap's {heap} bytes"
        assert torch.equal(recv_x * 1, want), "a view read after close() changed"
        torch.cuda.synchronize()
        del out, recv_x
        import gc
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the product above came from torch's cache
        freed = torch.cuda.mem_get_info()[0] - free_before
        assert freed >= heap, f"the heap outlived its last view: {freed} of {heap} bytes freed"
    print("ok")


@pytest.mark.parametrize("case", ["gil", "views"])
def test_close(case):
    result = run_case(__file__, case, timeout=300,
                      env={"PYTHONPATH": os.pathsep.join(
                          [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])})
    assert_case_ok(result, f"close ({case})")
