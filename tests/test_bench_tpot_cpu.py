"""CPU tests of examples/bench_tpot_gsm8k.py (the `vllm serve` TPOT benchmark).

The real server needs GPUs, so a fake OpenAI-compatible streaming server stands in for
`vllm serve`: this file run as a script (`python tests/test_bench_tpot_cpu.py fake-server ...`,
standard library only). It logs what vLLM and the plugin log (the petit decision lines when
VLLM_USE_PETIT_MOE=1), streams /v1/completions as server-sent events with a set time per token
(faster when the flag is on), and starts a child process in its process group the way vLLM
starts its engine cores. Everything else is the benchmark's real code path: argument
parsing, prompt loading, the process-group start/stop, the health wait, the log check, the
aiohttp client, the metrics, the JSONL writer, the table and the plot.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_PATH = ROOT / "examples" / "bench_tpot_gsm8k.py"
FAKE = f"{{python}} {Path(__file__).resolve()} fake-server --port {{port}} --dp {{dp}}"


# ------------------------------------------------------------------------------------------
# The fake server (run as a script)
# ------------------------------------------------------------------------------------------

def fake_trace(steps: int, rank: int) -> dict:
    """A torch-profiler trace of `steps` engine steps of 1000 us each (plus one forward range
    closing the window): per step a 100 us dispatch, a 300 us Triton MoE GEMM on one stream
    overlapping a 200 us dense GEMM on another by 100 us, a 50 us memcpy; rank 1's dispatch
    takes 150 us. Before the window, a kernel that must not be counted."""
    ev = [{"ph": "X", "cat": "kernel", "name": "dispatch_kernel<early>", "ts": 0, "dur": 999}]
    for i in range(steps + 1):
        t = 10_000 + 1000 * i
        ev.append({"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: forward",
                   "ts": t, "dur": 400})
        if i == steps:
            break
        ev += [{"ph": "X", "cat": "kernel", "name": "dispatch_kernel<bf16>", "ts": t + 10,
                "dur": 150 if rank else 100},
               {"ph": "X", "cat": "kernel", "name": "fused_moe_kernel", "ts": t + 200,
                "dur": 300},
               {"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8", "ts": t + 400,
                "dur": 200},
               {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": t + 700,
                "dur": 50},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t + 5, "dur": 30}]
    return {"traceEvents": ev}


def fake_server_main(argv) -> int:
    import http.server

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--profiler-config", default=None)
    args = ap.parse_args(argv)
    profiler = json.loads(args.profiler_config) if args.profiler_config else None
    mode = os.environ.get("FAKE_MODE", "normal")
    petit = os.environ.get("VLLM_USE_PETIT_MOE") == "1"
    tpot = float(os.environ.get("FAKE_TPOT_MS_PETIT" if petit else "FAKE_TPOT_MS", "3")) / 1e3
    ttft = float(os.environ.get("FAKE_TTFT_MS", "5")) / 1e3
    print("fake vllm serve: env " + " ".join(
        f"{k}={os.environ.get(k)}" for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                             "NVSHMEM_DISABLE_NVLS", "VLLM_ALLREDUCE_USE_SYMM_MEM",
                                             "VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE",
                                             "TRANSFORMERS_OFFLINE", "VLLM_USE_PETIT_MOE",
                                             "VLLM_PETIT_MOE_STRICT", "VLLM_PETIT_MOE_EXPERTS",
                                             "VLLM_CUSTOM_SCOPES_FOR_PROFILING")),
          flush=True)
    if mode == "crash":
        print("Traceback (most recent call last):\nRuntimeError: fake engine failed", flush=True)
        return 3
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if mode == "ignore-term" else ""
    child = subprocess.Popen([sys.executable, "-c",
                              f"import signal, time; {ignore}time.sleep(600)"])
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("FAKE_PIDFILE"):
        with open(os.environ["FAKE_PIDFILE"], "a") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
    for rank in range(args.dp):
        prefix = f"(EngineCore_DP{rank} pid={os.getpid()}) INFO 11-29 12:00:00 [hook.py:203] "
        if petit and mode != "no-petit-line":
            print(prefix + "vllm-petit-moe: MoE layers use PetitPrepareAndFinalize (petit "
                  "dispatch/combine) instead of MoEPrepareAndFinalizeNaiveDPEPModular: DP=2 x "
                  "EP=2 on one node, bf16", flush=True)
            if os.environ.get("VLLM_PETIT_MOE_EXPERTS") == "1":
                print(prefix + "vllm-petit-moe: MoE layers use PetitExperts (petit grouped "
                      "GEMMs, tile family auto) instead of TritonExperts "
                      "(VLLM_PETIT_MOE_EXPERTS=1)", flush=True)
        elif not petit:
            print(prefix + "vllm-petit-moe: installed, not enabled (set VLLM_USE_PETIT_MOE=1); "
                  "MoE layers use vLLM's own backends", flush=True)
        print(prefix + "Using TRITON Unquantized MoE backend out of potential backends", flush=True)
    ready_at = time.monotonic() + 0.2
    import threading
    lock, counters = threading.Lock(), {"steps": 0, "tokens": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):  # like --disable-uvicorn-access-log
            pass

        def do_GET(self):
            if self.path == "/metrics":  # vLLM's Prometheus text, two engines (DP ranks)
                with lock:
                    steps, tokens = counters["steps"], counters["tokens"]
                body = "".join(
                    f'vllm:iteration_tokens_total_count{{engine="{e}",model_name="m"}} '
                    f'{steps}\nvllm:iteration_tokens_total_sum{{engine="{e}",model_name="m"}} '
                    f'{tokens}\nvllm:num_preemptions_total{{engine="{e}",model_name="m"}} '
                    f'0.0\n' for e in range(args.dp)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            healthy = mode != "never-healthy" and time.monotonic() > ready_at
            code = 200 if (self.path != "/health" or healthy) else 503
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            if self.path in ("/start_profile", "/stop_profile"):  # vLLM's, if configured
                code = 200 if profiler else 404
                if profiler and self.path == "/stop_profile":
                    for rank in range(args.dp):  # what each DP rank's worker would write
                        name = (f"dp{rank}_pp0_tp0_dcp0_ep{rank}_rank{rank}."
                                f"{time.monotonic_ns()}.pt.trace.json")
                        with open(Path(profiler["torch_profiler_dir"]) / name, "w") as f:
                            json.dump(fake_trace(profiler["max_iterations"], rank), f)
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok = (self.path == "/v1/completions" and body.get("stream") is True
                  and body.get("ignore_eos") is True and body.get("temperature") == 0
                  and body["prompt"].startswith("Question: ")
                  and body["prompt"].endswith("\nAnswer:")
                  and body.get("stream_options", {}).get("include_usage") is True)
            if not ok:
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b'{"error": "unexpected request"}')
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = int(body["max_tokens"])
            time.sleep(ttft)
            for i in range(n):
                if i:
                    time.sleep(tpot)
                chunk = {"choices": [{"index": 0, "text": " x",
                                      "finish_reason": "length" if i == n - 1 else None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            with lock:  # one "engine step" per generated token of a request
                counters["steps"] += n
                counters["tokens"] += n
            usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"].split()),
                                              "completion_tokens": n}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()

    http.server.ThreadingHTTPServer.request_queue_size = 256  # a connection per request
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"fake vllm serve: listening on 127.0.0.1:{args.port}", flush=True)
    try:
        server.serve_forever()
    finally:
        child.kill()
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "fake-server":
    sys.exit(fake_server_main(sys.argv[2:]))


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------

import pytest  # noqa: E402


def _load_bench():
    from script_module import load_script
    return load_script("examples/bench_tpot_gsm8k.py")


bench = _load_bench()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _pids(pidfile: Path) -> list[int]:
    if not pidfile.exists():
        return []
    return [int(x) for x in pidfile.read_text().split()]


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_hidden_layers": 6, "layer_types": ["full_attention"] * 6,
        "mlp_only_layers": [0, 5], "max_window_layers": 6, "hidden_size": 64}))
    (d / "tokenizer.json").write_text("{}")
    (d / "tokenizer_config.json").write_text("{}")
    return d


@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_TPOT_MS", "4")
    monkeypatch.setenv("FAKE_TPOT_MS_PETIT", "1")
    monkeypatch.setenv("FAKE_PIDFILE", str(tmp_path / "pids"))
    monkeypatch.setenv("PETIT_COMMIT", "abc1234")
    monkeypatch.setattr(bench, "MODEL_COPY_ROOT", tmp_path / "model-copies")
    for k in ("VLLM_USE_PETIT_MOE", "VLLM_PETIT_MOE_STRICT", "FAKE_MODE"):
        monkeypatch.delenv(k, raising=False)
    yield tmp_path / "pids"
    for pid in _pids(tmp_path / "pids"):  # nothing may survive a test; clean up if it did
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _fake_args(tmp_path, model_dir, *extra):
    return ["--model-dir", str(model_dir), "--server-cmd", FAKE, "--dp", "2",
            "--gpu-name", "TEST", "--vllm-version", "0.24.0-test", "--no-progress",
            "--health-poll", "0.05", "--stop-timeout", "5",
            "--results-dir", str(tmp_path / "results"), "--log-dir", str(tmp_path / "logs"),
            *extra]


# --- arguments, prompts, model copies --------------------------------------------------------

def test_parse_args_defaults_quick_and_errors():
    a = bench.parse_args([])
    assert a.concurrency == [8, 16, 32, 64, 128] and a.output_len == 256 and a.repeats == 2
    assert a.num_prompts is None and a.num_layers == 0 and a.max_num_seqs == 128
    assert a.backends == ["petit", "default"] and a.health_timeout == 900
    assert Path(a.model_dir) == ROOT / "examples" / "models" / "qwen3-30b-a3b"
    q = bench.parse_args(["--quick"])
    assert (q.num_prompts, q.concurrency, q.repeats, q.output_len, q.num_layers) == \
        (160, [8, 64], 1, 128, 4)
    assert q.max_num_seqs == 64
    q2 = bench.parse_args(["--quick", "--num-layers", "0", "--concurrency", "16", "8", "8"])
    assert q2.num_layers == 0 and q2.concurrency == [8, 16] and q2.num_prompts == 160
    assert bench.parse_args(["--model", "/x"]).model_dir == "/x"
    for bad in (["--output-len", "1"], ["--concurrency", "0"], ["--repeats", "0"],
                ["--max-num-seqs", "16"], ["--backends", "petit", "petit"], ["--bogus"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_prompts_per_level():
    assert bench.prompts_per_level(1319, 8, 0) == 1319
    assert bench.prompts_per_level(1319, 8, 4) == 32
    assert bench.prompts_per_level(1319, 128, 16) == 1319
    assert bench.prompts_per_level(160, 64, 0) == 160


def test_load_prompts(tmp_path):
    prompts = bench.load_prompts(bench.DEFAULT_DATA)
    assert len(prompts) == 1319
    assert prompts[0].startswith("Question: Janet\u2019s ducks lay 16 eggs per day.")
    assert all(p.startswith("Question: ") and p.endswith("\nAnswer:") for p in prompts)
    assert len(bench.load_prompts(bench.DEFAULT_DATA, limit=5)) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok?", "answer": "1"}\n{"answer": "no question"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        bench.load_prompts(bad)


def test_project_model_copy_is_complete():
    d = bench.DEFAULT_MODEL_DIR
    cfg = bench.read_config(d)
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_hidden_layers"] == 48
    assert bench.has_tokenizer(d) and (d / "tokenizer_config.json").is_file()
    assert not bench.is_mla(cfg) and bench.is_mla({"kv_lora_rank": 512})


def test_model_with_layers(tmp_path, model_dir):
    assert bench.model_with_layers(model_dir, 0) == model_dir.resolve()
    copy = bench.model_with_layers(model_dir, 4, copy_root=tmp_path / "copies")
    cfg = json.loads((copy / "config.json").read_text())
    assert copy.name == "tiny-model-4l" and cfg["num_hidden_layers"] == 4
    assert cfg["layer_types"] == ["full_attention"] * 4 and cfg["mlp_only_layers"] == [0]
    assert cfg["max_window_layers"] == 4 and cfg["hidden_size"] == 64
    assert (copy / "tokenizer.json").is_file() and (copy / "tokenizer_config.json").is_file()
    assert bench.model_with_layers(model_dir, 4, copy_root=tmp_path / "copies") == copy
    assert bench.model_tag(model_dir, 4) == "tiny-model-4l"
    with pytest.raises(ValueError, match="more|>"):
        bench.model_with_layers(model_dir, 7, copy_root=tmp_path / "copies")
    ds = tmp_path / "deepseek-v3"
    ds.mkdir()
    (ds / "config.json").write_text(json.dumps({"num_hidden_layers": 61,
                                                "first_k_dense_replace": 3, "kv_lora_rank": 512}))
    with pytest.raises(ValueError, match="dense"):
        bench.model_with_layers(ds, 3, copy_root=tmp_path / "copies")
    assert json.loads((bench.model_with_layers(ds, 4, copy_root=tmp_path / "copies")
                       / "config.json").read_text())["num_hidden_layers"] == 4


# --- server command, environment, log check -------------------------------------------------

def test_serve_command_and_env(model_dir, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # must be overridden
    monkeypatch.setenv("SOME_USER_VAR", "kept")
    a = bench.parse_args(["--model-dir", str(model_dir), "--serve-args", "--foo 'a b'"])
    cmd = bench.serve_command(a, model_dir, "tiny", 8123, 2, "TRITON_ATTN")
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir)]
    text = " ".join(cmd)
    for part in ("--data-parallel-size 2", "--enable-expert-parallel", "--load-format dummy",
                 "--attention-backend TRITON_ATTN", "--max-model-len 2048", "--max-num-seqs 128",
                 "--host 127.0.0.1", "--port 8123", "--served-model-name tiny",
                 "--no-enable-prefix-caching"):
        assert part in text
    assert "--enforce-eager" not in cmd and cmd[-2:] == ["--foo", "a b"]
    on, off = bench.server_env("petit", True), bench.server_env("default", True)
    for env in (on, off):
        for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
                     "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1", "SOME_USER_VAR": "kept"}.items():
            assert env[k] == v
    assert on["VLLM_USE_PETIT_MOE"] == "1" and on["VLLM_PETIT_MOE_STRICT"] == "1"
    assert "VLLM_USE_PETIT_MOE" not in off and "VLLM_PETIT_MOE_STRICT" not in off
    assert "VLLM_PETIT_MOE_STRICT" not in bench.server_env("petit", False)
    assert "VLLM_PETIT_MOE_EXPERTS" not in on and "VLLM_PETIT_MOE_EXPERTS" not in off
    both = bench.server_env("petit-experts", True)
    assert both["VLLM_USE_PETIT_MOE"] == both["VLLM_PETIT_MOE_EXPERTS"] == "1"
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer"):
        bench.serve_command(a, model_dir, "tiny", 8123, 2, "TRITON_ATTN")


def test_check_backend_from_log():
    petit_line = ("(EngineCore_DP0 pid=7) INFO [hook.py:203] vllm-petit-moe: MoE layers use "
                  "PetitPrepareAndFinalize (petit dispatch/combine) instead of X: DP=2 x EP=2")
    moe = "(EngineCore_DP0 pid=7) INFO Using TRITON Unquantized MoE backend out of potential"
    ok, ev = bench.check_backend(f"a\n{petit_line}\n{petit_line}\n{moe}\n", "petit")
    assert ok and ev.startswith("vllm-petit-moe: MoE layers use PetitPrepareAndFinalize")
    assert "2 process(es)" in ev and "TRITON Unquantized MoE backend" in ev
    ok, ev = bench.check_backend("nothing\n", "petit")
    assert not ok and "no 'vllm-petit-moe" in ev
    fallback = "WARNING vllm-petit-moe: VLLM_USE_PETIT_MOE=1 but unsupported here: EPLB"
    ok, ev = bench.check_backend(f"{petit_line}\n{fallback}\n", "petit")
    assert not ok and "unsupported here: EPLB" in ev
    ok, ev = bench.check_backend("INFO vllm-petit-moe: not used for these MoE layers (x)", "petit")
    assert not ok
    ok, ev = bench.check_backend("vllm-petit-moe: installed, not enabled (set ...)", "default")
    assert ok and "installed, not enabled" in ev
    assert bench.check_backend("", "default") == (
        True, "vLLM default allgather/reduce-scatter (plugin not loaded)")
    assert not bench.check_backend(petit_line, "default")[0]
    experts_line = ("(EngineCore_DP1 pid=8) INFO [hook.py:327] vllm-petit-moe: MoE layers use "
                    "PetitExperts (petit grouped GEMMs, tile family auto) instead of "
                    "TritonExperts (VLLM_PETIT_MOE_EXPERTS=1)")
    ok, ev = bench.check_backend(f"{petit_line}\n{experts_line}\n{moe}\n", "petit-experts")
    assert ok and "PetitPrepareAndFinalize" in ev and "PetitExperts" in ev
    assert "TRITON Unquantized" not in ev  # vLLM's choice is replaced, not in use
    ok, ev = bench.check_backend(f"{petit_line}\n{moe}\n", "petit-experts")
    assert not ok and "no 'vllm-petit-moe: MoE layers use PetitExperts'" in ev
    no_experts = ("WARNING vllm-petit-moe: VLLM_PETIT_MOE_EXPERTS=1 but PetitExperts cannot "
                  "serve these MoE layers (fp8); they keep vLLM's TritonExperts.")
    ok, ev = bench.check_backend(f"{petit_line}\n{experts_line}\n{no_experts}\n",
                                 "petit-experts")
    assert not ok and "(fp8)" in ev
    ok, ev = bench.check_backend(f"{petit_line}\n{experts_line}\n", "petit")
    assert not ok and "without PetitExperts" in ev
    assert not bench.check_backend(experts_line, "petit-experts")[0]  # no prepare/finalize


# --- metrics ---------------------------------------------------------------------------------

PROM_TEXT = """\
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="q"} 3.0
vllm:iteration_tokens_total_count{engine="0",model_name="q"} 100.0
vllm:iteration_tokens_total_sum{engine="0",model_name="q"} 6400.0
vllm:iteration_tokens_total_count{engine="1",model_name="q"} 90.0
vllm:iteration_tokens_total_sum{engine="1",model_name="q"} 5000.0
vllm:num_preemptions_total{engine="0",model_name="q"} 1.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="q"} 1000.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="q"} 8.0
vllm:num_requests_running{engine="0",model_name="q"} 64.0
"""


def test_server_counters_from_prometheus_text():
    before = bench.parse_prometheus(PROM_TEXT)
    assert before[("vllm:iteration_tokens_total_count", "0")] == 100.0
    assert ("vllm:num_requests_running", "0") not in before  # only the wanted names
    after = dict(before)
    after.update({("vllm:iteration_tokens_total_count", "0"): 300.0,
                  ("vllm:iteration_tokens_total_sum", "0"): 19200.0,
                  ("vllm:num_preemptions_total", "0"): 3.0,
                  ("vllm:inter_token_latency_seconds_count", "0"): 3000.0,
                  ("vllm:inter_token_latency_seconds_sum", "0"): 26.0})
    c = bench.server_counters(before, after, duration_s=2.0)
    assert c["0"] == {"steps": 200, "steps_per_s": 100.0, "tokens_per_step": 64.0,
                      "preemptions": 2, "itl_ms": pytest.approx(9.0)}
    assert c["1"] == {"steps": 0, "steps_per_s": 0.0, "tokens_per_step": None,
                      "preemptions": 0, "itl_ms": None}
    assert bench.server_counters(None, after, 2.0) is None
    text = bench.format_counters(c)
    assert "engine 0: 200 steps (100/s), 64.0 tok/step, ITL 9.00 ms, 2 preempted" in text
    assert bench.format_counters(None) == "no /metrics"
    # a server without the endpoint: None, not an error
    assert bench.fetch_metrics(f"http://127.0.0.1:{bench.free_port()}", timeout=2) is None

def test_metrics_math():
    R = bench.RequestResult
    results = [R(ok=True, ttft=0.100, latency=1.120, output_tokens=256, prompt_tokens=60),
               R(ok=True, ttft=0.050, latency=0.560, output_tokens=256, prompt_tokens=70),
               R(ok=True, ttft=0.200, latency=2.240, output_tokens=256, prompt_tokens=80),
               R(ok=True, ttft=0.010, latency=0.010, output_tokens=1, prompt_tokens=50)]
    assert bench.request_tpot(results[0]) == pytest.approx((1.120 - 0.100) / 255)
    assert bench.request_tpot(results[3]) is None and bench.request_tpot(R()) is None
    m = bench.summarize(results, duration=4.0)  # ms rounded to 0.1 us
    tpots_ms = [4.0, 2.0, 8.0]  # (1.02, 0.51, 2.04 s) / 255 tokens
    assert m["tpot_ms_mean"] == pytest.approx(sum(tpots_ms) / 3, abs=1e-3)
    assert m["tpot_ms_p50"] == pytest.approx(4.0, abs=1e-3)
    assert m["tpot_ms_p99"] == pytest.approx(4.0 + (8.0 - 4.0) * 0.98, abs=1e-3)
    assert m["ttft_ms_mean"] == pytest.approx((100 + 50 + 200 + 10) / 4, abs=1e-3)
    assert m["output_tok_s"] == pytest.approx((3 * 256 + 1) / 4.0, abs=1e-2)
    assert m["req_s"] == pytest.approx(1.0) and m["num_ok"] == 4 and m["num_failed"] == 0
    assert m["prompt_tokens_mean"] == pytest.approx(65)
    import numpy as np
    values = [0.3, 5.0, 1.25, 7.5, 2.0, 9.0, 0.1]
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    empty = bench.summarize([R(ok=False, error="x")], 1.0)
    assert empty["tpot_ms_mean"] is None and empty["tpot_ms_p99"] is None
    assert empty["num_failed"] == 1 and json.dumps(empty)  # JSON-safe (no NaN)


def test_progress_counter_without_a_terminal(capsys):
    prog = bench._Progress(3, "petit#0 c=8", True, interval=0.0)
    for _ in range(3):
        prog.update()
    prog.close()
    out = capsys.readouterr().out  # not a TTY under pytest: counter lines, no tqdm bar
    assert "petit#0 c=8: 1/3 requests done" in out and "2/3" in out and "3/3" not in out
    quiet = bench._Progress(3, "x", False, interval=0.0)
    quiet.update()
    assert capsys.readouterr().out == ""


def test_table_and_plot_and_report(tmp_path):
    def row(backend, conc, rep, tpot, tok_s):
        return dict(gpu="H200", world=2, model="m", commit="c", date="d", vllm_version="v",
                    backend=backend, concurrency=conc, num_prompts=64, output_len=256,
                    tpot_ms_mean=tpot, tpot_ms_p50=tpot, tpot_ms_p99=tpot * 1.2,
                    ttft_ms_mean=50.0, output_tok_s=tok_s, repeat=rep, req_s=1.0)
    rows = [row("default", 8, 0, 10.0, 800), row("petit", 8, 0, 8.0, 1000),
            row("default", 8, 1, 10.0, 800), row("petit", 8, 1, 9.0, 900),
            row("default", 64, 0, 20.0, 3200), row("petit", 64, 0, 15.0, 4000)]
    table = bench.ratio_table(rows)
    line8 = next(ln for ln in table.splitlines() if ln.strip().startswith("8 "))
    assert "0.850 [0.800..0.900]" in line8 and "10.00 [10.00..10.00]" in line8
    assert "8.50 [8.00..9.00]" in line8 and "1.188 [1.125..1.250]" in line8
    line64 = next(ln for ln in table.splitlines() if ln.strip().startswith("64 "))
    assert "0.750" in line64 and "[" not in line64.split("|")[1].split()[-1]
    assert "petit-experts" not in table  # a backend only gets columns when it has rows
    # a third backend: its own columns, ratios against the default of the same repeat
    rows += [row("petit-experts", 8, 0, 5.0, 1600), row("petit-experts", 8, 1, 6.0, 1200)]
    table = bench.ratio_table(rows)
    assert "TPOT petit-experts/def" in table.splitlines()[1]
    line8 = next(ln for ln in table.splitlines() if ln.strip().startswith("8 "))
    parts = line8.split("|")
    assert "0.850 [0.800..0.900]" in parts[2] and "0.550 [0.500..0.600]" in parts[3]
    assert "1.750 [1.500..2.000]" in parts[3]
    line64 = next(ln for ln in table.splitlines() if ln.strip().startswith("64 "))
    assert line64.split("|")[3].split() == ["-", "-", "-"]
    path = tmp_path / "r.jsonl"
    bench.write_rows(path, rows)
    assert bench.read_rows(path) == rows
    assert bench.main(["--report", str(path)]) == 0
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# --- the client against the fake server, and the server lifecycle ----------------------------

def _server(tmp_path, port=None, name="s.log", stop_timeout=5.0):
    port = port or bench.free_port()
    cmd = [sys.executable, __file__, "fake-server", "--port", str(port), "--dp", "2"]
    return bench.Server(cmd, bench.server_env("default", True), tmp_path / name, port,
                        stop_timeout)


def test_client_metrics_against_fake_server(tmp_path, fake_env, monkeypatch):
    import asyncio
    monkeypatch.setenv("FAKE_TPOT_MS", "4")
    monkeypatch.setenv("FAKE_TTFT_MS", "30")
    srv = _server(tmp_path)
    srv.env = bench.server_env("default", True)
    srv.start()
    try:
        assert srv.wait_healthy(10, 0.05) < 10
        prompts = bench.load_prompts(bench.DEFAULT_DATA, limit=6)
        results, duration = asyncio.run(bench.run_level(srv.base_url, "m", prompts, 3, 20,
                                                        30, 10))
        assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
        assert all(r.output_tokens == 20 and r.prompt_tokens > 0 for r in results)
        m = bench.summarize(results, duration)
        # sleeps only overshoot: lower bounds are exact, upper bounds leave room for load
        assert 3.9 <= m["tpot_ms_mean"] <= 40 and m["tpot_ms_p99"] >= m["tpot_ms_p50"]
        assert 29.5 <= m["ttft_ms_mean"] <= 2000
        assert m["output_tok_s"] == pytest.approx(120 / duration, abs=1e-3)  # rounded to 3 decimals
        # a failing request is reported and stops the level from issuing more
        bad, _ = asyncio.run(bench.run_level(srv.base_url, "m", ["not a GSM8K prompt"] * 5, 1,
                                             4, 30, 10))
        assert len(bad) == 1 and not bad[0].ok and "HTTP 400" in bad[0].error
    finally:
        assert srv.stop() == "stopped by SIGTERM"
    assert not bench.port_in_use(srv.port)
    assert not any(_alive(p) for p in _pids(fake_env))


def test_stop_kills_a_group_that_ignores_sigterm(tmp_path, fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "ignore-term")
    srv = _server(tmp_path, stop_timeout=0.5)
    srv.env = dict(os.environ)
    srv.start()
    srv.wait_healthy(10, 0.05)
    pgid = srv.pgid
    assert len(bench.group_members(pgid)) == 2  # server + its "engine core"
    assert srv.stop().startswith("killed (SIGKILL")
    assert bench.group_members(pgid) == [] and not any(_alive(p) for p in _pids(fake_env))
    assert srv.stop() == "not running"


def test_health_timeout_and_crash_report_the_log(tmp_path, fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "never-healthy")
    srv = _server(tmp_path, name="never.log")
    srv.env = dict(os.environ)
    srv.start()
    try:
        with pytest.raises(bench.BenchError, match=r"not healthy after 1s(.|\n)*listening on"):
            srv.wait_healthy(1.0, 0.05)
    finally:
        srv.stop()
    monkeypatch.setenv("FAKE_MODE", "crash")
    srv = _server(tmp_path, name="crash.log")
    srv.env = dict(os.environ)
    srv.start()
    try:
        with pytest.raises(bench.BenchError, match=r"exited with 3(.|\n)*RuntimeError: fake"):
            srv.wait_healthy(10, 0.05)
    finally:
        srv.stop()


# --- end to end ------------------------------------------------------------------------------

def test_end_to_end_interleaved_runs_files_and_resume(tmp_path, model_dir, fake_env, capsys):
    out = tmp_path / "out"
    args = _fake_args(tmp_path, model_dir, "--concurrency", "2", "4", "--num-prompts", "8",
                      "--output-len", "6", "--repeats", "2", "--out-dir", str(out))
    assert bench.main(args) == 0
    text = capsys.readouterr().out
    name = "tpot_gsm8k_TESTx2_tiny-model"
    rows = bench.read_rows(tmp_path / "results" / f"{name}.jsonl")
    assert [(r["repeat"], r["backend"], r["concurrency"]) for r in rows] == [
        (rep, b, c) for rep in (0, 1) for b in ("petit", "default") for c in (2, 4)]
    for r in rows:
        assert list(r)[:17] == list(bench.ROW_FIELDS)
        assert (r["gpu"], r["world"], r["model"], r["commit"], r["vllm_version"]) == \
            ("TEST", 2, "tiny-model", "abc1234", "0.24.0-test")
        assert r["num_prompts"] == 8 and r["output_len"] == 6 and r["num_failed"] == 0
        assert r["tpot_ms_p99"] >= r["tpot_ms_p50"] > 0 and r["output_tok_s"] > 0
        assert r["req_s"] > 0 and r["ttft_ms_mean"] > 0
        evidence = r["backend_evidence"]
        counters = r["server_counters"]  # from the fake's /metrics, warm-up excluded
        assert sorted(counters) == ["0", "1"]
        assert counters["1"]["steps"] == r["num_prompts"] * r["output_len"]
        assert counters["1"]["tokens_per_step"] == 1.0 and counters["1"]["preemptions"] == 0
        if r["backend"] == "petit":
            assert "PetitPrepareAndFinalize" in evidence and "2 process(es)" in evidence
        else:
            assert evidence.startswith("vLLM default") and "installed, not enabled" in evidence
    # the fake is 4x faster per token with the flag: the ratio must show it
    by = {(r["backend"], r["concurrency"], r["repeat"]): r["tpot_ms_mean"] for r in rows}
    assert all(by["petit", c, k] < by["default", c, k] for c in (2, 4) for k in (0, 1))
    assert "TPOT petit/def" in text and "COMPLETE: 8 rows" in text
    # out-dir: results + the 4 server logs (the device brings back at most 8 files)
    files = sorted(p.name for p in out.iterdir())
    assert f"{name}.jsonl" in files and f"{name}.png" in files and len(files) == 6
    logs = sorted((tmp_path / "logs").iterdir())
    assert len(logs) == 4
    for log_file in logs:
        t = log_file.read_text()
        assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 " \
               "VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 " \
               "TRANSFORMERS_OFFLINE=1" in t
        flag = "VLLM_USE_PETIT_MOE=1 VLLM_PETIT_MOE_STRICT=1" if "_petit_" in log_file.name \
            else "VLLM_USE_PETIT_MOE=None VLLM_PETIT_MOE_STRICT=None"
        assert flag in t
    assert not any(_alive(p) for p in _pids(fake_env))
    # --resume with everything present: no server is started
    assert bench.main(args + ["--resume"]) == 0
    assert len(list((tmp_path / "logs").iterdir())) == 4
    # --resume after losing one row: only that server runs, the rows are merged
    bench.write_rows(tmp_path / "results" / f"{name}.jsonl", rows[:-1])
    assert bench.main(args + ["--resume"]) == 0
    again = bench.read_rows(tmp_path / "results" / f"{name}.jsonl")
    assert len(again) == 8 and again[:7] == rows[:7] and again[7]["date"] >= rows[7]["date"]
    assert len(list((tmp_path / "logs").iterdir())) == 5
    # --resume refuses rows of another configuration
    assert bench.main(args + ["--resume", "--output-len", "8"]) == 1


def test_petit_experts_backend_end_to_end(tmp_path, model_dir, fake_env, capsys):
    """The third backend: its server gets both flags, its log must name PetitExperts, and the
    table gets its own columns next to petit's."""
    rc = bench.main(_fake_args(tmp_path, model_dir, "--backends", "petit", "petit-experts",
                               "default", "--concurrency", "2", "--num-prompts", "4",
                               "--output-len", "4", "--repeats", "1"))
    assert rc == 0
    text = capsys.readouterr().out
    rows = bench.read_rows(tmp_path / "results" / "tpot_gsm8k_TESTx2_tiny-model.jsonl")
    assert [r["backend"] for r in rows] == ["petit", "petit-experts", "default"]
    experts = rows[1]["backend_evidence"]
    assert "PetitPrepareAndFinalize" in experts and "PetitExperts" in experts
    assert "PetitExperts" not in rows[0]["backend_evidence"]
    assert "TPOT petit/def" in text and "TPOT petit-experts/def" in text
    (experts_log,) = (tmp_path / "logs").glob("server_*_petit-experts_*.log")
    (petit_log,) = (tmp_path / "logs").glob("server_*_petit_r0_*.log")
    assert "VLLM_PETIT_MOE_EXPERTS=1" in experts_log.read_text()
    assert "VLLM_PETIT_MOE_EXPERTS=None" in petit_log.read_text()
    assert not any(_alive(p) for p in _pids(fake_env))


