#!/usr/bin/env python3
"""Bit-equality of the default expert path between two source trees (a same-run A/B's other
half; tools/ab_trees.sh times them). Run once per tree, each a built checkout, on the same GPU:

    python tools/ab_outputs.py --tree ab_old --out $OUT/outputs-old.json
    python tools/ab_outputs.py --tree .      --out $OUT/outputs-new.json
    python tools/ab_outputs.py --compare $OUT/outputs-old.json $OUT/outputs-new.json

For each preset (rank 0's share at W=2: E/2 local experts), routing (uniform local ids with
-1 slots, or 80% of the slots on 1/8 of the experts) and token count (W x tokens received
rows), it runs that tree's `ops.experts_forward` with its default tiles (--op megamoe: its
`ops.megamoe_forward` on the token count's rows, at most MEGAMOE_MAX_ENTRIES entries) on
inputs drawn from a seeded CUDA generator (the same bits in both runs) and records the SHA-256
of the output's bytes. --compare prints the configurations whose outputs differ and exits 1 if
any does.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import vllm_moe_harness as harness  # noqa: E402

PRESETS = {name: harness.PRESETS[name] for name in ("deepseek-v3", "qwen3-30b-a3b")}
TOKENS = [1, 2, 8, 32, 128, 512, 2048, 8192]
WORLD = 2


def digests(tree: Path, tokens: list[int], op: str = "experts") -> dict[str, str]:
    sys.path.insert(0, str(tree.resolve()))
    import torch

    from vllm_petit_moe import ops
    out = {}
    for preset, shape in PRESETS.items():
        hidden, inter, top_k = shape.hidden, shape.intermediate, shape.top_k
        local = shape.num_experts // WORLD
        g = torch.Generator(device="cuda").manual_seed(1)
        w13 = (torch.randn(local, 2 * inter, hidden, generator=g, device="cuda")
               / hidden**0.5).bfloat16()
        w2 = (torch.randn(local, hidden, inter, generator=g, device="cuda")
              / inter**0.5).bfloat16()
        for routing in ("uniform", "skewed"):
            for t in tokens:
                rows = WORLD * t if op == "experts" else t
                g.manual_seed(zlib.crc32(f"{preset}/{routing}/{t}".encode()))
                x = torch.randn(rows, hidden, generator=g, device="cuda").bfloat16()
                ids = torch.randint(0, local, (rows, top_k), generator=g, device="cuda")
                if routing == "skewed":
                    hot = torch.rand(rows, top_k, generator=g, device="cuda") < 0.8
                    ids = torch.where(hot, ids % max(1, local // 8), ids)
                ids[torch.rand(rows, top_k, generator=g, device="cuda") < 0.4] = -1
                w = torch.rand(rows, top_k, generator=g, device="cuda")
                forward = ops.experts_forward if op == "experts" else ops.megamoe_forward
                y = forward(x, ids.int(), w, w13, w2)
                torch.cuda.synchronize()
                out[f"{preset}/{routing}/{t}"] = hashlib.sha256(
                    y.view(torch.int16).cpu().numpy().tobytes()).hexdigest()
        del w13, w2
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=Path, help="a built checkout whose vllm_petit_moe to run")
    p.add_argument("--out", type=Path, help="JSON of {configuration: sha256}")
    p.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    p.add_argument("--op", choices=("experts", "megamoe"), default="experts",
                   help="the op whose outputs are hashed")
    p.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"))
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.loads(path.read_text()) for path in args.compare)
        common = sorted(set(a) & set(b))
        differ = [k for k in common if a[k] != b[k]]
        for k in differ:
            print(f"differs: {k}")
        print(f"{len(common) - len(differ)} of {len(common)} configurations bit-equal")
        return 1 if differ or not common else 0
    if args.tree is None or args.out is None:
        p.error("--tree and --out (or --compare A B)")
    args.out.write_text(json.dumps(digests(args.tree, args.tokens, args.op), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
