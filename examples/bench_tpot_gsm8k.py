#!/usr/bin/env python3
"""End-to-end TPOT/ITL/TTFT of `vllm serve` with and without VLLM_USE_PETIT_MOE, measured by
vLLM's own `vllm bench serve` on the GSM8K test questions (a custom JSONL dataset).

For each repeat and backend in turn ("default": vLLM's own MoE path; "petit": VLLM_USE_PETIT_MOE=1,
our dispatch/combine at DP >= 2 with EP, our one-GPU experts at DP 1), one
`vllm serve <model dir> --load-format dummy` starts, answers `vllm bench serve` at every
concurrency level, and stops. Dummy weights route every token to the same experts, which hides
the MoE layer, so the servers always run with VLLM_MOE_ROUTING_SIMULATION_STRATEGY
(--routing-strategy, recorded in every row) and VLLM_RANDOMIZE_DP_DUMMY_INPUTS=1.

One JSONL row per (backend, concurrency, repeat) goes to
<results-dir>/tpot_gsm8k_<gpu>_<dp>gpu.jsonl (a DP rank per GPU; rows lead with gpu, world =
DP, num_gpus) as soon as its level is done; rows of the same commit and server settings
already there are skipped (rerun the same command to resume). --max-runtime S plans
only the server runs whose estimate fits in S seconds, every backend measuring the same
levels (later repeats dropped first, then the highest levels), starts nothing expected to end
after S seconds, and exits 3 while work is left. --plot draws TPOT p50
vs concurrency.

  python3 examples/bench_tpot_gsm8k.py --dry-run                     # commands and env only
  python3 examples/bench_tpot_gsm8k.py --data-parallel-size 1        # one GPU: default, petit
  python3 examples/bench_tpot_gsm8k.py --dp 1 --concurrency 1 2 4 8 32 64 --num-prompts 64 \
      --prompts-per-client 16                                         # 16 prompts at 1 client
  python3 examples/bench_tpot_gsm8k.py --data-parallel-size 2 --repeats 2 --plot
  python3 examples/bench_tpot_gsm8k.py --report examples/results/tpot_gsm8k_H200_2gpu.jsonl --plot

Exit status: 0 done, 1 a server or benchmark failed, 2 usage, 3 stopped by --max-runtime.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_server import (
    BACKENDS, HOST, MEGAMOE_MAX_TOKENS, PLUGIN_ENV, BenchError, Server, check_backend, free_port,
    load_prompts, log, server_env, server_settings, vllm_serve_command)

from vllm_petit_moe.testing.bench_env import (
    VLLM_SAFE_ENV, commit_stamp, device_stamp, results_name, utc_date, write_jsonl)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GSM8K = HERE / "data" / "gsm8k_test.jsonl"
ROUTING_STRATEGIES = ("uniform_random", "normal_routing")  # vLLM 0.24's RoutingSimulator
# a row's identity: a result of the same commit with these fields equal is done (resume). The
# server's settings are part of it (rows written before they were recorded have None there).
KEY = ("backend", "routing_strategy", "concurrency", "num_prompts", "output_len", "max_num_seqs",
       "max_num_batched_tokens", "repeat")
CONFIG = KEY[1:-1]  # a table line: per configuration, every backend and repeat
# `vllm bench serve`'s saved result JSON (vllm/benchmarks/serve.py) -> row fields
RESULT_FIELDS = {"mean_tpot_ms": "tpot_ms_mean", "median_tpot_ms": "tpot_ms_p50",
                 "p99_tpot_ms": "tpot_ms_p99", "median_itl_ms": "itl_ms_p50",
                 "p99_itl_ms": "itl_ms_p99", "mean_ttft_ms": "ttft_ms_mean",
                 "p99_ttft_ms": "ttft_ms_p99", "request_throughput": "request_throughput",
                 "output_throughput": "output_throughput", "completed": "completed",
                 "duration": "duration_s"}


def write_custom_dataset(src, dst) -> int:
    """GSM8K -> the JSONL of `vllm bench serve --dataset-name custom` ({"prompt": ...} a line;
    no output_tokens: --output-len sets it). Returns the number of prompts."""
    prompts = load_prompts(src)
    Path(dst).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return len(prompts)


def bench_command(python: str, port: int, served_name: str, tokenizer, dataset, *,
                  concurrency: int, num_prompts: int, output_len: int, result_dir,
                  result_filename: str) -> list[str]:
    """`vllm bench serve` of the custom dataset at one concurrency level: streaming
    /v1/completions, greedy, ignore_eos (every request makes `output_len` tokens), one warm-up
    wave of `concurrency` requests, seed 0 (the same prompts for every backend)."""
    return [python, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
            "--backend", "openai", "--base-url", f"http://{HOST}:{port}",
            "--endpoint", "/v1/completions", "--model", served_name, "--tokenizer", str(tokenizer),
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--num-prompts", str(num_prompts), "--custom-output-len", str(output_len),
            "--ignore-eos",
            "--temperature", "0", "--max-concurrency", str(concurrency),
            "--num-warmups", str(concurrency), "--seed", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_filename]


def client_env() -> dict:
    """`vllm bench serve`'s environment: its aiohttp session honours proxy variables."""
    return {**os.environ, **VLLM_SAFE_ENV, "no_proxy": HOST, "NO_PROXY": HOST}


