#!/usr/bin/env python3
"""Bit-equality of the default expert path between two source trees (a same-run A/B's other
half; tools/ab_trees.sh times them). Run once per tree, each a built checkout, on the same GPU:

    python tools/ab_outputs.py --tree ab_old --out $OUT/outputs-old.json
    python tools/ab_outputs.py --tree .      --out $OUT/outputs-new.json
    python tools/ab_outputs.py --compare $OUT/outputs-old.json $OUT/outputs-new.json

For each preset (rank 0's share at W=2: E/2 local experts), routing (uniform local ids with
-1 slots, or 80% of the slots on 1/8 of the experts) and token count (W x tokens received
rows), it runs that tree's `ops.experts_forward` with its default tiles (--op megamoe: its
`ops.megamoe_forward` on the token count's rows, at most MEGAMOE_MAX_ENTRIES entries) on inputs
drawn from a seeded CUDA generator (the same bits in both runs) and records the SHA-256 of the
output's bytes. --compare prints the configurations whose outputs differ and exits 1 if any does.
The digests run in a fresh interpreter whose PYTHONPATH starts with the tree, so that its
vllm_petit_moe is the one imported.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

PRESET_NAMES = ("deepseek-v3", "qwen3-30b-a3b")  # of vllm_moe_harness.PRESETS
TOKENS = [1, 2, 8, 32, 128, 512, 2048, 8192]
WORLD = 2

# Run by tree_digests in the fresh interpreter: this file loaded by its path (its folder is not
# on that interpreter's path), digests() with the shapes and tokens given as JSON.
_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("ab_outputs", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
digests = module.digests(json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[5])
with open(sys.argv[4], "w") as f:
    json.dump(digests, f, indent=1)
"""


def tree_digests(tree: Path, tokens: list[int], out: Path, op: str = "experts") -> int:
    """digests() of `tree`'s vllm_petit_moe, written to `out` as JSON (returns the exit
    status): in a fresh interpreter in the tree with the tree first on PYTHONPATH (this one has imported the installed
    vllm_petit_moe for the presets; `python -c` puts its working directory first)."""
    from vllm_petit_moe.testing.vllm_moe_harness import PRESETS
    shapes = {name: dataclasses.asdict(PRESETS[name]) for name in PRESET_NAMES}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree.resolve())] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-c", _CHILD, str(Path(__file__).resolve()),
                           json.dumps(shapes), json.dumps(tokens), str(out.resolve()), op],
                          cwd=tree.resolve(), env=env).returncode


def digests(shapes: dict[str, dict], tokens: list[int], op: str = "experts") -> dict[str, str]:
    """{preset/routing/tokens: SHA-256 of the output} of the imported vllm_petit_moe's
    experts_forward (op "megamoe": megamoe_forward); `shapes`: {preset: MoEShape's fields as
    a dict}."""
    import torch

    from vllm_petit_moe import ops
    out = {}
    for preset, shape in shapes.items():
        hidden, inter, top_k = shape["hidden"], shape["intermediate"], shape["top_k"]
        local = shape["num_experts"] // WORLD
        g = torch.Generator(device="cuda").manual_seed(1)
        w13 = (torch.randn(local, 2 * inter, hidden, generator=g, device="cuda")
               / hidden**0.5).bfloat16()
        w2 = (torch.randn(local, hidden, inter, generator=g, device="cuda")
              / inter**0.5).bfloat16()
        for routing in ("uniform", "skewed"):
            for t in tokens:
                rows = WORLD * t if op == "experts" else t
                if op == "megamoe" and rows * top_k > ops.MEGAMOE_MAX_ENTRIES:
                    continue  # beyond the fused layer's limit
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
    return tree_digests(args.tree, args.tokens, args.out, args.op)


if __name__ == "__main__":
    sys.exit(main())
