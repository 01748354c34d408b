#!/usr/bin/env bash
# The GPU checks in one prepared run, for a machine with a CUDA GPU, nvcc, and only torch, triton,
# numpy and pytest (pytest-xdist and pytest-timeout used when present). Everything lands in OUT_DIR
# (default ./gpu-check), written as it happens, so a run stopped at a time limit keeps what it did.
# In order, each phase within its own limit and all within TOTAL_SECONDS (default 480: 8 minutes;
# a phase that would start with under 20 s left is skipped and says so):
#   1. build   the CUDA decode and store kernels' libraries for this GPU, in parallel (120 s) -> run.log
#   2. tests   tests/test_cuda_decode.py, tests/test_cuda_store.py (the cases marked cuda first), the
#              static checks, and sparse decode's device tests (marked device) (150 s)                                           -> tests.log, failures.log
#  2b. prefill python -m hack_cli.bench_prefill_cuda: the prefill `--hack-prefill auto` runs (CUDA store,
#              then flash attention) and each store alone against BF16 flash prefill (60 s)
#                                                                              -> prefill-cuda.json, run.log
#   3. bench   python -m hack_cli.bench_decode_cuda: per cell the CUDA kernel, its fragment-order
#              and 3-page-ring variants, the Triton kernel and BF16, and sparse decode at a 2K budget (the device selection,
#              then both kernels over its per-head tables; HACK_GPU_SPARSE_BUDGETS, "" for none) (150 s)
#                                                            -> decode-cuda.json (after every cell), run.log
#  3b. splits  only with HACK_GPU_SPLITS_SECONDS > 0: the split-count sweep        -> splits.json
#   4. model   python -m hack_cli.bench_decode_model: Llama-3-8B shapes at 32K, tokens/s of BF16 and
#              HACK KV at equal KV memory (120 s)                            -> decode-model.json, run.log
#   5. ncu     one launch of the kernel at batch 32 (HACK_GPU_NCU_BATCH) x 32K, `ncu --set full` (60 s, when ncu is here)
#                                                                                      -> ncu.txt
#   6. triton  only with HACK_GPU_CHECK_TRITON=1, outside the total: the Triton kernel tests
#              (cuda-marked first) and `hack bench attention --device cuda`
#                                                                 -> tests.log, attention-cuda.json, run.log
# device.txt collects the GPU, the versions and every phase's exit status (8 files at most in all).
# Phase limits: HACK_GPU_{BUILD,TEST,PREFILL,BENCH,MODEL,NCU}_SECONDS (0 skips a phase);
# HACK_GPU_CPU_TESTS=0 leaves out the test pass CI also runs (the tests not marked cuda).
# Back on a machine without a GPU: python -m hack_cli.bench_decode_cuda --from-json OUT_DIR/decode-cuda.json
# writes docs/bench/decode-cuda.json and the table in docs/kernels.md; likewise
# python -m hack_cli.bench_prefill_cuda --from-json OUT_DIR/prefill-cuda.json.
# Usage: scripts/gpu_check.sh [OUT_DIR] [TOTAL_SECONDS] [extra bench_decode_cuda args...]
set -u
out=${1:-gpu-check}; total=${2:-480}; shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HACK_KERNEL_DEVICE=cuda HACK_FAILURE_LOG="$out/failures.log"
# One torch thread per test worker: the CPU references of the real-shape tests otherwise start
# cores x workers threads and the run crawls.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "scripts/gpu_check.sh needs a CUDA GPU that torch sees; here it sees none (the CPU checks run in" \
       "\`make test\` instead)" >&2
  exit 2
fi
: >"$out/failures.log"
nvidia-smi -L 2>&1 | tee "$out/device.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$out/device.txt"
(nvcc --version 2>&1 | tail -1) | tee -a "$out/device.txt"
workers=()
if "$py" -c "import xdist" 2>/dev/null; then
  cores=$(nproc --all)  # not plain nproc: it answers OMP_NUM_THREADS, set to 1 above
  n=$(( cores > 2 ? cores - 2 : 1 )); workers=(-n "$n")
