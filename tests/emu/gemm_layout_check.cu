// Host-side check of the Hopper tile configurations (csrc/gemm/sm90_mainloop_wgmma.h,
// sm90_mainloop_wgmma_ws.h): the epilogue view (row_of / col_of) covers every output of a tile
// exactly once, the shared-memory B row that the PTX accumulator layout of wgmma.m64nNk16
// assigns to each accumulator holds the weight row of the same B group and tile column
// (b_group_of / b_col_of), and the TMA weight boxes tile each stage. Built with nvcc and run by
// tests/test_gemm_layouts_cpu.py; prints one line per config, exits non-zero on a mismatch.
#include <cstdio>
#include <vector>

#include "gemm/sm90_mainloop_wgmma.h"
#include "gemm/sm90_mainloop_wgmma_ws.h"

namespace {

int failures = 0;

void expect(bool ok, const char* config, const char* what, int t, int i, int j) {
  if (!ok && failures++ < 20)
    std::printf("FAIL %s: %s (thread %d, row %d, col %d)\n", config, what, t, i, j);
}

// Every (row, group, column) of the tile is produced by exactly one (thread, i, g, j).
template <class Cfg>
void check_coverage(const char* name) {
  const int groups = Cfg::kNumBGroups;
  std::vector<int> seen(Cfg::kBlockM * groups * Cfg::kBlockN, 0);
  for (int t = 0; t < Cfg::kThreads; ++t)
    for (int i = 0; i < Cfg::kThreadM; ++i)
      for (int g = 0; g < groups; ++g)
        for (int j = 0; j < Cfg::kThreadN; ++j) {
          const int row = Cfg::row_of(t, i), col = Cfg::col_of(t, j);
          const bool in = row >= 0 && row < Cfg::kBlockM && col >= 0 && col < Cfg::kBlockN;
          expect(in, name, "output outside the tile", t, i, j);
          if (in) ++seen[(row * groups + g) * Cfg::kBlockN + col];
        }
  for (size_t k = 0; k < seen.size(); ++k)
    expect(seen[k] == 1, name, "output not produced exactly once", -1, int(k), seen[k]);
}

// wgmma.m64nNk16 accumulators (PTX ISA, "Register fragments"): in warp w of a warpgroup, lane
// l, register 4c + 2h + e is row 16w + l/4 + 8h of the warpgroup's 64 rows and column
// 8c + 2(l%4) + e of its N = kWgmmaN B rows. The main loop hands register
// (g * kGroupCols/8 + c) * 4 + 2h + e to acc[h][g * kThreadN + 2c + e].
template <class Cfg>
void check_wgmma(const char* name) {
  check_coverage<Cfg>(name);
  for (int t = 0; t < Cfg::kThreads; ++t) {
    const int wg = t / 128, wm = wg / Cfg::kWgN, wn = wg % Cfg::kWgN;
    const int warp = (t / 32) % 4, lane = t % 32;
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < Cfg::kNumBGroups; ++g)
        for (int j = 0; j < Cfg::kThreadN; ++j) {
          const int c = g * (Cfg::kGroupCols / 8) + j / 2, e = j % 2;
          const int row = wm * 64 + 16 * warp + lane / 4 + 8 * h;
          const int b_row = wn * Cfg::kWgmmaN + 8 * c + 2 * (lane % 4) + e;
          expect(Cfg::row_of(t, h) == row, name, "row_of disagrees with the wgmma layout", t, h, j);
          expect(b_row < Cfg::kBRows && Cfg::b_group_of(b_row) == g, name,
                 "B row of another group", t, h, j);
          expect(Cfg::b_col_of(b_row) == Cfg::col_of(t, j), name,
                 "B row of another column", t, h, j);
        }
  }
  std::printf("%s: %d threads, %dx%d tile x %d group(s), wgmma m64n%d\n", name, Cfg::kThreads,
              Cfg::kBlockM, Cfg::kBlockN, Cfg::kNumBGroups, Cfg::kWgmmaN);
}

