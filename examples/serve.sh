#!/usr/bin/env bash
# Serve a MoE model with vLLM with vllm-petit-moe switched on (VLLM_USE_PETIT_MOE=1): data
# parallel + expert parallel over this node's GPUs (petit's dispatch/combine), or on one GPU
# (petit's one-GPU experts in place of vLLM's Triton experts); send one
# /v1/completions request, print the generated token ids, report whether the MoE layers use
# petit (from the server log), and stop the server.
#
#   bash examples/serve.sh [MODEL_DIR] [extra `vllm serve` args...]
#   bash examples/serve.sh --enforce-eager                 # default model + extra args
#   bash examples/serve.sh --help                          # this text
#
#   bash examples/serve.sh                                  # bundled tiny Qwen3-MoE, all GPUs
#   DP=2 bash examples/serve.sh                             # 2 DP ranks
#   bash examples/serve.sh /path/to/qwen3-30b-a3b --enforce-eager
#   SERVE_ONLY=1 HOST=0.0.0.0 bash examples/serve.sh        # keep serving until Ctrl-C
#
# MODEL_DIR defaults to examples/models/tiny-qwen3-moe (config only: 2 layers, hidden 1024,
# 16 experts, top-4). Weights are random (--load-format dummy; LOAD_FORMAT=auto for real
# ones). A model directory without tokenizer files is served with --skip-tokenizer-init, so
# prompts are token ids and the returned text is empty.
#
# Needs a GPU, vLLM and this package installed (see README.md).
# Environment:
#   DP                 data-parallel size (default: number of visible GPUs; 1: one GPU, no EP)
#   PORT, HOST         where to serve (default 8000, 127.0.0.1)
#   HEALTH_TIMEOUT     seconds to wait for /health (default 600)
#   MAX_TOKENS         tokens to generate (default 16)
#   PROMPT_IDS         space-separated prompt token ids (default "1 2 3 4 5 6 7 8")
#   LOAD_FORMAT        default dummy
#   ATTENTION_BACKEND  default TRITON_ATTN (MLA models such as DeepSeek need an MLA backend)
#   LOG                server log file (default: a new file in /tmp)
#   SERVE_ONLY=1       no request: wait for /health, report, then keep serving in the
#                      foreground (server log follows) until Ctrl-C or the server exits
#   VLLM_USE_PETIT_MOE default 1; set 0 for a baseline run on vLLM's own all-to-all
#   PYTHON             interpreter of the vLLM install (default python3)
# Exit codes: 0 served, and (flag on) the MoE layers use petit; 1 server or request failed;
# 2 usage/environment error; 3 served, but petit was not used (fallback: see the report).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  # The comment block at the top of this file, without its '#'.
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"
  exit 0
fi
PYTHON=${PYTHON:-python3}
MODEL=$HERE/models/tiny-qwen3-moe
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then  # first argument: the model, unless it is an option
  MODEL=$1
  shift
fi
EXTRA_ARGS=("$@")
PORT=${PORT:-8000}
HOST=${HOST:-127.0.0.1}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
MAX_TOKENS=${MAX_TOKENS:-16}
PROMPT_IDS=${PROMPT_IDS:-1 2 3 4 5 6 7 8}
LOAD_FORMAT=${LOAD_FORMAT:-dummy}
ATTENTION_BACKEND=${ATTENTION_BACKEND:-TRITON_ATTN}
SERVE_ONLY=${SERVE_ONLY:-0}

die() { echo "serve.sh: $*" >&2; exit 2; }
say() { echo "[serve.sh $(date +%H:%M:%S)] $*"; }

# Safety: NVLink multicast stays off (NCCL NVLS, torch symmetric memory, NVSHMEM, and vLLM's
# symm-mem all-reduce, which would use multicast ops).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_ALLREDUCE_USE_SYMM_MEM=0
# A vLLM install without FlashInfer (some offline bundles) would make the engine die at
# start-up in FlashInfer's sampler. Same set as vllm_petit_moe/testing/bench_env.py
# VLLM_SAFE_ENV; each can be overridden from the environment.
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export VLLM_NO_USAGE_STATS=${VLLM_NO_USAGE_STATS:-1} DO_NOT_TRACK=${DO_NOT_TRACK:-1}
export VLLM_USE_PETIT_MOE=${VLLM_USE_PETIT_MOE:-1}
export PYTHONUNBUFFERED=1

