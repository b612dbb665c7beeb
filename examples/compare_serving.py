#!/usr/bin/env python3
"""Serve one model with and without VLLM_USE_PETIT_MOE and check that the outputs agree.

Starts `vllm serve` on this node's GPUs (data parallel = number of GPUs, with
`--enable-expert-parallel` from 2; CUDA graphs on, TRITON_ATTN) twice: with the flag ("petit",
strict: a layer that would fall back fails the start; or, with --backend petit-experts, the flag
and VLLM_PETIT_MOE_EXPERTS=1: petit's expert GEMMs as well, whose use the server log must show)
and without it ("default": vLLM's allgather/reduce-scatter and Triton experts). On one GPU
(`--dp 1`, or a node with one GPU) the flag's defaults put the fused layer (MegaMoE) on every
decode step (the prompts are answered one after another: 1 token per step) and petit's
composed or vLLM's Triton experts on the prefills, against vLLM's Triton experts throughout.
Each server answers the same GSM8K prompts with greedy decoding and the top-5 logprobs of
every generated token. The model defaults to a seeded checkpoint at a
realistic weight scale (examples/make_seeded_checkpoint.py: the bundled tiny Qwen3-MoE with the
Qwen3 tokenizer), because `--load-format dummy` weights give nearly uniform logits on which
greedy tokens flip at any rounding difference.

Per prompt, with tolerance --tol (nats, default 0.1), a prompt agrees strictly when
- on the common prefix of the two greedy sequences, the chosen tokens' logprobs differ by at
  most --tol, and
- where the sequences diverge, the two tokens were a near-tie in both runs: each run's
  logprob of the other run's token is within 2 x --tol of its own choice (and among its top 5).
Two correct backends that round differently do not pass that for every prompt: a different
last bit in one layer's output can flip a later layer's near-tied expert choice for a token
and move its logprobs by tenths of a nat, and the served logprobs come from bf16 logits whose
steps at this model's top logits (0.06-0.125 nats) are the size of --tol. So the run agrees
when the differences are of rounding's size and rare (every count over all prompts):
- the 99th percentile of the logprob differences over every common-prefix position <= 2 x tol,
- at most 1/5 of the prompts differ by more than 2 x tol on their common prefix,
- at most 1/8 of the prompts diverge other than at a near-tie.
Calibrated on the CPU (examples/compare_rounding_cpu.py, 64 prompts): pairs of correct
roundings pass it, and each injected fault fails it, down to one 32-row tile of one expert
missing or every 50th call's first token zeroed. "strict" records whether every prompt
agreed strictly. Results: compare_serving_<gpu>_<W>gpu.json (a DP rank per GPU)
(compare_serving_<gpu>_<W>gpu_petit-experts.json with --backend petit-experts) in --results-dir
(default examples/results); server logs and each server's outputs (outputs_<backend>.json,
written as soon as that server is done) in --log-dir.

    python3 examples/compare_serving.py                       # seeded tiny Qwen3-MoE
    python3 examples/compare_serving.py --model-dir DIR --num-prompts 32 --max-tokens 32
    python3 examples/compare_serving.py --backend petit-experts  # PetitExperts as well

Needs a GPU, vLLM 0.24 and this package installed into the environment of the servers'
Python (README.md, "Install"; --python names that interpreter). Exit status: 0 agree, 1
disagree or an error, 2 usage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import make_seeded_checkpoint as seeded
import vllm_server as bench  # (server lifecycle, plugin checks, prompts)
from vllm_petit_moe.testing.bench_env import commit_stamp, results_name, utc_date

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_DATA = ROOT / "examples" / "data" / "gsm8k_test.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, default=None,
                   help="model to serve (default: a seeded checkpoint written to "
                        "$TMPDIR/petit-seeded-tiny-qwen3-moe)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="GSM8K prompts sent to both servers (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--tol", type=float, default=0.1,
                   help="logprob tolerance in nats (default: %(default)s)")
    p.add_argument("--backend", choices=("petit", "petit-experts", "petit-megamoe"),
                   default="petit",
                   help="the flag-on server: petit's prepare/finalize with vLLM's Triton "
                        "experts (petit), with petit's experts too, or with the fused layer "
                        f"for steps up to {bench.MEGAMOE_MAX_TOKENS} tokens per rank "
                        "(vllm_server.MEGAMOE_MAX_TOKENS) (default: %(default)s)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="GSM8K questions, JSONL (default: %(default)s)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter of the vLLM install (default: %(default)s)")
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default: all GPUs)")
    p.add_argument("--health-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="vllm serve's --gpu-memory-utilization (default: %(default)s)")
    p.add_argument("--results-dir", type=Path, default=ROOT / "examples" / "results",
                   help="where the JSON result goes (default: %(default)s)")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "petit-compare",
                   help="server logs (default: %(default)s)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1 or args.tol <= 0:
        p.error("--num-prompts and --max-tokens must be >= 1, --tol > 0")
    return args


def complete(base_url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """Greedy completion with the top-5 logprobs of every generated token."""
    body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                           logprobs=5, ignore_eos=True)).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=120) as r:
        choice = json.loads(r.read())["choices"][0]
    lp = choice["logprobs"]
    return dict(tokens=lp["tokens"], logprobs=lp["token_logprobs"], top=lp["top_logprobs"])


def compare(a: dict, b: dict, tol: float) -> dict:
    """Agreement of two greedy runs of one prompt (``complete`` outputs), see the module doc."""
    n = 0
    while n < min(len(a["tokens"]), len(b["tokens"])) and a["tokens"][n] == b["tokens"][n]:
        n += 1
    diffs = [abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])]
    worst = max(range(n), key=diffs.__getitem__, default=None)
    result = dict(common_prefix=n, length=min(len(a["tokens"]), len(b["tokens"])),
                  max_logprob_diff=max(diffs, default=0.0), divergence=None,
                  diffs=diffs,  # per position of the common prefix
                  # where the largest difference is, and the two logprobs there (diagnosis)
                  max_diff_position=worst,
                  max_diff_logprobs=None if worst is None else [a["logprobs"][worst],
                                                                b["logprobs"][worst]])
    ok = result["max_logprob_diff"] <= tol
    if n < result["length"]:
        ta, tb = a["tokens"][n], b["tokens"][n]
        # each run's logprob of the other run's choice (None: not in its top 5)
        a_of_b, b_of_a = a["top"][n].get(tb), b["top"][n].get(ta)
        gap_a = None if a_of_b is None else a["logprobs"][n] - a_of_b
        gap_b = None if b_of_a is None else b["logprobs"][n] - b_of_a
        near_tie = (gap_a is not None and gap_b is not None and gap_a <= 2 * tol
                    and gap_b <= 2 * tol)
        result["divergence"] = dict(position=n, token_a=ta, token_b=tb, gap_a=gap_a,
                                    gap_b=gap_b, near_tie=near_tie)
        ok = ok and near_tie
    result["agree"] = ok
    return result


def pooled_quantiles(per_prompt: list[dict]) -> dict:
    """Quantiles of the logprob differences of every common-prefix position of every prompt."""
    diffs = sorted(d for r in per_prompt for d in r["diffs"])
    if not diffs:
        return dict(positions=0, q50=0.0, q90=0.0, q99=0.0, max=0.0)
    at = lambda f: diffs[round(f * (len(diffs) - 1))]  # noqa: E731
    return dict(positions=len(diffs), q50=at(0.5), q90=at(0.9), q99=at(0.99), max=diffs[-1])


def verdict(per_prompt: list[dict], tol: float) -> dict:
    """The run's agreement (module doc): the pooled quantiles, the two counts and the result."""
    n = len(per_prompt)
    q = pooled_quantiles(per_prompt)
    over_2tol = sum(r["max_logprob_diff"] > 2 * tol for r in per_prompt)
    far = sum(r["divergence"] is not None and not r["divergence"]["near_tie"] for r in per_prompt)
    return dict(quantiles=q, prompts_over_2tol=over_2tol, divergences_not_near_tie=far,
                strict=all(r["agree"] for r in per_prompt),
                agree=q["q99"] <= 2 * tol and 5 * over_2tol <= n and 8 * far <= n)


