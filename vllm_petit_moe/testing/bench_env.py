"""Environment every multi-GPU process of this project runs with (tests, benchmarks, servers).

NVLink multicast must stay off on the shared GPU hosts: a program using it can take the
host's GPUs out of service. vLLM's symmetric-memory all-reduce uses multicast operations, its
FlashInfer sampler is not in the offline vLLM bundle, and the GPU machines have no network.

Also how the benchmark drivers stamp (commit, date), write their results and sum profiled
kernel time by category (their --profile).

Examples, tools and tests import it as ``vllm_petit_moe.testing.bench_env``.
"""

MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

VLLM_SAFE_ENV = {
    **MULTICAST_OFF_ENV,
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def commit_stamp(repo_root) -> str:
    """The commit a result was made at: $PETIT_COMMIT (the GPU machines get a copy of the
    tree without .git), else git's short hash of `repo_root`, else "unknown"."""
    import os
    import subprocess
    if os.environ.get("PETIT_COMMIT"):
        return os.environ["PETIT_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(repo_root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "unknown"


def utc_date() -> str:
    """Now, as the results files' `date` field (UTC, ISO 8601, seconds)."""
    import datetime
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def short_gpu_name(name: str) -> str:
    """A CUDA device name as results name the GPU model: without "NVIDIA ", spaces as dashes
    ("NVIDIA H200" -> "H200", "NVIDIA H100 80GB HBM3" -> "H100-80GB-HBM3")."""
    return name.replace("NVIDIA ", "").strip().replace(" ", "-") or "unknown"


def gpu_name(device=None) -> str:
    """`short_gpu_name` of the current (or the given) CUDA device."""
    import torch
    return short_gpu_name(torch.cuda.get_device_name(device))


def results_name(bench: str, gpu: str, num_gpus: int, ranks: int | None = None,
                 suffix: str = "") -> str:
    """The file name (no extension) of a benchmark's results: what ran is in the name, the GPU
    model, the physical GPU count and, where processes share GPUs (`ranks` given), the rank
    count: ``<bench>_<gpu>_<G>gpu[_<R>ranks]<suffix>``, e.g. ``dispatch_combine_H200_2gpu``,
    ``soak_H100_1gpu_2ranks``. (Files written before this scheme were ``<bench>_<gpu>x<W>``, W the rank
    count, which hid ranks sharing one GPU.)"""
    if num_gpus < 1 or (ranks is not None and ranks < 1):
        raise ValueError(f"results_name: num_gpus {num_gpus} and ranks {ranks} must be >= 1")
    return f"{bench}_{gpu}_{num_gpus}gpu" + (f"_{ranks}ranks" if ranks is not None else "") \
        + suffix


def device_stamp(repo_root, world, num_gpus: int = 1, **extra) -> dict:
    """The fields that lead every results line of a tool on the current CUDA device: gpu
    (`gpu_name`), world (the EP world size, or DP size, the row is about), num_gpus (physical
    GPUs the run used: 1 for a one-GPU tool, even one that models rank 0 of W), commit, date,
    then `extra`."""
    return dict(gpu=gpu_name(), world=world, num_gpus=num_gpus, commit=commit_stamp(repo_root),
                date=utc_date(), **extra)


def write_jsonl(path, rows, stamp=None) -> None:
    """`rows` to `path`, one JSON line each, led by the fields of `stamp` when given (a field
    in both is an error)."""
    import json
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(dict(**stamp, **r) if stamp else r) + "\n")


def write_results(repo_root, name, rows, stamp, plot, title, out_dir=None):
    """Write `rows` to <repo_root>/examples/results/<name>.jsonl (and to `out_dir` when given;
    `name` from `results_name`), one line per row led by the fields of `stamp` (gpu, world,
    num_gpus, commit, date, ...), and
    `plot(rows, <same folder>/<name>.png, title)` next to each. Returns the repo's .jsonl."""
    from pathlib import Path
    out_dirs = [Path(repo_root) / "examples" / "results"] + ([Path(out_dir)] if out_dir else [])
    for folder in out_dirs:
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / f"{name}.jsonl", rows, stamp)
        plot(rows, folder / f"{name}.png", title)
    print(f"wrote {out_dirs[0] / name}.jsonl and .png")
    return out_dirs[0] / f"{name}.jsonl"


