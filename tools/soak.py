"""GPU soak of the EP MoE layer (docs/faults.md: no hang, no wrong row in rare orderings and
shapes): >= 10^4 randomized rounds of dispatch -> experts -> combine per run against the torch
reference, with CUDA-graph replays in between; writes one
JSONL line to examples/results/soak_<gpu>x<W>.jsonl. The path rotates (--experts alternate):
seed % 3 == 1 runs the fused layer kernel as the expert stage (ops.megamoe_forward over the
received rows), seed % 3 == 2 the whole layer fused (EpBuffer.megamoe: dispatch, experts and
combine in one launch), where the round's shape qualifies (H and I multiples of 64,
W x R x K <= 2048 entries); the rest runs dispatch -> ops.experts_forward -> combine.
`rounds_megamoe` and `rounds_fused` count the first two.

    python tools/soak.py --world 2 --rounds 10000           # W ranks share the visible GPUs
    python tools/soak.py --world 4 --rounds 10000 --seed 7

Every rank draws the same rounds (vllm_petit_moe.testing.soak.draw_round: seeds swept, shape
from SHAPES, T per rank random with zeros, uniform / hot rank / hot expert / -1 slots /
repeated ids), computes its own expected output (testing.soak.RankReference: the rounding
model of testing.reference.ep_moe_reference, vectorized over the experts for one rank's
tokens, checked against it by tests/test_soak_emu_cpu.py) and counts a mismatch where the
layer's output leaves the tolerance derived from the reference's own bf16-vs-fp32 error
(testing.reference.tolerance). --max-seconds ends a run early, at a round all ranks agree on;
the row records the rounds that ran. Every --graph-every rounds a rank captures one round of
fixed shapes in a CUDA graph and replays it --replays times with fresh inputs copied in (odd
counts), each replay checked the same way. W ranks are processes on the visible GPUs (rank r
on GPU r % num_gpus: ranks share one GPU when there are fewer), joined by a gloo group; each
rank's persistent grid gets SMs / ranks-per-GPU SMs. A round in which a rank has no tokens
is not synchronized on that rank (nothing to check), so it runs ahead into the next round as
in a serving loop: that found the zero-token combine race fixed in 1b3a2a2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 96


def _check(y, inputs, reference):
    """(mismatch, relative error) of this rank's output y for its inputs (x, ids, weights)."""
    from vllm_petit_moe.testing.soak import check_round
    return check_round(y, reference(*inputs, "kernel"), reference(*inputs, "fp32"))


PATHS = ("composed", "megamoe", "fused")


def round_path(seed: int, experts: str, shape, world: int, stride: int) -> str:
    """The path of the round drawn from `seed`: "composed", "megamoe" (the fused kernel as the
    expert stage) or "fused" (the whole layer), in rotation by seed for experts="alternate"
    (so `--seed S --rounds 1` replays round S of a run from seed 0); composed where the fused
    kernel does not take the shape."""
    from vllm_petit_moe import ops
    hidden, inter, top_k, _ = shape
    wanted = PATHS[seed % 3] if experts == "alternate" else experts
    qualifies = ops.megamoe_unsupported_reason(world * stride, top_k, hidden, inter) is None
    return wanted if qualifies else "composed"


