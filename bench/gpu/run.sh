#!/usr/bin/env bash
# The GPU checks of the kernels issue, on one CUDA machine (its own python3 with torch, triton, transformers,
# pytest): the kernel tests on CUDA, then the benchmarks of bench/gpu/kernels.py. ~4 minutes on an H200, at most 7.8
# (TESTS_LIMIT_S + BENCH_LIMIT_S; the benchmarks write their JSON after every part, so a limit loses only the part it
# cut). Extra arguments go to kernels.py (e.g. --only model).
#   OUT=/some/dir bash bench/gpu/run.sh      (default OUT: bench/results/gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
timing=(); python3 -c "import pytest_timeout" 2>/dev/null && timing=(--timeout 60)  # a hung test costs 60 s, not all
# -m: the slow tests too (slow in the CPU interpreter, not on a GPU)
timeout "${TESTS_LIMIT_S:-150}" python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" "${timing[@]}" \
    tests/test_triton_kernels.py tests/test_triton_elementwise.py tests/test_layer_copies.py \
    tests/test_strided_copy.py tests/test_decode_graphs.py tests/test_kernels.py tests/test_sampling.py \
    tests/test_fp8_weights.py tests/test_sparse_attention.py tests/test_memory.py \
    2>&1 | tail -40 | tee "$OUT/tests.log"
echo "tests: ${SECONDS} s"
timeout "${BENCH_LIMIT_S:-320}" python3 bench/gpu/kernels.py --out "$OUT/gpu_kernels.json" "$@" 2>&1 | tail -60 \
    | tee "$OUT/bench.log"
echo "run.sh: ${SECONDS} s in all" | tee -a "$OUT/bench.log"
