// CPU emulation of the PTX that csrc/gemm/ wraps for the tensor-core kernels (cp.async,
// ldmatrix and mma.sync of the sm_80 family, wgmma on shared-memory descriptors and mbarriers
// of the sm_90a ones), so that every tensor-core family, the warp-specialized ones included,
// runs on the thread-per-GPU-thread runtime of emu_runtime.h (which includes this; platform.h
// routes the wrappers here when PETIT_EMU_PTX is 1).
//
// The asynchronous operations complete as LATE as the PTX allows, so that a missing wait or a
// stage handed back too early reads stale or overwritten shared memory and the result is wrong:
//   - cp.async 16 bytes: queued per thread; commit_group closes a group; wait_group N performs
//     all but the newest N groups, wait_all everything, and cp.async.mbarrier.arrive performs
//     all of the thread's queued copies and then arrives (the arrival can come no sooner);
//   - wgmma.mma_async m64nNk16 bf16 -> fp32, both operands K-major with the 128-byte swizzle:
//     queued per thread; commit_group closes a group; wait_group N performs all but the newest
//     N groups, reading shared memory then, and is a barrier of the warp's lanes
//     (.sync.aligned). A performed MMA computes the thread's own accumulators with the PTX
//     register layout (warp w, lane l, register 4c + 2h + e: row 16w + l/4 + 8h, column
//     8c + 2(l%4) + e) and the swizzle as an address transform (16-byte chunk bits 4-6 XOR
//     row-in-atom bits 7-9), from the descriptor's start address and stride byte offset;
//   - ldmatrix.x4 and mma.sync.m16n8k16 (bf16 -> fp32): warp-collective, so the lanes exchange
//     their row addresses / fragments through the warp's exchange slots and each computes its
//     own registers with the PTX fragment layouts (see sm80_mainloop_mma.h);
//   - shared memory addresses (cvta to .shared): byte offsets into the block's dynamic shared
//     memory, which emu::launch allocates 1024-byte aligned and poisons;
//   - mbarrier init / arrive / arrive.expect_tx / try_wait.parity: a phase counter and pending
//     count under one mutex, in the barrier's 8 bytes of shared memory, plus the barrier's
//     expected transaction bytes and queued TMA copies in a table beside it; a phase completes
//     when its arrivals and its transaction bytes are both done; a failed try_wait yields
//     (sleeps, after kPollsBeforeSleep failures in a row);
//   - TMA tile loads (cp.async.bulk.tensor, 4-D, 128-byte swizzle, zero fill out of bounds)
//     through a tensor map that tensor_map_encode writes in its own format into the 128 bytes
//     of a CUtensorMap: queued on their mbarrier, performed (and their bytes completed) when
//     a thread waits on that barrier, i.e. no earlier than someone needs them;
//   - thread-block clusters (emu::launch_cluster runs a cluster's blocks at the same time):
//     %cluster_ctarank, barrier.cluster (a barrier of all the cluster's threads), mapa (a
//     shared::cluster address carries the target block's rank in its high bits, which
//     smem_ptr resolves) and multicast TMA boxes (queued on each target block's barrier);
//   - bulk stores shared -> global (cp.async.bulk.global.shared::cta.bulk_group): queued per
//     thread; commit_group closes a group; wait_group(.read) N performs all but the newest N
//     groups, reading shared memory then (so staging rewritten before the wait is caught);
//   - bar.sync id, count (named barriers): a barrier of `count` threads of the block;
//   - %globaltimer: the host's steady clock, kTimerSlowdown times slower; trap: a message
//     (also to $PETIT_EMU_TRAP_LOG) and abort().
// What it checks: the data path (loaders, swizzle, descriptors, stage and phase indexing,
// epilogues) and the ordering the kernels rely on (copies waited for before use, a stage not
// refilled before the MMAs that read it retired, no deadlock). What it cannot show: the
// memory model beyond that order, anything of the proxies, or performance.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace emu {
class Barrier;
extern thread_local unsigned char* dynamic_smem;  // this thread's block's dynamic shared memory
extern thread_local int cluster_rank;
extern thread_local int cluster_size;
extern thread_local unsigned char* const* cluster_smem;  // every block's of the cluster, by rank
extern thread_local Barrier* cluster_barrier;
void cluster_barrier_wait();
}

