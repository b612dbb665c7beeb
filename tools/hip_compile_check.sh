#!/usr/bin/env bash
# AMD gate (no AMD GPU needed): compile every framework-free kernel source in csrc/ with hipcc
# for an AMD target, through the same portability header (csrc/platform.h) the CUDA build
# uses. Sources that include torch/pybind headers (csrc/bindings.cpp) are skipped: they need
# a ROCm torch build. Fails on the first compile error after trying every file.
#
#   bash tools/hip_compile_check.sh                      # gfx90a
#   HIP_ARCHS="gfx90a gfx942" bash tools/hip_compile_check.sh
#
# Needs hipcc (Debian/Ubuntu: apt-get install -y hipcc libamdhip64-dev). Objects and logs go
# to $OUT (default: a fresh temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."

HIPCC=${HIPCC:-hipcc}
HIP_ARCHS=${HIP_ARCHS:-gfx90a}
OUT=${OUT:-$(mktemp -d /tmp/petit-hip-check.XXXXXX)}
mkdir -p "$OUT"
export HIP_PLATFORM=amd

if ! command -v "$HIPCC" >/dev/null 2>&1; then
  echo "hip_compile_check: '$HIPCC' not found (apt-get install -y hipcc libamdhip64-dev)" >&2
  exit 2
fi
echo "hip_compile_check: $("$HIPCC" --version 2>/dev/null | head -1); archs: $HIP_ARCHS; out: $OUT"

shopt -s nullglob
sources=(csrc/*.cu csrc/*.cpp)
num_ok=0 num_failed=0 num_skipped=0
failed=()
for src in "${sources[@]}"; do
  if grep -Eq '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](torch|pybind11|ATen|c10)/' "$src"; then
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
