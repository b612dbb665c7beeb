#!/usr/bin/env bash
# On a GPU machine: build the extension with every core, run the GPU test files (tests/*_gpu.py,
# multi-rank tests included: W ranks share the GPUs when there are fewer GPUs than ranks),
# optionally the benchmarks, and print a short summary last. Logs go to $OUT (default
# /tmp/petit-gpu-check). The CPU tests (the kernels' emulation among them, minutes of CPU) are
# CI's and would only spend device time here: TEST_PATHS=tests runs the whole suite.
#
#   bash tools/gpu_check.sh                 # build + GPU tests
#   BENCH=1 bash tools/gpu_check.sh         # + examples/bench_dispatch_combine.py (>= 2 GPUs)
#   BENCH_EXPERTS=1 bash tools/gpu_check.sh # + examples/bench_experts.py (1 GPU;
#                                           #   BENCH_EXPERTS_ARGS, default --quick)
#   BENCH_SWEEP="reduce_pct=40 reduce_pct=25,reduce_vectors=64" \
#     bash tools/gpu_check.sh                # + the dispatch/combine bench once per setting,
#                                            #   a CombineConfig (--combine-configs; fields
#                                            #   of vllm_petit_moe/config.py, comma-separated;
#                                            #   BENCH_SWEEP_ARGS; tables in $OUT/sweep.log)
#   PACK=1 bash tools/gpu_check.sh       # logs and results packed into $OUT/gpu_check.tgz
#   PYTEST_ARGS='-k "fp8 or graph"' bash tools/gpu_check.sh   # shell-quoted, like a command line
#   TEST_PATHS="tests/test_dispatch_combine_gpu.py" bash tools/gpu_check.sh  # some test files
# The device copy of the tree has no .git: pass PETIT_COMMIT=<hash> to stamp results.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=tools/common.sh
. tools/common.sh
OUT=${OUT:-/tmp/petit-gpu-check}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# This checkout's vllm_petit_moe (built in place below, not pip-installed here): the benchmarks
# and the tests' subprocesses import it, vllm_petit_moe.testing included.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *//')
num_gpus=$(nvidia-smi -L 2>/dev/null | wc -l)

t0=$(date +%s)
MAX_JOBS=$(nproc) $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1
build_rc=$?
build_s=$(( $(date +%s) - t0 ))
spills=$(grep -c "bytes spill stores" "$OUT/build.log" 2>/dev/null || true)
[ $build_rc -eq 0 ] || tail -40 "$OUT/build.log"

# SASS of the built image, per kernel: which contain HGMMA (the wgmma expert GEMMs must) and
# which touch local memory (LDL/STL: spills or stack arrays; the dispatch/combine kernels'
# 48-byte frame is the printf argument buffer of their timeout report, off the hot path).
sass_summary=-
CUOBJDUMP=$CUDA_HOME/bin/cuobjdump
so=$(ls vllm_petit_moe/_C*.so 2>/dev/null | head -1)
if [ $build_rc -eq 0 ] && [ -x "$CUOBJDUMP" ] && [ -n "$so" ]; then
  "$CUOBJDUMP" -sass "$so" > /tmp/petit_sass.txt 2>/dev/null
  # kernel names shortened to the identifier before the template arguments
  sass_summary=$(awk '
    /Function :/ { fn = $3; sub(/^.*_cu_[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]/, "", fn)  # namespace, file hash
                   sub(/^[0-9]+/, "", fn); match(fn, /^[a-z0-9_]+/); fn = substr(fn, 1, RLENGTH) }
    /HGMMA/ { h[fn]++ }
    /[[:space:]](LDL|STL)[.[:space:]]/ { l[fn]++ }
    END { printf "HGMMA in:"; n = 0; for (f in h) { printf " %s(%d)", f, h[f]; n++ }
          if (n == 0) printf " none"
          printf "; local memory in:"; n = 0; for (f in l) { printf " %s(%d)", f, l[f]; n++ }
          if (n == 0) printf " none" }' /tmp/petit_sass.txt)
fi

test_rc=1
if [ $build_rc -eq 0 ]; then
  t1=$(date +%s)
  pytest_args=()
  eval "pytest_args=(${PYTEST_ARGS:-})"  # keeps quoted words (-k "a or b") together
  timeout ${TEST_TIMEOUT:-420} $PY -m pytest -q -rs "${pytest_args[@]}" ${TEST_PATHS:-tests/*_gpu.py} 2>&1 | tee "$OUT/pytest.log"
  test_rc=${PIPESTATUS[0]}
  test_s=$(( $(date +%s) - t1 ))
fi

bench_rc=-
if [ "${BENCH:-0}" = 1 ] && [ $build_rc -eq 0 ] && [ "$num_gpus" -ge 2 ]; then
  timeout ${BENCH_TIMEOUT:-300} $PY examples/bench_dispatch_combine.py ${BENCH_ARGS:-} --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi

sweep_rc=-
if [ -n "${BENCH_SWEEP:-}" ] && [ $build_rc -eq 0 ] && [ "$num_gpus" -ge 2 ]; then
  sweep_rc=0
  for setting in $BENCH_SWEEP; do
    tag=$(sweep_tag "$OUT/sweep-" "$setting")
    echo "=== $setting ($tag)" | tee -a "$OUT/sweep.log"
    # shellcheck disable=SC2086
    timeout ${BENCH_TIMEOUT:-300} $PY examples/bench_dispatch_combine.py \
      ${BENCH_SWEEP_ARGS:---routings uniform --tokens 1 128 4096 16384 --num-sms 0 --iters 20} \
      --combine-configs "$setting" --out-dir "$OUT/sweep-$tag" 2>&1 | grep -vi "warn" | tee -a "$OUT/sweep.log"
    [ "${PIPESTATUS[0]}" = 0 ] || sweep_rc=1
  done
fi

experts_bench_rc=-
if [ "${BENCH_EXPERTS:-0}" = 1 ] && [ $build_rc -eq 0 ] && [ "$num_gpus" -ge 1 ]; then
  timeout ${BENCH_TIMEOUT:-300} $PY examples/bench_experts.py ${BENCH_EXPERTS_ARGS:---quick} --out-dir "$OUT" 2>&1 | tee "$OUT/bench_experts.log"
  experts_bench_rc=${PIPESTATUS[0]}
fi

echo
echo "================ petit-moe GPU check ================"
echo "gpus        : ${gpus:-none} ($num_gpus)"
echo "commit      : ${PETIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
echo "build       : rc=$build_rc in ${build_s}s (spilling functions: ${spills:-0})"
echo "sass        : $sass_summary"
echo "tests       : rc=$test_rc in ${test_s:-0}s: $(tail -1 "$OUT/pytest.log" 2>/dev/null)"
echo "bench       : rc=$bench_rc"
echo "experts     : rc=$experts_bench_rc"
echo "sweep       : rc=$sweep_rc ${BENCH_SWEEP:-}"
pack_out gpu_check
[ $build_rc -eq 0 ] && [ $test_rc -eq 0 ] && { [ "$bench_rc" = - ] || [ "$bench_rc" = 0 ]; } &&
  { [ "$experts_bench_rc" = - ] || [ "$experts_bench_rc" = 0 ]; } &&
  { [ "$sweep_rc" = - ] || [ "$sweep_rc" = 0 ]; }
