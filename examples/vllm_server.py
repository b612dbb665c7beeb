"""`vllm serve` for the examples: its command line and environment, one server in its own
process group (start, bounded wait for /health, stop of the whole group), whether the MoE
layers use petit (from the server log), and the GSM8K prompts. Used by bench_tpot_gsm8k.py and
compare_serving.py.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import re
import subprocess
import time
import urllib.request
from pathlib import Path

from vllm_petit_moe.testing.bench_env import VLLM_SAFE_ENV
from vllm_petit_moe.vllm_glue.envs import ENV_VARS

HOST = "127.0.0.1"
PROMPT_FORMAT = "Question: {question}\nAnswer:"
SAFE_ENV = {**VLLM_SAFE_ENV, "PYTHONUNBUFFERED": "1"}
# The plugin's variables (all of them): a server gets only those of its backend, never the
# caller's.
PLUGIN_ENV = tuple(ENV_VARS)
# Backends: "default" (vLLM's own), "petit" (the flag), "petit-experts" (+ our GEMMs behind our
# DP+EP dispatch/combine), "petit-megamoe" (+ the fused layer for steps of up to
# MEGAMOE_MAX_TOKENS tokens per rank, or the caller's bound: one GPU or DP+EP).
BACKENDS = ("default", "petit", "petit-experts", "petit-megamoe")
# The petit-megamoe backend's bound (bench_tpot_gsm8k.py --megamoe-max-tokens): a benchmark
# choice, not a default of the plugin (SingleGpuLayerConfig / EpLayerConfig hold those). Above
# the one-GPU default, so that backend differs from "petit" there (check_backend tells them
# apart by it), and below the sizes where the fused layer trails the other paths
# (docs/experiments/one-gpu-thresholds.md).
MEGAMOE_MAX_TOKENS = 16
# What the plugin logs (vllm_petit_moe/vllm_glue/hook.py, experts.py).
# DP + EP: our dispatch/combine; one GPU: our single-GPU experts
LOG_PETIT_USED = ("vllm-petit-moe: MoE layers use PetitPrepareAndFinalize",
                  "vllm-petit-moe: MoE layers use PetitSingleGpuExperts")
LOG_PETIT_KEPT = ("vllm-petit-moe: VLLM_USE_PETIT_MOE=1 but unsupported here",
                  "vllm-petit-moe: not used for these MoE layers")
LOG_PETIT_EXPERTS_USED = "vllm-petit-moe: MoE layers use PetitEpExperts"
# the fused layer on: DP+EP (PetitEpExperts) or one GPU (PetitSingleGpuExperts)
LOG_FUSED = re.compile(r"the fused layer for steps of up to [1-9]|MegaMoE up to [1-9]")
LOG_ONE_GPU_BOUND = re.compile(r"MegaMoE up to (\d+) tokens")


def _default_one_gpu_bound() -> int:
    """The one-GPU layer's default MegaMoE bound (what the flag alone runs)."""
    from vllm_petit_moe.config import SingleGpuLayerConfig

    return SingleGpuLayerConfig().megamoe_max_tokens


class BenchError(RuntimeError):
    """A server or a benchmark run failed."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_prompts(path, limit: int | None = None) -> list[str]:
    """GSM8K questions as completion prompts ("Question: ...\\nAnswer:"), in file order."""
    with open(path) as f:
        prompts = [PROMPT_FORMAT.format(question=json.loads(line)["question"].strip())
                   for line in f if line.strip()]
    return prompts[:limit] if limit else prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_settings(backend: str, strict: bool = False, routing_strategy: str | None = None,
                    *, megamoe_max_tokens: int = MEGAMOE_MAX_TOKENS) -> dict:
    """What a server's environment gets on top of the caller's (which loses PLUGIN_ENV):
    SAFE_ENV, the backend's flags ("petit": VLLM_USE_PETIT_MOE=1; "petit-experts": also
    VLLM_PETIT_MOE_EXPERTS=1; "petit-megamoe": also VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS=
    megamoe_max_tokens; "default": none) and vLLM's routing simulation (dummy weights)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {BACKENDS}")
    if megamoe_max_tokens < 1:
        raise ValueError(f"megamoe_max_tokens must be >= 1, got {megamoe_max_tokens}")
    env = dict(SAFE_ENV)
    if backend != "default":
        env["VLLM_USE_PETIT_MOE"] = "1"
        if strict:
            env["VLLM_PETIT_MOE_STRICT"] = "1"
    if backend == "petit-experts":
        env["VLLM_PETIT_MOE_EXPERTS"] = "1"
    if backend == "petit-megamoe":
        env["VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS"] = str(megamoe_max_tokens)
    if routing_strategy:
        env.update(VLLM_MOE_ROUTING_SIMULATION_STRATEGY=routing_strategy,
                   VLLM_RANDOMIZE_DP_DUMMY_INPUTS="1")
    return env


