#!/usr/bin/env bash
# On a GPU machine (>= 2 GPUs), with the vLLM bundle carried in .devkit (run with
# carry [".devkit"]): install vLLM 0.24.0, build the extension, make the plugin's entry point
# discoverable, run the vLLM integration tests and the MoE-layer benchmark; logs under $OUT,
# a short summary last. Every step has a time limit taken from one overall budget, so the
# summary is printed before the machine's per-command limit (600 s) even when a step hangs.
#
#   bash tools/vllm_gpu_check.sh                     # all steps
#   bash tools/vllm_gpu_check.sh build test-vllm     # some steps (install + env always run)
# Steps: build meta test-vllm test-plugin bench bench-experts ncu profile compare serve tpot. On a
# cold machine all of them do not fit in one 600 s command: run "build meta test-vllm
# test-plugin", then "bench" while it is warm; "compare" (examples/compare_serving.py: the
# seeded tiny Qwen3-MoE served with and without the flag, outputs compared, ~3-5 min) and
# "serve" (examples/serve.sh on the full Qwen3-30B-A3B config, dummy weights, flag on, ~5 min
# cold) each take a command of their own. "profile": examples/bench_moe_layer.py --profile
# (kernel time by category; PROFILE_ARGS, default --tokens 1 64 1024 --petit-experts-tiles
# auto --iters 20). "ncu": Nsight Compute's detailed sections for the expert GEMM kernels
# matching NCU_KERNEL (regex, default expert_(gate_up|down)_ws, first 2 launches) in one
# examples/bench_experts.py run (NCU_ARGS, default DeepSeek-V3, 8192 tokens/rank, wgmma;
# NCU_SET, default detailed: "full" adds the warp stall reasons and per-instruction counters);
# skipped where the machine has no ncu. "tpot": examples/bench_tpot_gsm8k.py (vllm bench serve)
# with TPOT_ARGS (default: DP = all GPUs, default and petit, concurrency 8 64, 128 prompts, 2
# repeats), resuming from /tmp/petit-tpot and --max-runtime = the budget left: repeat the
# command on the warm machine until its summary says COMPLETE (rc 3 = work left).
# Environment: OUT (default /tmp/petit-vllm-check), BUDGET_S (whole run, default 570),
#   PETIT_COMMIT (stamps results: the device copy has no .git), BENCH_ARGS (default --quick --megamoe),
#   EXPERTS_TILES (bench-experts: tile families, default "auto wgmma wgmma_m64"),
#   EXPERTS_SWEEP (bench-experts once per NAME=VALUE environment setting; A=1,B=2 sets two; the
#   kernels read no environment: sweep ExpertConfig with BENCH_EXPERTS_ARGS="--expert-configs ..."),
#   EXPERTS_LIMIT_S (bench-experts: the time limit of each run, default 300 s),
#   COMPARE_ARGS (compare: extra examples/compare_serving.py arguments, e.g. --backend
#   petit-experts),
#   PACK=1 (pack $OUT into $OUT/vllm_gpu_check.tgz: the device returns <= 8 files),
#   PYTEST_ARGS (extra pytest arguments, shell-quoted: PYTEST_ARGS='-k "fp8 or graph"').
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=tools/common.sh
. tools/common.sh
REPO=$(pwd)
OUT=${OUT:-/tmp/petit-vllm-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-570}
STEPS=${*:-build meta test-vllm test-plugin bench}
EXPERTS_TILES=${EXPERTS_TILES:-auto wgmma wgmma_m64}
pytest_args=()
eval "pytest_args=(${PYTEST_ARGS:-})"  # keeps quoted words (-k "a or b") together
want_any() { for s in "$@"; do [[ " $STEPS " == *" $s "* ]] && return 0; done; return 1; }
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_ALLREDUCE_USE_SYMM_MEM=0
unset VLLM_USE_PETIT_MOE VLLM_PETIT_MOE_STRICT
T0=$(date +%s)