def model_dtype(model_dir: Path) -> str:
    """The expert weights' format of a model directory's config: ``fp8`` for a block-fp8
    checkpoint (``quantization_config.quant_method`` fp8), else ``bf16``."""
    config = json.loads((model_dir / "config.json").read_text())
    quant = config.get("quantization_config") or {}
    return "fp8" if quant.get("quant_method") == "fp8" else "bf16"


def result_row(result: dict, **fields) -> dict:
    """A row from `vllm bench serve`'s saved result JSON: `fields`, then RESULT_FIELDS."""
    missing = [k for k in RESULT_FIELDS if k not in result]
    if missing:
        raise BenchError(f"bench serve result lacks {missing}")
    return {**fields, **{ours: round(v, 4) if isinstance(v := result[theirs], float) else v
                         for theirs, ours in RESULT_FIELDS.items()}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=str(HERE / "models" / "qwen3-30b-a3b"),
                   help="config.json + tokenizer; served with --load-format dummy "
                        "(default: %(default)s)")
    p.add_argument("--data-parallel-size", "--dp", dest="dp", type=int, default=1,
                   help="DP ranks, with EP from 2 (default: %(default)s)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                   help="default: default petit (petit-experts: DP >= 2 only; "
                        "petit-megamoe: the fused layer up to --megamoe-max-tokens tokens per "
                        "rank)")
    p.add_argument("--strict", action="store_true", help="VLLM_PETIT_MOE_STRICT=1 for petit")
    p.add_argument("--megamoe-max-tokens", type=int, default=MEGAMOE_MAX_TOKENS,
                   help="petit-megamoe: the fused layer serves steps of up to this many tokens "
                   "per rank (VLLM_PETIT_MOE_MEGAMOE_MAX_TOKENS; recorded in its rows) "
                   "(default: %(default)s)")
    p.add_argument("--routing-strategy", choices=ROUTING_STRATEGIES, default="uniform_random",
                   help="vLLM's routing simulation (recorded in every row) (default: %(default)s)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64],
                   help="client levels (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=0, help="per level (default: all 1,319)")
    p.add_argument("--prompts-per-client", type=int, default=0,
                   help="N > 0: level c sends min(--num-prompts, N * c) prompts (a level of "
                   "few clients costs its prompts' whole decode one after another); 0: "
                   "--num-prompts at every level (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=256,
                   help="tokens per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="server runs per backend, interleaved (default: %(default)s)")
    p.add_argument("--attention-backend", default="TRITON_ATTN",
                   help="vllm serve's --attention-backend (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="vllm serve's --max-model-len (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="vllm serve's --gpu-memory-utilization (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="vllm serve's --max-num-seqs, recorded in every row; 0: the highest "
                   "--concurrency level. vLLM captures CUDA graphs for batches up to twice it: "
                   "at its own default (256) 102 graphs up to 512, over 3.5 min of a cold fp8 "
                   "start on an H100; for levels up to 8, ten (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="vllm serve's --max-num-batched-tokens, recorded in every row; 0: "
                   "--max-model-len. vLLM compiles for and warms up DeepGEMM's fp8 GEMMs at every "
                   "size up to it: at its own default (8192) 645 JIT builds, 3.5 min of a cold "
                   "fp8 start on an H100 (default: %(default)s)")
    p.add_argument("--serve-args", default="", help="more `vllm serve` arguments (one string)")
    p.add_argument("--health-timeout", type=float, default=900.0,
                   help="seconds a server may take to answer /health (default: %(default)s)")
    p.add_argument("--max-runtime", type=float, default=0.0,
                   help="seconds; 0: no limit (default: %(default)s)")
    p.add_argument("--results-dir", default=str(HERE / "results"),
                   help="where tpot_gsm8k_<gpu>_<dp>gpu.jsonl goes (default: %(default)s)")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "petit-bench-tpot"),
                   help="dataset, server logs, bench serve outputs (default: %(default)s)")
    p.add_argument("--python", default=sys.executable,
                   help="the vLLM install's interpreter (default: %(default)s)")
    p.add_argument("--gpu-name", default=None, help="default: the CUDA device's (dry run: GPU)")
    p.add_argument("--plot", action="store_true", help="<results>.png: TPOT p50 vs concurrency")
    p.add_argument("--report", metavar="JSONL", help="only the table (and --plot) of a file")
    p.add_argument("--dry-run", action="store_true", help="print the commands and env, run none")
    args = p.parse_args(argv)
    args.backends = args.backends or ["default", "petit"]
    if "petit-experts" in args.backends and args.dp < 2:
        p.error("petit-experts pairs our experts with our DP+EP dispatch/combine: it needs "
                "--data-parallel-size >= 2 (at DP 1, petit already runs our experts)")
    if not 0 <= args.num_prompts <= 1319 or min(args.concurrency) < 1 or args.repeats < 1 or \
            args.megamoe_max_tokens < 1 or args.prompts_per_client < 0:
        p.error("--num-prompts 0..1319, --concurrency >= 1, --repeats >= 1, "
                "--megamoe-max-tokens >= 1, --prompts-per-client >= 0")
    if args.max_num_seqs < 0 or 0 < args.max_num_seqs < max(args.concurrency):
        p.error(f"--max-num-seqs {args.max_num_seqs}: 0, or at least the highest --concurrency "
                f"({max(args.concurrency)}; fewer would queue that level's requests)")
    if args.max_num_batched_tokens < 0:
        p.error(f"--max-num-batched-tokens {args.max_num_batched_tokens}: 0 or more")
    for flag in ("--max-num-seqs", "--max-num-batched-tokens"):
        if any(w.split("=")[0] == flag for w in shlex.split(args.serve_args)):
            p.error(f"{flag} in --serve-args: give it as {flag} (rows record it)")
    args.max_num_seqs = args.max_num_seqs or max(args.concurrency)
    args.max_num_batched_tokens = args.max_num_batched_tokens or args.max_model_len
    return args


def read_rows(path) -> list[dict]:
    path = Path(path)
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] \
        if path.exists() else []


def ratio_table(rows: list[dict]) -> str:
    """TPOT p50 / p99, ITL p50 and TTFT mean (medians over repeats) per configuration and
    backend, and petit/default of TPOT p50 (median of the per-repeat ratios, min..max)."""
    by = {}
    for r in rows:
        by.setdefault(tuple(r.get(k) for k in CONFIG), {}).setdefault(r["backend"], {})[
            r["repeat"]] = r
    out = ["routing         conc  prompts  out  seqs  batched  backend  tpot_p50  tpot_p99  "
           "itl_p50  ttft_mean  petit/default (tpot p50)"]

    def order(config):  # a server setting not recorded (None) first
        return tuple(-1 if v is None else v for v in config)

    for (strategy, conc, n, olen, seqs, batched), per in sorted(by.items(),
                                                                key=lambda kv: order(kv[0])):
        for backend, reps in sorted(per.items()):
            def med(k):
                return statistics.median(r[k] for r in reps.values())
            ratios = [reps[i]["tpot_ms_p50"] / per["default"][i]["tpot_ms_p50"]
                      for i in reps if backend != "default" and i in per.get("default", {})]
            ratio = (f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
                     if ratios else "")
            out.append(f"{strategy:15s} {conc:4d} {n:8d} {olen:4d}  {seqs or '-':>4}  "
                       f"{batched or '-':>7}  {backend:7s} "
                       f"{med('tpot_ms_p50'):9.2f} {med('tpot_ms_p99'):9.2f} "
                       f"{med('itl_ms_p50'):8.2f} {med('ttft_ms_mean'):10.1f}  {ratio}")
    return "\n".join(out)


def of_commit(rows: list[dict], commit: str | None = None) -> list[dict]:
    """The rows measured at `commit` (default: the newest row's): a results file keeps earlier
    commits' rows, which neither count as done nor enter the table and plot."""
    commit = commit or (rows[-1]["commit"] if rows else None)
    return [r for r in rows if r["commit"] == commit]


def plot(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axr) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})
    series = {}
    for r in rows:
        series.setdefault((r["backend"], r["routing_strategy"]), {}).setdefault(
            r["concurrency"], []).append(r["tpot_ms_p50"])
    med = {s: {c: statistics.median(v) for c, v in sorted(pts.items())}
           for s, pts in series.items()}
    for (backend, strategy), pts in sorted(med.items()):
        ax.plot(list(pts), list(pts.values()), "o-", label=f"{backend} ({strategy})")
        base = med.get(("default", strategy))
        if backend != "default" and base:
            cs = [c for c in pts if c in base]
            axr.plot(cs, [pts[c] / base[c] for c in cs], "o-", label=f"{backend}/default")
    r0 = rows[0]
    ax.set_ylabel("TPOT p50 (ms)")
    ax.set_title(f"{r0.get('model', 'vllm serve')} ({r0.get('dtype', 'bf16')}, dummy weights), "
                 f"GSM8K, {r0['gpu']} x {r0['world']}, {r0['commit']}", fontsize=10)
    axr.axhline(1.0, color="gray", lw=0.8)
    axr.set(xlabel="concurrency", ylabel="ratio", xscale="log")
    for a in (ax, axr):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


