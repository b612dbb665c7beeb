#!/usr/bin/env bash
# On a GPU machine: same-run A/B of two source trees of this repository with the
# dispatch/combine benchmark (or AB_BENCH=examples/bench_experts.py, the expert GEMMs: give
# it AB_ARGS and AB_METRIC=us), so a kernel change is measured against its parent on the same
# GPUs in the same call. AB_OLD names a folder holding the other tree, made before the call
# by tools/ab_prepare.sh (old=<commit>; untracked, so it travels with the working tree, which
# must stay under the device call's 64 MiB; delete it afterwards). Both trees are built at once
# (half the cores each); then every run of AB_RUNS, repeated AB_REPEATS times in interleaved order,
# runs $AB_BENCH $AB_ARGS from its own tree. A run is TREE[:NAME=VALUE[,NAME=VALUE...]] with
# TREE `old` (AB_OLD) or `new` (this tree) and environment variables to set; its results go to
# $OUT/ab-<tree>[_<setting>][_rN]/, and tools/ab_compare.py compares each run with the first.
# Without AB_OLD only `new` runs are allowed (a sweep of settings of this tree). More trees:
# AB_TREES="NAME=FOLDER ..." (NAME letters and digits), each run as NAME[:settings], all built
# at once (the cores shared), e.g. a base and two kernel variants in one call. The kernels'
# tuning configs are benchmark arguments, not environment (AB_ARGS: --combine-configs of
# bench_dispatch_combine.py, --expert-configs of bench_experts.py). Results are stamped with
# each tree's commit: ab_prepare.sh's for its folders, PETIT_COMMIT (pass it) for this tree.
# AB_AFTER: a shell command run once in each tree of AB_RUNS after the benchmarks (a trace, a
# test), with PYTHONPATH that tree, PY the interpreter and AB_TREE_OUT=$OUT/after-<tree> for its
# files; its output goes to $OUT/after-<tree>.log (AB_AFTER_TIMEOUT s each, default 120).
#
#   AB_OLD=ab_old AB_RUNS="old new" AB_REPEATS=2 \
#     AB_ARGS="--routings uniform --tokens 128 4096 --num-sms 24 132 --iters 20" \
#     PACK=1 bash tools/ab_trees.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=tools/common.sh
. tools/common.sh
OUT=${OUT:-/tmp/petit-ab}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PY=${PYTHON:-python3}
declare -A DIRS=([new]=$PWD)
add_tree() {  # NAME FOLDER
  local dir
  [[ $1 =~ ^[A-Za-z0-9]+$ ]] || { echo "tree name '$1': letters and digits only"; exit 2; }
  dir=$(cd "$2" && pwd) || exit 1
  [ -f "$dir/setup.py" ] || { echo "tree $1=$2 holds no source tree"; exit 1; }
  DIRS[$1]=$dir
}
[ -z "${AB_OLD:-}" ] || add_tree old "$AB_OLD"
for entry in ${AB_TREES:-}; do add_tree "${entry%%=*}" "${entry#*=}"; done
RUNS=${AB_RUNS:-old new}
BENCH=${AB_BENCH:-examples/bench_dispatch_combine.py}
for run in $RUNS; do
  tree=${run%%:*}
  [ -n "${DIRS[$tree]:-}" ] || {
    [ "$tree" = old ] && echo "AB_RUNS has old runs but no AB_OLD" || echo "run $run: no tree $tree"
    exit 2; }
done
jobs=$(( $(nproc) / ${#DIRS[@]} > 0 ? $(nproc) / ${#DIRS[@]} : 1 ))

for name in "${!DIRS[@]}"; do
  (cd "${DIRS[$name]}" && MAX_JOBS=$jobs $PY setup.py build_ext --inplace > "$OUT/build-$name.log" 2>&1) &
done
build_rc=0
for job in $(jobs -p); do wait "$job" || build_rc=1; done
if [ $build_rc -ne 0 ]; then tail -30 "$OUT"/build-*.log; pack_out ab_trees; exit 1; fi

bench_rc=0
first=
for _ in $(seq "${AB_REPEATS:-2}"); do
  for run in $RUNS; do
    tree=${run%%:*}; setting=${run#"$tree"}; setting=${setting#:}
    dir=${DIRS[$tree]}
    name=$tree${setting:+_$setting}
    tag=$(sweep_tag "$OUT/ab-" "$name")
    first=${first:-$OUT/ab-${name//[^A-Za-z0-9]/_}}
    echo "=== $run ($tag)" | tee -a "$OUT/ab.log"
    # results stamped with the tree's commit: ab_prepare.sh's .petit_commit, else $PETIT_COMMIT
    commit=${PETIT_COMMIT:-unknown}
    [ -f "$dir/.petit_commit" ] && commit=$(cat "$dir/.petit_commit")
    # shellcheck disable=SC2086
    (cd "$dir" && env ${setting:+${setting//,/ }} PYTHONPATH="$dir:${PYTHONPATH:-}" PETIT_COMMIT="$commit" \
      timeout ${BENCH_TIMEOUT:-300} $PY "$BENCH" \
      ${AB_ARGS:---routings uniform --tokens 128 4096 16384 --num-sms 24 0 --iters 20} \
      --out-dir "$OUT/ab-$tag") 2>&1 | grep -vi "warn" >> "$OUT/ab.log"
    [ "${PIPESTATUS[0]}" = 0 ] || bench_rc=1
  done
done

echo
echo "================ petit-moe A/B of source trees ================"
echo "old: ${AB_OLD:-none}  new: ${PETIT_COMMIT:-this tree}${AB_TREES:+  also: $AB_TREES}  runs: $RUNS x ${AB_REPEATS:-2}  bench rc=$bench_rc"
for run in $(printf '%s\n' $RUNS | awk '!seen[$0]++'); do
  tree=${run%%:*}; setting=${run#"$tree"}; setting=${setting#:}
  name=$tree${setting:+_$setting}
  base=$OUT/ab-${name//[^A-Za-z0-9]/_}
  [ "$base" = "$first" ] && continue
  echo "--- $(basename "$first") vs $(basename "$base")" | tee -a "$OUT/ab_summary.log"
  $PY tools/ab_compare.py "$first" "$base" --metric "${AB_METRIC:-combine_us}" | tee -a "$OUT/ab_summary.log"
done
if [ -n "${AB_AFTER:-}" ]; then
  for tree in $(printf '%s\n' $RUNS | sed 's/:.*//' | awk '!seen[$0]++'); do
    mkdir -p "$OUT/after-$tree"
    (cd "${DIRS[$tree]}" && PYTHONPATH="${DIRS[$tree]}:${PYTHONPATH:-}" PY="$PY" \
      AB_TREE_OUT="$OUT/after-$tree" timeout "${AB_AFTER_TIMEOUT:-120}" bash -c "$AB_AFTER") \
      > "$OUT/after-$tree.log" 2>&1 || echo "AB_AFTER in $tree: rc $?" | tee -a "$OUT/ab_summary.log"
  done
fi
pack_out ab_trees
[ $bench_rc -eq 0 ]
