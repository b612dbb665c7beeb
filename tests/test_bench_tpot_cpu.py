"""CPU tests of examples/bench_tpot_gsm8k.py (the driver around `vllm bench serve`) and
examples/vllm_server.py (the `vllm serve` lifecycle it shares with compare_serving.py).

Real vLLM 0.24 code wherever it runs on the CPU: the GSM8K dataset goes through vLLM's
CustomDataset/get_samples, both command lines through the `vllm` CLI's own parsers and
validation, and `vllm bench serve` itself runs against a small streaming stand-in for the GPU
server, so its saved result JSON (real key names) feeds the row mapping. The last test runs
vLLM's MoE runner step with its routing-simulation router in front of petit's
prepare/finalize: the ids petit dispatches and its experts compute with are the simulated ones.
"""
from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import types
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

import bench_tpot_gsm8k as bench
import vllm_server
from stand_in_server import StandInServer

ROOT = Path(__file__).resolve().parent.parent

MODEL_DIR = ROOT / "examples" / "models" / "qwen3-30b-a3b"


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's CPU platform, as `vllm bench` picks it where no GPU is (cli/main.py): its engine
    arguments' defaults need a device type."""
    pytest.importorskip("vllm")
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(platforms, "current_platform", CpuPlatform(), raising=False)


def vllm_cli(cmd: list[str]):
    """`cmd` (`python -m vllm.entrypoints.cli.main <args>`) parsed by the `vllm` command's
    parser, built as vllm/entrypoints/cli/main.py builds it (which looks at sys.argv to add
    the `bench` subcommands). Returns (args, the subcommand objects by name)."""
    import vllm.entrypoints.cli.benchmark.main
    import vllm.entrypoints.cli.serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert cmd[1:3] == ["-m", "vllm.entrypoints.cli.main"]
    argv, sys.argv = sys.argv, ["vllm", *cmd[3:]]
    try:
        parser = FlexibleArgumentParser(description="vLLM CLI")
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        cmds = {}
        for module in (vllm.entrypoints.cli.serve, vllm.entrypoints.cli.benchmark.main):
            for sub in module.cmd_init():
                sub.subparser_init(subparsers).set_defaults(dispatch_function=sub.cmd)
                cmds[sub.name] = sub
        return parser.parse_args(cmd[3:]), cmds
    finally:
        sys.argv = argv


def bench_cmd(dataset, port=8000, **kw):
    args = dict(concurrency=8, num_prompts=1319, output_len=256, result_dir="/tmp/r",
                result_filename="x.json")
    args.update(kw)
    return bench.bench_command(sys.executable, port, "qwen3-30b-a3b", MODEL_DIR, dataset, **args)


# ------------------------------------------------------------------------------------------
# GSM8K as vLLM's custom dataset, the command lines through vLLM's parsers
# ------------------------------------------------------------------------------------------

def test_gsm8k_custom_dataset_is_what_vllm_samples(tmp_path, cpu_platform):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import CustomDataset, get_samples

    dataset = tmp_path / "gsm8k.jsonl"
    assert bench.write_custom_dataset(bench.GSM8K, dataset) == 1319
    prompts = bench.load_prompts(bench.GSM8K)
    assert prompts[0].startswith("Question: Janet") and prompts[0].endswith("\nAnswer:")
    loaded = CustomDataset(dataset_path=str(dataset), disable_shuffle=True, random_seed=0)
    assert [d["prompt"] for d in loaded.data] == prompts

    args, _ = vllm_cli(bench_cmd(dataset, num_prompts=5, output_len=17))
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    samples = get_samples(args, tokenizer)  # shuffled with seed 0: a subset, same every run
    assert len(samples) == 5 and len({s.prompt for s in samples}) == 5
    assert {s.prompt for s in samples} <= set(prompts)  # no chat template around them
    assert all(s.expected_output_len == 17 for s in samples)
    assert [s.prompt for s in get_samples(args, tokenizer)] == [s.prompt for s in samples]
    assert all(s.prompt_len == len(tokenizer(s.prompt).input_ids) for s in samples)