// Warp-specialized main loop (sm90_mainloop_wgmma_ws.h): its producer loads a stage's weight
// rows as TMA boxes (sm90_tma.h), box `run` = stage rows [run * kRunRows, (run + 1) *
// kRunRows) from rows b_col_of(run * kRunRows).. of group b_group_of(run * kRunRows). That is
// right only if every stage row of a box is the next column of the same group, as b_group_of /
// b_col_of name it, and the boxes tile the stage.
template <class Mainloop>
void check_wgmma_ws(const char* name) {
  using Cfg = typename Mainloop::Cfg;
  using Loader = typename Mainloop::LoaderB;
  check_wgmma<Cfg>(name);
  expect(Loader::kRuns * Loader::kRunRows == Cfg::kBRows, name, "boxes do not tile the stage",
         -1, Loader::kRuns, Loader::kRunRows);
  std::vector<int> covered(Cfg::kBRows, 0);
  for (int b = 0; b < Loader::kBoxes; ++b) {  // with clusters: each CTA's share of a run
    const int r0 = Loader::box_row(b);
    for (int i = 0; i < Loader::kBoxRows; ++i) {
      expect(r0 + i < Cfg::kBRows, name, "weight box past the stage", -1, r0 + i, b);
      if (r0 + i >= Cfg::kBRows) continue;
      ++covered[r0 + i];
      expect(Cfg::b_group_of(r0 + i) == Cfg::b_group_of(r0) &&
                 Cfg::b_col_of(r0 + i) == Cfg::b_col_of(r0) + i,
             name, "weight box row is not the next column of the box's group", -1, r0 + i,
             Cfg::b_col_of(r0 + i));
    }
  }
  for (int r = 0; r < Cfg::kBRows; ++r)
    expect(covered[r] == 1, name, "stage row not loaded by exactly one box", -1, r, covered[r]);
  std::printf("%s: %d producer + %d consumer threads, consumers at %d registers (setmaxnreg), "
              "%d-stage ring %d bytes, %d weight box(es) of %d rows, cluster of %d\n",
              name, Mainloop::kProducerThreads, Mainloop::kConsumerThreads,
              Mainloop::kConsumerRegs, Cfg::kStages, Mainloop::kSmemBytes, Loader::kBoxes,
              Loader::kBoxRows, Mainloop::kClusterM);
}

}  // namespace

int main() {
  using petit::gemm::Sm90WgmmaTileConfig;
  using petit::gemm::Sm90WgmmaWsMainloop;
  // The configurations csrc/experts/gemm_sm90.cu instantiates (keep in sync), plus variants.
  check_wgmma_ws<Sm90WgmmaWsMainloop<Sm90WgmmaTileConfig<128, 128, 2, 4, 1>>>("wgmma gate/up");
  check_wgmma_ws<Sm90WgmmaWsMainloop<Sm90WgmmaTileConfig<128, 256, 1, 3, 1>>>("wgmma down");
  check_wgmma_ws<Sm90WgmmaWsMainloop<Sm90WgmmaTileConfig<64, 128, 2, 5, 2>>>("wgmma_m64 gate/up");
  check_wgmma_ws<Sm90WgmmaWsMainloop<Sm90WgmmaTileConfig<64, 256, 1, 5, 2>>>("wgmma_m64 down");
  check_wgmma_ws<Sm90WgmmaWsMainloop<Sm90WgmmaTileConfig<64, 64, 2, 8, 2>>>(
      "wgmma_narrow gate/up");
  check_wgmma_ws<Sm90WgmmaWsMainloop<Sm90WgmmaTileConfig<64, 128, 1, 8, 2>>>("wgmma_narrow down");
  check_wgmma_ws<Sm90WgmmaWsMainloop<Sm90WgmmaTileConfig<128, 128, 2, 4, 1>, 2>>(
      "wgmma_mc gate/up");
  check_wgmma_ws<Sm90WgmmaWsMainloop<Sm90WgmmaTileConfig<128, 256, 1, 3, 1>, 2>>(
      "wgmma_mc down");
  check_wgmma<Sm90WgmmaTileConfig<128, 128, 2, 4, 2>>("wgmma 128 rows, 2x2 warpgroups, gated");
  check_wgmma<Sm90WgmmaTileConfig<192, 128, 1, 3, 1>>("wgmma 192 rows, n128");
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
