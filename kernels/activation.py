import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """SwiGLU's inner product of ``gate_up [..., 2I]`` (gate columns, then up): ``silu(gate) * up``.
    ``backend`` "triton": one fused kernel (``dualpath.kernels.triton_elementwise``)."""
    if backend == "triton":
        from dualpath.kernels.triton_elementwise import silu_and_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