def test_summarize_trace(tmp_path):
    import gzip
    path = tmp_path / "dp1_pp0_tp0_dcp0_ep1_rank1.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(fake_trace(4, 1), f)
    s = bench.summarize_trace(path)
    assert (s["dp_rank"], s["steps"], s["step_us"]) == (1, 4, 1000.0)
    # 150 dispatch + (300 + 200 - 100 overlap) GEMMs + 50 copy; the early kernel is outside
    assert s["gpu_busy_us"] == pytest.approx(600.0) and s["gpu_idle_us"] == pytest.approx(400.0)
    # MoE kernels: the dispatch and the Triton GEMM (150 + 300), not the dense GEMM's overlap
    assert s["moe_busy_us"] == pytest.approx(450.0)
    c = s["categories"]
    assert (c["dispatch"], c["triton_gemm"], c["dense_gemm"], c["copy_memset"]) == \
        (150.0, 300.0, 200.0, 50.0)
    assert c["kernels_total"] == pytest.approx(700.0) and "other" not in c
    assert s["top_kernels"][0] == ["fused_moe_kernel", 300.0]
    assert "dp1: 4 steps, step 1000 us = GPU busy 600 (MoE kernels 450) + idle 400" in \
        bench.format_profile("petit", s)
    (tmp_path / "one.json").write_text(json.dumps(
        {"traceEvents": fake_trace(4, 0)["traceEvents"][:3]}))
    with pytest.raises(ValueError, match="1 'gpu_model_runner: forward' range"):
        bench.summarize_trace(tmp_path / "one.json")


