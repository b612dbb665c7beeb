# Shell helpers shared by tools/gpu_check.sh, tools/vllm_gpu_check.sh and tools/ab_trees.sh
# (sourced, from the repository root).

# sweep_tag DIR_PREFIX SETTING: SETTING (NAME=VALUE) as a folder-name tag, with _r2, _r3, ...
# when DIR_PREFIX<tag> already exists (a setting repeated in a sweep, as interleaved A/B
# repeats are).
sweep_tag() {
  local base=${2//[^A-Za-z0-9]/_} n=1
  local tag=$base
  while [ -e "$1$tag" ]; do n=$((n + 1)); tag=${base}_r$n; done
  echo "$tag"
}

# PACK=1: everything under $OUT into one $OUT/<name>.tgz (the lent device machines return at
# most 8 files from $OUT).
pack_out() {
  [ "${PACK:-0}" = 1 ] || return 0
  local tgz
  tgz=$(mktemp /tmp/petit-pack.XXXXXX.tgz)
  tar czf "$tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$tgz" "$OUT/$1.tgz"
}
