"""A full fine-tuning model's linears in FP8: patch_model(fp8_base=True) on a model without LoRA layers.

Why: in full fine-tuning the decoder's GEMMs are most of the update (Qwen2.5-1.5B, 64 x 4352 tokens on an H200: 4.4 s
of 6.5, benchmarks/NOTES.md). FP8Linear runs the forward and the input gradient as the frozen base of fp8_base runs
them (fastgrpo.ops.fp8_base: fp8_base_product, fp8_input_grad: each row of the input, of the output's gradient and of
the weight in e4m3 with its own scale); the weight gradient g^T x stays in the model's dtype, as nn.Linear computes
it, so each update's direction is not quantized.

Each weight's e4m3 copy (fp8_weight_of) and its transpose (the input gradient's operand) are kept on the layer, 2
bytes a parameter, and made again after the weight changed: in place, replaced, or (a trained weight) after any
torch.optim optimizer step, which a fused optimizer takes without moving the weight's version counter. Made at every
call instead, they made the update 0.7 s longer (Qwen2.5-1.5B at 10K tokens a micro-batch on an H200: 3.10 s against
2.38, nearly all of it host time for the extra launches). A write through .data (no version, no optimizer step) is
not seen, as for any fp8_base copy. Even so FP8 pays only where micro-batches are long: quantizing every input and
output gradient (~40K values per token and layer) takes back most of what the e4m3 GEMMs gain (benchmarks/NOTES.md,
forty-eighth session).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from fastgrpo.hf.binding import WeakBoundMethod
from fastgrpo.ops.fp8_base import (
    fp8_base_product, fp8_input_grad, fp8_transposed_of, fp8_weight_of, quantized_input,
)
from fastgrpo.ops.fp8_scaled_linear import scaled_mm_fits

FP8_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_linear_eligible(layer: nn.Module) -> bool:
    """Whether patch_model(fp8_base=True) binds fp8_linear_forward on `layer`: an nn.Linear itself (a subclass, e.g. a
    bitsandbytes or FP8 one, has math of its own) of floating weights whose sides _scaled_mm takes."""
    return (type(layer) is nn.Linear and layer.weight.dtype in FP8_DTYPES
            and scaled_mm_fits(*layer.weight.shape))


def fp8_linear_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The forward patch_model binds: FP8Linear where the call is the layer's plain F.linear in its own dtype;
    F.linear for the rest (another dtype, autocast, a weight since replaced by one of another shape or dtype)."""
    weight, bias = layer.weight, layer.bias
    if (x.dtype != weight.dtype or not fp8_linear_eligible(layer) or x.dim() < 2
            or torch.is_autocast_enabled(x.device.type) or (bias is not None and bias.dtype != weight.dtype)):
        return F.linear(x, weight, bias)
    copy = fp8_weight_of(layer)
    # a trained bias alone (BitFit) too: _scaled_mm, which adds it, has no derivative
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return FP8Linear.apply(x, weight, bias, copy, layer)
    return _product(x, bias, copy)


def _product(x: torch.Tensor, bias: torch.Tensor | None, copy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [..., in] times the weight's e4m3 copy (q [out, in], scale [out]) + bias -> [..., out]."""
    out = fp8_base_product(x.reshape(-1, x.shape[-1]), *copy, bias, quantized_x=quantized_input(x))
    return out.view(*x.shape[:-1], copy[0].shape[0])


class FP8Linear(torch.autograd.Function):
    """F.linear(x, weight, bias) with the forward and input-gradient GEMMs in e4m3: copy is fp8_weight_of(layer),
    and the backward multiplies by its transpose kept on the layer (fp8_transposed_of)."""

    @staticmethod
    def forward(ctx, x, weight, bias, copy, layer):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None)
        ctx.copy, ctx.layer = copy, layer  # not activations: kept out of saved-tensor hooks
        ctx.x_shape = x.shape
        return _product(x, bias, copy)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])  # [N, out]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_input_grad(g, *ctx.copy, fp8_transposed_of(ctx.layer, ctx.copy[0])).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = g.t().mm(x.reshape(-1, x.shape[-1]))  # in the weight's dtype, as nn.Linear's
        if ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        return grad_x, grad_weight, grad_bias, None, None


def fp8_linears(model: nn.Module) -> list[nn.Linear]:
    """The layers of `model` that patch_model bound fp8_linear_forward on."""
    return [m for m in model.modules() if _bound_fp8(m.__dict__.get("forward"))]


def _bound_fp8(forward: object) -> bool:
    return isinstance(forward, WeakBoundMethod) and forward.__func__ is fp8_linear_forward