namespace emu_ptx {

// A shared-memory address is a byte offset into the block's dynamic shared memory; a
// shared::cluster address (map_shared_rank) carries the target block's cluster rank + 1 in
// bits 24-31.
constexpr uint32_t kClusterRankShift = 24;
inline uint32_t smem_addr(const void* ptr) {
  return uint32_t(static_cast<const unsigned char*>(ptr) - emu::dynamic_smem);
}
inline unsigned char* smem_ptr(uint32_t addr) {
  const uint32_t rank_plus_one = addr >> kClusterRankShift;
  if (rank_plus_one == 0) return emu::dynamic_smem + addr;
  return emu::cluster_smem[rank_plus_one - 1] + (addr & ((1u << kClusterRankShift) - 1));
}

inline void describe_mbarriers(std::FILE* f);  // below

// The message, then the state of the mbarriers with transactions (describe_mbarriers), go to
// stderr and, with PETIT_EMU_TRAP_LOG set, are appended to that file too (pytest's capture of
// stderr is lost when the process aborts; .ci/run prints the file). A process run by a test
// that expects the trap (PETIT_EMU_EXPECT_TRAP=1) says "expected trap" and leaves the file
// alone, so the file holds only the traps nobody expected.
[[noreturn]] inline void trap(const char* what) {
  const char* expect = std::getenv("PETIT_EMU_EXPECT_TRAP");
  const bool expected = expect != nullptr && std::strcmp(expect, "1") == 0;
  char line[256];
  std::snprintf(line, sizeof(line), "emu_ptx: %s: %s (block %u, thread %u)\n",
                expected ? "expected trap" : "trap", what, unsigned(emu::block_idx.x),
                unsigned(emu::thread_idx.x));
  std::fputs(line, stderr);
  describe_mbarriers(stderr);
  if (const char* path = expected ? nullptr : std::getenv("PETIT_EMU_TRAP_LOG")) {
    if (std::FILE* f = std::fopen(path, "a")) {
      std::fputs(line, f);
      describe_mbarriers(f);
      std::fclose(f);
    }
  }
  std::abort();
}

// ---- clusters
inline int cluster_rank() { return emu::cluster_rank; }
inline void cluster_sync() { emu::cluster_barrier_wait(); }
inline uint32_t map_shared_rank(uint32_t addr, int rank) {
  if (rank < 0 || rank >= emu::cluster_size) trap("mapa to a rank outside the cluster");
  return (uint32_t(rank + 1) << kClusterRankShift) | (addr & ((1u << kClusterRankShift) - 1));
}

// The lanes of this thread's warp meet (blocks of whole warps only).
inline void warp_sync() {
  if (emu::warp == nullptr) trap("warp-synchronous instruction in a block of partial warps");
  emu::warp->barrier.wait();
}

// emu::warp_gather for a warp-collective instruction (a block of whole warps only).
template <int kWords>
inline void warp_gather(const uint32_t (&mine)[kWords], uint32_t (&all)[kWords][32]) {
  if (!emu::warp_gather(mine, all)) trap("warp-collective instruction in a block of partial warps");
}

// ---- ldmatrix.sync.aligned.m8n8.x4.b16: lanes 8j..8j+7 give the row addresses of matrix j;
// register j of lane t is row t/4, elements 2(t%4), 2(t%4)+1 of matrix j.
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  const uint32_t mine[1] = {addr};
  uint32_t addrs[1][32];
  warp_gather(mine, addrs);
  const int t = int(emu::thread_idx.x) % 32;
  for (int j = 0; j < 4; ++j)
    std::memcpy(&r[j], smem_ptr(addrs[0][8 * j + t / 4] + 4 * (t % 4)), 4);
}

