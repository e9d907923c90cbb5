#!/usr/bin/env bash
# One batch of single-GPU work: the lanes and benchmarks written without a GPU.
#   OUT=/path bash benchmarks/gpu_one.sh [deps tests strided fp8_torch fp8_jax ipc overlap ...]
#   (#49: overlap_tests overlap overlap_copy overlap_end; the round in one request against its
#   start apart, same tree, alternately: two_calls1 one_call1 two_calls2 one_call2)
# Each step runs under `timeout`, logs to $OUT/<step>.log, appends its exit code to $OUT/summary.txt.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/ww-deps:$PWD/benchmarks" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-$(command -v python3)}"
T0=$(date +%s); BUDGET="${BUDGET_S:-580}"
step() { local name=$1 limit=$2; shift 2; local t0 left; t0=$(date +%s)
  left=$(( BUDGET - (t0 - T0) )); [ "$left" -lt 15 ] && { echo "== $name skipped (budget)" | tee -a "$OUT/summary.txt"; return; }
  [ "$limit" -gt "$left" ] && limit=$left
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name exit=$rc after $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"; tail -n "${TAIL:-15}" "$OUT/$name.log"; }
PYT=("$PY" -m pytest -q -m gpu -rs -p no:cacheprovider -o addopts="")
for s in "$@"; do case $s in
  deps) step deps 60 bash -c "'$PY' -m pip install -q --no-index --no-deps --target /tmp/ww-deps .whl/gpu/*.whl && nvidia-smi -L" ;;
  tests) step tests 200 "${PYT[@]}" tests/gpu/test_ipc_strided_batch_gpu.py tests/trainer/test_fp8_quant.py tests/gpu/test_ipc_write_through_gpu.py ;;
  mid) step mid 200 "${PYT[@]}" tests/gpu/test_fp8_kernel_gpu.py tests/trainer/test_fp8_quant.py tests/gpu/test_ipc_strided_batch_gpu.py tests/gpu/test_vllm_stub_ipc_gpu.py ;;
  fp8q) step fp8q 90 bash -c "'$PY' benchmarks/bench_fp8.py --engine torch --backends weightwire_ipc --quantize-only --reps 5 && '$PY' benchmarks/bench_fp8.py --engine jax --backends weightwire_ipc --quantize-only --reps 5" ;;
  fp8kvar) step fp8kvar 90 "$PY" benchmarks/bench_fp8_kernel.py --reps 5 ;;
  fp8qt) step fp8qt 60 "$PY" benchmarks/bench_fp8.py --engine torch --backends weightwire_ipc --quantize-only --reps 5 ;;
  ipc_before) [ -d _before ] && step ipc_before 120 env PYTHONPATH="$PWD/_before:/tmp/ww-deps:$PWD/_before/benchmarks" "$PY" _before/benchmarks/bench_ipc.py --modes default --rounds 5 --deadline-s 110 --out "$OUT/ipc_before.md" ;;
  gpu_v) step gpu_v "${ALL_LIMIT:-300}" "${PYT[@]}" -v --durations=20 tests/gpu/test_ipc_write_through_gpu.py tests/gpu/test_ipc_strided_batch_gpu.py tests/gpu/test_fp8_kernel_gpu.py tests/trainer/test_fp8_quant.py tests/trainer/test_overlap_torch.py tests/trainer/test_overlap_cow.py tests/gpu/test_delta_gpu.py tests/gpu/test_delta_cuda_gpu.py tests/torch_side/test_fused_patch.py tests/gpu/test_ipc_gather_gpu.py tests/gpu/test_ipc_gpu.py tests/gpu/test_vllm_stub_ipc_gpu.py tests ;;
  all_gpu) step all_gpu "${ALL_LIMIT:-300}" "${PYT[@]}" tests ;;
  delta_tests) step delta_tests 200 "${PYT[@]}" -v tests/gpu/test_delta_cuda_gpu.py tests/gpu/test_delta_gpu.py ;;
  strided) step strided 60 bash -c "'$PY' benchmarks/bench_strided.py --model qwen2-0.5b --reps 10 && '$PY' benchmarks/bench_strided.py --model llama3-8b --reps 5" ;;
  fp8_torch) step fp8_torch 100 "$PY" benchmarks/bench_fp8.py --engine torch --backends weightwire_ipc --rounds 2 --reps 3 --out "$OUT/fp8_torch.md" ;;
  fp8_jax) step fp8_jax 100 "$PY" benchmarks/bench_fp8.py --engine jax --backends weightwire_ipc --rounds 2 --reps 3 --out "$OUT/fp8_jax.md" ;;
  ipc) step ipc 170 "$PY" benchmarks/bench_ipc.py --modes default --rounds 5 --deadline-s 160 --out "$OUT/ipc.md" ;;
  ipc_batch) step ipc_batch 120 env WEIGHTWIRE_IPC_STRIDED_BATCH=1 "$PY" benchmarks/bench_ipc.py --modes default --rounds 5 --deadline-s 110 --out "$OUT/ipc_batch.md" ;;
  overlap) step overlap 120 "$PY" benchmarks/bench_overlap.py --device cuda --engines torch-cow --steps 5 --deadline-s 100 --out "$OUT/overlap.md" ;;
  overlap_copy) step overlap_copy 120 "$PY" benchmarks/bench_overlap.py --device cuda --engines torch --steps 5 --deadline-s 100 --out "$OUT/overlap_copy.md" ;;
  overlap_end) step overlap_end 120 "$PY" benchmarks/bench_overlap.py --device cuda --engines torch-cow --steps 5 --write-at end --deadline-s 100 --out "$OUT/overlap_end.md" ;;
  overlap_tests) step overlap_tests 240 "${PYT[@]}" tests/trainer/test_overlap_torch.py tests/trainer/test_overlap_cow.py tests/gpu/test_ipc_gpu.py -k overlap ;;
  delta) step delta 120 "$PY" benchmarks/bench_delta_round.py --backends weightwire_ipc --rounds 2 --out "$OUT/delta_round.md" ;;
  ipc_trace) step ipc_trace 200 bash -c "mkdir -p '$OUT/tr' && WEIGHTWIRE_IPC_TRACE='$OUT/tr/x' '$PY' benchmarks/bench_ipc.py --modes default --rounds 10 --deadline-s 180 --out '$OUT/ipc_trace.md' && '$PY' benchmarks/ipc_timeline.py '$OUT/tr/x'" ;;
  trace05) step trace05 150 bash -c "mkdir -p '$OUT/t5' && WEIGHTWIRE_IPC_TRACE='$OUT/t5/x' '$PY' benchmarks/bench_ipc.py --modes default --models qwen2-0.5b --rounds 20 --deadline-s 140 --out '$OUT/trace05.md' && '$PY' benchmarks/ipc_timeline.py '$OUT/t5/x'" ;;
  gpu_rest) step gpu_rest "${ALL_LIMIT:-300}" "${PYT[@]}" tests/gpu/test_logits_gpu.py tests/gpu/test_sliced_nccl_gpu.py tests/gpu/test_transport_nccl_gpu.py tests/gpu/test_vllm_stub_ipc_gpu.py tests/jax_side tests/server tests/torch_side tests/trainer ;;
  ab_req*) step "$s" 100 "$PY" benchmarks/bench_ipc.py --modes default --models qwen2-0.5b --rounds 60 --ab-request --deadline-s 90 --out "$OUT/$s.md" ;;
  ab8*) step "$s" 120 "$PY" benchmarks/bench_ipc.py --modes default --models llama3-8b --rounds 20 --ab-request --deadline-s 110 --out "$OUT/$s.md" ;;
  q05now*) step "$s" 90 "$PY" benchmarks/bench_ipc.py --modes default --models qwen2-0.5b --rounds 30 --deadline-s 80 --out "$OUT/$s.md" ;;
  q05before*) [ -d _before ] && step "$s" 90 env PYTHONPATH="$PWD/_before:/tmp/ww-deps:$PWD/_before/benchmarks" "$PY" _before/benchmarks/bench_ipc.py --modes default --models qwen2-0.5b --rounds 30 --deadline-s 80 --out "$OUT/$s.md" ;;
  cowpull) step cowpull 150 "${PYT[@]}" -v tests/gpu/test_ipc_gpu.py -k overlapped ;;
  delta_probe) step delta_probe 150 "$PY" benchmarks/bench_delta_round.py --backends weightwire_ipc --rounds 2 --probe --out "$OUT/delta_probe.md" ;;
  wt_tests) step wt_tests 420 "${PYT[@]}" tests/gpu/test_ipc_write_through_gpu.py tests/gpu/test_ipc_gpu.py tests/gpu/test_vllm_stub_ipc_gpu.py tests/gpu/test_ipc_gather_gpu.py ;;
  ab_now*) step "$s" 80 bash -c "rm -rf /tmp/$s && mkdir -p /tmp/$s && WEIGHTWIRE_IPC_TRACE=/tmp/$s/x '$PY' benchmarks/bench_ipc.py --modes default --rounds 10 --deadline-s 75 --out /tmp/$s.md && '$PY' benchmarks/ipc_timeline.py /tmp/$s/x" ;;
  ab_before*) [ -d _before ] && step "$s" 80 bash -c "rm -rf /tmp/$s && mkdir -p /tmp/$s && cd _before && WEIGHTWIRE_IPC_TRACE=/tmp/$s/x PYTHONPATH=\$PWD:/tmp/ww-deps:\$PWD/benchmarks '$PY' benchmarks/bench_ipc.py --modes default --rounds 10 --deadline-s 75 --out /tmp/$s.md && '$PY' benchmarks/ipc_timeline.py /tmp/$s/x" ;;
  one_call*) step "$s" 150 "$PY" benchmarks/bench_ipc.py --modes default --engines jax --models qwen2-0.5b,llama3-8b --rounds 10 --deadline-s 140 --out "/tmp/$s.md" ;;
  two_calls*) step "$s" 150 "$PY" benchmarks/bench_ipc.py --modes default --engines jax --models qwen2-0.5b,llama3-8b --rounds 10 --deadline-s 140 --two-calls --out "/tmp/$s.md" ;;
  rest) step rest "${ALL_LIMIT:-120}" "${PYT[@]}" -v tests/gpu/test_vllm_stub_ipc_gpu.py tests/gpu/test_ipc_gather_gpu.py ;;
  delta6) step delta6 100 "$PY" benchmarks/bench_delta_round.py --backends weightwire_ipc --rounds 6 --out /tmp/delta6.md ;;
  patch) step patch 80 "$PY" benchmarks/bench_patch_apply.py --repeats 3 ;;
esac; done
echo "== total $(( $(date +%s) - T0 ))s"