def test_profile_steps_end_to_end(tmp_path, model_dir, fake_env, capsys):
    """--profile-steps: only the profiled level's servers get --profiler-config; the extra wave
    is not a row; each DP rank's trace becomes a row of profile_<results>.jsonl."""
    out = tmp_path / "out"
    args = _fake_args(tmp_path, model_dir, "--concurrency", "2", "4", "--num-prompts", "4",
                      "--output-len", "4", "--repeats", "1", "--profile-steps", "3",
                      "--profile-concurrency", "2", "4", "--out-dir", str(out))
    assert bench.main(args) == 0
    text = capsys.readouterr().out
    rows = bench.read_rows(tmp_path / "results" / "tpot_gsm8k_TESTx2_tiny-model.jsonl")
    assert len(rows) == 4
    prof = bench.read_rows(tmp_path / "results" / "profile_tpot_gsm8k_TESTx2_tiny-model.jsonl")
    assert [(r["backend"], r["dp_rank"], r["concurrency"], r["steps"]) for r in prof] == [
        (b, rank, c, 3) for b in ("petit", "default") for c in (2, 4) for rank in (0, 1)]
    assert all(r["commit"] == "abc1234" and r["gpu"] == "TEST" for r in prof)
    assert prof[1]["categories"]["dispatch"] == 150.0
    assert "petit#0 c=4 dp1: 3 steps, step 1000 us" in text and "default#0 c=2 dp0" in text
    assert (out / "profile_tpot_gsm8k_TESTx2_tiny-model.jsonl").is_file()
    for log_file in (tmp_path / "logs").glob("server_*.log"):  # the step ranges are on
        assert "VLLM_CUSTOM_SCOPES_FOR_PROFILING=1" in log_file.read_text()
    dirs = sorted(p.name for p in (tmp_path / "logs").glob("profile_*"))
    assert len(dirs) == 2 and all(d.startswith("profile_tiny-model_") for d in dirs)
    with pytest.raises(SystemExit):
        bench.parse_args(["--profile-steps", "3", "--concurrency", "2", "4",
                          "--profile-concurrency", "8"])
    a = bench.parse_args(["--profile-steps", "3", "--concurrency", "2", "4"])
    assert a.profile_concurrency == [4]
    cfg = json.loads(bench.profiler_config(tmp_path, 3))
    assert cfg["profiler"] == "torch" and cfg["max_iterations"] == 3
    assert cfg["delay_iterations"] == bench.PROFILE_DELAY_STEPS and cfg["ignore_frontend"]