// ---- mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (g = lane / 4, q = lane % 4):
// a = {A[g][2q..], A[g+8][2q..], A[g][2q+8..], A[g+8][2q+8..]}, b = {B[2q..][g], B[2q+8..][g]},
// d = {D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1]}.
inline float bf16_half(uint32_t word, int hi) {
  return petit_bf16_to_float(petit_bf16_bits(hi ? word >> 16 : word & 0xFFFFu));
}
inline void mma_bf16_16816(float& d0, float& d1, float& d2, float& d3, const uint32_t (&a)[4],
                           uint32_t b0, uint32_t b1) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  uint32_t frag[6][32];  // [register][lane]: a0..a3, b0, b1
  warp_gather(mine, frag);
  auto A = [&](int row, int k) {  // A[row][k], 16 x 16
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return bf16_half(frag[reg][(row % 8) * 4 + (k % 8) / 2], k % 2);
  };
  auto B = [&](int k, int n) {  // B[k][n], 16 x 8
    return bf16_half(frag[4 + (k >= 8 ? 1 : 0)][n * 4 + (k % 8) / 2], k % 2);
  };
  const int t = int(emu::thread_idx.x) % 32, g = t / 4, q = t % 4;
  float* d[4] = {&d0, &d1, &d2, &d3};
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * q + i % 2;
    float acc = *d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    *d[i] = acc;
  }
}

// ---- asynchronous operations of one kind, per thread, in commit groups (PTX's cp.async
// groups, bulk async-groups, wgmma groups): issued into the open group, committed, and
// performed oldest group first when a wait leaves at most `pending` groups in flight.
template <class Op>
struct AsyncGroups {
  std::vector<Op> open;                // issued, not committed yet
  std::deque<std::vector<Op>> groups;  // committed, oldest first

  void commit() {
    groups.push_back(std::move(open));
    open.clear();
  }
  template <class Perform>
  void wait(int pending, Perform&& perform) {
    while (int(groups.size()) > pending) {
      for (Op& op : groups.front()) perform(op);
      groups.pop_front();
    }
  }
  bool empty() const { return open.empty() && groups.empty(); }
};

// ---- cp.async: copies of 16 bytes into shared memory (zero-filled below 16 source bytes)
struct Copy {
  uint32_t dst;
  const void* src;
  int src_bytes;
};
inline thread_local AsyncGroups<Copy> copies;

inline void perform_copy(const Copy& c) {
  if (c.src_bytes == 16)
    std::memcpy(smem_ptr(c.dst), c.src, 16);
  else
    std::memset(smem_ptr(c.dst), 0, 16);
}
inline void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  copies.open.push_back(Copy{dst, src, src_bytes});
}
inline void cp_async_commit() { copies.commit(); }
inline void cp_async_wait(int pending) { copies.wait(pending, perform_copy); }
inline void cp_async_wait_all() {  // committed or not
  cp_async_wait(0);
  for (const Copy& c : copies.open) perform_copy(c);
  copies.open.clear();
}

// ---- bulk stores shared -> global, in bulk async-groups
struct BulkStore {
  void* dst;
  uint32_t src;
  int bytes;
};
inline thread_local AsyncGroups<BulkStore> bulk_stores;

inline void bulk_store(void* dst, uint32_t src, int bytes) {
  if (bytes <= 0 || bytes % 16 != 0 || src % 16 != 0 ||
      reinterpret_cast<uintptr_t>(dst) % 16 != 0)
    trap("bulk store of a size or address not a multiple of 16 bytes");
  bulk_stores.open.push_back(BulkStore{dst, src, bytes});
}
inline void bulk_commit() { bulk_stores.commit(); }
inline void bulk_wait(int pending) {
  bulk_stores.wait(pending, [](const BulkStore& s) {
    std::memcpy(s.dst, smem_ptr(s.src), size_t(s.bytes));
  });
}

inline void named_barrier_sync(int id, int count) {
  if (!emu::named_barriers->wait(id, count)) trap("bar.sync with a bad id or thread count");
}

// ---- wgmma: MMAs in commit groups
inline thread_local AsyncGroups<std::function<void()>> mmas;

inline void wgmma_commit() { mmas.commit(); }
inline void wgmma_wait(int pending) {
  mmas.wait(pending, [](std::function<void()>& mma) { mma(); });
  warp_sync();  // .sync.aligned: the warp's lanes leave it together
}

// One bf16 element (row, k) of a K-major operand with the 128-byte swizzle whose 64-bit
// shared-memory descriptor is `desc` (start address bits 0-13, stride byte offset bits 32-45,
// both in 16-byte units; layout type bits 62-63 = 1).
inline float swizzled_element(uint64_t desc, int row, int k) {
  if ((desc >> 62) != 1) trap("wgmma descriptor without the 128-byte swizzle");
  const uint32_t start = uint32_t(desc & 0x3FFF) << 4;
  const uint32_t stride = uint32_t((desc >> 32) & 0x3FFF) << 4;
  uint32_t addr = start + uint32_t(row / 8) * stride + uint32_t(row % 8) * 128 + uint32_t(k) * 2;
  addr ^= ((addr >> 7) & 7u) << 4;
  uint16_t bits;
  std::memcpy(&bits, smem_ptr(addr), 2);
  return petit_bf16_to_float(bits);
}

