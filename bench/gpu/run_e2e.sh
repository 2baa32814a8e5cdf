#!/usr/bin/env bash
# Issue 52's GPU run in one go, on one CUDA machine (its own python3 with torch, triton, transformers; the runtime
# dependencies it lacks carried as .wheels/, bench/gpu/wheelhouse.sh): every part under its own time limit, in the
# issue's order, 8 minutes at most (the limits' sum, 470 s, and ~10 s of set-up; a part writes its JSON as it
# goes, so a limit loses only what it cut; 0 skips a part):
#   (e2e.log)             first, the new FP8 kernels' tests on CUDA (tests/kernels/test_fp8_decode.py: their
#                         split-K reduction orders programs through memory, which the interpreter never tests)
#                                                                                                 CHECK_LIMIT_S=40
#   decode_roofline.json  item 1: decode step time against (weight + KV bytes) / copy bandwidth, 1.1B and 8B shapes
#                         (bench/gpu/decode_roofline.py)                                          ROOFLINE_LIMIT_S=95
#   fp8_decode.json       item 2: bench/gpu/fp8_decode.py, where that file exists                 FP8_LIMIT_S=75
#   lora.json             item 4: LoRA adapter decode against the base model's, on CUDA graphs
#                         (bench/gpu/kernels.py --only lora)                                      LORA_LIMIT_S=40
#   gpu_serving.json      item 3a: dualpath serve on the one GPU against the offline LLM          SERVING_LIMIT_S=125
#   gpu_agentic.json      item 3b: dualpath bench agentic, storage-bound                          AGENTIC_LIMIT_S=95
#   e2e.log               everything printed, the GPU and the versions first
# Six files: the device tool brings back at most eight from $OUT. The random checkpoints are built once, in $WORK.
# --smoke: the roofline and serve parts on CPU with tiny models (tests/docs/test_gpu_e2e.py); the LoRA and FP8 parts
# are skipped there unless their limits are given (under Triton's interpreter they take minutes).
#   OUT=/some/dir bash bench/gpu/run_e2e.sh [--smoke]        (default OUT: bench/results/gpu/e2e)
# On the device tool: run with carry [".wheels"] and the command `OUT=$OUT bash bench/gpu/run_e2e.sh`.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit
OUT=${OUT:-bench/results/gpu/e2e}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
smoke=()
quiet_default=""  # the LoRA and FP8 parts' default limits: none in a smoke run
if [ "${1:-}" = --smoke ]; then
    smoke=(--smoke)
    quiet_default=0
fi
exec > >(tee -a "$OUT/e2e.log") 2>&1
echo "run_e2e.sh on $(date -u +%FT%TZ) ${smoke[*]}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | head -3
df -h /dev/shm /tmp | tail -2  # the engines' shared-memory transport and the Oracle's KV store; checkpoints, KV
# shellcheck source=bench/gpu/setup_device.sh
source bench/gpu/setup_device.sh
unset TRITON_INTERPRET
[ ${#smoke[@]} = 0 ] || export TRITON_INTERPRET=1  # (the smoke's Triton kernels on CPU)
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
WORK=$(mktemp -d -t dualpath-e2e-XXXX)  # (KEEP_WORK=1 keeps it: the agentic figures, every process's log)
export WORK
[ -n "${KEEP_WORK:-}" ] || trap 'rm -rf "$WORK"' EXIT

step() {  # step LIMIT_S NAME COMMAND...: COMMAND under its limit (0: skipped), its exit and the time so far
    local limit=$1 name=$2
    shift 2
    if [ "$limit" = 0 ]; then
        echo "== $name: skipped"
        return
    fi
    echo "== $name (limit $limit s)"
    timeout -k 15 "$limit" "$@"
    echo "== $name: exit $? at ${SECONDS} s"
}

step "${CHECK_LIMIT_S:-${quiet_default:-40}}" check python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fp8_decode.py
step "${ROOFLINE_LIMIT_S:-95}" roofline python3 bench/gpu/decode_roofline.py "${smoke[@]}" --work "$WORK" \
    --out "$OUT/decode_roofline.json"
if [ -f bench/gpu/fp8_decode.py ]; then
    fp8_limit=${FP8_LIMIT_S:-${quiet_default:-75}}
    fp8_args=()  # its own sweeps' budget, where it takes one: 15 s short of the limit, for its JSON
    grep -q -- --budget bench/gpu/fp8_decode.py && [ "$fp8_limit" -gt 30 ] && fp8_args=(--budget $((fp8_limit - 15)))
    step "$fp8_limit" fp8_decode python3 bench/gpu/fp8_decode.py "${smoke[@]}" "${fp8_args[@]}" \
        --out "$OUT/fp8_decode.json"
fi
step "${LORA_LIMIT_S:-${quiet_default:-40}}" lora python3 bench/gpu/kernels.py "${smoke[@]}" --only lora --work "$WORK" \
    --out "$OUT/lora.json"
SERVING_LIMIT_S=${SERVING_LIMIT_S:-125} AGENTIC_LIMIT_S=${AGENTIC_LIMIT_S:-95} bash bench/gpu/serve.sh "${smoke[@]}"
echo "run_e2e.sh: ${SECONDS} s in all"
