"""The LoRA branch of PEFT's vanilla LoRA Linear, base_layer(x) + lora_B(lora_A(x)) * scaling, in two precisions.

lora_add (patch_model's default, lora_dtype="input"): the branch computes in x's dtype, as under torch autocast (what
TRL's bf16 Trainer and Unsloth run): the fp32 adapter weights are cast to x's dtype per call (r x in and out x r:
tiny), h = x A^T is one GEMM and the delta goes into the base output in the epilogue of the second one,
addmm(result, h, B^T, alpha=scaling): bf16 tensor-core GEMMs with fp32 accumulation, no [N, out] fp32 tensor and no
separate scale, add or cast pass. The backward's four GEMMs are in x's dtype too; the weight gradients are cast to
the adapter's dtype at the end (autocast's cast backward). Why it is the default: PEFT without autocast runs fp32
GEMMs (on FFMA cores: TF32 is off) and fp32 elementwise passes over [N, out]; measured on an H100 in a GRPO step of
Qwen2.5-1.5B, LoRA r16 (64 x 1280 tokens, micro-batch 8), a no-grad forward took 1.25 s of GPU time with the adapter
vs 0.43 s without (add<float> 234 ms, fp32 FFMA GEMMs 220 ms, fp32 scale 140 ms, casts 230 ms), and the update
(forward, recompute, backward) ~2.5 s of its 4.4 s were adapter math.

lora_delta (lora_dtype="adapter"): lora_B(lora_A(x.to(A.dtype))) * scaling, PEFT's ops in PEFT's order and dtypes
(bitwise PEFT without autocast) for those who need its fp32 adapter math.

Both save x itself (the tensor the base layer reads: q, k and v share one) and the small [N, r] lora_A output, never a
copy of x in the adapter's dtype. PEFT casts a bf16 input to its fp32 adapters' dtype before lora_A, so autograd
saves that fp32 copy for lora_A's weight gradient: one [N, in] fp32 tensor per adapted linear, and q, k and v each
keep their own copy of the same input: most of a LoRA step's activation memory at its peak (measured:
benchmarks/NOTES.md). lora_delta's backward casts x to the adapter's dtype one chunk of tokens at a time for dA.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fastgrpo._checks import check_floating, check_positive_int, check_shape

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


class LoRAAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, result, x, weight_a, weight_b, scaling):
        dtype = x.dtype
        x2 = x.reshape(-1, x.shape[-1])  # x2: [N, in]
        h = x2.mm(weight_a.to(dtype).t())  # h: [N, r]
        # The delta is added in the GEMM's epilogue (fp32 accumulator + result, rounded once): out-of-place, so the
        # base output is not modified (bitsandbytes' 4-bit one is a view that refuses in-place ops). Written into a
        # tensor of result's shape: a view returned from a custom Function could not be modified in place after.
        out = result.new_empty(result.shape)  # out: [..., out]
        torch.addmm(result.reshape(-1, result.shape[-1]), h, weight_b.to(dtype).t(), alpha=scaling,
                    out=out.view(-1, out.shape[-1]))
        want_a, want_b = ctx.needs_input_grad[2:4]
        # The adapter weights are parameters (saving them costs nothing); their casts are redone in the backward.
        ctx.save_for_backward(x if want_a else None, h if want_b else None, weight_a, weight_b)
        ctx.scaling = scaling
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, h, weight_a, weight_b = ctx.saved_tensors
        want_result, want_x, want_a, want_b = ctx.needs_input_grad[:4]
        dtype, scaling = grad_out.dtype, ctx.scaling
        g = grad_out.reshape(-1, grad_out.shape[-1])  # g: [N, out]
        grad_b = _scaled(g.t().mm(h), scaling, weight_b.dtype) if want_b else None  # grad_b: [out, r]
        grad_x = grad_a = None
        if want_x or want_a:
            # scaling folded into B before its cast (one rounding of an [out, r] tensor, not of dh)
            dh = g.mm(_scaled(weight_b, scaling, dtype))  # dh: [N, r]
            if want_x:
                grad_x = dh.mm(weight_a.to(dtype)).view(*grad_out.shape[:-1], weight_a.shape[1])  # [..., in]
            if want_a:
                grad_a = dh.t().mm(x.reshape(-1, x.shape[-1])).to(weight_a.dtype)  # grad_a: [r, in]
        return grad_out if want_result else None, grad_x, grad_a, grad_b, None


def _scaled(t: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """t * scaling in the wider of t's dtype and `dtype`, rounded to `dtype` once."""
    return t.to(torch.promote_types(t.dtype, dtype)).mul(scaling).to(dtype)


def lora_add(
    result: torch.Tensor,
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """result + (x @ weight_a^T @ weight_b^T) * scaling in x's dtype, for result [..., out] (the base layer's output,
    of x's dtype), x [..., in], weight_a [r, in], weight_b [out, r] of any floating dtype -> a new [..., out] tensor.

    The weights are cast to x's dtype, the delta is added in the epilogue of the second GEMM (one rounding), and the
    gradients of weight_a / weight_b come back in their own dtypes; the backward keeps x as given and the [..., r]
    product x @ weight_a^T. A bf16 x on fp32 adapters gives what PEFT computes under bf16 autocast, with one rounding
    fewer (the scale and the add are in the GEMM).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"x: expected a floating tensor of shape [..., in], got {_describe(x)}")
    check_shape("weight_a", weight_a, (None, x.shape[-1]))
    check_shape("weight_b", weight_b, (None, weight_a.shape[0]))
    for name, weight in (("weight_a", weight_a), ("weight_b", weight_b)):
        check_floating(name, weight)
    check_shape("result", result, (*x.shape[:-1], weight_b.shape[0]))
    if result.dtype != x.dtype:
        raise ValueError(f"result: expected the dtype of x {x.dtype}, got {result.dtype}")
    if not isinstance(scaling, numbers.Real) or isinstance(scaling, bool):
        raise ValueError(f"scaling: expected a real number, got {type(scaling).__name__}")
    return LoRAAddFunction.apply(result, x, weight_a, weight_b, float(scaling))


def _describe(x: object) -> str:
    return f"{x.dtype} of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