// d[64 x N] (+)= A[64 x 16] * B[N x 16]^T for this thread's accumulators, performed at the
// wait_group that retires it (d must stay untouched until then, as on the GPU).
template <int kN>
void wgmma(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  const int t = int(emu::thread_idx.x) % 128, w = t / 32, l = t % 32;
  float* acc_regs = d;
  mmas.open.push_back([=] {
    for (int c = 0; c < kN / 8; ++c)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) {
          const int row = 16 * w + l / 4 + 8 * h, col = 8 * c + 2 * (l % 4) + e;
          float acc = scale_d ? acc_regs[4 * c + 2 * h + e] : 0.0f;
          for (int k = 0; k < 16; ++k)
            acc += swizzled_element(desc_a, row, k) * swizzled_element(desc_b, col, k);
          acc_regs[4 * c + 2 * h + e] = acc;
        }
  });
}

struct Mbarrier {
  int32_t pending;   // arrivals still missing in the current phase
  int16_t expected;  // arrivals per phase
  uint16_t phase;    // phases completed
};
static_assert(sizeof(Mbarrier) == 8, "an mbarrier is 8 bytes of shared memory");

// ---- TMA: tensor maps in the emulation's own format, copies queued on their mbarrier
struct TensorMap {
  const unsigned char* base;
  uint64_t dims[4];     // elements, innermost first
  uint64_t strides[4];  // bytes; strides[0] = the element size (2: bf16, 1: e4m3)
  uint32_t box[4];      // elements per box, innermost first
};
static_assert(sizeof(TensorMap) <= sizeof(CUtensorMap), "fits a CUtensorMap's bytes");
struct TmaCopy {
  unsigned char* dst;  // in the destination block's shared memory
  TensorMap map;
  int coord[4];
};
struct MbarrierTx {
  int64_t bytes = 0;             // expected transaction bytes not completed yet
  std::vector<TmaCopy> copies;   // issued, not performed yet
};
inline std::mutex mbarrier_mutex;
inline std::map<const unsigned char*, MbarrierTx> mbarrier_tx;  // by the barrier's location

inline Mbarrier* mbarrier_at(uint32_t bar) {
  if (bar % 8 != 0) trap("mbarrier not 8-byte aligned");
  return reinterpret_cast<Mbarrier*>(smem_ptr(bar));
}
inline const unsigned char* tx_key(uint32_t bar) { return smem_ptr(bar); }

inline void tensor_map_encode(CUtensorMap* map, const void* base, const cuuint64_t (&dims)[4],
                              const cuuint64_t (&strides)[3], const cuuint32_t (&box)[4],
                              int element_bytes = 2) {
  TensorMap m{static_cast<const unsigned char*>(base), {}, {uint64_t(element_bytes), 0, 0, 0}, {}};
  for (int d = 0; d < 4; ++d) {
    m.dims[d] = dims[d];
    m.box[d] = box[d];
    if (d > 0) m.strides[d] = strides[d - 1];
  }
  std::memset(map, 0, sizeof(CUtensorMap));
  std::memcpy(map, &m, sizeof(m));
}