def test_flag_on_server_without_petit_log_is_an_error(tmp_path, model_dir, fake_env, capsys,
                                                     monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "no-petit-line")
    rc = bench.main(_fake_args(tmp_path, model_dir, "--concurrency", "2", "--num-prompts", "4",
                               "--output-len", "4", "--repeats", "1"))
    assert rc == 1
    text = capsys.readouterr().out
    assert "wrong MoE backend for 'petit'" in text and "FAILED" in text
    rows = bench.read_rows(tmp_path / "results" / "tpot_gsm8k_TESTx2_tiny-model.jsonl")
    assert [r["backend"] for r in rows] == ["default"]  # never reported as petit
    assert not any(_alive(p) for p in _pids(fake_env))


def test_max_runtime_defers_work_and_dry_run(tmp_path, model_dir, fake_env, capsys):
    # 1,319 prompts at concurrency 8 can never fit in 5 s: an error, not an endless --resume
    assert bench.main(_fake_args(tmp_path, model_dir, "--max-runtime", "5")) == 1
    assert "no run could ever finish" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # no server was started
    assert bench.main(_fake_args(tmp_path, model_dir, "--dry-run", "--quick")) == 0
    text = capsys.readouterr().out
    assert "petit#0 levels [8, 64]" in text and "'VLLM_USE_PETIT_MOE': '1'" in text
    assert "_quick.jsonl" in text


