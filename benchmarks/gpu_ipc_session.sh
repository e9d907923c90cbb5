#!/usr/bin/env bash
# One batch of single-GPU work for weightwire_ipc (issue 19): probe, deps, GPU tests, benchmark.
#   OUT=/path bash benchmarks/gpu_ipc_session.sh [probe deps ipc_tests all_gpu bench]
# Each step runs under `timeout`, logs to $OUT/<step>.log, appends its exit code to $OUT/summary.txt.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-ipc-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-$(command -v python3)}"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name exit=$rc after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
for s in "${@:-probe deps ipc_tests bench}"; do for s1 in $s; do case $s1 in
  probe) step probe 60 "$PY" -c "
import cupy, torch, jax; r = cupy.cuda.runtime
print('cupy', cupy.__version__, 'torch', torch.__version__, 'jax', jax.__version__, jax.devices())
print([n for n in dir(r) if 'ipc' in n.lower() or n.startswith('event')])
print('uuid', r.getDeviceProperties(0).get('uuid'))" ;;
  deps) step deps 120 bash -c "'$PY' -m pip install -q --no-index --no-deps --target /tmp/ww-deps .whl/gpu/*.whl && echo installed" ;;
  ipc_tests) step ipc_tests "${IPC_LIMIT:-330}" env PYTHONPATH="$PYTHONPATH:/tmp/ww-deps" "$PY" -m pytest -q -m gpu -s -p no:cacheprovider -o addopts="" tests/gpu/test_ipc_gpu.py ;;
  all_gpu) step all_gpu "${ALL_LIMIT:-300}" env PYTHONPATH="$PYTHONPATH:/tmp/ww-deps" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider -o addopts="" tests ;;
  some_ipc) step some_ipc "${IPC_LIMIT:-200}" env PYTHONPATH="$PYTHONPATH:/tmp/ww-deps" "$PY" -m pytest -q -m gpu -s -p no:cacheprovider -o addopts="" tests/gpu/test_ipc_gpu.py -k "${IPC_K:-killed or one_slot}" ;;
  demo) step demo "${DEMO_LIMIT:-150}" env PYTHONPATH="$PYTHONPATH:/tmp/ww-deps" "$PY" -c "import sys; from weightwire.tools.cli import main; sys.exit(main(['demo', '--colocated', '--steps', '${DEMO_STEPS:-6}']))" ;;
  bench_host) TAIL=30 step bench_host "${BENCH_LIMIT:-240}" env WEIGHTWIRE_IPC_WAIT=host PYTHONPATH="$PYTHONPATH:/tmp/ww-deps:$PWD/benchmarks" "$PY" benchmarks/bench_ipc.py --out "$OUT/bench_ipc_host.md" --deadline-s "${BENCH_DEADLINE:-200}" ${BENCH_ARGS:-} ;;
  bench) TAIL=40 step bench "${BENCH_LIMIT:-240}" env PYTHONPATH="$PYTHONPATH:/tmp/ww-deps:$PWD/benchmarks" "$PY" benchmarks/bench_ipc.py --out "$OUT/bench_ipc.md" --deadline-s "${BENCH_DEADLINE:-200}" ${BENCH_ARGS:-} ;;
esac; done; done