def run_backend(args, backend: str, model_dir: Path, prompts: list[str], dp: int) -> dict:
    port = bench.free_port()
    cmd = bench.vllm_serve_command(args.python, model_dir, "m", port, dp, "TRITON_ATTN",
                                   max_model_len=2048,
                                   gpu_memory_utilization=args.gpu_memory_utilization)
    server = bench.Server(cmd, bench.server_env(backend, strict=True),
                          args.log_dir / f"server_{backend}.log", port)
    bench.log(f"{backend}: starting {' '.join(cmd[2:5])} ... (log {server.log_path})")
    server.start()
    try:
        healthy_s = server.wait_healthy(args.health_timeout)
        ok, evidence = bench.check_backend(server.log_text(), backend)
        if not ok:
            raise bench.BenchError(f"{backend}: {evidence}")
        bench.log(f"{backend}: healthy after {healthy_s:.0f}s; {evidence}")
        outputs = [complete(server.base_url, "m", p, args.max_tokens) for p in prompts]
    finally:
        bench.log(f"{backend}: {server.stop()}")
    # kept even if the other server never comes up (diagnosis across runs)
    out_path = args.log_dir / f"outputs_{backend}.json"
    out_path.write_text(json.dumps(dict(backend=backend, prompts=prompts, outputs=outputs)) + "\n")
    bench.log(f"{backend}: outputs in {out_path}")
    return dict(healthy_s=healthy_s, evidence=evidence, outputs=outputs)


