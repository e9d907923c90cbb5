#!/usr/bin/env bash
# One batch of GPU work on a 2-GPU host (NCCL tests, then the benchmarks), run from
# the repository root or anywhere:
#
#   OUT=/path/to/out bash benchmarks/gpu_session.sh [all | env tests comm sync others ...]
#
# all = deps env tests comm sync (tests/gpu only); `others` runs the repository's other
# @pytest.mark.gpu tests (engines, worker); `pack` runs bench_pack.py. `deps` installs
# the wheels in .whl/gpu (fastapi, uvicorn, ...: the GPU host lacks them; fetch with
# `pip download -d .whl/gpu --only-binary=:all: --python-version 3.12 fastapi uvicorn`)
# into a private target dir put on PYTHONPATH, so `sync` can time the HTTP control plane.
# uvloop and httptools are what a vLLM server runs (fastapi[standard]); uvicorn picks them up.
# SYNC_ARGS adds arguments to weightwire.tools.bench.sync (e.g. "--models llama3-8b --engines jax").
#
# Every step runs under `timeout`, logs to $OUT/<step>.log and appends its exit code
# to $OUT/summary.txt; a failing step never stops the next. The steps of one call
# share a wall-clock budget (BUDGET_S, default 580 s) so a call fits in a 10-minute
# command; to give every step its full limit, run `env tests comm`, then `sync`.
# Needs no installs: weightwire is put on PYTHONPATH, pytest-timeout is optional.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-session-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# NVLink multicast stays off on the shared H200 hosts (it can take the GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-$(command -v python3 || command -v python)}"
BUDGET_S="${BUDGET_S:-580}"
START_S=$(date +%s)

# Seconds a step may use: its own limit, capped by what is left of the session budget.
limit_for() {
  local want=$1 left
  left=$(( BUDGET_S - ($(date +%s) - START_S) - 5 ))
  [ "$left" -lt "$want" ] && want=$left
  [ "$want" -lt 10 ] && want=10
  echo "$want"
}

run_step() {  # run_step NAME LIMIT_S CMD...
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
  timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name exit=$rc after $(( $(date +%s) - t0 ))s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')" | tee -a "$OUT/summary.txt"
  tail -n 40 "$OUT/$name.log"
  return 0
}

step_env() {
  run_step env "$(limit_for 60)" bash -c "nvidia-smi; nvidia-smi topo -m; '$PY' - <<'EOF'
import importlib, sys
print('python', sys.version.split()[0])
for name in ('cupy', 'jax', 'torch', 'numpy', 'ml_dtypes', 'pytest', 'pytest_timeout'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', 'present'))
    except Exception as exc:
        print(name, 'MISSING', type(exc).__name__)
from weightwire.backends.nccl import comm as nccl
print('nccl_available', nccl.nccl_available(), 'version', nccl.nccl_version() if nccl.nccl_available() else '-')
import jax
print('jax devices', jax.devices())
EOF"
}

step_tests() {
  local extra=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout=900)
  # addopts is cleared: the project's default deselects gpu tests and needs pytest-timeout.
  run_step tests "$(limit_for 330)" "$PY" -m pytest -o addopts="" -p no:cacheprovider -m gpu -rA -q tests/gpu \
    --junitxml="$OUT/gpu-tests.xml" "${extra[@]}"
}

step_others() {  # the other GPU-marked tests of the repository (engines, worker)
  local extra=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout=900)
  run_step others "$(limit_for 560)" "$PY" -m pytest -o addopts="" -p no:cacheprovider -m gpu -rA -q tests \
    --ignore=tests/gpu --ignore=tests/interop --junitxml="$OUT/gpu-tests-others.xml" "${extra[@]}"
}

step_comm() {
  local limit
  limit=$(limit_for 150)
  run_step comm "$limit" "$PY" -m weightwire.tools.bench.comm --backend nccl --repeats 7 --json
  if ! grep -q '^{"nccl"' "$OUT/comm.log"; then  # weightwire.tools.bench.comm printed no result line: run ours directly
    run_step comm_direct "$(limit_for 150)" "$PY" -m weightwire.tools.bench.comm_nccl --repeats 7 --json "$OUT/bench_comm_nccl.json"
  fi
}

step_sync() {
  local limit
  limit=$(limit_for 560)
  # shellcheck disable=SC2086  # SYNC_ARGS is a list of arguments
  run_step sync "$limit" "$PY" -m weightwire.tools.bench.sync --out "$OUT/bench_sync.md" \
    --deadline-s $(( limit > 120 ? limit - 90 : 30 )) ${SYNC_ARGS:-}
}

step_pack() {
  run_step pack "$(limit_for 120)" "$PY" benchmarks/bench_pack.py --chunk-mib 1024
}

step_deps() {
  local target=/tmp/weightwire-gpu-deps
  if ! ls .whl/gpu/*.whl >/dev/null 2>&1; then
    echo "== deps: no wheels in .whl/gpu, skipped" | tee -a "$OUT/summary.txt"
    return 0
  fi
  # --no-deps and only what the host lacks: its own numpy/anyio/idna stay in charge.
  run_step deps "$(limit_for 120)" "$PY" -m pip install --quiet --no-index --no-deps --target "$target" \
    .whl/gpu/fastapi-*.whl .whl/gpu/starlette-*.whl .whl/gpu/pydantic-*.whl .whl/gpu/pydantic_core-*.whl \
    .whl/gpu/uvicorn-*.whl .whl/gpu/h11-*.whl .whl/gpu/annotated_types-*.whl .whl/gpu/annotated_doc-*.whl \
    .whl/gpu/typing_inspection-*.whl .whl/gpu/click-*.whl .whl/gpu/opentelemetry_api-*.whl \
    .whl/gpu/uvloop-*.whl .whl/gpu/httptools-*.whl
  export PYTHONPATH="$PYTHONPATH:$target"
}

MODE="${1:-all}"
if [ "$MODE" = all ]; then
  set -- deps env tests comm sync
fi
echo "gpu_session $(date -u +%FT%TZ) steps: $* (python: $PY)" | tee -a "$OUT/summary.txt"
for step in "$@"; do
  case "$step" in
    deps | env | tests | comm | sync | others | pack) "step_$step" ;;
    *) echo "unknown step $step (deps, env, tests, comm, sync, others, pack, all)" | tee -a "$OUT/summary.txt" ;;
  esac
done
cat "$OUT/summary.txt"
