#!/usr/bin/env bash
# The product on one GPU (issue 52, item 3), bench/gpu/serve_bench.py's two parts, each under a time limit:
#   serving  `dualpath serve --device cuda:0` (a prefill and a decode engine sharing the GPU) under a fixed-rate
#            open-loop load against the offline LLM on the same GPU: the 1.1B and the 8B-shape model
#            -> $OUT/gpu_serving.json
#   agentic  `dualpath bench agentic` on the same GPU, storage reads capped: Basic, DualPath, Oracle (the 1.1B)
#            -> $OUT/gpu_agentic.json (its figures and per-process logs in $WORK, kept with KEEP_WORK=1)
# ~4 minutes on an H200 (SERVING_LIMIT_S + AGENTIC_LIMIT_S at most; 0 skips a part). The JSON is written after each
# model, so a limit loses only what it cut. --smoke: both parts on CPU with tiny models (tests/docs/test_gpu_e2e.py).
# The image's missing dependencies come from .wheels/ (bench/gpu/wheelhouse.sh here; the device tool's carry).
#   OUT=/some/dir bash bench/gpu/serve.sh [--smoke]        (default OUT: bench/results/gpu/e2e)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
OUT=${OUT:-bench/results/gpu/e2e}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
smoke=()
[ "${1:-}" = --smoke ] && smoke=(--smoke)
# shellcheck source=bench/gpu/setup_device.sh
source bench/gpu/setup_device.sh
if [ -z "${WORK:-}" ]; then  # the random checkpoints and the agentic runs' files (run_e2e.sh gives its own)
    WORK=$(mktemp -d -t dualpath-serve-XXXX)
    [ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT
fi
read -ra models <<<"${SERVE_MODELS:-llama_1b llama3_8b}"
read -ra agentic_models <<<"${AGENTIC_MODELS:-llama_1b}"
start=$SECONDS
[ "${SERVING_LIMIT_S:-170}" = 0 ] || timeout -k 15 "${SERVING_LIMIT_S:-170}" python3 bench/gpu/serve_bench.py serving \
    "${smoke[@]}" --models "${models[@]}" --work "$WORK" --out "$OUT/gpu_serving.json"
echo "serve.sh serving: exit $? after $((SECONDS - start)) s"
[ "${AGENTIC_LIMIT_S:-110}" = 0 ] || timeout -k 15 "${AGENTIC_LIMIT_S:-110}" python3 bench/gpu/serve_bench.py agentic \
    "${smoke[@]}" --models "${agentic_models[@]}" --work "$WORK" --out "$WORK/agentic" --json "$OUT/gpu_agentic.json"
echo "serve.sh agentic: exit $? after $((SECONDS - start)) s"
