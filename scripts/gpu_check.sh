#!/usr/bin/env bash
# The GPU checks in one prepared run, for a machine with a CUDA GPU and only torch, triton,
# numpy and pytest (pytest-xdist and pytest-timeout used when present): the Triton kernel tests
# on CUDA, then `hack bench attention --device cuda`. Everything lands in OUT_DIR (default
# ./gpu-check), written as it happens, so a run stopped at a time limit keeps what it did:
#   tests.log     one line per test (PASSED/FAILED), then pytest's summary and slowest tests
#   failures.log  each failure's traceback, appended the moment it fails
#   attention-cuda.json / bench.log   the benchmark (the JSON is rewritten after every cell;
#                 render it here with `hack bench attention --device cuda --from-json FILE`)
# Usage: scripts/gpu_check.sh [OUT_DIR] [TEST_SECONDS] [BENCH_SECONDS] [extra bench args...]
set -u
out=${1:-gpu-check}; test_s=${2:-420}; bench_s=${3:-300}; shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HACK_KERNEL_DEVICE=cuda HACK_FAILURE_LOG="$out/failures.log"
# One torch thread per test worker: the CPU references of the real-shape tests otherwise start
# cores x workers threads and the run crawls.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "scripts/gpu_check.sh needs a CUDA GPU that torch sees; here it sees none (the kernel tests run in" \
       "Triton's interpreter by \`make test\` instead)" >&2
  exit 2
fi
: >"$out/failures.log"
nvidia-smi -L 2>&1 | tee "$out/device.txt"
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$out/device.txt"
workers=()
if "$py" -c "import xdist" 2>/dev/null; then
  n=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 )); workers=(-n "$n")
fi
has_timeout=0
"$py" -c "import pytest_timeout" 2>/dev/null && has_timeout=1
tests=(tests/test_triton_decode.py tests/test_triton_prefill.py tests/test_triton_store.py
       "tests/test_triton_aot.py::test_launches_run_on_the_gpu_with_the_aot_registers")
start=$SECONDS
# The cases marked cuda (real shapes, driver registers) first: they are what only a GPU shows.
for pass in cuda "not cuda"; do
  left=$(( test_s - (SECONDS - start) ))
  (( left > 10 )) || { echo "no time left for the tests marked '$pass'" >>"$out/tests.log"; continue; }
  echo "=== tests marked '$pass' (${left}s) ===" >>"$out/tests.log"
  per_test=()
  (( has_timeout )) && per_test=(--timeout "$left")
  timeout "$left" "$py" -m pytest "${tests[@]}" -m "$pass" -v -p no:cacheprovider -p no:benchmark "${workers[@]}" \
    "${per_test[@]}" -rfE --tb=short --durations=15 >>"$out/tests.log" 2>&1
  echo "kernel tests marked '$pass': exit $? (124: stopped at its time limit)" | tee -a "$out/device.txt"
done
echo "kernel tests: $(grep -c ' PASSED' "$out/tests.log") passed, $(grep -c ' FAILED' "$out/tests.log") failed" \
  | tee -a "$out/device.txt"
timeout "$bench_s" "$py" -m hack_cli.bench_attention_gpu --out "$out/attention-cuda.json" "$@" >"$out/bench.log" 2>&1
echo "benchmark: exit $? (124: stopped at ${bench_s}s)" | tee -a "$out/device.txt"
