#!/usr/bin/env python3
"""How far two correct MoE backends drift apart on compare_serving's model, from rounding alone.

examples/compare_serving.py compares greedy generations of two `vllm serve` runs by their tokens
and top-5 logprobs. Two backends that round differently (petit sums a token's per-expert bf16
partials in fp32 and rounds once; vLLM's Triton path sums them in bf16 in `moe_sum`, rounding
after every add) give slightly different MoE outputs, and a slightly different hidden state can
flip a later layer's top-k expert choice for a token whose k-th and (k+1)-th router scores are
near-tied: that token then gets another expert's output, and its logprobs move by tenths of a
nat with no fault anywhere.

This script measures that effect on the CPU, with no GPU kernel involved: the seeded tiny
Qwen3-MoE of compare_serving (examples/make_seeded_checkpoint.py, same seed and scales) in
Hugging Face transformers (bf16), decoded greedily twice over the same GSM8K prompts, once per
backend of --pair, each modelled by where it rounds (both GEMMs accumulate in fp32):

    petit    petit's composed experts: SiLU·mul from the fp32 gate/up rounded to bf16, each
             entry's weighted output rounded to bf16, fp32 sum in ascending expert order,
             rounded to bf16 once
    megamoe  the fused layer (one GPU): SiLU·mul from the fp32 gate/up rounded to bf16, the
             weighted outputs kept in fp32 and summed in top-k slot order, rounded once
    triton   vLLM's Triton experts: gate/up rounded to bf16 (the GEMM's output), SiLU·mul
             rounded to bf16, each weighted output rounded to bf16, bf16 sum in top-k slot
             order (`moe_sum`), rounded after every add

and reports compare_serving's statistics between the two (identical prompts, largest logprob
difference on the common prefix, divergences and whether they are near-ties, its verdict and
the strict per-prompt agreement at --tol) plus, per prompt, the decode steps at which some
layer's top-k expert set differs while the tokens still agree. A large logprob difference
that sits on such a routing flip is what rounding does; one without a flip would point at a
fault.

    python examples/compare_rounding_cpu.py                      # 64 prompts, ~4 min on 2 cores
    python examples/compare_rounding_cpu.py --pair megamoe,triton --num-prompts 16
    python examples/compare_rounding_cpu.py --pair megamoe,triton --fault tile  # what a fault does

Writes examples/results/compare_rounding_cpu.json (compare_rounding_cpu_<a>-<b>.json for
another pair, _fault-<name> appended with --fault; --results-dir), with the quantiles of the
logprob differences over every common-prefix position. Needs torch and transformers
(installed with vLLM).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path

import bench_tpot_gsm8k as bench  # (prompts)
import compare_serving  # (the comparison itself)
import make_seeded_checkpoint as seeded
from vllm_petit_moe.testing.bench_env import commit_stamp, utc_date

ROOT = Path(__file__).resolve().parent.parent

BACKENDS = ("petit", "megamoe", "triton")
# Faults injected into the first backend of the pair (--fault), to see what the comparison
# catches: the last top-k slot's expert output missing; the routing weights not applied; one
# 32-row tile of H missing from the lowest-numbered expert with rows in every call; every 50th
# MoE call's first token given 0 (a stale or unwritten row).
FAULTS = ("none", "drop-slot", "unweighted", "tile", "rare-row")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64,
                   help="GSM8K prompts compared (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--pair", default="petit,triton",
                   help=f"the two backends compared, A,B from {', '.join(BACKENDS)} "
                        "(default: %(default)s)")
    p.add_argument("--fault", choices=FAULTS, default="none",
                   help="a fault injected into the first backend of --pair "
                        "(default: %(default)s)")
    p.add_argument("--tol", type=float, default=0.1,
                   help="compare_serving's tolerance, nats (default: %(default)s)")
    p.add_argument("--data", type=Path, default=compare_serving.DEFAULT_DATA,
                   help="GSM8K questions, JSONL (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the seeded checkpoint (default: written to $TMPDIR, as compare_serving)")
    p.add_argument("--results-dir", type=Path, default=ROOT / "examples" / "results",
                   help="where the JSON result goes (default: %(default)s)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1 or args.tol <= 0:
        p.error("--num-prompts and --max-tokens must be >= 1, --tol > 0")
    args.pair = tuple(args.pair.split(","))
    if len(args.pair) != 2 or args.pair[0] == args.pair[1] or not set(args.pair) <= set(BACKENDS):
        p.error(f"--pair: two different backends of {BACKENDS}, got {args.pair}")
    return args


def reduce_partials(parts, top_k_index, reduction: str):
    """parts [T, K, H] (a token's weighted per-entry expert outputs in slot order: fp32 for
    megamoe, bf16 for the others) -> [T, H] bf16, summed as backend `reduction` does."""
    import torch

    if reduction == "megamoe":
        return parts.float().sum(dim=1).to(torch.bfloat16)
    if reduction == "petit":
        order = top_k_index.argsort(dim=1)
        ordered = parts.gather(1, order[:, :, None].expand_as(parts)).float()
        return ordered.sum(dim=1).to(torch.bfloat16)
    if reduction == "triton":
        acc = parts[:, 0]
        for k in range(1, parts.shape[1]):
            acc = (acc.float() + parts[:, k].float()).to(torch.bfloat16)
        return acc
    raise ValueError(f"reduction must be one of {BACKENDS}, got {reduction!r}")


class RoutedExperts:
    """Replacement forward of transformers' Qwen3MoeExperts: both GEMMs in fp32 on the bf16
    weights, rounded where backend `reduction` rounds (the module docstring), then summed as
    it sums. Records the sorted top-k ids of every call in `routes[step]` (one list per
    forward, in layer order)."""

    def __init__(self):
        self.reduction = "petit"
        self.fault = "none"
        self.calls = 0
        self.routes = []

    def __call__(self, module, hidden_states, top_k_index, top_k_weights):
        import torch

        self.routes[-1].append(top_k_index.sort(dim=1).values.clone())
        x = hidden_states.float()
        num_tokens, top_k = top_k_index.shape
        fp32_parts = self.reduction == "megamoe"
        parts = torch.zeros(num_tokens, top_k, x.shape[1],
                            dtype=torch.float32 if fp32_parts else torch.bfloat16)
        for expert in top_k_index.unique().tolist():
            rows, slots = torch.where(top_k_index == expert)
            gate, up = (x[rows] @ module.gate_up_proj[expert].float().T).chunk(2, dim=-1)
            if self.reduction == "triton":  # the gate/up GEMM writes bf16
                gate, up = gate.to(torch.bfloat16).float(), up.to(torch.bfloat16).float()
            act = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float()
            weights = top_k_weights[rows, slots].float()[:, None]
            y = act @ module.down_proj[expert].float().T
            if self.fault != "unweighted":
                y = weights * y
            if self.fault == "tile" and expert == int(top_k_index.min()):
                y[:, :32] = 0
            parts[rows, slots] = y if fp32_parts else y.to(torch.bfloat16)
        if self.fault == "drop-slot":
            parts[:, -1] = 0
        out = reduce_partials(parts, top_k_index, self.reduction)
        self.calls += 1
        if self.fault == "rare-row" and self.calls % 50 == 0:
            out[0] = 0
        return out


def greedy(model, tokenizer, experts, prompt: str, max_tokens: int) -> dict:
    """compare_serving.complete's output (tokens, logprobs, top-5) plus the routes per call."""
    import torch

    experts.routes = []
    tokens, logprobs, tops = [], [], []
    inputs = tokenizer(prompt, return_tensors="pt").input_ids
    cache = None
    with torch.no_grad():
        for _ in range(max_tokens):
            experts.routes.append([])
            out = model(input_ids=inputs, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(logp.argmax())
            tokens.append(tokenizer.decode([token]))
            logprobs.append(float(logp[token]))
            tops.append({tokenizer.decode([int(i)]): float(logp[i]) for i in logp.topk(5).indices})
            inputs = torch.tensor([[token]])
    return dict(tokens=tokens, logprobs=logprobs, top=tops, routes=experts.routes)


def routing_flips(a: dict, b: dict, common_prefix: int) -> list[list[int]]:
    """[step, MoE layer, tokens] where the two runs' top-k sets differ, over the forwards whose
    inputs agree: step 0 (the prompt) to step common_prefix (step s decodes generated token
    s - 1 and gives the logprobs of token s)."""
    flips = []
    for step in range(min(len(a["routes"]), len(b["routes"]), common_prefix + 1)):
        for layer, (x, y) in enumerate(zip(a["routes"][step], b["routes"][step])):
            if x.shape == y.shape and not bool((x == y).all()):
                flips.append([step, layer, int((x != y).any(dim=1).sum())])
    return flips


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    torch.manual_seed(0)
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / "petit-seeded-tiny-qwen3-moe"
    if not (model_dir / "model.safetensors").is_file():
        seeded.make_checkpoint(seeded.DEFAULT_CONFIG, model_dir,
                               tokenizer_dir=seeded.DEFAULT_TOKENIZER, seed=0, std=0.02,
                               head_std=0.2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.eval()
    experts = RoutedExperts()
    for module in model.modules():  # this model's expert modules only (no global patch)
        if isinstance(module, modeling_qwen3_moe.Qwen3MoeExperts):
            module.forward = functools.partial(experts, module)
    prompts = bench.load_prompts(args.data, limit=args.num_prompts)
    runs = {}
    for i, reduction in enumerate(args.pair):
        experts.reduction = reduction
        experts.fault = args.fault if i == 0 else "none"
        runs[reduction] = [greedy(model, tokenizer, experts, p, args.max_tokens)
                           for p in prompts]
        if not all(step for run in runs[reduction] for step in run["routes"]):
            raise RuntimeError("the replacement expert forward was not called in every "
                               "forward: this transformers' Qwen3-MoE is laid out differently")
    per_prompt = []
    for a, b in zip(runs[args.pair[0]], runs[args.pair[1]]):
        result = compare_serving.compare(a, b, args.tol)
        result["routing_flips"] = routing_flips(a, b, result["common_prefix"])
        result["flip_at_max_diff"] = any(f[0] == result["max_diff_position"]
                                         for f in result["routing_flips"])
        per_prompt.append(result)
    large = [r for r in per_prompt if r["max_logprob_diff"] > args.tol]
    very_large = [r for r in per_prompt if r["max_logprob_diff"] > 2 * args.tol]
    result = compare_serving.verdict(per_prompt, args.tol)
    summary = dict(
        commit=commit_stamp(ROOT), date=utc_date(), model=str(model_dir),
        reductions=list(args.pair), fault=args.fault, tol=args.tol, num_prompts=len(prompts),
        max_tokens=args.max_tokens, agree=result["agree"], strict=result["strict"],
        identical_prompts=sum(r["common_prefix"] == r["length"] for r in per_prompt),
        max_logprob_diff=max(r["max_logprob_diff"] for r in per_prompt),
        divergences=[r["divergence"] for r in per_prompt if r["divergence"]],
        prompts_over_tol=len(large),
        # differences over 2 x tol, and how many of them sit on a routing flip of the same
        # step (the forward of step s gives the logprob of generated token s)
        prompts_over_2tol=len(very_large),
        over_2tol_at_a_flip=sum(r["flip_at_max_diff"] for r in very_large),
        divergences_not_near_tie=result["divergences_not_near_tie"],
        quantiles=result["quantiles"],
        per_prompt=per_prompt)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.pair == ("petit", "triton") else "_" + "-".join(args.pair)
    suffix += "" if args.fault == "none" else f"_fault-{args.fault}"
    path = args.results_dir / f"compare_rounding_cpu{suffix}.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{summary['identical_prompts']}/{len(prompts)} prompts identical over "
          f"{args.max_tokens} tokens; max logprob difference on common prefixes "
          f"{summary['max_logprob_diff']:.4f} nats; {len(large)} prompt(s) over tol {args.tol}, "
          f"{len(very_large)} over {2 * args.tol}, {summary['over_2tol_at_a_flip']} of those at "
          f"a routing flip of that step; "
          f"{len(summary['divergences'])} divergence(s), near-ties: "
          f"{[d['near_tie'] for d in summary['divergences']]}")
    print("pooled logprob differences: " + json.dumps(summary["quantiles"]))
    for i, r in enumerate(per_prompt):
        if r["max_logprob_diff"] > args.tol:
            print(f"  prompt {i}: {r['max_logprob_diff']:.3f} nats at step "
                  f"{r['max_diff_position']}; routing flips [step, layer, tokens]: "
                  f"{r['routing_flips']}")
    print(("AGREE" if summary["agree"] else "DISAGREE") + f": wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