# ------------------------------------------------------------------------------ checks
if [ -d "$MODEL" ]; then
  MODEL=$(cd "$MODEL" && pwd)
  [ -f "$MODEL/config.json" ] || die "$MODEL has no config.json"
  # A local model needs no Hugging Face hub; the GPU machines have no network, where hub
  # look-ups would only time out.
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
elif [[ "$MODEL" == */* && "$MODEL" != /* && "$MODEL" != .* ]]; then
  say "$MODEL is not a directory: treating it as a Hugging Face model id"
else
  die "model directory $MODEL not found"
fi

# GPUs visible to torch (honours CUDA_VISIBLE_DEVICES), vLLM version, plugin entry point.
probe=$("$PYTHON" - <<'PY' 2>&1
import importlib.metadata as md
try:
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
except Exception as e:  # noqa: BLE001
    gpus = 0
try:
    vllm_version = md.version("vllm")
except md.PackageNotFoundError:
    vllm_version = "missing"
plugin = any(e.name == "petit_moe" for e in md.entry_points(group="vllm.general_plugins"))
print(gpus, vllm_version, "yes" if plugin else "no")
PY
) || die "$PYTHON could not run: $probe"
read -r NUM_GPUS VLLM_VERSION PLUGIN <<< "$(tail -1 <<< "$probe")"
[ "$VLLM_VERSION" != missing ] || die "vLLM is not installed for $PYTHON (pip install \"vllm>=0.24,<0.34\")"
[ "$PLUGIN" = yes ] || die "vllm-petit-moe's vllm.general_plugins entry point is not visible to \
$PYTHON: install the plugin into the environment vllm runs from (activate it, then from the \
repo root: CUDA_HOME=/usr/local/cuda pip install --no-build-isolation -e .; see README.md, \
\"Install\"), or set PYTHON=<that environment's python>"
[ "$NUM_GPUS" -ge 1 ] || die "needs a CUDA GPU; found none visible to torch"
DP=${DP:-$NUM_GPUS}
[[ "$DP" =~ ^[0-9]+$ ]] && [ "$DP" -ge 1 ] || die "DP=$DP is not a positive number"
[ "$DP" -le "$NUM_GPUS" ] || die "DP=$DP but only $NUM_GPUS GPUs are visible"
EP_ARGS=()
[ "$DP" -ge 2 ] && EP_ARGS=(--enable-expert-parallel)  # one GPU: no expert parallel

# SO_REUSEADDR as uvicorn does: connections of an earlier run in TIME_WAIT do not block it.
if "$PYTHON" -c "import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('$HOST', $PORT))" 2>/dev/null; then :; else
  die "port $PORT on $HOST is in use (set PORT=...)"
fi

# `python -m vllm.entrypoints.cli.main`, not the `vllm` script: DP serving starts its
# coordinator with multiprocessing "spawn", which re-runs the parent's main file, and a
# `vllm` script without a __main__ guard (the devkit bundle's bin/vllm) then recurses into a
# second server start ("DP Coordinator process failed during startup"; 2x H200, 89805c0).
VLLM=("$PYTHON" -m vllm.entrypoints.cli.main)

cmd=("${VLLM[@]}" serve "$MODEL"
     --load-format "$LOAD_FORMAT"
     --data-parallel-size "$DP" "${EP_ARGS[@]}"
     --attention-backend "$ATTENTION_BACKEND"
     --host "$HOST" --port "$PORT")
# No tokenizer files in the model directory: serve token ids only.
has_tokenizer=0
for f in tokenizer.json tokenizer.model tokenizer_config.json vocab.json; do
  if [ -f "$MODEL/$f" ]; then has_tokenizer=1; fi
done
if [ -d "$MODEL" ] && [ "$has_tokenizer" = 0 ]; then
  cmd+=(--skip-tokenizer-init)
fi
cmd+=("${EXTRA_ARGS[@]}")

LOG=${LOG:-$(mktemp /tmp/petit-serve.XXXXXX.log)}
base="http://$HOST:$PORT"
[ "$HOST" = 0.0.0.0 ] && base="http://127.0.0.1:$PORT"

# ------------------------------------------------------------------------------ server
SERVER_PID=""
SERVER_PGID=""
stop_server() {
  [ -n "$SERVER_PGID" ] || return 0
  local pgid=$SERVER_PGID sig
  SERVER_PGID=""
  # The whole process group: API server, DP engine cores and their workers. SIGINT is
  # vLLM's clean shutdown; escalate if the group outlives it.
  for sig in INT TERM KILL; do
    kill -s "$sig" -- "-$pgid" 2>/dev/null || break
    for _ in $(seq 1 30); do
      kill -0 -- "-$pgid" 2>/dev/null || break 2
      sleep 1
    done
    say "server process group $pgid still alive after SIG$sig"
  done
  wait "$SERVER_PID" 2>/dev/null || true
  if kill -0 -- "-$pgid" 2>/dev/null; then
    say "WARNING: processes of group $pgid survived SIGKILL: $(pgrep -g "$pgid" 2>/dev/null | tr '\n' ' ')"
  else
    say "server stopped (process group $pgid gone)"
  fi
}
on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  stop_server
  [ -n "${LOG:-}" ] && say "server log: $LOG"
  exit $rc
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

say "model $MODEL, DP=$DP${EP_ARGS:+ x EP} on $NUM_GPUS GPUs, vLLM $VLLM_VERSION, VLLM_USE_PETIT_MOE=$VLLM_USE_PETIT_MOE"
say "\$ ${cmd[*]}"
t0=$(date +%s)
# Job control on for the launch only: bash puts the server into a process group of its own
# (pgid = its pid, set before it runs), so stopping the group reaches every vLLM process, and a
# Ctrl-C at the terminal reaches this script (which stops the server) rather than the server.
set -m
"${cmd[@]}" > "$LOG" 2>&1 < /dev/null &
SERVER_PID=$!
set +m
SERVER_PGID=$SERVER_PID

http() {  # http METHOD URL [JSON-BODY] -> prints "STATUS BODY"; never fails
  "$PYTHON" - "$@" <<'PY'
import sys, urllib.request, urllib.error
method, url = sys.argv[1], sys.argv[2]
data = sys.argv[3].encode() if len(sys.argv) > 3 else None
req = urllib.request.Request(url, data=data, method=method,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=300) as r:
        print(r.status, r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode())
except Exception as e:  # noqa: BLE001
    print(0, repr(e))
PY
}

say "waiting for $base/health (up to ${HEALTH_TIMEOUT}s; log: $LOG)"
while :; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    wait "$SERVER_PID" && rc=0 || rc=$?
    say "server exited during start-up (rc=$rc); last lines of $LOG:"
    grep -E '(Error|Exception)' "$LOG" | grep -v ulimit | head -3 | cut -c1-400 || true
    tail -40 "$LOG" | cut -c1-300
    exit 1
  fi
  status=$(http GET "$base/health" | cut -d' ' -f1)
  [ "$status" = 200 ] && break
  if [ $(( $(date +%s) - t0 )) -ge "$HEALTH_TIMEOUT" ]; then
    say "not healthy after ${HEALTH_TIMEOUT}s; last lines of $LOG:"
    tail -40 "$LOG" | cut -c1-300
    exit 1
  fi
  sleep 3
done
say "healthy after $(( $(date +%s) - t0 ))s"

report_backend() {
  echo "---------------- petit backend (from the server log) ----------------"
  grep -hE 'vllm-petit-moe: (VLLM_USE_PETIT_MOE=1 \(|installed, not enabled)' "$LOG" \
    | head -1 | cut -c1-300 || true
  grep -E 'vllm-petit-moe: EpBuffer rank' "$LOG" | cut -c1-300 || true
  local used fallback notused
  used=$(grep -cE 'vllm-petit-moe: MoE layers use (PetitPrepareAndFinalize|PetitSingleGpuExperts)' "$LOG" || true)
  fallback=$(grep -cE 'vllm-petit-moe: VLLM_USE_PETIT_MOE=1 but unsupported here' "$LOG" || true)
  notused=$(grep -cE 'vllm-petit-moe: not used for these MoE layers' "$LOG" || true)
  grep -E 'vllm-petit-moe: (MoE layers use Petit(PrepareAndFinalize|SingleGpuExperts)|VLLM_USE_PETIT_MOE=1 but unsupported here|not used for these MoE layers)' \
    "$LOG" | cut -c1-400 || true
  if [[ "${VLLM_USE_PETIT_MOE,,}" =~ ^(0|false|no|off)$ ]]; then
    echo "petit: flag off (baseline run on vLLM's own all-to-all)"
    return 0
  elif [ "$used" -gt 0 ] && [ "$fallback" -eq 0 ] && [ "$notused" -eq 0 ]; then
    echo "petit: ACTIVE ($used process(es) report petit's MoE path; expect one per DP rank: $DP)"
    return 0
  elif [ "$used" -gt 0 ]; then
    echo "petit: PARTIAL (some MoE layers kept vLLM's path, see above)"
  elif [ "$fallback" -gt 0 ] || [ "$notused" -gt 0 ]; then
    echo "petit: NOT USED (the MoE layers kept vLLM's path, see above)"
  else
    echo "petit: no decision logged (plugin not loaded, or no MoE layer was built)"
  fi
  return 3
}

if [ "$SERVE_ONLY" = 1 ]; then
  backend_rc=0
  report_backend || backend_rc=$?
  say "serving $MODEL on http://$HOST:$PORT (OpenAI API; Ctrl-C stops it); server log follows"
  tail -n 0 -f --pid="$SERVER_PID" "$LOG" &
  wait "$SERVER_PID" && rc=0 || rc=$?
  say "server exited (rc=$rc)"
  exit 1
fi

# ------------------------------------------------------------------------------ request
models=$(http GET "$base/v1/models")
served_name=$("$PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1].split(" ",1)[1])["data"][0]["id"])' "$models") \
  || { say "GET /v1/models failed: $models"; exit 1; }
prompt_json="[[$(tr -s ' ' <<< "$PROMPT_IDS" | sed 's/^ //; s/ $//; s/ /, /g')]]"
body=$(printf '{"model": "%s", "prompt": %s, "max_tokens": %d, "temperature": 0.0, "ignore_eos": true, "return_token_ids": true}' \
       "$served_name" "$prompt_json" "$MAX_TOKENS")
say "POST /v1/completions $body"
t1=$(date +%s.%N)
resp=$(http POST "$base/v1/completions" "$body")
t2=$(date +%s.%N)
request_ok=0
"$PYTHON" - "$resp" "$MAX_TOKENS" "$t1" "$t2" <<'PY' || request_ok=$?
import json, sys
status, _, text = sys.argv[1].partition(" ")
max_tokens, seconds = int(sys.argv[2]), float(sys.argv[4]) - float(sys.argv[3])
if status != "200":
    print(f"request failed: HTTP {status}: {text[:2000]}")
    sys.exit(1)
resp = json.loads(text)
ok = True
for ch in resp["choices"]:
    ids = ch.get("token_ids") or []
    print(f"choice {ch['index']}: finish={ch.get('finish_reason')} prompt_token_ids="
          f"{ch.get('prompt_token_ids')}\n  generated token_ids={ids}\n  text={ch.get('text')!r}")
    ok &= len(ids) == max_tokens
print(f"usage {resp.get('usage')}; HTTP 200 in {seconds:.3f}s")
if not ok:
    print(f"expected {max_tokens} generated tokens per choice")
sys.exit(0 if ok else 1)
PY
backend_rc=0
report_backend || backend_rc=$?
if [ "$request_ok" -ne 0 ]; then
  say "FAIL: the completion request failed"
  exit 1
fi
if [ "$backend_rc" -ne 0 ]; then
  say "served, but petit was not used (exit 3)"
  exit 3
fi
say "PASS"
