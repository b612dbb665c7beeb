"""GPU soak of the EP MoE layer as vLLM runs it (docs/faults.md: no hang, no wrong row in rare
orderings and shapes): >= 10^4 randomized rounds per rank against the torch reference, with
CUDA-graph replays in between; appends one JSONL line to
examples/results/soak_<gpu>_<G>gpu_<R>ranks.jsonl (G physical GPUs, R ranks on them).

    python tools/soak.py --ranks 2 --rounds 10000          # R ranks share the visible GPUs
    python tools/soak.py --ranks 4 --rounds 10000 --seed 7
    python tools/soak.py --seed 37 --rounds 1               # replay round 37 of a run

What a round runs rotates with its seed (vllm_petit_moe.testing.soak.plan_round; every 40
consecutive seeds cover every combination, so `--seed S --rounds 1` replays round S):
  - the path: "composed" (EpBuffer.dispatch -> ops.experts_forward -> combine), "megamoe"
    (the fused kernel, ops.megamoe_forward, as the expert stage on the received rows),
    "fused" (the whole layer in one launch, EpBuffer.megamoe), "megamoe_w1_fp8" (the one-GPU
    fused op with block-fp8 weights, e4m3 with fp32 scales per 128 x 128 block, on each
    rank's own tokens), "fused_fp8" (the whole layer on this rank's experts' block-fp8
    weights); a shape the fused kernels do not take runs composed;
  - the dispatch wire: bf16 or one of dispatch's fp8 modes (fp8_block128, fp8_block128_ue8m0,
    fp8_per_token; a hidden size that is not a multiple of 128 takes fp8_per_token); the
    expert stage gets the received e4m3 rows dequantized to bf16, the reference the same
    quantization of the sent rows (testing.reference.quantize_fp8_reference). The fused layer
    and the one-GPU op take bf16 rows;
  - the ids' dtype: int32 (what vLLM's router gives) or int64 (the one-GPU op: int32).
The buffers run with validate_ids=False and no barrier between rounds, as the vLLM glue runs
them (vllm_glue/buffer_cache.py, prepare_finalize.py): ranks run ahead of each other as far as
the layer lets them; where ranks share a GPU, a rank spinning in the layer while its peer
checks the last round costs time slices, not correctness. --path / --wire / --ids fix one
choice instead of the rotation.

Every rank draws the same rounds (testing.soak.soak_round: seeds swept, shape from SHAPES,
T per rank random with zeros, uniform / hot rank / hot expert / -1 slots / repeated ids),
computes its own expected output (testing.soak.RankReference: the rounding model of
testing.reference.ep_moe_reference, vectorized over the experts for one rank's tokens, checked
against it by tests/test_soak_emu_cpu.py; for fp8 weights the dequantized weights at W=1) and
counts a mismatch where the layer's output leaves the tolerance derived from the reference's
own bf16-vs-fp32 error (testing.reference.tolerance). --max-seconds ends a run early, at a
round all ranks agree on (one gloo all-reduce every STOP_CHECK_EVERY rounds, only then); the
row records the rounds that ran, by path, wire, ids dtype and weight format
(testing.soak.soak_row). Every --graph-every rounds a rank captures one round of fixed shapes
in a CUDA graph and replays it --replays times with fresh inputs copied in (odd counts), each
replay checked the same way. R ranks are processes on the visible GPUs (rank r on GPU r % G:
ranks share a GPU when there are fewer), joined by a gloo group; each rank's persistent grid
gets SMs / ranks-per-GPU SMs. A round in which a rank has no tokens is not synchronized on
that rank (nothing to check), so it runs ahead into the next round as in a serving loop: that
found the zero-token combine race fixed in 1b3a2a2.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from vllm_petit_moe.testing.soak import ID_DTYPES, PATHS, WIRES

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 96
STOP_CHECK_EVERY = 50  # rounds between the ranks' agreement on --max-seconds
IDS = tuple(str(d).removeprefix("torch.") for d in ID_DTYPES)


def soak_rank(state, rounds: int, seed: int, graph_every: int, replays: int,
              path: str = "alternate", wire: str = "alternate", ids: str = "alternate",
              max_seconds: float = 0.0, timeout_s: float = 60.0) -> dict:
    """One rank's share of the soak (run on every rank of a rank pool). timeout_s bounds a
    wait on a peer, max_wait_s (a wait on a peer whose process still beats) is twice it: a
    deadlock of live ranks becomes an error naming the wait within 2 x timeout_s, not
    EpBuffer's 30-minute default."""
    import torch

    from vllm_petit_moe import ops
    from vllm_petit_moe.limits import FP8_SCALE_BLOCK
    from vllm_petit_moe.testing.rank_pool import get_buffer
    from vllm_petit_moe.testing.soak import (
        SHAPES, RankReference, check_round, dequantize_wire, expert_weights, fp8_expert_weights,
        schedule_mix, soak_round, wire_rows)

    rank, world, device = state["rank"], state["world_size"], state["device"]
    per_gpu = -(-world // max(torch.cuda.device_count(), 1))
    sms = torch.cuda.get_device_properties(device).multi_processor_count // per_gpu
    mine, bufs, refs = {}, {}, {}  # per shape: this rank's experts' weights, buffer, reference
    # per fp8-able shape: all experts' block-fp8 weights and this rank's, the W=1 reference
    # (every expert on this rank's tokens) and the EP one
    fp8, fp8_mine, fp8_refs, fp8_ep_refs = {}, {}, {}, {}
    for shape in SHAPES:
        w13, w2 = expert_weights(shape, device=device)
        refs[shape] = RankReference(w13, w2, world)
        hidden, inter, top_k, num_experts = shape
        local = slice(rank * (num_experts // world), (rank + 1) * (num_experts // world))
        mine[shape] = w13[local].contiguous(), w2[local].contiguous()
        # validate_ids=False: the vLLM glue's setting (no host sync on the forward path)
        bufs[shape] = get_buffer(state, hidden_size=hidden, num_experts=num_experts,
                                 max_tokens_per_rank=MAX_TOKENS, max_top_k=top_k, num_sms=sms,
                                 timeout_s=timeout_s, max_wait_s=2 * timeout_s,
                                 validate_ids=False)
        if hidden % FP8_SCALE_BLOCK == 0 and inter % FP8_SCALE_BLOCK == 0:
            q13, s13, q2, s2, d13, d2 = fp8_expert_weights(shape, device=device)
            fp8[shape] = q13, s13, q2, s2
            fp8_mine[shape] = tuple(t[local].contiguous() for t in (q13, s13, q2, s2))
            fp8_refs[shape] = RankReference(d13, d2, 1)
            fp8_ep_refs[shape] = RankReference(d13, d2, world)
            del d13, d2

    def layer(plan, shape, x, ids_, w, stride, out=None):
        if plan.path == "megamoe_w1_fp8":  # this rank's tokens, every expert, no dispatch
            q13, s13, q2, s2 = fp8[shape]
            return ops.megamoe_forward(x, ids_, w, q13, q2, w13_scale=s13, w2_scale=s2,
                                       num_sms=sms, out=out)
        buf = bufs[shape]
        w13, w2 = mine[shape]
        if plan.path == "fused":
            return buf.megamoe(x, ids_, w, w13, w2, region_stride=stride, out=out)
        if plan.path == "fused_fp8":
            q13, s13, q2, s2 = fp8_mine[shape]
            return buf.megamoe(x, ids_, w, q13, q2, w13_scale=s13, w2_scale=s2,
                               region_stride=stride, out=out)
        d = buf.dispatch(x, ids_, w, region_stride=stride, quant=plan.quant)
        # fp8 wire: the experts take bf16, so the received e4m3 rows are dequantized first
        # (rows no local id routes to may hold anything; the expert stage never reads them)
        recv_x = d.recv_x if plan.quant is None else dequantize_wire(d.recv_x, d.recv_x_scales)
        if plan.path == "megamoe":
            expert_out = ops.megamoe_forward(recv_x, d.recv_topk_ids, d.recv_topk_weights,
                                             w13, w2, num_sms=sms)
        else:
            expert_out = ops.experts_forward(recv_x, d.recv_topk_ids, d.recv_topk_weights,
                                             w13, w2)
        return buf.combine(expert_out, d.handle, out=out)

    def check(y, plan, shape, x, ids_, w):
        reference = {"megamoe_w1_fp8": fp8_refs, "fused_fp8": fp8_ep_refs}.get(
            plan.path, refs)[shape]
        sent = wire_rows(x, plan.quant)  # what the experts receive from this rank
        return check_round(y, reference(sent, ids_, w, "kernel"),
                           reference(sent, ids_, w, "fp32"))

    start = time.monotonic()
    if rank == 0:  # --max-seconds counts from here, after the set-up
        print(f"rank 0: set up (weights, references, {len(SHAPES)} buffers)", file=sys.stderr,
              flush=True)
    plans = []
    stats = dict(rounds=0, graph_replays=0, mismatches=0, max_rel_err=0.0, first_mismatch=None)
    for i in range(rounds):
        # drawn on the host (every rank draws every rank's inputs, the same stream of random
        # numbers); only this rank's go to the GPU. No barrier: as in vLLM, a rank enters the
        # next round as soon as its own output of this one is back.
        rd, plan, stride = soak_round(seed + i, world, MAX_TOKENS, path=path, wire=wire,
                                      ids=ids)
        inputs = tuple(t[rank].to(device) for t in (rd.xs, rd.topk_ids, rd.topk_weights))
        try:
            y = layer(plan, rd.shape, *inputs, stride)
            bad, err = check(y, plan, rd.shape, *inputs)
        except Exception as e:  # which round: --seed <its seed> --rounds 1 replays it
            raise RuntimeError(f"rank {rank}: round {i} (seed {rd.seed}, {plan}, shape "
                               f"{rd.shape}, tokens {rd.tokens}, {rd.pattern}, region stride "
                               f"{stride}) failed: {e}") from e
        plans.append(plan)
        stats["rounds"] += 1
        stats["mismatches"] += bad
        stats["max_rel_err"] = max(stats["max_rel_err"], err)
        if bad and stats["first_mismatch"] is None:
            stats["first_mismatch"] = dict(seed=rd.seed, pattern=rd.pattern, shape=rd.shape,
                                           path=plan.path, wire=plan.wire, ids=plan.ids)
        if graph_every and (i + 1) % graph_every == 0:
            # One graph of this round's shapes and plan (every rank captures and replays the
            # same count), fresh inputs of the same token counts copied in before each replay.
            x, ids_, w = (t.clone() for t in inputs)
            out = torch.empty_like(x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer(plan, rd.shape, x, ids_, w, stride, out=out)
            for r in range(replays):
                # every rank draws the same fresh rows for every rank; its own go in
                gen = torch.Generator(device="cpu").manual_seed(seed * 7919 + i * 31 + r)
                fresh = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in rd.xs]
                x.copy_(fresh[rank].to(device))
                graph.replay()
                bad, err = check(out, plan, rd.shape, x, ids_, w)
                stats["graph_replays"] += 1
                stats["mismatches"] += bad
                stats["max_rel_err"] = max(stats["max_rel_err"], err)
            del graph
        if (i + 1) % 100 == 0 and rank == 0:  # progress, so a cut-off run still says where
            mix = schedule_mix(plans)
            print(f"rank 0: {i + 1} rounds ({mix['rounds_megamoe']} megamoe, "
                  f"{mix['rounds_fused']} fused, {mix['rounds_fused_fp8']} fused fp8, "
                  f"{mix['rounds_megamoe_w1_fp8']} one-GPU fp8, "
                  f"{i + 1 - mix['rounds_wire_bf16']} fp8 wire, {mix['rounds_ids_int32']} "
                  f"int32 ids), {stats['graph_replays']} replays, {stats['mismatches']} "
                  f"mismatches, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        if max_seconds and (i + 1) % STOP_CHECK_EVERY == 0:  # all stop after the same round
            late = torch.tensor([float(time.monotonic() - start > max_seconds)])
            torch.distributed.all_reduce(late, op=torch.distributed.ReduceOp.MAX,
                                         group=state["group"])
            if late.item() > 0:
                break
    torch.cuda.synchronize()
    stats["mix"] = schedule_mix(plans)
    return stats


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", "--world", dest="ranks", type=int, default=2,
                        help="EP ranks (processes), rank r on visible GPU r %% GPUs")
    parser.add_argument("--rounds", type=int, default=10_000, help="rounds per rank")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first round")
    parser.add_argument("--graph-every", type=int, default=250,
                        help="rounds between CUDA-graph captures (0: none)")
    parser.add_argument("--replays", type=int, default=5, help="replays per captured graph")
    parser.add_argument("--path", "--experts", dest="path", choices=("alternate",) + PATHS,
                        default="alternate",
                        help="the layer's path: rotate over all, or always one (the fused "
                        "ones where the shape qualifies)")
    parser.add_argument("--wire", choices=("alternate",) + WIRES, default="alternate",
                        help="dispatch's wire format: rotate, or always one")
    parser.add_argument("--ids", choices=("alternate",) + IDS, default="alternate",
                        help="the top-k ids' dtype: rotate, or always one")
    parser.add_argument("--max-seconds", type=float, default=0.0,
                        help="end early after this long (0: run every round)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="EpBuffer's timeout_s; max_wait_s is twice it")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file; None: examples/results/"
                        "soak_<gpu>_<G>gpu_<R>ranks.jsonl")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    import json

    import torch

    import soak  # the workers unpickle soak_rank by its module (tools/, the script's folder)

    from vllm_petit_moe.testing.bench_env import commit_stamp, gpu_name, utc_date
    from vllm_petit_moe.testing.rank_pool import ep_rank_pool
    from vllm_petit_moe.testing.soak import soak_results_name, soak_row
    visible = torch.cuda.device_count()
    if visible == 0:
        print("soak: needs a CUDA GPU", file=sys.stderr)
        return 2
    num_gpus = min(visible, args.ranks)
    start = time.monotonic()
    pool = ep_rank_pool(args.ranks, num_gpus)
    try:
        results = pool.run(soak.soak_rank, args.rounds, args.seed, args.graph_every, args.replays,
                           args.path, args.wire, args.ids, args.max_seconds, args.timeout_s,
                           timeout_s=args.max_seconds + 600 if args.max_seconds else 24 * 3600)
    finally:
        pool.close()
    gpu = gpu_name(0)
    row = soak_row(results, gpu=gpu, num_gpus=num_gpus, seed=args.seed,
                   rounds_asked=args.rounds, path=args.path, wire=args.wire, ids=args.ids,
                   commit=commit_stamp(ROOT), date=utc_date(),
                   seconds=time.monotonic() - start)
    out = args.out or ROOT / "examples" / "results" / (
        soak_results_name(gpu, num_gpus, args.ranks) + ".jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return 0 if row["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