def main(argv=None) -> int:
    args = parse_args(argv)
    gpus = bench.visible_gpus()
    dp = args.dp or len(gpus)
    if dp < 1 or dp > len(gpus):
        print(f"compare_serving: --dp {dp} needs as many GPUs, found {len(gpus)}",
              file=sys.stderr)
        return 2
    env = dict(os.environ, **bench.SAFE_ENV)
    try:
        bench.check_plugin_visible(args.python, env)
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = Path(tempfile.gettempdir()) / "petit-seeded-tiny-qwen3-moe"
            if not (model_dir / "model.safetensors").is_file():
                seeded.make_checkpoint(seeded.DEFAULT_CONFIG, model_dir,
                                       tokenizer_dir=seeded.DEFAULT_TOKENIZER, seed=0,
                                       std=0.02, head_std=0.2)
        prompts = bench.load_prompts(args.data, limit=args.num_prompts)
        runs = {b: run_backend(args, b, model_dir, prompts, dp)
                for b in (args.backend, "default")}
    except (bench.BenchError, ValueError, OSError) as e:
        print(f"compare_serving: {e}", file=sys.stderr)
        return 1
    per_prompt = [compare(a, b, args.tol) for a, b in
                  zip(runs[args.backend]["outputs"], runs["default"]["outputs"])]
    result = verdict(per_prompt, args.tol)
    agree = result["agree"]
    summary = dict(
        gpu=bench.short_gpu_name(gpus[0]) if gpus else "none", world=dp, num_gpus=dp,
        model=str(model_dir), commit=commit_stamp(ROOT),
        date=utc_date(),
        vllm_version=bench.probe_vllm_version(args.python, env), tol=args.tol,
        backend=args.backend, num_prompts=len(prompts), max_tokens=args.max_tokens,
        agree=agree, strict=result["strict"],
        identical_prompts=sum(r["common_prefix"] == r["length"] for r in per_prompt),
        prompts_over_tol=sum(r["max_logprob_diff"] > args.tol for r in per_prompt),
        prompts_over_2tol=result["prompts_over_2tol"],
        divergences_not_near_tie=result["divergences_not_near_tie"],
        max_logprob_diff=max(r["max_logprob_diff"] for r in per_prompt),
        divergences=[r["divergence"] for r in per_prompt if r["divergence"]],
        quantiles=result["quantiles"],
        evidence={b: runs[b]["evidence"] for b in runs},
        healthy_s={b: runs[b]["healthy_s"] for b in runs}, per_prompt=per_prompt)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.backend == "petit" else f"_{args.backend}"
    # vllm serve places each DP rank (TP 1) on its own GPU
    path = args.results_dir / (results_name("compare_serving", summary["gpu"], dp,
                                            suffix=suffix) + ".json")
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{summary['identical_prompts']}/{len(prompts)} prompts identical over "
          f"{args.max_tokens} tokens; max logprob difference on common prefixes "
          f"{summary['max_logprob_diff']:.4f} nats (tol {args.tol}); "
          f"{len(summary['divergences'])} divergence(s), near-ties: "
          f"{[d['near_tie'] for d in summary['divergences']]}")
    print("pooled logprob differences: " + json.dumps(summary["quantiles"]))
    print(("AGREE" if agree else "DISAGREE") + f": wrote {path}")
    return 0 if agree else 1


if __name__ == "__main__":
    t0 = time.monotonic()
    rc = main()
    bench.log(f"done in {time.monotonic() - t0:.0f}s")
    sys.exit(rc)
