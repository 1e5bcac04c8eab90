"""RMSNorm as an autograd Function over the Triton kernels, with a plain-torch path for the CPU.

`rms_norm(x, weight, eps, offset, cast_before_weight)` reproduces both Hugging Face variants:
Llama (offset 0, x * rstd rounded to x's dtype before the weight multiply, output in the promoted dtype) and
Gemma (offset 1: x * rstd * (1 + w) in fp32, output in x's dtype).
"""
from __future__ import annotations

import torch

from fastgrpo._checks import check_dtype, check_shape
from fastgrpo.ops._backend import use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, cast_before_weight: bool) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if cast_before_weight else x.dtype


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, cast_before_weight):
        from fastgrpo.kernels.rms_norm import rms_norm_fwd

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # x2: [N, H]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y, rstd = rms_norm_fwd(x2, weight, eps, offset, cast_before_weight, _out_dtype(x, weight, cast_before_weight))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.offset, ctx.cast_before_weight = shape, offset, cast_before_weight
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        from fastgrpo.kernels.rms_norm import rms_norm_bwd

        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.reshape(-1, x2.shape[-1])  # dy2: [N, H]
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx, dw = rms_norm_bwd(dy2, x2, weight, rstd, ctx.offset, ctx.cast_before_weight)
        return dx.view(ctx.shape), dw.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None, None


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, cast_before_weight: bool = True
) -> torch.Tensor:
    """The Hugging Face formulas in eager torch (the CPU path and the benchmark baseline)."""
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        return (offset + weight) * x_hat.to(x.dtype)
    return (x_hat * (offset + weight.float())).to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0, cast_before_weight: bool = True
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight) over the last dim: x [..., H], weight [H]."""
    check_dtype("x", x, _FLOATS)
    check_shape("weight", weight, (x.shape[-1],))
    if not use_triton(x, weight):
        return rms_norm_torch(x, weight, eps, offset, cast_before_weight)
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), bool(cast_before_weight))
