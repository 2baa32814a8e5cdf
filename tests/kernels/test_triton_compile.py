"""Every Triton kernel compiles to a cubin for the GPUs the runtime targets (H100/H200: sm_90; A100: sm_80) at the
engines' shapes and launch options, and fits the device's shared memory: what the interpreter-run kernel tests
cannot see (``tests/support/triton_compile.py`` does the work, in a process without ``TRITON_INTERPRET``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


# sm_90 (the H200) in the default run; sm_80 adds 25 s for a device we are not measured on
@pytest.mark.parametrize("target", ["cuda:90", pytest.param("cuda:80", marks=pytest.mark.slow)])
def test_kernels_compile_for_the_gpu_and_fit_its_shared_memory(target):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "triton_compile.py"), "--target", target],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    launches = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert launches, res.stderr[-3000:]
    failed = [x for x in launches if not x["fits"]]
    assert not failed and res.returncode == 0, failed
    kernels = {x["kernel"] for x in launches}
    assert kernels == {
        "_prefill_kernel",
        "_decode_split_kernel",
        "_decode_reduce_kernel",
        "_move_kernel",
        "_moe_up_kernel",
        "_moe_down_kernel",
        "_rms_norm_kernel",
        "_rope_qkv_kernel",
        "_rope_kernel",
        "_silu_mul_kernel",
        "_w8a16_kernel",
        "_w8a16_swap_kernel",
        "_index_score_kernel",
        "_sparse_split_kernel",
    } | (
        {"_w8a8_kernel", "_act_quant_kernel"}  # FP8 tensor cores
        if target == "cuda:90"
        else set()
    )
    assert {x["case"] for x in launches} >= {
        "gqa 32/8x128 bf16",
        "mla 128 heads 512+64 bf16",
        "moe 7168/2048 top-8 bf16",
        "cache row writes 2048 into fp8 (as bytes)",
    }
    # FP8 weights: e4m3 converted by the GPU from compute capability 8.9, as bytes (bit arithmetic) on any
    assert "fp8 weights as bytes" in {x["case"] for x in launches}
    fp8 = {
        "gqa 32/8x128 bf16 over fp8",
        "mla 128 heads 512+64 bf16 over fp8",  # e4m3 needs compute capability 8.9
        "fp8 weights native",
        "sparse mla 128 heads, indexer 64x128 bf16 over fp8",
        "fp8 weights x fp8 activations",
    }
    assert fp8 <= {x["case"] for x in launches} if target == "cuda:90" else not fp8 & {x["case"] for x in launches}