// The box at `coord` into shared memory at `dst`, elements in box order (innermost first),
// each 16-byte chunk placed by the 128-byte swizzle of its address (chunk bits 4-6 XOR bits
// 7-9); elements outside the tensor are zeros. Returns the bytes written.
inline int64_t perform(const TmaCopy& c) {
  const TensorMap& m = c.map;
  int64_t n = 0;
  for (uint32_t i3 = 0; i3 < m.box[3]; ++i3)
    for (uint32_t i2 = 0; i2 < m.box[2]; ++i2)
      for (uint32_t i1 = 0; i1 < m.box[1]; ++i1)
        for (uint32_t i0 = 0; i0 < m.box[0]; ++i0, ++n) {
          const int64_t g[4] = {int64_t(c.coord[0]) + i0, int64_t(c.coord[1]) + i1,
                                int64_t(c.coord[2]) + i2, int64_t(c.coord[3]) + i3};
          bool in = true;
          int64_t offset = 0;
          for (int d = 0; d < 4; ++d) {
            in = in && g[d] >= 0 && uint64_t(g[d]) < m.dims[d];
            offset += g[d] * int64_t(m.strides[d]);
          }
          // the swizzle of the address (the blocks' shared memory is 1024-byte aligned)
          const int size = int(m.strides[0]);
          uintptr_t addr = reinterpret_cast<uintptr_t>(c.dst) + uintptr_t(n) * size;
          addr ^= ((addr >> 7) & 7u) << 4;
          uint16_t bits = 0;
          if (in) std::memcpy(&bits, m.base + offset, size);
          std::memcpy(reinterpret_cast<void*>(addr), &bits, size);
        }
  return n * int64_t(m.strides[0]);
}

// Into the block of cluster rank `rank` (-1: this thread's block).
inline void tma_load_4d_into(int rank, uint32_t dst, const CUtensorMap* map, int c0, int c1,
                             int c2, int c3, uint32_t bar) {
  if (dst % 1024 != 0) trap("TMA box with the 128-byte swizzle not 1024-byte aligned");
  if (rank >= 0) {
    dst = map_shared_rank(dst, rank);
    bar = map_shared_rank(bar, rank);
  }
  TmaCopy copy{smem_ptr(dst), {}, {c0, c1, c2, c3}};
  std::memcpy(&copy.map, map, sizeof(TensorMap));
  if (copy.map.box[0] * copy.map.strides[0] != 128) trap("128-byte swizzle needs 128-byte box rows");
  std::lock_guard<std::mutex> lock(mbarrier_mutex);
  mbarrier_tx[tx_key(bar)].copies.push_back(copy);
}

inline void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                        uint32_t bar) {
  tma_load_4d_into(-1, dst, map, c0, c1, c2, c3, bar);
}

// The same box into every block of the cluster in cta_mask, at the same offsets.
inline void tma_load_4d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                  int c3, uint32_t bar, uint16_t cta_mask) {
  if (cta_mask == 0 || (cta_mask >> emu::cluster_size) != 0)
    trap("multicast mask names blocks outside the cluster");
  for (int q = 0; q < emu::cluster_size; ++q)
    if ((cta_mask >> q) & 1u) tma_load_4d_into(q, dst, map, c0, c1, c2, c3, bar);
}

inline void mbarrier_init(uint32_t bar, int count) {
  std::lock_guard<std::mutex> lock(mbarrier_mutex);
  *mbarrier_at(bar) = Mbarrier{count, int16_t(count), 0};
  mbarrier_tx.erase(tx_key(bar));
}

// Under mbarrier_mutex: the current phase completes once its arrivals and bytes are done.
inline void mbarrier_complete_if_done(uint32_t bar, Mbarrier* m) {
  auto tx = mbarrier_tx.find(tx_key(bar));
  if (m->pending == 0 && (tx == mbarrier_tx.end() || tx->second.bytes == 0)) {
    ++m->phase;
    m->pending = m->expected;
  }
}

inline void mbarrier_arrive_locked(uint32_t bar) {
  Mbarrier* m = mbarrier_at(bar);
  if (m->pending <= 0) trap("mbarrier arrival beyond its expected count");
  --m->pending;
  mbarrier_complete_if_done(bar, m);
}

inline void mbarrier_arrive(uint32_t bar) {
  std::lock_guard<std::mutex> lock(mbarrier_mutex);
  mbarrier_arrive_locked(bar);
}

inline void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  std::lock_guard<std::mutex> lock(mbarrier_mutex);
  mbarrier_tx[tx_key(bar)].bytes += bytes;
  mbarrier_arrive_locked(bar);
}

constexpr int kPollsBeforeSleep = 1024;

