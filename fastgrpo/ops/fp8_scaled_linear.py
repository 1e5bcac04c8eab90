"""W8A8 FP8 linear: per-token e4m3 activations times quantize_fp8's per-channel e4m3 weight on the FP8 tensor cores
(a Triton split-K GEMM, or torch._scaled_mm), and its fp64 reference.

Why: at 64 rows a decode GEMM reads each weight once; fp8_linear (W8A16) halves those bytes but its Triton kernel
upcasts every weight tile to bf16 in registers, and stayed far from the read roofline on an H100 (a Llama-3.1-8B
rollout 1.10x bf16's tokens/s, benchmarks/NOTES_rollout.md "D4"). Quantizing the 64 rows of activations instead
(64 x K values, against N x K weights) lets the FP8 tensor cores take e4m3 x e4m3 as they are.

fp8_scaled_linear(x, q, scale, bias) = (xq q^T) sx scale + bias, where each row of x is quantized as quantize_fp8
quantizes a weight row (quantize_rows: sx = amax / 448, so |x - xq sx| <= 2^-4 |x| for normals, 2^-10 sx below).

Scale layout: _scaled_mm's rowwise scales, scale_a = sx [M, 1] and scale_b = scale [1, N] (both fp32; `scale`'s
[N] is that [1, N] without a copy), applied with the bias in the GEMM's epilogue, out in bf16: one kernel per
linear, nothing else written. The alternative, scalar scales with an fp32 out multiplied afterwards, writes then
reads 4 bytes per output (64 x 28672 x 4 = 7.3 MB each way for Llama-3.1-8B's stacked gate/up, whose e4m3 weights
are 117 MB) in one more pass; benchmarks/bench_fp8.py times both (w8a8_us, w8a8_tensorwise_us). torch's rowwise
kernel for Hopper writes bf16 only, so the output and the bias are bf16 whatever x's dtype, then cast to it: for
fp16 / fp32 activations a rounding of 2^-8 relative, small next to the activations' own 2^-4.

Two GEMMs run that math (GEMMS): "scaled_mm" (torch._scaled_mm: cuBLASLt on Hopper) and "triton"
(fastgrpo.kernels.fp8_linear with x in e4m3: the W8A16 kernel's split-K tiles on the FP8 tensor cores, its partial
sums added into fp32 as often as _scaled_mm's, the bias rounded to bf16 and the output written in bf16 as
_scaled_mm does: the same bound in the tests). Why both: _scaled_mm's small-M kernels do not split K, and at 64 rows
left Llama-3.1-8B's q/o, q/k/v and down_proj at 34-45% of the read roofline (k/v 9%) on an H100
(benchmarks/results/fp8-nvidia-h100-80gb-hbm3.json, w8a8_share). GEMM picks the default; a call may name one.

Per-group activation scales (x_group; the Triton GEMM only): x quantized per row and group of x_group along K
(quantize_groups), each K step's dot scaled by its group's scales. The quantizer then needs no reduction over a
whole row, and a few large channels cost only their own group precision. Timed against the row scales on an H200
(benchmarks/bench_w8a8_scales.py, NOTES_rollout.md): the GEMM's per-step scaling cost more than the quantizer saved
at every decode shape, so the engine keeps a scale per row; the option stays for what it buys in error.

Shapes: on CUDA _scaled_mm needs K and N to be multiples of 16 (the e4m3 operands' 16-byte alignment); the CPU
takes any, but the op applies the CUDA rule everywhere so both devices run the same math. Other shapes (a vocab of
32001, a test model's 44) run fp8_linear over the same copy: one odd linear, usually lm_head, decodes at W8A16
instead of failing the rollout (a raise would make such models unusable with "w8a8" for no numerical reason).
The Triton GEMM would take any shape, but keeps that rule: both GEMMs then compute the same math for every shape.
The choice reads static shapes only: no host sync, nothing data-dependent, so it traces into a compiled decode
step as plain torch ops (not a custom op: Inductor fuses the quantizer's amax, divide and cast into one kernel)
with the GEMM opaque (_scaled_mm an extern kernel, the Triton one a custom op), and is captured in the step's CUDA
graph.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastgrpo.ops._backend import use_triton
from fastgrpo.ops.fp8_linear import (
    check_fp8_linear_args,
    dequantize_groups,
    fp8_linear,
    fp8_linear_torch,
    quantize_groups,
    quantize_rows,
)

ALIGN = 16  # what torch._scaled_mm asks of K and N on CUDA
GEMMS = ("scaled_mm", "triton")
# the default: a decode step's GEMMs, each with its activation quantizer, took 4.0 ms through the Triton kernel
# against 4.5 through _scaled_mm for Llama-3.1-8B shapes (Qwen2.5-1.5B: 1.7 against 2.1) on an H100, before
# W8A8_TILES cut the kernel's part by another 4% (benchmarks/NOTES_rollout.md "W8A8 in Triton")
GEMM = "triton"


def scaled_mm_fits(N: int, K: int) -> bool:
    """Whether a weight [N, K] runs on _scaled_mm (else fp8_scaled_linear runs fp8_linear)."""
    return N % ALIGN == 0 and K % ALIGN == 0


def fp8_scaled_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, gemm: str | None = None,
    x_group: int | None = None,
) -> torch.Tensor:
    """x [..., K] (fp16, bf16 or fp32), q [N, K] float8_e4m3fn, scale [N] fp32, bias [N] -> [..., N] in x's dtype,
    through bf16 (module docstring); gemm: one of GEMMS (None: GEMM). x_group: x quantized per row and group of
    x_group along K (quantize_groups; the Triton GEMM only) instead of per row. No autograd: it serves the rollout,
    under no_grad."""
    check_fp8_linear_args(x, q, scale, bias)
    gemm = GEMM if gemm is None else gemm
    if gemm not in GEMMS:
        raise ValueError(f"gemm: expected one of {', '.join(GEMMS)}, got {gemm!r}")
    if x_group is not None and (gemm != "triton" or isinstance(x_group, bool) or not isinstance(x_group, int)
                                or x_group < 16 or x_group & (x_group - 1)):
        raise ValueError(f"x_group: expected a power of two >= 16 (a whole number of the GEMM's K steps) with "
                         f"gemm='triton' (the only GEMM with per-group activation scales), got x_group={x_group!r}, "
                         f"gemm={gemm!r}")
    N, K = q.shape
    if not scaled_mm_fits(N, K):
        return fp8_linear(x, q, scale, bias)
    lead = x.shape[:-1]
    bias = None if bias is None else bias.to(torch.bfloat16).contiguous()  # the Triton kernel reads it unit-stride
    if x_group is not None:
        xq, sx = quantize_groups(x.reshape(-1, K), x_group)  # sx [M, groups]
        y = _fp8_groups_linear_op(xq, sx, q.contiguous(), scale.contiguous(), bias, x_group)
        return y.to(x.dtype).reshape(*lead, N)
    xq, sx = quantize_rows(x.reshape(-1, K))  # xq [M, K] e4m3 row-major, sx [M]
    if gemm == "triton":
        y = _fp8_rows_linear_op(xq, sx, q.contiguous(), scale.contiguous(), bias)
    else:
        y = torch._scaled_mm(  # q [N, K] row-major: q.t() is the column-major [K, N] operand the GEMM wants
            xq, q.contiguous().t(), scale_a=sx[:, None], scale_b=scale.contiguous()[None, :], bias=bias,
            out_dtype=torch.bfloat16)
    return y.to(x.dtype).reshape(*lead, N)


# the op's schema is inferred from these annotations: Optional[...], the form torch.library documents
@torch.library.custom_op("fastgrpo::fp8_rows_linear", mutates_args=())
def _fp8_rows_linear_op(xq: torch.Tensor, sx: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
    """bf16 (xq q^T) sx scale + bias for e4m3 xq [M, K] and q [N, K]: the Triton kernel, or torch's CPU _scaled_mm
    where Triton does not run (the same math)."""
    if not use_triton(xq, q):
        return torch._scaled_mm(xq, q.t(), scale_a=sx[:, None], scale_b=scale[None, :], bias=bias,
                                out_dtype=torch.bfloat16)
    from fastgrpo.kernels.fp8_linear import fp8_linear_fwd

    return fp8_linear_fwd(xq, q, scale, bias, x_scale=sx, out_dtype=torch.bfloat16)


@_fp8_rows_linear_op.register_fake
def _(xq, sx, q, scale, bias):
    return xq.new_empty(xq.shape[0], q.shape[0], dtype=torch.bfloat16)


@torch.library.custom_op("fastgrpo::fp8_groups_linear", mutates_args=())
def _fp8_groups_linear_op(xq: torch.Tensor, sx: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          bias: Optional[torch.Tensor], group: int) -> torch.Tensor:
    """bf16 (xq sx) q^T scale + bias for e4m3 xq [M, K] with sx [M, cdiv(K, group)] and q [N, K]: the Triton
    kernel, or the same math in fp32 where Triton does not run."""
    if not use_triton(xq, q):
        y = (dequantize_groups(xq, sx, group) @ q.float().T) * scale
        return (y if bias is None else y + bias.float()).to(torch.bfloat16)
    from fastgrpo.kernels.fp8_linear import fp8_linear_fwd

    return fp8_linear_fwd(xq, q, scale, bias, x_scale=sx, out_dtype=torch.bfloat16, x_group=group)


@_fp8_groups_linear_op.register_fake
def _(xq, sx, q, scale, bias, group):
    return xq.new_empty(xq.shape[0], q.shape[0], dtype=torch.bfloat16)


def fp8_scaled_linear_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    x_group: int | None = None,
) -> torch.Tensor:
    """The op's math in fp64, eager: x's rows (or groups of x_group) quantized as the op quantizes them, then
    (xq sx) (q scale)^T + bias, exact but for fp64's rounding; for shapes that do not fit _scaled_mm, fp8_linear's
    (x unquantized). [..., N] fp64; the bias is taken as given (the op rounds it to bf16)."""
    N, K = q.shape
    bias = None if bias is None else bias.double()
    if not scaled_mm_fits(N, K):
        return fp8_linear_torch(x.double(), q, scale.double(), bias)
    return fp8_linear_torch(dequantized_x(x, x_group), q, scale.double(), bias)


def dequantized_x(x: torch.Tensor, x_group: int | None = None) -> torch.Tensor:
    """x [..., K] as the op quantizes it (per row, or per group of x_group along K), dequantized in fp64 (exact)."""
    K = x.shape[-1]
    if x_group is None:
        xq, sx = quantize_rows(x.reshape(-1, K))
        return (xq.double() * sx.double()[:, None]).reshape(*x.shape)
    return dequantize_groups(*quantize_groups(x.reshape(-1, K), x_group), x_group, torch.float64).reshape(*x.shape)
