#!/usr/bin/env bash
# The GPU checks of the kernels issue, on one CUDA machine (its own python3 with torch, triton, transformers,
# pytest): the kernel tests on CUDA, then the benchmarks of bench/gpu/kernels.py. About 5 minutes on an H200.
#   OUT=/some/dir bash bench/gpu/run.sh      (default OUT: bench/results/gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/versions.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_layer_copies.py \
    tests/test_decode_graphs.py tests/test_kernels.py 2>&1 | tail -40 | tee "$OUT/tests.log"
timeout 420 python3 bench/gpu/kernels.py --out "$OUT/gpu_kernels.json" 2>&1 | tail -60 | tee "$OUT/bench.log"