// The phase with parity `parity` has completed: the current phase has the other parity. The
// barrier's queued TMA copies land first (a waiter is the latest they can be needed by).
inline bool mbarrier_try_wait_parity(uint32_t bar, uint32_t parity) {
  bool done;
  {
    std::lock_guard<std::mutex> lock(mbarrier_mutex);
    Mbarrier* m = mbarrier_at(bar);
    auto tx = mbarrier_tx.find(tx_key(bar));
    if (tx != mbarrier_tx.end() && !tx->second.copies.empty()) {
      for (const TmaCopy& c : tx->second.copies) tx->second.bytes -= perform(c);
      tx->second.copies.clear();
      // bytes < 0 is legal: another block's multicast box may land before this block's
      // expect_tx of the phase (the phase still waits for that arrival)
      if (m->pending == 0) mbarrier_complete_if_done(bar, m);
    }
    done = (m->phase & 1u) != parity;
  }
  // Polling threads give the cores to the ones that make progress: a yield, then after
  // kPollsBeforeSleep failed polls in a row a short sleep per poll.
  thread_local int failed_polls = 0;
  if (done) {
    failed_polls = 0;
  } else if (++failed_polls <= kPollsBeforeSleep) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return done;
}

// For a trap's report: each mbarrier that has had TMA transactions (its offset in its block's
// shared memory, phases completed, arrivals missing, bytes not completed, copies queued); not
// when the trapping thread holds the table's mutex.
inline void describe_mbarriers(std::FILE* f) {
  std::unique_lock<std::mutex> lock(mbarrier_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return;
  for (const auto& [location, tx] : mbarrier_tx) {
    const auto* m = reinterpret_cast<const Mbarrier*>(location);
    long offset = -1;
    int rank = -1;
    for (int q = 0; q < emu::cluster_size && emu::cluster_smem != nullptr; ++q) {
      const unsigned char* base = emu::cluster_smem[q];  // the nearest block below it
      if (base != nullptr && location >= base && (offset < 0 || location - base < offset)) {
        offset = long(location - base);
        rank = q;
      }
    }
    std::fprintf(f, "  mbarrier rank %d offset %ld: phase %u, pending %d of %d, bytes %lld, "
                    "copies queued %zu\n", rank, offset, unsigned(m->phase), int(m->pending),
                 int(m->expected), static_cast<long long>(tx.bytes), tx.copies.size());
  }
}

// A block (a cluster's blocks: `count` shared memories of `bytes` each) that ends with TMA
// copies nobody waited for, or expected bytes that never came; then its mbarriers leave the
// table. Only its own: another grid (another emulated rank's) may be streaming meanwhile.
inline void check_block_drained(unsigned char* const* smem, int count, size_t bytes) {
  bool undrained = false;
  {
    std::lock_guard<std::mutex> lock(mbarrier_mutex);
    for (auto it = mbarrier_tx.begin(); it != mbarrier_tx.end();) {
      bool mine = false;
      for (int q = 0; q < count; ++q)
        mine |= smem[q] != nullptr && it->first >= smem[q] && it->first < smem[q] + bytes;
      if (!mine) {
        ++it;
        continue;
      }
      undrained |= !it->second.copies.empty() || it->second.bytes != 0;
      if (!undrained) it = mbarrier_tx.erase(it);
      else ++it;
    }
  }
  if (undrained) trap("block exits with TMA copies or expected bytes its mbarrier never completed");
}

// A thread that ends with copies or MMAs it never waited for: the GPU would have completed
// them at some point, which the kernel cannot have relied on.
inline void check_drained() {
  if (!copies.empty()) trap("thread exits with cp.async copies it never waited for");
  if (!mmas.empty()) trap("thread exits with wgmma operations it never waited for");
  if (!bulk_stores.empty())
    trap("thread exits with bulk stores it never committed or waited for");
}

// cp.async.mbarrier.arrive(.noinc): arrives once the thread's earlier copies have completed.
inline void cp_async_mbarrier_arrive(uint32_t bar) {
  cp_async_wait_all();
  mbarrier_arrive(bar);
}

// The emulated %globaltimer runs kTimerSlowdown times slower than the host's steady clock: a
// block is hundreds of OS threads that poll on few cores, so a wait the GPU finishes in
// microseconds can take seconds here (seen with 6 test processes on one core: first-stage waits
// of a cluster launch, the cp.async path included, past the kernels' 10 s bound while the
// block's other threads had not run yet), while a real deadlock still traps, only later.
constexpr uint64_t kTimerSlowdown = 30;
inline uint64_t globaltimer_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count()) /
         kTimerSlowdown;
}

}  // namespace emu_ptx
