// The Hopper main loop of the expert GEMMs, warp-specialized (wgmma pieces and tile configs:
// sm90_mainloop_wgmma.h): one producer warpgroup only loads, the consumer warpgroups of the
// tile config only multiply, and a ring of kStages stages is handed between them through
// shared-memory mbarriers:
//   - full[s] (kProducerThreads + 1 arrivals and the weight bytes): each producer thread
//     arrives once per fill of stage s when its cp.async copies of the A rows into it have
//     landed (cp.async.mbarrier.arrive.noinc); the first producer thread also arrives with
//     the stage's weight bytes as expected transactions (arrive.expect_tx) and issues the
//     weight rows as TMA boxes (sm90_tma.h), which complete those bytes as they land;
//   - empty[s]: each consumer warp arrives once per use of stage s, after the wgmma group
//     that read it has retired (wgmma.wait_group).
// Stage s of the block's i-th k-tile (counted over all its tiles, so the ring runs on across
// tile boundaries) is i % kStages, in phase (i / kStages) & 1. The producer therefore loads
// up to kStages k-tiles ahead and runs on into the block's next tile while the consumers are
// still in the epilogue of the current one. Registers move from the producer (kProducerRegs)
// to the consumers (kConsumerRegs) with setmaxnreg, since the consumers hold the
// accumulators of 64 x kWgmmaN tiles.
//
// Tile configs: Sm90WgmmaTileConfig (the consumers keep threadIdx.x < Cfg::kThreads and its
// row_of / col_of maps, so epilogues.h applies unchanged); A rows gathered through the row list
// by cp.async (cp_async.h) into 128-byte swizzled K-major stages; the weights through a tensor
// map (a kernel parameter). Every mbarrier wait is bounded (kMbarrierTimeoutNs): on
// expiry the thread traps, so a broken pipeline fails the launch (and the CUDA context) with
// an error instead of hanging.
//
// CUDA only; the asm is emitted only in sm_90a device passes (PETIT_SM90A_DEVICE). Under the
// CPU emulation (PETIT_EMU_PTX) the mbarriers and TMA copies are tests/emu/emu_ptx.h's.
#pragma once

#include "sm90_mainloop_wgmma.h"
#include "sm90_tma.h"

