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

lora_linear (the same math, where patch_model's layer has a frozen nn.Linear base): F.linear(x, W, bias) and every
active adapter's delta in one op, for its backward: the base GEMM writes the input gradient g W and each adapter's
GEMM adds its (s g B) A into it (beta = 1), where nn.Linear + lora_add leave autograd two [N, in] gradients to add:
an H100 trace of that Qwen2.5-1.5B update found those bf16 adds at 133 ms of ~2.6 s of GPU time, plus their launches
(benchmarks/NOTES.md). Its forward makes the GEMM calls of F.linear then lora_add for a contiguous x (F.linear's
addmm, the bias added in its epilogue, or mm; then each delta's two; bit for bit in the CPU tests); in the input
gradient each adapter's term is no longer rounded on its own before the add. Bases it does not stand in for
(bitsandbytes, hooked, trained, of another dtype than x) run base_layer(x), then lora_add.

lora_delta (lora_dtype="adapter"): lora_B(lora_A(x.to(A.dtype))) * scaling, PEFT's ops in PEFT's order and dtypes
(bitwise PEFT without autocast) for those who need its fp32 adapter math.

All three save x itself (the tensor the base layer reads: q, k and v share one) and the small [N, r] lora_A output,
never a copy of x in the adapter's dtype. PEFT casts a bf16 input to its fp32 adapters' dtype before lora_A, so autograd
saves that fp32 copy for lora_A's weight gradient: one [N, in] fp32 tensor per adapted linear, and q, k and v each
keep their own copy of the same input: most of a LoRA step's activation memory at its peak (measured:
benchmarks/NOTES.md). lora_delta's backward casts x to the adapter's dtype one chunk of tokens at a time for dA.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fastgrpo._checks import check_floating, check_positive_int, check_shape
from fastgrpo.ops.fp8_base import fp8_base_product, fp8_input_grad, quantized_input

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
    """result += (x A^T B^T) * scaling in place, in x's dtype. Every kernel counts: with bf16 GEMMs the LoRA step is
    bound by the host's launches (an H200 profile of Qwen2.5-1.5B's update: 2.1 s of GPU work in 4.2 s), so the casts
    of A and B are made once per forward and kept for the backward, and each scaling rides a GEMM's alpha."""

    @staticmethod
    def forward(ctx, result, x, weight_a, weight_b, scaling, inplace):
        a, b = weight_a.to(x.dtype), weight_b.to(x.dtype)  # a: [r, in], b: [out, r]; tiny
        out, h = _add_delta(result, x, a, b, scaling, inplace)
        if inplace:
            ctx.mark_dirty(result)
        want_a, want_b = ctx.needs_input_grad[2:4]
        ctx.save_for_backward(x if want_a else None, h if want_b else None, a, b)
        ctx.scaling, ctx.weight_dtypes = scaling, (weight_a.dtype, weight_b.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, h, a, b = ctx.saved_tensors
        want_result = ctx.needs_input_grad[0]
        g = grad_out.reshape(-1, grad_out.shape[-1])  # g: [N, out]
        grad_x, grad_a, grad_b = _branch_backward(g, x, h, a, b, ctx.scaling, ctx.weight_dtypes,
                                                  ctx.needs_input_grad[1:4])
        grad_x = None if grad_x is None else grad_x.view(*grad_out.shape[:-1], a.shape[1])  # [..., in]
        return grad_out if want_result else None, grad_x, grad_a, grad_b, None, None


class LoRALinearFunction(torch.autograd.Function):
    """F.linear(x, weight, bias) of a frozen base plus each adapter's delta, in x's dtype. The point is the backward:
    the base GEMM writes the input gradient g W and each adapter's GEMM adds (s g B) A into it (beta = 1), where
    nn.Linear + lora_add hand autograd two [N, in] gradients to add (an H100 trace of a Qwen2.5-1.5B LoRA r16 update:
    133 ms of bf16 adds in ~2.6 s, benchmarks/NOTES.md). Per adapter the math, casts and saved tensors are lora_add's;
    the base weight is saved as autograd's linear saves it (a parameter: no memory)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8_weight, scalings, *weights):
        # weights: a_1, b_1, a_2, b_2, ... of any floating dtypes; casts: the same in x's dtype (tiny)
        casts = [w.to(x.dtype) for w in weights]
        out, hs = _linear_with_deltas(x, weight, bias, casts, scalings, fp8_weight)
        want_x, wants = ctx.needs_input_grad[0], ctx.needs_input_grad[5:]
        hs = [h if want_b else None for h, want_b in zip(hs, wants[1::2])]
        ctx.save_for_backward(x if any(wants[0::2]) else None, weight if want_x and fp8_weight is None else None,
                              *hs, *casts)
        ctx.scalings, ctx.weight_dtypes, ctx.x_shape = scalings, [w.dtype for w in weights], x.shape
        ctx.fp8_weight = fp8_weight  # the layer's e4m3 copy (not an activation: kept out of saved-tensor hooks)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, *rest = ctx.saved_tensors
        hs, casts = rest[: len(ctx.scalings)], rest[len(ctx.scalings) :]
        want_x, wants = ctx.needs_input_grad[0], ctx.needs_input_grad[5:]
        g = grad_out.reshape(-1, grad_out.shape[-1])  # g: [N, out]
        grad_x = None  # grad_x: [N, in], the base layer's; the adapters' add into it
        if want_x:
            grad_x = g.mm(weight) if ctx.fp8_weight is None else fp8_input_grad(g, *ctx.fp8_weight)
        grads = []
        for i, scaling in enumerate(ctx.scalings):
            grad_x, grad_a, grad_b = _branch_backward(
                g, x, hs[i], *casts[2 * i : 2 * i + 2], scaling, ctx.weight_dtypes[2 * i : 2 * i + 2],
                (want_x, *wants[2 * i : 2 * i + 2]), grad_x,
            )
            grads += [grad_a, grad_b]
        grad_x = None if grad_x is None else grad_x.view(ctx.x_shape)
        return grad_x, None, None, None, None, *grads


def _linear_with_deltas(x, weight, bias, casts, scalings, fp8_weight=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(F.linear(x, weight, bias) + each delta, [h_i = x a_i^T]) for casts [a_1, b_1, ...] in x's dtype. The base
    product goes into a new tensor of the output's shape (not a view, see _add_delta) by the GEMM F.linear runs for a
    contiguous x (addmm with the bias in its epilogue, or mm: the same bits); each delta is added into it by its
    second GEMM. fp8_weight (q, scale): the base product is fp8_base_product's instead, of x's rows as
    quantized_input gives them (shared with the siblings that read the same x)."""
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, weight.shape[0])  # x2: [N, in], out2: [N, out]
    if fp8_weight is not None:
        fp8_base_product(x2, *fp8_weight, bias, out=out2, quantized_x=quantized_input(x))
    elif bias is None:
        torch.mm(x2, weight.t(), out=out2)
    else:
        torch.addmm(bias, x2, weight.t(), out=out2)
    hs = [_add_delta(out, x2, a, b, scaling, True)[1] for a, b, scaling in zip(casts[0::2], casts[1::2], scalings)]
    return out, hs


def _add_delta(result, x, a, b, scaling, inplace) -> tuple[torch.Tensor, torch.Tensor]:
    """(result + (x a^T) b^T * scaling, h = x a^T [N, r]): the add and the scale in the second GEMM's epilogue
    (fp32 accumulator + result, rounded once), into result itself or into a new tensor of its shape (not a view:
    a custom Function's output that is a view would refuse in-place ops later)."""
    h = x.reshape(-1, x.shape[-1]).mm(a.t())
    out = result if inplace else result.new_empty(result.shape)
    torch.addmm(result.view(-1, result.shape[-1]), h, b.t(), alpha=scaling, out=out.view(-1, out.shape[-1]))
    return out, h


def _mm(m1: torch.Tensor, m2: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * m1 @ m2 in one GEMM (beta = 0: the input tensor is never read)."""
    return torch.addmm(m1.new_empty(()), m1, m2, beta=0, alpha=alpha)


def _branch_backward(g, x, h, a, b, scaling, weight_dtypes, want, grad_x=None) -> tuple:
    """(input gradient, dA, dB) of one branch (x a^T) b^T * scaling from g [N, out], each None where `want` (for x,
    a, b) says so. The input gradient (scaling g b) a is added into grad_x [N, in] by its GEMM (beta = 1) where one
    is given, else a new tensor; dA and dB come back in the adapter weights' dtypes."""
    want_x, want_a, want_b = want
    dtype_a, dtype_b = weight_dtypes
    grad_b = _mm(g.t(), h, scaling).to(dtype_b) if want_b else None  # grad_b: [out, r]
    grad_a = None
    if want_x or want_a:
        dh = _mm(g, b, scaling)  # dh: [N, r]
        if want_x:
            grad_x = dh.mm(a) if grad_x is None else grad_x.addmm_(dh, a)
        if want_a:
            grad_a = dh.t().mm(x.reshape(-1, x.shape[-1])).to(dtype_a)  # grad_a: [r, in]
    return grad_x, grad_a, grad_b


def lora_add(
    result: torch.Tensor,
    x: torch.Tensor,
    weight_a: torch.Tensor,
    weight_b: torch.Tensor,
    scaling: float,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """result + (x @ weight_a^T @ weight_b^T) * scaling in x's dtype, for result [..., out] (the base layer's output,
    of x's dtype), x [..., in], weight_a [r, in], weight_b [out, r] of any floating dtype -> [..., out]. inplace: add
    into result and return it, which saves a copy of result per call (a non-contiguous result is copied first and
    stays as it was; a contiguous leaf that requires grad cannot be added into).

    The weights are cast to x's dtype, the delta is added in the epilogue of the second GEMM (one rounding), and the
    gradients of weight_a / weight_b come back in their own dtypes; the backward keeps x as given, the [..., r]
    product x @ weight_a^T and the casts. A bf16 x on fp32 adapters gives what PEFT computes under bf16 autocast, with
    one rounding fewer (the scale and the add are in the GEMM). Without grad it runs as plain in-place ops, which
    torch.compile traces like any others.
    """
    _check_x(x)
    _check_branch("", x, weight_a, weight_b, scaling)
    check_shape("result", result, (*x.shape[:-1], weight_b.shape[0]))
    if result.dtype != x.dtype:
        raise ValueError(f"result: expected the dtype of x {x.dtype}, got {result.dtype}")
    if not result.is_contiguous():
        result, inplace = result.contiguous(), True  # a copy of our own already
    if inplace and result.is_leaf and result.requires_grad:
        raise ValueError("result: inplace=True needs a tensor that is not a leaf requiring grad")
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (result, x, weight_a, weight_b)):
        return _add_delta(result, x, weight_a.to(x.dtype), weight_b.to(x.dtype), float(scaling), inplace)[0]
    return LoRAAddFunction.apply(result, x, weight_a, weight_b, float(scaling), inplace)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]],
) -> torch.Tensor:
    """F.linear(x, weight, bias) + the sum over adapters (weight_a [r, in], weight_b [out, r], scaling) of
    (x @ weight_a^T @ weight_b^T) * scaling, for x [..., in] and a frozen base (weight [out, in], bias [out] or None,
    of x's dtype, not requiring grad) -> [..., out] in x's dtype: PEFT's LoRA Linear over an nn.Linear, each delta
    computed as lora_add computes it, with one input gradient: the base GEMM writes it and each adapter's GEMM adds
    into it, where F.linear followed by lora_add gives autograd two to add. A base that trains: F.linear + lora_add.

    The base product has F.linear's bits for a contiguous x of 2 or more dims (its addmm, the bias added in the GEMM's
    epilogue, or its mm without a bias). For another x, F.linear multiplies first and adds the bias in a second pass
    (one more rounding), where this op still adds it in the GEMM. In the input gradient each adapter's GEMM adds its
    term before rounding (round(round(g W) + t) for one adapter), where autograd rounds each term, then their sum.
    """
    _check_x(x)
    check_shape("weight", weight, (None, x.shape[-1]))
    if bias is not None:
        check_shape("bias", bias, (weight.shape[0],))
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name}: expected the dtype of x {x.dtype}, got {t.dtype}")
        if t is not None and t.requires_grad:
            raise ValueError(f"{name}: expected a frozen base (requires_grad=False); a trained one: F.linear, lora_add")
    for i, (weight_a, weight_b, scaling) in enumerate(adapters):
        _check_branch(f"adapters[{i}].", x, weight_a, weight_b, scaling)
        check_shape(f"adapters[{i}].weight_b", weight_b, (weight.shape[0], weight_a.shape[0]))
    return lora_linear_of_checked_values(x, weight, bias, adapters)


