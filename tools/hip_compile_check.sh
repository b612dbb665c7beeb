#!/usr/bin/env bash
# AMD gate (no AMD GPU needed): compile every framework-free kernel source in csrc/ with hipcc
# for an AMD target, through the same portability header (csrc/common/platform.h) the CUDA build
# uses (comm/ep_context.cpp, the EP context, included). Sources that include torch/pybind
# headers (csrc/bindings/) are skipped: they need a ROCm torch build. Fails on the first
# compile error after trying every file.
#
#   bash tools/hip_compile_check.sh                      # gfx90a + CDNA3 (+ gfx950), see below
#   HIP_ARCHS="gfx90a gfx942" bash tools/hip_compile_check.sh
#
# Default targets: gfx90a (MI200, CDNA2), the MI300 family (CDNA3) as gfx942 or, with a hipcc
# too old to know it (ROCm 5.x, as on CI's Debian), as gfx940, the CDNA3 target ID such a
# hipcc does know, and gfx950 (MI350, CDNA4) when the hipcc knows it; what it does not know is
# named, not checked.
#
# Needs hipcc (Debian/Ubuntu: apt-get install -y hipcc libamdhip64-dev). Objects and logs go
# to $OUT (default: a fresh temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."

HIPCC=${HIPCC:-hipcc}
OUT=${OUT:-$(mktemp -d /tmp/petit-hip-check.XXXXXX)}
mkdir -p "$OUT"
export HIP_PLATFORM=amd

if ! command -v "$HIPCC" >/dev/null 2>&1; then
  echo "hip_compile_check: '$HIPCC' not found (apt-get install -y hipcc libamdhip64-dev)" >&2
  exit 2
fi

# Whether this hipcc compiles an empty kernel for offload arch $1.
knows_arch() {
  printf '#include <hip/hip_runtime.h>\n__global__ void k() {}\n' > "$OUT/probe.hip"
  "$HIPCC" --offload-arch="$1" -x hip -c "$OUT/probe.hip" -o "$OUT/probe.$1.o" \
    > "$OUT/probe.$1.log" 2>&1
}
not_checked=()
if [ -z "${HIP_ARCHS:-}" ]; then
  HIP_ARCHS=gfx90a
  if knows_arch gfx942; then
    HIP_ARCHS+=" gfx942"
  elif knows_arch gfx940; then
    HIP_ARCHS+=" gfx940"
    not_checked+=("gfx942 (MI300X; CDNA3 checked as gfx940)")
  else
    not_checked+=("gfx942/gfx940 (MI300, CDNA3)")
  fi
  if knows_arch gfx950; then HIP_ARCHS+=" gfx950"; else not_checked+=("gfx950 (MI350)"); fi
fi
echo "hip_compile_check: $("$HIPCC" --version 2>/dev/null | head -1); archs: $HIP_ARCHS; out: $OUT"
if [ ${#not_checked[@]} -gt 0 ]; then
  echo "hip_compile_check: not known to this hipcc, not checked: ${not_checked[*]}"
fi

shopt -s nullglob
sources=(csrc/*/*.cu csrc/*/*.cpp)
num_ok=0 num_failed=0 num_skipped=0
failed=()
for src in "${sources[@]}"; do
  if [[ $src == csrc/bindings/* ]] ||
     grep -Eq '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](torch|pybind11|ATen|c10)/' "$src"; then
    echo "  skip  $src (framework binding: needs a ROCm torch build)"
    num_skipped=$((num_skipped + 1))
    continue
  fi
  for arch in $HIP_ARCHS; do
    obj="$OUT/$(basename "$src").$arch.o"
    log="$OUT/$(basename "$src").$arch.log"
    t0=$(date +%s)
    if "$HIPCC" --offload-arch="$arch" -std=c++17 -O2 -Icsrc -x hip -c "$src" -o "$obj" \
        > "$log" 2>&1; then
      echo "  ok    $src [$arch] ($(( $(date +%s) - t0 ))s, $(grep -c 'warning:' "$log" || true) warnings)"
      num_ok=$((num_ok + 1))
    else
      echo "  FAIL  $src [$arch]"
      grep -E 'error' "$log" | head -30 | sed 's/^/        /'
      num_failed=$((num_failed + 1))
      failed+=("${src}[${arch}]")
    fi
  done
done

if [ $((num_ok + num_failed)) -eq 0 ]; then
  echo "hip_compile_check: no kernel sources compiled (nothing found in csrc/?)" >&2
  exit 1
fi
echo "hip_compile_check: $num_ok compiled, $num_failed failed, $num_skipped skipped"
if [ "$num_failed" -ne 0 ]; then
  echo "hip_compile_check: FAILED: ${failed[*]} (full logs in $OUT)" >&2
  exit 1
fi