fi
has_timeout=0
"$py" -c "import pytest_timeout" 2>/dev/null && has_timeout=1
start=$SECONDS

# limit PHASE SECONDS: the phase's own limit or what the total leaves, whichever is less (0: skip).
limit() {
  local left=$(( total - (SECONDS - start) )) want=$2
  (( want > left )) && want=$left
  if (( want < 20 )); then echo "$1: skipped, ${left}s of the ${total}s total left" | tee -a "$out/device.txt"; echo 0
  else echo "$want"; fi
}

# phase NAME SECONDS CMD...: CMD within the phase's limit (0 skips it), its output appended to
# run.log, its exit status to device.txt.
phase() {
  local name=$1 s
  s=$(limit "$name" "$2" | tail -1)
  shift 2
  (( s > 0 )) || return 0
  echo "=== $name: ${*:2} ===" >>"$out/run.log"
  timeout "$s" "$@" >>"$out/run.log" 2>&1
  echo "$name: exit $? (124: stopped at ${s}s)" | tee -a "$out/device.txt"
}

# 1. build: every variant the tests and the benchmarks load, for this GPU, before anything times it.
s=$(limit build "${HACK_GPU_BUILD_SECONDS:-120}" | tail -1)
if (( s > 0 )); then
  timeout "$s" "$py" -m hack_ops.cuda.build --head-dims 64,128,256 --dtypes bf16,fp16 --orders token,fragment \
    --caps 0,1 >"$out/run.log" 2>&1
  echo "build: exit $? ($(( SECONDS - start ))s; 124: stopped at ${s}s)" | tee -a "$out/device.txt"
  # the 3-page ring the decode benchmark times beside the served 2-page one
  timeout "$s" "$py" -m hack_ops.cuda.build --head-dims 128 --dtypes bf16 --orders token --caps 0 --stages 3 \
    >>"$out/run.log" 2>&1
  echo "build (3 stages): exit $? ($(( SECONDS - start ))s)" | tee -a "$out/device.txt"
fi

# 2. tests: the CUDA kernel on the GPU (cuda-marked first: what only a GPU shows), then the rest of
# its files (they also run in CI, without a GPU).
# Beside them the tests marked device (sparse decode's selection and the Triton kernel over its per-head
# tables), which run on the GPU here and under Triton's interpreter in CI.
tests=(tests/test_cuda_decode.py tests/test_cuda_store.py tests/test_cuda_static.py tests/test_sparse_device.py
       tests/test_triton_decode.py::test_per_head_page_tables)
s=$(limit tests "${HACK_GPU_TEST_SECONDS:-150}" | tail -1)
t0=$SECONDS
passes=("cuda or device")
[[ "${HACK_GPU_CPU_TESTS:-1}" == 0 ]] || passes+=("not cuda and not device")
for pass in "${passes[@]}"; do
  (( s > 0 )) || break
  left=$(( s - (SECONDS - t0) ))
  (( left > 10 )) || { echo "no time left for the tests marked '$pass'" >>"$out/tests.log"; continue; }
  echo "=== tests marked '$pass' (${left}s) ===" >>"$out/tests.log"
  per_test=()
  (( has_timeout )) && per_test=(--timeout "$left")
  timeout "$left" "$py" -m pytest "${tests[@]}" -m "$pass" -v -p no:cacheprovider -p no:benchmark "${workers[@]}" \
    "${per_test[@]}" -rfE --tb=short --durations=10 >>"$out/tests.log" 2>&1
  echo "CUDA kernel tests marked '$pass': exit $? (124: stopped at its time limit)" | tee -a "$out/device.txt"
done
echo "CUDA kernel tests: $(grep -c ' PASSED' "$out/tests.log" 2>/dev/null) passed," \
     "$(grep -c ' FAILED' "$out/tests.log" 2>/dev/null) failed" | tee -a "$out/device.txt"

# 2b. prefill: the GPU prefill `auto` picks, with the CUDA store, against BF16 (and the Triton store).
phase prefill "${HACK_GPU_PREFILL_SECONDS:-60}" "$py" -m hack_cli.bench_prefill_cuda --out "$out/prefill-cuda.json"