def replot(jsonl, plot, title, key=()):
    """Redraw the PNG next to a results file written by `write_results`:
    `plot(rows, <jsonl without suffix>.png, title(first row))`, the title row's commit naming
    every commit drawn. With `key` (field names), a file that gathers runs of several commits
    draws only the last row of each configuration. Returns 0 (an exit status)."""
    import json
    from pathlib import Path
    rows = [json.loads(line) for line in open(jsonl) if line.strip()]
    if not rows:
        raise SystemExit(f"{jsonl}: no results to plot")
    if key:
        rows = list({tuple(r.get(k) for k in key): r for r in rows}.values())
    commits = " + ".join(dict.fromkeys(str(r.get("commit")) for r in rows))
    plot(rows, Path(jsonl).with_suffix(".png"), title(dict(rows[0], commit=commits)))
    return 0



# Kernel-name categories of the benchmarks' --profile, first match wins (case-insensitive
# substrings): our kernels (csrc/*.cu), NCCL, and vLLM's Triton fused-MoE path.
PROFILE_CATEGORIES = (
    ("dispatch", ("dispatch_kernel",)),
    ("combine", ("combine_kernel",)),
    ("nccl", ("nccl",)),
    ("petit_gemm", ("expert_gate_up", "expert_down", "expert_fused")),
    ("petit_reduce", ("expert_reduce",)),
    ("petit_row_lists", ("row_list_",)),
    ("triton_gemm", ("fused_moe_kernel",)),
    ("triton_align_sum_act", ("moe_align", "moe_sum", "act_and_mul", "silu", "count_and_sort")),
)


def kernel_category(name: str, categories=PROFILE_CATEGORIES) -> str:
    """The first of ``categories`` ((name, substrings) pairs) with a substring in the kernel
    name (case-insensitive), else ``other``."""
    low = name.lower()
    return next((c for c, keys in categories if any(k in low for k in keys)), "other")


def kernel_breakdown(kernels, replays: int, categories=PROFILE_CATEGORIES) -> dict[str, float]:
    """Device time per call (us) by ``categories`` (default ``PROFILE_CATEGORIES``; + ``other``)
    and their sum ``kernels_total``, from ``(kernel name, total device us)`` pairs over
    ``replays`` calls. Categories with no kernel are left out."""
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    totals: dict[str, float] = {}
    for name, us in kernels:
        cat = kernel_category(name, categories)
        totals[cat] = totals.get(cat, 0.0) + us
    order = [c for c, _ in categories] + ["other"]
    out = {c: totals[c] / replays for c in order if totals.get(c, 0.0) > 0}
    out["kernels_total"] = sum(out.values())
    return out


def format_breakdown(breakdown: dict[str, float]) -> str:
    parts = [f"{k} {v:.1f}" for k, v in breakdown.items() if k != "kernels_total"]
    return ", ".join(parts) + f" (kernels {breakdown.get('kernels_total', 0.0):.1f} us)"


def profile_kernels(call, replays: int, categories=PROFILE_CATEGORIES) -> dict[str, float]:
    """``kernel_breakdown`` (by ``categories``) of ``replays`` calls of ``call()`` (e.g. a CUDA
    graph's replay: CUPTI traces the kernels inside graph replays like launched ones), under
    torch.profiler with CUDA activity only. The caller warms ``call`` up first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            call()
        torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:  # older torch
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if us > 0:
            kernels.append((evt.key, float(us)))
    return kernel_breakdown(kernels, replays, categories)
