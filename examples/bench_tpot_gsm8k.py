#!/usr/bin/env python3
"""End-to-end `vllm serve` benchmark: TPOT/TTFT/throughput with and without VLLM_USE_PETIT_MOE.

Starts `vllm serve <model dir>` on this node's GPUs (data parallel = number of GPUs,
`--enable-expert-parallel`, `--load-format dummy`, CUDA graphs on), alternately with
VLLM_USE_PETIT_MOE=1 ("petit": our dispatch/combine, vLLM's Triton experts) and without it
("default": vLLM's allgather/reduce-scatter), e.g. on, off, on, off for --repeats 2, and sends
the GSM8K test questions through the OpenAI-compatible API at each concurrency level.
`--backends petit petit-experts default` adds a third server per repeat, "petit-experts":
VLLM_USE_PETIT_MOE=1 VLLM_PETIT_MOE_EXPERTS=1 (our expert GEMMs too).

Requests: POST /v1/completions, streaming, prompt text "Question: <question>\\nAnswer:" (no
chat template), max_tokens=--output-len, ignore_eos=true, temperature 0, prefix caching off
(every level re-sends the same prompts). Client side (asyncio + aiohttp, 127.0.0.1 only):
  TTFT = time to the first streamed token chunk
  TPOT = (latency - TTFT) / (output_tokens - 1) per request, latency = time to the last token
         chunk (vLLM's own `vllm bench serve` definition); mean, p50, p99 over requests
  output_tok_s, req_s = completed tokens / requests over the level's wall time
Each level starts with one untimed wave of `concurrency` short requests (warm-up).
Server side, per level and per engine (DP rank), from vLLM's Prometheus /metrics read before
and after the timed requests (`server_counters` in each row): engine steps and steps/s, mean
tokens per step, preemptions and vLLM's own mean inter-token latency; they tell a slower step
from more steps or different batching when two backends' TPOT differ.

--profile-steps N (with --profile-concurrency C ...): after each profiled level's timed
requests, two more untimed waves under vLLM's torch profiler (the server then starts with
--profiler-config and VLLM_CUSTOM_SCOPES_FOR_PROFILING=1); N engine steps per DP rank are
summarized (`summarize_trace`: step time, GPU busy and idle, the MoE kernels' union, kernel
time by category, top kernels) into profile_<results name>.jsonl and the log.

Noise control: the servers of the backends alternate (--repeats), and the table gives, next
to every <backend>/default ratio, its min..max over the repeats (ratio of the same repeat).

Outputs, in --results-dir (default examples/results):
  tpot_gsm8k_<gpu>x<W>[_<model>][_quick].jsonl  one line per (backend, concurrency, repeat);
        the _<model> part only for a model other than the full qwen3-30b-a3b
  the same name .png                            TPOT and throughput vs concurrency
  a printed table with <backend>/default ratios and their spread
and the server logs in --log-dir. --out-dir also copies the results and this run's logs there.

Model: --model-dir (default examples/models/qwen3-30b-a3b: config.json + tokenizer files
copied from ../shared/models, which does not travel to the GPU machine). --num-layers N serves
a copy with num_hidden_layers=N (written under $TMPDIR/petit-bench-models/, same path every
time so vLLM's compile cache is reused). DeepSeek-V3 (config + tokenizer in
examples/models/deepseek-v3, copied from ../shared/models; bf16, no quantization config) works
the same way: --model-dir examples/models/deepseek-v3 --num-layers N with N >= 4 (its first 3
layers are dense; 8 layers = 5 MoE layers, ~57 GB of expert weights per GPU at DP=2); MLA
models get --attention-backend TRITON_MLA (not yet run on the devkit).

--quick: 160 prompts, concurrency 8 and 64, 1 repeat, 128 output tokens, and by default a
4-layer copy of the model (--num-layers 4; --num-layers 0 keeps all 48): two cold starts of
the 48-layer Qwen3-30B-A3B alone take about 8 minutes, so --quick serves the 4-layer copy
(estimated 1.5-2.5 min per start, about 5-6 min in all). It is a check of the whole
pipeline, not a measurement of the full model.

Expected runtime (2 x H200, 48-layer Qwen3-30B-A3B; estimates from the devkit's measured
~270 s cold start): a server start takes ~270 s cold and less once torch.compile's cache is
warm (the flag is part of vLLM's compile hash, so each backend compiles once per machine); a
wave of 256 tokens takes 256 x TPOT, roughly 2.5-5 s. All 1,319 prompts at 5 levels is
~15 min of requests per server (c=8 alone ~7 min), so 2 backends x 2 repeats take well over
an hour. --waves K sends min(1319, K x concurrency) prompts per level (the same K waves at
every level: --waves 4 is ~1.5 min of requests per server). --max-runtime S makes a command
start only what is expected to finish within S seconds (exit 3 = work left) and --resume
continues from the results file, so the plan runs as several commands of under 10 minutes.

Examples (on the GPU machine; $OUT is what comes back):
  python3 examples/bench_tpot_gsm8k.py --quick --out-dir $OUT
  python3 examples/bench_tpot_gsm8k.py --waves 4 --max-runtime 540 --resume --out-dir $OUT
      # repeat until it prints COMPLETE; the results file (examples/results/...) must be the
      # latest one: same warm machine, or copy the returned .jsonl into the repo between calls
  python3 examples/bench_tpot_gsm8k.py --report examples/results/tpot_gsm8k_H200x2.jsonl
  python3 examples/bench_tpot_gsm8k.py --dry-run     # the plan and the server commands

Exit status: 0 complete; 1 an error (server failed, a request failed, a flag-on server that
does not log our backend); 2 usage; 3 stopped by --max-runtime with work left (rerun the same
command with --resume).
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import datetime
import gzip
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = ROOT / "examples" / "models" / "qwen3-30b-a3b"
DEFAULT_DATA = ROOT / "examples" / "data" / "gsm8k_test.jsonl"
DEFAULT_RESULTS_DIR = ROOT / "examples" / "results"
DEFAULT_LOG_DIR = Path(tempfile.gettempdir()) / "petit-bench-tpot-logs"
MODEL_COPY_ROOT = Path(tempfile.gettempdir()) / "petit-bench-models"

sys.path.insert(0, str(ROOT))
from vllm_petit_moe.device_env import VLLM_SAFE_ENV, commit_stamp  # noqa: E402

CONCURRENCY = [8, 16, 32, 64, 128]
QUICK = dict(num_prompts=160, concurrency=[8, 64], repeats=1, output_len=128, num_layers=4)
# petit: our prepare/finalize + vLLM's Triton experts; petit-experts: also our expert GEMMs
# (VLLM_PETIT_MOE_EXPERTS=1); default: vLLM's allgather/reduce-scatter + Triton experts.
BACKENDS = ("petit", "petit-experts", "default")
DEFAULT_BACKENDS = ("petit", "default")
PROMPT_FORMAT = "Question: {question}\nAnswer:"
HOST = "127.0.0.1"

# Forced into the server's environment (the rest is inherited).
SAFE_ENV = {**VLLM_SAFE_ENV, "PYTHONUNBUFFERED": "1"}

# What the plugin logs (vllm_petit_moe/plugin.py, vllm_petit_moe/vllm_glue/hook.py).
LOG_PETIT_USED = "vllm-petit-moe: MoE layers use PetitPrepareAndFinalize"
LOG_PETIT_UNSUPPORTED = "vllm-petit-moe: VLLM_USE_PETIT_MOE=1 but unsupported here"
LOG_PETIT_EXPERTS_USED = "vllm-petit-moe: MoE layers use PetitExperts"
LOG_PETIT_EXPERTS_NOT_USED = "but PetitExperts cannot serve these MoE layers"
LOG_PETIT_NOT_USED = "vllm-petit-moe: not used for these MoE layers"
LOG_PLUGIN_DISABLED = "vllm-petit-moe: installed, not enabled"
# vLLM's own MoE kernel choice, e.g. "Using TRITON Unquantized MoE backend".
LOG_VLLM_MOE_RE = re.compile(r"Using \S+ .*MoE backend.*")

# --profile-steps: engine steps skipped after /start_profile (the wave's prefills, ramp-up).
PROFILE_DELAY_STEPS = 20
# Kernel categories of the server profile, after device_env.PROFILE_CATEGORIES (the MoE
# layer's kernels): first match wins, case-insensitive substrings of the kernel name.
SERVER_PROFILE_CATEGORIES = (
    ("attention", ("attention", "attn", "reshape_and_cache")),
    ("dense_gemm", ("nvjet", "gemm", "cutlass", "xmma", "splitk")),
    ("norm_rope", ("rms_norm", "rotary", "layernorm", "layer_norm")),
    ("moe_routing", ("topkgating", "topk_softmax", "grouped_topk", "moe_fused_gate")),
    ("sampling", ("sample", "argmax", "softmax", "topk", "top_k")),
    ("copy_memset", ("memcpy", "memset", "copy")),
    # torch's bf16 sum: in the Qwen3-MoE profiles only vLLM's default MoE path runs one (the
    # sum over each token's top-k expert outputs), so it counts as MoE time below
    ("torch_sum", ("sum_functor",)),
)
# The categories whose kernels are the MoE layers' (their union is `moe_busy_us`): the layer's
# own kernels of device_env.PROFILE_CATEGORIES, the router's top-k and the default's sum.
MOE_PROFILE_CATEGORIES = ("dispatch", "combine", "nccl", "petit_gemm", "petit_reduce",
                          "petit_row_lists", "triton_gemm", "triton_align_sum_act",
                          "moe_routing", "torch_sum")

# Fields every row starts with (the schema); more follow.
ROW_FIELDS = ("gpu", "world", "model", "commit", "date", "vllm_version", "backend",
              "concurrency", "num_prompts", "output_len", "tpot_ms_mean", "tpot_ms_p50",
              "tpot_ms_p99", "ttft_ms_mean", "output_tok_s", "repeat", "req_s")


class BenchError(RuntimeError):
    """A failure of one server run or level, reported and counted, not a crash."""


class HealthTimeout(BenchError):
    """The server was not healthy within the time allowed."""

    budget_cut = False  # True: the time allowed was cut short by --max-runtime


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", "--model", dest="model_dir", default=str(DEFAULT_MODEL_DIR),
                   help="model directory with config.json and tokenizer files (weights are "
                        "random: --load-format dummy). Default: %(default)s")
    p.add_argument("--num-layers", type=int, default=None,
                   help="serve a copy of the model with num_hidden_layers=N (0: as is; "
                        "default: as is, 4 with --quick)")
    p.add_argument("--data", default=str(DEFAULT_DATA),
                   help="GSM8K jsonl ({question, answer} per line). Default: %(default)s")
    p.add_argument("--quick", action="store_true",
                   help="160 prompts, concurrency 8 and 64, 1 repeat, output 128, 4-layer model "
                        "copy (each overridable by its own option)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help=f"concurrency levels (default {CONCURRENCY})")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per level, the first N questions (default: all 1,319)")
    p.add_argument("--waves", type=int, default=0,
                   help="if > 0: min(num_prompts, K x concurrency) prompts per level, i.e. the "
                        "same number of full waves at every level")
    p.add_argument("--output-len", type=int, default=None, help="max_tokens (default 256)")
    p.add_argument("--repeats", type=int, default=None, help="server runs per backend (default 2)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(DEFAULT_BACKENDS),
                   help="order within each repeat (default: petit default)")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default: all GPUs)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="per DP rank (default: the highest concurrency)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--attention-backend", default="auto",
                   help="auto: TRITON_MLA for MLA configs (kv_lora_rank), else TRITON_ATTN")
    p.add_argument("--serve-args", default="",
                   help="extra `vllm serve` arguments, one shell-quoted string")
    p.add_argument("--no-strict", dest="strict", action="store_false",
                   help="flag-on servers without VLLM_PETIT_MOE_STRICT=1 (a layer that cannot "
                        "use petit then falls back instead of failing the start-up)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter of the vLLM install (default: this one)")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one per start)")
    p.add_argument("--health-timeout", type=float, default=900.0,
                   help="seconds to wait for /health (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="bound of one request, seconds (default %(default)s)")
    p.add_argument("--read-timeout", type=float, default=120.0,
                   help="bound of the wait for the next streamed chunk, seconds")
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL to the server's process group")
    p.add_argument("--max-runtime", type=float, default=0.0,
                   help="seconds: do not start a server run or level that is not expected to "
                        "finish within this (exit 3; rerun with --resume). 0: no limit")
    p.add_argument("--startup-guess", type=float, default=0.0,
                   help="seconds a server start is assumed to take for --max-runtime until one "
                        "was measured (default: 120 + 4 per layer, ~300 s for 48 layers)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows already in the results file and run only what is missing")
    p.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR))
    p.add_argument("--log-dir", default=str(DEFAULT_LOG_DIR))
    p.add_argument("--out-dir", default=None,
                   help="also copy the results (jsonl, png) and this run's server logs here")
    p.add_argument("--gpu-name", default=None, help="default: from nvidia-smi, e.g. H200")
    p.add_argument("--vllm-version", default=None,
                   help="default: `import vllm` in the server's environment")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and the server commands, start nothing")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="after the timed requests of each --profile-concurrency level, send two "
                        "more (untimed) waves of requests under vLLM's torch profiler and record "
                        "N engine steps per DP rank (after 20 steps of ramp-up); per step: GPU "
                        "busy and idle time, the MoE kernels' union, kernel time by category, "
                        "to profile_<results name>.jsonl and the log. 0: off (default); the "
                        "server then runs without --profiler-config")
    p.add_argument("--profile-concurrency", type=int, nargs="+", default=None,
                   help="the level(s) profiled by --profile-steps (default: the highest)")
    p.add_argument("--report", metavar="JSONL",
                   help="only print the table and redraw the plot of a results file")
    # For tests and other launchers: a command run instead of `vllm serve`, formatted with
    # {python} {port} {host} {model_dir} {served_name} {dp}.
    p.add_argument("--server-cmd", default=None, help=argparse.SUPPRESS)
    p.add_argument("--health-poll", type=float, default=2.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    if args.concurrency is None:
        args.concurrency = list(CONCURRENCY)
    if args.output_len is None:
        args.output_len = 256
    if args.repeats is None:
        args.repeats = 2
    if args.num_layers is None:
        args.num_layers = 0
    if args.report:
        return args
    problems = []
    if any(c < 1 for c in args.concurrency):
        problems.append("--concurrency values must be >= 1")
    args.concurrency = sorted(set(args.concurrency))
    if args.output_len < 2:
        problems.append("--output-len must be >= 2 (TPOT needs two tokens)")
    if args.repeats < 1:
        problems.append("--repeats must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        problems.append("--num-prompts must be >= 1")
    if args.waves < 0 or args.num_layers < 0:
        problems.append("--waves and --num-layers must be >= 0")
    if len(set(args.backends)) != len(args.backends):
        problems.append("--backends lists a backend twice")
    if args.profile_steps < 0:
        problems.append("--profile-steps must be >= 0")
    stray = sorted(set(args.profile_concurrency or ()) - set(args.concurrency))
    if args.profile_steps and stray:
        problems.append(f"--profile-concurrency {stray} not among the levels {args.concurrency}")
    if args.max_num_seqs and args.max_num_seqs < max(args.concurrency):
        problems.append(f"--max-num-seqs {args.max_num_seqs} < highest concurrency "
                        f"{max(args.concurrency)}")
    if problems:
        p.error("; ".join(problems))
    if not args.max_num_seqs:
        args.max_num_seqs = max(args.concurrency)
    if args.profile_steps and not args.profile_concurrency:
        args.profile_concurrency = [max(args.concurrency)]
    return args


def prompts_per_level(num_prompts: int, concurrency: int, waves: int) -> int:
    """Prompts sent at one level: all of them, or `waves` full waves when waves > 0."""
    return min(num_prompts, waves * concurrency) if waves > 0 else num_prompts


# ------------------------------------------------------------------------------------------
# Prompts and model directory
# ------------------------------------------------------------------------------------------

def load_prompts(path, limit: int | None = None) -> list[str]:
    """GSM8K questions as completion prompts, in file order."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                question = json.loads(line)["question"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a GSM8K line ({e})") from None
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{path}:{lineno}: empty question")
            prompts.append(PROMPT_FORMAT.format(question=question.strip()))
    if not prompts:
        raise ValueError(f"{path}: no questions")
    return prompts[:limit] if limit else prompts


