#!/usr/bin/env bash
# Here, before a device call (the GPU machine's copy of the tree has no usable .git): make the
# source-tree folders that tools/ab_trees.sh compares, from git refs and optional patches.
#
#   bash tools/ab_prepare.sh old=main branch=exp/my-kernel-change \
#       patched=main+my-kernel-change.patch
#
# Each NAME=REF[+PATCH] (NAME letters and digits) becomes the folder $AB_DIR/NAME (default: the
# repository root; an existing one is replaced): `git archive REF` of what a build, the
# benchmarks, the tests and the tools need (csrc, vllm_petit_moe, setup.py, pyproject.toml,
# tests, tools, examples without models/ and results/), then PATCH applied exactly (patch -p1,
# no fuzz; a path relative to the repository root). Untracked, the folders travel with the
# working tree to the device (keep the whole under the call's 64 MiB; delete them afterwards);
# then AB_OLD=old AB_TREES="branch=branch patched=patched" ... bash tools/ab_trees.sh there.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
top=$(git rev-parse --show-toplevel 2> /dev/null || true)
[ "$top" = "$ROOT" ] || { echo "ab_prepare: $ROOT is not the top of a git checkout"; exit 2; }
DIR=${AB_DIR:-$ROOT}
[ $# -gt 0 ] || { sed -n '2,14p' "$0"; exit 2; }
for spec in "$@"; do
  name=${spec%%=*} source=${spec#*=}
  [[ $spec == *=* && $name =~ ^[A-Za-z0-9]+$ ]] || { echo "ab_prepare: '$spec': expected NAME=REF[+PATCH]"; exit 2; }
  ref=${source%%+*} patch=
  [[ $source == *+* ]] && patch=${source#*+}
  git rev-parse --verify -q "$ref^{commit}" > /dev/null || { echo "ab_prepare: no commit '$ref'"; exit 2; }
  [ -z "$patch" ] || [ -f "$patch" ] || { echo "ab_prepare: no patch file '$patch'"; exit 2; }
  out=$DIR/$name
  rm -rf "$out"
  mkdir -p "$out"
  git archive "$ref" csrc vllm_petit_moe setup.py pyproject.toml tests tools examples |
    tar -x -C "$out"
  rm -rf "$out/examples/models" "$out/examples/results"
  # GNU patch, not git apply: inside this repository git apply would patch its root
  if [ -n "$patch" ] && ! patch -p1 --forward --fuzz=0 --quiet -d "$out" < "$patch"; then
    echo "ab_prepare: $patch does not apply to $ref"
    exit 1
  fi
  short=$(git rev-parse --short "$ref")
  # the results' commit stamp there (ab_trees.sh exports it as PETIT_COMMIT for this tree)
  echo "$short${patch:++$(basename "$patch")}" > "$out/.petit_commit"
  echo "$name: $short${patch:+ + $patch}, $(du -sh "$out" | cut -f1)"
done
