#!/usr/bin/env bash
# Sourced by the GPU scripts, in the repository root, on the device machine (its own python3, no network): the
# project installed without its dependencies (dualpath.kernels, .engines, ... are the repository's top-level folders
# mapped into one namespace by pyproject's package-dir), and the runtime dependencies of `dualpath serve` that the
# machine's image lacks installed from the wheelhouse that bench/gpu/wheelhouse.sh fills here (`carry: [".wheels"]`).
# pip's resolver takes each name's needs from the image where it has them, from .wheels where not.
python3 -c "import dualpath.kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . \
    || echo "pip install -e . failed: imports of dualpath.kernels will fail"
if ! python3 -c "import fastapi, uvicorn, llguidance, zmq, gguf" 2>/dev/null; then
    if [ -d .wheels ]; then
        python3 -m pip install -q --no-index --find-links .wheels fastapi uvicorn llguidance pyzmq gguf \
            || echo "installing from .wheels failed: dualpath serve will not start"
    else
        echo "no .wheels/ (run bench/gpu/wheelhouse.sh, then carry .wheels): dualpath serve will not start"
    fi
fi
