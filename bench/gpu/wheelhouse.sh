#!/usr/bin/env bash
# Fill .wheels/ (ignored) with the runtime dependencies of `dualpath serve` that the GPU device machine's image
# lacks, for its Python (3.12, x86-64; bench/results/gpu/versions.txt, the tests' log), so that bench/gpu/serve.sh
# installs them there with no network: `pip install --no-index` from the folder the device tool carries
# (`carry: [".wheels"]`). The image already holds torch, numpy, safetensors, tokenizers, jinja2, pyyaml, grpcio,
# tqdm, xxhash, prometheus-client, msgpack, httpx, anyio, click, h11, typing-extensions
# (/work/.library/device/KINDS.md); what it lacks is fastapi and its pydantic stack, uvicorn, llguidance, pyzmq and
# gguf. The versions are the ones this machine runs the tests with. ~7 MiB in all (the device tool carries 64 MiB).
#   bash bench/gpu/wheelhouse.sh            (again: downloads only what is not there yet)
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.wheels}
PY=${PY_VERSION:-3.12}
# name==version, one each (two versions of one package stop the whole install there)
PACKAGES=(
    fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.3
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    uvicorn==0.55.0 llguidance==1.9.1 pyzmq==27.3.0 gguf==0.19.0
    typing-extensions==4.16.0  # pydantic needs >= 4.14.1: pip takes it from here only if the image's is older
)
mkdir -p "$DEST"
platforms=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# manylinux up to 2.35: the image's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39); llguidance is built for 2.31
# --no-deps: each needed one is named above; the rest are in the image. serve.sh installs by name with pip's
# resolver (--no-index), so a wheel here replaces nothing the image holds in a version that satisfies these
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platforms[@]}" -d "$DEST" "${PACKAGES[@]}"
du -sh "$DEST"
ls "$DEST"
