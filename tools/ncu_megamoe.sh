#!/usr/bin/env bash
# On one sm_90 GPU, with the extension built: Nsight Compute's full sections for the fused MoE
# layer (ops.megamoe_forward, W=1) at a few token counts of one preset (DeepSeek-V3: its
# 32-expert EP8 share), uniform routing, fresh random weights (bf16, or NCU_DTYPE=fp8: e4m3
# with random 128 x 128 block scales), and each launch's most-stalled instructions
# (tools/ncu_stalls.py): where its warps wait (weight ring mbarriers, input loads, the control
# warp's counters). Text under $OUT (default /tmp/petit-ncu-megamoe).
#   NCU_PRESET (deepseek-v3 | qwen3-30b-a3b), NCU_TOKENS (default "1 8"), NCU_PICK (the global
#   experts top-8 picks from, the first ones local: default 256 for DeepSeek-V3, 128 for Qwen3;
#   DeepSeek-V3 with 64 and 256 tokens gives its 32 experts 32 rows each, as skewed routing does)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/petit-ncu-megamoe}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
NCU=$(command -v ncu || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
PRESET=${NCU_PRESET:-deepseek-v3}
PICK=${NCU_PICK:-0}
DTYPE=${NCU_DTYPE:-bf16}
case $DTYPE in bf16|fp8) ;; *) echo "NCU_DTYPE=$DTYPE: bf16 or fp8"; exit 2 ;; esac
for tokens in ${NCU_TOKENS:-1 8}; do
  rep=$OUT/megamoe_${PRESET}_${DTYPE}_${tokens}${NCU_PICK:+_pick$PICK}
  "$NCU" --set full --import-source no -f -o "$rep" --kernel-name "regex:megamoe" \
    --launch-skip 2 --launch-count 1 "$PY" -c "
import torch
from vllm_petit_moe import ops
# local experts, and the global experts that top-8 picks from (ids >= local: another rank's)
hidden, inter, experts, pick = {'deepseek-v3': (7168, 2048, 32, 256),
                                'qwen3-30b-a3b': (2048, 768, 128, 128)}['$PRESET']
pick = $PICK or pick
if pick < 8:
    raise SystemExit(f'NCU_PICK={pick}: top-8 needs at least 8 experts to pick from')
g = torch.Generator(device='cuda').manual_seed(0)
w13 = torch.randn(experts, 2 * inter, hidden, device='cuda', dtype=torch.bfloat16, generator=g) * 0.02
w2 = torch.randn(experts, hidden, inter, device='cuda', dtype=torch.bfloat16, generator=g) * 0.02
scales = {}
if '$DTYPE' == 'fp8':  # e4m3 weights, one fp32 scale per 128 x 128 block (as vLLM loads them)
    w13, w2 = (w.mul(20).to(torch.float8_e4m3fn) for w in (w13, w2))
    scales = {name: torch.rand(experts, r // 128, c // 128, device='cuda', generator=g) * 0.01 + 1e-3
              for name, (r, c) in (('w13_scale', (2 * inter, hidden)), ('w2_scale', (hidden, inter)))}
for _ in range(3):
    x = torch.randn($tokens, hidden, device='cuda', dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(pick, device='cuda', generator=g)[:8] for _ in range($tokens)]).int()
    ids[0, 0] = 0  # at least one local expert
    w = torch.rand($tokens, 8, device='cuda', generator=g)
    ops.megamoe_forward(x, ids, w, w13, w2, **scales)
torch.cuda.synchronize()
" > "$rep.log" 2>&1
  [ -f "$rep.ncu-rep" ] || { echo "$PRESET $tokens: no report"; tail -5 "$rep.log"; continue; }
  "$NCU" --import "$rep.ncu-rep" --print-details all > "${rep}_details.txt" 2>&1
  "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass 2> /dev/null |
    "$PY" tools/ncu_stalls.py --top 20 > "${rep}_stalls.txt" 2>&1
  rm -f "$rep.ncu-rep"
  echo "=== $PRESET $DTYPE, $tokens tokens"
  grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" "${rep}_details.txt" | head -8
  head -45 "${rep}_stalls.txt"
done