def lora_linear_of_checked_values(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]],
    fp8_weight: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """lora_linear without its argument checks, for a caller whose arguments are a PEFT layer's own (patch_model's
    forward, which runs once per adapted linear, micro-batch and recompute in a host-bound LoRA update: the checks
    took ~25 us of the op's ~110 us of host time, measured on a CPU). fp8_weight: (q [out, in] e4m3, scale [out]
    fp32), quantize_fp8 of weight: the base product is fp8_base_product's and its input gradient fp8_input_grad's."""
    scalings = tuple(float(scaling) for _, _, scaling in adapters)
    weights = [w for weight_a, weight_b, _ in adapters for w in (weight_a, weight_b)]  # a_1, b_1, a_2, b_2, ...
    if not torch.is_grad_enabled() or not (x.requires_grad or any(w.requires_grad for w in weights)):
        return _linear_with_deltas(x, weight, bias, [w.to(x.dtype) for w in weights], scalings, fp8_weight)[0]
    return LoRALinearFunction.apply(x, weight, bias, fp8_weight, scalings, *weights)


def _check_x(x: object) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"x: expected a floating tensor of shape [..., in], got {_describe(x)}")


def _check_branch(prefix: str, x: torch.Tensor, weight_a: object, weight_b: object, scaling: object) -> None:
    check_shape(f"{prefix}weight_a", weight_a, (None, x.shape[-1]))
    check_shape(f"{prefix}weight_b", weight_b, (None, weight_a.shape[0]))
    for name, weight in (("weight_a", weight_a), ("weight_b", weight_b)):
        check_floating(f"{prefix}{name}", weight)
    if not isinstance(scaling, numbers.Real) or isinstance(scaling, bool):
        raise ValueError(f"{prefix}scaling: expected a real number, got {type(scaling).__name__}")


def _describe(x: object) -> str:
    return f"{x.dtype} of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
