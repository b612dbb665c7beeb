"""CPU checks of examples/bench_dispatch_combine.py: --help (with --trace), and how a row is
merged over the ranks (timings averaged, the combine timelines kept one per rank). The timed
parts need >= 2 GPUs."""
from __future__ import annotations

import pytest
from script_module import load_script, script_help


@pytest.fixture(scope="module")
def bench():
    return load_script("examples/bench_dispatch_combine.py")


def test_help_runs_without_a_gpu():
    out = script_help("examples/bench_dispatch_combine.py")
    assert "--trace" in out and "--num-sms" in out


def test_rows_average_over_ranks_and_keep_each_ranks_timeline(bench):
    rank0 = dict(preset="deepseek-v3", tokens=4096, num_sms=132, dispatch_us=170.0,
                 combine_us=180.0, phys_send_bytes=100, combine_trace={"kernel_us": 179.0})
    rank1 = dict(preset="deepseek-v3", tokens=4096, num_sms=132, dispatch_us=174.0,
                 combine_us=176.0, phys_send_bytes=100, combine_trace={"kernel_us": 175.5})
    row = bench._average([rank0, rank1])
    assert row["dispatch_us"] == pytest.approx(172.0) and row["combine_us"] == pytest.approx(178.0)
    assert row["tokens"] == 4096 and row["phys_send_bytes"] == 100  # ints: rank 0's
    assert row["combine_trace"] == [{"kernel_us": 179.0}, {"kernel_us": 175.5}]
    assert "combine_trace" not in bench._average([{"combine_us": 1.0}, {"combine_us": 3.0}])