def test_bench_command_parses_with_vllms_parser(tmp_path, cpu_platform):
    pytest.importorskip("vllm")
    cmd = bench_cmd(tmp_path / "d.jsonl", port=1234, concurrency=32, num_prompts=100,
                    output_len=64, result_dir=tmp_path, result_filename="r.json")
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    args, _ = vllm_cli(cmd)
    assert (args.subparser, args.bench_type) == ("bench", "serve")
    assert (args.dataset_name, args.dataset_path) == ("custom", str(tmp_path / "d.jsonl"))
    assert (args.max_concurrency, args.num_prompts, args.custom_output_len) == (32, 100, 64)
    assert args.ignore_eos and args.skip_chat_template and args.save_result
    assert (args.percentile_metrics, args.metric_percentiles) == ("ttft,tpot,itl", "50,99")
    assert (args.result_dir, args.result_filename) == (str(tmp_path), "r.json")
    assert (args.base_url, args.endpoint, args.backend) == (
        "http://127.0.0.1:1234", "/v1/completions", "openai")
    assert (args.temperature, args.seed, args.num_warmups, args.request_rate) == (
        0.0, 0, 32, float("inf"))


@pytest.mark.parametrize("dp", [1, 2])
def test_serve_command_parses_and_validates_with_vllms_parser(dp, cpu_platform):
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs

    cmd = bench.vllm_serve_command(sys.executable, MODEL_DIR, "m", 8123, dp, "TRITON_ATTN",
                                   max_model_len=2048, gpu_memory_utilization=0.85,
                                   load_format="dummy") + ["--enforce-eager"]
    args, cmds = vllm_cli(cmd)
    cmds["serve"].validate(args)
    assert (args.model_tag, args.port, args.host) == (str(MODEL_DIR), 8123, "127.0.0.1")
    engine = AsyncEngineArgs.from_cli_args(args)
    assert (engine.data_parallel_size, engine.enable_expert_parallel) == (dp, dp > 1)
    assert (engine.load_format, engine.enforce_eager, engine.enable_prefix_caching) == (
        "dummy", True, False)


# ------------------------------------------------------------------------------------------
# `vllm bench serve` against a streaming stand-in server -> its result JSON -> our row
# ------------------------------------------------------------------------------------------

def test_vllm_bench_serve_result_maps_to_a_row(tmp_path):
    pytest.importorskip("vllm")
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dataset = tmp_path / "gsm8k.jsonl"
    bench.write_custom_dataset(bench.GSM8K, dataset)
    cmd = bench_cmd(dataset, port=server.server_address[1], concurrency=4, num_prompts=12,
                    output_len=16, result_dir=tmp_path, result_filename="c4.json")
    try:
        proc = subprocess.run(cmd, env=bench.client_env(), capture_output=True, text=True,
                              timeout=300)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "c4.json").read_text())
    row = bench.result_row(result, backend="default", concurrency=4)
    assert set(bench.RESULT_FIELDS.values()) <= set(row) and row["backend"] == "default"
    assert row["completed"] == 12 and result["failed"] == 0 and result["max_concurrency"] == 4
    # 16 tokens 3 ms apart: a request takes >= 45 ms, 12 of them 4 at a time >= 3 x 45 ms.
    # TPOT and ITL are gaps between received chunks: on a loaded machine the client reads
    # several tokens at once and sees gaps near 0, so their values are checked as vLLM's.
    assert row["duration_s"] >= 3 * 0.045
    assert 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"] < 100
    assert 0 <= row["itl_ms_p50"] <= row["itl_ms_p99"] and row["ttft_ms_mean"] > 0
    for ours, theirs in (("tpot_ms_mean", "mean_tpot_ms"), ("tpot_ms_p50", "median_tpot_ms"),
                         ("itl_ms_p50", "median_itl_ms"), ("itl_ms_p99", "p99_itl_ms"),
                         ("ttft_ms_mean", "mean_ttft_ms")):
        assert row[ours] == pytest.approx(result[theirs], abs=1e-4)
    bodies = StandInServer.requests
    assert len(bodies) == 12 + 4  # + one warm-up wave of `concurrency` requests
    prompts = set(bench.load_prompts(bench.GSM8K))
    assert all(b["prompt"] in prompts and b["max_tokens"] == 16 and b["ignore_eos"]
               and b["temperature"] == 0 and b["model"] == "qwen3-30b-a3b" for b in bodies)
    with pytest.raises(vllm_server.BenchError, match="p99_tpot_ms"):
        bench.result_row({k: v for k, v in result.items() if k != "p99_tpot_ms"})


# ------------------------------------------------------------------------------------------
# Server environment, backend check, lifecycle
# ------------------------------------------------------------------------------------------

