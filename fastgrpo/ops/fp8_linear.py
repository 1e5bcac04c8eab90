"""FP8 (e4m3) weight-only linear: the quantizer, the eager reference, and the op over the Triton kernel.

`quantize_fp8(weight)` -> (q [N, K] float8_e4m3fn, scale [N] fp32) with one scale per output channel, amax / 448,
so each row's largest weight lands on e4m3's largest value; relative error of a weight <= 2^-4 (3 mantissa bits,
round to nearest), absolute <= 2^-10 scale below e4m3's normal range.
`fp8_linear(x, q, scale, bias)` = x (q scale)^T + bias: the Triton kernel (fastgrpo.kernels.fp8_linear) on CUDA
tensors or under TRITON_INTERPRET=1, else `fp8_linear_torch`, the eager reference (any float dtype; tests run it
in fp64, where q, scale and a 16-bit x are exact). No autograd: FP8 weights serve the rollout, which runs under
no_grad. The op is a torch.library custom op, so torch.compile keeps it as one opaque call in the compiled decode
step (the kernel's split-K tickets are none of the compiler's business: every launch leaves them as it found them).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from fastgrpo._checks import check_dtype, check_shape
from fastgrpo.ops._backend import use_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# elements per chunk of the quantizer's fp32 temporaries (64 MiB): an lm_head of 128K x 4096 is 2 GiB in fp32
QUANT_CHUNK = 1 << 24
_ACTIVATIONS = (torch.float16, torch.bfloat16, torch.float32)


@torch.no_grad()
def quantize_fp8(weight: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale [N] fp32), on weight's device; into `out`
    (q, scale) where given (e.g. a fused group's slice of its stacked copy). column_scale [K] fp32: the rows of
    weight * column_scale (each product one fp32 multiply) are quantized instead.

    scale = amax over the row / 448, at least fp32's smallest normal (an all-zero row gets q = 0, not 0/0).
    A 16-bit or fp32 weight on CUDA goes through the Triton kernel (kernels/quantize_fp8.py: one pass, the same
    bytes); elsewhere rows go through fp32 in chunks of QUANT_CHUNK elements, so the temporaries stay small whatever
    the weight. Not under TRITON_INTERPRET: Triton 3.9's interpreter casts fp32 to e4m3 wrongly where rounding
    carries into the exponent (125.2 gives 64, not 128)."""
    check_shape("weight", weight, (None, None))
    N, K = weight.shape
    if out is None:
        out = (torch.empty(N, K, dtype=FP8_DTYPE, device=weight.device),
               torch.empty(N, dtype=torch.float32, device=weight.device))
    q, scale = out
    check_shape("out[0]", q, (N, K))
    check_shape("out[1]", scale, (N,))
    check_dtype("out[0]", q, (FP8_DTYPE,))
    check_dtype("out[1]", scale, (torch.float32,))
    for name, t in (("out[0]", q), ("out[1]", scale)):
        if t.device != weight.device:
            raise ValueError(f"{name}: expected a tensor on the weight's device {weight.device}, got {t.device}")
    if column_scale is not None:
        check_shape("column_scale", column_scale, (K,))
        check_dtype("column_scale", column_scale, (torch.float32,))
    kernel = weight.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    if kernel and weight.dtype in _ACTIVATIONS and q.stride(1) == 1 and scale.stride(0) == 1:
        from fastgrpo.kernels.quantize_fp8 import quantize_rows_fwd

        quantize_rows_fwd(weight if weight.stride(1) == 1 else weight.contiguous(), q, scale,
                          None if column_scale is None else column_scale.contiguous())
        return q, scale
    rows = max(1, QUANT_CHUNK // max(K, 1))
    for start in range(0, N, rows):
        rows_of = weight[start:start + rows]
        q[start:start + rows], scale[start:start + rows] = quantize_rows(
            rows_of if column_scale is None else rows_of.float() * column_scale)
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (any float dtype) -> (q [R, K] float8_e4m3fn, scale [R] fp32): quantize_fp8's rounding without its
    chunks, in plain torch ops (fastgrpo.ops.fp8_scaled_linear quantizes activations with it inside the compiled
    decode step, where Inductor fuses it into one kernel). fp64 x is rounded to fp32 first."""
    x = x.float()
    scale = (x.abs().amax(1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (q [R, K] float8_e4m3fn, scale [R, cdiv(K, group)] fp32): quantize_rows per group of `group`
    values along K (the last may be shorter; its padding zeros leave its amax alone), in plain torch ops."""
    R, K = x.shape
    groups = -(-K // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - K)).view(R, groups, group)
    scale = (padded.abs().amax(2) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(R, groups * group)
    return q[:, :K], scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [N, K] e4m3, scale [N] -> q scale [N, K] in `dtype` (exact in fp32 and fp64)."""
    return (q.to(torch.float64 if dtype == torch.float64 else torch.float32) * scale[:, None]).to(dtype)


def group_scale_per_value(scale: torch.Tensor, group: int, K: int) -> torch.Tensor:
    """quantize_groups' scale [R, cdiv(K, group)] -> [R, K]: each value's group scale."""
    return scale.repeat_interleave(group, 1)[:, :K]


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_groups' (q [R, K], scale) -> q scale [R, K] in `dtype` (exact in fp64; one rounding a value in fp32)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(work) * group_scale_per_value(scale.to(work), group, q.shape[1])).to(dtype)


def fp8_linear_torch(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ q^T [K, N], times scale [N], plus bias, in fp32 (fp64 for fp64 x) -> [..., N] in x's dtype."""
    work = torch.promote_types(x.dtype, torch.float32)
    y = (x.to(work) @ q.to(work).T) * scale.to(work)
    if bias is not None:
        y = y + bias.to(work)
    return y.to(x.dtype)


# the op's schema is inferred from these annotations: Optional[...], the form torch.library documents
@torch.library.custom_op("fastgrpo::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if not use_triton(x, q, scale):
        return fp8_linear_torch(x, q, scale, bias)
    from fastgrpo.kernels.fp8_linear import fp8_linear_fwd

    return fp8_linear_fwd(x, q, scale, bias)


@_fp8_linear_op.register_fake
def _(x, q, scale, bias):
    return x.new_empty(x.shape[0], q.shape[0])


def check_fp8_linear_args(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The argument checks of fp8_linear and fp8_scaled_linear (one ValueError naming the argument)."""
    check_dtype("x", x, _ACTIVATIONS)
    check_dtype("q", q, (FP8_DTYPE,))
    check_shape("q", q, (None, x.shape[-1]))
    check_shape("scale", scale, (q.shape[0],))
    check_dtype("scale", scale, (torch.float32,))
    if bias is not None:
        check_shape("bias", bias, (q.shape[0],))


def fp8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (fp16, bf16 or fp32), q [N, K] float8_e4m3fn, scale [N] fp32, bias [N] -> [..., N] in x's dtype."""
    check_fp8_linear_args(x, q, scale, bias)
    N = q.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bias = bias.contiguous() if bias is not None else None
    return _fp8_linear_op(x2, q.contiguous(), scale.contiguous(), bias).reshape(*lead, N)


def prepare_fp8_linear(device: torch.device) -> None:
    """Allocate what the kernel keeps per CUDA device (its split-K tickets) now, before any CUDA graph capture."""
    if device.type == "cuda":
        from fastgrpo.kernels.fp8_linear import prepare

        prepare(device)
