#!/usr/bin/env bash
# On one sm_90 GPU, with the extension built: Nsight Compute's full sections for the expert
# GEMM kernels of one examples/bench_experts.py configuration and for cuBLAS's bmm on equal
# groups of the same size (what the vendor GEMM does with these shapes), plus each kernel's
# most-stalled instructions (tools/ncu_stalls.py). Text under $OUT (default /tmp/petit-ncu).
#   NCU_TOKENS (default 8192), NCU_TILES (default wgmma_mc), NCU_PRESET (default deepseek-v3),
#   NCU_CUBLAS=0 (skip the cuBLAS kernels)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/petit-ncu}
mkdir -p "$OUT"
# This checkout's vllm_petit_moe (built in place): bench_experts.py imports it.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
NCU=$(command -v ncu || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
TOKENS=${NCU_TOKENS:-8192}
TILES=${NCU_TILES:-wgmma_mc}
PRESET=${NCU_PRESET:-deepseek-v3}

"$NCU" --set full --import-source no -f -o "$OUT/petit" \
  --kernel-name "regex:expert_(gate_up|down)_ws" --launch-count 2 \
  "$PY" examples/bench_experts.py --presets "$PRESET" --routings uniform --tokens "$TOKENS" \
  --tiles "$TILES" --iters 1 --no-triton --out-dir "$OUT/bench" > "$OUT/ncu_petit_run.log" 2>&1
# cuBLAS on the bench's dense baseline (bench_experts.py: torch.bmm over the local experts with
# the mean rows per expert of uniform routing at W = 2)
[ "${NCU_CUBLAS:-1}" = 0 ] || "$NCU" --set full --import-source no -f -o "$OUT/cublas" --kernel-name "regex:nvjet|gemm|xmma|cutlass" \
  --launch-skip 2 --launch-count 2 "$PY" -c "
import torch
hidden, inter, experts, top_k = {'deepseek-v3': (7168, 2048, 256, 8),
                                 'qwen3-30b-a3b': (2048, 768, 128, 8)}['$PRESET']
E = experts // 2
rows = -(-$TOKENS * top_k // E)  # 2 * T rows x top-k entries, half of them local
a1 = torch.randn(E, rows, hidden, dtype=torch.bfloat16, device='cuda')
a2 = torch.randn(E, rows, inter, dtype=torch.bfloat16, device='cuda')
w13 = torch.randn(E, 2 * inter, hidden, dtype=torch.bfloat16, device='cuda').transpose(1, 2)
w2 = torch.randn(E, hidden, inter, dtype=torch.bfloat16, device='cuda').transpose(1, 2)
for _ in range(2):
    torch.bmm(a1, w13); torch.bmm(a2, w2)
torch.cuda.synchronize()
" > "$OUT/ncu_cublas_run.log" 2>&1
for rep in petit cublas; do
  [ -f "$OUT/$rep.ncu-rep" ] || { echo "$rep: no report"; tail -5 "$OUT/ncu_${rep}_run.log" 2>/dev/null; continue; }
  "$NCU" --import "$OUT/$rep.ncu-rep" --print-details all > "$OUT/${rep}_details.txt" 2>&1
  # one kernel at a time: unfiltered, the source page repeats the first kernel's table
  : > "$OUT/${rep}_stalls.txt"
  for i in 0 1; do
    "$NCU" --import "$OUT/$rep.ncu-rep" --launch-skip "$i" --launch-count 1 --page source --csv \
      --print-source sass 2> /dev/null |
      "$PY" tools/ncu_stalls.py --top 25 >> "$OUT/${rep}_stalls.txt" 2>&1
  done
  rm -f "$OUT/$rep.ncu-rep"
  grep -E "^  [a-z_<>]|Duration|SM Frequency|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per|Cluster Size|Grid Size|Shared Memory Per|Issue Slots|Warp Cycles Per Issued" "$OUT/${rep}_details.txt" | head -60
  cat "$OUT/${rep}_stalls.txt"
done