def test_max_runtime_runs_what_fits_then_resume_completes(tmp_path, model_dir, fake_env,
                                                          monkeypatch, capsys):
    monkeypatch.setenv("FAKE_TPOT_MS", "20")
    monkeypatch.setenv("FAKE_TPOT_MS_PETIT", "20")
    args = _fake_args(tmp_path, model_dir, "--concurrency", "2", "--num-prompts", "4",
                      "--output-len", "40", "--repeats", "1", "--startup-guess", "0.1",
                      "--stop-timeout", "0.5")
    # petit#0 is expected to fit (guessed start 0.1 s + 3 waves of 0.3 s + 40 x 4.4 ms + the
    # 0.5 s stop: 2.0 s, so up to ~3 s of this process's own start-up still fits in 5 s); once
    # it ran (3 waves of 40 x 20 ms: > 2.4 s), default#0 is not (measured 20 ms per token:
    # 3 x 1.1 s + 0.5 s after > 2.4 s already spent is > 5 s)
    assert bench.main(args + ["--max-runtime", "5"]) == 3
    out = capsys.readouterr().out
    assert "INCOMPLETE: 1 measurement(s) left" in out and "default#0 [2]" in out
    jsonl = tmp_path / "results" / "tpot_gsm8k_TESTx2_tiny-model.jsonl"
    assert [r["backend"] for r in bench.read_rows(jsonl)] == ["petit"]
    assert bench.main(args + ["--resume"]) == 0
    assert [r["backend"] for r in bench.read_rows(jsonl)] == ["petit", "default"]
    assert "COMPLETE: 2 rows" in capsys.readouterr().out
    # a start-up cut short by the budget is "out of time" (exit 3), not an error
    monkeypatch.setenv("FAKE_MODE", "never-healthy")
    t0 = time.monotonic()
    assert bench.main(_fake_args(tmp_path / "b", model_dir, "--max-runtime", "2",
                                 "--startup-guess", "0.1", "--stop-timeout", "0.5",
                                 "--concurrency", "2", "--num-prompts", "4", "--output-len", "4",
                                 "--repeats", "1")) == 3
    assert time.monotonic() - t0 < 8
    assert "start-up outlasted the budget" in capsys.readouterr().out
    assert not any(_alive(p) for p in _pids(fake_env))


def test_ctrl_c_and_sigkill_leave_no_orphans(tmp_path, model_dir, fake_env):
    env = dict(os.environ, FAKE_TPOT_MS="50", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(BENCH_PATH), *_fake_args(
        tmp_path, model_dir, "--concurrency", "2", "--num-prompts", "50", "--output-len", "100",
        "--repeats", "1", "--backends", "default")]
    for sig in (signal.SIGINT, signal.SIGKILL):
        out = tmp_path / f"bench-{sig.name}.out"
        with open(out, "w") as f:
            proc = subprocess.Popen(  # SIGINT as on a terminal, even if ours is ignored
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 15
        while "healthy after" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "healthy after" in out.read_text(), out.read_text()
        time.sleep(0.3)  # requests in flight
        server_pid = _pids(fake_env)[-2]
        proc.send_signal(sig)
        rc = proc.wait(20)
        if sig == signal.SIGINT:
            assert rc == 130, out.read_text()
            assert "server stopped by SIGTERM" in out.read_text()
            assert not any(_alive(p) for p in _pids(fake_env))
        else:  # no cleanup possible: PR_SET_PDEATHSIG still stops the server itself
            deadline = time.monotonic() + 10
            while _alive(server_pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(server_pid)