# 3. bench: the decode grid against BF16, the JSON rewritten after every cell.
sparse=${HACK_GPU_SPARSE_BUDGETS-2048}
phase bench "${HACK_GPU_BENCH_SECONDS:-150}" "$py" -m hack_cli.bench_decode_cuda --out "$out/decode-cuda.json" \
  ${sparse:+--sparse-budgets "$sparse"} "$@"

# 3b. splits, only with HACK_GPU_SPLITS_SECONDS > 0: the kernel at each split count against the
# count hack_ops.cuda.decode.choose_splits picks, per cell of the small-batch grid.
if (( ${HACK_GPU_SPLITS_SECONDS:-0} > 0 )); then
  phase splits "$HACK_GPU_SPLITS_SECONDS" "$py" -m hack_cli.bench_decode_cuda --out "$out/splits.json" \
    --batches 1,8,32 --contexts 8192,32768 --repeats 10 --sweep-splits 1,2,3,4,6,8,12,16,24,32,48,64
fi

# 4. model: tokens/s at equal KV memory (HACK's batch against BF16's), Llama-3-8B shapes at 32K.
phase model "${HACK_GPU_MODEL_SECONDS:-120}" "$py" -m hack_cli.bench_decode_model --out "$out/decode-model.json"

# 5. ncu: what bounds one launch (memory or issue), when the tool is here.
s=$(limit ncu "${HACK_GPU_NCU_SECONDS:-60}" | tail -1)
if (( s > 0 )); then
  if command -v ncu >/dev/null 2>&1; then
    timeout "$s" ncu --target-processes all -k regex:hack_decode_kernel -c 1 --set full --page details --csv \
      "$py" -m hack_cli.bench_decode_cuda --shapes llama3-8b --batches "${HACK_GPU_NCU_BATCH:-32}" --contexts 32768 --repeats 1 \
      --out /tmp/hack-ncu-cell.json >"$out/ncu.txt" 2>&1
    echo "ncu: exit $? (124: stopped at ${s}s)" | tee -a "$out/device.txt"
  else
    echo "ncu: not installed, skipped" | tee -a "$out/device.txt"
  fi
fi
echo "total: $(( SECONDS - start ))s" | tee -a "$out/device.txt"

# 6. the Triton kernels, on request: their tests (cuda-marked first) and the attention benchmark.
if [[ "${HACK_GPU_CHECK_TRITON:-0}" == 1 ]]; then
  triton_tests=(tests/test_triton_decode.py tests/test_triton_prefill.py tests/test_triton_store.py
                "tests/test_triton_aot.py::test_launches_run_on_the_gpu_with_the_aot_registers")
  triton_s=${HACK_GPU_TRITON_TEST_SECONDS:-420}; t0=$SECONDS
  for pass in cuda "not cuda"; do
    left=$(( triton_s - (SECONDS - t0) ))
    (( left > 10 )) || { echo "no time left for the Triton tests marked '$pass'" >>"$out/tests.log"; continue; }
    echo "=== Triton tests marked '$pass' (${left}s) ===" >>"$out/tests.log"
    per_test=()
    (( has_timeout )) && per_test=(--timeout "$left")
    timeout "$left" "$py" -m pytest "${triton_tests[@]}" -m "$pass" -v -p no:cacheprovider -p no:benchmark \
      "${workers[@]}" "${per_test[@]}" -rfE --tb=short --durations=15 >>"$out/tests.log" 2>&1
    echo "Triton kernel tests marked '$pass': exit $? (124: stopped at its time limit)" | tee -a "$out/device.txt"
  done
  timeout "${HACK_GPU_TRITON_BENCH_SECONDS:-300}" "$py" -m hack_cli.bench_attention_gpu \
    --out "$out/attention-cuda.json" >>"$out/run.log" 2>&1
  echo "bench_attention_gpu: exit $? (124: stopped at its time limit)" | tee -a "$out/device.txt"
fi
