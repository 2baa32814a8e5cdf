import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's inner product: ``silu(gate) * up``."""
    return F.silu(gate) * up
