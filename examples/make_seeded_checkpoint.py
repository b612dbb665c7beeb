#!/usr/bin/env python3
"""Write a seeded random Qwen3-MoE checkpoint at a realistic weight scale, for serving tests.

`--load-format dummy` weights make vLLM's logits nearly uniform (every logprob ~ -log(vocab)),
so greedy tokens flip on any rounding difference and two backends cannot be compared by their
outputs. This writes a real safetensors checkpoint instead: every matrix ~ N(0, std^2)
(std 0.02, the Hugging Face initializer range) except the output head (std 0.2), norms 1, from
a fixed seed, with the tensor names of Hugging Face Qwen3-MoE checkpoints (what vLLM's
Qwen3MoeForCausalLM loads). With std 0.02 everywhere the 151,936 logits have a spread of only
~0.6 (top-2 gaps of a few hundredths of a nat: near-ties everywhere); the 0.2 head gives ~6,
so the next-token distribution is peaked and two backends can be compared by their tokens.
The MoE output dominates the residual stream (~0.09 rms per layer vs 0.02 for the embedding),
so the comparison is sensitive to the MoE layers.

    python examples/make_seeded_checkpoint.py --out /tmp/qwen3-moe-seeded
    python examples/make_seeded_checkpoint.py --config examples/models/tiny-qwen3-moe \\
        --tokenizer examples/models/qwen3-30b-a3b --num-layers 2 --out DIR --seed 0

--config: a model directory with a qwen3_moe config.json (default the bundled tiny model:
2 layers, hidden 1024, 16 experts, top-4). --tokenizer: a directory whose tokenizer files are
copied next to the weights; its config.json's vocab_size replaces the model's (default the
project's Qwen3-30B-A3B copy, so text prompts and logprobs work). Writes config.json,
tokenizer files, model.safetensors (bf16) and petit_seeded.json (how it was made). The same
arguments always give the same bytes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "examples" / "models" / "tiny-qwen3-moe"
DEFAULT_TOKENIZER = ROOT / "examples" / "models" / "qwen3-30b-a3b"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "generation_config.json")


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a Hugging Face Qwen3-MoE checkpoint for `config`."""
    if config.get("model_type") != "qwen3_moe":
        raise ValueError(f"only qwen3_moe configs are supported, got {config.get('model_type')!r}")
    h, v = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    experts, moe_i = config["num_experts"], config["moe_intermediate_size"]
    dense_i = config["intermediate_size"]
    mlp_only = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1) or 1
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * head_dim, h),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, h),
            p + "self_attn.o_proj.weight": (h, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
        })
        sparse = i not in mlp_only and experts > 0 and (i + 1) % step == 0
        if sparse:
            shapes[p + "mlp.gate.weight"] = (experts, h)
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (moe_i, h), q + "up_proj.weight": (moe_i, h),
                               q + "down_proj.weight": (h, moe_i)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (dense_i, h),
                           p + "mlp.up_proj.weight": (dense_i, h),
                           p + "mlp.down_proj.weight": (h, dense_i)})
    return shapes


def make_checkpoint(config_dir: Path, out: Path, *, tokenizer_dir: Path | None, seed: int,
                    std: float, head_std: float, num_layers: int | None = None) -> Path:
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(config_dir) / "config.json").read_text())
    if num_layers:
        config["num_hidden_layers"] = num_layers
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        tok_config = json.loads((Path(tokenizer_dir) / "config.json").read_text())
        config["vocab_size"] = tok_config["vocab_size"]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in tok_config:
                config[key] = tok_config[key]
        copied = [name for name in TOKENIZER_FILES if (Path(tokenizer_dir) / name).exists()]
        if "tokenizer.json" not in copied and "vocab.json" not in copied:
            raise FileNotFoundError(f"{tokenizer_dir} has no tokenizer files")
        for name in copied:
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in tensor_shapes(config).items():
        if len(shape) == 1:  # RMSNorm weights
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            scale = head_std if name == "lm_head.weight" else std
            tensors[name] = (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "petit_seeded.json").write_text(json.dumps(dict(
        config=str(config_dir), tokenizer=str(tokenizer_dir) if tokenizer_dir else None,
        seed=seed, std=std, head_std=head_std, num_layers=config["num_hidden_layers"],
        num_tensors=len(tensors), num_params=sum(t.numel() for t in tensors.values())),
        indent=2) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="model directory with a qwen3_moe config.json (default: %(default)s)")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                   help="directory with tokenizer files + config.json (its vocab_size is used); "
                        "'none' for no tokenizer (default: %(default)s)")
    p.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02, help="std of every matrix but the head")
    p.add_argument("--head-std", type=float, default=0.2, help="std of lm_head.weight")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    tokenizer = None if str(args.tokenizer).lower() == "none" else args.tokenizer
    try:
        out = make_checkpoint(args.config, args.out, tokenizer_dir=tokenizer, seed=args.seed,
                              std=args.std, head_std=args.head_std,
                              num_layers=args.num_layers)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"make_seeded_checkpoint: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({json.loads((out / 'petit_seeded.json').read_text())['num_params']:,} "
          "parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