namespace petit {
namespace gemm {

// ------------------------------------------------------------------ mbarrier wrappers

PETIT_DEVICE void sm90_mbarrier_init(uint32_t bar, int count) {
#if PETIT_SM90A_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::mbarrier_init(bar, count);
#endif
}

// Makes the initialized barriers visible to the whole block (with a barrier after it).
PETIT_DEVICE void sm90_fence_mbarrier_init() {
#if PETIT_SM90A_DEVICE
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

PETIT_DEVICE void sm90_mbarrier_arrive(uint32_t bar) {
#if PETIT_SM90A_DEVICE
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
      : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::mbarrier_arrive(bar);
#endif
}

// Arrives on `bar` and adds `bytes` to the transactions its current phase waits for (the TMA
// copies that complete them may land before or after).
PETIT_DEVICE void sm90_mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if PETIT_SM90A_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::mbarrier_arrive_expect_tx(bar, bytes);
#endif
}

// Arrives on `bar` once every cp.async this thread issued before has completed; the arrival
// counts against the barrier's expected count (noinc).
PETIT_DEVICE void sm90_cp_async_mbarrier_arrive_noinc(uint32_t bar) {
#if PETIT_SM90A_DEVICE
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::cp_async_mbarrier_arrive(bar);
#endif
}

PETIT_DEVICE bool sm90_mbarrier_try_wait_parity(uint32_t bar, uint32_t parity) {
#if PETIT_SM90A_DEVICE
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
#elif PETIT_EMU_PTX
  return emu_ptx::mbarrier_try_wait_parity(bar, parity);
#else
  return true;
#endif
}

PETIT_DEVICE uint64_t sm90_globaltimer_ns() {
  uint64_t t = 0;
#if PETIT_SM90A_DEVICE
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
#elif PETIT_EMU_PTX
  t = emu_ptx::globaltimer_ns();
#endif
  return t;
}

// No pipeline wait of a healthy kernel comes near this; a stuck one traps after it.
constexpr uint64_t kMbarrierTimeoutNs = 10ull * 1000 * 1000 * 1000;

// What a wait of the expert kernels does once it has waited kMbarrierTimeoutNs: trap (under
// the CPU emulation, with `what` printed). No printf on the GPU: a call anywhere in the
// kernel, even on the producer's side, makes ptxas serialize the consumers' wgmma (warning
// C7510, which tests/test_ptxas_cpu.py rejects).
PETIT_DEVICE void sm90_wait_timed_out(const char* what) {
#if PETIT_EMU_PTX
  emu_ptx::trap(what);
#else
  (void)what;
  __trap();
#endif
}

// Polls until done() holds; after kMbarrierTimeoutNs, sm90_wait_timed_out(what).
template <class Done>
PETIT_DEVICE void sm90_wait_bounded(const Done& done, const char* what) {
  if (done()) return;
  const uint64_t start = sm90_globaltimer_ns();
  while (!done())
    if (sm90_globaltimer_ns() - start > kMbarrierTimeoutNs) sm90_wait_timed_out(what);
}

// Until the phase of `bar` with parity `parity` has completed (bounded, see above).
PETIT_DEVICE void sm90_mbarrier_wait_parity(uint32_t bar, uint32_t parity) {
  sm90_wait_bounded([&] { return sm90_mbarrier_try_wait_parity(bar, parity); },
                    "expert GEMM pipeline wait timed out");
}

// ------------------------------------------------------------------ clusters (sm_90)

// This CTA's rank in its cluster.
PETIT_DEVICE int sm90_cluster_rank() {
#if PETIT_SM90A_DEVICE
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return int(rank);
#elif PETIT_EMU_PTX
  return emu_ptx::cluster_rank();
#else
  return 0;
#endif
}

// Every thread of every CTA of the cluster (a superset of __syncthreads): what each wrote to
// its shared memory before (barrier inits included) is visible to the cluster after.
PETIT_DEVICE void sm90_cluster_sync() {
#if PETIT_SM90A_DEVICE
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" :::
                   "memory");
#elif PETIT_EMU_PTX
  emu_ptx::cluster_sync();
#endif
}

// The shared::cluster address of the same offset `addr` in the CTA of cluster rank `rank`.
PETIT_DEVICE uint32_t sm90_map_shared_rank(uint32_t addr, int rank) {
#if PETIT_SM90A_DEVICE
  uint32_t mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(addr), "r"(rank));
  return mapped;
#elif PETIT_EMU_PTX
  return emu_ptx::map_shared_rank(addr, rank);
#else
  return addr;
#endif
}

// Arrives on the mbarrier at shared::cluster address `bar`, which may be another CTA's (the
// default semantics of a remote arrival, .release at .cta scope, as CUTLASS's cluster
// pipelines use to hand a multicast stage back: the arriving warp's reads of the stage have
// retired, wgmma.wait_group, before it arrives).
PETIT_DEVICE void sm90_mbarrier_arrive_cluster(uint32_t bar) {
#if PETIT_SM90A_DEVICE
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
#elif PETIT_EMU_PTX
  emu_ptx::mbarrier_arrive(bar);
#endif
}

