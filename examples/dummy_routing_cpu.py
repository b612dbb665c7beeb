#!/usr/bin/env python3
"""How a `vllm serve --load-format dummy` model routes its decode tokens, on the CPU.

vLLM's dummy loader (`initialize_dummy_weights`) fills every floating-point tensor of the model's
state dict with uniform values in [-1e-3, 1e-3], each tensor from a generator re-seeded with
1234 (so tensors of equal shape, e.g. every layer's router, get equal values). This script
builds the same model from its config with Hugging Face transformers (an N-layer copy), gives
it weights made the same way, decodes the first P GSM8K questions greedily in one batch (the
TPOT benchmark's prompt format) and records the router's top-k experts of every token of every
decode step in every MoE layer.

Printed and written (--out, JSON): per decode step, how many distinct tokens the P sequences
emit and, per layer, how many distinct experts the step's P tokens use together (what the
step's expert GEMMs stream), against the expectation under uniform routing, and the distinct
top-k sets over all decode tokens. The values are not vLLM's (another generator, fp32/bf16
CPU kernels, transformers' layer layout), the way they are made is: so the outcome is a
model of the served decode, to compare with the kernel times of a served step (README,
"Where a decode step's time goes").

    python examples/dummy_routing_cpu.py --model-dir examples/models/qwen3-30b-a3b \\
        --num-layers 4 --prompts 16 --new-tokens 12 --out examples/results/dummy_routing_cpu.json

Needs torch and transformers (the test extra); ~7 GB of memory for 4 Qwen3-30B-A3B layers in
bf16 (the experts dominate: 1.2 GB per layer).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_tpot_gsm8k import load_prompts  # (the TPOT benchmark's prompts)

ROOT = Path(__file__).resolve().parent.parent

DUMMY_LOW, DUMMY_HIGH, DUMMY_SEED = -1e-3, 1e-3, 1234  # vLLM's initialize_dummy_weights


def dummy_init_(model) -> int:
    """vLLM's dummy weights, made the same way: every floating-point tensor of the state dict
    uniform in [DUMMY_LOW, DUMMY_HIGH] from a generator seeded DUMMY_SEED per tensor. Returns
    the number of tensors filled."""
    import torch

    filled = 0
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if torch.is_floating_point(tensor):
                gen = torch.Generator(device=tensor.device).manual_seed(DUMMY_SEED)
                tensor.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=gen)
                filled += 1
    return filled


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Mean number of distinct experts `tokens` tokens use when each picks `top_k` distinct
    experts uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def routing_summary(steps: list[list], num_experts: int, top_k: int) -> dict:
    """`steps[s][layer]`: the [P, K] expert ids of decode step s's P tokens in that layer
    (lists). Per layer: mean and max distinct experts per step, distinct top-k sets over all
    decode tokens, distinct experts over all decode tokens."""
    layers = len(steps[0]) if steps else 0
    tokens = len(steps[0][0]) if layers else 0
    out = []
    for layer in range(layers):
        per_step = [len({e for row in step[layer] for e in row}) for step in steps]
        sets = {tuple(sorted(row)) for step in steps for row in step[layer]}
        used = {e for step in steps for row in step[layer] for e in row}
        out.append({"layer": layer, "experts_per_step_mean": sum(per_step) / len(per_step),
                    "experts_per_step_max": max(per_step), "distinct_topk_sets": len(sets),
                    "distinct_experts": len(used)})
    return {"tokens_per_step": tokens,
            "uniform_experts_per_step": expected_distinct_experts(num_experts, top_k, tokens),
            "layers": out}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--model-dir", default=str(ROOT / "examples" / "models" / "qwen3-30b-a3b"),
                   help="config.json + tokenizer files (a Qwen3-MoE model)")
    p.add_argument("--num-layers", type=int, default=4, help="layers of the copy (default 4)")
    p.add_argument("--prompts", type=int, default=16, help="GSM8K questions, one batch")
    p.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per question")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--data", default=str(ROOT / "examples" / "data" / "gsm8k_test.jsonl"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="write the summary here (JSON)")
    args = p.parse_args(argv)
    if args.num_layers < 1 or args.prompts < 1 or args.new_tokens < 2:
        p.error("--num-layers and --prompts must be >= 1, --new-tokens >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(args.model_dir)
    if getattr(config, "model_type", "") != "qwen3_moe":
        raise SystemExit(f"{args.model_dir}: model_type {config.model_type!r}; this script "
                         f"reads the router of Qwen3-MoE layers (qwen3_moe)")
    config.num_hidden_layers = args.num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:args.num_layers]
    dtype = getattr(torch, args.dtype)
    t0 = time.time()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    filled = dummy_init_(model)
    print(f"model: {args.num_layers} layers, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}"
          f"e9 parameters, {filled} tensors filled with dummy weights ({time.time() - t0:.0f}s)")

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(load_prompts(args.data, args.prompts), return_tensors="pt", padding=True)

    record: list[list] = []  # per forward call: per layer the [tokens, K] expert ids
    current: dict[int, list] = {}
    moe_layers = []
    for index, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue  # a dense layer
        moe_layers.append(index)

        def hook(_module, _inputs, output, index=index):
            current[index] = output[2].reshape(-1, output[2].shape[-1]).tolist()

        gate.register_forward_hook(hook)

    def step_hook(_module, _inputs, _output):
        record.append([current[i] for i in moe_layers])
        current.clear()

    model.model.register_forward_hook(step_hook)
    t0 = time.time()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    print(f"decoded {args.prompts} x {args.new_tokens} tokens in {time.time() - t0:.0f}s")
    generated = out[:, batch["input_ids"].shape[1]:].tolist()
    decode_steps = record[1:]  # record[0] is the prefill of the whole batch
    tokens_per_step = [len({seq[s] for seq in generated}) for s in range(len(generated[0]))]
    summary = routing_summary(decode_steps, config.num_experts, config.num_experts_per_tok)
    result = {"model_dir": str(args.model_dir), "num_layers": args.num_layers,
              "moe_layers": moe_layers, "dtype": args.dtype, "prompts": args.prompts,
              "new_tokens": args.new_tokens, "num_experts": config.num_experts,
              "top_k": config.num_experts_per_tok,
              "distinct_tokens_per_step": tokens_per_step,
              "generated_token_ids": generated, **summary}
    print(f"distinct emitted tokens per step (of {args.prompts} sequences): {tokens_per_step}")
    print(f"experts used by one decode step's {summary['tokens_per_step']} tokens "
          f"(uniform routing would use {summary['uniform_experts_per_step']:.1f} of "
          f"{config.num_experts}):")
    for row in summary["layers"]:
        print(f"  layer {moe_layers[row['layer']]}: mean {row['experts_per_step_mean']:.1f}, "
              f"max {row['experts_per_step_max']}; {row['distinct_topk_sets']} distinct top-"
              f"{config.num_experts_per_tok} sets and {row['distinct_experts']} experts over "
              f"all {len(decode_steps) * summary['tokens_per_step']} decode tokens")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
