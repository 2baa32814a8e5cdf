"""The GPU bench's tuning sweep of the attention kernels (``tests/support/triton_compile.py --all`` compiles the same)."""

# decode: (num_splits, block_n, num_warps); None: the kernel's own choice by batch and device
DECODE_CONFIGS = ((None, 32, 4), (None, 64, 4), (8, 64, 4), (16, 64, 4), (32, 64, 8), (16, 128, 8))
# prefill: (block_m, block_n, num_warps, num_stages)
PREFILL_CONFIGS = (
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (64, 128, 8, 2),
    (128, 128, 8, 2),
    (128, 32, 4, 3),
    (64, 32, 4, 3),
)
