import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch") -> torch.Tensor:
    """RMSNorm computed in float32, scaled by ``weight`` in the input dtype (as Hugging Face models do).
    ``backend`` "triton": one fused kernel (``kernels.triton_elementwise``)."""
    if backend == "triton":
        from kernels.triton_elementwise import rms_norm as fused

        return fused(x, weight, eps)[0]
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` (the residual stream after a sublayer) and ``rms_norm(h)``: returns (normed, h)."""
    if backend == "triton":
        from kernels.triton_elementwise import rms_norm as fused

        return fused(x, weight, eps, residual)
    h = residual + x
    return rms_norm(h, weight, eps), h
