# Shell helpers shared by tools/gpu_check.sh and tools/vllm_gpu_check.sh (sourced, from the
# repository root).

# PACK=1: everything under $OUT into one $OUT/<name>.tgz (the lent device machines return at
# most 8 files from $OUT).
pack_out() {
  [ "${PACK:-0}" = 1 ] || return 0
  local tgz
  tgz=$(mktemp /tmp/petit-pack.XXXXXX.tgz)
  tar czf "$tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$tgz" "$OUT/$1.tgz"
}