def test_server_env_always_simulates_routing_and_keeps_multicast_off():
    base = {"PATH": "/bin", "VLLM_USE_PETIT_MOE": "1", "VLLM_PETIT_MOE_EXPERTS": "1"}
    default = vllm_server.server_env("default", routing_strategy="uniform_random", base=base)
    assert "VLLM_USE_PETIT_MOE" not in default and "VLLM_PETIT_MOE_EXPERTS" not in default
    petit = vllm_server.server_env("petit", True, "normal_routing", base=base)
    assert petit["VLLM_USE_PETIT_MOE"] == petit["VLLM_PETIT_MOE_STRICT"] == "1"
    for env, strategy in ((default, "uniform_random"), (petit, "normal_routing")):
        assert env["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] == strategy
        assert env["VLLM_RANDOMIZE_DP_DUMMY_INPUTS"] == "1" and env["PATH"] == "/bin"
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    experts = vllm_server.server_env("petit-experts", base={})
    assert experts["VLLM_PETIT_MOE_EXPERTS"] == "1" and "VLLM_PETIT_MOE_STRICT" not in experts
    assert "VLLM_MOE_ROUTING_SIMULATION_STRATEGY" not in experts  # real weights (compare_serving)


USED = ("INFO hook.py:207] vllm-petit-moe: MoE layers use PetitPrepareAndFinalize (petit "
        "dispatch/combine) instead of MoEPrepareAndFinalizeNaiveDPEPModular: DP=2 x EP=2")


def test_check_backend_reads_the_plugin_log_lines():
    check = vllm_server.check_backend
    assert check(f"a\n{USED}\n{USED}\n", "petit") == (True, USED[USED.index("vllm-"):] +
                                                     " [2 process(es)]")
    assert not check("plain vLLM log", "petit")[0]
    kept = "vllm-petit-moe: not used for these MoE layers (no data+expert parallelism)"
    assert "not used" in check(f"{USED}\n{kept}", "petit")[1]
    assert check("plain vLLM log", "default")[0] and not check(USED, "default")[0]
    one_gpu = ("INFO vllm-petit-moe: MoE layers use PetitSingleGpuExperts instead of "
               "TritonExperts: one GPU: ...")
    assert check(one_gpu, "petit")[0] and not check(one_gpu, "default")[0]
    experts = ("vllm-petit-moe: MoE layers use PetitEpExperts (petit grouped GEMMs (tile "
               "family auto)) instead of TritonExperts (VLLM_PETIT_MOE_EXPERTS=1)")
    assert check(f"{USED}\n{experts}", "petit-experts")[0]
    assert not check(USED, "petit-experts")[0] and not check(f"{USED}\n{experts}", "petit")[0]
    fused = ("vllm-petit-moe: MoE layers use PetitEpExperts (the fused layer for steps of up "
             "to 64 tokens per rank, else vLLM's TritonExperts) instead of TritonExperts")
    assert check(f"{USED}\n{fused}", "petit-megamoe")[0]
    assert not check(f"{USED}\n{fused}", "petit")[0]
    assert not check(f"{USED}\n{fused}", "petit-experts")[0]
    assert not check(f"{USED}\n{experts}", "petit-megamoe")[0]
    one_gpu_fused = one_gpu.replace("...", "petit's composed experts from 32 tokens per call, "
                                           "vLLM's Triton experts below, MegaMoE up to 64 tokens")
    assert check(one_gpu_fused, "petit-megamoe")[0] and not check(one_gpu_fused, "petit")[0]
    # the flag alone on one GPU: MegaMoE up to SingleGpuLayerConfig's default bound
    from vllm_petit_moe.config import SingleGpuLayerConfig
    one_gpu_default = one_gpu_fused.replace(
        "up to 64", f"up to {SingleGpuLayerConfig().megamoe_max_tokens}")
    assert check(one_gpu_default, "petit")[0]
    assert not check(one_gpu.replace("...", "MegaMoE up to 0 tokens"), "petit-megamoe")[0]
    megamoe = vllm_server.server_env("petit-megamoe", base={})
    assert megamoe["VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS"] == str(vllm_server.MEGAMOE_MAX_TOKENS)
    bound = vllm_server.server_env("petit-megamoe", base={}, megamoe_max_tokens=8)
    assert bound["VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS"] == "8"
    with pytest.raises(ValueError, match="megamoe_max_tokens"):
        vllm_server.server_env("petit-megamoe", base={}, megamoe_max_tokens=0)
    assert "VLLM_PETIT_MOE_EXPERTS" not in megamoe
    with pytest.raises(ValueError, match="backend"):
        vllm_server.server_env("petit-fast", base={})


# A stand-in `vllm serve`: a child in its process group (as vLLM's engine cores), /health.
FAKE_SERVE = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_server_waits_for_health_and_stops_its_whole_group(tmp_path):
    port = vllm_server.free_port()
    server = vllm_server.Server([sys.executable, "-c", FAKE_SERVE, str(port)], dict(os.environ),
                                tmp_path / "s.log", port)
    server.start()
    pgid = server.proc.pid
    try:
        assert server.wait_healthy(60) < 60
        assert group_alive(pgid)
    finally:
        how = server.stop()
    assert how == "stopped by SIGINT" and not group_alive(pgid)
    assert server.log_text().startswith("$ ")


def test_server_start_failure_and_timeout_are_errors(tmp_path):
    crash = vllm_server.Server([sys.executable, "-c", "print('engine died'); raise SystemExit(3)"],
                               dict(os.environ), tmp_path / "c.log", vllm_server.free_port())
    crash.start()
    with pytest.raises(vllm_server.BenchError, match="exited with 3(.|\n)*engine died"):
        crash.wait_healthy(60)
    crash.stop()
    mute = vllm_server.Server([sys.executable, "-c", "import time; time.sleep(60)"],
                              dict(os.environ), tmp_path / "m.log", vllm_server.free_port())
    mute.start()
    try:
        with pytest.raises(vllm_server.BenchError, match="not healthy after 3s"):
            mute.wait_healthy(3)
    finally:
        mute.stop()


# ------------------------------------------------------------------------------------------
# The driver: dry run, resume, table, plot
# ------------------------------------------------------------------------------------------

def dry_run(capsys, *argv) -> str:
    assert bench.main(["--dry-run", "--gpu-name", "H200", *argv]) == 0
    return capsys.readouterr().out


def test_dry_run_prints_every_server_and_bench_command_with_its_env(capsys, tmp_path):
    out = dry_run(capsys, "--dp", "2", "--routing-strategy", "normal_routing", "--repeats", "2",
                  "--concurrency", "8", "64", "--results-dir", str(tmp_path))
    runs = out.split("\n# server run ")[1:]
    assert [r.split(":")[0] for r in runs] == [
        "default_normal_routing_r0", "petit_normal_routing_r0",
        "default_normal_routing_r1", "petit_normal_routing_r1"]  # interleaved
    for run in runs:
        assert "export VLLM_MOE_ROUTING_SIMULATION_STRATEGY=normal_routing" in run
        assert "export VLLM_RANDOMIZE_DP_DUMMY_INPUTS=1" in run
        for var in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                    "NVSHMEM_DISABLE_NVLS=1", "VLLM_ALLREDUCE_USE_SYMM_MEM=0"):
            assert f"export {var}" in run
        assert ("export VLLM_USE_PETIT_MOE=1" in run) == run.startswith("petit")
        assert "--data-parallel-size 2 --enable-expert-parallel" in run
        assert run.count("bench serve") == 2 and "--max-concurrency 64" in run
        # a server holds the highest level's sequences and captures graphs for no more
        assert "--max-num-seqs 64 " in run.split(" bench serve ")[0]
        # and compiles (DeepGEMM's fp8 warm-up included) for batches up to --max-model-len
        assert "--max-num-batched-tokens 2048 " in run.split(" bench serve ")[0]
    assert str(tmp_path / "tpot_gsm8k_H200_2gpu.jsonl") in out
    wider = dry_run(capsys, "--backends", "default", "--concurrency", "1", "8",
                    "--max-num-seqs", "256", "--results-dir", str(tmp_path))
    assert "--max-num-seqs 256 " in wider and "--max-num-seqs 8 " not in wider
    longer = dry_run(capsys, "--backends", "default", "--max-model-len", "4096",
                     "--results-dir", str(tmp_path))
    assert "--max-num-batched-tokens 4096 " in longer
    batched = dry_run(capsys, "--backends", "default", "--max-num-batched-tokens", "8192",
                      "--results-dir", str(tmp_path))
    assert "--max-num-batched-tokens 8192 " in batched