def read_config(model_dir) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: no config.json (copy the model directory into the repo, "
                         f"e.g. examples/models/<name>/ with config.json + tokenizer files)")
    return json.loads(path.read_text())


def has_tokenizer(model_dir) -> bool:
    return any((Path(model_dir) / f).is_file()
               for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def is_mla(config: dict) -> bool:
    return bool(config.get("kv_lora_rank"))


def model_with_layers(model_dir, num_layers: int, copy_root=None) -> Path:
    """A copy of `model_dir` with num_hidden_layers=num_layers (0: `model_dir` itself).

    Per-layer lists in the config (e.g. layer_types) are cut to the new depth, and layer ids
    >= N are dropped from mlp_only_layers. The copy's path depends only on the source and N,
    so vLLM's torch.compile cache (keyed on the model path among others) is reused.
    """
    model_dir = Path(model_dir).resolve()
    config = read_config(model_dir)
    if not num_layers:
        return model_dir
    old = int(config["num_hidden_layers"])
    dense = int(config.get("first_k_dense_replace", 0) or 0)
    if num_layers <= dense:
        raise ValueError(f"--num-layers {num_layers}: {model_dir.name}'s first {dense} layers are "
                         f"dense (first_k_dense_replace), so no layer would be MoE; use "
                         f">= {dense + 1}")
    if num_layers > old:
        raise ValueError(f"--num-layers {num_layers} > the model's {old} layers")
    new = dict(config, num_hidden_layers=num_layers)
    for key, value in config.items():
        if isinstance(value, list) and len(value) == old and key != "architectures":
            new[key] = value[:num_layers]
    if isinstance(config.get("mlp_only_layers"), list):
        new["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < num_layers]
    if "max_window_layers" in config:
        new["max_window_layers"] = min(int(config["max_window_layers"]), num_layers)
    dest = Path(copy_root or MODEL_COPY_ROOT) / f"{model_dir.name}-{num_layers}l"
    text = json.dumps(new, indent=2) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    for src in model_dir.iterdir():
        if src.is_file() and src.name != "config.json":
            target = dest / src.name
            if not target.exists() or target.stat().st_size != src.stat().st_size:
                shutil.copyfile(src, target)
    cfg = dest / "config.json"
    if not cfg.exists() or cfg.read_text() != text:
        cfg.write_text(text)
    return dest


def model_tag(model_dir, num_layers: int) -> str:
    name = Path(model_dir).resolve().name
    return f"{name}-{num_layers}l" if num_layers else name


# ------------------------------------------------------------------------------------------
# Machine facts
# ------------------------------------------------------------------------------------------

def _run(cmd, timeout=60, env=None) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def visible_gpus() -> list[str]:
    """Names of the GPUs this process may use (nvidia-smi, honouring CUDA_VISIBLE_DEVICES)."""
    out = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    if not out:
        return []
    names = [line.strip() for line in out.splitlines() if line.strip()]
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        picked = []
        for tok in cvd.split(","):
            tok = tok.strip()
            if tok.isdigit() and int(tok) < len(names):
                picked.append(names[int(tok)])
            elif tok and not tok.lstrip("-").isdigit():
                picked.append(names[0] if names else "GPU")  # UUIDs: same kind assumed
            elif tok.startswith("-"):
                break
        names = picked
    return names


def short_gpu_name(name: str) -> str:
    return name.replace("NVIDIA ", "").strip().replace(" ", "-") or "unknown"


def gpu_memory_used_mib() -> list[int] | None:
    out = _run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
               timeout=30)
    if not out:
        return None
    try:
        return [int(float(x)) for x in out.split()]
    except ValueError:
        return None


def wait_gpus_idle(timeout: float = 60.0, threshold_mib: int = 4096) -> None:
    """Before a server start: warn if the GPUs still hold memory (a leftover server?)."""
    deadline = time.monotonic() + timeout
    used = gpu_memory_used_mib()
    while used is not None and max(used, default=0) > threshold_mib:
        if time.monotonic() > deadline:
            log(f"WARNING: GPU memory still in use before the server start: {used} MiB "
                f"(another process? the server may run out of memory)")
            return
        time.sleep(2)
        used = gpu_memory_used_mib()


def probe_vllm_version(python: str, env: dict) -> str:
    code = ("import vllm\ntry:\n    print(vllm.__version__)\nexcept Exception:\n"
            "    import importlib.metadata as m; print(m.version('vllm'))")
    out = _run([python, "-c", code], timeout=300, env=env)
    lines = out.strip().splitlines() if out else []
    return lines[-1].strip() if lines else "unknown"


PLUGIN_PROBE = """
import json
from importlib.metadata import entry_points
eps = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "petit_moe"]
try:
    import vllm_petit_moe.plugin  # noqa: F401
    importable = True
except Exception:  # noqa: BLE001
    importable = False
print(json.dumps(dict(entry_points=eps, importable=importable)))
"""


def check_plugin_visible(python: str, env: dict) -> None:
    """BenchError unless `python`, in the servers' environment, sees the plugin's
    vllm.general_plugins entry point and can import it. Without it a flag-on server starts
    with vLLM's own backend and is rejected only after its whole start-up."""
    out = _run([python, "-c", PLUGIN_PROBE], timeout=120, env=env)
    try:
        found = json.loads(out.strip().splitlines()[-1]) if out else None
    except (ValueError, IndexError):
        found = None
    if found and found["entry_points"] and found["importable"]:
        return
    raise BenchError(
        f"the servers' Python ({python}) does not see the vllm-petit-moe plugin ({found}): "
        "install it (pip install --no-build-isolation -e .), or on a devkit GPU machine run "
        "`bash tools/vllm_gpu_check.sh build meta`, then `. /tmp/vllm-site/env.sh` and "
        "`export PYTHONPATH=/tmp/petit-moe-meta:$PWD:$PYTHONPATH` before this benchmark")


# ------------------------------------------------------------------------------------------
# Server process
# ------------------------------------------------------------------------------------------

def port_in_use(port: int, host: str = HOST) -> bool:
    """Something listens on host:port (TIME_WAIT leftovers do not count, as for uvicorn)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc (killpg(0) if no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def local_opener() -> urllib.request.OpenerDirector:
    """urllib without the environment's proxies: the server is on 127.0.0.1."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _libc_prctl():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def _pdeathsig():
    """In the server's process (between fork and exec): SIGTERM it if this benchmark dies
    without cleaning up (PR_SET_PDEATHSIG). Only a call into the already-resolved function."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM), 0, 0, 0)


_LIVE_SERVERS: set = set()


class Server:
    """One `vllm serve` in its own process group, output to a log file."""

    def __init__(self, cmd: list[str], env: dict, log_path: Path, port: int,
                 stop_timeout: float = 30.0):
        self.cmd, self.env, self.log_path, self.port = cmd, env, Path(log_path), port
        self.stop_timeout = stop_timeout
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self._log_file = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self._log_file.write(("$ " + shlex.join(self.cmd) + "\n").encode())
        self._log_file.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     start_new_session=True, preexec_fn=_pdeathsig)
        self.pgid = self.proc.pid
        _LIVE_SERVERS.add(self)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_text().splitlines()
        errors = [ln for ln in text if re.search(r"Error|Exception|Traceback", ln)
                  and "ulimit" not in ln][:5]
        tail = text[-lines:]
        head = (["first error lines:"] + errors + ["last lines:"]) if errors else []
        return "\n".join("  | " + ln[:300] for ln in head + tail)

    def wait_healthy(self, timeout: float, poll: float = 2.0) -> float:
        """Seconds until GET /health answered 200; BenchError if the server died or timed out."""
        t0 = time.monotonic()
        opener = local_opener()
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise BenchError(f"server exited with {rc} during start-up; log "
                                 f"{self.log_path}:\n{self.log_tail()}")
            try:
                with opener.open(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() - t0 > timeout:
                raise HealthTimeout(f"server not healthy after {timeout:.0f}s; log "
                                 f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(poll)

    def stop(self) -> str:
        """SIGTERM to the process group, wait, then SIGKILL; returns what happened."""
        if self.pgid is None:
            return "not running"
        pgid, how = self.pgid, "stopped by SIGTERM"
        try:
            for sig, wait_s in ((signal.SIGTERM, self.stop_timeout), (signal.SIGKILL, 15.0)):
                if not group_members(pgid) and self.proc.poll() is not None:
                    break
                if sig == signal.SIGKILL:
                    how = f"killed (SIGKILL after {self.stop_timeout:.0f}s)"
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline:
                    self.proc.poll()
                    if self.proc.returncode is not None and not group_members(pgid):
                        break
                    time.sleep(0.1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            left = group_members(pgid)
            if left:
                how = f"WARNING: processes {left} of group {pgid} survived SIGKILL"
        finally:
            self.pgid = None
            if self._log_file:
                self._log_file.close()
                self._log_file = None
            _LIVE_SERVERS.discard(self)
        return how


def _stop_all_servers() -> None:
    for server in list(_LIVE_SERVERS):
        with contextlib.suppress(Exception):
            log(f"stopping server (port {server.port}): {server.stop()}")


atexit.register(_stop_all_servers)


def vllm_serve_command(python: str, model_dir: Path, served_name: str, port: int, dp: int,
                       attention_backend: str, *, max_model_len: int,
                       gpu_memory_utilization: float, load_format: str | None = None,
                       max_num_seqs: int | None = None) -> list[str]:
    """`vllm serve` on 127.0.0.1 with DP = `dp` + expert parallelism, bf16, seed 0, CUDA graphs
    on, no prefix caching (python -m: the DP coordinator is spawned, and a `vllm` script
    without a __main__ guard would be re-run by it)."""
    return ([python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
             "--served-model-name", served_name,
             "--host", HOST, "--port", str(port)]
            + (["--load-format", load_format] if load_format else [])
            + ["--dtype", "bfloat16", "--seed", "0",
               "--data-parallel-size", str(dp), "--enable-expert-parallel",
               "--attention-backend", attention_backend,
               "--max-model-len", str(max_model_len)]
            + (["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else [])
            + ["--gpu-memory-utilization", str(gpu_memory_utilization),
               "--no-enable-prefix-caching",
               "--disable-uvicorn-access-log"])


def profiler_config(profile_dir: Path, steps: int) -> str:
    """vLLM's --profiler-config (JSON) for --profile-steps: torch profiler, traces of the
    workers only (no API-server trace), no Python stacks, `steps` engine steps after
    PROFILE_DELAY_STEPS once /start_profile is posted."""
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(profile_dir),
                       "ignore_frontend": True, "torch_profiler_with_stack": False,
                       "torch_profiler_dump_cuda_time_total": False,
                       "delay_iterations": PROFILE_DELAY_STEPS, "max_iterations": steps})


def post_local(url: str, timeout: float) -> int:
    """POST with an empty body, no proxy (the server is on 127.0.0.1); the HTTP status."""
    req = urllib.request.Request(url, data=b"", method="POST")
    with local_opener().open(req, timeout=timeout) as resp:
        return resp.status


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels of several streams overlap)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize_trace(path, top: int = 12) -> dict:
    """One worker's torch-profiler trace (vLLM --profiler-config, .json or .json.gz) as per
    engine-step figures, over the steps between the first and the last
    "gpu_model_runner: forward" range: ``steps``, ``step_us`` (mean interval between forward
    starts), ``gpu_busy_us`` (union of the kernels' and copies' device time, per step),
    ``gpu_idle_us`` (step_us - gpu_busy_us: launch gaps, host work, waits), ``moe_busy_us``
    (union of the MOE_PROFILE_CATEGORIES kernels, per step: a kernel launched early by
    programmatic dependent launch overlaps the one before it, so the categories' sum
    overstates the layer's time and this union does not), ``categories`` (device time per
    step by kernel category, ``device_env.kernel_breakdown``; a kernel's time includes its
    waits: on a peer in dispatch or NCCL, on the previous kernel under PDL) and
    ``top_kernels`` ([name, us per step], the longest first). Raises ValueError when the
    trace has fewer than two forward ranges."""
    from vllm_petit_moe.device_env import PROFILE_CATEGORIES, kernel_breakdown, kernel_category

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    forwards = sorted(float(e["ts"]) for e in events
                      if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                      and e.get("name") == "gpu_model_runner: forward")
    if len(forwards) < 2:
        raise ValueError(f"{path}: {len(forwards)} 'gpu_model_runner: forward' range(s) "
                         f"(the server needs VLLM_CUSTOM_SCOPES_FOR_PROFILING=1); need 2 or "
                         f"more engine steps")
    lo, hi = forwards[0], forwards[-1]
    steps = len(forwards) - 1
    categories = PROFILE_CATEGORIES + SERVER_PROFILE_CATEGORIES
    kernels, intervals, moe_intervals = [], [], []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if lo <= ts < hi:
            name = str(e.get("name", "?"))
            kernels.append((name, dur))
            intervals.append((ts, ts + dur))
            if kernel_category(name, categories) in MOE_PROFILE_CATEGORIES:
                moe_intervals.append((ts, ts + dur))
    per_name: dict[str, float] = {}
    for name, dur in kernels:
        per_name[name] = per_name.get(name, 0.0) + dur
    step_us = (hi - lo) / steps
    busy = _busy_us(intervals) / steps
    rank = re.search(r"dp(\d+)", Path(path).name)
    return {"trace": Path(path).name, "dp_rank": int(rank.group(1)) if rank else None,
            "steps": steps, "step_us": step_us, "gpu_busy_us": busy,
            "gpu_idle_us": step_us - busy, "moe_busy_us": _busy_us(moe_intervals) / steps,
            "categories": kernel_breakdown(kernels, steps, categories),
            "top_kernels": [[n, us / steps] for n, us in
                            sorted(per_name.items(), key=lambda kv: -kv[1])[:top]]}


def format_profile(backend: str, s: dict) -> str:
    cats = ", ".join(f"{k} {v:.0f}" for k, v in s["categories"].items() if k != "kernels_total")
    return (f"{backend} dp{s['dp_rank']}: {s['steps']} steps, step {s['step_us']:.0f} us = "
            f"GPU busy {s['gpu_busy_us']:.0f} (MoE kernels {s['moe_busy_us']:.0f}) + idle "
            f"{s['gpu_idle_us']:.0f}; kernel us/step: {cats}")


def serve_command(args, model_dir: Path, served_name: str, port: int, dp: int,
                  attention_backend: str, profile_dir: Path | None = None) -> list[str]:
    profiling = ([] if profile_dir is None else
                 ["--profiler-config", profiler_config(profile_dir, args.profile_steps)])
    if args.server_cmd:
        fields = dict(python=args.python, port=port, host=HOST, model_dir=str(model_dir),
                      served_name=served_name, dp=dp)
        return [tok.format(**fields) for tok in shlex.split(args.server_cmd)] + profiling
    cmd = vllm_serve_command(args.python, model_dir, served_name, port, dp, attention_backend,
                             max_model_len=args.max_model_len,
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             load_format="dummy", max_num_seqs=args.max_num_seqs)
    if not has_tokenizer(model_dir):
        raise ValueError(f"{model_dir} has no tokenizer files: text prompts need them")
    return cmd + profiling + shlex.split(args.serve_args)


def server_env(backend: str, strict: bool) -> dict:
    env = dict(os.environ)
    env.update(SAFE_ENV)
    env.pop("VLLM_PETIT_MOE_STRICT", None)
    env.pop("VLLM_USE_PETIT_MOE", None)  # default: vLLM's stock environment
    env.pop("VLLM_PETIT_MOE_EXPERTS", None)
    if backend != "default":
        env["VLLM_USE_PETIT_MOE"] = "1"
        if strict:
            env["VLLM_PETIT_MOE_STRICT"] = "1"
    if backend == "petit-experts":
        env["VLLM_PETIT_MOE_EXPERTS"] = "1"
    return env


def check_backend(log_text: str, backend: str) -> tuple[bool, str]:
    """From the server log: (the backend asked for is in use, evidence to record)."""
    lines = log_text.splitlines()

    def grab(marker):
        return [ln[ln.index(marker):].strip()[:300] for ln in lines if marker in ln]

    used = grab(LOG_PETIT_USED)
    fallback = grab(LOG_PETIT_UNSUPPORTED) + grab(LOG_PETIT_NOT_USED)
    experts = grab(LOG_PETIT_EXPERTS_USED)
    vllm_moe = [m.group(0)[:120] for ln in lines if (m := LOG_VLLM_MOE_RE.search(ln))]
    moe = f"; vLLM: {vllm_moe[0]}" if vllm_moe else ""
    if backend in ("petit", "petit-experts"):
        if backend == "petit" and experts:
            return False, f"petit asked for without PetitExperts, but the log has: {experts[0]}"
        if backend == "petit-experts":
            no_experts = [ln.strip()[:300] for ln in lines if LOG_PETIT_EXPERTS_NOT_USED in ln]
            if no_experts or not experts:
                return False, ("PetitExperts asked for, but " + (
                    no_experts[0] if no_experts else
                    "the log has no '" + LOG_PETIT_EXPERTS_USED + "' line"))
            moe = f"; {experts[0]} [logged by {len(experts)} process(es)]"
        if used and not fallback:
            return True, f"{used[0]} [logged by {len(used)} process(es)]{moe}"
        if fallback:
            return False, ("flag on, but MoE layers kept vLLM's path: " + " | ".join(fallback[:2])
                           + (f" (and {len(used)} line(s) using petit)" if used else ""))
        return False, ("flag on, but the log has no '" + LOG_PETIT_USED + "' line (plugin not "
                       "installed in the server's environment, or no MoE layer built)")
    if used:
        return False, f"flag off, but the log shows petit in use: {used[0]}"
    plugin = ("plugin installed, not enabled" if grab(LOG_PLUGIN_DISABLED)
              else "plugin not loaded")
    return True, f"vLLM default allgather/reduce-scatter ({plugin}){moe}"


# ------------------------------------------------------------------------------------------
# Client and metrics
# ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0          # s, request sent -> first token chunk
    latency: float = 0.0       # s, request sent -> last token chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


async def stream_completion(session, url: str, model: str, prompt: str, max_tokens: int,
                            timeout: float, read_timeout: float) -> RequestResult:
    """One streamed /v1/completions request, timed on arrival of each SSE chunk."""
    import aiohttp

    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult()
    chunks = 0
    done = False
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(
                total=timeout, sock_read=read_timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {str(msg['error'])[:300]}"
                    return res
                if msg.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    chunks += 1
                    last = now
                    if msg["choices"][0].get("finish_reason"):
                        done = True  # a usage chunk and [DONE] may follow
                if msg.get("usage"):
                    res.output_tokens = int(msg["usage"].get("completion_tokens") or 0)
                    res.prompt_tokens = int(msg["usage"].get("prompt_tokens") or 0)
    except asyncio.TimeoutError:
        res.error = f"timed out (total {timeout:.0f}s, between chunks {read_timeout:.0f}s)"
        return res
    except (aiohttp.ClientError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    if chunks == 0 or not done:
        res.error = "stream ended early" if chunks else "no token received"
        return res
    res.latency = last - start
    if not res.output_tokens:
        res.output_tokens = chunks  # no usage chunk: one chunk per token
    res.ok = True
    return res


class _Progress:
    """A tqdm bar on a terminal; elsewhere (captured output) a line at most every 60 s."""

    def __init__(self, total: int, desc: str, enabled: bool, interval: float = 60.0):
        self.total, self.desc, self.n, self._bar = total, desc, 0, None
        self.enabled, self.interval = enabled, interval
        self._t0 = self._last = time.monotonic()
        if not enabled or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
            tqdm.monitor_interval = 0  # no monitor thread (the server is started by fork)
            self._bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr,
                             mininterval=0.5, dynamic_ncols=True)
        except ImportError:
            self._bar = None

    def update(self) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)
            return
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval and self.n < self.total:
            self._last = now
            print(f"  {self.desc}: {self.n}/{self.total} requests done, "
                  f"{now - self._t0:.0f}s", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int,
                    max_tokens: int, timeout: float, read_timeout: float,
                    progress: _Progress | None = None) -> tuple[list[RequestResult], float]:
    """All `prompts` at `concurrency` requests in flight; stops issuing after a failure.

    Returns the results (in prompt order; requests never sent are absent) and the wall time
    from the first request sent to the last one finished.
    """
    import aiohttp

    url = base_url + "/v1/completions"
    results: list[RequestResult | None] = [None] * len(prompts)
    next_index = 0
    failed = False

    async def worker(session):
        nonlocal next_index, failed
        while not failed and next_index < len(prompts):
            i = next_index
            next_index += 1
            r = await stream_completion(session, url, model, prompts[i], max_tokens, timeout,
                                        read_timeout)
            results[i] = r
            if not r.ok:
                failed = True
            if progress:
                progress.update()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(prompts)))))
        duration = time.perf_counter() - t0
    return [r for r in results if r is not None], duration


def percentile(values, q: float) -> float:
    """Linear interpolation between closest ranks (numpy.percentile's default)."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def request_tpot(r: RequestResult) -> float | None:
    """(latency - TTFT) / (output_tokens - 1), seconds; None below two tokens."""
    if not r.ok or r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


# Server-side counters read from vLLM's Prometheus endpoint before and after each level (per
# engine = DP rank): engine steps and their tokens, preemptions, server-side inter-token latency.
PROM_NAMES = ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum",
              "vllm:num_preemptions_total", "vllm:inter_token_latency_seconds_count",
              "vllm:inter_token_latency_seconds_sum")
_PROM_LINE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_PROM_ENGINE_RE = re.compile(r'engine="([^"]*)"')


def parse_prometheus(text: str, names=PROM_NAMES) -> dict[tuple[str, str], float]:
    """``{(metric name, engine label or ""): value}`` of the wanted names, summed over the
    other labels (model name, ...)."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _PROM_LINE_RE.match(line)
        if not m or m.group(1) not in names:
            continue
        engine = _PROM_ENGINE_RE.search(m.group(2) or "")
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        key = (m.group(1), engine.group(1) if engine else "")
        out[key] = out.get(key, 0.0) + value
    return out


def fetch_metrics(base_url: str, timeout: float = 10.0) -> dict | None:
    """The wanted counters of ``GET /metrics``, or None where the server has no such endpoint
    (the level is still measured)."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as resp:
            return parse_prometheus(resp.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def server_counters(before: dict | None, after: dict | None,
                    duration_s: float) -> dict[str, dict] | None:
    """Per engine, what happened between two ``fetch_metrics``: ``steps`` (engine steps),
    ``steps_per_s``, ``tokens_per_step`` (mean scheduled tokens per step), ``preemptions``,
    ``itl_ms`` (server-side mean inter-token latency)."""
    if before is None or after is None:
        return None

    def delta(name, engine):
        return after.get((name, engine), 0.0) - before.get((name, engine), 0.0)

    out = {}
    for engine in sorted({e for _, e in after}):
        steps = delta("vllm:iteration_tokens_total_count", engine)
        itl_n = delta("vllm:inter_token_latency_seconds_count", engine)
        out[engine or "all"] = dict(
            steps=int(steps),
            steps_per_s=steps / duration_s if duration_s > 0 else None,
            tokens_per_step=(delta("vllm:iteration_tokens_total_sum", engine) / steps
                             if steps else None),
            preemptions=int(delta("vllm:num_preemptions_total", engine)),
            itl_ms=(delta("vllm:inter_token_latency_seconds_sum", engine) / itl_n * 1e3
                    if itl_n else None))
    return out


def format_counters(counters: dict[str, dict] | None) -> str:
    if not counters:
        return "no /metrics"
    return "; ".join(
        f"engine {e}: {c['steps']} steps ({_fmt(c['steps_per_s'], 0)}/s), "
        f"{_fmt(c['tokens_per_step'], 1)} tok/step, ITL {_fmt(c['itl_ms'])} ms, "
        f"{c['preemptions']} preempted" for e, c in counters.items())


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Metrics of one level (times in ms)."""
    ok = [r for r in results if r.ok]
    tpots = [t for t in (request_tpot(r) for r in ok) if t is not None]
    ttfts = [r.ttft for r in ok]
    lat = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def ms(x):
        return round(x * 1e3, 4) if x == x else None  # NaN -> None (JSON)

    return {
        "tpot_ms_mean": ms(statistics.fmean(tpots)) if tpots else None,
        "tpot_ms_p50": ms(percentile(tpots, 50)),
        "tpot_ms_p99": ms(percentile(tpots, 99)),
        "ttft_ms_mean": ms(statistics.fmean(ttfts)) if ttfts else None,
        "ttft_ms_p50": ms(percentile(ttfts, 50)),
        "ttft_ms_p99": ms(percentile(ttfts, 99)),
        "e2e_ms_mean": ms(statistics.fmean(lat)) if lat else None,
        "output_tok_s": round(out_tokens / duration, 3) if duration > 0 else None,
        "req_s": round(len(ok) / duration, 4) if duration > 0 else None,
        "duration_s": round(duration, 3),
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
        "output_tokens_total": out_tokens,
        "prompt_tokens_mean": (round(statistics.fmean(r.prompt_tokens for r in ok), 2)
                               if ok else None),
    }


# ------------------------------------------------------------------------------------------
# Results: files, table, plot
# ------------------------------------------------------------------------------------------

def results_name(gpu: str, world: int, tag: str, quick: bool) -> str:
    name = f"tpot_gsm8k_{gpu}x{world}"
    if tag != DEFAULT_MODEL_DIR.name:
        name += f"_{tag}"
    return name + ("_quick" if quick else "")


def read_rows(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def row_key(row: dict) -> tuple:
    return (row["backend"], int(row["concurrency"]), int(row["repeat"]))


def _fmt(x, nd=2) -> str:
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def _spread(values, nd=2) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{nd}f}"
    return f"{mean:.{nd}f} [{min(values):.{nd}f}..{max(values):.{nd}f}]"


def ratio_table(rows: list[dict]) -> str:
    """Per (model, output_len) group and concurrency: every backend, <backend>/default ratios.

    A ratio's spread is min..max over repeats of b(repeat r) / default(repeat r) (the
    interleaved pairs); with no common repeat, of every b/default pair.
    """
    out = []
    groups = sorted({(r["model"], r["output_len"]) for r in rows})
    for model, output_len in groups:
        sel = [r for r in rows if (r["model"], r["output_len"]) == (model, output_len)]
        others = [b for b in BACKENDS if b != "default" and any(r["backend"] == b for r in sel)]
        first = sel[0]
        out.append(f"{model}, {first.get('gpu')} x{first.get('world')}, output {output_len} "
                   f"tokens, commit {first.get('commit')}, vLLM {first.get('vllm_version')}; "
                   f"mean [min..max over repeats]")
        head = f"{'conc':>4} {'prompts':>7} | {'TPOT ms default':>22} |"
        for b in others:
            head += (f" {'TPOT ms ' + b:>22} {'TPOT ' + b + '/def':>21} "
                     f"{'tok/s ' + b + '/def':>21} |")
        out.append(head + " TTFT ms " + " / ".join(["default"] + others))
        for conc in sorted({int(r["concurrency"]) for r in sel}):
            by = {b: {int(r["repeat"]): r for r in sel
                      if r["backend"] == b and int(r["concurrency"]) == conc} for b in BACKENDS}
            d = by["default"]

            def ratios(p, field):
                common = sorted(set(d) & set(p))
                pairs = ([(p[k], d[k]) for k in common] if common
                         else [(x, y) for x in p.values() for y in d.values()])
                return [x[field] / y[field] for x, y in pairs if x.get(field) and y.get(field)]

            prompts = sorted({r["num_prompts"] for b in ["default"] + others
                              for r in by[b].values()})
            line = (f"{conc:>4} {'/'.join(map(str, prompts)):>7} | "
                    f"{_spread([r['tpot_ms_mean'] for r in d.values()]):>22} |")
            for b in others:
                p = by[b]
                line += (f" {_spread([r['tpot_ms_mean'] for r in p.values()]):>22} "
                         f"{_spread(ratios(p, 'tpot_ms_mean'), 3):>21} "
                         f"{_spread(ratios(p, 'output_tok_s'), 3):>21} |")
            ttft = [[r["ttft_ms_mean"] for r in by[b].values()] for b in ["default"] + others]
            out.append(line + " " + " / ".join(_fmt(statistics.fmean(v), 1) if v else "-"
                                                for v in ttft))
    return "\n".join(out)


def plot(rows: list[dict], path, title: str) -> Path | None:
    """TPOT (mean with min..max over repeats, p99 dotted) and output tok/s vs concurrency."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    groups = sorted({(r["model"], r["output_len"]) for r in rows})
    styles = {"default": ("tab:blue", "o"), "petit": ("tab:red", "s"),
              "petit-experts": ("tab:green", "^")}
    for gi, (model, output_len) in enumerate(groups):
        for backend in BACKENDS:
            sel = [r for r in rows if (r["model"], r["output_len"], r["backend"]) ==
                   (model, output_len, backend) and r.get("tpot_ms_mean")]
            if not sel:
                continue
            color, marker = styles[backend]
            label = backend if len(groups) == 1 else f"{backend} {model} out{output_len}"
            ls = ["-", "--", ":", "-."][gi % 4]
            concs = sorted({int(r["concurrency"]) for r in sel})
            for ax, field in ((axes[0], "tpot_ms_mean"), (axes[1], "output_tok_s")):
                vals = [[r[field] for r in sel if int(r["concurrency"]) == c] for c in concs]
                mean = [statistics.fmean(v) for v in vals]
                err = [[max(0.0, m - min(v)) for m, v in zip(mean, vals)],
                       [max(0.0, max(v) - m) for m, v in zip(mean, vals)]]
                ax.errorbar(concs, mean, yerr=err, color=color, marker=marker, ls=ls,
                            capsize=3, label=label)
            p99 = [statistics.fmean([r["tpot_ms_p99"] for r in sel
                                     if int(r["concurrency"]) == c and r.get("tpot_ms_p99")]
                                    or [float("nan")]) for c in concs]
            axes[0].plot(concs, p99, color=color, ls=":", alpha=0.6, label=f"{label} p99")
    axes[0].set(xscale="log", xlabel="concurrency (requests in flight)",
                ylabel="TPOT (ms)", title="time per output token (mean, min..max of repeats)")
    axes[1].set(xscale="log", xlabel="concurrency (requests in flight)",
                ylabel="output tokens / s", title="output throughput")
    for ax in axes:
        concs = sorted({int(r["concurrency"]) for r in rows})
        ax.set_xticks(concs)
        ax.set_xticklabels([str(c) for c in concs])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_title(rows: list[dict]) -> str:
    r = rows[0]
    return (f"vllm serve {r['model']} (dummy weights), {r['gpu']} x{r['world']} DP+EP, GSM8K "
            f"prompts, {r['output_len']} output tokens, commit {r['commit']}, "
            f"vLLM {r['vllm_version']}")


def report(path) -> int:
    rows = read_rows(path)
    if not rows:
        print(f"{path}: no rows", file=sys.stderr)
        return 1
    print(ratio_table(rows))
    png = plot(rows, Path(path).with_suffix(".png"), plot_title(rows))
    if png:
        print(f"wrote {png}")
    return 0


# ------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------

def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds through the `finally` blocks that stop servers


class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.errors: list[str] = []
        self.skipped: list[str] = []
        self.logs: list[Path] = []
        self.start_s: list[float] = []      # measured server start-up times
        self.level_tpot: dict[int, float] = {}  # concurrency -> last measured TPOT (s)
        self.out_of_time = False  # once something is skipped, keep the interleaved order
        self.ran_any = False      # a server was started by this invocation
        self.profile_rows: Path | None = None  # --profile-steps results file

    # --- time budget (--max-runtime) ---
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def guess_start_s(self) -> float:
        if self.start_s:
            return max(self.start_s[-2:])
        return self.args.startup_guess or 120.0 + 4.0 * self.layers  # ~300 s for 48 layers

    def guess_level_s(self, conc: int) -> float:
        n = self.per_level[conc]
        tpot = self.level_tpot.get(conc, (2.0 + 0.4 * self.layers) * 1e-3)
        wave = 0.3 + self.args.output_len * tpot
        extra = 0.0
        if self.args.profile_steps and conc in self.args.profile_concurrency:
            extra = 2 * wave * 3 + 30  # two waves slowed by the profiler, writing the traces
        return (math.ceil(n / conc) + 1) * wave + extra  # + the warm-up wave

    def would_fit(self, seconds: float) -> bool:
        limit = self.args.max_runtime
        return not limit or self.elapsed() + seconds + self.args.stop_timeout <= limit

    def time_left(self) -> float:
        if not self.args.max_runtime:
            return float("inf")
        return self.args.max_runtime - self.elapsed() - self.args.stop_timeout

    def run(self) -> int:
        a = self.args
        prompts = load_prompts(a.data)
        num_prompts = min(a.num_prompts or len(prompts), len(prompts))
        if a.num_prompts and a.num_prompts > len(prompts):
            log(f"--num-prompts {a.num_prompts} > {len(prompts)} questions: using {len(prompts)}")
        self.prompts = prompts
        self.per_level = {c: prompts_per_level(num_prompts, c, a.waves) for c in a.concurrency}

        src_config = read_config(a.model_dir)
        self.layers = a.num_layers or int(src_config.get("num_hidden_layers", 48))
        model_dir = model_with_layers(a.model_dir, a.num_layers)
        self.model_dir = model_dir
        self.tag = model_tag(a.model_dir, a.num_layers)
        self.attention = (a.attention_backend if a.attention_backend != "auto"
                          else "TRITON_MLA" if is_mla(src_config) else "TRITON_ATTN")
        gpus = visible_gpus()
        dp = a.dp or len(gpus)
        if dp < 2 and not a.server_cmd:
            raise BenchError(f"data + expert parallel needs >= 2 GPUs; found {len(gpus)} "
                             f"(nvidia-smi, CUDA_VISIBLE_DEVICES)")
        self.dp = dp
        gpu = a.gpu_name or (short_gpu_name(gpus[0]) if gpus else "unknown")
        results_dir = Path(a.results_dir)
        self.jsonl = results_dir / (results_name(gpu, dp, self.tag, a.quick) + ".jsonl")
        self.png = self.jsonl.with_suffix(".png")
        plan = [(rep, b) for rep in range(a.repeats) for b in a.backends]

        existing = read_rows(self.jsonl) if a.resume else []
        for r in existing:
            mismatch = [k for k, v in (("model", self.tag), ("world", dp), ("gpu", gpu),
                                       ("output_len", a.output_len)) if r.get(k) != v]
            if int(r.get("concurrency", 0)) in self.per_level and \
                    r.get("num_prompts") != self.per_level[int(r["concurrency"])]:
                mismatch.append("num_prompts")
            if mismatch:
                raise BenchError(f"--resume: {self.jsonl} has rows of another configuration "
                                 f"({', '.join(mismatch)} differ, e.g. {r}); use another "
                                 f"--results-dir or drop --resume")
        self.rows = existing
        done = {row_key(r) for r in existing}
        todo = {(rep, b): [c for c in a.concurrency if (b, c, rep) not in done]
                for rep, b in plan}

        log(f"model {self.tag} ({model_dir}), {self.attention}, DP={dp} x EP on {gpu}; "
            f"levels {a.concurrency}, prompts/level "
            f"{[self.per_level[c] for c in a.concurrency]}, output {a.output_len} tokens, "
            f"order {' '.join(f'{b}#{rep}' for rep, b in plan)}")
        if a.resume:
            log(f"--resume: {len(existing)} rows in {self.jsonl}; to run: "
                f"{sum(len(v) for v in todo.values())} levels on "
                f"{sum(1 for v in todo.values() if v)} server(s)")
        if a.dry_run:
            for (rep, b), levels in todo.items():
                if levels:
                    env = server_env(b, a.strict)
                    delta = {k: env[k] for k in sorted(env) if os.environ.get(k) != env[k]}
                    cmd = serve_command(a, model_dir, self.tag, a.port or 8000, dp,
                                        self.attention)
                    print(f"{b}#{rep} levels {levels}: env {delta}\n  $ {shlex.join(cmd)}")
            print(f"results: {self.jsonl}")
            return 0

        if any(b != "default" for b in a.backends) and not a.server_cmd:
            check_plugin_visible(a.python, server_env("petit", a.strict))
        self.meta = {"gpu": gpu, "world": dp, "model": self.tag, "commit": commit_stamp(ROOT),
                     "vllm_version": a.vllm_version
                     or probe_vllm_version(a.python, server_env("default", False))}
        log(f"commit {self.meta['commit']}, vLLM {self.meta['vllm_version']}, "
            f"results {self.jsonl}")

        for (rep, backend), levels in todo.items():
            if not levels:
                continue
            # the whole server run must fit, or at least its first level if nothing ran yet
            # (else no invocation could ever make progress)
            start = self.guess_start_s()
            if self.out_of_time or not (
                    self.would_fit(start + sum(self.guess_level_s(c) for c in levels))
                    or (not self.ran_any and self.would_fit(start + self.guess_level_s(
                        levels[0])))):
                if not self.ran_any and not self.out_of_time:
                    need = start + self.guess_level_s(levels[0]) + a.stop_timeout
                    raise BenchError(
                        f"--max-runtime {a.max_runtime:.0f}s: one server start plus its first "
                        f"level (c={levels[0]}, {self.per_level[levels[0]]} prompts) is expected "
                        f"to take ~{need:.0f}s, so no run could ever finish; send fewer prompts "
                        f"(--waves K or --num-prompts N) or raise --max-runtime")
                self.out_of_time = True
                self.skipped.append(f"{backend}#{rep} {levels}")
                continue
            try:
                self.ran_any = True
                self.server_run(backend, rep, levels)
            except HealthTimeout as e:
                if not e.budget_cut:
                    self.errors.append(f"{backend}#{rep}: {e}")
                    log(f"ERROR {backend}#{rep}: {e}")
                    continue
                self.out_of_time = True
                self.skipped.append(f"{backend}#{rep} {levels} (start-up outlasted the budget)")
                log(f"{backend}#{rep}: not healthy within the --max-runtime budget; stopped")
            except BenchError as e:
                self.errors.append(f"{backend}#{rep}: {e}")
                log(f"ERROR {backend}#{rep}: {e}")
        return self.finish(todo)

    def server_run(self, backend: str, rep: int, levels: list[int]) -> None:
        a = self.args
        port = a.port or free_port()
        deadline = time.monotonic() + 60
        while port_in_use(port):
            if time.monotonic() > deadline:
                raise BenchError(f"port {port} is still in use")
            time.sleep(1)
        wait_gpus_idle()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_path = Path(a.log_dir) / f"server_{self.tag}_{backend}_r{rep}_{stamp}.log"
        n = 1
        while log_path.exists():  # never overwrite an earlier server's log
            log_path = log_path.with_name(f"server_{self.tag}_{backend}_r{rep}_{stamp}-{n}.log")
            n += 1
        profile_dir = None
        if a.profile_steps and set(a.profile_concurrency) & set(levels):
            profile_dir = Path(a.log_dir) / log_path.stem.replace("server_", "profile_", 1)
            profile_dir.mkdir(parents=True, exist_ok=True)
        cmd = serve_command(a, self.model_dir, self.tag, port, self.dp, self.attention,
                            profile_dir)
        env = server_env(backend, a.strict)
        if profile_dir is not None:  # the per-step ranges summarize_trace counts steps by
            env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
        server = Server(cmd, env, log_path, port, a.stop_timeout)
        log(f"{backend}#{rep}: starting server on port {port} "
            f"(VLLM_USE_PETIT_MOE={env.get('VLLM_USE_PETIT_MOE', 'unset')}), log {log_path}")
        self.logs.append(log_path)
        server.start()
        try:
            allowed = max(1.0, min(a.health_timeout, self.time_left()))
            try:
                start_s = server.wait_healthy(allowed, a.health_poll)
            except HealthTimeout as e:
                e.budget_cut = allowed < a.health_timeout
                raise
            self.start_s.append(start_s)
            ok, evidence = check_backend(server.log_text(), backend)
            log(f"{backend}#{rep}: healthy after {start_s:.0f}s; MoE backend: {evidence}")
            if not ok:
                raise BenchError(f"wrong MoE backend for '{backend}': {evidence}; log {log_path}")
            procs = server.log_text().count(LOG_PETIT_USED)
            if backend != "default" and procs < self.dp:
                log(f"WARNING: {procs} process(es) logged petit, expected one per DP rank "
                    f"({self.dp})")
            for conc in levels:
                if self.out_of_time or not self.would_fit(self.guess_level_s(conc)):
                    self.out_of_time = True
                    self.skipped.append(f"{backend}#{rep} c={conc}")
                    continue
                self.level(server, backend, rep, conc, start_s, evidence, log_path)
                if profile_dir is not None and conc in a.profile_concurrency:
                    self.profile_level(server, backend, rep, conc, profile_dir)
        finally:
            how = server.stop()
            log(f"{backend}#{rep}: server {how}")
            if port_in_use(port):
                log(f"WARNING: port {port} still in use after the server stopped")

    def level(self, server: Server, backend: str, rep: int, conc: int, start_s: float,
              evidence: str, log_path: Path) -> None:
        a = self.args
        n = self.per_level[conc]
        prompts = self.prompts[:n]
        warm = self.prompts[::-1][:conc]  # other questions, one short wave
        warm_res, _ = asyncio.run(run_level(server.base_url, self.tag, warm, conc,
                                            min(16, a.output_len), a.request_timeout,
                                            a.read_timeout))
        bad = [r for r in warm_res if not r.ok]
        if bad or len(warm_res) != len(warm):
            raise BenchError(f"warm-up at concurrency {conc} failed: "
                             f"{bad[0].error if bad else 'requests not sent'}\n"
                             f"{server.log_tail(20)}")
        progress = _Progress(n, f"{backend}#{rep} c={conc}", not a.no_progress)
        before = fetch_metrics(server.base_url)
        try:
            results, duration = asyncio.run(run_level(
                server.base_url, self.tag, prompts, conc, a.output_len, a.request_timeout,
                a.read_timeout, progress))
        finally:
            progress.close()
        counters = server_counters(before, fetch_metrics(server.base_url), duration)
        metrics = summarize(results, duration)
        failed = [r for r in results if not r.ok]
        if failed or len(results) != n:
            raise BenchError(f"concurrency {conc}: {len(failed)} request(s) failed, "
                             f"{n - len(results)} not sent; first error: "
                             f"{failed[0].error if failed else '-'}\n{server.log_tail(20)}")
        short = sum(1 for r in results if r.output_tokens != a.output_len)
        if short:
            log(f"WARNING: {short} request(s) returned != {a.output_len} tokens")
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        values = dict(self.meta, date=date, backend=backend, concurrency=conc, num_prompts=n,
                      output_len=a.output_len, repeat=rep, **metrics)
        row = {k: values[k] for k in ROW_FIELDS}
        row.update({k: v for k, v in metrics.items() if k not in row})
        row.update(num_wrong_length=short, num_layers=self.layers,
                   attention_backend=self.attention, max_model_len=a.max_model_len,
                   max_num_seqs=a.max_num_seqs, api="/v1/completions stream",
                   prompt_format=PROMPT_FORMAT, server_start_s=round(start_s, 1),
                   backend_evidence=evidence, server_log=log_path.name,
                   server_counters=counters)
        self.rows = [r for r in self.rows if row_key(r) != row_key(row)] + [row]
        self.rows.sort(key=lambda r: (r["repeat"], BACKENDS.index(r["backend"]),
                                      r["concurrency"]))
        write_rows(self.jsonl, self.rows)
        if metrics["tpot_ms_mean"]:
            self.level_tpot[conc] = metrics["tpot_ms_mean"] / 1e3
        log(f"{backend}#{rep} c={conc}: {n} req in {duration:.1f}s, TPOT mean "
            f"{_fmt(metrics['tpot_ms_mean'])} p50 {_fmt(metrics['tpot_ms_p50'])} p99 "
            f"{_fmt(metrics['tpot_ms_p99'])} ms, TTFT {_fmt(metrics['ttft_ms_mean'], 1)} ms, "
            f"{_fmt(metrics['output_tok_s'], 0)} tok/s, {_fmt(metrics['req_s'])} req/s; "
            f"server: {format_counters(counters)}")

    def profile_level(self, server: Server, backend: str, rep: int, conc: int,
                      profile_dir: Path) -> None:
        """--profile-steps: two more waves at `conc` (untimed) with vLLM's profiler started
        before them; the workers' traces are summarized (``summarize_trace``) into
        profile_<results name>.jsonl. A failure here is logged, not fatal: the level's row
        is already written."""
        a = self.args
        prompts = (self.prompts * 2)[:2 * conc]
        earlier = set(profile_dir.glob("*.pt.trace.json*"))  # another level's, same server
        try:
            post_local(server.base_url + "/start_profile", timeout=120)
            results, duration = asyncio.run(run_level(
                server.base_url, self.tag, prompts, conc, a.output_len, a.request_timeout,
                a.read_timeout))
            post_local(server.base_url + "/stop_profile", timeout=600)
        except (urllib.error.URLError, OSError) as e:
            log(f"WARNING {backend}#{rep} c={conc}: profiling failed: {e}")
            return
        if not all(r.ok for r in results):
            log(f"WARNING {backend}#{rep} c={conc}: a profiled request failed")
        traces = sorted(set(profile_dir.glob("*.pt.trace.json*")) - earlier)
        if not traces:
            log(f"WARNING {backend}#{rep} c={conc}: no trace in {profile_dir}")
            return
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        path = self.jsonl.with_name("profile_" + self.jsonl.name)
        rows = read_rows(path)
        for trace in traces:
            try:
                summary = summarize_trace(trace)
            except (ValueError, OSError, json.JSONDecodeError) as e:
                log(f"WARNING {backend}#{rep} c={conc}: {e}")
                continue
            log(format_profile(f"{backend}#{rep} c={conc}", summary))
            rows.append(dict(self.meta, date=date, backend=backend, repeat=rep,
                             concurrency=conc, output_len=a.output_len,
                             wave_s=round(duration, 2), **summary))
        write_rows(path, rows)
        self.profile_rows = path

    def finish(self, todo) -> int:
        a = self.args
        missing = [(b, c, rep) for (rep, b), levels in todo.items() for c in levels
                   if (b, c, rep) not in {row_key(r) for r in self.rows}]
        if self.rows:
            print("\n" + ratio_table(self.rows))
            png = plot(self.rows, self.png, plot_title(self.rows))
            log(f"wrote {self.jsonl}" + (f" and {png.name}" if png else ""))
            if a.out_dir:
                out = Path(a.out_dir)
                out.mkdir(parents=True, exist_ok=True)
                for f in [self.jsonl] + ([png] if png else []):
                    shutil.copyfile(f, out / f.name)
        if a.out_dir:
            out = Path(a.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            if self.profile_rows and self.profile_rows.is_file():
                shutil.copyfile(self.profile_rows, out / self.profile_rows.name)
            for f in self.logs:
                if f.is_file():
                    shutil.copyfile(f, out / f.name)
        for e in self.errors:
            print(f"ERROR {e.splitlines()[0]}")
        if self.errors:
            print(f"FAILED: {len(self.errors)} error(s); {len(missing)} measurement(s) missing")
            return 1
        if missing:
            print(f"INCOMPLETE: {len(missing)} measurement(s) left (--max-runtime "
                  f"{a.max_runtime:.0f}s; skipped {'; '.join(self.skipped)}): rerun the same "
                  f"command with --resume")
            return 3
        print(f"COMPLETE: {len(self.rows)} rows in {self.jsonl} ({self.elapsed():.0f}s)")
        return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return Bench(args).run()
    except (BenchError, ValueError, OSError) as e:
        print(f"bench_tpot_gsm8k: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_tpot_gsm8k: interrupted; servers stopped, finished levels are saved",
              file=sys.stderr)
        return 130
    finally:
        _stop_all_servers()
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