# Time guesses for --max-runtime where no earlier row of the results file measured the same
# (one H200, Qwen3-30B-A3B config: a server healthy after 120-170 s, a level of 8-16 prompts
# per client 35-55 s)
START_GUESS_S, LEVEL_GUESS_S = 150.0, 45.0


def start_guess(rows) -> float:
    """Seconds the next server start is expected to take: the newest start among `rows` (the
    first start on a machine fills its compile caches: 220 s, then 56-76 s on one H100), else
    START_GUESS_S."""
    starts = [r["server_start_s"] for r in rows if r.get("server_start_s")]
    return starts[-1] if starts else START_GUESS_S


def fit_budget(todo: list, budget: float, start_s: float, level_s) -> list:
    """The server runs of `todo` ([(repeat, backend, levels)]) that fit in `budget` seconds,
    every backend measuring the same levels: later repeats go first, then the highest
    concurrency levels of every run alike. [] when not even the lowest level fits."""
    def cost(runs):
        return sum(start_s + sum(level_s(c) for c in levels) for *_, levels in runs)

    for reps in sorted({rep for rep, *_ in todo}, reverse=True):
        runs = [t for t in todo if t[0] <= reps]
        levels = sorted({c for *_, ls in runs for c in ls})
        while levels:
            fit = [(rep, b, [c for c in ls if c in levels]) for rep, b, ls in runs]
            fit = [t for t in fit if t[2]]
            if cost(fit) <= budget:
                return fit
            if reps > min(rep for rep, *_ in todo):
                break  # drop a repeat before any level
            levels.pop()
    return []


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        rows = of_commit(read_rows(args.report))
        print(ratio_table(rows))
        if args.plot and rows:
            plot(rows, Path(args.report).with_suffix(".png"))
        return 0
    t0, work = time.monotonic(), Path(args.work_dir)
    # vllm serve places each DP rank (TP 1) on its own GPU
    stamp = (dict(gpu=args.gpu_name or "GPU", world=args.dp, num_gpus=args.dp,
                  commit=commit_stamp(ROOT), date=utc_date()) if args.dry_run or args.gpu_name
             else device_stamp(ROOT, args.dp, num_gpus=args.dp))
    stamp["dtype"] = model_dtype(Path(args.model_dir))
    suffix = "" if stamp["dtype"] == "bf16" else f"_{stamp['dtype']}"
    results = Path(args.results_dir) / (
        results_name("tpot_gsm8k", stamp["gpu"], args.dp, suffix=suffix) + ".jsonl")
    rows = read_rows(results)
    num_rows_before = len(rows)
    all_prompts = args.num_prompts or len(load_prompts(GSM8K))
    prompts = {c: min(all_prompts, args.prompts_per_client * c) if args.prompts_per_client
               else all_prompts for c in args.concurrency}
    done = {tuple(r.get(k) for k in KEY) for r in of_commit(rows, stamp["commit"])}
    this_run = dict(routing_strategy=args.routing_strategy, output_len=args.output_len,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens)

    def key(backend, conc, rep):  # the KEY of this command's row
        row = dict(this_run, backend=backend, concurrency=conc, num_prompts=prompts[conc],
                   repeat=rep)
        return tuple(row[k] for k in KEY)

    todo = [(rep, b, [c for c in args.concurrency if key(b, c, rep) not in done])
            for rep in range(args.repeats) for b in args.backends]
    todo = [t for t in todo if t[2]]
    dataset = work / "gsm8k_custom.jsonl"
    log(f"results {results} ({len(rows)} rows there); {len(todo)} server run(s) to do")
    if not args.dry_run:
        work.mkdir(parents=True, exist_ok=True)
        write_custom_dataset(GSM8K, dataset)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally: stops the server

    def time_left() -> float:
        return args.max_runtime - (time.monotonic() - t0) if args.max_runtime else 1e9

    def guess(field, **match) -> float:  # longest earlier measurement of the same thing
        return max((r.get(field, 0) for r in rows
                    if all(r.get(k) == v for k, v in match.items())), default=0.0)

    planned = sum(len(levels) for *_, levels in todo)
    if args.max_runtime and not args.dry_run:  # paired levels, not one backend's alone
        todo = fit_budget(todo, args.max_runtime, start_guess(rows),
                          lambda c: guess("bench_wall_s", concurrency=c, num_prompts=prompts[c],
                                          output_len=args.output_len) or LEVEL_GUESS_S)
        if sum(len(levels) for *_, levels in todo) < planned:
            log(f"--max-runtime {args.max_runtime:.0f} s: running {todo or 'nothing'} of "
                f"{planned} (repeat, backend, level) runs; rerun to resume")

    for rep, backend, levels in todo:
        port, name = free_port(), Path(args.model_dir).name
        cmd = vllm_serve_command(args.python, args.model_dir, name, port, args.dp,
                                 args.attention_backend, max_model_len=args.max_model_len,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 load_format="dummy", max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens
                                 ) + shlex.split(args.serve_args)
        bound = dict(megamoe_max_tokens=args.megamoe_max_tokens)
        settings = server_settings(backend, args.strict, args.routing_strategy, **bound)
        env = server_env(backend, args.strict, args.routing_strategy, **bound)
        tag = f"{backend}_{args.routing_strategy}_r{rep}"
        benches = {c: bench_command(args.python, port, name, args.model_dir, dataset,
                                    concurrency=c, num_prompts=prompts[c],
                                    output_len=args.output_len, result_dir=work,
                                    result_filename=f"bench_{tag}_c{c}.json") for c in levels}
        if args.dry_run:
            print(f"\n# server run {tag}: environment = the caller's, then")
            print("unset " + " ".join(k for k in PLUGIN_ENV if k not in settings))
            print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in settings.items()))
            print(f"{shlex.join(cmd)} > {work}/server_{tag}.log 2>&1 &")
            print(f"# wait for http://{HOST}:{port}/health (<= {args.health_timeout:.0f} s)")
            print("\n".join(shlex.join(b) for b in benches.values()))
            continue
        if time_left() < start_guess(rows):
            break
        server = Server(cmd, env, work / f"server_{tag}.log", port)
        log(f"{tag}: starting vllm serve (DP {args.dp}, log {server.log_path})")
        server.start()
        try:
            start_s = server.wait_healthy(min(args.health_timeout, max(time_left(), 1)))
            ok, evidence = check_backend(server.log_text(), backend)
            if not ok:
                raise BenchError(f"{tag}: {evidence}")
            log(f"{tag}: healthy after {start_s:.0f} s; {evidence}")
            for c in levels:
                num_prompts = prompts[c]
                if time_left() < guess("bench_wall_s", concurrency=c, num_prompts=num_prompts,
                                       output_len=args.output_len):
                    break
                out, wall = work / f"bench_{tag}_c{c}.log", time.monotonic()
                with open(out, "w") as f:
                    rc = subprocess.run(benches[c], stdout=f, stderr=subprocess.STDOUT,
                                        timeout=max(time_left(), 1), env=client_env()).returncode
                result_path = work / f"bench_{tag}_c{c}.json"
                if rc != 0 or not result_path.exists():
                    raise BenchError(f"{tag} c={c}: vllm bench serve failed (rc {rc}; {out})")
                row = result_row(json.loads(result_path.read_text()),
                                 **{**stamp, "date": utc_date()},
                                 backend=backend, routing_strategy=args.routing_strategy,
                                 concurrency=c, num_prompts=num_prompts,
                                 output_len=args.output_len, repeat=rep, model=name,
                                 max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 server_start_s=round(start_s, 1),
                                 bench_wall_s=round(time.monotonic() - wall, 1),
                                 **(bound if backend == "petit-megamoe" else {}))
                if row["completed"] != num_prompts:
                    raise BenchError(f"{tag} c={c}: {row['completed']}/{num_prompts} "
                                     f"requests completed ({out})")
                rows.append(row)
                results.parent.mkdir(parents=True, exist_ok=True)
                write_jsonl(results, rows)
                log(f"{tag} c={c}: TPOT p50 {row['tpot_ms_p50']:.2f} ms, mean "
                    f"{row['tpot_ms_mean']:.2f}, p99 {row['tpot_ms_p99']:.2f}; ITL p50 "
                    f"{row['itl_ms_p50']:.2f}; TTFT mean {row['ttft_ms_mean']:.1f}")
        except (BenchError, subprocess.TimeoutExpired, OSError) as e:
            if args.max_runtime and time_left() <= 1:
                log(f"stopped by --max-runtime ({type(e).__name__}); rerun to resume")
                return 3
            log(f"FAILED: {e}")
            return 1
        finally:
            log(f"{tag}: server {server.stop()}")
    if args.dry_run:
        return 0
    current = of_commit(rows, stamp["commit"])
    print(ratio_table(current))
    if args.plot and current:
        plot(current, results.with_suffix(".png"))
    left = planned - (len(rows) - num_rows_before)
    log(f"{'COMPLETE' if left <= 0 else f'{left} level(s) left: rerun to resume'} "
        f"in {time.monotonic() - t0:.0f} s")
    return 0 if left <= 0 else 3


if __name__ == "__main__":
    sys.exit(main())