def test_dry_run_on_one_gpu_and_usage_errors(capsys, tmp_path):
    out = dry_run(capsys)
    assert "--data-parallel-size 1 --attention-backend" in out  # no expert parallel at DP 1
    assert "VLLM_USE_PETIT_MOE=1" in out  # petit at DP 1: the one-GPU layer
    assert "--num-prompts 1319" in out and "--max-concurrency 32" in out
    fused = dry_run(capsys, "--backends", "petit-megamoe", "--megamoe-max-tokens", "8")
    assert "export VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS=8" in fused
    # few clients, few prompts: level c sends min(--num-prompts, N * c)
    scaled = dry_run(capsys, "--backends", "default", "--concurrency", "1", "2", "64",
                     "--num-prompts", "64", "--prompts-per-client", "16",
                     "--results-dir", str(tmp_path))  # no earlier rows to skip
    sent = {}
    for line in scaled.splitlines():
        if " bench serve " in line:
            words = line.split()
            sent[int(words[words.index("--max-concurrency") + 1])] = \
                int(words[words.index("--num-prompts") + 1])
    assert sent == {1: 16, 2: 32, 64: 64}
    for argv in (["--backends", "petit-experts"], ["--num-prompts", "2000"],
                 ["--concurrency", "0"], ["--routing-strategy", "none"],
                 ["--megamoe-max-tokens", "0"], ["--prompts-per-client", "-1"],
                 ["--concurrency", "8", "--max-num-seqs", "4"], ["--max-num-seqs", "-1"],
                 ["--serve-args", "--max-num-seqs 16"], ["--serve-args", "--max-num-seqs=16"],
                 ["--max-num-batched-tokens", "-1"],
                 ["--serve-args", "--max-num-batched-tokens=4096"]):
        with pytest.raises(SystemExit) as e:
            bench.main(["--dry-run", *argv])
        assert e.value.code == 2


