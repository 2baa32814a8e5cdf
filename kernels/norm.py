import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch", out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm computed in float32, scaled by ``weight`` in the input dtype (as Hugging Face models do), into
    ``out`` when given (rows with unit column stride, e.g. the latent part of MLA's KV row). ``backend`` "triton":
    one fused kernel (``dualpath.kernels.triton_elementwise``)."""
    if backend == "triton":
        from dualpath.kernels.triton_elementwise import rms_norm as fused

        return fused(x, weight, eps, out=out)[0]
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return y if out is None else out.copy_(y)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` (the residual stream after a sublayer) and ``rms_norm(h)``: returns (normed, h)."""
    if backend == "triton":
        from dualpath.kernels.triton_elementwise import rms_norm as fused

        return fused(x, weight, eps, residual)
    h = residual + x
    return rms_norm(h, weight, eps), h