declare -A RC SECS
want() { [[ " $STEPS " == *" $1 "* ]]; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
# run_step NAME LIMIT CMD...: runs CMD with a time limit (capped by the budget left, minus 25 s
# kept for the later summary; timeout kills the whole process group, spawned ranks included),
# output to $OUT/NAME.log (its last lines echoed); records rc and seconds.
run_step() {
  local name=$1 limit=$2; shift 2
  local cap=$(( $(left) - 25 ))
  [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -le 5 ]; then
    echo "--- $name: skipped, no time left in BUDGET_S=$BUDGET_S"
    RC[$name]=skipped; SECS[$name]=0; return
  fi
  echo "--- $name (limit ${limit}s): $*"
  local s0
  s0=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  RC[$name]=$?
  SECS[$name]=$(( $(date +%s) - s0 ))
  [ "${RC[$name]}" = 124 ] && echo "(timed out after ${limit}s)" >> "$OUT/$name.log"
  tail -n 25 "$OUT/$name.log"
}

# 1. vLLM 0.24.0 from the carried bundle (idempotent: ~0.1 s when already unpacked)
s0=$(date +%s)
bash .devkit/install_vllm_bundle.sh > "$OUT/install.log" 2>&1
RC[install]=$?; SECS[install]=$(( $(date +%s) - s0 ))
if [ "${RC[install]}" != 0 ] || [ ! -f /tmp/vllm-site/env.sh ]; then
  cat "$OUT/install.log"
  echo "install failed (rc=${RC[install]}): carry .devkit (MANIFEST.json + vllm-bundle.part*)"
  exit 1
fi
# shellcheck disable=SC1091
. /tmp/vllm-site/env.sh
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

# 2. the extension, in place (ninja, every core); also when a later step needs it and a fresh
#    machine has none (a warm machine keeps the ignored .so between calls)
if ! want build && want_any test-vllm bench bench-experts ncu profile compare serve tpot && ! ls vllm_petit_moe/_C*.so > /dev/null 2>&1; then
  echo "no compiled extension here: adding the build step"
  STEPS="build $STEPS"
fi
if want build; then
  run_step build 300 env MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace
fi

# 3. package metadata, so that importlib.metadata (vLLM's load_general_plugins) finds the
#    vllm.general_plugins entry point without a pip install: setup.py egg_info into a
#    folder on PYTHONPATH, or a hand-written .dist-info if that fails.
META=/tmp/petit-moe-meta
if want_any meta test-plugin compare serve tpot; then
  rm -rf "$META"; mkdir -p "$META"
  run_step meta 60 env PETIT_MOE_SKIP_EXTENSION=1 "$PY" setup.py -q egg_info --egg-base "$META"
  if ! ls "$META"/*.egg-info/entry_points.txt > /dev/null 2>&1; then
    echo "egg_info failed (rc=${RC[meta]}): writing a minimal .dist-info instead"
    d="$META/vllm_petit_moe-0.1.0.dist-info"
    mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: vllm-petit-moe\nVersion: 0.1.0\n' > "$d/METADATA"
    printf '[vllm.general_plugins]\npetit_moe = vllm_petit_moe.plugin:register\n' \
      > "$d/entry_points.txt"
    RC[meta]=fallback
  fi
  export PYTHONPATH=$META:$PYTHONPATH
  "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/meta.log"
from importlib.metadata import entry_points
eps = [f"{ep.name} = {ep.value}" for ep in entry_points(group="vllm.general_plugins")]
print("vllm.general_plugins entry points:", eps or "NONE")
EOF
fi

nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader \
  > "$OUT/gpus.txt" 2>/dev/null || : > "$OUT/gpus.txt"
num_gpus=$(grep -c . "$OUT/gpus.txt")

# 4. the vLLM integration tests (one GPU: a block-fp8 layer; real DP + EP setup: >= 2 GPUs)
if want test-vllm; then
  # shellcheck disable=SC2086
  run_step test-vllm 300 "$PY" -m pytest -q -rs "${pytest_args[@]}" \
    tests/test_vllm_single_gpu_gpu.py tests/test_vllm_moe_gpu.py
  # all skipped (no GPUs, extension missing) is not a pass here
  if [ "${RC[test-vllm]}" = 0 ] && ! tail -1 "$OUT/test-vllm.log" | grep -q passed; then
    RC[test-vllm]=all-skipped
  fi
fi

# 5. the plugin's CPU tests (real vLLM; entry point from step 3)
if want test-plugin; then
  # shellcheck disable=SC2086
  run_step test-plugin 180 "$PY" -m pytest -q -rs "${pytest_args[@]}" tests/test_plugin_*_cpu.py
fi

# 6. the MoE-layer benchmark (results also copied to $OUT)
if want bench; then
  # shellcheck disable=SC2086
  run_step bench 400 "$PY" examples/bench_moe_layer.py ${BENCH_ARGS:---quick --megamoe} --out-dir "$OUT"
fi

# 6b. the expert GEMMs against vLLM's Triton experts (needs vLLM, hence here): every tile
#     family in EXPERTS_TILES on the same rows, one run
#     (EXPERTS_SWEEP="NAME=VALUE ...": once per environment setting, each into
#     $OUT/experts-NAME_VALUE and its own log; a repeated setting into experts-NAME_VALUE_r2,
#     ...; the kernels' own knobs are ExpertConfig fields, swept by --expert-configs)
experts_steps=bench-experts  # the steps' names, for the summary
if want bench-experts; then
  if [ -z "${EXPERTS_SWEEP:-}" ]; then
    # shellcheck disable=SC2086
    run_step bench-experts "${EXPERTS_LIMIT_S:-300}" "$PY" examples/bench_experts.py ${BENCH_EXPERTS_ARGS:---quick} \
      --tiles $EXPERTS_TILES --out-dir "$OUT/experts"
  else
    for setting in $EXPERTS_SWEEP; do
      tag=$(sweep_tag "$OUT/experts-" "$setting")
      [ "$experts_steps" = bench-experts ] && experts_steps=""
      experts_steps+=" bench-experts-$tag"
      # shellcheck disable=SC2086
      run_step "bench-experts-$tag" "${EXPERTS_LIMIT_S:-300}" env ${setting//,/ } "$PY" examples/bench_experts.py \
        ${BENCH_EXPERTS_ARGS:---quick} --tiles $EXPERTS_TILES --out-dir "$OUT/experts-$tag"
    done
  fi
fi

# 6b'. hardware counters of the expert GEMM kernels (Nsight Compute), where the machine has it
if want ncu; then
  NCU=$(command -v ncu || ls "$CUDA_HOME"/bin/ncu 2>/dev/null | head -1)
  if [ -n "$NCU" ]; then
    # shellcheck disable=SC2086
    run_step ncu 150 "$NCU" --set "${NCU_SET:-detailed}" \
      --kernel-name "regex:${NCU_KERNEL:-expert_(gate_up|down)_ws}" \
      --launch-count 2 "$PY" examples/bench_experts.py \
      ${NCU_ARGS:---presets deepseek-v3 --routings uniform --tokens 8192 --tiles wgmma --iters 1 --no-triton} \
      --out-dir "$OUT/ncu-bench"
  else
    echo "--- ncu: no ncu on this machine" | tee "$OUT/ncu.log"
    RC[ncu]=missing; SECS[ncu]=0
  fi
fi

# 6c. where the MoE layer's time goes: kernel time per category for each path
if want profile; then
  # shellcheck disable=SC2086
  run_step profile 300 "$PY" examples/bench_moe_layer.py --profile \
    ${PROFILE_ARGS:---tokens 1 64 1024 --petit-experts-tiles auto --iters 20} --out-dir "$OUT/profile"
fi

# 7. serving: the same model with and without the flag, outputs compared (seeded weights)
if want compare; then
  # shellcheck disable=SC2086
  run_step compare 560 "$PY" examples/compare_serving.py --log-dir "$OUT/compare" \
    --results-dir "$OUT" ${COMPARE_ARGS:-}
fi

# 8. serving the full Qwen3-30B-A3B config (dummy weights) with the flag: answers + backend
if want serve; then
  run_step serve 560 env HEALTH_TIMEOUT=480 LOG="$OUT/serve_server.log" \
    bash examples/serve.sh examples/models/qwen3-30b-a3b
fi

# 9. TPOT through vllm serve (examples/bench_tpot_gsm8k.py), resumable across commands: it
#    starts only the servers that fit in the budget left (rc 3: work left, run again)
if want tpot; then
  # the benchmark stops starting work at its --max-runtime and then stops its server (<= 30 s);
  # the step's own limit (the budget left - 25 s) comes after that
  tpot_budget=$(( $(left) - 70 ))
  # shellcheck disable=SC2086
  run_step tpot $(( tpot_budget + 45 )) "$PY" examples/bench_tpot_gsm8k.py \
    ${TPOT_ARGS:---data-parallel-size $num_gpus --concurrency 8 64 --num-prompts 128 --repeats 2} \
    --results-dir /tmp/petit-tpot --work-dir /tmp/petit-tpot/work --max-runtime "$tpot_budget"
  cp -r /tmp/petit-tpot "$OUT/tpot"
fi

echo
echo "================ petit-moe vLLM GPU check ================"
echo "gpus        : $(cut -d, -f2 "$OUT/gpus.txt" | sort | uniq -c | xargs) ($num_gpus)"
echo "commit      : ${PETIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
echo "vllm        : $("$PY" -c 'from importlib.metadata import version; print(version("vllm"))' 2>&1 | tail -1)"
echo "install     : rc=${RC[install]} in ${SECS[install]}s"
ok=1
for step in build meta test-vllm test-plugin bench $experts_steps ncu profile compare serve tpot; do
  case $step in bench-experts*) want bench-experts || continue ;; *) want "$step" || continue ;; esac
  rc=${RC[$step]:-not-run}
  summary=""
  case $step in
    test-*) summary=$(grep -E "(passed|failed|skipped|error)" "$OUT/$step.log" 2>/dev/null | tail -1) ;;
    ncu) summary=$(grep -cE "Duration|Throughput" "$OUT/ncu.log" 2>/dev/null | sed 's/$/ metric lines/') ;;
    bench-experts*) summary=$(grep -E "^wrote|NOTE" "$OUT/$step.log" 2>/dev/null | tail -2 | tr '\n' ' ') ;;
    bench|profile) summary=$(grep -E "^wrote|^WARNING: " "$OUT/$step.log" 2>/dev/null | tail -2 | tr -d "'\"") ;;
    tpot) summary=$(grep -E "COMPLETE|left: rerun|FAILED|stopped by" "$OUT/$step.log" 2>/dev/null | tail -1) ;;
    compare) summary=$(grep -E "^(AGREE|DISAGREE)|prompts identical" "$OUT/$step.log" 2>/dev/null | tail -2 | tr '\n' ' ') ;;
    serve) summary=$(grep -E "MoE layers use|token ids|exit" "$OUT/$step.log" 2>/dev/null | tail -2 | tr '\n' ' ') ;;
    meta) summary=$(grep "entry points" "$OUT/meta.log" 2>/dev/null | tail -1) ;;
  esac
  printf '%-12s: rc=%s in %ss %s\n' "$step" "$rc" "${SECS[$step]:-0}" "$summary"
  case $step:$rc in *:0|*:fallback|tpot:3|ncu:missing) ;; *) ok=0 ;; esac
done
echo "logs        : $OUT ($(( $(date +%s) - T0 ))s total)"
pack_out vllm_gpu_check
[ "$ok" = 1 ]