def row(backend, conc, rep, tpot, strategy="uniform_random", **kw):
    r = dict(gpu="H200", world=2, commit="abc", date="d", backend=backend,
             routing_strategy=strategy, concurrency=conc, num_prompts=1319, output_len=256,
             repeat=rep, tpot_ms_mean=tpot, tpot_ms_p50=tpot, tpot_ms_p99=2 * tpot,
             itl_ms_p50=tpot, ttft_ms_mean=50.0, max_num_seqs=64, max_num_batched_tokens=2048)
    r.update(kw)
    return r


def test_resume_skips_the_rows_already_there(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PETIT_COMMIT", "abc")  # the rows' commit
    rows = [row("default", 8, 0, 5.0), row("petit", 8, 0, 4.0), row("default", 64, 0, 9.0),
            row("petit", 64, 0, 7.0, num_prompts=100)]  # another configuration: not done
    bench.write_jsonl(tmp_path / "tpot_gsm8k_H200_2gpu.jsonl", rows)
    out = dry_run(capsys, "--dp", "2", "--concurrency", "8", "64", "--repeats", "2",
                  "--results-dir", str(tmp_path))
    assert "(4 rows there); 3 server run(s) to do" in out
    runs = {r.split(":")[0]: r for r in out.split("\n# server run ")[1:]}
    assert set(runs) == {"petit_uniform_random_r0", "default_uniform_random_r1",
                         "petit_uniform_random_r1"}
    assert runs["petit_uniform_random_r0"].count("bench serve") == 1
    assert "--max-concurrency 64" in runs["petit_uniform_random_r0"]
    assert runs["default_uniform_random_r1"].count("bench serve") == 2
    rows += [row(b, c, r, 5.0) for b in ("default", "petit") for c in (8, 64) for r in (0, 1)]
    bench.write_jsonl(tmp_path / "tpot_gsm8k_H200_2gpu.jsonl", rows)
    out = dry_run(capsys, "--dp", "2", "--concurrency", "8", "64", "--repeats", "2",
                  "--results-dir", str(tmp_path))
    assert "0 server run(s) to do" in out and "bench serve" not in out
    # rows of other server settings, or of none recorded, are not this command's results
    for other in (("--max-num-seqs", "128"), ("--max-num-batched-tokens", "4096")):
        out = dry_run(capsys, "--dp", "2", "--concurrency", "8", "64", "--repeats", "2",
                      "--results-dir", str(tmp_path), *other)
        assert "4 server run(s) to do" in out
    unrecorded = [{k: v for k, v in r.items() if k != "max_num_batched_tokens"} for r in rows]
    bench.write_jsonl(tmp_path / "tpot_gsm8k_H200_2gpu.jsonl", unrecorded)
    out = dry_run(capsys, "--dp", "2", "--concurrency", "8", "64", "--repeats", "2",
                  "--results-dir", str(tmp_path))
    assert "4 server run(s) to do" in out
    bench.write_jsonl(tmp_path / "tpot_gsm8k_H200_2gpu.jsonl", rows)
    monkeypatch.setenv("PETIT_COMMIT", "def")  # another commit's rows are not its results
    out = dry_run(capsys, "--dp", "2", "--concurrency", "8", "64", "--repeats", "2",
                  "--results-dir", str(tmp_path))
    assert "4 server run(s) to do" in out


def test_table_gives_petit_over_default_per_repeat_and_the_plot_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [row("default", 8, 0, 10.0), row("petit", 8, 0, 8.0),
            row("default", 8, 1, 10.0), row("petit", 8, 1, 9.0),
            row("default", 64, 0, 20.0), row("petit", 64, 0, 15.0)]
    table = bench.ratio_table(rows + [row("petit", 8, 0, 7.0, max_num_seqs=None)]).splitlines()
    assert len(table) == 6 and "petit/default" in table[0]
    # a server setting not recorded (max_num_seqs None): its own line, first, with no ratio
    assert table[1].split()[1:7] == ["8", "1319", "256", "-", "2048", "petit"]
    assert table[1].rstrip().endswith("50.0")

    def line(conc, backend):
        return [ln for ln in table[2:] if ln.split()[1] == str(conc) and backend in ln.split()][0]
    c8 = line(8, "petit")
    assert "0.850 (0.800..0.900)" in c8 and "8.50" in c8  # median of 8 and 9
    c64 = line(64, "petit")
    assert c64.endswith("0.750 (0.750..0.750)")
    path = tmp_path / "tpot_gsm8k_H200_2gpu.jsonl"
    bench.write_jsonl(path, rows)
    assert bench.main(["--report", str(path), "--plot"]) == 0
    assert "0.850" in capsys.readouterr().out
    assert path.with_suffix(".png").stat().st_size > 10_000


# The driver's whole loop, with `--python` a wrapper that starts this stand-in for
# `python -m vllm.entrypoints.cli.main serve` (tests/ on its PYTHONPATH) and the real
# interpreter for `bench serve`.
STAND_IN_SERVE = """
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from stand_in_server import StandInServer
print("env", json.dumps(dict(os.environ)), flush=True)
if os.environ.get("VLLM_USE_PETIT_MOE") == "1":
    print("INFO hook.py:207] vllm-petit-moe: MoE layers use PetitPrepareAndFinalize", flush=True)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])),
                    StandInServer).serve_forever()
"""


def test_driver_runs_interleaves_resumes_and_records_the_strategy(tmp_path, capsys):
    pytest.importorskip("vllm")
    (tmp_path / "serve.py").write_text(STAND_IN_SERVE)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$3" = serve ]; then exec env '
                      f'PYTHONPATH={Path(__file__).parent} {sys.executable} '
                      f'{tmp_path / "serve.py"} "$@"; else exec {sys.executable} "$@"; fi\n')
    python.chmod(0o755)
    argv = ["--python", str(python), "--gpu-name", "CPU", "--dp", "2", "--concurrency", "2",
            "--health-timeout", "120",
            "--num-prompts", "4", "--output-len", "8", "--routing-strategy", "normal_routing",
            "--results-dir", str(tmp_path), "--work-dir", str(tmp_path / "work")]
    assert bench.main(argv) == 0
    rows = bench.read_rows(tmp_path / "tpot_gsm8k_CPU_2gpu.jsonl")
    assert [(r["backend"], r["concurrency"], r["repeat"]) for r in rows] == [
        ("default", 2, 0), ("petit", 2, 0)]
    for r in rows:
        assert list(r)[:12] == ["gpu", "world", "num_gpus", "commit", "date", "dtype",
                                "backend", "routing_strategy", "concurrency", "num_prompts",
                                "output_len", "repeat"]
        assert (r["gpu"], r["world"], r["num_gpus"], r["dtype"], r["routing_strategy"],
                r["num_prompts"], r["max_num_seqs"], r["max_num_batched_tokens"]) == \
            ("CPU", 2, 2, "bf16", "normal_routing", 4, 2, 2048)
        # the stand-in sleeps TOKEN_S per token: 2 requests of 8 tokens in turn per client.
        # (Its TPOT can read under TOKEN_S: a busy client receives the chunks in bursts.)
        assert r["completed"] == 4 and 0 < r["tpot_ms_p50"] < 100
        assert r["duration_s"] >= 2 * 8 * StandInServer.TOKEN_S
        log = (tmp_path / "work" / f"server_{r['backend']}_normal_routing_r0.log").read_text()
        env = json.loads(log.split("env ", 1)[1].splitlines()[0])
        assert env["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] == "normal_routing"
        assert env["VLLM_RANDOMIZE_DP_DUMMY_INPUTS"] == env["TORCH_SYMM_MEM_DISABLE_MULTICAST"]
        assert env.get("VLLM_USE_PETIT_MOE") == ("1" if r["backend"] == "petit" else None)
    assert "COMPLETE" in capsys.readouterr().out
    assert bench.main(argv) == 0 and "0 server run(s) to do" in capsys.readouterr().out
    assert len(bench.read_rows(tmp_path / "tpot_gsm8k_CPU_2gpu.jsonl")) == 2


# ------------------------------------------------------------------------------------------
# vLLM's routing simulation runs in its router, before petit's prepare/finalize
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["uniform_random", "normal_routing"])
def test_simulated_routing_reaches_petit_prepare_and_experts(strategy, monkeypatch):
    """vLLM 0.24: with VLLM_MOE_ROUTING_SIMULATION_STRATEGY set, create_fused_moe_router (what
    FusedMoE calls) returns a RoutingSimulatorRouter, and MoERunner._apply_quant_method, for a
    modular kernel such as FusedMoEKernel(PetitPrepareAndFinalize, experts), calls
    router.select_experts and hands its ids to forward_modular -> FusedMoEModularMethod.apply
    -> FusedMoEKernel.apply -> prepare. Run here, real classes throughout, on rank 0 of W=2
    (tests/fakes.py's FakeEpBuffer stands in for the GPU buffer, ReferenceExperts for the
    Triton GEMMs): the router logits all point at experts 0..3, so any bypass of the simulation
    would dispatch those."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from fakes import (FakeEpBuffer, ReferenceExperts, SimulatedCall, dp_step, make_moe_config,
                       make_parallel_config, make_vllm_config)
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.fused_moe_modular_method import (
        FusedMoEModularMethod)
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.router.router_factory import (
        create_fused_moe_router)
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.v1.worker import workspace

    from vllm_petit_moe.testing import reference
    from vllm_petit_moe.vllm_glue.prepare_finalize import PetitPrepareAndFinalize

    monkeypatch.setenv("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", strategy)
    if not workspace.is_workspace_manager_initialized():
        workspace.init_workspace_manager(torch.device("cpu"))
    num_experts, top_k, hidden, inter, tokens = 16, 4, 40, 24, [256, 7]
    router = create_fused_moe_router(top_k=top_k, global_num_experts=num_experts,
                                     renormalize=True, scoring_func="softmax")
    assert type(router).__name__ == "RoutingSimulatorRouter"

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(t, hidden, generator=gen).to(torch.bfloat16) for t in tokens]
    logits = [torch.full((t, num_experts), -20.0) for t in tokens]
    for lg in logits:
        lg[:, :top_k] = 20.0  # argmax routing: experts 0..3 for every token
    rank1_weights, rank1_ids = router.select_experts(xs[1], logits[1])
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5)
    call = SimulatedCall(xs, [None, rank1_ids.to(torch.int32)], [None, rank1_weights],
                         w13.to(torch.bfloat16), w2.to(torch.bfloat16))

    class Buffer(FakeEpBuffer):  # rank 0's ids exist only once the router ran in the forward
        def dispatch(self, x, topk_ids, topk_weights, region_stride=None, quant=None):
            self.dispatched = (topk_ids.clone(), topk_weights.clone())
            call.topk_ids[0], call.topk_weights[0] = topk_ids.to(torch.int32), topk_weights
            return super().dispatch(x, topk_ids, topk_weights, region_stride, quant)

    class Experts(ReferenceExperts):
        def apply(self, *args, **kwargs):
            bound = inspect.signature(ReferenceExperts.apply).bind(self, *args, **kwargs)
            self.received_ids = bound.arguments["topk_ids"].clone()
            return super().apply(*args, **kwargs)

    vllm_config = make_vllm_config()
    parallel = make_parallel_config(dp_size=2, dp_rank=0, ep_size=2, ep_rank=0)
    moe_config = make_moe_config(parallel, num_experts=num_experts, experts_per_token=top_k,
                                 hidden_dim=hidden, intermediate_size=inter)
    buffer = Buffer(0, 2, num_experts, call)
    pf = PetitPrepareAndFinalize(buffer, num_experts=num_experts, max_tokens_per_rank=512)
    with set_current_vllm_config(vllm_config):
        experts = Experts(moe_config, FUSED_MOE_UNQUANTIZED_CONFIG)
        kernel = mk.FusedMoEKernel(pf, experts)
        method = FusedMoEModularMethod(
            types.SimpleNamespace(moe_quant_config=FUSED_MOE_UNQUANTIZED_CONFIG), kernel)
    assert not method.is_monolithic  # else the runner would pass router logits to the kernel
    _, expert_map, _ = determine_expert_map(2, 0, num_experts, "linear")
    w13_local, w2_local = call.local_weights(0, 2)
    layer = types.SimpleNamespace(quant_method=method, w13_weight=w13_local, w2_weight=w2_local,
                                  activation=MoEActivation.SILU, global_num_experts=num_experts,
                                  apply_router_weight_on_input=False, expert_map=expert_map)
    layer.forward_modular = types.MethodType(RoutedExperts.forward_modular, layer)
    runner = types.SimpleNamespace(router=router, routed_experts=layer, _quant_method=method,
                                   _shared_experts=None)
    runner._maybe_apply_shared_experts = types.MethodType(
        MoERunner._maybe_apply_shared_experts, runner)
    captured = []
    router.set_capture_fn(captured.append)  # the router's own output (vLLM's capture hook)
    try:
        with dp_step(vllm_config, tokens):
            _, out = MoERunner._apply_quant_method(runner, xs[0], logits[0], None)
    finally:
        buffer.close()

    ids, weights = buffer.dispatched
    assert len(captured) == 1 and torch.equal(ids.long(), captured[0].long())
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts).float()
    assert counts[:top_k].sum() < 0.5 * counts.sum()  # not the logits' top-k
    if strategy == "uniform_random":  # 1024 picks, 64 per expert expected
        assert bool((counts > 32).all()) and bool((counts < 100).all())
        assert bool((weights == 1.0).all())  # vLLM's uniform strategy: weights of 1, not 1/k
    else:  # sigmoid(N(0, 1)) * 16: experts 4..11 get ~73%
        assert counts[4:12].sum() > 0.65 * counts.sum()
    # petit's experts computed with the simulated ids: rows for experts 0..7, from both ranks
    sent = torch.cat([i.flatten() for i in call.topk_ids]).long()
    received = experts.received_ids.flatten().long()
    assert int(((received >= 0) & (received < 8)).sum()) == int((sent < 8).sum())
    expected = reference.ep_moe_reference(call.xs, call.topk_ids, call.topk_weights, call.w13,
                                          call.w2, 2)[0]
    assert torch.equal(out, expected)
    argmax_ids = [torch.arange(top_k).expand(t, top_k).to(torch.int32) for t in tokens]
    unsimulated = reference.ep_moe_reference(call.xs, argmax_ids, call.topk_weights, call.w13,
                                             call.w2, 2)[0]
    assert not torch.allclose(out.float(), unsimulated.float(), atol=1e-2)


def test_fit_budget_keeps_levels_paired():
    """--max-runtime plans whole server runs, every backend the same levels: later repeats
    go first, then the highest levels of every run alike."""
    todo = [(0, "default", [1, 2]), (0, "petit", [1, 2]), (1, "default", [1, 2]),
            (1, "petit", [1, 2])]
    level = {1: 40.0, 2: 45.0}.__getitem__
    assert bench.fit_budget(todo, 1e9, 150.0, level) == todo
    assert bench.fit_budget(todo, 470.0, 150.0, level) == todo[:2]     # 2 x (150 + 85)
    assert bench.fit_budget(todo, 469.0, 150.0, level) == [(0, "default", [1]), (0, "petit", [1])]
    assert bench.fit_budget(todo, 379.0, 150.0, level) == []           # 2 x (150 + 40) > 379
    resumed = [(0, "petit", [2]), (1, "default", [1, 2]), (1, "petit", [1, 2])]
    assert bench.fit_budget(resumed, 200.0, 150.0, level) == [(0, "petit", [2])]


def test_start_guess_is_the_newest_start():
    """A resumed --max-runtime plans with the newest server start: the first start on a
    machine fills its compile caches (220 s on one H100, 56-76 s after it), and planning with
    the longest left a 509 s budget unable to fit the two starts that took 56 + 58 s."""
    assert bench.start_guess([]) == bench.START_GUESS_S
    rows = [dict(server_start_s=220.1), dict(server_start_s=220.1), dict(server_start_s=76.0),
            dict(tpot_ms_p50=4.3)]
    assert bench.start_guess(rows) == 76.0
    level = lambda c: bench.LEVEL_GUESS_S  # noqa: E731 (levels not yet measured)
    todo = [(0, "default", [2, 8]), (0, "petit", [2, 8])]
    assert bench.fit_budget(todo, 509.0, bench.start_guess(rows), level) == todo
    assert bench.fit_budget(todo, 509.0, 220.1, level) == []