def soak_rank(state, rounds: int, seed: int, graph_every: int, replays: int,
              experts: str = "alternate", max_seconds: float = 0.0,
              timeout_s: float = 60.0) -> dict:
    """One rank's share of the soak (run on every rank of a rank pool). timeout_s bounds a
    wait on a peer, max_wait_s (a wait on a peer whose process still beats) is twice it: a
    deadlock of live ranks becomes an error naming the wait within 2 x timeout_s, not
    EpBuffer's 30-minute default."""
    import torch

    from vllm_petit_moe import ops
    from vllm_petit_moe.testing.rank_pool import get_buffer
    from vllm_petit_moe.testing.soak import SHAPES, RankReference, draw_round, expert_weights

    rank, world, device = state["rank"], state["world_size"], state["device"]
    per_gpu = -(-world // max(torch.cuda.device_count(), 1))
    sms = torch.cuda.get_device_properties(device).multi_processor_count // per_gpu
    mine, bufs, refs = {}, {}, {}  # per shape: this rank's experts' weights, buffer, reference
    for shape in SHAPES:
        w13, w2 = expert_weights(shape, device=device)
        refs[shape] = RankReference(w13, w2, world)
        hidden, _, top_k, num_experts = shape
        local = slice(rank * (num_experts // world), (rank + 1) * (num_experts // world))
        mine[shape] = w13[local].contiguous(), w2[local].contiguous()
        bufs[shape] = get_buffer(state, hidden_size=hidden, num_experts=num_experts,
                                 max_tokens_per_rank=MAX_TOKENS, max_top_k=top_k, num_sms=sms,
                                 timeout_s=timeout_s, max_wait_s=2 * timeout_s)

    def layer(buf, shape, x, ids, w, stride, kind, out=None):
        w13, w2 = mine[shape]
        if kind == "fused":
            return buf.megamoe(x, ids, w, w13, w2, region_stride=stride, out=out)
        d = buf.dispatch(x, ids, w, region_stride=stride)
        if kind == "megamoe":
            expert_out = ops.megamoe_forward(d.recv_x, d.recv_topk_ids, d.recv_topk_weights,
                                             w13, w2, num_sms=sms)
        else:
            expert_out = ops.experts_forward(d.recv_x, d.recv_topk_ids, d.recv_topk_weights,
                                             w13, w2)
        return buf.combine(expert_out, d.handle, out=out)

    start = time.monotonic()
    if rank == 0:  # --max-seconds counts from here, after the set-up
        print(f"rank 0: set up (weights, references, {len(SHAPES)} buffers)", file=sys.stderr,
              flush=True)
    stats = dict(rounds=0, rounds_megamoe=0, rounds_fused=0, graph_replays=0, mismatches=0,
                 max_rel_err=0.0, first_mismatch=None)
    for i in range(rounds):
        # drawn on the host (every rank draws every rank's inputs, the same stream of random
        # numbers); only this rank's go to the GPU
        rd = draw_round(seed + i, world, MAX_TOKENS)
        inputs = tuple(t[rank].to(device) for t in (rd.xs, rd.topk_ids, rd.topk_weights))
        stride = max(max(rd.tokens), 1)
        kind = round_path(rd.seed, experts, rd.shape, world, stride)
        # ranks enter the round together: where they share a GPU by time slices, a rank
        # spinning in the layer while its peer still checks the last round slows both
        torch.distributed.barrier(group=state["group"])
        try:
            y = layer(bufs[rd.shape], rd.shape, *inputs, stride, kind)
            bad, err = _check(y, inputs, refs[rd.shape])
        except Exception as e:  # which round: --seed <its seed> --rounds 1 replays it
            raise RuntimeError(f"rank {rank}: round {i} (seed {rd.seed}, path {kind}, shape "
                               f"{rd.shape}, tokens {rd.tokens}, {rd.pattern}, region stride "
                               f"{stride}) failed: {e}") from e
        stats["rounds"] += 1
        stats["rounds_megamoe"] += kind == "megamoe"
        stats["rounds_fused"] += kind == "fused"
        stats["mismatches"] += bad
        stats["max_rel_err"] = max(stats["max_rel_err"], err)
        if bad and stats["first_mismatch"] is None:
            stats["first_mismatch"] = dict(seed=rd.seed, pattern=rd.pattern, shape=rd.shape,
                                           path=kind)
        if graph_every and (i + 1) % graph_every == 0:
            # One graph of this round's shapes (every rank captures and replays the same
            # count), fresh inputs of the same token counts copied in before each replay.
            buf = bufs[rd.shape]
            x, ids, w = (t.clone() for t in inputs)
            out = torch.empty_like(x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer(buf, rd.shape, x, ids, w, stride, kind, out=out)
            for r in range(replays):
                # every rank draws the same fresh rows for every rank; its own go in
                gen = torch.Generator(device="cpu").manual_seed(seed * 7919 + i * 31 + r)
                fresh = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in rd.xs]
                x.copy_(fresh[rank].to(device))
                graph.replay()
                bad, err = _check(out, (x, ids, w), refs[rd.shape])
                stats["graph_replays"] += 1
                stats["mismatches"] += bad
                stats["max_rel_err"] = max(stats["max_rel_err"], err)
            del graph
        if (i + 1) % 100 == 0 and rank == 0:  # progress, so a cut-off run still says where
            print(f"rank 0: {i + 1} rounds ({stats['rounds_megamoe']} megamoe, "
                  f"{stats['rounds_fused']} fused), {stats['graph_replays']} replays, "
                  f"{stats['mismatches']} mismatches, {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
        if max_seconds and (i + 1) % 10 == 0:  # every rank stops after the same round
            late = torch.tensor([float(time.monotonic() - start > max_seconds)])
            torch.distributed.all_reduce(late, op=torch.distributed.ReduceOp.MAX,
                                         group=state["group"])
            if late.item() > 0:
                break
    torch.cuda.synchronize()
    return stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10_000, help="rounds per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--graph-every", type=int, default=250)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--experts", choices=("alternate",) + PATHS,
                        default="alternate",
                        help="the path: rotate over the three (default), or always one (the "
                        "fused ones where the shape qualifies)")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="end early after this long (0: run every round)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="EpBuffer's timeout_s; max_wait_s is twice it")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    import soak  # the workers unpickle soak_rank by its module (tools/, the script's folder)

    from vllm_petit_moe.testing.rank_pool import ep_rank_pool
    num_gpus = torch.cuda.device_count()
    if num_gpus == 0:
        print("soak: needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0).split()[-1]
    start = time.monotonic()
    pool = ep_rank_pool(args.world, min(num_gpus, args.world))
    try:
        results = pool.run(soak.soak_rank, args.rounds, args.seed, args.graph_every, args.replays,
                           args.experts, args.max_seconds, args.timeout_s,
                           timeout_s=args.max_seconds + 600 if args.max_seconds else 24 * 3600)
    finally:
        pool.close()
    seconds = time.monotonic() - start
    from vllm_petit_moe.testing.bench_env import commit_stamp
    commit = commit_stamp(ROOT)
    row = dict(gpu=gpu, world=args.world, num_gpus=min(num_gpus, args.world), commit=commit,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               seed=args.seed, experts=args.experts,
               rounds=sum(r["rounds"] for r in results),
               rounds_megamoe=sum(r["rounds_megamoe"] for r in results),
               rounds_fused=sum(r["rounds_fused"] for r in results),
               rounds_per_rank=results[0]["rounds"], rounds_asked=args.rounds,
               graph_replays=sum(r["graph_replays"] for r in results),
               mismatches=sum(r["mismatches"] for r in results),
               max_rel_err=max(r["max_rel_err"] for r in results),
               first_mismatch=next((r["first_mismatch"] for r in results
                                    if r["first_mismatch"]), None),
               seconds=round(seconds, 1))
    out = args.out or ROOT / "examples" / "results" / f"soak_{gpu}x{args.world}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return 0 if row["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
