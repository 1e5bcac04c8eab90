"""The LoRA delta lora_B(lora_A(x)) * scaling of PEFT's vanilla LoRA Linear, saving x in its own dtype.

PEFT keeps adapter weights in fp32 and casts a bf16 input to fp32 before lora_A, so autograd saves that fp32 copy
for lora_A's weight gradient: one [N, in] fp32 tensor per adapted linear, and q, k and v each keep their own copy
of the same input: most of a LoRA step's activation memory at its peak (measured: benchmarks/NOTES.md).

Here the forward runs PEFT's ops in PEFT's order and dtypes (its output is bitwise PEFT's), but saves x itself
(the tensor the base layer reads: q, k and v share one, at half the bytes of an fp32 copy when it is bf16) and the
small [N, r] lora_A output. The backward casts x to the adapter's dtype one chunk of tokens at a time for dA.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fastgrpo._checks import check_positive_int, check_shape

# 4096 tokens: one chunk of x in fp32 (and of its fp32 gradient) at Qwen2.5-1.5B's down_proj (in = 8960) is
# 140 MiB, where unchunked at 8 x 8192 tokens it would be 2.2 GiB.
DEFAULT_CHUNK_TOKENS = 4096


class LoRADeltaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_a, weight_b, scaling, chunk_tokens):
        # PEFT: lora_B(lora_A(x.to(A.dtype))) * scaling. x.to is x itself when the dtypes match.
        h = F.linear(x.to(weight_a.dtype), weight_a)  # h: [..., r]
        ctx.save_for_backward(x, weight_a, weight_b, h)
        ctx.scaling, ctx.chunk_tokens = scaling, chunk_tokens
        return F.linear(h, weight_b) * scaling

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        # The matmuls autograd runs for PEFT's graph (mm backward on the flattened rows), so one chunk is bitwise it.
        x, weight_a, weight_b, h = ctx.saved_tensors
        want_x, want_a, want_b = ctx.needs_input_grad[:3]
        x2 = x.reshape(-1, x.shape[-1])  # x2: [N, in]
        g = (grad_out * ctx.scaling).reshape(-1, grad_out.shape[-1])  # g: [N, out]
        grad_b = g.t().mm(h.reshape(-1, h.shape[-1])) if want_b else None  # grad_b: [out, r]
        grad_x = grad_a = None
        if want_x or want_a:
            dh = g.mm(weight_b)  # dh: [N, r]
            grad_x = torch.empty_like(x2) if want_x else None
            step = ctx.chunk_tokens
            chunked = x2.shape[0] > step
            for start in range(0, x2.shape[0], step):
                dh_c = dh[start : start + step]  # dh_c: [n, r]
                if want_x:
                    grad_x[start : start + step] = dh_c.mm(weight_a)  # rounded to x's dtype, as PEFT's cast back
                if want_a:
                    part = dh_c.t().mm(x2[start : start + step].to(weight_a.dtype))  # part: [r, in]
                    if chunked:  # sum the chunks in fp32 (fp64 stays fp64), round once below
                        part = part.to(torch.promote_types(part.dtype, torch.float32))
                    grad_a = part if grad_a is None else grad_a.add_(part)
            grad_a = None if grad_a is None else grad_a.to(weight_a.dtype)
            grad_x = None if grad_x is None else grad_x.view(x.shape)
        return grad_x, grad_a, grad_b, None, None


def lora_delta(
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    scaling: float,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """lora_B(lora_A(x.to(A.dtype))) * scaling for x [..., in], weight_a [r, in], weight_b [out, r] -> [..., out].

    Forward and gradients are those of PEFT's vanilla LoRA branch (bitwise for inputs of at most chunk_tokens
    tokens); the backward keeps x as given plus the [..., r] lora_A output instead of a copy of x in A's dtype.
    chunk_tokens: tokens per chunk of the backward's transient x in A's dtype.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"x: expected a floating tensor of shape [..., in], got {_describe(x)}")
    check_shape("weight_a", weight_a, (None, x.shape[-1]))
    check_shape("weight_b", weight_b, (None, weight_a.shape[0]))
    if weight_b.dtype != weight_a.dtype:
        raise ValueError(f"weight_b: expected the dtype of weight_a {weight_a.dtype}, got {weight_b.dtype}")
    if not isinstance(scaling, numbers.Real) or isinstance(scaling, bool):
        raise ValueError(f"scaling: expected a real number, got {type(scaling).__name__}")
    check_positive_int("chunk_tokens", chunk_tokens)
    return LoRADeltaFunction.apply(x, weight_a, weight_b, scaling, chunk_tokens)


def _describe(x: object) -> str:
    return f"{x.dtype} of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
