#!/usr/bin/env bash
# The GPU checks of the kernels issue, on one CUDA machine (its own python3 with torch, triton, transformers,
# pytest): the kernel tests on CUDA (4 pytest-xdist workers where it is there), the benchmarks of
# bench/gpu/kernels.py, then the FP8 GEMM tile sweep of bench/gpu/fp8_tiles.py. ~5 minutes on an H200 (tests 90 s,
# benchmarks 170 s), at most 8 (TESTS_LIMIT_S + BENCH_LIMIT_S + TILES_LIMIT_S; the benchmarks write their JSON after
# every part, so a limit loses only the part it cut). A limit of 0 skips that step; TESTS names other test files.
# Extra arguments go to kernels.py (e.g. --only model).
#   OUT=/some/dir bash bench/gpu/run.sh      (default OUT: bench/results/gpu)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=bench/gpu/setup_device.sh
source bench/gpu/setup_device.sh  # the project installed (and serve's dependencies, where .wheels/ came along)
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
timing=(); python3 -c "import pytest_timeout" 2>/dev/null && timing=(--timeout 60)  # a hung test costs 60 s, not all
# four workers, tests dealt one by one (by file, two files left one worker with most of the work): most of a kernel
# test's time is Triton compiling its shapes on the CPU
python3 -c "import xdist" 2>/dev/null && timing+=(-n 4 --dist load)
# -m: the slow tests too (slow in the CPU interpreter, not on a GPU)
TESTS=${TESTS:-tests/kernels/test_triton_kernels.py tests/kernels/test_triton_elementwise.py tests/engines/test_layer_copies.py
    tests/traffic/test_strided_copy.py tests/engines/test_decode_graphs.py tests/kernels/test_kernels.py tests/engines/test_sampling.py
    tests/engines/test_fp8_weights.py tests/kernels/test_sparse_attention.py tests/engines/test_memory.py}
# shellcheck disable=SC2086 # TESTS is a list of files
timeout "${TESTS_LIMIT_S:-150}" python3 -m pytest -p no:cacheprovider -m "slow or not slow" "${timing[@]}" $TESTS \
    -v -rfE --durations=15 2>&1 | tee "$OUT/tests.log" | grep -v ' PASSED \| SKIPPED \|PASSED$\|SKIPPED$'
# the whole log is kept: a limit that cuts pytest loses its summary, and the per-test lines say how far it got
echo "tests: ${SECONDS} s"
[ "${BENCH_LIMIT_S:-240}" = 0 ] || timeout "${BENCH_LIMIT_S:-240}" python3 bench/gpu/kernels.py \
    --out "$OUT/gpu_kernels.json" "$@" 2>&1 | tee "$OUT/bench.log"
[ "${TILES_LIMIT_S:-90}" = 0 ] || timeout "${TILES_LIMIT_S:-90}" python3 bench/gpu/fp8_tiles.py \
    --out "$OUT/fp8_tiles.json" 2>&1 | tee "$OUT/fp8_tiles.log"
echo "run.sh: ${SECONDS} s in all" | tee -a "$OUT/bench.log"