// Register budget of a warpgroup from here on (all its warps execute it).
template <int kRegs>
PETIT_DEVICE void sm90_setmaxnreg_dec() {
#if PETIT_SM90A_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

template <int kRegs>
PETIT_DEVICE void sm90_setmaxnreg_inc() {
#if PETIT_SM90A_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// ------------------------------------------------------------------ main loop

// kClusterM > 1: the kernel is launched in clusters of kClusterM CTAs that walk the same
// scheduler units (scheduler.h). In a unit whose weight rows they share (multicast) each weight
// box is loaded once for all of them (TMA multicast, Sm90WeightTmaLoader): a CTA's stage is
// then written by every CTA's producer, so its `full` barrier waits for the whole stage's
// weight bytes whoever loads them, and a producer may refill stage s only when the consumers
// of EVERY CTA of the cluster have released it: each consumer warp arrives on the `empty`
// barrier of every CTA (kClusterM x kConsumerWarps arrivals per phase), in every unit, shared
// or not. The CTAs of a cluster thus advance through the k-tiles together, which is the point
// (L2 serves the shared weight rows once, to all of them).
// kUserBytes: shared memory after the barriers for the kernel's own use (user_smem; the tile
// scheduler's, which cannot be a static __shared__ variable under the CPU emulation's
// concurrently running cluster CTAs).
template <class Cfg_, int kClusterM_ = 1, int kUserBytes_ = 0>
struct Sm90WgmmaWsMainloop {
  using Cfg = Cfg_;
  static constexpr int kClusterM = kClusterM_;
  static constexpr int kUserBytes = kUserBytes_;
  static constexpr bool kCompiled = PETIT_SM90A_BODY;
  static constexpr int kConsumerThreads = Cfg::kThreads;
  static constexpr int kProducerThreads = 128;
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  // The block is launched with kThreads threads of at most 65536 / kThreads registers each;
  // setmaxnreg moves the producer's share to the consumers (multiples of 8, within the pool).
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static constexpr int kProducerRegs = kClusterM > 1 ? 64 : 56;
  static constexpr int kConsumerRegs =
      (kLaunchRegs * kThreads - kProducerRegs * kProducerThreads) / kConsumerThreads / 8 * 8 > 240
          ? 240
          : (kLaunchRegs * kThreads - kProducerRegs * kProducerThreads) / kConsumerThreads / 8 *
                8;
  static_assert(Cfg::kMinBlocksPerSm == 1, "one warp-specialized block per SM");
  static_assert(Cfg::kNumBGroups * Cfg::kBlockN / Cfg::kWgN / 2 + 32 <= kConsumerRegs,
                "the consumers' accumulators do not fit their registers");

  using LoaderA = CpAsyncLoader<Cfg::kBlockM, kProducerThreads, Sw128Swizzle, kConsumerThreads>;
  // Arrivals per fill of a stage: every producer thread's cp.async arrival and the TMA
  // issuer's expect_tx one.
  static constexpr int kFullArrivals = kProducerThreads + 1;
  using LoaderB = Sm90WeightTmaLoader<Cfg, kClusterM>;
  static constexpr int kAccCols = Cfg::kNumBGroups * Cfg::kThreadN;
  static constexpr int kStageBytes = LoaderA::kStageBytes + LoaderB::kStageBytes;
  static_assert(LoaderA::kStageBytes % 1024 == 0 && kStageBytes % 1024 == 0,
                "every operand tile starts on a 1024-byte swizzle atom");
  // Dynamic shared memory: the ring (1024-byte aligned by the slack), then full[kStages] and
  // empty[kStages] (8 bytes each), then kUserBytes.
  static constexpr int kBarrierBytes = 2 * Cfg::kStages * 8;
  static constexpr int kSmemBytes =
      Cfg::kStages * kStageBytes + 1024 + kBarrierBytes + (kUserBytes + 15) / 16 * 16;
  static_assert(kSmemBytes + 4096 <= 228 * 1024, "the ring does not fit one block per SM");

  uint32_t ring;   // smem address of stage 0
  uint32_t full;   // smem address of full[0]
  uint32_t empty;  // smem address of empty[0]
  uint32_t it;     // this thread's k-tiles so far (the ring position)

  // acc[i][g * kThreadN + j] (consumers): row Cfg::row_of(threadIdx.x, i), column
  // Cfg::col_of(threadIdx.x, j) of group g.
  float acc[Cfg::kThreadM][kAccCols];

  PETIT_DEVICE static bool is_producer() { return threadIdx.x >= kConsumerThreads; }

  // The kUserBytes after the barriers, in the dynamic shared memory `smem` (16-byte aligned).
  PETIT_DEVICE static unsigned char* user_smem(unsigned char* smem) {
    const uint32_t base = smem_addr_u32(smem);
    const uint32_t ring_begin = (base + 1023u) & ~1023u;
    return smem + (ring_begin - base) + Cfg::kStages * kStageBytes + kBarrierBytes;
  }

  // Block-wide (contains a barrier; with clusters a cluster-wide one, which every thread of
  // every CTA of the cluster must reach): carve the ring and the barriers out of `smem` and
  // initialize the barriers.
  PETIT_DEVICE void init(unsigned char* smem) {
    ring = (smem_addr_u32(smem) + 1023u) & ~1023u;
    full = ring + Cfg::kStages * kStageBytes;
    empty = full + Cfg::kStages * 8;
    it = 0;
    if (threadIdx.x == 0) {
      for (int s = 0; s < Cfg::kStages; ++s) {
        sm90_mbarrier_init(full + 8 * s, kFullArrivals);
        sm90_mbarrier_init(empty + 8 * s, kConsumerWarps * kClusterM);
      }
      sm90_fence_mbarrier_init();
    }
    if constexpr (kClusterM > 1)
      sm90_cluster_sync();  // no remote arrival or multicast before every CTA's inits
    else
      __syncthreads();
  }

  // Instead of init: takes over the ring of `other`, a main loop of the same ring shape (stages,
  // stage bytes, consumer warps) that this thread has run so far, at its position, so a kernel
  // can run a second GEMM with other tiles through the same ring (expert_fused_ws_kernel):
  // the producer fills the next stages for it while the consumers finish the first.
  template <class Other>
  PETIT_DEVICE void continue_from(const Other& other) {
    static_assert(Other::kStageBytes == kStageBytes && Other::Cfg::kStages == Cfg::kStages &&
                      Other::kConsumerWarps == kConsumerWarps && Other::kClusterM == kClusterM &&
                      Other::kProducerThreads == kProducerThreads,
                  "one ring: same stages, stage bytes and arrivals");
    ring = other.ring;
    full = other.full;
    empty = other.empty;
    it = other.it;
  }

  // Cluster-wide, the last thing the kernel does (every thread of every CTA): no CTA exits
  // while another may still multicast into its shared memory or arrive on its barriers.
  PETIT_DEVICE void finish() {
    if constexpr (kClusterM > 1) sm90_cluster_sync();
  }

  // The producer thread that issues the weight boxes.
  PETIT_DEVICE static bool is_tma_issuer() { return threadIdx.x == kConsumerThreads; }

  // Producer threads: the k-tiles of one output tile into the ring (rank: this CTA's cluster
  // rank, which picks its share of the weight boxes when the cluster shares them: multicast).
  // stage_tags (a kernel that hands its consumers the tiles it picks, expert_fused_ws_kernel):
  // the TMA issuer writes `tag` to stage_tags[s] of the tile's first stage s before the
  // stage's arrival, which publishes it to the consumers that wait for the stage.
  PETIT_DEVICE void produce(const LoaderA& a_loader, const LoaderB& b_loader, int k_dim, int rank,
                            bool multicast, volatile int* stage_tags = nullptr, int tag = 0) {
    const int num_k_tiles = (k_dim + Cfg::kBlockK - 1) / Cfg::kBlockK;
    const bool tma_issuer = is_tma_issuer();
    for (int kt = 0; kt < num_k_tiles; ++kt, ++it) {
      const uint32_t s = wait_empty(it);
      if (tma_issuer) {
        if (stage_tags != nullptr && kt == 0) stage_tags[s] = tag;
        issue_weights(b_loader, s, kt, rank, multicast);
      }
      a_loader.issue(ring + s * kStageBytes, kt * Cfg::kBlockK, k_dim);
      sm90_cp_async_mbarrier_arrive_noinc(full + 8 * s);
    }
  }

  // Producer threads: waits until the stage of the block's i-th k-tile is empty; returns its
  // index. A fresh barrier counts as having completed the phase before its first (parity 1),
  // so the first kStages fills do not wait.
  PETIT_DEVICE uint32_t wait_empty(uint32_t i) const {
    const uint32_t s = i % Cfg::kStages;
    sm90_mbarrier_wait_parity(empty + 8 * s, ((i / Cfg::kStages) & 1u) ^ 1u);
    return s;
  }

  // TMA issuer: the weight boxes of k-tile kt into stage s, after the stage's expected bytes
  // (the whole stage's, whichever CTA of the cluster loads them) that those copies complete.
  PETIT_DEVICE void issue_weights(const LoaderB& b_loader, uint32_t s, int kt, int rank,
                                  bool multicast) const {
    sm90_mbarrier_arrive_expect_tx(full + 8 * s, LoaderB::kStageBytes);
    b_loader.issue(ring + s * kStageBytes + LoaderA::kStageBytes, kt * Cfg::kBlockK, full + 8 * s,
                   rank, multicast);
  }

  // A consumer warp hands a stage back: on its `empty` barrier, and with clusters on that of
  // every CTA of the cluster (whose producers multicast into this CTA's copy of the stage).
  PETIT_DEVICE static void release(uint32_t empty_bar) {
    if constexpr (kClusterM == 1) {
      sm90_mbarrier_arrive(empty_bar);
    } else {
#pragma unroll
      for (int q = 0; q < kClusterM; ++q)
        sm90_mbarrier_arrive_cluster(sm90_map_shared_rank(empty_bar, q));
    }
  }

  // Producer threads, after their last tile: one more stage with no data whose tag is `tag`
  // (e.g. -1: no more tiles), completed by plain arrivals of every producer thread.
  PETIT_DEVICE void produce_end(volatile int* stage_tags, int tag) {
    const uint32_t s = wait_empty(it);
    if (is_tma_issuer()) {
      stage_tags[s] = tag;
      sm90_mbarrier_arrive(full + 8 * s);  // the issuer's second arrival of a stage
    }
    sm90_mbarrier_arrive(full + 8 * s);
    ++it;
  }

  // Consumer threads: the tag of the next stage (waits until it is full; consume then finds
  // the stage full without waiting).
  PETIT_DEVICE int peek_tag(const volatile int* stage_tags) const {
    const uint32_t s = it % Cfg::kStages;
    sm90_mbarrier_wait_parity(full + 8 * s, (it / Cfg::kStages) & 1u);
    return stage_tags[s];
  }

  // Consumer threads: the reduction over k_dim (> 0, a multiple of 8) of one output tile into
  // acc; every stage it read is released again when it returns.
  PETIT_DEVICE void consume(int k_dim) {
    float d[Cfg::kWgmmaN / 2];
#pragma unroll
    for (int i = 0; i < Cfg::kWgmmaN / 2; ++i) d[i] = 0.0f;
    const int num_k_tiles = (k_dim + Cfg::kBlockK - 1) / Cfg::kBlockK;
    const int warpgroup = threadIdx.x / 128;
    const uint32_t a_wg_offset = uint32_t((warpgroup / Cfg::kWgN) * 64 * 128);
    const uint32_t b_wg_offset = uint32_t((warpgroup % Cfg::kWgN) * Cfg::kWgmmaN * 128);
    const bool warp_leader = threadIdx.x % 32 == 0;
    for (int kt = 0; kt < num_k_tiles; ++kt, ++it) {
      const uint32_t s = it % Cfg::kStages;
      sm90_mbarrier_wait_parity(full + 8 * s, (it / Cfg::kStages) & 1u);
      // The producers' cp.async writes of the A rows (generic proxy) before this warpgroup's
      // wgmma reads (async proxy) of the stage; the TMA's rows are async-proxy writes.
      sm90_fence_proxy_async_smem();
      // Wait for this k-tile's group itself (wait_group 0) and hand its stage back at once:
      // the consumers then hold no stage while they wait for the next one, so the producer
      // has the whole ring to load ahead in (a stage more than with wait_group 1, which kept
      // the k-tile's stage until the next k-tile's MMAs were issued). The other consumer
      // warpgroup's MMAs keep the tensor pipe busy meanwhile. (Nsight Compute on H200,
      // DeepSeek-V3 8192 tokens/rank: with wait_group 1 the down kernel's consumers waited for
      // a full stage a third of their time; cuBLAS's kernels on the same shapes wait 0.)
      sm90_wgmma_k_tile<Cfg, 0>(d, ring + s * kStageBytes + a_wg_offset,
                                ring + s * kStageBytes + LoaderA::kStageBytes + b_wg_offset,
                                kt == 0);
      if (warp_leader) release(empty + 8 * s);
    }

    sm90_epilogue_view<Cfg>(d, acc);
  }
};

}  // namespace gemm
}  // namespace petit