def server_env(backend: str, strict: bool = False, routing_strategy: str | None = None,
               base: dict | None = None, *, megamoe_max_tokens: int = MEGAMOE_MAX_TOKENS) -> dict:
    """The server's whole environment: `base` (default os.environ) without PLUGIN_ENV, then
    server_settings()."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in PLUGIN_ENV}
    return {**env, **server_settings(backend, strict, routing_strategy,
                                     megamoe_max_tokens=megamoe_max_tokens)}


def vllm_serve_command(python: str, model_dir, served_name: str, port: int, dp: int,
                       attention_backend: str, *, max_model_len: int,
                       gpu_memory_utilization: float, load_format: str | None = None,
                       max_num_seqs: int | None = None,
                       max_num_batched_tokens: int | None = None) -> list[str]:
    """`vllm serve` on 127.0.0.1, bf16, seed 0, CUDA graphs on, no prefix caching; DP = `dp`,
    + expert parallel when dp > 1. (python -m: the DP coordinator is spawned, and a `vllm`
    script without a __main__ guard would be re-run by it.)"""
    return ([python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
             "--served-model-name", served_name, "--host", HOST, "--port", str(port)]
            + (["--load-format", load_format] if load_format else [])
            + ["--dtype", "bfloat16", "--seed", "0", "--data-parallel-size", str(dp)]
            + (["--enable-expert-parallel"] if dp > 1 else [])
            + ["--attention-backend", attention_backend, "--max-model-len", str(max_model_len)]
            + (["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else [])
            + (["--max-num-batched-tokens", str(max_num_batched_tokens)]
               if max_num_batched_tokens else [])
            + ["--gpu-memory-utilization", str(gpu_memory_utilization),
               "--no-enable-prefix-caching", "--disable-uvicorn-access-log"])


def check_backend(log_text: str, backend: str) -> tuple[bool, str]:
    """From the server log: (the backend asked for is the one in use, evidence)."""
    def grab(*markers):  # the plugin's lines, from its prefix on
        return [ln[ln.index("vllm-petit-moe:"):][:300] for ln in log_text.splitlines()
                if any(m in ln for m in markers)]

    used, kept, experts = grab(*LOG_PETIT_USED), grab(*LOG_PETIT_KEPT), grab(LOG_PETIT_EXPERTS_USED)
    fused = [ln for ln in used + experts if LOG_FUSED.search(ln)]
    if backend == "default":
        return (not used, used[0] if used else "vLLM's own MoE path (no petit line)")
    if backend == "petit-experts" and not any("petit grouped GEMMs" in ln for ln in experts):
        return False, f"petit's GEMMs asked for, but no '{LOG_PETIT_EXPERTS_USED} (...petit " \
                      "grouped GEMMs...)' line"
    if backend == "petit-megamoe" and not fused:
        return False, "the fused layer asked for, but no plugin line says it is on"
    # "petit" is the flag with the plugin's defaults: on one GPU they include MegaMoE up to
    # SingleGpuLayerConfig's bound; another bound, or PetitEpExperts, comes from an opt-in
    opted_in = experts + [ln for ln in used if (m := LOG_ONE_GPU_BOUND.search(ln))
                          and int(m.group(1)) != _default_one_gpu_bound()]
    if backend == "petit" and opted_in:
        return False, f"petit asked for alone, but: {opted_in[0]}"
    if used and not kept:
        return True, f"{used[0]} [{len(used)} process(es)]" + (f"; {experts[0]}" if experts else "")
    return False, "flag on, but " + (kept[0] if kept else f"no '{LOG_PETIT_USED[0]}' line")


class Server:
    """One `vllm serve` in its own process group, output to a log file."""

    def __init__(self, cmd: list[str], env: dict, log_path, port: int):
        self.cmd, self.env, self.log_path, self.port = cmd, env, Path(log_path), port
        self.base_url = f"http://{HOST}:{port}"
        self.proc = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as f:
            f.write(("$ " + shlex.join(self.cmd) + "\n").encode())
            f.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until GET /health answers 200; BenchError if the server exits or times out."""
        t0, opener = time.monotonic(), urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while self.proc.poll() is None and time.monotonic() - t0 < timeout:
            try:
                with opener.open(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                time.sleep(2)
        tail = "\n".join("  | " + ln[:300] for ln in self.log_text().splitlines()[-30:])
        state = (f"exited with {self.proc.returncode}" if self.proc.poll() is not None
                 else f"not healthy after {timeout:.0f}s")
        raise BenchError(f"server {state}; log {self.log_path}:\n{tail}")

    def stop(self) -> str:
        """SIGINT (vLLM's clean shutdown) to the process group, then SIGTERM, then SIGKILL,
        each until the whole group (API server, engine cores, workers) is gone."""
        if self.proc is None:
            return "not running"
        how = "already gone"
        for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            how, deadline = f"stopped by {sig.name}", time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the API server, else its zombie keeps the group
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    self.proc = None
                    return how
                time.sleep(0.5)
        self.proc = None
        return how




# For compare_serving.py: the GPUs, the vLLM version and the plugin as the servers see them.

def visible_gpus() -> list[str]:
    """Names of the GPUs nvidia-smi lists, the first len(CUDA_VISIBLE_DEVICES) if set."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names = [ln.strip() for ln in out.splitlines() if ln.strip()]
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return names[:len([d for d in cvd.split(",") if d.strip()])] if cvd is not None else names


def short_gpu_name(name: str) -> str:
    return name.replace("NVIDIA ", "").strip().replace(" ", "-") or "unknown"


def _probe(python: str, env: dict, code: str) -> str:
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                             timeout=300).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[-1] if out else ""


def probe_vllm_version(python: str, env: dict) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    return _probe(python, env, code) or "unknown"


def check_plugin_visible(python: str, env: dict) -> None:
    """BenchError unless `python`, in `env`, sees the plugin's vllm.general_plugins entry
    point and imports it (else a flag-on server starts with vLLM's path, rejected only
    after its whole start-up)."""
    code = ("from importlib.metadata import entry_points as e; import vllm_petit_moe.plugin; "
            "print([x.value for x in e(group='vllm.general_plugins') if x.name == 'petit_moe'])")
    if _probe(python, env, code) in ("", "[]"):
        raise BenchError(
            f"{python} does not see the vllm-petit-moe plugin: install it into the environment "
            "vllm runs from (from the repo root: CUDA_HOME=/usr/local/cuda pip install "
            "--no-build-isolation -e .; README.md, \"Install\"), or pass that environment's "
            "python")
